"""Command R7B (`cohere2`, Cohere2ForCausalLM: c4ai-command-r7b-12-2024, Command A).

What differs from llama:
- Parallel blocks: attention and MLP both read one normalised input and are added to
  the residual together, x + attn(norm(x)) + mlp(norm(x)); one norm per block.
- Norms are LayerNorms without a bias (mean removed, weight only), in float32.
- Sliding and global layers: `layer_types`, else every `sliding_window_pattern`-th layer
  global (default 4: three sliding, one global). Sliding layers see their
  `sliding_window` most recent positions, itself included, cache them in a
  `RotatingKVCache`, and turn queries and keys with rope; global layers use no
  positional encoding at all.
- Rope is the interleaved (GPT-J) kind: pairs (2i, 2i + 1), MLX's traditional rope.
- Logits are scaled by `logit_scale`; embeddings are tied by default.
- head_dim is always hidden_size / num_attention_heads (transformers ignores a
  `head_dim` key; we refuse one that disagrees).

Hub configs (transformers 4) carry `rope_theta` and `sliding_window_pattern`, plus keys
transformers never reads (`use_qk_norm`, `position_embedding_type`, ...); we refuse
`use_qk_norm: true`, which Cohere2 has no weights for. transformers 5 writes
`rope_parameters` and `layer_types`. Weights are `model.*` (+ `lm_head.*` unless tied).
Reference: transformers `models/cohere2/modeling_cohere2.py`, `configuration_cohere2.py`.
"""

from dataclasses import dataclass
from typing import Any, Dict, List, Optional

import mlx.core as mx
import mlx.nn as nn

from . import llama
from .base import (
    BaseModelArgs,
    check_head_grouping,
    check_layer_types,
    check_sliding_window,
    scaled_dot_product_attention,
)
from .llama import FULL, SLIDING
from .rope_utils import initialize_rope, resolve_rope


@dataclass
class ModelArgs(BaseModelArgs):
    """Cohere2Config's keys, with its defaults."""

    model_type: str = "cohere2"
    hidden_size: int = 8192
    intermediate_size: int = 22528
    logit_scale: float = 0.0625
    num_hidden_layers: int = 40
    num_attention_heads: int = 64
    num_key_value_heads: Optional[int] = None
    head_dim: Optional[int] = None  # hub configs; must be hidden_size / num_attention_heads
    hidden_act: str = "silu"
    max_position_embeddings: int = 8192
    layer_norm_eps: float = 1e-5
    vocab_size: int = 256000
    tie_word_embeddings: bool = True
    rope_theta: Optional[float] = None  # transformers 4
    rope_scaling: Optional[Dict[str, Any]] = None  # transformers 4
    rope_parameters: Optional[Dict[str, Any]] = None  # transformers 5
    attention_bias: bool = False
    sliding_window: Optional[int] = 4096
    sliding_window_pattern: int = 4  # transformers 4; layer_types wins when given
    layer_types: Optional[List[str]] = None
    use_qk_norm: bool = False  # a hub key transformers' Cohere2 does not implement

    def __post_init__(self):
        if self.num_key_value_heads is None:
            self.num_key_value_heads = self.num_attention_heads
        check_head_grouping(self.num_attention_heads, self.num_key_value_heads)
        derived = self.hidden_size // self.num_attention_heads
        if self.head_dim is not None and self.head_dim != derived:
            raise ValueError(
                f"cohere2 head_dim is hidden_size / num_attention_heads = {derived}; "
                f"the config says head_dim={self.head_dim}"
            )
        self.head_dim = derived
        self._set_layer_types()
        theta, self.rope_scaling, partial = resolve_rope(self.rope_theta, self.rope_scaling, self.rope_parameters)
        if partial not in (None, 1.0):
            raise ValueError(f"cohere2 rotates whole heads; got partial_rotary_factor={partial}")
        self.rope_theta = 10000.0 if theta is None else theta
        if self.hidden_act != "silu":
            raise ValueError(f"hidden_act {self.hidden_act!r} is not supported; cohere2 uses 'silu'")
        if self.use_qk_norm:
            raise ValueError("use_qk_norm=True is not supported: Cohere2 (transformers) has no q/k norms")

    def _set_layer_types(self):
        if self.layer_types is None:
            if not (isinstance(self.sliding_window_pattern, int) and self.sliding_window_pattern >= 1):
                raise ValueError(f"sliding_window_pattern must be an int >= 1, got {self.sliding_window_pattern!r}")
            pattern = self.sliding_window_pattern
            self.layer_types = [FULL if (i + 1) % pattern == 0 else SLIDING for i in range(self.num_hidden_layers)]
        check_layer_types(self.layer_types, self.num_hidden_layers, (SLIDING, FULL))
        check_sliding_window(self.layer_types, self.sliding_window)


