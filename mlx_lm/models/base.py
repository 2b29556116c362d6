"""Shared pieces of every model family: config parsing, attention masks, attention."""

import inspect
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Sequence, Tuple, Union

import mlx.core as mx

from . import masks
from .cache import QuantizedKVCache
from .masks import causal_mask_for_positions  # noqa: F401  (re-exported for the models)

# What attention takes as a mask: None (attend to everything), "causal" (the plain
# causal mask, aligned to the last key, which MLX's fused attention builds itself), or
# a boolean (True = attend) or additive array broadcastable to (B, H, N, S).
Mask = Union[None, str, mx.array]


@dataclass
class BaseModelArgs:
    @classmethod
    def from_dict(cls, params: Dict[str, Any]):
        """Build the args from a config dict, ignoring keys that are not fields."""
        fields = inspect.signature(cls).parameters
        return cls(**{k: v for k, v in params.items() if k in fields})


def check_layer_types(layer_types: Sequence[str], num_hidden_layers: int, allowed: Sequence[str]) -> None:
    """One known kind per layer, else a ValueError naming what is wrong."""
    if len(layer_types) != num_hidden_layers:
        raise ValueError(
            f"layer_types has {len(layer_types)} entries but num_hidden_layers is "
            f"{num_hidden_layers}; give one kind per layer"
        )
    unknown = sorted(set(layer_types) - set(allowed))
    if unknown:
        raise ValueError(f"layer_types has unknown kinds {unknown}; expected one of {list(allowed)}")


def check_sliding_window(layer_types: Sequence[str], sliding_window: Optional[int]) -> None:
    """Sliding layers need a positive window, else a ValueError naming the value."""
    if "sliding_attention" in layer_types and not (isinstance(sliding_window, int) and sliding_window > 0):
        raise ValueError(
            f"layer_types has sliding_attention layers but sliding_window is {sliding_window!r}; "
            "give a positive window size"
        )


def check_head_grouping(num_attention_heads: int, num_key_value_heads: int) -> None:
    """Grouped-query attention needs whole groups of query heads per KV head."""
    if num_attention_heads % num_key_value_heads:
        raise ValueError(
            f"num_attention_heads ({num_attention_heads}) must be a multiple of "
            f"num_key_value_heads ({num_key_value_heads})"
        )


def resolve_aliases(args: Any, table: Sequence[Tuple[str, str, Any]]) -> None:
    """Config values that come under either of two keys (transformers' attribute_map:
    the hub's `n_embd` or `hidden_size`), in place: for each (field, alias, default) of
    `table` both attributes become the one given, else `default`; a ValueError when
    both are given and differ."""
    for field, alias, default in table:
        value, alias_value = getattr(args, field), getattr(args, alias)
        if value is not None and alias_value is not None and value != alias_value:
            raise ValueError(f"{field}={value!r} and {alias}={alias_value!r} disagree; give one of them")
        chosen = value if value is not None else alias_value if alias_value is not None else default
        setattr(args, field, chosen)
        setattr(args, alias, chosen)


def create_causal_mask(
    N: int,
    offset: int = 0,
    window_size: Optional[int] = None,
    right_padding: Optional[mx.array] = None,
    left_padding: Optional[mx.array] = None,
) -> mx.array:
    """Boolean causal mask of N queries at positions offset.. over offset + N keys.

    (N, offset + N); with per-row padding counts (B,) it is (B, 1, N, offset + N):
    `left_padding[b]` keys at the start of row b and `right_padding[b]` keys at the end
    of its N new tokens are padding, hidden from every query.
    """
    mask = masks.create_causal_mask(N, offset, window_size)
    if left_padding is None and right_padding is None:
        return mask
    key_pos = mx.arange(offset + N)[None]  # (1, S)
    valid = mx.ones(key_pos.shape, dtype=mx.bool_)
    if left_padding is not None:
        valid = valid & (key_pos >= left_padding[:, None])
    if right_padding is not None:
        valid = valid & (key_pos < (offset + N - right_padding)[:, None])
    return mask[None, None] & valid[:, None, None, :]  # (B, 1, N, S)


def create_attention_mask(h: mx.array, cache=None, window_size: Optional[int] = None, return_array: bool = False) -> Mask:
    """Mask for a (B, N, D) input given the cache it will be appended to.

    None when every query may see every key (a single query, the common decode step);
    "causal" when the plain causal mask is exact, unless `return_array` asks for the
    boolean array; else the boolean array (a window cuts in, a ring buffer's layout).
    """
    num_queries = h.shape[1]
    if cache is not None:
        return cache.make_mask(num_queries, window_size=window_size, return_array=return_array)
    if num_queries == 1:
        return None
    if return_array or (window_size is not None and num_queries > window_size):
        return create_causal_mask(num_queries, window_size=window_size)
    return "causal"


