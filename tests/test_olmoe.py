"""olmoe.py (OLMoE): the shared family checks (family_checks.py) on the transformers
fixtures, plus what only OLMoE has: the MoE block (softmax top-k) against a naive
per-token loop, the QK-norm over the whole projection, that the fixtures depend on the
renormalisation, the config dialects and errors, and sanitize on every layout. Its
sharded q/k norms (squares summed over ranks) are checked by test_distributed.py,
which shards FAMILY.tiny over two ranks.

Fixtures come from fixtures/make_olmoe_reference.py: olmoe_tf4 (hub dialect, no
renormalisation) and olmoe_tf5 (as transformers 5 saves it, renormalised, biases, tied).
"""

import pytest
from checkpoints import VOCAB_SIZE
from family_checks import Family, FamilyChecks, fixture_model
from moe_checks import assert_block_equals_naive, assert_sanitize_layouts, fused_mlp_experts, softmax_top_k
from sliding_checks import assert_override_matters

from mlx_lm.models.olmo3 import ProjectionNorm
from mlx_lm.models.olmoe import ModelArgs

MOE = dict(num_experts=4, num_experts_per_tok=2)
FAMILY = Family(
    fixtures=["olmoe_tf4", "olmoe_tf5"],
    tiny=dict(MOE, model_type="olmoe", hidden_size=64, intermediate_size=64, num_hidden_layers=2,
              num_attention_heads=4, num_key_value_heads=2, vocab_size=VOCAB_SIZE, tie_word_embeddings=False,
              eos_token_id=0),
    small=dict(MOE, model_type="olmoe", hidden_size=32, intermediate_size=32, num_hidden_layers=1,
               num_attention_heads=2, num_key_value_heads=1, vocab_size=256),
)
ARGS = dict(model_type="olmoe", hidden_size=64, intermediate_size=32, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, vocab_size=256, **MOE)


class TestOlmoe(FamilyChecks):
    family = FAMILY


@pytest.mark.parametrize("name", FAMILY.fixtures)
def test_moe_block_equals_a_naive_loop(name):
    model = fixture_model(name)
    block = model.layers[1].mlp
    assert_block_equals_naive(block, softmax_top_k(block.gate.weight, 2, model.args.norm_topk_prob), 64)


def test_qk_norm_spans_the_whole_projection():
    attn = fixture_model("olmoe_tf4").layers[0].self_attn
    assert isinstance(attn.q_norm, ProjectionNorm) and attn.q_norm.weight.shape == (64,)
    assert attn.k_norm.weight.shape == (32,)  # H_kv * D


@pytest.mark.parametrize("name, override", [("olmoe_tf4", {"norm_topk_prob": True}),
                                            ("olmoe_tf5", {"norm_topk_prob": False})])
def test_fixtures_exercise_routing(name, override):
    assert_override_matters(name, override)


def test_config_dialects_give_the_same_args():
    tf4 = ModelArgs.from_dict(dict(ARGS, rope_theta=1e4))
    tf5 = ModelArgs.from_dict(dict(ARGS, rope_parameters={"rope_type": "default", "rope_theta": 1e4}))
    for field in ("rope", "rope_theta", "rope_scaling", "num_experts", "norm_topk_prob", "rms_norm_eps"):
        assert getattr(tf4, field) == getattr(tf5, field), field
    assert tf4.moe_intermediate_size == 32 and tf4.rms_norm_eps == 1e-5


@pytest.mark.parametrize("override, message", [
    ({"clip_qkv": 8.0}, "clip_qkv=8.0 is not supported"),
    ({"head_dim": 32}, r"head_dim \(32\) x num_attention_heads \(4\) must equal hidden_size \(64\)"),
    ({"num_experts_per_tok": 9}, r"num_experts_per_tok \(9\)"),
    ({"num_key_value_heads": 3}, r"\(3\)"),
])
def test_config_errors_name_the_value(override, message):
    with pytest.raises(ValueError, match=message):
        ModelArgs.from_dict(dict(ARGS, **override))


def test_sanitize_takes_every_layout_once():
    assert_sanitize_layouts(FAMILY.fixtures, fused_mlp_experts)
