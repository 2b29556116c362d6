"""The prompt-cache file layouts of upstream mlx-lm, independent of the cache classes.

One safetensors file, in either of upstream's two layouts; files are written in the
current one (upstream 0.32.1+, its PR #1778) and both are read:
- current: tensors are the entries' states flattened with dotted keys, "<layer>.<i>[.<j>]",
  each state carrying its scalars too (a KVCache's is (keys, values, offset)), stored as
  0-d arrays, strings as arrays of code points and None as an empty array. String
  metadata: "0.<key>" the user's metadata, "1.<layer>" the class names, and "2.*" a list
  that starts with "" and then names each converted tensor and its kind ("scalar",
  "string", "none").
- before (upstream up to 0.32.0): tensors the array states; string metadata "0.<layer>..."
  the meta states, "1.<key>" the user's metadata, "2.<layer>" the class names.
Which state each class stores, and how a class is rebuilt from it, is `models/cache.py`'s
business: this module maps (class name, state, meta state) per layer to and from the
file, converting between the layouts by class name, so it imports nothing of ours.
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


# --- the current layout: scalars inside the states ------------------------------------

_SCALAR, _STRING, _NONE = "scalar", "string", "none"


def _ints(meta) -> List[int]:
    return [int(x) for x in meta]


def to_current_state(class_name: str, state, meta_state):
    """The state upstream's current layout stores for an entry given as before
    (array state, string meta state): its scalars move into the state. A class upstream
    does not have keeps (state, meta state), which only this package reads back."""
    if class_name == "KVCache":
        keys, values = state if state else (None, None)
        return [keys, values, 0 if keys is None else keys.shape[2]]
    if class_name == "ConcatenateKVCache":
        return list(state) if state else [None, None]
    if class_name == "QuantizedKVCache":
        keys, values = state if state else (None, None)
        return [keys, values, *_ints(meta_state)]  # offset, group_size, bits
    if class_name == "RotatingKVCache":
        keep, max_size, offset, idx = _ints(meta_state)
        keys, values = state if state else (None, None)
        return [keys, values, offset, keep, max_size, idx]
    if class_name == "ChunkedKVCache":  # state: the rows held, in order (cache.py's _file_state)
        _, chunk_size, offset, _ = _ints(meta_state)
        keys, values = state if state else (None, None)
        return [keys, values, offset, chunk_size, offset - (0 if keys is None else keys.shape[2])]
    if class_name == "ArraysCache":
        arrays = state[0] if state and isinstance(state[0], list) else state
        return [[None if a.size == 0 else a for a in arrays], None, None]
    if class_name == "CacheList":
        names, metas = meta_state
        state = list(state) + [[]] * (len(names) - len(state))
        return [[to_current_state(n, s, m), n] for n, s, m in zip(names, state, metas)]
    return [state, meta_state]


def from_current_state(class_name: str, state) -> Tuple[Any, Any]:
    """(array state, string meta state) of an entry read from the current layout: the
    inverse of to_current_state, for files upstream wrote too (a KVCache buffer longer
    than its offset is cut to it)."""
    if class_name == "KVCache":
        keys, values, offset = state
        return ([] if keys is None else [keys[..., :offset, :], values[..., :offset, :]]), ""
    if class_name == "ConcatenateKVCache":
        keys, values = state
        return ([] if keys is None else [keys, values]), ""
    if class_name == "QuantizedKVCache":
        keys, values, offset, group_size, bits = state
        return ([] if keys is None else [list(keys), list(values)]), tuple(map(str, (offset, group_size, bits)))
    if class_name == "RotatingKVCache":
        keys, values, offset, keep, max_size, idx = state
        return ([] if keys is None else [keys, values]), tuple(map(str, (keep, max_size, offset, idx)))
    if class_name == "ChunkedKVCache":
        return _newest_chunk_rows(*state)
    if class_name == "ArraysCache":
        arrays, left_padding, lengths = state
        if left_padding is not None or lengths is not None:
            raise ValueError("batched ArraysCache entries (left padding, lengths) are not supported")
        return [mx.array([]) if a is None else a for a in arrays], ""
    if class_name == "CacheList":
        children = [from_current_state(name, child) for child, name in state]
        return [c[0] for c in children], ([name for _, name in state], [c[1] for c in children])
    array_state, meta_state = state
    return array_state, meta_state


def _newest_chunk_rows(keys, values, offset: int, chunk_size: int, start_position: int):
    """An upstream ChunkedKVCache (rows of positions start_position.. from row 0 of a
    buffer that may be longer) as the state and meta state of this package's: a ring of
    the chunk_size newest rows, here in order, the write index past them."""
    held = min(offset, chunk_size)
    meta = tuple(map(str, (0, chunk_size, offset, held)))
    if keys is None:
        if offset:
            raise ValueError(f"a ChunkedKVCache at offset {offset} holds no keys")
        return [], meta
    valid = offset - start_position
    if not held <= valid <= keys.shape[2]:
        raise ValueError(f"a ChunkedKVCache at offset {offset} (chunks of {chunk_size}) needs its newest {held} "
                         f"rows; from position {start_position} it has {valid}, in a buffer of {keys.shape[2]}")
    return [keys[..., valid - held : valid, :], values[..., valid - held : valid, :]], meta


def _encode_leaf(key: str, leaf, kinds: list):
    """A state leaf as an array, its kind recorded in `kinds` unless it is one."""
    if isinstance(leaf, mx.array):
        return leaf
    if isinstance(leaf, str):
        kinds.append([key, _STRING])
        return mx.array([ord(c) for c in leaf], dtype=mx.int32)
    if leaf is None:
        kinds.append([key, _NONE])
        return mx.array([])
    if isinstance(leaf, (bool, int, float)):
        kinds.append([key, _SCALAR])
        return mx.array(leaf)
    raise ValueError(f"cache state leaf {key} is not serializable: {type(leaf).__name__}")


def _decode_leaf(array: mx.array, kind: str):
    if kind == _SCALAR:
        return array.item()
    if kind == _STRING:
        return "".join(chr(c) for c in array.tolist())
    if kind == _NONE:
        return None
    raise ValueError(f"unknown kind {kind!r} of a state entry")


def write_cache_file(file_name: str, entries: Sequence[Tuple[str, Any, Any]], metadata: Dict[str, str]) -> None:
    """Write one (class name, state tree of arrays, meta state tree of strings) per
    layer and the user's string `metadata`, in upstream's current layout (MLX appends
    ".safetensors" to a name without it)."""
    bad = {k: v for k, v in metadata.items() if not (isinstance(k, str) and isinstance(v, str))}
    if bad:
        raise ValueError(f"Prompt cache metadata must map strings to strings; got {bad!r}")
    tensors, kinds = {}, [""]  # "" first: upstream's list is never empty
    strings = {f"0.{k}": v for k, v in metadata.items()}
    for i, (class_name, state, meta_state) in enumerate(entries):
        for key, leaf in _flatten(to_current_state(class_name, state, meta_state), str(i)).items():
            tensors[key] = _encode_leaf(key, leaf, kinds)
        strings[f"1.{i}"] = class_name
    strings.update(_flatten(kinds, "2"))
    mx.save_safetensors(str(file_name), tensors, strings)


def _is_current_layout(strings: Dict[str, str]) -> bool:
    """The current layout's "2" list starts with "" ("2.0"); before, "2.0" named the
    first entry's class."""
    return strings.get("2.0") == ""


