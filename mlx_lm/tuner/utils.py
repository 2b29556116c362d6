"""Loading fine-tuned adapters in the layout upstream mlx-lm's trainer saves.

An adapter directory holds
- `adapter_config.json`: "fine_tune_type" ("lora", the default, "dora" or "full"),
  "num_layers" (adapters sit in the last num_layers blocks; <= 0 means all, as
  upstream) and "lora_parameters" {"rank", "scale", "dropout", optional "keys": module
  paths inside a block, by default every linear, expert and embedding layer of one};
  the trainer writes its other options there too, which are ignored.
- `adapters.safetensors`: for LoRA `<module>.lora_a` (in, r) and `<module>.lora_b`
  (r, out), DoRA also `<module>.m` (out,); for "full", tensors of the model itself.
"""

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, List, Optional, Union

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten, tree_unflatten

from ..models.switch_layers import QuantizedSwitchLinear, SwitchLinear
from .lora import adapter_for

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapters.safetensors"
FINE_TUNE_TYPES = ("lora", "dora", "full")
# What upstream's trainer puts an adapter on by default (the layer kinds it can wrap).
_DEFAULT_TARGETS = (nn.Linear, nn.QuantizedLinear, SwitchLinear, QuantizedSwitchLinear, nn.Embedding, nn.QuantizedEmbedding)


@dataclass
class AdapterConfig:
    fine_tune_type: str
    num_layers: int
    rank: int = 0  # LoRA / DoRA only
    scale: float = 0.0
    keys: Optional[List[str]] = None


def _number(value, name: str, where: Path, integer: bool = False):
    kinds = (int,) if integer else (int, float)
    if isinstance(value, bool) or not isinstance(value, kinds):
        raise ValueError(f"{where}: {name} must be {'an int' if integer else 'a number'}, got {value!r}")
    return value


def read_adapter_config(adapter_path: Path) -> AdapterConfig:
    """The validated adapter_config.json of an adapter directory."""
    config_file = adapter_path / ADAPTER_CONFIG
    if not config_file.is_file():
        raise FileNotFoundError(f"Adapter directory {adapter_path} has no {ADAPTER_CONFIG}")
    try:
        raw = json.loads(config_file.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"Malformed {config_file}: {e}") from None
    if not isinstance(raw, dict):
        raise ValueError(f"Malformed {config_file}: expected a JSON object")
    fine_tune_type = raw.get("fine_tune_type", "lora")
    if fine_tune_type not in FINE_TUNE_TYPES:
        raise ValueError(f"{config_file}: fine_tune_type {fine_tune_type!r} is not one of {', '.join(FINE_TUNE_TYPES)}")
    if fine_tune_type == "full":
        return AdapterConfig(fine_tune_type, num_layers=0)
    if "num_layers" not in raw:
        raise ValueError(f"{config_file}: no num_layers (how many of the last blocks carry adapters)")
    num_layers = _number(raw["num_layers"], "num_layers", config_file, integer=True)
    params = raw.get("lora_parameters")
    if not isinstance(params, dict) or "rank" not in params or "scale" not in params:
        raise ValueError(f'{config_file}: lora_parameters must be an object with "rank" and "scale", got {params!r}')
    rank = _number(params["rank"], "lora_parameters.rank", config_file, integer=True)
    if rank < 1:
        raise ValueError(f"{config_file}: lora_parameters.rank must be at least 1, got {rank}")
    scale = _number(params["scale"], "lora_parameters.scale", config_file)
    keys = params.get("keys")
    if keys is not None and not (isinstance(keys, list) and all(isinstance(k, str) for k in keys)):
        raise ValueError(f"{config_file}: lora_parameters.keys must be a list of module paths, got {keys!r}")
    return AdapterConfig(fine_tune_type, num_layers, rank, float(scale), keys)


def _module_paths(model: nn.Module, kinds=nn.Module) -> List[str]:
    """Paths, relative to a block, of the modules of type `kinds` in any block."""
    return sorted({path for block in model.layers for path, m in block.named_modules() if isinstance(m, kinds)})


