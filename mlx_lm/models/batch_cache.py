"""Batched caches: the caches of several sequences side by side, one (B, ...) array per
layer, for continuous batching (`mlx_lm/batching.py`).

Each sequence (row) is prefilled alone in ordinary caches (`cache.py`); `merge_caches`
stacks rows into batched caches, `extend_caches` joins two batches, `filter_caches`
keeps some rows and `extract_caches` gives one row back as ordinary caches. The models
see the same contract as unbatched: `offset` (here a (B,) array of each row's position,
which `mx.fast.rope` takes per row), `update_and_fetch`, `make_mask`, `cache[i]`.

KV layout: right-aligned. Every row writes its next token at the same column `width`
of a (B, H_kv, capacity, D) buffer, so one slice update serves the batch; `positions`
(B, capacity) says which position each column holds, NO_TOKEN for none (left padding
of a shorter row, or a rejected draft). Masks come from positions alone: a query at
position p sees the columns holding positions <= p (within its window). So a row rolls
back its last n tokens by marking its last n columns NO_TOKEN (`trim_rows`), whatever
the other rows do; the holes are squeezed out once they are half the columns. A sliding
window drops the leading columns no query will see. Both happen in `make_room`, which
the generator calls before each forward, never between a mask and its update.

Upstream's batch API works on these classes: `BatchKVCache(left_padding)` and
`BatchRotatingKVCache(max_size, left_padding)` make an empty batch whose rows start with
that much padding (the padding becomes holes: a row's positions start at -padding),
`prepare(left_padding=, lengths=, right_padding=)` / `finalize()` bracket a prefill of
prompts padded to one length (right padding becomes holes at `finalize`), `merge`
(also `KVCache.merge(...)`, cache.py), `extend` (in place), `extract`, `keys`,
`values`, `keys_and_values()`, `left_padding`, `nbytes`. Where this differs: `filter`
returns the kept rows as a new batch and leaves the receiver whole, `trim(n)` raises
where upstream clamps, and recurrent caches take no padding (cache.ArraysCache).

Quantized KV rows (`BatchQuantizedKVCache`) use the same layout with a (packed,
scales, biases) triple of buffers for each of keys and values.

Recurrent state (`BatchArraysCache`) is each row's arrays stacked: a decode step gives
every row exactly one new token, so no padding ever enters the recurrence; a verify
forward is rolled back per row from the layers' records (replay of each row's prefix).
"""

from typing import Any, Callable, List, Optional, Sequence, Tuple

import mlx.core as mx

from .cache import (
    ArraysCache, CacheList, ChunkedKVCache, KVCache, QuantizedKVCache, RotatingKVCache, SharedKVReader,
    check_kv_quantization_params,
)
from .cache_base import BATCH_CLASSES, RollbackLog, int_list, merge_entries
from .masks import chunked_mask_for_positions


NO_TOKEN = -1  # the position of a column that holds no token (padding, a rejected draft)


def _placed(array: mx.array, width: int, capacity: int, axis: int, fill) -> mx.array:
    """`array`'s n columns along `axis` placed right-aligned at [width - n, width) of
    `capacity` columns, the rest `fill`."""
    n = array.shape[axis]

    def block(size):
        shape = list(array.shape)
        shape[axis] = size
        return mx.full(shape, fill, array.dtype)

    pieces = [block(width - n), array, block(capacity - width)]
    return mx.concatenate([p for p in pieces if p.shape[axis]], axis=axis)


def _counts(values, name: str, batch_size: Optional[int] = None) -> List[int]:
    """Per-row token counts (paddings, lengths), checked: ints >= 0, one per row."""
    counts = int_list(values)
    if batch_size is not None and len(counts) != batch_size:
        raise ValueError(f"{name} needs one count per row of the batch ({batch_size}), got {counts}")
    if any(c < 0 for c in counts):
        raise ValueError(f"{name} counts tokens and cannot be negative, got {counts}")
    return counts


def _rows(indices, batch_size: int) -> List[int]:
    """Row numbers (a list or an mx.array), checked against the batch size."""
    rows = int_list(indices)
    bad = [i for i in rows if not 0 <= i < batch_size]
    if bad:
        raise IndexError(f"rows {bad} do not exist in a batch of {batch_size} rows")
    return rows


class _NotSaved:
    """Batched entries are not written to prompt-cache files: their rows are."""

    @property
    def meta_state(self):
        raise ValueError(f"a {type(self).__name__} (a batch) is not saved as it is; save each row's cache "
                         "(extract(i)) instead")


