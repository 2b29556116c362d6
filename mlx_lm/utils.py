"""Finding, reading and building models from Hugging Face style checkpoints."""

import glob
import importlib
import json
from pathlib import Path
from typing import Any, Dict, Optional, Tuple, Union

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten

from . import tokenizer_utils
from .tokenizer_utils import TokenizerWrapper

# Checkpoint model_type -> the module of ours that implements it.
MODEL_REMAPPING = {
    "mistral": "llama",
    "iquestcoder": "llama",
}

# What a hub download fetches: configs, weights, code-free tokenizer files.
HUB_ALLOW_PATTERNS = [
    "*.json",
    "model*.safetensors",
    "tokenizer.model",
    "*.tiktoken",
    "tiktoken.model",
    "*.txt",
    "*.jsonl",
    "*.jinja",
]


def get_model_path(path_or_hf_repo: str, revision: Optional[str] = None) -> Path:
    """A local directory as is, else a hub snapshot (downloaded unless cached)."""
    model_path = Path(path_or_hf_repo)
    if model_path.exists():
        if not model_path.is_dir():
            raise ValueError(f"Model path {model_path} is a file; expected a model directory")
        return model_path
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import HFValidationError, LocalEntryNotFoundError

    try:
        return Path(
            snapshot_download(path_or_hf_repo, revision=revision, allow_patterns=HUB_ALLOW_PATTERNS)
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


def load_config(model_path: Path) -> Dict[str, Any]:
    """config.json, with eos_token_id from generation_config.json when that has one."""
    config_file = model_path / "config.json"
    if not config_file.exists():
        raise FileNotFoundError(f"No config.json in {model_path}")
    try:
        config = json.loads(config_file.read_text())
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


def load_model(
    model_path: Path,
    lazy: bool = False,
    strict: bool = True,
    model_config: Optional[Dict[str, Any]] = None,
) -> Tuple[nn.Module, Dict[str, Any]]:
    """Build the model of `model_path` and load its weights; returns (model, config)."""
    config = load_config(model_path)
    config.update(model_config or {})
    model_class, args_class = get_model_classes(config)
    model = model_class(args_class.from_dict(config))
    weights = load_weights_files(model_path)
    weights = model.sanitize(weights)
    if strict:
        check_weights(model, weights)
    model.eval()
    model.load_weights(list(weights.items()), strict=strict)
    if not lazy:
        mx.eval(model.parameters())
    return model, config


def load(
    path_or_hf_repo: str,
    tokenizer_config: Optional[Dict[str, Any]] = None,
    model_config: Optional[Dict[str, Any]] = None,
    lazy: bool = False,
    return_config: bool = False,
    revision: Optional[str] = None,
) -> Union[Tuple[nn.Module, TokenizerWrapper], Tuple[nn.Module, TokenizerWrapper, Dict[str, Any]]]:
    """Load (model, tokenizer[, config]) from a local directory or a hub repo id."""
    model_path = get_model_path(path_or_hf_repo, revision=revision)
    model, config = load_model(model_path, lazy=lazy, model_config=model_config)
    tokenizer = tokenizer_utils.load(
        model_path, tokenizer_config, eos_token_ids=config.get("eos_token_id")
    )
    if return_config:
        return model, tokenizer, config
    return model, tokenizer
