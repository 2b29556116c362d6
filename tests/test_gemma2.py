"""gemma2.py: the shared family checks (family_checks.py) on the transformers fixtures,
plus what only Gemma 2 has: soft-capped attention against a naive loop, the config
dialects, sanitize, that the fixtures exercise the window and both soft-caps, and the
speculative-sampling law at T > 0 with a window that wraps many times.

Fixtures come from fixtures/make_gemma2_reference.py (sliding_window 8, 40 tokens):
gemma2_tf4 in the hub's transformers-4 dialect, gemma2_tf5 as transformers 5 saves it.
"""

import mlx.core as mx
import numpy as np
import pytest
from checkpoints import VOCAB_SIZE, perturb
from family_checks import FIXTURES, Family, FamilyChecks, fixture_model, reference, relative_error
from mlx.utils import tree_flatten, tree_unflatten
from sliding_checks import assert_override_matters, assert_sanitize_is_idempotent
from test_speculative_sampling import PROMPT as LAW_PROMPT
from test_speculative_sampling import VOCAB as LAW_VOCAB
from test_speculative_sampling import assert_target_law

from mlx_lm.generate import SpeculationStats, speculative_generate_step
from mlx_lm.models.cache import KVCache, QuantizedKVCache, RotatingKVCache
from mlx_lm.models.gemma2 import FULL, SLIDING, Model, ModelArgs, softcapped_attention
from mlx_lm.sample_utils import make_logits_processors, make_sampler
from mlx_lm.utils import load_model

SHAPE = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
             num_key_value_heads=2, head_dim=16, query_pre_attn_scalar=16, sliding_window=8)

FAMILY = Family(
    fixtures=["gemma2_tf4", "gemma2_tf5"],
    tiny=dict(SHAPE, model_type="gemma2", attn_logit_softcapping=5.0, final_logit_softcapping=10.0,
              vocab_size=VOCAB_SIZE, tie_word_embeddings=False, eos_token_id=0),
    small=dict(model_type="gemma2", hidden_size=32, intermediate_size=48, num_hidden_layers=2,
               num_attention_heads=2, num_key_value_heads=1, head_dim=16, query_pre_attn_scalar=16,
               sliding_window=8, attn_logit_softcapping=3.0, final_logit_softcapping=5.0, vocab_size=256),
)


class TestGemma2(FamilyChecks):
    family = FAMILY


# --- soft-capped attention ----------------------------------------------------------------


def naive_softcapped_attention(q, k, v, scale, cap, allowed):
    """One head at a time, KV heads repeated, -inf where `allowed` (B, N, S) is False."""
    q, k, v, allowed = (np.array(t, dtype=np.float64) for t in (q, k, v, allowed))
    B, H, N, _ = q.shape
    out = np.zeros_like(q)
    for b in range(B):
        for h in range(H):
            kv = h // (H // k.shape[1])
            scores = cap * np.tanh(q[b, h] @ k[b, kv].T * scale / cap)
            scores = np.where(allowed[b] > 0, scores, -np.inf)
            weights = np.exp(scores - scores.max(-1, keepdims=True))
            out[b, h] = weights / weights.sum(-1, keepdims=True) @ v[b, kv]
    return out


def test_softcapped_attention_matches_a_naive_loop():
    """Grouped heads (4 query heads over 2 KV heads), queries offset into the keys, each
    mask form: none, "causal", a windowed (N, S) and a per-row (B, 1, N, S) boolean."""
    B, H, H_kv, N, S, D, window = 2, 4, 2, 5, 9, 8, 3
    keys = mx.random.split(mx.random.key(0), 3)
    q, k, v = (mx.random.normal(shape, key=key) * 2 for shape, key in
               zip([(B, H, N, D), (B, H_kv, S, D), (B, H_kv, S, D)], keys))
    query_pos, key_pos = np.arange(S - N, S)[:, None], np.arange(S)[None]
    causal = key_pos <= query_pos
    windowed = causal & (query_pos - key_pos < window)
    padded = np.broadcast_to(windowed, (B, N, S)).copy()
    padded[1, :, :2] = False  # row 1's first two keys are left padding
    for mask, allowed in ((None, np.ones((B, N, S))), ("causal", np.broadcast_to(causal, (B, N, S))),
                          (mx.array(windowed), np.broadcast_to(windowed, (B, N, S))),
                          (mx.array(padded[:, None]), padded)):
        got = softcapped_attention(q, k, v, 0.3, 2.0, mask)
        want = naive_softcapped_attention(q, k, v, 0.3, 2.0, allowed)
        assert np.allclose(np.array(got), want, atol=1e-5), mask if isinstance(mask, str) else type(mask)


# --- the fixtures exercise every feature --------------------------------------------------


@pytest.mark.parametrize("override", [
    {"sliding_window": 1000}, {"attn_logit_softcapping": None}, {"final_logit_softcapping": None},
    {"query_pre_attn_scalar": 64}, {"rope_theta": 20000.0}, {"layer_types": [SLIDING] * 4},
])
def test_fixture_exercises_every_feature(override):
    """Without the window, either soft-cap, the query scalar, the rope theta or the
    alternating layer types the logits are far off (gemma2_tf4 names none of these
    in transformers 5's keys, so this also shows its tf4 keys are read)."""
    assert_override_matters("gemma2_tf4", override)


def test_norms_are_shifted_exactly_once():
    ids, want = reference("gemma2_tf5")
    for shift in (-1.0, 1.0):
        model, _ = load_model(FIXTURES / "gemma2_tf5")
        norms = [(k, v + shift) for k, v in tree_flatten(model.parameters()) if k.endswith("norm.weight")]
        model.update(tree_unflatten(norms))
        assert relative_error(model(ids), want) > 1e-2


