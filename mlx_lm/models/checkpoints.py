"""Exact snapshots of a prompt cache's untrimmable entries, so that a cached prompt can
be resumed at an earlier position.

A recurrent state (ArraysCache: Gated DeltaNet, Mamba-2, short convolutions) and a
sliding window that has wrapped (RotatingKVCache) cannot give tokens back outside
speculation; KV entries can (they forget rows). A `CheckpointedCache` is a model's cache
list (the target's entries, then a draft's) that keeps, while it is prefilled, copies of
its untrimmable entries at chosen positions. Rebuilding those entries from the snapshot
at position p and trimming the KV entries to p gives the cache a cold feed of the first
p tokens builds, and prefilling the rest from there gives what a cold run gives, bit for
bit, because:

- snapshots are taken only on the prefill grid: p is a multiple of the prefill step S
  and every chunk before it was a whole [kS, (k + 1)S) chunk, which is how a cold
  prefill of any longer prompt feeds those tokens. Moving a chunk boundary changes the
  floating point result of the chunked recurrences (tests/test_checkpoints.py shows
  it), so a position off the grid, a message boundary say, cannot be exact;
- a prompt resumed at p is fed in chunks from p: the cold run's chunks again.

Spacing. Snapshots sit at multiples of `spacing`, at first S. When they would exceed
the cache's byte budget the spacing doubles and the snapshots off the coarser grid go,
so they always fit and cover a prompt of any length evenly; the newest one stays
whatever its position (the usual shared prefix is all of a prompt but its end).

Counting. The cache counts the tokens it holds: each prefill loop calls
`maybe_snapshot(cache, num_fed)` at its chunk boundaries (0 at its start), and the
prompt cache sets the count from its keys. Where the list has an attention entry its
offset is the truth; a purely recurrent list knows whether it was fed since it last
counted by the identity of its state arrays (layers replace them on every forward), so
tokens fed past the hooks (generation) make its length unknown instead of wrong. Trimming
entries directly (not through `trim_prompt_cache`) and feeding other tokens to the same
length cannot be seen; the snapshots then describe tokens the cache no longer holds.
"""

import weakref
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional, Tuple

import mlx.core as mx

from .cache import (
    CacheList,
    KVCache,
    QuantizedKVCache,
    RewindableCacheList,
    RotatingKVCache,
    SharedKVReader,
    can_trim_prompt_cache,
)


def always_trimmable(entry: Any) -> bool:
    """Whether an entry gives tokens back whatever state it is in (it keeps every row)."""
    if isinstance(entry, CacheList):
        return all(always_trimmable(c) for c in entry.caches)
    return isinstance(entry, (KVCache, QuantizedKVCache, SharedKVReader))


def copy_entry(entry: Any) -> Any:
    """An entry holding the same tokens that can be fed independently of `entry`, rebuilt
    through its class's `from_state` (a CacheList's children one by one)."""
    if isinstance(entry, CacheList):
        return CacheList(*(copy_entry(c) for c in entry.caches))
    return type(entry).from_state(entry.state, entry.meta_state)


def _fresh(tree):
    """The arrays of a state as new Python objects, copying only views (a sliding
    window's rows inside a larger buffer): no write to a live cache's arrays can then
    reach a snapshot, nor a restored cache's writes the snapshot it came from."""
    if isinstance(tree, (list, tuple)):
        return type(tree)(_fresh(t) for t in tree)
    return None if tree is None else mx.contiguous(tree)


def _arrays(tree) -> List[mx.array]:
    if isinstance(tree, (list, tuple)):
        return [a for t in tree for a in _arrays(t)]
    return [] if tree is None else [tree]


def held_by_rows(entries: List[Any]) -> Optional[int]:
    """The tokens held, from the first entry that counts them (an attention entry's
    offset); None for a list of recurrent entries only."""
    for entry in entries:
        if isinstance(entry, CacheList):
            found = held_by_rows(list(entry.caches))
            if found is not None:
                return found
        elif isinstance(entry, (KVCache, QuantizedKVCache, RotatingKVCache)):
            return entry.offset
    return None


