"""MLX quantization: the config block, quantized checkpoints' layers, quantizing a model
and undoing it."""

from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional, Protocol, Tuple, Union, runtime_checkable

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten, tree_unflatten

from .fp_quant_schemes import SchemeQuantizedLinear
from .models.switch_layers import QuantizedSwitchLinear, SwitchLinear

# ---------------------------------------------------------------------------
# Quantization: the config block, loading quantized checkpoints, making them.
#
# config["quantization"] = {"group_size": G, "bits": B, "mode": M, <path>: override}
# where an override is `false` (the layer stays float) or a dict passed to the layer's
# `to_quantized` (MLX semantics: a missing "mode" is "affine" and a missing group size or
# bits is that mode's default). Older MLX checkpoints name the block
# "quantization_config"; a "quantization_config" with a "quant_method" is a Hugging Face
# quantization scheme instead, which only a model that knows it can read (gpt-oss MXFP4) or
# compressed_tensors.py repacks (llm-compressor's pack-quantized integers).

# mode -> (group sizes, bits) MLX accepts for it; the first of each is the default.
QUANT_MODES: Dict[str, Tuple[Tuple[int, ...], Tuple[int, ...]]] = {
    "affine": ((64, 32, 128), (4, 2, 3, 5, 6, 8)),
    "mxfp4": ((32,), (4,)),
    "mxfp8": ((32,), (8,)),
    "nvfp4": ((16,), (4,)),
}
_BLOCK_PARAMS = ("group_size", "bits", "mode")


def quant_params(
    group_size: Optional[int] = None, bits: Optional[int] = None, mode: str = "affine",
    global_scale: bool = False, *, where: str,
) -> Dict[str, Any]:
    """Complete, validated {"group_size", "bits", "mode"} (and "global_scale": True, for
    nvfp4 experts with a tensor scale each); a value left None takes the mode's default.
    `where` names the source in the error message."""
    if global_scale not in (True, False):
        raise ValueError(f"{where}: global_scale must be true or false, got {global_scale!r}")
    if global_scale and mode != "nvfp4":
        raise ValueError(f"{where}: global_scale is nvfp4's per-expert tensor scale; mode {mode!r} has none")
    if mode not in QUANT_MODES:
        raise ValueError(f"{where}: unsupported quantization mode {mode!r}; choose from {', '.join(QUANT_MODES)}")
    group_sizes, bit_widths = QUANT_MODES[mode]
    group_size = group_sizes[0] if group_size is None else group_size
    bits = bit_widths[0] if bits is None else bits
    if type(bits) is not int or bits not in bit_widths:
        raise ValueError(f"{where}: {mode} quantization supports bits {sorted(bit_widths)}, got {bits!r}")
    if type(group_size) is not int or group_size not in group_sizes:
        raise ValueError(f"{where}: {mode} quantization supports group sizes {sorted(group_sizes)}, got {group_size!r}")
    params = {"group_size": group_size, "bits": bits, "mode": mode}
    return dict(params, global_scale=True) if global_scale else params


@dataclass
class QuantizationSpec:
    """A parsed quantization block: the default parameters and per-layer overrides
    (None = keep that layer in float)."""

    default: Dict[str, Any]
    overrides: Dict[str, Optional[Dict[str, Any]]]

    def params_for(self, path: str) -> Optional[Dict[str, Any]]:
        return self.overrides.get(path, self.default)


