"""Liquid LFM2: a hybrid of gated short convolutions and grouped-query attention.

What differs from llama:
- Most layers (`layer_types` "conv", or every layer not in `full_attn_idxs`) mix tokens
  with a gated short convolution (`conv`): in_proj splits into gates B, C and values x;
  B * x goes through a depthwise causal conv of `conv_L_cache` taps, and C gates its
  output before `out_proj`. Its cache is an `ArraysCache(1)` holding the last
  `conv_L_cache - 1` conv inputs: that is all the state the conv needs, and rolling back
  a speculative forward to its first m tokens is a slice of those inputs.
- Attention layers RMS-normalise each query and key head (`q_layernorm`, `k_layernorm`)
  before rope and call their output projection `out_proj`.
- Layer norms are `operator_norm` / `ffn_norm`; the final norm is `embedding_norm`.
- The SwiGLU MLP (`w1` gate, `w3` up, `w2` down) may shrink its width: with
  `block_auto_adjust_ff_dim` it is 2/3 of the configured width, scaled by
  `block_ffn_dim_multiplier` and rounded up to a multiple of `block_multiple_of`.
- Embeddings are tied by default.
Config dialects: transformers 4 writes `rope_theta`, `full_attn_idxs`, and Liquid's
checkpoints `block_ff_dim` and `tie_embedding`; transformers 5 writes `rope_parameters`,
`layer_types`, `intermediate_size` and `tie_word_embeddings`.
Reference: transformers `models/lfm2/modeling_lfm2.py`, `configuration_lfm2.py`.
"""

from dataclasses import dataclass
from functools import partial
from typing import Any, Dict, List, Optional, Tuple, Union

import mlx.core as mx
import mlx.nn as nn

from . import sharding
from .base import (
    BaseModelArgs,
    run_hybrid_layers,
    check_head_grouping,
    check_layer_types,
    scaled_dot_product_attention,
)
from .cache import ArraysCache, KVCache
from .qwen3_next import causal_conv1d
from .rope_utils import initialize_rope, resolve_rope
from .ssm import conv_state_after

CONV, FULL_ATTENTION = "conv", "full_attention"
CONV_STATE = 0  # the one slot of a conv layer's ArraysCache
DEFAULT_ROPE_THETA = 1e6  # transformers' default for this family


@dataclass
class ModelArgs(BaseModelArgs):
    model_type: str
    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    intermediate_size: Optional[int] = None  # transformers 5
    block_ff_dim: Optional[int] = None  # Liquid's name for it (transformers 4 checkpoints)
    block_multiple_of: int = 256
    block_ffn_dim_multiplier: Optional[float] = 1.0
    block_auto_adjust_ff_dim: bool = True
    head_dim: Optional[int] = None
    norm_eps: float = 1e-5
    conv_bias: bool = False
    conv_L_cache: int = 3
    max_position_embeddings: Optional[int] = 128000
    rope_theta: Optional[float] = None
    rope_scaling: Optional[Dict[str, Any]] = None
    rope_parameters: Optional[Dict[str, Any]] = None
    layer_types: Optional[List[str]] = None
    full_attn_idxs: Optional[List[int]] = None
    tie_word_embeddings: Optional[bool] = None
    tie_embedding: Optional[bool] = None  # Liquid's name for it

    def __post_init__(self):
        normalise_shared_keys(self)
        self.intermediate_size, self.block_ff_dim = same_value(
            "intermediate_size", self.intermediate_size, "block_ff_dim", self.block_ff_dim
        )
        if self.intermediate_size is None:
            raise ValueError("config has neither intermediate_size nor block_ff_dim; set one (the MLP width)")
        if self.layer_types is None and self.full_attn_idxs is None:  # transformers: every layer attends
            self.full_attn_idxs = list(range(self.num_hidden_layers))
        self.layer_types, self.full_attn_idxs = layer_pattern(
            self.layer_types, self.full_attn_idxs, self.num_hidden_layers
        )
        self._validate()

    def _validate(self):
        check_head_grouping(self.num_attention_heads, self.num_key_value_heads)
        # K = 1 would leave no conv state, and make the HF (C, 1, K) and MLX (C, K, 1)
        # conv layouts indistinguishable, which sanitize relies on.
        if self.conv_L_cache < 2:
            raise ValueError(f"conv_L_cache must be >= 2, got {self.conv_L_cache}")
        if self.block_auto_adjust_ff_dim and self.block_multiple_of < 1:
            raise ValueError(f"block_multiple_of must be >= 1, got {self.block_multiple_of}")

    @property
    def feed_forward_dim(self) -> int:
        return feed_forward_dim(
            self.intermediate_size, self.block_auto_adjust_ff_dim, self.block_ffn_dim_multiplier, self.block_multiple_of
        )


