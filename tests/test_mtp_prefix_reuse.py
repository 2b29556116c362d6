"""Prefix reuse with an MTP head (issue 33): a CheckpointedCache of a hybrid target and
its head keeps, at each snapshot, the target's last hidden state, which the head's next
pair reads. A prompt resumed at a snapshot then feeds target and head in the chunks a
cold run feeds: its caches (target and head) equal a cold run's bit for bit, and so do
its tokens and logprobs, greedy and sampled with a seed, for shared lengths on, just
before and just after a snapshot; through speculative_generate_step, trim_prompt_cache,
a prompt-cache file and the server's workers (one at a time and batched). A run that
continues a generated cache feeds the head the pair of its last token too."""

import mlx.core as mx
import numpy as np
import pytest
from test_checkpoints import assert_same_caches, flat_state, tokens
from test_mtp import CONFIGS, build, hf_weights, train_head, write_hf
from test_prompt_cache_reuse import answer

from mlx_lm.drafters import MTPHead
from mlx_lm.generate import SpeculationStats, speculative_generate_step
from mlx_lm.models.lru_prompt_cache import LRUPromptCache
from mlx_lm.models.cache import make_prompt_cache, trim_prompt_cache
from mlx_lm.models.checkpoint_files import load_checkpointed, save_checkpointed
from mlx_lm.models.checkpoints import CheckpointedCache, SnapshottingProgress
from mlx_lm.sample_utils import make_sampler
from mlx_lm.serving import BatchWorker, GenerationWorker, ModelProvider

STEP = 8  # snapshots at 8, 16, 24, ...
PROMPT = tokens(0, 45)  # 44 fed: snapshots at 8..40
FAMILY = "qwen3_5"  # Gated DeltaNet and attention layers, a one-layer head with a KV cache


@pytest.fixture(scope="module")
def model():
    return train_head(build(CONFIGS[FAMILY]))


def fresh(model):
    return make_prompt_cache(model) + model.make_mtp_cache()


def speculate(model, prompt_cache, prompt, sampled=False, max_tokens=8):
    """Tokens and logprobs of an MTP run, and its (drafted, accepted) counts."""
    stats = SpeculationStats()
    mx.random.seed(7)
    sampler = make_sampler(temp=1.0) if sampled else None
    steps = speculative_generate_step(mx.array(prompt), model, mtp=True, num_draft_tokens=3, sampler=sampler,
                                      adaptive_draft_length=False, max_tokens=max_tokens, prompt_cache=prompt_cache,
                                      prefill_step_size=STEP, stats=stats)
    return [(t, lp) for t, lp, _ in steps], (stats.num_drafted, stats.num_accepted)


def stored(model):
    """An LRU holding PROMPT plus a few generated tokens, prefilled with snapshots."""
    lru = LRUPromptCache()
    prompt_cache = lru.checkpointed(fresh(model), STEP)
    generated, _ = speculate(model, prompt_cache, PROMPT, max_tokens=3)
    lru.insert(PROMPT + [t for t, _ in generated], prompt_cache)
    return lru, prompt_cache


def assert_same_runs(a, b):
    (steps_a, rounds_a), (steps_b, rounds_b) = a, b
    assert [t for t, _ in steps_a] == [t for t, _ in steps_b] and rounds_a == rounds_b
    assert all(mx.array_equal(x, y).item() for (_, x), (_, y) in zip(steps_a, steps_b))


@pytest.mark.parametrize("sampled", [False, True])
@pytest.mark.parametrize("shared, resumed_at", [(16, 16), (15, 8), (17, 16), (44, 40)])
def test_a_resumed_mtp_prompt_equals_a_cold_run(model, shared, resumed_at, sampled):
    lru, first = stored(model)
    assert first.positions() == [8, 16, 24, 32, 40]
    assert all(first.snapshots[p].hidden.shape == (1, 64) for p in first.positions())
    prompt = PROMPT[:shared] + tokens(1, 12)
    got = lru.fetch(prompt)
    assert (got.num_cached, got.remaining) == (resumed_at, prompt[resumed_at:])
    head = got.prompt_cache[-1]
    assert head.offset == resumed_at - 1  # the head holds one pair fewer; the kept row makes the next
    resumed = speculate(model, got.prompt_cache, got.remaining, sampled)
    cold_cache = fresh(model)
    cold = speculate(model, cold_cache, prompt, sampled)
    assert_same_runs(resumed, cold)
    assert_same_caches(got.prompt_cache, cold_cache)


