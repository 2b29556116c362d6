"""Llama (and Mistral): pre-norm decoder with grouped-query attention, rope, SwiGLU MLP.

This file is also the dense skeleton qwen2 and qwen3 reuse: they bring their own
`ModelArgs`, whose `qkv_bias`, `o_bias` and `qk_norm` say how their attention differs.

Sliding-window attention: a layer of kind "sliding_attention" lets a query see its
`sliding_window` most recent positions, itself included, and caches them in a
`RotatingKVCache`; "full_attention" layers see everything. The kinds come from
`layer_types` (Ministral style, mixed) when given; else a Mistral config's
`sliding_window` makes every layer slide, as transformers' MistralModel does (a Llama
config has no window, and Qwen2/3 configs carry one that only their `layer_types` or
`use_sliding_window` switch on).

References: transformers `models/llama/modeling_llama.py`, `models/mistral/`,
`models/ministral/`.
"""

from dataclasses import dataclass
from typing import Any, Dict, List, Optional

import mlx.core as mx
import mlx.nn as nn

from .base import (
    BaseModelArgs,
    check_head_grouping,
    check_layer_types,
    create_attention_mask,
    scaled_dot_product_attention,
)
from . import pipeline, sharding
from .cache import KVCache, RotatingKVCache
from .rope_utils import initialize_rope, resolve_rope

SLIDING, FULL = "sliding_attention", "full_attention"
# Model types whose bare `sliding_window` (no layer_types) applies to every layer.
WINDOW_ON_EVERY_LAYER = ("mistral",)


@dataclass
class ModelArgs(BaseModelArgs):
    model_type: str
    hidden_size: int
    num_hidden_layers: int
    intermediate_size: int
    num_attention_heads: int
    vocab_size: int
    rms_norm_eps: float = 1e-6
    num_key_value_heads: Optional[int] = None
    head_dim: Optional[int] = None
    max_position_embeddings: Optional[int] = None
    attention_bias: bool = False
    mlp_bias: bool = False
    rope_theta: Optional[float] = None
    rope_scaling: Optional[Dict[str, Any]] = None
    rope_parameters: Optional[Dict[str, Any]] = None
    tie_word_embeddings: bool = False
    sliding_window: Optional[int] = None
    layer_types: Optional[List[str]] = None

    qk_norm = False  # qwen3 normalises each query and key head before rope

    def __post_init__(self):
        if self.num_key_value_heads is None:
            self.num_key_value_heads = self.num_attention_heads
        if self.head_dim is None:
            self.head_dim = self.hidden_size // self.num_attention_heads
        check_head_grouping(self.num_attention_heads, self.num_key_value_heads)
        theta, self.rope_scaling, _ = resolve_rope(self.rope_theta, self.rope_scaling, self.rope_parameters)
        self.rope_theta = 10000.0 if theta is None else theta
        self._set_layer_types()

    def _set_layer_types(self):
        if self.layer_types is None:
            every = self.sliding_window is not None and self.model_type in WINDOW_ON_EVERY_LAYER
            self.layer_types = [SLIDING if every else FULL] * self.num_hidden_layers
        check_layer_types(self.layer_types, self.num_hidden_layers, (SLIDING, FULL))
        if SLIDING in self.layer_types and not (isinstance(self.sliding_window, int) and self.sliding_window > 0):
            raise ValueError(
                f"layer_types has sliding_attention layers but sliding_window is {self.sliding_window!r}; "
                "give a positive window size"
            )

    @property
    def qkv_bias(self) -> bool:
        return self.attention_bias

    @property
    def o_bias(self) -> bool:
        return self.attention_bias


