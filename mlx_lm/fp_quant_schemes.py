"""Floating point quantization schemes of Hugging Face checkpoints, repacked at load
into MLX's microscaling modes (`mx.quantize` modes "nvfp4", "mxfp4", "mxfp8"), which
compute w = element * scale per group with the same element and scale encodings:

- NVFP4 (NVIDIA ModelOpt "quant_algo" "NVFP4"; compressed-tensors
  "nvfp4-pack-quantized"): E2M1 elements, two a byte (element 2i in the low nibble),
  weight (out, in / 2) uint8; E4M3 scales per 16 inputs, (out, in / 16); and a
  float32 second-level scale per layer: ModelOpt's `weight_scale_2` multiplies,
  compressed-tensors' `weight_global_scale` divides. MLX's nvfp4 layout is the same
  bytes read as uint32 words (element j of a word at bits 4j), the scales the same
  bytes; MLX's quantized matmul takes no second-level scale, so a layer with one
  becomes a GlobalScaledQuantizedLinear (its output times that scale).
- MXFP4 (compressed-tensors "mxfp4-pack-quantized"): E2M1 elements as above, E8M0
  scales (uint8) per 32 inputs: MLX's mxfp4 as it is.
- MXFP8 ("quant_method" "mxfp8"): E4M3 elements, E8M0 scales per 32 inputs, saved as
  MLX names them (`weight`, as uint32 words or one byte an element, and `scales`).
- FP8 with power-of-two scales ("quant_method" "fp8", "scale_fmt" "ue8m0",
  "weight_block_size" [32, 32]): E4M3 weight (out, in) and one scale per 32 x 32
  block (`weight_scale_inv`, float powers of two or E8M0 bytes). A block's scale
  repeated over its 32 rows is MLX's mxfp8, exactly.

Activations run in the model's float dtype (the input scales NVFP4 checkpoints carry
for 4-bit activations are dropped), as upstream mlx-lm 0.32.2 runs them.
"""

from typing import Any, Dict, Optional, Tuple

import mlx.core as mx
import mlx.nn as nn

NVFP4 = {"group_size": 16, "bits": 4, "mode": "nvfp4"}
MXFP4 = {"group_size": 32, "bits": 4, "mode": "mxfp4"}
MXFP8 = {"group_size": 32, "bits": 8, "mode": "mxfp8"}
FP8_BLOCK = [32, 32]  # the only block whose power-of-two scales are an MLX mode (mxfp8)
GLOBAL_SCALE = "global_scale"  # the MLX-layout name of a layer's second-level scale
# mx.quantize / mx.dequantize's nvfp4 global_scale g multiplies by g / (448 * 6) (E4M3's
# largest scale times E2M1's largest element): stored that way, as MLX's expert layers do.
NVFP4_GLOBAL_SCALE_DIVISOR = 448 * 6


