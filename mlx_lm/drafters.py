"""Drafting for speculative decoding: the drafters and the acceptance rules (the draft
length: draft_length.py).

Drafters (DESIGN.md §3a) propose the next tokens of a sequence for the target to verify:
`DraftModel` (a smaller model sharing the target's tokenizer), `PromptLookup`
(n-gram lookup in the tokens seen so far, no model) and `MTPHead` (the target's own
multi-token-prediction head, fed the target's hidden states). The loop that verifies,
accepts, rolls back and reports (generate.speculative_generate_step) is written once
for all.

Speculative sampling (Leviathan et al. 2023, arXiv:2211.17192; Chen et al. 2023,
arXiv:2302.01318): the draft proposes x_1..x_K, each drawn from its law q_i; the
target's laws p_1..p_{K+1} come from one forward. x_i is accepted with probability
min(1, p_i(x_i) / q_i(x_i)); at the first rejection the token is drawn from
norm(max(0, p_i - q_i)) instead, and after K acceptances a bonus token is drawn from
p_{K+1}. Each emitted token then has exactly the target's law, and a draft is accepted
with probability sum_x min(p_i(x), q_i(x)). A point-mass drafter (prompt lookup) is
the case q_i = one-hot(x_i): x_i is accepted with probability p_i(x_i). The acceptance
functions take log-probabilities and allow leading batch dimensions (`...`).
"""

import functools
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import mlx.core as mx
import mlx.nn as nn

from .models.cache import check_kv_quantization, maybe_quantize_kv_cache, trim_prompt_cache
from .models.checkpoints import maybe_snapshot
from .sample_utils import CategoricalSampler

Processors = List[Callable[[mx.array, mx.array], mx.array]]

# All generation runs on this stream (upstream's name; `mlx_lm.generate.generation_stream`),
# one per thread, so that a server's worker thread never shares it.
generation_stream = mx.new_thread_local_stream(mx.default_device())


def on_generation_stream(fn):
    """Build (and evaluate) `fn`'s work on generation_stream."""

    @functools.wraps(fn)
    def run(*args, **kwargs):
        with mx.stream(generation_stream):
            return fn(*args, **kwargs)

    return run

# ---------------------------------------------------------------------------
# Feeding a model and its cache
# ---------------------------------------------------------------------------


def check_generation_args(
    prompt: mx.array, max_tokens: int, prefill_step_size: int, input_embeddings: Optional[mx.array] = None
) -> None:
    if input_embeddings is not None:
        _check_input_embeddings(prompt, input_embeddings)
    elif prompt.ndim != 1 or prompt.size == 0:
        raise ValueError(f"prompt must be a non-empty 1-D array of token ids, got shape {prompt.shape}")
    if max_tokens != -1 and max_tokens < 1:
        raise ValueError(f"max_tokens must be positive or -1 (no limit), got {max_tokens}")
    if prefill_step_size < 1:
        raise ValueError(f"prefill_step_size must be positive, got {prefill_step_size}")


def _check_input_embeddings(prompt: mx.array, input_embeddings: mx.array) -> None:
    if input_embeddings.ndim != 2 or input_embeddings.shape[0] == 0:
        raise ValueError(f"input_embeddings must be (prompt length, hidden size), got shape {input_embeddings.shape}")
    if prompt.ndim != 1 or prompt.size not in (0, input_embeddings.shape[0]):
        raise ValueError(
            f"prompt ({prompt.size} tokens) and input_embeddings ({input_embeddings.shape[0]} rows) must have the "
            "same length, or the prompt be empty"
        )


def kv_quantizer(
    prompt_cache: List[Any], kv_bits: Optional[int], kv_group_size: int, quantized_kv_start: int
) -> Callable[[List[Any]], None]:
    """Check the KV quantization settings against the cache before any work; returns
    the function that quantizes a cache list's entries once they are long enough."""
    if kv_bits is not None:
        check_kv_quantization(prompt_cache, kv_group_size, kv_bits, quantized_kv_start)
    return functools.partial(
        maybe_quantize_kv_cache, quantized_kv_start=quantized_kv_start, kv_group_size=kv_group_size, kv_bits=kv_bits
    )


# Prompt tokens per prefill forward, for every loop (plain, speculative, batched, the
# server's): one chunking, so a prompt gives the same caches, bit for bit, in each.
DEFAULT_PREFILL_STEP_SIZE = 2048


