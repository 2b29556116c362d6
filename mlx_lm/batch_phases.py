"""Upstream 0.32.2's two phases of a batch as public classes of `mlx_lm.generate`:
`PromptProcessingBatch` feeds the prompts of several sequences together (right padded
to one length, in chunks of `prefill_step_size`) and `generate()` turns it into a
`GenerationBatch`, which feeds every row its latest token and samples the next, each
row with its own sampler, logits processors, stop sequences and max_tokens.

They sit on this project's batched caches (models/batch_cache.py: `merge_caches`,
`extend_caches`, in-place `filter`, `extract`), whose rows each keep a (B,) offset, so
rows of different lengths share a forward. `BatchGenerator` (batching.py) is this
project's batch API; these classes serve code written for upstream's.

Where this differs from upstream: recurrent caches take no right padding
(ArraysCache.__init__ says why), so prompts of different lengths on a model with
recurrent layers raise a ValueError naming the layer (prompt rows of one length
together instead); every per-row argument is checked against the number of uids; and
the token lists given are copied, not appended to.
"""

from dataclasses import dataclass
from typing import Any, List, Optional, Sequence

import mlx.core as mx
import mlx.nn as nn

from .feeding import DEFAULT_PREFILL_STEP_SIZE, processed_logprobs
from .models.batch_cache import bookkeeping, extend_caches, extract_caches, make_room, merge_caches
from .models.cache import TokenBuffer
from .sample_utils import LogitsProcessor, Sampler, greedy_sampler
from .stop_sequences import StopSequences

# Upstream's generate.DEFAULT_MAX_TOKENS, the default of both classes' max_tokens (the
# same value as generate.py's CLI default, which imports this module).
DEFAULT_MAX_TOKENS = 100


def _per_row(values: Optional[Sequence], name: str, num_rows: int, default) -> list:
    """One entry per row: `values` copied, or `default()` for each row when none are
    given (None, or an empty list as upstream's callers pass)."""
    if values is None or (len(values) == 0 and num_rows):
        return [default() for _ in range(num_rows)]
    if len(values) != num_rows:
        raise ValueError(f"{name} holds {len(values)} entries for a batch of {num_rows} uids; give one per uid")
    return list(values)


def _checked_max_tokens(max_tokens: Optional[Sequence[int]], num_rows: int) -> List[int]:
    limits = _per_row(max_tokens, "max_tokens", num_rows, lambda: DEFAULT_MAX_TOKENS)
    bad = [m for m in limits if not isinstance(m, int) or m < 1]
    if bad:
        raise ValueError(f"max_tokens must be whole numbers >= 1 (a row's token budget), got {bad}")
    return limits


def _joined(caches: List[Any], more: List[Any]) -> List[Any]:
    """Batched caches followed by more rows' (either may be an empty batch: [])."""
    if not caches:
        return more
    if not more:
        return caches
    return extend_caches(caches, more)


def _kept(caches: List[Any], keep: List[int]) -> List[Any]:
    """Only rows `keep` of batched caches (in place; no rows: [], as upstream's)."""
    if not keep:
        return []
    for entry in caches:
        entry.filter(keep)
    return caches


def _checked_rows(indices: Sequence[int], num_rows: int) -> List[int]:
    rows = [int(i) for i in indices]
    bad = [i for i in rows if not 0 <= i < num_rows]
    if bad or len(set(rows)) != len(rows):
        raise IndexError(f"rows {rows} are not distinct rows of a batch of {num_rows}")
    return rows


def _right_padded(prompts: List[List[int]], width: int) -> mx.array:
    """(B, width) token ids, each prompt followed by zeros (the padding)."""
    return mx.array([p + [0] * (width - len(p)) for p in prompts])


def _prepare_padding(caches: List[Any], lengths: List[int], padding: List[int]) -> None:
    for layer, entry in enumerate(caches):
        try:
            entry.prepare(lengths=lengths, right_padding=padding)
        except ValueError as e:
            # (a prepared layer cannot be unprepared: its batch is then spent)
            spent = "; the layers before it were prepared, so build the batch again" if layer else ""
            raise ValueError(
                f"layer {layer}'s {type(entry).__name__} cannot take prompts of different lengths "
                f"{lengths} (right padding {padding}): {e}; prompt rows of one length together{spent}"
            ) from e


