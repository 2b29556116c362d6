"""quant_schemes.py and fp_quant_schemes.py: AWQ, GPTQ, BitNet, NVFP4 (ModelOpt and
compressed-tensors), MXFP4, MXFP8 and FP8-ue8m0 checkpoints load as MLX quantization,
each layer dequantizing to what was written and the logits following.

The checkpoints are written here from a tiny random llama by packers that follow each
format's public description (not upstream's code): AWQ's GEMM words (8 output columns
a word, field j column 8c + (0, 2, 4, 6, 1, 3, 5, 7)[j]), GPTQ's (32 / b inputs a word,
zeros stored minus one), BitNet's (t + 1 in 2 bits, four output rows a byte), FP4
elements two a byte with the low nibble first, E4M3 / E8M0 scales."""

import json
import shutil
import struct

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from checkpoints import TINY_CONFIGS, assert_saves_and_reloads, write_checkpoint
from mlx.utils import tree_unflatten

from mlx_lm import fp_quant_schemes as fp
from mlx_lm import quant_schemes
from mlx_lm.generate import generate
from mlx_lm.utils import dequantize_model, load, load_model

LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
TOKENS = mx.array([[1, 5, 9, 200, 17, 3, 44, 8]])
E2M1 = np.array([0, 0.5, 1, 1.5, 2, 3, 4, 6, -0.0, -0.5, -1, -1.5, -2, -3, -4, -6], np.float32)
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)


def words_of(fields, bits):
    """(R, C) unsigned fields -> (R, C * bits / 32) int32, field j of a word at bits b*j."""
    per_word = 32 // bits
    grouped = fields.astype(np.uint64).reshape(fields.shape[0], -1, per_word)
    return (grouped << (np.arange(per_word, dtype=np.uint64) * bits)).sum(-1).astype(np.uint32).view(np.int32)


