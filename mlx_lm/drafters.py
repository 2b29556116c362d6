"""Drafters for speculative decoding (DESIGN.md §3a): each proposes the next tokens of a
sequence for the target to verify. `DraftModel` (a smaller model sharing the target's
tokenizer), `PromptLookup` (n-gram lookup in the tokens seen so far, no model) and
`MTPHead` (the target's own multi-token-prediction head, fed the target's hidden
states). The loop that verifies, accepts, rolls back and reports is written once for
all (speculative.py), the acceptance rules too (acceptance.py); feeding a model and
its cache lives in feeding.py."""

from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import mlx.core as mx
import mlx.nn as nn

from .feeding import CachedModel, Processors, on_generation_stream, prefill, processed_logprobs
from .models.cache import trim_prompt_cache
from .models.checkpoints import CheckpointedCache, PrefillChunks, held_by_rows, next_pair_hidden
from .sample_utils import CategoricalSampler




class Drafter:
    """What speculative_generate_step asks for drafts.

    The loop keeps `sequence`: the prompt, then every token the target committed to.
    A round calls `can_draft(sequence)` (cheap, host only) and then `propose(sequence,
    k, ...)`; after the target decided, `settle(tokens)` with what the drafter must now
    hold (the sequence minus its last token); at the end `finish(tokens, ...)`. Between
    rounds a drafter may lag behind `sequence` (plain rounds do not call it): it
    catches up in its next `propose`. `cache` lists the cache entries it feeds, which
    join the target's in a speculative prompt cache (after them) and take part in the
    rollback protocol.
    """

    cache: List[Any] = []

    def run_target(self, target: CachedModel) -> CachedModel:
        """The target as the loop should run it: `target` itself, unless the drafter
        reads more of its forwards (MTPHead: the hidden states)."""
        return target

    def prefill(
        self, target: CachedModel, prompt: mx.array, prefill_step_size: int,
        progress: Callable[[int, int], None], quantize_kv: Callable[[List[Any]], None],
    ) -> None:
        """Feed all of the prompt (1-D) but its last token to the target and the
        drafter, in the same chunks (feeding.prefill; `progress` after each, which
        may raise to cancel)."""
        prefill(target.model, prompt, target.cache, prefill_step_size, progress, quantize_kv,
                also=self.prefill_feeds(prompt))
        target.num_held = prompt.size - 1

    def prefill_feeds(self, prompt: mx.array) -> List[Tuple[nn.Module, List[Any], mx.array]]:
        """(model, cache, ids) the drafter is fed beside the target's prefill (none: it
        has no model, or feeds itself as MTPHead does); takes in the prompt."""
        return []

    def can_draft(self, sequence: List[int]) -> bool:
        """Whether propose() would propose anything after `sequence`."""
        raise NotImplementedError

    def propose(
        self, sequence: List[int], num_draft: int, sampler: Callable[[mx.array], mx.array], processors: Processors
    ) -> Tuple[mx.array, Optional[mx.array]]:
        """Up to `num_draft` tokens to follow `sequence` (1-D uint32, lazy; at least one
        when can_draft said so), and with a CategoricalSampler the laws (n, V) each was
        drawn from, or None where each was chosen with certainty (point masses). Under
        any other sampler the laws are not read (token matching decides)."""
        raise NotImplementedError

    def settle(self, tokens: List[int]) -> None:
        """After a round: hold `tokens` (what was fed beyond them is given back), or
        lag behind them."""
        raise NotImplementedError

    def finish(self, tokens: List[int]) -> None:
        """At the end of a run: hold exactly `tokens` (feeding lazily what is missing)."""
        raise NotImplementedError


def draw_draft(
    logits: mx.array, sequence: List[int], proposals: List[mx.array], sampler: Callable[[mx.array], mx.array],
    processors: Processors,
) -> Tuple[mx.array, Optional[mx.array]]:
    """Draw the next draft token (1,) uint32 from a drafter's logits (1, V), which the
    processors see after `sequence` and the `proposals` so far; with a
    CategoricalSampler also the law (1, V) it was drawn from (else None)."""
    history = mx.concatenate([mx.array(sequence), *proposals]) if processors else None
    logprobs = processed_logprobs(logits, history, mx.array([], mx.uint32), processors)
    if not isinstance(sampler, CategoricalSampler):
        return sampler(logprobs).astype(mx.uint32), None
    law = sampler.distribution(logprobs)
    return mx.random.categorical(law).astype(mx.uint32), law


