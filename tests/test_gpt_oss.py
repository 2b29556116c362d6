"""gpt_oss.py against transformers, through both cache kinds, and its MXFP4 loading.

Fixtures come from fixtures/make_gpt_oss_reference.py: tiny random gpt-oss checkpoints
saved by transformers (sliding window 8, 30 tokens, so every window edge is crossed
three times), gpt_oss_tf4 in the transformers-4 config dialect with the default layer
alternation, gpt_oss_tf5 in the transformers-5 dialect with an explicit pattern, and
MXFP4 expert blocks with transformers' own dequantization of them.
"""

import json

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from conftest import FIXTURES
from mlx.utils import tree_flatten

from mlx_lm.models.cache import KVCache, RotatingKVCache
from mlx_lm.models.gpt_oss import (
    FULL,
    SLIDING,
    Model,
    ModelArgs,
    clamped_swiglu,
    deinterleave,
    mxfp4_blocks_as_weight,
    route,
)
from mlx_lm.models.switch_layers import QuantizedSwitchLinear, SwitchLinear
from mlx_lm.utils import load_model

FIXTURE_NAMES = ["gpt_oss_tf4", "gpt_oss_tf5"]
TOLERANCE = 1e-4  # fp32 on both sides


def relative_error(got: mx.array, want: mx.array) -> float:
    return (mx.abs(got - want).max() / mx.abs(want).max()).item()


def load_fixture(name):
    model, _ = load_model(FIXTURES / name)
    reference = mx.load(str(FIXTURES / name / "reference.safetensors"))
    return model, reference["input_ids"], reference["logits"]


def decode_in_chunks(model, ids: mx.array, chunk: int) -> mx.array:
    cache = model.make_cache()
    pieces = [model(ids[:, i : i + chunk], cache=cache) for i in range(0, ids.shape[1], chunk)]
    assert all(c.offset == ids.shape[1] for c in cache)
    return mx.concatenate(pieces, axis=1)


# --- against transformers -------------------------------------------------------------


@pytest.mark.parametrize("name", FIXTURE_NAMES)
def test_full_forward_matches_transformers(name):
    model, ids, want = load_fixture(name)
    assert ids.shape[1] >= 3 * model.args.sliding_window
    assert relative_error(model(ids), want) < TOLERANCE


@pytest.mark.parametrize("name", FIXTURE_NAMES)
@pytest.mark.parametrize("chunk", [1, 5, 30])
def test_cached_decode_matches_transformers(name, chunk):
    """Token by token (ring-buffer writes, no mask), chunks of 5 that straddle the window
    edges at 8, 16 and 24 like a speculative verify step, and one 30-token prefill."""
    model, ids, want = load_fixture(name)
    assert relative_error(decode_in_chunks(model, ids, chunk), want) < TOLERANCE


@pytest.mark.parametrize("name", FIXTURE_NAMES)
def test_fixture_exercises_every_feature(name):
    """Without the clamp, the window, the sinks or yarn the logits are far off, so the
    tests above do check each of them."""
    model, ids, want = load_fixture(name)
    for override in ({"swiglu_limit": 1e9}, {"sliding_window": 1000},
                     {"rope_scaling": {"rope_type": "default"}, "rope_parameters": None}):
        changed, _ = load_model(FIXTURES / name, model_config=override)
        assert relative_error(changed(ids), want) > 1e-2, override
    for layer in model.layers:
        layer.self_attn.sinks = mx.zeros_like(layer.self_attn.sinks)
    assert relative_error(model(ids), want) > 1e-2


def test_layer_types_and_caches():
    tf4, _ = load_model(FIXTURES / "gpt_oss_tf4")  # no layer_types: alternate from sliding
    assert tf4.args.layer_types == [SLIDING, FULL, SLIDING, FULL]
    tf5, _ = load_model(FIXTURES / "gpt_oss_tf5")
    assert tf5.args.layer_types == [FULL, SLIDING, SLIDING, FULL]
    cache = tf5.make_cache()
    assert [type(c) for c in cache] == [KVCache, RotatingKVCache, RotatingKVCache, KVCache]
    assert all(c.max_size == 8 and c.keep == 0 for c in cache[1:3])


# --- config ---------------------------------------------------------------------------


def test_rope_dialects_agree():
    yarn = {"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0,
            "truncate": False, "original_max_position_embeddings": 4096}
    tf4 = ModelArgs(rope_theta=150000.0, rope_scaling=dict(yarn))
    tf5 = ModelArgs(rope_parameters=dict(yarn, rope_theta=150000.0))
    default = ModelArgs()  # as transformers' GptOssConfig: yarn when no rope is named
    for args in (tf5, default):
        assert (args.rope_theta, args.rope_scaling) == (tf4.rope_theta, tf4.rope_scaling)
    legacy = ModelArgs(rope_theta=150000.0, rope_scaling=dict(yarn, type="yarn"))
    assert legacy.rope_scaling["rope_type"] == "yarn"


