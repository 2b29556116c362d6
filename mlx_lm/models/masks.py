"""Causal attention masks: pure functions from positions to boolean masks.

The bottom of the models package: the caches (`cache.py`) and the shared model code
(`base.py`) both build on it, so it imports nothing of ours.
"""

from typing import Optional

import mlx.core as mx


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
