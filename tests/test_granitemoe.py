"""granitemoe.py (Granite 3.x MoE): the shared family checks (family_checks.py) on the
transformers fixtures, plus what only this family has: the MoE block (softmax over the
top-k logits) against a naive per-token loop, that the fixtures depend on each muP
multiplier, the config dialects and errors, and sanitize on every layout. Two-rank
sharding of FAMILY.tiny is in test_distributed.py.

Fixtures come from fixtures/make_granitemoe_reference.py: granitemoe_tf4 (hub dialect,
the released checkpoints' kind of multipliers, tied) and granitemoe_tf5 (as
transformers 5 saves it, biases, untied).
"""

import pytest
from checkpoints import VOCAB_SIZE
from family_checks import Family, FamilyChecks, fixture_model
from moe_checks import assert_block_equals_naive, assert_sanitize_layouts, softmax_top_k
from sliding_checks import assert_override_matters

from mlx_lm.models.granitemoe import ModelArgs

MOE = dict(num_local_experts=4, num_experts_per_tok=2)
FAMILY = Family(
    fixtures=["granitemoe_tf4", "granitemoe_tf5"],
    tiny=dict(MOE, model_type="granitemoe", hidden_size=64, intermediate_size=64, num_hidden_layers=2,
              num_attention_heads=4, num_key_value_heads=2, vocab_size=VOCAB_SIZE, embedding_multiplier=12.0,
              residual_multiplier=0.22, attention_multiplier=0.0625, logits_scaling=4.0, tie_word_embeddings=False,
              eos_token_id=0),
    small=dict(MOE, model_type="granitemoe", hidden_size=32, intermediate_size=32, num_hidden_layers=1,
               num_attention_heads=2, num_key_value_heads=1, vocab_size=256, attention_multiplier=0.0625),
)
ARGS = dict(model_type="granitemoe", hidden_size=64, intermediate_size=32, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, vocab_size=256, **MOE)


class TestGraniteMoe(FamilyChecks):
    family = FAMILY


@pytest.mark.parametrize("name", FAMILY.fixtures)
def test_moe_block_equals_a_naive_loop(name):
    """Softmax over the top-k logits = the renormalised top-k of the full softmax."""
    block = fixture_model(name).layers[1].block_sparse_moe
    assert_block_equals_naive(block, softmax_top_k(block.router.weight, 2, normalize=True), 64)


@pytest.mark.parametrize("override", [{"embedding_multiplier": 1.0}, {"residual_multiplier": 1.0},
                                      {"attention_multiplier": 0.25}, {"logits_scaling": 1.0}])
def test_fixtures_exercise_every_multiplier(override):
    assert_override_matters("granitemoe_tf4", override)


def test_config_dialects_give_the_same_args():
    tf4 = ModelArgs.from_dict(dict(ARGS, rope_theta=1e4, logits_scaling=6.0))
    tf5 = ModelArgs.from_dict(dict(ARGS, rope_parameters={"rope_type": "default", "rope_theta": 1e4},
                                   logits_scaling=6.0))
    for field in ("rope_theta", "rope_scaling", "logits_scaling", "num_local_experts"):
        assert getattr(tf4, field) == getattr(tf5, field), field


@pytest.mark.parametrize("override, message", [
    ({"num_experts_per_tok": 5}, r"num_experts_per_tok \(5\) must be in 1..num_local_experts \(4\)"),
    ({"logits_scaling": 0}, "logits_scaling is 0"),
    ({"num_key_value_heads": 3}, r"\(3\)"),
])
def test_config_errors_name_the_value(override, message):
    with pytest.raises(ValueError, match=message):
        ModelArgs.from_dict(dict(ARGS, **override))


def in_memory(weights):
    """transformers 5's in-memory names of the fused expert tensors and the router."""
    renames = {".input_linear.weight": ".experts.gate_up_proj", ".output_linear.weight": ".experts.down_proj",
               ".router.layer.weight": ".router.weight"}
    out = {}
    for key, value in weights.items():
        for old, new in renames.items():
            key = key.replace(old, new)
        out[key] = value
    return out


def test_sanitize_takes_every_layout_once():
    assert_sanitize_layouts(FAMILY.fixtures, in_memory)
