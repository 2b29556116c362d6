"""models/cache.py: KV caches, the rotating window, recurrent arrays, prompt-cache helpers."""

import mlx.core as mx
import numpy as np
import pytest

from mlx_lm.models.base import causal_mask_for_positions, create_attention_mask, create_causal_mask
from mlx_lm.models.cache import (
    ArraysCache,
    CacheList,
    KVCache,
    RotatingKVCache,
    can_trim_prompt_cache,
    make_prompt_cache,
    trim_prompt_cache,
)

B, H, D = 1, 2, 8


def kv(num_tokens, seed):
    rng = np.random.default_rng(seed)
    shape = (B, H, num_tokens, D)
    return mx.array(rng.standard_normal(shape), dtype=mx.float32), mx.array(
        rng.standard_normal(shape), dtype=mx.float32
    )


def attend(q, k, v, mask):
    return mx.fast.scaled_dot_product_attention(q, k, v, scale=D**-0.5, mask=mask)


def test_kv_cache_grows_and_returns_everything():
    cache = KVCache()
    k1, v1 = kv(300, 0)  # crosses the 256-token growth step
    k2, v2 = kv(1, 1)
    cache.update_and_fetch(k1, v1)
    keys, values = cache.update_and_fetch(k2, v2)
    assert cache.offset == 301 and keys.shape == (B, H, 301, D)
    assert mx.array_equal(keys, mx.concatenate([k1, k2], axis=2))
    assert mx.array_equal(values, mx.concatenate([v1, v2], axis=2))
    assert cache.keys.shape[2] == 512 and cache.nbytes == 2 * 512 * B * H * D * 4


def test_kv_cache_trim_overwrites_and_refuses_too_much():
    cache = KVCache()
    cache.update_and_fetch(*kv(10, 0))
    assert cache.trim(0) == 0 and cache.trim(-3) == 0
    assert cache.trim(4) == 4 and cache.offset == 6
    k, v = kv(2, 1)
    keys, _ = cache.update_and_fetch(k, v)
    assert keys.shape[2] == 8 and mx.array_equal(keys[..., 6:, :], k)
    with pytest.raises(ValueError, match="Cannot trim 9 tokens"):
        cache.trim(9)
    assert cache.offset == 8


def test_kv_cache_state_round_trip():
    cache = KVCache()
    cache.update_and_fetch(*kv(5, 0))
    clone = KVCache.from_state(cache.state, cache.meta_state)
    assert clone.offset == 5
    k, v = kv(1, 1)
    assert mx.array_equal(clone.update_and_fetch(k, v)[0], cache.update_and_fetch(k, v)[0])
    assert KVCache().empty() and KVCache().state == []


def test_kv_cache_masks():
    cache = KVCache()
    assert cache.make_mask(1) is None
    cache.update_and_fetch(*kv(6, 0))
    mask = cache.make_mask(3, return_array=True)
    assert mask.shape == (3, 9)
    assert mx.array_equal(mask, create_causal_mask(3, offset=6))
    windowed = cache.make_mask(1, window_size=4, return_array=True)  # one query past the window needs a mask
    assert windowed.tolist() == [[False] * 3 + [True] * 4]


def test_create_causal_mask_matches_naive():
    mask = np.array(create_causal_mask(4, offset=3, window_size=3))
    naive = np.array([[j <= 3 + i and 3 + i - j < 3 for j in range(7)] for i in range(4)])
    assert (mask == naive).all()


UPDATE_PATTERNS = [
    [1] * 20,  # decode only, wraps twice
    [7, 1, 1, 5, 1, 9, 1, 1, 1, 3],  # mixes, multi-token updates crossing the window edge
    [30, 1, 2, 1],  # a prefill longer than the window
    [3, 3, 3, 3, 3, 3],
]


@pytest.mark.parametrize("pattern", UPDATE_PATTERNS)
@pytest.mark.parametrize("keep", [0, 2])
def test_rotating_attention_equals_windowed_full_attention(pattern, keep):
    """Whatever the mix of updates, attention through the ring equals attention over the
    full history under the window mask (sinks always visible)."""
    max_size = 8
    cache = RotatingKVCache(max_size, keep=keep)
    all_k, all_v = kv(sum(pattern), 0)
    queries, _ = kv(sum(pattern), 1)
    start = 0
    for step, num in enumerate(pattern):
        k, v = all_k[..., start : start + num, :], all_v[..., start : start + num, :]
        q = queries[..., start : start + num, :]
        mask = cache.make_mask(num, return_array=True)
        keys, values = cache.update_and_fetch(k, v)
        got = attend(q, keys, values, mask)
        positions = mx.arange(start + num)
        ref_mask = causal_mask_for_positions(
            mx.arange(start, start + num)[:, None], positions[None], max_size - keep, keep
        )
        want = attend(q, all_k[..., : start + num, :], all_v[..., : start + num, :], ref_mask)
        assert mx.allclose(got, want, atol=1e-5), f"update {step} ({num} tokens)"
        start += num
        assert cache.offset == start and cache.size() == min(start, max_size)


