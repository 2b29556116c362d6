"""Upstream 0.32.2's PromptProcessingBatch and GenerationBatch (mlx_lm/batch_phases.py,
exported by mlx_lm.generate), built as code written for 0.32.2 builds them. Greedy rows
of a batch must produce what a solo generate_step produces."""

import importlib

import mlx.core as mx
import pytest

from checkpoints import TINY_CONFIGS, write_checkpoint
from mlx_lm.batch_phases import GenerationBatch, PromptProcessingBatch
from mlx_lm.generate import generate_step
from mlx_lm.models.cache import make_prompt_cache
from mlx_lm.sample_utils import greedy_sampler
from mlx_lm.stop_sequences import StopSequences
from mlx_lm.utils import load

PROMPTS = [[5, 17, 30, 41, 52, 63, 74], [9, 88, 120], [200, 13, 7, 99, 150]]


@pytest.fixture(scope="module")
def qwen3(tiny_model_dir):
    return load(str(tiny_model_dir))[0]


@pytest.fixture(scope="module")
def qwen3_next(tmp_path_factory):
    return load(str(write_checkpoint(tmp_path_factory.mktemp("tiny_qwen3_next"), TINY_CONFIGS["qwen3_next"])))[0]


def solo(model, prompt, max_tokens):
    return [t for t, _ in generate_step(mx.array(prompt), model, max_tokens=max_tokens)]


def prompted(model, prompts, uids=None, **rows):
    uids = list(range(len(prompts))) if uids is None else uids
    batch = PromptProcessingBatch(model, uids, [make_prompt_cache(model) for _ in prompts], **rows)
    return batch.generate(prompts)


def run(generation):
    """Every response until the batch is empty, per uid."""
    out = {}
    while responses := generation.next():
        for r in responses:
            out.setdefault(r.uid, []).append(r)
    return out


def tokens_of(responses):
    return [r.token for r in responses]


def test_generate_exports_both_classes():
    generate_module = importlib.import_module("mlx_lm.generate")
    assert generate_module.PromptProcessingBatch is PromptProcessingBatch
    assert generate_module.GenerationBatch is GenerationBatch


def test_greedy_rows_of_different_lengths_equal_solo(qwen3):
    out = run(prompted(qwen3, PROMPTS, max_tokens=[6, 6, 6]))
    for uid, prompt in enumerate(PROMPTS):
        assert tokens_of(out[uid]) == solo(qwen3, prompt, 6)
        assert out[uid][-1].finish_reason == "length"
        assert [r.finish_reason for r in out[uid][:-1]] == [None] * 5


def test_chunked_prompt_equals_solo(qwen3):
    batch = PromptProcessingBatch(qwen3, [0, 1], [make_prompt_cache(qwen3) for _ in range(2)], prefill_step_size=2,
                                  max_tokens=[4, 4])
    batch.prompt([PROMPTS[0][:3], PROMPTS[1][:1]])  # two prompt calls, the second right padded again
    out = run(batch.generate([PROMPTS[0][3:], PROMPTS[1][1:]]))
    assert tokens_of(out[0]) == solo(qwen3, PROMPTS[0], 4)
    assert tokens_of(out[1]) == solo(qwen3, PROMPTS[1], 4)


def test_hybrid_rows_of_one_length_equal_solo(qwen3_next):
    prompts = [PROMPTS[0][:5], PROMPTS[2]]
    out = run(prompted(qwen3_next, prompts, max_tokens=[5, 5]))
    for uid, prompt in enumerate(prompts):
        assert tokens_of(out[uid]) == solo(qwen3_next, prompt, 5)


