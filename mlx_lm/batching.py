"""Continuous batching: many sequences decoded together by one model, each admitted and
retired while the others run (`BatchGenerator`, `batch_generate`).

How a sequence goes through (`BatchGenerator.next` does one step of each stage):
1. Waiting: its prompt is prefilled alone, into ordinary caches, in the same chunks as
   `generate_step` (so its cache is the one a solo run builds). A step prefills at most
   about `prefill_step_size` tokens across the waiting sequences, first come first
   served, so decoding never stalls for more than a chunk.
2. Ready: all but the last prompt token fed. It joins the batch at the next step: its
   caches are merged into the batched caches (`models/batch_cache.py`) and its last
   prompt token is fed with every other row's token, in one forward.
3. Active: each step feeds every row's latest token (B, 1) and samples the next per row
   (each row's own sampler, logits processors and seed). The forward of step t is
   queued before the tokens of step t - 1 are read, so the model computes while the
   caller handles them; a token is reported once it has been fed, so the cache of a
   finished row holds its prompt and every token it produced (as after generate_step).
4. Finished (a stop token or max_tokens) or removed: its row leaves the batch.

Speculation (`prompt_lookup=True`; or, on the device, batch_drafters.py: a `draft_model`
or the target's own MTP head (`mtp=True`), whose caches are batched beside the target's
and which draft every row greedily in K single-token steps): each row drafts from its
own prompt and output (at most its num_draft_tokens, and as many as the batch's
draft-length policy, draft_length.BatchDraftLengthPolicy, finds fastest: K = 0 is a plain
step, pipelined, which the drafter sits out), one forward verifies every row's
token and drafts (padded to the longest), each row accepts by its own rule (greedy:
the agreeing prefix of the argmax; sampling: the agreeing prefix of its own draws, which
for point-mass drafts is speculative sampling, so the law is the target's) and rolls
back its own rejected tokens (`trim_rows`: KV columns become holes, recurrent states
are replayed from the layers' records). Rows with logits processors decode plainly in
the same forward. With a drafter on the
device, a round is queued (its drafts and verify computing) as soon as the previous
one is decided, before that one's tokens are returned, unless rows wait to join; a
removal or a cache copy between steps undoes the queued round first.

Greedy output of every sequence equals its solo run, whatever joins or leaves: rows do
not see each other (per-row masks hide other rows' padding), and a row's numbers differ
from a solo run only by the rounding of batched matrix products.
"""

import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Callable, Deque, Dict, List, NamedTuple, Optional, Sequence, Set, Tuple, Union

import mlx.core as mx
import mlx.nn as nn

from .batch_drafters import MAX_LAG, BatchDraftModel, BatchMTPHead
from .draft_length import DRAFT_LENGTHS, AcceptanceEstimate, BatchDraftLengthPolicy, LearnedBatchDraftLength
from .drafters import DEFAULT_PREFILL_STEP_SIZE, PromptLookup
from .generate_utils import BatchCounters, BatchCountersSnapshot, BatchStats
from .models.batch_cache import (
    bookkeeping, extend_caches, extract_caches, filter_caches, make_room, merge_caches, trim_rows,
)
from .models.cache import make_prompt_cache
from .models.checkpoints import maybe_snapshot
from .sample_utils import CategoricalSampler, make_sampler
from .speculative import SpeculationStats
from .tokenizer_utils import TokenizerWrapper
from .utils import parameter_dtypes

Sampler = Callable[[mx.array], mx.array]
Processor = Callable[[mx.array, mx.array], mx.array]


@dataclass
class BatchResponse:
    """What `batch_generate` returns: one text per prompt (in order) and the stats;
    with the matching flags, each prompt's cache, generated token ids and logprobs."""

    texts: List[str]
    stats: BatchStats
    caches: Optional[List[List[Any]]] = None
    token_ids: Optional[List[List[int]]] = None
    logprobs: Optional[List[List[mx.array]]] = None


@dataclass
class PromptProgress:
    """A sequence's prefill advanced: `num_fed` of its `total` prompt tokens are in its
    cache. When all but the last are, `prompt_cache` is that cache, which the batch no
    longer touches (a server keeps it for prompts that extend this one)."""

    uid: int
    num_fed: int
    total: int
    prompt_cache: Optional[List[Any]] = None


@dataclass
class RowSpeculation(SpeculationStats):
    """A speculating sequence's SpeculationStats so far, counted a round at a time:
    every target forward it took part in (draft_lengths index k, 0: a plain step);
    its rounds' times are the batch's, known only once the next round begins."""

    last_draft_length: int = 0  # the k of its last round, which `add_seconds` times

    def add_round(self, num_drafted: int, num_accepted: int) -> None:
        self.num_drafted += num_drafted
        self.num_accepted += num_accepted
        self.num_target_forwards += 1
        self.draft_lengths += [0] * (num_drafted + 1 - len(self.draft_lengths))
        self.draft_lengths[num_drafted] += 1
        self.count_round(num_drafted, num_accepted, None)
        self.last_draft_length = num_drafted

    def add_seconds(self, seconds: float) -> None:
        """Its last round (the whole batch's) took `seconds`."""
        self.count_seconds(self.last_draft_length, seconds)


