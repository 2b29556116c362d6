"""models/checkpoints.py: snapshots at chunk ends (the prefill step, the grid, message
boundaries) resume every untrimmable kind exactly (Gated DeltaNet, Mamba-2 with and without attention, short convolutions, a
sliding window past its wrap): the resumed cache and its greedy continuation equal a
cold run bit for bit; trim_prompt_cache goes back to a snapshot and refuses elsewhere;
the byte budget holds; the count survives generation or says it is lost."""

from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from family_checks import fixture_model, noisy_model
from test_lru_prompt_cache import flat_state as entry_state

from mlx_lm.generate import generate_step, speculative_generate_step
from mlx_lm.models.lru_prompt_cache import LRUPromptCache
from mlx_lm.models import checkpoints
from mlx_lm.models.cache import KVCache, make_prompt_cache, trim_prompt_cache
from mlx_lm.models.checkpoints import (
    CheckpointedCache,
    PrefillChunks,
    SnapshottingProgress,
    chunk_end,
    first_spacing,
    maybe_snapshot,
)

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


def assert_same_steps(a, b):
    """Two runs' (token, logprobs) steps: the same tokens, the logprobs bit for bit."""
    assert [t for t, _ in a] == [t for t, _ in b]
    assert all(mx.array_equal(x, y).item() for (_, x), (_, y) in zip(a, b))


def assert_resumes_as_cold(model, got, prompt, cold_cache=None, max_tokens=6):
    """A fetched cache's greedy continuation equals a cold run of `prompt` (fed to
    `cold_cache`, a fresh one by default), and so do the caches after it, bit for bit."""
    cold_cache = make_prompt_cache(model) if cold_cache is None else cold_cache
    resumed = greedy(model, got.prompt_cache, got.remaining, max_tokens)
    assert_same_steps(resumed, greedy(model, cold_cache, prompt, max_tokens))
    assert_same_caches(got.prompt_cache, cold_cache)


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
    assert_resumes_as_cold(model, got, prompt)


@pytest.mark.parametrize("family", ["gated_deltanet", "sliding_window"])
def test_a_prompt_leaving_a_cached_answer_resumes_in_its_prompt(family):
    """No snapshot is taken while generating: tokens fed one at a time leave a state a
    cold prefill (cut in chunks) does not compute. A prompt that follows a cached
    prompt and part of its answer, then leaves it (an edited reply, a template that
    renders the answer otherwise), resumes at the prompt's last snapshot and prefills
    the rest as a cold run does: the same continuation, bit for bit."""
    model = fixture_model(FAMILIES[family])
    lru, first = stored(model)
    answer = [token for token, _ in greedy(model, make_prompt_cache(model), PROMPT, max_tokens=3)]
    assert first.positions() == [8, 16, 24, 32, 40]  # none past the prompt
    prompt = PROMPT + answer[:2] + tokens(2, 9)
    got = lru.fetch(prompt)
    assert (got.num_cached, got.remaining) == (40, prompt[40:])
    assert_resumes_as_cold(model, got, prompt)


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


def test_chunk_ends_are_a_function_of_position():
    """The step, the grid and the message boundaries cut a chunk, whichever comes first,
    whatever position a run began at."""
    assert checkpoints.SNAPSHOT_GRID == 128
    assert chunk_end(0, 2048) == 128 and chunk_end(300, 2048) == 384 and chunk_end(300, 100) == 384
    assert chunk_end(500, 100) == 512 and chunk_end(512, 100) == 600 and chunk_end(13, 8) == 16
    assert chunk_end(0, 2048, (13, 300)) == 13 and chunk_end(13, 2048, (13, 300)) == 128
    assert chunk_end(256, 2048, (13, 300)) == 300
    assert first_spacing(2048) == 128 and first_spacing(8) == 8 and first_spacing(100) == 100
    with pytest.raises(ValueError, match=r"increasing positive token positions, got \[5, 3\]"):
        CheckpointedCache([], STEP, 1).set_message_boundaries([5, 3])
    # A loop cutting whole steps from each segment's start (the batch) cuts these chunks.
    hybrid = make_prompt_cache(fixture_model(FAMILIES["gated_deltanet"]))
    segments = PrefillChunks(hybrid, 100).segments(list(range(600)))
    assert [len(s) for s in segments] == [128, 72, 56, 44, 84, 16, 112, 88] and sum(segments, []) == list(range(600))
    assert PrefillChunks([KVCache()], 100).segments(list(range(600))) == [list(range(600))]


def test_at_the_default_step_snapshots_sit_on_the_grid(monkeypatch):
    """A prefill step coarser than the prompt still leaves snapshots (every grid
    multiple ends a chunk, in cold runs too), and a resumed prompt equals a cold one."""
    monkeypatch.setattr(checkpoints, "SNAPSHOT_GRID", 16)
    model = fixture_model(FAMILIES["gated_deltanet"])
    lru = LRUPromptCache()
    first = lru.checkpointed(make_prompt_cache(model), 2048)
    steps = generate_step(mx.array(PROMPT), model, max_tokens=2, prompt_cache=first)
    lru.insert(PROMPT + [t for t, _ in steps], first)
    assert first.positions() == [16, 32]
    prompt = PROMPT[:40] + tokens(1, 12)
    got = lru.fetch(prompt)
    assert got.num_cached == 32
    resumed = list(generate_step(mx.array(got.remaining), model, max_tokens=4, prompt_cache=got.prompt_cache))
    cold_cache = make_prompt_cache(model)
    cold = list(generate_step(mx.array(prompt), model, max_tokens=4, prompt_cache=cold_cache))
    assert_same_steps(resumed, cold)
    assert_same_caches(got.prompt_cache, cold_cache)


