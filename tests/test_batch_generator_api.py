"""Upstream mlx-lm 0.32.2's BatchGenerator surface (mlx_lm/batching.py), as its
documentation and tests describe it: constructor keywords, insert / insert_segments with
per-row all_tokens, samplers, logits processors and stop sequences, next() with prompt
and generation responses, next_generated, remove(return_prompt_caches), extract_cache
-> {uid: (cache, tokens)}, stats() as a context manager over a window,
prompt_cache_nbytes, batch_generate(return_prompt_caches, return_token_ids,
return_logprobs). Greedy rows must produce what a solo generate_step produces."""

import mlx.core as mx
import pytest

from checkpoints import TINY_CONFIGS
from family_checks import random_model
from mlx_lm.batching import BatchGenerator, batch_generate
from mlx_lm.generate import generate_step
from mlx_lm.generate_utils import BatchStats
from mlx_lm.models.cache import KVCache, RotatingKVCache, make_prompt_cache
from mlx_lm.sample_utils import make_logits_processors

_MODEL = []


def model():
    if not _MODEL:
        _MODEL.append(random_model(TINY_CONFIGS["qwen3"], seed=3, scale=0.5))
    return _MODEL[0]


def prompt(length, seed):
    return mx.random.randint(1, 200, (length,), key=mx.random.key(seed)).tolist()


def solo(tokens, max_tokens, prompt_cache=None):
    """Greedy tokens and their logprobs from generate_step."""
    steps = list(generate_step(mx.array(tokens), model(), max_tokens=max_tokens, prompt_cache=prompt_cache))
    return [t for t, _ in steps], [lp for _, lp in steps]


def collect(generator):
    """Every generation response until the generator is done, per uid."""
    out = {}
    while responses := generator.next_generated():
        for r in responses:
            out.setdefault(r.uid, []).append(r)
    return out


def test_constructor_takes_upstreams_keywords():
    want = solo(prompt(4, 1), 3)[0]
    absent = [t for t in range(TINY_CONFIGS["qwen3"]["vocab_size"]) if t not in want][:3]
    generator = BatchGenerator(model(), max_tokens=3, stop_tokens=[absent[:1], absent[1:]], sampler=None,
                               logits_processors=None,
                               completion_batch_size=4, prefill_batch_size=2, prefill_step_size=16, max_kv_size=None,
                               stream=None)
    assert generator.stream is not None
    uids = generator.insert([prompt(4, 1)])
    assert [r.token for r in collect(generator)[uids[0]]] == want


def test_greedy_rows_equal_solo_with_small_batches():
    prompts = [prompt(n, 10 + n) for n in (5, 1, 9, 3)]
    generator = BatchGenerator(model(), max_tokens=6, prefill_batch_size=2, prefill_step_size=4,
                               completion_batch_size=3)
    uids = generator.insert(prompts)
    out, calls = {}, 0
    while responses := generator.next_generated():
        calls += 1
        assert len(responses) <= 3
        for r in responses:
            out.setdefault(r.uid, []).append(r)
    assert calls > 6  # never more than three rows at once
    for uid, p in zip(uids, prompts):
        tokens, logprobs = solo(p, 6)
        assert [r.token for r in out[uid]] == tokens
        assert mx.allclose(out[uid][0].logprobs, logprobs[0], atol=1e-4).item()
        assert [r.finish_reason for r in out[uid]] == [None] * 5 + ["length"]


def test_stop_tokens_are_token_sequences():
    p = prompt(6, 2)
    tokens = solo(p, 12)[0]
    pair_end = next(i for i in range(3, 12) if (tokens[i - 1], tokens[i]) not in zip(tokens[: i - 1], tokens[1:i]))
    generator = BatchGenerator(model(), max_tokens=12, stop_tokens=[[tokens[pair_end - 1], tokens[pair_end]]])
    (uid,) = generator.insert([p])
    got = collect(generator)[uid]
    assert [r.token for r in got] == tokens[: pair_end + 1]
    assert got[-1].finish_reason == "stop"