# What a snapshot keeps of one entry: None (it trims), a CacheList's children's, or
# (class, state, meta_state).
Saved = Any


def _save(entry: Any) -> Saved:
    if always_trimmable(entry):
        return None
    if isinstance(entry, CacheList):
        return [_save(c) for c in entry.caches]
    return type(entry), _fresh(entry.state), entry.meta_state


def _restore(entry: Any, saved: Saved, num_later: int) -> Any:
    """`entry` as it was `num_later` tokens ago: rebuilt from what was saved then, or
    (a trimmable entry) a copy trimmed by num_later."""
    if saved is None:
        copy = copy_entry(entry)
        copy.trim(num_later)
        return copy
    if isinstance(saved, list):
        return CacheList(*(_restore(c, s, num_later) for c, s in zip(entry.caches, saved)))
    cls, state, meta_state = saved
    return cls.from_state(_fresh(state), meta_state)


@dataclass(eq=False)
class Snapshot:
    """The untrimmable entries of a cache list after its first `position` tokens; one
    Saved per entry. Shared, never changed, by the copies of the cache it was taken of."""

    position: int
    saved: List[Saved]
    nbytes: int

    @classmethod
    def take(cls, entries: List[Any], position: int) -> "Snapshot":
        saved = [_save(e) for e in entries]
        arrays = _arrays([s[1] for s in _flat_saved(saved)])
        mx.eval(arrays)
        return cls(position, saved, sum(a.nbytes for a in arrays))


def _flat_saved(saved: List[Saved]) -> List[Tuple[type, Any, Any]]:
    found = []
    for s in saved:
        if isinstance(s, list):
            found += _flat_saved(s)
        elif s is not None:
            found.append(s)
    return found


def _recurrent_arrays(entries: List[Any]) -> List[Optional[mx.array]]:
    """The state arrays of the untrimmable entries, by identity (None slots included)."""
    found = []
    for entry in entries:
        if isinstance(entry, CacheList):
            found += _recurrent_arrays(list(entry.caches))
        elif not always_trimmable(entry):
            found += entry.state if isinstance(entry.state, list) else _arrays(entry.state)
    return found


def _identities(arrays: List[Optional[mx.array]]) -> List[Optional[weakref.ref]]:
    return [None if a is None else weakref.ref(a) for a in arrays]


def _same_arrays(seen: List[Optional[weakref.ref]], arrays: List[Optional[mx.array]]) -> bool:
    return len(seen) == len(arrays) and all(
        (r is None and a is None) or (r is not None and r() is a) for r, a in zip(seen, arrays)
    )