@dataclass
class Response:
    """One generated token of sequence `uid`; `logprobs` (V,) is the distribution it was
    sampled from. `finish_reason`: "stop" (a stop token, reported as the token), "length"
    (max_tokens reached) or None. `prompt_cache`: on the last response, when the generator
    returns caches, the sequence's caches (its prompt and every token it generated).
    `speculation`: a speculating sequence's counts so far."""

    uid: int
    token: int
    logprobs: mx.array
    finish_reason: Optional[str] = None
    prompt_cache: Optional[List[Any]] = None
    speculation: Optional[RowSpeculation] = None


class _QueuedRound(NamedTuple):
    """A drafting round computing, not yet decided (the arguments of _finish_round)."""

    fed: List[int]  # each row's token the round feeds first
    columns: mx.array  # (B, K + 1): those tokens, the drafts, padding
    logits: mx.array  # the verify's, lazy
    hidden: Optional[mx.array]  # the verify's final hidden states, for an MTP head
    read_drafts: Callable[[], List[List[int]]]  # each row's drafts, once computed
    top: float  # when it was queued


@dataclass
class _Sequence:
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
    num_generated: int = 0
    num_sampled: int = 0  # generated tokens drawn (the index of the next draw)
    first: Optional[Tuple[mx.array, mx.array]] = None  # (token, logprobs) sampled alone
    draft_pending: Any = None  # what its drafter keeps for it until it joins (an MTP head: a pair)
    lookup: Optional[PromptLookup] = None  # its drafter, when it speculates
    num_draft_tokens: int = 0  # its cap on drafts per round
    speculates: bool = False  # drafts and verifies (rows with processors decode plainly)
    speculation: Optional[RowSpeculation] = None  # its counts, when it speculates
    acceptance: AcceptanceEstimate = field(default_factory=AcceptanceEstimate)  # of its drafts (policy.new_row)


GREEDY = make_sampler()  # rows with this sampler speculate by token matching


def check_rollback(model: nn.Module, role: str = "speculation in a batch") -> None:
    """Speculating rows roll back every cache entry of the target and the draft:
    recurrent states only through their layers' records (`supports_speculative_rollback`)."""
    layers_record = getattr(type(model), "supports_speculative_rollback", False)
    entries = make_prompt_cache(model)
    blocked = sorted({type(c).__name__ for c in entries if c.needs_layer_records and not layers_record})
    if blocked:
        raise ValueError(f"{role} needs every cache of {type(model).__module__} to roll back, but "
                         f"{', '.join(blocked)} entries cannot: its layers do not record rollbacks")


def accepted_prefix(drafts: List[int], targets: List[int]) -> int:
    """How many leading drafts equal the targets."""
    n = 0
    while n < len(drafts) and drafts[n] == targets[n]:
        n += 1
    return n


def seeded_key(seed: int, index: int) -> mx.array:
    """The PRNG key a seeded row draws its index-th generated token with: a function
    of the seed and the index only, so the row's tokens do not depend on its batch,
    its drafts or how many tokens a round gave (and the global state is left alone)."""
    return mx.random.key((seed * 0x9E3779B97F4A7C15 + index * 0xBF58476D1CE4E5B9) % (1 << 64))


