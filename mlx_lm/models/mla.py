"""Multi-head latent attention (MLA, DeepSeek-V2 arXiv 2405.04434): what deepseek_v2,
deepseek_v3 and kimi_linear share.

Each token is compressed to one latent c = norm(kv_a_proj_with_mqa(x)[:kv_lora_rank])
(r features) and one rope key k_rot (dr features), both shared by every head; per
head, kv_b_proj maps c to a key part k_nope = W_k c (dn) and a value v = W_v c (dv).
Queries come from `q_proj`, or from the q LoRA (`q_a_proj`, `q_a_layernorm`,
`q_b_proj`), and split into q_nope (dn) and q_rot (dr). Rope (if any) turns q_rot and
k_rot only.

The cache is the latent itself: a KVCache whose "keys" are c (B, 1, S, r) and whose
"values" are k_rot (B, 1, S, dr), as transformers caches them. It trims, batches and
saves like any KVCache (one key head), and holds r + dr numbers a token and layer
instead of H (dn + dr + dv) for expanded keys and values (576 against 40960 at
DeepSeek-V3 sizes). Attention runs in the latent space (kv_b_proj absorbed, see
`latent_attention`), so kv_b_proj is read as a matrix and stays float when quantizing.

`MultiLinear` and `QuantizedMultiLinear` are upstream's per-head matrices (H, out, in),
the layout its DeepSeek files split kv_b_proj into (`embed_q`, `unembed_out`); the
families here read kv_b_proj whole, but the classes work standalone.

Reference: transformers `models/deepseek_v3/modeling_deepseek_v3.py` (DeepseekV3Attention),
`models/deepseek_v2/`, `models/kimi_linear/`.
"""

from typing import Any, Dict, Optional

import mlx.core as mx
import mlx.nn as nn

from . import sharding
from .base import Mask
from .cache import KVCache, QuantizedKVCache
from .rope_utils import apply_yarn_mscale
from .switch_layers import quantized_group_size_and_bits

# transformers builds q_a_layernorm / kv_a_layernorm with its RMSNorm's default eps,
# not the config's rms_norm_eps.
LATENT_NORM_EPS = 1e-6


def latent_attention(q_latent: mx.array, q_rot: mx.array, latent: mx.array, k_rot: mx.array, w_v: mx.array,
                     scale: float, mask: Mask) -> mx.array:
    """MLA in the latent space, one key head for all query heads.

    q_latent (B, H, L, r) = q_nope W_k (kv_b_proj's key rows absorbed), q_rot (B, H, L,
    dr); latent (B, 1, S, r), k_rot (B, 1, S, dr) from the cache; w_v (H, dv, r) the
    value rows of kv_b_proj. softmax(scale (q_nope . k_nope + q_rot . k_rot)) v, with
    k_nope = W_k c and v = W_v c, is softmax(scale [q_latent, q_rot] . [c, k_rot]) c
    mapped by W_v afterwards -> (B, H, L, dv)."""
    queries = mx.concatenate([q_latent, q_rot], axis=-1)  # (B, H, L, r + dr)
    keys = mx.concatenate([latent, k_rot], axis=-1)  # (B, 1, S, r + dr)
    attended = mx.fast.scaled_dot_product_attention(queries, keys, latent, scale=scale, mask=mask)  # (B, H, L, r)
    return attended @ w_v.swapaxes(-1, -2)  # (B, H, L, dv)


def softmax_scale(qk_head_dim: int, rope_scaling: Optional[Dict[str, Any]]) -> float:
    """transformers' yarn_apply_mscale: qk_head_dim^-1/2, times get_mscale(factor,
    mscale_all_dim)^2 when the rope is scaled and mscale_all_dim is set (DeepSeek's yarn
    checkpoints: the softmax sharpens as the rotated features' attention factor alone
    would not). `rope_scaling` is rope_utils.resolve_rope's dict (None: plain rope)."""
    return apply_yarn_mscale(qk_head_dim**-0.5, rope_scaling)


