"""A CheckpointedCache's snapshots in a prompt-cache file (issue 33), so that a cache
loaded from a file (mlx_lm.cache_prompt, --prompt-cache-file) goes back to them.

The file is the one `save_prompt_cache` writes (upstream's current layout,
cache_files.py), plus:
- the snapshots' arrays as tensors "<N + j>.<a>": N entries are named in the file, so
  these sit at the positions of entries that are not there. Upstream's loader pairs
  class names with states (`zip`), so it never reaches them, and ours skips them too
  (cache_files._by_layer); both load the cache as if they were absent;
- one string of user metadata, SNAPSHOTS_KEY: JSON of where each snapshot was taken,
  what it holds per entry (class name, meta state, which of its arrays are which
  tensors) and the CheckpointedCache's own settings. Upstream returns it among the
  metadata, as any other key.

`save_checkpointed(file, cache, metadata)` writes a cache with its snapshots (a plain
list as save_prompt_cache does); `load_checkpointed(file)` gives back a CheckpointedCache
where the file has snapshots, else the plain list.
"""

import json
import os
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple

import mlx.core as mx

from .cache import CACHE_CLASSES, load_prompt_cache, save_prompt_cache
from .checkpoints import CheckpointedCache, Saved, Snapshot

# No dot: upstream unflattens metadata keys at dots.
SNAPSHOTS_KEY = "mlx_lm_snapshots"


def _describe(saved: Saved, arrays: List[mx.array]) -> Any:
    """JSON for one entry of a snapshot; its arrays are appended to `arrays`."""
    if saved is None or isinstance(saved, int):
        return saved  # a trimmable entry: the tokens it held, None for the snapshot's position
    if isinstance(saved, list):
        return [_describe(s, arrays) for s in saved]
    cls, state, meta_state = saved
    slots = []
    for array in state:
        slots.append(None if array is None else len(arrays))
        if array is not None:
            arrays.append(array)
    return {"class": cls.__name__, "meta": meta_state, "arrays": slots}


def _rebuild(description: Any, tensors: Dict[str, mx.array], layer: int) -> Saved:
    if description is None or isinstance(description, int):
        return description
    if isinstance(description, list):
        return [_rebuild(d, tensors, layer) for d in description]
    name = description["class"]
    if name not in CACHE_CLASSES:
        raise ValueError(f"unknown cache class {name!r} in a snapshot")
    state = [None if a is None else tensors[f"{layer}.{a}"] for a in description["arrays"]]
    meta = description["meta"]
    return CACHE_CLASSES[name], state, tuple(meta) if isinstance(meta, list) else meta


def save_checkpointed(file_name: str, prompt_cache: List[Any], metadata: Optional[Dict[str, str]] = None) -> None:
    """save_prompt_cache, and for a CheckpointedCache its snapshots too (module
    docstring). Written to a temporary file first, then moved over `file_name`."""
    metadata = dict(metadata or {})
    if SNAPSHOTS_KEY in metadata:
        raise ValueError(f"metadata key {SNAPSHOTS_KEY!r} is reserved for the cache's snapshots")
    if not isinstance(prompt_cache, CheckpointedCache):
        save_prompt_cache(file_name, prompt_cache, metadata)
        return
    path = Path(file_name if str(file_name).endswith(".safetensors") else f"{file_name}.safetensors")
    extra, described = {}, []
    for j, position in enumerate(prompt_cache.positions()):
        snapshot, arrays = prompt_cache.snapshots[position], []
        entries = [_describe(s, arrays) for s in snapshot.saved]
        hidden = None if snapshot.hidden is None else len(arrays)
        arrays += [] if snapshot.hidden is None else [snapshot.hidden]
        extra.update({f"{len(prompt_cache) + j}.{a}": array for a, array in enumerate(arrays)})
        described.append({"position": position, "message_boundaries": list(snapshot.message_boundaries),
                          "nbytes": snapshot.nbytes, "entries": entries, "hidden": hidden})
    metadata[SNAPSHOTS_KEY] = json.dumps({
        "prefill_step_size": prompt_cache.prefill_step_size, "max_bytes": prompt_cache.max_bytes,
        "spacing": prompt_cache.spacing, "num_tokens": prompt_cache.held_tokens(), "on_grid": prompt_cache.on_grid,
        "message_boundaries": list(prompt_cache.message_boundaries), "snapshots": described,
    })
    temporary = path.with_name(path.name + ".partial.safetensors")
    save_prompt_cache(str(temporary), prompt_cache, metadata)
    tensors, strings = mx.load(str(temporary), return_metadata=True)
    mx.save_safetensors(str(temporary), {**tensors, **extra}, strings)
    os.replace(temporary, path)


def load_checkpointed(file_name: str) -> Tuple[List[Any], Dict[str, str]]:
    """(cache, user metadata) from a file: a CheckpointedCache holding the snapshots the
    file keeps (their key left out of the metadata), else load_prompt_cache's list.
    A malformed snapshot record raises ValueError naming the file."""
    entries, metadata = load_prompt_cache(file_name, return_metadata=True)
    if SNAPSHOTS_KEY not in metadata:
        return entries, metadata
    record = metadata.pop(SNAPSHOTS_KEY)
    try:
        return _checkpointed(entries, json.loads(record), mx.load(str(file_name))), metadata
    except (ValueError, KeyError, TypeError, IndexError) as e:
        raise ValueError(f"Prompt cache file {file_name} has a malformed {SNAPSHOTS_KEY} record: {e}") from None


def _checkpointed(entries: List[Any], record: dict, tensors: Dict[str, mx.array]) -> CheckpointedCache:
    cache = CheckpointedCache(entries, record["prefill_step_size"], record["max_bytes"],
                              num_tokens=record["num_tokens"], on_grid=record["on_grid"])
    cache.count_as(record["num_tokens"])  # checks the entries hold that many
    cache.on_grid, cache.spacing = record["on_grid"], record["spacing"]
    cache.message_boundaries = tuple(record["message_boundaries"])
    for j, described in enumerate(record["snapshots"]):
        layer = len(entries) + j
        saved = [_rebuild(d, tensors, layer) for d in described["entries"]]
        if len(saved) != len(entries):
            raise ValueError(f"a snapshot describes {len(saved)} entries, the file holds {len(entries)}")
        # "hidden" (an MTP head's row, the tensor's index) is absent from older files.
        hidden = described.get("hidden")
        cache.snapshots[described["position"]] = Snapshot(
            described["position"], saved, described["nbytes"], tuple(described["message_boundaries"]),
            None if hidden is None else tensors[f"{layer}.{hidden}"])
    return cache