def test_rotating_keeps_sinks_and_newest_window():
    cache = RotatingKVCache(6, keep=2)
    k, v = kv(15, 0)
    cache.update_and_fetch(k[..., :9, :], v[..., :9, :])
    for i in range(9, 15):
        cache.update_and_fetch(k[..., i : i + 1, :], v[..., i : i + 1, :])
    held = cache._temporal_order(cache.keys)
    want = mx.concatenate([k[..., :2, :], k[..., 11:, :]], axis=2)
    assert mx.array_equal(held, want)


def test_rotating_trim_before_wrap_and_refusal_after():
    cache = RotatingKVCache(8)
    cache.update_and_fetch(*kv(8, 0))
    assert cache.is_trimmable() and cache.trim(3) == 3 and cache.offset == 5
    k, v = kv(1, 1)
    keys, _ = cache.update_and_fetch(k, v)
    assert keys.shape[2] == 6 and mx.array_equal(keys[..., 5:, :], k)
    cache.update_and_fetch(*kv(4, 2))  # 10 tokens seen: wrapped
    assert not cache.is_trimmable()
    with pytest.raises(RuntimeError, match="wrapped"):
        cache.trim(1)
    assert cache.offset == 10


def test_rotating_state_round_trip_continues_identically():
    cache = RotatingKVCache(5, keep=1)
    cache.update_and_fetch(*kv(4, 0))
    for i in range(4):
        cache.update_and_fetch(*kv(1, 10 + i))
    clone = RotatingKVCache.from_state(cache.state, cache.meta_state)
    for num in (1, 3, 1):
        k, v = kv(num, 20 + num)
        mask, clone_mask = cache.make_mask(num, return_array=True), clone.make_mask(num, return_array=True)
        assert (mask is None and clone_mask is None) or mx.array_equal(mask, clone_mask)
        assert mx.array_equal(cache.update_and_fetch(k, v)[0], clone.update_and_fetch(k, v)[0])


def test_rotating_rejects_bad_arguments():
    with pytest.raises(ValueError, match="keep < max_size"):
        RotatingKVCache(4, keep=4)
    with pytest.raises(ValueError, match="window_size=9"):  # longer than the window held
        RotatingKVCache(8).make_mask(2, window_size=9)


def test_arrays_cache_is_not_trimmable():
    cache = ArraysCache(2)
    assert cache.empty()
    cache[0] = mx.zeros((1, 3, 4))
    cache[1] = mx.ones((1, 2, 4, 4))
    assert not cache.is_trimmable() and cache.trim(0) == 0
    with pytest.raises(RuntimeError, match="ArraysCache"):
        cache.trim(1)
    clone = ArraysCache.from_state(cache.state, cache.meta_state)
    assert mx.array_equal(clone[1], cache[1]) and cache.nbytes == (12 + 32) * 4


def test_cache_list_forwards_to_children():
    kv_cache, rotating = KVCache(), RotatingKVCache(4)
    combined = CacheList(kv_cache, rotating)
    kv_cache.update_and_fetch(*kv(3, 0))
    rotating.update_and_fetch(*kv(3, 1))
    assert combined.is_trimmable() and combined.trim(2) == 2
    assert kv_cache.offset == 1 and rotating.offset == 1
    clone = CacheList.from_state(combined.state, combined.meta_state)
    assert isinstance(clone[1], RotatingKVCache) and clone[1].offset == 1
    combined = CacheList(KVCache(), ArraysCache(1))
    assert not combined.is_trimmable()