class BatchGenerator:
    """Decodes many sequences at once (continuous batching; see the module docstring).

    `insert` queues prompts (token ids, optionally each with a cache already holding
    earlier tokens, its own max_tokens, sampler, logits processors and seed) and returns
    their uids; each `next()` does one step and returns (prompt progress, generated
    tokens); `remove` drops sequences at any stage. At most `completion_batch_size`
    sequences are admitted (prefilling or decoding) at once; the rest wait in order.
    `stop_tokens` end a sequence (the stop token is reported, finish_reason "stop").
    With `return_prompt_caches`, each finished sequence's last Response carries its caches.
    With `prompt_lookup`, a `draft_model` (recurrent ones too) or `mtp` (a model with
    a multi-token-prediction head), rows speculate (module docstring); with a draft
    model or MTP a cache list holds the target's entries, then the drafter's (given to
    `insert`, returned by `remove` and in responses). With
    `fixed_draft_length` every speculating row drafts its cap each round. A seeded
    row (a sampler from make_sampler) draws its t-th token with its own key
    (seeded_key(seed, t)): its tokens depend on nothing else, not the batch, the
    drafts or max_tokens, and the global mx.random state is left alone.
    """

    def __init__(
        self,
        model: nn.Module,
        *,
        max_tokens: int = 128,
        stop_tokens: Optional[Set[int]] = None,
        sampler: Optional[Sampler] = None,
        logits_processors: Optional[List[Processor]] = None,
        completion_batch_size: int = 32,
        prefill_step_size: int = DEFAULT_PREFILL_STEP_SIZE,
        return_prompt_caches: bool = False,
        prompt_lookup: bool = False,
        num_draft_tokens: int = 3,
        max_ngram_size: int = 3,
        draft_model: Optional[nn.Module] = None,
        mtp: bool = False,
        fixed_draft_length: bool = False,
    ):
        if completion_batch_size < 1:
            raise ValueError(f"completion_batch_size must be at least 1, got {completion_batch_size}")
        if prefill_step_size < 1:
            raise ValueError(f"prefill_step_size must be positive, got {prefill_step_size}")
        self.model = model
        self.max_tokens = max_tokens
        self.stop_tokens = set(stop_tokens or ())
        self.sampler = sampler or make_sampler()
        self.logits_processors = list(logits_processors or [])
        self.completion_batch_size = completion_batch_size
        self.prefill_step_size = prefill_step_size
        self.return_prompt_caches = return_prompt_caches
        if prompt_lookup + (draft_model is not None) + mtp > 1:
            raise ValueError("give at most one of prompt_lookup=True, a draft_model and mtp=True")
        self.speculating = prompt_lookup or draft_model is not None or mtp
        if self.speculating:
            check_rollback(model)
            if num_draft_tokens < 1:
                raise ValueError(f"num_draft_tokens must be at least 1, got {num_draft_tokens}")
            PromptLookup(max_ngram_size)  # checks it
        if draft_model is not None:
            check_rollback(draft_model, "a draft model in a batch")
        self.prompt_lookup, self.num_draft_tokens, self.max_ngram_size = prompt_lookup, num_draft_tokens, max_ngram_size
        # A drafter on the device, whose entries follow the target's in each cache list.
        self._drafter: Union[None, BatchDraftModel, BatchMTPHead] = (
            BatchDraftModel(draft_model, model.args.vocab_size) if draft_model is not None
            else BatchMTPHead(model) if mtp else None)
        # Adaptive: costs and acceptance shared with earlier generators of this pair.
        learned = None
        if self.speculating and not fixed_draft_length:
            models = [model] if draft_model is None else [model, draft_model]
            kind = "mtp" if mtp else "prompt lookup" if prompt_lookup else "draft model"
            setting = ("batch", kind, tuple(parameter_dtypes(m) for m in models))
            learned = DRAFT_LENGTHS.get(models, setting, LearnedBatchDraftLength)
        self._policy = BatchDraftLengthPolicy(adaptive=not fixed_draft_length, learned=learned)
        self._last_round: Optional[Tuple[int, int, float]] = None  # the last step's (rows, K, top)
        self._round_timed = True  # nothing but the last round ran since it started
        self._pending: Optional[_QueuedRound] = None  # queued by the last step, decided by the next
        self._plain_next: Optional[int] = None  # rows of a batch whose next step was chosen plain
        # Cache lists hold the target's entries, then (with a draft model or MTP) the drafter's.
        self._num_target = len(make_prompt_cache(model))
        self._num_draft = 0 if self._drafter is None else len(self._drafter.make_cache())
        self._next_uid = 0
        self._queued: Deque[_Sequence] = deque()  # inserted, not yet admitted
        self._prefilling: List[_Sequence] = []  # admitted, prompt being fed
        self._ready: List[_Sequence] = []  # all but the last prompt token fed
        self._active: List[_Sequence] = []  # in the batch, in row order
        self._caches: Optional[List[Any]] = None  # the batched caches of _active
        self._tokens: Optional[mx.array] = None  # (B,) each row's token to feed next
        self._logprobs: List[Optional[mx.array]] = []  # the distribution of each
        self._emit: List[bool] = []  # whether that token is generated (else the prompt's last)
        self._stats = BatchCounters()  # what stats() reports, since
        self._created = BatchCountersSnapshot()

    # ------------------------------------------------------------------ admission

    def insert(
        self,
        prompts: Sequence[Sequence[int]],
        max_tokens: Union[None, int, Sequence[int]] = None,
        caches: Optional[Sequence[Optional[List[Any]]]] = None,
        *,
        cached_tokens: Optional[Sequence[Sequence[int]]] = None,
        samplers: Optional[Sequence[Optional[Sampler]]] = None,
        logits_processors: Optional[Sequence[Optional[List[Processor]]]] = None,
        seeds: Optional[Sequence[Optional[int]]] = None,
        num_draft_tokens: Optional[Sequence[Optional[int]]] = None,
    ) -> List[int]:
        """Queue `prompts` (lists of token ids); per prompt optionally a cache holding
        earlier tokens (the prompt is then what follows them) and those tokens
        (`cached_tokens`: logits processors and prompt lookup see them, then the prompt
        and what follows), max_tokens (-1: no limit), sampler, logits processors, seed
        and, when speculating, a cap on drafts per round. Everything is checked before
        anything is queued. Returns the uids."""
        n = len(prompts)
        per_prompt = {"max_tokens": max_tokens, "caches": caches, "samplers": samplers, "cached_tokens": cached_tokens,
                      "logits_processors": logits_processors, "seeds": seeds, "num_draft_tokens": num_draft_tokens}
        for name, values in per_prompt.items():
            if values is not None and not isinstance(values, int) and len(values) != n:
                raise ValueError(f"{name} has {len(values)} entries for {n} prompts")
        if isinstance(max_tokens, int) or max_tokens is None:
            max_tokens = [self.max_tokens if max_tokens is None else max_tokens] * n

        def pick(values, i):
            return None if values is None else values[i]

        def cap(i):
            value = pick(num_draft_tokens, i)
            return self.num_draft_tokens if value is None else value

        sequences = [self._sequence(prompts[i], max_tokens[i], pick(caches, i), pick(cached_tokens, i) or (),
                                    pick(samplers, i), pick(logits_processors, i), pick(seeds, i), cap(i))
                     for i in range(n)]
        self._queued.extend(sequences)
        return [s.uid for s in sequences]

    def _sequence(self, prompt, max_tokens, cache, cached_tokens, sampler, processors, seed,
                  num_draft_tokens) -> _Sequence:
        tokens = mx.array(list(prompt), dtype=mx.uint32)
        if tokens.ndim != 1 or tokens.size == 0:
            raise ValueError(f"each prompt must be a non-empty list of token ids, got {list(prompt)!r}")
        if max_tokens != -1 and max_tokens < 1:
            raise ValueError(f"max_tokens must be positive or -1 (no limit), got {max_tokens}")
        if num_draft_tokens < 1:
            raise ValueError(f"num_draft_tokens must be at least 1, got {num_draft_tokens}")
        sampler = sampler or self.sampler
        if seed is not None and sampler is not GREEDY and not isinstance(sampler, CategoricalSampler):
            raise ValueError(f"a seed needs a sampler from make_sampler, which draws with the row's own keys; "
                             f"got {sampler!r}")
        if cache is None:
            cache = make_prompt_cache(self.model) + (self._drafter.make_cache() if self._drafter else [])
        elif len(cache) != self._num_target + self._num_draft:
            whose = "MTP head" if isinstance(self._drafter, BatchMTPHead) else "draft model"
            draft = f", then the {whose}'s {self._num_draft}" if self._drafter else ""
            raise ValueError(f"a cache of {len(cache)} entries does not fit: give the target's {self._num_target} "
                             f"entries{draft}")
        processors = self.logits_processors if processors is None else list(processors)
        seen = list(cached_tokens) + list(prompt)
        sequence = _Sequence(self._next_uid, tokens, cache, max_tokens, sampler, processors,
                             None if sampler is GREEDY else seed,
                             total=tokens.size, history=mx.array(seen, dtype=mx.uint32) if processors else None,
                             num_draft_tokens=num_draft_tokens)
        sequence.speculates = self.speculating and not processors
        sequence.acceptance = self._policy.new_row()
        sequence.speculation = RowSpeculation() if sequence.speculates else None
        if self.prompt_lookup and not processors:
            sequence.lookup = PromptLookup(self.max_ngram_size, context=seen)
        self._next_uid += 1
        return sequence

    def __len__(self) -> int:
        """Sequences not finished: queued, prefilling or decoding."""
        return len(self._queued) + len(self._prefilling) + len(self._ready) + len(self._active)

    # ------------------------------------------------------------------ one step

    def next(self) -> Tuple[List[PromptProgress], List[Response]]:
        """One step: prefill some waiting prompts, admit the ready ones, one batched
        forward; returns the prompt progress made and the tokens generated."""
        tic = time.perf_counter()
        progress = self._prefill_some()
        self._stats.prompt_time += time.perf_counter() - tic
        tic = time.perf_counter()
        responses = self._decode_step()
        self._stats.decode_time += time.perf_counter() - tic
        self._stats.generation_steps += bool(responses)
        return progress, responses

    def next_generated(self) -> List[Response]:
        """One step; only the generated tokens."""
        return self.next()[1]

    def _admit(self) -> None:
        admitted = len(self._prefilling) + len(self._ready) + len(self._active)
        while self._queued and admitted < self.completion_batch_size:
            self._prefilling.append(self._queued.popleft())
            admitted += 1

    def _prefill_some(self) -> List[PromptProgress]:
        """Prefill admitted prompts in generate_step's chunks until about
        prefill_step_size tokens went in (always whole chunks, so caches equal solo)."""
        self._admit()
        progress, budget = [], self.prefill_step_size
        while self._prefilling and budget > 0:
            s = self._prefilling[0]
            n = min(self.prefill_step_size, s.prompt.size - 1)
            if n > 0:
                self._prefill_chunk(s, s.prompt[: n + 1])
                s.prompt, s.num_in_cache, budget = s.prompt[n:], s.num_in_cache + n, budget - n
                self._stats.prompt_tokens += n
            if s.prompt.size > 1:
                progress.append(PromptProgress(s.uid, s.total - s.prompt.size, s.total))
                continue
            self._prefilling.pop(0)
            if any(c.empty() for c in s.cache[: self._num_target]):  # nothing to merge yet: its first token alone
                self._first_alone(s)
            else:
                progress.append(PromptProgress(s.uid, s.total - 1, s.total, prompt_cache=s.cache))
            self._ready.append(s)
        return progress

    def _target(self, tokens: mx.array, cache: List[Any]) -> Tuple[Optional[mx.array], mx.array]:
        """The target on (B, L) tokens -> (its final hidden states if the drafter
        needs them, else None; logits (B, L, V))."""
        if self._drafter is not None and self._drafter.needs_hidden:
            return self.model.hidden_and_logits(tokens, cache=cache)
        return None, self.model(tokens, cache=cache)

    def _prefill_chunk(self, s: _Sequence, tokens: mx.array) -> None:
        """Feed all of `tokens` but the last (one of generate_step's chunks) to the
        sequence's caches, the drafter's too. Unlike drafters.prefill it keeps MLX's
        buffer cache: the batch decoding meanwhile reuses those buffers."""
        self._round_timed = False
        hidden, _ = self._target(tokens[None, :-1], s.cache[: self._num_target])
        if self._drafter is not None:
            s.draft_pending = self._drafter.prefill(s.cache[self._num_target :], tokens, hidden, s.draft_pending)
        mx.eval([c.state for c in s.cache], s.draft_pending)
        maybe_snapshot(s.cache, tokens.size - 1)  # a CheckpointedCache's snapshots (issue 33)

    def _first_alone(self, s: _Sequence) -> None:
        self._round_timed = False
        hidden, logits = self._target(s.prompt[None], s.cache[: self._num_target])
        s.num_in_cache += 1
        self._stats.prompt_tokens += 1
        s.first = self._sample_row(s, logits[:, -1, :])
        if self._drafter is not None:
            s.draft_pending = self._drafter.first_alone(s.cache[self._num_target :], s.prompt, hidden, s.first[0],
                                                        s.draft_pending)
        mx.async_eval(*s.first, s.draft_pending)

    def _join_ready(self) -> None:
        if not self._ready:
            return
        joining, self._ready, self._round_timed = self._ready, [], False
        self._catch_up()
        merged = merge_caches([s.cache for s in joining])
        self._caches = merged if self._caches is None else extend_caches(self._caches, merged)
        tokens = [s.first[0] if s.first else s.prompt for s in joining]
        if self._drafter is not None:
            self._drafter.join([s.draft_pending for s in joining], mx.concatenate(tokens))
        if self.speculating:  # (a join comes between rounds: no rollback is pending)
            for entry in self._caches[: self._num_target]:
                entry.start_speculation()  # one verify a round
        if self._drafter is not None:  # a draft model steps up to K times a round
            window = self._drafter.rollback_window(max(s.num_draft_tokens for s in self._active + joining))
            for entry in self._caches[self._num_target :]:
                entry.start_speculation(window)
        self._tokens = mx.concatenate(([self._tokens] if self._tokens is not None else []) + tokens)
        self._logprobs += [s.first[1][0] if s.first else None for s in joining]
        self._emit += [s.first is not None for s in joining]
        self._stats.prompt_tokens += sum(s.first is None for s in joining)  # last prompt tokens, fed below
        for s in joining:
            s.cache, s.prompt, s.first, s.draft_pending = None, None, None, None  # the batch holds them now
        self._active += joining

    def _decode_step(self) -> List[Response]:
        if self._pending is not None:
            pending, self._pending = self._pending, None
            return self._finish_round(*pending)
        if self.speculating:
            self._time_last_round()
        top = time.perf_counter()
        self._join_ready()
        if not self._active:
            return []
        committed = False  # whether the lookups have this step's tokens
        if self.speculating:
            chosen_plain, self._plain_next = self._plain_next == len(self._active), None
            rooms = [0] * len(self._active) if chosen_plain else self._rooms()
            if any(rooms):  # (else a plain step, pipelined as without speculation)
                fed = self._tokens.tolist()  # drafting needs each row's token now (the last round is done)
                if self._drafter is not None:  # (every row with room drafts)
                    columns, read_drafts = self._drafter.draft(self._caches[self._num_target :], fed, rooms)
                    return self._speculative_step(fed, columns, read_drafts, top)
                drafts = self._drafts(fed, rooms)
                if any(drafts):
                    columns = [[t] + d + [t] * (max(map(len, drafts)) - len(d)) for t, d in zip(fed, drafts)]
                    return self._speculative_step(fed, mx.array(columns, dtype=mx.uint32), lambda: drafts, top)
                committed = True
        fed, fed_logprobs, emit = self._tokens, self._logprobs, self._emit
        for i, s in enumerate(self._active):
            s.num_in_cache += 1
            if s.speculation is not None:
                s.speculation.add_round(0, 0)
            if s.history is not None and emit[i]:
                s.history = mx.concatenate([s.history, fed[i : i + 1]])
        make_room(self._caches[: self._num_target], 1)
        hidden, logits = self._target(fed[:, None], self._caches[: self._num_target])
        self._tokens, logprobs = self._sample(logits[:, -1, :])  # (B,), (B, V)
        if self._drafter is not None:  # it gets what it missed when it next drafts, or after MAX_LAG
            self._drafter.plain_step(fed, self._tokens, hidden)
            if len(self._drafter.lag) >= MAX_LAG:
                self._catch_up()
        mx.async_eval(self._tokens, logprobs, bookkeeping(self._caches))
        self._logprobs = [logprobs[i] for i in range(len(self._active))]
        self._emit = [True] * len(self._active)
        responses, finished = [], []
        fed = fed.tolist()  # the last round's tokens, while this one computes
        if self.speculating:
            self._policy.update(0, 0, False)
            self._last_round = (len(self._active), 0, top)
        for i, (s, token) in enumerate(zip(self._active, fed)):
            if s.lookup is not None and emit[i] and not committed:
                s.lookup.extend([token])
            if emit[i] and self._emit_token(s, token, fed_logprobs[i], responses):
                finished.append(i)
        self._retire(finished, responses)
        return responses

    def _emit_token(self, s: _Sequence, token: int, logprobs: mx.array, responses: List[Response]) -> bool:
        """Report a generated token (already fed); True if it ends the sequence."""
        s.num_generated += 1
        self._stats.generation_tokens += 1
        reason = "stop" if token in self.stop_tokens else "length" if s.num_generated == s.max_tokens else None
        responses.append(Response(s.uid, token, logprobs, reason, speculation=s.speculation))
        return reason is not None

    def _retire(self, rows: List[int], responses: List[Response]) -> None:
        """Finished rows leave the batch; their last responses carry their caches if asked."""
        if rows:
            self._catch_up()
        if self.return_prompt_caches:
            last = {r.uid: r for r in responses}
            for i in rows:
                last[self._active[i].uid].prompt_cache = extract_caches(self._caches, i)
        self._drop_rows(rows)

    # ------------------------------------------------------------------ speculation

    def _drafts(self, fed: List[int], rooms: List[int]) -> List[List[int]]:
        """Each speculating row commits its token about to be fed and looks up drafts
        (at most its room)."""
        drafts = []
        for i, (s, room) in enumerate(zip(self._active, rooms)):
            if not s.speculates:
                drafts.append([])
                continue
            if self._emit[i]:
                s.lookup.extend([fed[i]])
            drafts.append(s.lookup.lookup(room) if room > 0 else [])
        return drafts

    def _rooms(self) -> List[int]:
        """How many drafts each row may verify this round: the batch policy's K
        (all of its cap with fixed_draft_length) within its cap; 0 if it does not
        speculate. Which rounds draft how much never changes what a row emits."""
        caps = []
        for i, s in enumerate(self._active):
            cap = s.num_draft_tokens if s.speculates else 0
            if s.max_tokens != -1:
                cap = min(cap, s.max_tokens - s.num_generated - self._emit[i])
            caps.append(max(cap, 0))
        following = [(s.acceptance.value, cap) for s, cap in zip(self._active, caps) if cap]
        k = self._policy.choose(len(self._active), following)
        return [min(cap, k) for cap in caps]

    def _time_last_round(self) -> None:
        """The policy learns the last step's seconds, from its top to this one's, if
        nothing else ran meanwhile (a prefill, rows joining or leaving). Every round is
        timed alike: a plain step's interval holds one forward (pipelined, MLX may
        compute most of it inside async_eval) and the host work beside it; a drafting
        round's, its forwards, its syncs and the host work after them (the caller's
        too), which nothing overlaps."""
        if self._last_round is not None and self._round_timed:
            num_rows, k, top = self._last_round
            seconds = time.perf_counter() - top
            self._policy.learn_cost(num_rows, k, seconds)
            for s in self._active:  # the rows of that round (none joined or left since)
                if s.speculation is not None:
                    s.speculation.add_seconds(seconds)
        self._last_round, self._round_timed = None, True

    def _catch_up(self) -> None:
        """The drafter is fed what plain steps gave the target alone: before rows join
        or leave, and before the drafter drafts."""
        if self._drafter is not None and self._caches is not None:
            self._drafter.catch_up(self._caches[self._num_target :])

    def _speculative_step(self, fed: List[int], columns: mx.array, read_drafts: Callable[[], List[List[int]]],
                          top: float) -> List[Response]:
        """Feed every row its token and drafts (`columns`, (B, K + 1), padded to the
        longest) in one forward; each row accepts drafts by its own rule (_decide) and
        forgets the rest."""
        return self._finish_round(fed, columns, *self._queue_verify(columns), read_drafts, top)

    def _queue_verify(self, columns: mx.array) -> Tuple[mx.array, Optional[mx.array]]:
        make_room(self._caches[: self._num_target], columns.shape[1])
        hidden, logits = self._target(columns, self._caches[: self._num_target])  # (B, K+1, V)
        mx.async_eval(logits)
        return logits, hidden

    def _queue_next_round(self) -> None:
        """With a draft model or MTP, queue the next round's drafts and verify as soon
        as this one is decided, so they compute while its tokens are handed out (as the
        single-sequence loop does); the next step decides it. Not while rows wait to
        join (they join between rounds). A plain choice is kept for the next step."""
        if self._drafter is None or not self._active or self._ready:
            return
        self._time_last_round()
        top = time.perf_counter()
        rooms = self._rooms()
        if not any(rooms):
            self._plain_next = len(self._active)
            return
        fed = self._tokens.tolist()
        columns, read_drafts = self._drafter.draft(self._caches[self._num_target :], fed, rooms)
        self._pending = _QueuedRound(fed, columns, *self._queue_verify(columns), read_drafts, top)

    def _cancel_pending(self) -> None:
        """Undo a queued round before the batch changes from outside (remove,
        extract_cache): its verify and draft feeds trimmed from every row; the next
        step drafts afresh."""
        if self._pending is None:
            return
        num_columns, self._pending = self._pending.columns.shape[1], None
        trim_rows(self._caches[: self._num_target], [num_columns] * len(self._active))
        self._drafter.cancel(self._caches[self._num_target :])
        self._round_timed = False

    def _finish_round(self, fed: List[int], columns: mx.array, logits: mx.array, hidden: Optional[mx.array],
                      read_drafts: Callable[[], List[List[int]]], top: float) -> List[Response]:
        """Decide a verified round: each row accepts drafts by its own rule (_decide),
        reports its tokens and forgets the rest; then the next round is queued."""
        num_columns = columns.shape[1]
        logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
        greedy = mx.argmax(logprobs, axis=-1).tolist()  # (B, K + 1): the greedy rows' targets
        drafts = read_drafts()
        responses, finished, trims, tokens, next_logprobs, accepted = [], [], [], [], [], []
        all_accepted, round_accepted = True, 0
        for i, s in enumerate(self._active):
            num_accepted, token, token_logprobs = self._decide(i, s, drafts[i], logits, logprobs, greedy[i])
            self._stats.draft_tokens += len(drafts[i])
            self._stats.accepted_tokens += num_accepted
            if s.speculation is not None:
                s.speculation.add_round(len(drafts[i]), num_accepted)
            if drafts[i]:
                self._policy.learn_row(s.acceptance, len(drafts[i]), num_accepted)
                all_accepted = all_accepted and num_accepted == len(drafts[i])
                round_accepted += num_accepted
            tokens.append(token)
            next_logprobs.append(token_logprobs)
            accepted.append(num_accepted)
            kept, done = self._commit(i, s, fed[i], drafts[i][:num_accepted], logprobs, responses)
            if done:
                finished.append(i)
            if s.lookup is not None:
                s.lookup.extend(drafts[i][:num_accepted])
            trims.append(num_columns - kept)
            s.num_in_cache += kept
        trim_rows(self._caches[: self._num_target], trims)
        self._tokens = mx.concatenate(tokens)
        if self._drafter is not None:
            self._drafter.settle(self._caches[self._num_target :], columns, accepted,
                                 [num_columns - t for t in trims], self._tokens, hidden)
        # The rollback (recurrent rows replay their kept prefix) computes while the
        # tokens are handed out; rounds are timed top to top, so it is this round's cost.
        mx.async_eval([c.state for c in self._caches], bookkeeping(self._caches))
        self._logprobs, self._emit = next_logprobs, [True] * len(self._active)
        # Its outcome learned now, so the next choice knows it; its time at the next top.
        self._policy.update(num_columns - 1, round_accepted, all_accepted)
        self._last_round = (len(self._active), num_columns - 1, top)
        self._retire(finished, responses)
        self._queue_next_round()
        return responses

    def _decide(self, i: int, s: _Sequence, drafts: List[int], logits: mx.array, logprobs: mx.array,
                greedy: List[int]) -> Tuple[int, mx.array, mx.array]:
        """Row i's accepted drafts, the token after them (1,) and its logprobs (V,):
        greedy rows keep the drafts the argmax agrees with, sampling rows those their
        own draws agree with; rows with processors do not speculate (a plain step)."""
        if not s.speculates:
            if s.history is not None and self._emit[i]:
                s.history = mx.concatenate([s.history, self._tokens[i : i + 1]])
            token, token_logprobs = self._sample_row(s, logits[i : i + 1, 0])
            return 0, token, token_logprobs[0]
        if s.sampler is GREEDY:
            num_accepted = accepted_prefix(drafts, greedy)
            return num_accepted, mx.array([greedy[num_accepted]], dtype=mx.uint32), logprobs[i, num_accepted]
        # The row's own draw at each position (k + 1 of them), its drafts accepted while
        # they equal them. For a point-mass draft x this is speculative sampling: x is
        # accepted with probability p(x), else the token is a draw from p without x,
        # norm(max(0, p - q)); and the row's tokens are its draws, whatever it drafted.
        targets = self._draws(s, logprobs[i, : len(drafts) + 1]).tolist()
        num_accepted = accepted_prefix(drafts, targets)
        s.num_sampled += num_accepted + 1
        return num_accepted, mx.array([targets[num_accepted]], dtype=mx.uint32), logprobs[i, num_accepted]

    def _commit(self, i: int, s: _Sequence, fed: int, accepted: List[int], logprobs: mx.array,
                responses: List[Response]) -> Tuple[int, bool]:
        """Report row i's fed token (unless the prompt's) and accepted drafts, up to a
        stop; returns how many of this round's columns its cache keeps, and whether it
        finished."""
        emitted = [(fed, self._logprobs[i])] if self._emit[i] else []
        emitted += [(token, logprobs[i, j]) for j, token in enumerate(accepted)]
        for j, (token, token_logprobs) in enumerate(emitted):
            if self._emit_token(s, token, token_logprobs, responses):
                return (j + 1 if self._emit[i] else j + 2), True  # up to and with its last token
        return 1 + len(accepted), False

    def _drop_rows(self, rows: List[int]) -> None:
        if not rows:
            return
        self._round_timed = False  # the next forward also evaluates the filtered caches
        keep = [i for i in range(len(self._active)) if i not in set(rows)]
        self._active = [self._active[i] for i in keep]
        self._logprobs = [self._logprobs[i] for i in keep]
        self._emit = [self._emit[i] for i in keep]
        if self._drafter is not None:
            self._drafter.filter(keep)
        if keep:
            self._caches = filter_caches(self._caches, keep)
            self._tokens = mx.take(self._tokens, mx.array(keep, dtype=mx.int32))
        else:
            self._caches, self._tokens = None, None

    # ------------------------------------------------------------------ sampling

    def _sample(self, logits: mx.array) -> Tuple[mx.array, mx.array]:
        """(B, V) logits -> (B,) tokens and (B, V) logprobs, each row its own way; rows
        that share a plain sampler draw in one call."""
        rows = self._active
        if len({id(s.sampler) for s in rows}) == 1 and all(not s.processors and s.seed is None for s in rows):
            logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
            return rows[0].sampler(logprobs), logprobs
        drawn = [self._sample_row(s, logits[i : i + 1]) for i, s in enumerate(rows)]
        return mx.concatenate([t for t, _ in drawn]), mx.concatenate([lp for _, lp in drawn])

    @classmethod
    def _sample_row(cls, s: _Sequence, logits: mx.array) -> Tuple[mx.array, mx.array]:
        """(1, V) logits of one row -> (1,) token and (1, V) logprobs."""
        for processor in s.processors:
            logits = processor(s.history, logits)
        logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
        token = cls._draws(s, logprobs)
        s.num_sampled += 1
        return token, logprobs

    @staticmethod
    def _draws(s: _Sequence, logprobs: mx.array) -> mx.array:
        """(n, V) logprobs of the row's next n generated tokens -> (n,) its draws: a
        seeded row's j-th with seeded_key(seed, num_sampled + j), the others' from
        the global state."""
        if s.seed is None:
            return s.sampler(logprobs)
        return mx.concatenate([s.sampler(logprobs[j : j + 1], key=seeded_key(s.seed, s.num_sampled + j))
                               for j in range(logprobs.shape[0])])

    # ------------------------------------------------------------------ removal

    def remove(self, uids: Sequence[int], return_prompt_caches: bool = False) -> Dict[int, Tuple[List[Any], int]]:
        """Drop sequences at whatever stage they are. With `return_prompt_caches`:
        uid -> (its caches, how many of the tokens it was given they hold: prompt
        tokens fed, then generated tokens)."""
        wanted, removed = set(uids), {}
        for stage in (self._queued, self._prefilling, self._ready):
            for s in [s for s in stage if s.uid in wanted]:
                stage.remove(s)
                removed[s.uid] = (s.cache, s.num_in_cache)
        rows = [i for i, s in enumerate(self._active) if s.uid in wanted]
        if rows:
            self._cancel_pending()
            self._catch_up()
        for i in rows:
            s = self._active[i]
            removed[s.uid] = (extract_caches(self._caches, i) if return_prompt_caches else None, s.num_in_cache)
        self._drop_rows(rows)
        return removed if return_prompt_caches else {}

    def extract_cache(self, uids: Sequence[int]) -> Dict[int, List[Any]]:
        """Copies of the caches of active sequences `uids`, which keep running."""
        rows = {s.uid: i for i, s in enumerate(self._active)}
        self._cancel_pending()
        self._catch_up()
        return {uid: extract_caches(self._caches, rows[uid]) for uid in uids if uid in rows}

    def stats(self) -> BatchStats:
        """What the generator did since it was made (generate_utils.BatchStats)."""
        return BatchCountersSnapshot.between(self._created, BatchCountersSnapshot(**vars(self._stats)))

    def close(self) -> None:
        self._queued.clear()
        self._prefilling, self._ready, self._active = [], [], []
        self._caches, self._tokens, self._logprobs, self._emit = None, None, [], []
        self._last_round, self._pending, self._plain_next = None, None, None
        if self._drafter is not None:
            self._drafter.close()