@on_generation_stream
def prefill(
    model: nn.Module,
    prompt: mx.array,
    prompt_cache: List[Any],
    prefill_step_size: int,
    progress: Callable[[int, int], None],
    quantize_kv: Optional[Callable[[List[Any]], None]] = None,
    input_embeddings: Optional[mx.array] = None,
) -> mx.array:
    """Feed all prompt positions but the last through the model in chunks; return the
    tokens still to feed (the last one, whose logits start generation).
    `quantize_kv(prompt_cache)` runs after each chunk (see maybe_quantize_kv_cache).
    With `input_embeddings` (T, hidden) the model takes those rows instead of the
    tokens' embeddings; `prompt` is then the T tokens they stand for, or empty."""
    total = prompt.size if input_embeddings is None else input_embeddings.shape[0]
    done = 0
    maybe_snapshot(prompt_cache, 0)  # a CheckpointedCache's snapshots (issue 33)
    while total - done > 1:
        n = min(prefill_step_size, total - done - 1)
        rows = {} if input_embeddings is None else {"input_embeddings": input_embeddings[done : done + n][None]}
        model(prompt[done : done + n][None], cache=prompt_cache, **rows)
        if quantize_kv is not None:
            quantize_kv(prompt_cache)
        mx.eval([c.state for c in prompt_cache])
        done += n
        maybe_snapshot(prompt_cache, n)
        progress(done, total)
        mx.clear_cache()
    return prompt[done:]


def ids_within(tokens: mx.array, table_size: int) -> mx.array:
    """`tokens` with ids beyond an embedding table of `table_size` rows replaced by 0
    (a draft with a smaller table than the target's; see CachedModel)."""
    return mx.where(tokens < table_size, tokens, 0)


@dataclass
class CachedModel:
    """One model of a speculative run and what its cache holds: the first `num_held`
    tokens of the sequence, then `num_fed` more fed this round, not yet accepted.

    Logits come out with `num_columns` columns, the target's vocabulary: a draft with a
    larger table loses the extra columns, a smaller one gets -inf columns, so the draft
    never proposes an id the target's table lacks and processors and samplers always
    see the target's shape. Ids beyond this model's own table (a draft with a smaller
    table, fed a padding-row id the target committed: no tokenizer has it, only an odd
    target emits one) are fed as id 0: the draft's guesses after it may be worse, the
    output is still the target's.
    """

    model: nn.Module
    cache: List[Any]
    table_size: int
    num_columns: int
    num_held: int = 0
    num_fed: int = 0

    def model_ids(self, tokens: mx.array) -> mx.array:
        return tokens if self.table_size >= self.num_columns else ids_within(tokens, self.table_size)

    def forward(self, tokens: mx.array) -> mx.array:
        """Logits (T, num_columns) after each of `tokens` (1-D). MLX writes the cache
        while it builds the graph, so the tokens count as fed when the call returns,
        before anything that can still fail (processors, sampler, the sync)."""
        logits = self.model(self.model_ids(tokens)[None], cache=self.cache)[0]
        self.num_fed += tokens.size
        if self.table_size > self.num_columns:
            return logits[:, : self.num_columns]
        if self.table_size < self.num_columns:
            missing = mx.full((logits.shape[0], self.num_columns - self.table_size), -mx.inf, logits.dtype)
            return mx.concatenate([logits, missing], axis=1)
        return logits

    @on_generation_stream
    def settle(self, tokens: List[int], *, feed: bool) -> None:
        """Hold exactly `tokens`, which agree with what the cache holds and was fed up
        to the shorter of the two: trim what lies beyond them, then, if `feed`, feed
        (lazily) what is missing; else leave it for the next forward to catch up."""
        num_in_cache = self.num_held + self.num_fed
        trim_prompt_cache(self.cache, num_in_cache - len(tokens))
        self.num_held, self.num_fed = min(num_in_cache, len(tokens)), 0
        if self.num_held < len(tokens) and feed:
            self.forward(mx.array(tokens[self.num_held :], mx.uint32))
            self.num_held, self.num_fed = len(tokens), 0