class _AlignedKV(_NotSaved):
    """Shared machinery of the right-aligned KV layouts (see the module docstring).

    buffers: (B, H_kv, capacity, d) arrays, the keys' then the values' (one each, or a
    quantized cache's packed/scales/biases triples), None while no row holds a token;
    `positions` (B, capacity) int32: the position of the token in each column, NO_TOKEN for none;
    `width`: columns in use; `lengths`: per-row positions (the tokens each row has
    seen, which for a sliding window exceeds what it holds); `num_invalid`: per row,
    columns before `width` that hold no token. A row's length is negative while padding
    is still to come (upstream's left padding, given to the constructor or `prepare`)."""

    step = 256

    def __init__(self, left_padding: Sequence[int]):
        """Upstream's constructor: an empty batch of len(left_padding) rows whose first
        left_padding[b] tokens fed are padding, held as holes (row b's positions start at
        -left_padding[b], so its first real token has position 0)."""
        padding = _counts(left_padding, "left_padding")
        self._set_rows(None, None, 0, [-p for p in padding], [0] * len(padding))

    def _set_rows(self, buffers: Optional[List[mx.array]], positions: Optional[mx.array], width: int,
                  lengths: List[int], num_invalid: List[int]) -> None:
        self.buffers, self.positions, self.width = buffers, positions, width
        self.lengths, self.num_invalid = list(lengths), list(num_invalid)
        self.offset = mx.array(self.lengths, dtype=mx.int32)  # (B,) rope positions
        self._room_for = 0  # make_room ran for this many new tokens and nothing changed since
        # (right_padding, lengths or None, each row's length at prepare) until finalize
        self._right_padding: Optional[Tuple[List[int], Optional[List[int]], List[int]]] = None

    def _settings(self) -> dict:
        """The constructor's arguments besides left_padding."""
        return {}

    def _like(self, *rows) -> "_AlignedKV":
        """A batch of this class and settings holding `rows` (what _set_rows takes)."""
        made = type(self)(left_padding=[], **self._settings())
        made._set_rows(*rows)
        return made

    @classmethod
    def _from_rows(cls, buffers: Optional[List[mx.array]], first_position: int, length: int,
                   **settings) -> "_AlignedKV":
        """One row holding (1, H, n, d) buffers of positions first_position.. (None: n = 0)."""
        n = 0 if buffers is None else buffers[0].shape[2]
        positions = None if buffers is None else mx.arange(first_position, first_position + n, dtype=mx.int32)[None]
        made = cls(left_padding=[], **settings)
        made._set_rows(buffers, positions, n, [length], [0])
        return made

    def _extend(self, other: "_AlignedKV") -> "_AlignedKV":
        """Upstream's extend, in place: other's rows after these (returns self too)."""
        if type(other) is not type(self):
            raise ValueError(f"a {type(self).__name__} cannot be extended by a {type(other).__name__}")
        if self._right_padding is not None or other._right_padding is not None:
            raise ValueError("finalize() a padded prefill before the batch changes rows")
        self._set_rows(*self._joined(other))
        return self

    def _split(self, keys: mx.array, values: mx.array) -> List[mx.array]:
        """New (B, H_kv, N, D) keys and values as buffer rows."""
        return [keys, values]

    def _fetch(self, end: int):
        """What update_and_fetch returns: the first `end` columns of keys and values."""
        return self.buffers[0][..., :end, :], self.buffers[1][..., :end, :]

    @property
    def capacity(self) -> int:
        return 0 if self.buffers is None else self.buffers[0].shape[2]

    @property
    def keys(self):
        """Upstream's: the keys buffer of every column (None while empty)."""
        return None if self.buffers is None else self._fetch(self.capacity)[0]

    @property
    def values(self):
        return None if self.buffers is None else self._fetch(self.capacity)[1]

    def keys_and_values(self):
        """The keys and values of the columns in use, as update_and_fetch returns them."""
        return (None, None) if self.buffers is None else self._fetch(self.width)

    @property
    def left_padding(self) -> mx.array:
        """(B,) upstream's left padding: each row's leading columns that hold no token,
        plus the padding still to come."""
        to_come = mx.array([max(-n, 0) for n in self.lengths], dtype=mx.int32)
        if self.buffers is None:
            return to_come
        held = self.positions[:, : self.width] >= 0
        leading = mx.where(held.any(axis=1), mx.argmax(held, axis=1).astype(mx.int32), self.width)
        return leading + to_come

    @property
    def state(self) -> List[mx.array]:
        """The columns in use of every buffer (rows' padding and holes included)."""
        return [] if self.buffers is None else [b[..., : self.width, :] for b in self.buffers]

    @property
    def bookkeeping(self) -> List[mx.array]:
        """`positions`, which a step updates lazily but a gapless one-token step never
        reads: evaluated with each step (see `bookkeeping` below)."""
        return [] if self.positions is None else [self.positions]

    @property
    def batch_size(self) -> int:
        return len(self.lengths)

    def _capacity(self, needed: int) -> int:
        return -(-needed // self.step) * self.step

    def _columns_to_drop(self, num_new: int) -> int:
        """Leading columns no query will see any more (a window's)."""
        return 0

    def _resize(self, capacity: int) -> None:
        """The columns in use, right-aligned in buffers of `capacity` columns."""
        self.buffers = [_placed(b[..., : self.width, :], self.width, capacity, 2, 0) for b in self.buffers]
        self.positions = _placed(self.positions[:, : self.width], self.width, capacity, 1, NO_TOKEN)

    def make_room(self, num_new: int) -> None:
        """Before a forward of num_new tokens (not during one: the mask and the update
        must see the same columns), if they do not fit: drop the columns no query will
        see, and squeeze out the holes left by rejected drafts once they are half."""
        if self.buffers is None or self.width + num_new <= self.capacity or num_new <= self._room_for:
            return
        drop = self._columns_to_drop(num_new)
        if drop:
            self._drop(drop)
        if self.width + num_new > self.capacity and max(self.num_invalid) * 2 >= self.width:
            self._compact()
        self._room_for = num_new  # (so the next layers' calls need no read of the positions)

    def _ensure_room(self, rows: List[mx.array]) -> None:
        """Allocate, or grow in blocks of `step` columns, so the new columns fit."""
        num_new = rows[0].shape[2]
        if self.buffers is None:
            capacity = self._capacity(num_new)
            self.buffers = [_placed(r[..., :0, :], 0, capacity, 2, 0) for r in rows]
            self.positions = mx.full((rows[0].shape[0], capacity), NO_TOKEN, mx.int32)
        elif self.width + num_new > self.capacity:
            self._resize(self._capacity(self.width + num_new))

    def _drop(self, count: int) -> None:
        self.buffers = [b[..., count:, :] for b in self.buffers]
        self.positions = self.positions[:, count:]
        self.width -= count
        self.num_invalid = (self.positions[:, : self.width] < 0).sum(axis=1).tolist()

    def _compact(self) -> None:
        """Every row's tokens moved together, in order, right-aligned (holes squeezed out)."""
        rows = [[c for c, p in enumerate(row) if p >= 0] for row in self.positions[:, : self.width].tolist()]
        width = max(len(r) for r in rows)
        columns = mx.array([[0] * (width - len(r)) + r for r in rows], dtype=mx.int32)  # (B, width)
        real = mx.array([[False] * (width - len(r)) + [True] * len(r) for r in rows])
        gather = columns[:, None, :, None]
        moved = [mx.take_along_axis(b[..., : self.width, :], gather, axis=2) for b in self.buffers]
        positions = mx.where(real, mx.take_along_axis(self.positions[:, : self.width], columns, axis=1), NO_TOKEN)
        capacity = self.capacity
        self.buffers = [_placed(b, width, capacity, 2, 0) for b in moved]
        self.positions = _placed(positions, width, capacity, 1, NO_TOKEN)
        self.width, self.num_invalid = width, [width - len(r) for r in rows]

    def update_and_fetch(self, keys: mx.array, values: mx.array):
        """Append (B, H_kv, N, D) keys/values at column `width` for every row; return the
        (B, H_kv, width, D) columns in use. Tokens of a row's padding still to come become
        holes. Makes room first (make_room; a no-op when the caller already has)."""
        if keys.shape[0] != self.batch_size:
            raise ValueError(f"keys of {keys.shape[0]} rows cannot update a batch of {self.batch_size} rows")
        num_new = keys.shape[2]
        self.make_room(num_new)
        rows = self._split(keys, values)
        self._ensure_room(rows)
        start, end = self.width, self.width + num_new
        for buffer, row in zip(self.buffers, rows):
            buffer[..., start:end, :] = row
        positions = self.offset[:, None] + mx.arange(num_new, dtype=mx.int32)
        padded = [min(max(-n, 0), num_new) for n in self.lengths]
        if any(padded):
            positions = mx.maximum(positions, NO_TOKEN)  # padding: negative positions, holes
            self.num_invalid = [i + p for i, p in zip(self.num_invalid, padded)]
        self.positions[:, start:end] = positions
        self.width = end
        self.lengths = [n + num_new for n in self.lengths]
        self.offset = self.offset + num_new
        self._room_for = 0
        return self._fetch(end)

    def _window(self, window_size: Optional[int]) -> Optional[int]:
        return window_size

    def make_mask(self, num_queries: int, window_size: Optional[int] = None, return_array: bool = False):
        """(B, 1, N, S) boolean over the S columns the update of these N queries returns:
        the query at position p of row b sees the columns holding its positions up to p
        (within its window). None for a single query when every column holds a token
        and every row sees every column. Makes room for them first (the update will
        return exactly these columns)."""
        self.make_room(num_queries)
        window = self._window(window_size)
        gapless = not any(self.num_invalid)
        if num_queries == 1 and gapless and (window is None or self.width < window) and not return_array:
            return None
        query_pos, key_pos = self._mask_positions(num_queries)
        mask = (key_pos >= 0) & (key_pos <= query_pos[..., None])  # (B, N, S)
        if window is not None:
            mask = mask & (query_pos[..., None] - key_pos < window)
        return mask[:, None]

    def _mask_positions(self, num_queries: int) -> Tuple[mx.array, mx.array]:
        """The positions of num_queries new tokens, (B, N), and of the columns their
        update returns, (B, 1, S) (NO_TOKEN for a column holding none)."""
        query_pos = self.offset[:, None] + mx.arange(num_queries, dtype=mx.int32)  # (B, N)
        held = self.positions[:, : self.width] if self.positions is not None else query_pos[:, :0]
        return query_pos, mx.concatenate([held, query_pos], axis=1)[:, None, :]  # (B, 1, S)

    def trim_rows(self, counts: Sequence[int]) -> None:
        """Forget the last counts[b] tokens of each row b, which must be its last
        counts[b] columns (so right after a forward of at least that many tokens): they
        become holes, and the columns no row holds any more are given back."""
        if not any(counts):
            return
        if max(counts) > self.width or min(counts) < 0:
            raise ValueError(f"cannot trim {list(counts)} tokens from rows holding {self.width} columns")
        if any(c > max(n, 0) for c, n in zip(counts, self.lengths)):
            raise ValueError(f"cannot trim {list(counts)} tokens from rows of lengths {self.lengths}")
        self._room_for = 0
        columns = mx.arange(self.positions.shape[1])[None]
        first_gone = self.width - mx.array(list(counts), dtype=mx.int32)[:, None]
        self.positions = mx.where((columns >= first_gone) & (columns < self.width), NO_TOKEN, self.positions)
        self.lengths = [n - c for n, c in zip(self.lengths, counts)]
        self.offset = mx.array(self.lengths, dtype=mx.int32)
        common = min(counts)
        self.width -= common
        self.num_invalid = [i + c - common for i, c in zip(self.num_invalid, counts)]

    def trim(self, n: int) -> int:
        """Every row's last n tokens (strict, as trim_rows: upstream clamps to the columns)."""
        self.trim_rows([n] * self.batch_size)
        return max(n, 0)

    def prepare(self, *, left_padding=None, lengths=None, right_padding=None) -> None:
        """Upstream's step before a batched prefill of prompts padded to one length.
        `left_padding`: more padding before the rows' first tokens (an empty batch only).
        `right_padding` (and `lengths`): of the tokens row b is fed next, lengths[b] are
        real and the right_padding[b] after them padding, which `finalize` turns into
        holes; call it right after the prefill."""
        padding = [] if left_padding is None else _counts(left_padding, "left_padding", self.batch_size)
        if any(padding):
            if self.buffers is not None:
                raise ValueError(f"left padding {padding} can only be added to an empty {type(self).__name__}; "
                                 f"this one holds {self.width} columns")
            self._set_rows(None, None, 0, [n - p for n, p in zip(self.lengths, padding)], self.num_invalid)
        if right_padding is not None:
            padding = _counts(right_padding, "right_padding", self.batch_size)
            real = None if lengths is None else _counts(lengths, "lengths", self.batch_size)
            if any(padding):
                self._right_padding = (padding, real, list(self.lengths))
                self._room_for = 0

    def finalize(self) -> None:
        """Upstream's step after a right-padded prefill: the padding becomes holes."""
        if self._right_padding is None:
            return
        padding, real, before = self._right_padding
        fed = [n - b for n, b in zip(self.lengths, before)]
        expected = fed if real is None else [r + p for r, p in zip(real, padding)]
        if fed != expected or any(f < p for f, p in zip(fed, padding)):
            raise ValueError(f"prepare announced {real} tokens then right padding {padding} per row, "
                             f"but the rows were fed {fed}")
        self._right_padding = None
        self.trim_rows(padding)

    def _take_rows(self, indices: Sequence[int]):
        if self._right_padding is not None:
            raise ValueError("finalize() a padded prefill before the batch changes rows")
        indices = _rows(indices, self.batch_size)
        at = mx.array(indices, dtype=mx.int32)
        lengths = [self.lengths[i] for i in indices]
        num_invalid = [self.num_invalid[i] for i in indices]
        if self.buffers is None:
            return None, None, 0, lengths, num_invalid
        positions = mx.take(self.positions, at, axis=0)
        leading = mx.argmax(positions[:, : self.width] >= 0, axis=1).tolist() if self.width else [0]
        drop = min(leading)  # columns no kept row holds a token in: gone
        buffers = [mx.take(b, at, axis=0)[..., drop:, :] for b in self.buffers]
        return buffers, positions[:, drop:], self.width - drop, lengths, [i - drop for i in num_invalid]

    def _joined(self, other: "_AlignedKV"):
        """buffers, positions, width, lengths, num_invalid of self's rows then other's."""
        lengths = self.lengths + other.lengths
        if self.buffers is None and other.buffers is None:
            return None, None, 0, lengths, self.num_invalid + other.num_invalid
        width = max(self.width, other.width)
        capacity = self._capacity(width + 1)
        some = self if self.buffers is not None else other
        likes = some.buffers + [some.positions]
        joined = []
        for j, like in enumerate(likes):
            axis, fill = (1, NO_TOKEN) if j == len(likes) - 1 else (2, 0)
            parts = []
            for c in (self, other):
                if c.buffers is None:  # rows holding nothing yet
                    shape = list(like.shape)
                    shape[0], shape[axis] = c.batch_size, width
                    parts.append(mx.full(shape, fill, like.dtype))
                else:
                    own = (c.buffers + [c.positions])[j]
                    used = own[:, :, : c.width] if axis == 2 else own[:, : c.width]
                    parts.append(_placed(used, width, width, axis, fill))
            joined.append(_placed(mx.concatenate(parts), width, capacity, axis, fill))
        num_invalid = [i + width - c.width for c in (self, other) for i in c.num_invalid]
        return joined[:-1], joined[-1], width, lengths, num_invalid

    def _row_columns(self, index: int) -> List[int]:
        """The columns of row `index` that hold tokens, oldest first."""
        return [c for c, p in enumerate(self.positions[index, : self.width].tolist()) if p >= 0]

    def _row(self, index: int, columns: List[int]) -> List[mx.array]:
        """Row `index`'s `columns` of every buffer, as new (1, H, n, d) arrays."""
        at = mx.array(columns, dtype=mx.int32)
        return [mx.take(b[index : index + 1], at, axis=2) for b in self.buffers]

    def is_trimmable(self) -> bool:
        return True

    def start_speculation(self, rollback_window: int = 0) -> None:
        pass  # rows roll back by turning their last columns into holes (trim_rows)

    def stop_speculation(self) -> None:
        pass

    def size(self) -> int:
        return self.width

    def empty(self) -> bool:
        return self.buffers is None

    @property
    def nbytes(self) -> int:
        return 0 if self.buffers is None else sum(b.nbytes for b in self.buffers)


class BatchKVCache(_AlignedKV):
    """KVCache rows side by side (right-aligned; see the module docstring)."""

    @classmethod
    def merge(cls, caches: Sequence[KVCache]) -> "BatchKVCache":
        batch = cls([])
        for c in caches:
            batch.extend(cls._from_rows(list(c.state) if c.offset else None, 0, c.offset))
        return batch

    def extend(self, other: "BatchKVCache") -> "BatchKVCache":
        """Other's rows after these, in place (as upstream's); returns self."""
        return self._extend(other)

    def filter(self, indices: Sequence[int]) -> "BatchKVCache":
        """Rows `indices` (in that order) as a new batch; this one is left whole (upstream
        filters in place)."""
        return self._like(*self._take_rows(indices))

    def extract(self, index: int) -> KVCache:
        cache = KVCache()
        columns = [] if self.buffers is None else self._row_columns(index)
        if columns:
            cache.state = tuple(self._row(index, columns))
        return cache


class BatchRotatingKVCache(_AlignedKV):
    """RotatingKVCache rows (sliding windows, no sink tokens) side by side: the newest
    columns right-aligned, each query masked to its window of `max_size` tokens."""

    row_class = RotatingKVCache  # what extract gives back

    def __init__(self, max_size: int, left_padding: Sequence[int]):
        if max_size < 1:
            raise ValueError(f"a sliding window holds at least one token, got max_size={max_size}")
        super().__init__(left_padding)
        self.max_size = max_size

    def _settings(self) -> dict:
        return {"max_size": self.max_size}

    def _window(self, window_size: Optional[int]) -> int:
        if window_size is not None and not 0 < window_size <= self.max_size:
            raise ValueError(f"a batched window of {self.max_size} tokens cannot mask for window_size={window_size}")
        return self.max_size if window_size is None else window_size

    def _columns_to_drop(self, num_new: int) -> int:
        # Row b keeps its max_size newest tokens, as a RotatingKVCache does: its next
        # query (position lengths[b]) sees back to lengths[b] - max_size + 1, and a
        # forward rolled back whole (a cancelled round) must leave the row a full window.
        # While a right-padded prefill runs, a row's padding does not move its window.
        ends = self.offset if self._right_padding is None else self.offset - mx.array(self._right_padding[0])
        seen = self.positions[:, : self.width] >= (ends - self.max_size)[:, None]  # (B, width)
        first = mx.where(seen.any(axis=1), mx.argmax(seen, axis=1), self.width)
        return min(first.tolist())

    @classmethod
    def merge(cls, caches: Sequence[RotatingKVCache]) -> "BatchRotatingKVCache":
        sizes = {c.max_size for c in caches}
        if len(sizes) > 1:
            raise ValueError(f"rotating caches of different sizes {sorted(sizes)} cannot share a batch")
        sinks = [c.keep for c in caches if c.keep]
        if sinks:
            raise ValueError(
                f"batching does not support sink tokens (RotatingKVCache keep={sinks[0]}); drop max_kv_size"
            )
        max_size = sizes.pop()
        batch = cls(max_size, [])
        for c in caches:
            held = c.size()
            rows = [c._temporal_order(c.keys), c._temporal_order(c.values)] if held else None
            batch.extend(cls._from_rows(rows, c.offset - held, c.offset, max_size=max_size))
        return batch

    def extend(self, other: "BatchRotatingKVCache") -> "BatchRotatingKVCache":
        """Other's rows after these, in place (as upstream's); returns self."""
        if type(other) is type(self) and other.max_size != self.max_size:
            raise ValueError(f"rotating caches of sizes {self.max_size} and {other.max_size} cannot share a batch")
        return self._extend(other)

    def filter(self, indices: Sequence[int]) -> "BatchRotatingKVCache":
        """Rows `indices` as a new batch; this one is left whole (upstream: in place)."""
        return self._like(*self._take_rows(indices))

    def extract(self, index: int) -> RotatingKVCache:
        """The row as a RotatingKVCache holding its newest tokens in temporal order
        (the write index past them: the next write overwrites the oldest)."""
        columns = [] if self.buffers is None else self._row_columns(index)[-self.max_size :]
        if not columns:
            return self.row_class(self.max_size)
        assert len(columns) == min(self.lengths[index], self.max_size), "a window row lost a token it needs"
        state = tuple(self._row(index, columns))
        meta = tuple(map(str, (0, self.max_size, self.lengths[index], len(columns))))
        return self.row_class.from_state(state, meta)


class BatchChunkedKVCache(BatchRotatingKVCache):
    """ChunkedKVCache rows side by side: the layout of BatchRotatingKVCache (each row
    keeps its chunk_size newest tokens), masked by chunk instead of by window. Chunks
    count from each row's own first token, as transformers aligns them past left
    padding."""

    row_class = ChunkedKVCache

    def make_mask(self, num_queries: int, window_size: Optional[int] = None, return_array: bool = False):
        """(B, 1, N, S) boolean: the query at position p of row b sees the columns holding
        that row's positions of p's chunk up to p."""
        self.make_room(num_queries)
        if window_size is not None:
            raise ValueError(f"a batched chunked cache masks by its chunks of {self.max_size}; "
                             f"got window_size={window_size}")
        query_pos, key_pos = self._mask_positions(num_queries)
        return chunked_mask_for_positions(query_pos[..., None], key_pos, self.max_size)[:, None]


class BatchQuantizedKVCache(_AlignedKV, QuantizedKVCache):
    """QuantizedKVCache rows side by side: keys and values each a (packed, scales,
    biases) triple of right-aligned buffers, quantized as they arrive (each token row
    on its own, as a QuantizedKVCache does); attention reads them with quantized
    matmuls (base.scaled_dot_product_attention dispatches on QuantizedKVCache)."""

    def __init__(self, left_padding: Sequence[int], group_size: int = 64, bits: int = 8):
        check_kv_quantization_params(group_size, bits)
        self.group_size, self.bits = group_size, bits
        _AlignedKV.__init__(self, left_padding)

    def _split(self, keys: mx.array, values: mx.array) -> List[mx.array]:
        return [*self._quantize(keys), *self._quantize(values)]

    def _fetch(self, end: int):
        used = [b[..., :end, :] for b in self.buffers]
        return tuple(used[:3]), tuple(used[3:])

    def _settings(self) -> dict:
        return {"group_size": self.group_size, "bits": self.bits}

    @classmethod
    def merge(cls, caches: Sequence[QuantizedKVCache]) -> "BatchQuantizedKVCache":
        settings = {(c.group_size, c.bits) for c in caches}
        if len(settings) > 1:
            raise ValueError(f"quantized caches of different (group_size, bits) {sorted(settings)} cannot share a batch")
        group_size, bits = settings.pop()
        batch = cls([], group_size=group_size, bits=bits)
        for c in caches:
            rows = [*c.state[0], *c.state[1]] if c.offset else None
            batch.extend(cls._from_rows(rows, 0, c.offset, group_size=group_size, bits=bits))
        return batch

    def extend(self, other: "BatchQuantizedKVCache") -> "BatchQuantizedKVCache":
        """Other's rows after these, in place; returns self."""
        if type(other) is type(self) and (other.group_size, other.bits) != (self.group_size, self.bits):
            raise ValueError(f"quantized caches of bits {self.bits} and {other.bits} (group sizes {self.group_size}, "
                             f"{other.group_size}) cannot share a batch")
        return self._extend(other)

    def filter(self, indices: Sequence[int]) -> "BatchQuantizedKVCache":
        """Rows `indices` as a new batch; this one is left whole."""
        return self._like(*self._take_rows(indices))

    def extract(self, index: int) -> QuantizedKVCache:
        cache = QuantizedKVCache(self.group_size, self.bits)
        columns = [] if self.buffers is None else self._row_columns(index)
        if columns:
            parts = self._row(index, columns)
            cache.state = (tuple(parts[:3]), tuple(parts[3:]))
        return cache


class BatchArraysCache(_NotSaved, ArraysCache):
    """ArraysCache rows (recurrent and conv state) stacked along the batch axis.

    While speculating, the layers record each forward (`record_rollback`, as for one
    sequence) and `trim_rows` rewinds each row by its own count: within one record, in
    one replay of every row's own prefix (rows that keep it all keep their state); across
    the stacked records of a draft's steps, the state after the first m recorded tokens
    is rebuilt once per distinct m (a record's snapshot, mostly) and each row takes its
    own. Records stack while the newer ones cover fewer than `rollback_window` tokens:
    a target verifies once per round (a window of 1: a new record commits the previous
    forward), a draft model steps K times (a window of K + 1). A trim commits everything
    recorded."""

    _rollbacks: Optional[RollbackLog] = None  # while speculating: records (num_tokens, (replay, snapshot))
    bookkeeping: List[mx.array] = []  # the state is each step's output

    @classmethod
    def merge(cls, caches: Sequence[ArraysCache]) -> "BatchArraysCache":
        batch = cls(len(caches[0].cache))
        for c in caches:
            batch = batch.extend(c)
        return batch

    _rows_without_state = 0  # while the arrays are None: how many rows have seen no token

    @property
    def batch_size(self) -> int:
        return self._rows_without_state if self.cache[0] is None else self.cache[0].shape[0]

    @staticmethod
    def _num_rows(cache: ArraysCache) -> int:
        if isinstance(cache, BatchArraysCache):
            return cache.batch_size
        return 1 if cache.cache[0] is None else cache.cache[0].shape[0]  # one sequence's

    def _like(self, arrays: List[Optional[mx.array]], num_rows: int) -> "BatchArraysCache":
        made = BatchArraysCache(len(arrays))
        made.cache = arrays
        # Speculating as these rows, without their records (they replay the rows they were taken of).
        made._rollbacks = None if self._rollbacks is None else RollbackLog(self._rollbacks.window)
        made._rows_without_state = num_rows if arrays[0] is None else 0
        return made

    def extend(self, other: ArraysCache) -> "BatchArraysCache":
        """Other's rows (a batch's or one sequence's) after these, in place; returns self.
        A row that has seen no token cannot join rows that have (nor they it): upstream
        gives it zeros, but a layer may start a sequence differently from a zero state
        (recurrent_gemma's RG-LRU)."""
        if not isinstance(other, ArraysCache):
            raise ValueError(f"a BatchArraysCache cannot be extended by a {type(other).__name__}")
        if len(other.cache) != len(self.cache):
            raise ValueError(f"ArraysCache of {len(other.cache)} arrays cannot join a batch of {len(self.cache)}")
        num_rows, joined = self._num_rows(other), []
        for mine, theirs in zip(self.cache, other.cache):
            if (mine is None) != (theirs is None) and self.batch_size and num_rows:
                raise ValueError("a recurrent cache that has seen no token cannot join one that has "
                                 "(prefill a token alone first)")
            joined.append(theirs if mine is None else mine if theirs is None else mx.concatenate([mine, theirs]))
        rows = self.batch_size + num_rows
        self.cache = joined
        if self._rollbacks is not None:
            self._rollbacks.records = []  # records replay the rows they were taken of
        self._rows_without_state = rows if joined[0] is None else 0
        return self

    def filter(self, indices: Sequence[int]) -> "BatchArraysCache":
        """Rows `indices` as a new batch; this one is left whole (upstream: in place)."""
        rows = _rows(indices, self.batch_size)
        at = mx.array(rows, dtype=mx.int32)
        return self._like([None if a is None else mx.take(a, at, axis=0) for a in self.cache], len(rows))

    def extract(self, index: int) -> ArraysCache:
        row = ArraysCache(len(self.cache))
        row.cache = [None if a is None else mx.contiguous(a[index : index + 1]) for a in self.cache]
        return row

    def start_speculation(self, rollback_window: int = 1) -> None:
        self._rollbacks = RollbackLog(max(rollback_window, 1))

    def record_rollback(self, num_tokens: int, fn: Callable, snapshot: List[Optional[mx.array]]) -> None:
        if self._rollbacks is None:
            raise RuntimeError("record_rollback called on a BatchArraysCache that is not speculating")
        self._rollbacks.push(num_tokens, (fn, list(snapshot)))

    def _state_after(self, records, m: int) -> List[Optional[mx.array]]:
        """The state after the first m of the tokens `records` recorded."""
        start = 0
        for num_tokens, (fn, snapshot) in records:
            if m == start:
                return snapshot
            if m < start + num_tokens:
                return list(fn(m - start))
            start += num_tokens
        return self.cache

    def trim_rows(self, counts: Sequence[int]) -> None:
        """Rewind row b by counts[b] of the recorded tokens."""
        records = [] if self._rollbacks is None else self._rollbacks.records
        recorded = sum(n for n, _ in records)
        if any(counts) and max(counts) > recorded:
            raise RuntimeError(f"cannot roll rows back by {list(counts)}: the last forwards recorded "
                               f"{recorded} tokens")
        keeps = [recorded - c for c in counts]
        if self._rollbacks is not None:
            self._rollbacks.records = []
        if len(set(keeps)) > 1 and len(records) == 1:
            _, (fn, _) = records[0]
            kept_all = mx.array([m == recorded for m in keeps])
            self.cache = [mx.where(kept_all.reshape(-1, *[1] * (a.ndim - 1)), a, replayed)
                          for a, replayed in zip(self.cache, fn(keeps))]
            return
        states = {m: self._state_after(records, m) for m in set(keeps)}
        if len(states) == 1:
            self.cache = list(states[keeps[0]])
            return
        self.cache = [mx.concatenate([states[m][i][b : b + 1] for b, m in enumerate(keeps)])
                      for i in range(len(self.cache))]

    def trim(self, n: int) -> int:
        self.trim_rows([n] * self.batch_size)
        return max(n, 0)

    def make_room(self, num_new: int) -> None:
        pass  # a fixed size


class BatchCacheList(CacheList):
    """CacheList rows: each child batched on its own."""

    @classmethod
    def merge(cls, caches: Sequence[CacheList]) -> "BatchCacheList":
        return cls(*(merge_entries([c.caches[i] for c in caches]) for i in range(len(caches[0].caches))))

    def extend(self, other: CacheList) -> "BatchCacheList":
        """Other's rows after these, child by child, in place; returns self."""
        self.caches = tuple(extend_entry(a, b) for a, b in zip(self.caches, other.caches))
        return self

    def filter(self, indices: Sequence[int]) -> "BatchCacheList":
        return BatchCacheList(*(c.filter(indices) for c in self.caches))

    def extract(self, index: int) -> CacheList:
        return CacheList(*(c.extract(index) for c in self.caches))

    def trim_rows(self, counts: Sequence[int]) -> None:
        for c in self.caches:
            c.trim_rows(counts)

    @property
    def bookkeeping(self) -> List[mx.array]:
        return [a for c in self.caches for a in c.bookkeeping]

    def make_room(self, num_new: int) -> None:
        for c in self.caches:
            c.make_room(num_new)

    def prepare(self, **padding) -> None:
        for c in self.caches:
            c.prepare(**padding)

    def finalize(self) -> None:
        for c in self.caches:
            c.finalize()


class BatchSharedKVReader(_NotSaved, SharedKVReader):
    """SharedKVReader rows: nothing to stack, pad, drop or roll back."""

    @classmethod
    def merge(cls, caches: Sequence[SharedKVReader]) -> "BatchSharedKVReader":
        return cls()

    def extend(self, other: SharedKVReader) -> "BatchSharedKVReader":
        return self

    def filter(self, indices: Sequence[int]) -> "BatchSharedKVReader":
        return self

    def extract(self, index: int) -> SharedKVReader:
        return SharedKVReader()

    def trim_rows(self, counts: Sequence[int]) -> None:
        pass

    @property
    def bookkeeping(self) -> List[mx.array]:
        return []

    def make_room(self, num_new: int) -> None:
        pass

    def prepare(self, **padding) -> None:
        pass  # holds no tokens, padded or not

    def finalize(self) -> None:
        pass


# Which batched class holds rows of each cache class (exact types: any other kind
# cannot be batched), in cache.py's registry (see there why).
BATCH_CLASSES.update({
    KVCache: BatchKVCache,
    RotatingKVCache: BatchRotatingKVCache,
    QuantizedKVCache: BatchQuantizedKVCache,
    ArraysCache: BatchArraysCache,
    CacheList: BatchCacheList,
    SharedKVReader: BatchSharedKVReader,
    ChunkedKVCache: BatchChunkedKVCache,
})


def extend_entry(batched: Any, rows: Any) -> Any:
    """A batched entry followed by the rows of another batched entry of its kind
    (`batched`, extended in place)."""
    return batched.extend(rows)


def merge_caches(row_caches: Sequence[List[Any]]) -> List[Any]:
    """Per-row cache lists (one entry per layer) -> one batched cache list."""
    return [merge_entries([caches[layer] for caches in row_caches]) for layer in range(len(row_caches[0]))]


def extend_caches(batched: List[Any], more: List[Any]) -> List[Any]:
    return [extend_entry(a, b) for a, b in zip(batched, more)]


def filter_caches(batched: List[Any], indices: Sequence[int]) -> List[Any]:
    """Only rows `indices` (in that order), padding common to all of them dropped."""
    return [entry.filter(indices) for entry in batched]


def make_room(batched: List[Any], num_new: int) -> None:
    """Call before each forward of num_new tokens per row (see _AlignedKV.make_room)."""
    for entry in batched:
        entry.make_room(num_new)


def trim_rows(batched: List[Any], counts: Sequence[int]) -> None:
    """Forget the last counts[b] tokens of each row b (see _AlignedKV.trim_rows)."""
    for entry in batched:
        entry.trim_rows(counts)


def bookkeeping(batched: List[Any]) -> List[mx.array]:
    """The small arrays a step updates that its output need not depend on. Evaluate
    them with the step's output: left lazy, their updates pile up, one per layer and
    step, until the next read (a row joining or leaving) evaluates them all at once
    (at 300 steps, 15 ms for a 6-layer model)."""
    return [a for entry in batched for a in entry.bookkeeping]


def extract_caches(batched: List[Any], index: int) -> List[Any]:
    """Row `index` as ordinary caches, copied out of the batch buffers."""
    return [entry.extract(index) for entry in batched]
