"""Shared pieces of every model family: config parsing, attention masks, attention."""

import inspect
from dataclasses import dataclass
from typing import Any, Dict, Optional

import mlx.core as mx


@dataclass
class BaseModelArgs:
    @classmethod
    def from_dict(cls, params: Dict[str, Any]):
        """Build the args from a config dict, ignoring keys that are not fields."""
        fields = inspect.signature(cls).parameters
        return cls(**{k: v for k, v in params.items() if k in fields})


def create_causal_mask(
    num_queries: int,
    offset: int = 0,
    window_size: Optional[int] = None,
) -> mx.array:
    """Boolean mask (num_queries, offset + num_queries), True where attention is allowed.

    Query i sits at position offset + i and sees key j iff j <= offset + i and, with a
    window, offset + i - j < window_size.
    """
    query_pos = mx.arange(offset, offset + num_queries)[:, None]
    key_pos = mx.arange(offset + num_queries)[None]
    return causal_mask_for_positions(query_pos, key_pos, window_size)


def causal_mask_for_positions(
    query_pos: mx.array,
    key_pos: mx.array,
    window_size: Optional[int] = None,
    keep: int = 0,
) -> mx.array:
    """Mask from explicit positions: query_pos (N, 1), key_pos (1, S) -> (N, S) bool.

    The first `keep` positions stay visible whatever the window (attention sinks).
    """
    mask = key_pos <= query_pos
    if window_size is not None:
        in_window = (query_pos - key_pos) < window_size
        if keep > 0:
            in_window = in_window | (key_pos < keep)
        mask = mask & in_window
    return mask


def create_attention_mask(
    h: mx.array, cache=None, window_size: Optional[int] = None
) -> Optional[mx.array]:
    """Mask for a (B, N, D) input given the cache it will be appended to.

    None when a single query may see every cached key (the common decode step).
    """
    num_queries = h.shape[1]
    if cache is not None:
        return cache.make_mask(num_queries, window_size=window_size)
    if num_queries == 1:
        return None
    return create_causal_mask(num_queries, window_size=window_size)


def scaled_dot_product_attention(
    queries: mx.array,
    keys: mx.array,
    values: mx.array,
    cache,
    scale: float,
    mask: Optional[mx.array],
    sinks: Optional[mx.array] = None,
) -> mx.array:
    """Attention over (B, H, N, D) queries and (B, H_kv, S, D) keys/values -> (B, H, N, D).

    `sinks` (H,) are learned per-head logits that join the softmax without a value
    (gpt-oss). `cache` is accepted for upstream compatibility; quantized caches route
    elsewhere.
    """
    return mx.fast.scaled_dot_product_attention(
        queries, keys, values, scale=scale, mask=mask, sinks=sinks
    )
