"""Phi-1, Phi-1.5 and Phi-2 (`phi`, PhiForCausalLM: microsoft/phi-1, phi-1_5, phi-2).

What differs from llama:
- Parallel blocks: x + attn(norm(x)) + mlp(norm(x)), one LayerNorm (with a bias) per
  block; a final LayerNorm, `final_layernorm`.
- Rope turns only the first `partial_rotary_factor` (default 0.5; 0.4 in Phi-2) of each
  head's features, in rotate-half pairs; the rest pass. The factor is a top-level key
  in the hub's configs and sits in `rope_parameters` in transformers 5's.
- Every projection has a bias: q/k/v, the attention output `dense`, the MLP's
  fc1 -> gelu_new -> fc2 (not gated), and lm_head (also when tied to the embeddings).
- `qk_layernorm`: queries and keys pass a LayerNorm (with a bias) over head_dim before
  rope, one set of weights shared by every head.
Weights are `model.*` and `lm_head.*` as transformers saves them (MLX converters keep
them). The older `phi-msft` layout (Wqkv, transformer.h.*) is not read.
Reference: transformers `models/phi/modeling_phi.py`, `modular_phi.py`, `configuration_phi.py`.
"""

from dataclasses import dataclass
from typing import Any, Dict, List, Optional

import mlx.core as mx
import mlx.nn as nn

from . import glm4, llama, sharding
from .base import BaseModelArgs, check_head_grouping, run_hybrid_layers, scaled_dot_product_attention
from .ernie4_5_moe import OutputBias
from .llama import FULL
from .rope_utils import initialize_rope, resolve_rope

DEFAULT_PARTIAL_ROTARY_FACTOR = 0.5  # PhiConfig's default
# gelu_new and gelu_pytorch_tanh are one formula, 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3))).
TANH_GELU_NAMES = ("gelu_new", "gelu_pytorch_tanh")


@dataclass
class ModelArgs(BaseModelArgs):
    """PhiConfig's keys, with its defaults."""

    model_type: str = "phi"
    vocab_size: int = 51200
    hidden_size: int = 2048
    intermediate_size: int = 8192
    num_hidden_layers: int = 24
    num_attention_heads: int = 32
    num_key_value_heads: Optional[int] = None
    hidden_act: str = "gelu_new"
    max_position_embeddings: int = 2048
    layer_norm_eps: float = 1e-5
    tie_word_embeddings: bool = False
    rope_theta: Optional[float] = None  # transformers 4
    rope_scaling: Optional[Dict[str, Any]] = None  # transformers 4
    rope_parameters: Optional[Dict[str, Any]] = None  # transformers 5
    partial_rotary_factor: Optional[float] = None  # transformers 4; 5 puts it in rope_parameters
    qk_layernorm: bool = False

    sliding_window = None  # what llama's caches read: no layer slides

    def __post_init__(self):
        if self.num_key_value_heads is None:
            self.num_key_value_heads = self.num_attention_heads
        check_head_grouping(self.num_attention_heads, self.num_key_value_heads)
        theta, self.rope_scaling, _ = resolve_rope(self.rope_theta, self.rope_scaling, self.rope_parameters)
        self.rope_theta = 10000.0 if theta is None else theta
        self.partial_rotary_factor = glm4.resolve_partial_rotary(
            self.partial_rotary_factor, self.rope_parameters, DEFAULT_PARTIAL_ROTARY_FACTOR)
        if self.hidden_act not in TANH_GELU_NAMES:
            raise ValueError(f"hidden_act {self.hidden_act!r} is not supported; phi uses 'gelu_new'")

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads

    @property
    def rotary_dims(self) -> int:
        return int(self.head_dim * self.partial_rotary_factor)