def test_max_tokens_samplers_and_processors_per_row():
    p = prompt(5, 3)
    generator = BatchGenerator(model(), max_tokens=4, sampler=lambda lp: mx.full((lp.shape[0],), 1, mx.int32))
    a, b = generator.insert([p, p], max_tokens=[2, 3], samplers=[None, lambda lp: mx.full((lp.shape[0],), 2, mx.int32)])
    (c,) = generator.insert([p], logits_processors=[make_logits_processors({3: 2000.0})])
    out = collect(generator)
    assert [r.token for r in out[a]] == [1, 1] and [r.token for r in out[b]] == [2, 2, 2]
    assert len(out[c]) == 4 and out[c][0].logprobs[3].item() == 0.0
    assert [r.finish_reason for r in out[a]] == [None, "length"]


def test_constructor_processors_apply_to_every_row_and_see_the_prompt():
    seen = []

    def processor(tokens, logits):
        seen.append(tokens.tolist())
        return logits

    p = prompt(4, 4)
    generator = BatchGenerator(model(), max_tokens=1, logits_processors=[processor])
    generator.insert([p])
    collect(generator)
    assert seen[0] == p


def test_stop_sequences_per_row():
    from mlx_lm.generate import StopSequences

    p = prompt(5, 5)
    generator = BatchGenerator(model(), max_tokens=10)
    uids = generator.insert([p, p], logits_processors=[make_logits_processors({0: 2000.0}),
                                                       make_logits_processors({1: 2000.0})],
                            stop_sequences=[StopSequences([[0]]), StopSequences([[1]])])
    out = collect(generator)
    for uid, token in zip(uids, (0, 1)):
        assert [(r.token, r.finish_reason) for r in out[uid]] == [(token, "stop")]


def test_the_last_response_carries_the_cache_and_all_tokens():
    """all_tokens: the tokens already in a given cache, then the prompt and every token
    generated; the cache holds exactly those."""
    history, p = prompt(6, 6), prompt(3, 7)
    cache = make_prompt_cache(model())
    model()(mx.array([history]), cache=cache)
    want = solo(history + p, 4)[0]
    generator = BatchGenerator(model(), max_tokens=4)
    (uid,) = generator.insert([p], caches=[cache], all_tokens=[history])
    got = collect(generator)[uid]
    assert [r.token for r in got] == want
    assert all(r.prompt_cache is None and r.all_tokens is None for r in got[:-1])
    assert got[-1].all_tokens == history + p + want
    assert got[-1].prompt_cache[0].offset == len(history + p + want)


def test_insert_segments_stops_at_each_boundary():
    first, second = prompt(5, 8), prompt(4, 9)
    generator = BatchGenerator(model(), max_tokens=3, prefill_step_size=3)
    (uid,) = generator.insert_segments([[first, second]])
    progress, tokens = [], []
    while True:
        prompt_responses, generation_responses = generator.next()
        progress += [r for r in prompt_responses if r.uid == uid]
        tokens += [r.token for r in generation_responses]
        if not prompt_responses and not generation_responses:
            break
    done = [r.progress[0] for r in progress]
    assert done == sorted(done) and all(r.progress[1] == 9 for r in progress)
    assert all(b - a <= 3 for a, b in zip([0] + done, done))
    boundaries = [r.progress[0] for r in progress if r.end_of_segment]
    assert 5 in boundaries and progress[-1].progress == (9, 9)
    assert [r.end_of_prompt for r in progress] == [False] * (len(progress) - 1) + [True]
    assert tokens == solo(first + second, 3)[0]