def layer_pattern(layer_types: Optional[List[str]], full_attn_idxs: Optional[List[int]],
                  num_hidden_layers: int) -> Tuple[List[str], List[int]]:
    """Both spellings of the layer pattern, (layer_types, full_attn_idxs), from either:
    layer_types wins (transformers reads only it), else full_attn_idxs; given both, they
    must agree. One of them must be given."""
    if layer_types is None:
        layer_types = [FULL_ATTENTION if i in full_attn_idxs else CONV for i in range(num_hidden_layers)]
    check_layer_types(layer_types, num_hidden_layers, (CONV, FULL_ATTENTION))
    from_types = [i for i, kind in enumerate(layer_types) if kind == FULL_ATTENTION]
    if full_attn_idxs is not None and sorted(full_attn_idxs) != from_types:
        raise ValueError(
            f"full_attn_idxs {full_attn_idxs} disagrees with layer_types {layer_types}; remove one of them"
        )
    return layer_types, from_types


def normalise_shared_keys(args: BaseModelArgs) -> None:
    """In place, the keys LFM2 and LFM2-MoE share: head_dim (default hidden / heads),
    rope in either dialect (default theta 1e6), and the tying flag under either name
    (default tied)."""
    if args.head_dim is None:
        args.head_dim = args.hidden_size // args.num_attention_heads
    theta, args.rope_scaling, _ = resolve_rope(args.rope_theta, args.rope_scaling, args.rope_parameters)
    args.rope_theta = DEFAULT_ROPE_THETA if theta is None else theta
    args.tie_word_embeddings, args.tie_embedding = same_value(
        "tie_word_embeddings", args.tie_word_embeddings, "tie_embedding", args.tie_embedding
    )
    if args.tie_word_embeddings is None:
        args.tie_word_embeddings = args.tie_embedding = True


def same_value(name: str, value: Any, alias: str, alias_value: Any) -> Tuple[Any, Any]:
    """Two config keys for one setting: either may be given; both must then agree."""
    if value is not None and alias_value is not None and value != alias_value:
        raise ValueError(f"{name} is {value!r} but {alias} is {alias_value!r}; they name one setting, keep one")
    value = alias_value if value is None else value
    return value, value


