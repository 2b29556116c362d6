"""minimax_m2.py (MiniMax-M2): the shared family checks (family_checks.py) on the
transformers fixtures, plus what only this family has: the MoE block (sigmoid scores,
choice through the correction bias, renormalised) against a naive per-token loop, the
whole-projection q/k norms and the partial rope from either key, the config dialects,
and sanitize on every layout. Its sharded q/k norms (squares summed over ranks) are
checked by test_distributed.py, which shards FAMILY.tiny over two ranks.

Fixtures come from fixtures/make_minimax_m2_reference.py: minimax_m2_tf4 (hub dialect,
rotary_dim 8) and minimax_m2_tf5 (as transformers 5 saves it, partial factor 0.75, tied).
"""

import mlx.core as mx
import numpy as np
import pytest
from checkpoints import VOCAB_SIZE
from family_checks import FIXTURES, Family, FamilyChecks, fixture_model, reference, relative_error
from moe_checks import assert_block_equals_naive, assert_sanitize_layouts, fuse_per_expert
from sliding_checks import assert_override_matters

from mlx_lm.models.minimax_m2 import ModelArgs
from mlx_lm.models.olmo3 import ProjectionNorm
from mlx_lm.utils import load_model

MOE = dict(num_local_experts=4, num_experts_per_tok=2)
FAMILY = Family(
    fixtures=["minimax_m2_tf4", "minimax_m2_tf5"],
    tiny=dict(MOE, model_type="minimax_m2", hidden_size=64, intermediate_size=64, num_hidden_layers=2,
              num_attention_heads=4, num_key_value_heads=2, head_dim=16, rotary_dim=8, vocab_size=VOCAB_SIZE,
              tie_word_embeddings=False, eos_token_id=0),
    small=dict(MOE, model_type="minimax_m2", hidden_size=32, intermediate_size=32, num_hidden_layers=1,
               num_attention_heads=2, num_key_value_heads=1, head_dim=16, vocab_size=256),
)
ARGS = dict(MOE, model_type="minimax_m2", hidden_size=64, intermediate_size=32, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, head_dim=16, vocab_size=256)


class TestMiniMaxM2(FamilyChecks):
    family = FAMILY


@pytest.mark.parametrize("name", FAMILY.fixtures)
def test_moe_block_equals_a_naive_loop(name):
    block = fixture_model(name).layers[1].block_sparse_moe
    router = np.array(block.gate.weight, dtype=np.float64)
    bias = np.array(block.e_score_correction_bias, dtype=np.float64)
    assert np.abs(bias).max() > 0.01  # the fixture's biases are drawn

    def choose(x):
        scores = 1 / (1 + np.exp(-(router @ x)))
        best = np.argsort(-(scores + bias))[:2]
        return list(zip(best, scores[best] / scores[best].sum()))

    assert_block_equals_naive(block, choose, 64)


def test_qk_norms_span_the_projection_and_rope_is_partial():
    model = fixture_model("minimax_m2_tf4")
    attn = model.layers[0].self_attn
    assert isinstance(attn.q_norm, ProjectionNorm) and attn.q_norm.weight.shape == (64,)
    assert (model.args.rotary_dims, fixture_model("minimax_m2_tf5").args.rotary_dims) == (8, 12)
    assert_override_matters("minimax_m2_tf4", {"rotary_dim": 16})


def test_the_correction_bias_steers_the_choice():
    model, _ = load_model(FIXTURES / "minimax_m2_tf5")
    for layer in model.layers:
        layer.block_sparse_moe.e_score_correction_bias = mx.zeros((4,))
    ids, want = reference("minimax_m2_tf5")
    assert relative_error(model(ids), want) > 1e-2


def test_config_dialects_give_the_same_args():
    tf4 = ModelArgs.from_dict(dict(ARGS, rope_theta=1e4, rotary_dim=8))
    tf5 = ModelArgs.from_dict(dict(ARGS, rope_parameters={"rope_type": "default", "rope_theta": 1e4,
                                                          "partial_rotary_factor": 0.5}))
    for field in ("rope", "rope_theta", "partial_rotary_factor", "rotary_dims", "layer_types"):
        assert getattr(tf4, field) == getattr(tf5, field), field
    assert ModelArgs.from_dict(ARGS).rope_theta == 5e6  # transformers' default theta
    with pytest.raises(ValueError, match=r"partial_rotary_factor must be in \(0, 1\], got 2.0"):
        ModelArgs.from_dict(dict(ARGS, rotary_dim=32))


def in_memory(weights):
    """transformers 5's in-memory names: block_sparse_moe -> mlp, experts fused."""
    fused = fuse_per_expert(weights, "block_sparse_moe", "w1", "w3", "w2", into="mlp")
    return {k.replace(".block_sparse_moe.", ".mlp."): v for k, v in fused.items()}


def test_sanitize_takes_every_layout_once():
    assert_sanitize_layouts(FAMILY.fixtures, in_memory)