def read_quantization(config: Dict[str, Any]) -> Optional[QuantizationSpec]:
    """The MLX quantization block of a config, validated; None for a float checkpoint."""
    key = "quantization"
    block = config.get(key)
    legacy = config.get("quantization_config")
    if block is None and isinstance(legacy, dict) and "quant_method" not in legacy:
        key, block = "quantization_config", legacy
    if block is None:
        return None
    if not isinstance(block, dict):
        raise ValueError(f'config.json "{key}" must be a JSON object, got {block!r}')
    where = f'config.json "{key}"'
    default = quant_params(block.get("group_size"), block.get("bits"), block.get("mode", "affine"), where=where)
    overrides: Dict[str, Optional[Dict[str, Any]]] = {}
    for path, value in block.items():
        if path in _BLOCK_PARAMS or path == "quant_method":
            continue
        if value is False:
            overrides[path] = None
        elif value is True:
            overrides[path] = default
        elif isinstance(value, dict):
            overrides[path] = quant_params(
                value.get("group_size"), value.get("bits"), value.get("mode", "affine"),
                value.get("global_scale", False), where=f"{where}[{path!r}]",
            )
        else:
            raise ValueError(
                f"{where}: entry {path!r} = {value!r} is neither a quantization parameter "
                f"({', '.join(_BLOCK_PARAMS)}) nor a per-layer override (false, or an object with group_size and bits)"
            )
    return QuantizationSpec(default, overrides)


@runtime_checkable
class Quantizable(Protocol):
    """MLX's protocol for a layer with a quantized counterpart (Linear, Embedding,
    SwitchLinear): `to_quantized` returns it. Such layers keep their matrix in `weight`,
    quantized along its last (input) axis."""

    def to_quantized(self, group_size: int, bits: int, mode: str) -> nn.Module: ...


def infer_quant_config(path: str, module: nn.Module, weights: Dict[str, mx.array]) -> Dict[str, Any]:
    """{"group_size", "bits", "mode"} of the quantized `<path>.weight` and `.scales` in
    `weights`, read from their widths against `module`'s float input width: bits =
    32 * packed width / width, group size = width / scales width; uint8 scales mean a
    microscaling mode (mxfp4, mxfp8 or nvfp4, told apart by those two), other scales
    affine. Raises ValueError when no mode packs the layer that way."""
    width = module.weight.shape[-1]
    packed, scales = weights[f"{path}.weight"], weights[f"{path}.scales"]
    bits, group_size = 32 * packed.shape[-1] // width, width // scales.shape[-1]
    modes = [m for m in QUANT_MODES if (m == "affine") == (scales.dtype != mx.uint8)]
    for mode in modes:
        group_sizes, bit_widths = QUANT_MODES[mode]
        if group_size in group_sizes and bits in bit_widths and packed.shape[-1] * 32 == width * bits:
            return {"group_size": group_size, "bits": bits, "mode": mode}
    raise ValueError(
        f"{path}: packed weight width {packed.shape[-1]} and scales width {scales.shape[-1]} ({scales.dtype}) "
        f"of input width {width} are no quantization mode's ({', '.join(modes)})"
    )


