"""Hugging Face quantization schemes that upstream mlx-lm 0.32.2 loads, repacked at load
(before the family is built and its sanitize runs) into MLX quantization, per layer and
exactly; compressed-tensors' packed integers are compressed_tensors.py's.

config "quant_method"          per layer, as the format stores it       -> MLX
awq (AutoAWQ, version gemm)    qweight (in, out / 8) int32, qzeros      affine 4-bit
                               (in / g, out / 8), scales (in / g, out)
gptq (AutoGPTQ, GPTQModel)     qweight (in / (32 / b), out), qzeros     affine b-bit
                               (in / g, out / (32 / b)), scales, g_idx   (b = 2, 4, 8)
bitnet (BitLinear, offline)    weight uint8 (out / 4, in), weight_scale  affine 2-bit
modelopt (NVFP4)               weight, weight_scale, weight_scale_2      nvfp4
compressed-tensors nvfp4- / mxfp4-pack-quantized                        nvfp4 / mxfp4
mxfp8, mxfp4 (MLX names)       weight, scales                            mxfp8 / mxfp4
fp8, ue8m0 scales, 32 x 32     weight, weight_scale_inv                  mxfp8
(the floating point ones: fp_quant_schemes.py).

The integer formats, from their public descriptions:
- AWQ: a word holds 8 output columns, field j (bits 4j) column 8c + AWQ_ORDER[j];
  zeros packed the same way; w = (q - z) * s.
- GPTQ: a word holds 32 / b consecutive *inputs* of one output, field j input
  (32 / b) * row + j, which is MLX's affine packing transposed, so the words are reused
  as they are; zeros pack outputs the same way, stored as z - 1 ("checkpoint_format"
  "gptq", AutoGPTQ's) or z ("gptq_v2"). g_idx assigns inputs to groups: in order it is
  MLX's grouping; act-order (desc_act) groups are not contiguous, so their inputs are
  sorted by group and the layer (PermutedQuantizedLinear) gathers its input in that
  order: W x = W[:, order] x[order], exactly.
- BitNet: ternary t in {-1, 0, 1} stored as t + 1 in 2 bits, four output rows a byte:
  field k (bits 2k) of packed row r is output k * (out / 4) + r; w = t / weight_scale
  for linear_class "bitlinear" and t * weight_scale for "autobitlinear", as upstream.
  Upstream multiplies the float activations (transformers also rounds them to 8 bits
  per token), and so does this affine layout.
MLX's affine layout computes w = u * scale + bias, u the stored field, per group of 32,
64 or 128 inputs: a coarser group (a channel, 256) repeats its scale, exactly.

Two layouts need a layer of their own, made by add_scheme_layers after the model is
quantized, from the extra tensor the weights carry: `<layer>.input_order` (GPTQ
act-order) and `<layer>.global_scale` (NVFP4's second-level scale).

Upstream reads GPTQ's qweight as AWQ's (transposed, interleaved), refuses any g_idx,
and leaves NVFP4, MXFP4 and FP8 tensors to the families that rename them.
"""

import json
from functools import lru_cache
from pathlib import Path
from typing import Any, Callable, Dict, Optional, Tuple

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_unflatten

from . import compressed_tensors as ct
from . import fp_quant_schemes as fp

AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # the output column in each field of an AWQ word
GPTQ_BITS = (2, 4, 8)  # packings MLX shares (3-bit GPTQ fields straddle words)
GPTQ_ZERO_OFFSET = {"gptq": 1, "gptq_v2": 0}  # checkpoint_format -> what loading adds to stored zeros
BITNET_CLASSES = {"bitlinear": True, "autobitlinear": False}  # linear_class -> scale inverted
CT_FP4_FORMATS = {"nvfp4-pack-quantized": fp.NVFP4, "mxfp4-pack-quantized": fp.MXFP4}
LOADABLE = "awq, gptq, bitnet, modelopt (NVFP4), mxfp8, mxfp4, fp8 and compressed-tensors"

Params = Dict[str, Any]
Tensors = Dict[str, mx.array]
LayerRepack = Callable[[str, Tensors], Tuple[Tensors, Params]]


