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

- every prefill of a list with untrimmable entries (feeding.prefill, the server's, a
  batch's) cuts its chunks by `chunk_end`: a chunk starting at position s ends at the
  first of the next multiples of S (the prefill step) and of SNAPSHOT_GRID and the next
  message boundary the prompt has (the server's, see below), so where chunks end is a
  function of the position and the prompt's prefix only, never of where a run began;
- a snapshot is taken only at the end of a chunk when every chunk before it was cut so
  (the list is `on_grid`): a cold run of any prompt sharing those tokens (and their
  message boundaries) then ends a chunk there with the same state. Moving a chunk
  boundary changes the floating point result of the chunked recurrences
  (tests/test_checkpoints.py shows it), so no other position can be exact;
- a prompt resumed at p is fed in chunks from p by the same rule: the cold run's chunks.

Message boundaries. The server knows where the chat template's rendering of the
earlier messages ends inside a prompt (a system prompt, a document, the turns before);
`message_boundaries` (positions) end chunks and take snapshots there too. A snapshot
remembers the boundaries at or before it, and resumes only a prompt with the same ones
there (with others, a cold run would have cut its chunks elsewhere).

Spacing. Snapshots are kept at multiples of `spacing`, at first the smaller of S and
SNAPSHOT_GRID (chunks end at every multiple of either). When they would exceed the cache's byte budget the spacing
doubles and the snapshots off the coarser grid go, so they always fit and cover a
prompt of any length evenly; the newest one stays whatever its position (the usual
shared prefix is all of a prompt but its end), and so do those at message boundaries
until only they are left over budget (then the oldest go first).

An MTP head (drafters.MTPHead) reads pairs (the target's final hidden state at t,
token t + 1), so while the target holds p tokens its head's KV entries hold p - 1
pairs, and the next pair needs the target's hidden state at p - 1. A snapshot records
how many tokens each trimmable entry held (a resume trims it back to that) and the
row its loop told it (`keep_hidden`), so a run resumed at p feeds the head that pair
with the next chunk, as a cold run does (tests/test_mtp_prefix_reuse.py).

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
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

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


# Prefill chunks of a list with untrimmable entries end at multiples of this, whatever
# the prefill step: the finest spacing of snapshots at the default step (2048), so that a
# 2k prompt sharing all but its last 64 tokens resumes within 128 of them (256 would
# leave up to 0.125x of a cold prefill to do). On the CPU a cold 2k prefill of the demo
# target took no longer in 128-token chunks than in one 2048 chunk (2.2-2.5 s against
# 2.5-2.9 s of CPU time); KV-only lists keep whole steps.
SNAPSHOT_GRID = 128


def chunk_end(start: int, prefill_step_size: int, message_boundaries: Sequence[int] = ()) -> int:
    """Where a prefill chunk starting at position `start` ends when the list has
    untrimmable entries (before the prompt's own end): the first of the next multiples
    of the step and of SNAPSHOT_GRID and the next message boundary after `start`. The
    step's multiples, not start + step: after a boundary the chunks fall back in line."""
    end = min(next_multiple(start, prefill_step_size), next_multiple(start, SNAPSHOT_GRID))
    return min([end] + [b for b in message_boundaries if b > start])


def next_multiple(position: int, spacing: int) -> int:
    return (position // spacing + 1) * spacing


def first_spacing(prefill_step_size: int) -> int:
    """The finest spacing whose multiples are all chunk ends."""
    return min(prefill_step_size, SNAPSHOT_GRID)


def check_message_boundaries(message_boundaries: Sequence[int]) -> Tuple[int, ...]:
    bounds = tuple(message_boundaries)
    if any(not isinstance(b, int) or b < 1 for b in bounds) or list(bounds) != sorted(set(bounds)):
        raise ValueError(f"message boundaries must be increasing positive token positions, got {list(bounds)}")
    return bounds


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


# What a snapshot keeps of one entry: None (it trims, and held the snapshot's
# position), an int (it trims, and held that many tokens: an MTP head's KV entries hold
# one pair fewer than the target), a CacheList's children's, or (class, state, meta_state).
Saved = Any


def _save(entry: Any, position: int) -> Saved:
    if always_trimmable(entry):
        held = held_by_rows([entry])
        return None if held is None or held == position else held
    if isinstance(entry, CacheList):
        return [_save(c, position) for c in entry.caches]
    return type(entry), _fresh(entry.state), entry.meta_state


def _restore(entry: Any, saved: Saved, num_later: int) -> Any:
    """`entry` as it was `num_later` tokens ago: rebuilt from what was saved then, or
    (a trimmable entry) a copy trimmed back to what it held then."""
    if saved is None or isinstance(saved, int):
        copy = copy_entry(entry)
        copy.trim(num_later if saved is None else held_by_rows([copy]) - saved)
        return copy
    if isinstance(saved, list):
        return CacheList(*(_restore(c, s, num_later) for c, s in zip(entry.caches, saved)))
    cls, state, meta_state = saved
    return cls.from_state(_fresh(state), meta_state)


@dataclass(eq=False)
class Snapshot:
    """The untrimmable entries of a cache list after its first `position` tokens; one
    Saved per entry. Shared, never changed, by the copies of the cache it was taken of.
    `message_boundaries`: those its chunks were cut at (all at or before `position`);
    `hidden`: the target's final hidden state (1, H) at position - 1, where an MTP head
    reads it (its next pair; see CheckpointedCache.keep_hidden), else None."""

    position: int
    saved: List[Saved]
    nbytes: int
    message_boundaries: Tuple[int, ...] = ()
    hidden: Optional[mx.array] = None

    @classmethod
    def take(cls, entries: List[Any], position: int, message_boundaries: Sequence[int] = (),
             hidden: Optional[mx.array] = None) -> "Snapshot":
        saved = [_save(e, position) for e in entries]
        arrays = _arrays([s[1] for s in _flat_saved(saved)]) + _arrays(hidden)
        mx.eval(arrays)
        bounds = tuple(b for b in message_boundaries if b <= position)
        return cls(position, saved, sum(a.nbytes for a in arrays), bounds, hidden)

    @property
    def at_message(self) -> bool:
        return self.message_boundaries[-1:] == (self.position,)

    def resumes(self, message_boundaries: Sequence[int]) -> bool:
        """Whether a prompt with these message boundaries is cut as this one was up to here."""
        return tuple(b for b in message_boundaries if b <= self.position) == self.message_boundaries


def _flat_saved(saved: List[Saved]) -> List[Tuple[type, Any, Any]]:
    found = []
    for s in saved:
        if isinstance(s, list):
            found += _flat_saved(s)
        elif isinstance(s, tuple):
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
    module docstring), within `max_bytes`, for prefills in steps of `prefill_step_size`.

    `num_tokens`: the tokens it holds as counted (None: unknown, see held_tokens);
    `on_grid`: it holds what a cold prefill holds after those tokens (every chunk so
    far cut by chunk_end), so a snapshot taken now is exact; `snapshots`: by
    position; `message_boundaries`: the current prompt's (set_message_boundaries);
    `last_hidden`: (position, row) from keep_hidden, for an MTP head. Positions are
    counted from the first token the list holds."""

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
        self.spacing = first_spacing(prefill_step_size)
        self.snapshots: Dict[int, Snapshot] = {}
        self.message_boundaries: Tuple[int, ...] = ()
        self.num_tokens: Optional[int] = num_tokens
        self.last_hidden: Optional[Tuple[int, mx.array]] = None
        # Unless told, only an empty list is known to hold a cold prefill's state.
        self.on_grid = num_tokens == 0 if on_grid is None else on_grid
        self._seen = _identities(_recurrent_arrays(self))

    @property
    def snapshot_bytes(self) -> int:
        return sum(s.nbytes for s in self.snapshots.values())

    def positions(self) -> List[int]:
        return sorted(self.snapshots)

    def nearest(self, limit: int, message_boundaries: Sequence[int] = ()) -> Optional[int]:
        """The largest snapshot position <= limit that resumes a prompt with these
        message boundaries, or None."""
        return max((p for p, s in self.snapshots.items() if p <= limit and s.resumes(message_boundaries)),
                   default=None)

    def set_message_boundaries(self, message_boundaries: Sequence[int]) -> None:
        """The boundaries of the prompt it is about to be fed (absolute positions):
        chunks end and snapshots are taken there. Where those at or before what it
        holds differ from the ones it was cut at, it is off the grid from now on."""
        bounds = check_message_boundaries(message_boundaries)
        held = self.num_tokens
        if held is None or [b for b in bounds if b <= held] != [b for b in self.message_boundaries if b <= held]:
            self.on_grid = False
        self.message_boundaries = bounds

    def keep_hidden(self, position: int, row: Optional[mx.array]) -> None:
        """An MTP head's loop tells the target's final hidden state (1, H) at its last
        held position, `position` - 1 (None: unknown). The head's next pair reads it,
        which its entries (one pair behind the target's) lack: a snapshot taken at
        `position` keeps it, so that a run resumed there feeds the pair a cold run feeds."""
        # Its own copy: a row of a chunk's hidden states would keep the whole chunk alive.
        self.last_hidden = None if row is None else (position, mx.contiguous(row))

    def hidden_at(self, position: int) -> Optional[mx.array]:
        """The row keep_hidden told for `position`, or a snapshot's there; None if neither."""
        if self.last_hidden is not None and self.last_hidden[0] == position:
            return self.last_hidden[1]
        snapshot = self.snapshots.get(position)
        return None if snapshot is None else snapshot.hidden

    def chunk_origin(self) -> Optional[int]:
        """The position the next prefill chunk starts at, or None where unknown."""
        self._recount()
        return self.num_tokens

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

    def took_in(self, num_fed: int, hidden: Optional[mx.array] = None) -> None:
        """The prefill hook (maybe_snapshot): the list just took in one chunk of
        `num_fed` tokens, or (0) a prefill is about to start; `hidden`: the target's
        final hidden state (1, H) at the chunk's last position, for an MTP head."""
        if num_fed < 0:
            raise ValueError(f"a prefill chunk cannot feed {num_fed} tokens")
        if hidden is not None and self.num_tokens is not None and self._fed_since_count():
            self.keep_hidden(self.num_tokens + num_fed, hidden)
        if num_fed == 0 or self.num_tokens is None or not self._fed_since_count():
            self._recount()  # a prefill starts, the count is lost, or a second hook told of this chunk
            return
        start, self.num_tokens = self.num_tokens, self.num_tokens + num_fed
        # A shorter chunk is a prompt's last one, a longer one another step's (or
        # another rule's); after either the grid is lost.
        expected = chunk_end(start, self.prefill_step_size, self.message_boundaries)
        self.on_grid = self.on_grid and start + num_fed == expected
        self._recount(just_fed=True)
        if self.on_grid:
            self._add(Snapshot.take(self, self.num_tokens, self.message_boundaries, self.hidden_at(self.num_tokens)))

    def _add(self, snapshot: Snapshot) -> None:
        """Keep `snapshot` as the newest; thin the others to fit the budget."""
        if snapshot.nbytes > self.max_bytes:
            return
        newest = max(self.snapshots, default=None)
        if newest is not None and not self._on_spacing(self.snapshots[newest]):
            del self.snapshots[newest]  # it stayed only as the newest
        self.snapshots[snapshot.position] = snapshot
        while self.snapshot_bytes > self.max_bytes:
            if self.spacing < snapshot.position:  # a coarser spacing still thins
                self.spacing *= 2
                self.snapshots = {p: s for p, s in self.snapshots.items()
                                  if self._on_spacing(s) or p == snapshot.position}
            else:  # only message boundaries (and the newest) left: the oldest goes
                del self.snapshots[min(p for p in self.snapshots if p != snapshot.position)]

    def _on_spacing(self, snapshot: Snapshot) -> bool:
        return snapshot.position % self.spacing == 0 or snapshot.at_message

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
        # Restored, it was cut at the snapshot's boundaries (set_message_boundaries checks the next prompt's).
        copy.spacing = self.spacing
        copy.message_boundaries = self.snapshots[position].message_boundaries if restored else self.message_boundaries
        copy.snapshots = {p: s for p, s in self.snapshots.items() if p <= position}
        copy.keep_hidden(position, self.hidden_at(position))
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
        self.message_boundaries = self.snapshots[position].message_boundaries
        self.keep_hidden(position, self.snapshots[position].hidden)
        self._forget_after(position)
        self._seen = _identities(_recurrent_arrays(self))
        return num_tokens


class PrefillChunks:
    """How a prefill loop cuts a prompt fed to `prompt_cache`: by chunk_end from the
    position the list holds where it has untrimmable entries (a CheckpointedCache's
    message boundaries too), else in whole steps. Where a recurrent-only list does not
    know its position (fed past the hooks) positions count from this prefill's start:
    such a list takes no snapshots, and any cut is as good."""

    def __init__(self, prompt_cache: List[Any], prefill_step_size: int):
        self.step = prefill_step_size
        self.message_boundaries: Tuple[int, ...] = ()
        self.origin: Optional[int] = None  # None: whole steps
        if isinstance(prompt_cache, CheckpointedCache):
            self.origin = prompt_cache.chunk_origin() or 0
            self.message_boundaries = prompt_cache.message_boundaries
        elif not all(always_trimmable(c) for c in prompt_cache):
            self.origin = held_by_rows(prompt_cache) or 0

    def size(self, done: int, num_left: int) -> int:
        """The tokens of the next chunk, `done` tokens into this prefill with `num_left`
        still to feed before the last."""
        if self.origin is None:
            return min(self.step, num_left)
        start = self.origin + done
        return min(chunk_end(start, self.step, self.message_boundaries) - start, num_left)

    def segments(self, tokens: List[int]) -> List[List[int]]:
        """`tokens` (what this prefill feeds) as segments for a loop that cuts whole
        steps from each segment's start (BatchGenerator.insert_segments) and so cuts
        them into these chunks: a segment ends only after a chunk shorter than a step
        (a grid or message boundary), so there are at most as many as those."""
        segments, done, start = [], 0, 0
        while done < len(tokens):
            n = self.size(done, len(tokens) - done)
            done += n
            if n < self.step or done == len(tokens):
                segments.append(tokens[start:done])
                start = done
        return segments


def maybe_snapshot(prompt_cache: List[Any], num_fed: int, hidden: Optional[mx.array] = None) -> None:
    """The prefill hook. A prefill loop calls it with a model's whole cache list (a
    draft's entries included, once they took the chunk too) at each chunk boundary:
    `num_fed` = 0 before its first chunk, then the tokens each chunk fed, and with an
    MTP head the target's hidden state (1, H) at the chunk's last position. Only a
    CheckpointedCache does anything: it counts, and snapshots on the grid. A chunk told
    of twice (a loop's hook and a SnapshottingProgress around it) counts once."""
    if isinstance(prompt_cache, CheckpointedCache):
        prompt_cache.took_in(num_fed, hidden)


def next_pair_hidden(prompt_cache: List[Any], num_target: int) -> Optional[mx.array]:
    """For an MTP head's entries after the first `num_target` of a cache list: the
    target's hidden state (1, H) the head's next pair reads, where the list is a
    CheckpointedCache that kept it and the head holds one pair fewer than the target
    (after a prefill, a resume or a run); else None (the head skips that pair)."""
    if not isinstance(prompt_cache, CheckpointedCache):
        return None
    held = held_by_rows(prompt_cache[:num_target])
    if not held or held_by_rows(prompt_cache[num_target:]) != held - 1:
        return None
    return prompt_cache.hidden_at(held)


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
