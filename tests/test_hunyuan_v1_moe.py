"""hunyuan_v1_moe.py (Hunyuan-A13B): the shared family checks (family_checks.py) on the
transformers fixtures, plus what only this family has: the MoE block (softmax top-k
renormalised, plus the shared MLP) against a naive per-token loop, per-layer top-k,
the config dialects and errors, and sanitize on every layout. Two-rank sharding of
FAMILY.tiny is in test_distributed.py.

Fixtures come from fixtures/make_hunyuan_v1_moe_reference.py: hunyuan_v1_moe_tf4 (hub
dialect, NTK-alpha rope, moe_topk as a list) and hunyuan_v1_moe_tf5 (as transformers 5
saves it, biases, tied).
"""

import numpy as np
import pytest
from checkpoints import VOCAB_SIZE
from family_checks import Family, FamilyChecks, fixture_model
from moe_checks import (assert_block_equals_naive, assert_sanitize_layouts, fused_mlp_experts, np_swiglu,
                        softmax_top_k)
from sliding_checks import assert_override_matters

from mlx_lm.models.hunyuan_v1_moe import ModelArgs

MOE = dict(num_experts=4, moe_topk=2)
FAMILY = Family(
    fixtures=["hunyuan_v1_moe_tf4", "hunyuan_v1_moe_tf5"],
    tiny=dict(MOE, model_type="hunyuan_v1_moe", hidden_size=64, intermediate_size=64, num_hidden_layers=2,
              num_attention_heads=4, num_key_value_heads=2, head_dim=16, vocab_size=VOCAB_SIZE,
              tie_word_embeddings=False, eos_token_id=0),
    small=dict(MOE, model_type="hunyuan_v1_moe", hidden_size=32, intermediate_size=32, num_hidden_layers=1,
               num_attention_heads=2, num_key_value_heads=1, head_dim=16, vocab_size=256),
)
ARGS = dict(MOE, model_type="hunyuan_v1_moe", hidden_size=64, intermediate_size=32, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, head_dim=16, vocab_size=256)


class TestHunyuanV1Moe(FamilyChecks):
    family = FAMILY


@pytest.mark.parametrize("name", FAMILY.fixtures)
def test_moe_block_equals_a_naive_loop(name):
    block = fixture_model(name).layers[1].mlp
    shared = [np.array(w, dtype=np.float64) for w in (block.shared_mlp.gate_proj.weight,
                                                       block.shared_mlp.up_proj.weight,
                                                       block.shared_mlp.down_proj.weight)]
    assert_block_equals_naive(block, softmax_top_k(block.gate.wg.weight, 2, normalize=True), 64,
                              shared=lambda x: np_swiglu(x, *shared))


def test_top_k_per_layer():
    args = ModelArgs.from_dict(dict(ARGS, moe_topk=[1, 3]))
    assert [args.top_k(i) for i in range(2)] == [1, 3]
    assert_override_matters("hunyuan_v1_moe_tf4", {"moe_topk": [1, 1]})


def test_config_dialects_give_the_same_args():
    tf4 = ModelArgs.from_dict(dict(ARGS, rope_theta=1e4, rope_scaling={"type": "dynamic", "alpha": 1000.0}))
    tf5 = ModelArgs.from_dict(dict(ARGS, rope_parameters={"rope_type": "dynamic", "rope_theta": 1e4, "alpha": 1000.0}))
    for field in ("rope_theta", "rope_scaling", "ntk_alpha", "num_experts"):
        assert getattr(tf4, field) == getattr(tf5, field), field


@pytest.mark.parametrize("override, message", [
    ({"moe_topk": [2]}, "moe_topk has 1 entries but num_hidden_layers is 2"),
    ({"moe_topk": 5}, r"moe_topk \(5\) must be in 1..num_experts \(4\)"),
    ({"num_experts": [4, 4]}, r"num_experts must be one count for every layer, got \[4, 4\]"),
])
def test_config_errors_name_the_value(override, message):
    with pytest.raises(ValueError, match=message):
        ModelArgs.from_dict(dict(ARGS, **override))


def test_sanitize_takes_every_layout_once():
    assert_sanitize_layouts(FAMILY.fixtures, fused_mlp_experts)