class DraftModel(Drafter):
    """A smaller model with the target's tokenizer drafts: k single-token forwards a
    round, each token drawn by the run's sampler (from the law q the sampler gives,
    with every processor applied, for speculative sampling)."""

    def __init__(self, model: nn.Module, cache: List[Any], num_columns: int):
        self.side = CachedModel(model, cache, model.args.vocab_size, num_columns)
        self.cache = cache

    def prefill_feeds(self, prompt: mx.array) -> List[Tuple[nn.Module, List[Any], mx.array]]:
        self.side.num_held = prompt.size - 1
        return [(self.side.model, self.cache, self.side.model_ids(prompt))]

    def can_draft(self, sequence: List[int]) -> bool:
        return True

    @on_generation_stream
    def propose(
        self, sequence: List[int], num_draft: int, sampler: Callable[[mx.array], mx.array], processors: Processors
    ) -> Tuple[mx.array, Optional[mx.array]]:
        """The draft holds a prefix of `sequence[:-1]`; it is fed the rest of the
        sequence in one forward, then each proposal but the last."""
        explicit = isinstance(sampler, CategoricalSampler)
        proposals, laws = [], []
        inputs = mx.array(sequence[self.side.num_held :], mx.uint32)
        for _ in range(num_draft):
            logits = self.side.forward(inputs)[-1:]
            token, law = draw_draft(logits, sequence, proposals, sampler, processors)
            proposals.append(token)
            laws.append(law)
            # Start computing each draft as soon as it is built, so building the next
            # step overlaps it (measured 6-12% faster per round than one eval).
            mx.async_eval(proposals[-1])
            inputs = proposals[-1]
        return mx.concatenate(proposals), mx.concatenate(laws) if explicit else None

    def settle(self, tokens: List[int]) -> None:
        # Not fed what it lacks (after a fully accepted round, its last proposal): the
        # next propose feeds it with the token after, in one forward instead of two.
        self.side.settle(tokens, feed=False)

    def finish(self, tokens: List[int]) -> None:
        self.side.settle(tokens, feed=True)


