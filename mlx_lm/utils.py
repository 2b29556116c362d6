"""Loading models from Hugging Face style checkpoints: the architecture a config names,
its weights, the compute dtype, the tokenizer; tensor- and pipeline-parallel loading.

Upstream keeps all of its checkpoint helpers in this one module, and code written for it
imports them from here; they live in hub.py, config_files.py, quantization.py and
saving.py, and every public name is importable from here as well."""

import glob
import importlib
import inspect
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Tuple, Union

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten, tree_map_with_path

from . import compressed_tensors, quant_schemes, tokenizer_utils
from .config_files import decode_tagged_floats, encode_tagged_floats, load_config, save_config  # noqa: F401
from .hub import DEFAULT_ALLOW_PATTERNS, create_model_card, get_model_path, hf_repo_to_path, upload_to_hub  # noqa: F401
from .quantization import (  # noqa: F401
    QUANT_MODES,
    HasQuantPredicate,
    Quantizable,
    QuantizationSpec,
    QuantPredicate,
    compute_bits_per_weight,
    dequantize_model,
    get_total_parameters,
    infer_quant_config,
    quant_params,
    quantize_from_weights,
    quantize_model,
    quantized_layers,
    read_quantization,
)
from .saving import EXTRA_FILES, MAX_FILE_SIZE_GB, MAX_SHARD_BYTES, WEIGHTS_INDEX, make_shards, save, save_model  # noqa: F401
from .models.pipeline import pipelined_backbone
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

# (model_type, an entry of config "architectures") -> our module, for a model_type that
# names different architectures. Consulted before MODEL_REMAPPING. Empty: upstream's one
# entry (bailing_hybrid's BailingMoeV3ForCausalLM) is a family this package lacks; code
# that registers its own, as it may upstream, is honoured.
MODEL_ARCHITECTURE_REMAPPING: Dict[Tuple[str, str], str] = {}


def does_model_support_input_embeddings(model: nn.Module) -> bool:
    """Whether the model's forward takes `input_embeddings` (rows fed instead of the
    tokens' embeddings; generate_step's `input_embeddings`)."""
    return "input_embeddings" in inspect.signature(model.__call__).parameters



def get_model_classes(config: Dict[str, Any]):
    """(Model, ModelArgs) of the module implementing the config's architecture: the
    MODEL_ARCHITECTURE_REMAPPING entry of (model_type, one of its "architectures") when
    there is one, else the module config["model_type"] names (MODEL_REMAPPING)."""
    model_type = config.get("model_type")
    if not model_type:
        raise ValueError("config.json has no model_type; cannot tell which architecture to build")
    architectures = config.get("architectures") or []
    if isinstance(architectures, str):
        architectures = [architectures]
    by_architecture = [MODEL_ARCHITECTURE_REMAPPING.get((model_type, a)) for a in architectures]
    module_name = next((m for m in by_architecture if m), MODEL_REMAPPING.get(model_type, model_type))
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


def common_prefix_len(list1: List[Any], list2: List[Any]) -> int:
    """How many leading items the two sequences share."""
    for i, (a, b) in enumerate(zip(list1, list2)):
        if a != b:
            return i
    return min(len(list1), len(list2))


def can_run_metal() -> bool:
    """Whether computations run on a Metal GPU (the default device is the GPU and
    the Metal backend is present)."""
    return mx.default_device() == mx.gpu and mx.metal.is_available()


