"""EXAONE 4.0 (`exaone4`, Exaone4ForCausalLM: LG AI Research's EXAONE-4.0-1.2B / 32B).

What differs from llama:
- Post-norms only: a block normalises what attention and the MLP return, before each
  joins the residual, x + norm(attn(x)), then h + norm(mlp(h)); its inputs are not
  normalised (OLMo 2's layout).
- QK-norm: queries and keys are RMS-normalised per head before rope.
- Sliding and global layers: `layer_types`; else from `sliding_window_pattern`, an int
  p (layer i global iff (i + 1) % p == 0, transformers' rule) or a string of "L"
  (local) and "G" (global) repeating from layer 0 with the last layer always global
  (the rule transformers documents; its code reads only ints); with no
  `sliding_window` every layer is global. Sliding layers see their `sliding_window`
  most recent positions, itself included, and cache them in a `RotatingKVCache`.
- Rope: when the model has a window, only the sliding layers turn queries and keys
  (global layers are NoPE); without one, every layer does. `rope_scaling` (llama3 in the
  released models) applies wherever rope does.

Hub configs (transformers 4.54) carry `rope_theta`/`rope_scaling`, `head_dim` and
`sliding_window_pattern` (beside `layer_types`); transformers 5 writes
`rope_parameters`. Weights are `model.*` (+ `lm_head.*` unless tied).
Reference: transformers `models/exaone4/modeling_exaone4.py`, `configuration_exaone4.py`.
"""

from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Union

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


def layer_types_from_pattern(pattern: Union[int, str], num_layers: int) -> List[str]:
    """Layer kinds from an int p (every p-th layer global) or an "L"/"G" string that
    repeats from layer 0, the last layer global whatever the string says."""
    if isinstance(pattern, str):
        if not pattern or set(pattern) - {"L", "G"}:
            raise ValueError(f"sliding_window_pattern must be a string of 'L' and 'G', got {pattern!r}")
        kinds = [SLIDING if pattern[i % len(pattern)] == "L" else FULL for i in range(num_layers)]
        return kinds[:-1] + [FULL]
    if isinstance(pattern, bool) or not isinstance(pattern, int) or pattern < 1:
        raise ValueError(f"sliding_window_pattern must be an int >= 1 or an 'L'/'G' string, got {pattern!r}")
    return [FULL if (i + 1) % pattern == 0 else SLIDING for i in range(num_layers)]


@dataclass
class ModelArgs(BaseModelArgs):
    """Exaone4Config's keys, with its defaults."""

    model_type: str = "exaone4"
    vocab_size: int = 102400
    hidden_size: int = 4096
    intermediate_size: int = 16384
    num_hidden_layers: int = 32
    num_attention_heads: int = 32
    num_key_value_heads: int = 32
    head_dim: Optional[int] = None  # hub configs; default hidden_size / num_attention_heads
    hidden_act: str = "silu"
    max_position_embeddings: int = 2048
    rms_norm_eps: float = 1e-5
    tie_word_embeddings: bool = False
    rope_theta: Optional[float] = None  # transformers 4
    rope_scaling: Optional[Dict[str, Any]] = None  # transformers 4
    rope_parameters: Optional[Dict[str, Any]] = None  # transformers 5
    sliding_window: Optional[int] = 4096
    sliding_window_pattern: Union[int, str, None] = 4  # layer_types wins when given
    layer_types: Optional[List[str]] = None

    def __post_init__(self):
        check_head_grouping(self.num_attention_heads, self.num_key_value_heads)
        if self.head_dim is None:
            self.head_dim = self.hidden_size // self.num_attention_heads
        if self.layer_types is None:
            if self.sliding_window is None:
                self.layer_types = [FULL] * self.num_hidden_layers
            else:
                self.layer_types = layer_types_from_pattern(self.sliding_window_pattern, self.num_hidden_layers)
        check_layer_types(self.layer_types, self.num_hidden_layers, (SLIDING, FULL))
        check_sliding_window(self.layer_types, self.sliding_window)
        theta, self.rope_scaling, partial = resolve_rope(self.rope_theta, self.rope_scaling, self.rope_parameters)
        if partial not in (None, 1.0):
            raise ValueError(f"exaone4 rotates whole heads; got partial_rotary_factor={partial}")
        self.rope_theta = 10000.0 if theta is None else theta
        if self.hidden_act != "silu":
            raise ValueError(f"hidden_act {self.hidden_act!r} is not supported; exaone4 uses 'silu'")

    def uses_rope(self, layer_type: str) -> bool:
        """Global layers are NoPE in a model with a window; without one all layers rope."""
        return self.sliding_window is None or layer_type == SLIDING


