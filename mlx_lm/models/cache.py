"""Per-layer caches and the helpers that build, inspect and trim a model's cache list.

Every cache entry implements the protocol of DESIGN.md §2: `state`/`meta_state` (what a
prompt-cache file stores), `from_state`, `is_trimmable()`, `trim(n)`, `size()`,
`nbytes`, `empty()` and `make_mask(N)`. `trim` never clamps: removing more than the
cache can give back is an error, because the layers of one model must stay in step.

Speculative decoding needs every entry to give back the last few tokens. KV caches
simply forget rows. A sliding window that has wrapped, and a recurrent state, cannot:
between `start_speculation()` and `stop_speculation()` they keep a `RollbackLog` of
the forwards they took part in, and `trim(n)` rewinds through it exactly.

Upstream's other names live here too, some re-exported: ArraysCache (arrays_cache.py),
QuantizedKVCache (quantized_cache.py), RotatingKVCache and ChunkedKVCache
(rotating_cache.py), the batched classes (batch_cache.py), PromptTrie (prompt_trie.py),
TokenBuffer, create_attention_mask, dynamic_roll and LRUPromptCache (lru_prompt_cache.py,
which builds on checkpoints.py and so on this module: it registers itself).
"""

from typing import Any, List, Optional, Sequence

import mlx.core as mx

from .arrays_cache import ArraysCache
from .cache_base import (  # noqa: F401  (create_attention_mask, dynamic_roll: upstream's home)
    BATCH_CLASSES, LATE_NAMES, ROLLBACK_WINDOW, _AppendOnlyCache, _BaseCache, _grow, create_attention_mask,
    dynamic_roll, grown_capacity,
)
from .cache_files import read_cache_file, write_cache_file
from .prompt_trie import PromptTrie, PromptTrieResult  # noqa: F401  (upstream's home of both)
from .quantized_cache import QuantizedKVCache, check_kv_quantization_params
from .rotating_cache import ChunkedKVCache, RotatingKVCache  # noqa: F401  (upstream's home of both)


class KVCache(_AppendOnlyCache):
    """Keys and values (B, H_kv, T, D) of every token seen, grown in blocks of `step`."""

    step = 256

    def __init__(self):
        self.keys = None
        self.values = None
        self.offset = 0

    def update_and_fetch(self, keys: mx.array, values: mx.array):
        """Append (B, H_kv, S, D) keys/values; return all (B, H_kv, offset, D) so far."""
        start, end = self.offset, self.offset + keys.shape[2]
        if self.keys is None or end > self.keys.shape[2]:
            self.keys = _grow(self.keys, start, end, keys, self.step)
            self.values = _grow(self.values, start, end, values, self.step)
        self.keys[..., start:end, :] = keys
        self.values[..., start:end, :] = values
        self.offset = end
        return self.keys_and_values()

    def keys_and_values(self):
        """The (B, H_kv, offset, D) keys and values held, as update_and_fetch returns
        them (a layer that reads another layer's cache); (None, None) when empty."""
        if self.keys is None:
            return None, None
        return self.keys[..., : self.offset, :], self.values[..., : self.offset, :]

    @property
    def state(self):
        if self.keys is None:
            return []
        return self.keys_and_values()

    @state.setter
    def state(self, value):
        self.keys, self.values = value if len(value) else (None, None)
        self.offset = 0 if self.keys is None else self.keys.shape[2]

    @property
    def meta_state(self):
        return ""

    @meta_state.setter
    def meta_state(self, value):
        pass

    @property
    def nbytes(self) -> int:
        return 0 if self.keys is None else self.keys.nbytes + self.values.nbytes

    def to_quantized(self, group_size: int = 64, bits: int = 4) -> "QuantizedKVCache":
        """A QuantizedKVCache holding these tokens (each row quantized on its own, so
        quantizing now or token by token gives the same result)."""
        quantized = QuantizedKVCache(group_size, bits)
        if self.keys is not None and self.offset:
            quantized.update_and_fetch(*self.state)
        return quantized


class ConcatenateKVCache(KVCache):
    """Upstream's simplest KV cache: keys and values (B, H_kv, T, D) of every token seen,
    one array each, concatenated on every update (no spare rows: the choice for a few
    large updates, where KVCache's blocks buy nothing). `trim(n)` drops the rows."""

    def update_and_fetch(self, keys: mx.array, values: mx.array):
        """Append (B, H_kv, S, D) keys/values; return all (B, H_kv, offset, D) so far."""
        if self.keys is not None:
            keys = mx.concatenate([self.keys, keys], axis=2)
            values = mx.concatenate([self.values, values], axis=2)
        self.keys, self.values, self.offset = keys, values, keys.shape[2]
        return keys, values

    def trim(self, n: int) -> int:
        """Drop the last n rows (upstream moves only the offset and keeps returning them)."""
        n = super().trim(n)
        if n:
            kept = self.offset
            self.keys, self.values = (self.keys[..., :kept, :], self.values[..., :kept, :]) if kept else (None, None)
        return n


