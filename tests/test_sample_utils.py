"""Samplers and logits processors, checked against numpy references."""

import math

import mlx.core as mx
import numpy as np
import pytest

from mlx_lm.sample_utils import (
    CategoricalSampler,
    apply_min_p,
    apply_top_k,
    apply_top_p,
    apply_xtc,
    categorical_sampling,
    greedy_sampler,
    make_logits_processors,
    make_sampler,
)

PROBS = np.array([0.05, 0.4, 0.1, 0.3, 0.15], dtype=np.float32)
NUM_DRAWS = 20000
# Binomial std of a frequency is sqrt(p (1 - p) / N) <= 0.0036 for N = 20000,
# so 0.02 is more than 5 standard deviations.
FREQUENCY_TOLERANCE = 0.02


def logprobs_of(probs) -> mx.array:
    """(V,) probabilities -> (1, V) log-probabilities."""
    return mx.log(mx.array(np.asarray(probs, dtype=np.float32)))[None]


def kept(filtered: mx.array) -> np.ndarray:
    """(1, V) filtered log-probs -> boolean mask of the entries not at -inf."""
    return np.isfinite(np.array(filtered[0]))


def empirical_frequencies(sampler, probs, num_draws=NUM_DRAWS) -> np.ndarray:
    """Draw ``num_draws`` tokens in one batched call; return (V,) frequencies."""
    logprobs = mx.broadcast_to(logprobs_of(probs), (num_draws, len(probs)))
    tokens = np.array(sampler(logprobs))
    return np.bincount(tokens, minlength=len(probs)) / num_draws


def renormalised(probs, mask) -> np.ndarray:
    restricted = np.where(mask, probs, 0.0)
    return restricted / restricted.sum()


# ---------------------------------------------------------------------------
# Filters against hand-computed references
# ---------------------------------------------------------------------------


def test_greedy_is_argmax_per_row():
    logprobs = mx.array([[0.1, 3.0, -1.0], [5.0, 0.0, 4.9]])
    tokens = make_sampler(temp=0.0)(logprobs)
    assert tokens.shape == (2,)
    assert tokens.tolist() == [1, 0]


@pytest.mark.parametrize(
    "top_p, expected",
    [
        (0.3, [False, True, False, False, False]),  # 0.4 >= 0.3 already
        (0.5, [False, True, False, True, False]),  # 0.4 + 0.3
        (0.75, [False, True, False, True, True]),  # + 0.15 = 0.85
        (0.9, [False, True, True, True, True]),  # + 0.1 = 0.95
        (0.99, [True, True, True, True, True]),
    ],
)
def test_top_p_keeps_smallest_nucleus(top_p, expected):
    filtered = apply_top_p(logprobs_of(PROBS), top_p)
    assert kept(filtered).tolist() == expected
    # Kept entries are untouched.
    np.testing.assert_array_equal(
        np.array(filtered[0])[kept(filtered)], np.log(PROBS)[np.array(expected)]
    )


def random_logprobs(seed: int, shape=(4, 50)) -> np.ndarray:
    rng = np.random.default_rng(seed)
    logits = rng.normal(size=shape).astype(np.float32) * 2
    return logits - np.log(np.exp(logits).sum(-1, keepdims=True))


def test_top_p_matches_numpy_reference_on_random_rows():
    logprobs = random_logprobs(0)
    probs = np.exp(logprobs.astype(np.float64))
    reference = np.zeros_like(probs, dtype=bool)
    for row, row_probs in enumerate(probs):
        mass = 0.0
        for token in np.argsort(-row_probs):
            reference[row, token] = True
            mass += row_probs[token]
            if mass >= 0.7:
                break
    filtered = np.isfinite(np.array(apply_top_p(mx.array(logprobs), 0.7)))
    np.testing.assert_array_equal(filtered, reference)


def test_top_p_always_keeps_the_top_token():
    filtered = apply_top_p(logprobs_of([0.9, 0.05, 0.05]), 0.01)
    assert kept(filtered).tolist() == [True, False, False]