class PromptLookup(Drafter):
    """Prompt-lookup (n-gram) drafting: the tokens that followed the most recent
    earlier occurrence of the current suffix, longest suffix first (`max_ngram_size`
    down to `min_ngram_size` tokens), in the tokens seen so far: `context` (e.g. a
    conversation already in a reused prompt cache), then each run's prompt and
    committed tokens. A continuation that runs into the end of the seen tokens repeats
    with the same period (the occurrence and the suffix may overlap: "ab ab ab").

    The index maps every n-gram to the position after its latest occurrence and is
    updated per token (insert or undo: O(ngram sizes) each), so a lookup costs the
    same at 100 or 100k tokens. A run's drafts are never indexed, only tokens the
    target committed to; a drafter passed to several runs (speculative_generate_step's
    `drafter`) keeps what each run committed, so a conversation continued from a
    prompt cache looks up in all of it. Drafts are point masses: with a
    CategoricalSampler their laws are one-hot, and speculative sampling accepts each
    with the target's probability of it.
    """

    def __init__(self, max_ngram_size: int = 3, min_ngram_size: int = 1, context: Sequence[int] = ()):
        if not 1 <= min_ngram_size <= max_ngram_size:
            raise ValueError(
                f"need 1 <= min_ngram_size <= max_ngram_size, got min_ngram_size={min_ngram_size}, "
                f"max_ngram_size={max_ngram_size}"
            )
        self.ngram_sizes = range(max_ngram_size, min_ngram_size - 1, -1)  # longest first
        self.tokens: List[int] = []
        self.latest: Dict[int, Dict[Tuple[int, ...], int]] = {n: {} for n in self.ngram_sizes}
        self.replaced: Dict[int, List[Optional[int]]] = {n: [] for n in self.ngram_sizes}  # per position
        self.run_start = 0  # where this run's sequence starts in self.tokens
        self.extend(context)

    # --- the index -----------------------------------------------------------------

    def extend(self, tokens: Sequence[int]) -> None:
        """Append tokens to what was seen, indexing each."""
        for token in tokens:
            position = len(self.tokens)
            for n in self.ngram_sizes:
                key = tuple(self.tokens[position - n : position]) if position >= n else None
                self.replaced[n].append(None if key is None else self.latest[n].get(key))
                if key is not None:
                    self.latest[n][key] = position
            self.tokens.append(int(token))

    def truncate(self, length: int) -> None:
        """Forget all but the first `length` tokens seen, undoing their index entries."""
        while len(self.tokens) > length:
            self.tokens.pop()
            position = len(self.tokens)
            for n in self.ngram_sizes:
                previous = self.replaced[n].pop()
                if position < n:
                    continue
                key = tuple(self.tokens[position - n : position])
                if previous is None:
                    del self.latest[n][key]
                else:
                    self.latest[n][key] = previous

    def lookup(self, num_draft: int) -> List[int]:
        """Up to `num_draft` tokens continuing the longest suffix seen before ([] if none)."""
        end = len(self.tokens)
        for n in self.ngram_sizes:
            if end < n:
                continue
            start = self.latest[n].get(tuple(self.tokens[end - n :]))
            if start is not None:
                period = end - start  # >= 1: the suffix itself is not indexed yet
                return [self.tokens[start + i % period] for i in range(num_draft)]
        return []

    # --- the drafter -----------------------------------------------------------------

    def _follow(self, sequence: List[int]) -> None:
        """Index what the run committed since the last call."""
        self.extend(sequence[len(self.tokens) - self.run_start :])

    def prefill_feeds(self, prompt: mx.array) -> List[Tuple[nn.Module, List[Any], mx.array]]:
        self.run_start = len(self.tokens)
        self.extend(prompt.tolist())
        return []

    def can_draft(self, sequence: List[int]) -> bool:
        self._follow(sequence)
        return bool(self.lookup(1))

    def propose(
        self, sequence: List[int], num_draft: int, sampler: Callable[[mx.array], mx.array], processors: Processors
    ) -> Tuple[mx.array, Optional[mx.array]]:
        self._follow(sequence)
        return mx.array(self.lookup(num_draft), mx.uint32), None  # point masses

    def settle(self, tokens: List[int]) -> None:
        pass  # only committed tokens are indexed; the next call catches up

    def finish(self, tokens: List[int]) -> None:
        self.truncate(self.run_start + len(tokens))
        self.extend(tokens[len(self.tokens) - self.run_start :])


# ---------------------------------------------------------------------------
# Multi-token prediction: the target's own MTP head drafts
# ---------------------------------------------------------------------------


class HiddenStates:
    """The target's final hidden states (after its final norm) at run positions, kept
    from each forward until the MTP head has taken them in.

    A forward that starts at position b finds the target holding b tokens, so rows kept
    for positions >= b belonged to tokens since trimmed: they are dropped then, and the
    records stay disjoint and in order."""

    def __init__(self):
        self.records: List[Tuple[int, mx.array]] = []  # (first position, rows (T, H))

    def add(self, start: int, rows: mx.array) -> None:
        kept = [(begin, old[: start - begin]) for begin, old in self.records if begin < start]
        self.records = kept + [(start, rows)]

    def rows(self, start: int, stop: int) -> mx.array:
        """(stop - start, H): the rows of positions start..stop-1, all of them kept."""
        pieces = []
        for begin, rows in self.records:
            low, high = max(start, begin), min(stop, begin + rows.shape[0])
            if low < high:
                pieces.append(rows[low - begin : high - begin])
        assert sum(p.shape[0] for p in pieces) == stop - start, (start, stop, [(b, r.shape) for b, r in self.records])
        return pieces[0] if len(pieces) == 1 else mx.concatenate(pieces)

    def row(self, position: int) -> Optional[mx.array]:
        """(1, H): the row of `position`, or None if it is not kept."""
        for begin, rows in self.records:
            if begin <= position < begin + rows.shape[0]:
                return rows[position - begin : position - begin + 1]
        return None

    def forget_before(self, position: int) -> None:
        self.records = [(b, r) for b, r in self.records if b + r.shape[0] > position]