def run_hybrid_layers(h: mx.array, layers: Sequence[Any], cache: Optional[List[Any]],
                      mask_layer: Optional[int]) -> mx.array:
    """(B, L, D) through `layers`, layer i with cache[i] (None: no caches). The
    attention layers share one mask, made from the cache of layer `mask_layer` (the
    first attention layer; None: there is none); recurrent layers ignore it."""
    if cache is None:
        cache = [None] * len(layers)
    mask = None if mask_layer is None else create_attention_mask(h, cache[mask_layer])
    for layer, layer_cache in zip(layers, cache):
        h = layer(h, mask, layer_cache)
    return h


def create_ssm_mask(h: mx.array, cache=None) -> Optional[mx.array]:
    """Validity mask (B, N) of a recurrent layer's N inputs, from its cache; None when
    every input is a real token (always, unbatched: no padding to skip)."""
    if cache is None:
        return None
    return cache.make_mask(h.shape[1])


def gather_last_axis(x: mx.array, group: mx.distributed.Group) -> mx.array:
    """Upstream's: x (..., d), this rank's slice of an array split along its last axis
    over the ranks of `group` (the same shape on each) -> the whole (..., n * d), rank
    r's slice at columns r * d .. (r + 1) * d (a tensor-parallel layer's outputs)."""
    if x.ndim == 0:
        raise ValueError("gather_last_axis needs an array with a last axis, got a scalar")
    slices = mx.distributed.all_gather(x[None], group=group)  # (n, ..., d): rank-major
    return mx.moveaxis(slices, 0, -2).reshape(*x.shape[:-1], -1)


def scaled_dot_product_attention(
    queries: mx.array,
    keys: mx.array,
    values: mx.array,
    cache,
    scale: float,
    mask: Mask,
    sinks: Optional[mx.array] = None,
) -> mx.array:
    """Attention over (B, H, N, D) queries and (B, H_kv, S, D) keys/values -> (B, H, N, D).

    `sinks` (H,) are learned per-head logits that join the softmax without a value
    (gpt-oss). With a QuantizedKVCache, keys and values are its (packed, scales,
    biases) triples and attention runs on them with quantized matmuls.
    """
    if isinstance(cache, QuantizedKVCache):
        return quantized_scaled_dot_product_attention(
            queries, keys, values, scale=scale, mask=mask, group_size=cache.group_size, bits=cache.bits, sinks=sinks
        )
    return mx.fast.scaled_dot_product_attention(
        queries, keys, values, scale=scale, mask=mask, sinks=sinks
    )


def quantized_scaled_dot_product_attention(
    queries: mx.array,
    q_keys: Tuple[mx.array, mx.array, mx.array],
    q_values: Tuple[mx.array, mx.array, mx.array],
    scale: float,
    mask: Mask,
    group_size: int = 64,
    bits: int = 8,
    sinks: Optional[mx.array] = None,
) -> mx.array:
    """Attention of (B, H, N, D) queries over affine-quantized keys/values -> (B, H, N, D).

    q_keys, q_values: (packed (B, H_kv, S, D*bits/32), scales, biases (B, H_kv, S,
    D/group_size)). Query heads are grouped per KV head so the quantized tensors are
    never repeated or dequantized; mask is None, "causal", boolean (True = attend) or
    additive.
    """
    B, H, N, D = queries.shape
    H_kv = q_keys[0].shape[1]
    repeats = H // H_kv
    queries = (queries * scale).reshape(B, H_kv, repeats, N, D)
    q_keys = tuple(mx.expand_dims(t, 2) for t in q_keys)  # (B, H_kv, 1, S, .)
    q_values = tuple(mx.expand_dims(t, 2) for t in q_values)
    scores = mx.quantized_matmul(queries, *q_keys, transpose=True, group_size=group_size, bits=bits)
    if isinstance(mask, str):
        if mask != "causal":
            raise ValueError(f'mask must be None, "causal" or an array, got {mask!r}')
        mask = masks.create_causal_mask(N, scores.shape[-1] - N)  # aligned to the last key
    if mask is not None:  # (N, S) or (B, 1 or H, N, S)
        if mask.ndim == 4:
            mask = mask.reshape(mask.shape[0], -1, mask.shape[1] // H_kv or 1, *mask.shape[2:])
        if mask.dtype == mx.bool_:
            scores = mx.where(mask, scores, mx.finfo(scores.dtype).min)
        else:
            scores = scores + mask
    if sinks is not None:  # one extra logit per head, with no value
        sink_logits = sinks.astype(scores.dtype).reshape(1, H_kv, repeats, 1, 1)
        sink_logits = mx.broadcast_to(sink_logits, (B, H_kv, repeats, N, 1))
        scores = mx.concatenate([sink_logits, scores], axis=-1)
    weights = mx.softmax(scores, axis=-1, precise=True)
    if sinks is not None:
        weights = weights[..., 1:]
    out = mx.quantized_matmul(weights, *q_values, transpose=False, group_size=group_size, bits=bits)
    return out.reshape(B, H, N, D)  # (B, H_kv, repeats, N, D) -> (B, H, N, D)
