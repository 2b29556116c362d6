"""Writing a model directory in the MLX layout: sharded weights with their index, the
config, the tokenizer and the files generation needs."""

import json
import os
import secrets
import shutil
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Tuple, Union

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten, tree_map

from .config_files import save_config
from .hub import create_model_card, hf_repo_to_path
from .quantization import get_total_parameters
from .tokenizer_utils import TokenizerWrapper

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


def _weights_of(model: Union[nn.Module, Dict[str, mx.array]], donate_model: bool) -> Dict[str, mx.array]:
    if not isinstance(model, nn.Module):
        if donate_model:
            raise ValueError("donate_model=True needs the model (an nn.Module), not a dict of weights")
        return dict(model)
    weights = dict(tree_flatten(model.parameters()))
    if donate_model:  # the model keeps no reference, so each shard is freed once written
        model.update(tree_map(lambda _: mx.array([]), model.parameters()))
    return weights


def save_model(
    save_path: Union[str, Path],
    model: Union[nn.Module, Dict[str, mx.array]],
    *,
    donate_model: bool = False,
    max_shard_bytes: int = MAX_SHARD_BYTES,
    progress: Optional[Callable[[int, int], None]] = None,
) -> None:
    """Write the model's weights (or a dict of them) as `model.safetensors` (or
    `model-0000i-of-0000n.safetensors` shards) plus `model.safetensors.index.json` with
    the weight map, the total size and, for a model, its parameter count.
    `progress(bytes_written, total_bytes)` is called as tensors are computed.
    `donate_model` (upstream's): empty the model's parameters first, so that each shard's
    memory is freed as soon as it is written and the model is left unusable; a failed
    write then loses the in-memory model (the checkpoint it came from is untouched)."""
    save_path = Path(save_path)
    save_path.mkdir(parents=True, exist_ok=True)
    metadata: Dict[str, int] = {}
    if isinstance(model, nn.Module):
        metadata["total_parameters"] = get_total_parameters(model)
    weights = _weights_of(model, donate_model)
    metadata["total_size"] = sum(t.nbytes for t in weights.values())
    shards = _shards_of_bytes(weights, max_shard_bytes)
    weights.clear()
    done, weight_map = 0, {}
    for i in range(len(shards)):
        shard, shards[i] = shards[i], None  # hold each shard only while writing it
        name = "model.safetensors" if len(shards) == 1 else f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        for tensor in shard.values():  # evaluate one by one so progress moves
            mx.eval(tensor)
            done += tensor.nbytes
            if progress is not None:
                progress(done, metadata["total_size"])
        mx.save_safetensors(str(save_path / name), shard, metadata={"format": "mlx"})
        weight_map.update({k: name for k in shard})
        del shard
    index = {"metadata": metadata, "weight_map": dict(sorted(weight_map.items()))}
    (save_path / WEIGHTS_INDEX).write_text(json.dumps(index, indent=4))


# Copied as they are by `save`: what generation needs beyond config and tokenizer, and
# the source's Python files (a tokenizer's remote code, which the copy needs to load).
EXTRA_FILES = ["generation_config.json", "*.py"]


def _source_directory(src_path_or_repo: Union[str, Path]) -> Tuple[Path, Optional[str]]:
    """(the local directory, the hub repo id or None) of what was converted."""
    from huggingface_hub.errors import HFValidationError, LocalEntryNotFoundError

    if Path(src_path_or_repo).exists():
        return Path(src_path_or_repo), None
    try:
        return hf_repo_to_path(str(src_path_or_repo)), str(src_path_or_repo)
    except (HFValidationError, LocalEntryNotFoundError):
        raise FileNotFoundError(
            f"save: the source {str(src_path_or_repo)!r} is neither a directory nor a hub repo in the local cache"
        ) from None


def save(
    dst_path: Union[str, Path],
    src_path_or_repo: Union[str, Path],
    model: nn.Module,
    tokenizer: TokenizerWrapper,
    config: Dict[str, Any],
    donate_model: bool = True,
    *,
    progress: Optional[Callable[[int, int], None]] = None,
) -> None:
    """Save a complete model directory: weights (save_model, which calls `progress`;
    `donate_model`, upstream's default, frees them as they are written and leaves the
    model empty), config.json, the tokenizer files, the source's EXTRA_FILES and a model
    card (README.md). `src_path_or_repo`: the checkpoint converted, a directory or a hub
    repo in the local cache. `dst_path` must not exist; it is written under a temporary
    name and renamed when complete, so a failure leaves nothing behind."""
    dst_path = Path(dst_path)
    if dst_path.exists():
        raise ValueError(f"Cannot save to {dst_path}: it already exists; choose another path or remove it")
    src_path, hf_repo = _source_directory(src_path_or_repo)
    dst_path.parent.mkdir(parents=True, exist_ok=True)
    # os.mkdir, not tempfile.mkdtemp: the folder is renamed into place, and should get
    # the mode the umask gives any folder (mkdtemp's is 0700, private to its owner).
    staging = dst_path.parent / f".{dst_path.name}.partial-{secrets.token_hex(8)}"
    os.mkdir(staging)
    try:
        save_model(staging, model, donate_model=donate_model, progress=progress)
        save_config(config, staging / "config.json")
        tokenizer.save_pretrained(str(staging))
        for pattern in EXTRA_FILES:
            for source in sorted(src_path.glob(pattern)):
                shutil.copyfile(source, staging / source.name)
        create_model_card(staging, hf_repo)
        os.rename(staging, dst_path)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
