"""Checkpoints quantized by llm-compressor ("quant_method": "compressed-tensors",
format "pack-quantized", e.g. W4A16 and W8A16), repacked at load into MLX's affine layout.

The format, per quantized linear layer `p` (compressed-tensors' pack-quantized
compressor):
- `p.weight_packed` int32 (out, ceil(in / (32 / b))): each b-bit integer q in
  [-2^(b-1), 2^(b-1)) stored as u = q + 2^(b-1), element j of a word at bits b*j.
- `p.weight_scale` (out, in / group) for the "group" strategy, (out, 1) for "channel",
  one value for "tensor".
- `p.weight_zero_point` only when asymmetric: the zero points z, stored as
  z + 2^(b-1) and packed the same way but along the *output* axis,
  (ceil(out / (32 / b)), groups) int32 (older writers: int8 (out, groups), unpacked).
- `p.weight_shape` [out, in]; `p.weight_g_idx` with activation-ordered groups.
The weight is (q - z) * s.

MLX's affine layout keeps uint32 words with element j at bits b*j (the same packing
for b = 2, 4, 8) and computes w = u * scale + bias per group of 32, 64 or 128 inputs.
So the words are reused as they are, scale = s and bias = -(z + 2^(b-1)) * s. A coarser
group (a channel, the whole tensor, a group of 256) becomes the largest MLX group that
divides it, its scale repeated: exact. A finer one (16) or 3-, 5- or 6-bit packing has
no MLX equivalent and is refused, as are the other formats (float-quantized FP8,
int-quantized, the FP4 formats, sparse ones): dequantize those to float first.

Upstream 0.32.2 maps this config to {"group_size": 32, "bits": 4} whatever it says and
leaves the renaming to a few families' sanitize; here every family loads it, with the
group size and bits the checkpoint has, per layer.
"""

from collections import Counter
from typing import Any, Dict, Optional, Tuple

import mlx.core as mx

QUANT_METHOD = "compressed-tensors"
SUPPORTED_FORMAT = "pack-quantized"
SUPPORTED_BITS = (2, 4, 8)  # the widths whose words MLX packs the same way
SUPPORTED_STRATEGIES = ("group", "channel", "tensor")
MLX_GROUP_SIZES = (128, 64, 32)  # largest first: the fewest repeated scales
SUFFIXES = ("weight_packed", "weight_scale", "weight_zero_point", "weight_shape", "weight_g_idx")


def quantization_config_of(config: Dict[str, Any]) -> Optional[Dict[str, Any]]:
    """The compressed-tensors block of a config (top level or, for multimodal
    checkpoints, in text_config), or None when it has none."""
    for section in (config, config.get("text_config") or {}):
        block = section.get("quantization_config")
        if isinstance(block, dict) and block.get("quant_method") == QUANT_METHOD:
            return block
    return None


def check_scheme(block: Dict[str, Any]) -> None:
    """Refuse, naming the value, every scheme this module cannot repack exactly."""
    where = 'config.json "quantization_config" (compressed-tensors)'
    status = block.get("quantization_status", "compressed")
    if status != "compressed":
        raise ValueError(f"{where}: quantization_status {status!r}; only saved, compressed checkpoints load "
                         "(\"compressed\")")
    if block.get("kv_cache_scheme"):
        raise ValueError(f"{where}: kv_cache_scheme {block['kv_cache_scheme']!r} quantizes the KV cache, which "
                         "this package does not; remove it to run the cache in float")
    groups = block.get("config_groups") or {}
    if not isinstance(groups, dict) or not groups:
        raise ValueError(f"{where}: config_groups must name at least one scheme, got {groups!r}")
    for name, group in groups.items():
        fmt = group.get("format") or block.get("format")
        if fmt != SUPPORTED_FORMAT:
            raise ValueError(f"{where}: config_groups[{name!r}] has format {fmt!r}; only {SUPPORTED_FORMAT!r} "
                             "(packed integers) repacks to MLX: dequantize the checkpoint to float, then "
                             "quantize it with mlx_lm.convert -q")
        _check_weights_args(f"{where}: config_groups[{name!r}]", group.get("weights") or {})


