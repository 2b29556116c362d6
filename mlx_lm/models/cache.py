"""Per-layer caches and the helpers that build, inspect and trim a model's cache list.

Every cache entry implements the protocol of DESIGN.md §2: `state`/`meta_state` (what a
prompt-cache file stores), `from_state`, `is_trimmable()`, `trim(n)`, `size()`,
`nbytes`, `empty()` and `make_mask(N)`. `trim` never clamps: removing more than the
cache can give back is an error, because the layers of one model must stay in step.

Speculative decoding needs every entry to give back the last few tokens. KV caches
simply forget rows. A sliding window that has wrapped, and a recurrent state, cannot:
between `start_speculation()` and `stop_speculation()` they keep a `RollbackLog` of
the forwards they took part in, and `trim(n)` rewinds through it exactly.
"""

from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import mlx.core as mx

from .cache_files import read_cache_file, write_cache_file
from .masks import causal_mask_for_positions, chunked_mask_for_positions, create_causal_mask


def _grow(buffer: Optional[mx.array], used: int, needed: int, like: mx.array, step: int, limit=None):
    """A (B, H, capacity, D) buffer holding the first `used` rows of `buffer` and room
    for `needed` rows; capacity rounds up to `step` (at most `limit`), so appending one
    token at a time reallocates once per `step` tokens."""
    capacity = -(-needed // step) * step
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

    @classmethod
    def merge(cls, caches: Sequence["_BaseCache"]):
        """Upstream's: one layer's caches of several sequences (one kind, whichever class
        this is called on) as the batched cache holding them side by side."""
        return merge_entries(caches)


class _AppendOnlyCache(_BaseCache):
    """A cache holding every token seen, `offset` of them: trimming forgets exactly by
    moving `offset` back (rows past it are overwritten later), so speculation needs no
    records."""

    offset: int

    def make_mask(self, num_queries: int, window_size: Optional[int] = None, return_array: bool = False):
        """The causal mask of num_queries new tokens over every token held; None when
        each query sees every key, "causal" (unless `return_array`) when the plain
        causal mask is exact, else the (N, offset + N) boolean array."""
        sees_all = window_size is None or self.offset + num_queries <= window_size
        if num_queries == 1 and (window_size is None or self.offset < window_size):
            return None
        if sees_all and not return_array:
            return "causal"
        return create_causal_mask(num_queries, self.offset, window_size)

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


class _RotatingWrite:
    """One update of a speculating RotatingKVCache, as its RollbackLog rewind.

    It keeps only what the update destroys: the cache's `offset` and write index `idx`
    before it, and copies of the rows it overwrote or evicted (`old_keys`/`old_values`,
    the oldest non-sink rows then, oldest first; None if none; for a single token a row
    of the block copied ahead, see RotatingKVCache._next_overwritten), plus, for a
    multi-token update, its own rows (`keys`/`values`) so that a prefix can be
    re-appended. So records cost O(tokens written + lookahead) rows, never the window,
    and nothing but the cache holds the ring buffers, which MLX then updates in place.
    `num_applied`: how many of the update's tokens the cache holds now (fewer after a
    partial rewind).
    """

    def __init__(self, cache: "RotatingKVCache", num_tokens: int, old_rows, new_rows):
        self.cache = cache
        self.offset, self.idx, self.had_buffer = cache.offset, cache._idx, cache.keys is not None
        self.old_keys, self.old_values = old_rows
        self.keys, self.values = new_rows
        self.num_applied = num_tokens

    def __call__(self, m: int) -> None:
        self.cache._undo(self, m)


class RotatingKVCache(_BaseCache):
    """At most `max_size` tokens: the first `keep` (attention sinks) plus the most recent.

    A query at position p sees the sinks and the keys at p - (max_size - keep) < j <= p:
    exactly what the cache holds after p is written, so single-token decoding needs no
    mask and writes in place around a ring. A multi-token update returns the whole held
    window plus the new tokens in temporal order (make_mask masks the part outside each
    query's window), then keeps only the newest window.
    """

    step = 256
    lookahead = 32  # rows copied per wait while speculating (see _next_overwritten)
    _rollbacks: Optional[RollbackLog] = None  # set while speculating
    # While speculating: copies of the rows that the writes at offsets _ahead_from,
    # _ahead_from + 1, ... destroy, one (keys, values) pair each (see _next_overwritten).
    _ahead_from = 0
    _ahead_rows: Optional[List[Tuple[mx.array, mx.array]]] = None

    def __init__(self, max_size: int, keep: int = 0):
        if not 0 <= keep < max_size:
            raise ValueError(f"RotatingKVCache needs 0 <= keep < max_size, got keep={keep}, max_size={max_size}")
        self.max_size = max_size
        self.keep = keep
        self.keys = None
        self.values = None
        self.offset = 0  # tokens seen
        self._idx = 0  # ring slot of the next single-token write

    @property
    def window(self) -> int:
        """How many most recent tokens (sinks aside) a query sees, itself included."""
        return self.max_size - self.keep

    def wrapped(self) -> bool:
        return self.offset > self.max_size

    def size(self) -> int:
        return min(self.offset, self.max_size)

    def _ring_start(self) -> int:
        """Ring slot of the oldest non-sink row (the next to be overwritten once full)."""
        if self.wrapped() and self._idx < self.max_size:
            return self._idx
        return self.keep

    def _temporal_order(self, buffer: mx.array) -> mx.array:
        """The held rows of `buffer` ordered by position."""
        n, start = self.size(), self._ring_start()
        if start == self.keep:
            return buffer[..., :n, :]
        return mx.concatenate(
            [buffer[..., : self.keep, :], buffer[..., start:n, :], buffer[..., self.keep : start, :]], axis=2
        )

    def _ring_order(self, rows: mx.array) -> mx.array:
        """Inverse of _temporal_order: held rows in temporal order, laid out as the ring
        holds them at the current offset and write index."""
        n, start = self.size(), self._ring_start()
        if start == self.keep:
            return rows
        split = self.keep + n - start  # rows before it sit at slots start..n-1
        return mx.concatenate(
            [rows[..., : self.keep, :], rows[..., split:, :], rows[..., self.keep : split, :]], axis=2
        )

    def _oldest_slots(self, count: int) -> List[int]:
        """Ring slots of the `count` oldest non-sink rows, oldest first."""
        ring, start = self.size() - self.keep, self._ring_start() - self.keep
        return [self.keep + (start + j) % ring for j in range(count)]

    def _num_evicted(self, held: int, num_new: int) -> int:
        """How many of `held` rows an update of num_new tokens overwrites or evicts (always
        the oldest non-sink ones)."""
        return min(max(held + num_new - self.max_size, 0), max(held - self.keep, 0))

    def _held_positions(self) -> mx.array:
        """Positions of the held tokens in temporal order."""
        if not self.wrapped():
            return mx.arange(self.offset)
        recent = mx.arange(self.offset - self.window, self.offset)
        return mx.concatenate([mx.arange(self.keep), recent])

    def update_and_fetch(self, keys: mx.array, values: mx.array):
        if self._rollbacks is not None:
            self._rollbacks.push(keys.shape[2], self._record(keys, values))
        return self._append(keys, values)

    def _append(self, keys: mx.array, values: mx.array):
        if keys.shape[2] == 1:
            return self._update_in_place(keys, values)
        return self._update_concat(keys, values)

    def _record(self, keys: mx.array, values: mx.array) -> _RotatingWrite:
        """Copy the rows this update will destroy, before it runs."""
        num_new = keys.shape[2]
        num_evicted = self._num_evicted(self.size(), num_new)
        if num_new == 1:
            # A single token is never partly undone, so its own rows are not needed.
            old_rows = self._next_overwritten() if num_evicted else (None, None)
            return _RotatingWrite(self, num_new, old_rows, (None, None))
        old_rows = (None, None)
        if num_evicted:
            # A gather allocates its own rows (a slice would be a view pinning the whole
            # buffer). Queue it now so the old buffer is freed once it has run.
            old_rows = self._copy_oldest(num_evicted)
            mx.async_eval(*old_rows)
        return _RotatingWrite(self, num_new, old_rows, (keys, values))

    def _copy_oldest(self, count: int) -> Tuple[mx.array, mx.array]:
        at = mx.array(self._oldest_slots(count))
        return mx.take(self.keys, at, axis=2), mx.take(self.values, at, axis=2)

    def _next_overwritten(self) -> Tuple[mx.array, mx.array]:
        """Copies of the row the next single-token write overwrites (a full ring).

        MLX writes a buffer in place only if nothing else holds it when the write is
        scheduled, a pending read included, so a copy must be waited for. One wait
        serves `lookahead` writes: the write at offset o destroys position o - window
        (the oldest non-sink), so the block copied at offset o0 holds at j = o - o0 the
        row that write destroys. A position only changes after a trim goes back to it,
        so the block stays right while the offset stays at or above o0 (_undo drops it).
        """
        j = self.offset - self._ahead_from
        if self._ahead_rows is None or not 0 <= j < len(self._ahead_rows):
            count = min(self.lookahead, self.size() - self.keep)
            keys, values = self._copy_oldest(count)
            mx.eval(keys, values)
            # Row views made once per block: slicing per write costs more than the write.
            self._ahead_rows = list(zip(mx.split(keys, count, axis=2), mx.split(values, count, axis=2)))
            self._ahead_from, j = self.offset, 0
        return self._ahead_rows[j]

    def _undo(self, record: _RotatingWrite, m: int) -> None:
        """Put back the cache `record` was taken from (later records already undone),
        then re-append the first m of its tokens."""
        held_before = min(record.offset, self.max_size)
        num_evicted = self._num_evicted(held_before, record.num_applied)
        if record.num_applied == 1:  # written in place: write the destroyed row back
            self.offset, self._idx = record.offset, record.idx
            if num_evicted:
                at = mx.array(self._oldest_slots(1))
                self.keys = mx.slice_update(self.keys, record.old_keys[..., :1, :], at, axes=(2,))
                self.values = mx.slice_update(self.values, record.old_values[..., :1, :], at, axes=(2,))
        else:  # concatenated: rebuild the window from the held rows and the evicted ones
            keys = self._window_before(self.keys, record.old_keys, held_before, num_evicted)
            values = self._window_before(self.values, record.old_values, held_before, num_evicted)
            self.offset, self._idx = record.offset, record.idx
            self.keys, self.values = self._ring_order(keys), self._ring_order(values)
        if not record.had_buffer:
            self.keys = self.values = None
        if self.offset < self._ahead_from:
            self._ahead_rows = None
        if m:
            self._append(record.keys[..., :m, :], record.values[..., :m, :])
        record.num_applied = m

    def _window_before(self, buffer: mx.array, old: Optional[mx.array], held: int, num_evicted: int) -> mx.array:
        """The `held` rows, in temporal order, that the cache had before an update that
        evicted `old` (num_evicted rows after the sinks); `buffer` is the cache after it."""
        rows = self._temporal_order(buffer)
        sinks = min(self.keep, held)
        pieces = [rows[..., :sinks, :], rows[..., sinks : held - num_evicted, :]]
        if num_evicted:
            pieces.insert(1, old[..., :num_evicted, :])
        return mx.concatenate(pieces, axis=2)

    def _update_in_place(self, keys: mx.array, values: mx.array):
        if self._idx == self.max_size:
            self._idx = self.keep  # full: overwrite the oldest non-sink row
        if self.keys is None or self._idx >= self.keys.shape[2]:
            held = self.size()
            self.keys = _grow(self.keys, held, held + 1, keys, self.step, self.max_size)
            self.values = _grow(self.values, held, held + 1, values, self.step, self.max_size)
        # In place when only the cache holds the buffer; speculating too, as _record
        # copied the row this destroys beforehand and keeps no reference to the buffer.
        at = mx.array([self._idx])
        self.keys = mx.slice_update(self.keys, keys, at, axes=(2,))
        self.values = mx.slice_update(self.values, values, at, axes=(2,))
        self._idx += 1
        self.offset += 1
        n = self.size()
        return self.keys[..., :n, :], self.values[..., :n, :]

    def _update_concat(self, keys: mx.array, values: mx.array):
        num_new = keys.shape[2]
        if self.keys is not None:
            keys = mx.concatenate([self._temporal_order(self.keys), keys], axis=2)
            values = mx.concatenate([self._temporal_order(self.values), values], axis=2)
        self.offset += num_new
        self.keys, self.values = self._newest_window(keys), self._newest_window(values)
        self._idx = self.keys.shape[2]
        return keys, values

    def _newest_window(self, rows: mx.array) -> mx.array:
        """The sinks plus the last `window` rows of a temporal (B, H, T, D) array."""
        if rows.shape[2] <= self.max_size:
            return rows
        return mx.concatenate([rows[..., : self.keep, :], rows[..., -self.window :, :]], axis=2)

    def make_mask(self, num_queries: int, window_size: Optional[int] = None, return_array: bool = False):
        """The mask of num_queries new tokens over what update_and_fetch returns: each
        query sees the sinks and the last `window_size` tokens (default: the whole
        window held). A window shorter than the one held masks the rest; a longer one
        would need evicted tokens (ValueError). None when nothing needs masking,
        "causal" (unless `return_array`) when the plain causal mask is exact."""
        window = self.window if window_size is None else window_size
        if not 0 < window <= self.window:
            raise ValueError(
                f"RotatingKVCache(max_size={self.max_size}, keep={self.keep}) holds a window of "
                f"{self.window} tokens; it cannot mask for window_size={window_size}"
            )
        if num_queries == 1:
            return self._decode_mask(window)
        if not return_array and not self.wrapped() and self.offset + num_queries <= window + self.keep:
            return "causal"
        query_pos = mx.arange(self.offset, self.offset + num_queries)
        key_pos = mx.concatenate([self._held_positions(), query_pos])
        return causal_mask_for_positions(query_pos[:, None], key_pos[None], window, self.keep)

    def _decode_mask(self, window: int) -> Optional[mx.array]:
        """The (1, n) mask of one new token over the n ring slots the in-place write
        returns (None when the window held is the window asked for)."""
        if window == self.window or self.offset < window + self.keep:
            return None
        positions = self._slot_positions_after_write()
        visible = (self.offset - positions < window) | (positions < self.keep)
        return visible[None]

    def _slot_positions_after_write(self) -> mx.array:
        """The positions held by the ring slots a single-token write returns, (n,)."""
        slots = mx.arange(min(self.offset + 1, self.max_size))
        idx = (self.keep if self._idx == self.max_size else self._idx) + 1  # after the write
        ring = self.max_size - self.keep
        # The slot before idx holds the new token (position offset) and the ring slots
        # go back in time from it, wrapped or not (before the wrap slot s holds s).
        return mx.where(slots < self.keep, slots, self.offset - (idx - 1 - slots) % ring)

    @property
    def state(self):
        if self.keys is None:
            return []
        n = self.size()
        return self.keys[..., :n, :], self.values[..., :n, :]

    @state.setter
    def state(self, value):
        self.keys, self.values = value if len(value) else (None, None)

    @property
    def meta_state(self):
        return tuple(map(str, (self.keep, self.max_size, self.offset, self._idx)))

    @meta_state.setter
    def meta_state(self, value):
        self.keep, self.max_size, self.offset, self._idx = map(int, value)

    def start_speculation(self, rollback_window: int = ROLLBACK_WINDOW) -> None:
        self._rollbacks = RollbackLog(rollback_window)
        self._ahead_rows = None

    def stop_speculation(self) -> None:
        self._rollbacks = None
        self._ahead_rows = None

    def is_trimmable(self) -> bool:
        return self._rollbacks is not None or not self.wrapped()

    def trim(self, n: int) -> int:
        """Forget the last n tokens: exactly through the rollback log while speculating
        (also past the wrap), else by moving the write position before a wrap."""
        if n <= 0:
            return 0
        if self._rollbacks is not None:
            self._rollbacks.rewind(n)
            return n
        if self.wrapped():
            raise RuntimeError(
                f"Cannot trim a RotatingKVCache that has wrapped (offset {self.offset} > "
                f"max_size {self.max_size}): the evicted tokens are gone"
            )
        if n > self.offset:
            raise ValueError(f"Cannot trim {n} tokens from a RotatingKVCache holding {self.offset}")
        self.offset -= n
        self._idx = self.offset
        return n

    @property
    def nbytes(self) -> int:
        return 0 if self.keys is None else self.keys.nbytes + self.values.nbytes

    def empty(self) -> bool:
        return self.keys is None

    def to_quantized(self, group_size: int = 64, bits: int = 4) -> "QuantizedKVCache":
        raise ValueError(
            "A RotatingKVCache (--max-kv-size, sliding-window layers) cannot be quantized; "
            "drop --kv-bits or --max-kv-size"
        )


class ChunkedKVCache(RotatingKVCache):
    """Keys and values of a chunked local attention layer (Llama 4): positions are cut
    into chunks of `chunk_size` from 0, and a query at position p sees the keys of its
    own chunk, floor(p / C) * C .. p.

    Those are always among the C most recent positions, so the cache is a ring of C rows
    without sinks (a RotatingKVCache) and only the mask differs: by chunk, not by window.
    Memory stays C rows whatever the context. Rollback is the ring's: a verify whose
    tokens enter a new chunk overwrites the old chunk's rows through recorded writes, so
    trimming back into the old chunk restores them bit for bit.
    """

    def __init__(self, chunk_size: int):
        super().__init__(chunk_size, keep=0)

    @property
    def chunk_size(self) -> int:
        return self.max_size

    def make_mask(self, num_queries: int, window_size: Optional[int] = None, return_array: bool = False):
        """The chunked causal mask of num_queries new tokens over what update_and_fetch
        returns; None for a single query that sees every slot, "causal" (unless
        `return_array`) while everything lies in the first chunk."""
        if window_size is not None:
            raise ValueError(f"a ChunkedKVCache masks by its chunks of {self.max_size}; got window_size={window_size}")
        size = self.max_size
        if num_queries == 1:
            if self.offset < size or self.offset % size == size - 1:
                return None
            key_pos = self._slot_positions_after_write()
        else:
            if not return_array and self.offset + num_queries <= size:
                return "causal"
            key_pos = mx.concatenate([self._held_positions(), mx.arange(self.offset, self.offset + num_queries)])
        query_pos = mx.arange(self.offset, self.offset + num_queries)
        return chunked_mask_for_positions(query_pos[:, None], key_pos[None], size)

    def to_quantized(self, group_size: int = 64, bits: int = 4) -> "QuantizedKVCache":
        raise ValueError("A ChunkedKVCache (chunked attention layers) cannot be quantized; drop --kv-bits")


class ArraysCache(_BaseCache):
    """A fixed number of state arrays (e.g. a recurrent layer's conv and SSM state).

    The state after a token depends on every earlier token, so it cannot be trimmed by
    dropping rows. While speculating, the layer that owns it records how to rebuild
    the state after any prefix of each forward (`record_rollback`), and `trim` uses
    those records.
    """

    needs_layer_records = True
    _rollbacks: Optional[RollbackLog] = None  # set while speculating

    def __init__(self, size: int, left_padding: Optional[Sequence[int]] = None):
        # Upstream's batched recurrent caches mask padded inputs; the recurrent layers
        # here read no mask (a batch prefills each row alone, then merges them), so
        # padding would enter the state: it is refused, not ignored.
        check_unpadded("left_padding", left_padding)
        self.cache: List[Optional[mx.array]] = [None] * size

    def prepare(self, *, left_padding=None, lengths=None, right_padding=None) -> None:
        """Upstream's step before a batched prefill of prompts padded to one length:
        here only unpadded ones (see __init__), which need nothing; `lengths` then
        equal the prompt lengths."""
        check_unpadded("left_padding", left_padding)
        check_unpadded("right_padding", right_padding)

    def finalize(self) -> None:
        """Upstream's step after a padded prefill: nothing was padded (prepare)."""

    @property
    def speculating(self) -> bool:
        """Whether layers should call record_rollback for their forwards."""
        return self._rollbacks is not None

    def start_speculation(self, rollback_window: int = ROLLBACK_WINDOW) -> None:
        self._rollbacks = RollbackLog(rollback_window)

    def stop_speculation(self) -> None:
        self._rollbacks = None

    def record_rollback(
        self,
        num_tokens: int,
        fn: Callable[[int], List[Optional[mx.array]]],
        snapshot: List[Optional[mx.array]],
    ) -> None:
        """Called by a layer during a speculative forward of num_tokens tokens:
        `snapshot` holds the entries before it and `fn(m)` returns the exact entries
        after only its first m tokens (0 < m < num_tokens); given a list of counts,
        one per row (0 <= m[b] <= num_tokens), each row's after its own, in one replay
        (a batch, models/batch_cache.py)."""
        if self._rollbacks is None:
            raise RuntimeError("record_rollback called on an ArraysCache that is not speculating")
        snapshot = list(snapshot)
        # A one-token forward is only ever undone whole: keeping `fn` (and the tensors
        # it holds) would cost memory and stop MLX from updating buffers in place.
        replay = fn if num_tokens > 1 else None

        def rewind(m: int) -> None:
            self.cache = list(replay(m)) if m else list(snapshot)

        self._rollbacks.push(num_tokens, rewind)

    def __getitem__(self, index: int) -> Optional[mx.array]:
        return self.cache[index]

    def __setitem__(self, index: int, value: Optional[mx.array]):
        self.cache[index] = value

    def make_mask(self, num_queries: int, window_size: Optional[int] = None, return_array: bool = False):
        return None

    def size(self) -> int:
        return 0

    @property
    def state(self):
        return self.cache

    @state.setter
    def state(self, value):
        self.cache = list(value)

    @property
    def meta_state(self):
        return ""

    @meta_state.setter
    def meta_state(self, value):
        pass

    def is_trimmable(self) -> bool:
        return self._rollbacks is not None

    def trim(self, n: int) -> int:
        if n <= 0:
            return 0
        if self._rollbacks is None:
            raise RuntimeError(
                "Cannot trim an ArraysCache outside speculation: recurrent state has no "
                "per-token rows to drop"
            )
        self._rollbacks.rewind(n)
        return n

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in self.cache if a is not None)

    def empty(self) -> bool:
        return self.cache[0] is None