def hf_quantization_block(config: Dict[str, Any], model_path: Optional[Path] = None) -> Optional[Dict[str, Any]]:
    """The Hugging Face quantization_config (one with a "quant_method": top level, in
    text_config, or ModelOpt's hf_quant_config.json beside config.json), or None when
    the config already has MLX's "quantization" block or is not quantized."""
    if "quantization" in config:
        return None
    for section in (config, config.get("text_config") or {}):
        block = section.get("quantization_config")
        if isinstance(block, dict) and "quant_method" in block:
            return block
    sidecar = Path(model_path) / "hf_quant_config.json" if model_path is not None else None
    if sidecar is not None and sidecar.exists():
        try:
            block = json.loads(sidecar.read_text())
        except json.JSONDecodeError as e:
            raise ValueError(f"Malformed {sidecar}: {e}") from None
        if isinstance(block, dict) and isinstance(block.get("quantization"), dict):
            return dict(block, quant_method="modelopt")
    return None


def to_mlx(weights: Tensors, config: Dict[str, Any], model_path: Optional[Path] = None
           ) -> Tuple[Tensors, Dict[str, Any]]:
    """(weights, config) of a checkpoint in one of this module's schemes -> the same
    model in MLX's layout, the config's "quantization" block giving each layer's
    parameters (compressed_tensors.with_mlx_quantization). Any other checkpoint comes
    back as it is; an unknown quant_method is refused by name."""
    block = hf_quantization_block(config, model_path)
    if block is None:
        return weights, config
    plan = _plan(block, weights)
    if plan is None:
        return weights, config
    suffixes, repack = plan
    grouped, rest = ct.split_layers(weights, suffixes)
    params: Dict[str, Params] = {}
    for path, tensors in sorted(grouped.items()):
        if suffixes[0] in tensors:  # the first suffix marks a quantized layer
            tensors, params[path] = repack(path, tensors)
        rest.update({f"{path}.{name}": value for name, value in tensors.items()})
    if not params:
        raise ValueError(f'config.json "quantization_config" says {block["quant_method"]!r}, but no weight is '
                         f"quantized that way (no *.{suffixes[0]}): the checkpoint does not match its config")
    return _drop(rest, DROPPED.get(block["quant_method"], ())), ct.with_mlx_quantization(config, params)


# Per-layer tensors a scheme stores that MLX has no use for: activation scales of W4A4.
DROPPED = {"modelopt": ("input_scale",), "compressed-tensors": ("input_global_scale",)}


def _drop(weights: Tensors, suffixes: Tuple[str, ...]) -> Tensors:
    return {k: v for k, v in weights.items() if k.rpartition(".")[2] not in suffixes}


def _plan(block: Dict[str, Any], weights: Tensors) -> Optional[Tuple[Tuple[str, ...], LayerRepack]]:
    """(the per-layer suffixes, the first marking a quantized layer; the layer repacker)
    for the scheme `block` names, or None where a family or compressed_tensors.py owns
    it. Settings this module cannot repack exactly are refused, naming the value."""
    method = block.get("quant_method")
    if method == "awq":
        return ("qweight", "qzeros", "scales"), _awq_repacker(block)
    if method == "gptq":
        return ("qweight", "qzeros", "scales", "g_idx"), _gptq_repacker(block)
    if method == "bitnet":
        return ("weight_scale", "weight"), _bitnet_repacker(block)
    if method == "modelopt":
        fp.modelopt_settings(block)
        return ("weight_scale", "weight", "weight_scale_2", "input_scale"), _modelopt_layer
    if method == "compressed-tensors":
        return _ct_fp4_plan(block)
    if method == "mxfp8" or (method == "mxfp4" and not any(k.endswith("_blocks") for k in weights)):
        params = fp.MXFP8 if method == "mxfp8" else fp.MXFP4  # gpt-oss's own *_blocks are its sanitize's
        return ("scales", "weight"), lambda path, t: (fp.repack_mx(path, t, params), dict(params))
    if method == "fp8" and fp.fp8_blocks_are_mxfp8(block):
        fp.check_fp8_block(block)
        return ("weight_scale_inv", "weight"), _fp8_layer
    if method in ("fp8", "mxfp4"):
        return None  # block-scaled fp8 (deepseek_v3, mimo_v2_flash) and gpt-oss MXFP4: the families'
    raise ValueError(f'config.json "quantization_config": quant_method {method!r} is not supported (loadable: '
                     f"{LOADABLE}); dequantize the checkpoint to float, then quantize it with mlx_lm.convert -q")