def test_cache_list_masks_like_its_masking_children():
    kv_cache, state = KVCache(), ArraysCache(1)
    kv_cache.update_and_fetch(*kv(6, 0))
    combined = CacheList(state, kv_cache)
    h = mx.zeros((1, 3, 8))
    for num in (1, 3):
        for window in (None, 4):
            want = kv_cache.make_mask(num, window_size=window, return_array=True)
            got = create_attention_mask(h[:, :num], combined, window_size=window, return_array=True)
            assert (got is None and want is None) or mx.array_equal(got, want)
    assert mx.array_equal(combined.make_mask(3, return_array=True), create_causal_mask(3, offset=6))
    assert CacheList(ArraysCache(1), ArraysCache(2)).make_mask(3) is None
    behind = KVCache()
    behind.update_and_fetch(*kv(4, 1))
    with pytest.raises(ValueError, match=r"\(3, 9\) from KVCache, \(3, 7\) from KVCache"):
        CacheList(kv_cache, behind).make_mask(3, return_array=True)


class _TwoLayerModel:
    def make_cache(self):
        return [KVCache(), KVCache()]


def test_make_prompt_cache_bounds_kv_caches():
    caches = make_prompt_cache(_TwoLayerModel(), max_kv_size=16)
    assert all(isinstance(c, RotatingKVCache) and c.max_size == 16 and c.keep == 4 for c in caches)
    assert all(type(c) is KVCache for c in make_prompt_cache(_TwoLayerModel()))
    with pytest.raises(ValueError, match="max_kv_size"):
        make_prompt_cache(_TwoLayerModel(), max_kv_size=4)


def test_trim_prompt_cache_all_or_nothing():
    caches = [KVCache(), KVCache()]
    for c in caches:
        c.update_and_fetch(*kv(5, 0))
    assert can_trim_prompt_cache(caches) and trim_prompt_cache(caches, 2) == 2
    assert [c.offset for c in caches] == [3, 3]
    assert trim_prompt_cache(caches, 0) == 0 and trim_prompt_cache([], 3) == 0
    mixed = [KVCache(), ArraysCache(2)]
    mixed[0].update_and_fetch(*kv(5, 0))
    assert not can_trim_prompt_cache(mixed)
    with pytest.raises(ValueError, match="ArraysCache"):
        trim_prompt_cache(mixed, 1)
    assert mixed[0].offset == 5


def _decaying_sum_forward(cache, inputs):
    """A toy recurrent layer: state <- 0.5 * state + x per token, recording rollbacks."""
    before = cache[0] if cache[0] is not None else mx.zeros((2,))

    def state_after(m):
        state = before
        for x in inputs[:m]:
            state = 0.5 * state + x
        return [state]

    if cache.speculating:
        cache.record_rollback(len(inputs), state_after, [cache[0]])
    cache[0] = state_after(len(inputs))[0]


def test_arrays_cache_rollback_stacks_and_keeps_prefix():
    cache = ArraysCache(1)
    _decaying_sum_forward(cache, [mx.array([1.0, 2.0])])
    with pytest.raises(RuntimeError, match="not speculating"):
        cache.record_rollback(1, lambda m: [None], [None])
    cache.start_speculation()
    assert cache.is_trimmable()
    steps = [mx.array([float(i), -1.0]) for i in range(5)]
    _decaying_sum_forward(cache, steps[:3])  # a verify chunk
    _decaying_sum_forward(cache, steps[3:4])  # two single-token draft steps
    _decaying_sum_forward(cache, steps[4:])

    def fed(n):
        plain = ArraysCache(1)
        _decaying_sum_forward(plain, [mx.array([1.0, 2.0])] + steps[:n])
        return plain[0]

    assert cache.trim(3) == 3  # both single steps and the chunk's last token
    assert mx.array_equal(cache[0], fed(2))
    assert cache.trim(1) == 1  # the chunk's shorter record serves again
    assert mx.array_equal(cache[0], fed(1))
    with pytest.raises(RuntimeError, match="Cannot roll back 2 tokens: only 1"):
        cache.trim(2)
    assert cache.trim(1) == 1 and mx.array_equal(cache[0], fed(0))
    cache.stop_speculation()
    assert not cache.is_trimmable() and not cache.speculating


def test_arrays_cache_rollback_window_drops_oldest():
    cache = ArraysCache(1)
    cache.start_speculation(rollback_window=3)
    for i in range(6):
        _decaying_sum_forward(cache, [mx.array([float(i), 0.0])])
    assert cache._rollbacks.num_tokens == 3
    with pytest.raises(RuntimeError, match="rollback window 3"):
        cache.trim(4)


def test_cache_list_speculation_reaches_children():
    combined = CacheList(KVCache(), ArraysCache(1))
    assert combined.needs_layer_records and not combined.is_trimmable()
    combined.start_speculation()
    assert combined.is_trimmable() and combined[1].speculating
    combined.stop_speculation()
    assert not combined[1].speculating


