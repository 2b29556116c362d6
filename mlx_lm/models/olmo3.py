"""OLMo 3 (`olmo3`, Olmo3ForCausalLM: allenai/Olmo-3-7B and -32B, Think and Instruct).

What differs from llama:
- Post-norms only (OLMo 2's block, the one exaone4.py runs): x + norm(attn(x)), then
  h + norm(mlp(h)); the sublayers' inputs are not normalised.
- QK-norm over the whole projection: q_proj's output (all heads together, H * D
  features) and k_proj's (H_kv * D) are RMS-normalised before the heads are split, so
  one RMS spans every head. Tensor parallel therefore sums the squares over the ranks
  (`projection_rms_norm`) instead of splitting the norm per head.
- Sliding and global layers: `layer_types`, else three sliding then one global. Sliding
  layers see their `sliding_window` most recent positions, itself included, and cache
  them in a `RotatingKVCache`. Every layer ropes.
- Each layer type has its own rope: transformers 5 writes `rope_parameters` keyed by
  layer type; transformers-4 configs give one `rope_theta` (default 500000) for both and
  a `rope_scaling` (YaRN in the long-context releases) for the global layers only.
  (transformers 5.24 reading a transformers-4 config gives the sliding layers 500000
  whatever `rope_theta` says: it consumes the key for the global layers first. Every
  released checkpoint has 500000, so the two agree on them; we read the key for both.)

Weights are `model.*` (+ `lm_head.*` unless tied).
Reference: transformers `models/olmo3/modeling_olmo3.py`, `configuration_olmo3.py`.
"""

from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Tuple

import mlx.core as mx
import mlx.nn as nn

from . import exaone4, llama, sharding
from .base import BaseModelArgs, check_head_grouping, check_layer_types, check_sliding_window
from .base import scaled_dot_product_attention
from .llama import FULL, SLIDING
from .rope_utils import initialize_rope, resolve_rope

DEFAULT_THETA = 500000.0  # Olmo3Config.default_theta


@dataclass
class ModelArgs(BaseModelArgs):
    """Olmo3Config's keys, with its defaults."""

    model_type: str = "olmo3"
    vocab_size: int = 50304
    hidden_size: int = 4096
    intermediate_size: int = 11008
    num_hidden_layers: int = 32
    num_attention_heads: int = 32
    num_key_value_heads: Optional[int] = None
    head_dim: Optional[int] = None  # transformers reads it when present; else hidden / heads
    hidden_act: str = "silu"
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = False
    rope_theta: Optional[float] = None  # transformers 4: both layer types
    rope_scaling: Optional[Dict[str, Any]] = None  # transformers 4: global layers
    rope_parameters: Optional[Dict[str, Dict[str, Any]]] = None  # transformers 5: per layer type
    attention_bias: bool = False
    rms_norm_eps: float = 1e-5
    sliding_window: Optional[int] = 4096
    layer_types: Optional[List[str]] = None

    def __post_init__(self):
        if self.num_key_value_heads is None:
            self.num_key_value_heads = self.num_attention_heads
        check_head_grouping(self.num_attention_heads, self.num_key_value_heads)
        if self.head_dim is None:
            self.head_dim = self.hidden_size // self.num_attention_heads
        if self.layer_types is None:
            self.layer_types = [FULL if (i + 1) % 4 == 0 else SLIDING for i in range(self.num_hidden_layers)]
        check_layer_types(self.layer_types, self.num_hidden_layers, (SLIDING, FULL))
        check_sliding_window(self.layer_types, self.sliding_window)
        self.rope = {kind: self._resolve_rope(kind) for kind in (SLIDING, FULL)}
        if self.hidden_act != "silu":
            raise ValueError(f"hidden_act {self.hidden_act!r} is not supported; olmo3 uses 'silu'")

    def _resolve_rope(self, kind: str) -> Tuple[float, Optional[Dict[str, Any]]]:
        """(theta, scaling) of one layer type from either dialect; top-level keys win."""
        params = self.rope_parameters or {}
        if set(params) - {SLIDING, FULL}:
            raise ValueError(
                f"olmo3 rope_parameters must be keyed by layer type ({SLIDING!r}, {FULL!r}); got keys {sorted(params)}"
            )
        scaling = self.rope_scaling if kind == FULL else None
        theta, scaling, partial = resolve_rope(self.rope_theta, scaling, params.get(kind))
        if partial not in (None, 1.0):
            raise ValueError(f"olmo3 rotates whole heads; got partial_rotary_factor={partial} for {kind}")
        return (DEFAULT_THETA if theta is None else theta), scaling


