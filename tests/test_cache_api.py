"""Upstream mlx-lm 0.32.2's cache API beyond the protocol (models/cache.py and the
modules it re-exports): ConcatenateKVCache, create_attention_mask, dynamic_roll,
TokenBuffer, PromptTrie, RotatingKVCache.keys_and_values, ArraysCache rows, and the
batched classes importable from both of their homes."""

import mlx.core as mx
import numpy as np
import pytest

from mlx_lm.models import batch_cache
from mlx_lm.models import cache as cache_module
from mlx_lm.models.cache import (
    ArraysCache,
    BatchRotatingKVCache,
    ChunkedKVCache,
    ConcatenateKVCache,
    KVCache,
    PromptTrie,
    PromptTrieResult,
    RotatingKVCache,
    TokenBuffer,
    create_attention_mask,
    dynamic_roll,
)
from mlx_lm.models.masks import create_causal_mask
from test_cache import B, D, H, attend, kv  # (1, 2, _, 8) random keys and values, attention over them


# ConcatenateKVCache


def test_concatenate_cache_returns_every_token_in_order():
    cache, (k1, v1), (k2, v2) = ConcatenateKVCache(), kv(5, 0), kv(2, 1)
    assert cache.empty() and cache.keys_and_values() == (None, None) and cache.nbytes == 0
    cache.update_and_fetch(k1, v1)
    keys, values = cache.update_and_fetch(k2, v2)
    assert cache.offset == cache.size() == 7
    assert mx.array_equal(keys, mx.concatenate([k1, k2], axis=2))
    assert mx.array_equal(values, mx.concatenate([v1, v2], axis=2))
    assert all(mx.array_equal(a, b) for a, b in zip(cache.keys_and_values(), (keys, values)))
    assert cache.keys.shape[2] == 7 and cache.nbytes == 2 * 7 * B * H * D * 4  # no spare rows


def test_concatenate_cache_attends_like_kv_cache():
    ours, reference = ConcatenateKVCache(), KVCache()
    for num_tokens, seed in [(6, 0), (1, 1), (3, 2)]:
        k, v = kv(num_tokens, seed)
        q = kv(num_tokens, seed + 10)[0]
        mask = ours.make_mask(num_tokens)
        assert (mask is None) == (reference.make_mask(num_tokens) is None)
        got = attend(q, *ours.update_and_fetch(k, v), mask)
        want = attend(q, *reference.update_and_fetch(k, v), reference.make_mask(num_tokens) if mask is None else mask)
        assert mx.allclose(got, want, atol=1e-6)


def test_concatenate_cache_trim_drops_the_rows_exactly():
    cache, fed = ConcatenateKVCache(), kv(9, 0)
    cache.update_and_fetch(*fed)
    assert cache.is_trimmable() and cache.trim(0) == 0 and cache.trim(-2) == 0
    assert cache.trim(4) == 4 and cache.offset == 5
    keys, values = cache.keys_and_values()  # upstream would still return all 9
    assert keys.shape[2] == 5 and mx.array_equal(keys, fed[0][..., :5, :])
    fresh = ConcatenateKVCache()
    fresh.update_and_fetch(fed[0][..., :5, :], fed[1][..., :5, :])
    more = kv(2, 3)
    after_trim, after_feed = cache.update_and_fetch(*more), fresh.update_and_fetch(*more)
    assert all(mx.array_equal(a, b) for a, b in zip(after_trim, after_feed))
    with pytest.raises(ValueError, match="Cannot trim 8 tokens from a ConcatenateKVCache holding 7"):
        cache.trim(8)
    assert cache.offset == 7 and cache.keys.shape[2] == 7  # left whole
    assert cache.trim(7) == 7 and cache.empty() and cache.state == []


def test_concatenate_cache_state_rebuilds_it():
    cache = ConcatenateKVCache()
    cache.update_and_fetch(*kv(4, 0))
    rebuilt = ConcatenateKVCache.from_state(cache.state, cache.meta_state)
    assert rebuilt.offset == 4 and all(mx.array_equal(a, b) for a, b in zip(rebuilt.state, cache.state))
    assert ConcatenateKVCache.from_state([], "").empty()


