"""deepseek_v2.py: the shared family checks (family_checks.py) on the transformers
fixtures, plus what only DeepSeek-V2 has: the MoE block (softmax router, greedy and
group-limited, shared experts with biases) against a naive loop, moe_layer_freq's
layer pattern, the yarn rope and biases mattering on the fixtures, the config dialects
and errors, and sanitize on every layout. The latent attention with rope is tested in
test_mla.py; two-rank sharding of FAMILY.tiny in test_distributed.py.

Fixtures come from fixtures/make_deepseek_v2_reference.py: deepseek_v2_tf4 (the hub
dialect of DeepSeek-V2-Lite: no q LoRA, yarn with mscale = mscale_all_dim = 0.707,
greedy, two shared experts) and deepseek_v2_tf5 (as transformers 5 saves it: q LoRA,
plain rope, group_limited_greedy over 2 groups keeping 1, attention and MLP biases, tied).
"""

from typing import Callable, List, Tuple

import mlx.core as mx
import numpy as np
import pytest
from checkpoints import VOCAB_SIZE
from family_checks import FIXTURES, PROMPT, Family, FamilyChecks, fixture_model
from moe_checks import assert_block_equals_naive, assert_sanitize_layouts, fused_mlp_experts, np_softmax, np_swiglu
from sliding_checks import assert_override_matters

from mlx_lm.models.deepseek_v2 import MoE, ModelArgs
from mlx_lm.models.llama import MLP
from mlx_lm.utils import load_model, quantize_model

MLA = dict(kv_lora_rank=16, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16)
FAMILY = Family(
    fixtures=["deepseek_v2_tf4", "deepseek_v2_tf5"],
    tiny=dict(MLA, model_type="deepseek_v2", vocab_size=VOCAB_SIZE, hidden_size=64, intermediate_size=256,
              moe_intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, q_lora_rank=None,
              n_routed_experts=4, n_shared_experts=1, num_experts_per_tok=2, first_k_dense_replace=1,
              topk_method="group_limited_greedy", n_group=2, topk_group=1, mlp_bias=True, rope_theta=10000.0,
              eos_token_id=0),
    small=dict(model_type="deepseek_v2", vocab_size=256, hidden_size=32, intermediate_size=48, moe_intermediate_size=16,
               num_hidden_layers=1, num_attention_heads=2, q_lora_rank=None, kv_lora_rank=8, qk_nope_head_dim=8,
               qk_rope_head_dim=8, v_head_dim=8, n_routed_experts=4, n_shared_experts=1, num_experts_per_tok=2),
)
ARGS = dict(MLA, model_type="deepseek_v2", vocab_size=256, hidden_size=64, intermediate_size=96,
            moe_intermediate_size=16, num_hidden_layers=2, num_attention_heads=4, q_lora_rank=None,
            n_routed_experts=8, num_experts_per_tok=2, first_k_dense_replace=1, max_position_embeddings=64)
YARN = {"factor": 4.0, "mscale": 0.707, "mscale_all_dim": 0.707, "original_max_position_embeddings": 16}


class TestDeepseekV2(FamilyChecks):
    family = FAMILY


# --- the MoE block --------------------------------------------------------------------------


def softmax_group_top_k(block: MoE) -> Callable[[np.ndarray], List[Tuple[int, float]]]:
    """DeepSeek-V2's router as its paper and transformers write it, for naive_moe: softmax
    probabilities; with group_limited_greedy only the topk_group groups of the highest
    single probability compete; the k most probable experts, weighted by their
    probabilities (never renormalised) times routed_scaling_factor."""
    a, weight = block.args, np.array(block.gate.weight, dtype=np.float64)

    def choose(x: np.ndarray) -> List[Tuple[int, float]]:
        p = np_softmax(weight @ x)
        if a.topk_method == "group_limited_greedy":
            grouped = p.reshape(a.n_group, -1).copy()
            grouped[np.argsort(-grouped.max(-1))[a.topk_group:]] = 0.0  # the groups not kept
            p = grouped.reshape(-1)
        best = np.argsort(-p)[: a.num_experts_per_tok]
        return list(zip(best, p[best] * a.routed_scaling_factor))

    return choose


def np_mlp(mlp: MLP) -> Callable[[np.ndarray], np.ndarray]:
    """A SwiGLU with optional biases in float64, for one token (H,)."""
    w = {name: np.array(getattr(mlp, name).weight, dtype=np.float64) for name in ("gate_proj", "up_proj", "down_proj")}
    b = {name: np.array(getattr(mlp, name).bias, dtype=np.float64) if "bias" in getattr(mlp, name) else 0.0
         for name in w}

    def apply(x: np.ndarray) -> np.ndarray:
        g, u = w["gate_proj"] @ x + b["gate_proj"], w["up_proj"] @ x + b["up_proj"]
        return w["down_proj"] @ (g / (1 + np.exp(-g)) * u) + b["down_proj"]

    return apply