def min_max(w, bits, group, symmetric=False):
    """Integer quantization in groups of `group` inputs: (q (out, in), z (out, G), s (out, G))."""
    out, width = w.shape
    grouped = w.reshape(out, width // group, group).astype(np.float64)
    top = (1 << bits) - 1
    if symmetric:
        s = np.abs(grouped).max(-1) / (top / 2)
        z = np.full(s.shape, 1 << (bits - 1))
    else:
        low, high = np.minimum(grouped.min(-1), 0), np.maximum(grouped.max(-1), 0)
        s = (high - low) / top
        z = np.clip(np.round(-low / s), 1, top)  # >= 1: GPTQ's "minus one" zeros stay non-negative
    s = s.astype(np.float32)
    q = np.clip(np.round(grouped / s[..., None] + z[..., None]), 0, top)
    reference = ((q - z[..., None]) * s[..., None]).astype(np.float32).reshape(out, width)
    return q.reshape(out, width).astype(np.uint32), z.astype(np.uint32), s, reference


def pack_awq(w, group=32):
    q, z, s, reference = min_max(w, 4, group)
    by_word = lambda v: v.reshape(-1, 8, v.shape[1])[:, list(AWQ_ORDER)].reshape(v.shape)  # field j <- col 8c+order[j]
    tensors = {"qweight": words_of(by_word(q).T, 4), "qzeros": words_of(by_word(z).T, 4), "scales": s.T}
    return tensors, reference


def pack_gptq(w, bits=4, group=32, symmetric=True, zero_offset=1):
    q, z, s, reference = min_max(w, bits, group, symmetric)
    tensors = {"qweight": words_of(q, bits).T, "qzeros": words_of((z - zero_offset).T, bits), "scales": s.T,
               "g_idx": (np.arange(w.shape[1]) // group).astype(np.int32)}
    return tensors, reference


def pack_gptq_act_order(w, group=32):
    """GPTQ with desc_act: inputs quantized in a shuffled order, g_idx naming each one's group."""
    order = np.random.default_rng(4).permutation(w.shape[1])
    tensors, sorted_reference = pack_gptq(w[:, order], group=group, symmetric=False)
    q = np.zeros(w.shape[::-1], np.uint32)  # back to the inputs' own order: (in, out) fields
    fields = (tensors["qweight"].view(np.uint32)[:, None, :] >> (np.arange(8, dtype=np.uint32) * 4)[None, :, None]) & 15
    q[order] = fields.reshape(-1, w.shape[0])
    g_idx = np.zeros(w.shape[1], np.int32)
    g_idx[order] = np.arange(w.shape[1]) // group
    reference = np.zeros_like(sorted_reference)
    reference[:, order] = sorted_reference
    return dict(tensors, qweight=words_of(q.T, 4).T, g_idx=g_idx), reference


def pack_bitnet(w):
    scale = np.abs(w).mean()
    t = np.clip(np.round(w / scale), -1, 1).astype(np.int64)
    rows = w.shape[0] // 4
    packed = sum((t[k * rows:(k + 1) * rows] + 1) << (2 * k) for k in range(4)).astype(np.uint8)
    weight_scale = np.array([1 / scale], np.float32)  # BitLinear stores the inverse
    return {"weight": packed, "weight_scale": weight_scale}, (t / weight_scale[0]).astype(np.float32)


def e2m1_codes(x):
    """The nearest E2M1 code of each value (sign in bit 3)."""
    return np.abs(x[..., None] - E2M1[:8] * np.sign(x)[..., None]).argmin(-1) + 8 * (x < 0)


def fp4_bytes(codes):
    return (codes[:, 0::2] | (codes[:, 1::2] << 4)).astype(np.uint8)


def pack_nvfp4(w):
    """ModelOpt's NVFP4: (tensors, reference), E4M3 scales per 16 inputs and a global one."""
    global_scale = np.float32(np.abs(w).max() / (6 * 448))
    blocks = w.reshape(w.shape[0], -1, 16)
    scale_bytes = np.array(mx.to_fp8(mx.array(np.abs(blocks).max(-1) / 6 / global_scale)))
    scales = np.array(mx.from_fp8(mx.array(scale_bytes), mx.float32)) * global_scale
    codes = e2m1_codes(blocks / scales[..., None]).reshape(w.shape)
    reference = (E2M1[codes].reshape(blocks.shape) * scales[..., None]).reshape(w.shape)
    return {"weight": fp4_bytes(codes), "weight_scale": scale_bytes, "weight_scale_2": np.array(global_scale),
            "input_scale": np.array(1.0, np.float32)}, reference


def power_of_two_scales(amax, largest):
    return np.exp2(np.ceil(np.log2(np.maximum(amax, 1e-30) / largest))).astype(np.float32)


def pack_mxfp4(w):
    blocks = w.reshape(w.shape[0], -1, 32)
    scales = power_of_two_scales(np.abs(blocks).max(-1), 6)
    codes = e2m1_codes(blocks / scales[..., None]).reshape(w.shape)
    reference = (E2M1[codes].reshape(blocks.shape) * scales[..., None]).reshape(w.shape)
    e8m0 = (np.log2(scales) + 127).astype(np.uint8)
    return {"weight_packed": fp4_bytes(codes), "weight_scale": e8m0}, reference


def fp8_with(w, scales, rows, cols):
    """E4M3 bytes of w / scale, each scale over a rows x cols block, and the reference."""
    full = np.repeat(np.repeat(scales, rows, 0), cols, 1)
    q = np.array(mx.to_fp8(mx.array(w / full)))
    return q, np.array(mx.from_fp8(mx.array(q), mx.float32)) * full


def pack_mxfp8(w):
    scales = power_of_two_scales(np.abs(w.reshape(w.shape[0], -1, 32)).max(-1), 448)
    q, reference = fp8_with(w, scales, 1, 32)
    return {"weight": q, "scales": (np.log2(scales) + 127).astype(np.uint8)}, reference


def pack_fp8_blocks(w):
    out, width = w.shape
    amax = np.abs(w.reshape(out // 32, 32, width // 32, 32)).max((1, 3))
    scales = power_of_two_scales(amax, 448)
    q, reference = fp8_with(w, scales, 32, 32)
    return {"weight": q, "weight_scale_inv": scales}, reference


def retag_fp8(path, names):
    """Mark the named uint8 tensors of a safetensors file F8_E4M3, as torch writes them."""
    raw = path.read_bytes()
    size = struct.unpack("<Q", raw[:8])[0]
    header = json.loads(raw[8:8 + size])
    for name in names:
        header[name]["dtype"] = "F8_E4M3"
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    path.write_bytes(struct.pack("<Q", len(text)) + text + raw[8 + size:])


CT_NVFP4 = {"quant_method": "compressed-tensors", "format": "nvfp4-pack-quantized", "quantization_status": "compressed",
            "config_groups": {"group_0": {"targets": ["Linear"], "format": "nvfp4-pack-quantized",
                                          "weights": {"num_bits": 4, "type": "float", "strategy": "tensor_group",
                                                      "group_size": 16}}}, "ignore": ["lm_head"]}
CT_MXFP4 = json.loads(json.dumps(CT_NVFP4).replace("nvfp4", "mxfp4").replace('"group_size": 16', '"group_size": 32'))


def pack_ct_nvfp4(w):
    tensors, reference = pack_nvfp4(w)
    return {"weight_packed": tensors["weight"], "weight_scale": tensors["weight_scale"],
            "weight_global_scale": (1 / tensors["weight_scale_2"]).reshape(1).astype(np.float32),
            "input_global_scale": np.array([1.0], np.float32)}, reference


# name -> (packer, quantization_config, tensors tagged F8_E4M3, MLX params of each layer, tolerance)
SCHEMES = {
    "awq": (pack_awq, {"quant_method": "awq", "bits": 4, "group_size": 32, "zero_point": True, "version": "gemm"},
            (), {"bits": 4, "group_size": 32, "mode": "affine"}, 1e-6),
    "gptq sym": (pack_gptq, {"quant_method": "gptq", "bits": 4, "group_size": 32, "desc_act": False, "sym": True},
                 (), {"bits": 4, "group_size": 32, "mode": "affine"}, 1e-6),
    "gptq 8-bit v2 asym": (lambda w: pack_gptq(w, 8, 64, False, 0),
                           {"quant_method": "gptq", "bits": 8, "group_size": 64, "sym": False,
                            "checkpoint_format": "gptq_v2"}, (), {"bits": 8, "group_size": 64, "mode": "affine"},
                           1e-6),
    "gptq act-order": (pack_gptq_act_order, {"quant_method": "gptq", "bits": 4, "group_size": 32, "desc_act": True,
                                             "sym": False}, (), {"bits": 4, "group_size": 32, "mode": "affine"}, 1e-6),
    "bitnet": (pack_bitnet, {"quant_method": "bitnet", "linear_class": "bitlinear", "quantization_mode": "offline",
                             "modules_to_not_convert": ["lm_head"]}, (), {"bits": 2, "mode": "affine"}, 1e-6),
    "modelopt nvfp4": (pack_nvfp4, {"quant_method": "modelopt", "quant_algo": "NVFP4", "group_size": 16,
                                    "kv_cache_quant_algo": None, "exclude_modules": ["lm_head"]},
                       ("weight_scale",), fp.NVFP4, 1e-6),
    "compressed-tensors nvfp4": (pack_ct_nvfp4, CT_NVFP4, ("weight_scale",), fp.NVFP4, 1e-6),
    "compressed-tensors mxfp4": (pack_mxfp4, CT_MXFP4, (), fp.MXFP4, 0),
    "mxfp8": (pack_mxfp8, {"quant_method": "mxfp8"}, (), fp.MXFP8, 0),
    "fp8 ue8m0 32x32": (pack_fp8_blocks, {"quant_method": "fp8", "fmt": "e4m3", "scale_fmt": "ue8m0",
                                          "weight_block_size": [32, 32], "activation_scheme": "dynamic"},
                        ("weight",), fp.MXFP8, 0),
}


def write_scheme(directory, name, *, block=None, sidecar=False, layers=LINEARS):
    """A tiny llama with `layers` packed as SCHEMES[name] packs them (the rest float);
    returns (path, {layer path: reference weight})."""
    packer, default_block, fp8_tensors, _, _ = SCHEMES[name]
    float_dir = write_checkpoint(directory / "float", TINY_CONFIGS["llama"])
    saved, reference, fp8_names = {}, {}, []
    for key, value in mx.load(str(float_dir / "model.safetensors")).items():
        path, _, suffix = key.rpartition(".")
        if path.rpartition(".")[2] not in layers or suffix != "weight":
            saved[key] = value
            continue
        tensors, reference[path] = packer(np.array(value))
        saved.update({f"{path}.{s}": mx.array(t) for s, t in tensors.items()})
        fp8_names += [f"{path}.{s}" for s in fp8_tensors]
    shutil.copytree(float_dir, directory / "packed", ignore=shutil.ignore_patterns("*.safetensors", "config.json"))
    target = directory / "packed" / "model.safetensors"
    mx.save_safetensors(str(target), saved)
    retag_fp8(target, fp8_names)
    block = dict(default_block if block is None else block)
    config = dict(TINY_CONFIGS["llama"])
    if sidecar:  # ModelOpt's own file; config.json carries no quantization_config
        settings = {k: v for k, v in block.items() if k != "quant_method"}
        (directory / "packed" / "hf_quant_config.json").write_text(
            json.dumps({"producer": {"name": "modelopt"}, "quantization": settings}))
    else:
        config["quantization_config"] = block
    (directory / "packed" / "config.json").write_text(json.dumps(config))
    return directory / "packed", reference


def dequantized(m):
    weight = mx.dequantize(m.weight, m.scales, m.get("biases"), m.group_size, m.bits, mode=m.mode, dtype=mx.float32)
    if isinstance(m, quant_schemes.PermutedQuantizedLinear):
        return weight[:, mx.argsort(m.input_order)]  # column k of weight is input input_order[k]
    if isinstance(m, fp.GlobalScaledQuantizedLinear):  # the stored scale as MLX's own nvfp4 reads it
        return mx.dequantize(m.weight, m.scales, None, 16, 4, mode="nvfp4", global_scale=m.global_scale,
                             dtype=mx.float32)
    return weight


def float_model_with(path, reference):
    model, _ = load_model(path.parent / "float")
    model.update(tree_unflatten([(f"{p}.weight", mx.array(w)) for p, w in reference.items()]))
    return model


@pytest.mark.parametrize("name", SCHEMES)
def test_each_layer_dequantizes_to_what_was_written_and_logits_follow(tmp_path, name):
    path, reference = write_scheme(tmp_path, name)
    model, config = load_model(path)
    layers = dict(model.named_modules())
    for layer, want in reference.items():
        np.testing.assert_allclose(np.array(dequantized(layers[layer])), want, rtol=SCHEMES[name][4],
                                   atol=SCHEMES[name][4], err_msg=layer)
        params = {k: getattr(layers[layer], k) for k in SCHEMES[name][3]}
        assert params == SCHEMES[name][3], layer
    assert not any("scales" in m for p, m in layers.items() if p not in reference)  # lm_head, embeddings: float
    assert "quant_method" not in config["quantization_config"] and "mode" in config["quantization"]
    want = float_model_with(path, reference)(TOKENS)
    np.testing.assert_allclose(np.array(model(TOKENS)), np.array(want), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("name", ["awq", "modelopt nvfp4"])
def test_a_loaded_model_generates_as_its_float_reference(tmp_path, name):
    path, reference = write_scheme(tmp_path, name)
    model, tokenizer = load(str(path))
    want = float_model_with(path, reference)
    args = dict(prompt="the quick brown fox", max_tokens=8)
    assert generate(model, tokenizer, **args) == generate(want, tokenizer, **args)


def test_modelopt_settings_in_hf_quant_config_json(tmp_path):
    """ModelOpt writes its settings to hf_quant_config.json, nested under "quantization"."""
    path, reference = write_scheme(tmp_path, "modelopt nvfp4", sidecar=True, layers=("down_proj",))
    model, config = load_model(path)
    m = model.model.layers[0].mlp.down_proj
    assert isinstance(m, fp.GlobalScaledQuantizedLinear) and config["quantization"]["mode"] == "nvfp4"
    np.testing.assert_allclose(np.array(dequantized(m)), reference["model.layers.0.mlp.down_proj"], rtol=1e-6)


@pytest.mark.parametrize("name", ["gptq act-order", "modelopt nvfp4"])
def test_layers_of_their_own_dequantize_to_the_weight_they_apply(tmp_path, name):
    path, reference = write_scheme(tmp_path, name, layers=("down_proj",))
    model, _ = load_model(path)
    logits = model(TOKENS)
    dequantize_model(model)
    m = model.model.layers[1].mlp.down_proj
    assert type(m) is nn.Linear
    atol = 1e-6 if name.startswith("gptq") else 2e-2  # nvfp4 dequantizes to bfloat16, as mx.dequantize does
    np.testing.assert_allclose(np.array(m.weight.astype(mx.float32)), reference["model.layers.1.mlp.down_proj"],
                               rtol=atol, atol=atol)
    np.testing.assert_allclose(np.array(model(TOKENS).astype(mx.float32)), np.array(logits), rtol=max(atol, 1e-4),
                               atol=max(atol, 1e-4))


def test_a_half_precision_load_keeps_the_global_scale_in_float32(tmp_path):
    path, _ = write_scheme(tmp_path, "modelopt nvfp4", layers=("down_proj",))
    full, _ = load_model(path)
    half, _ = load_model(path, dtype=mx.bfloat16)
    m = half.model.layers[0].mlp.down_proj
    assert m.global_scale.dtype == mx.float32 and m.scales.dtype == mx.uint8
    assert mx.array_equal(m.global_scale, full.model.layers[0].mlp.down_proj.global_scale).item()
    assert half(TOKENS).dtype == mx.bfloat16


@pytest.mark.parametrize("name", ["awq", "gptq act-order", "compressed-tensors nvfp4"])
def test_the_loaded_model_saves_as_an_mlx_checkpoint(tmp_path, name):
    path, _ = write_scheme(tmp_path, name)
    model, config = load_model(path)
    assert_saves_and_reloads(model, config, tmp_path / "mlx", TOKENS)


def test_awq_with_half_precision_scales(tmp_path):
    """AutoAWQ saves float16 scales; they keep their dtype and the biases -z * s round once."""
    def half(w):
        tensors, _ = pack_awq(w)
        tensors["scales"] = tensors["scales"].astype(np.float16)
        q, z, _, _ = min_max(w, 4, 32)
        s = tensors["scales"].T.astype(np.float32)
        return tensors, ((q.reshape(*s.shape, -1) - z[..., None].astype(np.float32)) * s[..., None]).reshape(w.shape)

    SCHEMES["awq half"] = (half,) + SCHEMES["awq"][1:]
    try:
        path, reference = write_scheme(tmp_path, "awq half", layers=("down_proj",))
    finally:
        del SCHEMES["awq half"]
    m = load_model(path)[0].model.layers[1].mlp.down_proj
    assert m.scales.dtype == mx.float16 and m.biases.dtype == mx.float16
    # bias = -z * s rounded to float16: at most 15 s, 4 more bits than s
    np.testing.assert_allclose(np.array(dequantized(m)), reference["model.layers.1.mlp.down_proj"], atol=2e-3)


def test_bitnet_autobitlinear_scales_multiply():
    """Upstream divides by weight_scale except for linear_class "autobitlinear"."""
    w = np.random.default_rng(0).normal(size=(8, 64)).astype(np.float32)
    tensors, reference = pack_bitnet(w)
    tensors = {k: mx.array(v) for k, v in tensors.items()}
    for invert, want in ((True, reference), (False, reference * tensors["weight_scale"].item() ** 2)):
        repacked, params = quant_schemes.repack_bitnet("layer", tensors, invert_scale=invert)
        got = mx.dequantize(repacked["weight"], repacked["scales"], repacked["biases"], params["group_size"], 2)
        np.testing.assert_allclose(np.array(got), want, rtol=1e-6, atol=1e-7)


def block_with(method, **change):
    block = dict(next(b for _, b, *_ in SCHEMES.values() if b["quant_method"] == method))
    block.update(change)
    return {"quantization_config": block}


@pytest.mark.parametrize("config, message", [
    (block_with("awq", version="gemv"), "version 'gemv'; only AutoAWQ's GEMM"),
    (block_with("awq", bits=8), "bits 8; AWQ's interleaved packing is 4-bit"),
    (block_with("gptq", bits=3), r"bits 3; MLX's packing matches GPTQ's for \[2, 4, 8\]"),
    (block_with("gptq", checkpoint_format="marlin"), "checkpoint_format 'marlin'"),
    (block_with("bitnet", linear_class="other"), "linear_class 'other'"),
    (block_with("bitnet", quantization_mode="online"), "quantization_mode 'online'"),
    (block_with("modelopt", quant_algo="FP8"), "quant_algo 'FP8'; only NVFP4"),
    (block_with("modelopt", kv_cache_quant_algo="FP8"), "kv_cache_quant_algo 'FP8'"),
    (block_with("fp8", fmt="e5m2"), "fmt 'e5m2'"),
    ({"quantization_config": dict(CT_NVFP4, kv_cache_scheme={"num_bits": 8})}, "kv_cache_scheme"),
    ({"quantization_config": {"quant_method": "bitsandbytes", "load_in_4bit": True}},
     "quant_method 'bitsandbytes' is not supported"),
])
def test_settings_it_cannot_repack_are_refused_by_name(config, message):
    with pytest.raises(ValueError, match=message):
        quant_schemes.to_mlx({"x.qweight": mx.zeros((1, 1), mx.int32)}, config)


def test_schemes_owned_elsewhere_are_left_as_they_are():
    weights = {"x.weight": mx.zeros((4, 4), mx.uint8), "x.weight_scale_inv": mx.ones((1, 1))}
    for config in ({"quantization_config": {"quant_method": "fp8", "weight_block_size": [128, 128]}},
                   {"quantization_config": dict(CT_NVFP4, format="pack-quantized", config_groups={})},
                   {"quantization_config": {"quant_method": "mxfp4"}, "note": "gpt-oss blocks"},
                   {"quantization": {"group_size": 64, "bits": 4}, "quantization_config": {"quant_method": "awq"}}):
        given = dict(weights, **({"e.gate_up_proj_blocks": mx.zeros(1)} if "note" in config else {}))
        assert quant_schemes.to_mlx(given, config) == (given, config)


def test_layouts_it_cannot_express_are_refused_by_layer():
    w = np.random.default_rng(1).normal(size=(32, 64)).astype(np.float32)
    tensors = {k: mx.array(v) for k, v in pack_gptq(w)[0].items()}
    tensors["g_idx"] = mx.array(np.random.default_rng(2).permutation(np.arange(64) >= 40).astype(np.int32))
    with pytest.raises(ValueError, match="layer.g_idx puts unequal numbers of inputs in its 2 groups"):
        quant_schemes.repack_gptq("layer", tensors, 4, 1)
    with pytest.raises(ValueError, match="2 scale groups of 64 inputs, but the config says group_size 128"):
        quant_schemes.repack_gptq("layer", dict(tensors, g_idx=mx.arange(64) // 32), 4, 1, 128)
    with pytest.raises(ValueError, match="layer: a packed layer needs qweight, scales; missing qweight"):
        quant_schemes.repack_awq("layer", {"scales": mx.ones((2, 64))})
    with pytest.raises(ValueError, match=r"layer.weight_scale_inv: scale 0.30000001192092896 is not a positive power"):
        fp.repack_fp8_blocks("layer", mx.zeros((32, 64), mx.uint8), mx.array([[0.5, 0.3]]))
    with pytest.raises(ValueError, match=r"scales \(32, 2\) are not one per 16 inputs"):
        fp.repack_fp4("layer", mx.zeros((32, 32), mx.uint8), mx.zeros((32, 2), mx.uint8), fp.NVFP4)


def test_scheme_layers_need_a_quantized_linear_layer_of_their_mode(tmp_path):
    model, _ = load_model(write_checkpoint(tmp_path, TINY_CONFIGS["llama"]))
    with pytest.raises(ValueError, match="model.layers.0.mlp.up_proj.global_scale but model.layers.0.mlp.up_proj "
                                         "is Linear; only a quantized linear"):
        quant_schemes.add_scheme_layers(model, {"model.layers.0.mlp.up_proj.global_scale": mx.ones((1,))})
    nn.quantize(model, 64, 4)
    with pytest.raises(ValueError, match="up_proj.global_scale, but a GlobalScaledQuantizedLinear is "
                                         "nvfp4-quantized; this layer is affine"):
        quant_schemes.add_scheme_layers(model, {"model.layers.0.mlp.up_proj.global_scale": mx.ones((1,))})


def test_a_config_without_quantized_weights_is_refused(tmp_path):
    path = write_checkpoint(tmp_path, dict(TINY_CONFIGS["llama"], quantization_config=SCHEMES["gptq sym"][1]))
    with pytest.raises(ValueError, match=r"says 'gptq', but no weight is quantized that way \(no \*.qweight\)"):
        load_model(path)


@pytest.mark.parametrize("bits", [2, 4, 8])
def test_mlx_words_are_mlx_affine_packing(bits):
    values = mx.array(np.random.default_rng(3).integers(0, 1 << bits, size=(64, 3)).astype(np.uint32))  # (in, out)
    words = quant_schemes.mlx_words(values, bits)
    got = mx.dequantize(words, mx.ones((3, 2)), mx.zeros((3, 2)), 32, bits)
    assert mx.array_equal(got, values.T.astype(mx.float32)).item()


@pytest.mark.parametrize("name", ["mxfp8", "modelopt nvfp4"])
def test_quantize_activations_rounds_each_layers_input_as_its_weight(tmp_path, name):
    """model_config {"quantize_activations": true} (upstream's): each nvfp4 / mxfp8
    layer computes W x' with x' = x rounded to the layer's format per group, which is
    nn.QQLinear's result (checked on one row, where MLX's CPU backend runs mx.qqmm)."""
    path, _ = write_scheme(tmp_path, name)
    plain, _ = load_model(path)
    model, config = load_model(path, model_config={"quantize_activations": True})
    assert config["quantize_activations"] is True and isinstance(model.lm_head, nn.Linear)
    layer, plain_layer = model.model.layers[0].mlp.up_proj, plain.model.layers[0].mlp.up_proj
    assert isinstance(layer, type(plain_layer)) and type(layer) is not type(plain_layer)
    x = mx.random.normal((3, 64), key=mx.random.key(5))
    rounded = mx.dequantize(*mx.quantize(x, mode=plain_layer.mode), mode=plain_layer.mode, dtype=mx.float32)
    assert mx.array_equal(layer(x), plain_layer(rounded)).item()
    assert not mx.allclose(layer(x), plain_layer(x), rtol=1e-3, atol=1e-3).item()  # the input is rounded
    if isinstance(plain_layer, nn.QuantizedLinear):
        qq = nn.QQLinear(64, 128, mode=plain_layer.mode)
        qq.eval()
        qq.weight, qq.scales = plain_layer.weight, plain_layer.scales
        assert mx.array_equal(layer(x[:1]), qq(x[:1])).item()
    logits, plain_logits = model(TOKENS), plain(TOKENS)
    error = (mx.linalg.norm(logits - plain_logits) / mx.linalg.norm(plain_logits)).item()
    assert 0 < error < {"mxfp8": 0.3, "nvfp4": 0.6}[plain_layer.mode]  # 3-bit vs 1-bit element mantissas


def test_quantize_activations_refuses_other_modes(tmp_path):
    path, _ = write_scheme(tmp_path, "awq")
    with pytest.raises(ValueError, match="quantize_activations: model.layers.0.mlp.down_proj has mode 'affine'; "
                                         "activations quantize only in nvfp4 and mxfp8 layers"):
        load_model(path, model_config={"quantize_activations": True})
