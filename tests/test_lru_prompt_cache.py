"""models/lru_prompt_cache.py: copies independent of the stored entry for every cache class,
the reuse rules (strict prefixes always, longer or diverging entries only when
trimmable, one token always left to feed), eviction, and exact reuse with real models."""

import mlx.core as mx
import numpy as np
import pytest
from checkpoints import TINY_CONFIGS, write_checkpoint

from mlx_lm.generate import generate_step
from mlx_lm.models.lru_prompt_cache import LRUPromptCache, common_prefix_length, copy_prompt_cache
from mlx_lm.models.checkpoints import CheckpointedCache, maybe_snapshot
from mlx_lm.models.cache import (
    ArraysCache,
    CacheList,
    KVCache,
    QuantizedKVCache,
    RotatingKVCache,
    make_prompt_cache,
)
from mlx_lm.utils import load

def kv(num_tokens, seed, dim=32):
    rng = np.random.default_rng(seed)
    shape = (1, 2, num_tokens, dim)
    return tuple(mx.array(rng.standard_normal(shape), dtype=mx.float32) for _ in range(2))


def filled(cache, *updates):
    for num_tokens, seed in updates:
        cache.update_and_fetch(*kv(num_tokens, seed))
    return cache


def arrays_cache():
    cache = ArraysCache(2)
    cache[0], cache[1] = mx.ones((1, 3, 4)), mx.arange(6, dtype=mx.float32).reshape(1, 2, 3)
    return cache


CACHES = {
    "kv": lambda: filled(KVCache(), (5, 0), (1, 1)),  # spare buffer rows past the offset
    "rotating": lambda: filled(RotatingKVCache(16, keep=2), (5, 0), (1, 1)),
    "rotating_wrapped": lambda: filled(RotatingKVCache(6, keep=2), (5, 0), (1, 1), (1, 2), (1, 3)),
    "quantized": lambda: filled(QuantizedKVCache(group_size=32, bits=4), (5, 0), (1, 1)),
    "arrays": arrays_cache,
    "cache_list": lambda: CacheList(filled(KVCache(), (4, 0)), arrays_cache()),
}


def flat_state(entry):
    """Every array of an entry's state, plus its meta state."""
    arrays = []

    def walk(tree):
        if isinstance(tree, (list, tuple)):
            for t in tree:
                walk(t)
        elif tree is not None:
            arrays.append(np.array(tree))

    walk(entry.state)
    return arrays, str(entry.meta_state)


def feed(entry, seed):
    """Write into an entry the way layers do (in place where the class does)."""
    if isinstance(entry, CacheList):
        for child in entry.caches:
            feed(child, seed)
    elif isinstance(entry, ArraysCache):
        entry[0], entry[1] = entry[0] + seed, entry[1] * seed
    else:
        entry.update_and_fetch(*kv(1, seed))
        entry.update_and_fetch(*kv(3, seed + 1))
    mx.eval(entry.state)


def assert_same_state(a, b):
    (arrays_a, meta_a), (arrays_b, meta_b) = a, b
    assert meta_a == meta_b
    assert len(arrays_a) == len(arrays_b)
    for x, y in zip(arrays_a, arrays_b):
        np.testing.assert_array_equal(x, y)


@pytest.mark.parametrize("name", sorted(CACHES))
def test_copies_never_write_into_the_stored_entry(name):
    stored = CACHES[name]()
    mx.eval(stored.state)
    before = flat_state(stored)
    first = copy_prompt_cache([stored])[0]
    assert type(first) is type(stored)
    assert_same_state(flat_state(first), before)
    if first.is_trimmable():  # trimmed copies write into rows the stored entry still holds
        first.trim(2)
    feed(first, seed=7)
    assert_same_state(flat_state(stored), before)
    second = copy_prompt_cache([stored])[0]
    feed(second, seed=7)
    reference = CACHES[name]()
    feed(reference, seed=7)
    assert_same_state(flat_state(second), flat_state(reference))


def test_common_prefix_length():
    assert common_prefix_length([1, 2, 3], [1, 2, 4, 5]) == 2
    assert common_prefix_length([], [1]) == 0
    assert common_prefix_length([1, 2], [1, 2]) == 2


def kv_entry(num_tokens):
    return [filled(KVCache(), (num_tokens, num_tokens))]


def hybrid_entry(num_tokens):
    return [filled(KVCache(), (num_tokens, num_tokens)), arrays_cache()]  # ArraysCache: untrimmable


