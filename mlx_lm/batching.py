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
are replayed from the layers' records). Rows with logits processors speculate too: the
processors see, at each verified position, what plain decoding would show them. With a
drafter on the device, a round is queued (its drafts and verify computing) as soon as the previous
one is decided, before that one's tokens are returned, unless rows wait to join; a
removal or a cache copy between steps undoes the queued round first.

The parts: admission (here), the rows and their caches (batch_rows.py), the rounds
(batch_round.py) over the one acceptance rule (acceptance.py).

Greedy output of every sequence equals its solo run, whatever joins or leaves: rows do
not see each other (per-row masks hide other rows' padding), and a row's numbers differ
from a solo run only by the rounding of batched matrix products.
"""

import time
from collections import deque
from typing import Any, Deque, Dict, Iterable, List, Optional, Sequence, Tuple, Union

import mlx.core as mx
import mlx.nn as nn

from .acceptance import acceptance_rule
from .batch_drafters import MAX_LAG, BatchDraftModel, BatchMTPHead, BatchPromptLookup
from .batch_responses import BatchResponse, PromptProgress, Response
from .batch_round import Decision, QueuedRound, Rounds
from .batch_rows import GREEDY, Processor, Row, RowTable, Sampler, run_target, sample_row, sample_rows
from .draft_length import DRAFT_LENGTHS, BatchDraftLengthPolicy, LearnedBatchDraftLength
from .drafters import PromptLookup
from .feeding import DEFAULT_PREFILL_STEP_SIZE, check_can_speculate, generation_stream
from .generate_utils import BatchCounters, BatchCountersSnapshot, BatchStats, StatsWindow  # noqa: F401 (re-exported)
from .models.batch_cache import bookkeeping, make_room
from .models.cache import KVCache, RotatingKVCache, make_prompt_cache
from .models.checkpoints import PrefillChunks, maybe_snapshot, next_pair_hidden
from .sample_utils import CategoricalSampler, make_sampler
from .speculation_stats import SpeculationStats
from .stop_sequences import StopSequences
from .tokenizer_utils import TokenizerWrapper
from .utils import parameter_dtypes


class BatchGenerator:
    """Decodes many sequences at once (continuous batching; see the module docstring).

    `insert` queues prompts (token ids, optionally each with a cache already holding
    earlier tokens, its own max_tokens, sampler, logits processors and seed) and returns
    their uids; each `next()` does one step and returns (prompt progress, generated
    tokens); `remove` drops sequences at any stage. At most `completion_batch_size`
    sequences are admitted (prefilling or decoding) at once; the rest wait in order.
    `stop_tokens` end a sequence: token ids, or sequences of token ids (the stop
    sequences; the token completing one is reported, finish_reason "stop"); a row may
    bring its own (`stop_sequences`). Each finished sequence's last Response carries its
    caches and tokens (`return_prompt_caches=False`: only its tokens). At most
    `prefill_batch_size` prompts prefill at once; `max_kv_size` bounds the KV caches
    made for prompts inserted without one (rotating); `next` runs on `stream`
    (default: generation_stream).
    With `prompt_lookup`, a `draft_model` (recurrent ones too) or `mtp` (a model with
    a multi-token-prediction head), rows speculate (module docstring); with a draft
    model or MTP a cache list holds the target's entries, then the drafter's (given to
    `insert`, returned by `remove` and in responses). With
    `fixed_draft_length` every speculating row drafts its cap each round. A seeded
    row (a sampler from make_sampler) draws its t-th token with its own key
    (seeded_key(seed, t)): its tokens depend on nothing else, not the batch, the
    drafts or max_tokens, and the global mx.random state is left alone.

    Its parts: the admission scheduler here (waiting, prefilling, ready), the row
    table (batch_rows.RowTable: the rows decoding and their caches) and the rounds
    (batch_round.Rounds: queue, decide, settle or cancel, timing).
    """

    def __init__(
        self,
        model: nn.Module,
        *,
        max_tokens: int = 128,
        stop_tokens: Optional[Iterable[Union[int, Sequence[int]]]] = None,
        sampler: Optional[Sampler] = None,
        logits_processors: Optional[List[Processor]] = None,
        completion_batch_size: int = 32,
        prefill_batch_size: int = 8,
        prefill_step_size: int = DEFAULT_PREFILL_STEP_SIZE,
        max_kv_size: Optional[int] = None,
        stream: Optional[mx.Stream] = None,
        return_prompt_caches: bool = True,
        prompt_lookup: bool = False,
        num_draft_tokens: int = 3,
        max_ngram_size: int = 3,
        draft_model: Optional[nn.Module] = None,
        mtp: bool = False,
        fixed_draft_length: bool = False,
    ):
        for name, value in [("completion_batch_size", completion_batch_size), ("prefill_batch_size", prefill_batch_size)]:
            if value < 1:
                raise ValueError(f"{name} must be at least 1, got {value}")
        if max_kv_size is not None and max_kv_size < 1:
            raise ValueError(f"max_kv_size must be positive, got {max_kv_size}")
        if prefill_step_size < 1:
            raise ValueError(f"prefill_step_size must be positive, got {prefill_step_size}")
        self.model = model
        self.max_tokens = max_tokens
        self.stop_sequences = StopSequences(stop_tokens)
        self.sampler = sampler or make_sampler()
        self.logits_processors = list(logits_processors or [])
        self.completion_batch_size = completion_batch_size  # (upstream raises it to prefill_batch_size)
        self.prefill_batch_size = prefill_batch_size
        self.prefill_step_size = prefill_step_size
        self.max_kv_size = max_kv_size
        self.stream = stream or generation_stream
        self.return_prompt_caches = return_prompt_caches
        if prompt_lookup + (draft_model is not None) + mtp > 1:
            raise ValueError("give at most one of prompt_lookup=True, a draft_model and mtp=True")
        self.speculating = prompt_lookup or draft_model is not None or mtp
        if self.speculating:
            check_can_speculate(model, make_prompt_cache(model), "target model", "speculation in a batch")
            if num_draft_tokens < 1:
                raise ValueError(f"num_draft_tokens must be at least 1, got {num_draft_tokens}")
            PromptLookup(max_ngram_size)  # checks it
        if draft_model is not None:
            check_can_speculate(draft_model, make_prompt_cache(draft_model), "draft model", "a draft model in a batch")
        self.prompt_lookup, self.num_draft_tokens, self.max_ngram_size = prompt_lookup, num_draft_tokens, max_ngram_size
        # The drafter; a device one's entries follow the target's in each cache list.
        self._drafter: Union[None, BatchPromptLookup, BatchDraftModel, BatchMTPHead] = (
            BatchDraftModel(draft_model, model.args.vocab_size) if draft_model is not None
            else BatchMTPHead(model) if mtp else BatchPromptLookup(max_ngram_size) if prompt_lookup else None)
        # Adaptive: costs and acceptance shared with earlier generators of this pair.
        learned = None
        if self.speculating and not fixed_draft_length:
            models = [model] if draft_model is None else [model, draft_model]
            kind = "mtp" if mtp else "prompt lookup" if prompt_lookup else "draft model"
            setting = ("batch", kind, tuple(parameter_dtypes(m) for m in models))
            learned = DRAFT_LENGTHS.get(models, setting, LearnedBatchDraftLength)
        self._policy = BatchDraftLengthPolicy(adaptive=not fixed_draft_length, learned=learned)
        # Cache lists hold the target's entries, then (with a draft model or MTP) the drafter's.
        self._num_target = len(make_prompt_cache(model))
        self._num_draft = 0 if self._drafter is None else len(self._drafter.make_cache())
        self._table = RowTable(self._num_target, self._drafter)
        self._rounds = Rounds(model, self._table, self._policy)
        self._next_uid = 0
        self._queued: Deque[Row] = deque()  # inserted, not yet admitted
        self._prefilling: List[Row] = []  # admitted, prompt being fed
        self._ready: List[Row] = []  # all but the last prompt token fed
        self._stats = BatchCounters()  # what stats() reports, since
        self._created = BatchCountersSnapshot()

    # ------------------------------------------------------------------ admission

    def insert(
        self,
        prompts: Sequence[Sequence[int]],
        max_tokens: Union[None, int, Sequence[int]] = None,
        caches: Optional[Sequence[Optional[List[Any]]]] = None,
        all_tokens: Optional[Sequence[Sequence[int]]] = None,
        samplers: Optional[Sequence[Optional[Sampler]]] = None,
        logits_processors: Optional[Sequence[Optional[List[Processor]]]] = None,
        stop_sequences: Optional[Sequence[Optional[StopSequences]]] = None,
        *,
        seeds: Optional[Sequence[Optional[int]]] = None,
        num_draft_tokens: Optional[Sequence[Optional[int]]] = None,
    ) -> List[int]:
        """Queue `prompts` (lists of token ids); per prompt optionally max_tokens (-1: no
        limit), a cache holding earlier tokens (the prompt is then what follows them)
        and those tokens (`all_tokens`: logits processors and prompt lookup see them,
        then the prompt and what follows), a sampler, logits processors, its stop
        sequences (default: the generator's), a seed and, when speculating, a cap on
        drafts per round. Everything is checked before anything is queued. Returns the
        uids."""
        return self.insert_segments([[p] for p in prompts], max_tokens, caches, all_tokens, samplers,
                                    logits_processors, stop_sequences, seeds=seeds,
                                    num_draft_tokens=num_draft_tokens)

    def insert_segments(
        self,
        segments: Sequence[Sequence[Sequence[int]]],
        max_tokens: Union[None, int, Sequence[int]] = None,
        caches: Optional[Sequence[Optional[List[Any]]]] = None,
        all_tokens: Optional[Sequence[Sequence[int]]] = None,
        samplers: Optional[Sequence[Optional[Sampler]]] = None,
        logits_processors: Optional[Sequence[Optional[List[Processor]]]] = None,
        stop_sequences: Optional[Sequence[Optional[StopSequences]]] = None,
        *,
        seeds: Optional[Sequence[Optional[int]]] = None,
        num_draft_tokens: Optional[Sequence[Optional[int]]] = None,
    ) -> List[int]:
        """`insert` for prompts given as segments (lists of token-id lists): a prefill
        chunk never crosses the end of a segment, and the progress reported there says
        `end_of_segment` (a server keeps the cache of a shared prefix, e.g. a system
        prompt, at such a boundary)."""
        n = len(segments)
        per_prompt = {"max_tokens": max_tokens, "caches": caches, "all_tokens": all_tokens, "samplers": samplers,
                      "logits_processors": logits_processors, "stop_sequences": stop_sequences, "seeds": seeds,
                      "num_draft_tokens": num_draft_tokens}
        for name, values in per_prompt.items():
            if values is not None and not isinstance(values, int) and len(values) != n:
                raise ValueError(f"{name} has {len(values)} entries for {n} prompts")
        if isinstance(max_tokens, int) or max_tokens is None:
            max_tokens = [self.max_tokens if max_tokens is None else max_tokens] * n

        def pick(values, i):
            return None if values is None else values[i]

        rows = [self._row(segments[i], max_tokens[i], pick(caches, i), pick(all_tokens, i) or (), pick(samplers, i),
                          pick(logits_processors, i), pick(stop_sequences, i), pick(seeds, i),
                          self.num_draft_tokens if pick(num_draft_tokens, i) is None else num_draft_tokens[i])
                for i in range(n)]
        for r in rows:  # numbered once all are checked
            r.uid, self._next_uid = self._next_uid, self._next_uid + 1
        self._queued.extend(rows)
        return [r.uid for r in rows]

    def _row(self, segments, max_tokens, cache, all_tokens, sampler, processors, stop, seed,
             num_draft_tokens) -> Row:
        segments = [list(s) for s in segments if len(s)]
        prompt = [t for s in segments for t in s]
        tokens = mx.array(prompt, dtype=mx.uint32)
        if tokens.ndim != 1 or tokens.size == 0:
            raise ValueError(f"each prompt must be a non-empty list of token ids, got {prompt!r}")
        if max_tokens != -1 and max_tokens < 1:
            raise ValueError(f"max_tokens must be positive or -1 (no limit), got {max_tokens}")
        if num_draft_tokens < 1:
            raise ValueError(f"num_draft_tokens must be at least 1, got {num_draft_tokens}")
        sampler = sampler or self.sampler
        if seed is not None and sampler is not GREEDY and not isinstance(sampler, CategoricalSampler):
            raise ValueError(f"a seed needs a sampler from make_sampler, which draws with the row's own keys; "
                             f"got {sampler!r}")
        if cache is None:
            cache = self._fresh_target_cache() + (self._drafter.make_cache() if self._drafter else [])
        elif len(cache) != self._num_target + self._num_draft:
            whose = "MTP head" if isinstance(self._drafter, BatchMTPHead) else "draft model"
            draft = f", then the {whose}'s {self._num_draft}" if self._num_draft else ""
            raise ValueError(f"a cache of {len(cache)} entries does not fit: give the target's {self._num_target} "
                             f"entries{draft}")
        processors = self.logits_processors if processors is None else list(processors)
        seen = list(all_tokens) + prompt
        ends = [sum(len(s) for s in segments[: j + 1]) for j in range(len(segments))]
        # A resumed MTP row's first pair: its first token and the hidden state the cache kept (issue 33).
        resumed = next_pair_hidden(cache, self._num_target) if isinstance(self._drafter, BatchMTPHead) else None
        row = Row(-1, tokens, cache, max_tokens, sampler, processors,
                  None if sampler is GREEDY else seed, total=tokens.size,
                  history=mx.array(seen, dtype=mx.uint32) if processors else None, num_draft_tokens=num_draft_tokens,
                  tokens=seen, num_given=len(all_tokens), segment_ends=ends,
                  stop=(stop if stop is not None else self.stop_sequences).matcher(),
                  draft_pending=None if resumed is None else (tokens[None, :1], resumed[None]))
        row.acceptance = self._policy.new_row()
        row.speculation = SpeculationStats(acceptance_rule=acceptance_rule(sampler)) if self.speculating else None
        return row

    def _fresh_target_cache(self) -> List[Any]:
        """The target's entries for a prompt inserted without a cache: with max_kv_size
        its growing KV caches become windows of that size (without the sink tokens
        make_prompt_cache keeps, which a batch cannot hold: as upstream's batch)."""
        cache = make_prompt_cache(self.model)
        if self.max_kv_size is None:
            return cache
        return [RotatingKVCache(self.max_kv_size) if type(c) is KVCache else c for c in cache]

    def __len__(self) -> int:
        """Sequences not finished: queued, prefilling or decoding."""
        return len(self._queued) + len(self._prefilling) + len(self._ready) + len(self._table)

    def _admit(self) -> None:
        admitted = len(self._prefilling) + len(self._ready) + len(self._table)
        while self._queued and admitted < self.completion_batch_size and len(self._prefilling) < self.prefill_batch_size:
            self._prefilling.append(self._queued.popleft())
            admitted += 1

    def _prefill_some(self) -> List[PromptProgress]:
        """Prefill admitted prompts in generate_step's chunks (cut at segment ends)
        until about prefill_step_size tokens went in (always whole chunks, so caches
        equal solo)."""
        self._admit()
        progress, budget = [], self.prefill_step_size
        while self._prefilling and budget > 0:
            r = self._prefilling[0]
            fed = r.total - r.prompt.size
            segment_end = next(end for end in r.segment_ends if end > fed)
            n = min(PrefillChunks(r.cache, self.prefill_step_size).size(0, r.prompt.size - 1), segment_end - fed)
            if n > 0:
                self._prefill_chunk(r, r.prompt[: n + 1])
                r.prompt, r.num_in_cache, budget = r.prompt[n:], r.num_in_cache + n, budget - n
                self._stats.prompt_tokens += n
            if n > 0:
                progress.append(PromptProgress(r.uid, fed + n, r.total, end_of_segment=fed + n == segment_end))
            if r.prompt.size > 1:
                continue
            self._prefilling.pop(0)
            if any(c.empty() for c in r.cache[: self._num_target]):  # nothing to merge yet: its first token alone
                self._first_alone(r)
                progress.append(PromptProgress(r.uid, r.total, r.total, end_of_segment=True, end_of_prompt=True))
            else:
                progress.append(PromptProgress(r.uid, r.total - 1, r.total, prompt_cache=r.cache,
                                               end_of_segment=True, end_of_prompt=True))
            self._ready.append(r)
        return progress

    def _prefill_chunk(self, r: Row, tokens: mx.array) -> None:
        """Feed all of `tokens` but the last (one of generate_step's chunks) to the
        row's caches, the drafter's too. Unlike feeding.prefill it keeps MLX's buffer
        cache: the batch decoding meanwhile reuses those buffers."""
        self._rounds.untimed()
        hidden, _ = run_target(self.model, self._drafter, tokens[None, :-1], r.cache[: self._num_target])
        if self._drafter is not None:
            r.draft_pending = self._drafter.prefill(r.cache[self._num_target :], tokens, hidden, r.draft_pending)
        mx.eval([c.state for c in r.cache], r.draft_pending)
        maybe_snapshot(r.cache, tokens.size - 1, None if hidden is None else hidden[0, -1:])  # snapshots (issue 33)

    def _first_alone(self, r: Row) -> None:
        self._rounds.untimed()
        hidden, logits = run_target(self.model, self._drafter, r.prompt[None], r.cache[: self._num_target])
        r.num_in_cache += 1
        self._stats.prompt_tokens += 1
        r.first = sample_row(r, logits[:, -1, :])
        if self._drafter is not None:
            r.draft_pending = self._drafter.first_alone(r.cache[self._num_target :], r.prompt, hidden, r.first[0],
                                                        r.draft_pending)
        mx.async_eval(*r.first, r.draft_pending)

    def _join_ready(self) -> None:
        if not self._ready:
            return
        joining, self._ready = self._ready, []
        self._rounds.untimed()
        self._stats.prompt_tokens += sum(r.first is None for r in joining)  # last prompt tokens, fed next
        self._table.join(joining, self.speculating)

    # ------------------------------------------------------------------ one step

    def next(self) -> Tuple[List[PromptProgress], List[Response]]:
        """One step: prefill some waiting prompts, admit the ready ones, one batched
        forward; returns the prompt progress made and the tokens generated."""
        with mx.stream(self.stream):
            tic = time.perf_counter()
            progress = self._prefill_some()
            self._stats.prompt_time += time.perf_counter() - tic
            tic = time.perf_counter()
            responses = self._decode_step()
            self._stats.decode_time += time.perf_counter() - tic
        self._stats.generation_steps += bool(responses)
        return progress, responses

    def next_generated(self) -> List[Response]:
        """Steps until one generates tokens, or nothing is left (then []): the tokens."""
        while True:
            responses = self.next()[1]
            if responses or not len(self):
                return responses

    def _decode_step(self) -> List[Response]:
        rounds, table = self._rounds, self._table
        if rounds.queued is not None:
            queued, rounds.queued = rounds.queued, None
            return self._finish_round(queued)
        if self.speculating:
            rounds.time_last_round()
        top = time.perf_counter()
        self._join_ready()
        if not len(table):
            return []
        if self.speculating:
            chosen_plain, rounds.plain_next = rounds.plain_next == len(table), None
            rooms = [0] * len(table) if chosen_plain else rounds.rooms()
            if any(rooms):  # (else a plain step, pipelined as without speculation)
                # The drafter's catch-up feed is the plain steps' debt, not this round's
                # cost, so it is computed before the round's top: fed by a draft model's
                # first step, it made each probe after plain steps look dearer than it is
                # (at batch 8, 62.6 ms against 54.9 for a K = 3 round after another).
                caught_up = time.perf_counter()
                table.catch_up()
                mx.eval([c.state for c in table.draft_caches])
                top += time.perf_counter() - caught_up
                queued = rounds.queue_drafted(rooms, top)
                if queued is not None:
                    return self._finish_round(queued)
        return self._plain_step(top)

    def _plain_step(self, top: float) -> List[Response]:
        """Feed every row its token and sample the next, pipelined: the forward is
        queued before the last step's tokens are read."""
        table = self._table
        fed, fed_logprobs, emit = table.tokens, table.logprobs, table.emit
        for i, r in enumerate(table.rows):
            r.num_in_cache += 1
            if r.speculation is not None:
                r.speculation.add_round(0, 0)
            if r.history is not None and emit[i]:
                r.history = mx.concatenate([r.history, fed[i : i + 1]])
        make_room(table.target_caches, 1)
        hidden, logits = run_target(self.model, self._drafter, fed[:, None], table.target_caches)
        table.tokens, logprobs = sample_rows(table.rows, logits[:, -1, :])  # (B,), (B, V)
        if self._drafter is not None:  # it gets what it missed when it next drafts, or after MAX_LAG
            self._drafter.plain_step(fed, table.tokens, hidden)
            if len(self._drafter.lag) >= MAX_LAG:
                table.catch_up()
        mx.async_eval(table.tokens, logprobs, bookkeeping(table.caches))
        table.logprobs = [logprobs[i] for i in range(len(table))]
        table.emit = [True] * len(table)
        responses, finished = [], []
        fed = fed.tolist()  # the last round's tokens, while this one computes
        if self.speculating:
            self._rounds.plain_step_done(top)
        for i, (r, token) in enumerate(zip(table.rows, fed)):
            if emit[i] and self._emit_token(r, token, fed_logprobs[i], responses):
                finished.append(i)
        self._retire(finished, responses)
        return responses

    def _finish_round(self, queued: QueuedRound) -> List[Response]:
        """Decide a verified round: each row accepts drafts by its own rule, reports its
        tokens and forgets the rest; then the next round is queued."""
        table = self._table
        decisions = self._rounds.decide(queued)
        responses, finished, kept = [], [], []
        for i, (r, d) in enumerate(zip(table.rows, decisions)):
            self._stats.draft_tokens += len(d.drafts)
            self._stats.accepted_tokens += d.num_accepted
            if r.speculation is not None:
                r.speculation.add_round(len(d.drafts), d.num_accepted)
            row_kept, done = self._commit(i, r, queued.fed[i], d, responses)
            if done:
                finished.append(i)
            kept.append(row_kept)
            r.num_in_cache += row_kept
        self._rounds.settle(queued, decisions, kept)
        self._retire(finished, responses)
        self._rounds.queue_ahead(rows_waiting=bool(self._ready))
        return responses

    def _commit(self, i: int, r: Row, fed: int, decision: Decision, responses: List[Response]) -> Tuple[int, bool]:
        """Report row i's fed token (unless the prompt's) and accepted drafts, up to a
        stop; returns how many of this round's columns its cache keeps, and whether it
        finished."""
        accepted = decision.drafts[: decision.num_accepted]
        emit = self._table.emit[i]
        emitted = [(fed, self._table.logprobs[i])] if emit else []
        emitted += [(token, decision.logprobs[j]) for j, token in enumerate(accepted)]
        for j, (token, token_logprobs) in enumerate(emitted):
            if self._emit_token(r, token, token_logprobs, responses):
                return (j + 1 if emit else j + 2), True  # up to and with its last token
        return 1 + len(accepted), False

    def _emit_token(self, r: Row, token: int, logprobs: mx.array, responses: List[Response]) -> bool:
        """Report a generated token (already fed); True if it ends the sequence."""
        r.num_generated += 1
        r.tokens.append(token)
        self._stats.generation_tokens += 1
        reason = "stop" if r.stop.advance(token) else "length" if r.num_generated == r.max_tokens else None
        responses.append(Response(r.uid, token, logprobs, reason, speculation=r.speculation,
                                  all_tokens=r.tokens if reason else None))
        return reason is not None

    def _retire(self, rows: List[int], responses: List[Response]) -> None:
        """Finished rows leave the batch; their last responses carry their caches if asked."""
        if not rows:
            return
        self._table.catch_up()
        if self.return_prompt_caches:
            last = {r.uid: r for r in responses}
            for i in rows:
                last[self._table.rows[i].uid].prompt_cache = self._table.extract(i)
        self._rounds.untimed()  # the next forward also evaluates the filtered caches
        self._table.drop(rows)

    # ------------------------------------------------------------------ removal

    def remove(self, uids: Sequence[int],
               return_prompt_caches: bool = False) -> Dict[int, Tuple[List[Any], List[int]]]:
        """Drop sequences at whatever stage they are. With `return_prompt_caches`:
        uid -> (its caches, the tokens they hold: all_tokens, the prompt tokens fed,
        then the generated tokens), as extract_cache gives them."""
        removed = self.extract_cache(uids) if return_prompt_caches else {}
        wanted = set(uids)
        for stage in (self._queued, self._prefilling, self._ready):
            for r in [r for r in stage if r.uid in wanted]:
                stage.remove(r)
        rows = [i for i, r in enumerate(self._table.rows) if r.uid in wanted]
        if rows:
            self._rounds.cancel()
            self._table.catch_up()
            self._rounds.untimed()
            self._table.drop(rows)
        return removed

    def extract_cache(self, uids: Sequence[int]) -> Dict[int, Tuple[List[Any], List[int]]]:
        """uid -> (its caches, the tokens they hold) for sequences `uids` at any stage,
        which keep running: a decoding row's caches are a copy; a waiting one's are
        the ones it prefills."""
        wanted, found = set(uids), {}
        for r in [*self._queued, *self._prefilling, *self._ready]:
            if r.uid in wanted:
                found[r.uid] = (r.cache, r.held_tokens)
        rows = [i for i, r in enumerate(self._table.rows) if r.uid in wanted]
        if rows:
            self._rounds.cancel()
            self._table.catch_up()
        for i in rows:
            r = self._table.rows[i]
            found[r.uid] = (self._table.extract(i), r.held_tokens)
        return found

    @property
    def prompt_cache_nbytes(self) -> int:
        """Bytes of every cache the generator holds (waiting sequences' and the batch's)."""
        waiting = [c for r in [*self._queued, *self._prefilling, *self._ready] for c in r.cache]
        return sum(c.nbytes for c in waiting) + self._table.nbytes

    def stats(self) -> StatsWindow:
        """What the generator did since it was made (a generate_utils.BatchStats); as a
        context manager, a BatchStats of what it does inside the block (upstream's)."""
        return StatsWindow(self._created, self._stats)

    def close(self) -> None:
        self._queued.clear()
        self._prefilling, self._ready = [], []
        self._table.clear()
        self._rounds.close()
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
    logprobs: List[List[float]] = [[] for _ in uids]
    caches: List[Optional[List[Any]]] = [None] * len(uids)
    while len(generator):
        for r in generator.next_generated():
            i = order[r.uid]
            if r.finish_reason != "stop":
                tokens[i].append(r.token)
                if return_logprobs:  # (as upstream: the chosen token's)
                    logprobs[i].append(r.logprobs[r.token].item())
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