@dataclass
class HiddenCachedModel(CachedModel):
    """The target of an MTP run: each forward also keeps its final hidden states
    (`model.hidden_and_logits`) for the head, by run position."""

    hidden: HiddenStates = field(default_factory=HiddenStates)

    def forward(self, tokens: mx.array) -> mx.array:
        start = self.num_held + self.num_fed
        hidden, logits = self.model.hidden_and_logits(tokens[None], cache=self.cache)
        self.num_fed += tokens.size
        self.hidden.add(start, hidden[0])
        return logits[0]  # the target's own table: no columns to fix


def check_mtp_head(model: nn.Module) -> None:
    """Raise ValueError unless `model` carries a one-layer multi-token-prediction head."""
    # Families written for upstream mlx-lm do not declare the attribute: they have no head.
    head = model.mtp_head if getattr(type(model), "supports_mtp", False) else None
    if head is None:
        raise ValueError(
            f"mtp=True needs a multi-token-prediction head, but this {model.args.model_type} model "
            f"({type(model).__module__}) has none: "
            "its checkpoint has no mtp.* weights (mtp.fc.weight, mtp.pre_fc_norm_embedding.weight, "
            "mtp.pre_fc_norm_hidden.weight, mtp.norm.weight, mtp.layers.0.*) or its config declares no head "
            "(num_nextn_predict_layers, or mtp_num_hidden_layers in text_config); use a draft model or "
            "prompt lookup instead"
        )
    if len(head.layers) != 1:
        raise ValueError(f"MTP drafting runs heads of one layer; this head has {len(head.layers)}")