@pytest.mark.parametrize("dtype", [mx.float32, mx.float16, mx.bfloat16])
@pytest.mark.parametrize("top_p", [1e-8, 1e-4])
def test_top_p_keeps_the_top_token_at_tiny_thresholds_in_every_dtype(dtype, top_p):
    # float16 rounds 1e-8 to 0, which no mass is below: the top token must stay anyway.
    logits = mx.random.normal((2, 4096), key=mx.random.key(0)) * 3
    logprobs = (logits - mx.logsumexp(logits, axis=-1, keepdims=True)).astype(dtype)
    filtered = apply_top_p(logprobs, top_p)
    assert (filtered > -mx.inf).sum(axis=-1).tolist() == [1, 1]
    assert mx.array_equal(filtered.max(axis=-1), logprobs.max(axis=-1))


def test_top_p_per_row_in_a_batch():
    logprobs = mx.log(mx.array([[0.6, 0.3, 0.1], [0.1, 0.2, 0.7]]))
    filtered = np.isfinite(np.array(apply_top_p(logprobs, 0.8)))
    assert filtered.tolist() == [[True, True, False], [False, True, True]]


@pytest.mark.parametrize(
    "min_p, min_tokens, expected",
    [
        (0.5, 1, [False, True, False, True, False]),  # p >= 0.2
        (0.3, 1, [False, True, False, True, True]),  # p >= 0.12
        (0.9, 1, [False, True, False, False, False]),  # p >= 0.36
        (0.9, 3, [False, True, False, True, True]),  # keep at least 3
        (0.0, 1, [True, True, True, True, True]),
    ],
)
def test_min_p(min_p, min_tokens, expected):
    filtered = apply_min_p(logprobs_of(PROBS), min_p, min_tokens)
    assert kept(filtered).tolist() == expected


def test_min_p_matches_numpy_reference_on_random_rows():
    logprobs = random_logprobs(1)
    probs = np.exp(logprobs)
    reference = probs >= 0.1 * probs.max(-1, keepdims=True)
    filtered = np.isfinite(np.array(apply_min_p(mx.array(logprobs), 0.1)))
    np.testing.assert_array_equal(filtered, reference)


@pytest.mark.parametrize("top_k", [1, 2, 4, 5, 9])
def test_top_k_keeps_exactly_the_k_largest(top_k):
    filtered = apply_top_k(logprobs_of(PROBS), top_k)
    order = np.argsort(-PROBS)
    expected = np.zeros(len(PROBS), dtype=bool)
    expected[order[:top_k]] = True
    assert kept(filtered).tolist() == expected.tolist()
    np.testing.assert_array_equal(
        np.array(filtered[0])[expected], np.log(PROBS)[expected]
    )


def test_top_k_matches_numpy_reference_on_random_rows():
    logprobs = random_logprobs(2)
    reference = np.zeros_like(logprobs, dtype=bool)
    np.put_along_axis(reference, np.argsort(-logprobs, axis=-1)[:, :7], True, axis=-1)
    filtered = np.isfinite(np.array(apply_top_k(mx.array(logprobs), 7)))
    np.testing.assert_array_equal(filtered, reference)


def test_xtc_removes_top_choices_but_the_least_likely_above_threshold():
    # Above 0.12: 0.4, 0.3, 0.15; 0.15 is the least likely of them and stays.
    filtered = apply_xtc(logprobs_of(PROBS), 1.0, 0.12, [])
    assert kept(filtered).tolist() == [True, False, True, False, True]


def test_xtc_never_removes_special_tokens():
    filtered = apply_xtc(logprobs_of(PROBS), 1.0, 0.12, [1])
    assert kept(filtered).tolist() == [True, True, True, False, True]


def test_xtc_keeps_everything_when_one_token_is_above_threshold():
    filtered = apply_xtc(logprobs_of(PROBS), 1.0, 0.35, [])
    assert kept(filtered).all()