def test_layer_types_and_caches():
    tf4, tf5 = fixture_model("gemma2_tf4"), fixture_model("gemma2_tf5")
    assert tf4.args.layer_types == [SLIDING, FULL, SLIDING, FULL]
    assert [type(c) for c in tf5.make_cache()] == [RotatingKVCache, KVCache, KVCache, RotatingKVCache]
    assert all(c.max_size == 8 and c.keep == 0 for c in tf4.make_cache() if isinstance(c, RotatingKVCache))


# --- config -------------------------------------------------------------------------------


def test_config_dialects_give_the_same_args():
    """The hub's transformers-4 keys and transformers 5's keys for one model."""
    tf4 = ModelArgs.from_dict(dict(SHAPE, model_type="gemma2", rope_theta=500.0, hidden_act="gelu_pytorch_tanh",
                                   sliding_window_size=8, cache_implementation="hybrid"))
    tf5 = ModelArgs.from_dict(dict(SHAPE, model_type="gemma2", layer_types=[SLIDING, FULL] * 2,
                                   rope_parameters={"rope_type": "default", "rope_theta": 500.0}))
    tf5.rope_parameters = None  # the raw key; everything read from it must agree
    assert tf4 == tf5
    assert tf4.rope_theta == 500.0 and tf4.rope_scaling is None
    assert ModelArgs.from_dict(dict(SHAPE, model_type="gemma2")).rope_theta == 10000.0  # transformers' default


@pytest.mark.parametrize("override, message", [
    ({"layer_types": [SLIDING, "chunked_attention", FULL, FULL]}, "chunked_attention"),
    ({"layer_types": [SLIDING, FULL]}, "has 2 entries"),
    ({"sliding_window": None}, "sliding_window is None"),
    ({"num_key_value_heads": 3}, r"\(3\)"),
    ({"attn_logit_softcapping": 0.0}, "attn_logit_softcapping must be positive or null, got 0.0"),
    ({"hidden_activation": "gelu"}, "'gelu'"),
    ({"use_bidirectional_attention": True}, "use_bidirectional_attention"),
    ({"rope_parameters": {"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 0.5}}, "0.5"),
])
def test_config_errors_name_the_value(override, message):
    with pytest.raises(ValueError, match=message):
        ModelArgs.from_dict(dict(SHAPE, model_type="gemma2", **override))


# --- sanitize -----------------------------------------------------------------------------


def test_sanitize_is_idempotent_and_drops_what_we_compute():
    assert_sanitize_is_idempotent(FAMILY.fixtures)


# --- sampling law past the wrap -----------------------------------------------------------


def tiny_gemma2(noise: float = 0.0) -> Model:
    """A 16-token Gemma 2 with a 4-token window: the 300 tokens wrap its ring buffers
    seventy times."""
    args = ModelArgs.from_dict(dict(SHAPE, model_type="gemma2", sliding_window=4, vocab_size=LAW_VOCAB,
                                    attn_logit_softcapping=3.0, final_logit_softcapping=8.0))
    model = Model(args)
    mx.random.seed(0)
    model.update(tree_unflatten([(k, mx.random.normal(v.shape) * 0.3) for k, v in tree_flatten(model.parameters())]))
    mx.eval(model.parameters())
    return perturb(model, noise, seed=1) if noise else model


def test_speculative_sampling_has_the_target_law_past_the_wrap():
    """test_speculative_sampling's end-to-end law check (PIT histogram and the
    towards-the-draft z test) on a sliding-window target: every round verifies and
    rolls back RotatingKVCaches that have long wrapped."""
    target, draft = tiny_gemma2(), tiny_gemma2(noise=0.6)
    sampler = make_sampler(temp=1.0, top_k=10, top_p=0.9, min_p=0.05)
    processors = make_logits_processors(repetition_penalty=1.5)
    mx.random.seed(11)
    stats = SpeculationStats()
    tokens = [t for t, _, _ in speculative_generate_step(
        LAW_PROMPT, target, draft, num_draft_tokens=3, adaptive_draft_length=False, stats=stats, max_tokens=300,
        sampler=sampler, logits_processors=processors)]
    assert 0.2 < stats.acceptance_rate < 0.8
    assert_target_law(target, draft, tokens, sampler, processors, "gemma2 past the wrap")


def test_soft_capped_attention_reads_a_quantized_kv_cache():
    """--kv-bits turns global layers' KVCaches into QuantizedKVCaches (sliding layers'
    ring buffers refuse it): soft-capping then runs on the dequantized keys and values,
    close to the float cache at 8 bits."""
    args = ModelArgs.from_dict(dict(SHAPE, model_type="gemma2", head_dim=32, query_pre_attn_scalar=32,
                                    layer_types=[FULL] * 4, attn_logit_softcapping=3.0, vocab_size=64))
    model = Model(args)
    mx.random.seed(0)
    model.update(tree_unflatten([(k, mx.random.normal(v.shape) * 0.3) for k, v in tree_flatten(model.parameters())]))
    ids = mx.array([[(7 * i + 3) % 64 for i in range(12)]])
    float_cache, quantized = model.make_cache(), [KVCache().to_quantized(group_size=32, bits=8) for _ in range(4)]
    model(ids[:, :8], cache=float_cache)
    model(ids[:, :8], cache=quantized)
    assert isinstance(quantized[0], QuantizedKVCache)
    want, got = model(ids[:, 8:], cache=float_cache), model(ids[:, 8:], cache=quantized)
    assert 0 < relative_error(got, want) < 0.02