def test_strict_prefix_is_reused_as_is():
    lru = LRUPromptCache()
    lru.insert([1, 2, 3], hybrid_entry(3))
    got = lru.fetch([1, 2, 3, 4, 5])
    assert (got.num_cached, got.remaining) == (3, [4, 5])
    assert got.prompt_cache[0].offset == 3


def test_exact_hit_leaves_one_token_to_feed():
    lru = LRUPromptCache()
    lru.insert([1, 2, 3], kv_entry(3))
    got = lru.fetch([1, 2, 3])
    assert (got.num_cached, got.remaining, got.prompt_cache[0].offset) == (2, [3], 2)
    # Untrimmable: an exact hit cannot give its last token back.
    lru = LRUPromptCache()
    lru.insert([1, 2, 3], hybrid_entry(3))
    got = lru.fetch([1, 2, 3])
    assert (got.prompt_cache, got.num_cached, got.remaining) == (None, 0, [1, 2, 3])


def test_longer_or_diverging_entries_only_when_trimmable():
    lru = LRUPromptCache()
    lru.insert([1, 2, 3, 4, 5, 6], kv_entry(6))
    got = lru.fetch([1, 2, 3, 9])
    assert (got.num_cached, got.remaining, got.prompt_cache[0].offset) == (3, [9], 3)
    got = lru.fetch([1, 2, 3])  # the prompt is a prefix of the entry: keep one to feed
    assert (got.num_cached, got.remaining, got.prompt_cache[0].offset) == (2, [3], 2)
    assert lru.fetch([1, 2, 3, 4, 5, 6, 7]).prompt_cache[0].offset == 6  # the stored entry is untouched

    lru = LRUPromptCache()
    lru.insert([1, 2, 3, 4, 5, 6], hybrid_entry(6))
    assert lru.fetch([1, 2, 3, 9]).prompt_cache is None


def test_longest_reusable_entry_wins():
    lru = LRUPromptCache()
    lru.insert([1, 2], hybrid_entry(2))
    lru.insert([1, 2, 3, 4], hybrid_entry(4))
    lru.insert([1, 2, 3, 4, 5, 6, 7], hybrid_entry(7))  # diverges, untrimmable: unusable
    got = lru.fetch([1, 2, 3, 4, 5, 9])
    assert (got.num_cached, got.remaining) == (4, [5, 9])
    lru.insert([1, 2, 3, 4, 5, 6, 8], kv_entry(7))  # diverges, trimmable: 5 tokens
    got = lru.fetch([1, 2, 3, 4, 5, 9])
    assert (got.num_cached, got.remaining, got.prompt_cache[0].offset) == (5, [9], 5)


def test_insert_drops_prefixes_made_redundant_by_a_trimmable_entry():
    lru = LRUPromptCache()
    lru.insert([1, 2], kv_entry(2))
    lru.insert([7, 8], kv_entry(2))
    lru.insert([1, 2, 3], kv_entry(3))
    assert sorted(lru.keys()) == [(1, 2, 3), (7, 8)]
    lru = LRUPromptCache()
    lru.insert([1, 2], hybrid_entry(2))
    lru.insert([1, 2, 3], hybrid_entry(3))  # untrimmable: the prefix stays useful
    assert sorted(lru.keys()) == [(1, 2), (1, 2, 3)]


def test_lru_eviction_by_count_and_bytes():
    lru = LRUPromptCache(max_size=2)
    lru.insert([1], kv_entry(1))
    lru.insert([2], kv_entry(1))
    lru.fetch([1, 5])  # a use: [2] is now the least recent
    lru.insert([3], kv_entry(1))
    assert sorted(lru.keys()) == [(1,), (3,)]
    one_entry = sum(c.nbytes for c in kv_entry(1))
    lru = LRUPromptCache(max_bytes=2 * one_entry)
    for i in range(4):
        lru.insert([i], kv_entry(1))
    assert lru.keys() == [(2,), (3,)] and lru.nbytes == 2 * one_entry
    lru.trim_to(n_sequences=1)
    assert lru.keys() == [(3,)]
    with pytest.raises(ValueError, match="empty token sequence"):
        lru.insert([], kv_entry(1))
    assert LRUPromptCache(max_size=0).fetch([1]).prompt_cache is None


