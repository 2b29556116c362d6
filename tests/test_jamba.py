"""jamba.py: the shared family checks (family_checks.py) on the jamba fixtures, plus its
router (top-k of the softmax, not renormalised) and learned dt/B/C norms against naive
references, its layer pattern and config errors, and its expert layouts.

Fixtures (tests/fixtures/make_mamba_reference.py, 40 tokens): `jamba_tf5` (attention at
layer 1 of 4, experts at 0 and 2, untied) and `jamba_tf4` (attention at 1 and 3, experts
at 3, Mamba projection biases, 3 conv taps, tied), both as transformers 5 saves them,
tf4 with the hub's extra keys.
"""

import json

import mlx.core as mx
import numpy as np
import pytest
from family_checks import FIXTURES, Family, FamilyChecks, fixture_model

from mlx_lm.models.cache import ArraysCache, KVCache, make_prompt_cache
from mlx_lm.models.jamba import FULL_ATTENTION, MAMBA, ModelArgs, SparseMoeBlock

COMMON = dict(model_type="jamba", hidden_size=64, intermediate_size=32, num_hidden_layers=4, num_attention_heads=4,
              num_key_value_heads=2, num_experts=4, num_experts_per_tok=2, mamba_d_state=8, attn_layer_period=2,
              attn_layer_offset=1, expert_layer_period=2, expert_layer_offset=0)
FAMILY = Family(
    fixtures=["jamba_tf4", "jamba_tf5"],
    tiny=dict(COMMON, vocab_size=512, eos_token_id=0),
    small=dict(COMMON, vocab_size=256, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
               num_key_value_heads=1),
)


class TestJamba(FamilyChecks):
    family = FAMILY


ARGS = dict(COMMON, vocab_size=64)
F, M = FULL_ATTENTION, MAMBA


def raw_weights(name):
    return mx.load(str(FIXTURES / name / "model.safetensors"))


# --- the router and the norms -----------------------------------------------------------


def test_router_keeps_the_softmax_weights_of_the_top_k():
    """transformers' JambaTopKRouter: softmax over all experts, the k best weights as they
    are (summing to less than 1), no renormalisation."""
    block = fixture_model("jamba_tf5").layers[0].feed_forward
    assert isinstance(block, SparseMoeBlock)
    rng = np.random.default_rng(0)
    x = rng.standard_normal((1, 5, 64)).astype(np.float32)
    logits = x @ np.array(block.router.weight).T
    probs = np.exp(logits - logits.max(-1, keepdims=True))
    probs /= probs.sum(-1, keepdims=True)
    top = np.argsort(-probs, axis=-1)[..., :2]
    per_expert = np.array(block.switch_mlp(mx.array(x), mx.array(top)))  # (1, 5, 2, 64)
    weights = np.take_along_axis(probs, top, axis=-1)
    want = (per_expert * weights[..., None]).sum(-2)
    got = np.array(block(mx.array(x)))
    assert np.abs(got - want).max() < 1e-5 * np.abs(want).max()
    renormalised = (per_expert * (weights / weights.sum(-1, keepdims=True))[..., None]).sum(-2)
    assert np.abs(got - renormalised).max() > 1e-2  # what upstream computes differs


def test_dt_b_c_norms_have_learned_weights():
    mixer = fixture_model("jamba_tf5").layers[0].mamba
    x = mx.array(np.random.default_rng(1).standard_normal((1, 3, 128)).astype(np.float32))
    _, B, C = mixer.ssm_inputs(x)
    raw = np.array(mixer.x_proj(x)).astype(np.float64)
    r, n = mixer.dt_rank, mixer.state_size

    def rms(v, weight):
        return v / np.sqrt((v**2).mean(-1, keepdims=True) + 1e-5) * np.array(weight)

    assert np.abs(np.array(B) - rms(raw[..., r : r + n], mixer.b_layernorm.weight)).max() < 1e-5
    assert np.abs(np.array(C) - rms(raw[..., r + n :], mixer.c_layernorm.weight)).max() < 1e-5
    assert not mx.allclose(mixer.b_layernorm.weight, mx.ones((n,)))  # the fixture's weights matter


# --- config -----------------------------------------------------------------------------


