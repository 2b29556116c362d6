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


def chunked_mask_for_positions(query_pos: mx.array, key_pos: mx.array, chunk_size: int) -> mx.array:
    """Chunked causal attention (Llama 4's local layers): positions are cut into chunks
    of `chunk_size` from position 0, and a query sees the keys of its own chunk up to
    itself. query_pos (..., N, 1), key_pos (..., 1, S) -> (..., N, S) bool; a negative
    key position (no token) is in no query's chunk."""
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be at least 1, got {chunk_size}")
    return (key_pos <= query_pos) & (key_pos // chunk_size == query_pos // chunk_size)


def create_chunked_mask(num_queries: int, offset: int, chunk_size: int) -> mx.array:
    """Chunked causal mask (num_queries, offset + num_queries) of queries at positions
    offset.. over every key from position 0 (see chunked_mask_for_positions)."""
    query_pos = mx.arange(offset, offset + num_queries)[:, None]
    return chunked_mask_for_positions(query_pos, mx.arange(offset + num_queries)[None], chunk_size)
