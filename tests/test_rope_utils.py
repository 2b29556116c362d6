"""rope_utils: every rope kind against a naive numpy reference, initialize_rope with
upstream's arguments, and no config dict mutated.

The reference rotates feature pairs by angle = position * inverse frequency, the
frequencies written out element by element from the papers' formulas (the production
code computes them vectorised), so a slip in either shows up.
"""

import copy
import math

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from conftest import FIXTURES
from test_gpt_oss import decode_in_chunks, relative_error

from mlx_lm.models.rope_utils import (
    DynamicNTKRoPE,
    Llama3RoPE,
    ProportionalRoPE,
    SuScaledRoPE,
    YarnRoPE,
    initialize_rope,
    resolve_rope,
)
from mlx_lm.utils import load_model

HEAD = 16


def naive_rope(x: np.ndarray, positions, inv_freq_at, mscale_at, dims: int, traditional: bool = False):
    """x (B, H, L, D); inv_freq_at(p) -> (dims // 2,), mscale_at(p) -> float, per position."""
    out = x.astype(np.float64).copy()
    for row, p in enumerate(positions):
        freqs, scale = inv_freq_at(p), mscale_at(p)
        for i in range(dims // 2):
            a, b = (2 * i, 2 * i + 1) if traditional else (i, i + dims // 2)
            c, s = math.cos(p * freqs[i]), math.sin(p * freqs[i])
            xa, xb = x[..., row, a] * scale, x[..., row, b] * scale
            out[..., row, a], out[..., row, b] = xa * c - xb * s, xb * c + xa * s
    return out


def plain_freqs(dims, base):
    return np.array([base ** (-2 * i / dims) for i in range(dims // 2)])


def features(length: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).normal(size=(1, 2, length, HEAD)).astype(np.float32)


def assert_matches(rope, x, offset, want, tol=2e-5):
    got = np.array(rope(mx.array(x), offset=offset))
    np.testing.assert_allclose(got, want, rtol=tol, atol=tol)


def test_naive_reference_agrees_with_mlx_rope():
    x = features(5)
    for traditional in (False, True):
        want = naive_rope(x, range(3, 8), lambda p: plain_freqs(12, 500.0), lambda p: 1.0, 12, traditional)
        assert_matches(nn.RoPE(12, traditional=traditional, base=500.0), x, 3, want)


def test_llama3_frequencies():
    config = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
              "original_max_position_embeddings": 64}
    frozen = copy.deepcopy(config)
    rope = Llama3RoPE(HEAD, max_position_embeddings=512, base=10000.0, scaling_config=config)
    assert config == frozen

    def freqs(_):
        out = []
        for f in plain_freqs(HEAD, 10000.0):
            wavelen = 2 * math.pi / f
            if wavelen < 64 / 4.0:
                out.append(f)
            elif wavelen > 64 / 1.0:
                out.append(f / 8.0)
            else:
                smooth = (64 / wavelen - 1.0) / (4.0 - 1.0)
                out.append((1 - smooth) * f / 8.0 + smooth * f)
        return np.array(out)

    np.testing.assert_allclose(1 / np.array(rope._freqs), freqs(0), rtol=1e-6)
    ratios = freqs(0) / plain_freqs(HEAD, 1e4)  # the config has all three bands: kept, blended, slowed
    assert np.isclose(ratios, 1).any() and np.isclose(ratios, 1 / 8).any()
    assert ((ratios > 1 / 8 + 1e-6) & (ratios < 1 - 1e-6)).any()
    x = features(6)
    assert_matches(rope, x, 40, naive_rope(x, range(40, 46), freqs, lambda p: 1.0, HEAD))
    # Without original_max_position_embeddings: max positions stand in (transformers).
    bare = {k: v for k, v in config.items() if k != "original_max_position_embeddings"}
    fallback = Llama3RoPE(HEAD, max_position_embeddings=64, base=10000.0, scaling_config=bare)
    assert mx.array_equal(fallback._freqs, rope._freqs)


def yarn_reference_freqs(dims, base, factor, original, beta_fast=32, beta_slow=1):
    def correction(rotations):
        return dims * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low, high = max(math.floor(correction(beta_fast)), 0), min(math.ceil(correction(beta_slow)), dims - 1)
    out = []
    for i, f in enumerate(plain_freqs(dims, base)):
        ramp = min(max((i - low) / (high - low), 0.0), 1.0)
        out.append(f / factor * ramp + f * (1 - ramp))
    return np.array(out)


def test_yarn_frequencies_and_attention_factor():
    rope = YarnRoPE(HEAD, max_position_embeddings=4096, base=10000.0, scaling_factor=4.0,
                    original_max_position_embeddings=256)
    mscale = 0.1 * math.log(4.0) + 1.0
    assert rope.mscale == pytest.approx(mscale)
    freqs = yarn_reference_freqs(HEAD, 10000.0, 4.0, 256)
    x = features(4)
    assert_matches(rope, x, 300, naive_rope(x, range(300, 304), lambda p: freqs, lambda p: mscale, HEAD), tol=1e-4)
    # scaling_factor None: max / original positions, as transformers without "factor".
    assert YarnRoPE(HEAD, scaling_factor=None, max_position_embeddings=1024,
                    original_max_position_embeddings=256).mscale == pytest.approx(mscale)
    deepseek = YarnRoPE(HEAD, scaling_factor=4.0, mscale=0.707, mscale_all_dim=1.0)
    assert deepseek.mscale == pytest.approx((0.0707 * math.log(4.0) + 1) / (0.1 * math.log(4.0) + 1))


def test_yarn_from_config_follows_transformers_mscale_rule():
    base = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 256}
    only_one = initialize_rope(HEAD, 1e4, False, dict(base, mscale=0.707), 4096)
    assert only_one.mscale == pytest.approx(0.1 * math.log(4.0) + 1.0)  # the ratio needs both keys
    both = initialize_rope(HEAD, 1e4, False, dict(base, mscale=1.0, mscale_all_dim=1.0), 4096)
    assert both.mscale == pytest.approx(1.0)
    assert initialize_rope(HEAD, 1e4, False, dict(base, attention_factor=0.5), 4096).mscale == 0.5


SHORT = [1.0, 1.1, 1.3, 1.6, 2.0, 2.5, 3.0, 4.0]
LONG = [1.5, 2.0, 3.0, 4.0, 6.0, 8.0, 12.0, 16.0]


def su_reference(original, maximum, reach, base=1e4):
    """Naive longrope for one call whose last position is reach - 1: all its positions
    take the long factors if reach > original, else the short ones (transformers picks
    by the call's length), with sqrt(1 + ln(max / original) / ln(original)) on both."""
    mscale = math.sqrt(1 + math.log(maximum / original) / math.log(original))
    factors = np.array(LONG if reach > original else SHORT)
    return (lambda p: plain_freqs(HEAD, base) / factors), (lambda p: mscale)


@pytest.mark.parametrize("offset, length", [(0, 10), (10, 12), (16, 5), (15, 1), (16, 1), (3, 13), (0, 17)])
def test_su_scaled_rope_picks_factors_by_the_length_a_call_reaches(offset, length):
    """A call ending at position 15 or before uses the short factors, one reaching 16 or
    beyond the long ones for every position in it (10..21: 10..15 too), with the
    attention factor sqrt(1 + ln(64 / 16) / ln(16)) on both."""
    rope = SuScaledRoPE(HEAD, base=1e4, max_position_embeddings=64, original_max_position_embeddings=16,
                        short_factor=SHORT, long_factor=LONG)
    assert rope.short_mscale == rope.long_mscale == pytest.approx(math.sqrt(1.5))
    x = features(length, seed=offset)
    freqs, mscale = su_reference(16, 64, reach=offset + length)
    assert_matches(rope, x, offset, naive_rope(x, range(offset, offset + length), freqs, mscale, HEAD))


def test_su_scaled_rope_separate_mscales_and_partial_dims():
    rope = SuScaledRoPE(12, max_position_embeddings=64, original_max_position_embeddings=16,
                        short_factor=SHORT[:6], long_factor=LONG[:6], short_mscale=1.0, long_mscale=1.25)
    x = features(8)
    plain = plain_freqs(12, 1e4)
    for offset, factors, mscale in ((8, SHORT[:6], 1.0), (12, LONG[:6], 1.25)):  # reaching 16, then 20
        want = naive_rope(x, range(offset, offset + 8), lambda p: plain / np.array(factors), lambda p: mscale, 12)
        assert_matches(rope, x, offset, want)
    assert np.array_equal(np.array(rope(mx.array(x), offset=12))[..., 12:], x[..., 12:])  # unrotated tail untouched
    with pytest.raises(ValueError, match="short_factor needs 6 values"):
        SuScaledRoPE(12, short_factor=SHORT, long_factor=LONG[:6])
    with pytest.raises(ValueError, match="needs an int offset"):
        rope(mx.array(x), offset=3.0)


@pytest.mark.parametrize("length", [1, 4])
def test_su_scaled_rope_batch_rows_turn_as_alone(length):
    """A (B,) array of offsets (a batch): each row takes the factors its own call would,
    rows short and long in one call (a row is long when offset + length > 16)."""
    rope = SuScaledRoPE(HEAD, base=1e4, max_position_embeddings=64, original_max_position_embeddings=16,
                        short_factor=SHORT, long_factor=LONG)
    offsets = [3, 13, 16]
    assert {o + length > 16 for o in offsets} == {True, False}
    x = mx.array(np.stack([features(length, seed=o)[0] for o in offsets]))  # (3, 2, length, HEAD)
    got = rope(x, offset=mx.array(offsets))
    for row, offset in enumerate(offsets):
        assert mx.array_equal(got[row : row + 1], rope(x[row : row + 1], offset=offset)), offset


def test_su_scaled_rope_depends_on_the_split_as_transformers():
    """One call over 24 positions turns 0..15 with the long factors; in calls of 5 the
    ones ending by 15 keep the short factors. From 16 on both agree."""
    rope = SuScaledRoPE(HEAD, max_position_embeddings=64, original_max_position_embeddings=16,
                        short_factor=SHORT, long_factor=LONG)
    x = mx.array(features(24))
    whole = rope(x)
    pieces = mx.concatenate([rope(x[..., i : i + 5, :], offset=i) for i in range(0, 24, 5)], axis=2)
    assert mx.allclose(whole[..., 15:, :], pieces[..., 15:, :], atol=1e-6)  # the call 15..19 reaches past 16
    assert not mx.allclose(whole[..., 1:15, :], pieces[..., 1:15, :], atol=1e-2)


@pytest.mark.parametrize("traditional", [False, True])
def test_dynamic_ntk_per_position(traditional):
    """Up to max positions plain rope; the token at p beyond it turns with
    base * (factor * (p + 1) / max - (factor - 1))^(d / (d - 2))."""
    rope = DynamicNTKRoPE(HEAD, 1e4, traditional, factor=2.0, max_position_embeddings=32)

    def freqs(p):
        seq_len = max(p + 1, 32)
        base = 1e4 * ((2.0 * seq_len / 32) - 1.0) ** (HEAD / (HEAD - 2))
        return plain_freqs(HEAD, base)

    x = features(8)
    assert_matches(rope, x, 28, naive_rope(x, range(28, 36), freqs, lambda p: 1.0, HEAD, traditional), tol=1e-4)


def test_dynamic_ntk_matches_transformers_token_by_token():
    """fixtures/llama_dynamic_tf4: a llama with dynamic NTK rope (factor 4) over 24
    tokens, max_position_embeddings 12. Every chunking gives transformers' incremental
    logits; its one full forward (base from the call's length, for all positions) differs."""
    model, _ = load_model(FIXTURES / "llama_dynamic_tf4")
    reference = mx.load(str(FIXTURES / "llama_dynamic_tf4" / "reference.safetensors"))
    ids, want = reference["input_ids"], reference["incremental_logits"]
    assert type(model.layers[0].self_attn.rope) is DynamicNTKRoPE
    assert relative_error(model(ids), want) < 1e-4
    assert relative_error(decode_in_chunks(model, ids, 5), want) < 1e-4
    assert relative_error(reference["logits"], want) > 1e-2


# --- initialize_rope with upstream's arguments -----------------------------------------

LONGROPE_WITH_FACTOR = {"rope_type": "longrope", "short_factor": SHORT, "long_factor": LONG,
                        "original_max_position_embeddings": 16, "factor": 4.0}
UPSTREAM_CONFIGS = [
    ({"type": "linear", "factor": 2.0}, nn.RoPE),
    ({"rope_type": "default"}, nn.RoPE),
    ({"type": "mrope", "mrope_section": [2, 3, 3]}, nn.RoPE),  # text positions: plain rope
    ({"type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
      "original_max_position_embeddings": 8192}, Llama3RoPE),
    ({"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 1024, "beta_fast": 32, "beta_slow": 1},
     YarnRoPE),
    ({"type": "longrope", "short_factor": SHORT, "long_factor": LONG}, SuScaledRoPE),
    (LONGROPE_WITH_FACTOR, SuScaledRoPE),
    ({"type": "dynamic", "factor": 2.0}, DynamicNTKRoPE),
]


@pytest.mark.parametrize("config, kind", UPSTREAM_CONFIGS)
def test_initialize_rope_upstream_arguments_leave_the_config_alone(config, kind):
    frozen = copy.deepcopy(config)
    rope = initialize_rope(HEAD, 10000.0, False, config, 4096)
    assert type(rope) is kind
    assert config == frozen
    assert rope(mx.ones((1, 1, 3, HEAD)), offset=2).shape == (1, 1, 3, HEAD)
    assert type(initialize_rope(HEAD, 10000.0, False, scaling_config=config, max_position_embeddings=4096)) is kind


def test_initialize_rope_linear_scales_positions():
    x = features(4)
    rope = initialize_rope(HEAD, 1e4, False, {"type": "linear", "factor": 4.0})
    want = naive_rope(x, [p / 4.0 for p in range(8, 12)], lambda p: plain_freqs(HEAD, 1e4), lambda p: 1.0, HEAD)
    assert_matches(rope, x, 8, want)


def test_initialize_rope_longrope_defaults():
    """original_max_position_embeddings falls back to max positions (transformers); an
    explicit factor gives the attention factor from it, not from max / original."""
    rope = initialize_rope(HEAD, 1e4, False, {"type": "longrope", "short_factor": SHORT, "long_factor": LONG}, 4096)
    assert rope.original_max_position_embeddings == 4096 and rope.short_mscale == 1.0
    rope = initialize_rope(HEAD, 1e4, False, LONGROPE_WITH_FACTOR, 128)
    assert rope.long_mscale == pytest.approx(math.sqrt(1 + math.log(4.0) / math.log(16)))


@pytest.mark.parametrize("rotated, traditional, factor", [(0, False, 1.0), (4, False, 1.0), (8, True, 1.0),
                                                           (HEAD, False, 2.0), (6, False, 0.5)])
def test_proportional_rope_matches_the_formula(rotated, traditional, factor):
    """Pair i < rotated // 2 turns at base^(-2i / HEAD) / factor (the exponent over the
    whole head), the other pairs not at all."""
    def freqs(p):
        return np.array([1e4 ** (-2 * i / HEAD) / factor if i < rotated // 2 else 0.0 for i in range(HEAD // 2)])

    x = features(5)
    rope = ProportionalRoPE(HEAD, rotated, traditional, 1e4, factor)
    for offset in (0, 11):
        want = naive_rope(x, range(offset, offset + 5), freqs, lambda p: 1.0, HEAD, traditional)
        assert_matches(rope, x, offset, want)
    got = np.array(rope(mx.array(x), offset=3))
    unturned = [i for i in range(HEAD // 2) if i >= rotated // 2]
    pairs = [2 * i + k for i in unturned for k in (0, 1)] if traditional else unturned + [i + HEAD // 2 for i in unturned]
    assert np.array_equal(got[..., pairs], x[..., pairs])  # bit for bit: they pass through


def test_initialize_rope_proportional_is_upstreams():
    """upstream's config: int(dims * partial_rotary_factor) features turn, default factor 1."""
    x = features(4)
    rope = initialize_rope(HEAD, 1e4, False, {"rope_type": "proportional", "partial_rotary_factor": 0.25})
    assert type(rope) is ProportionalRoPE
    assert_matches(rope, x, 2, np.array(ProportionalRoPE(HEAD, 4, False, 1e4)(mx.array(x), offset=2)), tol=0)
    whole = initialize_rope(HEAD, 1e4, True, {"type": "proportional", "factor": 4.0})
    assert_matches(whole, x, 2, naive_rope(x, range(2, 6), lambda p: plain_freqs(HEAD, 1e4) / 4, lambda p: 1.0,
                                           HEAD, traditional=True))
    with pytest.raises(ValueError, match="partial_rotary_factor in \\[0, 1\\], got 1.5"):
        initialize_rope(HEAD, 1e4, False, {"rope_type": "proportional", "partial_rotary_factor": 1.5})
    with pytest.raises(ValueError, match="rotated_dims=20"):
        ProportionalRoPE(HEAD, 20)
    with pytest.raises(ValueError, match="positive factor, got 0"):
        ProportionalRoPE(HEAD, 4, factor=0)


def test_initialize_rope_errors_name_the_value():
    with pytest.raises(ValueError, match="'chatglm'"):
        initialize_rope(HEAD, 1e4, False, {"type": "chatglm"})
    with pytest.raises(ValueError, match="original_max_position_embeddings"):
        initialize_rope(HEAD, 1e4, False, {"type": "yarn", "factor": 4.0})
    with pytest.raises(ValueError, match="'factor'"):
        Llama3RoPE(HEAD, scaling_config={"low_freq_factor": 1.0})
    with pytest.raises(ValueError, match="max_position_embeddings"):
        initialize_rope(HEAD, 1e4, False, {"type": "dynamic", "factor": 2.0})


def test_resolve_rope_leaves_its_inputs_alone():
    scaling = {"type": "yarn", "factor": 4.0}
    params = {"rope_type": "longrope", "rope_theta": 5.0, "partial_rotary_factor": 0.5, "short_factor": SHORT}
    frozen = copy.deepcopy((scaling, params))
    assert resolve_rope(None, scaling, None) == (None, {"rope_type": "yarn", "factor": 4.0}, None)
    theta, got, partial = resolve_rope(None, None, params)
    assert (theta, partial, got["rope_type"]) == (5.0, 0.5, "longrope") and "rope_theta" not in got
    assert (scaling, params) == frozen