def test_xtc_with_probability_zero_is_identity():
    filtered = apply_xtc(logprobs_of(PROBS), 0.0, 0.12, [])
    np.testing.assert_array_equal(np.array(filtered), np.array(logprobs_of(PROBS)))


def test_xtc_applies_with_the_given_probability():
    mx.random.seed(3)
    rows = 4000
    logprobs = mx.broadcast_to(logprobs_of(PROBS), (rows, len(PROBS)))
    filtered = np.array(apply_xtc(logprobs, 0.3, 0.12, []))
    applied = np.isinf(filtered[:, 1])
    assert abs(applied.mean() - 0.3) < 0.04
    # A row is either untouched or filtered as a whole.
    np.testing.assert_array_equal(np.isinf(filtered[:, 3]), applied)


# ---------------------------------------------------------------------------
# Sampling distributions
# ---------------------------------------------------------------------------


def test_categorical_sampling_temperature_matches_softmax():
    mx.random.seed(0)
    temp = 0.5
    freqs = empirical_frequencies(lambda lp: categorical_sampling(lp, temp), PROBS)
    expected = PROBS ** (1 / temp) / (PROBS ** (1 / temp)).sum()
    np.testing.assert_allclose(freqs, expected, atol=FREQUENCY_TOLERANCE)


def test_temperature_one_matches_the_distribution():
    mx.random.seed(1)
    freqs = empirical_frequencies(make_sampler(temp=1.0), PROBS)
    np.testing.assert_allclose(freqs, PROBS, atol=FREQUENCY_TOLERANCE)


@pytest.mark.parametrize(
    "kwargs, mask",
    [
        ({"top_k": 2}, [False, True, False, True, False]),
        ({"top_p": 0.75}, [False, True, False, True, True]),
        ({"min_p": 0.3}, [False, True, False, True, True]),
        ({"top_p": 0.9, "top_k": 3}, [False, True, False, True, True]),
    ],
)
def test_filtered_sampling_renormalises_over_allowed_tokens(kwargs, mask):
    mx.random.seed(2)
    freqs = empirical_frequencies(make_sampler(temp=1.0, **kwargs), PROBS)
    mask = np.array(mask)
    assert (freqs[~mask] == 0).all()
    np.testing.assert_allclose(
        freqs, renormalised(PROBS, mask), atol=FREQUENCY_TOLERANCE
    )


def test_xtc_sampler_never_draws_excluded_tokens():
    mx.random.seed(4)
    sampler = make_sampler(temp=1.0, xtc_probability=1.0, xtc_threshold=0.12)
    freqs = empirical_frequencies(sampler, PROBS)
    mask = np.array([True, False, True, False, True])
    np.testing.assert_allclose(
        freqs, renormalised(PROBS, mask), atol=FREQUENCY_TOLERANCE
    )


def reference_law(probs, temp, mask):
    """Naive law of a sampler that keeps `mask` and samples at `temp`."""
    weights = np.where(mask, np.asarray(probs, np.float64) ** (1 / temp), 0.0)
    return weights / weights.sum()


@pytest.mark.parametrize(
    "kwargs, mask",
    [
        ({"temp": 1.0}, [True] * 5),
        ({"temp": 0.5, "top_k": 2}, [False, True, False, True, False]),
        ({"temp": 2.0, "top_p": 0.75}, [False, True, False, True, True]),
        ({"temp": 0.7, "min_p": 0.3}, [False, True, False, True, True]),
        ({"temp": 1.3, "top_p": 0.9, "top_k": 3}, [False, True, False, True, True]),
    ],
)
def test_distribution_is_the_filtered_law(kwargs, mask):
    """CategoricalSampler.distribution against a naive reference, and against the
    frequencies of the sampler's own draws."""
    sampler = make_sampler(**kwargs)
    assert isinstance(sampler, CategoricalSampler)
    law = np.exp(np.array(sampler.distribution(logprobs_of(PROBS))[0]))
    want = reference_law(PROBS, kwargs["temp"], np.array(mask))
    np.testing.assert_allclose(law, want, atol=1e-6)
    mx.random.seed(5)
    np.testing.assert_allclose(empirical_frequencies(sampler, PROBS), law, atol=FREQUENCY_TOLERANCE)