class CacheList(_BaseCache):
    """Several caches serving one layer; trimmable iff every child is."""

    def __init__(self, *caches: _BaseCache):
        self.caches = caches

    def __getitem__(self, index: int) -> _BaseCache:
        return self.caches[index]

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
        masks = [(type(c).__name__, c.make_mask(num_queries, window_size, return_array)) for c in self.caches]
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
CACHE_CLASSES = {c.__name__: c for c in (KVCache, RotatingKVCache, ArraysCache, CacheList, SharedKVReader)}
CACHE_CLASSES[ChunkedKVCache.__name__] = ChunkedKVCache


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


# ---------------------------------------------------------------------------
# Quantized KV cache.

# What MLX's affine quantization accepts.
KV_BITS = (2, 3, 4, 5, 6, 8)
KV_GROUP_SIZES = (32, 64, 128)


def check_kv_quantization_params(group_size: int, bits: int) -> None:
    if bits not in KV_BITS:
        raise ValueError(f"KV cache quantization supports bits {list(KV_BITS)}, got kv_bits={bits}")
    if group_size not in KV_GROUP_SIZES:
        raise ValueError(
            f"KV cache quantization supports group sizes {list(KV_GROUP_SIZES)}, got kv_group_size={group_size}"
        )


class QuantizedKVCache(_AppendOnlyCache):
    """Keys and values quantized along the head dimension as they arrive.

    Each of keys and values is a (packed, scales, biases) triple: uint32
    (B, H_kv, T, D * bits / 32) and (B, H_kv, T, D / group_size) twice, grown in blocks
    of `step`. Each token row is quantized once, on its own. Attention reads the triples
    with quantized matmuls (`base.quantized_scaled_dot_product_attention`).
    """

    step = 256

    def __init__(self, group_size: int = 64, bits: int = 8):
        check_kv_quantization_params(group_size, bits)
        self.group_size = group_size
        self.bits = bits
        self.keys: Optional[Tuple[mx.array, ...]] = None
        self.values: Optional[Tuple[mx.array, ...]] = None
        self.offset = 0

    def _quantize(self, rows: mx.array) -> Tuple[mx.array, ...]:
        if rows.shape[-1] % self.group_size:
            raise ValueError(
                f"kv_group_size {self.group_size} does not divide the head dimension {rows.shape[-1]}; "
                f"choose one of {[g for g in KV_GROUP_SIZES if rows.shape[-1] % g == 0] or 'none: keep the cache float'}"
            )
        return tuple(mx.quantize(rows, group_size=self.group_size, bits=self.bits))

    def update_and_fetch(self, keys: mx.array, values: mx.array):
        """Quantize and append (B, H_kv, S, D) keys/values; return both triples up to offset."""
        start, end = self.offset, self.offset + keys.shape[2]
        new_keys, new_values = self._quantize(keys), self._quantize(values)
        if self.keys is None or end > self.keys[0].shape[2]:
            old_keys, old_values = self.keys or (None,) * 3, self.values or (None,) * 3
            self.keys = tuple(_grow(b, start, end, n, self.step) for b, n in zip(old_keys, new_keys))
            self.values = tuple(_grow(b, start, end, n, self.step) for b, n in zip(old_values, new_values))
        for buffer, rows in zip(self.keys + self.values, new_keys + new_values):
            buffer[..., start:end, :] = rows
        self.offset = end
        return self.keys_and_values()

    def keys_and_values(self):
        """The quantized (packed, scales, biases) keys and values held, as
        update_and_fetch returns them, for quantized attention; (None, None) when empty."""
        if self.keys is None:
            return None, None
        return self._upto(self.keys, self.offset), self._upto(self.values, self.offset)

    @staticmethod
    def _upto(triple: Tuple[mx.array, ...], end: int) -> Tuple[mx.array, ...]:
        return tuple(t[..., :end, :] for t in triple)

    @property
    def state(self):
        if self.keys is None:
            return []
        return self._upto(self.keys, self.offset), self._upto(self.values, self.offset)

    @state.setter
    def state(self, value):
        self.keys, self.values = (tuple(value[0]), tuple(value[1])) if len(value) else (None, None)
        self.offset = 0 if self.keys is None else self.keys[0].shape[2]

    @property
    def meta_state(self):
        return tuple(map(str, (self.offset, self.group_size, self.bits)))

    @meta_state.setter
    def meta_state(self, value):
        offset, group_size, bits = map(int, value)
        check_kv_quantization_params(group_size, bits)
        held = 0 if self.keys is None else self.keys[0].shape[2]
        if offset > held:
            raise ValueError(f"QuantizedKVCache offset {offset} exceeds the {held} rows it holds")
        self.offset, self.group_size, self.bits = offset, group_size, bits

    @property
    def nbytes(self) -> int:
        return 0 if self.keys is None else sum(t.nbytes for t in self.keys + self.values)


