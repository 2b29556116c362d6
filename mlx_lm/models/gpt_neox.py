"""GPT-NeoX (`gpt_neox`, GPTNeoXForCausalLM: EleutherAI/gpt-neox-20b, the Pythia suite,
Dolly v2, RedPajama-INCITE, StableLM-Tuned-Alpha): LayerNorm blocks with a fused
per-head q/k/v projection, partial rope and (by default) a parallel residual.

What differs from llama:
- `query_key_value` computes, for each head in turn, [q_h | k_h | v_h] (its output
  viewed (heads, 3 head_dim)); `dense` mixes the heads back. Both have biases with
  `attention_bias` (default True); MLP (dense_h_to_4h, act, dense_4h_to_h) always.
- Rope turns the first `rotary_pct` (hub) / `partial_rotary_factor` (transformers 5;
  default 0.25) of each head in rotate-half pairs, base `rotary_emb_base` / `rope_theta`
  (default 10000); `rope_scaling` (linear, dynamic) as llama's.
- `use_parallel_residual` (default True): out = x + attn(ln_1(x)) + mlp(ln_2(x));
  else the sequential h = x + attn(ln_1(x)), out = h + mlp(ln_2(h)).
- LayerNorms with biases (`input_layernorm`, `post_attention_layernorm`,
  `final_layer_norm`); the head is `embed_out` (tied to `embed_in` when
  tie_word_embeddings).
Weights: transformers' names (`gpt_neox.*`, `embed_out.*`; MLX layout too); upstream
mlx-lm's `model.h.*` / `model.embed_out` are renamed; old checkpoints' mask and rope
buffers are dropped.
Reference: transformers `models/gpt_neox/modeling_gpt_neox.py`, `configuration_gpt_neox.py`.
"""

from dataclasses import dataclass
from typing import Any, Dict, List, Optional

import mlx.core as mx
import mlx.nn as nn

from . import sharding
from .activations import activation
from .base import BaseModelArgs, run_hybrid_layers, scaled_dot_product_attention
from .cache import KVCache
from .rope_utils import initialize_rope, resolve_rope

HF_BUFFERS = (".attention.bias", ".attention.masked_bias", ".attention.rotary_emb.inv_freq")
# upstream mlx-lm's converted names -> ours, applied in order to keys under `model.`
UPSTREAM_RENAMES = (("model.embed_out.", "embed_out."), ("model.h.", "gpt_neox.layers."), ("model.", "gpt_neox."))


@dataclass
class ModelArgs(BaseModelArgs):
    """GPTNeoXConfig's keys (and the hub's rotary_pct / rotary_emb_base), with its defaults."""

    model_type: str
    hidden_size: int = 6144
    num_hidden_layers: int = 44
    num_attention_heads: int = 64
    intermediate_size: int = 24576
    vocab_size: int = 50432
    hidden_act: str = "gelu"
    max_position_embeddings: int = 2048
    layer_norm_eps: float = 1e-5
    tie_word_embeddings: bool = False
    use_parallel_residual: bool = True
    attention_bias: bool = True
    rotary_pct: Optional[float] = None
    rotary_emb_base: Optional[float] = None
    rope_scaling: Optional[Dict[str, Any]] = None
    rope_parameters: Optional[Dict[str, Any]] = None

    def __post_init__(self):
        if self.hidden_size % self.num_attention_heads:
            raise ValueError(f"hidden_size ({self.hidden_size}) must be a multiple of "
                             f"num_attention_heads ({self.num_attention_heads})")
        activation(self.hidden_act)
        # transformers: rope_scaling (or else rope_parameters) first, then the hub's keys, then
        # defaults; a top-level rope_theta is not read.
        theta, self.rope_scaling, factor = resolve_rope(None, self.rope_scaling, self.rope_parameters)
        theta = theta if theta is not None else (self.rope_scaling or {}).get("rope_theta")
        self.rope_theta = next(t for t in (theta, self.rotary_emb_base, 10000.0) if t is not None)
        factor = factor if factor is not None else (self.rope_scaling or {}).get("partial_rotary_factor")
        self.rotary_pct = next(f for f in (factor, self.rotary_pct, 0.25) if f is not None)
        if not 0 < self.rotary_pct <= 1:
            raise ValueError(f"rotary_pct (partial_rotary_factor) must be in (0, 1], got {self.rotary_pct}")

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads

    @property
    def rotary_dims(self) -> int:
        return int(self.head_dim * self.rotary_pct)