class SchemeQuantizedLinear(nn.Module):
    """A quantized linear layer (MLX's weight, scales and, for affine, biases, named and
    shaped as nn.QuantizedLinear's) with one more tensor a checkpoint's scheme needs.
    Not an nn.QuantizedLinear on purpose: code that dequantizes one would drop that
    tensor. Subclasses name their MODE and add the tensor and the forward."""

    MODE = ""

    def __init__(self, input_dims: int, output_dims: int, bias: bool, group_size: int, bits: int):
        super().__init__()
        self.group_size, self.bits, self.mode = group_size, bits, self.MODE
        self.weight = mx.zeros((output_dims, input_dims * bits // 32), mx.uint32)
        scale_dtype = mx.float32 if self.MODE == "affine" else mx.uint8  # microscaling scales are 8-bit codes
        self.scales = mx.zeros((output_dims, input_dims // group_size), scale_dtype)
        if self.MODE == "affine":
            self.biases = mx.zeros_like(self.scales)
        if bias:
            self.bias = mx.zeros((output_dims,))

    @classmethod
    def from_quantized(cls, layer: nn.QuantizedLinear) -> "SchemeQuantizedLinear":
        """The empty layer of this class in `layer`'s shape (its tensors are loaded next)."""
        if layer.mode != cls.MODE:
            raise ValueError(f"a {cls.__name__} is {cls.MODE}-quantized; this layer is {layer.mode}")
        output_dims, packed = layer.weight.shape
        made = cls(packed * 32 // layer.bits, output_dims, "bias" in layer, layer.group_size, layer.bits)
        made.freeze()
        return made

    def dequantized_weight(self) -> mx.array:
        """(out, in): the float weight this layer applies."""
        raise NotImplementedError(f"{type(self).__name__} does not say how it dequantizes")

    def to_float(self) -> nn.Linear:
        """The float layer this one computes (utils' dequantize_model)."""
        weight = self.dequantized_weight()
        layer = nn.Linear(weight.shape[1], weight.shape[0], bias="bias" in self)
        layer.weight = weight
        if "bias" in self:
            layer.bias = self.bias
        return layer

    def matmul(self, x: mx.array) -> mx.array:
        return mx.quantized_matmul(x, self.weight, scales=self.scales, biases=self.get("biases"), transpose=True,
                                   group_size=self.group_size, bits=self.bits, mode=self.mode)


class GlobalScaledQuantizedLinear(SchemeQuantizedLinear):
    """nvfp4 weights whose product is multiplied by one float32 second-level scale
    before the bias (`global_scale` / NVFP4_GLOBAL_SCALE_DIVISOR, as mx.dequantize reads
    it), which mx.quantized_matmul does not take."""

    MODE = "nvfp4"

    def __init__(self, *args: Any):
        super().__init__(*args)
        self.global_scale = mx.ones((1,), mx.float32)

    def dequantized_weight(self) -> mx.array:
        return mx.dequantize(self.weight, self.scales, None, self.group_size, self.bits, mode=self.mode,
                             global_scale=self.global_scale)

    def __call__(self, x: mx.array) -> mx.array:
        # In float32, then the activations' dtype: one rounding, as a scale folded into the weight would give.
        y = (self.matmul(x).astype(mx.float32) * (self.global_scale / NVFP4_GLOBAL_SCALE_DIVISOR)).astype(x.dtype)
        return y + self.bias if "bias" in self else y


def e8m0_from_powers_of_two(where: str, scales: mx.array) -> mx.array:
    """Float scales that are exact powers of two (or already E8M0 bytes) -> E8M0 bytes
    (the float32 exponent field). Anything else has no E8M0 value: ValueError."""
    if scales.dtype == mx.uint8:
        return scales
    bits = scales.astype(mx.float32).view(mx.uint32)
    exponent, mantissa, sign = (bits >> 23) & 0xFF, bits & 0x7FFFFF, bits >> 31
    bad = (mantissa != 0) | (sign != 0) | (exponent == 0) | (exponent == 0xFF)
    if mx.any(bad).item():
        first = scales.reshape(-1)[mx.argmax(bad.reshape(-1)).item()].item()
        raise ValueError(f"{where}: scale {first!r} is not a positive power of two, which \"scale_fmt\" \"ue8m0\" "
                         "promises; such a checkpoint has no exact MLX layout")
    return exponent.astype(mx.uint8)


def _check_fp4_layer(path: str, weight: mx.array, scales: mx.array, group_size: int) -> None:
    if weight.dtype != mx.uint8 or weight.ndim != 2 or scales.dtype != mx.uint8:
        raise ValueError(f"{path}: weight {weight.dtype} {tuple(weight.shape)} and scales {scales.dtype} are not "
                         "FP4 elements two a byte (uint8) with 8-bit scales")
    width = weight.shape[1] * 2
    if scales.shape != (weight.shape[0], width // group_size) or width % group_size:
        raise ValueError(f"{path}: scales {tuple(scales.shape)} are not one per {group_size} inputs of a "
                         f"({weight.shape[0]}, {width}) weight")


def repack_fp4(path: str, weight: mx.array, scales: mx.array, params: Dict[str, Any],
               global_scale: Optional[mx.array] = None) -> Dict[str, mx.array]:
    """One FP4 layer (uint8 elements two a byte, 8-bit scales, an optional float32
    multiplier `global_scale`) -> MLX's tensors for `params` (NVFP4 or MXFP4)."""
    _check_fp4_layer(path, weight, scales, params["group_size"])
    if weight.shape[1] % 4:
        raise ValueError(f"{path}: {weight.shape[1] * 2} inputs do not fill whole 32-bit words of FP4 elements")
    tensors = {"weight": mx.contiguous(weight).view(mx.uint32), "scales": scales}
    if global_scale is not None:
        if global_scale.size != 1:
            raise ValueError(f"{path}: a second-level scale of shape {tuple(global_scale.shape)}; one value a layer")
        multiplier = global_scale.astype(mx.float32).reshape(1)
        if multiplier.item() != 1.0:  # a unit scale needs no layer of its own
            tensors[GLOBAL_SCALE] = multiplier * NVFP4_GLOBAL_SCALE_DIVISOR
    return tensors


def repack_mx(path: str, tensors: Dict[str, mx.array], params: Dict[str, Any]) -> Dict[str, mx.array]:
    """A layer saved in MLX's names under an HF "mxfp8"/"mxfp4" config: `weight` as
    uint32 words or uint8 bytes (one E4M3 or two E2M1 elements each), `scales` E8M0."""
    weight, scales = tensors["weight"], tensors["scales"]
    if scales.dtype != mx.uint8 or weight.dtype not in (mx.uint8, mx.uint32) or weight.ndim != 2:
        raise ValueError(f"{path}: weight {weight.dtype} {tuple(weight.shape)}, scales {scales.dtype}: "
                         f"{params['mode']} keeps packed uint32 (or uint8) elements and uint8 E8M0 scales")
    bytes_per_word = 4 if weight.dtype == mx.uint8 else 1
    if weight.shape[1] % bytes_per_word:
        raise ValueError(f"{path}: {weight.shape[1]} bytes a row do not fill whole 32-bit words")
    words = mx.contiguous(weight).view(mx.uint32)
    width = words.shape[1] * 32 // params["bits"]
    if scales.shape != (words.shape[0], width // params["group_size"]):
        raise ValueError(f"{path}: scales {tuple(scales.shape)} are not one per {params['group_size']} inputs of "
                         f"a ({words.shape[0]}, {width}) {params['mode']} weight")
    return {"weight": words, "scales": scales}


def repack_fp8_blocks(path: str, weight: mx.array, block_scales: mx.array) -> Dict[str, mx.array]:
    """E4M3 weight (out, in) uint8 with one power-of-two scale per 32 x 32 block
    (ceil(out / 32), in / 32) -> MLX mxfp8: the words as they are, each block's E8M0
    scale repeated over its rows."""
    rows, width = weight.shape
    block_rows = -(-rows // FP8_BLOCK[0])
    if weight.dtype != mx.uint8 or width % FP8_BLOCK[1] or block_scales.shape != (block_rows, width // FP8_BLOCK[1]):
        raise ValueError(f"{path}: weight {weight.dtype} {tuple(weight.shape)} with block scales "
                         f"{tuple(block_scales.shape)} is not E4M3 in {FP8_BLOCK[0]} x {FP8_BLOCK[1]} blocks "
                         f"(scales ({block_rows}, {width // FP8_BLOCK[1]}))")
    scales = mx.repeat(e8m0_from_powers_of_two(f"{path}.weight_scale_inv", block_scales), FP8_BLOCK[0], axis=0)
    return {"weight": mx.contiguous(weight).view(mx.uint32), "scales": scales[:rows]}


def fp8_blocks_are_mxfp8(block: Dict[str, Any]) -> bool:
    """Whether an "fp8" quantization_config is the one upstream reads as mxfp8 (its
    other fp8 checkpoints are the families' to dequantize)."""
    return (block.get("quant_method") == "fp8" and block.get("scale_fmt") == "ue8m0"
            and list(block.get("weight_block_size") or ()) == FP8_BLOCK)


def check_fp8_block(block: Dict[str, Any]) -> None:
    fmt = block.get("fmt", "e4m3")
    if fmt != "e4m3":
        raise ValueError(f'config.json "quantization_config" (fp8): fmt {fmt!r}; MLX\'s mxfp8 holds e4m3 elements')


def modelopt_settings(block: Dict[str, Any]) -> Tuple[Dict[str, Any], str]:
    """(the settings, where they were read) of a ModelOpt block: hf_quant_config.json
    nests them under "quantization", config.json does not."""
    settings = block.get("quantization", block)
    where = 'ModelOpt "quantization"'
    algo = settings.get("quant_algo")
    if algo != "NVFP4":
        raise ValueError(f"{where}: quant_algo {algo!r}; only NVFP4 (4-bit E2M1 weights) has an MLX mode")
    group_size = settings.get("group_size", NVFP4["group_size"])
    if group_size != NVFP4["group_size"]:
        raise ValueError(f"{where}: group_size {group_size!r}; NVFP4 scales groups of 16")
    if settings.get("kv_cache_quant_algo"):
        raise ValueError(f"{where}: kv_cache_quant_algo {settings['kv_cache_quant_algo']!r} quantizes the KV "
                         "cache, which this package does not; set it to null to run the cache in float")
    return settings, where
