"""Phi-3 family (Phi-3 / Phi-3.5-mini, Phi-4-mini): the llama decoder with fused projections.

What differs from llama:
- Attention projects q, k and v with one fused `qkv_proj` (rows: all query heads, then
  all key heads, then all value heads) and the MLP gate and up with one `gate_up_proj`
  (rows: gate, then up): the layout transformers saves and MLX converters keep, so
  checkpoints load without rewriting and each is one matmul.
- Rope may cover only the first `partial_rotary_factor` of each head (Phi-4-mini: 0.75),
  and long-context checkpoints use LongRoPE ("longrope", formerly "su"; Phi-3 configs
  saying "yarn" mean it too): per-frequency short/long rescale factors and an attention
  factor on the rotated features (rope_utils). As in transformers, a forward call whose
  sequence reaches past `original_max_position_embeddings` (a top-level key that wins
  over the rope dict's) rotates all its positions with the long factors, so a full
  forward and token-by-token decoding differ before that position.
- `sliding_window`, when set, applies to every layer (a query sees that many most recent
  positions, itself included) and those layers cache in a RotatingKVCache. A window no
  smaller than max_position_embeddings (Phi-3.5/4-mini's 262144 against 131072) never
  binds within the model's context, so it is ignored there: plain KV caches stay
  quantizable (--kv-bits) and trim without records.

Reference: transformers `models/phi3/modeling_phi3.py`, `configuration_phi3.py`.
"""

from dataclasses import dataclass
from typing import Any, Dict, List, Optional

import mlx.core as mx
import mlx.nn as nn

from . import llama, sharding
from .base import BaseModelArgs, check_head_grouping, scaled_dot_product_attention
from .llama import FULL, SLIDING
from .rope_utils import initialize_rope, resolve_rope

LONGROPE_ALIASES = ("su", "yarn", "longrope")  # transformers' Phi3Config maps all three to longrope


@dataclass
class ModelArgs(BaseModelArgs):
    model_type: str
    hidden_size: int
    num_hidden_layers: int
    intermediate_size: int
    num_attention_heads: int
    vocab_size: int
    rms_norm_eps: float = 1e-5
    num_key_value_heads: Optional[int] = None
    head_dim: Optional[int] = None
    max_position_embeddings: int = 4096
    original_max_position_embeddings: int = 4096
    partial_rotary_factor: Optional[float] = None
    rope_theta: Optional[float] = None
    rope_scaling: Optional[Dict[str, Any]] = None
    rope_parameters: Optional[Dict[str, Any]] = None
    sliding_window: Optional[int] = None
    hidden_act: str = "silu"
    tie_word_embeddings: bool = False

    def __post_init__(self):
        if self.num_key_value_heads is None:
            self.num_key_value_heads = self.num_attention_heads
        if self.head_dim is None:
            self.head_dim = self.hidden_size // self.num_attention_heads
        check_head_grouping(self.num_attention_heads, self.num_key_value_heads)
        if self.hidden_act != "silu":
            raise ValueError(f"phi3 supports hidden_act 'silu' only, got {self.hidden_act!r}")
        if self.sliding_window is not None and not (isinstance(self.sliding_window, int) and self.sliding_window > 0):
            raise ValueError(f"sliding_window must be a positive int or null, got {self.sliding_window!r}")
        theta, self.rope_scaling, factor = resolve_rope(self.rope_theta, self.rope_scaling, self.rope_parameters)
        self.rope_theta = 10000.0 if theta is None else theta
        if self.partial_rotary_factor is None:
            self.partial_rotary_factor = 1.0 if factor is None else factor
        if self.rope_scaling is not None:
            self.rope_scaling = self._longrope(self.rope_scaling)

    def _longrope(self, scaling: Dict[str, Any]) -> Dict[str, Any]:
        if scaling["rope_type"] not in LONGROPE_ALIASES:
            raise ValueError(f"phi3 rope_type must be 'default' or 'longrope', got {scaling['rope_type']!r}")
        return dict(
            scaling, rope_type="longrope", original_max_position_embeddings=self.original_max_position_embeddings
        )

    @property
    def rotary_dims(self) -> int:
        return int(self.head_dim * self.partial_rotary_factor)

    @property
    def layer_types(self) -> List[str]:
        binds = self.sliding_window is not None and self.sliding_window < self.max_position_embeddings
        return [SLIDING if binds else FULL] * self.num_hidden_layers