class CheckpointedCache(RewindableCacheList):
    """A model's cache list plus exact snapshots of its untrimmable entries (see the
    module docstring), within `max_bytes`, on the grid of `prefill_step_size`.

    `num_tokens`: the tokens it holds as counted (None: unknown, see held_tokens);
    `on_grid`: it holds what a cold prefill holds after those tokens (every chunk so
    far a whole grid chunk), so a snapshot taken now is exact; `snapshots`: by
    position. Positions are counted from the first token the list holds."""

    def __init__(self, entries: List[Any], prefill_step_size: int, max_bytes: int, *, num_tokens: int = 0,
                 on_grid: Optional[bool] = None):
        if prefill_step_size < 1:
            raise ValueError(f"prefill_step_size must be positive, got {prefill_step_size}")
        if max_bytes < 0:
            raise ValueError(f"a checkpoint byte budget must be >= 0, got {max_bytes}")
        if num_tokens < 0:
            raise ValueError(f"num_tokens must be >= 0, got {num_tokens}")
        super().__init__(entries)
        self.prefill_step_size = prefill_step_size
        self.max_bytes = max_bytes
        self.spacing = prefill_step_size
        self.snapshots: Dict[int, Snapshot] = {}
        self.num_tokens: Optional[int] = num_tokens
        # Unless told, only an empty list is known to hold a cold prefill's state.
        self.on_grid = num_tokens == 0 if on_grid is None else on_grid
        self._seen = _identities(_recurrent_arrays(self))

    @property
    def snapshot_bytes(self) -> int:
        return sum(s.nbytes for s in self.snapshots.values())

    def positions(self) -> List[int]:
        return sorted(self.snapshots)

    def nearest(self, limit: int) -> Optional[int]:
        """The largest snapshot position <= limit, or None."""
        return max((p for p in self.snapshots if p <= limit), default=None)

    def _recount(self, just_fed: bool = False) -> None:
        """Check the count against what the entries show (module docstring): tokens
        fed past the hooks end the grid, and unknown ones the count. `just_fed`: the
        hook counted a chunk, which replaced the recurrent arrays."""
        by_rows = held_by_rows(self)
        if by_rows is not None:
            if by_rows != self.num_tokens:
                self.num_tokens, self.on_grid = by_rows, False
                self._forget_after(by_rows)
        elif not just_fed and not _same_arrays(self._seen, _recurrent_arrays(self)):
            self.num_tokens, self.on_grid = None, False
        self._seen = _identities(_recurrent_arrays(self))

    def _fed_since_count(self) -> bool:
        by_rows = held_by_rows(self)
        if by_rows is not None:
            return by_rows != self.num_tokens
        return not _same_arrays(self._seen, _recurrent_arrays(self))

    def _forget_after(self, position: int) -> None:
        self.snapshots = {p: s for p, s in self.snapshots.items() if p <= position}

    def count_as(self, num_tokens: int) -> None:
        """Set the count (the prompt cache knows it from its key); an attention entry
        holding another number of tokens is a caller's bug."""
        if num_tokens < 0:
            raise ValueError(f"a token count must be >= 0, got {num_tokens}")
        by_rows = held_by_rows(self)
        if by_rows is not None and by_rows != num_tokens:
            raise ValueError(f"this cache's attention entries hold {by_rows} tokens, not {num_tokens}")
        if self.num_tokens != num_tokens:
            self.on_grid = False
            self._forget_after(num_tokens)
        self.num_tokens = num_tokens
        self._seen = _identities(_recurrent_arrays(self))

    def held_tokens(self) -> int:
        """How many tokens it holds; RuntimeError when that is unknown."""
        self._recount()
        if self.num_tokens is None:
            raise RuntimeError(
                "this checkpointed cache holds only recurrent entries and was fed past its prefill hooks "
                "(generation), so it does not know how many tokens it holds; count_as(n) tells it"
            )
        return self.num_tokens

    def took_in(self, num_fed: int) -> None:
        """The prefill hook (maybe_snapshot): the list just took in one chunk of
        `num_fed` tokens, or (0) a prefill is about to start."""
        if num_fed < 0:
            raise ValueError(f"a prefill chunk cannot feed {num_fed} tokens")
        if num_fed == 0 or self.num_tokens is None or not self._fed_since_count():
            self._recount()  # a prefill starts, the count is lost, or a second hook told of this chunk
            return
        start, self.num_tokens = self.num_tokens, self.num_tokens + num_fed
        # A cold prefill feeds [kS, (k + 1)S): a shorter chunk is a prompt's last one,
        # a longer one another step's; after either the grid is lost.
        self.on_grid = self.on_grid and start % self.prefill_step_size == 0 and num_fed == self.prefill_step_size
        self._recount(just_fed=True)
        if self.on_grid:
            self._add(Snapshot.take(self, self.num_tokens))

    def _add(self, snapshot: Snapshot) -> None:
        """Keep `snapshot` as the newest; thin the others to fit the budget."""
        if snapshot.nbytes > self.max_bytes:
            return
        newest = max(self.snapshots, default=None)
        if newest is not None and newest % self.spacing:
            del self.snapshots[newest]  # it stayed only as the newest
        self.snapshots[snapshot.position] = snapshot
        while self.snapshot_bytes > self.max_bytes:
            self.spacing *= 2
            self.snapshots = {p: s for p, s in self.snapshots.items()
                              if p % self.spacing == 0 or p == snapshot.position}

    def _entries_at(self, position: int, held: int) -> List[Any]:
        """New entries holding the first `position` of the `held` tokens."""
        if position == held:
            return [copy_entry(e) for e in self]
        if position not in self.snapshots:
            raise ValueError(
                f"cannot go back to position {position} of the {held} tokens this cache holds: its "
                f"untrimmable entries have snapshots only at {self.positions() or 'no position'}"
            )
        saved = self.snapshots[position].saved
        return [_restore(e, s, held - position) for e, s in zip(self, saved)]

    def copy_at(self, position: int) -> "CheckpointedCache":
        """An independent cache holding the first `position` tokens (a snapshot
        position, or all of them), with the snapshots up to there."""
        held = self.held_tokens()
        if not 0 <= position <= held:
            raise ValueError(f"position {position} is outside the {held} tokens this cache holds")
        restored = position < held
        copy = CheckpointedCache(self._entries_at(position, held), self.prefill_step_size, self.max_bytes,
                                 num_tokens=position, on_grid=restored or self.on_grid)
        copy.spacing = self.spacing
        copy.snapshots = {p: s for p, s in self.snapshots.items() if p <= position}
        return copy

    def trim(self, num_tokens: int) -> int:
        """Give back the last `num_tokens`: by the entries themselves where they all can
        (speculating, or no window wrapped), else by restoring the snapshot at the
        position that leaves (ValueError where there is none)."""
        if num_tokens <= 0:
            return 0
        if can_trim_prompt_cache(self):
            for entry in self:
                entry.trim(num_tokens)
            self.on_grid = False
            if self.num_tokens is not None:
                self.num_tokens = max(self.num_tokens - num_tokens, 0)
            self._recount()
            return num_tokens
        held = self.held_tokens()
        if num_tokens > held:
            raise ValueError(f"cannot trim {num_tokens} tokens from a cache holding {held}")
        position = held - num_tokens
        self[:] = self._entries_at(position, held)
        self.num_tokens, self.on_grid = position, True
        self._forget_after(position)
        self._seen = _identities(_recurrent_arrays(self))
        return num_tokens


