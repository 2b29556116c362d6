"""Batched caches (mlx_lm/models/batch_cache.py) through upstream mlx-lm 0.32.2's batch
cache API: left padding given at construction or by prepare/finalize, merge from single
caches (`KVCache.merge`), extend, filter, extract, keys and values, left_padding; each
row of a padded batch computes what it computes alone. And where this project differs
on purpose: filter returns a new batch, trim raises instead of clamping, recurrent
caches take no padding and no empty row joins a row with state."""

import mlx.core as mx
import pytest

from checkpoints import TINY_CONFIGS
from family_checks import random_model
from mlx_lm.models import batch_cache
from mlx_lm.models.batch_cache import NO_TOKEN, BatchArraysCache, BatchKVCache, BatchRotatingKVCache, merge_caches
from mlx_lm.models.cache import (
    ArraysCache, CacheList, KVCache, QuantizedKVCache, RotatingKVCache, save_prompt_cache,
)

SLIDING = dict(
    model_type="mistral", hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, vocab_size=256, sliding_window=6, layer_types=["full_attention", "sliding_attention"],
    rms_norm_eps=1e-5, rope_theta=10000.0,
)
CONFIGS = {"qwen3": TINY_CONFIGS["qwen3"], "mistral_sliding": SLIDING}
_MODELS = {}


def tiny_model(name):
    if name not in _MODELS:
        _MODELS[name] = random_model(CONFIGS[name], scale=0.5)
    return _MODELS[name]


def prompt(length, seed):
    return mx.random.randint(1, 200, (length,), key=mx.random.key(seed)).tolist()


def padded_caches(model, left_padding):
    """The model's layers as upstream's batch caches, each row starting with its padding."""
    caches = []
    for entry in model.make_cache():
        if type(entry) is KVCache:
            caches.append(BatchKVCache(left_padding))
        else:
            assert type(entry) is RotatingKVCache and not entry.keep
            caches.append(BatchRotatingKVCache(entry.max_size, left_padding))
    return caches


def solo_logits(model, tokens, steps):
    """Logits after the prompt, then after each of `steps` tokens fed one at a time."""
    cache = model.make_cache()
    out = [model(mx.array([tokens]), cache=cache)[0, -1]]
    for token in steps:
        out.append(model(mx.array([[token]]), cache=cache)[0, -1])
    return out


def assert_close(a, b):
    assert not mx.isnan(a).any().item()
    assert mx.allclose(a, b, atol=2e-4, rtol=2e-4).item(), mx.abs(a - b).max().item()


@pytest.mark.parametrize("name", list(CONFIGS))
def test_left_padded_rows_compute_what_they_compute_alone(name):
    """Upstream's way: prompts left-padded to one length into BatchKVCache(left_padding)
    (a window of 6 wraps: prompts of 9 and decoding past them)."""
    model = tiny_model(name)
    prompts = [prompt(9, 1), prompt(4, 2), prompt(1, 3)]
    width = max(map(len, prompts))
    padding = [width - len(p) for p in prompts]
    caches = padded_caches(model, padding)
    batch = mx.array([[0] * n + p for n, p in zip(padding, prompts)])
    steps = [prompt(8, 10 + b) for b in range(3)]
    got = [model(batch, cache=caches)[:, -1]]
    for t in range(8):
        got.append(model(mx.array([[s[t]] for s in steps]), cache=caches)[:, -1])
    assert caches[0].offset.tolist() == [17, 12, 9]
    for b, p in enumerate(prompts):
        for step, want in enumerate(solo_logits(model, p, steps[b])):
            assert_close(got[step][b], want)