def _feed(model: nn.Module, tokens: mx.array, caches: List[Any], step_size: int) -> None:
    """All (B, L) tokens through the model in chunks of step_size positions."""
    for start in range(0, tokens.shape[1], step_size):
        chunk = tokens[:, start : start + step_size]
        make_room(caches, chunk.shape[1])
        model(chunk, cache=caches)
        mx.eval([c.state for c in caches])
        mx.clear_cache()


class _Rows:
    """What both phases hold row by row, kept in step by `extend` and `filter`: the
    names in `_per_row` are lists with one entry per uid."""

    _per_row = ("uids", "tokens", "samplers", "logits_processors", "stop_sequences", "max_tokens")

    def __len__(self) -> int:
        return len(self.uids)

    def extract_cache(self, idx: int) -> List[Any]:
        """Row idx's caches, copied out as ordinary (unbatched) caches."""
        return extract_caches(self.prompt_cache, _checked_rows([idx], len(self))[0])

    def extend(self, batch: "_Rows") -> None:
        """Batch's rows after these (batch is left as it was, sharing them)."""
        if type(batch) is not type(self):
            raise ValueError(f"a {type(self).__name__} cannot be extended by a {type(batch).__name__}")
        self.prompt_cache = _joined(self.prompt_cache, batch.prompt_cache)
        for name in self._per_row:
            getattr(self, name).extend(getattr(batch, name))

    def filter(self, keep: Sequence[int]) -> None:
        """Only rows `keep` stay, in that order."""
        keep = _checked_rows(keep, len(self))
        self.prompt_cache = _kept(self.prompt_cache, keep)
        for name in self._per_row:
            values = getattr(self, name)
            setattr(self, name, [values[i] for i in keep])


class PromptProcessingBatch(_Rows):
    """Prompts of several sequences fed together into batched caches; `generate()`
    starts their generation. `tokens[b]` are the tokens row b's caches hold."""

    @dataclass
    class Response:
        """Upstream's report of a row's prompt progress (BatchGenerator's own is
        batch_responses.PromptProgress)."""

        uid: int
        progress: tuple
        end_of_segment: bool
        end_of_prompt: bool

    def __init__(
        self,
        model: nn.Module,
        uids: List[int],
        caches: List[List[Any]],
        tokens: Optional[List[List[int]]] = None,
        prefill_step_size: int = DEFAULT_PREFILL_STEP_SIZE,
        samplers: Optional[List[Optional[Sampler]]] = None,
        fallback_sampler: Optional[Sampler] = None,
        logits_processors: Optional[List[List[LogitsProcessor]]] = None,
        stop_sequences: Optional[List[StopSequences]] = None,
        max_tokens: Optional[List[int]] = None,
    ):
        num_rows = len(uids)
        if len(caches) != num_rows:
            raise ValueError(f"caches holds {len(caches)} cache lists for a batch of {num_rows} uids; give one per uid")
        if not isinstance(prefill_step_size, int) or prefill_step_size < 1:
            raise ValueError(f"prefill_step_size must be a whole number >= 1, got {prefill_step_size!r}")
        self.model = model
        self.uids = list(uids)
        self.tokens = [list(t) for t in _per_row(tokens, "tokens", num_rows, list)]
        self.prefill_step_size = prefill_step_size
        self.samplers = _per_row(samplers, "samplers", num_rows, lambda: None)
        self.fallback_sampler = fallback_sampler or greedy_sampler
        self.logits_processors = _per_row(logits_processors, "logits_processors", num_rows, list)
        self.stop_sequences = _per_row(stop_sequences, "stop_sequences", num_rows, StopSequences)
        self.max_tokens = _checked_max_tokens(max_tokens, num_rows)
        self.prompt_cache = merge_caches(caches) if caches else []

    def split(self, indices: Sequence[int]) -> "PromptProcessingBatch":
        """Rows `indices` (in increasing order) leave this batch as a batch of their own."""
        indices = sorted(_checked_rows(indices, len(self)))
        split = PromptProcessingBatch(
            self.model, [self.uids[i] for i in indices], [self.extract_cache(i) for i in indices],
            tokens=[self.tokens[i] for i in indices], prefill_step_size=self.prefill_step_size,
            samplers=[self.samplers[i] for i in indices], fallback_sampler=self.fallback_sampler,
            logits_processors=[self.logits_processors[i] for i in indices],
            stop_sequences=[self.stop_sequences[i] for i in indices],
            max_tokens=[self.max_tokens[i] for i in indices],
        )
        leaving = set(indices)
        self.filter([i for i in range(len(self)) if i not in leaving])
        return split

    def prompt(self, tokens: List[List[int]]) -> None:
        """Feed row b the tokens tokens[b] (rows of different lengths right padded: the
        caches turn the padding into holes)."""
        if len(tokens) != len(self):
            raise ValueError(f"prompt got {len(tokens)} token lists for a batch of {len(self)} rows")
        lengths = [len(t) for t in tokens]
        width = max(lengths, default=0)
        if width == 0:
            return
        padding = [width - n for n in lengths]
        if any(padding):
            _prepare_padding(self.prompt_cache, lengths, padding)
        for held, new in zip(self.tokens, tokens):
            held.extend(new)
        _feed(self.model, _right_padded([list(t) for t in tokens], width), self.prompt_cache, self.prefill_step_size)
        if any(padding):
            for entry in self.prompt_cache:
                entry.finalize()
            mx.eval([c.state for c in self.prompt_cache])

    def generate(self, tokens: List[List[int]]) -> "GenerationBatch":
        """Feed each row all but the last of tokens[b]; the rows (which leave this
        batch) then generate from their last token."""
        if len(tokens) != len(self):
            raise ValueError(f"generate got {len(tokens)} token lists for a batch of {len(self)} rows")
        empty = [uid for uid, t in zip(self.uids, tokens) if not len(t)]
        if empty:
            raise ValueError(f"rows of uids {empty} have no token to start generating from; give each at least one")
        self.prompt([list(t[:-1]) for t in tokens])
        generation = GenerationBatch(
            self.model, self.uids, mx.array([t[-1] for t in tokens], dtype=mx.uint32), self.prompt_cache,
            self.tokens, self.samplers, self.fallback_sampler, self.logits_processors, self.stop_sequences,
            self.max_tokens,
        )
        self.prompt_cache = []
        for name in self._per_row:
            setattr(self, name, [])
        return generation

    @classmethod
    def empty(cls, model: nn.Module, fallback_sampler: Sampler,
              prefill_step_size: int = DEFAULT_PREFILL_STEP_SIZE) -> "PromptProcessingBatch":
        return cls(model, [], [], prefill_step_size=prefill_step_size, fallback_sampler=fallback_sampler)


