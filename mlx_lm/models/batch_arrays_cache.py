"""Batched entries that hold no KV columns: recurrent state (`BatchArraysCache`), lists
of entries (`BatchCacheList`) and readers of another layer's KV (`BatchSharedKVReader`).

Recurrent state is each row's arrays stacked: a decode step gives every row exactly one
new token, so no padding ever enters the recurrence; a verify forward is rolled back per
row from the layers' records (replay of each row's prefix).
"""

from typing import Any, Callable, List, Optional, Sequence

import mlx.core as mx

from .batch_kv_cache import _NotSaved
from .cache import ArraysCache, CacheList, SharedKVReader
from .cache_base import RollbackLog, merge_entries


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

    _rows_without_state = 0  # an empty batch has no rows

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


def extend_entry(batched: Any, rows: Any) -> Any:
    """A batched entry followed by the rows of another batched entry of its kind
    (`batched`, extended in place)."""
    return batched.extend(rows)


class BatchCacheList(CacheList):
    """CacheList rows: each child batched on its own."""

    @classmethod
    def merge(cls, caches: Sequence[CacheList]) -> "BatchCacheList":
        return cls(*(merge_entries([c.caches[i] for c in caches]) for i in range(len(caches[0].caches))))

    def trim_rows(self, counts: Sequence[int]) -> None:
        for c in self.caches:
            c.trim_rows(counts)

    @property
    def bookkeeping(self) -> List[mx.array]:
        return [a for c in self.caches for a in c.bookkeeping]

    def make_room(self, num_new: int) -> None:
        for c in self.caches:
            c.make_room(num_new)


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