class Attention(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        dim, head_dim = args.hidden_size, args.head_dim
        self.n_heads = args.num_attention_heads
        self.n_kv_heads = args.num_key_value_heads
        self.scale = head_dim**-0.5
        self.q_proj = nn.Linear(dim, self.n_heads * head_dim, bias=args.qkv_bias)
        self.k_proj = nn.Linear(dim, self.n_kv_heads * head_dim, bias=args.qkv_bias)
        self.v_proj = nn.Linear(dim, self.n_kv_heads * head_dim, bias=args.qkv_bias)
        self.o_proj = nn.Linear(self.n_heads * head_dim, dim, bias=args.o_bias)
        if args.qk_norm:
            self.q_norm = nn.RMSNorm(head_dim, eps=args.rms_norm_eps)
            self.k_norm = nn.RMSNorm(head_dim, eps=args.rms_norm_eps)
        self.qk_norm = args.qk_norm
        self.rope = initialize_rope(
            head_dim, args.rope_theta, False, args.rope_scaling, args.max_position_embeddings
        )

    def __call__(self, x: mx.array, mask: Optional[mx.array] = None, cache=None) -> mx.array:
        B, L, _ = x.shape
        q = self.q_proj(x).reshape(B, L, self.n_heads, -1)  # (B, L, H, D)
        k = self.k_proj(x).reshape(B, L, self.n_kv_heads, -1)
        v = self.v_proj(x).reshape(B, L, self.n_kv_heads, -1)
        if self.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k, v = (t.transpose(0, 2, 1, 3) for t in (q, k, v))  # (B, H, L, D)
        offset = cache.offset if cache is not None else 0
        q, k = self.rope(q, offset=offset), self.rope(k, offset=offset)
        if cache is not None:
            k, v = cache.update_and_fetch(k, v)
        out = scaled_dot_product_attention(q, k, v, cache=cache, scale=self.scale, mask=mask)
        return self.o_proj(out.transpose(0, 2, 1, 3).reshape(B, L, -1))


class MLP(nn.Module):
    def __init__(self, dim: int, hidden_dim: int, bias: bool = False):
        super().__init__()
        self.gate_proj = nn.Linear(dim, hidden_dim, bias=bias)
        self.up_proj = nn.Linear(dim, hidden_dim, bias=bias)
        self.down_proj = nn.Linear(hidden_dim, dim, bias=bias)

    def __call__(self, x: mx.array) -> mx.array:
        return self.down_proj(nn.silu(self.gate_proj(x)) * self.up_proj(x))


class TransformerBlock(nn.Module):
    def __init__(self, args: ModelArgs, layer_type: str = FULL):
        super().__init__()
        self.layer_type = layer_type
        self.self_attn = Attention(args)
        self.mlp = MLP(args.hidden_size, args.intermediate_size, bias=args.mlp_bias)
        self.input_layernorm = nn.RMSNorm(args.hidden_size, eps=args.rms_norm_eps)
        self.post_attention_layernorm = nn.RMSNorm(args.hidden_size, eps=args.rms_norm_eps)

    def __call__(self, x: mx.array, mask: Optional[mx.array] = None, cache=None) -> mx.array:
        h = x + self.self_attn(self.input_layernorm(x), mask, cache)
        return h + self.mlp(self.post_attention_layernorm(h))


class LlamaModel(pipeline.PipelineMixin, nn.Module):
    block_class = TransformerBlock  # families with another block (phi3) swap it

    def __init__(self, args: ModelArgs):
        super().__init__()
        self.embed_tokens = nn.Embedding(args.vocab_size, args.hidden_size)
        self.layers = [self.block_class(args, layer_type) for layer_type in args.layer_types]
        self.norm = nn.RMSNorm(args.hidden_size, eps=args.rms_norm_eps)
        self.sliding_window = args.sliding_window

    def __call__(
        self, inputs: mx.array, cache: Optional[List[Any]] = None, input_embeddings: Optional[mx.array] = None
    ) -> mx.array:
        h = self.embed_tokens(inputs) if input_embeddings is None else input_embeddings  # (B, L, hidden)
        h = pipeline.receive(h, self.stage)
        if cache is None:
            cache = [None] * len(self.layers)
        masks = masks_by_layer_type(h, self.layers, cache, self.sliding_window)
        for layer, layer_cache in zip(self.layers, cache):
            h = layer(h, masks[layer.layer_type], layer_cache)
        return self.norm(pipeline.send_and_share(h, self.stage, cache))


def masks_by_layer_type(
    h: mx.array, layers: List[nn.Module], cache: List[Any], sliding_window: Optional[int]
) -> Dict[str, Optional[mx.array]]:
    """One mask per attention kind (each layer's `layer_type`), from the first cache of
    that kind: all caches of a kind hold the same positions. Sliding masks are windowed
    even without a cache."""
    masks = {}
    for layer, layer_cache in zip(layers, cache):
        if layer.layer_type not in masks:
            window = sliding_window if layer.layer_type == SLIDING else None
            masks[layer.layer_type] = create_attention_mask(h, layer_cache, window_size=window)
    return masks


def make_layer_caches(layers: List[nn.Module], sliding_window: Optional[int]) -> List[Any]:
    """A window-sized ring buffer for each sliding layer, a growing cache for full ones."""
    return [RotatingKVCache(sliding_window) if layer.layer_type == SLIDING else KVCache() for layer in layers]


class Model(nn.Module):
    backbone_class = LlamaModel

    def __init__(self, args: ModelArgs):
        super().__init__()
        self.args = args
        self.model_type = args.model_type
        self.model = self.backbone_class(args)
        if not args.tie_word_embeddings:
            self.lm_head = nn.Linear(args.hidden_size, args.vocab_size, bias=False)

    def __call__(
        self, inputs: mx.array, cache: Optional[List[Any]] = None, input_embeddings: Optional[mx.array] = None
    ) -> mx.array:
        """Token ids (B, L) -> logits (B, L, vocab); `input_embeddings` (B, L, hidden)
        replace the token embeddings (the ids are then not read)."""
        h = self.model(inputs, cache, input_embeddings)
        if self.args.tie_word_embeddings:
            return self.model.embed_tokens.as_linear(h)
        return self.lm_head(h)

    def sanitize(self, weights: Dict[str, mx.array]) -> Dict[str, mx.array]:
        # Old checkpoints store rope's inverse frequencies; we compute them.
        weights = {k: v for k, v in weights.items() if "rotary_emb.inv_freq" not in k}
        if self.args.tie_word_embeddings:
            weights.pop("lm_head.weight", None)
        return weights

    @property
    def layers(self):
        return self.model.layers

    def make_cache(self) -> List[Any]:
        return make_layer_caches(self.layers, self.args.sliding_window)

    def shard(self, group: Optional[mx.distributed.Group] = None) -> None:
        """Tensor parallel over `group` (default: the global group), in place: each rank
        keeps its share of every layer's heads and MLP units (`models/sharding.py`);
        embeddings and lm_head stay whole."""
        group = sharding.world(group)
        for layer in self.layers:
            attn = layer.self_attn
            attn.n_heads, attn.n_kv_heads = sharding.shard_attention(attn, attn.n_heads, attn.n_kv_heads, group)
            sharding.shard_mlp(layer.mlp, group)