# --- ChunkedKVCache (Llama 4's chunked attention) ------------------------------------------


@pytest.mark.parametrize("pattern", UPDATE_PATTERNS)
def test_chunked_attention_equals_chunk_masked_full_attention(pattern):
    """Whatever the mix of updates, attention through the one-chunk ring equals
    attention over the full history under the chunked causal mask."""
    from mlx_lm.models.cache import ChunkedKVCache
    from mlx_lm.models.masks import create_chunked_mask

    chunk = 6
    cache = ChunkedKVCache(chunk)
    all_k, all_v = kv(sum(pattern), 0)
    queries, _ = kv(sum(pattern), 1)
    start = 0
    for step, num in enumerate(pattern):
        q = queries[..., start : start + num, :]
        mask = cache.make_mask(num)
        keys, values = cache.update_and_fetch(all_k[..., start : start + num, :], all_v[..., start : start + num, :])
        got = attend(q, keys, values, mask)
        ref_mask = create_chunked_mask(num, start, chunk)
        want = attend(q, all_k[..., : start + num, :], all_v[..., : start + num, :], ref_mask)
        assert mx.allclose(got, want, atol=1e-5), f"update {step} ({num} tokens)"
        start += num
        assert cache.offset == start and cache.size() == min(start, chunk)


def chunked_fed(chunk_updates, num_tokens, chunk=4):
    """A ChunkedKVCache prefilled with 6 tokens, then fed the first num_tokens of
    `chunk_updates` in the same updates (the last cut short)."""
    from mlx_lm.models.cache import ChunkedKVCache

    cache = ChunkedKVCache(chunk)
    cache.update_and_fetch(*kv(6, 50))
    for k, v in chunk_updates:
        if num_tokens <= 0:
            break
        take = min(num_tokens, k.shape[2])
        cache.update_and_fetch(k[..., :take, :], v[..., :take, :])
        num_tokens -= take
    return cache


@pytest.mark.parametrize("pattern", [(7,), (1, 1, 1, 1, 1, 1), (2, 1, 4), (3, 5)])
def test_chunked_rollback_across_chunk_edges_is_exact(pattern):
    """Verify and draft updates that cross chunk edges (chunks of 4, offset 6: edges at
    8 and 12), trimmed back by every amount, leave the cache equal bit for bit to one
    fed only what it still holds, with the same next mask and output."""
    updates = [kv(num, 60 + i) for i, num in enumerate(pattern)]
    total = sum(pattern)
    for n in range(total + 1):
        cache = chunked_fed([], 0)
        cache.start_speculation()
        for k, v in updates:
            cache.update_and_fetch(k, v)
        assert cache.trim(n) == n
        fed = chunked_fed(updates, total - n)
        assert cache.meta_state == fed.meta_state and type(cache) is type(fed)
        assert all(mx.array_equal(x, y) for x, y in zip(cache.state, fed.state)), n
        for num in (1, 3):
            got_mask, want_mask = cache.make_mask(num), fed.make_mask(num)
            assert (got_mask is None and want_mask is None) or mx.array_equal(got_mask, want_mask), n
        k, v = kv(1, 99)
        assert all(mx.array_equal(x, y) for x, y in zip(cache.update_and_fetch(k, v), fed.update_and_fetch(k, v)))


def test_chunked_cache_file_round_trip_and_refusals(tmp_path):
    from mlx_lm.models.cache import ChunkedKVCache, load_prompt_cache, save_prompt_cache

    cache = ChunkedKVCache(4)
    cache.update_and_fetch(*kv(7, 0))
    save_prompt_cache(str(tmp_path / "c.safetensors"), [cache])
    (loaded,) = load_prompt_cache(str(tmp_path / "c.safetensors"))
    assert type(loaded) is ChunkedKVCache and loaded.chunk_size == 4 and loaded.offset == 7
    k, v = kv(1, 1)
    assert all(mx.array_equal(x, y) for x, y in zip(loaded.update_and_fetch(k, v), cache.update_and_fetch(k, v)))
    with pytest.raises(ValueError, match="masks by its chunks of 4; got window_size=2"):
        cache.make_mask(2, window_size=2)
    with pytest.raises(ValueError, match="ChunkedKVCache .* cannot be quantized"):
        cache.to_quantized()
    assert not cache.is_trimmable()  # wrapped and not speculating: the evicted rows are gone
    with pytest.raises(RuntimeError, match="has wrapped"):
        cache.trim(1)