class CacheList(_BaseCache):
    """Several caches serving one layer; trimmable iff every child is."""

    def __init__(self, *caches: _BaseCache):
        self.caches = caches

    def __getitem__(self, index: int) -> _BaseCache:
        return self.caches[index]

    # Upstream's batch forms, child by child (each child a batch of its kind).

    def filter(self, batch_indices: Sequence[int]) -> "CacheList":
        """Only rows `batch_indices` of every child stay, in place (as upstream's); returns self."""
        self.caches = tuple(c.filter(batch_indices) for c in self.caches)
        return self

    def extend(self, other: "CacheList") -> "CacheList":
        """Other's rows after these, child by child, in place; returns self."""
        if not isinstance(other, CacheList) or len(other.caches) != len(self.caches):
            found = f"{len(other.caches)} children" if isinstance(other, CacheList) else f"a {type(other).__name__}"
            raise ValueError(f"a CacheList of {len(self.caches)} children cannot be extended by {found}")
        self.caches = tuple(c.extend(o) for c, o in zip(self.caches, other.caches))
        return self

    def extract(self, index: int) -> "CacheList":
        """Row `index` of every child, as a CacheList of one sequence."""
        return CacheList(*(c.extract(index) for c in self.caches))

    def prepare(self, **padding) -> None:
        for c in self.caches:
            c.prepare(**padding)

    def finalize(self) -> None:
        for c in self.caches:
            c.finalize()

    def make_mask(self, num_queries: int, window_size: Optional[int] = None, return_array: bool = False):
        """The mask of the children that need one (a recurrent child needs none). The
        children serve one layer and so hold the same tokens: children that mask must
        give the same shape, else the layer should ask the child its attention uses.
        "causal" only if every masking child answers it."""
        masks = self._child_masks(num_queries, window_size, return_array)
        if masks and not return_array and any(not isinstance(mask, str) for _, mask in masks):
            masks = self._child_masks(num_queries, window_size, True)
        if not masks:
            return None
        shapes = {mask if isinstance(mask, str) else tuple(mask.shape) for _, mask in masks}
        if len(shapes) > 1:
            found = ", ".join(f"{tuple(mask.shape)} from {name}" for name, mask in masks)
            raise ValueError(
                f"The children of this CacheList need different masks ({found}); call make_mask "
                "on the child the attention reads (cache_list[i].make_mask)"
            )
        return masks[0][1]

    def _child_masks(self, num_queries: int, window_size: Optional[int], return_array: bool):
        masks = [(type(c).__name__, c.make_mask(num_queries, window_size=window_size, return_array=return_array)) for c in self.caches]
        return [(name, mask) for name, mask in masks if mask is not None]

    def size(self) -> int:
        return max((c.size() for c in self.caches), default=0)

    @property
    def state(self):
        return [c.state for c in self.caches]

    @state.setter
    def state(self, value):
        for c, s in zip(self.caches, value):
            c.state = s

    @property
    def meta_state(self):
        return [type(c).__name__ for c in self.caches], [c.meta_state for c in self.caches]

    @meta_state.setter
    def meta_state(self, value):
        pass

    @classmethod
    def from_state(cls, state, meta_state):
        class_names, metas = meta_state
        return cls(*(CACHE_CLASSES[n].from_state(s, m) for n, s, m in zip(class_names, state, metas)))

    @property
    def needs_layer_records(self) -> bool:
        return any(c.needs_layer_records for c in self.caches)

    def start_speculation(self, rollback_window: int = ROLLBACK_WINDOW) -> None:
        for c in self.caches:
            c.start_speculation(rollback_window)

    def stop_speculation(self) -> None:
        for c in self.caches:
            c.stop_speculation()

    def is_trimmable(self) -> bool:
        return all(c.is_trimmable() for c in self.caches)

    def trim(self, n: int) -> int:
        if n > 0 and not self.is_trimmable():
            raise RuntimeError("Cannot trim a CacheList with an untrimmable child")
        for c in self.caches:
            c.trim(n)
        return max(n, 0)

    @property
    def nbytes(self) -> int:
        return sum(c.nbytes for c in self.caches)

    def empty(self) -> bool:
        return self.caches[0].empty()


