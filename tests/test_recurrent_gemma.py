"""recurrent_gemma.py and rg_lru.py: the shared family checks (family_checks.py) on the
transformers fixtures, plus what only this family has: the RG-LRU recurrence and its
chunked scan against a naive loop (and prefix stability, which makes a rollback's
replay bit for bit the verify forward's own state), its inputs against transformers'
formulas, the config dialects, sanitize, the bfloat16 embedding scale, and the
sampling law at T > 0 through recurrent and sliding-window rollbacks.

Fixtures (fixtures/make_recurrent_gemma_reference.py): recurrent_gemma_tf4 (hub dialect,
hidden 48, 2 KV heads, q/k/v bias, 3 conv taps) and recurrent_gemma_tf5 (transformers 5
dialect, hidden 64, lru_width 80, one KV head, 4 taps); both 4 layers (recurrent,
recurrent, attention, recurrent), window 8, 40 tokens.
"""

from functools import partial

import mlx.core as mx
import numpy as np
import pytest
from checkpoints import perturb
from family_checks import (
    FIXTURES,
    PROMPT,
    Family,
    FamilyChecks,
    fixture_model,
    random_model,
    reference,
    relative_error,
)
from mlx.utils import tree_flatten
from test_speculative_sampling import PROMPT as LAW_PROMPT
from test_speculative_sampling import assert_target_law

from mlx_lm.generate import SpeculationStats, speculative_generate_step
from mlx_lm.models.cache import ArraysCache, RotatingKVCache, make_prompt_cache, trim_prompt_cache
from mlx_lm.models.recurrent_gemma import ATTENTION, CONV_STATE, LRU_STATE, RECURRENT, ModelArgs, scale_embeddings
from mlx_lm.models.rg_lru import (
    block_diagonal_linear,
    linear_scan,
    linear_scan_sequential,
    rg_lru_inputs,
    state_after,
)
from mlx_lm.sample_utils import make_logits_processors, make_sampler
from mlx_lm.utils import load_model

FAMILY = Family(
    fixtures=["recurrent_gemma_tf4", "recurrent_gemma_tf5"],
    tiny=dict(model_type="recurrent_gemma", vocab_size=512, hidden_size=64, intermediate_size=128,
              num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=1, attention_window_size=8,
              conv1d_width=4, rope_theta=10000.0, partial_rotary_factor=0.5, eos_token_id=1),
    small=dict(model_type="recurrent_gemma", vocab_size=256, hidden_size=32, intermediate_size=64,
               num_hidden_layers=3, num_attention_heads=2, num_key_value_heads=1, attention_window_size=8,
               conv1d_width=4, block_types=["recurrent", "attention"]),
)


class TestRecurrentGemma(FamilyChecks):
    family = FAMILY


# --- the recurrence -------------------------------------------------------------------


def random_scan_inputs(B=2, T=37, W=24, seed=0):
    """a in (0, 1) as the RG-LRU makes it, b of unit scale, a nonzero state."""
    key_a, key_b, key_h = mx.random.split(mx.random.key(seed), 3)
    a = mx.random.uniform(0.05, 0.999, (B, T, W), key=key_a)
    return a, mx.random.normal((B, T, W), key=key_b), mx.random.normal((B, W), key=key_h)


def test_linear_scan_matches_a_naive_loop():
    a, b, h0 = random_scan_inputs()
    a_np, b_np, h = (np.array(t, dtype=np.float64) for t in (a, b, h0))
    want = []
    for t in range(a.shape[1]):
        h = a_np[:, t] * h + b_np[:, t]
        want.append(h)
    want = np.stack(want, axis=1)
    chunked = [partial(linear_scan, chunk_size=c) for c in (1, 4, 16, 64)]  # 37 tokens: padded, or one chunk
    for scan in [linear_scan_sequential] + chunked:
        hs, last = scan(a, b, h0)
        assert hs.dtype == last.dtype == mx.float32
        assert np.allclose(np.array(hs), want, rtol=1e-5, atol=1e-5), scan
        assert mx.array_equal(last, hs[:, -1])
    # No state: zeros; one token: exactly the decode step.
    assert mx.allclose(linear_scan(a, b)[0], linear_scan_sequential(a, b, mx.zeros_like(h0))[0], atol=1e-5)
    assert mx.array_equal(linear_scan(a[:, :1], b[:, :1], h0)[1], a[:, 0] * h0 + b[:, 0])