def maybe_set_recommended_wired_limit() -> Optional[int]:
    """Set MLX's wired memory limit to the device's recommended working set and return
    the previous limit; None, changing nothing, where the device recommends none (the
    CPU and CUDA backends, which wire no memory)."""
    recommended = mx.device_info().get("max_recommended_working_set_size")
    if recommended is None:
        return None
    return mx.set_wired_limit(recommended)



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
# keeps them float32, and rounded to bf16 they change which experts win. NVFP4's
# second-level global_scale is float32 in MLX (mx.quantize's) and in the checkpoints.
FLOAT32_PARAMETERS = ("e_score_correction_bias", "expert_bias", "global_scale")


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
    repacked into that layout (compressed_tensors.py), as are AWQ, GPTQ, BitNet, NVFP4, MXFP8
    and FP8 (ue8m0) checkpoints (quant_schemes.py); the config returned says so. `dtype`
    casts every floating point parameter (None keeps the checkpoint's; see
    `compute_dtype` for what `load` picks)."""
    config = load_config(model_path)
    config.update(model_config or {})
    _check_no_model_code(config, model_path, trust_remote_code)
    model_class, args_class = get_model_classes(config)
    # Before ModelArgs read the config: they then see an MLX-quantized checkpoint.
    weights, config = quant_schemes.to_mlx(load_weights_files(model_path), config, model_path)
    model = model_class(args_class.from_dict(config))
    if compressed_tensors.quantization_config_of(config) is not None:  # llm-compressor's packed integers
        weights, config = compressed_tensors.to_mlx(weights, config)
    weights = model.sanitize(weights)
    quantize_from_weights(model, weights, read_quantization(config))
    quant_schemes.add_scheme_layers(model, weights)  # GPTQ act-order, NVFP4 global scales
    if config.get("quantize_activations"):  # upstream's model_config option: inputs quantized as weights
        quant_schemes.quantize_activations(model)
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
    model_path: Union[str, Path],
    tokenizer_config_extra: Optional[Dict[str, Any]] = None,
    eos_token_ids: Union[List[int], int, None] = None,
) -> TokenizerWrapper:
    """The wrapped tokenizer of `model_path` (a directory, or a hub repo id fetched as
    `get_model_path` does, as upstream); `tokenizer_config_extra` goes to
    `AutoTokenizer.from_pretrained` (e.g. {"trust_remote_code": True}, which also fetches
    the repo's code), and `eos_token_ids` (default: the tokenizer's EOS) end generation."""
    with_code = bool((tokenizer_config_extra or {}).get("trust_remote_code"))
    model_path = get_model_path(str(model_path), with_code=with_code)
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
    repo: str,
    pipeline_group: Optional[mx.distributed.Group] = None,
    tensor_group: Optional[mx.distributed.Group] = None,
    return_config: bool = False,
    *,
    dtype: Optional[str] = None,
    model_config: Optional[Dict[str, Any]] = None,
    tokenizer_config: Optional[Dict[str, Any]] = None,
    trust_remote_code: bool = False,
) -> Union[Tuple[nn.Module, TokenizerWrapper], Tuple[nn.Module, TokenizerWrapper, Dict[str, Any]]]:
    """Load `repo` (a directory or hub repo id) split across the ranks of a group, as
    `mlx.launch` sets it up; weights are read lazily and each rank materialises only its
    part, one decoder layer at a time.

    Tensor parallel over `tensor_group` (the default, with the global group): each rank
    keeps its shard of every layer (`model.shard`, models/sharding.py), holding at most
    one layer's full tensors besides, never the whole checkpoint. Pipeline parallel over
    `pipeline_group`: each rank keeps a contiguous slice of the layers
    (`model.model.pipeline`, models/pipeline.py) and never reads the others' weights;
    families without it (pipeline.FAMILIES lists those with it) raise ValueError. One
    group, not both.

    Every rank must then run the same forwards in the same order (each mixer and MLP
    all-sums; a pipeline passes each forward down the ranks). For speculation that
    means identical drafts on every rank: seed every rank alike and pin the draft
    length (`adaptive_draft_length=False`), since the adaptive policy reads wall-clock
    times; `mlx_lm.generate` does both.
    `trust_remote_code` as in `load` (the tokenizer's code only; upstream's default
    tokenizer_config trusts it, this one trusts it only when asked)."""
    if pipeline_group is not None and tensor_group is not None:
        raise ValueError("sharded_load takes pipeline_group or tensor_group, not both: "
                         "a rank here is either a pipeline stage or a tensor shard")
    model, tokenizer, config = load(
        repo, tokenizer_config, model_config, lazy=True, return_config=True,
        trust_remote_code=trust_remote_code, dtype=dtype,
    )
    if pipeline_group is not None:
        pipelined_backbone(model, config.get("model_type", "?")).pipeline(pipeline_group)
    else:
        model.shard(tensor_group if tensor_group is not None else mx.distributed.init())
    for layer in model.layers:  # one layer's full tensors in memory at a time
        mx.eval(layer.parameters())
    mx.eval(model.parameters())
    if return_config:
        return model, tokenizer, config
    return model, tokenizer


def pipeline_load(
    repo: str, return_config: bool = False
) -> Union[Tuple[nn.Module, TokenizerWrapper], Tuple[nn.Module, TokenizerWrapper, Dict[str, Any]]]:
    """Upstream's shorthand: `sharded_load` pipelined over the global group."""
    return sharded_load(repo, mx.distributed.init(), None, return_config)