def test_concatenate_cache_is_a_registered_class():
    assert cache_module.CACHE_CLASSES["ConcatenateKVCache"] is ConcatenateKVCache


# create_attention_mask


@pytest.mark.parametrize("num_queries,offset,window", [(1, 0, None), (1, 7, None), (4, 0, None), (4, 9, None),
                                                        (1, 3, 4), (1, 5, 4), (3, 0, 4), (3, 2, 4), (6, 0, 4)])
def test_create_attention_mask_attends_as_upstreams_array_would(num_queries, offset, window):
    mask = create_attention_mask(num_queries, offset, False, window)
    full = create_causal_mask(num_queries, offset, window)  # what upstream returns for a window
    q, (keys, values) = kv(num_queries, 1)[0], kv(offset + num_queries, 2)
    assert mx.allclose(attend(q, keys, values, mask), attend(q, keys, values, full), atol=1e-6)
    if window is None:
        assert mask == (None if num_queries == 1 else "causal")
    array = create_attention_mask(num_queries, offset, True, window)
    assert array is None or mx.array_equal(array, full)
    assert (array is None) == (num_queries == 1 and (window is None or offset < window))


def test_create_attention_mask_is_what_kv_caches_mask_with():
    cache = KVCache()
    cache.update_and_fetch(*kv(5, 0))
    for args in [(1, None, False), (3, None, False), (3, 4, False), (3, None, True)]:
        num_queries, window, as_array = args
        got, want = cache.make_mask(num_queries, window, as_array), create_attention_mask(num_queries, 5, as_array, window)
        assert (got == want) if isinstance(want, str) or want is None else mx.array_equal(got, want)


def test_create_attention_mask_refuses_an_empty_window():
    with pytest.raises(ValueError, match="window_size=0"):
        create_attention_mask(2, 0, False, 0)


# dynamic_roll


def naive_roll(x, shifts, axis):
    """Each index of the axes before `axis` rolled by its own shift, with np.roll."""
    x = np.asarray(x)
    shifts = np.broadcast_to(np.asarray(shifts), x.shape[:axis])
    out = np.empty_like(x)
    for index in np.ndindex(*x.shape[:axis]):
        out[index] = np.roll(x[index], int(shifts[index]), axis=0)
    return out


@pytest.mark.parametrize("shape,axis,shifts", [
    ((3, 2, 5, 4), 2, [[1], [4], [-2]]),  # a batch's keys, one shift per row (upstream's use)
    ((3, 2, 5, 4), 2, [[0, 7], [2, 3], [1, 1]]),  # per row and head
    ((2, 6), 1, [5, -1]),
    ((2, 6), -1, 3),  # one shift for all, negative axis
    ((4, 3), 0, 1),
])
def test_dynamic_roll_matches_a_roll_per_index(shape, axis, shifts):
    x = mx.arange(int(np.prod(shape))).reshape(shape)
    got = dynamic_roll(x, mx.array(shifts) if isinstance(shifts, list) else shifts, axis)
    assert np.array_equal(np.array(got), naive_roll(np.array(x), shifts, axis % len(shape)))


@pytest.mark.parametrize("axis,shifts,message", [
    (3, 1, "axis 3 is out of range"),
    (1, mx.array([[1], [2]]), r"broadcastable to the axes before axis 1 \(2,\)"),
    (1, mx.array([0.5, 1.0]), "dtype mlx.core.float32"),
])
def test_dynamic_roll_refuses_bad_axes_and_shifts(axis, shifts, message):
    with pytest.raises(ValueError, match=message):
        dynamic_roll(mx.zeros((2, 6)), shifts, axis)


# TokenBuffer