@pytest.mark.parametrize("name", list(CONFIGS))
def test_right_padded_prefill_becomes_holes_at_finalize(name):
    """Upstream's generator: merged caches, then the next prompts right-padded between
    prepare(lengths, right_padding) and finalize(); each row then decodes as alone."""
    model = tiny_model(name)
    firsts, seconds = [prompt(5, 4), prompt(2, 5)], [prompt(3, 6), prompt(7, 7)]
    row_caches = []
    for p in firsts:
        row_caches.append(model.make_cache())
        model(mx.array([p]), cache=row_caches[-1])
    caches = merge_caches(row_caches)
    lengths = [len(p) for p in seconds]
    padding = [max(lengths) - n for n in lengths]
    for c in caches:
        c.prepare(lengths=lengths, right_padding=padding)
    logits = model(mx.array([p + [0] * n for p, n in zip(seconds, padding)]), cache=caches)
    for c in caches:
        c.finalize()
    steps = [prompt(7, 20 + b) for b in range(2)]
    decoded = [model(mx.array([[s[t]] for s in steps]), cache=caches)[:, -1] for t in range(7)]
    for b in range(2):
        want = solo_logits(model, firsts[b] + seconds[b], steps[b])
        assert_close(logits[b, lengths[b] - 1], want[0])
        for t in range(7):
            assert_close(decoded[t][b], want[t + 1])


def test_batch_kv_mask_options_in_upstreams_order():
    """BatchKVCache.make_mask(N, True) asks for an array, as upstream's does (the
    second option is a window for the other caches): one query of a gapless batch."""
    cache = merge_caches([[KVCache()], [KVCache()]])[0]
    cache.update_and_fetch(mx.zeros((2, 1, 3, 1)), mx.zeros((2, 1, 3, 1)))
    assert cache.make_mask(1) is None
    assert mx.array_equal(cache.make_mask(1, True), cache.make_mask(1, return_array=True))
    assert cache.make_mask(1, True).shape == (2, 1, 1, 4)
    windowed = cache.make_mask(2, window_size=2)[0, 0, 1].tolist()  # row 0's second query
    assert windowed[-2:] == [True, True] and sum(windowed) == 2


def test_constructor_padding_offsets_and_mask():
    cache = BatchKVCache(left_padding=[2, 0])
    assert cache.offset.tolist() == [-2, 0] and cache.left_padding.tolist() == [2, 0] and cache.empty()
    F, T = False, True
    # Before any token: row 0's first two queries are padding and see nothing.
    assert cache.make_mask(3)[:, 0].tolist() == [[[F] * 3, [F] * 3, [F, F, T]], [[T, F, F], [T, T, F], [T, T, T]]]
    keys = mx.arange(6, dtype=mx.float32).reshape(2, 1, 3, 1)
    k, v = cache.update_and_fetch(keys, keys)
    assert k.shape == (2, 1, 3, 1) and cache.keys.shape == (2, 1, 256, 1)
    assert cache.offset.tolist() == [1, 3] and cache.left_padding.tolist() == [2, 0] and cache.num_invalid == [2, 0]
    assert cache.positions[:, :3].tolist() == [[NO_TOKEN, NO_TOKEN, 0], [0, 1, 2]]
    assert cache.make_mask(1)[:, 0, 0].tolist() == [[F, F, T, T], [T, T, T, T]]
    assert mx.array_equal(cache.keys_and_values()[0], keys)
    row = cache.extract(0)
    assert row.offset == 1 and row.state[0].tolist() == [[[[2.0]]]]
    assert cache.size() == 3 and cache.nbytes == 2 * 2 * 256 * 4
    with pytest.raises(ValueError, match="cannot be negative"):
        BatchKVCache([1, -1])
    with pytest.raises(ValueError, match="3 rows cannot update a batch of 2"):
        cache.update_and_fetch(mx.zeros((3, 1, 1, 1)), mx.zeros((3, 1, 1, 1)))


