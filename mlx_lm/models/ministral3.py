"""Ministral 3 (`ministral3`, Ministral3ForCausalLM: the text model of
mistralai/Ministral-3-3B/8B/14B-*-2512): Mistral with YaRN rope and Llama 4's
position-dependent query scale.

What differs from llama (Mistral):
- After rope, each query at position p is scaled by
  1 + llama_4_scaling_beta * log(1 + floor(p / original_max_position_embeddings)),
  both read from the rope parameters (`query_scale`). Without a beta there is no
  scale (transformers would fail on such a config).
- transformers' default rope is YaRN: theta 1e6, factor 16 over an original context of
  16384, beta_fast 32, beta_slow 1, mscale = mscale_all_dim = 1 (attention factor 1),
  llama_4_scaling_beta 0.1. transformers 5 uses it whenever a config gives no
  `rope_scaling` / `rope_parameters`, even with a `rope_theta` (then ignored); so do we.
- A `sliding_window` makes every layer slide (MistralModel's mask); transformers has
  no per-layer kinds here, so `layer_types` must agree with that.
- Defaults: head_dim 128, rms_norm_eps 1e-5, untied.
Reference: transformers `models/ministral3/modeling_ministral3.py` (modular_ministral3.py),
`configuration_ministral3.py`.
"""

from dataclasses import dataclass
from typing import Optional

import mlx.core as mx

from . import llama
from .base import scaled_dot_product_attention
from .llama4 import query_positions

# Ministral3Config's rope when a config names none.
DEFAULT_ROPE = {"rope_type": "yarn", "rope_theta": 1_000_000.0, "factor": 16.0,
                "original_max_position_embeddings": 16384, "beta_fast": 32.0, "beta_slow": 1.0,
                "mscale": 1.0, "mscale_all_dim": 1.0, "llama_4_scaling_beta": 0.1}


def query_scale(positions: mx.array, beta: float, original_max_position_embeddings: int) -> mx.array:
    """Llama 4's attention scale at integer `positions` (any shape), float32:
    1 + beta * log(1 + floor(p / original_max_position_embeddings))."""
    steps = mx.floor(positions.astype(mx.float32) / original_max_position_embeddings)
    return 1.0 + beta * mx.log1p(steps)


@dataclass
class ModelArgs(llama.ModelArgs):
    """Ministral3Config's keys (llama's), with its defaults."""

    head_dim: int = 128
    rms_norm_eps: float = 1e-5
    max_position_embeddings: int = 262144

    def __post_init__(self):
        if self.rope_scaling is None and self.rope_parameters is None:
            self.rope_parameters, self.rope_theta = dict(DEFAULT_ROPE), None  # transformers 5's default
        rope = dict(self.rope_parameters or {}, **(self.rope_scaling or {}))
        self.scaling_beta = rope.get("llama_4_scaling_beta")
        self.scaling_context = rope.get("original_max_position_embeddings")
        if self.scaling_beta is not None and not (isinstance(self.scaling_context, int) and self.scaling_context > 0):
            raise ValueError(f"llama_4_scaling_beta {self.scaling_beta} needs a positive "
                             f"original_max_position_embeddings in the rope parameters, got {self.scaling_context!r}")
        super().__post_init__()

    def _set_layer_types(self):
        every = [llama.SLIDING if self.sliding_window is not None else llama.FULL] * self.num_hidden_layers
        if self.layer_types is not None and list(self.layer_types) != every:
            raise ValueError(f"layer_types {self.layer_types} disagree with sliding_window {self.sliding_window!r}: "
                             "Ministral 3 slides every layer when a window is set, else none")
        self.layer_types = every
        super()._set_layer_types()


class Attention(llama.Attention):
    def __init__(self, args: ModelArgs):
        super().__init__(args)
        self.scaling_beta, self.scaling_context = args.scaling_beta, args.scaling_context

    def __call__(self, x: mx.array, mask: Optional[mx.array] = None, cache=None) -> mx.array:
        B, L, _ = x.shape
        q = self.q_proj(x).reshape(B, L, self.n_heads, -1).transpose(0, 2, 1, 3)  # (B, H, L, D)
        k = self.k_proj(x).reshape(B, L, self.n_kv_heads, -1).transpose(0, 2, 1, 3)  # (B, H_kv, L, D)
        v = self.v_proj(x).reshape(B, L, self.n_kv_heads, -1).transpose(0, 2, 1, 3)
        offset = cache.offset if cache is not None else 0
        q, k = self.rope(q, offset=offset), self.rope(k, offset=offset)
        if self.scaling_beta is not None:
            scales = query_scale(query_positions(offset, L), self.scaling_beta, self.scaling_context)
            q = (q * scales[:, None, :, None]).astype(q.dtype)  # (B or 1, 1, L, 1)
        if cache is not None:
            k, v = cache.update_and_fetch(k, v)
        out = scaled_dot_product_attention(q, k, v, cache=cache, scale=self.scale, mask=mask)
        return self.o_proj(out.transpose(0, 2, 1, 3).reshape(B, L, -1))


class DecoderLayer(llama.TransformerBlock):
    """llama's block with the scaled queries (llama's attention, replaced here, is never
    computed: MLX initialises lazily)."""

    def __init__(self, args: ModelArgs, layer_type: str):
        super().__init__(args, layer_type)
        self.self_attn = Attention(args)


class Ministral3Model(llama.LlamaModel):
    block_class = DecoderLayer


class Model(llama.Model):
    """llama's LM head, sanitize, caches and tensor parallelism over Ministral 3's blocks."""

    # KV caches (and the sliding ones' ring buffers) roll back by themselves.
    supports_speculative_rollback = True
    backbone_class = Ministral3Model