BOUNDARIES = (13, 30)  # where a chat template's earlier messages end, say


def test_message_boundaries_cut_chunks_and_resume_only_prompts_cut_alike():
    """Chunks end at the prompt's message boundaries too, snapshots are taken there,
    and a snapshot resumes a prompt only where its boundaries up to it are the same
    (a cold run of it is then cut alike, and equals the resumed one bit for bit)."""
    model = fixture_model(FAMILIES["gated_deltanet"])
    lru = LRUPromptCache()
    first = lru.checkpointed(make_prompt_cache(model), STEP, message_boundaries=BOUNDARIES)
    lru.insert(PROMPT + [t for t, _ in greedy(model, first, PROMPT, max_tokens=2)], first)
    assert first.positions() == [8, 13, 16, 24, 30, 32, 40]
    prompt = PROMPT[:35] + tokens(1, 12)
    for bounds, resumed_at in [(BOUNDARIES, 32), ((13, 36), 24), ((14,), 8)]:
        got = lru.fetch(prompt, message_boundaries=bounds)
        assert got.num_cached == resumed_at, bounds
        cold_cache = lru.checkpointed(make_prompt_cache(model), STEP, message_boundaries=bounds)
        assert_resumes_as_cold(model, got, prompt, cold_cache, max_tokens=3)


def test_snapshots_at_message_boundaries_outlast_the_grid_ones():
    model = fixture_model(FAMILIES["gated_deltanet"])
    probe = CheckpointedCache(make_prompt_cache(model), STEP, 1 << 40)
    greedy(model, probe, PROMPT[:9], max_tokens=1)
    one = probe.snapshot_bytes
    # The grid thins (8, 16, 32, 64: only the newest of it is left), the boundaries
    # stay; with room for two, the oldest boundary goes too.
    for budget, positions in [(3, [13, 30, 40]), (2, [30, 40])]:
        prompt_cache = CheckpointedCache(make_prompt_cache(model), STEP, budget * one)
        prompt_cache.set_message_boundaries(BOUNDARIES)
        greedy(model, prompt_cache, PROMPT, max_tokens=1)
        assert prompt_cache.positions() == positions and prompt_cache.snapshot_bytes <= budget * one


def test_speculation_takes_snapshots_target_and_draft_alike():
    """speculative_generate_step with a CheckpointedCache (a hybrid target and a hybrid
    draft) snapshots both at the grid, and a prompt resumed from them answers as a cold
    speculative run, caches bit for bit."""
    model = fixture_model(FAMILIES["gated_deltanet"])
    draft = noisy_model(FAMILIES["gated_deltanet"], 0.5)

    def speculate(prompt_cache, prompt):
        steps = speculative_generate_step(mx.array(prompt), model, draft, num_draft_tokens=2, max_tokens=6,
                                          prompt_cache=prompt_cache, prefill_step_size=STEP)
        return [(t, lp) for t, lp, _ in steps]

    lru = LRUPromptCache()
    first = lru.checkpointed(make_prompt_cache(model) + make_prompt_cache(draft), STEP)
    lru.insert(PROMPT + [t for t, _ in speculate(first, PROMPT)], first)
    assert first.positions() == [8, 16, 24, 32, 40]
    prompt = PROMPT[:20] + tokens(1, 12)
    got = lru.fetch(prompt)
    assert got.num_cached == 16
    resumed = speculate(got.prompt_cache, got.remaining)
    cold_cache = make_prompt_cache(model) + make_prompt_cache(draft)
    cold = speculate(cold_cache, prompt)
    assert_same_steps(resumed, cold)
    assert_same_caches(got.prompt_cache, cold_cache)


def test_speculation_with_a_quantized_kv_keeps_every_snapshot():
    """With kv_bits the loop replaces the KV entries of the target's and the draft's
    parts of the list by quantized ones; the list takes them back at every chunk, so
    its snapshots see the entries being fed (before, they saw the float ones, frozen at
    the first chunk, lost count and stopped at 64) and a resumed prompt answers as cold.
    The demo pair: the tiny models' heads (16) are narrower than any quantization group."""
    from mlx_lm import load

    demo = Path(__file__).resolve().parent.parent / "examples" / "models"
    model, draft = load(str(demo / "qwen3-next-stdlib"))[0], load(str(demo / "qwen3-draft-stdlib"))[0]
    step, document = 64, tokens(5, 300)

    def speculate(prompt_cache, prompt):
        steps = speculative_generate_step(mx.array(prompt), model, draft, max_tokens=6, prompt_cache=prompt_cache,
                                          prefill_step_size=step, kv_bits=8, quantized_kv_start=0)
        return [(t, lp) for t, lp, _ in steps]

    lru = LRUPromptCache()
    first = lru.checkpointed(make_prompt_cache(model) + make_prompt_cache(draft), step)
    lru.insert(document + [t for t, _ in speculate(first, document)], first)
    assert first.positions() == [64, 128, 192, 256]
    assert any(type(entry).__name__ == "QuantizedKVCache" for entry in first)
    prompt = document[:200] + tokens(6, 20)
    got = lru.fetch(prompt)
    assert got.num_cached == 192
    resumed = speculate(got.prompt_cache, got.remaining)
    cold = speculate(lru.checkpointed(make_prompt_cache(model) + make_prompt_cache(draft), step), prompt)
    assert_same_steps(resumed, cold)