def test_linear_scan_is_prefix_stable_and_replay_is_bit_exact():
    """Every prefix of a scan is bit for bit the scan of that prefix; state_after
    (int or per-row counts) is the scan's own state at m."""
    a, b, h0 = random_scan_inputs(T=21)
    for chunk_size in (4, 16):
        hs, _ = linear_scan(a, b, h0, chunk_size=chunk_size)
        for m in range(1, a.shape[1] + 1):
            assert mx.array_equal(linear_scan(a[:, :m], b[:, :m], h0, chunk_size=chunk_size)[0], hs[:, :m]), m
    hs, _ = linear_scan(a, b, h0)
    for m in range(1, a.shape[1] + 1):
        assert mx.array_equal(state_after(a, b, h0, m), hs[:, m - 1]), m
    rows = state_after(a, b, h0, [0, 13])
    assert mx.array_equal(rows[0], h0[0]) and mx.array_equal(rows[1], hs[1, 12])
    assert mx.array_equal(state_after(a, b, None, [0, 0]), mx.zeros_like(h0))


def test_block_diagonal_linear_matches_per_head_products():
    key_x, key_w, key_b = mx.random.split(mx.random.key(3), 3)
    x = mx.random.normal((2, 5, 12), key=key_x)
    weight, bias = mx.random.normal((3, 4, 4), key=key_w), mx.random.normal((3, 4), key=key_b)
    got = block_diagonal_linear(x, weight, bias)
    want = mx.concatenate([x[..., 4 * h : 4 * h + 4] @ weight[h] + bias[h] for h in range(3)], axis=-1)
    assert mx.allclose(got, want, atol=1e-5)


def test_rg_lru_inputs_follow_transformers_formulas():
    """gate = sigmoid(logits), a = exp(-8 gate_a softplus(Lambda)), b = x gate_x
    sqrt(1 - a^2); at position 0 of a sequence a = 0 and b = x gate_x."""
    rng = np.random.default_rng(0)
    x, gx_logits, ga_logits = rng.normal(size=(3, 1, 6, 8))
    gx, ga = 1 / (1 + np.exp(-gx_logits)), 1 / (1 + np.exp(-ga_logits))
    lam = rng.normal(size=8)
    a_want = np.exp(-8.0 * ga * np.log1p(np.exp(lam)))
    b_want = x * gx * np.sqrt(1 - a_want**2)
    for starts in (False, True):
        inputs = (mx.array(t, dtype=mx.float32) for t in (x, gx_logits, ga_logits, lam))
        a, b = rg_lru_inputs(*inputs, starts_sequence=starts)
        aw, bw = a_want.copy(), b_want.copy()
        if starts:
            aw[:, 0], bw[:, 0] = 0.0, (x * gx)[:, 0]
        assert np.allclose(np.array(a), aw, rtol=1e-5, atol=1e-6) and np.allclose(np.array(b), bw, rtol=1e-4, atol=1e-5)


# --- the model against transformers ---------------------------------------------------


@pytest.mark.parametrize("override", [
    {"attention_window_size": 1000},
    {"partial_rotary_factor": 1.0},
    {"logits_soft_cap": 1e6},
])
def test_fixture_exercises_every_feature(override):
    """Without the window, with whole-head rope or without the soft cap the logits are
    far off (the tf4 fixture's soft cap of 30 bites)."""
    name = "recurrent_gemma_tf4"
    ids, want = reference(name)
    changed, _ = load_model(FIXTURES / name, model_config=override)
    assert relative_error(changed(ids), want) > 1e-2


