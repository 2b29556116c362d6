"""compressed_tensors.py: llm-compressor's pack-quantized checkpoints load as MLX affine
quantization, each layer dequantizing to exactly (q - z) * s of what was written.

The checkpoints are written here by a packer that follows compressed-tensors' published
format (quantize to signed integers, store them offset by 2^(b-1), b-bit fields from
the low bits of each int32 word, weights packed along the input axis and zero points
along the output axis), from a tiny random llama."""

import json

import mlx.core as mx
import numpy as np
import pytest
from checkpoints import TINY_CONFIGS, assert_saves_and_reloads, write_checkpoint
from mlx.utils import tree_unflatten

from mlx_lm import compressed_tensors
from mlx_lm.utils import load_model

LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
TOKENS = mx.array([[1, 5, 9, 200, 17, 3, 44, 8]])


def quantize(w, bits, group, symmetric):
    """compressed-tensors' min-max integer quantization of w (rows, cols) in groups of
    `group` columns: (q int8 (rows, cols), s float32 (rows, G), z int8 (rows, G))."""
    rows, cols = w.shape
    grouped = w.reshape(rows, cols // group, group).astype(np.float64)
    qmin, qmax = -(1 << (bits - 1)), (1 << (bits - 1)) - 1
    low, high = np.minimum(grouped.min(-1), 0), np.maximum(grouped.max(-1), 0)
    if symmetric:
        scale, zero = np.maximum(-low, high) / ((qmax - qmin) / 2), np.zeros(low.shape)
    else:
        scale = (high - low) / (qmax - qmin)
        zero = np.clip(np.round(qmin - low / scale), qmin, qmax)
    scale = scale.astype(np.float32)
    q = np.clip(np.round(grouped / scale[..., None].astype(np.float64) + zero[..., None]), qmin, qmax)
    return q.reshape(rows, cols).astype(np.int8), scale, zero.astype(np.int8)


def pack_to_int32(values, bits, packed_dim=1):
    """The format's packing: v + 2^(b-1) as unsigned b-bit fields, field j of a word at
    bits b*j, along axis `packed_dim` (padded with zeros to whole words)."""
    unsigned = (values.astype(np.int64) + (1 << (bits - 1))).astype(np.uint64)
    if packed_dim == 0:
        unsigned = unsigned.T
    per_word = 32 // bits
    rows, cols = unsigned.shape
    unsigned = np.pad(unsigned, ((0, 0), (0, -cols % per_word))).reshape(rows, -1, per_word)
    words = (unsigned << (np.arange(per_word, dtype=np.uint64) * bits)).sum(-1).astype(np.uint32).view(np.int32)
    return words.T if packed_dim == 0 else words


def compress_layer(w, bits, strategy, group, symmetric, scale_dtype, old_zero_points=False):
    """({suffix: tensor} as llm-compressor saves one layer, its weight as they define it)."""
    rows, cols = w.shape
    if strategy == "tensor":  # one scale: the whole matrix as one group
        q, s, z = quantize(w.reshape(1, -1), bits, rows * cols, symmetric)
    else:
        q, s, z = quantize(w, bits, group if strategy == "group" else cols, symmetric)
    s = np.array(mx.array(s).astype(scale_dtype).astype(mx.float32))  # the stored scale's rounding
    grouped = q.reshape(*s.shape, -1).astype(np.float32)
    dequantized = ((grouped - z[..., None]) * s[..., None]).reshape(rows, cols)
    q = q.reshape(rows, cols)
    if strategy == "tensor":
        s, z = s.reshape(1), z.reshape(1)
    tensors = {"weight_packed": mx.array(pack_to_int32(q, bits)), "weight_scale": mx.array(s).astype(scale_dtype),
               "weight_shape": mx.array(np.array([rows, cols], np.int64))}
    if not symmetric:
        packed = strategy != "tensor" and not old_zero_points  # as the format packs them
        tensors["weight_zero_point"] = mx.array(pack_to_int32(z, bits, packed_dim=0) if packed else z)
    return tensors, dequantized


def write_compressed(directory, groups, *, scale_dtype=mx.float32, old_zero_points=False, extra=None):
    """A tiny llama in compressed-tensors' layout: `groups` maps a projection name to
    (bits, strategy, group, symmetric); returns (path, {layer: dequantized weight})."""
    write_checkpoint(directory / "float", TINY_CONFIGS["llama"])
    weights = dict(mx.load(str(directory / "float" / "model.safetensors")))
    saved, reference = {}, {}
    for name, value in weights.items():
        proj = name.split(".")[-2]
        if proj not in groups or not name.endswith(".weight"):
            saved[name] = value
            continue
        tensors, dequantized = compress_layer(np.array(value), *groups[proj], scale_dtype, old_zero_points)
        saved.update({f"{name[:-len('weight')]}{suffix}": t for suffix, t in tensors.items()})
        reference[name[: -len(".weight")]] = dequantized
    directory.mkdir(exist_ok=True)
    mx.save_safetensors(str(directory / "model.safetensors"), saved)
    config = dict(TINY_CONFIGS["llama"], quantization_config=quantization_config(groups, **(extra or {})))
    (directory / "config.json").write_text(json.dumps(config))
    return directory, reference


def quantization_config(groups, **extra):
    """The config block llm-compressor writes: one scheme per distinct setting."""
    schemes = {}
    for proj, (bits, strategy, group, symmetric) in groups.items():
        key = f"group_{bits}_{strategy}_{group}_{symmetric}"
        scheme = schemes.setdefault(key, {"targets": [], "format": "pack-quantized", "input_activations": None,
                                          "output_activations": None,
                                          "weights": {"num_bits": bits, "type": "int", "symmetric": symmetric,
                                                      "strategy": strategy, "group_size": group,
                                                      "dynamic": False, "actorder": None}})
        scheme["targets"].append(f"re:.*{proj}$")
    block = {"quant_method": "compressed-tensors", "format": "pack-quantized", "config_groups": schemes,
             "ignore": ["lm_head"], "quantization_status": "compressed", "kv_cache_scheme": None}
    block.update(extra)
    return block


def float_model_with(directory, reference):
    """The float llama carrying the reference dequantized weights."""
    model, _ = load_model(directory / "float")
    model.update(tree_unflatten([(f"{path}.weight", mx.array(w)) for path, w in reference.items()]))
    return model


SCHEMES = {
    "w4 group 32 symmetric": {p: (4, "group", 32, True) for p in LINEARS},
    "w8 channel asymmetric": {p: (8, "channel", None, False) for p in LINEARS},
    "w4 attention, w8 tensor mlp": {**{p: (4, "group", 64, False) for p in LINEARS[:4]},
                                    **{p: (8, "tensor", None, True) for p in LINEARS[4:]}},
    "w2 group 128 (down only)": {"down_proj": (2, "group", 128, False)},
}


@pytest.mark.parametrize("name", SCHEMES)
def test_each_layer_dequantizes_to_what_was_written_and_logits_follow(tmp_path, name):
    path, reference = write_compressed(tmp_path, SCHEMES[name])
    model, config = load_model(path)
    layers = dict(model.named_modules())
    for layer, want in reference.items():
        m = layers[layer]
        got = mx.dequantize(m.weight, m.scales, m.biases, m.group_size, m.bits)
        np.testing.assert_allclose(np.array(got), want, rtol=1e-6, atol=1e-6, err_msg=layer)
        assert m.bits == SCHEMES[name][layer.split(".")[-1]][0]
    assert not any("scales" in m for p, m in layers.items() if p not in reference)  # lm_head, embeddings: float
    assert "quant_method" not in config["quantization_config"] and config["quantization"]["mode"] == "affine"
    want = float_model_with(tmp_path, reference)(TOKENS)
    np.testing.assert_allclose(np.array(model(TOKENS)), np.array(want), rtol=1e-4, atol=1e-4)


def test_half_precision_scales_and_unpacked_zero_points(tmp_path):
    """Older writers stored asymmetric zero points as int8, unpacked; float16 scales
    keep their dtype."""
    groups = {p: (4, "group", 32, False) for p in LINEARS}
    path, reference = write_compressed(tmp_path, groups, scale_dtype=mx.float16, old_zero_points=True)
    model, _ = load_model(path)
    m = model.model.layers[1].mlp.down_proj
    assert m.scales.dtype == mx.float16 and m.biases.dtype == mx.float16
    got = mx.dequantize(m.weight, m.scales, m.biases, m.group_size, m.bits).astype(mx.float32)
    # bias = -(z + 8) * s, rounded once to float16 (at most 15 s: 4 more bits than s)
    np.testing.assert_allclose(np.array(got), reference["model.layers.1.mlp.down_proj"], rtol=2e-3, atol=2e-3)


def test_the_loaded_model_saves_as_an_mlx_checkpoint(tmp_path):
    path, _ = write_compressed(tmp_path, SCHEMES["w4 attention, w8 tensor mlp"])
    model, config = load_model(path)
    assert_saves_and_reloads(model, config, tmp_path / "mlx", TOKENS)


@pytest.mark.parametrize("change, message", [
    ({"format": "float-quantized"}, "format 'float-quantized'; only 'pack-quantized'"),
    ({"weights": {"num_bits": 3}}, "num_bits 3"),
    ({"weights": {"type": "float"}}, "type 'float'"),
    ({"weights": {"strategy": "block"}}, "strategy 'block'"),
    ({"quantization_status": "frozen"}, "quantization_status 'frozen'"),
    ({"kv_cache_scheme": {"num_bits": 8}}, "kv_cache_scheme"),
])
def test_schemes_it_cannot_repack_are_refused_by_name(tmp_path, change, message):
    block = quantization_config({"q_proj": (4, "group", 32, True)})
    scheme = block["config_groups"]["group_4_group_32_True"]
    for key, value in change.items():
        if key == "weights":
            scheme["weights"].update(value)
        elif key == "format":
            scheme["format"] = block["format"] = value
        else:
            block[key] = value
    with pytest.raises(ValueError, match=message):
        compressed_tensors.check_scheme(block)


def test_layouts_it_cannot_express_are_refused_by_layer(tmp_path):
    w = np.random.default_rng(0).normal(size=(8, 64)).astype(np.float32)
    tensors, _ = compress_layer(w, 4, "group", 16, True, mx.float32)
    with pytest.raises(ValueError, match="layer.q: groups of 16 inputs"):
        compressed_tensors.repack_layer("layer.q", tensors)
    tensors, _ = compress_layer(w, 4, "group", 32, True, mx.float32)
    tensors["weight_g_idx"] = mx.array(np.random.default_rng(1).permutation(64) // 32)
    with pytest.raises(ValueError, match="weight_g_idx assigns inputs to groups out of order"):
        compressed_tensors.repack_layer("layer.q", tensors)
    tensors["weight_g_idx"] = mx.arange(64) // 32  # in order: loads
    assert compressed_tensors.repack_layer("layer.q", tensors)[1] == {"group_size": 32, "bits": 4, "mode": "affine"}
    del tensors["weight_shape"]
    with pytest.raises(ValueError, match="missing weight_shape"):
        compressed_tensors.repack_layer("layer.q", tensors)


def test_a_config_without_packed_weights_is_refused(tmp_path):
    write_checkpoint(tmp_path, dict(TINY_CONFIGS["llama"], quantization_config=quantization_config(
        {"q_proj": (4, "group", 32, True)})))
    with pytest.raises(ValueError, match="no weight is pack-quantized"):
        load_model(tmp_path)


def test_unpack_rows_inverts_the_packing():
    values = np.random.default_rng(2).integers(-8, 8, size=(13, 5)).astype(np.int8)
    got = compressed_tensors.unpack_rows(mx.array(pack_to_int32(values, 4, packed_dim=0)), 4, 13)
    assert np.array_equal(np.array(got), values.astype(np.int64) + 8)
