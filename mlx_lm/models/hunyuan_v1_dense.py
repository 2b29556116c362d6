"""Hunyuan dense (`hunyuan_v1_dense`, HunYuanDenseV1ForCausalLM: tencent/Hunyuan-0.5B,
-1.8B, -4B, -7B): llama with per-head q/k RMSNorms after rope and NTK-alpha rope.

What differs from llama:
- Each query and key head is RMS-normalised (`query_layernorm`, `key_layernorm`)
  *after* rope (qwen3 normalises before it).
- The released configs give rope_scaling {"type": "dynamic", "alpha": a, ...}: not
  dynamic NTK but a fixed base stretched once, theta * a^(D / (D - 2))
  (`ntk_alpha_base`), as transformers' "ntk_alpha" rope; a "dynamic" scaling without
  alpha is llama's dynamic NTK.
- q/k/v/o biases with `attention_bias`; transformers' defaults rms_norm_eps 1e-5 and
  max_position_embeddings 2048.
Reference: transformers `models/hunyuan_v1_dense/modeling_hunyuan_v1_dense.py`.
"""

from dataclasses import dataclass
from typing import Optional

import mlx.core as mx
import mlx.nn as nn

from . import llama
from .base import scaled_dot_product_attention


def ntk_alpha_base(theta: float, alpha: float, dims: int) -> float:
    """The rope base NTK-alpha scaling stretches theta to, for heads of `dims` features."""
    return theta * alpha ** (dims / (dims - 2))


@dataclass
class ModelArgs(llama.ModelArgs):
    """HunYuanDenseV1Config's keys, with its defaults."""

    rms_norm_eps: float = 1e-5
    max_position_embeddings: Optional[int] = 2048

    @property
    def ntk_alpha(self) -> Optional[float]:
        """The alpha of a fixed NTK-alpha rope, or None."""
        scaling = self.rope_scaling or {}
        return scaling.get("alpha") if scaling.get("rope_type") == "dynamic" else None


class Attention(llama.Attention):
    def __init__(self, args: ModelArgs):
        super().__init__(args)
        self.query_layernorm = nn.RMSNorm(args.head_dim, eps=args.rms_norm_eps)
        self.key_layernorm = nn.RMSNorm(args.head_dim, eps=args.rms_norm_eps)
        if args.ntk_alpha:
            self.rope = nn.RoPE(args.head_dim, base=ntk_alpha_base(args.rope_theta, args.ntk_alpha, args.head_dim))

    def __call__(self, x: mx.array, mask: Optional[mx.array] = None, cache=None) -> mx.array:
        B, L, _ = x.shape
        q = self.q_proj(x).reshape(B, L, self.n_heads, -1).transpose(0, 2, 1, 3)  # (B, H, L, D)
        k = self.k_proj(x).reshape(B, L, self.n_kv_heads, -1).transpose(0, 2, 1, 3)  # (B, H_kv, L, D)
        v = self.v_proj(x).reshape(B, L, self.n_kv_heads, -1).transpose(0, 2, 1, 3)
        offset = cache.offset if cache is not None else 0
        q = self.query_layernorm(self.rope(q, offset=offset))  # normalised after rope
        k = self.key_layernorm(self.rope(k, offset=offset))
        if cache is not None:
            k, v = cache.update_and_fetch(k, v)
        out = scaled_dot_product_attention(q, k, v, cache=cache, scale=self.scale, mask=mask)
        return self.o_proj(out.transpose(0, 2, 1, 3).reshape(B, L, -1))


class DecoderLayer(llama.TransformerBlock):
    """llama's block with Hunyuan's attention (MLX initialises lazily, so llama's
    attention, replaced here, is never computed)."""

    def __init__(self, args: ModelArgs, layer_type: str):
        super().__init__(args, layer_type)
        self.self_attn = Attention(args)


class HunYuanModel(llama.LlamaModel):
    block_class = DecoderLayer


class Model(llama.Model):
    """llama's LM head, sanitize, caches and tensor parallelism (the per-head norms are
    shared by every head, so they stay whole) over Hunyuan's blocks."""

    # KV caches roll back by themselves; the layers record nothing.
    supports_speculative_rollback = True
    backbone_class = HunYuanModel