def test_embedding_scale_is_rounded_to_bfloat16():
    """sqrt(48) = 6.928 scales by 6.9375 in fp32 too; the unrounded factor misses the
    tf4 fixture's logits by more than the tolerance."""
    h = mx.ones((1, 1, 48))
    assert scale_embeddings(h, 48)[0, 0, 0].item() == 6.9375
    assert scale_embeddings(h, 2560)[0, 0, 0].item() == 50.5
    model = fixture_model("recurrent_gemma_tf4")
    ids, want = reference("recurrent_gemma_tf4")
    embed = model.model.embed_tokens
    exact = mx.sqrt(mx.array(48.0)) / 6.9375
    weight = embed.weight
    try:
        embed.weight = weight * exact
        assert relative_error(model(ids), want) > 1e-4
    finally:
        embed.weight = weight


def test_layers_and_caches():
    model = fixture_model("recurrent_gemma_tf5")
    assert model.args.layer_types == [RECURRENT, RECURRENT, ATTENTION, RECURRENT]
    cache = make_prompt_cache(model)
    assert [type(c) for c in cache] == [ArraysCache, ArraysCache, RotatingKVCache, ArraysCache]
    assert cache[2].max_size == 8 and cache[2].keep == 0
    model(PROMPT[None], cache=cache)
    assert cache[0][CONV_STATE].shape == (1, 3, 80) and cache[0][LRU_STATE].shape == (1, 80)
    assert cache[0][LRU_STATE].dtype == mx.float32


def test_rollback_replay_is_bit_exact_with_a_one_forward_feed():
    """Trimmed back to m, a verify forward's recurrent states equal, bit for bit, one
    forward of just those m tokens (the same prefix-stable scan) in the layers before
    the first attention layer, past the window's wrap."""
    model = fixture_model("recurrent_gemma_tf5")
    chunk = [17, 3, 250, 9, 41, 77]

    def prefilled():
        cache = make_prompt_cache(model)
        model(PROMPT[None], cache=cache)
        for c in cache:
            c.start_speculation()
        return cache

    for m in range(1, len(chunk)):
        replayed, fed = prefilled(), prefilled()
        model(mx.array([chunk]), cache=replayed)
        trim_prompt_cache(replayed, len(chunk) - m)
        model(mx.array([chunk[:m]]), cache=fed)
        for i, slot in ((0, CONV_STATE), (0, LRU_STATE), (1, CONV_STATE), (1, LRU_STATE)):
            assert mx.array_equal(replayed[i][slot], fed[i][slot]), (m, i, slot)
        # After the attention layer its inputs differ by rounding (attention over 6 new
        # keys or over 1 is another reduction), so only to float tolerance.
        assert mx.allclose(replayed[3][LRU_STATE], fed[3][LRU_STATE], atol=1e-5, rtol=1e-5), m


# --- config ---------------------------------------------------------------------------

TF5 = dict(model_type="recurrent_gemma", vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=5,
           num_attention_heads=2, num_key_value_heads=1, attention_window_size=4, head_dim=16,
           rope_parameters={"rope_type": "default", "rope_theta": 500.0, "partial_rotary_factor": 0.25},
           block_types=["recurrent", "recurrent", "attention"])


def tf4_dialect(config):
    config = dict(config)
    rope = config.pop("rope_parameters")
    return dict(config, rope_theta=rope["rope_theta"], partial_rotary_factor=rope["partial_rotary_factor"],
                _block_types=config.pop("block_types"), embeddings_scale_by_sqrt_dim=True,
                final_w_init_variance_scale=0.4)


def test_config_dialects_give_the_same_args():
    tf5, tf4 = ModelArgs.from_dict(TF5), ModelArgs.from_dict(tf4_dialect(TF5))
    for args in (tf5, tf4):
        assert (args.rope_theta, args.partial_rotary_factor, args.rotary_dims) == (500.0, 0.25, 4)
        assert args.layer_types == [RECURRENT, RECURRENT, ATTENTION, RECURRENT, RECURRENT]
        assert (args.lru_width, args.head_dim) == (32, 16)
    assert ModelArgs.from_dict(dict(TF5, layer_types=tf5.layer_types)).layer_types == tf5.layer_types
    only_kinds = {k: v for k, v in TF5.items() if k != "block_types"}
    assert ModelArgs.from_dict(dict(only_kinds, layer_types=[RECURRENT] * 5)).block_types is None
    # transformers' defaults: theta 1e4, half the head turned, recurrent-recurrent-attention.
    bare = {k: v for k, v in TF5.items() if k not in ("rope_parameters", "block_types")}
    args = ModelArgs.from_dict(bare)
    assert (args.rope_theta, args.partial_rotary_factor, args.block_types) == (
        10000.0, 0.5, ["recurrent", "recurrent", "attention"])
    assert ModelArgs.from_dict(dict(bare, sliding_window=4)).attention_window_size == 4