class Attention(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.n_heads, self.n_kv_heads, head_dim = args.num_attention_heads, args.num_key_value_heads, args.head_dim
        self.scale = head_dim**-0.5
        self.qkv_proj = nn.Linear(args.hidden_size, (self.n_heads + 2 * self.n_kv_heads) * head_dim, bias=False)
        self.o_proj = nn.Linear(self.n_heads * head_dim, args.hidden_size, bias=False)
        self.rope = initialize_rope(
            args.rotary_dims, args.rope_theta, False, args.rope_scaling, args.max_position_embeddings
        )

    def __call__(self, x: mx.array, mask: Optional[mx.array] = None, cache=None) -> mx.array:
        B, L, _ = x.shape
        qkv = self.qkv_proj(x).reshape(B, L, self.n_heads + 2 * self.n_kv_heads, -1)  # (B, L, H + 2 H_kv, D)
        q, k, v = mx.split(qkv, [self.n_heads, self.n_heads + self.n_kv_heads], axis=2)
        q, k, v = (t.transpose(0, 2, 1, 3) for t in (q, k, v))  # (B, H, L, D)
        offset = cache.offset if cache is not None else 0
        q, k = self.rope(q, offset=offset), self.rope(k, offset=offset)
        if cache is not None:
            k, v = cache.update_and_fetch(k, v)
        out = scaled_dot_product_attention(q, k, v, cache=cache, scale=self.scale, mask=mask)
        return self.o_proj(out.transpose(0, 2, 1, 3).reshape(B, L, -1))


class MLP(nn.Module):
    def __init__(self, dim: int, hidden_dim: int):
        super().__init__()
        self.gate_up_proj = nn.Linear(dim, 2 * hidden_dim, bias=False)
        self.down_proj = nn.Linear(hidden_dim, dim, bias=False)

    def __call__(self, x: mx.array) -> mx.array:
        gate, up = mx.split(self.gate_up_proj(x), 2, axis=-1)
        return self.down_proj(nn.silu(gate) * up)


class TransformerBlock(nn.Module):
    def __init__(self, args: ModelArgs, layer_type: str):
        super().__init__()
        self.layer_type = layer_type
        self.self_attn = Attention(args)
        self.mlp = MLP(args.hidden_size, args.intermediate_size)
        self.input_layernorm = nn.RMSNorm(args.hidden_size, eps=args.rms_norm_eps)
        self.post_attention_layernorm = nn.RMSNorm(args.hidden_size, eps=args.rms_norm_eps)

    def __call__(self, x: mx.array, mask: Optional[mx.array] = None, cache=None) -> mx.array:
        h = x + self.self_attn(self.input_layernorm(x), mask, cache)
        return h + self.mlp(self.post_attention_layernorm(h))


class Phi3Model(llama.LlamaModel):
    block_class = TransformerBlock


class Model(llama.Model):
    """llama's Model over the fused-projection blocks: same logits, sanitize (drops
    rope's stored inverse frequencies and a tied lm_head; fused tensors load as they
    are) and caches (a RotatingKVCache per sliding layer)."""

    backbone_class = Phi3Model

    def shard(self, group: Optional[mx.distributed.Group] = None) -> None:
        """Tensor parallel as llama; the fused qkv_proj splits each of its q, k, v row
        blocks and gate_up_proj each of its halves, so a rank's rows stay [q | k | v]
        and [gate | up]."""
        group = sharding.world(group)
        for layer in self.layers:
            attn = layer.self_attn
            head_dim = attn.qkv_proj.weight.shape[0] // (attn.n_heads + 2 * attn.n_kv_heads)
            pieces = [attn.n_heads * head_dim, (attn.n_heads + attn.n_kv_heads) * head_dim]
            attn.n_heads, attn.n_kv_heads = sharding.shard_attention(
                attn, attn.n_heads, attn.n_kv_heads, group, qkv=("qkv_proj",), qkv_segments=pieces
            )
            sharding.shard_mlp(layer.mlp, group, inputs=("gate_up_proj",), segments=2)
