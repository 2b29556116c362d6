"""Batched caches: the caches of several sequences side by side, one (B, ...) array per
layer, for continuous batching (`mlx_lm/batching.py`).

Each sequence (row) is prefilled alone in ordinary caches (`cache.py`); `merge_caches`
stacks rows into batched caches, `extend_caches` joins two batches, `filter_caches`
keeps some rows and `extract_caches` gives one row back as ordinary caches. The models
see the same contract as unbatched: `offset` (here a (B,) array of each row's position,
which `mx.fast.rope` takes per row), `update_and_fetch`, `make_mask`, `cache[i]`.

KV layout: right-aligned. Row b holds its tokens in columns [pads[b], width) of a
(B, H_kv, capacity, D) buffer, so every row writes its next token at column `width` and
one slice update serves the batch; the columns before pads[b] are padding, hidden by the
mask. A sliding window keeps only the newest columns (at least `max_size`, dropped in
blocks so that copies are rare); the mask cuts each query's window.

Recurrent state (`BatchArraysCache`) is simply each row's arrays stacked: a batched
forward gives every row exactly one new token, so no padding ever enters the recurrence.
"""

from typing import Any, List, Optional, Sequence

import mlx.core as mx

from .cache import ArraysCache, CacheList, KVCache, RotatingKVCache
from .masks import causal_mask_for_positions


def _left_padded(rows: mx.array, width: int, capacity: int) -> mx.array:
    """(B, H, n, D) rows placed right-aligned at columns [width - n, width) of a zero
    (B, H, capacity, D) buffer."""
    B, H, n, D = rows.shape
    pieces = [mx.zeros((B, H, width - n, D), rows.dtype), rows, mx.zeros((B, H, capacity - width, D), rows.dtype)]
    return mx.concatenate([p for p in pieces if p.shape[2]], axis=2)