class SharedKVReader(_BaseCache):
    """The entry of a layer that attends over the keys and values another layer's cache
    returns (Gemma 3n's and Gemma 4's KV-shared layers): it holds nothing, so trimming,
    speculating, saving and batching it change nothing. The layer it reads from rolls
    back its own cache, and so what its readers see, in the same trim."""

    def start_speculation(self, rollback_window: int = ROLLBACK_WINDOW) -> None:
        pass

    def stop_speculation(self) -> None:
        pass

    @property
    def state(self):
        return []

    @state.setter
    def state(self, value):
        if len(value):
            raise ValueError(f"a SharedKVReader holds no arrays; got a state of {len(value)}")

    @property
    def meta_state(self):
        return ""

    @meta_state.setter
    def meta_state(self, value):
        pass

    def make_mask(self, num_queries: int, window_size: Optional[int] = None, return_array: bool = False):
        return None  # the layer uses the mask of the cache it reads

    def is_trimmable(self) -> bool:
        return True

    def trim(self, n: int) -> int:
        return max(n, 0)

    def size(self) -> int:
        return 0

    @property
    def nbytes(self) -> int:
        return 0

    def empty(self) -> bool:
        # Nothing of its own ever arrives: whether a model's caches are filled is for the
        # entries that hold tokens to say.
        return False


# Explicit name -> class registry for rebuilding caches from saved class names.
CACHE_CLASSES = {c.__name__: c for c in (KVCache, ConcatenateKVCache, QuantizedKVCache, RotatingKVCache,
                                          ChunkedKVCache, ArraysCache, CacheList, SharedKVReader)}


def make_prompt_cache(model, max_kv_size: Optional[int] = None) -> List[Any]:
    """The model's cache list; with `max_kv_size`, every growing KVCache becomes a
    RotatingKVCache of that size that keeps the first 4 tokens (attention sinks)."""
    cache = model.make_cache()
    if max_kv_size is None:
        return cache
    if max_kv_size <= 4:
        raise ValueError(f"max_kv_size must exceed the 4 kept sink tokens, got {max_kv_size}")
    return [RotatingKVCache(max_kv_size, keep=4) if type(c) is KVCache else c for c in cache]


class RewindableCacheList(list):
    """A model's cache list that can give back more than its entries can on their own
    (models/checkpoints.py's CheckpointedCache, from snapshots): trim_prompt_cache asks
    the list itself."""

    def trim(self, num_tokens: int) -> int:
        raise NotImplementedError


def can_trim_prompt_cache(cache: List[Any]) -> bool:
    return all(c.is_trimmable() for c in cache)


def trim_prompt_cache(cache: List[Any], num_tokens: int) -> int:
    """Remove the last `num_tokens` from every entry; returns the number removed.

    An untrimmable entry raises before anything is trimmed. Asking for more than an entry
    can give back raises from that entry; the entries of one model hold the same tokens,
    so that is a caller's bug, never clamped away. A RewindableCacheList trims itself
    (a CheckpointedCache also to a position it holds a snapshot of)."""
    if isinstance(cache, RewindableCacheList):
        return cache.trim(num_tokens)
    if not cache or num_tokens <= 0:
        return 0
    if not can_trim_prompt_cache(cache):
        names = sorted({type(c).__name__ for c in cache if not c.is_trimmable()})
        raise ValueError(f"Prompt cache cannot be trimmed: {', '.join(names)} entries are not trimmable")
    for c in cache:
        c.trim(num_tokens)
    return num_tokens



def check_kv_quantization(prompt_cache: List[Any], group_size: int, bits: int, quantized_kv_start: int) -> None:
    """Validate KV quantization options against a cache before any work is done."""
    check_kv_quantization_params(group_size, bits)
    if quantized_kv_start < 0:
        raise ValueError(f"quantized_kv_start must be >= 0, got {quantized_kv_start}")
    for c in prompt_cache:
        if isinstance(c, RotatingKVCache):
            c.to_quantized(group_size, bits)  # raises: not supported
        if isinstance(c, QuantizedKVCache) and (c.group_size, c.bits) != (group_size, bits):
            raise ValueError(
                f"The prompt cache is quantized with kv_bits={c.bits}, kv_group_size={c.group_size}; "
                f"it cannot continue with kv_bits={bits}, kv_group_size={group_size}"
            )


def maybe_quantize_kv_cache(
    prompt_cache: List[Any], quantized_kv_start: int, kv_group_size: int, kv_bits: Optional[int]
) -> None:
    """With `kv_bits` set, replace in place every KVCache entry holding at least
    `quantized_kv_start` tokens by its QuantizedKVCache. Recurrent (ArraysCache) and
    already quantized entries stay; a RotatingKVCache cannot be quantized (ValueError)."""
    if kv_bits is None:
        return
    for i, entry in enumerate(prompt_cache):
        if isinstance(entry, (KVCache, RotatingKVCache)) and entry.offset >= quantized_kv_start:
            prompt_cache[i] = entry.to_quantized(group_size=kv_group_size, bits=kv_bits)