def test_extend_and_filter_are_in_place():
    a, b = BatchKVCache([2, 1, 2]), BatchKVCache([3, 0])
    a.update_and_fetch(mx.ones((3, 1, 8, 2), mx.bfloat16), mx.ones((3, 1, 8, 2), mx.bfloat16))
    b.update_and_fetch(mx.ones((2, 1, 4, 2), mx.bfloat16), mx.ones((2, 1, 4, 2), mx.bfloat16))
    assert a.extend(b) is a
    assert a.offset.tolist() == [6, 7, 6, 1, 4] and a.left_padding.tolist() == [2, 1, 2, 7, 4]
    empty = BatchKVCache.merge([KVCache()])
    a.extend(empty)  # a new row with nothing yet keeps the dtype
    assert a.keys.dtype == mx.bfloat16 and a.offset.tolist() == [6, 7, 6, 1, 4, 0]
    with pytest.raises(IndexError, match=r"rows \[6\] do not exist in a batch of 6"):
        a.filter([0, 6])
    assert a.batch_size == 6  # a bad filter changes nothing
    # As upstream's: in place (code that ignores the return value keeps working), and returns self.
    assert a.filter(mx.array([3, 1])) is a
    assert a.batch_size == 2 and a.offset.tolist() == [1, 7]
    assert a.left_padding.tolist() == [6, 0] and a.width == 7  # the column no kept row holds is gone
    with pytest.raises(ValueError, match="cannot be extended by a BatchRotatingKVCache"):
        a.extend(BatchRotatingKVCache(4, [0]))


def test_single_caches_merge_into_their_batched_classes():
    from mlx_lm.models import cache as cache_module

    assert cache_module.BatchKVCache is BatchKVCache and cache_module.BatchArraysCache is BatchArraysCache
    with pytest.raises(AttributeError, match="BatchNothing"):
        cache_module.BatchNothing
    kv = [KVCache(), KVCache()]
    kv[1].update_and_fetch(mx.ones((1, 2, 3, 4)), mx.ones((1, 2, 3, 4)))
    merged = KVCache.merge(kv)
    assert type(merged) is BatchKVCache and merged.offset.tolist() == [0, 3]
    assert merged.extract(0).empty() and mx.array_equal(merged.extract(1).state[0], kv[1].state[0])
    rotating = RotatingKVCache(4)
    for t in range(6):
        rotating.update_and_fetch(mx.full((1, 1, 1, 2), float(t)), mx.full((1, 1, 1, 2), float(t)))
    batch = RotatingKVCache.merge([rotating])
    assert type(batch) is BatchRotatingKVCache and batch.extract(0).state[0][0, 0, :, 0].tolist() == [2, 3, 4, 5]
    arrays = ArraysCache(2)
    arrays[0], arrays[1] = mx.ones((1, 3)), mx.zeros((1, 2))
    stacked = ArraysCache.merge([arrays, arrays])
    assert type(stacked) is BatchArraysCache and stacked[0].shape == (2, 3)
    pair = CacheList.merge([CacheList(KVCache(), ArraysCache(1))] * 2)
    assert [type(c).__name__ for c in pair.caches] == ["BatchKVCache", "BatchArraysCache"]
    with pytest.raises(ValueError, match="different cache kinds"):
        KVCache.merge([KVCache(), RotatingKVCache(4)])
    with pytest.raises(ValueError, match="at least one sequence"):
        KVCache.merge([])


def test_trim_raises_where_upstream_clamps():
    """Upstream's BatchKVCache.trim(n) trims min(n, columns) and returns it; a clamp here
    would leave some layers (or rows) at other positions than the rest."""
    cache = BatchKVCache([1, 0])
    cache.update_and_fetch(mx.ones((2, 1, 3, 2)), mx.ones((2, 1, 3, 2)))  # rows of 2 and 3 tokens
    with pytest.raises(ValueError, match="from rows holding 3 columns"):
        cache.trim(4)
    with pytest.raises(ValueError, match=r"from rows of lengths \[2, 3\]"):
        cache.trim(3)
    assert cache.offset.tolist() == [2, 3]  # nothing changed
    assert cache.trim(1) == 1 and cache.offset.tolist() == [1, 2]