CACHE_CLASSES[QuantizedKVCache.__name__] = QuantizedKVCache


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



# ---------------------------------------------------------------------------
# Prompt-cache files (upstream's layout, written and read by cache_files.py).

# An empty array stands for None in a file (an ArraysCache slot not yet filled).
_EMPTY = mx.array([], dtype=mx.float32)


def _file_state(entry: _BaseCache):
    """What a file stores for `entry`: its state, an ArraysCache as upstream does since
    #1632 ([arrays], left_padding, lengths)."""
    if isinstance(entry, CacheList):
        return [_file_state(c) for c in entry.caches]
    if isinstance(entry, ArraysCache):
        return [[_EMPTY if a is None else a for a in entry.state], _EMPTY, _EMPTY]
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


# ---------------------------------------------------------------------------
# Batched caches (upstream's names for the classes of models/batch_cache.py).
#
# The batched classes build on the ones here, so this module cannot import them:
# batch_cache.py registers the class that batches each kind when it is imported (the
# models package imports it first), and upstream's `KVCache.merge(caches)` and
# `from mlx_lm.models.cache import BatchKVCache` reach them through the registry.

BATCH_CLASSES: Dict[type, type] = {}  # exact cache class -> the class holding its rows


def int_list(values) -> List[int]:
    """Row numbers or counts given as a list or an mx.array, as Python ints."""
    return values.tolist() if isinstance(values, mx.array) else [int(v) for v in values]


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


def __getattr__(name: str):
    """Upstream's batched class names (BatchKVCache, BatchRotatingKVCache, ...)."""
    for cls in BATCH_CLASSES.values():
        if cls.__name__ == name:
            return cls
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
