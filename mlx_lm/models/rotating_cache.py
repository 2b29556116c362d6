"""Sliding-window KV caches: `RotatingKVCache` (a ring buffer of the last max_size
tokens, plus `keep` sink tokens) and `ChunkedKVCache` (attention within fixed chunks).
While speculating, each update is recorded as the rows it destroyed, so `trim(n)`
rewinds exactly even after the window has wrapped."""

from typing import List, NoReturn, Optional, Tuple

import mlx.core as mx

from .cache_base import ROLLBACK_WINDOW, RollbackLog, _BaseCache, _grow
from .masks import causal_mask_for_positions, chunked_mask_for_positions


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

    def held_in_order(self) -> Tuple[mx.array, mx.array]:
        """The held keys and values ordered by position, sinks first (non-empty cache)."""
        return self._temporal_order(self.keys), self._temporal_order(self.values)

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

    def keys_and_values(self):
        """The keys and values held, in ring order: what a single-token update_and_fetch
        returns (and what make_mask(1) masks), for a layer reading this layer's cache.
        After a multi-token update that outgrew the window, only the newest window is
        held (upstream keeps what that update returned until the next write); (None,
        None) when empty."""
        if self.keys is None:
            return None, None
        n = self.size()
        return self.keys[..., :n, :], self.values[..., :n, :]

    @property
    def state(self):
        return [] if self.keys is None else self.keys_and_values()

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

    def to_quantized(self, group_size: int = 64, bits: int = 4) -> NoReturn:
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

    @property
    def start_position(self) -> int:
        """Upstream's: the position of the oldest token held, max(0, offset - chunk_size).
        (Upstream's buffer holds them in order from there; this ring returns them so for
        a multi-token update, in ring order for a single token: make_mask answers for
        what update_and_fetch returns either way.)"""
        return self.offset - self.size()

    def maybe_trim_front(self) -> None:
        """Upstream's layers call it before each update, to drop the keys older than the
        newest chunk_size; the ring never holds more than those, so nothing is dropped."""

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

    def to_quantized(self, group_size: int = 64, bits: int = 4) -> NoReturn:
        raise ValueError("A ChunkedKVCache (chunked attention layers) cannot be quantized; drop --kv-bits")