def _check_weights_args(where: str, args: Dict[str, Any]) -> None:
    kind, bits, strategy = args.get("type", "int"), args.get("num_bits"), args.get("strategy", "group")
    if kind != "int":
        raise ValueError(f"{where}: weights of type {kind!r}; pack-quantized weights are integers (\"int\")")
    if bits not in SUPPORTED_BITS:
        raise ValueError(f"{where}: num_bits {bits!r}; MLX's packing matches {list(SUPPORTED_BITS)} bits only")
    if strategy not in SUPPORTED_STRATEGIES:
        raise ValueError(f"{where}: strategy {strategy!r}; supported: {', '.join(SUPPORTED_STRATEGIES)}")
    if args.get("dynamic"):
        raise ValueError(f"{where}: dynamic weight quantization ({args['dynamic']!r}) stores no scales to load")


def unpack_rows(packed: mx.array, bits: int, rows: int) -> mx.array:
    """(ceil(rows / (32 / bits)), C) int32 words packed along the first axis ->
    (rows, C) uint32 values: row r is field r % (32 / bits) of word r // (32 / bits)."""
    shifts = mx.arange(0, 32, bits, dtype=mx.uint32)[:, None]  # (per_word, 1)
    fields = (packed.view(mx.uint32)[:, None, :] >> shifts) & ((1 << bits) - 1)  # (words, per_word, C): one op
    return fields.reshape(-1, packed.shape[-1])[:rows]


