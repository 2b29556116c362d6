"""Exact rollback through whole models: Gated-DeltaNet hybrids and gpt-oss past its window.

Equalities (DESIGN.md §2):
1. Tail independence, bit for bit: two verify chunks sharing an m-token prefix, each
   rolled back to m, leave identical caches (every state array) and identical next logits.
2. Replay equals feed: rollback to m equals feeding exactly those m tokens from the
   pre-forward state, to fp32 tolerance (the feed's projections run on m rows instead
   of T, so BLAS may round them differently; the recurrence itself is replayed with the
   same code).
"""

import mlx.core as mx
import numpy as np
import pytest
from conftest import FIXTURES
from mlx.utils import tree_flatten

from mlx_lm.models.cache import make_prompt_cache, trim_prompt_cache
from mlx_lm.utils import load_model

FAMILIES = ["qwen3_next_tf5", "qwen3_5_tf5", "qwen3_5_moe_tf4", "gpt_oss_tf5"]
PROMPT = mx.array([[(i * 53 + 7) % 256 for i in range(20)]])  # past gpt-oss's window of 8
T = 5


def load(name):
    return load_model(FIXTURES / name)[0]


def prefilled(model):
    cache = make_prompt_cache(model)
    model(PROMPT, cache=cache)
    for c in cache:
        c.start_speculation()
    return cache


def flat_state(cache):
    return [x for c in cache for _, x in tree_flatten(c.state) if x is not None]


def chunk(prefix, seed):
    rng = np.random.default_rng(seed)
    return mx.array([prefix + rng.integers(0, 256, T - len(prefix)).tolist()])


@pytest.mark.parametrize("name", FAMILIES)
def test_tail_independence_and_replay_equals_feed(name):
    model = load(name)
    assert type(model).supports_speculative_rollback
    prefix_all = [11, 22, 33, 44, 55]
    next_token = mx.array([[99]])
    for m in range(T + 1):
        prefix = prefix_all[:m]
        caches = []
        for seed in (1, 2):
            cache = prefilled(model)
            model(chunk(prefix, seed), cache=cache)
            assert trim_prompt_cache(cache, T - m) == T - m
            caches.append(cache)
        a, b = (flat_state(c) for c in caches)
        assert len(a) == len(b) and all(mx.array_equal(x, y) for x, y in zip(a, b)), f"m={m}"
        logits = [model(next_token, cache=c) for c in caches]
        assert mx.array_equal(logits[0], logits[1]), f"m={m}"

        fed = prefilled(model)
        if m:
            model(mx.array([prefix]), cache=fed)
        replayed = prefilled(model)
        model(chunk(prefix, 3), cache=replayed)
        trim_prompt_cache(replayed, T - m)
        for x, y in zip(flat_state(replayed), flat_state(fed)):
            assert mx.allclose(x, y, atol=1e-5, rtol=1e-5), f"m={m}"


@pytest.mark.parametrize("name", ["qwen3_next_tf5", "qwen3_5_tf5"])
def test_stacked_draft_records_rewind_together(name):
    """Three single-token forwards (a hybrid draft drafting) roll back at once."""
    model = load(name)
    cache = prefilled(model)
    before = flat_state(cache)
    after_one = None
    for i, token in enumerate([5, 6, 7]):
        model(mx.array([[token]]), cache=cache)
        if i == 0:
            after_one = flat_state(cache)
    trim_prompt_cache(cache, 2)
    assert all(mx.array_equal(x, y) for x, y in zip(flat_state(cache), after_one))
    trim_prompt_cache(cache, 1)
    assert all(mx.array_equal(x, y) for x, y in zip(flat_state(cache), before))


@pytest.mark.parametrize("name", ["qwen3_next_tf5"])
def test_rollback_limits(name):
    model = load(name)
    cache = make_prompt_cache(model)
    model(PROMPT, cache=cache)
    with pytest.raises(ValueError, match="ArraysCache"):
        trim_prompt_cache(cache, 1)  # not speculating: recurrent state cannot trim
    for c in cache:
        c.start_speculation(rollback_window=4)
    with pytest.raises(RuntimeError, match="only 0 are recorded"):
        trim_prompt_cache(cache, 1)  # nothing recorded yet: prefill does not record
    model(mx.array([[1, 2, 3]]), cache=cache)
    with pytest.raises(RuntimeError, match="Cannot roll back 4 tokens"):
        trim_prompt_cache(cache, 4)
    for c in cache:
        c.stop_speculation()
    assert not any(c.is_trimmable() and c.needs_layer_records for c in cache)


def test_recording_keeps_no_prompt_sized_tensors():
    """Prefill runs before start_speculation, so records only hold verify-sized inputs."""
    model = load("qwen3_next_tf5")
    cache = prefilled(model)
    recurrent = [c for c in cache if c.needs_layer_records]
    assert all(c._rollbacks.num_tokens == 0 for c in recurrent)
    model(mx.array([[1, 2]]), cache=cache)
    assert all(c._rollbacks.num_tokens == 2 for c in recurrent)