def test_mtp_prefill_cuts_and_snapshots_at_message_boundaries(model):
    """The head's loop cuts the prefill as the whole list is cut, message boundaries
    included (before, it cut by its target part, which knows none: no snapshot at a
    boundary, and a chat prompt resumed at the grid before it); a prompt resumed there
    answers as a cold run."""
    bounds = (13, 30)
    lru = LRUPromptCache()
    first = lru.checkpointed(fresh(model), STEP, message_boundaries=bounds)
    generated, _ = speculate(model, first, PROMPT, max_tokens=3)
    lru.insert(PROMPT + [t for t, _ in generated], first)
    assert first.positions() == [8, 13, 16, 24, 30, 32, 40]
    prompt = PROMPT[:31] + tokens(1, 12)
    got = lru.fetch(prompt, message_boundaries=bounds)
    assert got.num_cached == 30
    resumed = speculate(model, got.prompt_cache, got.remaining)
    cold_cache = lru.checkpointed(fresh(model), STEP, message_boundaries=bounds)
    assert_same_runs(resumed, speculate(model, cold_cache, prompt))
    assert_same_caches(got.prompt_cache, cold_cache)


def test_without_the_kept_row_the_head_skips_a_pair(model):
    """What the kept hidden state is for: a resume that lacks it (as a plain list's)
    leaves the head a pair short, so its cache is not a cold run's (the tokens, the
    target's, are still the same)."""
    lru, _ = stored(model)
    prompt = PROMPT[:20] + tokens(1, 12)
    got = lru.fetch(prompt)
    got.prompt_cache.last_hidden = None
    got.prompt_cache.snapshots = {}
    resumed = speculate(model, got.prompt_cache, got.remaining)
    cold_cache = fresh(model)
    cold = speculate(model, cold_cache, prompt)
    assert [t for t, _ in resumed[0]] == [t for t, _ in cold[0]]
    assert got.prompt_cache[-1].offset == cold_cache[-1].offset - 1
    assert_same_caches(got.prompt_cache[:-1], cold_cache[:-1])


def test_a_run_continuing_a_generated_cache_feeds_the_pair_of_its_last_token(model):
    """finish tells the cache the target's last hidden state, so a next turn (a strict
    prefix hit) feeds the head the pair a plain list's head skips."""
    turn = tokens(6, 5)
    for checkpointed in (True, False):
        prompt_cache = CheckpointedCache(fresh(model), STEP, 1 << 40) if checkpointed else fresh(model)
        speculate(model, prompt_cache, PROMPT, max_tokens=3)
        speculate(model, prompt_cache, turn, max_tokens=3)
        target_held = len(PROMPT) + 3 + len(turn) + 3
        assert prompt_cache[-1].offset == target_held - (1 if checkpointed else 2), checkpointed


def prefilled(model, prompt):
    """A cold MTP prefill of all of `prompt` but its last token, with snapshots."""
    prompt_cache = CheckpointedCache(fresh(model), STEP, 1 << 40)
    num_target = len(model.layers)
    head = MTPHead(model, prompt_cache[:num_target], prompt_cache[num_target:], model.args.vocab_size,
                   checkpoints=prompt_cache)
    head.prefill_with_target(mx.array(prompt), STEP, SnapshottingProgress(prompt_cache), lambda c: None)
    return prompt_cache


def test_a_snapshot_counts_its_hidden_row_in_its_bytes(model):
    with_head = prefilled(model, PROMPT[:17])
    target_only = CheckpointedCache(make_prompt_cache(model), STEP, 1 << 40)
    list(speculative_generate_step(mx.array(PROMPT[:17]), model, prompt_lookup=True, max_tokens=1,
                                   prompt_cache=target_only, prefill_step_size=STEP))
    assert with_head.positions() == target_only.positions() == [8, 16]
    row = with_head.snapshots[16].hidden
    assert with_head.snapshots[16].nbytes == target_only.snapshots[16].nbytes + row.nbytes > row.nbytes


