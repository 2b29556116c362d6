"""ernie4_5_moe.py (ERNIE 4.5 MoE): the shared family checks (family_checks.py) on the
transformers fixtures, plus what only this family has: the MoE block (softmax chosen
through the correction bias, renormalised, plus shared experts) against a naive
per-token loop, the layer pattern, the lm_head bias when tied, the config dialects and
errors, and sanitize on every layout (MTP weights dropped). Two-rank sharding of
FAMILY.tiny is in test_distributed.py.

Fixtures come from fixtures/make_ernie4_5_moe_reference.py: ernie4_5_moe_tf4 (hub
dialect, a dense first layer, a shared expert, biases, tied) and ernie4_5_moe_tf5 (as
transformers 5 saves it, every other layer MoE, no shared expert, untied).
"""

import mlx.core as mx
import numpy as np
import pytest
from checkpoints import VOCAB_SIZE
from family_checks import FIXTURES, Family, FamilyChecks, fixture_model, reference, relative_error
from moe_checks import assert_block_equals_naive, assert_sanitize_layouts, fused_mlp_experts, np_softmax
from sliding_checks import assert_override_matters

from mlx_lm.models.ernie4_5_moe import ModelArgs, OutputBias, SparseMoeBlock
from mlx_lm.utils import load_model

MOE = dict(moe_num_experts=4, moe_k=2, moe_intermediate_size=32, moe_num_shared_experts=1)
FAMILY = Family(
    fixtures=["ernie4_5_moe_tf4", "ernie4_5_moe_tf5"],
    tiny=dict(MOE, model_type="ernie4_5_moe", hidden_size=64, intermediate_size=128, num_hidden_layers=2,
              num_attention_heads=4, num_key_value_heads=2, head_dim=16, vocab_size=VOCAB_SIZE, use_bias=True,
              tie_word_embeddings=False, eos_token_id=0),
    small=dict(MOE, model_type="ernie4_5_moe", hidden_size=32, intermediate_size=48, num_hidden_layers=1,
               num_attention_heads=2, num_key_value_heads=1, head_dim=16, moe_layer_start_index=0,
               vocab_size=256),
)
ARGS = dict(MOE, model_type="ernie4_5_moe", hidden_size=64, intermediate_size=96, num_hidden_layers=3,
            num_attention_heads=4, num_key_value_heads=2, head_dim=16, vocab_size=256)


class TestErnie4_5Moe(FamilyChecks):
    family = FAMILY


@pytest.mark.parametrize("name", FAMILY.fixtures)
def test_moe_block_equals_a_naive_loop(name):
    model = fixture_model(name)
    block = next(layer.mlp for layer in model.layers if isinstance(layer.mlp, SparseMoeBlock))
    router = np.array(block.gate.weight, dtype=np.float64)
    bias = np.array(block.moe_statics.e_score_correction_bias[0], dtype=np.float64)

    def choose(x):
        p = np_softmax(router @ x)
        best = np.argsort(-(p + bias))[:2]
        return list(zip(best, p[best] / p[best].sum()))

    shared = None
    if "shared_experts" in block:
        mlp = block.shared_experts
        w = {n: np.array(getattr(mlp, n).weight, dtype=np.float64) for n in ("gate_proj", "up_proj", "down_proj")}
        b = {n: np.array(getattr(mlp, n).bias, dtype=np.float64) for n in ("gate_proj", "up_proj", "down_proj")}

        def shared(x):
            g, u = w["gate_proj"] @ x + b["gate_proj"], w["up_proj"] @ x + b["up_proj"]
            return w["down_proj"] @ (g / (1 + np.exp(-g)) * u) + b["down_proj"]

    assert_block_equals_naive(block, choose, 64, shared=shared)


def test_moe_layers_follow_start_interval_and_end():
    kinds = lambda name: [isinstance(layer.mlp, SparseMoeBlock) for layer in fixture_model(name).layers]  # noqa: E731
    assert kinds("ernie4_5_moe_tf4") == [False, True, True]
    assert kinds("ernie4_5_moe_tf5") == [False, True]
    args = ModelArgs.from_dict(dict(ARGS, moe_layer_start_index=0, moe_layer_end_index=1))
    assert [args.is_moe_layer(i) for i in range(3)] == [True, True, False]


def test_the_correction_bias_and_the_tied_output_bias_matter():
    tf4 = fixture_model("ernie4_5_moe_tf4")
    assert isinstance(tf4.lm_head, OutputBias) and tf4.args.tie_word_embeddings
    model, _ = load_model(FIXTURES / "ernie4_5_moe_tf5")
    for layer in model.layers[1:]:
        layer.mlp.moe_statics.e_score_correction_bias = mx.zeros_like(layer.mlp.moe_statics.e_score_correction_bias)
    ids, want = reference("ernie4_5_moe_tf5")
    assert relative_error(model(ids), want) > 1e-2
    assert_override_matters("ernie4_5_moe_tf5", {"moe_k": 1})


def test_config_dialects_give_the_same_args():
    tf4 = ModelArgs.from_dict(dict(ARGS, rope_theta=5e5))
    tf5 = ModelArgs.from_dict(dict(ARGS, rope_parameters={"rope_type": "default", "rope_theta": 5e5}))
    for field in ("rope_theta", "rope_scaling", "moe_layer_end_index", "moe_num_experts"):
        assert getattr(tf4, field) == getattr(tf5, field), field
    assert tf4.moe_layer_end_index == 2  # -1: the last layer


@pytest.mark.parametrize("override, message", [
    ({"moe_k": 5}, r"moe_k \(5\) must be in 1..moe_num_experts \(4\)"),
    ({"moe_layer_interval": 0}, "moe_layer_interval must be >= 1, got 0"),
    ({"num_key_value_heads": 3}, r"\(3\)"),
])
def test_config_errors_name_the_value(override, message):
    with pytest.raises(ValueError, match=message):
        ModelArgs.from_dict(dict(ARGS, **override))


def in_memory(weights):
    """transformers 5's in-memory layout: experts fused, the bias under the router."""
    fused = fused_mlp_experts(weights)
    return {k.replace(".mlp.moe_statics.", ".mlp.gate.moe_statics."): v for k, v in fused.items()}


def test_sanitize_takes_every_layout_once_and_drops_mtp():
    assert_sanitize_layouts(FAMILY.fixtures, in_memory)
    model = fixture_model("ernie4_5_moe_tf5")
    raw = mx.load(str(FIXTURES / "ernie4_5_moe_tf5" / "model.safetensors"))
    extra = {"model.mtp_block.0.input_layernorm.weight": mx.ones((64,)), "model.mtp_emb_norm.0.weight": mx.ones((64,))}
    assert model.sanitize(dict(raw, **extra)).keys() == model.sanitize(raw).keys()
