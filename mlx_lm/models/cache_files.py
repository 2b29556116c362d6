"""The prompt-cache file layout of upstream mlx-lm, independent of the cache classes.

One safetensors file. Tensors: the entries' states flattened with dotted keys,
"<layer>.<i>[.<j>]". String metadata: "0.<layer>[.<i>...]" the meta states, "1.<key>"
the user's metadata, "2.<layer>" the class names. Which state each class stores, and
how a class is rebuilt from it, is `models/cache.py`'s business (`save_prompt_cache`,
`load_prompt_cache`); this module only maps (class name, state, meta state) per layer
to and from the file, so it sits below cache.py and imports nothing of ours.
"""

from typing import Any, Callable, Dict, List, Sequence, Tuple, TypeVar

import mlx.core as mx

Entry = TypeVar("Entry")


def _flatten(tree, prefix: str) -> dict:
    """Nested lists/tuples -> {dotted key: leaf}: ([a, b], c) -> {"p.0.0": a, "p.0.1": b, "p.1": c}."""
    if isinstance(tree, (list, tuple)):
        flat = {}
        for i, subtree in enumerate(tree):
            flat.update(_flatten(subtree, f"{prefix}.{i}"))
        return flat
    return {prefix: tree}


def _unflatten(flat: dict, allow_gaps: bool = False):
    """Inverse of _flatten below one prefix: {"": leaf} -> leaf, {"0.0": a, "1": b} -> [[a], b].

    `allow_gaps` (tensor states): an empty list, the state of an empty cache, flattens
    to no key at all, so a missing index is an empty list; trailing ones are lost and
    the reader pads them back (a CacheList knows its number of children from its meta
    state). Strings (class names, meta states) are never empty lists: a gap is an error.
    """
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
    if not allow_gaps and sorted(children) != list(range(len(children))):
        raise ValueError(f"indices {sorted(children)} are not 0..{len(children) - 1}")
    size = max(children, default=-1) + 1
    return [_unflatten(children[i], allow_gaps) if i in children else [] for i in range(size)]


def write_cache_file(file_name: str, entries: Sequence[Tuple[str, Any, Any]], metadata: Dict[str, str]) -> None:
    """Write one (class name, state tree of arrays, meta state tree of strings) per
    layer and the user's string `metadata` (MLX appends ".safetensors" to a name
    without it)."""
    bad = {k: v for k, v in metadata.items() if not (isinstance(k, str) and isinstance(v, str))}
    if bad:
        raise ValueError(f"Prompt cache metadata must map strings to strings; got {bad!r}")
    tensors = {}
    strings = {f"1.{k}": v for k, v in metadata.items()}
    for i, (class_name, state, meta_state) in enumerate(entries):
        tensors.update(_flatten(state, str(i)))
        strings.update(_flatten(meta_state, f"0.{i}"))
        strings[f"2.{i}"] = class_name
    mx.save_safetensors(str(file_name), tensors, strings)


def read_cache_file(
    file_name: str, build_entry: Callable[[str, Any, Any], Entry]
) -> Tuple[List[Entry], Dict[str, str]]:
    """([build_entry(class name, state, meta state) per layer], user metadata). Every
    problem, in the layout or from `build_entry`, raises ValueError naming the file
    (and the entry)."""
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
    entries = []
    for i, (name, meta) in enumerate(zip(class_names, meta_states)):
        try:
            entries.append(build_entry(name, _unflatten(per_layer[i], allow_gaps=True), meta))
        except (ValueError, TypeError, IndexError, KeyError, AttributeError) as e:
            raise ValueError(f"Malformed prompt cache file {file_name}: entry {i} ({name!r}): {e}") from None
    return entries, by_section["1"]