class GenerationBatch(_Rows):
    """Rows that generate: each `next()` feeds every row the token sampled last and
    reports it; the next token is computed while the caller handles those. A token is
    reported once it is fed, so a finished row's caches hold its prompt and every
    token it produced (its Response's prompt_cache, all_tokens)."""

    @dataclass
    class Response:
        uid: int
        token: int
        logprobs: mx.array  # (V,) the distribution `token` was drawn from
        finish_reason: Optional[str]  # "stop", "length" or None (still generating)
        prompt_cache: Optional[List[Any]]  # a finished row's, as ordinary caches
        all_tokens: Optional[List[int]]  # a finished row's: what its caches hold

    _per_row = _Rows._per_row + ("_next_logprobs", "_histories", "_num_tokens", "_matchers")

    def __init__(
        self,
        model: nn.Module,
        uids: List[int],
        inputs: mx.array,
        prompt_cache: List[Any],
        tokens: List[List[int]],
        samplers: Optional[List[Optional[Sampler]]],
        fallback_sampler: Sampler,
        logits_processors: Optional[List[List[LogitsProcessor]]],
        stop_sequences: List[StopSequences],
        max_tokens: List[int],
    ):
        num_rows = len(uids)
        inputs = inputs if isinstance(inputs, mx.array) else mx.array(inputs, dtype=mx.uint32)
        if inputs.shape != (num_rows,):
            raise ValueError(f"inputs must hold one token per uid, shape ({num_rows},), got {inputs.shape}")
        self.model = model
        self.uids = list(uids)
        self.prompt_cache = prompt_cache if num_rows else []
        self.tokens = [list(t) for t in _per_row(tokens, "tokens", num_rows, list)]
        self.samplers = _per_row(samplers, "samplers", num_rows, lambda: None)
        self.fallback_sampler = fallback_sampler or greedy_sampler
        self.logits_processors = _per_row(logits_processors, "logits_processors", num_rows, list)
        self.stop_sequences = _per_row(stop_sequences, "stop_sequences", num_rows, StopSequences)
        self.max_tokens = _checked_max_tokens(max_tokens, num_rows)
        self._next_tokens: Optional[mx.array] = inputs if num_rows else None
        self._next_logprobs: List[Optional[mx.array]] = [None] * num_rows
        # Logits processors read a row's history as an array (what its caches hold).
        self._histories = [TokenBuffer(t) for t in self.tokens]
        self._num_tokens = [0] * num_rows
        self._matchers = [s.matcher() for s in self.stop_sequences]
        if num_rows:
            self._step()  # the inputs fed, the first tokens queued

    def extend(self, batch: "GenerationBatch") -> None:
        super().extend(batch)
        mine, theirs = self._next_tokens, batch._next_tokens
        if theirs is not None:
            self._next_tokens = theirs if mine is None else mx.concatenate([mine, theirs])

    def filter(self, keep: Sequence[int]) -> None:
        keep = _checked_rows(keep, len(self))
        super().filter(keep)
        self._next_tokens = self._next_tokens[mx.array(keep, dtype=mx.int32)] if keep else None

    def _sampled(self, logprobs: mx.array) -> mx.array:
        """(B, V) -> (B,): each row drawn by its sampler (or the fallback); one call
        when every row shares one."""
        samplers = [self.fallback_sampler if s is None else s for s in self.samplers]
        if all(s is samplers[0] for s in samplers):
            return samplers[0](logprobs)
        return mx.concatenate([s(logprobs[b : b + 1]) for b, s in enumerate(samplers)])

    def _logprobs(self, logits: mx.array, fed: mx.array) -> mx.array:
        """(B, V) logits after the fed (B,) tokens -> logprobs, each row's processors
        applied to it with its history."""
        if not any(self.logits_processors):
            return logits - mx.logsumexp(logits, axis=-1, keepdims=True)
        rows = []
        for b, processors in enumerate(self.logits_processors):
            history = self._histories[b].update_and_fetch(fed[b : b + 1]) if processors else None
            rows.append(processed_logprobs(logits[b : b + 1], history, fed[:0], processors))
        return mx.concatenate(rows)

    def _step(self):
        """Feed the tokens sampled last, queue the next; return the fed tokens (ids)
        and the logprobs they were drawn from."""
        fed, fed_logprobs = self._next_tokens, self._next_logprobs
        make_room(self.prompt_cache, 1)
        logits = self.model(fed[:, None], cache=self.prompt_cache)[:, -1, :]
        logprobs = self._logprobs(logits, fed)
        self._next_tokens = self._sampled(logprobs)
        self._next_logprobs = list(logprobs)
        mx.async_eval(self._next_tokens, self._next_logprobs, bookkeeping(self.prompt_cache))
        fed_ids = fed.tolist()  # (the next step computes meanwhile)
        for held, token in zip(self.tokens, fed_ids):
            held.append(token)
        return fed_ids, fed_logprobs

    def _finish_reason(self, row: int, token: int) -> Optional[str]:
        self._num_tokens[row] += 1
        stopped = self._matchers[row].advance(token)  # (advanced even at the length limit)
        if stopped:
            return "stop"
        return "length" if self._num_tokens[row] >= self.max_tokens[row] else None

    def next(self) -> List["GenerationBatch.Response"]:
        """One token of every row; finished rows leave the batch."""
        if not self.uids:
            return []
        tokens, logprobs = self._step()
        responses, keep = [], []
        for row, (uid, token) in enumerate(zip(self.uids, tokens)):
            reason = self._finish_reason(row, token)
            finished = reason is not None
            if not finished:
                keep.append(row)
            responses.append(self.Response(
                uid, token, logprobs[row], reason, self.extract_cache(row) if finished else None,
                self.tokens[row] if finished else None,
            ))
        if len(keep) < len(self):
            self.filter(keep)
        return responses

    @classmethod
    def empty(cls, model: nn.Module, fallback_sampler: Sampler) -> "GenerationBatch":
        return cls(model, [], mx.array([], dtype=mx.uint32), [], [], [], fallback_sampler, [], [], [])
