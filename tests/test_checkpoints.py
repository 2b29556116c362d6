"""models/checkpoints.py: snapshots on the prefill grid resume every untrimmable kind
exactly (Gated DeltaNet, Mamba-2 with and without attention, short convolutions, a
sliding window past its wrap): the resumed cache and its greedy continuation equal a
cold run bit for bit; trim_prompt_cache goes back to a snapshot and refuses elsewhere;
the byte budget holds; the count survives generation or says it is lost."""

import mlx.core as mx
import numpy as np
import pytest
from family_checks import fixture_model
from test_lru_prompt_cache import flat_state as entry_state

from mlx_lm.generate import generate_step
from mlx_lm.lru_prompt_cache import LRUPromptCache
from mlx_lm.models.cache import make_prompt_cache, trim_prompt_cache
from mlx_lm.models.checkpoints import CheckpointedCache, SnapshottingProgress, maybe_snapshot

STEP = 8  # the prefill step: snapshots at 8, 16, 24, ...
FAMILIES = {
    "gated_deltanet": "qwen3_next_tf4",
    "mamba2_hybrid": "nemotron_h_tf4",
    "mamba2": "mamba2_tf4",  # recurrent entries only: counted by array identity
    "short_conv": "lfm2_tf4",
    "sliding_window": "gemma3_text_tf4",  # window 8: wrapped long before 45 tokens
}


def tokens(seed, n):
    return np.random.default_rng(seed).integers(1, 256, n).tolist()


PROMPT = tokens(0, 45)  # fed 44 tokens: snapshots at 8..40


def greedy(model, prompt_cache, prompt, max_tokens=6):
    steps = generate_step(mx.array(prompt), model, max_tokens=max_tokens, prompt_cache=prompt_cache,
                          prefill_step_size=STEP)
    return [(token, logprobs) for token, logprobs in steps]


def flat_state(prompt_cache):
    return [array for entry in prompt_cache for array in entry_state(entry)[0]]


def assert_same_caches(a, b):
    arrays_a, arrays_b = flat_state(a), flat_state(b)
    assert len(arrays_a) == len(arrays_b)
    for x, y in zip(arrays_a, arrays_b):
        np.testing.assert_array_equal(x, y)
    assert [e.meta_state for e in a] == [e.meta_state for e in b]


def stored(model, prompt=PROMPT):
    """An LRU holding `prompt` plus a few generated tokens, prefilled with snapshots."""
    lru = LRUPromptCache()
    prompt_cache = lru.checkpointed(make_prompt_cache(model), STEP)
    generated = [token for token, _ in greedy(model, prompt_cache, prompt, max_tokens=3)]
    lru.insert(prompt + generated, prompt_cache)
    return lru, prompt_cache


@pytest.mark.parametrize("family", sorted(FAMILIES))
@pytest.mark.parametrize("shared, resumed_at", [(16, 16), (15, 8), (17, 16), (44, 40)])
def test_a_resumed_prompt_equals_a_cold_run(family, shared, resumed_at):
    """Shared lengths on, just before and just after a snapshot: the fetched cache
    resumes at the nearest one at or before, and the continuation equals a cold run
    of the same prompt token for token and logit for logit, caches bit for bit."""
    model = fixture_model(FAMILIES[family])
    lru, first = stored(model)
    assert first.positions() == [8, 16, 24, 32, 40]
    prompt = PROMPT[:shared] + tokens(1, 12)
    got = lru.fetch(prompt)
    assert (got.num_cached, got.remaining) == (resumed_at, prompt[resumed_at:])
    resumed = greedy(model, got.prompt_cache, got.remaining)
    cold_cache = make_prompt_cache(model)
    cold = greedy(model, cold_cache, prompt)
    assert [t for t, _ in resumed] == [t for t, _ in cold]
    for (_, a), (_, b) in zip(resumed, cold):
        assert mx.array_equal(a, b).item()
    assert_same_caches(got.prompt_cache, cold_cache)


def test_moving_a_chunk_boundary_changes_the_state():
    """Why snapshots are taken only on the prefill grid: the chunked recurrence rounds
    differently when a chunk boundary moves, so a state at an off-grid position is not
    the one a cold prefill computes."""
    model = fixture_model(FAMILIES["gated_deltanet"])
    states = []
    for cuts in ([0, 16, 24], [0, 12, 24]):
        prompt_cache = make_prompt_cache(model)
        for start, end in zip(cuts, cuts[1:]):
            model(mx.array(PROMPT[start:end])[None], cache=prompt_cache)
        states.append(flat_state(prompt_cache))
    assert any(not np.array_equal(x, y) for x, y in zip(*states))


def fed_on_grid(model, prompt, num_tokens):
    """A cold prefill's cache after exactly `num_tokens` (a multiple of STEP)."""
    prompt_cache = make_prompt_cache(model)
    for start in range(0, num_tokens, STEP):
        model(mx.array(prompt[start : start + STEP])[None], cache=prompt_cache)
    mx.eval([c.state for c in prompt_cache])
    return prompt_cache


