"""Batched sliding windows (RotatingKVCache rows) and chunked attention (ChunkedKVCache
rows), in the right-aligned layout of `batch_kv_cache.py`."""

from typing import NoReturn, Optional, Sequence

import mlx.core as mx

from .batch_kv_cache import _AlignedKV
from .cache import ChunkedKVCache, RotatingKVCache
from .masks import chunked_mask_for_positions


class BatchRotatingKVCache(_AlignedKV):
    """RotatingKVCache rows (sliding windows, no sink tokens) side by side: the newest
    columns right-aligned, each query masked to its window of `max_size` tokens."""

    row_class = RotatingKVCache  # what extract gives back

    def __init__(self, max_size: int, left_padding: Sequence[int]):
        if max_size < 1:
            raise ValueError(f"a sliding window holds at least one token, got max_size={max_size}")
        super().__init__(left_padding)
        self.max_size = max_size

    def _settings(self) -> dict:
        return {"max_size": self.max_size}

    def _window(self, window_size: Optional[int]) -> int:
        if window_size is not None and not 0 < window_size <= self.max_size:
            raise ValueError(f"a batched window of {self.max_size} tokens cannot mask for window_size={window_size}")
        return self.max_size if window_size is None else window_size

    def _columns_to_drop(self, num_new: int) -> int:
        # Row b keeps its max_size newest tokens, as a RotatingKVCache does: its next
        # query (position lengths[b]) sees back to lengths[b] - max_size + 1, and a
        # forward rolled back whole (a cancelled round) must leave the row a full window.
        # While a right-padded prefill runs, a row's padding does not move its window.
        ends = self.offset if self._right_padding is None else self.offset - mx.array(self._right_padding[0])
        seen = self.positions[:, : self.width] >= (ends - self.max_size)[:, None]  # (B, width)
        first = mx.where(seen.any(axis=1), mx.argmax(seen, axis=1), self.width)
        return min(first.tolist())

    @classmethod
    def merge(cls, caches: Sequence[RotatingKVCache]) -> "BatchRotatingKVCache":
        sizes = {c.max_size for c in caches}
        if len(sizes) > 1:
            raise ValueError(f"rotating caches of different sizes {sorted(sizes)} cannot share a batch")
        sinks = [c.keep for c in caches if c.keep]
        if sinks:
            raise ValueError(
                f"batching does not support sink tokens (RotatingKVCache keep={sinks[0]}); drop max_kv_size"
            )
        max_size = sizes.pop()
        batch = cls(max_size, [])
        for c in caches:
            held = c.size()
            rows = list(c.held_in_order()) if held else None
            batch.extend(cls._from_rows(rows, c.offset - held, c.offset, max_size=max_size))
        return batch

    def to_quantized(self, group_size: int = 64, bits: int = 4) -> NoReturn:
        raise ValueError(
            "A BatchRotatingKVCache (sliding-window rows) cannot be quantized, as its RotatingKVCache rows "
            "cannot; drop --kv-bits or --max-kv-size"
        )

    def extend(self, other: "BatchRotatingKVCache") -> "BatchRotatingKVCache":
        """Other's rows after these, in place (as upstream's); returns self."""
        if type(other) is type(self) and other.max_size != self.max_size:
            raise ValueError(f"rotating caches of sizes {self.max_size} and {other.max_size} cannot share a batch")
        return self._extend(other)

    def extract(self, index: int) -> RotatingKVCache:
        """The row as a RotatingKVCache holding its newest tokens in temporal order
        (the write index past them: the next write overwrites the oldest)."""
        columns = [] if self.buffers is None else self._row_columns(index)[-self.max_size :]
        if not columns:
            return self.row_class(self.max_size)
        assert len(columns) == min(self.lengths[index], self.max_size), "a window row lost a token it needs"
        state = tuple(self._row(index, columns))
        meta = tuple(map(str, (0, self.max_size, self.lengths[index], len(columns))))
        return self.row_class.from_state(state, meta)


class BatchChunkedKVCache(BatchRotatingKVCache):
    """ChunkedKVCache rows side by side: the layout of BatchRotatingKVCache (each row
    keeps its chunk_size newest tokens), masked by chunk instead of by window. Chunks
    count from each row's own first token, as transformers aligns them past left
    padding."""

    row_class = ChunkedKVCache

    def make_mask(self, num_queries: int, window_size: Optional[int] = None, return_array: bool = False):
        """(B, 1, N, S) boolean: the query at position p of row b sees the columns holding
        that row's positions of p's chunk up to p."""
        self.make_room(num_queries)
        if window_size is not None:
            raise ValueError(f"a batched chunked cache masks by its chunks of {self.max_size}; "
                             f"got window_size={window_size}")
        query_pos, key_pos = self._mask_positions(num_queries)
        return chunked_mask_for_positions(query_pos[..., None], key_pos, self.max_size)[:, None]
