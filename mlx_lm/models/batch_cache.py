"""Batched caches: the caches of several sequences side by side, one (B, ...) array per
layer, for continuous batching (`mlx_lm/batching.py`).

Each sequence (row) is prefilled alone in ordinary caches (`cache.py`); `merge_caches`
stacks rows into batched caches, `extend_caches` joins two batches, `filter_caches`
keeps some rows and `extract_caches` gives one row back as ordinary caches. The models
see the same contract as unbatched: `offset` (here a (B,) array of each row's position,
which `mx.fast.rope` takes per row), `update_and_fetch`, `make_mask`, `cache[i]`.

Upstream's batch API works on these classes: `BatchKVCache(left_padding)` and
`BatchRotatingKVCache(max_size, left_padding)` make an empty batch whose rows start with
that much padding (the padding becomes holes: a row's positions start at -padding),
`prepare(left_padding=, lengths=, right_padding=)` / `finalize()` bracket a prefill of
prompts padded to one length (right padding becomes holes at `finalize`), `merge`
(also `KVCache.merge(...)`, cache.py), `extend` (in place), `extract`, `keys`,
`values`, `keys_and_values()`, `left_padding`, `nbytes`. Where this differs: `filter`
returns the kept rows as a new batch and leaves the receiver whole, `trim(n)` raises
where upstream clamps, and recurrent caches take no padding (cache.ArraysCache).

The classes live by kind: the right-aligned KV layout with the batched KVCache and
QuantizedKVCache in `batch_kv_cache.py`, sliding windows and chunks in
`batch_rotating_cache.py`, recurrent state and the entries holding no KV in
`batch_arrays_cache.py`; every name is importable from here (and from `cache.py`).
"""

from typing import Any, List, Sequence

import mlx.core as mx

from .batch_arrays_cache import BatchArraysCache, BatchCacheList, BatchSharedKVReader, extend_entry
from .batch_kv_cache import NO_TOKEN, BatchKVCache, BatchQuantizedKVCache, _AlignedKV  # noqa: F401  (importable here)
from .batch_rotating_cache import BatchChunkedKVCache, BatchRotatingKVCache
from .cache import ArraysCache, CacheList, ChunkedKVCache, KVCache, QuantizedKVCache, RotatingKVCache, SharedKVReader
from .cache_base import BATCH_CLASSES, merge_entries


# Which batched class holds rows of each cache class (exact types: any other kind
# cannot be batched), in cache.py's registry (see there why).
BATCH_CLASSES.update({
    KVCache: BatchKVCache,
    RotatingKVCache: BatchRotatingKVCache,
    QuantizedKVCache: BatchQuantizedKVCache,
    ArraysCache: BatchArraysCache,
    CacheList: BatchCacheList,
    SharedKVReader: BatchSharedKVReader,
    ChunkedKVCache: BatchChunkedKVCache,
})


def merge_caches(row_caches: Sequence[List[Any]]) -> List[Any]:
    """Per-row cache lists (one entry per layer) -> one batched cache list."""
    return [merge_entries([caches[layer] for caches in row_caches]) for layer in range(len(row_caches[0]))]


def extend_caches(batched: List[Any], more: List[Any]) -> List[Any]:
    return [extend_entry(a, b) for a, b in zip(batched, more)]


def filter_caches(batched: List[Any], indices: Sequence[int]) -> List[Any]:
    """Only rows `indices` (in that order), padding common to all of them dropped."""
    return [entry.filter(indices) for entry in batched]


def make_room(batched: List[Any], num_new: int) -> None:
    """Call before each forward of num_new tokens per row (see _AlignedKV.make_room)."""
    for entry in batched:
        entry.make_room(num_new)


def trim_rows(batched: List[Any], counts: Sequence[int]) -> None:
    """Forget the last counts[b] tokens of each row b (see _AlignedKV.trim_rows)."""
    for entry in batched:
        entry.trim_rows(counts)


def bookkeeping(batched: List[Any]) -> List[mx.array]:
    """The small arrays a step updates that its output need not depend on. Evaluate
    them with the step's output: left lazy, their updates pile up, one per layer and
    step, until the next read (a row joining or leaving) evaluates them all at once
    (at 300 steps, 15 ms for a 6-layer model)."""
    return [a for entry in batched for a in entry.bookkeeping]


def extract_caches(batched: List[Any], index: int) -> List[Any]:
    """Row `index` as ordinary caches, copied out of the batch buffers."""
    return [entry.extract(index) for entry in batched]
