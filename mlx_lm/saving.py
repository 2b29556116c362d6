"""Writing a model directory in the MLX layout: sharded weights with their index, the
config, the tokenizer and the files generation needs."""

import json
import os
import secrets
import shutil
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Union

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten

from .config_files import save_config
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
