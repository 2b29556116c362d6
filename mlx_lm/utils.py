"""Finding, reading and building models from Hugging Face style checkpoints."""

import glob
import importlib
import inspect
import json
import math
import os
import secrets
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Protocol, Tuple, Union, runtime_checkable

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten, tree_map_with_path, tree_unflatten

from . import compressed_tensors, tokenizer_utils
from .tokenizer_utils import TokenizerWrapper
from .tuner.utils import load_adapters  # noqa: F401  (upstream exports it here)

# Checkpoint model_type -> the module of ours that implements it.
MODEL_REMAPPING = {
    "mistral": "llama",
    "iquestcoder": "llama",
    "xverse": "llama",  # XVERSE-7B/13B/65B: llama's weights and config keys
    "gemma3_text": "gemma3",
    "gemma3n_text": "gemma3n",
    "gemma4": "gemma4_text",
    "ministral": "llama",
    "llama4_text": "llama4",
    "kimi_k2": "deepseek_v3",
    "joyai_llm_flash": "deepseek_v3",
}

# What a hub download fetches (upstream's name): configs, weights, code-free tokenizer files.
DEFAULT_ALLOW_PATTERNS = [
    "*.json",
    "model*.safetensors",
    "tokenizer.model",
    "*.tiktoken",
    "tiktoken.model",
    "*.txt",
    "*.jsonl",
    "*.jinja",
]


def get_model_path(path_or_hf_repo: str, revision: Optional[str] = None, *, with_code: bool = False) -> Path:
    """A local directory as is, else a hub snapshot (downloaded unless cached).
    `with_code` also fetches the repo's *.py files (a tokenizer's remote code)."""
    model_path = Path(path_or_hf_repo)
    if model_path.exists():
        if not model_path.is_dir():
            raise ValueError(f"Model path {model_path} is a file; expected a model directory")
        return model_path
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import HFValidationError, LocalEntryNotFoundError

    try:
        return Path(
            snapshot_download(
                path_or_hf_repo, revision=revision, allow_patterns=DEFAULT_ALLOW_PATTERNS + ["*.py"] * with_code
            )
        )
    except HFValidationError:
        raise FileNotFoundError(
            f"Model path {path_or_hf_repo!r} does not exist and is not a valid Hugging Face repo id"
        ) from None
    except LocalEntryNotFoundError:
        raise FileNotFoundError(
            f"Model {path_or_hf_repo!r} is not a local directory and could not be fetched from the "
            "Hugging Face hub (offline, or HF_HUB_OFFLINE=1, and not in the local cache)"
        ) from None
    except Exception as e:  # repo missing, gated, network errors: name the repo
        raise FileNotFoundError(f"Could not fetch model {path_or_hf_repo!r} from the Hugging Face hub: {e}") from e


def hf_repo_to_path(hf_repo: str) -> Path:
    """The local snapshot of hub repo `hf_repo` (what get_model_path downloaded), never
    fetching: huggingface_hub's LocalEntryNotFoundError if it is not in the cache."""
    from huggingface_hub import snapshot_download

    return Path(snapshot_download(hf_repo, local_files_only=True, allow_patterns=DEFAULT_ALLOW_PATTERNS))


def does_model_support_input_embeddings(model: nn.Module) -> bool:
    """Whether the model's forward takes `input_embeddings` (rows fed instead of the
    tokens' embeddings; generate_step's `input_embeddings`)."""
    return "input_embeddings" in inspect.signature(model.__call__).parameters


# transformers 5 writes a non-finite float as {"__float__": "Infinity"} so that
# config.json stays valid JSON for every parser; read it back as the float it is.
_FLOAT_TAG = "__float__"
_TAGGED_FLOATS = {"Infinity": math.inf, "-Infinity": -math.inf, "NaN": math.nan}


def decode_tagged_floats(value: Any) -> Any:
    """`value` (parsed JSON) with every {"__float__": "Infinity" | "-Infinity" | "NaN"}
    replaced by its float; any other object, even one with a "__float__" key, kept."""
    if isinstance(value, dict):
        if set(value) == {_FLOAT_TAG} and value[_FLOAT_TAG] in _TAGGED_FLOATS:
            return _TAGGED_FLOATS[value[_FLOAT_TAG]]
        return {k: decode_tagged_floats(v) for k, v in value.items()}
    if isinstance(value, list):
        return [decode_tagged_floats(v) for v in value]
    return value


