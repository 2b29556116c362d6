"""granitemoehybrid.py: the shared family checks (family_checks.py) on the Granite 4.0-H
fixtures, plus its expert mixture against a naive loop, its config dialects and errors,
and its weight layouts.

Fixtures (tests/fixtures/make_mamba2_reference.py, 80 tokens, past the 64-token chunk
of ssm.py), every multiplier away from 1: `granitemoehybrid_tf5` as transformers 5
writes it (layer_types linear_attention / full_attention, rope_parameters, no experts,
4 Mamba groups); `granitemoehybrid_tf4` in the hub's dialect (layer_types mamba /
attention, position_embedding_type "nope", top-level rope_theta, 4 experts top-2 in the
hub's fused layout, tied embeddings).
"""

import json

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from family_checks import FIXTURES, Family, FamilyChecks, fixture_model, fresh_model
from mlx.utils import tree_flatten

from mlx_lm.models.cache import ArraysCache, KVCache, make_prompt_cache
from mlx_lm.models.granitemoehybrid import ModelArgs, NoPositions

FAMILY = Family(
    fixtures=["granitemoehybrid_tf5", "granitemoehybrid_tf4"],
    tiny=dict(model_type="granitemoehybrid", vocab_size=512, hidden_size=64, intermediate_size=32,
              shared_intermediate_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
              layer_types=["mamba", "attention"], num_local_experts=4, num_experts_per_tok=2,
              position_embedding_type="rope", rope_theta=10000.0, mamba_n_heads=8, mamba_n_groups=2,
              mamba_d_state=8, mamba_expand=1, embedding_multiplier=2.0, attention_multiplier=0.2,
              residual_multiplier=0.7, logits_scaling=1.7, tie_word_embeddings=True),
    small=dict(model_type="granitemoehybrid", vocab_size=256, hidden_size=32, intermediate_size=16,
               shared_intermediate_size=32, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
               layer_types=["mamba", "attention"], num_local_experts=0, position_embedding_type="nope",
               mamba_n_heads=4, mamba_n_groups=1, mamba_d_state=8, mamba_expand=1, attention_multiplier=0.25),
)


class TestGraniteMoeHybrid(FamilyChecks):
    family = FAMILY


ARGS = dict(FAMILY.small, num_local_experts=4, num_experts_per_tok=2)


def raw_weights(name):
    return mx.load(str(FIXTURES / name / "model.safetensors"))


def assert_same(a, b):
    assert a.keys() == b.keys()
    for k in a:
        assert a[k].shape == b[k].shape and mx.array_equal(a[k], b[k]), k


def test_moe_matches_a_naive_loop():
    """Softmax over the top-k router logits, SwiGLU experts (gate first in the fused
    input_linear), their weighted sum: transformers' formula, token by token."""
    raw = raw_weights("granitemoehybrid_tf4")
    moe = fixture_model("granitemoehybrid_tf4").layers[1].block_sparse_moe
    prefix = "model.layers.1.block_sparse_moe."
    router = np.array(raw[prefix + "router.layer.weight"])
    gate_up, down = np.array(raw[prefix + "input_linear.weight"]), np.array(raw[prefix + "output_linear.weight"])
    x = np.random.default_rng(0).standard_normal((1, 6, 64)).astype(np.float32)
    want = np.zeros_like(x)
    for t in range(6):
        logits = router @ x[0, t]
        top = np.argsort(-logits)[:2]
        weights = np.exp(logits[top] - logits[top].max())
        for e, w in zip(top, weights / weights.sum()):
            gate, up = np.split(gate_up[e] @ x[0, t], 2)
            want[0, t] += w * (down[e] @ (gate / (1 + np.exp(-gate)) * up))
    got = np.array(moe(mx.array(x)))
    assert np.abs(got - want).max() / np.abs(want).max() < 1e-5


def test_config_dialects_normalise_alike():
    """The hub's keys and transformers 5's give the same model: layer kinds by either
    name and field, rope_theta at the top or in rope_parameters, both infinities."""
    tf4 = json.loads((FIXTURES / "granitemoehybrid_tf4" / "config.json").read_text())
    assert tf4["layer_types"] == ["mamba", "mamba", "attention"] and "rope_parameters" not in tf4
    tf5 = dict(tf4, layer_types=["linear_attention", "linear_attention", "full_attention"],
               rope_parameters={"rope_type": "default", "rope_theta": tf4["rope_theta"]},
               time_step_limit=[0.0, {"__float__": "Infinity"}])
    del tf5["rope_theta"], tf5["rope_scaling"]
    alias = {("layers_block_type" if k == "layer_types" else k): v for k, v in tf4.items()}
    args = [ModelArgs.from_dict(c) for c in (tf4, tf5, alias)]
    for a in args:
        assert a.layer_types == ["linear_attention", "linear_attention", "full_attention"]
        assert (a.rope_theta, a.rope_scaling, a.time_step_limit) == (10000.0, None, (0.0, float("inf")))
        assert a.mamba_shape == args[0].mamba_shape and a.head_dim == 16 and a.mamba_d_head == 8
    default = ModelArgs.from_dict(dict(ARGS, layer_types=None))
    assert default.layer_types == ["linear_attention"] * 2  # transformers' default: all Mamba-2