@pytest.mark.parametrize("name", FAMILY.fixtures)
def test_moe_block_equals_a_naive_loop(name):
    block = fixture_model(name).layers[1].mlp
    assert_block_equals_naive(block, softmax_group_top_k(block), 64, shared=np_mlp(block.shared_experts))


def test_np_mlp_without_biases_is_the_plain_swiglu():
    shared = fixture_model("deepseek_v2_tf4").layers[1].mlp.shared_experts
    x = np.random.default_rng(0).standard_normal(64)
    weights = [np.array(getattr(shared, n).weight, dtype=np.float64) for n in ("gate_proj", "up_proj", "down_proj")]
    np.testing.assert_allclose(np_mlp(shared)(x), np_swiglu(x, *weights))


def test_moe_layers_follow_first_k_dense_replace_and_moe_layer_freq():
    args = ModelArgs.from_dict(dict(ARGS, num_hidden_layers=6, first_k_dense_replace=1, moe_layer_freq=2))
    assert [args.is_moe_layer(i) for i in range(6)] == [False, False, True, False, True, False]
    tf4 = fixture_model("deepseek_v2_tf4")
    assert [type(layer.mlp) for layer in tf4.layers] == [MLP, MoE]


@pytest.mark.parametrize("name, override", [
    ("deepseek_v2_tf4", {"rope_scaling": None}),  # plain rope, unscaled softmax
    ("deepseek_v2_tf4", {"routed_scaling_factor": 2.0}),
    ("deepseek_v2_tf5", {"topk_method": "greedy"}),  # every group competes: other experts win
    ("deepseek_v2_tf5", {"rope_parameters": {"rope_type": "default", "rope_theta": 10000.0}}),
])
def test_the_fixtures_depend_on_the_router_and_rope_features(name, override):
    assert_override_matters(name, override)


def test_the_fixtures_cover_biases_and_both_query_paths():
    tf4, tf5 = fixture_model("deepseek_v2_tf4"), fixture_model("deepseek_v2_tf5")
    assert "q_proj" in tf4.layers[0].self_attn and "q_a_proj" in tf5.layers[0].self_attn
    assert "bias" in tf5.layers[0].mlp.down_proj and "bias" in tf5.layers[1].mlp.shared_experts.up_proj
    assert "bias" in tf5.layers[0].self_attn.o_proj and "bias" not in tf4.layers[0].self_attn.o_proj


def test_quantization_keeps_kv_b_proj_and_the_router_float():
    model, config = load_model(FIXTURES / "deepseek_v2_tf5")
    quantize_model(model, config, 32, 8)
    attn, moe = model.layers[1].self_attn, model.layers[1].mlp
    assert "scales" not in attn.kv_b_proj and "scales" in attn.o_proj and "scales" in moe.switch_mlp.up_proj
    assert moe.gate.weight.dtype == mx.float32
    assert mx.isfinite(model(PROMPT[None])).all().item()


# --- config ---------------------------------------------------------------------------------


def test_config_dialects_give_the_same_args():
    tf4 = ModelArgs.from_dict(dict(ARGS, rope_theta=1e4, rope_scaling=dict(YARN, type="yarn"), moe_layer_freq=1,
                                   scoring_func="softmax", n_group=1, topk_group=1))
    tf5 = ModelArgs.from_dict(dict(ARGS, rope_parameters=dict(YARN, rope_type="yarn", rope_theta=1e4), head_dim=8,
                                   qk_head_dim=24, n_group=None, topk_group=None))
    for field in ("rope_theta", "rope_scaling", "rope_traditional", "first_k_dense_replace", "topk_method"):
        assert getattr(tf4, field) == getattr(tf5, field), field


@pytest.mark.parametrize("override, message", [
    ({"num_experts_per_tok": None}, "deepseek_v2 configs must give num_experts_per_tok"),
    ({"num_experts_per_tok": 9}, r"num_experts_per_tok \(9\) must be in 1..n_routed_experts \(8\)"),
    ({"topk_method": "noaux_tc"}, "topk_method 'noaux_tc' is not supported"),
    ({"topk_method": "group_limited_greedy", "n_group": 3, "topk_group": 1}, r"n_group \(3\) must divide"),
    ({"topk_method": "group_limited_greedy", "n_group": 2}, r"topk_group \(None\) must be in 1..n_group \(2\)"),
    ({"norm_topk_prob": True}, "norm_topk_prob True is not supported"),
    ({"scoring_func": "sigmoid"}, "scoring_func 'sigmoid' is not supported"),
    ({"num_key_value_heads": 1}, r"num_key_value_heads \(1\) must equal num_attention_heads \(4\)"),
    ({"moe_layer_freq": 0}, r"moe_layer_freq \(0\) must be >= 1"),
    ({"rope_parameters": {"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 0.5}},
     "partial_rotary_factor 0.5 is not supported"),
])
def test_config_errors_name_the_value(override, message):
    with pytest.raises(ValueError, match=message):
        ModelArgs.from_dict(dict(ARGS, **override))


# --- sanitize -------------------------------------------------------------------------------


def test_sanitize_takes_every_layout_once():
    assert_sanitize_layouts(FAMILY.fixtures, fused_mlp_experts)
