"""mamba.py: the shared family checks (family_checks.py) on the mamba fixtures, plus its
config dialects and errors, its weight layouts, its cache, and the sampling law at T > 0
with a disagreeing draft (a recurrent family, rolled back every round).

Fixtures (tests/fixtures/make_mamba_reference.py, 40 tokens, past the 32-token chunk of
selective_scan.py): `mamba_tf5` as transformers 5 writes it (untied head); `mamba_tf4`
in the hub's transformers-4 dialect (no tie key: tied; mamba_ssm leftovers; projection
biases, no conv bias, 3 taps, dt rank 8, residual_in_fp32 false).
"""

import json

import mlx.core as mx
import pytest
from checkpoints import perturb
from family_checks import FIXTURES, Family, FamilyChecks, fixture_model, random_model, reference, relative_error
from test_speculative_sampling import PROMPT as LAW_PROMPT
from test_speculative_sampling import assert_target_law

from mlx_lm.generate import SpeculationStats, speculative_generate_step
from mlx_lm.models.cache import ArraysCache, make_prompt_cache, trim_prompt_cache
from mlx_lm.models.mamba import CONV_STATE, SSM_STATE, ModelArgs
from mlx_lm.sample_utils import make_logits_processors, make_sampler

FAMILY = Family(
    fixtures=["mamba_tf4", "mamba_tf5"],
    tiny=dict(model_type="mamba", vocab_size=512, hidden_size=64, num_hidden_layers=2, state_size=8,
              tie_word_embeddings=False, eos_token_id=0),
    small=dict(model_type="mamba", vocab_size=256, hidden_size=32, num_hidden_layers=1, state_size=8),
)


class TestMamba(FamilyChecks):
    family = FAMILY


ARGS = dict(model_type="mamba", vocab_size=64, hidden_size=32, num_hidden_layers=2, state_size=8)


def raw_weights(name):
    return mx.load(str(FIXTURES / name / "model.safetensors"))


def config(name):
    return json.loads((FIXTURES / name / "config.json").read_text())


# --- config -----------------------------------------------------------------------------


def test_config_dialects_normalise_alike():
    tf4, tf5 = config("mamba_tf4"), config("mamba_tf5")
    assert "tie_word_embeddings" not in tf4 and tf5["tie_word_embeddings"] is False
    args4, args5 = ModelArgs.from_dict(tf4), ModelArgs.from_dict(tf5)
    assert args4.tie_word_embeddings and not args5.tie_word_embeddings
    assert (args4.intermediate_size, args4.time_step_rank, args5.time_step_rank) == (128, 8, 4)
    # The same model written without the derived keys, or with "auto", reads the same.
    derived = {k: v for k, v in tf5.items() if k not in ("intermediate_size", "time_step_rank")}
    assert ModelArgs.from_dict(derived) == args5
    assert ModelArgs.from_dict(dict(derived, time_step_rank="auto")) == args5
    # A written intermediate_size wins over expand, as in transformers: falcon-mamba-7b
    # writes expand 16 beside intermediate_size 8192 (2 x its hidden size 4096).
    assert ModelArgs.from_dict(dict(ARGS, expand=16, intermediate_size=64)).intermediate_size == 64


def test_config_errors_name_the_value():
    with pytest.raises(ValueError, match="intermediate_size must be positive, got 0"):
        ModelArgs.from_dict(dict(ARGS, intermediate_size=0))
    with pytest.raises(ValueError, match="time_step_rank must be a positive int or 'auto', got 'big'"):
        ModelArgs.from_dict(dict(ARGS, time_step_rank="big"))
    with pytest.raises(ValueError, match="hidden_act 'gelu'"):
        ModelArgs.from_dict(dict(ARGS, hidden_act="gelu"))
    with pytest.raises(ValueError, match="conv_kernel must be >= 2, got 1"):
        ModelArgs.from_dict(dict(ARGS, conv_kernel=1))


# --- weights ----------------------------------------------------------------------------


def test_sanitize_converts_the_hf_layout_once():
    model = fixture_model("mamba_tf4")  # tied, 3 taps
    raw = raw_weights("mamba_tf4")
    older = {("backbone.embedding.weight" if k == "backbone.embeddings.weight" else k): v for k, v in raw.items()}
    older["lm_head.weight"] = raw["backbone.embeddings.weight"]  # a saved tied copy is dropped
    once = model.sanitize(older)
    again = model.sanitize(dict(once))
    assert once.keys() == again.keys() and all(mx.array_equal(once[k], again[k]) for k in once)
    assert "lm_head.weight" not in once and "backbone.embedding.weight" not in once
    conv = "backbone.layers.1.mixer.conv1d.weight"
    assert raw[conv].shape == (128, 1, 3) and once[conv].shape == (128, 3, 1)
    assert mx.array_equal(once[conv][..., 0], raw[conv][:, 0])
    model.load_weights(list(once.items()))  # every parameter, each shape as the model has it
    untied = fixture_model("mamba_tf5")
    assert "lm_head.weight" in untied.sanitize(raw_weights("mamba_tf5"))