def test_layer_pattern_from_periods_or_layer_types():
    tf5 = ModelArgs.from_dict(json.loads((FIXTURES / "jamba_tf5" / "config.json").read_text()))
    assert tf5.layer_types == [M, F, M, M]
    assert [tf5.is_moe_layer(i) for i in range(4)] == [True, False, True, False]
    model = fixture_model("jamba_tf4")
    assert [layer.is_attention for layer in model.layers] == [False, True, False, True]
    assert [isinstance(layer.feed_forward, SparseMoeBlock) for layer in model.layers] == [False] * 3 + [True]
    listed = ModelArgs.from_dict(dict(ARGS, attn_layer_period=None, attn_layer_offset=None,
                                      layer_types=[M, F, M, F]))
    assert listed.layer_types == ModelArgs.from_dict(ARGS).layer_types
    legacy = ModelArgs.from_dict(dict(ARGS, layer_types=["mamba", "attention", "mamba", "attention"]))
    assert legacy.layer_types == [M, F, M, F]
    defaults = ModelArgs.from_dict(dict(ARGS, num_hidden_layers=8, attn_layer_period=None, attn_layer_offset=None,
                                        expert_layer_period=None, expert_layer_offset=None))
    assert defaults.layer_types == [M] * 4 + [F] + [M] * 3  # transformers' 8 / 4
    assert [defaults.is_moe_layer(i) for i in range(4)] == [False, True, False, True]
    alias = ModelArgs.from_dict(dict(ARGS, num_experts=None, num_local_experts=8, mamba_dt_rank="auto"))
    assert (alias.num_experts, alias.mamba_dt_rank, alias.head_dim) == (8, 4, 16)
    dense = ModelArgs.from_dict(dict(ARGS, num_experts=1))
    assert not any(dense.is_moe_layer(i) for i in range(4))


def test_config_errors_name_the_value():
    with pytest.raises(ValueError, match=r"layer_types \['linear_attention', .*\] disagrees with attn_layer_period"):
        ModelArgs.from_dict(dict(ARGS, layer_types=[M, M, M, F]))
    with pytest.raises(ValueError, match=r"attn_layer_offset \(2\) must be in 0..attn_layer_period - 1 \(1\)"):
        ModelArgs.from_dict(dict(ARGS, attn_layer_offset=2))
    with pytest.raises(ValueError, match=r"expert_layer_offset \(3\) must be in 0..expert_layer_period - 1 \(1\)"):
        ModelArgs.from_dict(dict(ARGS, expert_layer_offset=3))
    with pytest.raises(ValueError, match=r"num_experts \(4\) and num_local_experts \(8\) disagree"):
        ModelArgs.from_dict(dict(ARGS, num_local_experts=8))
    with pytest.raises(ValueError, match=r"num_experts_per_tok \(5\) must be in 1..num_experts \(4\)"):
        ModelArgs.from_dict(dict(ARGS, num_experts_per_tok=5))
    with pytest.raises(ValueError, match=r"num_attention_heads \(4\) must be a multiple of num_key_value_heads \(3\)"):
        ModelArgs.from_dict(dict(ARGS, num_key_value_heads=3))
    with pytest.raises(ValueError, match="mamba_dt_rank must be a positive int or 'auto', got 0"):
        ModelArgs.from_dict(dict(ARGS, mamba_dt_rank=0))


# --- weights and cache ------------------------------------------------------------------


def assert_same(a, b):
    assert a.keys() == b.keys()
    assert all(a[k].shape == b[k].shape and mx.array_equal(a[k], b[k]) for k in a), [k for k in a]


def test_sanitize_stacks_or_splits_experts_once():
    model, raw = fixture_model("jamba_tf5"), raw_weights("jamba_tf5")
    once = model.sanitize(raw)
    assert_same(model.sanitize(dict(once)), once)
    prefix = "model.layers.0.feed_forward."
    gate = once[prefix + "switch_mlp.gate_proj.weight"]
    assert gate.shape == (4, 32, 64) and mx.array_equal(gate[2], raw[prefix + "experts.2.gate_proj.weight"])
    conv = "model.layers.0.mamba.conv1d.weight"
    assert raw[conv].shape == (128, 1, 4) and once[conv].shape == (128, 4, 1)
    # transformers 5's in-memory layout: experts.gate_up_proj (E, 2I, H) and down_proj (E, H, I).
    fused = {k: v for k, v in raw.items() if ".experts." not in k}
    for layer in (0, 2):
        p = f"model.layers.{layer}.feed_forward.experts."
        fused[p + "gate_up_proj"] = mx.stack([mx.concatenate([raw[f"{p}{e}.gate_proj.weight"],
                                                              raw[f"{p}{e}.up_proj.weight"]]) for e in range(4)])
        fused[p + "down_proj"] = mx.stack([raw[f"{p}{e}.down_proj.weight"] for e in range(4)])
    assert_same(model.sanitize(fused), once)
    tied = fixture_model("jamba_tf4")
    assert "lm_head" not in tied and "lm_head.weight" not in tied.sanitize(
        dict(raw_weights("jamba_tf4"), **{"lm_head.weight": mx.zeros((256, 64))}))


def test_cache_layout_follows_the_layers():
    model = fixture_model("jamba_tf5")  # M A M M
    cache = make_prompt_cache(model)
    assert [type(c) for c in cache] == [ArraysCache, KVCache, ArraysCache, ArraysCache]
    model(mx.array([[1, 2, 3, 4, 5]]), cache=cache)
    assert cache[1].offset == 5 and cache[0][1].shape == (1, 128, 8)
    with pytest.raises(ValueError, match="cache has 2 entries; this model needs 4"):
        model(mx.array([[1]]), cache=cache[:2])