def test_recurrent_caches_take_no_padding():
    """Upstream's recurrent layers skip padded inputs through ArraysCache's mask; the
    ones here read no mask, so padding is refused rather than fed into the state."""
    with pytest.raises(ValueError, match=r"left_padding=\[0, 2\]: the recurrent layers do not mask"):
        ArraysCache(2, left_padding=[0, 2])
    assert ArraysCache(2, left_padding=[0, 0]).empty()
    batch = ArraysCache.merge([ArraysCache(1), ArraysCache(1)])
    assert batch.batch_size == 2 and batch.filter([1]).batch_size == 1  # rows without state are still rows
    with pytest.raises(ValueError, match=r"right_padding=\[1, 0\]"):
        batch.prepare(lengths=[2, 3], right_padding=[1, 0])
    batch.prepare(lengths=[3, 3], right_padding=[0, 0])
    batch.finalize()
    # Upstream fills an empty row with zeros; a layer may start a sequence otherwise.
    full = ArraysCache(1)
    full[0] = mx.ones((1, 4))
    with pytest.raises(ValueError, match="has seen no token cannot join one that has"):
        ArraysCache.merge([ArraysCache(1), full])


def test_prepare_and_finalize_check_what_they_are_given():
    cache = BatchKVCache([0, 0])
    cache.prepare(left_padding=[1, 0])
    assert cache.left_padding.tolist() == [1, 0] and cache.offset.tolist() == [-1, 0]
    cache.update_and_fetch(mx.ones((2, 1, 2, 2)), mx.ones((2, 1, 2, 2)))
    with pytest.raises(ValueError, match="only be added to an empty BatchKVCache"):
        cache.prepare(left_padding=[1, 0])
    with pytest.raises(ValueError, match="one count per row of the batch"):
        cache.prepare(lengths=[1], right_padding=[1])
    cache.prepare(lengths=[2, 1], right_padding=[0, 1])
    with pytest.raises(ValueError, match="finalize"):
        cache.filter([0])
    cache.update_and_fetch(mx.ones((2, 1, 1, 2)), mx.ones((2, 1, 1, 2)))  # one token short
    with pytest.raises(ValueError, match=r"announced \[2, 1\] tokens then right padding \[0, 1\].*fed \[1, 1\]"):
        cache.finalize()


def test_a_batch_is_not_saved_as_it_is(tmp_path):
    cache = BatchKVCache.merge([KVCache()])
    with pytest.raises(ValueError, match="save each row's cache"):
        save_prompt_cache(str(tmp_path / "batch.safetensors"), [cache])
    assert not list(tmp_path.iterdir())


def test_a_window_used_directly_stays_bounded(monkeypatch):
    """Driven by a model alone (no generator calling make_room), a batched window still
    drops what no query will see: make_mask and update_and_fetch make room."""
    monkeypatch.setattr(batch_cache._AlignedKV, "step", 8)
    batch, alone = BatchRotatingKVCache(4, [0]), RotatingKVCache(4)
    for t in range(40):
        kv = mx.full((1, 1, 1, 1), float(t))
        mask = batch.make_mask(1)
        keys, _ = batch.update_and_fetch(kv, kv)
        alone.update_and_fetch(kv, kv)
        assert batch.capacity <= 8 and keys.shape[2] == (mask.shape[-1] if mask is not None else keys.shape[2])
    assert batch.extract(0).state[0][0, 0, :, 0].tolist() == alone._temporal_order(alone.keys)[0, 0, :, 0].tolist()


def test_quantized_rows_take_upstream_constructor():
    cache = batch_cache.BatchQuantizedKVCache([1, 0], group_size=32, bits=4)
    cache.update_and_fetch(mx.ones((2, 1, 2, 32)), mx.ones((2, 1, 2, 32)))
    assert len(cache.keys) == 3 and cache.offset.tolist() == [1, 2]
    row = cache.extract(0)
    assert type(row) is QuantizedKVCache and row.offset == 1
    with pytest.raises(ValueError, match="kv_bits=7"):
        batch_cache.BatchQuantizedKVCache([0], bits=7)