def batch_generate(
    model: nn.Module,
    tokenizer,
    prompts: Sequence[Union[str, Sequence[int]]],
    prompt_caches: Optional[Sequence[Optional[List[Any]]]] = None,
    max_tokens: Union[int, Sequence[int]] = 128,
    verbose: bool = False,
    return_prompt_caches: bool = False,
    return_token_ids: bool = False,
    return_logprobs: bool = False,
    **kwargs,
) -> BatchResponse:
    """Generate for every prompt (token ids, or text encoded with the tokenizer) at once;
    the texts come back in prompt order, without the EOS token. kwargs go to
    BatchGenerator (sampler, logits_processors, completion_batch_size, ...)."""
    if not isinstance(tokenizer, TokenizerWrapper):
        tokenizer = TokenizerWrapper(tokenizer)
    token_prompts = [tokenizer.encode(p) if isinstance(p, str) else list(p) for p in prompts]
    generator = BatchGenerator(model, stop_tokens=tokenizer.eos_token_ids, return_prompt_caches=return_prompt_caches,
                               **kwargs)
    uids = generator.insert(token_prompts, max_tokens, caches=prompt_caches)
    order = {uid: i for i, uid in enumerate(uids)}
    tokens: List[List[int]] = [[] for _ in uids]
    logprobs: List[List[mx.array]] = [[] for _ in uids]
    caches: List[Optional[List[Any]]] = [None] * len(uids)
    while len(generator):
        for r in generator.next_generated():
            i = order[r.uid]
            if r.finish_reason != "stop":
                tokens[i].append(r.token)
                if return_logprobs:
                    logprobs[i].append(r.logprobs)
            if r.finish_reason is not None:
                caches[i] = r.prompt_cache
                if verbose:
                    print(f"[{i}] {tokenizer.decode(tokens[i])!r}", flush=True)
    stats = generator.stats()
    if verbose:
        print(f"Prompt: {stats.prompt_tokens} tokens, {stats.prompt_tps:.3f} tokens-per-sec")
        print(f"Generation: {stats.generation_tokens} tokens, {stats.generation_tps:.3f} tokens-per-sec")
        print(f"Peak memory: {stats.peak_memory:.3f} GB")
    return BatchResponse(
        texts=[tokenizer.decode(t) for t in tokens],
        stats=stats,
        caches=caches if return_prompt_caches else None,
        token_ids=tokens if return_token_ids else None,
        logprobs=logprobs if return_logprobs else None,
    )