# --- cache ------------------------------------------------------------------------------


def test_cache_layout_and_decode():
    """One ArraysCache per layer: the last K-1 conv inputs and the fp32 (I, N) state;
    decoding token by token follows transformers' full forward."""
    model = fixture_model("mamba_tf5")
    cache = make_prompt_cache(model)
    assert [type(c) for c in cache] == [ArraysCache] * 2
    ids, want = reference("mamba_tf5")
    for t in range(6):
        logits = model(ids[:, t : t + 1], cache=cache)
    assert relative_error(logits[0, -1], want[0, 5]) < 1e-4
    assert cache[0][CONV_STATE].shape == (1, 3, 128)
    assert cache[0][SSM_STATE].shape == (1, 128, 8) and cache[0][SSM_STATE].dtype == mx.float32


def test_prefill_records_nothing_and_speculation_records_each_forward():
    model = fixture_model("mamba_tf5")
    cache = make_prompt_cache(model)
    model(mx.array([[1, 2, 3, 4]]), cache=cache)
    assert not any(c.is_trimmable() for c in cache)
    with pytest.raises(RuntimeError, match="outside speculation"):
        cache[0].trim(1)
    for c in cache:
        c.start_speculation()
    model(mx.array([[5, 6, 7]]), cache=cache)
    model(mx.array([[8]]), cache=cache)
    assert [n for n, _ in cache[0]._rollbacks.records] == [3, 1]
    with pytest.raises(RuntimeError, match="Cannot roll back 5 tokens: only 4 are recorded"):
        cache[0].trim(5)


def test_rollback_equals_a_feed_bit_for_bit():
    """Stronger than the shared check (which allows float tolerance): the replay steps
    the decode step's arithmetic on the verify forward's own per-token inputs, so rolling
    a 6-token forward back to m leaves the caches a feed of the m tokens leaves, bit for
    bit (the reference BLAS computes each row of a product alike whatever the rows)."""
    model = fixture_model("mamba_tf5")

    def prefilled():
        cache = make_prompt_cache(model)
        model(LAW_PROMPT[None], cache=cache)
        for c in cache:
            c.start_speculation()
        return cache

    chunk = [11, 22, 33, 44, 55, 66]
    for m in range(1, 6):
        rolled, fed = prefilled(), prefilled()
        model(mx.array([chunk]), cache=rolled)
        trim_prompt_cache(rolled, len(chunk) - m)
        model(mx.array([chunk[:m]]), cache=fed)
        assert all(mx.array_equal(a, b) for r, f in zip(rolled, fed) for a, b in zip(r.state, f.state)), m


# --- the sampling law -------------------------------------------------------------------

VOCAB = 16
LAW_CONFIG = dict(model_type="mamba", vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, state_size=8,
                  tie_word_embeddings=False)


def test_speculative_sampling_has_the_target_law():
    """At T = 1 with top-k, top-p, min-p and a repetition penalty, a mamba target with a
    draft that is itself plus noise (about half its drafts rejected, so the recurrent
    states roll back most rounds) emits tokens with the target's law at every position
    (test_speculative_sampling's PIT and draft-lean tests)."""
    target = random_model(LAW_CONFIG, seed=0, scale=0.3)
    draft = perturb(random_model(LAW_CONFIG, seed=0, scale=0.3), 0.6, seed=1)
    sampler = make_sampler(temp=1.0, top_k=10, top_p=0.9, min_p=0.05)
    processors = make_logits_processors(repetition_penalty=1.5)
    mx.random.seed(11)
    stats = SpeculationStats()
    tokens = [t for t, _, _ in speculative_generate_step(
        LAW_PROMPT, target, draft, num_draft_tokens=3, adaptive_draft_length=False, stats=stats, max_tokens=500,
        sampler=sampler, logits_processors=processors)]
    assert 0.2 < stats.acceptance_rate < 0.8, stats.acceptance_rate
    assert_target_law(target, draft, tokens, sampler, processors, "mamba")