def test_an_entry_larger_than_the_byte_budget_is_not_stored():
    def nbytes(entry):
        return sum(c.nbytes for c in entry)

    one_entry = nbytes(kv_entry(1))  # KV buffers grow in blocks of 256 rows
    lru = LRUPromptCache(max_bytes=4 * one_entry)
    lru.insert([1], kv_entry(1))
    lru.insert([5, 6], hybrid_entry(2))
    before = lru.keys()
    # Too big alone: refused without evicting anything, not even the prefix it extends.
    huge = kv_entry(1200)
    assert nbytes(huge) > lru.max_bytes and not lru.insert([1, 2], huge)
    assert lru.keys() == before and lru.nbytes == one_entry + nbytes(hybrid_entry(2))
    assert lru.insert([9], kv_entry(1)) and lru.keys() == before + [(9,)]
    # The running byte count follows replacements, prefix drops and evictions.
    lru.insert([9], kv_entry(1))
    lru.insert([1, 2], kv_entry(2))  # trimmable: drops its prefix [1]
    assert sorted(lru.keys()) == [(1, 2), (5, 6), (9,)]
    assert lru.nbytes == sum(nbytes(e.prompt_cache) for e in lru._entries.values())
    assert not LRUPromptCache(max_size=0).insert([1], kv_entry(1))


def continue_greedy(model, prompt_cache, tokens, num_tokens=6):
    steps = generate_step(mx.array(tokens), model, max_tokens=num_tokens, prompt_cache=prompt_cache)
    return [token for token, _ in steps]


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("lru_models")
    return {
        "dense": write_checkpoint(root / "dense", TINY_CONFIGS["qwen3"]),
        "hybrid": write_checkpoint(root / "hybrid", TINY_CONFIGS["qwen3_next"]),
        "gpt_oss": write_checkpoint(root / "gpt_oss", TINY_CONFIGS["gpt_oss"]),
    }


@pytest.mark.parametrize("family", ["dense", "hybrid", "gpt_oss"])
def test_reused_entry_continues_exactly_and_repeatably(model_dirs, family):
    """A stored cache, fetched twice for a longer prompt, continues both times exactly
    as a cache that was fed the whole prompt at once (same chunks: bit for bit)."""
    model, _ = load(str(model_dirs[family]))
    first_turn = list(range(10, 30))  # past gpt-oss's sliding window of 8
    prompt_cache = make_prompt_cache(model)
    generated = continue_greedy(model, prompt_cache, first_turn)
    key = first_turn + generated
    lru = LRUPromptCache()
    lru.insert(key, prompt_cache)
    second_turn = key + [40, 41, 42]
    outputs = []
    for _ in range(2):
        got = lru.fetch(second_turn)
        assert got.num_cached == len(key) and got.remaining == [40, 41, 42]
        outputs.append(continue_greedy(model, got.prompt_cache, got.remaining))
    assert outputs[0] == outputs[1]

    fresh = make_prompt_cache(model)
    continue_greedy(model, fresh, first_turn)  # the same forwards that built the entry
    assert continue_greedy(model, fresh, [40, 41, 42]) == outputs[0]


# --- checkpointed entries (models/checkpoints.py) ---------------------------------------

CHUNK = 4


def checkpointed_entry(num_chunks, max_bytes=1 << 40):
    """A KV layer and a recurrent one fed `num_chunks` chunks the way a prefill does,
    the recurrent state after chunk i filled with i (so a restored state tells which)."""
    cache = CheckpointedCache([KVCache(), ArraysCache(1)], CHUNK, max_bytes)
    for i in range(1, num_chunks + 1):
        cache[0].update_and_fetch(*kv(CHUNK, i))
        cache[1][0] = mx.full((1, 8, 16), float(i))
        maybe_snapshot(cache, CHUNK)
    return cache


def test_a_diverging_prompt_resumes_at_the_nearest_snapshot():
    lru = LRUPromptCache()
    key = list(range(1, 4 * CHUNK + 1))  # 16 tokens: snapshots at 4, 8, 12, 16
    lru.insert(key, checkpointed_entry(4))
    got = lru.fetch(key[:10] + [99, 98])
    assert (got.num_cached, got.remaining) == (8, key[8:10] + [99, 98])
    assert got.prompt_cache[0].offset == 8 and got.prompt_cache[1][0][0, 0, 0].item() == 2.0
    assert got.prompt_cache.positions() == [4, 8]
    got = lru.fetch(key)  # an exact hit keeps a token to feed: the snapshot before it
    assert (got.num_cached, got.prompt_cache[1][0][0, 0, 0].item()) == (12, 3.0)
    assert lru.fetch([5, 6, 7]).prompt_cache is None
    # The copies were fed nothing the stored entry sees.
    assert lru.fetch(key + [1]).prompt_cache[1][0][0, 0, 0].item() == 4.0