def _check_quantized_tensors(path: str, module: nn.Module, weights: Dict[str, mx.array], params: Dict[str, Any]):
    """The checkpoint's packed weight and scales must be what `params` make of this layer."""
    if not isinstance(module, Quantizable) or "weight" not in module:
        raise ValueError(
            f"The weights hold {path}.scales but {path} is a {type(module).__name__}, which has no quantized form"
        )
    if params.get("global_scale") and not isinstance(module, SwitchLinear):
        raise ValueError(f"{path}: a per-expert global_scale is for expert layers; {path} is a {type(module).__name__}")
    width, group_size, bits = module.weight.shape[-1], params["group_size"], params["bits"]
    if width % group_size:
        raise ValueError(
            f"{path}: quantization group_size {group_size} does not divide its input width {width}; "
            f"set a group size that does for this layer in config.json \"quantization\""
        )
    want = {"weight": width * bits // 32, "scales": width // group_size}
    got = {name: weights[f"{path}.{name}"].shape[-1] for name in want if f"{path}.{name}" in weights}
    if any(got[name] != want[name] for name in got):
        raise ValueError(
            f"{path}: the checkpoint's quantized tensors (last dims {got}) are not {bits}-bit, group size "
            f"{group_size} quantization of input width {width} (which gives {want}); the config's quantization "
            "parameters disagree with the weights"
        )


def quantize_from_weights(model: nn.Module, weights: Dict[str, mx.array], spec: Optional[QuantizationSpec]) -> None:
    """Make quantized exactly the layers whose `<path>.scales` the (sanitized) weights
    hold and the model does not already hold quantized, with `spec`'s parameters.
    Raises ValueError when config and weights disagree."""
    existing = {k for k, _ in tree_flatten(model.parameters())}
    pending = sorted(k[: -len(".scales")] for k in weights if k.endswith(".scales") and k not in existing)
    if spec is None:
        if pending:
            raise ValueError(
                f"The weights hold quantized layers ({pending[0]}.scales and {len(pending) - 1} more) but "
                'config.json has no "quantization" block; add one, e.g. "quantization": '
                '{"group_size": 64, "bits": 4}, matching how they were quantized (a Hugging Face '
                "scheme such as AWQ or GPTQ is read from its own quantization_config: quant_schemes.py)"
            )
        return
    if not any(k.endswith(".scales") for k in weights):
        raise ValueError(
            f'config.json has a "quantization" block ({spec.default}) but no weight has .scales: the '
            "checkpoint is not quantized; remove the block or use the quantized weights"
        )
    plan = {}
    for path in pending:
        params = spec.params_for(path)
        if params is None:
            raise ValueError(
                f'config.json "quantization" keeps {path} in float (false) but the weights hold {path}.scales'
            )
        plan[path] = params

    def predicate(path: str, module: nn.Module) -> Union[bool, Dict[str, Any]]:
        if path not in plan:
            return False
        params = dict(plan[path])
        if isinstance(module, SwitchLinear) and f"{path}.global_scale" in weights:
            params["global_scale"] = True  # as upstream: the tensor says so where the config may not
        _check_quantized_tensors(path, module, weights, params)
        return params

    nn.quantize(model, class_predicate=predicate)


@runtime_checkable
class HasQuantPredicate(Protocol):
    """A model that chooses per layer how it is quantized (MoE routers at 8 bits, say):
    True (the default parameters), False (keep float) or a dict for `to_quantized`.
    Dense models do not implement it and every quantizable layer is quantized."""

    def quant_predicate(self, path: str, module: nn.Module) -> Union[bool, Dict[str, Any]]: ...


QuantPredicate = Callable[[str, nn.Module], Union[bool, Dict[str, Any]]]


def quantized_layers(model: nn.Module) -> Dict[str, Dict[str, Any]]:
    """{path: params} of the model's quantized layers. A quantized layer is one holding
    `scales`; MLX's and ours record their group_size, bits and mode as attributes."""
    layers = {}
    for path, m in model.named_modules():
        if "scales" in m:
            layers[path] = {"group_size": m.group_size, "bits": m.bits, "mode": m.mode}
            if isinstance(m, QuantizedSwitchLinear) and "global_scale" in m:
                layers[path]["global_scale"] = True
    return layers


def quantize_model(
    model: nn.Module,
    config: Dict[str, Any],
    group_size: Optional[int] = None,
    bits: Optional[int] = None,
    mode: str = "affine",
    global_scale: bool = False,
    quant_predicate: Optional[QuantPredicate] = None,
) -> Tuple[nn.Module, Dict[str, Any]]:
    """Quantize the model in place; returns (model, config with the quantization block).

    Layers are chosen by `quant_predicate`, else the model's own `quant_predicate`, else
    all. As upstream, a layer whose input width the group size does not divide stays in
    float. Every layer quantized differently from the default, or kept float by the
    predicate, is recorded in the block, so loading rebuilds exactly these layers.
    `global_scale` (upstream's; nvfp4): the expert layers (SwitchLinear) get one float32
    tensor scale per expert, recorded per layer in the block."""
    default = quant_params(group_size, bits, mode, where="quantize_model")
    if global_scale:
        _check_global_scale_applies(model, mode)
    if quant_predicate is None and isinstance(model, HasQuantPredicate):
        quant_predicate = model.quant_predicate
    kept_float: List[str] = []

    def choose(path: str, module: nn.Module) -> Union[bool, Dict[str, Any]]:
        if not isinstance(module, Quantizable) or "weight" not in module:
            return False  # not quantizable, or already quantized (e.g. MXFP4 experts)
        choice = True if quant_predicate is None else quant_predicate(path, module)
        if choice is False:
            kept_float.append(path)
            return False
        params = _layer_params(path, module, choice, default, global_scale)
        if module.weight.shape[-1] % params["group_size"]:
            return False
        return params

    nn.quantize(model, class_predicate=choose)
    layers = quantized_layers(model)
    if not layers:
        raise ValueError(
            f"No layer could be quantized with group_size {default['group_size']}: it divides no "
            "quantizable layer's input width; choose a smaller group size"
        )
    block = dict(default)
    block.update({path: params for path, params in layers.items() if params != default})
    block.update({path: False for path in kept_float})
    config = dict(config)
    # Upstream writes the block under both names; older readers look at the second.
    config["quantization"] = block
    config["quantization_config"] = dict(block)
    return model, config


def _layer_params(path: str, module: nn.Module, choice: Union[bool, Dict[str, Any]], default: Dict[str, Any],
                  global_scale: bool) -> Dict[str, Any]:
    """The parameters quantize_model gives the layer at `path`, validated: the default,
    or the predicate's `choice`; expert layers take the tensor scale `global_scale` asks for."""
    params = dict(default) if not isinstance(choice, dict) else dict(choice)
    where = f"quant_predicate({path!r})" if isinstance(choice, dict) else f"quantize_model at {path!r}"
    wants_scale = params.get("global_scale", False) or (global_scale and isinstance(module, SwitchLinear))
    if wants_scale and not isinstance(module, SwitchLinear):
        raise ValueError(
            f"{where}: a per-expert global_scale is for expert layers; {path} is a {type(module).__name__}"
        )
    return quant_params(params.get("group_size"), params.get("bits"), params.get("mode", "affine"), wants_scale,
                        where=where)


def _check_global_scale_applies(model: nn.Module, mode: str) -> None:
    if mode != "nvfp4":
        raise ValueError(f"quantize_model: global_scale is nvfp4's per-expert tensor scale; mode {mode!r} has none")
    if not any(isinstance(m, SwitchLinear) for _, m in model.named_modules()):
        raise ValueError(
            f"quantize_model: global_scale applies to expert layers (SwitchLinear) and {type(model).__name__} has "
            "none; leave it out"
        )


def get_total_parameters(model: nn.Module) -> int:
    """How many parameters the model represents: a quantized layer counts its weight
    unpacked (32 / bits entries a packed word) plus its bias, not its scales."""
    total = 0
    for _, module in tree_flatten(model.leaf_modules(), is_leaf=nn.Module.is_module):
        if "scales" in module:
            total += module.weight.size * 32 // module.bits + (module.bias.size if "bias" in module else 0)
        else:
            total += sum(v.size for _, v in tree_flatten(module.parameters()))
    return total


def compute_bits_per_weight(model: nn.Module) -> float:
    """The model's bytes (scales and biases included) in bits per represented parameter."""
    num_bytes = sum(v.nbytes for _, v in tree_flatten(model.parameters()))
    return num_bytes * 8 / get_total_parameters(model)


def _float_layer(module: nn.Module) -> nn.Module:
    """The float layer a quantized one approximates (its dequantized weight)."""
    if isinstance(module, SchemeQuantizedLinear):  # GPTQ act-order, NVFP4 global scales: their own inverse
        return module.to_float()
    if isinstance(module, QuantizedSwitchLinear) and "global_scale" in module:  # one tensor scale an expert
        weight = mx.stack([
            mx.dequantize(w, s, None, module.group_size, module.bits, mode=module.mode, global_scale=g)
            for w, s, g in zip(module.weight, module.scales, module.global_scale)
        ])
    else:
        weight = mx.dequantize(
            module.weight, module.scales, module.get("biases"), module.group_size, module.bits, mode=module.mode
        )
    if isinstance(module, nn.QuantizedEmbedding):
        layer = nn.Embedding(*weight.shape)
    elif isinstance(module, nn.QuantizedLinear):
        layer = nn.Linear(weight.shape[1], weight.shape[0], bias="bias" in module)
    elif isinstance(module, QuantizedSwitchLinear):
        num_experts, output_dims, input_dims = weight.shape
        layer = SwitchLinear(input_dims, output_dims, num_experts, bias="bias" in module)
    else:
        raise ValueError(f"Cannot dequantize a {type(module).__name__}: no float counterpart is known")
    layer.weight = weight
    if "bias" in module:
        layer.bias = module.bias
    return layer


def dequantize_model(model: nn.Module) -> nn.Module:
    """Replace every quantized layer by its float counterpart, in place."""
    floats = [(path, _float_layer(m)) for path, m in model.named_modules() if "scales" in m]
    if floats:
        model.update_modules(tree_unflatten(floats))
    return model


# ---------------------------------------------------------------------------
# Mixed-precision recipes (upstream's names): most layers at the low bit width; the
# value projections and MLP down projections of the first and last eighth of the layers
# and of every third layer between, and the LM head, at the high one. The choice of
# llama.cpp's Q4_K_M (https://github.com/ggerganov/llama.cpp/blob/917786f/src/llama.cpp#L5265):
# those layers' errors hurt most.
QUANT_RECIPES = ["mixed_2_6", "mixed_3_4", "mixed_3_6", "mixed_4_6"]
_RECIPE_BITS = {"mixed_2_6": (2, 6), "mixed_3_4": (3, 4), "mixed_3_6": (3, 6), "mixed_4_6": (4, 6)}
_HIGH_BIT_PROJECTIONS = ("v_proj", "v_a_proj", "v_b_proj", "down_proj")


def _layer_index_position(model: nn.Module) -> int:
    """Where, in a dotted module path, the decoder layer's index sits (2 in
    model.layers.3.mlp.down_proj), read from the model's first down projection."""
    down_projections = [path for path, _ in model.named_modules() if "down_proj" in path]
    if not down_projections:
        raise ValueError(
            f"{type(model).__name__} has no down_proj layers, which the mixed-precision recipes key on; "
            "quantize it with one bit width instead"
        )
    parts = down_projections[0].split(".")
    return next((i for i, part in enumerate(parts) if part.isdigit()), len(parts))


def is_sensitive_layer(index: int, num_layers: int) -> bool:
    """Whether decoder layer `index` of `num_layers` gets the high bit width: the first
    and last eighth, and every third layer between."""
    eighth = num_layers // 8
    return index < eighth or index >= 7 * num_layers // 8 or (index - eighth) % 3 == 2


def mixed_quant_predicate_builder(recipe: str, model: nn.Module, group_size: Optional[int] = 64) -> QuantPredicate:
    """The quant predicate of mixed-precision `recipe` (one of QUANT_RECIPES, affine at
    `group_size`, None meaning 64) for `model`. A layer whose path holds no layer index
    counts as layer 0, as upstream. Where the model has its own `quant_predicate`, its
    False (keep float) and explicit parameters win (an MoE router stays at 8 bits, not the
    recipe's 2); upstream's recipes override the model's choice."""
    if recipe not in _RECIPE_BITS:
        raise ValueError(f"Unknown quantization recipe {recipe!r}; choose from {', '.join(QUANT_RECIPES)}")
    low_bits, high_bits = _RECIPE_BITS[recipe]
    low = quant_params(group_size, low_bits, "affine", where=f"recipe {recipe}")
    high = dict(low, bits=high_bits)
    position, num_layers = _layer_index_position(model), len(model.layers)
    own_predicate = model.quant_predicate if isinstance(model, HasQuantPredicate) else None

    def mixed_quant_predicate(path: str, module: nn.Module) -> Union[bool, Dict[str, Any]]:
        if own_predicate is not None and (choice := own_predicate(path, module)) is not True:
            return choice
        parts = path.split(".")
        index = int(parts[position]) if position < len(parts) and parts[position].isdigit() else 0
        if "lm_head" in path:
            return dict(high)
        if any(name in path for name in _HIGH_BIT_PROJECTIONS) and is_sensitive_layer(index, num_layers):
            return dict(high)
        return dict(low)

    return mixed_quant_predicate
