"""Speculative rounds of a continuous batch (batching.BatchGenerator): each row's room,
its drafts (prompt lookup on the host; a draft model or the target's MTP head on the
device, batch_drafters.py), one verify forward of every row's token and drafts (padded
to the longest), each row decided by the one acceptance rule (acceptance.accept), and
each row's rejected tokens rolled back (`trim_rows`: KV columns become holes, recurrent
states are rewound from the layers' records). The next round is queued as soon as one
is decided, before its tokens are handed out; a queued round can be cancelled. Rounds
are timed top to top for the draft-length policy."""

import time
from dataclasses import dataclass
from typing import Callable, List, NamedTuple, Optional, Tuple

import mlx.core as mx
import mlx.nn as nn

from .acceptance import accept
from .batch_rows import Row, RowTable, draws, run_target
from .draft_length import BatchDraftLengthPolicy
from .feeding import processed_logprobs
from .models.batch_cache import bookkeeping, make_room, trim_rows
from .sample_utils import CategoricalSampler


class QueuedRound(NamedTuple):
    """A drafting round computing, not yet decided."""

    fed: List[int]  # each row's token the round feeds first
    columns: mx.array  # (B, K + 1): those tokens, the drafts, padding
    logits: mx.array  # the verify's, lazy
    hidden: Optional[mx.array]  # the verify's final hidden states, for an MTP head
    read_drafts: Callable[[], List[List[int]]]  # each row's drafts, once computed
    draft_laws: Optional[mx.array]  # (B, K, V) the log-laws they were drawn from (None: point masses)
    top: float  # when it was queued


@dataclass
class Decision:
    """A row's outcome of a round: the drafts it accepted, the token after them (1,)
    and the logprobs of its positions (K + 1, V)."""

    drafts: List[int]
    num_accepted: int
    token: mx.array
    logprobs: mx.array


def draft_sampler(row: Row) -> Optional[CategoricalSampler]:
    """The law a row's device drafter draws its drafts from: its own sampler's, unless
    it is greedy or seeded (a seeded row's tokens must not depend on its drafts, so it
    matches point masses against its own seeded draws)."""
    return row.sampler if isinstance(row.sampler, CategoricalSampler) and row.seed is None else None


def decide_row(row: Row, drafts: List[int], logits: mx.array, fed: mx.array, emitted: bool,
               draft_laws: Optional[mx.array] = None) -> Tuple[mx.array, mx.array, mx.array]:
    """A row's round (lazy): accepted count (), token (1,), logprobs (K + 1, V) from
    its verify logits (K + 1, V), its processors applied at each position to what
    plain decoding would show them (its history, `fed` (1,) if `emitted`, the drafts
    before). Drafts drawn from the row's law (`draft_laws` (K, V)) are decided by
    speculative sampling against it; point-mass drafts by matching the row's own draws
    (seeded keys: which for point masses is speculative sampling too, and a seeded
    row's tokens then do not depend on what was drafted)."""
    if row.history is not None and emitted:
        row.history = mx.concatenate([row.history, fed])
    drafted = mx.array(drafts, dtype=mx.uint32)
    logprobs = processed_logprobs(logits[: len(drafts) + 1], row.history, drafted, row.processors)
    laws = None if draft_laws is None or draft_sampler(row) is None else draft_laws[: len(drafts)]
    num_accepted, token = accept(logprobs, drafted, laws, row.sampler, draw=lambda lp: draws(row, lp))
    return num_accepted, token[None], logprobs