def test_remove_and_extract_cache_give_cache_and_tokens():
    p, q = prompt(4, 11), prompt(6, 12)
    generator = BatchGenerator(model(), max_tokens=8)
    a, b = generator.insert([p, q])
    seen = {a: [], b: []}
    for _ in range(4):
        for r in generator.next_generated():
            seen[r.uid].append(r.token)
    extracted = generator.extract_cache([a])
    cache, tokens = extracted[a]
    assert tokens == p + seen[a] and cache[0].offset == len(tokens)
    removed = generator.remove([b], return_prompt_caches=True)
    cache, tokens = removed[b]
    assert tokens == q + seen[b] and cache[0].offset == len(tokens)
    rest = collect(generator)
    assert b not in rest and seen[a] + [r.token for r in rest[a]] == solo(p, 8)[0]


def test_stats_is_a_window_and_windows_nest():
    generator = BatchGenerator(model(), max_tokens=2)
    with generator.stats() as empty:
        pass
    assert isinstance(empty, BatchStats) and empty.prompt_tps == 0.0 and empty.generation_tps == 0.0
    with generator.stats() as outer:
        generator.insert([prompt(5, 13)])
        collect(generator)
        with generator.stats() as inner:
            generator.insert([prompt(5, 14)])
            collect(generator)
    assert inner.generation_tokens == 2 and outer.generation_tokens == 4
    assert inner.prompt_tokens > 0 and outer.prompt_tokens == 2 * inner.prompt_tokens
    assert outer.wall_time >= inner.wall_time > 0
    assert inner.prompt_time > 0 and inner.decode_time > 0
    assert inner.prompt_time + inner.decode_time + inner.overhead_time == pytest.approx(inner.wall_time)


def test_prompt_cache_nbytes_counts_every_cache_held():
    cache = make_prompt_cache(model())
    model()(mx.array([prompt(7, 15)]), cache=cache)
    generator = BatchGenerator(model(), max_tokens=2)
    generator.insert([prompt(2, 16)], caches=[cache])
    assert generator.prompt_cache_nbytes == sum(c.nbytes for c in cache)
    generator.next()
    assert generator.prompt_cache_nbytes > 0
    collect(generator)
    assert generator.prompt_cache_nbytes == 0


def test_max_kv_size_gives_rows_windows():
    generator = BatchGenerator(model(), max_tokens=10, max_kv_size=8)
    (uid,) = generator.insert([prompt(12, 17)])
    last = collect(generator)[uid][-1]
    assert all(type(c) is RotatingKVCache and c.max_size == 8 and c.keys.shape[2] <= 8 for c in last.prompt_cache)
    generator = BatchGenerator(model(), max_tokens=1)
    (uid,) = generator.insert([prompt(3, 18)])
    assert all(type(c) is KVCache for c in collect(generator)[uid][-1].prompt_cache)


def test_insert_validates_before_queueing():
    generator = BatchGenerator(model(), max_tokens=2)
    p = prompt(3, 19)
    with pytest.raises(ValueError, match="max_tokens"):
        generator.insert([p, p, p], max_tokens=[2, 2])
    with pytest.raises(ValueError):
        generator.insert([p, p], max_tokens=[2, 0])
    with pytest.raises(ValueError):
        generator.insert([[]])
    assert generator.insert([p]) == [0]


def test_batch_generate_returns_caches_token_ids_and_logprobs(tiny_model_dir):
    from mlx_lm import load

    loaded, tokenizer = load(str(tiny_model_dir))
    prompts = [tokenizer.encode("hello"), tokenizer.encode("write a poem")]
    plain = batch_generate(loaded, tokenizer, prompts, max_tokens=4)
    assert plain.caches is None and plain.token_ids is None and plain.logprobs is None
    assert isinstance(plain.stats, BatchStats)
    full = batch_generate(loaded, tokenizer, prompts, max_tokens=4, return_prompt_caches=True,
                          return_token_ids=True, return_logprobs=True)
    assert full.texts == plain.texts and len(full.caches) == 2
    for ids, logprobs in zip(full.token_ids, full.logprobs):
        assert len(ids) == len(logprobs) and all(isinstance(lp, float) and lp <= 0.0 for lp in logprobs)