def processed_logprobs(
    logits: mx.array,
    history: Optional[mx.array],
    drafts: mx.array,
    logits_processors: Processors,
) -> mx.array:
    """Log-probabilities (N, V) of `logits` (N, V) after the processors, which see, for
    row i, `history` (1-D) followed by drafts[:i] (as plain decoding would show them)."""
    if logits_processors:
        rows = []
        for i in range(logits.shape[0]):
            row, seen = logits[i : i + 1], mx.concatenate([history, drafts[:i]])
            for processor in logits_processors:
                row = processor(seen, row)
            rows.append(row)
        logits = mx.concatenate(rows)
    return logits - mx.logsumexp(logits, axis=-1, keepdims=True)


# ---------------------------------------------------------------------------
# Drafters
# ---------------------------------------------------------------------------


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

    def prefill_run(
        self, target: CachedModel, prompt: mx.array, prefill_step_size: int,
        progress: Callable[[int, int], None], quantize_kv: Callable[[List[Any]], None],
    ) -> None:
        """Prefill the drafter, then the target (`progress` follows the target's)."""
        self.prefill(prompt, prefill_step_size, quantize_kv)
        prefill(target.model, prompt, target.cache, prefill_step_size, progress, quantize_kv)

    def prefill(self, prompt: mx.array, prefill_step_size: int, quantize_kv: Callable[[List[Any]], None]) -> None:
        """Take in the prompt (1-D); afterwards the drafter holds all of it but its last token."""
        raise NotImplementedError

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

    def prefill(self, prompt: mx.array, prefill_step_size: int, quantize_kv: Callable[[List[Any]], None]) -> None:
        prefill(self.side.model, self.side.model_ids(prompt), self.cache, prefill_step_size,
                lambda done, total: None, quantize_kv)
        self.side.num_held = prompt.size - 1

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

    def prefill(self, prompt: mx.array, prefill_step_size: int, quantize_kv: Callable[[List[Any]], None]) -> None:
        self.run_start = len(self.tokens)
        self.extend(prompt.tolist())

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


def point_masses(tokens: mx.array, num_columns: int) -> mx.array:
    """(n, num_columns) log-laws putting all mass on each of `tokens` (n,)."""
    columns = mx.arange(num_columns, dtype=mx.uint32)
    return mx.where(columns[None, :] == tokens[:, None], 0.0, -mx.inf)


# ---------------------------------------------------------------------------
# Acceptance rules (speculative sampling)
# ---------------------------------------------------------------------------


def accepted_count(
    target_logprobs: mx.array, draft_logprobs: mx.array, drafts: mx.array, uniforms: mx.array
) -> mx.array:
    """How many leading drafts pass the ratio test u_i < p_i(x_i) / q_i(x_i).

    Args:
        target_logprobs: (..., K or K + 1, V) log p; only the first K rows are read.
        draft_logprobs: (..., K, V) log q, the laws the drafts were drawn from.
        drafts: (..., K) the drafted ids x_i.
        uniforms: (..., K) independent draws from [0, 1).

    Returns:
        (...,) int32 in [0, K]. P(u < p/q) = min(1, p/q) for u uniform on [0, 1).
    """
    num_drafts = drafts.shape[-1]
    ids = drafts[..., None].astype(mx.int32)  # (..., K, 1)
    p = mx.take_along_axis(target_logprobs[..., :num_drafts, :], ids, axis=-1)[..., 0]
    q = mx.take_along_axis(draft_logprobs, ids, axis=-1)[..., 0]
    passed = (uniforms < mx.exp(p.astype(mx.float32) - q.astype(mx.float32))).astype(mx.int32)
    return mx.cumprod(passed, axis=-1).sum(axis=-1)


def correction_logprobs(target_logprobs: mx.array, draft_logprobs: mx.array) -> mx.array:
    """The law of the token emitted after n accepted drafts, for every n.

    Args:
        target_logprobs: (..., K + 1, V) log p.
        draft_logprobs: (..., K, V) log q.

    Returns:
        (..., K + 1, V) float32 log-probabilities: row i < K is
        log norm(max(0, p_i - q_i)) (the token after a rejection at i), row K is
        log p_K (the bonus). Where p_i <= q_i everywhere (p_i == q_i up to round-off)
        a rejection has probability ~0 and row i is p_i, so it is always a law.
    """
    num_drafts = draft_logprobs.shape[-2]
    target_logprobs = target_logprobs.astype(mx.float32)
    p = mx.exp(target_logprobs[..., :num_drafts, :])
    residual = mx.maximum(p - mx.exp(draft_logprobs.astype(mx.float32)), 0)  # (..., K, V)
    mass = residual.sum(axis=-1, keepdims=True)
    rows = mx.where(mass > 0, mx.log(residual) - mx.log(mass), target_logprobs[..., :num_drafts, :])
    return mx.concatenate([rows, target_logprobs[..., num_drafts:, :]], axis=-2)


