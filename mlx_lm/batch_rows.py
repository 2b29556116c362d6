"""The rows of a continuous batch (batching.BatchGenerator): each sequence's own state
(`Row`) and the table of the rows decoding together (`RowTable`): their batched caches
(the target's entries, then a device drafter's; models/batch_cache.py), each row's
token to feed next and the law it was drawn from. Rows join, leave and are copied out
in one operation each, the drafter's per-row state with them. Sampling is per row:
its sampler, its logits processors and, when seeded, its own keys."""

from dataclasses import dataclass, field
from typing import Any, Callable, List, Optional, Sequence, Tuple

import mlx.core as mx
import mlx.nn as nn

from .draft_length import AcceptanceEstimate
from .feeding import processed_logprobs
from .models.batch_cache import extend_caches, extract_caches, filter_caches, merge_caches
from .sample_utils import make_sampler
from .speculation_stats import SpeculationStats
from .stop_sequences import StopSequences

Sampler = Callable[[mx.array], mx.array]
Processor = Callable[[mx.array, mx.array], mx.array]

GREEDY = make_sampler()  # rows with this sampler speculate by token matching on the argmax


def seeded_key(seed: int, index: int) -> mx.array:
    """The PRNG key a seeded row draws its index-th generated token with: a function
    of the seed and the index only, so the row's tokens do not depend on its batch,
    its drafts or how many tokens a round gave (and the global state is left alone)."""
    return mx.random.key((seed * 0x9E3779B97F4A7C15 + index * 0xBF58476D1CE4E5B9) % (1 << 64))


@dataclass
class Row:
    """One sequence, from its insertion until it finishes or is removed."""

    uid: int
    prompt: mx.array  # prompt tokens not yet fed (1-D)
    cache: List[Any]  # its own caches until it joins the batch
    max_tokens: int
    sampler: Sampler
    processors: List[Processor]
    seed: Optional[int]
    total: int  # prompt tokens to feed
    history: Optional[mx.array] = None  # what processors see: the prompt, then each token fed
    num_in_cache: int = 0  # tokens its cache holds (of what it was given to feed)
    tokens: List[int] = field(default_factory=list)  # what its cache holds when fed: all_tokens, prompt, output
    num_given: int = 0  # of them, those its given cache already held (all_tokens)
    segment_ends: List[int] = field(default_factory=list)  # prompt positions where its segments end
    stop: Optional[StopSequences.Matcher] = None  # its place in its stop sequences
    num_generated: int = 0
    num_sampled: int = 0  # generated tokens drawn (the index of the next draw)
    first: Optional[Tuple[mx.array, mx.array]] = None  # (token, logprobs) sampled alone
    draft_pending: Any = None  # what its drafter keeps for it until it joins (an MTP head: a pair)
    num_draft_tokens: int = 0  # its cap on drafts per round
    speculation: Optional[SpeculationStats] = None  # its counts, when the batch speculates
    acceptance: AcceptanceEstimate = field(default_factory=AcceptanceEstimate)  # of its drafts (policy.new_row)

    @property
    def held_tokens(self) -> List[int]:
        """The tokens its cache holds now: all_tokens, the prompt fed, its output fed."""
        return self.tokens[: self.num_given + self.num_in_cache]


def draws(row: Row, logprobs: mx.array) -> mx.array:
    """(n, V) logprobs of the row's next n generated tokens -> (n,) its draws: a
    seeded row's j-th with seeded_key(seed, num_sampled + j), the others' from the
    global state."""
    if row.seed is None:
        return row.sampler(logprobs)
    return mx.concatenate([row.sampler(logprobs[j : j + 1], key=seeded_key(row.seed, row.num_sampled + j))
                           for j in range(logprobs.shape[0])])


def sample_row(row: Row, logits: mx.array) -> Tuple[mx.array, mx.array]:
    """(1, V) logits of one row -> (1,) token and (1, V) logprobs, its processors applied."""
    logprobs = processed_logprobs(logits, row.history, mx.array([], mx.uint32), row.processors)
    token = draws(row, logprobs)
    row.num_sampled += 1
    return token, logprobs