class Attention(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        dim, head_dim = args.hidden_size, args.head_dim
        self.n_heads, self.n_kv_heads = args.num_attention_heads, args.num_key_value_heads
        self.scale = head_dim**-0.5
        self.q_proj = nn.Linear(dim, self.n_heads * head_dim)
        self.k_proj = nn.Linear(dim, self.n_kv_heads * head_dim)
        self.v_proj = nn.Linear(dim, self.n_kv_heads * head_dim)
        self.dense = nn.Linear(self.n_heads * head_dim, dim)
        self.qk_layernorm = args.qk_layernorm
        if self.qk_layernorm:
            self.q_layernorm = nn.LayerNorm(head_dim, eps=args.layer_norm_eps)
            self.k_layernorm = nn.LayerNorm(head_dim, eps=args.layer_norm_eps)
        self.rope = initialize_rope(
            args.rotary_dims, args.rope_theta, False, args.rope_scaling, args.max_position_embeddings
        )

    def __call__(self, x: mx.array, mask: Optional[mx.array] = None, cache=None) -> mx.array:
        B, L, _ = x.shape
        q = self.q_proj(x).reshape(B, L, self.n_heads, -1).transpose(0, 2, 1, 3)  # (B, H, L, D)
        k = self.k_proj(x).reshape(B, L, self.n_kv_heads, -1).transpose(0, 2, 1, 3)  # (B, H_kv, L, D)
        v = self.v_proj(x).reshape(B, L, self.n_kv_heads, -1).transpose(0, 2, 1, 3)
        if self.qk_layernorm:
            q, k = self.q_layernorm(q), self.k_layernorm(k)
        offset = cache.offset if cache is not None else 0
        q, k = self.rope(q, offset=offset), self.rope(k, offset=offset)  # the first rotary_dims features
        if cache is not None:
            k, v = cache.update_and_fetch(k, v)  # (B, H_kv, S, D)
        out = scaled_dot_product_attention(q, k, v, cache=cache, scale=self.scale, mask=mask)
        return self.dense(out.transpose(0, 2, 1, 3).reshape(B, L, -1))


class MLP(nn.Module):
    def __init__(self, dim: int, hidden_dim: int):
        super().__init__()
        self.fc1 = nn.Linear(dim, hidden_dim)
        self.fc2 = nn.Linear(hidden_dim, dim)

    def __call__(self, x: mx.array) -> mx.array:
        return self.fc2(nn.gelu_approx(self.fc1(x)))  # gelu_new is mx's gelu_approx


class DecoderLayer(nn.Module):
    layer_type = FULL  # what llama's caches read: no layer slides

    def __init__(self, args: ModelArgs):
        super().__init__()
        self.self_attn = Attention(args)
        self.mlp = MLP(args.hidden_size, args.intermediate_size)
        self.input_layernorm = nn.LayerNorm(args.hidden_size, eps=args.layer_norm_eps)

    def __call__(self, x: mx.array, mask: Optional[mx.array] = None, cache=None) -> mx.array:
        h = self.input_layernorm(x)
        return x + self.self_attn(h, mask, cache) + self.mlp(h)  # parallel attention and MLP


class PhiModel(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.embed_tokens = nn.Embedding(args.vocab_size, args.hidden_size)
        self.layers = [DecoderLayer(args) for _ in range(args.num_hidden_layers)]
        self.final_layernorm = nn.LayerNorm(args.hidden_size, eps=args.layer_norm_eps)

    def __call__(
        self, inputs: mx.array, cache: Optional[List[Any]] = None, input_embeddings: Optional[mx.array] = None
    ) -> mx.array:
        h = self.embed_tokens(inputs) if input_embeddings is None else input_embeddings  # (B, L, hidden)
        # Every layer attends alike, so the first cache's mask serves them all.
        return self.final_layernorm(run_hybrid_layers(h, self.layers, cache, mask_layer=0))


class Model(llama.Model):
    """llama's sanitize (drops rope buffers and a tied lm_head's weight, keeping its
    bias) and KV caches over Phi's backbone, with a biased LM head."""

    # KV caches roll back by themselves; the layers record nothing.
    supports_speculative_rollback = True
    backbone_class = PhiModel

    def __init__(self, args: ModelArgs):
        super().__init__(args)
        tied = args.tie_word_embeddings
        self.lm_head = OutputBias(args.vocab_size) if tied else nn.Linear(args.hidden_size, args.vocab_size)

    def __call__(
        self, inputs: mx.array, cache: Optional[List[Any]] = None, input_embeddings: Optional[mx.array] = None
    ) -> mx.array:
        """Token ids (B, L) -> logits (B, L, vocab); `input_embeddings` (B, L, hidden)
        replace the token embeddings."""
        logits = super().__call__(inputs, cache, input_embeddings)
        return logits + self.lm_head.bias if self.args.tie_word_embeddings else logits

    def shard(self, group: Optional[mx.distributed.Group] = None) -> None:
        """Tensor parallel: heads split (q/k/v rows, `dense`'s columns, which all-sums)
        and the MLP's hidden units (fc1's rows, fc2's columns); the norms, shared by
        every head, stay whole."""
        group = sharding.world(group)
        for layer in self.layers:
            attn = layer.self_attn
            attn.n_heads, attn.n_kv_heads = sharding.shard_attention(
                attn, attn.n_heads, attn.n_kv_heads, group, out="dense")
            sharding.shard_mlp(layer.mlp, group, inputs=("fc1",), output="fc2")
