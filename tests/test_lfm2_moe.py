"""lfm2_moe.py: the shared family checks (family_checks.py) on the transformers fixtures,
plus what only LFM2-MoE has: the sigmoid router with its selection-only expert bias
against a naive loop, the dense-then-MoE layer split, the config dialects, and sanitize
over the per-expert and fused expert layouts.

Fixtures come from fixtures/make_lfm2_moe_reference.py (40 tokens, random expert
biases): lfm2_moe_tf4 with the hub's config keys (top-level rope_theta, tie_embedding),
lfm2_moe_tf5 as transformers 5 saves it.
"""

import mlx.core as mx
import numpy as np
import pytest
from checkpoints import VOCAB_SIZE
from family_checks import FIXTURES, Family, FamilyChecks, fixture_model, reference, relative_error

from mlx_lm.models.lfm2 import FeedForward
from mlx_lm.models.lfm2_moe import ModelArgs, SparseMoeBlock, sigmoid_route
from mlx_lm.utils import load_model

C, F = "conv", "full_attention"
SHAPE = dict(hidden_size=64, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
             intermediate_size=64, moe_intermediate_size=32, num_experts=4, num_experts_per_tok=2)

FAMILY = Family(
    fixtures=["lfm2_moe_tf4", "lfm2_moe_tf5"],
    tiny=dict(SHAPE, model_type="lfm2_moe", vocab_size=VOCAB_SIZE, layer_types=[C, F, C, F], num_dense_layers=1,
              tie_word_embeddings=False, eos_token_id=0),
    small=dict(model_type="lfm2_moe", hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
               num_key_value_heads=1, intermediate_size=48, moe_intermediate_size=16, num_experts=4,
               num_experts_per_tok=2, num_dense_layers=1, layer_types=[C, F], vocab_size=256),
)


class TestLfm2Moe(FamilyChecks):
    family = FAMILY


ARGS = dict(SHAPE, model_type="lfm2_moe", vocab_size=64, layer_types=[C, F, C, C])


# --- the router ---------------------------------------------------------------------------


def naive_route(logits, bias, top_k, normalize, scaling):
    """Token by token in float64, as transformers: sort by biased score, weigh by score."""
    logits = np.array(logits, dtype=np.float64).reshape(-1, logits.shape[-1])
    experts, weights = [], []
    for row in logits:
        scores = 1 / (1 + np.exp(-row))
        chosen = np.argsort(-(scores + (0 if bias is None else np.array(bias))))[:top_k]
        w = scores[chosen]
        if normalize:
            w = w / (w.sum() + 1e-6)
        experts.append(chosen)
        weights.append(w * scaling)
    return np.array(experts), np.array(weights)


@pytest.mark.parametrize("use_bias, normalize, scaling", [(True, True, 1.0), (True, False, 1.5), (False, True, 2.0)])
def test_sigmoid_route_matches_a_naive_loop(use_bias, normalize, scaling):
    logits = mx.random.normal((3, 5, 8), key=mx.random.key(1)) * 2
    bias = mx.random.normal((8,), key=mx.random.key(2)) if use_bias else None
    experts, weights = sigmoid_route(logits, bias, 3, normalize, scaling)
    want_experts, want_weights = naive_route(logits, bias, 3, normalize, scaling)
    order = np.argsort(np.array(experts).reshape(-1, 3), axis=-1)  # argpartition leaves the k unordered
    got_experts = np.take_along_axis(np.array(experts).reshape(-1, 3), order, -1)
    got_weights = np.take_along_axis(np.array(weights).reshape(-1, 3), order, -1)
    want_order = np.argsort(want_experts, axis=-1)
    assert (got_experts == np.take_along_axis(want_experts, want_order, -1)).all()
    np.testing.assert_allclose(got_weights, np.take_along_axis(want_weights, want_order, -1), rtol=1e-6)


def test_expert_bias_moves_the_choice_not_the_weights():
    """A large bias on one expert makes every token choose it, with its unbiased score."""
    logits = mx.random.normal((6, 4), key=mx.random.key(3))
    bias = mx.array([0.0, 0.0, 10.0, 0.0])
    experts, weights = sigmoid_route(logits, bias, 1, False, 1.0)
    assert (experts[:, 0] == 2).all().item()
    assert mx.allclose(weights[:, 0], mx.sigmoid(logits[:, 2])).item()


def test_fixtures_cover_both_dialects_and_the_moe_options():
    tf4, tf5 = fixture_model("lfm2_moe_tf4"), fixture_model("lfm2_moe_tf5")
    assert [isinstance(layer.feed_forward, SparseMoeBlock) for layer in tf4.layers] == [False, False, True, True]
    assert [isinstance(layer.feed_forward, SparseMoeBlock) for layer in tf5.layers] == [False, True, True, True]
    dense = tf4.layers[0].feed_forward
    assert isinstance(dense, FeedForward) and dense.w1.weight.shape == (64, 64)  # no LFM2 auto-adjust
    moe4, moe5 = tf4.layers[2].feed_forward, tf5.layers[1].feed_forward
    assert (moe4.top_k, moe4.normalize, moe4.scaling) == (3, True, 1.0)
    assert (moe5.top_k, moe5.normalize, moe5.scaling) == (2, False, 1.5)
    assert mx.abs(moe4.expert_bias).max().item() > 0.1  # the fixture's biases are random
    assert "lm_head" not in tf4 and "lm_head" in tf5
    assert (tf4.args.rope_theta, tf5.args.rope_theta) == (1e6, 5000.0)


# --- config -------------------------------------------------------------------------------