def maybe_snapshot(prompt_cache: List[Any], num_fed: int) -> None:
    """The prefill hook. A prefill loop calls it with a model's whole cache list (a
    draft's entries included, once they took the chunk too) at each chunk boundary:
    `num_fed` = 0 before its first chunk, then the tokens each chunk fed. Only a
    CheckpointedCache does anything: it counts, and snapshots on the grid. A chunk told
    of twice (a loop's hook and a SnapshottingProgress around it) counts once."""
    if isinstance(prompt_cache, CheckpointedCache):
        prompt_cache.took_in(num_fed)


class SnapshottingProgress:
    """A prefill's `progress(done, total)` callback (called after each chunk, once every
    cache of the list took it; it may raise to cancel) that first tells `prompt_cache`
    of the chunk: the hook for loops that feed parts of a cache list (a target's and a
    draft's) separately, and for callers of stream_generate. `done` counts from the
    prefill's start."""

    def __init__(self, prompt_cache: List[Any], progress: Optional[Callable[[int, int], None]] = None):
        self.prompt_cache, self.progress, self.done = prompt_cache, progress, 0
        maybe_snapshot(prompt_cache, 0)

    def __call__(self, done: int, total: int) -> None:
        num_fed, self.done = done - self.done, done
        maybe_snapshot(self.prompt_cache, num_fed)
        if self.progress is not None:
            self.progress(done, total)