@pytest.mark.parametrize("change, message", [
    ({"block_types": ["recurrent", "mlp"]}, "block_types"),
    ({"layer_types": [RECURRENT] * 5}, "disagrees with block_types"),
    ({"head_dim": 8}, "head_dim 8"),
    ({"partial_rotary_factor": 0.5}, "partial_rotary_factor"),
    ({"rope_theta": 10000.0}, "rope_theta is 10000.0"),
    ({"rope_parameters": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1.0}}, "'linear'"),
    ({"conv1d_width": 1}, "conv1d_width must be >= 2, got 1"),
    ({"lru_width": 33}, "lru_width 33"),
    ({"embeddings_scale_by_sqrt_dim": False}, "embeddings_scale_by_sqrt_dim"),
    ({"hidden_activation": "relu"}, "'relu'"),
    ({"sliding_window": 5}, "sliding_window is 5"),
    ({"_block_types": ["attention"]}, "_block_types is \\['attention'\\]"),
    ({"logits_soft_cap": 0.0}, "logits_soft_cap"),
])
def test_config_errors_name_the_value(change, message):
    with pytest.raises(ValueError, match=message):
        ModelArgs.from_dict(dict(TF5, **change))


# --- sanitize -------------------------------------------------------------------------


def test_sanitize_converts_the_hf_layout_once():
    model = fixture_model("recurrent_gemma_tf5")
    raw = mx.load(str(FIXTURES / "recurrent_gemma_tf5" / "model.safetensors"))
    conv = "model.layers.0.temporal_block.conv_1d.weight"
    raw = dict(raw, **{"lm_head.weight": raw["model.embed_tokens.weight"],
                       "model.layers.2.temporal_block.rotary_emb.inv_freq": mx.ones((4,))})
    once = model.sanitize(raw)
    twice = model.sanitize(dict(once))
    assert sorted(once) == sorted(twice) and all(mx.array_equal(once[k], twice[k]) for k in once)
    assert "lm_head.weight" not in once and not any("rotary_emb" in k for k in once)
    assert raw[conv].shape == (80, 1, 4) and once[conv].shape == (80, 4, 1)
    assert mx.array_equal(once[conv][..., 0], raw[conv][:, 0])
    assert sorted(k for k, _ in tree_flatten(model.parameters())) == sorted(once)


# --- sampling at T > 0 ----------------------------------------------------------------


def test_speculative_sampling_has_the_target_law():
    """Speculative sampling with a noisy draft of a tiny 16-token RecurrentGemma (every
    round rolls back RG-LRU states and a wrapped window of 4): the output has the
    target's law (the PIT and draft-lean tests of test_speculative_sampling)."""
    config = dict(FAMILY.small, vocab_size=16, attention_window_size=4)
    target = random_model(config, seed=0)
    draft = perturb(random_model(config, seed=0), 0.4, seed=1)
    sampler = make_sampler(temp=1.0, top_k=10, top_p=0.9, min_p=0.05)
    processors = make_logits_processors(repetition_penalty=1.5)
    mx.random.seed(11)
    stats = SpeculationStats()
    tokens = [t for t, _, _ in speculative_generate_step(
        LAW_PROMPT, target, draft, num_draft_tokens=2, adaptive_draft_length=False, stats=stats, max_tokens=300,
        sampler=sampler, logits_processors=processors)]
    assert 0.2 < stats.acceptance_rate < 0.8
    assert_target_law(target, draft, tokens, sampler, processors, "recurrent_gemma")
