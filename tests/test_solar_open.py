"""solar_open.py (Solar Open): the shared family checks (family_checks.py) on the
transformers fixtures, plus what only this family has beyond glm4_moe: every layer MoE
(checked against the naive loop), whole-head rope with the default theta 1e6, the
config dialects and errors, and sanitize on every layout. Two-rank sharding of
FAMILY.tiny is in test_distributed.py.

Fixtures come from fixtures/make_solar_open_reference.py: solar_open_tf4 (hub dialect,
2 groups keeping 1, scaling 2, biases) and solar_open_tf5 (as transformers 5 saves it,
the default theta, one group, tied).
"""

import pytest
from checkpoints import VOCAB_SIZE
from family_checks import Family, FamilyChecks, fixture_model
from moe_checks import assert_sanitize_layouts, assert_shared_moe_equals_naive, fused_mlp_experts
from sliding_checks import assert_override_matters

from mlx_lm.models.glm4_moe import MoE
from mlx_lm.models.solar_open import ModelArgs

MOE = dict(n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, n_shared_experts=1)
FAMILY = Family(
    fixtures=["solar_open_tf4", "solar_open_tf5"],
    tiny=dict(MOE, model_type="solar_open", hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, head_dim=16, n_group=2, topk_group=1, attention_bias=True,
              vocab_size=VOCAB_SIZE, tie_word_embeddings=False, eos_token_id=0),
    small=dict(MOE, model_type="solar_open", hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
               num_key_value_heads=1, head_dim=16, vocab_size=256),
)
ARGS = dict(MOE, model_type="solar_open", hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, vocab_size=256)


class TestSolarOpen(FamilyChecks):
    family = FAMILY


@pytest.mark.parametrize("name", FAMILY.fixtures)
def test_every_layer_is_moe_and_equals_a_naive_loop(name):
    model = fixture_model(name)
    assert all(isinstance(layer.mlp, MoE) for layer in model.layers)
    for layer in model.layers:
        assert_shared_moe_equals_naive(layer.mlp, model.args)


def test_whole_head_rope_and_its_default_theta():
    args = ModelArgs.from_dict(ARGS)
    assert (args.rope_theta, args.rotary_dims, args.qk_norm) == (1e6, 16, False)
    assert_override_matters("solar_open_tf5", {"rope_parameters": {"rope_type": "default", "rope_theta": 1e4}})
    assert_override_matters("solar_open_tf4", {"topk_group": 2})


def test_config_dialects_give_the_same_args():
    tf4 = ModelArgs.from_dict(dict(ARGS, rope_theta=1e4))
    tf5 = ModelArgs.from_dict(dict(ARGS, rope_parameters={"rope_type": "default", "rope_theta": 1e4}))
    for field in ("rope_theta", "rope_scaling", "rotary_dims", "n_routed_experts"):
        assert getattr(tf4, field) == getattr(tf5, field), field


@pytest.mark.parametrize("override, message", [
    ({"first_k_dense_replace": 1}, "first_k_dense_replace=1: every solar_open layer is MoE"),
    ({"n_group": 3}, r"n_group \(3\) must divide n_routed_experts \(4\)"),
    ({"num_key_value_heads": 3}, r"\(3\)"),
])
def test_config_errors_name_the_value(override, message):
    with pytest.raises(ValueError, match=message):
        ModelArgs.from_dict(dict(ARGS, **override))


def test_sanitize_takes_every_layout_once():
    assert_sanitize_layouts(FAMILY.fixtures, fused_mlp_experts)
