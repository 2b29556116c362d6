"""Exact rollback of a RotatingKVCache while speculating, also past the wrap."""

import functools
import gc
import inspect

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


def fed_tokens(chunks, num_tokens, max_size=4, keep=0):
    """A prefilled cache fed the first num_tokens of `chunks`, in the same chunks (the
    last one cut short), as plain decoding would have fed them."""
    cache = prefilled(max_size, keep)
    for k, v in chunks:
        if num_tokens <= 0:
            break
        take = min(num_tokens, k.shape[2])
        cache.update_and_fetch(k[..., :take, :], v[..., :take, :])
        num_tokens -= take
    return cache


def assert_rewinds_like_feeding(chunks, max_size, keep, trims):
    """Speculate over `chunks`, then trim by each of `trims` in turn; after every trim
    the cache equals one fed only the tokens still held, and continues identically."""
    cache = prefilled(max_size, keep)
    cache.start_speculation(rollback_window=64)
    for k, v in chunks:
        cache.update_and_fetch(k, v)
    held = sum(k.shape[2] for k, _ in chunks)
    for n in trims:
        assert cache.trim(n) == n
        held -= n
        reference = fed_tokens(chunks, held, max_size, keep)
        assert_same_cache(cache, reference)
        assert cache.empty() == reference.empty()
    for a, b in zip(next_output(cache), next_output(reference)):
        assert mx.array_equal(a, b)


@pytest.mark.parametrize("keep", [0, 1])
@pytest.mark.parametrize("num_steps", [1, 3, 8])
def test_single_token_writes_that_wrap_roll_back_exactly(num_steps, keep):
    """Draft-style steps on a full ring (8 steps lap a 4-slot ring twice), rolled back
    by every amount at once and one token at a time."""
    chunks = [rows(1, 30 + i) for i in range(num_steps)]
    for n in range(num_steps + 1):
        assert_rewinds_like_feeding(chunks, 4, keep, [n])
    assert_rewinds_like_feeding(chunks, 4, keep, [1] * num_steps)


@pytest.mark.parametrize("keep", [0, 1, 2])
@pytest.mark.parametrize("pattern", [(3,), (2, 1, 5), (1, 6, 1, 1, 2), (9, 2)])
def test_mixed_writes_crossing_the_window_roll_back_exactly(pattern, keep):
    """Multi-token updates that cross (and exceed) the window, stacked with single-token
    ones, rolled back by every amount, and in single steps through partly undone records
    (whose shorter prefix was re-appended)."""
    chunks = [rows(num, 40 + i) for i, num in enumerate(pattern)]
    total = sum(pattern)
    for n in range(total + 1):
        assert_rewinds_like_feeding(chunks, 5, keep, [n])
    assert_rewinds_like_feeding(chunks, 5, keep, [1] * total)
    assert_rewinds_like_feeding(chunks, 5, keep, [2, 1, total - 3] if total > 3 else [total])


def test_rollback_from_a_fresh_cache_leaves_it_empty():
    cache = RotatingKVCache(4)
    cache.start_speculation()
    cache.update_and_fetch(*rows(3, 0))
    cache.update_and_fetch(*rows(1, 1))
    assert cache.trim(4) == 4
    assert cache.empty() and cache.offset == 0 and cache.state == []


def test_stacked_records_up_to_the_rollback_window():
    cache = prefilled(keep=1)
    cache.start_speculation(rollback_window=6)
    chunks = [rows(2, 50), *(rows(1, 51 + i) for i in range(5))]
    for chunk in chunks:
        cache.update_and_fetch(*chunk)
    # 7 tokens written; the 2-token record is kept while the newer ones cover < 6.
    assert cache._rollbacks.num_tokens == 7
    assert cache.trim(6) == 6
    assert_same_cache(cache, fed_tokens(chunks, 1, keep=1))
    with pytest.raises(RuntimeError, match="Cannot roll back 2 tokens: only 1"):
        cache.trim(2)
    assert_same_cache(cache, fed_tokens(chunks, 1, keep=1))  # a refused trim changes nothing


def test_stop_speculation_leaves_a_clean_cache():
    cache, reference = prefilled(), prefilled()
    cache.start_speculation()
    for i in range(3):
        cache.update_and_fetch(*rows(1, 60 + i))
    cache.trim(1)
    cache.stop_speculation()
    for i in range(2):
        reference.update_and_fetch(*rows(1, 60 + i))
    assert cache._rollbacks is None and not cache.is_trimmable()
    assert_same_cache(cache, reference)
    for seed in (70, 71):  # plain writes afterwards, unrecorded
        for a, b in zip(next_output(cache, seed), next_output(reference, seed)):
            assert mx.array_equal(a, b)
    assert cache._rollbacks is None