def test_distribution_with_xtc_is_the_mixture():
    """XTC removes its top choices with probability a: the law is (1 - a) times the
    unfiltered law plus a times the filtered one, per row (top-k after both)."""
    sampler = make_sampler(temp=0.8, top_k=4, xtc_probability=0.4, xtc_threshold=0.12)
    law = np.exp(np.array(sampler.distribution(logprobs_of(PROBS))[0]))
    top4 = np.array([False, True, True, True, True])
    excluded = np.array([True, False, True, False, True])  # 0.4 and 0.3 go, 0.15 stays
    want = 0.6 * reference_law(PROBS, 0.8, top4) + 0.4 * reference_law(PROBS, 0.8, excluded)
    np.testing.assert_allclose(law, want, atol=1e-6)
    mx.random.seed(6)
    np.testing.assert_allclose(empirical_frequencies(sampler, PROBS), law, atol=FREQUENCY_TOLERANCE)
    always = make_sampler(temp=1.0, xtc_probability=1.0, xtc_threshold=0.12)
    law = np.exp(np.array(always.distribution(logprobs_of(PROBS))[0]))
    np.testing.assert_allclose(law, reference_law(PROBS, 1.0, excluded), atol=1e-6)


def test_greedy_sampler_is_a_plain_function():
    """Greedy decoding gives no law: speculation matches its tokens. It is upstream's
    greedy_sampler, the argmax of each row."""
    assert not isinstance(make_sampler(temp=0.0), CategoricalSampler)
    assert make_sampler(temp=0.0) is greedy_sampler
    assert greedy_sampler(mx.log(mx.array([[0.2, 0.5, 0.3], [0.6, 0.1, 0.3]]))).tolist() == [1, 0]


def test_same_seed_gives_same_samples():
    sampler = make_sampler(temp=0.8, top_p=0.9, min_p=0.05, top_k=4)
    logprobs = mx.broadcast_to(logprobs_of(PROBS), (64, len(PROBS)))
    mx.random.seed(42)
    first = sampler(logprobs).tolist()
    mx.random.seed(42)
    second = sampler(logprobs).tolist()
    mx.random.seed(43)
    third = sampler(logprobs).tolist()
    assert first == second
    assert first != third


def test_sampler_output_shape_and_type():
    tokens = make_sampler(temp=1.0)(mx.zeros((3, 7)))
    assert tokens.shape == (3,)
    assert tokens.dtype in (mx.uint32, mx.int32)
    assert all(0 <= t < 7 for t in tokens.tolist())


@pytest.mark.parametrize(
    "kwargs, name",
    [
        ({"temp": -0.1}, "temp"),
        ({"top_p": 1.5}, "top_p"),
        ({"top_p": -0.1}, "top_p"),
        ({"min_p": 2.0}, "min_p"),
        ({"top_k": -1}, "top_k"),
        ({"min_tokens_to_keep": 0}, "min_tokens_to_keep"),
        ({"xtc_probability": 1.5}, "xtc_probability"),
        ({"xtc_threshold": 0.6}, "xtc_threshold"),
        ({"xtc_threshold": -0.1}, "xtc_threshold"),
        (
            {"xtc_probability": 0.5, "xtc_special_tokens": [-2]},
            "xtc_special_tokens",
        ),
    ],
)
def test_bad_sampler_arguments_raise(kwargs, name):
    with pytest.raises(ValueError, match=name):
        make_sampler(**kwargs)


# ---------------------------------------------------------------------------
# Logits processors
# ---------------------------------------------------------------------------

LOGITS = np.array([[2.0, -1.0, 0.5, -3.0, 1.0, 0.0]], dtype=np.float32)
HISTORY = [1, 2, 2, 4, 2]