def test_trim_prompt_cache_goes_back_to_a_snapshot_target_and_head(model):
    _, prompt_cache = stored(model)
    held = prompt_cache.held_tokens()
    assert held == len(PROMPT) + 3 and prompt_cache[-1].offset == held - 1
    before = flat_state(prompt_cache)
    with pytest.raises(ValueError, match=r"position 23 of the 48 tokens.*snapshots only at \[8, 16, 24, 32, 40\]"):
        trim_prompt_cache(prompt_cache, held - 23)
    assert all(np.array_equal(x, y) for x, y in zip(before, flat_state(prompt_cache)))  # untouched
    assert trim_prompt_cache(prompt_cache, held - 24) == held - 24
    assert prompt_cache.held_tokens() == 24 and prompt_cache[-1].offset == 23
    cold = prefilled(model, PROMPT[:25])
    assert_same_caches(prompt_cache, cold)
    assert mx.array_equal(prompt_cache.hidden_at(24), cold.hidden_at(24)).item()
    # Fed on from there, it continues as a cold run of the whole prompt does.
    resumed = speculate(model, prompt_cache, PROMPT[24:])
    cold_cache = fresh(model)
    assert_same_runs(resumed, speculate(model, cold_cache, PROMPT))
    assert_same_caches(prompt_cache, cold_cache)


def test_a_prompt_cache_file_keeps_the_rows_and_the_heads_count(model, tmp_path):
    saved = prefilled(model, PROMPT)
    path = str(tmp_path / "mtp.safetensors")
    save_checkpointed(path, saved)
    loaded, _ = load_checkpointed(path)
    assert loaded.positions() == saved.positions() == [8, 16, 24, 32, 40]
    for p in loaded.positions():
        assert mx.array_equal(loaded.snapshots[p].hidden, saved.snapshots[p].hidden).item()
    trim_prompt_cache(loaded, loaded.held_tokens() - 16)
    assert loaded[-1].offset == 15
    prompt = PROMPT[:16] + tokens(1, 12)
    resumed = speculate(model, loaded, prompt[16:])
    cold_cache = fresh(model)
    assert_same_runs(resumed, speculate(model, cold_cache, prompt))
    assert_same_caches(loaded, cold_cache)


# --- the server ---------------------------------------------------------------------


@pytest.fixture(scope="module")
def model_dir(model, tmp_path_factory):
    return write_hf(tmp_path_factory.mktemp("mtp_reuse"), CONFIGS[FAMILY], hf_weights(model, fused_experts=False))


DOCUMENT = tokens(3, 37)
FIRST, SECOND = DOCUMENT + tokens(4, 6), DOCUMENT + tokens(5, 9)  # share 37 tokens: resume at 32


def worker(model_dir, kind="one_at_a_time"):
    provider = ModelProvider(str(model_dir), None, False, 10, 1 << 40, None, mtp=True)
    options = dict(prefill_step_size=STEP, default_num_draft_tokens=3, fixed_draft_length=True)
    if kind == "batch":
        return BatchWorker(provider, max_batch_size=2, **options)
    return GenerationWorker(provider, **options)


def stored_head(worker, key):
    """The head entry the worker's prompt cache holds for exactly `key`."""
    return worker.provider.default.prompt_cache.fetch(list(key) + [0]).prompt_cache


@pytest.mark.parametrize("kind", ["one_at_a_time", "batch"])
@pytest.mark.parametrize("sampling", [{}, {"temperature": 1.0, "seed": 3}])
def test_the_server_resumes_an_mtp_prompt_and_answers_as_cold(model_dir, kind, sampling):
    """One at a time and in the batch: the second request resumes at the snapshot and
    answers as a cold server does, drafts included, and both store its prompt with the
    same caches, the head's included."""
    warm = worker(model_dir, kind)
    answer(warm, FIRST, **sampling)
    resumed = answer(warm, SECOND, **sampling)
    assert resumed.cached_tokens == 32 and resumed.speculation.num_drafted > 0
    cold = worker(model_dir, kind)
    again = answer(cold, SECOND, **sampling)
    assert again.cached_tokens == 0 and again.text == resumed.text
    assert (again.speculation.num_drafted, again.speculation.num_accepted) == (
        resumed.speculation.num_drafted, resumed.speculation.num_accepted)
    assert_same_caches(stored_head(warm, SECOND[:-1]), stored_head(cold, SECOND[:-1]))
    lru = warm.provider.default.prompt_cache
    assert lru.nbytes <= lru.max_bytes