@pytest.mark.parametrize("lookahead", [1, 3, 32])
@pytest.mark.parametrize("keep", [0, 2])
@pytest.mark.parametrize("seed", range(4))
def test_random_writes_and_trims_equal_feeding(seed, keep, lookahead, monkeypatch):
    """Random single- and multi-token writes and trims (often below where the rows for
    the next writes were copied ahead, then different tokens) on a 9-slot ring: after
    every step the cache equals one fed the tokens it holds, in the same chunks."""
    monkeypatch.setattr(RotatingKVCache, "lookahead", lookahead)
    rng = np.random.default_rng(seed)
    max_size = 9
    cache = RotatingKVCache(max_size, keep=keep)
    cache.update_and_fetch(*rows(11, 1000 + seed))
    cache.start_speculation(rollback_window=64)
    held = [rows(11, 1000 + seed)]  # the chunks the cache holds, as a plain run fed them
    for step in range(60):
        recorded = cache._rollbacks.num_tokens
        if recorded and rng.random() < 0.3:
            n = int(rng.integers(1, recorded + 1))
            assert cache.trim(n) == n
            while n:
                k, v = held.pop()
                if k.shape[2] > n:
                    held.append((k[..., : k.shape[2] - n, :], v[..., : v.shape[2] - n, :]))
                n -= min(n, k.shape[2])
        else:
            chunk = rows(1 if rng.random() < 0.7 else int(rng.integers(2, 13)), 2000 + step)
            cache.update_and_fetch(*chunk)
            held.append(chunk)
        reference = RotatingKVCache(max_size, keep=keep)
        for chunk in held:
            reference.update_and_fetch(*chunk)
        assert_same_cache(cache, reference)


@pytest.mark.parametrize(
    "prefill, script",
    [
        # the block is copied at offset 12 (positions 3..11); a trim to 11, then 3 new
        # tokens rewrite position 11, which the write at offset 20 destroys
        (9, [("write", 3), ("write", 1), ("trim", 2), ("write", 3)] + [("write", 1)] * 7 + [("trim", 1)] * 8),
        # back before the first wrap: unevicting single writes rewrite positions 0..8,
        # the block (copied at offset 9) still holds the old ones
        (0, [("write", 9), ("write", 1), ("trim", 10)] + [("write", 1)] * 11 + [("trim", 1)] * 3),
    ],
)
def test_rows_copied_ahead_are_dropped_once_their_positions_can_change(prefill, script):
    cache = RotatingKVCache(9)
    held = [rows(prefill, 3000)] if prefill else []
    for chunk in held:
        cache.update_and_fetch(*chunk)
    cache.start_speculation()
    for step, (op, n) in enumerate(script):
        if op == "write":
            chunk = rows(n, 3100 + step)
            cache.update_and_fetch(*chunk)
            held += [(chunk[0][..., i : i + 1, :], chunk[1][..., i : i + 1, :]) for i in range(n)]
        else:
            cache.trim(n)
            del held[len(held) - n :]
        # Fed token by token the ring is laid out differently: compare rows by position.
        reference = RotatingKVCache(9)
        for chunk in held:
            reference.update_and_fetch(*chunk)
        assert cache.offset == reference.offset and cache.empty() == reference.empty()
        if reference.empty():
            continue
        for ours, theirs in ((cache.keys, reference.keys), (cache.values, reference.values)):
            assert mx.array_equal(cache._temporal_order(ours), reference._temporal_order(theirs)), f"step {step}"


# --- what speculating costs: records hold what a write destroys, never the window ---------


def arrays_held_by_records(cache):
    """The distinct arrays the rollback log keeps alive, found through closures, partials,
    bound methods and object attributes, but not through the cache itself (every design
    holds the cache's current buffers)."""
    found, seen, todo = {}, set(), [cache._rollbacks.records]
    while todo:
        obj = todo.pop()
        if obj is cache or id(obj) in seen or inspect.ismodule(obj) or inspect.isclass(obj):
            continue
        seen.add(id(obj))
        if isinstance(obj, mx.array):
            found[id(obj)] = obj
        elif isinstance(obj, (list, tuple)):
            todo.extend(obj)
        elif isinstance(obj, dict):
            todo.extend(obj.values())
        elif isinstance(obj, functools.partial):
            todo += [obj.func, obj.args, obj.keywords]
        elif inspect.ismethod(obj):
            todo.append(obj.__self__)
        elif inspect.isfunction(obj):
            todo.extend(cell.cell_contents for cell in obj.__closure__ or ())
        elif hasattr(obj, "__dict__"):
            todo.append(vars(obj))
    return list(found.values())


