"""Gemma 2 (`gemma2`, Gemma2ForCausalLM: gemma-2-2b/9b/27b).

Gemma 3's text model without its q/k norms and with one rope, plus attention soft-capping.
What differs from llama:
- Sliding and global attention layers alternate, sliding first: `layer_types`, else
  layer i slides iff i is even (transformers 4 configs name no pattern). A sliding
  layer's query sees its `sliding_window` most recent positions, itself included, and
  caches them in a `RotatingKVCache(sliding_window)`. Upstream mlx-lm gives Gemma 2 no
  window at all, so past 4096 tokens it attends where the checkpoint never looked.
- Attention logits are soft-capped before the mask and softmax:
  s = c * tanh(q.k * scale / c), c = `attn_logit_softcapping` (50 in the releases);
  MLX's fused attention cannot do that, so those layers run `softcapped_attention`.
- Scores are scaled by `query_pre_attn_scalar`^-1/2, not head_dim^-1/2.
- Final logits are soft-capped too: c * tanh(logits / c), c = `final_logit_softcapping`.
- As in Gemma 3 (whose pieces this reuses): zero-centred RMSNorms x_hat * (1 + w) in
  float32, four per block (pre/post attention, pre/post feed-forward), embeddings
  scaled by sqrt(hidden_size) rounded to the compute dtype, a GeGLU MLP with the tanh
  gelu, tied embeddings by default.

Rope: one theta for every layer, `rope_theta` (transformers 4) or `rope_parameters`
(transformers 5), default 10000. Weights are `model.*` (+ `lm_head.*` unless tied) in
transformers' and MLX converters' layouts alike.
Reference: transformers `models/gemma2/modeling_gemma2.py`, `configuration_gemma2.py`.
"""

from dataclasses import dataclass
from typing import Any, Dict, List, Optional

import mlx.core as mx
import mlx.nn as nn

from . import gemma3
from .base import (
    BaseModelArgs,
    Mask,
    check_head_grouping,
    check_layer_types,
    check_sliding_window,
    scaled_dot_product_attention,
)
from .cache import QuantizedKVCache
from .gpt_oss import FULL, SLIDING
from .masks import create_causal_mask
from .rope_utils import initialize_rope, resolve_rope


@dataclass
class ModelArgs(BaseModelArgs):
    """Gemma2Config's keys, with its defaults."""

    model_type: str = "gemma2"
    hidden_size: int = 2304
    intermediate_size: int = 9216
    num_hidden_layers: int = 26
    num_attention_heads: int = 8
    num_key_value_heads: int = 4
    head_dim: int = 256
    vocab_size: int = 256000
    rms_norm_eps: float = 1e-6
    hidden_activation: str = "gelu_pytorch_tanh"
    query_pre_attn_scalar: float = 256
    sliding_window: Optional[int] = 4096
    layer_types: Optional[List[str]] = None
    rope_theta: Optional[float] = None  # transformers 4
    rope_scaling: Optional[Dict[str, Any]] = None  # transformers 4
    rope_parameters: Optional[Dict[str, Any]] = None  # transformers 5
    max_position_embeddings: int = 8192
    attention_bias: bool = False
    final_logit_softcapping: Optional[float] = 30.0
    attn_logit_softcapping: Optional[float] = 50.0
    use_bidirectional_attention: Optional[bool] = None
    tie_word_embeddings: bool = True

    def __post_init__(self):
        if self.layer_types is None:
            self.layer_types = [SLIDING if i % 2 == 0 else FULL for i in range(self.num_hidden_layers)]
        check_layer_types(self.layer_types, self.num_hidden_layers, (SLIDING, FULL))
        check_head_grouping(self.num_attention_heads, self.num_key_value_heads)
        check_sliding_window(self.layer_types, self.sliding_window)
        theta, self.rope_scaling, partial = resolve_rope(self.rope_theta, self.rope_scaling, self.rope_parameters)
        if partial not in (None, 1.0):
            raise ValueError(f"gemma2 rotates whole heads; got partial_rotary_factor={partial}")
        self.rope_theta = 10000.0 if theta is None else theta
        for name in ("final_logit_softcapping", "attn_logit_softcapping"):
            cap = getattr(self, name)
            if cap is not None and not cap > 0:
                raise ValueError(f"{name} must be positive or null, got {cap!r}")
        if self.hidden_activation != "gelu_pytorch_tanh":
            raise ValueError(
                f"hidden_activation {self.hidden_activation!r} is not supported; gemma2 uses 'gelu_pytorch_tanh'"
            )
        if self.use_bidirectional_attention:
            raise ValueError("use_bidirectional_attention=True (an embedding model) is not supported; gemma2 is causal")