class Rounds:
    """Queues, decides, settles or cancels the rounds of a RowTable, and times them."""

    def __init__(self, model: nn.Module, table: RowTable, policy: BatchDraftLengthPolicy):
        self.model, self.table, self.policy = model, table, policy
        self.queued: Optional[QueuedRound] = None  # queued ahead by the last step, decided by the next
        self.plain_next: Optional[int] = None  # rows of a batch whose next step was chosen plain
        self.last_round: Optional[Tuple[int, int, float]] = None  # the last step's (rows, K, top)
        self.timed = True  # nothing but the last round ran since it started

    def untimed(self) -> None:
        """Something else ran (a prefill, rows joining or leaving): the round is not timed."""
        self.timed = False

    def time_last_round(self) -> None:
        """The policy learns the last step's seconds, from its top to this one's, if
        nothing else ran meanwhile. Every round is timed alike: a plain step's interval
        holds one forward (pipelined, MLX may compute most of it inside async_eval) and
        the host work beside it; a drafting round's, its forwards, its syncs and the
        host work after them (the caller's too), which nothing overlaps."""
        if self.last_round is not None and self.timed:
            num_rows, k, top = self.last_round
            seconds = time.perf_counter() - top
            self.policy.learn_round_time(num_rows, k, seconds)
            for row in self.table.rows:  # the rows of that round (none joined or left since)
                if row.speculation is not None:
                    row.speculation.add_seconds(seconds)
        self.last_round, self.timed = None, True

    def rooms(self) -> List[int]:
        """How many drafts each row may verify this round: the batch policy's K (all of
        its cap with a fixed draft length) within its cap and what max_tokens leaves.
        Which rounds draft how much never changes what a row emits."""
        caps = []
        for row, emit in zip(self.table.rows, self.table.emit):
            cap = row.num_draft_tokens
            if row.max_tokens != -1:
                cap = min(cap, row.max_tokens - row.num_generated - emit)
            caps.append(max(cap, 0))
        following = [(row.acceptance.value, cap) for row, cap in zip(self.table.rows, caps) if cap]
        k = self.policy.choose(len(self.table), following)
        return [min(cap, k) for cap in caps]

    def draft_samplers(self) -> Optional[List[Optional[CategoricalSampler]]]:
        """Each row's law to draft from (draft_sampler), None if every row drafts point masses."""
        samplers = [draft_sampler(row) for row in self.table.rows]
        return samplers if any(s is not None for s in samplers) else None

    def queue(self, fed: List[int], columns: mx.array, read_drafts: Callable[[], List[List[int]]],
              draft_laws: Optional[mx.array], top: float) -> QueuedRound:
        """The verify of every row's token and drafts (`columns`, (B, K + 1)), queued."""
        make_room(self.table.target_caches, columns.shape[1])
        hidden, logits = run_target(self.model, self.table.drafter, columns, self.table.target_caches)
        mx.async_eval(logits)
        return QueuedRound(fed, columns, logits, hidden, read_drafts, draft_laws, top)

    def queue_drafted(self, rooms: List[int], top: float) -> Optional[QueuedRound]:
        """Every row's drafts (at most its room) and their verify, queued; None if the
        drafter found none (prompt lookup may not)."""
        fed = self.table.tokens.tolist()  # drafting needs each row's token now (the last round is done)
        drafted = self.table.drafter.draft(self.table.draft_caches, fed, rooms, self.draft_samplers())
        if drafted is None:
            return None
        mx.async_eval(drafted[0])  # the drafts compute while the verify's graph is built
        return self.queue(fed, *drafted, top)

    def queue_ahead(self, rows_waiting: bool) -> None:
        """Queue the next round's drafts and verify as
        soon as this one is decided, so they compute while its tokens are handed out
        (as the single-sequence loop does); the next step decides it. Not while rows
        wait to join (they join between rounds). A plain choice is kept for the next step."""
        table = self.table
        if table.drafter is None or not len(table) or rows_waiting:
            return
        self.time_last_round()
        top = time.perf_counter()
        rooms = self.rooms()
        self.queued = self.queue_drafted(rooms, top) if any(rooms) else None
        if self.queued is None:
            self.plain_next = len(table)

    def cancel(self) -> None:
        """Undo a queued round before the batch changes from outside (remove,
        extract_cache): its verify and draft feeds trimmed from every row; the next
        step drafts afresh."""
        if self.queued is None:
            return
        num_columns, self.queued = self.queued.columns.shape[1], None
        trim_rows(self.table.target_caches, [num_columns] * len(self.table))
        self.table.drafter.cancel(self.table.draft_caches)
        self.timed = False

    def decide(self, queued: QueuedRound) -> List[Decision]:
        """Every row's outcome, with the round's one sync."""
        table, drafts = self.table, queued.read_drafts()
        laws = queued.draft_laws
        lazy = [decide_row(row, drafts[i], queued.logits[i], table.tokens[i : i + 1], table.emit[i],
                           None if laws is None else laws[i])
                for i, row in enumerate(table.rows)]
        counts = mx.stack([n for n, _, _ in lazy])
        mx.eval(counts, [token for _, token, _ in lazy])
        decisions = []
        for row, row_drafts, num_accepted, (_, token, logprobs) in zip(table.rows, drafts, counts.tolist(), lazy):
            row.num_sampled += num_accepted + 1
            if row.history is not None and num_accepted:
                row.history = mx.concatenate([row.history, mx.array(row_drafts[:num_accepted], mx.uint32)])
            if row_drafts:
                self.policy.learn_row(row.acceptance, len(row_drafts), num_accepted)
            decisions.append(Decision(row_drafts, num_accepted, token, logprobs))
        return decisions

    def settle(self, queued: QueuedRound, decisions: List[Decision], kept: List[int]) -> None:
        """Row i keeps kept[i] of the round's columns (its fed token, its accepted
        drafts, up to a stop): the rest is rolled back, the drafter settles, and the
        tokens after the accepted drafts become the ones to feed next."""
        table, num_columns = self.table, queued.columns.shape[1]
        trim_rows(table.target_caches, [num_columns - k for k in kept])
        table.tokens = mx.concatenate([d.token for d in decisions])
        if table.drafter is not None:
            table.drafter.settle(table.draft_caches, queued.columns, [d.num_accepted for d in decisions], kept,
                                 table.tokens, queued.hidden)
        # The rollback (recurrent rows replay their kept prefix) computes while the
        # tokens are handed out; rounds are timed top to top, so it is this round's cost.
        mx.async_eval([c.state for c in table.caches], bookkeeping(table.caches))
        table.logprobs = [d.logprobs[d.num_accepted] for d in decisions]
        table.emit = [True] * len(table)
        drafting = [d for d in decisions if d.drafts]
        # Its outcome learned now, so the next choice knows it; its time at the next top.
        self.policy.update(num_columns - 1, sum(d.num_accepted for d in drafting),
                           all(d.num_accepted == len(d.drafts) for d in drafting))
        self.last_round = (len(table), num_columns - 1, queued.top)

    def plain_step_done(self, top: float) -> None:
        """A plain step of the whole batch was queued at `top`."""
        self.policy.update(0, 0, False)
        self.last_round = (len(self.table), 0, top)

    def close(self) -> None:
        self.queued, self.plain_next, self.last_round = None, None, None