def test_hybrid_rows_of_different_lengths_are_refused_naming_the_layer(qwen3_next):
    batch = PromptProcessingBatch(qwen3_next, [0, 1], [make_prompt_cache(qwen3_next) for _ in range(2)])
    with pytest.raises(ValueError, match="layer 0's BatchArraysCache cannot take prompts of different lengths"):
        batch.prompt([PROMPTS[0], PROMPTS[1]])
    assert batch.tokens == [[], []]  # nothing was recorded as fed
    # Refused after an attention layer was prepared (caches in reverse layer order): spent.
    reversed_layers = [make_prompt_cache(qwen3_next)[::-1] for _ in range(2)]
    batch = PromptProcessingBatch(qwen3_next, [0, 1], reversed_layers)
    with pytest.raises(ValueError, match="layer 1.s BatchArraysCache .* the layers before it were prepared"):
        batch.prompt([PROMPTS[0], PROMPTS[1]])


def test_finished_row_carries_its_cache_and_tokens(qwen3):
    want = solo(qwen3, PROMPTS[1], 5)
    stop = StopSequences([want[1:3]])
    out = run(prompted(qwen3, PROMPTS[:2], stop_sequences=[StopSequences(), stop], max_tokens=[2, 10]))
    assert [r.finish_reason for r in out[1]] == [None, None, "stop"]
    assert tokens_of(out[1]) == want[:3]
    last = out[1][-1]
    assert last.all_tokens == PROMPTS[1] + want[:3]
    assert last.prompt_cache[0].offset == len(PROMPTS[1]) + 3
    assert out[0][-1].finish_reason == "length" and len(out[0]) == 2
    assert out[0][-1].all_tokens == PROMPTS[0] + tokens_of(out[0])
    # The extracted cache holds every reported token: fed the next, it goes on as solo.
    more = generate_step(mx.array(want[3:4]), qwen3, max_tokens=1, prompt_cache=last.prompt_cache)
    assert [t for t, _ in more] == want[4:5]


def test_logprobs_are_the_rows_normalised_distribution(qwen3):
    out = run(prompted(qwen3, PROMPTS[:2], max_tokens=[2, 2]))
    for responses in out.values():
        for r in responses:
            assert r.logprobs.shape == (TINY_CONFIGS["qwen3"]["vocab_size"],)
            assert abs(mx.logsumexp(r.logprobs).item()) < 1e-4
            assert r.token == mx.argmax(r.logprobs).item()


def test_per_row_samplers_and_fallback(qwen3):
    calls = []

    def first_token(logprobs):
        calls.append(logprobs.shape)
        return mx.zeros((logprobs.shape[0],), mx.uint32) + 3

    out = run(prompted(qwen3, PROMPTS, samplers=[first_token, None, first_token], max_tokens=[3, 3, 3],
                       fallback_sampler=greedy_sampler))
    assert tokens_of(out[0]) == tokens_of(out[2]) == [3, 3, 3]
    assert tokens_of(out[1]) == solo(qwen3, PROMPTS[1], 3)
    assert set(calls) == {(1, TINY_CONFIGS["qwen3"]["vocab_size"])}  # one row at a time


def test_per_row_logits_processors_see_the_rows_history(qwen3):
    seen = []

    def ban_greedy(history, logits):
        seen.append(history.tolist())
        return logits + mx.where(mx.arange(logits.shape[-1]) == mx.argmax(logits, axis=-1), -1e9, 0.0)

    out = run(prompted(qwen3, PROMPTS[:2], logits_processors=[[], [ban_greedy]], max_tokens=[3, 3]))
    assert tokens_of(out[0]) == solo(qwen3, PROMPTS[0], 3)
    generated = tokens_of(out[1])
    # (one call more than tokens: each step queues the next draw before reporting)
    assert seen == [PROMPTS[1] + generated[:i] for i in range(4)]
    assert generated[0] != solo(qwen3, PROMPTS[1], 1)[0]


