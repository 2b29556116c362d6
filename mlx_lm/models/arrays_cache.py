"""`ArraysCache`: a recurrent layer's fixed set of state arrays (conv and SSM state, the
gated delta state), one sequence or several stacked along the batch axis.

A recurrent state cannot be trimmed by dropping rows; while speculating, the layer
that owns it records how to rebuild the state after any prefix of each forward, and
`trim` rewinds through those records. Upstream's batch forms (`filter`, `extend`,
`extract`, `merge`) work on the stacked rows; models/batch_arrays_cache.py's
BatchArraysCache (what `merge` returns) adds per-row rollback.
"""

from typing import Callable, List, Optional, Sequence

import mlx.core as mx

from .cache_base import ROLLBACK_WINDOW, RollbackLog, _BaseCache, check_unpadded, checked_rows


class ArraysCache(_BaseCache):
    """A fixed number of state arrays (e.g. a recurrent layer's conv and SSM state).

    The state after a token depends on every earlier token, so it cannot be trimmed by
    dropping rows. While speculating, the layer that owns it records how to rebuild
    the state after any prefix of each forward (`record_rollback`), and `trim` uses
    those records.
    """

    needs_layer_records = True
    _rollbacks: Optional[RollbackLog] = None  # set while speculating
    _rows_without_state = 1  # rows while the arrays are None (batch_size)

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

    def advance(self, num_tokens: int) -> None:
        """Upstream's layers call it after consuming num_tokens, to count the padding
        still to mask down; no padding is ever taken here (__init__), so none is left."""

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

    @property
    def batch_size(self) -> int:
        """Rows of the state arrays; before they are set, the rows joined so far (one
        sequence, as upstream, unless `extend` joined more)."""
        return self._rows_without_state if self.cache[0] is None else self.cache[0].shape[0]

    def filter(self, batch_indices: Sequence[int]) -> "ArraysCache":
        """Only rows `batch_indices` stay, in that order, in place (as upstream's);
        returns self. Its records replayed the rows they were taken of: dropped."""
        rows = checked_rows(batch_indices, self.batch_size)
        at = mx.array(rows, dtype=mx.int32)
        self.cache = [None if a is None else mx.take(a, at, axis=0) for a in self.cache]
        self._rows_without_state = len(rows)
        if self._rollbacks is not None:
            self._rollbacks = RollbackLog(self._rollbacks.window)
        return self

    def extend(self, other: "ArraysCache") -> "ArraysCache":
        """Other's rows (a batch's or one sequence's) after these, in place (upstream's);
        returns self. A row that has seen no token cannot join rows that have (nor they
        it): upstream gives it zeros, but a layer may start a sequence differently from
        a zero state (recurrent_gemma's RG-LRU)."""
        if not isinstance(other, ArraysCache):
            raise ValueError(f"a {type(self).__name__} cannot be extended by a {type(other).__name__}")
        if len(other.cache) != len(self.cache):
            raise ValueError(f"ArraysCache of {len(other.cache)} arrays cannot join a batch of {len(self.cache)}")
        num_rows, joined = other.batch_size, []
        for mine, theirs in zip(self.cache, other.cache):
            if (mine is None) != (theirs is None) and self.batch_size and num_rows:
                raise ValueError("a recurrent cache that has seen no token cannot join one that has "
                                 "(prefill a token alone first)")
            joined.append(theirs if mine is None else mine if theirs is None else mx.concatenate([mine, theirs]))
        self._rows_without_state = self.batch_size + num_rows
        self.cache = joined
        if self._rollbacks is not None:
            self._rollbacks.records = []  # records replay the rows they were taken of
        return self

    def extract(self, index: int) -> "ArraysCache":
        """Row `index` of the state arrays, as a cache of its own (upstream's)."""
        if not 0 <= index < self.batch_size:
            raise IndexError(f"row {index} does not exist in an ArraysCache of {self.batch_size} rows")
        row = ArraysCache(len(self.cache))
        # Copied: a slice would be a view keeping every row's arrays alive.
        row.cache = [None if a is None else mx.contiguous(a[index : index + 1]) for a in self.cache]
        return row

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
