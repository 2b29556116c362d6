"""qwen2_moe.py (Qwen1.5-MoE, Qwen2-MoE): the shared family checks (family_checks.py) on
the transformers fixtures, plus what only this family has: the MoE block (softmax top-k
routing plus the sigmoid-gated shared expert) against a naive per-token loop, that the
fixtures depend on the routing, the config dialects and errors, and sanitize on every
layout. Two-rank sharding of FAMILY.tiny is checked by test_distributed.py.

Fixtures come from fixtures/make_qwen2_moe_reference.py: qwen2_moe_tf4 (hub dialect,
a dense middle layer, no renormalisation) and qwen2_moe_tf5 (as transformers 5 saves
it, decoder_sparse_step 2, renormalised top-k, tied).
"""

import mlx.core as mx
import numpy as np
import pytest
from checkpoints import VOCAB_SIZE
from family_checks import Family, FamilyChecks, fixture_model
from moe_checks import assert_sanitize_layouts, fuse_per_expert, naive_moe, np_softmax, np_swiglu, relative
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
    router = np.array(block.gate.weight, dtype=np.float64)
    k, norm = model.args.num_experts_per_tok, model.args.norm_topk_prob

    def choose(x):
        p = np_softmax(router @ x)
        best = np.argsort(-p)[:k]
        w = p[best] / (p[best].sum() if norm else 1.0)
        return list(zip(best, w))

    x = mx.random.normal((2, 5, 64), key=mx.random.key(0))
    s = block.switch_mlp
    want = naive_moe(x, choose, s.gate_proj.weight, s.up_proj.weight, s.down_proj.weight)
    shared = block.shared_expert
    sw = [np.array(w, dtype=np.float64) for w in (shared.gate_proj.weight, shared.up_proj.weight,
                                                   shared.down_proj.weight, block.shared_expert_gate.weight)]
    xs = np.array(x, dtype=np.float64)
    for b, t in np.ndindex(2, 5):
        want[b, t] += np_swiglu(xs[b, t], *sw[:3]) / (1 + np.exp(-(sw[3] @ xs[b, t])))
    assert relative(block(x), want) < 1e-5


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
    assert_sanitize_layouts(FAMILY.fixtures, lambda w: fuse_per_expert(w, "mlp", "gate_proj", "up_proj",
                                                                       "down_proj", into="mlp"))