@pytest.mark.parametrize("family", ["gated_deltanet", "sliding_window"])
def test_trim_prompt_cache_goes_back_to_a_snapshot_and_refuses_elsewhere(family):
    model = fixture_model(FAMILIES[family])
    _, prompt_cache = stored(model)
    held = prompt_cache.held_tokens()
    assert held == len(PROMPT) + 3
    before = flat_state(prompt_cache)
    with pytest.raises(ValueError, match=r"position 23 of the 48 tokens.*snapshots only at \[8, 16, 24, 32, 40\]"):
        trim_prompt_cache(prompt_cache, held - 23)
    assert prompt_cache.held_tokens() == held  # untouched
    for x, y in zip(before, flat_state(prompt_cache)):
        np.testing.assert_array_equal(x, y)
    assert trim_prompt_cache(prompt_cache, held - 24) == held - 24
    assert prompt_cache.held_tokens() == 24 and prompt_cache.positions() == [8, 16, 24]
    assert_same_caches(prompt_cache, fed_on_grid(model, PROMPT, 24))
    # Fed on from there, it takes snapshots again (it holds a cold prefill's state).
    greedy(model, prompt_cache, PROMPT[24:], max_tokens=1)
    assert prompt_cache.positions() == [8, 16, 24, 32, 40]


def test_snapshots_stay_within_the_byte_budget():
    model = fixture_model(FAMILIES["gated_deltanet"])
    probe = CheckpointedCache(make_prompt_cache(model), STEP, 1 << 40)
    greedy(model, probe, PROMPT[:9], max_tokens=1)
    one = probe.snapshot_bytes
    assert probe.positions() == [8] and one > 0
    prompt = tokens(2, 101)  # 100 fed: 12 grid positions
    prompt_cache = CheckpointedCache(make_prompt_cache(model), STEP, 3 * one)
    greedy(model, prompt_cache, prompt, max_tokens=1)
    assert prompt_cache.snapshot_bytes <= 3 * one
    # The spacing doubled from 8 until the older ones fit; the newest stays.
    assert prompt_cache.spacing == 32 and prompt_cache.positions() == [32, 64, 96]
    lean = CheckpointedCache(make_prompt_cache(model), STEP, one - 1)
    greedy(model, lean, prompt, max_tokens=1)
    assert lean.positions() == []


def test_a_recurrent_only_cache_knows_when_its_count_is_lost():
    """Mamba-2 alone has no attention offset: generation past the hooks makes the
    count unknown (trim raises) instead of wrong, until the owner says it."""
    model = fixture_model(FAMILIES["mamba2"])
    prompt_cache = CheckpointedCache(make_prompt_cache(model), STEP, 1 << 40)
    generated = [t for t, _ in greedy(model, prompt_cache, PROMPT, max_tokens=3)]
    with pytest.raises(RuntimeError, match="does not know how many tokens it holds"):
        trim_prompt_cache(prompt_cache, 10)
    greedy(model, prompt_cache, tokens(3, 20), max_tokens=1)  # a next turn: no snapshots at unknown positions
    assert prompt_cache.positions() == [8, 16, 24, 32, 40]
    prompt_cache = CheckpointedCache(make_prompt_cache(model), STEP, 1 << 40)
    greedy(model, prompt_cache, PROMPT, max_tokens=3)
    prompt_cache.count_as(len(PROMPT) + len(generated))
    trim_prompt_cache(prompt_cache, len(PROMPT) + len(generated) - 32)
    assert_same_caches(prompt_cache, fed_on_grid(model, PROMPT, 32))


def test_an_attention_offset_keeps_the_count_through_generation():
    model = fixture_model(FAMILIES["gated_deltanet"])
    prompt_cache = CheckpointedCache(make_prompt_cache(model), STEP, 1 << 40)
    greedy(model, prompt_cache, PROMPT, max_tokens=4)
    assert prompt_cache.held_tokens() == len(PROMPT) + 4  # generate_step fed every token it yielded
    with pytest.raises(ValueError, match="attention entries hold 49 tokens, not 50"):
        prompt_cache.count_as(50)


def test_a_chunk_told_twice_counts_once_and_off_grid_chunks_take_no_snapshots():
    model = fixture_model(FAMILIES["short_conv"])
    prompt_cache = CheckpointedCache(make_prompt_cache(model), STEP, 1 << 40)
    progress = SnapshottingProgress(prompt_cache)
    for start in range(0, 24, STEP):
        model(mx.array(PROMPT[start : start + STEP])[None], cache=prompt_cache)
        maybe_snapshot(prompt_cache, STEP)  # a loop's hook, then the progress around it
        progress(start + STEP, 45)
    assert prompt_cache.held_tokens() == 24 and prompt_cache.positions() == [8, 16, 24]
    model(mx.array(PROMPT[24:29])[None], cache=prompt_cache)  # a prompt's last, short chunk
    maybe_snapshot(prompt_cache, 5)
    model(mx.array(PROMPT[29:37])[None], cache=prompt_cache)  # whole, but off the grid now
    maybe_snapshot(prompt_cache, 8)
    assert prompt_cache.held_tokens() == 37 and prompt_cache.positions() == [8, 16, 24]
    with pytest.raises(ValueError, match="cannot feed -1"):
        maybe_snapshot(prompt_cache, -1)
    with pytest.raises(ValueError, match="prefill_step_size must be positive"):
        CheckpointedCache([], 0, 1)