BIG_WINDOW, BIG_H, BIG_D = 512, 4, 32


def big_rows(num_tokens, seed):
    keys, values = (mx.random.normal((1, BIG_H, num_tokens, BIG_D), key=mx.random.key(seed + i)) for i in (0, 1))
    mx.eval(keys, values)
    return keys, values


def wrapped_big_cache():
    cache = RotatingKVCache(BIG_WINDOW, keep=4)
    cache.update_and_fetch(*big_rows(BIG_WINDOW + 3, 0))
    for i in range(3):
        cache.update_and_fetch(*big_rows(1, 1 + i))
    mx.eval(cache.keys, cache.values)
    return cache


def test_records_hold_only_what_writes_destroy():
    """Retained bytes are O(tokens written x bytes per token), not O(window): the old log
    kept the whole pre-write window per record."""
    token_bytes = 2 * BIG_H * BIG_D * 4  # keys and values of one token, fp32
    cache = wrapped_big_cache()
    cache.start_speculation(rollback_window=8)
    for i in range(8):
        cache.update_and_fetch(*big_rows(1, 10 + i))
    held = arrays_held_by_records(cache)
    assert sum(a.nbytes for a in held) <= 8 * token_bytes
    cache.update_and_fetch(*big_rows(5, 20))  # a verify chunk crossing the window
    held = arrays_held_by_records(cache)
    # the chunk's own 5 tokens and the 5 it evicted, plus the 7 newest single-token rows
    assert sum(a.nbytes for a in held) <= (5 + 5 + 7) * token_bytes


def test_speculative_single_token_writes_are_in_place():
    """No write copies the window: peak memory over 16 recorded draft steps grows by the
    saved rows only (a copy of either buffer would add a whole buffer), and what the log
    then keeps alive, the buffers behind views included, is a few blocks of rows."""
    cache = wrapped_big_cache()
    steps = [big_rows(1, 30 + i) for i in range(16)]
    buffer_bytes = cache.keys.nbytes
    token_bytes = 2 * BIG_H * BIG_D * 4
    cache.start_speculation(rollback_window=8)
    gc.collect()
    mx.synchronize()
    mx.reset_peak_memory()
    base = mx.get_active_memory()
    for step in steps:
        out = cache.update_and_fetch(*step)
        mx.eval(out)
    del out
    assert mx.get_peak_memory() - base < buffer_bytes / 4
    assert cache._rollbacks.num_tokens == 8
    assert 0 < mx.get_active_memory() - base <= 2 * RotatingKVCache.lookahead * token_bytes
    assert cache.trim(8) == 8  # and the restore writes back in place too
    mx.eval(cache.keys, cache.values)
    assert mx.get_peak_memory() - base < buffer_bytes / 4
    cache.stop_speculation()
    assert mx.get_active_memory() - base <= 0  # nothing left behind


# --- end to end: draft models whose own sliding windows roll back every round ------------


@pytest.mark.parametrize(
    "target_name, draft_name, max_kv_size",
    [
        ("gpt_oss_tf5", "gpt_oss_tf4", None),  # both gpt-oss: sliding layers, window 8
        ("llama_tf4", "qwen3_tf5", 12),  # every layer of both a ring of 12 (4 sinks)
    ],
)
def test_greedy_speculation_with_rotating_drafts_equals_plain(target_name, draft_name, max_kv_size):
    """Single-token draft writes past the wrap are undone every round (a different random
    draft disagrees often), and the verify chunks cross the window."""
    from conftest import FIXTURES

    from mlx_lm.generate import SpeculationStats, generate_step, speculative_generate_step
    from mlx_lm.utils import load_model

    target, draft = load_model(FIXTURES / target_name)[0], load_model(FIXTURES / draft_name)[0]
    prompt = mx.array([(i * 37 + 11) % 256 for i in range(20)])
    want = [t for t, _ in generate_step(prompt, target, max_tokens=30, max_kv_size=max_kv_size)]
    for k in (1, 3, 6):
        stats = SpeculationStats()
        out = speculative_generate_step(
            prompt, target, draft, num_draft_tokens=k, max_tokens=30, max_kv_size=max_kv_size, stats=stats,
            adaptive_draft_length=False,  # k drafts every round, however rarely they are accepted
        )
        assert [t for t, _, _ in out] == want, f"k={k}"
        assert stats.num_accepted < stats.num_drafted / 2  # mostly rolled back
