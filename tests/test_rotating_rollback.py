"""Exact rollback of a RotatingKVCache while speculating, also past the wrap."""

import mlx.core as mx
import numpy as np
import pytest

from mlx_lm.models.cache import RotatingKVCache

H, D = 2, 8


def rows(num_tokens, seed):
    rng = np.random.default_rng(seed)
    k = rng.standard_normal((1, H, num_tokens, D)).astype(np.float32)
    v = rng.standard_normal((1, H, num_tokens, D)).astype(np.float32)
    return mx.array(k), mx.array(v)


def prefilled(max_size=4, keep=0, pattern=(7, 1, 1)):
    """A cache that has wrapped, through both update paths."""
    cache = RotatingKVCache(max_size, keep=keep)
    for i, num in enumerate(pattern):
        cache.update_and_fetch(*rows(num, 100 + i))
    return cache


def assert_same_cache(a, b):
    assert a.meta_state == b.meta_state
    for x, y in zip(a.state, b.state):
        assert mx.array_equal(x, y)


def next_output(cache, seed=7):
    """What the next single-token update returns (keys and values)."""
    k, v = rows(1, seed)
    return cache.update_and_fetch(k, v)


@pytest.mark.parametrize("keep", [0, 1])
@pytest.mark.parametrize("T", [1, 2, 5])
def test_tail_independence_and_replay_equals_feed(T, keep):
    """Two verify chunks sharing an m-token prefix, each rolled back to m, leave
    bit-identical caches, equal to feeding exactly those m tokens."""
    for m in range(T + 1):
        prefix = rows(m, 1)
        tail_a, tail_b = rows(T - m, 2), rows(T - m, 3)
        caches = []
        for tail in (tail_a, tail_b):
            cache = prefilled(keep=keep)
            cache.start_speculation()
            chunk = [mx.concatenate([p, t], axis=2) for p, t in zip(prefix, tail)]
            cache.update_and_fetch(*chunk)
            assert cache.trim(T - m) == T - m
            caches.append(cache)
        fed = prefilled(keep=keep)
        if m:
            fed.update_and_fetch(*prefix)
        for cache in caches:
            assert_same_cache(cache, fed)
            assert cache.offset == fed.offset
        outs = [next_output(c) for c in (*caches, fed)]
        for out in outs[1:]:
            assert all(mx.array_equal(x, y) for x, y in zip(out, outs[0]))


def test_stacked_single_token_records_rewind_together():
    cache = prefilled()
    reference = prefilled()
    cache.start_speculation()
    for i in range(3):
        cache.update_and_fetch(*rows(1, 10 + i))
    assert cache.trim(2) == 2  # keeps the first of the three
    reference.update_and_fetch(*rows(1, 10))
    assert_same_cache(cache, reference)
    assert cache.trim(1) == 1
    assert_same_cache(cache, prefilled())


def test_trim_beyond_records_raises_and_leaves_cache_alone():
    cache = prefilled()
    cache.start_speculation()
    with pytest.raises(RuntimeError, match="only 0 are recorded"):
        cache.trim(1)
    cache.update_and_fetch(*rows(3, 5))
    with pytest.raises(RuntimeError, match="Cannot roll back 4 tokens"):
        cache.trim(4)
    assert cache.offset == 9 + 3


def test_rollback_window_bounds_records():
    cache = prefilled()
    cache.start_speculation(rollback_window=2)
    for i in range(5):
        cache.update_and_fetch(*rows(1, 20 + i))
    assert cache._rollbacks.num_tokens == 2
    assert cache.trim(2) == 2
    with pytest.raises(RuntimeError, match="rollback window 2"):
        cache.trim(1)


def test_not_speculating_uses_plain_trim():
    cache = prefilled()
    assert not cache.is_trimmable()
    with pytest.raises(RuntimeError, match="wrapped"):
        cache.trim(1)
    cache.start_speculation()
    assert cache.is_trimmable()
    cache.stop_speculation()
    assert not cache.is_trimmable() and cache._rollbacks is None
    fresh = RotatingKVCache(8)
    fresh.update_and_fetch(*rows(5, 0))
    assert fresh.is_trimmable() and fresh.trim(2) == 2 and fresh.offset == 3