def group_mask(mask: mx.array, num_kv_heads: int) -> mx.array:
    """A mask (N, S) or (B, 1 or H, N, S) reshaped to broadcast over grouped scores
    (B, H_kv, H / H_kv, N, S)."""
    if mask.ndim != 4:
        return mask
    B, heads, N, S = mask.shape
    return mask.reshape(B, -1, heads // num_kv_heads or 1, N, S)


def softcapped_attention(
    queries: mx.array, keys: mx.array, values: mx.array, scale: float, cap: float, mask: Mask
) -> mx.array:
    """Attention whose logits are soft-capped before masking:
    softmax(cap * tanh(q k^T * scale / cap) + mask) v, in Gemma 2's order.

    queries (B, H, N, D), keys/values (B, H_kv, S, D) -> (B, H, N, D); the H / H_kv
    query heads of a group share their KV head without repeating it. mask: None,
    "causal" (aligned to the last key), boolean (True = attend) or additive,
    broadcastable to (B, H, N, S).
    """
    B, H, N, D = queries.shape
    H_kv, S = keys.shape[1], keys.shape[2]
    q = queries.reshape(B, H_kv, H // H_kv, N, D)
    scores = (q @ mx.expand_dims(keys, 2).swapaxes(-1, -2)) * scale  # (B, H_kv, r, N, S)
    scores = gemma3.softcap(scores, cap)
    if isinstance(mask, str):
        if mask != "causal":
            raise ValueError(f'mask must be None, "causal" or an array, got {mask!r}')
        mask = create_causal_mask(N, S - N)
    if mask is not None:
        mask = group_mask(mask, H_kv)
        # The dtype's lowest value, not -inf: a fully masked row (batch padding) stays finite.
        scores = mx.where(mask, scores, mx.finfo(scores.dtype).min) if mask.dtype == mx.bool_ else scores + mask
    weights = mx.softmax(scores, axis=-1, precise=True)
    return (weights @ mx.expand_dims(values, 2)).reshape(B, H, N, D)


class Attention(nn.Module):
    def __init__(self, args: ModelArgs, layer_type: str):
        super().__init__()
        dim, head_dim, bias = args.hidden_size, args.head_dim, args.attention_bias
        self.n_heads, self.n_kv_heads = args.num_attention_heads, args.num_key_value_heads
        self.scale = args.query_pre_attn_scalar**-0.5
        self.softcap = args.attn_logit_softcapping
        self.q_proj = nn.Linear(dim, self.n_heads * head_dim, bias=bias)
        self.k_proj = nn.Linear(dim, self.n_kv_heads * head_dim, bias=bias)
        self.v_proj = nn.Linear(dim, self.n_kv_heads * head_dim, bias=bias)
        self.o_proj = nn.Linear(self.n_heads * head_dim, dim, bias=bias)
        self.rope = initialize_rope(head_dim, args.rope_theta, False, args.rope_scaling, args.max_position_embeddings)

    def __call__(self, x: mx.array, mask: Optional[mx.array] = None, cache=None) -> mx.array:
        B, L, _ = x.shape
        q = self.q_proj(x).reshape(B, L, self.n_heads, -1).transpose(0, 2, 1, 3)  # (B, H, L, D)
        k = self.k_proj(x).reshape(B, L, self.n_kv_heads, -1).transpose(0, 2, 1, 3)  # (B, H_kv, L, D)
        v = self.v_proj(x).reshape(B, L, self.n_kv_heads, -1).transpose(0, 2, 1, 3)
        offset = cache.offset if cache is not None else 0
        q, k = self.rope(q, offset=offset), self.rope(k, offset=offset)
        if cache is not None:
            k, v = cache.update_and_fetch(k, v)  # (B, H_kv, S, D)
        if self.softcap is None:
            out = scaled_dot_product_attention(q, k, v, cache=cache, scale=self.scale, mask=mask)
        else:
            if isinstance(cache, QuantizedKVCache):  # soft-capping needs the float keys
                k, v = (mx.dequantize(*t, group_size=cache.group_size, bits=cache.bits) for t in (k, v))
            out = softcapped_attention(q, k, v, self.scale, self.softcap, mask)
        return self.o_proj(out.transpose(0, 2, 1, 3).reshape(B, L, -1))


class DecoderLayer(gemma3.DecoderLayer):
    """Gemma 3's block (four zero-centred norms, GeGLU) around the soft-capped attention."""

    attention_class = Attention


class TextModel(gemma3.TextModel):
    """Gemma 3's backbone: scaled embeddings, one mask per layer type, final norm."""

    layer_class = DecoderLayer


class Model(gemma3.LanguageModel):
    """Gemma 3's causal LM head (tied or `lm_head`, final soft-cap), sanitize (drops rope
    buffers and a tied `lm_head`), caches (RotatingKVCache for sliding layers, KVCache for
    global ones) and tensor-parallel `shard`, over Gemma 2's backbone."""

    # Both cache kinds roll back by themselves (a speculating RotatingKVCache records the
    # rows each write destroys); the layers record nothing.
    supports_speculative_rollback = True
    backbone_class = TextModel