def test_config_errors_name_the_value():
    with pytest.raises(ValueError, match="3 entries but num_hidden_layers is 4"):
        ModelArgs(num_hidden_layers=4, layer_types=[SLIDING, FULL, SLIDING])
    with pytest.raises(ValueError, match="chunked_attention"):
        ModelArgs(num_hidden_layers=2, layer_types=[SLIDING, "chunked_attention"])
    with pytest.raises(ValueError, match="'bitsandbytes'"):
        ModelArgs(quantization_config={"quant_method": "bitsandbytes"})


def test_mxfp4_only_when_not_mlx_converted():
    mxfp4 = {"quant_method": "mxfp4"}
    assert ModelArgs(quantization_config=mxfp4).mxfp4_experts
    assert not ModelArgs(quantization_config=mxfp4, quantization={"group_size": 64, "bits": 4}).mxfp4_experts
    assert not ModelArgs().mxfp4_experts


# --- pure helpers against naive references ---------------------------------------------


def test_clamped_swiglu():
    rng = np.random.default_rng(0)
    up, gate = rng.normal(0, 6, (2, 3, 16)).astype(np.float32), rng.normal(0, 6, (2, 3, 16)).astype(np.float32)
    g, u = np.minimum(gate, 7.0), np.clip(up, -7.0, 7.0)
    want = g / (1 + np.exp(-1.702 * g)) * (u + 1)
    got = clamped_swiglu(mx.array(up), mx.array(gate))
    np.testing.assert_allclose(np.array(got), want, rtol=1e-5, atol=1e-5)


def test_route_is_softmax_over_top_k():
    rng = np.random.default_rng(1)
    logits = rng.normal(size=(2, 5, 8)).astype(np.float32)
    indices, weights = route(mx.array(logits), 3)
    for row, idx, w in zip(logits.reshape(-1, 8), np.array(indices).reshape(-1, 3), np.array(weights).reshape(-1, 3)):
        assert sorted(idx) == sorted(np.argsort(-row)[:3])
        chosen = np.exp(row[idx] - row[idx].max())
        np.testing.assert_allclose(w, chosen / chosen.sum(), rtol=1e-5)


def test_deinterleave():
    x = mx.arange(24).reshape(2, 6, 2)
    even, odd = deinterleave(x, axis=1)
    assert mx.array_equal(even, x[:, [0, 2, 4]]) and mx.array_equal(odd, x[:, [1, 3, 5]])


# --- weights: sanitize and MXFP4 -------------------------------------------------------


def assert_same_weights(a, b):
    assert a.keys() == b.keys()
    assert all(a[k].dtype == b[k].dtype and mx.array_equal(a[k], b[k]) for k in a)


def test_sanitize_splits_interleaved_gate_up():
    model, _ = load_model(FIXTURES / "gpt_oss_tf5")
    raw = mx.load(str(FIXTURES / "gpt_oss_tf5" / "model.safetensors"))
    stem = "model.layers.2.mlp.experts."
    fused, fused_bias = raw[stem + "gate_up_proj"], raw[stem + "gate_up_proj_bias"]  # (E, H, 2I), (E, 2I)
    weights = model.sanitize(raw)
    assert mx.array_equal(weights[stem + "gate_proj.weight"][1, 3], fused[1, :, 6])
    assert mx.array_equal(weights[stem + "up_proj.weight"][1, 3], fused[1, :, 7])
    assert mx.array_equal(weights[stem + "up_proj.bias"][2, 5], fused_bias[2, 11])
    assert mx.array_equal(weights[stem + "down_proj.weight"][0], raw[stem + "down_proj"][0].T)
    assert not any(k.endswith(("gate_up_proj", "down_proj", "_bias")) for k in weights)


def test_sanitize_is_idempotent():
    """On raw transformers weights, raw MXFP4 ones (quantized and dequantizing model),
    and on MLX-converted ones, float and quantized."""
    model, _ = load_model(FIXTURES / "gpt_oss_tf4")
    raw = mx.load(str(FIXTURES / "gpt_oss_tf4" / "model.safetensors"))
    once = model.sanitize(raw)
    assert_same_weights(model.sanitize(once), once)
    converted = dict(tree_flatten(model.parameters()))
    assert_same_weights(model.sanitize(converted), converted)
    model = quantized_float_model()
    quantized = dict(tree_flatten(model.parameters()))
    assert "model.layers.0.mlp.experts.gate_proj.scales" in quantized
    assert_same_weights(model.sanitize(quantized), quantized)
    for quantization_config in ({"quant_method": "mxfp4"}, None):
        mxfp4_model = Model(ModelArgs.from_dict(dict(MXFP4_CONFIG, quantization_config=quantization_config)))
        once = mxfp4_model.sanitize(mxfp4_checkpoint(MXFP4_CONFIG, "blocks"))
        assert_same_weights(mxfp4_model.sanitize(once), once)