class Attention(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        dim = args.hidden_size
        self.n_heads = args.num_attention_heads
        self.scale = args.head_dim**-0.5
        self.query_key_value = nn.Linear(dim, 3 * dim, bias=args.attention_bias)
        self.dense = nn.Linear(dim, dim, bias=args.attention_bias)
        self.rope = initialize_rope(args.rotary_dims, args.rope_theta, False, args.rope_scaling,
                                    args.max_position_embeddings)

    def __call__(self, x: mx.array, mask: Optional[mx.array] = None, cache=None) -> mx.array:
        B, L, _ = x.shape
        qkv = self.query_key_value(x).reshape(B, L, self.n_heads, -1).transpose(0, 2, 1, 3)  # (B, H, L, 3 D)
        q, k, v = mx.split(qkv, 3, axis=-1)
        offset = cache.offset if cache is not None else 0
        q, k = self.rope(q, offset=offset), self.rope(k, offset=offset)
        if cache is not None:
            k, v = cache.update_and_fetch(k, v)
        out = scaled_dot_product_attention(q, k, v, cache=cache, scale=self.scale, mask=mask)
        return self.dense(out.transpose(0, 2, 1, 3).reshape(B, L, -1))


class MLP(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.dense_h_to_4h = nn.Linear(args.hidden_size, args.intermediate_size, bias=True)
        self.dense_4h_to_h = nn.Linear(args.intermediate_size, args.hidden_size, bias=True)
        self.act = activation(args.hidden_act)

    def __call__(self, x: mx.array) -> mx.array:
        return self.dense_4h_to_h(self.act(self.dense_h_to_4h(x)))


class Layer(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.use_parallel_residual = args.use_parallel_residual
        self.input_layernorm = nn.LayerNorm(args.hidden_size, eps=args.layer_norm_eps)
        self.post_attention_layernorm = nn.LayerNorm(args.hidden_size, eps=args.layer_norm_eps)
        self.attention = Attention(args)
        self.mlp = MLP(args)

    def __call__(self, x: mx.array, mask: Optional[mx.array] = None, cache=None) -> mx.array:
        attn = self.attention(self.input_layernorm(x), mask, cache)
        if self.use_parallel_residual:
            return x + attn + self.mlp(self.post_attention_layernorm(x))
        h = x + attn
        return h + self.mlp(self.post_attention_layernorm(h))


class GPTNeoXModel(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.embed_in = nn.Embedding(args.vocab_size, args.hidden_size)
        self.layers = [Layer(args) for _ in range(args.num_hidden_layers)]
        self.final_layer_norm = nn.LayerNorm(args.hidden_size, eps=args.layer_norm_eps)

    def __call__(self, inputs: mx.array, cache: Optional[List[Any]] = None) -> mx.array:
        h = self.embed_in(inputs)  # (B, L, D)
        h = run_hybrid_layers(h, self.layers, cache, mask_layer=0)  # every layer attends: one causal mask
        return self.final_layer_norm(h)


def rename_upstream_weights(weights: Dict[str, mx.array]) -> Dict[str, mx.array]:
    """Drop old checkpoints' buffers; upstream mlx-lm's `model.*` names -> ours."""
    out = {}
    for key, value in weights.items():
        if key.endswith(HF_BUFFERS):
            continue
        for old, new in UPSTREAM_RENAMES:
            if key.startswith(old):
                key = new + key[len(old):]
                break
        out[key] = value
    return out


class Model(nn.Module):
    # KV caches roll back by themselves; the layers record nothing.
    supports_speculative_rollback = True

    def __init__(self, args: ModelArgs):
        super().__init__()
        self.args = args
        self.model_type = args.model_type
        self.gpt_neox = GPTNeoXModel(args)
        if not args.tie_word_embeddings:
            self.embed_out = nn.Linear(args.hidden_size, args.vocab_size, bias=False)

    def __call__(self, inputs: mx.array, cache: Optional[List[Any]] = None) -> mx.array:
        """Token ids (B, L) -> logits (B, L, vocab)."""
        h = self.gpt_neox(inputs, cache)
        return self.gpt_neox.embed_in.as_linear(h) if self.args.tie_word_embeddings else self.embed_out(h)

    def sanitize(self, weights: Dict[str, mx.array]) -> Dict[str, mx.array]:
        weights = rename_upstream_weights(weights)
        if self.args.tie_word_embeddings:
            weights.pop("embed_out.weight", None)
        return weights

    @property
    def layers(self) -> List[Layer]:
        return self.gpt_neox.layers

    def make_cache(self) -> List[KVCache]:
        return [KVCache() for _ in self.layers]

    def shard(self, group: Optional[mx.distributed.Group] = None) -> None:
        """Tensor parallel over `group`: query_key_value's rows are whole heads in turn,
        so each rank keeps a block of heads; dense all-sums; the MLP by hidden units."""
        group = sharding.world(group)
        for layer in self.layers:
            attn = layer.attention
            attn.n_heads, _ = sharding.shard_attention(attn, attn.n_heads, attn.n_heads, group,
                                                       qkv=("query_key_value",), out="dense")
            sharding.shard_mlp(layer.mlp, group, inputs=("dense_h_to_4h",), output="dense_4h_to_h")
