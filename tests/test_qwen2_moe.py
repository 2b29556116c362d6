"""qwen2_moe.py (Qwen1.5-MoE, Qwen2-MoE): the shared family checks (family_checks.py) on
the transformers fixtures, plus what only this family has: the MoE block (softmax top-k
routing plus the sigmoid-gated shared expert) against a naive per-token loop, that the
fixtures depend on the routing, the config dialects and errors, and sanitize on every
layout. Two-rank sharding of FAMILY.tiny is checked by test_distributed.py.

Fixtures come from fixtures/make_qwen2_moe_reference.py: qwen2_moe_tf4 (hub dialect,
a dense middle layer, no renormalisation) and qwen2_moe_tf5 (as transformers 5 saves
it, decoder_sparse_step 2, renormalised top-k, tied).
"""

import numpy as np
import pytest
from checkpoints import VOCAB_SIZE
from family_checks import Family, FamilyChecks, fixture_model
from moe_checks import assert_block_equals_naive, assert_sanitize_layouts, fused_mlp_experts, np_swiglu, softmax_top_k
from sliding_checks import assert_override_matters

from mlx_lm.models.qwen2_moe import ModelArgs, SparseMoeBlock

MOE = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=64)
FAMILY = Family(
    fixtures=["qwen2_moe_tf4", "qwen2_moe_tf5"],
    tiny=dict(MOE, model_type="qwen2_moe", hidden_size=64, intermediate_size=128, num_hidden_layers=2,
              num_attention_heads=4, num_key_value_heads=2, mlp_only_layers=[1], vocab_size=VOCAB_SIZE,
              tie_word_embeddings=False, eos_token_id=0),
    small=dict(MOE, model_type="qwen2_moe", hidden_size=32, intermediate_size=48, num_hidden_layers=1,
               num_attention_heads=2, num_key_value_heads=1, vocab_size=256),
)
ARGS = dict(model_type="qwen2_moe", hidden_size=64, intermediate_size=96, num_hidden_layers=2,
            num_attention_heads=4, vocab_size=256, **MOE)


class TestQwen2Moe(FamilyChecks):
    family = FAMILY


@pytest.mark.parametrize("name", FAMILY.fixtures)
def test_moe_block_equals_a_naive_loop(name):
    """Softmax over all experts, the k best (renormalised if norm_topk_prob), plus the
    shared expert scaled by sigmoid(shared_expert_gate x)."""
    model = fixture_model(name)
    block = next(layer.mlp for layer in model.layers if isinstance(layer.mlp, SparseMoeBlock))
    shared = block.shared_expert
    gate, up, down, scale = (np.array(w, dtype=np.float64) for w in (
        shared.gate_proj.weight, shared.up_proj.weight, shared.down_proj.weight, block.shared_expert_gate.weight))
    choose = softmax_top_k(block.gate.weight, model.args.num_experts_per_tok, model.args.norm_topk_prob)
    assert_block_equals_naive(block, choose, 64,
                              shared=lambda x: np_swiglu(x, gate, up, down) / (1 + np.exp(-(scale @ x))))


@pytest.mark.parametrize("name, override", [
    ("qwen2_moe_tf4", {"norm_topk_prob": True}), ("qwen2_moe_tf5", {"norm_topk_prob": False}),
])
def test_fixtures_exercise_routing(name, override):
    assert_override_matters(name, override)


def test_moe_and_dense_layers_follow_the_config():
    assert [isinstance(l.mlp, SparseMoeBlock) for l in fixture_model("qwen2_moe_tf4").layers] == [True, False, True]
    assert [isinstance(l.mlp, SparseMoeBlock) for l in fixture_model("qwen2_moe_tf5").layers] == [False, True]


def test_config_dialects_give_the_same_args():
    tf4 = ModelArgs.from_dict(dict(ARGS, rope_theta=1e6))
    tf5 = ModelArgs.from_dict(dict(ARGS, rope_parameters={"rope_type": "default", "rope_theta": 1e6}, qkv_bias=True))
    for field in ("rope_theta", "rope_scaling", "qkv_bias", "num_experts", "mlp_only_layers", "layer_types"):
        assert getattr(tf4, field) == getattr(tf5, field), field
    assert ModelArgs.from_dict(dict(ARGS, num_experts=None)).num_experts == 60  # transformers' default
    assert ModelArgs.from_dict({k: v for k, v in ARGS.items() if k != "num_experts"}).num_experts == 60
    assert ModelArgs.from_dict(dict(ARGS, qkv_bias=False)).qkv_bias is False


@pytest.mark.parametrize("override, message", [
    ({"use_sliding_window": True}, "use_sliding_window=True"),
    ({"num_experts_per_tok": 5}, r"num_experts_per_tok \(5\)"),
    ({"shared_expert_intermediate_size": 0}, "shared_expert_intermediate_size must be > 0, got 0"),
    ({"decoder_sparse_step": 0}, "got 0"),
    ({"num_key_value_heads": 3}, r"\(3\)"),
])
def test_config_errors_name_the_value(override, message):
    with pytest.raises(ValueError, match=message):
        ModelArgs.from_dict(dict(ARGS, **override))


def test_sanitize_takes_every_layout_once():
    assert_sanitize_layouts(FAMILY.fixtures, fused_mlp_experts)