def quantized_float_model():
    """A float model (the MXFP4 test sizes, whose dims suit every group size), quantized
    as an MLX converter does: 4 bits, group 32, through quant_predicate."""
    model = Model(ModelArgs.from_dict(dict(MXFP4_CONFIG, quantization_config=None)))
    quantizable = (nn.Linear, nn.Embedding, SwitchLinear)
    nn.quantize(model, 32, 4, class_predicate=lambda p, m: isinstance(m, quantizable) and model.quant_predicate(p, m))
    return model


def test_quant_predicate_keeps_router_at_8_bits():
    model = quantized_float_model()
    router, expert = model.layers[0].mlp.router, model.layers[0].mlp.experts.up_proj
    assert (router.bits, router.group_size) == (8, 64)
    assert (expert.bits, expert.group_size) == (4, 32)


MXFP4_REFERENCE = FIXTURES / "gpt_oss_tf4" / "mxfp4_reference.safetensors"
MXFP4_CONFIG = dict(
    model_type="gpt_oss", vocab_size=256, hidden_size=64, intermediate_size=32, num_hidden_layers=2,
    num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_local_experts=4,
    num_experts_per_tok=2, sliding_window=8, rope_parameters={"rope_type": "default", "rope_theta": 1e4},
    quantization_config={"quant_method": "mxfp4", "modules_to_not_convert": ["model.layers.*.self_attn",
                         "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]},
)


def test_mxfp4_blocks_are_mlx_mxfp4():
    """Our view of the blocks, dequantized by MLX, equals transformers' dequantization,
    bit for bit: same nibble order, same e8m0 bias."""
    reference = mx.load(str(MXFP4_REFERENCE))
    for proj in ("gate_up_proj", "down_proj"):
        weight = mxfp4_blocks_as_weight(reference[f"{proj}_blocks"])
        ours = mx.dequantize(weight, reference[f"{proj}_scales"], group_size=32, bits=4, mode="mxfp4", dtype=mx.float32)
        assert mx.array_equal(ours.swapaxes(1, 2), reference[f"{proj}_dequantized"].astype(mx.float32))


def mxfp4_checkpoint(config, layout: str):
    """Random non-expert weights plus the reference experts (rolled per layer), the
    experts as MXFP4 `blocks` or as transformers' dequantized float `gate_up_proj`."""
    rng = np.random.default_rng(7)
    float_model = Model(ModelArgs.from_dict(dict(config, quantization_config=None)))
    weights = {
        k: mx.array(rng.normal(0, 0.5, v.shape).astype(np.float32))
        for k, v in tree_flatten(float_model.parameters())
        if ".mlp.experts." not in k
    }
    reference = mx.load(str(MXFP4_REFERENCE))
    for i in range(config["num_hidden_layers"]):
        stem = f"model.layers.{i}.mlp.experts."
        for proj, out_dims in (("gate_up_proj", 2 * config["intermediate_size"]), ("down_proj", config["hidden_size"])):
            if layout == "blocks":
                weights[f"{stem}{proj}_blocks"] = mx.roll(reference[f"{proj}_blocks"], i, axis=0)
                weights[f"{stem}{proj}_scales"] = mx.roll(reference[f"{proj}_scales"], i, axis=0)
            else:
                weights[stem + proj] = mx.roll(reference[f"{proj}_dequantized"], i, axis=0).astype(mx.float32)
            weights[f"{stem}{proj}_bias"] = mx.array(rng.normal(0, 0.2, (4, out_dims)).astype(np.float32))
    return weights


def write_checkpoint(directory, config, weights):
    directory.mkdir()
    (directory / "config.json").write_text(json.dumps(config))
    mx.save_safetensors(str(directory / "model.safetensors"), weights)
    return directory


def test_mxfp4_checkpoint_matches_its_dequantized_float_version(tmp_path):
    float_config = {k: v for k, v in MXFP4_CONFIG.items() if k != "quantization_config"}
    blocks_dir = write_checkpoint(tmp_path / "mxfp4", MXFP4_CONFIG, mxfp4_checkpoint(MXFP4_CONFIG, "blocks"))
    float_dir = write_checkpoint(tmp_path / "float", float_config, mxfp4_checkpoint(MXFP4_CONFIG, "float"))
    quantized, _ = load_model(blocks_dir)
    experts = quantized.layers[1].mlp.experts
    assert all(type(p) is QuantizedSwitchLinear and p.mode == "mxfp4" for p in (experts.gate_proj, experts.down_proj))
    assert experts.up_proj.bias.dtype == mx.float32
    reference, _ = load_model(float_dir)
    assert type(reference.layers[1].mlp.experts.gate_proj) is SwitchLinear
    # Without quantization_config the same blocks are dequantized into float experts.
    dequantized, _ = load_model(blocks_dir, model_config={"quantization_config": None})
    assert type(dequantized.layers[1].mlp.experts.gate_proj) is SwitchLinear
    ids = mx.array(np.random.default_rng(3).integers(0, 256, (1, 20)))
    want = reference(ids)
    assert relative_error(quantized(ids), want) < TOLERANCE
    assert relative_error(dequantized(ids), want) < TOLERANCE
    assert relative_error(decode_in_chunks(quantized, ids, 5), want) < TOLERANCE