def _default_keys(model: nn.Module) -> List[str]:
    """Every layer kind upstream adapts by default, in any block."""
    return _module_paths(model, _DEFAULT_TARGETS)


def adapter_targets(model: nn.Module, config: AdapterConfig) -> Dict[str, nn.Module]:
    """{full module path: module} of the layers that get an adapter: `keys` inside each
    of the last num_layers blocks, plus top-level modules named by a key (lm_head)."""
    keys = set(config.keys if config.keys is not None else _default_keys(model))
    by_id = {id(m): path for path, m in model.named_modules()}
    blocks = model.layers[-config.num_layers :] if config.num_layers > 0 else model.layers
    targets = {}
    for block in blocks:
        prefix = by_id[id(block)]
        targets.update({f"{prefix}.{k}": m for k, m in block.named_modules() if k in keys})
    targets.update({path: m for path, m in model.named_modules() if path in keys})
    known = set(_module_paths(model)) | {path for path, _ in model.named_modules()}
    unknown = sorted(keys - known)
    if unknown:
        raise ValueError(f"lora_parameters.keys {unknown} name no module of the model (nor of its blocks)")
    if not targets:
        raise ValueError(f"The adapter keys {sorted(keys)} match no module in the model's last {len(blocks)} blocks")
    return targets


def _check_adapter_weights(model: nn.Module, weights: Dict[str, mx.array], required: List[str], where: Path) -> None:
    """Every required tensor present, every tensor a parameter of the model, shapes equal."""
    params = dict(tree_flatten(model.parameters()))
    problems = []
    missing = [k for k in required if k not in weights]
    if missing:
        problems.append(f"missing {len(missing)} tensors: {', '.join(missing[:10])}")
    unexpected = sorted(k for k in weights if k not in params)
    if unexpected:
        problems.append(f"{len(unexpected)} tensors name nothing in the model: {', '.join(unexpected[:10])}")
    mismatched = [
        f"{k}: file {tuple(v.shape)} vs model {tuple(params[k].shape)}"
        for k, v in weights.items() if k in params and v.shape != params[k].shape
    ]
    if mismatched:
        problems.append(f"shape mismatches (another rank or base model?): {'; '.join(mismatched[:10])}")
    if problems:
        raise ValueError(f"{where} does not fit the model: " + " | ".join(problems))


def load_adapters(model: nn.Module, adapter_path: Union[str, Path]) -> nn.Module:
    """Put the adapters of `adapter_path` on `model` (in place) and return it in eval mode.

    LoRA/DoRA wrap their target layers in LoRALinear/DoRALinear and load the low-rank
    tensors; "full" loads replacement tensors. A malformed directory raises
    (FileNotFoundError, ValueError) naming the problem, before the model is changed."""
    adapter_path = Path(adapter_path)
    if not adapter_path.is_dir():
        raise FileNotFoundError(f"Adapter path {adapter_path} is not a directory")
    config = read_adapter_config(adapter_path)
    weights_file = adapter_path / ADAPTER_WEIGHTS
    if not weights_file.is_file():
        raise FileNotFoundError(f"Adapter directory {adapter_path} has no {ADAPTER_WEIGHTS}")
    try:
        weights = mx.load(str(weights_file))
    except Exception as e:  # MLX raises bare RuntimeError/ValueError for a bad file
        raise ValueError(f"Could not read {weights_file}: {e}") from None
    if config.fine_tune_type == "full":
        _check_adapter_weights(model, weights, [], weights_file)
    else:
        targets = adapter_targets(model, config)
        wrapped = {p: adapter_for(m, config.fine_tune_type, config.rank, config.scale, p) for p, m in targets.items()}
        names = ("lora_a", "lora_b", "m") if config.fine_tune_type == "dora" else ("lora_a", "lora_b")
        required = [f"{path}.{name}" for path in wrapped for name in names]
        originals = [(path, m) for path, m in targets.items()]
        model.update_modules(tree_unflatten(list(wrapped.items())))
        try:
            _check_adapter_weights(model, weights, required, weights_file)
        except ValueError:
            model.update_modules(tree_unflatten(originals))  # leave the model as it was
            raise
    model.load_weights(list(weights.items()), strict=False)
    model.eval()
    return model