def projection_rms_norm(
    x: mx.array, weight: mx.array, eps: float, group: Optional[mx.distributed.Group] = None
) -> mx.array:
    """RMSNorm over the last axis, (..., F) -> (..., F), where the F features may be one
    rank's share of a projection split across `group`: the mean square is then summed
    over the ranks, so every rank normalises by the RMS of the whole projection."""
    if group is None or group.size() == 1:
        return mx.fast.rms_norm(x, weight, eps)
    x32 = x.astype(mx.float32)
    total = mx.distributed.all_sum(mx.sum(mx.square(x32), axis=-1, keepdims=True), group=group)
    mean_square = total / (x.shape[-1] * group.size())
    return (x32 * mx.rsqrt(mean_square + eps)).astype(x.dtype) * weight


class ProjectionNorm(nn.Module):
    """RMSNorm of a whole q or k projection (all heads); `group` is set by `shard`."""

    def __init__(self, dims: int, eps: float):
        super().__init__()
        self.weight = mx.ones((dims,))
        self.eps = eps
        self.group: Optional[mx.distributed.Group] = None

    def __call__(self, x: mx.array) -> mx.array:
        return projection_rms_norm(x, self.weight, self.eps, self.group)


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
        self.q_norm = ProjectionNorm(self.n_heads * head_dim, args.rms_norm_eps)
        self.k_norm = ProjectionNorm(self.n_kv_heads * head_dim, args.rms_norm_eps)
        theta, scaling = args.rope[layer_type]
        self.rope = initialize_rope(head_dim, theta, False, scaling, args.max_position_embeddings)

    def __call__(self, x: mx.array, mask: Optional[mx.array] = None, cache=None) -> mx.array:
        B, L, _ = x.shape
        q = self.q_norm(self.q_proj(x)).reshape(B, L, self.n_heads, -1).transpose(0, 2, 1, 3)  # (B, H, L, D)
        k = self.k_norm(self.k_proj(x)).reshape(B, L, self.n_kv_heads, -1).transpose(0, 2, 1, 3)
        v = self.v_proj(x).reshape(B, L, self.n_kv_heads, -1).transpose(0, 2, 1, 3)  # (B, H_kv, L, D)
        offset = cache.offset if cache is not None else 0
        q, k = self.rope(q, offset=offset), self.rope(k, offset=offset)
        if cache is not None:
            k, v = cache.update_and_fetch(k, v)  # (B, H_kv, S, D)
        out = scaled_dot_product_attention(q, k, v, cache=cache, scale=self.scale, mask=mask)
        return self.o_proj(out.transpose(0, 2, 1, 3).reshape(B, L, -1))


class DecoderLayer(exaone4.DecoderLayer):
    """EXAONE 4's post-norm block around OLMo 3's attention."""

    attention_class = Attention


class Backbone(llama.LlamaModel):
    """llama's backbone (embeddings, one mask per layer type, final RMSNorm)."""

    block_class = DecoderLayer


class Model(llama.Model):
    """llama's LM head (tied or `lm_head`), sanitize (drops rope buffers and a tied
    `lm_head`) and caches (RotatingKVCache for sliding layers, KVCache for global ones),
    over OLMo 3's backbone."""

    # Both cache kinds roll back by themselves; the layers record nothing.
    supports_speculative_rollback = True
    backbone_class = Backbone

    def shard(self, group: Optional[mx.distributed.Group] = None) -> None:
        """llama's tensor parallelism (heads and MLP units split, o_proj and down_proj
        all-sum), plus the q/k norms: each rank keeps the weights of its features and
        sums the squares with the others (see projection_rms_norm)."""
        group = sharding.world(group)
        super().shard(group)
        for layer in self.layers:
            for norm in (layer.self_attn.q_norm, layer.self_attn.k_norm):
                norm.weight = sharding.take_shard(norm.weight, group)
                norm.group = group