def test_token_buffer_appends_in_blocks():
    buffer = TokenBuffer([3, 1, 4])
    assert buffer.tokens.tolist() == [3, 1, 4] and buffer.tokens.dtype == mx.int32
    assert buffer.update_and_fetch([1]).tolist() == [3, 1, 4, 1]
    grown = buffer.update_and_fetch(mx.arange(300))
    assert grown.tolist() == [3, 1, 4, 1] + list(range(300))
    assert buffer._buffer.size == 512  # room for 304 rounded up to blocks of 256
    assert buffer.state.tolist() == grown.tolist()
    assert TokenBuffer().tokens.tolist() == [] and TokenBuffer().update_and_fetch([]).tolist() == []


@pytest.mark.parametrize("tokens,message", [
    ([1.5, 2], r"shape \(2,\) dtype mlx.core.float32"),
    ([[1, 2]], r"shape \(1, 2\)"),
    ("12", "got str"),
])
def test_token_buffer_refuses_what_is_not_token_ids(tokens, message):
    buffer = TokenBuffer([7])
    with pytest.raises(ValueError, match=message):
        buffer.update_and_fetch(tokens)
    assert buffer.tokens.tolist() == [7]  # nothing appended


# PromptTrie


def stored_trie():
    trie = PromptTrie()
    for tokens, value in [([1, 2, 3], "abc"), ([1], "a"), ([1, 2, 3, 4, 5], "abcde"), ([1, 2, 7, 8], "ab78")]:
        assert trie.add("m", tokens, value) is None
    trie.add("other", [1, 2], "other model")
    return trie


@pytest.mark.parametrize("tokens,want", [
    ([1, 2, 3], ([1, 2, 3], None, None, 3)),
    ([1, 2, 3, 4], (None, [1, 2, 3], [1, 2, 3, 4, 5], 4)),  # past a stored prefix, short of a longer one
    ([1, 2, 9], (None, [1], [1, 2, 3], 2)),  # diverges: the nearest continuation of the shared part
    ([1, 5], (None, [1], [1, 2, 3], 1)),  # the one-token prefix counts (upstream skips it)
    ([1, 2, 3, 4, 5, 6], (None, [1, 2, 3, 4, 5], None, 5)),
    ([9], (None, None, None, 0)),
    ([], (None, None, None, 0)),
])
def test_prompt_trie_search_finds_the_nearest_stored_sequences(tokens, want):
    assert stored_trie().search("m", tokens) == PromptTrieResult("m", *want)


def test_prompt_trie_keeps_models_apart_and_stores_any_value():
    trie = stored_trie()
    assert trie.search("unseen", [1, 2]) == PromptTrieResult("unseen", None, None, None, 0)
    assert trie.get("other", [1, 2]) == "other model" and trie.search("other", [1]).longer == [1, 2]
    assert trie.add("m", [1], None) == "a" and trie.get("m", [1]) is None  # None is a value
    assert trie.add("m", [], "empty") is None and trie.search("m", []).exact == []
    assert trie.get("m", mx.array([1, 2, 3])) == "abc"  # ids as an array too


def test_prompt_trie_pop_prunes_and_refuses_what_is_not_stored():
    trie = stored_trie()
    assert trie.pop("m", [1, 2, 7, 8]) == "ab78"
    assert trie.search("m", [1, 2, 7]) == PromptTrieResult("m", None, [1], [1, 2, 3], 2)  # branch gone
    for model, tokens in [("m", [1, 2]), ("m", [1, 2, 7, 8]), ("unseen", [1])]:
        with pytest.raises(KeyError, match=f"no value stored under these {len(tokens)} tokens"):
            trie.pop(model, tokens)
        with pytest.raises(KeyError):
            trie.get(model, tokens)
    assert trie.pop("other", [1, 2]) == "other model"
    assert trie.search("other", [1, 2]) == PromptTrieResult("other", None, None, None, 0)