def feed_forward_dim(width: int, auto_adjust: bool, multiplier: Optional[float], multiple_of: int) -> int:
    """The MLP's hidden width as transformers builds it: with auto_adjust, int(2/3 width),
    then (only with a multiplier) int(multiplier * that) rounded up to multiple_of."""
    if not auto_adjust:
        return width
    width = int(2 * width / 3)
    if multiplier is not None:
        width = int(multiplier * width)
        width = multiple_of * ((width + multiple_of - 1) // multiple_of)
    return width


def conv_prefix_state(conv_input: mx.array, num_tokens: int, m: Union[int, List[int]]) -> List[mx.array]:
    """A conv layer's cache entries after only the first m of the num_tokens tokens of a
    forward whose conv input (B, K-1+num_tokens, C) was [pre-forward state ; new rows]:
    the state is the K-1 input rows before token m, rows [m, m+K-1) (m a list: each
    row's own)."""
    return [conv_state_after(conv_input, m, conv_input.shape[1] - num_tokens + 1)]


class ShortConv(nn.Module):
    """Gated short convolution: out_proj(C * conv(B * x)), B, C, x = split(in_proj(h))."""

    def __init__(self, args: ModelArgs):
        super().__init__()
        dim, self.kernel_size, self.has_bias = args.hidden_size, args.conv_L_cache, args.conv_bias
        self.conv = nn.Conv1d(dim, dim, self.kernel_size, groups=dim, bias=args.conv_bias)  # weight (C, K, 1)
        self.in_proj = nn.Linear(dim, 3 * dim, bias=args.conv_bias)
        self.out_proj = nn.Linear(dim, dim, bias=args.conv_bias)

    def conv_input(self, bx: mx.array, cache: Optional[ArraysCache]) -> mx.array:
        """[conv state ; new rows]: (B, K-1+T, C); zeros stand for the state before the
        first token, as transformers' left padding of the conv."""
        state = None if cache is None else cache[CONV_STATE]
        if state is None:
            state = mx.zeros((bx.shape[0], self.kernel_size - 1, bx.shape[2]), bx.dtype)
        return mx.concatenate([state, bx], axis=1)

    def __call__(self, x: mx.array, cache: Optional[ArraysCache] = None) -> mx.array:
        T = x.shape[1]
        b, c, v = mx.split(self.in_proj(x), 3, axis=-1)  # (B, T, C) each
        conv_input = self.conv_input(b * v, cache)  # (B, K-1+T, C)
        mixed = causal_conv1d(conv_input, self.conv.weight)  # (B, T, C)
        if self.has_bias:
            mixed = mixed + self.conv.bias
        if cache is not None:
            if cache.speculating:
                cache.record_rollback(T, partial(conv_prefix_state, conv_input, T), [cache[CONV_STATE]])
            cache[CONV_STATE] = conv_input[:, T:]
        return self.out_proj(c * mixed)

    def shard(self, group: mx.distributed.Group) -> None:
        """Keep this rank's channels: in_proj's b, c and x blocks split alike, the
        depthwise conv per channel (so a rank's conv state holds its channels), out_proj
        all-sums."""
        sharding.shard_projections(self, ("in_proj",), sharding.ALL_TO_SHARDED, group, segments=3)
        self.conv.weight = sharding.take_shard(self.conv.weight, group)  # (C/N, K, 1)
        if self.has_bias:
            self.conv.bias = sharding.take_shard(self.conv.bias, group)
        sharding.shard_projections(self, ("out_proj",), sharding.SHARDED_TO_ALL, group)


class Attention(nn.Module):
    """Grouped-query attention with per-head q/k RMSNorm before rope."""

    def __init__(self, args: ModelArgs):
        super().__init__()
        dim, head_dim = args.hidden_size, args.head_dim
        self.num_heads, self.num_kv_heads = args.num_attention_heads, args.num_key_value_heads
        self.scale = head_dim**-0.5
        self.q_proj = nn.Linear(dim, self.num_heads * head_dim, bias=False)
        self.k_proj = nn.Linear(dim, self.num_kv_heads * head_dim, bias=False)
        self.v_proj = nn.Linear(dim, self.num_kv_heads * head_dim, bias=False)
        self.out_proj = nn.Linear(self.num_heads * head_dim, dim, bias=False)
        self.q_layernorm = nn.RMSNorm(head_dim, eps=args.norm_eps)
        self.k_layernorm = nn.RMSNorm(head_dim, eps=args.norm_eps)
        self.rope = initialize_rope(head_dim, args.rope_theta, False, args.rope_scaling, args.max_position_embeddings)

    def __call__(self, x: mx.array, mask: Optional[mx.array] = None, cache: Optional[KVCache] = None) -> mx.array:
        B, L, _ = x.shape
        q = self.q_layernorm(self.q_proj(x).reshape(B, L, self.num_heads, -1))  # (B, L, H, D)
        k = self.k_layernorm(self.k_proj(x).reshape(B, L, self.num_kv_heads, -1))
        v = self.v_proj(x).reshape(B, L, self.num_kv_heads, -1)
        q, k, v = (t.transpose(0, 2, 1, 3) for t in (q, k, v))  # (B, H, L, D)
        offset = cache.offset if cache is not None else 0
        q, k = self.rope(q, offset=offset), self.rope(k, offset=offset)
        if cache is not None:
            k, v = cache.update_and_fetch(k, v)
        out = scaled_dot_product_attention(q, k, v, cache=cache, scale=self.scale, mask=mask)
        return self.out_proj(out.transpose(0, 2, 1, 3).reshape(B, L, -1))

    def shard(self, group: mx.distributed.Group) -> None:
        """Keep this rank's heads; out_proj all-sums."""
        self.num_heads, self.num_kv_heads = sharding.shard_attention(
            self, self.num_heads, self.num_kv_heads, group, out="out_proj"
        )


class FeedForward(nn.Module):
    def __init__(self, dim: int, hidden_dim: int):
        super().__init__()
        self.w1 = nn.Linear(dim, hidden_dim, bias=False)
        self.w3 = nn.Linear(dim, hidden_dim, bias=False)
        self.w2 = nn.Linear(hidden_dim, dim, bias=False)

    def __call__(self, x: mx.array) -> mx.array:
        return self.w2(nn.silu(self.w1(x)) * self.w3(x))


class DecoderLayer(nn.Module):
    """Token mixer (conv or attention) and feed-forward, each pre-normed; lfm2_moe passes
    its own `feed_forward` (a dense or a mixture-of-experts block)."""

    def __init__(self, args: ModelArgs, layer_idx: int, feed_forward: Optional[nn.Module] = None):
        super().__init__()
        self.is_attention = args.layer_types[layer_idx] == FULL_ATTENTION
        if self.is_attention:
            self.self_attn = Attention(args)
        else:
            self.conv = ShortConv(args)
        if feed_forward is None:
            feed_forward = FeedForward(args.hidden_size, args.feed_forward_dim)
        self.feed_forward = feed_forward
        self.operator_norm = nn.RMSNorm(args.hidden_size, eps=args.norm_eps)
        self.ffn_norm = nn.RMSNorm(args.hidden_size, eps=args.norm_eps)

    def __call__(self, x: mx.array, mask: Optional[mx.array] = None, cache=None) -> mx.array:
        h = self.operator_norm(x)
        h = x + (self.self_attn(h, mask, cache) if self.is_attention else self.conv(h, cache))
        return h + self.feed_forward(self.ffn_norm(h))


class Lfm2Model(nn.Module):
    def __init__(self, args: ModelArgs, layer_class: type = DecoderLayer):
        super().__init__()
        self.embed_tokens = nn.Embedding(args.vocab_size, args.hidden_size)
        self.layers = [layer_class(args, i) for i in range(args.num_hidden_layers)]
        self.embedding_norm = nn.RMSNorm(args.hidden_size, eps=args.norm_eps)  # the final norm
        # Attention layers share one mask, made from the first one's cache; conv layers need none.
        kinds = args.layer_types
        self.first_attention_layer = kinds.index(FULL_ATTENTION) if FULL_ATTENTION in kinds else None

    def __call__(self, inputs: mx.array, cache: Optional[List[Any]] = None) -> mx.array:
        h = self.embed_tokens(inputs)  # (B, L, hidden)
        return self.embedding_norm(run_hybrid_layers(h, self.layers, cache, self.first_attention_layer))


def sanitize_weights(weights: Dict[str, mx.array], tie_word_embeddings: bool) -> Dict[str, mx.array]:
    """Raw transformers or converted weights -> ours. Each rewrite is guarded by what it
    changes, so a second pass changes nothing: the conv weight is transposed only while it
    has the HF (C, 1, K) shape (MLX's is (C, K, 1), K >= 2); a tied lm_head is dropped."""
    weights = dict(weights)
    if tie_word_embeddings:
        weights.pop("lm_head.weight", None)
    for key, value in weights.items():
        if key.endswith("conv.conv.weight") and value.shape[1] == 1 and value.shape[2] > 1:
            weights[key] = value.swapaxes(1, 2)  # (C, 1, K) -> (C, K, 1)
    return weights


class Model(nn.Module):
    # Conv layers record rollbacks into their ArraysCache while speculating.
    supports_speculative_rollback = True
    # The decoder layer; lfm2_moe swaps in its own (mixture-of-experts feed-forward).
    decoder_layer_class = DecoderLayer

    def __init__(self, args: ModelArgs):
        super().__init__()
        self.args = args
        self.model_type = args.model_type
        self.model = Lfm2Model(args, self.decoder_layer_class)
        if not args.tie_word_embeddings:
            self.lm_head = nn.Linear(args.hidden_size, args.vocab_size, bias=False)

    def __call__(self, inputs: mx.array, cache: Optional[List[Any]] = None) -> mx.array:
        """Token ids (B, L) -> logits (B, L, vocab)."""
        h = self.model(inputs, cache)
        if self.args.tie_word_embeddings:
            return self.model.embed_tokens.as_linear(h)
        return self.lm_head(h)

    def sanitize(self, weights: Dict[str, mx.array]) -> Dict[str, mx.array]:
        return sanitize_weights(weights, self.args.tie_word_embeddings)

    @property
    def layers(self) -> List[DecoderLayer]:
        return self.model.layers

    def make_cache(self) -> List[Union[ArraysCache, KVCache]]:
        return [KVCache() if layer.is_attention else ArraysCache(1) for layer in self.layers]

    def shard(self, group: Optional[mx.distributed.Group] = None) -> None:
        """Tensor parallel over `group` (default: the global group), in place: attention
        by heads, each short conv by channels (in_proj's b, c and x blocks split alike,
        the depthwise conv per channel, so a rank's conv state holds its channels) and
        the feed-forward by hidden units; out_proj / w2 all-sum."""
        group = sharding.world(group)
        for layer in self.layers:
            (layer.self_attn if layer.is_attention else layer.conv).shard(group)
            sharding.shard_mlp(layer.feed_forward, group, inputs=("w1", "w3"), output="w2")