def test_snapshots_count_once_and_go_before_their_entry():
    entry = checkpointed_entry(4)
    copy = copy_prompt_cache(entry)  # shares entry's snapshots (its KV rows are sliced to 16)
    own, own_copy, snapshots = sum(c.nbytes for c in entry), sum(c.nbytes for c in copy), entry.snapshot_bytes
    key = list(range(16))
    lru = LRUPromptCache()
    lru.insert(key[:-1] + [0], copy)
    lru.insert(key, entry)
    assert lru.nbytes == own + own_copy + snapshots
    assert lru.stats_by_type()["assistant"] == {"n_sequences": 2, "n_bytes": own + own_copy + 2 * snapshots}
    # Over budget the oldest entry loses its snapshots first (shared: nothing freed
    # yet), then itself; the newest keeps serving strict-prefix hits without its own.
    lru.trim_to(n_bytes=own + snapshots)
    assert lru.keys() == [tuple(key)] and lru.nbytes == own + snapshots
    lru.trim_to(n_bytes=own)
    assert lru.keys() == [tuple(key)] and lru.nbytes == own
    assert lru.fetch(key + [5]).num_cached == 16
    assert lru.fetch(key[:10] + [99]).prompt_cache is None
    assert LRUPromptCache(max_bytes=own).insert(key, checkpointed_entry(4))  # fits: it drops its snapshots


def test_checkpointed_wraps_only_fresh_untrimmable_caches():
    lru = LRUPromptCache()
    kv_only = [KVCache()]
    assert lru.checkpointed(kv_only, 8) is kv_only  # trims anyway
    wrapped = lru.checkpointed([KVCache(), ArraysCache(2)], 8)
    assert isinstance(wrapped, CheckpointedCache) and wrapped.max_bytes == lru.max_bytes // 2
    with pytest.raises(ValueError, match="takes a fresh cache list"):
        lru.checkpointed(hybrid_entry(3), 8)
    plain = [KVCache(), ArraysCache(2)]
    assert LRUPromptCache(checkpoint_share=0).checkpointed(plain, 8) is plain
    with pytest.raises(ValueError, match="checkpoint_share must be within"):
        LRUPromptCache(checkpoint_share=1.5)


def test_upstream_method_names():
    lru = LRUPromptCache()
    lru.insert_cache("model-a", [1, 2, 3], kv_entry(3), cache_type="system")
    prompt_cache, rest = lru.fetch_nearest_cache("model-a", [1, 2, 3, 4])
    assert prompt_cache[0].offset == 3 and rest == [4]
    prompt_cache, rest = lru.fetch_nearest_cache("model-a", [1, 2, 3])  # unlike upstream: one left to feed
    assert prompt_cache[0].offset == 2 and rest == [3]
    assert lru.fetch_nearest_cache("model-a", [7]) == (None, [7])
    stats = lru.stats_by_type()
    assert stats["system"] == {"n_sequences": 1, "n_bytes": lru.nbytes}
    assert stats["user"] == stats["assistant"] == {"n_sequences": 0, "n_bytes": 0}
    with pytest.raises(ValueError, match="holds caches of model 'model-a', not 'model-b'"):
        lru.fetch_nearest_cache("model-b", [1])
    with pytest.raises(ValueError, match="cache_type must be one of assistant, user, system, got 'tool'"):
        lru.insert_cache("model-a", [5], kv_entry(1), cache_type="tool")
    assert lru.keys() == [(1, 2, 3)]


def test_upstreams_import_of_it_from_models_cache_works_in_a_fresh_process():
    """Upstream's home of LRUPromptCache is mlx_lm.models.cache; here it is registered
    there by models/lru_prompt_cache.py (which builds on cache.py) when the models
    package is imported, so the import works first thing in a process."""
    import subprocess
    import sys

    code = ("from mlx_lm.models.cache import LRUPromptCache; from mlx_lm.server import LRUPromptCache as served; "
            "import mlx_lm.models.lru_prompt_cache as m; assert LRUPromptCache is served is m.LRUPromptCache")
    subprocess.run([sys.executable, "-c", code], check=True)