def encode_tagged_floats(value: Any) -> Any:
    """The inverse of decode_tagged_floats: non-finite floats as tagged objects."""
    if isinstance(value, float) and not math.isfinite(value):
        return {_FLOAT_TAG: "NaN" if math.isnan(value) else "Infinity" if value > 0 else "-Infinity"}
    if isinstance(value, dict):
        return {k: encode_tagged_floats(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [encode_tagged_floats(v) for v in value]
    return value


def load_config(model_path: Path) -> Dict[str, Any]:
    """config.json (tagged non-finite floats decoded), with eos_token_id from
    generation_config.json when that has one."""
    config_file = model_path / "config.json"
    if not config_file.exists():
        raise FileNotFoundError(f"No config.json in {model_path}")
    try:
        config = decode_tagged_floats(json.loads(config_file.read_text()))
    except json.JSONDecodeError as e:
        raise ValueError(f"Malformed {config_file}: {e}") from None
    if not isinstance(config, dict):
        raise ValueError(f"Malformed {config_file}: expected a JSON object")
    generation_file = model_path / "generation_config.json"
    if generation_file.exists():
        try:
            eos = json.loads(generation_file.read_text()).get("eos_token_id")
        except (json.JSONDecodeError, AttributeError):
            eos = None
        if eos is not None:
            config["eos_token_id"] = eos
    return config


def get_model_classes(config: Dict[str, Any]):
    """(Model, ModelArgs) of the module implementing config["model_type"]."""
    model_type = config.get("model_type")
    if not model_type:
        raise ValueError("config.json has no model_type; cannot tell which architecture to build")
    module_name = MODEL_REMAPPING.get(model_type, model_type)
    try:
        module = importlib.import_module(f"mlx_lm.models.{module_name}")
    except ImportError:
        raise ValueError(f"Model type {model_type!r} not supported.") from None
    return module.Model, module.ModelArgs


def load_weights_files(model_path: Path) -> Dict[str, mx.array]:
    files = sorted(glob.glob(str(model_path / "model*.safetensors")))
    if not files:
        raise FileNotFoundError(f"No model*.safetensors weights found in {model_path}")
    weights = {}
    for f in files:
        try:
            weights.update(mx.load(f))
        except Exception as e:
            raise ValueError(f"Could not read weights file {f}: {e}") from None
    return weights


def check_weights(model: nn.Module, weights: Dict[str, mx.array]) -> None:
    """Fail loudly, listing every missing, unexpected or mis-shaped tensor."""
    expected = dict(tree_flatten(model.parameters()))
    missing = sorted(set(expected) - set(weights))
    unexpected = sorted(set(weights) - set(expected))
    mismatched = [
        f"{k}: checkpoint {tuple(weights[k].shape)} vs model {tuple(v.shape)}"
        for k, v in expected.items()
        if k in weights and weights[k].shape != v.shape
    ]
    problems = []
    if missing:
        problems.append(f"missing {len(missing)} weights: {', '.join(missing[:20])}")
    if unexpected:
        problems.append(f"unexpected {len(unexpected)} weights: {', '.join(unexpected[:20])}")
    if mismatched:
        problems.append(f"shape mismatches: {'; '.join(mismatched[:20])}")
    if problems:
        raise ValueError("Checkpoint does not match the model: " + " | ".join(problems))


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
    group_size: Optional[int] = None, bits: Optional[int] = None, mode: str = "affine", *, where: str
) -> Dict[str, Any]:
    """Complete, validated {"group_size", "bits", "mode"}; a value left None takes the
    mode's default. `where` names the source in the error message."""
    if mode not in QUANT_MODES:
        raise ValueError(f"{where}: unsupported quantization mode {mode!r}; choose from {', '.join(QUANT_MODES)}")
    group_sizes, bit_widths = QUANT_MODES[mode]
    group_size = group_sizes[0] if group_size is None else group_size
    bits = bit_widths[0] if bits is None else bits
    if type(bits) is not int or bits not in bit_widths:
        raise ValueError(f"{where}: {mode} quantization supports bits {sorted(bit_widths)}, got {bits!r}")
    if type(group_size) is not int or group_size not in group_sizes:
        raise ValueError(f"{where}: {mode} quantization supports group sizes {sorted(group_sizes)}, got {group_size!r}")
    return {"group_size": group_size, "bits": bits, "mode": mode}


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
                value.get("group_size"), value.get("bits"), value.get("mode", "affine"), where=f"{where}[{path!r}]"
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
                '{"group_size": 64, "bits": 4}, matching how they were quantized (Hugging Face '
                "schemes such as AWQ or GPTQ are not supported: convert the float checkpoint)"
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
        _check_quantized_tensors(path, module, weights, plan[path])
        return dict(plan[path])

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
    return {
        path: {"group_size": m.group_size, "bits": m.bits, "mode": m.mode}
        for path, m in model.named_modules()
        if "scales" in m
    }


def quantize_model(
    model: nn.Module,
    config: Dict[str, Any],
    group_size: Optional[int] = None,
    bits: Optional[int] = None,
    mode: str = "affine",
    quant_predicate: Optional[QuantPredicate] = None,
) -> Tuple[nn.Module, Dict[str, Any]]:
    """Quantize the model in place; returns (model, config with the quantization block).

    Layers are chosen by `quant_predicate`, else the model's own `quant_predicate`, else
    all. As upstream, a layer whose input width the group size does not divide stays in
    float. Every layer quantized differently from the default, or kept float by the
    predicate, is recorded in the block, so loading rebuilds exactly these layers."""
    default = quant_params(group_size, bits, mode, where="quantize_model")
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
        params = default
        if isinstance(choice, dict):
            params = quant_params(
                choice.get("group_size"), choice.get("bits"), choice.get("mode", "affine"),
                where=f"quant_predicate({path!r})",
            )
        if module.weight.shape[-1] % params["group_size"]:
            return False
        return dict(params)

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


def common_prefix_len(first: List[Any], second: List[Any]) -> int:
    """How many leading items the two sequences share."""
    for i, (a, b) in enumerate(zip(first, second)):
        if a != b:
            return i
    return min(len(first), len(second))


def _float_layer(module: nn.Module) -> nn.Module:
    """The float layer a quantized one approximates (its dequantized weight)."""
    from .models.switch_layers import QuantizedSwitchLinear, SwitchLinear

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


DTYPES = {"float16": mx.float16, "bfloat16": mx.bfloat16, "float32": mx.float32}


def compute_dtype(dtype: Optional[str] = None, device: Optional[mx.Device] = None) -> Tuple[Optional[mx.Dtype], str]:
    """The dtype `load` casts floating point parameters to, and why.

    `dtype` None or "auto": on the CPU backend half precision (float16, bfloat16,
    quantization scales included) becomes float32, because MLX's CPU kernels run it
    several times slower (measured: float16 matmuls ~3x, 4-bit with float16 scales
    ~40x); elsewhere (Metal, CUDA) the checkpoint's dtypes stay (None). A name from
    DTYPES casts every floating parameter to it."""
    if dtype not in (None, "auto") and dtype not in DTYPES:
        raise ValueError(f"Unsupported dtype {dtype!r}; choose auto or one of {', '.join(DTYPES)}")
    if dtype not in (None, "auto"):
        return DTYPES[dtype], f"{dtype}, as asked"
    device = device or mx.default_device()
    if device.type == mx.DeviceType.cpu:
        return mx.float32, "auto: half precision runs as float32 on the CPU backend, where it is several times faster"
    return None, "auto: the checkpoint's own dtypes"


# Router biases that choose experts (added to the scores before the top-k): transformers
# keeps them float32, and rounded to bf16 they change which experts win.
FLOAT32_PARAMETERS = ("e_score_correction_bias", "expert_bias")


def cast_floats(model: nn.Module, dtype: mx.Dtype) -> nn.Module:
    """Cast every floating point parameter (norms, biases and quantization scales
    included) to `dtype`, except the router biases of FLOAT32_PARAMETERS (float32);
    integer tensors (packed weights, MXFP scales) stay as they are."""

    def cast(path: str, p: mx.array) -> mx.array:
        if not mx.issubdtype(p.dtype, mx.floating):
            return p
        return p.astype(mx.float32 if path.rsplit(".", 1)[-1] in FLOAT32_PARAMETERS else dtype)

    model.update(tree_map_with_path(cast, model.parameters()))
    return model


def parameter_dtypes(model: nn.Module) -> str:
    """The floating point dtypes the model's parameters hold, e.g. "float32"."""
    floats = {p.dtype for _, p in tree_flatten(model.parameters()) if mx.issubdtype(p.dtype, mx.floating)}
    return "/".join(sorted(str(d).split(".")[-1] for d in floats))


# ---------------------------------------------------------------------------
# Saving in the MLX layout.

MAX_FILE_SIZE_GB = 5  # shard size, as upstream
MAX_SHARD_BYTES = MAX_FILE_SIZE_GB << 30
WEIGHTS_INDEX = "model.safetensors.index.json"


def make_shards(weights: Dict[str, mx.array], max_file_size_gb: float = MAX_FILE_SIZE_GB) -> List[Dict[str, mx.array]]:
    """Split weights, in order, into shards of at most `max_file_size_gb` GiB (a single
    larger tensor gets a shard of its own); no weights, no shards."""
    if isinstance(max_file_size_gb, bool) or not isinstance(max_file_size_gb, (int, float)) or max_file_size_gb <= 0:
        raise ValueError(f"max_file_size_gb must be a positive number of GiB, got {max_file_size_gb!r}")
    return _shards_of_bytes(weights, int(max_file_size_gb * (1 << 30))) if weights else []


def _shards_of_bytes(weights: Dict[str, mx.array], max_shard_bytes: int) -> List[Dict[str, mx.array]]:
    shards: List[Dict[str, mx.array]] = [{}]
    size = 0
    for name, tensor in weights.items():
        if shards[-1] and size + tensor.nbytes > max_shard_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = tensor
        size += tensor.nbytes
    return shards


def save_model(
    save_path: Union[str, Path],
    model_or_weights: Union[nn.Module, Dict[str, mx.array]],
    *,
    max_shard_bytes: int = MAX_SHARD_BYTES,
    progress: Optional[Callable[[int, int], None]] = None,
) -> None:
    """Write weights as `model.safetensors` (or `model-0000i-of-0000n.safetensors`
    shards) plus `model.safetensors.index.json` with the weight map and total size.
    `progress(bytes_written, total_bytes)` is called as tensors are computed."""
    save_path = Path(save_path)
    save_path.mkdir(parents=True, exist_ok=True)
    weights = model_or_weights
    if isinstance(model_or_weights, nn.Module):
        weights = dict(tree_flatten(model_or_weights.parameters()))
    shards = _shards_of_bytes(weights, max_shard_bytes)
    total = sum(t.nbytes for t in weights.values())
    done = 0
    weight_map = {}
    for i, shard in enumerate(shards, start=1):
        name = "model.safetensors" if len(shards) == 1 else f"model-{i:05d}-of-{len(shards):05d}.safetensors"
        for tensor in shard.values():  # evaluate one by one so progress moves
            mx.eval(tensor)
            done += tensor.nbytes
            if progress is not None:
                progress(done, total)
        mx.save_safetensors(str(save_path / name), shard, metadata={"format": "mlx"})
        weight_map.update({k: name for k in shard})
    index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
    (save_path / WEIGHTS_INDEX).write_text(json.dumps(index, indent=4))


def save_config(config: Dict[str, Any], config_path: Union[str, Path]) -> None:
    """Write config.json with sorted keys, minus transformers' local bookkeeping;
    non-finite floats tagged as transformers writes them (valid JSON)."""
    config = {k: v for k, v in config.items() if k != "_name_or_path"}
    Path(config_path).write_text(json.dumps(encode_tagged_floats(dict(sorted(config.items()))), indent=4))


# Copied as they are by `save`: what generation needs beyond config and tokenizer.
EXTRA_FILES = ["generation_config.json"]


def save(
    dst_path: Union[str, Path],
    src_path: Path,
    model: nn.Module,
    tokenizer: TokenizerWrapper,
    config: Dict[str, Any],
    *,
    progress: Optional[Callable[[int, int], None]] = None,
) -> None:
    """Save a complete model directory: weights (save_model, which calls `progress`),
    config.json, the tokenizer files and src_path's EXTRA_FILES. `dst_path` must not
    exist; it is written under a temporary name and renamed when complete, so a failure
    leaves nothing behind."""
    dst_path = Path(dst_path)
    if dst_path.exists():
        raise ValueError(f"Cannot save to {dst_path}: it already exists; choose another path or remove it")
    dst_path.parent.mkdir(parents=True, exist_ok=True)
    # os.mkdir, not tempfile.mkdtemp: the folder is renamed into place, and should get
    # the mode the umask gives any folder (mkdtemp's is 0700, private to its owner).
    staging = dst_path.parent / f".{dst_path.name}.partial-{secrets.token_hex(8)}"
    os.mkdir(staging)
    try:
        save_model(staging, model, progress=progress)
        save_config(config, staging / "config.json")
        tokenizer.save_pretrained(str(staging))
        for name in EXTRA_FILES:
            if (Path(src_path) / name).exists():
                shutil.copyfile(Path(src_path) / name, staging / name)
        os.rename(staging, dst_path)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise


def _check_no_model_code(config: Dict[str, Any], model_path: Path, trust_remote_code: bool = False) -> None:
    """Upstream runs a checkpoint's own model code (config "model_file") given
    trust_remote_code; this package only builds the families it implements."""
    if "model_file" in config:
        given = " (trust_remote_code=True does not change that)" if trust_remote_code else ""
        raise ValueError(
            f"{model_path} asks for its own model code (config.json \"model_file\": "
            f"{config['model_file']!r}), which this package never runs{given}; trust_remote_code only "
            "applies to the tokenizer here"
        )


def load_model(
    model_path: Path,
    lazy: bool = False,
    strict: bool = True,
    model_config: Optional[Dict[str, Any]] = None,
    get_model_classes: Callable[[Dict[str, Any]], Tuple[type, type]] = get_model_classes,
    trust_remote_code: bool = False,
    *,
    dtype: Optional[mx.Dtype] = None,
) -> Tuple[nn.Module, Dict[str, Any]]:
    """Build the model of `model_path` and load its weights; returns (model, config).
    `get_model_classes(config)` gives the (Model, ModelArgs) classes (upstream's hook
    for a custom architecture; default: the family config["model_type"] names).
    `trust_remote_code` is upstream's opt-in to a checkpoint's own model code
    (config "model_file"); this package refuses such checkpoints either way.

    A quantized checkpoint (MLX layout: `<layer>.weight` packed, `.scales`, `.biases`)
    is described by `config["quantization"]`; exactly the layers whose `.scales` the
    weights hold become quantized layers, before the weights are checked. A
    compressed-tensors checkpoint (llm-compressor's pack-quantized integers) is first
    repacked into that layout (compressed_tensors.py); the config returned says so. `dtype`
    casts every floating point parameter (None keeps the checkpoint's; see
    `compute_dtype` for what `load` picks)."""
    config = load_config(model_path)
    config.update(model_config or {})
    _check_no_model_code(config, model_path, trust_remote_code)
    model_class, args_class = get_model_classes(config)
    model = model_class(args_class.from_dict(config))
    weights = load_weights_files(model_path)
    if compressed_tensors.quantization_config_of(config) is not None:  # llm-compressor's packed integers
        weights, config = compressed_tensors.to_mlx(weights, config)
    weights = model.sanitize(weights)
    quantize_from_weights(model, weights, read_quantization(config))
    if strict:
        check_weights(model, weights)
    model.eval()
    model.load_weights(list(weights.items()), strict=strict)
    if dtype is not None:
        cast_floats(model, dtype)
    if not lazy:
        mx.eval(model.parameters())
    return model, config


def load_tokenizer(
    model_path: Path,
    tokenizer_config_extra: Optional[Dict[str, Any]] = None,
    eos_token_ids: Union[List[int], int, None] = None,
) -> TokenizerWrapper:
    """The wrapped tokenizer of `model_path`; `tokenizer_config_extra` goes to
    `AutoTokenizer.from_pretrained` (e.g. {"trust_remote_code": True}), and
    `eos_token_ids` (default: the tokenizer's EOS) end generation."""
    return tokenizer_utils.load(model_path, tokenizer_config_extra, eos_token_ids=eos_token_ids)


def load(
    path_or_hf_repo: str,
    tokenizer_config: Optional[Dict[str, Any]] = None,
    model_config: Optional[Dict[str, Any]] = None,
    adapter_path: Optional[str] = None,
    lazy: bool = False,
    return_config: bool = False,
    revision: Optional[str] = None,
    trust_remote_code: bool = False,
    *,
    dtype: Optional[str] = None,
) -> Union[Tuple[nn.Module, TokenizerWrapper], Tuple[nn.Module, TokenizerWrapper, Dict[str, Any]]]:
    """Load (model, tokenizer[, config]) from a local directory or a hub repo id.

    adapter_path: a local directory of fine-tuned adapters (`tuner.load_adapters`).
    trust_remote_code: let the tokenizer run the repo's own code (transformers'
    option); a checkpoint that needs its own *model* code is refused either way.
    dtype (keyword only; None/"auto", "float32", "float16", "bfloat16"): the compute
    dtype of the floating point parameters; auto is float32 on the CPU backend
    (`compute_dtype`)."""
    cast_to, _ = compute_dtype(dtype)
    model_path = get_model_path(path_or_hf_repo, revision=revision, with_code=trust_remote_code)
    model, config = load_model(model_path, lazy=True, model_config=model_config, dtype=cast_to)
    if adapter_path is not None:
        load_adapters(model, adapter_path)
        if cast_to is not None:
            cast_floats(model, cast_to)
    if not lazy:
        mx.eval(model.parameters())
    tokenizer_config = dict(tokenizer_config or {})
    if trust_remote_code:
        tokenizer_config["trust_remote_code"] = True
    tokenizer = load_tokenizer(model_path, tokenizer_config, eos_token_ids=config.get("eos_token_id"))
    if return_config:
        return model, tokenizer, config
    return model, tokenizer


def sharded_load(
    path_or_hf_repo: str,
    pipeline_group: Optional[mx.distributed.Group] = None,
    tensor_group: Optional[mx.distributed.Group] = None,
    return_config: bool = False,
    *,
    dtype: Optional[str] = None,
    model_config: Optional[Dict[str, Any]] = None,
    tokenizer_config: Optional[Dict[str, Any]] = None,
) -> Union[Tuple[nn.Module, TokenizerWrapper], Tuple[nn.Module, TokenizerWrapper, Dict[str, Any]]]:
    """Load a model tensor-parallel over `tensor_group` (default: the global group, as
    `mlx.launch` sets it up): each rank keeps and materialises only its shard
    (`model.shard`, models/sharding.py). Weights are read lazily and evaluated one
    decoder layer at a time, so a rank holds its shards plus at most one layer's
    full tensors, never the whole checkpoint.

    Every rank must then run the same forwards in the same order: each mixer and MLP
    all-sums. For speculation that means identical drafts on every rank: seed every
    rank alike and pin the draft length (`adaptive_draft_length=False`), since the
    adaptive policy reads wall-clock times; `mlx_lm.generate` does both.
    Pipeline parallelism is not implemented: `pipeline_group` must be None."""
    if pipeline_group is not None:
        raise ValueError(
            f"pipeline_group={pipeline_group!r}: pipeline parallelism is not supported; "
            "shard tensor-parallel with tensor_group instead"
        )
    group = tensor_group if tensor_group is not None else mx.distributed.init()
    model, tokenizer, config = load(
        path_or_hf_repo, tokenizer_config, model_config, lazy=True, return_config=True, dtype=dtype
    )
    model.shard(group)
    for layer in model.layers:  # one layer's full tensors in memory at a time
        mx.eval(layer.parameters())
    mx.eval(model.parameters())
    if return_config:
        return model, tokenizer, config
    return model, tokenizer