def _by_layer(leaves: dict, num_layers: int) -> Dict[int, dict]:
    """{"<layer>.<rest>": leaf} -> {layer: {"<rest>": leaf}} for layers 0..num_layers-1.
    Tensors of layers past the class names are skipped, as upstream's loader (which
    zips names with states) skips them: a checkpointed cache keeps its snapshots there
    (models/checkpoint_files.py)."""
    per_layer: Dict[int, dict] = {i: {} for i in range(num_layers)}
    for key, leaf in leaves.items():
        layer, _, rest = key.partition(".")
        if not layer.isdigit():
            raise ValueError(f"tensor {key!r} belongs to no cache entry")
        if int(layer) in per_layer:
            per_layer[int(layer)][rest] = leaf
    return per_layer


def _read_current(tensors: dict, strings: Dict[str, str], build_entry) -> Tuple[list, Dict[str, str]]:
    sections: dict = {"0": {}, "1": {}, "2": {}}
    for key, value in strings.items():
        section, _, rest = key.partition(".")
        if section in sections:
            sections[section][rest] = value
    class_names, kinds = _unflatten(sections["1"]), _unflatten(sections["2"])[1:]
    if not isinstance(class_names, list) or not class_names:
        raise ValueError('no class names (expected "1.<layer>" keys)')
    leaves = dict(tensors)
    for key, kind in kinds:
        if key not in leaves:
            raise ValueError(f"the kinds list names {key!r}, which the file has no tensor for")
        leaves[key] = _decode_leaf(leaves[key], kind)
    per_layer = _by_layer(leaves, len(class_names))
    entries = []
    for i, name in enumerate(class_names):
        try:
            state, meta_state = from_current_state(name, _unflatten(per_layer[i], allow_gaps=True))
            entries.append(build_entry(name, state, meta_state))
        except (ValueError, TypeError, IndexError, KeyError, AttributeError) as e:
            raise ValueError(f"entry {i} ({name!r}): {e}") from None
    return entries, sections["0"]


def read_cache_file(
    file_name: str, build_entry: Callable[[str, Any, Any], Entry]
) -> Tuple[List[Entry], Dict[str, str]]:
    """([build_entry(class name, state, meta state) per layer], user metadata), from a
    file in either layout. Every problem, in the layout or from `build_entry`, raises
    ValueError naming the file (and the entry)."""
    try:
        tensors, strings = mx.load(str(file_name), return_metadata=True)
    except (RuntimeError, ValueError, OSError) as e:
        raise ValueError(f"Could not read prompt cache file {file_name}: {e}") from None
    if not isinstance(tensors, dict):
        raise ValueError(f"Prompt cache file {file_name} is not a safetensors file")
    if _is_current_layout(strings):
        try:
            return _read_current(tensors, strings, build_entry)
        except ValueError as e:
            raise ValueError(f"Malformed prompt cache file {file_name}: {e}") from None
    by_section: dict = {"0": {}, "1": {}, "2": {}}
    for key, value in strings.items():
        section, _, rest = key.partition(".")
        if section in by_section:
            by_section[section][rest] = value
    try:
        class_names = _unflatten(by_section["2"])
        meta_states = _unflatten(by_section["0"])
        per_layer = _by_layer(tensors, len(class_names))
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
