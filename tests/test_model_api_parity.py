"""Upstream mlx-lm 0.32.2's model-level public names (issue 32), each against a naive
reference or an identity it must satisfy: the cache batch forms, activations, rope,
segsum, the expert layers, MultiLinear and the ops-only gated delta recurrence."""

import mlx.core as mx
import numpy as np
import pytest

from mlx_lm.models.batch_cache import merge_caches
from mlx_lm.models.cache import ArraysCache, CacheList, ChunkedKVCache, KVCache


def _filled_arrays(seed: int, rows: int = 1) -> ArraysCache:
    rng = np.random.default_rng(seed)
    cache = ArraysCache(2)
    cache[0] = mx.array(rng.standard_normal((rows, 3, 4)).astype(np.float32))
    cache[1] = mx.array(rng.standard_normal((rows, 2)).astype(np.float32))
    return cache


# --- ArraysCache / CacheList batch forms ----------------------------------------------


def test_arrays_cache_extend_equals_stacking_the_rows():
    a, b, c = _filled_arrays(0), _filled_arrays(1, rows=2), _filled_arrays(2)
    joined = a.extend(b)
    assert joined is a and a.batch_size == 3
    a.extend(c)
    for i in range(2):
        want = np.concatenate([np.array(_filled_arrays(s, r)[i]) for s, r in ((0, 1), (1, 2), (2, 1))])
        np.testing.assert_array_equal(np.array(a[i]), want)


def test_arrays_cache_filter_equals_taking_the_rows_and_leaves_the_receiver_whole():
    batch = _filled_arrays(3, rows=4)
    kept = batch.filter([3, 1])
    assert type(kept) is ArraysCache and kept.batch_size == 2 and batch.batch_size == 4
    for i in range(2):
        np.testing.assert_array_equal(np.array(kept[i]), np.array(batch[i])[[3, 1]])
    assert batch.filter(mx.array([0])).batch_size == 1
    with pytest.raises(IndexError, match=r"rows \[4\] do not exist"):
        batch.filter([4])


def test_arrays_cache_filter_then_extend_equals_building_the_batch_directly():
    rows = [_filled_arrays(s) for s in range(3)]
    batch = merge_caches([[r] for r in rows])[0]
    rebuilt = batch.filter([0]).extend(rows[2])
    direct = merge_caches([[rows[0]], [rows[2]]])[0]
    for i in range(2):
        np.testing.assert_array_equal(np.array(rebuilt[i]), np.array(direct[i]))


def test_arrays_cache_extend_counts_rows_without_state_and_refuses_mixing():
    empty = ArraysCache(2).extend(ArraysCache(2))
    assert empty.empty() and empty.batch_size == 2
    with pytest.raises(ValueError, match="has seen no token cannot join"):
        _filled_arrays(0).extend(ArraysCache(2))
    with pytest.raises(ValueError, match="cannot join a batch of 2"):
        _filled_arrays(0).extend(ArraysCache(3))
    with pytest.raises(ValueError, match="ArraysCache cannot be extended by a KVCache"):
        _filled_arrays(0).extend(KVCache())


def test_cache_list_batch_forms_delegate_to_each_child():
    pair = CacheList(_filled_arrays(0, rows=3), _filled_arrays(1, rows=3))
    kept = pair.filter([2, 0])
    assert type(kept) is CacheList and [c.batch_size for c in kept.caches] == [2, 2]
    np.testing.assert_array_equal(np.array(kept[1][0]), np.array(pair[1][0])[[2, 0]])
    assert pair.extend(CacheList(_filled_arrays(2), _filled_arrays(3))) is pair
    assert [c.batch_size for c in pair.caches] == [4, 4]
    row = pair.extract(3)
    np.testing.assert_array_equal(np.array(row[0][1]), np.array(_filled_arrays(2)[1]))
    pair.prepare(lengths=[1, 1, 1, 1])
    pair.finalize()
    with pytest.raises(ValueError, match="cannot be extended by 1 children"):
        pair.extend(CacheList(_filled_arrays(4)))


def test_batch_forms_on_a_one_sequence_cache_say_so():
    with pytest.raises(ValueError, match="KVCache holds one sequence, so it has no batch rows to filter"):
        CacheList(KVCache(), ArraysCache(2)).filter([0])
    with pytest.raises(ValueError, match="no batch rows to extend"):
        KVCache().extend(KVCache())


def test_batched_cache_list_keeps_its_kind_through_filter():
    rows = [[CacheList(KVCache(), _filled_arrays(s))] for s in range(2)]
    for entry, in rows:
        entry[0].update_and_fetch(mx.ones((1, 1, 2, 4)), mx.ones((1, 1, 2, 4)))
    batch = merge_caches(rows)[0]
    kept = batch.filter([1])
    assert type(kept) is type(batch) and kept[1].batch_size == 1


# --- ChunkedKVCache -----------------------------------------------------------------


def test_chunked_cache_start_position_is_the_oldest_position_held():
    cache = ChunkedKVCache(4)
    seen = []
    for _ in range(7):
        cache.maybe_trim_front()  # a no-op: the ring holds at most one chunk
        cache.update_and_fetch(mx.ones((1, 1, 1, 2)), mx.ones((1, 1, 1, 2)))
        seen.append(cache.start_position)
    assert seen == [max(0, n - 4) for n in range(1, 8)]
    keys, _ = cache.update_and_fetch(mx.ones((1, 1, 3, 2)), mx.ones((1, 1, 3, 2)))
    # A multi-token update returns the held window then the new tokens, in order.
    assert keys.shape[2] == 4 + 3