class _AlignedKV:
    """Shared machinery of the right-aligned KV layouts (see the module docstring).

    keys/values: (B, H_kv, capacity, D) or None while no row holds a token; `width`:
    columns in use; `pads`: per-row padding columns; `lengths`: per-row positions (the
    tokens each row has seen, which for a sliding window exceeds what it holds)."""

    step = 256

    def __init__(self, keys: Optional[mx.array], values: Optional[mx.array], width: int,
                 pads: List[int], lengths: List[int]):
        self.keys, self.values, self.width = keys, values, width
        self.pads, self.lengths = list(pads), list(lengths)
        self.offset = mx.array(self.lengths, dtype=mx.int32)  # (B,) rope positions

    @property
    def batch_size(self) -> int:
        return len(self.lengths)

    def _capacity(self, needed: int) -> int:
        return -(-needed // self.step) * self.step

    def _ensure_room(self, keys: mx.array, values: mx.array) -> None:
        """Grow the buffers (in blocks of `step` columns) so the new columns fit."""
        needed = self.width + keys.shape[2]
        if self.keys is not None and needed <= self.keys.shape[2]:
            return
        capacity = self._capacity(needed)
        if self.keys is None:
            self.keys = _left_padded(keys[..., :0, :], 0, capacity)
            self.values = _left_padded(values[..., :0, :], 0, capacity)
            return
        self.keys = _left_padded(self.keys[..., : self.width, :], self.width, capacity)
        self.values = _left_padded(self.values[..., : self.width, :], self.width, capacity)

    def update_and_fetch(self, keys: mx.array, values: mx.array):
        """Append (B, H_kv, N, D) keys/values at column `width` for every row; return the
        (B, H_kv, width, D) columns in use."""
        num_new = keys.shape[2]
        self._ensure_room(keys, values)
        start, end = self.width, self.width + num_new
        self.keys[..., start:end, :] = keys
        self.values[..., start:end, :] = values
        self.width = end
        self.lengths = [n + num_new for n in self.lengths]
        self.offset = self.offset + num_new
        return self.keys[..., :end, :], self.values[..., :end, :]

    def _window(self, window_size: Optional[int]) -> Optional[int]:
        return window_size

    def _columns_to_drop(self, num_new: int) -> int:
        """Old columns the next update of num_new tokens drops first (a window's)."""
        return 0

    def make_mask(self, num_queries: int, window_size: Optional[int] = None, return_array: bool = False):
        """(B, 1, N, S) boolean over the S columns the update of these N queries returns:
        query i of row b sees the columns from pads[b] up to itself, within its window.
        None for a single query when no row has padding and every row sees every column."""
        window = self._window(window_size)
        drop = self._columns_to_drop(num_queries)
        width, pads = self.width - drop, [max(p - drop, 0) for p in self.pads]
        if num_queries == 1 and not any(pads) and (window is None or width < window) and not return_array:
            return None
        query_cols = mx.arange(width, width + num_queries)[:, None]  # (N, 1)
        key_cols = mx.arange(width + num_queries)[None]  # (1, S)
        causal = causal_mask_for_positions(query_cols, key_cols, window)  # (N, S)
        real = key_cols >= mx.array(pads)[:, None]  # (B, S)
        return causal[None, None] & real[:, None, None, :]

    def _take_rows(self, indices: Sequence[int]):
        at = mx.array(list(indices), dtype=mx.int32)
        keys = None if self.keys is None else mx.take(self.keys, at, axis=0)
        values = None if self.values is None else mx.take(self.values, at, axis=0)
        pads = [self.pads[i] for i in indices]
        lengths = [self.lengths[i] for i in indices]
        drop = min(pads, default=0)  # padding every kept row has: gone
        if drop and keys is not None:
            keys, values = keys[..., drop:, :], values[..., drop:, :]
        return keys, values, self.width - drop, [p - drop for p in pads], lengths

    @staticmethod
    def _used(buffer: Optional[mx.array], used: int, width: int, batch_size: int, like: mx.array) -> mx.array:
        """The `used` columns of `buffer`, right-aligned to `width` (zeros shaped like
        `like` for rows that hold nothing yet)."""
        if buffer is None:
            return mx.zeros((batch_size, like.shape[1], width, like.shape[3]), like.dtype)
        return _left_padded(buffer[..., :used, :], width, width)

    def _joined(self, other: "_AlignedKV"):
        """keys, values, width, pads, lengths of self's rows then other's."""
        if self.keys is None and other.keys is None:
            return None, None, 0, self.pads + other.pads, self.lengths + other.lengths
        width = max(self.width, other.width)
        some = self if self.keys is not None else other
        capacity = self._capacity(width + 1)
        joined = []
        for name in ("keys", "values"):
            like = getattr(some, name)
            rows = [self._used(getattr(c, name), c.width, width, c.batch_size, like) for c in (self, other)]
            joined.append(_left_padded(mx.concatenate(rows), width, capacity))
        pads = [p + width - self.width for p in self.pads] + [p + width - other.width for p in other.pads]
        return joined[0], joined[1], width, pads, self.lengths + other.lengths

    def _row(self, buffer: mx.array, index: int, num_held: int) -> mx.array:
        """Row `index`'s last num_held columns as a new contiguous (1, H, n, D) array."""
        start = self.width - num_held
        return mx.contiguous(buffer[index : index + 1, :, start : self.width, :])

    def is_trimmable(self) -> bool:
        return False

    def start_speculation(self, rollback_window: int = 0) -> None:
        raise ValueError(f"speculation inside a batch is not supported ({type(self).__name__})")

    def stop_speculation(self) -> None:
        pass

    def size(self) -> int:
        return self.width

    def empty(self) -> bool:
        return self.keys is None

    @property
    def nbytes(self) -> int:
        return 0 if self.keys is None else self.keys.nbytes + self.values.nbytes


class BatchKVCache(_AlignedKV):
    """KVCache rows side by side (right-aligned; see the module docstring)."""

    @classmethod
    def merge(cls, caches: Sequence[KVCache]) -> "BatchKVCache":
        batch = cls(None, None, 0, [], [])
        for c in caches:
            keys, values = c.state if c.offset else (None, None)
            row = cls(keys, values, c.offset, [0], [c.offset])
            batch = batch.extend(row)
        return batch

    def extend(self, other: "BatchKVCache") -> "BatchKVCache":
        return BatchKVCache(*self._joined(other))

    def filter(self, indices: Sequence[int]) -> "BatchKVCache":
        return BatchKVCache(*self._take_rows(indices))

    def extract(self, index: int) -> KVCache:
        cache = KVCache()
        num_held = self.width - self.pads[index]
        if self.keys is not None and num_held:
            cache.state = (self._row(self.keys, index, num_held), self._row(self.values, index, num_held))
        return cache


class BatchRotatingKVCache(_AlignedKV):
    """RotatingKVCache rows (sliding windows, no sink tokens) side by side: the newest
    columns right-aligned, each query masked to its window of `max_size` tokens."""

    def __init__(self, max_size: int, keys, values, width: int, pads: List[int], lengths: List[int]):
        super().__init__(keys, values, width, pads, lengths)
        self.max_size = max_size

    def _window(self, window_size: Optional[int]) -> int:
        if window_size is not None and not 0 < window_size <= self.max_size:
            raise ValueError(f"a batched window of {self.max_size} tokens cannot mask for window_size={window_size}")
        return self.max_size if window_size is None else window_size

    def _columns_to_drop(self, num_new: int) -> int:
        # Before growing, drop the columns no query can see any more: the next query
        # sees at most max_size - 1 earlier tokens, so keeping max_size is enough.
        full = self.keys is not None and self.width + num_new > self.keys.shape[2]
        return self.width - self.max_size if full and self.width > self.max_size else 0

    def _ensure_room(self, keys: mx.array, values: mx.array) -> None:
        drop = self._columns_to_drop(keys.shape[2])
        if drop:
            self.keys, self.values = self.keys[..., drop:, :], self.values[..., drop:, :]
            self.width -= drop
            self.pads = [max(p - drop, 0) for p in self.pads]
        super()._ensure_room(keys, values)

    @classmethod
    def merge(cls, caches: Sequence[RotatingKVCache]) -> "BatchRotatingKVCache":
        sizes = {c.max_size for c in caches}
        if len(sizes) > 1:
            raise ValueError(f"rotating caches of different sizes {sorted(sizes)} cannot share a batch")
        sinks = [c.keep for c in caches if c.keep]
        if sinks:
            raise ValueError(f"batching does not support sink tokens (RotatingKVCache keep={sinks[0]}); drop max_kv_size")
        batch = cls(sizes.pop(), None, None, 0, [], [])
        for c in caches:
            held = c.size()
            keys = c._temporal_order(c.keys) if held else None
            values = c._temporal_order(c.values) if held else None
            batch = batch.extend(cls(c.max_size, keys, values, held, [0], [c.offset]))
        return batch

    def extend(self, other: "BatchRotatingKVCache") -> "BatchRotatingKVCache":
        if other.max_size != self.max_size:
            raise ValueError(f"rotating caches of sizes {self.max_size} and {other.max_size} cannot share a batch")
        return BatchRotatingKVCache(self.max_size, *self._joined(other))

    def filter(self, indices: Sequence[int]) -> "BatchRotatingKVCache":
        return BatchRotatingKVCache(self.max_size, *self._take_rows(indices))

    def extract(self, index: int) -> RotatingKVCache:
        """The row as a RotatingKVCache holding its newest tokens in temporal order
        (the write index past them: the next write overwrites the oldest)."""
        num_held = min(self.width - self.pads[index], self.max_size)
        if self.keys is None or not num_held:
            return RotatingKVCache(self.max_size)
        state = (self._row(self.keys, index, num_held), self._row(self.values, index, num_held))
        meta = tuple(map(str, (0, self.max_size, self.lengths[index], num_held)))
        return RotatingKVCache.from_state(state, meta)


class BatchArraysCache(ArraysCache):
    """ArraysCache rows (recurrent and conv state) stacked along the batch axis."""

    @classmethod
    def merge(cls, caches: Sequence[ArraysCache]) -> "BatchArraysCache":
        batch = cls(len(caches[0].cache))
        for c in caches:
            batch = batch.extend(c)
        return batch

    @property
    def batch_size(self) -> int:
        return 0 if self.cache[0] is None else self.cache[0].shape[0]

    def extend(self, other: ArraysCache) -> "BatchArraysCache":
        if len(other.cache) != len(self.cache):
            raise ValueError(f"ArraysCache of {len(other.cache)} arrays cannot join a batch of {len(self.cache)}")
        joined = BatchArraysCache(len(self.cache))
        for i, (mine, theirs) in enumerate(zip(self.cache, other.cache)):
            if mine is None or theirs is None:
                if mine is not None or self.batch_size:
                    raise ValueError("a recurrent cache that has seen no token cannot join a batch that has")
                joined[i] = theirs
            else:
                joined[i] = mx.concatenate([mine, theirs])
        return joined

    def filter(self, indices: Sequence[int]) -> "BatchArraysCache":
        at = mx.array(list(indices), dtype=mx.int32)
        kept = BatchArraysCache(len(self.cache))
        kept.cache = [None if a is None else mx.take(a, at, axis=0) for a in self.cache]
        return kept

    def extract(self, index: int) -> ArraysCache:
        row = ArraysCache(len(self.cache))
        row.cache = [None if a is None else mx.contiguous(a[index : index + 1]) for a in self.cache]
        return row

    def start_speculation(self, rollback_window: int = 0) -> None:
        raise ValueError("speculation inside a batch is not supported (BatchArraysCache)")


class BatchCacheList(CacheList):
    """CacheList rows: each child batched on its own."""

    @classmethod
    def merge(cls, caches: Sequence[CacheList]) -> "BatchCacheList":
        return cls(*(merge_entry([c.caches[i] for c in caches]) for i in range(len(caches[0].caches))))

    def extend(self, other: CacheList) -> "BatchCacheList":
        return BatchCacheList(*(extend_entry(a, b) for a, b in zip(self.caches, other.caches)))

    def filter(self, indices: Sequence[int]) -> "BatchCacheList":
        return BatchCacheList(*(c.filter(indices) for c in self.caches))

    def extract(self, index: int) -> CacheList:
        return CacheList(*(c.extract(index) for c in self.caches))


# Which batched class holds rows of each cache class (exact types: a QuantizedKVCache
# or any other kind cannot be batched).
BATCH_CLASSES = {
    KVCache: BatchKVCache,
    RotatingKVCache: BatchRotatingKVCache,
    ArraysCache: BatchArraysCache,
    CacheList: BatchCacheList,
}


def batch_class(entry: Any):
    cls = BATCH_CLASSES.get(type(entry))
    if cls is None:
        raise ValueError(
            f"{type(entry).__name__} entries cannot be batched; batchable kinds: "
            f"{', '.join(c.__name__ for c in BATCH_CLASSES)} (drop kv_bits for batching)"
        )
    return cls


def merge_entry(entries: Sequence[Any]) -> Any:
    """One layer's entries of several rows (ordinary caches) as one batched entry."""
    return batch_class(entries[0]).merge(entries)


def extend_entry(batched: Any, rows: Any) -> Any:
    """A batched entry followed by the rows of another batched entry of its kind."""
    return batched.extend(rows)


def merge_caches(row_caches: Sequence[List[Any]]) -> List[Any]:
    """Per-row cache lists (one entry per layer) -> one batched cache list."""
    return [merge_entry([caches[layer] for caches in row_caches]) for layer in range(len(row_caches[0]))]


def extend_caches(batched: List[Any], more: List[Any]) -> List[Any]:
    return [extend_entry(a, b) for a, b in zip(batched, more)]


def filter_caches(batched: List[Any], indices: Sequence[int]) -> List[Any]:
    """Only rows `indices` (in that order), padding common to all of them dropped."""
    return [entry.filter(indices) for entry in batched]


def extract_caches(batched: List[Any], index: int) -> List[Any]:
    """Row `index` as ordinary caches, copied out of the batch buffers."""
    return [entry.extract(index) for entry in batched]