def test_dialects_normalise_alike():
    tf5 = ModelArgs.from_dict(dict(ARGS, tie_word_embeddings=False,
                                   rope_parameters={"rope_type": "default", "rope_theta": 5e5}))
    tf4 = ModelArgs.from_dict(dict(ARGS, tie_embedding=False, rope_theta=5e5))
    by_idxs = ModelArgs.from_dict(dict(ARGS, layer_types=None, full_attn_idxs=[1], tie_embedding=False,
                                       rope_theta=5e5))
    for field in ("layer_types", "full_attn_idxs", "tie_word_embeddings", "tie_embedding", "rope_theta",
                  "rope_scaling"):
        assert getattr(tf4, field) == getattr(tf5, field) == getattr(by_idxs, field), field
    defaults = ModelArgs.from_dict(ARGS)
    assert (defaults.rope_theta, defaults.tie_word_embeddings, defaults.head_dim) == (1e6, True, 16)
    assert (defaults.num_dense_layers, defaults.use_expert_bias, defaults.norm_topk_prob) == (2, True, True)
    bare = ModelArgs.from_dict(dict(model_type="lfm2_moe", vocab_size=64, hidden_size=64, num_hidden_layers=4,
                                    num_attention_heads=4, num_key_value_heads=2, layer_types=[C, F, C, C]))
    assert (bare.intermediate_size, bare.moe_intermediate_size, bare.num_experts, bare.num_experts_per_tok) == (
        7168, 1792, 32, 4)  # transformers' defaults


@pytest.mark.parametrize("extra, message", [
    (dict(layer_types=None), "neither layer_types nor full_attn_idxs"),
    (dict(full_attn_idxs=[2]), "full_attn_idxs \\[2\\] disagrees"),
    (dict(layer_types=[C, "mamba", C, C]), "unknown kinds \\['mamba'\\]"),
    (dict(tie_word_embeddings=True, tie_embedding=False), "tie_word_embeddings is True but tie_embedding"),
    (dict(num_dense_layers=5), "num_dense_layers must be in 0..num_hidden_layers \\(4\\), got 5"),
    (dict(num_experts_per_tok=5), "num_experts_per_tok \\(5\\) must be in 1..num_experts \\(4\\)"),
    (dict(conv_L_cache=1), "conv_L_cache must be >= 2, got 1"),
    (dict(num_key_value_heads=3), "num_key_value_heads \\(3\\)"),
])
def test_config_errors_name_the_value(extra, message):
    with pytest.raises(ValueError, match=message):
        ModelArgs.from_dict(dict(ARGS, **extra))


def test_all_dense_layers_need_no_experts():
    args = ModelArgs.from_dict(dict(ARGS, num_dense_layers=4, num_experts=0, num_experts_per_tok=0))
    assert not any(args.is_moe_layer(i) for i in range(4))


# --- weights ------------------------------------------------------------------------------


def assert_same(a, b):
    assert a.keys() == b.keys()
    for k in a:
        assert a[k].shape == b[k].shape and mx.array_equal(a[k], b[k]), k


def fused(raw):
    """The per-expert checkpoint in transformers' in-memory layout: gate_up_proj
    (E, 2I, H) = [w1 ; w3] and down_proj (E, H, I) per MoE layer."""
    out, layers = {}, {}
    for key, value in raw.items():
        if ".experts." in key:
            prefix, rest = key.split(".experts.")
            expert, name, _ = rest.split(".")
            layers.setdefault(prefix, {}).setdefault(name, {})[int(expert)] = value
        else:
            out[key] = value
    for prefix, names in layers.items():
        stack = {name: mx.stack([w[e] for e in sorted(w)]) for name, w in names.items()}
        out[prefix + ".experts.gate_up_proj"] = mx.concatenate([stack["w1"], stack["w3"]], axis=1)
        out[prefix + ".experts.down_proj"] = stack["w2"]
    return out


@pytest.mark.parametrize("name", FAMILY.fixtures)
def test_sanitize_converts_each_hf_layout_once(name, tmp_path):
    model, raw = fixture_model(name), mx.load(str(FIXTURES / name / "model.safetensors"))
    once = model.sanitize(raw)
    assert_same(model.sanitize(dict(once)), once)
    assert_same(model.sanitize(fused(raw)), once)
    assert "model.layers.3.feed_forward.experts.0.w1.weight" in raw
    gate = once["model.layers.3.feed_forward.switch_mlp.gate_proj.weight"]
    assert gate.shape == (8, 16, 64)
    assert mx.array_equal(gate[5], raw["model.layers.3.feed_forward.experts.5.w1.weight"])
    assert mx.array_equal(once["model.layers.3.feed_forward.switch_mlp.up_proj.weight"][5],
                          raw["model.layers.3.feed_forward.experts.5.w3.weight"])
    missing = {k: v for k, v in raw.items() if ".experts.2." not in k}
    with pytest.raises(ValueError, match="for experts \\[0, 1, 3, 4, 5, 6, 7\\]; expected 0..6"):
        model.sanitize(missing)
    # Saved in the MLX layout (stacked experts, MLX conv layout), it loads to the same logits.
    mx.save_safetensors(str(tmp_path / "model.safetensors"), once)
    (tmp_path / "config.json").write_text((FIXTURES / name / "config.json").read_text())
    ids, want = reference(name)
    assert relative_error(load_model(tmp_path)[0](ids), want) < FAMILY.tolerance


def test_routers_stay_at_eight_bits():
    model = fixture_model("lfm2_moe_tf5")
    assert model.quant_predicate("model.layers.1.feed_forward.gate", None) == {"group_size": 64, "bits": 8}
    assert model.quant_predicate("model.layers.1.feed_forward.switch_mlp.up_proj", None) is True
