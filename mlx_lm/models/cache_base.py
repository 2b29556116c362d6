"""What every cache class shares (models/cache.py has the classes): the protocol
(`_BaseCache`), append-only buffer growth and masks, the rollback log of a speculating
cache, the registry of the batched classes (filled by models/batch_cache.py), and
upstream's array helper `dynamic_roll`."""

from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import mlx.core as mx

from .masks import create_causal_mask


def grown_capacity(needed: int, step: int) -> int:
    """`needed` rounded up to a whole number of blocks of `step`: a buffer grown to it
    reallocates once per `step` appended tokens, not once per token."""
    return -(-needed // step) * step


def _grow(buffer: Optional[mx.array], used: int, needed: int, like: mx.array, step: int, limit=None):
    """A (B, H, capacity, D) buffer holding the first `used` rows of `buffer` and room
    for `needed` rows; capacity rounds up to `step` (at most `limit`)."""
    capacity = grown_capacity(needed, step)
    if limit is not None:
        capacity = min(capacity, limit)
    B, H, _, D = like.shape
    spare = mx.zeros((B, H, capacity - used, D), like.dtype)
    if buffer is None or used == 0:
        return spare
    return mx.concatenate([buffer[..., :used, :], spare], axis=2)


# Default bound on what a speculating cache can rewind, in tokens.
ROLLBACK_WINDOW = 64


class RollbackLog:
    """Newest-last records of the forwards a cache took part in while speculating.

    A record is (num_tokens, rewind): `rewind(m)` puts the cache in the exact state it
    had after only the first m of that forward's num_tokens tokens (m = 0: before it).
    (A batch's recurrent rows keep (replay, snapshot) instead and rewind through
    batch_cache.BatchArraysCache.trim_rows, each row by its own count.)
    Records stack (a draft model adds one per single-token step). Once the newer records
    alone cover `window` tokens the oldest is dropped, bounding what stays alive.
    """

    def __init__(self, window: int = ROLLBACK_WINDOW):
        if window < 1:
            raise ValueError(f"rollback window must be at least 1 token, got {window}")
        self.window = window
        self.records: List[Tuple[int, Callable[[int], None]]] = []

    @property
    def num_tokens(self) -> int:
        return sum(n for n, _ in self.records)

    def push(self, num_tokens: int, rewind: Callable[[int], None]) -> None:
        self.records.append((num_tokens, rewind))
        while len(self.records) > 1 and self.num_tokens - self.records[0][0] >= self.window:
            self.records.pop(0)

    def rewind(self, n: int) -> None:
        """Undo the last n tokens, newest record first; a partly undone record stays
        as a shorter one (its rewind still reaches every shorter prefix)."""
        if n > self.num_tokens:
            raise RuntimeError(
                f"Cannot roll back {n} tokens: only {self.num_tokens} are recorded "
                f"(rollback window {self.window})"
            )
        while n > 0:
            num_tokens, rewind = self.records.pop()
            keep = max(num_tokens - n, 0)
            rewind(keep)
            if keep:
                self.records.append((keep, rewind))
            n -= num_tokens - keep


def create_attention_mask(N: int, offset: int, return_array: bool, window_size: Optional[int]):
    """Upstream's: the causal mask of N queries at positions offset.. over the offset + N
    keys of an append-only cache. None when each query sees every key, "causal" (unless
    `return_array`) when the plain causal mask is exact, else the (N, offset + N)
    boolean array. (Upstream returns the array whenever a window is given, also where
    it hides nothing; the attention computed is the same.)"""
    if window_size is not None and window_size < 1:
        raise ValueError(f"an attention window holds at least one token, got window_size={window_size}")
    sees_all = window_size is None or offset + N <= window_size
    if N == 1 and (window_size is None or offset < window_size):
        return None
    if sees_all and not return_array:
        return "causal"
    return create_causal_mask(N, offset, window_size)


def dynamic_roll(x: mx.array, shifts, axis: int) -> mx.array:
    """Upstream's: `x` rolled along `axis` by a shift of its own for each index of the
    axes before it: out[i..., j, ...] = x[i..., (j - shifts[i...]) % n, ...].

    shifts: an int or an integer array broadcastable to x.shape[:axis] (e.g. (B, 1)
    for the (B, H, T, D) keys of a batch rolled along T, one shift per row)."""
    if not -x.ndim <= axis < x.ndim:
        raise ValueError(f"axis {axis} is out of range for an array of {x.ndim} dimensions")
    axis %= x.ndim
    shifts = mx.array(shifts)
    if shifts.ndim > axis or mx.issubdtype(shifts.dtype, mx.floating):
        raise ValueError(f"shifts must be integers broadcastable to the axes before axis {axis} "
                         f"{tuple(x.shape[:axis])}, got dtype {shifts.dtype} shape {tuple(shifts.shape)}")
    n = x.shape[axis]
    after = x.ndim - axis - 1
    columns = mx.arange(n).reshape(n, *(1,) * after)  # (n, 1, ...): along axis
    # (..., n, 1, ...) sources; take_along_axis broadcasts them over the other axes.
    sources = (columns - shifts[(...,) + (None,) * (after + 1)]) % n
    sources = sources.reshape(*(1,) * (x.ndim - sources.ndim), *sources.shape)
    return mx.take_along_axis(x, sources, axis=axis)


class _BaseCache:
    """The protocol; each cache class implements every method explicitly.

    `needs_layer_records`: the entry can only rewind while speculating if the model's
    layers call `record_rollback` (a recurrent state); models whose layers do set
    `supports_speculative_rollback = True`.
    """

    needs_layer_records = False

    def start_speculation(self, rollback_window: int = ROLLBACK_WINDOW) -> None:
        raise NotImplementedError

    def stop_speculation(self) -> None:
        raise NotImplementedError

    @property
    def state(self):
        raise NotImplementedError

    @property
    def meta_state(self):
        raise NotImplementedError

    def is_trimmable(self) -> bool:
        raise NotImplementedError

    def trim(self, n: int) -> int:
        raise NotImplementedError

    def size(self) -> int:
        raise NotImplementedError

    @property
    def nbytes(self) -> int:
        raise NotImplementedError

    def empty(self) -> bool:
        raise NotImplementedError

    @classmethod
    def from_state(cls, state, meta_state):
        """Rebuild without __init__: the setters restore every attribute."""
        obj = cls.__new__(cls)
        obj.state = state
        obj.meta_state = meta_state
        return obj

    # Upstream's batch forms: a cache of one sequence has no rows to pick or join
    # (ArraysCache and the batched classes have them).

    def filter(self, batch_indices: Sequence[int]):
        raise ValueError(_one_sequence(self, "filter"))

    def extend(self, other: "_BaseCache"):
        raise ValueError(_one_sequence(self, "extend"))

    def extract(self, index: int):
        raise ValueError(_one_sequence(self, "extract"))

    @classmethod
    def merge(cls, caches: Sequence["_BaseCache"]):
        """Upstream's: one layer's caches of several sequences (one kind, whichever class
        this is called on) as the batched cache holding them side by side."""
        return merge_entries(caches)


def _one_sequence(cache: _BaseCache, method: str) -> str:
    name = type(cache).__name__
    return (f"a {name} holds one sequence, so it has no batch rows to {method}; batch the sequences' caches "
            f"first ({name}.merge([...]))")


class _AppendOnlyCache(_BaseCache):
    """A cache holding every token seen, `offset` of them: trimming forgets exactly by
    moving `offset` back (rows past it are overwritten later), so speculation needs no
    records."""

    offset: int

    def make_mask(self, num_queries: int, window_size: Optional[int] = None, return_array: bool = False):
        """The causal mask of num_queries new tokens over every token held (see
        create_attention_mask)."""
        return create_attention_mask(num_queries, self.offset, return_array, window_size)

    def size(self) -> int:
        return self.offset

    def start_speculation(self, rollback_window: int = ROLLBACK_WINDOW) -> None:
        pass

    def stop_speculation(self) -> None:
        pass

    def is_trimmable(self) -> bool:
        return True

    def trim(self, n: int) -> int:
        if n <= 0:
            return 0
        if n > self.offset:
            raise ValueError(f"Cannot trim {n} tokens from a {type(self).__name__} holding {self.offset}")
        self.offset -= n
        return n

    def empty(self) -> bool:
        return self.keys is None


# ---------------------------------------------------------------------------
# Batched caches (upstream's names for the classes of models/batch_cache.py).
#
# The batched classes build on the ones here, so cache_base cannot import them:
# batch_cache.py registers the class that batches each kind when it is imported (the
# models package imports it first), and upstream's `KVCache.merge(caches)` and
# `from mlx_lm.models.cache import BatchKVCache` reach them through the registry.

BATCH_CLASSES: Dict[type, type] = {}  # exact cache class -> the class holding its rows
# Upstream names of models/cache.py defined by modules that build on it (LRUPromptCache,
# models/lru_prompt_cache.py), registered by them as the models package imports them.
LATE_NAMES: Dict[str, Any] = {}


def int_list(values) -> List[int]:
    """Row numbers or counts given as a list or an mx.array, as Python ints."""
    return values.tolist() if isinstance(values, mx.array) else [int(v) for v in values]


def checked_rows(indices, batch_size: int) -> List[int]:
    """Row numbers (a list or an mx.array), checked against the batch size."""
    rows = int_list(indices)
    bad = [i for i in rows if not 0 <= i < batch_size]
    if bad:
        raise IndexError(f"rows {bad} do not exist in a batch of {batch_size} rows")
    return rows


def check_unpadded(name: str, padding) -> None:
    """Recurrent caches take no padding (ArraysCache.__init__ says why)."""
    if padding is not None and any(int_list(padding)):
        raise ValueError(
            f"a recurrent cache cannot take {name}={int_list(padding)}: the recurrent layers do not mask "
            "padded tokens, so prefill each row alone and merge the rows (ArraysCache.merge)"
        )


def batch_class(entry: Any) -> type:
    cls = BATCH_CLASSES.get(type(entry))
    if cls is None:
        raise ValueError(
            f"{type(entry).__name__} entries cannot be batched; batchable kinds: "
            f"{', '.join(c.__name__ for c in BATCH_CLASSES)}"
        )
    return cls


def merge_entries(entries: Sequence[Any]) -> Any:
    """One layer's entries of several rows (ordinary caches) as one batched entry."""
    if not len(entries):
        raise ValueError("merging caches needs the cache of at least one sequence, got none")
    kinds = sorted({type(e).__name__ for e in entries})
    if len(kinds) > 1:
        raise ValueError(f"one layer's rows hold different cache kinds ({', '.join(kinds)}); a batch needs one "
                         "kind per layer (e.g. every row's KV quantized, or none)")
    return batch_class(entries[0]).merge(entries)