class Attention(nn.Module):
    def __init__(self, args: ModelArgs, layer_type: str):
        super().__init__()
        dim, head_dim = args.hidden_size, args.head_dim
        self.n_heads, self.n_kv_heads = args.num_attention_heads, args.num_key_value_heads
        self.scale = head_dim**-0.5
        self.q_proj = nn.Linear(dim, self.n_heads * head_dim, bias=False)
        self.k_proj = nn.Linear(dim, self.n_kv_heads * head_dim, bias=False)
        self.v_proj = nn.Linear(dim, self.n_kv_heads * head_dim, bias=False)
        self.o_proj = nn.Linear(self.n_heads * head_dim, dim, bias=False)
        self.q_norm = nn.RMSNorm(head_dim, eps=args.rms_norm_eps)
        self.k_norm = nn.RMSNorm(head_dim, eps=args.rms_norm_eps)
        self.use_rope = args.uses_rope(layer_type)
        if self.use_rope:
            self.rope = initialize_rope(
                head_dim, args.rope_theta, False, args.rope_scaling, args.max_position_embeddings
            )

    def __call__(self, x: mx.array, mask: Optional[mx.array] = None, cache=None) -> mx.array:
        B, L, _ = x.shape
        q = self.q_norm(self.q_proj(x).reshape(B, L, self.n_heads, -1)).transpose(0, 2, 1, 3)  # (B, H, L, D)
        k = self.k_norm(self.k_proj(x).reshape(B, L, self.n_kv_heads, -1)).transpose(0, 2, 1, 3)
        v = self.v_proj(x).reshape(B, L, self.n_kv_heads, -1).transpose(0, 2, 1, 3)  # (B, H_kv, L, D)
        if self.use_rope:
            offset = cache.offset if cache is not None else 0
            q, k = self.rope(q, offset=offset), self.rope(k, offset=offset)
        if cache is not None:
            k, v = cache.update_and_fetch(k, v)  # (B, H_kv, S, D)
        out = scaled_dot_product_attention(q, k, v, cache=cache, scale=self.scale, mask=mask)
        return self.o_proj(out.transpose(0, 2, 1, 3).reshape(B, L, -1))


class DecoderLayer(nn.Module):
    """Post-norm block: each sublayer's output is normalised before the residual add."""

    attention_class = Attention  # olmo3 swaps in its own

    def __init__(self, args: ModelArgs, layer_type: str):
        super().__init__()
        self.layer_type = layer_type
        self.self_attn = self.attention_class(args, layer_type)
        self.mlp = llama.MLP(args.hidden_size, args.intermediate_size)  # SwiGLU, no biases
        self.post_attention_layernorm = nn.RMSNorm(args.hidden_size, eps=args.rms_norm_eps)
        self.post_feedforward_layernorm = nn.RMSNorm(args.hidden_size, eps=args.rms_norm_eps)

    def __call__(self, x: mx.array, mask: Optional[mx.array] = None, cache=None) -> mx.array:
        h = x + self.post_attention_layernorm(self.self_attn(x, mask, cache))
        return h + self.post_feedforward_layernorm(self.mlp(h))


class Backbone(llama.LlamaModel):
    """llama's backbone (embeddings, one mask per layer type, final RMSNorm)."""

    block_class = DecoderLayer


class Model(llama.Model):
    """llama's LM head (tied or `lm_head`), sanitize (drops rope buffers and a tied
    `lm_head`), caches (RotatingKVCache for sliding layers, KVCache for global ones) and
    tensor-parallel `shard` (per-head q/k norms stay whole), over EXAONE 4's backbone."""

    # Both cache kinds roll back by themselves; the layers record nothing.
    supports_speculative_rollback = True
    backbone_class = Backbone