def layer_norm(x: mx.array, weight: mx.array, eps: float) -> mx.array:
    """LayerNorm without a bias over the last axis, (..., D) -> (..., D): computed in
    float32 and cast back to x's dtype, as transformers does."""
    return mx.fast.layer_norm(x.astype(mx.float32), weight.astype(mx.float32), None, eps).astype(x.dtype)


class LayerNorm(nn.Module):
    def __init__(self, dims: int, eps: float):
        super().__init__()
        self.weight = mx.ones((dims,))
        self.eps = eps

    def __call__(self, x: mx.array) -> mx.array:
        return layer_norm(x, self.weight, self.eps)


class Attention(nn.Module):
    def __init__(self, args: ModelArgs, layer_type: str):
        super().__init__()
        dim, head_dim, bias = args.hidden_size, args.head_dim, args.attention_bias
        self.n_heads, self.n_kv_heads = args.num_attention_heads, args.num_key_value_heads
        self.scale = head_dim**-0.5
        self.q_proj = nn.Linear(dim, self.n_heads * head_dim, bias=bias)
        self.k_proj = nn.Linear(dim, self.n_kv_heads * head_dim, bias=bias)
        self.v_proj = nn.Linear(dim, self.n_kv_heads * head_dim, bias=bias)
        self.o_proj = nn.Linear(self.n_heads * head_dim, dim, bias=bias)
        # Global layers carry no positional encoding (NoPE); sliding ones interleaved rope.
        self.use_rope = layer_type == SLIDING
        if self.use_rope:
            self.rope = initialize_rope(
                head_dim, args.rope_theta, True, args.rope_scaling, args.max_position_embeddings
            )

    def __call__(self, x: mx.array, mask: Optional[mx.array] = None, cache=None) -> mx.array:
        B, L, _ = x.shape
        q = self.q_proj(x).reshape(B, L, self.n_heads, -1).transpose(0, 2, 1, 3)  # (B, H, L, D)
        k = self.k_proj(x).reshape(B, L, self.n_kv_heads, -1).transpose(0, 2, 1, 3)  # (B, H_kv, L, D)
        v = self.v_proj(x).reshape(B, L, self.n_kv_heads, -1).transpose(0, 2, 1, 3)
        if self.use_rope:
            offset = cache.offset if cache is not None else 0
            q, k = self.rope(q, offset=offset), self.rope(k, offset=offset)
        if cache is not None:
            k, v = cache.update_and_fetch(k, v)  # (B, H_kv, S, D)
        out = scaled_dot_product_attention(q, k, v, cache=cache, scale=self.scale, mask=mask)
        return self.o_proj(out.transpose(0, 2, 1, 3).reshape(B, L, -1))


class DecoderLayer(nn.Module):
    def __init__(self, args: ModelArgs, layer_type: str):
        super().__init__()
        self.layer_type = layer_type
        self.self_attn = Attention(args, layer_type)
        self.mlp = llama.MLP(args.hidden_size, args.intermediate_size)  # SwiGLU, no biases
        self.input_layernorm = LayerNorm(args.hidden_size, args.layer_norm_eps)

    def __call__(self, x: mx.array, mask: Optional[mx.array] = None, cache=None) -> mx.array:
        h = self.input_layernorm(x)
        return x + self.self_attn(h, mask, cache) + self.mlp(h)  # parallel attention and MLP


class Backbone(llama.LlamaModel):
    """llama's backbone (embeddings, one mask per layer type, final norm) with Cohere2's
    blocks and bias-free LayerNorm."""

    def __init__(self, args: ModelArgs):
        nn.Module.__init__(self)  # not LlamaModel's: its norm is an RMSNorm
        self.sliding_window = args.sliding_window
        self.embed_tokens = nn.Embedding(args.vocab_size, args.hidden_size)
        self.layers = [DecoderLayer(args, layer_type) for layer_type in args.layer_types]
        self.norm = LayerNorm(args.hidden_size, args.layer_norm_eps)


class Model(llama.Model):
    """llama's LM head (tied or `lm_head`), sanitize (drops rope buffers and a tied
    `lm_head`), caches (RotatingKVCache for sliding layers, KVCache for global ones) and
    tensor-parallel `shard` (the same attention and MLP names), over Cohere2's backbone,
    with the logits scaled."""

    # Both cache kinds roll back by themselves; the layers record nothing.
    supports_speculative_rollback = True
    backbone_class = Backbone

    def __call__(
        self, inputs: mx.array, cache: Optional[List[Any]] = None, input_embeddings: Optional[mx.array] = None
    ) -> mx.array:
        """Token ids (B, L) -> logits (B, L, vocab), scaled by logit_scale."""
        return super().__call__(inputs, cache, input_embeddings) * self.args.logit_scale