def test_config_errors_name_the_value():
    with pytest.raises(ValueError, match="layer_types has unknown kinds \\['conv'\\]"):
        ModelArgs.from_dict(dict(ARGS, layer_types=["mamba", "conv"]))
    with pytest.raises(ValueError, match="layer_types has 3 entries but num_hidden_layers is 2"):
        ModelArgs.from_dict(dict(ARGS, layer_types=["mamba"] * 3))
    with pytest.raises(ValueError, match="layers_block_type .* disagree"):
        ModelArgs.from_dict(dict(ARGS, layers_block_type=["attention", "attention"]))
    with pytest.raises(ValueError, match="position_embedding_type 'alibi' is not one of"):
        ModelArgs.from_dict(dict(ARGS, position_embedding_type="alibi"))
    with pytest.raises(ValueError, match=r"mamba_d_head \(16\) x mamba_n_heads \(4\) must equal mamba_expand"):
        ModelArgs.from_dict(dict(ARGS, mamba_d_head=16))
    with pytest.raises(ValueError, match=r"mamba_n_heads \(4\) must be a multiple of mamba_n_groups \(3\)"):
        ModelArgs.from_dict(dict(ARGS, mamba_n_groups=3))
    with pytest.raises(ValueError, match=r"num_experts_per_tok \(5\) must be in 1..num_local_experts \(4\)"):
        ModelArgs.from_dict(dict(ARGS, num_experts_per_tok=5))
    with pytest.raises(ValueError, match="mamba_d_conv must be >= 2, got 1"):
        ModelArgs.from_dict(dict(ARGS, mamba_d_conv=1))


@pytest.mark.parametrize("name", FAMILY.fixtures)
def test_sanitize_is_idempotent(name):
    model = fixture_model(name)
    once = model.sanitize(raw_weights(name))
    assert_same(model.sanitize(dict(once)), once)
    model.load_weights(list(once.items()))  # every parameter, each shape as the model has it


def test_sanitize_converts_the_hub_and_transformers_layouts_once():
    name = "granitemoehybrid_tf4"
    model, raw = fixture_model(name), raw_weights(name)
    once = model.sanitize(dict(raw, **{"lm_head.weight": raw["model.embed_tokens.weight"]}))
    assert "lm_head.weight" not in once  # tied
    prefix = "model.layers.0.block_sparse_moe."
    fused = raw[prefix + "input_linear.weight"]  # (E, 2I, D)
    assert mx.array_equal(once[prefix + "switch_mlp.gate_proj.weight"], fused[:, :16])
    assert mx.array_equal(once[prefix + "switch_mlp.up_proj.weight"], fused[:, 16:])
    conv = "model.layers.0.mamba.conv1d.weight"
    assert raw[conv].shape == (96, 1, 4) and once[conv].shape == (96, 4, 1)
    # transformers 5 in memory: experts.gate_up_proj / experts.down_proj, router.weight.
    renames = {"input_linear.weight": "experts.gate_up_proj", "output_linear.weight": "experts.down_proj",
               "router.layer.weight": "router.weight"}
    in_memory = {}
    for key, value in raw.items():
        for old, new in renames.items():
            key = key.replace("block_sparse_moe." + old, "block_sparse_moe." + new)
        in_memory[key] = value
    assert_same(model.sanitize(in_memory), model.sanitize(raw))


def test_layers_caches_and_positions_follow_the_config():
    hub, tf5 = fixture_model("granitemoehybrid_tf4"), fixture_model("granitemoehybrid_tf5")
    assert [type(c) for c in make_prompt_cache(hub)] == [ArraysCache, ArraysCache, KVCache]
    assert [type(c) for c in make_prompt_cache(tf5)] == [ArraysCache, KVCache, ArraysCache]
    assert isinstance(hub.layers[2].self_attn.rope, NoPositions)  # "nope"
    assert isinstance(tf5.layers[1].self_attn.rope, nn.RoPE) and tf5.layers[1].self_attn.rope.base == 5000.0
    assert all("block_sparse_moe" in layer for layer in hub.layers)
    assert not any("block_sparse_moe" in layer for layer in tf5.layers)  # num_local_experts 0
    assert tf5.layers[0].mamba.norm.group_size == 16  # 64 channels in 4 groups


def test_checkpoints_converted_by_upstream_load():
    """Upstream mlx-lm converts a dense Granite's shared_mlp to mlp.gate_proj / up_proj /
    down_proj (float or quantized) and quantizes the router as a Linear (8 bits, groups
    of 64): both read back into our layout."""
    dense = fixture_model("granitemoehybrid_tf5")
    ours = dict(tree_flatten(dense.parameters()))
    for params in (ours, quantized_weights("granitemoehybrid_tf5")):
        upstream = {}
        for key, value in params.items():
            if ".shared_mlp.input_linear." in key:
                gate, up = mx.split(value, 2, axis=0)
                upstream[key.replace("shared_mlp.input_linear", "mlp.gate_proj")] = gate
                upstream[key.replace("shared_mlp.input_linear", "mlp.up_proj")] = up
            else:
                upstream[key.replace("shared_mlp.output_linear", "mlp.down_proj")] = value
        assert_same(dense.sanitize(upstream), params)
    moe = fixture_model("granitemoehybrid_tf4")
    weights = dict(tree_flatten(moe.parameters()))
    router = "model.layers.1.block_sparse_moe.router"
    packed = mx.quantize(weights.pop(router + ".weight"), group_size=64, bits=8)
    weights.update({f"{router}.layer.{part}": v for part, v in zip(("weight", "scales", "biases"), packed)})
    loaded = moe.sanitize(weights)
    assert mx.array_equal(loaded[router + ".weight"], mx.dequantize(*packed, group_size=64, bits=8))
    assert not any(k.startswith(router + ".layer") for k in loaded)


def quantized_weights(name):
    model = fresh_model(name)
    nn.quantize(model, group_size=32, bits=8)
    return dict(tree_flatten(model.parameters()))