def test_filter_split_and_extend_keep_rows_with_their_uids(qwen3):
    batch = PromptProcessingBatch(qwen3, [10, 11, 12], [make_prompt_cache(qwen3) for _ in PROMPTS],
                                  max_tokens=[4, 4, 4])
    batch.prompt([p[:-1] for p in PROMPTS])
    split = batch.split([2, 0])
    assert split.uids == [10, 12] and batch.uids == [11]
    assert split.tokens == [PROMPTS[0][:-1], PROMPTS[2][:-1]]
    generation = split.generate([PROMPTS[0][-1:], PROMPTS[2][-1:]])
    generation.extend(batch.generate([PROMPTS[1][-1:]]))
    assert generation.uids == [10, 12, 11] and len(generation) == 3
    first = {r.uid: r.token for r in generation.next()}
    generation.filter([2, 0])
    assert generation.uids == [11, 10]
    out = run(generation)
    assert [first[10]] + tokens_of(out[10]) == solo(qwen3, PROMPTS[0], 4)
    assert [first[11]] + tokens_of(out[11]) == solo(qwen3, PROMPTS[1], 4)
    assert 12 not in out


def test_empty_batches_then_extend(qwen3):
    prompts = PromptProcessingBatch.empty(qwen3, greedy_sampler, prefill_step_size=64)
    assert len(prompts) == 0 and prompts.prefill_step_size == 64
    prompts.extend(PromptProcessingBatch(qwen3, [7], [make_prompt_cache(qwen3)], max_tokens=[3]))
    generation = GenerationBatch.empty(qwen3, greedy_sampler)
    assert len(generation) == 0 and generation.next() == []
    generation.extend(prompts.generate([PROMPTS[2]]))
    assert len(prompts) == 0
    assert tokens_of(run(generation)[7]) == solo(qwen3, PROMPTS[2], 3)
    assert len(generation) == 0 and generation.prompt_cache == []


@pytest.mark.parametrize("rows, match", [
    (dict(samplers=[greedy_sampler]), "samplers holds 1 entries for a batch of 2 uids"),
    (dict(max_tokens=[3]), "max_tokens holds 1 entries"),
    (dict(max_tokens=[3, 0]), r"max_tokens must be whole numbers >= 1.*\[0\]"),
    (dict(stop_sequences=[StopSequences()] * 3), "stop_sequences holds 3 entries"),
    (dict(logits_processors=[[], [], []]), "logits_processors holds 3 entries"),
    (dict(tokens=[[1]]), "tokens holds 1 entries"),
    (dict(prefill_step_size=0), "prefill_step_size must be a whole number >= 1, got 0"),
])
def test_mismatched_rows_are_refused(qwen3, rows, match):
    with pytest.raises(ValueError, match=match):
        PromptProcessingBatch(qwen3, [0, 1], [make_prompt_cache(qwen3) for _ in range(2)], **rows)


def test_mismatched_inputs_are_refused(qwen3):
    with pytest.raises(ValueError, match="caches holds 1 cache lists for a batch of 2 uids"):
        PromptProcessingBatch(qwen3, [0, 1], [make_prompt_cache(qwen3)])
    batch = PromptProcessingBatch(qwen3, [0, 1], [make_prompt_cache(qwen3) for _ in range(2)])
    with pytest.raises(ValueError, match="prompt got 1 token lists for a batch of 2 rows"):
        batch.prompt([[1, 2]])
    with pytest.raises(ValueError, match=r"rows of uids \[1\] have no token"):
        batch.generate([[1, 2], []])
    with pytest.raises(IndexError, match="not distinct rows of a batch of 2"):
        batch.split([2])
    with pytest.raises(ValueError, match=r"inputs must hold one token per uid, shape \(2,\)"):
        GenerationBatch(qwen3, [0, 1], mx.array([1]), [], [[], []], None, greedy_sampler, None, None, None)
    with pytest.raises(ValueError, match="cannot be extended by a PromptProcessingBatch"):
        GenerationBatch.empty(qwen3, greedy_sampler).extend(batch)


def test_rows_decode_across_the_caches_growth(qwen3):
    # The batched KV buffers grow in blocks of 256 columns: the row of 254 crosses one
    # while decoding.
    prompts = [(PROMPTS[0] * 40)[:254], PROMPTS[1]]
    out = run(prompted(qwen3, prompts, max_tokens=[4, 4]))
    for uid, prompt in enumerate(prompts):
        assert tokens_of(out[uid]) == solo(qwen3, prompt, 4)