def run_processors(processors, history, logits=LOGITS) -> np.ndarray:
    tokens = mx.array(history, dtype=mx.int32)
    out = mx.array(logits)
    for processor in processors:
        out = processor(tokens, out)
    return np.array(out)


def test_no_options_gives_no_processors():
    assert make_logits_processors() == []
    assert make_logits_processors(repetition_penalty=0, presence_penalty=0) == []


def test_logit_bias_adds_to_the_given_tokens():
    out = run_processors(make_logits_processors(logit_bias={0: -5.0, 3: 2.5}), [])
    expected = LOGITS.copy()
    expected[0, 0] -= 5.0
    expected[0, 3] += 2.5
    np.testing.assert_allclose(out, expected)


def test_repetition_penalty_divides_positive_and_multiplies_negative():
    processors = make_logits_processors(repetition_penalty=2.0)
    out = run_processors(processors, HISTORY)
    expected = LOGITS.copy()
    expected[0, 1] = -2.0  # -1 * 2
    expected[0, 2] = 0.25  # 0.5 / 2, once although token 2 occurs 3 times
    expected[0, 4] = 0.5  # 1 / 2
    np.testing.assert_allclose(out, expected)


def test_repetition_penalty_only_looks_at_the_context_window():
    processors = make_logits_processors(
        repetition_penalty=2.0, repetition_context_size=2
    )
    out = run_processors(processors, HISTORY)  # window: [4, 2]
    expected = LOGITS.copy()
    expected[0, 2] = 0.25
    expected[0, 4] = 0.5
    np.testing.assert_allclose(out, expected)


def test_presence_penalty_subtracts_once_per_distinct_token():
    out = run_processors(make_logits_processors(presence_penalty=0.5), HISTORY)
    expected = LOGITS.copy()
    expected[0, [1, 2, 4]] -= 0.5
    np.testing.assert_allclose(out, expected)


def test_frequency_penalty_subtracts_per_occurrence():
    processors = make_logits_processors(frequency_penalty=0.5, frequency_context_size=4)
    out = run_processors(processors, HISTORY)  # window: [2, 2, 4, 2]
    expected = LOGITS.copy()
    expected[0, 2] -= 1.5
    expected[0, 4] -= 0.5
    np.testing.assert_allclose(out, expected)


def test_penalties_apply_to_every_row_of_a_batch():
    logits = np.stack([LOGITS[0], -LOGITS[0]])
    out = run_processors(make_logits_processors(presence_penalty=1.0), [0], logits)
    expected = logits.copy()
    expected[:, 0] -= 1.0
    np.testing.assert_allclose(out, expected)


def test_empty_history_changes_nothing():
    processors = make_logits_processors(
        repetition_penalty=1.5, presence_penalty=0.5, frequency_penalty=0.5
    )
    assert len(processors) == 3
    np.testing.assert_array_equal(run_processors(processors, []), LOGITS)


def test_all_processors_compose_in_order():
    processors = make_logits_processors(
        logit_bias={5: 1.0}, repetition_penalty=2.0, frequency_penalty=0.25
    )
    out = run_processors(processors, [5, 5])
    expected = LOGITS.copy()
    # bias: 0 + 1 = 1; repetition: 1 / 2; frequency: - 2 * 0.25
    expected[0, 5] = 0.5 - 0.5
    np.testing.assert_allclose(out, expected)
    assert not math.isnan(out.sum())


@pytest.mark.parametrize(
    "kwargs, name",
    [
        ({"repetition_penalty": -1.0}, "repetition_penalty"),
        ({"repetition_context_size": 0}, "repetition_context_size"),
        ({"presence_context_size": -3}, "presence_context_size"),
        ({"frequency_context_size": 2.5}, "frequency_context_size"),
        ({"logit_bias": {"7": 1.0}}, "logit_bias"),
    ],
)
def test_bad_processor_arguments_raise(kwargs, name):
    with pytest.raises(ValueError, match=name):
        make_logits_processors(**kwargs)