def test_prompt_trie_pop_prefixes_removes_the_proper_prefixes():
    trie = stored_trie()
    assert trie.pop_prefixes("m", [1, 2, 3, 4, 5]) == [(1, "a"), (3, "abc")]
    assert trie.get("m", [1, 2, 3, 4, 5]) == "abcde" and trie.get("m", [1, 2, 7, 8]) == "ab78"
    assert trie.search("m", [1, 2, 3]) == PromptTrieResult("m", None, None, [1, 2, 3, 4, 5], 3)
    assert trie.pop_prefixes("m", [1, 2, 7, 9]) == [] and trie.pop_prefixes("unseen", [1]) == []
    trie.pop("m", [1, 2, 7, 8])
    assert trie.pop_prefixes("m", [1, 2, 7, 8, 9]) == []  # a pruned branch is simply absent
    assert trie.search("m", [1, 2, 7]).longer == [1, 2, 3, 4, 5]


# RotatingKVCache.keys_and_values


@pytest.mark.parametrize("cls,args", [(RotatingKVCache, (6,)), (RotatingKVCache, (6, 2)), (ChunkedKVCache, (6,))])
def test_rotating_keys_and_values_are_what_a_decode_step_returned(cls, args):
    cache = cls(*args)
    assert cache.keys_and_values() == (None, None)
    cache.update_and_fetch(*kv(4, 0))
    for seed in range(1, 9):  # single-token writes well past the wrap
        fetched = cache.update_and_fetch(*kv(1, seed))
        held = cache.keys_and_values()
        assert all(mx.array_equal(a, b) for a, b in zip(held, fetched))
    assert all(mx.array_equal(a, b) for a, b in zip(cache.keys_and_values(), cache.state))


def test_rotating_keys_and_values_attend_as_the_layer_that_wrote_them():
    """A layer reading another layer's window (the KV-shared layers) with that layer's
    decode mask attends exactly as the writer did."""
    cache = RotatingKVCache(8, keep=1)
    cache.update_and_fetch(*kv(11, 0))  # a multi-token update past the window: newest window held
    assert cache.keys_and_values()[0].shape[2] == 8
    for seed in range(1, 6):
        q = kv(1, seed + 20)[0]
        mask = cache.make_mask(1, window_size=5)
        written = attend(q, *cache.update_and_fetch(*kv(1, seed)), mask)
        assert mx.array_equal(attend(q, *cache.keys_and_values(), mask), written)


# ArraysCache rows


def test_arrays_cache_rows_extract_as_copies():
    states = ArraysCache(2)
    assert states.batch_size == 1
    states[0], states[1] = mx.arange(12, dtype=mx.float32).reshape(3, 4), mx.ones((3, 2, 2))
    assert states.batch_size == 3
    row = states.extract(1)
    assert type(row) is ArraysCache and row[0].tolist() == [[4, 5, 6, 7]] and row[1].shape == (1, 2, 2)
    with pytest.raises(IndexError, match="row 3 does not exist in an ArraysCache of 3 rows"):
        states.extract(3)


def test_arrays_cache_advance_as_upstreams_layers_call_it():
    """Upstream's recurrent layers call cache.advance(L) after each forward: here no
    padding is held, so the state and its (absent) mask stay as they are."""
    states = ArraysCache(1)
    states[0] = mx.ones((1, 3))
    states.advance(5)
    assert states[0].tolist() == [[1, 1, 1]] and states.make_mask(2) is None


# The batched classes: both homes, and what they refuse


def test_batched_names_import_from_cache_and_batch_cache():
    names = ["BatchKVCache", "BatchRotatingKVCache", "BatchChunkedKVCache", "BatchQuantizedKVCache",
             "BatchArraysCache", "BatchCacheList", "BatchSharedKVReader"]
    for name in names:
        assert getattr(cache_module, name) is getattr(batch_cache, name)
    for name in ["NO_TOKEN", "merge_caches", "extend_caches", "filter_caches", "extract_caches", "make_room",
                 "trim_rows", "bookkeeping", "extend_entry"]:
        assert callable(getattr(batch_cache, name)) or name == "NO_TOKEN"


def test_batch_rotating_cache_refuses_quantization_as_its_rows_do():
    with pytest.raises(ValueError, match="cannot be quantized"):
        BatchRotatingKVCache(8, [0, 1]).to_quantized(bits=4)