class TokenBuffer:
    """Upstream's: one sequence's token ids as an int32 array that grows in blocks of
    `step` (so appending a token at a time reallocates once per `step` tokens), for
    logits processors that read the history as an array."""

    step = 256

    def __init__(self, tokens=None):
        tokens = _token_ids([] if tokens is None else tokens)
        self._buffer = mx.zeros((grown_capacity(tokens.size, self.step),), mx.int32)
        self._buffer[: tokens.size] = tokens
        self._size = tokens.size

    def update_and_fetch(self, tokens) -> mx.array:
        """Append `tokens` (a list or 1-D array of ids); return every token so far."""
        tokens = _token_ids(tokens)
        start, end = self._size, self._size + tokens.size
        if end > self._buffer.size:
            spare = mx.zeros((grown_capacity(end, self.step) - self._buffer.size,), mx.int32)
            self._buffer = mx.concatenate([self._buffer, spare])
        self._buffer[start:end] = tokens
        self._size = end
        return self.tokens

    @property
    def tokens(self) -> mx.array:
        return self._buffer[: self._size]

    @property
    def state(self) -> mx.array:
        """The tokens held (upstream's also carries the unused zeros of the last block)."""
        return self.tokens


def _token_ids(tokens) -> mx.array:
    """Token ids (a list or an array) as a 1-D int32 array, refusing anything else."""
    ids = tokens
    if isinstance(tokens, (list, tuple)):  # (no dtype given: floats must show, not truncate)
        ids = mx.array(list(tokens)) if len(tokens) else mx.zeros((0,), mx.int32)
    if not isinstance(ids, mx.array) or ids.ndim != 1 or not mx.issubdtype(ids.dtype, mx.integer):
        described = f"shape {tuple(ids.shape)} dtype {ids.dtype}" if isinstance(ids, mx.array) else type(tokens).__name__
        raise ValueError(f"token ids must be a list or a 1-D integer array, got {described}")
    return ids.astype(mx.int32)


# ---------------------------------------------------------------------------
# Prompt-cache files (upstream's layout, written and read by cache_files.py).

# An empty array stands for None in a file (an ArraysCache slot not yet filled).
_EMPTY = mx.array([], dtype=mx.float32)


def _file_state(entry: _BaseCache):
    """What a file stores for `entry`: its state, an ArraysCache as upstream does since
    #1632 ([arrays], left_padding, lengths), a ChunkedKVCache's rows in order (upstream's
    holds them so, not as a ring)."""
    if isinstance(entry, CacheList):
        return [_file_state(c) for c in entry.caches]
    if isinstance(entry, ArraysCache):
        return [[_EMPTY if a is None else a for a in entry.state], _EMPTY, _EMPTY]
    if isinstance(entry, ChunkedKVCache) and not entry.empty():
        return entry.held_in_order()
    return entry.state


def _from_file(class_name: str, state, meta_state) -> _BaseCache:
    """Rebuild an entry; the class comes from CACHE_CLASSES only, so loading runs no code."""
    if class_name not in CACHE_CLASSES:
        raise ValueError(f"unknown cache class {class_name!r}; known classes: {', '.join(sorted(CACHE_CLASSES))}")
    cls = CACHE_CLASSES[class_name]
    if not isinstance(state, list):
        raise ValueError(f"a {class_name} state must be a list of arrays, got one array")
    if cls is CacheList:
        class_names, metas = meta_state
        if not len(class_names) == len(metas) >= len(state):
            raise ValueError(f"CacheList of {len(class_names)} classes, {len(metas)} metas, {len(state)} states")
        state = state + [[]] * (len(class_names) - len(state))  # trailing empty children wrote nothing
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
    entries = [(type(c).__name__, _file_state(c), c.meta_state) for c in cache]
    write_cache_file(file_name, entries, metadata or {})


def load_prompt_cache(file_name: str, return_metadata: bool = False):
    """Load a prompt cache (and, with `return_metadata`, its user metadata) saved by
    `save_prompt_cache` or upstream mlx-lm. A malformed file raises ValueError."""
    cache, metadata = read_cache_file(file_name, _from_file)
    if return_metadata:
        return cache, metadata
    return cache


# Upstream's names for the batched classes (models/batch_cache.py), through the
# registry in cache_base.py that batch_cache.py fills when it is imported.


def __getattr__(name: str):
    """Upstream's batched class names (BatchKVCache, BatchRotatingKVCache, ...) and
    LRUPromptCache (registered in cache_base by the modules defining them)."""
    for cls in BATCH_CLASSES.values():
        if cls.__name__ == name:
            return cls
    if name in LATE_NAMES:
        return LATE_NAMES[name]
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
