"""Prompt-cache files in upstream mlx-lm's layout.

One safetensors file. Tensors: the entries' states flattened with dotted keys,
"<layer>.<i>[.<j>]". String metadata: "0.<layer>[.<i>...]" the meta states, "1.<key>"
the user's metadata, "2.<layer>" the class names. An ArraysCache is stored as upstream
does since #1632: ([arrays], left_padding, lengths), an empty array standing for None.
Loading resolves class names through CACHE_CLASSES only and never runs code.
"""

from typing import Any, List, Optional

import mlx.core as mx

from .cache import CACHE_CLASSES, ArraysCache, CacheList, _BaseCache

_EMPTY = mx.array([], dtype=mx.float32)


def _flatten(tree, prefix: str) -> dict:
    """Nested lists/tuples -> {dotted key: leaf}: ([a, b], c) -> {"p.0.0": a, "p.0.1": b, "p.1": c}."""
    if isinstance(tree, (list, tuple)):
        flat = {}
        for i, subtree in enumerate(tree):
            flat.update(_flatten(subtree, f"{prefix}.{i}"))
        return flat
    return {prefix: tree}


def _unflatten(flat: dict):
    """Inverse of _flatten below one prefix: {"": leaf} -> leaf, {"0.0": a, "1": b} -> [[a], b]."""
    if "" in flat:
        if len(flat) > 1:
            raise ValueError(f"an entry is both a leaf and a list: {sorted(flat)}")
        return flat[""]
    children: dict = {}
    for key, value in flat.items():
        head, _, rest = key.partition(".")
        if not head.isdigit():
            raise ValueError(f"key part {head!r} is not an index")
        children.setdefault(int(head), {})[rest] = value
    if sorted(children) != list(range(len(children))):
        raise ValueError(f"indices {sorted(children)} are not 0..{len(children) - 1}")
    return [_unflatten(children[i]) for i in range(len(children))]


def _file_state(entry: _BaseCache):
    if isinstance(entry, CacheList):
        return [_file_state(c) for c in entry.caches]
    if isinstance(entry, ArraysCache):
        return [[_EMPTY if a is None else a for a in entry.state], _EMPTY, _EMPTY]
    return entry.state


def _from_file(class_name: str, state, meta_state) -> _BaseCache:
    if class_name not in CACHE_CLASSES:
        raise ValueError(f"unknown cache class {class_name!r}; known classes: {', '.join(sorted(CACHE_CLASSES))}")
    cls = CACHE_CLASSES[class_name]
    if not isinstance(state, list):
        raise ValueError(f"a {class_name} state must be a list of arrays, got one array")
    if cls is CacheList:
        class_names, metas = meta_state
        if not len(class_names) == len(metas) == len(state):
            raise ValueError(f"CacheList of {len(class_names)} classes, {len(metas)} metas, {len(state)} states")
        return CacheList(*(_from_file(n, s, m) for n, s, m in zip(class_names, state, metas)))
    if cls is ArraysCache:
        if state and isinstance(state[0], list):  # ([arrays], left_padding, lengths)
            if any(extra.size for extra in state[1:]):
                raise ValueError("batched ArraysCache entries (left padding, lengths) are not supported")
            state = state[0]
        state = [None if a.size == 0 else a for a in state]
    return cls.from_state(state, meta_state)


def save_prompt_cache(file_name: str, cache: List[Any], metadata: Optional[dict] = None) -> None:
    """Save a prompt cache and string `metadata` to one safetensors file (upstream's
    layout; MLX appends ".safetensors" to a name without it)."""
    metadata = metadata or {}
    bad = {k: v for k, v in metadata.items() if not (isinstance(k, str) and isinstance(v, str))}
    if bad:
        raise ValueError(f"Prompt cache metadata must map strings to strings; got {bad!r}")
    tensors = {}
    strings = {f"1.{k}": v for k, v in metadata.items()}
    for i, entry in enumerate(cache):
        tensors.update(_flatten(_file_state(entry), str(i)))
        strings.update(_flatten(entry.meta_state, f"0.{i}"))
        strings[f"2.{i}"] = type(entry).__name__
    mx.save_safetensors(str(file_name), tensors, strings)


def load_prompt_cache(file_name: str, return_metadata: bool = False):
    """Load a prompt cache (and, with `return_metadata`, its user metadata) saved by
    `save_prompt_cache` or upstream mlx-lm. A malformed file raises ValueError."""
    try:
        tensors, strings = mx.load(str(file_name), return_metadata=True)
    except (RuntimeError, ValueError, OSError) as e:
        raise ValueError(f"Could not read prompt cache file {file_name}: {e}") from None
    if not isinstance(tensors, dict):
        raise ValueError(f"Prompt cache file {file_name} is not a safetensors file")
    by_section: dict = {"0": {}, "1": {}, "2": {}}
    for key, value in strings.items():
        section, _, rest = key.partition(".")
        if section in by_section:
            by_section[section][rest] = value
    try:
        class_names = _unflatten(by_section["2"])
        meta_states = _unflatten(by_section["0"])
        per_layer: dict = {i: {} for i in range(len(class_names))}
        for key, tensor in tensors.items():
            layer, _, rest = key.partition(".")
            if not (layer.isdigit() and int(layer) in per_layer):
                raise ValueError(f"tensor {key!r} belongs to no cache entry")
            per_layer[int(layer)][rest] = tensor
    except ValueError as e:
        raise ValueError(f"Malformed prompt cache file {file_name}: {e}") from None
    if not (isinstance(class_names, list) and isinstance(meta_states, list)):
        raise ValueError(
            f"Malformed prompt cache file {file_name}: {len(class_names)} class names and no list of "
            'meta states (expected "2.<layer>" and "0.<layer>" keys)'
        )
    if not class_names or len(meta_states) != len(class_names):
        raise ValueError(
            f"Malformed prompt cache file {file_name}: {len(class_names)} class names and "
            f"{len(meta_states)} meta states (expected one of each per layer, at least one layer)"
        )
    cache = []
    for i, (name, meta) in enumerate(zip(class_names, meta_states)):
        try:
            cache.append(_from_file(name, _unflatten(per_layer[i]), meta))
        except (ValueError, TypeError, IndexError, KeyError, AttributeError) as e:
            raise ValueError(f"Malformed prompt cache file {file_name}: entry {i} ({name!r}): {e}") from None
    if return_metadata:
        return cache, by_section["1"]
    return cache
