"""The right-aligned KV layout of the batched caches (`batch_cache.py` says how the
batch is used), and the batched KVCache and QuantizedKVCache.

KV layout: right-aligned. Every row writes its next token at the same column `width`
of a (B, H_kv, capacity, D) buffer, so one slice update serves the batch; `positions`
(B, capacity) says which position each column holds, NO_TOKEN for none (left padding
of a shorter row, or a rejected draft). Masks come from positions alone: a query at
position p sees the columns holding positions <= p (within its window). So a row rolls
back its last n tokens by marking its last n columns NO_TOKEN (`trim_rows`), whatever
the other rows do; the holes are squeezed out once they are half the columns. A sliding
window drops the leading columns no query will see. Both happen in `make_room`, which
the generator calls before each forward, never between a mask and its update.

Quantized KV rows (`BatchQuantizedKVCache`) use the same layout with a (packed,
scales, biases) triple of buffers for each of keys and values.
"""

from typing import List, Optional, Sequence, Tuple

import mlx.core as mx

from .cache import KVCache, QuantizedKVCache, check_kv_quantization_params
from .cache_base import checked_rows as _rows, grown_capacity, int_list  # noqa: F401  (_rows: batch_arrays_cache's)


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
        return grown_capacity(needed, self.step)

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

    def filter(self, indices: Sequence[int]) -> "_AlignedKV":
        """Only rows `indices` stay, in that order, in place (as upstream's); returns self."""
        self._set_rows(*self._take_rows(indices))
        return self

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

    def make_mask(self, num_queries: int, return_array: bool = False, window_size: Optional[int] = None):
        """_AlignedKV.make_mask, with upstream's BatchKVCache order of the options
        (make_mask(N, True) asks for an array, as there)."""
        return super().make_mask(num_queries, window_size=window_size, return_array=return_array)

    @classmethod
    def merge(cls, caches: Sequence[KVCache]) -> "BatchKVCache":
        batch = cls([])
        for c in caches:
            batch.extend(cls._from_rows(list(c.state) if c.offset else None, 0, c.offset))
        return batch

    def extend(self, other: "BatchKVCache") -> "BatchKVCache":
        """Other's rows after these, in place (as upstream's); returns self."""
        return self._extend(other)

    def extract(self, index: int) -> KVCache:
        cache = KVCache()
        columns = [] if self.buffers is None else self._row_columns(index)
        if columns:
            cache.state = tuple(self._row(index, columns))
        return cache


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

    def extract(self, index: int) -> QuantizedKVCache:
        cache = QuantizedKVCache(self.group_size, self.bits)
        columns = [] if self.buffers is None else self._row_columns(index)
        if columns:
            parts = self._row(index, columns)
            cache.state = (tuple(parts[:3]), tuple(parts[3:]))
        return cache