def pack_rows(values: mx.array, bits: int) -> mx.array:
    """(R, C) integers below 2^bits -> (R * bits / 32, C) uint32 words, field j of word
    w (bits b*j) holding row (32 / b) * w + j; transposed, MLX's affine packing."""
    per_word = 32 // bits
    fields = values.astype(mx.uint32).reshape(-1, per_word, values.shape[1])  # (words, per_word, C)
    words = fields[:, 0]
    for j in range(1, per_word):
        words = words | (fields[:, j] << (bits * j))
    return words


def mlx_words(values: mx.array, bits: int) -> mx.array:
    """(in, out) fields -> MLX's (out, in * bits / 32) words: packed, then transposed
    (the packed array is the smaller one to move)."""
    return mx.contiguous(pack_rows(values, bits).T)


def _affine(path: str, words: mx.array, scale: mx.array, zero: mx.array, width: int, bits: int
            ) -> Tuple[Tensors, Params]:
    """MLX affine tensors of w = (u - zero) * scale, scale and zero (out, groups)."""
    if width % scale.shape[1]:
        raise ValueError(f"{path}: {scale.shape[1]} scale groups do not divide its {width} inputs")
    group_size = ct.mlx_group_size(path, width // scale.shape[1])
    scales, biases = ct.affine_scales_and_biases(scale, zero, width // scale.shape[1] // group_size)
    return {"weight": words, "scales": scales, "biases": biases}, {"group_size": group_size, "bits": bits,
                                                                    "mode": "affine"}


def _check_int32(path: str, tensors: Tensors, names: Tuple[str, ...]) -> None:
    missing = [n for n in names if n not in tensors]
    if missing:
        raise ValueError(f"{path}: a packed layer needs {', '.join(names)}; missing {', '.join(missing)}")
    for name in names:
        t = tensors[name]
        if name != "scales" and (t.dtype not in (mx.int32, mx.uint32) or t.ndim != 2):
            raise ValueError(f"{path}.{name}: {t.dtype} {tuple(t.shape)}; expected a 2-D int32 packing")


def _awq_repacker(block: Dict[str, Any]) -> LayerRepack:
    where = 'config.json "quantization_config" (awq)'
    version, bits = str(block.get("version", "gemm")).lower(), block.get("bits", block.get("w_bit", 4))
    if version != "gemm":
        raise ValueError(f"{where}: version {block.get('version')!r}; only AutoAWQ's GEMM layout (\"gemm\") "
                         "repacks to MLX")
    if bits != 4:
        raise ValueError(f"{where}: bits {bits!r}; AWQ's interleaved packing is 4-bit")
    return repack_awq


def _awq_columns(packed: mx.array) -> mx.array:
    """AWQ words (R, C / 8) -> (R, C) fields, in column order."""
    shifts = mx.array([4 * AWQ_ORDER.index(k) for k in range(8)], mx.uint32)  # column 8c + k of word c
    fields = (packed.view(mx.uint32)[..., None] >> shifts) & 0xF  # (R, C / 8, 8): one op, written in order
    return fields.reshape(packed.shape[0], -1)


def repack_awq(path: str, tensors: Tensors) -> Tuple[Tensors, Params]:
    """One AutoAWQ GEMM layer {qweight, qzeros?, scales} -> MLX affine 4-bit."""
    _check_int32(path, tensors, ("qweight", "scales"))
    qweight, scale = tensors["qweight"], tensors["scales"]
    width, columns = qweight.shape[0], qweight.shape[1] * 8
    if scale.ndim != 2 or scale.shape[1] != columns:
        raise ValueError(f"{path}.scales {tuple(scale.shape)} is not (groups, {columns}) for qweight "
                         f"{tuple(qweight.shape)}")
    groups = scale.shape[0]
    zero = tensors.get("qzeros")
    if zero is None:  # no zero points stored: the symmetric midpoint
        zero_points = mx.full((columns, groups), 8, mx.uint32)
    elif zero.shape != (groups, columns // 8):
        raise ValueError(f"{path}.qzeros {tuple(zero.shape)} is not ({groups}, {columns // 8})")
    else:
        zero_points = mx.contiguous(_awq_columns(zero).T)
    return _affine(path, mlx_words(_awq_columns(qweight), 4), mx.contiguous(scale.T), zero_points, width, 4)


def _gptq_repacker(block: Dict[str, Any]) -> LayerRepack:
    where = 'config.json "quantization_config" (gptq)'
    bits, fmt = block.get("bits", 4), block.get("checkpoint_format", "gptq")
    if bits not in GPTQ_BITS:
        raise ValueError(f"{where}: bits {bits!r}; MLX's packing matches GPTQ's for {list(GPTQ_BITS)} bits only")
    if fmt not in GPTQ_ZERO_OFFSET:
        raise ValueError(f"{where}: checkpoint_format {fmt!r}; supported: {', '.join(GPTQ_ZERO_OFFSET)}")
    group_size = block.get("group_size", 128)
    return lambda path, tensors: repack_gptq(path, tensors, bits, GPTQ_ZERO_OFFSET[fmt], group_size)


def repack_gptq(path: str, tensors: Tensors, bits: int, zero_offset: int, group_size: int = -1
                ) -> Tuple[Tensors, Params]:
    """One GPTQ layer {qweight, qzeros, scales, g_idx?} -> MLX affine `bits`-bit."""
    _check_int32(path, tensors, ("qweight", "qzeros", "scales"))
    qweight, zero, scale = tensors["qweight"], tensors["qzeros"], tensors["scales"]
    per_word = 32 // bits
    width, columns = qweight.shape[0] * per_word, qweight.shape[1]
    groups = scale.shape[0] if scale.ndim == 2 else 0
    if scale.ndim != 2 or scale.shape[1] != columns or zero.shape != (groups, -(-columns // per_word)):
        raise ValueError(f"{path}: scales {tuple(scale.shape)} and qzeros {tuple(zero.shape)} do not fit a "
                         f"{bits}-bit qweight {tuple(qweight.shape)} ({width} inputs, {columns} outputs)")
    if group_size not in (-1, None) and groups * group_size != width:
        raise ValueError(f"{path}: {groups} scale groups of {width} inputs, but the config says group_size "
                         f"{group_size}")
    zero_points = ct.unpack_rows(mx.contiguous(zero.T), bits, columns) + zero_offset  # (columns, groups)
    order = _act_order(path, tensors.get("g_idx"), width, groups)
    if order is None:
        words = mx.contiguous(qweight.T).view(mx.uint32)  # (columns, width / per_word): MLX's order already
        return _affine(path, words, mx.contiguous(scale.T), zero_points, width, bits)
    fields = mx.take(ct.unpack_rows(qweight, bits, width), order, axis=0)  # (width, columns), sorted by group
    tensors, params = _affine(path, mlx_words(fields, bits), mx.contiguous(scale.T), zero_points, width, bits)
    return dict(tensors, input_order=order), params


def _act_order(path: str, g_idx: Optional[mx.array], width: int, groups: int) -> Optional[mx.array]:
    """None when g_idx (each input's group) is absent or in order, else the inputs
    sorted by group (uint32): act-order. Each group must hold width / groups inputs."""
    in_order = mx.arange(width) // (width // groups)
    if g_idx is None or mx.array_equal(g_idx, in_order).item():
        return None
    if g_idx.shape != (width,):
        raise ValueError(f"{path}.g_idx {tuple(g_idx.shape)} is not one group per input ({width},)")
    order = mx.argsort(g_idx).astype(mx.uint32)
    if not mx.array_equal(g_idx[order], in_order).item():
        raise ValueError(f"{path}.g_idx puts unequal numbers of inputs in its {groups} groups; MLX's groups "
                         f"are {width // groups} inputs each")
    return order


class PermutedQuantizedLinear(fp.SchemeQuantizedLinear):
    """Affine weights over the input gathered in `input_order` (uint32): GPTQ
    act-order, whose groups are inputs scattered over the row."""

    MODE = "affine"

    def __init__(self, *args: Any):
        super().__init__(*args)
        self.input_order = mx.arange(self.weight.shape[1] * 32 // self.bits, dtype=mx.uint32)

    def dequantized_weight(self) -> mx.array:
        weight = mx.dequantize(self.weight, self.scales, self.biases, self.group_size, self.bits)
        return weight[:, mx.argsort(self.input_order)]  # column k is input input_order[k]

    def __call__(self, x: mx.array) -> mx.array:
        y = self.matmul(mx.take(x, self.input_order, axis=-1))  # columns in group order
        return y + self.bias if "bias" in self else y


# extra tensor of a layer in MLX's layout -> the layer class that holds it
SCHEME_LAYERS = {"input_order": PermutedQuantizedLinear, fp.GLOBAL_SCALE: fp.GlobalScaledQuantizedLinear}


def add_scheme_layers(model: nn.Module, weights: Tensors) -> None:
    """Make every quantized layer whose (sanitized) weights carry one of SCHEME_LAYERS'
    tensors that layer class, so the tensor has a place to load into."""
    modules = dict(model.named_modules())
    replaced = []
    for name in sorted(weights):
        path, _, suffix = name.rpartition(".")
        layer_class = SCHEME_LAYERS.get(suffix)
        layer = modules.get(path)
        if layer_class is None or isinstance(layer, layer_class) or (layer is not None and suffix in layer):
            continue  # nothing to add, or the layer holds it already (MLX's expert stacks' global_scale)
        if not isinstance(layer, nn.QuantizedLinear):
            raise ValueError(f"The weights hold {name} but {path} is "
                             f"{'missing' if layer is None else type(layer).__name__}; only a quantized linear "
                             "layer takes one (not an expert stack)")
        try:
            replaced.append((path, layer_class.from_quantized(layer)))
        except ValueError as e:
            raise ValueError(f"The weights hold {name}, but {e}") from None
    if replaced:
        model.update_modules(tree_unflatten(replaced))


def _bitnet_repacker(block: Dict[str, Any]) -> LayerRepack:
    where = 'config.json "quantization_config" (bitnet)'
    linear_class, mode = block.get("linear_class", "bitlinear"), block.get("quantization_mode", "offline")
    if linear_class not in BITNET_CLASSES:
        raise ValueError(f"{where}: linear_class {linear_class!r}; supported: {', '.join(BITNET_CLASSES)}")
    if mode != "offline":
        raise ValueError(f"{where}: quantization_mode {mode!r}; only offline (packed ternary weights) loads")
    return lambda path, tensors: repack_bitnet(path, tensors, invert_scale=BITNET_CLASSES[linear_class])


def repack_bitnet(path: str, tensors: Tensors, *, invert_scale: bool) -> Tuple[Tensors, Params]:
    """One packed BitLinear {weight uint8 (out / 4, in), weight_scale} -> MLX affine
    2-bit: u = t + 1 is the stored field, scale s and bias -s."""
    packed, weight_scale = tensors.get("weight"), tensors["weight_scale"]
    if packed is None or packed.dtype != mx.uint8 or packed.ndim != 2 or weight_scale.size != 1:
        raise ValueError(f"{path}: weight {None if packed is None else (packed.dtype, tuple(packed.shape))} and "
                         f"weight_scale {tuple(weight_scale.shape)} are not BitNet's packed uint8 ternary weight "
                         "with one scale")
    by_input = mx.contiguous(packed.T)  # (in, out / 4): the small array is the one transposed
    fields = mx.concatenate([(by_input >> (2 * k)) & 3 for k in range(4)], axis=1)  # (in, out): k * out/4 + r
    value = weight_scale.astype(mx.float32).reshape(1, 1)
    scale = (1 / value if invert_scale else value).astype(weight_scale.dtype)
    scale = mx.broadcast_to(scale, (fields.shape[1], 1))
    return _affine(path, mlx_words(fields, 2), scale, mx.ones(scale.shape, mx.uint32), packed.shape[1], 2)


def _modelopt_layer(path: str, tensors: Tensors) -> Tuple[Tensors, Params]:
    if "weight_scale_2" not in tensors:
        raise ValueError(f"{path}: an NVFP4 layer needs weight_scale_2 (its second-level scale); missing")
    return (fp.repack_fp4(path, tensors["weight"], tensors["weight_scale"], fp.NVFP4, tensors["weight_scale_2"]),
            dict(fp.NVFP4))


def _fp8_layer(path: str, tensors: Tensors) -> Tuple[Tensors, Params]:
    return fp.repack_fp8_blocks(path, tensors["weight"], tensors["weight_scale_inv"]), dict(fp.MXFP8)


def _ct_fp4_plan(block: Dict[str, Any]) -> Optional[Tuple[Tuple[str, ...], LayerRepack]]:
    """compressed-tensors' FP4 formats (its packed integers are compressed_tensors.py's)."""
    groups = block.get("config_groups") or {}
    formats = {g.get("format") or block.get("format") for g in groups.values()} if isinstance(groups, dict) else set()
    fp4 = formats & set(CT_FP4_FORMATS)
    if not fp4:
        return None
    where = 'config.json "quantization_config" (compressed-tensors)'
    if len(formats) != 1:
        raise ValueError(f"{where}: config_groups mix the formats {sorted(map(str, formats))}; one format a "
                         "checkpoint loads")
    if block.get("kv_cache_scheme"):
        raise ValueError(f"{where}: kv_cache_scheme {block['kv_cache_scheme']!r} quantizes the KV cache, which "
                         "this package does not; remove it to run the cache in float")
    params = CT_FP4_FORMATS[fp4.pop()]

    def repack(path: str, tensors: Tensors) -> Tuple[Tensors, Params]:
        global_scale = tensors.get("weight_global_scale")
        multiplier = None if global_scale is None else 1 / global_scale.astype(mx.float32)  # the format divides
        return fp.repack_fp4(path, tensors["weight_packed"], tensors["weight_scale"], params, multiplier), \
            dict(params)

    return ("weight_packed", "weight_scale", "weight_global_scale", "input_global_scale"), repack


# Modes whose activations can be quantized too, as upstream's `quantize_activations`
# (nn.QQLinear, mx.qqmm) does: the input rounded to the weight's own format per group.
ACTIVATION_MODES = ("nvfp4", "mxfp8")


def round_to_mode(x: mx.array, group_size: int, bits: int, mode: str) -> mx.array:
    """(..., D) -> (..., D): x rounded to `mode`'s elements and scales in groups of
    `group_size` along its last axis, in x's dtype."""
    quantized = mx.quantize(x, group_size, bits, mode=mode)
    return mx.dequantize(*quantized, group_size=group_size, bits=bits, mode=mode, dtype=x.dtype)


@lru_cache(maxsize=None)
def _activation_quantized_class(cls: type) -> type:
    def __call__(self, x: mx.array) -> mx.array:
        return cls.__call__(self, round_to_mode(x, self.group_size, self.bits, self.mode))

    doc = f"{cls.__name__} whose input is first rounded as its weight is (quant_schemes.quantize_activations)."
    return type(f"ActivationQuantized{cls.__name__}", (cls,), {"__call__": __call__, "__doc__": doc})


def quantize_activations(model: nn.Module) -> None:
    """Round every nvfp4 or mxfp8 linear layer's input to the layer's own format first
    (config "quantize_activations", upstream's --quantize-activations), in place: the
    instance becomes a subclass of its class, so its tensors and isinstance checks
    stay. This is what nn.QQLinear computes with mx.qqmm (equal, bit for bit, where
    MLX's CPU backend runs qqmm: one row), here through mx.quantized_matmul, which
    every backend runs for any shape; it does not use FP4/FP8 matrix units. Float
    layers stay float; a quantized layer of another mode is refused, naming it."""
    layers = [(path, m) for path, m in sorted(model.named_modules(), key=lambda item: item[0])
              if isinstance(m, (nn.QuantizedLinear, fp.SchemeQuantizedLinear))]
    for path, layer in layers:
        if layer.mode not in ACTIVATION_MODES:
            raise ValueError(f"quantize_activations: {path} has mode {layer.mode!r}; activations quantize only "
                             f"in {' and '.join(ACTIVATION_MODES)} layers (load without quantize_activations)")
    for _, layer in layers:
        if not type(layer).__name__.startswith("ActivationQuantized"):
            layer.__class__ = _activation_quantized_class(type(layer))