def sample_rows(rows: Sequence[Row], logits: mx.array) -> Tuple[mx.array, mx.array]:
    """(B, V) logits -> (B,) tokens and (B, V) logprobs, each row its own way; rows that
    share a plain sampler draw in one call."""
    if len({id(r.sampler) for r in rows}) == 1 and all(not r.processors and r.seed is None for r in rows):
        logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
        return rows[0].sampler(logprobs), logprobs
    drawn = [sample_row(r, logits[i : i + 1]) for i, r in enumerate(rows)]
    return mx.concatenate([t for t, _ in drawn]), mx.concatenate([lp for _, lp in drawn])


def run_target(model: nn.Module, drafter: Any, tokens: mx.array,
               cache: List[Any]) -> Tuple[Optional[mx.array], mx.array]:
    """The target on (B, L) tokens -> (its final hidden states if the drafter needs
    them, else None; logits (B, L, V))."""
    if drafter is not None and drafter.needs_hidden:
        return model.hidden_and_logits(tokens, cache=cache)
    return None, model(tokens, cache=cache)


class RowTable:
    """The rows decoding together, in row order, and what they share: the batched
    caches (`num_target` target entries, then the device drafter's, if any), `tokens`
    (B,) each row's token to feed next, `logprobs` the law each was drawn from and
    `emit` whether it is a generated token (else the prompt's last, not reported).
    The drafter is caught up (fed what plain steps gave the target alone) before rows
    join, leave or are copied out, so every row's entries hold what a solo run's would."""

    def __init__(self, num_target: int, drafter: Any):
        self.num_target, self.drafter = num_target, drafter
        self.rows: List[Row] = []
        self.caches: Optional[List[Any]] = None
        self.tokens: Optional[mx.array] = None
        self.logprobs: List[Optional[mx.array]] = []
        self.emit: List[bool] = []

    def __len__(self) -> int:
        return len(self.rows)

    @property
    def target_caches(self) -> List[Any]:
        return self.caches[: self.num_target]

    @property
    def draft_caches(self) -> List[Any]:
        return self.caches[self.num_target :]

    def catch_up(self) -> None:
        if self.drafter is not None and self.caches is not None:
            self.drafter.catch_up(self.draft_caches)

    def join(self, joining: List[Row], speculating: bool) -> None:
        """Rows whose prompt is in their own caches (all but the last token, or all of
        it and a first token sampled alone) join at the end, between rounds."""
        self.catch_up()
        merged = merge_caches([r.cache for r in joining])
        self.caches = merged if self.caches is None else extend_caches(self.caches, merged)
        tokens = [r.first[0] if r.first else r.prompt for r in joining]
        if self.drafter is not None:
            self.drafter.join(joining, mx.concatenate(tokens))
        if speculating:  # (no rollback is pending between rounds)
            for entry in self.target_caches:
                entry.start_speculation()  # one verify a round
        if self.drafter is not None:  # a draft model steps up to K times a round
            window = self.drafter.rollback_window(max(r.num_draft_tokens for r in self.rows + joining))
            for entry in self.draft_caches:
                entry.start_speculation(window)
        self.tokens = mx.concatenate(([self.tokens] if self.tokens is not None else []) + tokens)
        self.logprobs += [r.first[1][0] if r.first else None for r in joining]
        self.emit += [r.first is not None for r in joining]
        for r in joining:
            r.cache, r.prompt, r.first, r.draft_pending = None, None, None, None  # the table holds them now
        self.rows += joining

    def drop(self, indices: Sequence[int]) -> None:
        """Rows `indices` leave (the drafter caught up first, by the caller)."""
        if not indices:
            return
        gone = set(indices)
        keep = [i for i in range(len(self.rows)) if i not in gone]
        self.rows = [self.rows[i] for i in keep]
        self.logprobs = [self.logprobs[i] for i in keep]
        self.emit = [self.emit[i] for i in keep]
        if self.drafter is not None:
            self.drafter.filter(keep)
        if keep:
            self.caches = filter_caches(self.caches, keep)
            self.tokens = mx.take(self.tokens, mx.array(keep, dtype=mx.int32))
        else:
            self.caches, self.tokens = None, None

    def extract(self, index: int) -> List[Any]:
        """A copy of row `index`'s caches as ordinary caches (after a catch_up)."""
        return extract_caches(self.caches, index)

    @property
    def nbytes(self) -> int:
        return sum(c.nbytes for c in self.caches or [])

    def clear(self) -> None:
        self.rows, self.caches, self.tokens, self.logprobs, self.emit = [], None, None, [], []