def _zero_points(path: str, tensors: Dict[str, mx.array], bits: int, rows: int, groups: int) -> mx.array:
    """(rows, groups) unsigned zero points z + 2^(b-1): 2^(b-1) when symmetric."""
    offset = 1 << (bits - 1)
    zero = tensors.get("weight_zero_point")
    if zero is None:
        return mx.full((rows, groups), offset, mx.uint32)
    if zero.dtype == mx.int8 and zero.size in (1, rows * groups):  # unpacked signed values
        unsigned = (zero.astype(mx.int32) + offset).astype(mx.uint32)
        return mx.broadcast_to(unsigned.reshape(1, 1) if zero.size == 1 else unsigned.reshape(rows, groups),
                               (rows, groups))
    if zero.dtype == mx.int32 and zero.ndim == 2 and zero.shape == (-(-rows // (32 // bits)), groups):
        return unpack_rows(zero, bits, rows)
    raise ValueError(f"{path}.weight_zero_point: {zero.dtype} {tuple(zero.shape)} is neither packed "
                     f"({-(-rows // (32 // bits))}, {groups}) int32 nor ({rows}, {groups}) int8 zero points")


def mlx_group_size(path: str, group: int) -> int:
    """The largest MLX affine group size dividing a checkpoint's `group` (its scale repeated)."""
    for size in MLX_GROUP_SIZES:
        if group % size == 0:
            return size
    raise ValueError(f"{path}: groups of {group} inputs; MLX quantizes in groups of "
                     f"{', '.join(map(str, sorted(MLX_GROUP_SIZES)))} (or multiples, by repeating scales)")


def _layer_shape(path: str, tensors: Dict[str, mx.array]) -> Tuple[int, int, int]:
    """(out, in, bits) of one layer, read from weight_shape and the packed width."""
    missing = [s for s in ("weight_packed", "weight_scale", "weight_shape") if s not in tensors]
    if missing:
        raise ValueError(f"{path}: a pack-quantized layer needs weight_packed, weight_scale and weight_shape; "
                         f"missing {', '.join(missing)}")
    packed, shape = tensors["weight_packed"], tensors["weight_shape"].tolist()
    if packed.dtype != mx.int32 or packed.ndim != 2 or len(shape) != 2 or packed.shape[0] != shape[0]:
        raise ValueError(f"{path}: weight_packed {packed.dtype} {tuple(packed.shape)} is not the int32 packing "
                         f"of a {shape} matrix")
    rows, width = shape
    bits = next((b for b in SUPPORTED_BITS if packed.shape[1] == -(-width // (32 // b))), None)
    if bits is None:
        raise ValueError(f"{path}: weight_packed width {packed.shape[1]} for {width} inputs is no "
                         f"{list(SUPPORTED_BITS)}-bit packing")
    return rows, width, bits


def _check_group_order(path: str, tensors: Dict[str, mx.array], width: int, group: int) -> None:
    """Activation-ordered groups (weight_g_idx) load only where they are in order."""
    g_idx = tensors.get("weight_g_idx")
    if g_idx is not None and not mx.array_equal(g_idx, mx.arange(width) // group).item():
        raise ValueError(f"{path}.weight_g_idx assigns inputs to groups out of order (actorder \"group\"); "
                         "MLX groups are contiguous: quantize with actorder \"weight\" or none")


def affine_scales_and_biases(scale: mx.array, zero: mx.array, repeat: int) -> Tuple[mx.array, mx.array]:
    """(rows, G) scales s and unsigned zero points z of w = (u - z) * s -> MLX's (rows,
    G * repeat) scales and biases (w = u * scale + bias), each group's `repeat` times."""
    # zero * s in float32 first, then the scales' dtype: one rounding.
    biases = -(zero.astype(mx.float32) * scale.astype(mx.float32))
    return mx.repeat(scale, repeat, axis=1), mx.repeat(biases, repeat, axis=1).astype(scale.dtype)


def repack_layer(path: str, tensors: Dict[str, mx.array]) -> Tuple[Dict[str, mx.array], Dict[str, Any]]:
    """One layer's compressed tensors (keyed by suffix) -> ({"weight", "scales",
    "biases"} in MLX's affine layout, {"group_size", "bits", "mode"})."""
    rows, width, bits = _layer_shape(path, tensors)
    scale = tensors["weight_scale"]
    scale = scale.reshape(rows, -1) if scale.size != 1 else mx.broadcast_to(scale.reshape(1, 1), (rows, 1))
    groups = scale.shape[-1]
    if scale.shape[0] != rows or width % groups:
        raise ValueError(f"{path}.weight_scale {tuple(tensors['weight_scale'].shape)} fits no grouping of a "
                         f"({rows}, {width}) weight")
    _check_group_order(path, tensors, width, width // groups)
    group_size = mlx_group_size(path, width // groups)
    zero = _zero_points(path, tensors, bits, rows, groups)
    scales, biases = affine_scales_and_biases(scale, zero, width // groups // group_size)
    packed = tensors["weight_packed"].view(mx.uint32)
    return {"weight": packed, "scales": scales, "biases": biases}, {"group_size": group_size, "bits": bits,
                                                                     "mode": "affine"}


def split_layers(weights: Dict[str, mx.array], suffixes: Tuple[str, ...] = SUFFIXES
                 ) -> Tuple[Dict[str, Dict[str, mx.array]], Dict[str, mx.array]]:
    """({layer path: {suffix: tensor}} of the tensors named `<path>.<one of suffixes>`,
    the other weights)."""
    layers: Dict[str, Dict[str, mx.array]] = {}
    rest = {}
    for name, value in weights.items():
        path, _, suffix = name.rpartition(".")
        if suffix in suffixes:
            layers.setdefault(path, {})[suffix] = value
        else:
            rest[name] = value
    return layers, rest


def to_mlx(weights: Dict[str, mx.array], config: Dict[str, Any]) -> Tuple[Dict[str, mx.array], Dict[str, Any]]:
    """(weights, config) of a compressed-tensors checkpoint -> the same model in MLX's
    layout: repacked weights and a config whose "quantization" block (also written as
    "quantization_config", as upstream does) gives each layer's group size and bits,
    the most common as the default. Layers the checkpoint keeps in float stay so."""
    block = quantization_config_of(config)
    check_scheme(block)
    layers, repacked = split_layers(weights)
    if not layers:
        raise ValueError('config.json "quantization_config" says compressed-tensors, but no weight is '
                         "pack-quantized (no *.weight_packed): the checkpoint does not match its config")
    params: Dict[str, Dict[str, Any]] = {}
    for path, tensors in sorted(layers.items()):
        if f"{path}.weight" in repacked:
            raise ValueError(f"{path} has both a float weight and compressed tensors; the checkpoint is inconsistent")
        tensors_mlx, params[path] = repack_layer(path, tensors)
        repacked.update({f"{path}.{name}": value for name, value in tensors_mlx.items()})
    return repacked, with_mlx_quantization(config, params)


def with_mlx_quantization(config: Dict[str, Any], params: Dict[str, Dict[str, Any]]) -> Dict[str, Any]:
    """`config` without its Hugging Face "quantization_config" (top level or in
    text_config), with the MLX block for the layers' `params` ({path: {"group_size",
    "bits", "mode"}}): the most common as the default, the others per layer; written as
    "quantization" and, as upstream does, "quantization_config"."""
    counts = Counter(tuple(sorted(p.items())) for p in params.values())
    default = dict(counts.most_common(1)[0][0])
    quantization: Dict[str, Any] = dict(default)
    quantization.update({path: p for path, p in params.items() if p != default})
    config = {k: v for k, v in config.items() if k != "quantization_config"}
    if "text_config" in config and "quantization_config" in (config["text_config"] or {}):
        config["text_config"] = {k: v for k, v in config["text_config"].items() if k != "quantization_config"}
    config["quantization"] = quantization
    config["quantization_config"] = dict(quantization)
    return config