class MTPHead(Drafter):
    """The target's multi-token-prediction head drafts (models/qwen3_next.py:
    MultiTokenPredictor): pair i of the run is (sequence[i+1], h_i), h_i the target's
    final hidden state at position i, and the head's output after pair i predicts
    sequence[i+2]. The first draft comes from the pair of the last token the target
    holds; each further one from the head's own output hidden state and the token it
    just drafted, drawn by the run's sampler as DraftModel does (its law q for
    speculative sampling).

    The head's KV cache (`cache`) holds the true pairs (target hidden states) of the
    committed tokens: the pairs made while drafting are given back in settle(), and
    the target's hidden states of the accepted tokens are fed at the next propose, in
    one forward with the pair that drafts. So the head needs the target's hidden
    states: `target` is the run's target (a HiddenCachedModel) and `prefill_with_target`
    feeds both. After finish(tokens) the head holds the pairs of `tokens`: one entry
    fewer than the target, which the loop brings to `tokens`.

    A run that continues a prompt cache whose head is one pair behind its target needs
    the target's hidden state at the cache's last token for that pair (pair -1 of the
    run). A CheckpointedCache (`checkpoints`, the whole list) keeps it: this head tells
    it the row at each prefill chunk end, so its snapshots hold it (a run resumed at
    one feeds the pairs in the chunks a cold run feeds, bit for bit), and at finish.
    Without it the head's entries skip that pair (later drafts may be a little worse;
    the output is the target's either way)."""

    def __init__(self, model: nn.Module, target_cache: List[Any], head_cache: List[Any], num_columns: int, *,
                 checkpoints: Optional[CheckpointedCache] = None):
        check_mtp_head(model)
        self.model = model
        self.target = HiddenCachedModel(model, target_cache, num_columns, num_columns)
        self.cache = head_cache
        # Run position 0 is absolute position `start`; a target without attention entries
        # does not show it, and then keeps no rows.
        self.start = held_by_rows(target_cache)
        self.checkpoints = checkpoints if self.start is not None else None
        self.num_pairs = 0  # the head holds pairs 0..num_pairs-1 of this run
        self.num_drafting = 0  # entries it was fed while drafting, beyond them
        row = None if checkpoints is None else next_pair_hidden(checkpoints, len(target_cache))
        if row is not None:
            self.num_pairs = -1  # pair -1: (the run's first token, the target's state before it)
            self.target.hidden.add(-1, row)

    def prefill_with_target(
        self, prompt: mx.array, prefill_step_size: int, progress: Callable[[int, int], None],
        quantize_kv: Callable[[List[Any]], None], *, feed_last_pair: bool = False,
    ) -> None:
        """Feed the target all prompt tokens but the last, in chunks, and after each
        chunk the head the pairs whose next token the target has now seen.
        `feed_last_pair`: also the pair of the last token the target holds (a prompt
        cache filled for a later run that starts after the prompt, as the server's)."""
        tokens, total = prompt.tolist(), prompt.size
        # Cut as the whole list is (a CheckpointedCache's message boundaries too), not its target part.
        chunks = PrefillChunks(self.checkpoints if self.checkpoints is not None else self.target.cache,
                               prefill_step_size)
        first = self.target.num_fed
        while self.target.num_fed < total - 1:
            start = self.target.num_fed
            end = start + chunks.size(start - first, total - 1 - start)
            self.target.forward(prompt[start:end])
            self._feed_pairs(tokens, end - 1)
            quantize_kv(self.target.cache)
            quantize_kv(self.cache)
            mx.eval([c.state for c in self.target.cache + self.cache])
            self._keep_hidden(end)
            progress(end, total)
            mx.clear_cache()
        self.target.num_held, self.target.num_fed = total - 1, 0
        if feed_last_pair:
            self._feed_pairs(tokens, total - 1)

    def run_target(self, target: CachedModel) -> CachedModel:
        return self.target  # the same cache, keeping the hidden states the head reads

    def prefill(
        self, target: CachedModel, prompt: mx.array, prefill_step_size: int,
        progress: Callable[[int, int], None], quantize_kv: Callable[[List[Any]], None],
    ) -> None:
        """`target` is run_target's: prefill_with_target feeds both."""
        self.prefill_with_target(prompt, prefill_step_size, progress, quantize_kv)

    def can_draft(self, sequence: List[int]) -> bool:
        return len(sequence) - 1 > self.num_pairs

    def propose(
        self, sequence: List[int], num_draft: int, sampler: Callable[[mx.array], mx.array], processors: Processors
    ) -> Tuple[mx.array, Optional[mx.array]]:
        explicit = isinstance(sampler, CategoricalSampler)
        proposals, laws = [], []
        hidden, logits = self._feed_pairs(sequence, len(sequence) - 1)  # (1, 1, H), (1, V)
        for _ in range(num_draft):
            if proposals:  # the head again, on its own output and its last draft
                hidden, logits = self.model.mtp_forward(proposals[-1][None], hidden, self.cache)
                logits = logits[0]
                self.num_drafting += 1
            token, law = draw_draft(logits, sequence, proposals, sampler, processors)
            proposals.append(token)
            laws.append(law)
            mx.async_eval(proposals[-1])
        return mx.concatenate(proposals), mx.concatenate(laws) if explicit else None

    def settle(self, tokens: List[int]) -> None:
        # The pairs of the newly accepted tokens are fed by the next propose.
        self._hold(tokens)

    def finish(self, tokens: List[int]) -> None:
        self._hold(tokens)
        self._feed_pairs(tokens, len(tokens) - 1)
        self._keep_hidden(len(tokens))

    def _keep_hidden(self, num_held: int) -> None:
        """Tell `checkpoints` the target's hidden state at its last position while it
        holds `num_held` tokens of the run (module docstring of models/checkpoints.py)."""
        if self.checkpoints is not None:
            self.checkpoints.keep_hidden(self.start + num_held, self.target.hidden.row(num_held - 1))

    def _hold(self, tokens: List[int]) -> None:
        """Give back the drafting entries, and the pairs beyond those of `tokens`."""
        excess = max(self.num_pairs - max(len(tokens) - 1, 0), 0)
        trim_prompt_cache(self.cache, self.num_drafting + excess)
        self.num_pairs -= excess
        self.num_drafting = 0

    def _feed_pairs(self, sequence: List[int], stop: int) -> Tuple[Optional[mx.array], Optional[mx.array]]:
        """Feed the pairs num_pairs..stop-1 in one forward (lazy); returns the head's
        output hidden state (1, 1, H) and logits (1, V) after the last, or (None, None)
        if none was missing."""
        if stop <= self.num_pairs:
            return None, None
        hidden = self.target.hidden.rows(self.num_pairs, stop)
        tokens = mx.array(sequence[self.num_pairs + 1 : stop + 1], mx.uint32)
        out, logits = self.model.mtp_forward(tokens[None], hidden[None], self.cache)
        self.num_pairs = stop
        self.target.hidden.forget_before(stop)
        return out[:, -1:], logits[0, -1:]