class LatentAttention(nn.Module):
    """MLA over the latent cache. `rope` turns (B, H, L, dr) features at a position
    offset (`rope(x, offset=...)`), or is None (Kimi Linear: no positions); `scale`
    defaults to (dn + dr)^-1/2.

    Reads from `args`: hidden_size, num_attention_heads, q_lora_rank (None: q_proj),
    kv_lora_rank, qk_nope_head_dim, qk_rope_head_dim, v_head_dim, attention_bias (on
    q_a_proj, kv_a_proj_with_mqa and o_proj, as transformers)."""

    def __init__(self, args: Any, rope: Optional[nn.Module] = None, scale: Optional[float] = None):
        super().__init__()
        dim, bias = args.hidden_size, args.attention_bias
        self.num_heads = args.num_attention_heads
        self.nope_dim, self.rope_dim, self.v_dim = args.qk_nope_head_dim, args.qk_rope_head_dim, args.v_head_dim
        self.kv_lora_rank = args.kv_lora_rank
        self.scale = (self.nope_dim + self.rope_dim) ** -0.5 if scale is None else scale
        q_dim = self.num_heads * (self.nope_dim + self.rope_dim)
        if args.q_lora_rank is None:
            self.q_proj = nn.Linear(dim, q_dim, bias=False)
        else:
            self.q_a_proj = nn.Linear(dim, args.q_lora_rank, bias=bias)
            self.q_a_layernorm = nn.RMSNorm(args.q_lora_rank, eps=LATENT_NORM_EPS)
            self.q_b_proj = nn.Linear(args.q_lora_rank, q_dim, bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(dim, self.kv_lora_rank + self.rope_dim, bias=bias)
        self.kv_a_layernorm = nn.RMSNorm(self.kv_lora_rank, eps=LATENT_NORM_EPS)
        self.kv_b_proj = nn.Linear(self.kv_lora_rank, self.num_heads * (self.nope_dim + self.v_dim), bias=False)
        self.o_proj = nn.Linear(self.num_heads * self.v_dim, dim, bias=bias)
        if rope is not None:
            self.rope = rope

    def queries(self, x: mx.array) -> mx.array:
        B, L, _ = x.shape
        q = self.q_proj(x) if "q_proj" in self else self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x)))
        return q.reshape(B, L, self.num_heads, -1).transpose(0, 2, 1, 3)  # (B, H, L, dn + dr)

    def __call__(self, x: mx.array, mask: Mask = None, cache: Optional[KVCache] = None) -> mx.array:
        B, L, _ = x.shape
        if isinstance(cache, QuantizedKVCache):  # its triples would not concatenate into one key
            raise ValueError("a quantized KV cache (kv_bits) is not supported by latent attention (MLA); "
                             "run without kv_bits")
        q_nope, q_rot = mx.split(self.queries(x), [self.nope_dim], axis=-1)
        latent, k_rot = mx.split(self.kv_a_proj_with_mqa(x), [self.kv_lora_rank], axis=-1)
        latent = self.kv_a_layernorm(latent)[:, None]  # (B, 1, L, r)
        k_rot = k_rot[:, None]  # (B, 1, L, dr): one rope key shared by the heads
        if "rope" in self:
            offset = 0 if cache is None else cache.offset
            q_rot, k_rot = self.rope(q_rot, offset=offset), self.rope(k_rot, offset=offset)
        if cache is not None:
            latent, k_rot = cache.update_and_fetch(latent, k_rot)  # (B, 1, S, r), (B, 1, S, dr)
        w = self.kv_b_proj.weight.reshape(self.num_heads, self.nope_dim + self.v_dim, self.kv_lora_rank)
        w_k, w_v = w[:, : self.nope_dim], w[:, self.nope_dim :]  # (H, dn, r), (H, dv, r)
        out = latent_attention(q_nope @ w_k, q_rot, latent, k_rot, w_v, self.scale, mask)  # (B, H, L, dv)
        return self.o_proj(out.transpose(0, 2, 1, 3).reshape(B, L, -1))

    def shard(self, group: mx.distributed.Group) -> None:
        """By heads: the query projection's rows (q_proj or q_b_proj), kv_b_proj's rows
        (head-major, read as a matrix, so sliced in place) and o_proj's columns; the
        latent projection and its norm stay whole (every head reads the latent), so a
        rank's latent cache is whole too."""
        self.num_heads = sharding.per_rank(self.num_heads, group, "num_attention_heads")
        q_name = "q_proj" if "q_proj" in self else "q_b_proj"
        sharding.shard_projections(self, (q_name,), sharding.ALL_TO_SHARDED, group)
        self.kv_b_proj.weight = sharding.take_shard(self.kv_b_proj.weight, group)
        sharding.shard_projections(self, ("o_proj",), sharding.SHARDED_TO_ALL, group)


class MultiLinear(nn.Module):
    """One (out, in) matrix per head, `weight` (H, out, in), no bias: x (..., H, L, in)
    -> x W^T (..., H, L, out); with transpose=False, x (..., H, L, out) -> x W
    (..., H, L, in) (the same matrix read the other way, as MLA absorbs it)."""

    def __init__(self, input_dims: int, output_dims: int, num_heads: int):
        super().__init__()
        scale = input_dims**-0.5
        self.weight = mx.random.uniform(-scale, scale, (num_heads, output_dims, input_dims))

    def __call__(self, x: mx.array, transpose: bool = True) -> mx.array:
        return x @ (self.weight.swapaxes(-1, -2) if transpose else self.weight)

    def to_quantized(self, group_size: Optional[int] = None, bits: Optional[int] = None,
                     mode: str = "affine") -> "QuantizedMultiLinear":
        num_heads, output_dims, input_dims = self.weight.shape
        quantized = QuantizedMultiLinear(input_dims, output_dims, num_heads, group_size, bits, mode)
        quantized.set_weights(self.weight)
        return quantized


class QuantizedMultiLinear(nn.Module):
    """MultiLinear with each head's matrix quantized along `in` (mx.quantize's layout:
    `weight` packed, `scales`, and `biases` for the affine mode); frozen."""

    def __init__(self, input_dims: int, output_dims: int, num_heads: int, group_size: Optional[int] = None,
                 bits: Optional[int] = None, mode: str = "affine"):
        super().__init__()
        self.mode = mode
        self.group_size, self.bits = group_size, bits
        self.set_weights(mx.zeros((num_heads, output_dims, input_dims)))
        self.freeze()

    def set_weights(self, weight: mx.array) -> None:
        """Quantize float (H, out, in) `weight` into this layer."""
        self.weight, self.scales, *biases = mx.quantize(weight, self.group_size, self.bits, mode=self.mode)
        self.group_size, self.bits = quantized_group_size_and_bits(self.weight, self.scales, weight.shape[-1])
        if biases and biases[0] is not None:
            self.biases = biases[0]

    def __call__(self, x: mx.array, transpose: bool = True) -> mx.array:
        return mx.quantized_matmul(x, self.weight, self.scales, self.get("biases"), transpose=transpose,
                                   group_size=self.group_size, bits=self.bits, mode=self.mode)