def speculative_sample(
    target_logprobs: mx.array, draft_logprobs: mx.array, drafts: mx.array, key: Optional[mx.array] = None
) -> Tuple[mx.array, mx.array]:
    """One round of speculative sampling.

    Args:
        target_logprobs: (..., K + 1, V) log p after each draft position and the bonus.
        draft_logprobs: (..., K, V) log q; drafts[..., i] must have been drawn from row i.
        drafts: (..., K) drafted ids.
        key: PRNG key; default the global mx.random state.

    Returns:
        (num_accepted (...,) int32, token (...,) uint32): the drafts kept, and the
        token that follows them (a correction or the bonus). Lazy.
    """
    accept_key, token_key = mx.random.split(key) if key is not None else (None, None)
    uniforms = mx.random.uniform(shape=drafts.shape, key=accept_key)
    num_accepted = accepted_count(target_logprobs, draft_logprobs, drafts, uniforms)
    laws = correction_logprobs(target_logprobs, draft_logprobs)  # (..., K + 1, V)
    law = mx.take_along_axis(laws, num_accepted[..., None, None], axis=-2)[..., 0, :]
    return num_accepted, mx.random.categorical(law, key=token_key).astype(mx.uint32)


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
    fewer than the target, which the loop brings to `tokens`. A run that continues a
    prompt cache lacks the target's hidden state at the cache's last token, so the
    head's entries skip that one pair (later drafts may be a little worse; the output is
    the target's either way)."""

    def __init__(self, model: nn.Module, target_cache: List[Any], head_cache: List[Any], num_columns: int):
        check_mtp_head(model)
        self.model = model
        self.target = HiddenCachedModel(model, target_cache, num_columns, num_columns)
        self.cache = head_cache
        self.num_pairs = 0  # the head holds pairs 0..num_pairs-1 of this run
        self.num_drafting = 0  # entries it was fed while drafting, beyond them

    def prefill_with_target(
        self, prompt: mx.array, prefill_step_size: int, progress: Callable[[int, int], None],
        quantize_kv: Callable[[List[Any]], None], *, feed_last_pair: bool = False,
    ) -> None:
        """Feed the target all prompt tokens but the last, in chunks, and after each
        chunk the head the pairs whose next token the target has now seen.
        `feed_last_pair`: also the pair of the last token the target holds (a prompt
        cache filled for a later run that starts after the prompt, as the server's)."""
        tokens, total = prompt.tolist(), prompt.size
        while self.target.num_fed < total - 1:
            start = self.target.num_fed
            end = min(start + prefill_step_size, total - 1)
            self.target.forward(prompt[start:end])
            self._feed_pairs(tokens, end - 1)
            quantize_kv(self.target.cache)
            quantize_kv(self.cache)
            mx.eval([c.state for c in self.target.cache + self.cache])
            progress(end, total)
            mx.clear_cache()
        self.target.num_held, self.target.num_fed = total - 1, 0
        if feed_last_pair:
            self._feed_pairs(tokens, total - 1)

    def run_target(self, target: CachedModel) -> CachedModel:
        return self.target  # the same cache, keeping the hidden states the head reads

    def prefill_run(
        self, target: CachedModel, prompt: mx.array, prefill_step_size: int,
        progress: Callable[[int, int], None], quantize_kv: Callable[[List[Any]], None],
    ) -> None:
        self.prefill_with_target(prompt, prefill_step_size, progress, quantize_kv)

    def prefill(self, prompt: mx.array, prefill_step_size: int, quantize_kv: Callable[[List[Any]], None]) -> None:
        """Prefills the target too (see prefill_with_target)."""
        self.prefill_with_target(prompt, prefill_step_size, lambda done, total: None, quantize_kv)

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
