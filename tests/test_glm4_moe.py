"""glm4_moe.py (GLM-4.5/4.6): the shared family checks (family_checks.py) on the
transformers fixtures, plus what only this family has: the MoE block (sigmoid scores,
biased group-limited top-k, scaled weights, shared expert) against a naive per-token
loop, that the fixtures depend on the groups, the scaling, the correction bias and
the rope fraction, the config dialects and errors, and sanitize on every layout (and
the hub's MTP layers dropped). Two-rank sharding of FAMILY.tiny is in test_distributed.py.

Fixtures come from fixtures/make_glm4_moe_reference.py: glm4_moe_tf4 (hub dialect, a
dense first layer, 2 groups keeping 1, scaling 2.5, q/k norms, biases) and
glm4_moe_tf5 (as transformers 5 saves it, every layer MoE, one group, tied).
"""

import mlx.core as mx
import pytest
from checkpoints import VOCAB_SIZE
from family_checks import FIXTURES, Family, FamilyChecks, fixture_model, reference, relative_error
from moe_checks import assert_sanitize_layouts, assert_shared_moe_equals_naive, fused_mlp_experts
from sliding_checks import assert_override_matters

from mlx_lm.models.glm4_moe import ModelArgs, MoE
from mlx_lm.utils import load_model

MOE = dict(n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, n_shared_experts=1)
FAMILY = Family(
    fixtures=["glm4_moe_tf4", "glm4_moe_tf5"],
    tiny=dict(MOE, model_type="glm4_moe", hidden_size=64, intermediate_size=128, num_hidden_layers=2,
              num_attention_heads=4, num_key_value_heads=2, head_dim=16, n_group=2, topk_group=1,
              use_qk_norm=True, attention_bias=True, vocab_size=VOCAB_SIZE, tie_word_embeddings=False,
              eos_token_id=0),
    small=dict(MOE, model_type="glm4_moe", hidden_size=32, intermediate_size=48, num_hidden_layers=1,
               num_attention_heads=2, num_key_value_heads=1, first_k_dense_replace=0, vocab_size=256),
)
ARGS = dict(MOE, model_type="glm4_moe", hidden_size=64, intermediate_size=96, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, head_dim=16, vocab_size=256)


class TestGlm4Moe(FamilyChecks):
    family = FAMILY


@pytest.mark.parametrize("name", FAMILY.fixtures)
def test_moe_block_equals_a_naive_loop(name):
    model = fixture_model(name)
    assert_shared_moe_equals_naive(model.layers[1].mlp, model.args)


def test_dense_and_moe_layers_follow_first_k_dense_replace():
    assert [isinstance(layer.mlp, MoE) for layer in fixture_model("glm4_moe_tf4").layers] == [False, True]
    assert [isinstance(layer.mlp, MoE) for layer in fixture_model("glm4_moe_tf5").layers] == [True, True]


@pytest.mark.parametrize("name, override", [
    ("glm4_moe_tf4", {"topk_group": 2}), ("glm4_moe_tf4", {"routed_scaling_factor": 1.0}),
    ("glm4_moe_tf4", {"norm_topk_prob": False}), ("glm4_moe_tf5", {"partial_rotary_factor": 0.5}),
])
def test_fixtures_exercise_the_config(name, override):
    assert_override_matters(name, override)


def test_the_correction_bias_steers_the_choice():
    model, _ = load_model(FIXTURES / "glm4_moe_tf5")
    for layer in model.layers:
        layer.mlp.gate.e_score_correction_bias = mx.zeros_like(layer.mlp.gate.e_score_correction_bias)
    ids, want = reference("glm4_moe_tf5")
    assert relative_error(model(ids), want) > 1e-2


def test_config_dialects_give_the_same_args():
    tf4 = ModelArgs.from_dict(dict(ARGS, rope_theta=1e4, partial_rotary_factor=0.5))
    tf5 = ModelArgs.from_dict(dict(ARGS, rope_parameters={"rope_type": "default", "rope_theta": 1e4,
                                                          "partial_rotary_factor": 0.5}))
    for field in ("rope_theta", "rope_scaling", "partial_rotary_factor", "rotary_dims", "n_routed_experts"):
        assert getattr(tf4, field) == getattr(tf5, field), field
    defaults = ModelArgs.from_dict(ARGS)
    assert (defaults.attention_bias, defaults.qk_norm, defaults.rms_norm_eps, defaults.rotary_dims) == (
        False, False, 1e-5, 8)


@pytest.mark.parametrize("override, message", [
    ({"n_group": 3}, r"n_group \(3\) must divide n_routed_experts \(4\)"),
    ({"n_group": 2, "topk_group": 3}, r"topk_group \(3\) must be in 1..n_group \(2\)"),
    ({"n_group": 4, "topk_group": 2}, "at least 2 experts per group"),
    ({"num_experts_per_tok": 5}, r"num_experts_per_tok \(5\) must be in 1..n_routed_experts \(4\)"),
    ({"n_shared_experts": 0}, "n_shared_experts is 0"),
    ({"partial_rotary_factor": 0}, "got 0"),
])
def test_config_errors_name_the_value(override, message):
    with pytest.raises(ValueError, match=message):
        ModelArgs.from_dict(dict(ARGS, **override))


def test_sanitize_takes_every_layout_once():
    assert_sanitize_layouts(FAMILY.fixtures, fused_mlp_experts)


def test_sanitize_drops_the_mtp_layers():
    """The hub's checkpoints carry a next-token-prediction layer at index
    num_hidden_layers; it is dropped, the real layers kept."""
    model = fixture_model("glm4_moe_tf4")
    raw = mx.load(str(FIXTURES / "glm4_moe_tf4" / "model.safetensors"))
    mtp = {k.replace("model.layers.1.", "model.layers.2."): v
           for k, v in raw.items() if k.startswith("model.layers.1.")}
    mtp["model.layers.2.eh_proj.weight"] = mx.zeros((64, 128))
    assert model.sanitize(dict(raw, **mtp)).keys() == model.sanitize(raw).keys()
