"""Text generation: the token loop, streaming with detokenization, and the CLI."""

import argparse
import contextlib
import functools
import sys
import time
from dataclasses import dataclass, field, replace
from typing import Any, Callable, Generator, List, Optional, Tuple, Union

import mlx.core as mx
import mlx.nn as nn

from .cli_args import (
    DEFAULT_MODEL,
    DEFAULT_QUANTIZED_KV_START,
    HelpFormatter,
    add_dtype_argument,
    json_object,
    positive_int,
    prompt_text,
    str2bool,
)
from .batching import BatchGenerator, BatchResponse, BatchStats, batch_generate  # noqa: F401  (upstream's home)
from .models import cache
from .models.cache import maybe_quantize_kv_cache
from .drafters import (
    CachedModel,
    DraftLengthPolicy,
    DraftModel,
    Drafter,
    Processors,
    PromptLookup,
    point_masses,
    prefill,
    processed_logprobs,
    speculative_sample,
)
from .sample_utils import CategoricalSampler, make_sampler
from .tokenizer_utils import TokenizerWrapper

DEFAULT_PROMPT = "hello"
DEFAULT_MAX_TOKENS = 100
DEFAULT_TEMP = 0.0
DEFAULT_TOP_P = 1.0
DEFAULT_MIN_P = 0.0
DEFAULT_TOP_K = 0
DEFAULT_XTC_PROBABILITY = 0.0
DEFAULT_XTC_THRESHOLD = 0.1
DEFAULT_MIN_TOKENS_TO_KEEP = 1
DEFAULT_SEED = None
DEFAULT_NUM_DRAFT_TOKENS = 3


@contextlib.contextmanager
def wired_limit(model: nn.Module, streams: Optional[List[Any]] = None):
    """On Metal, wire the model's memory for the duration so it is not paged out.

    Elsewhere (CPU, CUDA) there is no wired memory and this does nothing."""
    if not mx.metal.is_available():
        yield
        return
    model_bytes = sum(p.nbytes for _, p in _flat_parameters(model))
    max_rec = mx.metal.device_info()["max_recommended_working_set_size"]
    old_limit = mx.set_wired_limit(min(model_bytes, max_rec))
    try:
        yield
    finally:
        for s in streams or []:
            mx.synchronize(s)
        mx.set_wired_limit(old_limit)


def _flat_parameters(model: nn.Module):
    from mlx.utils import tree_flatten

    return tree_flatten(model.parameters())


@dataclass
class SpeculationStats:
    """Counts of a speculative run: draft tokens proposed and accepted, target forwards;
    and how drafts were accepted: "speculative sampling" (the sampler gives its law) or
    "token matching" (greedy, or a sampler function)."""

    num_drafted: int = 0
    num_accepted: int = 0
    num_target_forwards: int = 0
    acceptance_rule: str = "token matching"
    draft_lengths: List[int] = field(default_factory=list)  # rounds that drafted k, per k

    @property
    def acceptance_rate(self) -> float:
        return self.num_accepted / self.num_drafted if self.num_drafted else 0.0

    @property
    def mean_draft_length(self) -> float:
        rounds = sum(self.draft_lengths)
        return sum(k * n for k, n in enumerate(self.draft_lengths)) / rounds if rounds else 0.0


@dataclass
class GenerationResponse:
    """One step of `stream_generate`.

    text: the new text segment; token: the token id; logprobs: log-probabilities over
    the vocabulary for this step; from_draft: proposed by a draft model and accepted;
    prompt_tokens / prompt_tps: prompt size and prefill speed; generation_tokens /
    generation_tps: tokens so far and decode speed; peak_memory: GB;
    finish_reason: "stop" (EOS), "length" (max_tokens) or None while generating;
    speculation: draft counts so far when a draft model is used.
    """

    text: str
    token: int
    logprobs: mx.array
    from_draft: bool
    prompt_tokens: int
    prompt_tps: float
    generation_tokens: int
    generation_tps: float
    peak_memory: float
    finish_reason: Optional[str] = None
    speculation: Optional[SpeculationStats] = None


def _check_generation_args(prompt: mx.array, max_tokens: int, prefill_step_size: int) -> None:
    if prompt.ndim != 1 or prompt.size == 0:
        raise ValueError(f"prompt must be a non-empty 1-D array of token ids, got shape {prompt.shape}")
    if max_tokens != -1 and max_tokens < 1:
        raise ValueError(f"max_tokens must be positive or -1 (no limit), got {max_tokens}")
    if prefill_step_size < 1:
        raise ValueError(f"prefill_step_size must be positive, got {prefill_step_size}")


def sample_next(
    model: nn.Module,
    tokens: mx.array,
    prompt_cache: List[Any],
    sampler: Callable[[mx.array], mx.array],
    logits_processors: List[Callable[[mx.array, mx.array], mx.array]],
    history: Optional[mx.array],
) -> Tuple[mx.array, mx.array]:
    """Feed `tokens` (1-D) and sample after the last: returns (token (1,), logprobs (V,))."""
    logits = model(tokens[None], cache=prompt_cache)[:, -1, :]
    for processor in logits_processors:
        logits = processor(history, logits)
    logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
    return sampler(logprobs), logprobs.squeeze(0)


def kv_quantizer(
    prompt_cache: List[Any], kv_bits: Optional[int], kv_group_size: int, quantized_kv_start: int
) -> Callable[[List[Any]], None]:
    """Check the KV quantization settings against the cache before any work; returns
    the function that quantizes a cache list's entries once they are long enough."""
    if kv_bits is not None:
        cache.check_kv_quantization(prompt_cache, kv_group_size, kv_bits, quantized_kv_start)
    return functools.partial(
        maybe_quantize_kv_cache, quantized_kv_start=quantized_kv_start, kv_group_size=kv_group_size, kv_bits=kv_bits
    )


def generate_step(
    prompt: mx.array,
    model: nn.Module,
    *,
    max_tokens: int = 256,
    sampler: Optional[Callable[[mx.array], mx.array]] = None,
    logits_processors: Optional[List[Callable[[mx.array, mx.array], mx.array]]] = None,
    max_kv_size: Optional[int] = None,
    prompt_cache: Optional[List[Any]] = None,
    prefill_step_size: int = 2048,
    kv_bits: Optional[int] = None,
    kv_group_size: int = 64,
    quantized_kv_start: int = 0,
    prompt_progress_callback: Optional[Callable[[int, int], None]] = None,
    prompt_lookup: bool = False,
    max_ngram_size: int = 3,
    num_draft_tokens: Optional[int] = None,
) -> Generator[Tuple[int, mx.array], None, None]:
    """Yield (token, logprobs) for each generated token.

    The prompt (1-D token ids) is prefilled in `prefill_step_size` chunks, then decoding
    is pipelined: the forward of each token is queued before the token is yielded, so
    after every yield `prompt_cache` holds the prompt and every token yielded so far. `max_tokens=-1` generates without limit.
    Logits processors see the whole prompt plus the tokens generated so far.
    With `kv_bits`, each KVCache becomes a `kv_bits`-bit QuantizedKVCache (groups of
    `kv_group_size`) once it holds `quantized_kv_start` tokens, checked after every
    prefill chunk and every step.

    `prompt_lookup=True` decodes speculatively with prompt-lookup drafts (see
    speculative_generate_step; at most `num_draft_tokens`, default 3, a round, looking
    up suffixes of up to `max_ngram_size` tokens): the same tokens under greedy
    decoding and the same law under sampling, faster where the output repeats the
    prompt or itself.
    """
    if prompt_lookup:
        yield from (
            (token, logprobs)
            for token, logprobs, _ in speculative_generate_step(
                prompt, model, prompt_lookup=True, max_ngram_size=max_ngram_size,
                num_draft_tokens=DEFAULT_NUM_DRAFT_TOKENS if num_draft_tokens is None else num_draft_tokens,
                max_tokens=max_tokens, sampler=sampler, logits_processors=logits_processors,
                max_kv_size=max_kv_size, prompt_cache=prompt_cache, prefill_step_size=prefill_step_size,
                kv_bits=kv_bits, kv_group_size=kv_group_size, quantized_kv_start=quantized_kv_start,
                prompt_progress_callback=prompt_progress_callback,
            )
        )
        return
    if num_draft_tokens is not None:
        raise ValueError("num_draft_tokens needs prompt_lookup=True (or a draft model: speculative_generate_step)")
    _check_generation_args(prompt, max_tokens, prefill_step_size)
    if prompt_cache is None:
        prompt_cache = cache.make_prompt_cache(model, max_kv_size=max_kv_size)
    elif max_kv_size is not None:
        raise ValueError("max_kv_size cannot be combined with a prompt_cache; size the cache when making it")
    quantize_kv = kv_quantizer(prompt_cache, kv_bits, kv_group_size, quantized_kv_start)
    sampler = sampler or make_sampler()
    logits_processors = logits_processors or []
    history = prompt if logits_processors else None
    progress = prompt_progress_callback or (lambda done, total: None)

    remaining = prefill(model, prompt, prompt_cache, prefill_step_size, progress, quantize_kv)
    y, logprobs = sample_next(model, remaining, prompt_cache, sampler, logits_processors, history)
    quantize_kv(prompt_cache)
    mx.async_eval(y, logprobs)
    num_generated = 0
    while True:
        # Feed y before yielding it, so the caller finds it in the cache (and the
        # model computes while the caller handles the token).
        if history is not None:
            history = mx.concatenate([history, y])
        next_y, next_logprobs = sample_next(model, y, prompt_cache, sampler, logits_processors, history)
        quantize_kv(prompt_cache)
        mx.async_eval(next_y, next_logprobs)
        if num_generated == 0:
            mx.eval(y)
            progress(prompt.size, prompt.size)
        yield y.item(), logprobs
        num_generated += 1
        if num_generated == max_tokens:
            break
        if num_generated % 256 == 0:
            mx.clear_cache()
        y, logprobs = next_y, next_logprobs


def check_same_tokenizer(tokenizer, draft_tokenizer, target_name: str, draft_name: str) -> None:
    """Raise ValueError unless the draft's tokenizer gives every token the target's id
    and agrees on the EOS, BOS and pad ids. Loaders call this (the CLI and the server);
    the embedding tables may still be padded to different sizes (see vocabulary_sizes)."""
    problem = _vocabulary_difference(tokenizer.get_vocab(), draft_tokenizer.get_vocab())
    specials = [
        ("EOS", tokenizer.eos_token_id, draft_tokenizer.eos_token_id),
        ("BOS", tokenizer.bos_token_id, draft_tokenizer.bos_token_id),
        ("pad", tokenizer.pad_token_id, draft_tokenizer.pad_token_id),
    ]
    for role, target_id, draft_id in specials:
        if problem is None and target_id != draft_id:
            problem = f"{role} id {target_id} for the target, {draft_id} for the draft"
    if problem is not None:
        raise ValueError(
            f"draft tokenizer ({draft_name}) differs from the target's ({target_name}): {problem}; "
            "use a draft model made with the target's tokenizer"
        )


def _vocabulary_difference(target_vocab: dict, draft_vocab: dict) -> Optional[str]:
    """How two token -> id maps differ, in words, or None if they are equal."""
    target_tokens = {i: token for token, i in target_vocab.items()}
    draft_tokens = {i: token for token, i in draft_vocab.items()}
    ids = sorted(target_tokens.keys() | draft_tokens.keys())
    differing = [i for i in ids if target_tokens.get(i) != draft_tokens.get(i)]
    if not differing:
        return None
    first = differing[0]
    return (
        f"{len(differing)} of {len(ids)} token ids differ, e.g. id {first} is "
        f"{target_tokens.get(first, 'missing')!r} for the target, {draft_tokens.get(first, 'missing')!r} for the draft"
    )


def check_can_speculate(model: nn.Module, prompt_cache: List[Any], role: str) -> None:
    """Every entry must be able to give back rejected tokens: trimmable caches, caches
    that record themselves (sliding windows), or recurrent states whose model's layers
    record rollbacks (`supports_speculative_rollback`)."""
    # Models written for upstream mlx-lm do not declare the attribute: they don't record.
    layers_record = getattr(type(model), "supports_speculative_rollback", False)
    blocked = sorted({type(c).__name__ for c in prompt_cache if c.needs_layer_records and not layers_record})
    if blocked:
        raise ValueError(
            f"Speculative decoding needs every cache of the {role} ({type(model).__module__}) "
            f"to roll back, but {', '.join(blocked)} entries cannot: its layers do not record rollbacks"
        )


def _speculation_prompt_cache(prompt_cache, model, draft_model, max_kv_size) -> List[Any]:
    """The target's cache entries followed by the draft model's (if any): fresh, or checked."""
    models = [model] if draft_model is None else [model, draft_model]
    if prompt_cache is None:
        return [entry for m in models for entry in cache.make_prompt_cache(m, max_kv_size)]
    if max_kv_size is not None:
        raise ValueError("max_kv_size cannot be combined with a prompt_cache; size the cache when making it")
    sizes = [len(m.layers) for m in models]
    if len(prompt_cache) != sum(sizes):
        wanted = f"the target's {sizes[0]}" + ("" if draft_model is None else f" followed by the draft's {sizes[1]}")
        raise ValueError(f"prompt_cache has {len(prompt_cache)} entries; speculation needs {wanted}")
    return prompt_cache


def make_drafter(
    model: nn.Module,
    draft_model: Optional[nn.Module],
    prompt_cache: List[Any],
    *,
    prompt_lookup: bool,
    max_ngram_size: int,
    min_ngram_size: int,
    drafter: Optional[Drafter],
) -> Drafter:
    """The one drafter of a speculative run, from speculative_generate_step's arguments
    (checked before any work); `prompt_cache` is the target's entries, then the draft
    model's."""
    given = [name for name, present in [("a draft_model", draft_model is not None),
                                        ("prompt_lookup=True", prompt_lookup),
                                        ("a drafter", drafter is not None)] if present]
    if len(given) != 1:
        raise ValueError(
            "speculative decoding takes exactly one drafter: a draft_model, prompt_lookup=True or a drafter; "
            f"got {' and '.join(given) if given else 'none'}"
        )
    if draft_model is not None:
        draft_cache = prompt_cache[len(model.layers) :]
        check_can_speculate(draft_model, draft_cache, "draft model")
        return DraftModel(draft_model, draft_cache, model.args.vocab_size)
    if prompt_lookup:
        return PromptLookup(max_ngram_size, min_ngram_size)
    if not isinstance(drafter, Drafter):
        raise ValueError(f"drafter must be a Drafter (e.g. PromptLookup()), got {type(drafter).__name__}")
    return drafter


def verify(target: CachedModel, sequence: List[int], drafts: mx.array, logits_processors: Processors) -> mx.array:
    """One target forward over the last token of `sequence` then the `drafts` (1-D,
    possibly empty): the target's log-probabilities (drafts.size + 1, V) after each of
    those positions, processed (lazy)."""
    inputs = mx.concatenate([mx.array(sequence[target.num_held :], mx.uint32), drafts])
    logits = target.forward(inputs)[-(drafts.size + 1) :]
    history = mx.array(sequence) if logits_processors else None
    return processed_logprobs(logits, history, drafts, logits_processors)


def plain_step(
    target: CachedModel,
    sequence: List[int],
    pending: Optional[mx.array],
    sampler: Callable[[mx.array], mx.array],
    logits_processors: Processors,
) -> Tuple[mx.array, mx.array]:
    """Queue one plain target step (lazy): feed what the target has not seen of
    `sequence`, then `pending` (a sampled token not yet in `sequence`, (1,), or None),
    and sample the token after it from the target alone. Returns (token (1,), logprobs (V,))."""
    num_in_cache = target.num_held + target.num_fed
    inputs = mx.array(sequence[num_in_cache:], mx.uint32)
    history = mx.array(sequence) if logits_processors else None
    if pending is not None:
        inputs = mx.concatenate([inputs, pending.astype(mx.uint32)])
        history = None if history is None else mx.concatenate([history, pending])
    logits = target.forward(inputs)[-1:]
    logprobs = processed_logprobs(logits, history, mx.array([], mx.uint32), logits_processors)
    return sampler(logprobs), logprobs[0]


def plain_stretch(
    target: CachedModel,
    sequence: List[int],
    keep_plain: Callable[[], bool],
    policy: DraftLengthPolicy,
    stats: SpeculationStats,
    sampler: Callable[[mx.array], mx.array],
    logits_processors: Processors,
    quantize_kv: Callable[[List[Any]], None],
    limit: Optional[int],
    start: float,
) -> Generator[Tuple[int, mx.array], None, None]:
    """Yield (token, logprobs) from the target alone while `keep_plain()` (drafting
    would lose, or there is nothing to draft), at most `limit` tokens (None: no
    limit), pipelined as in generate_step: each step queues the next (feeding its own
    token) before syncing, so at a yield the target holds `sequence`, every token
    yielded included; after the last, all but it (a round's state). Appends to
    `sequence`; the drafter is not called (it catches up when it next drafts).
    `keep_plain` sees `sequence` one token behind (the newest is still computing).
    `start`: when the first step began.

    Each step is learned as the stretch's mean time per step so far, counting the
    step queued after it: pipelined, a step's own interval is no measure of it, since
    queueing the next one computes most of it (MLX's CPU backend returns from
    async_eval only once few tasks are left), so the first interval holds about two
    steps' work and the last almost none."""
    token_array, token_logprobs = plain_step(target, sequence, None, sampler, logits_processors)
    mx.async_eval(token_array)
    num_steps, seconds = 0, 0.0
    while True:
        more = (limit is None or num_steps + 1 < limit) and keep_plain()
        if more:
            next_array, next_logprobs = plain_step(target, sequence, token_array, sampler, logits_processors)
            mx.async_eval(next_array)
        token = token_array.item()
        sequence.append(token)
        target.num_held, target.num_fed = target.num_held + target.num_fed, 0
        num_steps, seconds = num_steps + 1, seconds + time.perf_counter() - start
        policy.update(0, 0, seconds / (num_steps + more))
        stats.num_target_forwards += 1
        stats.draft_lengths = policy.counts[:]
        quantize_kv(target.cache)
        yield token, token_logprobs
        if not more:
            return
        start = time.perf_counter()  # the consumer's time is not the step's
        token_array, token_logprobs = next_array, next_logprobs


@dataclass
class QueuedRound:
    """A drafting round whose drafts and verify are computing, not yet decided.
    `draft_laws`: the laws the drafts were drawn from (speculative sampling), None for
    token matching; `build_seconds`: host time spent queueing it."""

    drafts: mx.array
    draft_laws: Optional[mx.array]
    logprobs: mx.array
    build_seconds: float


def queue_round(
    target: CachedModel,
    drafter: Drafter,
    sequence: List[int],
    num_draft: int,
    sampler: Callable[[mx.array], mx.array],
    logits_processors: Processors,
) -> QueuedRound:
    """Draft up to `num_draft` tokens after `sequence` and queue their verify in one
    target forward, behind the lazy drafts; computing starts at once, nothing syncs."""
    start = time.perf_counter()
    drafts, draft_laws = drafter.propose(sequence, num_draft, sampler, logits_processors)
    if not isinstance(sampler, CategoricalSampler):
        draft_laws = None  # token matching
    elif draft_laws is None:
        draft_laws = point_masses(drafts, target.num_columns)
    logprobs = verify(target, sequence, drafts, logits_processors)
    mx.async_eval(logprobs)
    return QueuedRound(drafts, draft_laws, logprobs, time.perf_counter() - start)


def accept(
    logprobs: mx.array,
    drafts: mx.array,
    draft_laws: Optional[mx.array],
    sampler: Callable[[mx.array], mx.array],
) -> Tuple[int, List[int]]:
    """Decide a round, syncing once: (number of drafts accepted, the tokens to emit:
    those drafts and the token after them). `logprobs` (K + 1, V) are the target's.

    With the laws the drafts were drawn from (a CategoricalSampler), speculative
    sampling (drafters.speculative_sample). Otherwise token matching: the sampler draws
    the target's own token at every position and the agreeing prefix is kept; exact for
    any sampler, and for greedy decoding token-identical to plain decoding.
    """
    if draft_laws is None:
        targets = sampler(logprobs).tolist()
        drafts = drafts.tolist()
        num_accepted = accepted_prefix(drafts, targets)
        return num_accepted, drafts[:num_accepted] + [targets[num_accepted]]
    num_accepted, token = speculative_sample(sampler.distribution(logprobs), draft_laws, drafts)
    mx.eval(num_accepted, token, drafts)
    num_accepted = num_accepted.item()
    return num_accepted, drafts.tolist()[:num_accepted] + [token.item()]


def accepted_prefix(drafts: List[int], targets: List[int]) -> int:
    """How many leading drafts equal the target's own choices."""
    n = 0
    while n < len(drafts) and drafts[n] == targets[n]:
        n += 1
    return n


def speculative_generate_step(
    prompt: mx.array,
    model: nn.Module,
    draft_model: Optional[nn.Module] = None,
    *,
    num_draft_tokens: int = 2,
    max_tokens: int = 256,
    sampler: Optional[Callable[[mx.array], mx.array]] = None,
    logits_processors: Optional[Processors] = None,
    prompt_cache: Optional[List[Any]] = None,
    prefill_step_size: int = 512,
    kv_bits: Optional[int] = None,
    kv_group_size: int = 64,
    quantized_kv_start: int = 0,
    max_kv_size: Optional[int] = None,
    prompt_progress_callback: Optional[Callable[[int, int], None]] = None,
    stats: Optional[SpeculationStats] = None,
    adaptive_draft_length: bool = True,
    prompt_lookup: bool = False,
    max_ngram_size: int = 3,
    min_ngram_size: int = 1,
    drafter: Optional[Drafter] = None,
) -> Generator[Tuple[int, mx.array, bool], None, None]:
    """Yield (token, logprobs, from_draft): the target's tokens, several per target
    forward when the drafter guesses them.

    The drafter, exactly one of: `draft_model` (a smaller model with the target's
    tokenizer), `prompt_lookup=True` (drafts the tokens that followed the latest
    earlier occurrence of the last `max_ngram_size` .. `min_ngram_size` tokens in the
    prompt and the output; drafters.PromptLookup), or a `drafter` object (e.g. a
    PromptLookup passed to every turn of a conversation continued from a prompt
    cache, so its lookups see the earlier turns too).

    Each round the drafter proposes k tokens, k chosen by a DraftLengthPolicy
    (drafters.py) from the measured acceptance and round times, between 0 (a plain
    target step, when drafting would lose) and `num_draft_tokens`;
    `adaptive_draft_length=False` drafts `num_draft_tokens` every round. Where the
    drafter has nothing to propose (a lookup that finds no match) the round is a plain
    target step too. k never changes greedy output; under sampling the law is the
    target's whatever k is, but which sample a seed gives depends on k, so a seeded
    run that must replay exactly pins it. One target forward scores the drafts, a
    prefix of them is accepted and a token of the target follows it. Each round is
    queued before the previous round's tokens are yielded, so it computes while the
    consumer handles them. The output has the law of `generate_step`'s with the same
    sampler and processors:
    - a sampler from `make_sampler(temp > 0, ...)` (a CategoricalSampler, which gives
      its law): speculative sampling. A draft model draws each token from its own law
      q (every filter and processor applied; a lookup draft is a point mass), the
      target's laws p come from the verify forward, a draft is kept with probability
      min(1, p/q), a rejected one replaced by a draw from norm(max(0, p - q))
      (drafters.py). Acceptance is sum min(p, q).
    - greedy, or any other callable: token matching. The sampler picks the draft
      model's tokens and the target's own token at every verified position, and the
      longest agreeing prefix is accepted: greedy output equals `generate_step`'s
      token for token. Acceptance at temp > 0 is only about sum p*q; to measure that,
      wrap a CategoricalSampler in a plain function.
    Rejected tokens are rolled back exactly on every cache kind (DESIGN.md §2).
    `prompt_cache` is the target's entries followed by the draft model's (none for
    other drafters). `stats` (optional) receives the counts; `kv_bits` etc. quantize KV
    caches as in `generate_step`. A draft model must use the target's tokenizer (the
    loaders check it with check_same_tokenizer); its embedding table may be padded to
    another size: it proposes only ids both tables hold, and is fed 0 for any id
    beyond its table.

    What the caches hold, target and draft model alike (and what a PromptLookup has
    indexed):
    - when the generator finishes or is closed at any yield: the prompt and every
      yielded token, exactly as after `generate_step` (feeding the last one lazily);
    - after an exception, also KeyboardInterrupt and one thrown in at a yield: the
      prompt and every yielded token but the last (before the first yield: the prompt
      minus its last token). The target gets there by trimming only; the draft model
      too, unless it lags behind (plain rounds do not feed it, nor does a fully
      accepted round its last proposal; its next forward catches up), when the
      missing tokens are fed lazily (computed when the cache is next used; if that
      fails too it stays short). The original exception propagates.
    Not covered: an exception during prefill, or an interrupt that lands inside a
    model's forward (between its layers) or between a trim and its recount, leaves the
    caches partly fed; discard them.
    """
    _check_generation_args(prompt, max_tokens, prefill_step_size)
    if num_draft_tokens < 1:
        raise ValueError(f"num_draft_tokens must be at least 1, got {num_draft_tokens}")
    prompt_cache = _speculation_prompt_cache(prompt_cache, model, draft_model, max_kv_size)
    drafter = make_drafter(model, draft_model, prompt_cache, prompt_lookup=prompt_lookup,
                           max_ngram_size=max_ngram_size, min_ngram_size=min_ngram_size, drafter=drafter)
    num_target = len(model.layers)
    target = CachedModel(model, prompt_cache[:num_target], model.args.vocab_size, model.args.vocab_size)
    check_can_speculate(model, target.cache, "target model")
    sampler = sampler or make_sampler()
    processors = logits_processors or []
    stats = stats if stats is not None else SpeculationStats()
    stats.acceptance_rule = "speculative sampling" if isinstance(sampler, CategoricalSampler) else "token matching"
    policy = DraftLengthPolicy(num_draft_tokens, adaptive=adaptive_draft_length)
    progress = prompt_progress_callback or (lambda done, total: None)
    quantize_kv = kv_quantizer(prompt_cache, kv_bits, kv_group_size, quantized_kv_start)

    drafter.prefill(prompt, prefill_step_size, quantize_kv)
    prefill(model, prompt, target.cache, prefill_step_size, progress, quantize_kv)
    sequence = prompt.tolist()  # the prompt, then every token the target committed to
    num_prompt = len(sequence)
    target.num_held = num_prompt - 1
    num_yielded = 0

    def next_round(num_left: Optional[int]) -> Optional[QueuedRound]:
        """The next drafting round, queued; None if it should be plain (k = 0, nothing
        to draft, or only one token left)."""
        num_draft = policy.choose() if num_left is None else min(policy.choose(), num_left - 1)
        if num_draft < 1 or not drafter.can_draft(sequence):
            return None
        return queue_round(target, drafter, sequence, num_draft, sampler, processors)

    def keep_plain() -> bool:
        return policy.choose_after_plain() == 0 or not drafter.can_draft(sequence)

    # A round is queued before the previous round's tokens are yielded, so rolling
    # back to a yield may undo two rounds.
    for c in target.cache + drafter.cache:
        c.start_speculation(rollback_window=2 * (num_draft_tokens + 1))
    clean_stop = False
    try:
        queued = None
        while max_tokens == -1 or num_yielded < max_tokens:
            num_left = None if max_tokens == -1 else max_tokens - num_yielded
            if queued is None:
                queued = next_round(num_left)
            if queued is None:
                for token, token_logprobs in plain_stretch(target, sequence, keep_plain, policy, stats, sampler,
                                                           processors, quantize_kv, num_left, time.perf_counter()):
                    num_yielded += 1
                    yield token, token_logprobs, False
                continue

            # Accept a prefix of the drafts and the target's token after it (the sync).
            wait_start = time.perf_counter()
            num_accepted, new_tokens = accept(queued.logprobs, queued.drafts, queued.draft_laws, sampler)
            num_draft, logprobs = queued.drafts.size, queued.logprobs
            sequence += new_tokens
            policy.update(num_draft, num_accepted, queued.build_seconds + time.perf_counter() - wait_start)

            # Rewind to the sequence minus its last token (the drafter may lag behind).
            target.settle(sequence[:-1], feed=False)
            drafter.settle(sequence[:-1])
            stats.num_drafted += num_draft
            stats.num_accepted += num_accepted
            stats.num_target_forwards += 1
            stats.draft_lengths = policy.counts[:]
            quantize_kv(target.cache)
            quantize_kv(drafter.cache)

            # Queue the next round, so that it computes while these tokens are handled.
            queued = None
            if num_left is None or len(new_tokens) < num_left:
                queued = next_round(None if num_left is None else num_left - len(new_tokens))

            # Emit.
            for i, token in enumerate(new_tokens):
                num_yielded += 1
                yield token, logprobs[i], i < num_accepted
        clean_stop = True
    except GeneratorExit:
        clean_stop = True  # closed by the consumer at a yield
        raise
    finally:
        _finish_speculation(target, drafter, sequence[: num_prompt + num_yielded], clean_stop)
        prompt_cache[:num_target] = target.cache  # entries quantized on the way
        if draft_model is not None:
            prompt_cache[num_target:] = drafter.cache


def _finish_speculation(target: CachedModel, drafter: Drafter, delivered: List[int], clean_stop: bool) -> None:
    """Bring target and drafter to the contract of speculative_generate_step: after a
    clean stop exactly `delivered`; after an exception `delivered` minus its last
    token, and nothing raised here may mask the exception. `delivered` ends before
    anything fed for a round not yet yielded, so the target gets there by trimming;
    a drafter that lags behind is fed (lazily)."""
    tokens = delivered if clean_stop else delivered[:-1]
    try:
        for finish in (lambda: target.settle(tokens, feed=True), lambda: drafter.finish(tokens)):
            try:
                finish()
            except Exception:
                if clean_stop:
                    raise
    finally:
        for c in target.cache + drafter.cache:
            c.stop_speculation()


def _encode_prompt(tokenizer: TokenizerWrapper, prompt: Union[str, List[int], mx.array]) -> mx.array:
    if isinstance(prompt, str):
        # Chat templates already start with BOS; adding another would shift the model.
        bos = tokenizer.bos_token
        add_special = bos is None or not prompt.startswith(bos)
        return mx.array(tokenizer.encode(prompt, add_special_tokens=add_special))
    return mx.array(prompt)


def stream_generate(
    model: nn.Module,
    tokenizer,
    prompt: Union[str, List[int], mx.array],
    max_tokens: int = 256,
    draft_model: Optional[nn.Module] = None,
    **kwargs,
) -> Generator[GenerationResponse, None, None]:
    """Generate text, yielding a GenerationResponse per token. kwargs go to
    `generate_step`, or with a `draft_model` to `speculative_generate_step`
    (`num_draft_tokens` among them), also with `prompt_lookup=True` or a `drafter`.
    Stops at an EOS token or after `max_tokens`; the last response carries the
    finish_reason. When it stops, a passed `prompt_cache` holds the prompt and every
    generated token."""
    if not isinstance(tokenizer, TokenizerWrapper):
        tokenizer = TokenizerWrapper(tokenizer)
    prompt = _encode_prompt(tokenizer, prompt)
    detokenizer = tokenizer.detokenizer
    stats = None
    if draft_model is None and not kwargs.get("prompt_lookup") and kwargs.get("drafter") is None:
        if "num_draft_tokens" in kwargs:
            raise ValueError("num_draft_tokens needs a draft_model, prompt_lookup=True or a drafter")
        kwargs.pop("drafter", None)
        token_generator = (
            (token, logprobs, False)
            for token, logprobs in generate_step(prompt, model, max_tokens=max_tokens, **kwargs)
        )
    else:
        stats = SpeculationStats()
        token_generator = speculative_generate_step(
            prompt, model, draft_model, max_tokens=max_tokens, stats=stats, **kwargs
        )

    def response(token, logprobs, from_draft, n, finish_reason=None):
        return GenerationResponse(
            text=detokenizer.last_segment,
            token=token,
            logprobs=logprobs,
            from_draft=from_draft,
            prompt_tokens=prompt.size,
            prompt_tps=prompt_tps,
            generation_tokens=n + 1,
            generation_tps=(n + 1) / (time.perf_counter() - tic),
            peak_memory=mx.get_peak_memory() / 1e9,
            finish_reason=finish_reason,
            speculation=None if stats is None else replace(stats),
        )

    with wired_limit(model), contextlib.closing(token_generator):
        tic = time.perf_counter()
        finish_reason = None
        for n, (token, logprobs, from_draft) in enumerate(token_generator):
            if n == 0:
                prompt_tps = prompt.size / (time.perf_counter() - tic)
                tic = time.perf_counter()
            if token in tokenizer.eos_token_ids:
                finish_reason = "stop"
            else:
                detokenizer.add_token(token)
                if n + 1 == max_tokens:
                    finish_reason = "length"
            if finish_reason is not None:
                break
            yield response(token, logprobs, from_draft, n)
    # Closed above, so caches are settled before the last response goes out.
    detokenizer.finalize()
    yield response(token, logprobs, from_draft, n, finish_reason)


def generate(
    model: nn.Module,
    tokenizer,
    prompt: Union[str, List[int], mx.array],
    verbose: bool = False,
    **kwargs,
) -> str:
    """Generate and return the whole completion; `verbose` prints it as it streams,
    then the prompt and generation speeds and peak memory."""
    text = ""
    for response in stream_generate(model, tokenizer, prompt, **kwargs):
        if verbose:
            if response.generation_tokens == 1:  # not before: an invalid call prints nothing
                print("=" * 10)
            print(response.text, end="", flush=True)
        text += response.text
    if verbose:
        print()
        print("=" * 10)
        if not text:
            print("No text generated for this prompt")
        print(f"Prompt: {response.prompt_tokens} tokens, {response.prompt_tps:.3f} tokens-per-sec")
        print(f"Generation: {response.generation_tokens} tokens, {response.generation_tps:.3f} tokens-per-sec")
        if response.speculation is not None:
            spec = response.speculation
            per_forward = response.generation_tokens / max(spec.num_target_forwards, 1)
            print(
                f"Speculation: {spec.num_accepted}/{spec.num_drafted} draft tokens accepted "
                f"({spec.acceptance_rate:.1%}), {per_forward:.2f} tokens per target forward ({spec.acceptance_rule})"
            )
            histogram = ", ".join(f"k={k}: {n}" for k, n in enumerate(spec.draft_lengths) if n)
            print(f"Draft length: mean {spec.mean_draft_length:.2f} per round ({histogram})")
        print(f"Peak memory: {response.peak_memory:.3f} GB")
    return text


def setup_arg_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="mlx_lm.generate", description="Generate text with an LLM", formatter_class=HelpFormatter
    )
    parser.add_argument("--model", type=str, default=DEFAULT_MODEL,
                        help="Local model directory or Hugging Face repo id")
    parser.add_argument("--extra-eos-token", type=str, nargs="+", default=(),
                        help="Extra tokens (strings or ids) that end generation")
    parser.add_argument("--system-prompt", default=None, help="System prompt for the chat template")
    parser.add_argument("--prompt", "-p", default=DEFAULT_PROMPT, help="Prompt text, or '-' for stdin")
    parser.add_argument("--max-tokens", "-m", type=int, default=DEFAULT_MAX_TOKENS,
                        help="Maximum tokens to generate (-1: no limit)")
    parser.add_argument("--temp", type=float, default=DEFAULT_TEMP, help="Sampling temperature")
    parser.add_argument("--top-p", type=float, default=DEFAULT_TOP_P, help="Nucleus sampling threshold")
    parser.add_argument("--min-p", type=float, default=DEFAULT_MIN_P, help="Min-p sampling threshold")
    parser.add_argument("--top-k", type=int, default=DEFAULT_TOP_K, help="Top-k sampling (0: off)")
    parser.add_argument("--xtc-probability", type=float, default=DEFAULT_XTC_PROBABILITY,
                        help="Probability of XTC sampling")
    parser.add_argument("--xtc-threshold", type=float, default=DEFAULT_XTC_THRESHOLD,
                        help="Probability threshold of XTC sampling")
    parser.add_argument("--min-tokens-to-keep", type=int, default=DEFAULT_MIN_TOKENS_TO_KEEP,
                        help="Minimum tokens min-p keeps")
    parser.add_argument("--seed", type=int, default=DEFAULT_SEED, help="PRNG seed (default: unseeded)")
    parser.add_argument("--ignore-chat-template", action="store_true",
                        help="Feed the prompt as is, without the chat template")
    parser.add_argument("--chat-template-config", type=json_object, default=None,
                        help="JSON object of extra chat template arguments")
    parser.add_argument("--verbose", type=str2bool, default=True,
                        help="Print the text as it streams plus speed and memory (true/false)")
    parser.add_argument("--max-kv-size", type=positive_int, default=None,
                        help="Bound every KV cache to this many tokens, keeping the first 4 (default: unbounded)")
    parser.add_argument("--prompt-cache-file", default=None,
                        help="Continue from a prompt cache made by mlx_lm.cache_prompt for this --model "
                        "(also with --draft-model)")
    parser.add_argument("--kv-bits", type=int, default=None,
                        help="Quantize the KV cache to this many bits (default: not quantized)")
    parser.add_argument("--kv-group-size", type=int, default=64, help="Group size of KV cache quantization")
    parser.add_argument("--quantized-kv-start", type=int, default=DEFAULT_QUANTIZED_KV_START,
                        help="Quantize the KV cache once it holds this many tokens (with --kv-bits)")
    parser.add_argument("--draft-model", type=str, default=None,
                        help="A smaller model sharing the tokenizer, for speculative decoding (default: none)")
    parser.add_argument("--prompt-lookup", action="store_true",
                        help="Speculative decoding without a draft model: draft the tokens that followed the "
                        "latest earlier occurrence of the last few tokens in the prompt and the output")
    parser.add_argument("--max-ngram-size", type=positive_int, default=3,
                        help="With --prompt-lookup: the longest suffix looked up, in tokens")
    parser.add_argument("--num-draft-tokens", type=positive_int, default=DEFAULT_NUM_DRAFT_TOKENS,
                        help="At most this many tokens drafted per target forward (each round picks 0..N "
                        "from the measured acceptance and speed)")
    parser.add_argument("--fixed-draft-length", action="store_true",
                        help="Draft exactly --num-draft-tokens every round (also implied by --seed with "
                        "--temp > 0, so that a seeded sampled run replays exactly)")
    add_dtype_argument(parser)
    return parser


def build_prompt(tokenizer: TokenizerWrapper, prompt: str, system_prompt: Optional[str],
                 use_chat_template: bool, template_args: dict) -> List[int]:
    if not (use_chat_template and tokenizer.has_chat_template):
        return tokenizer.encode(prompt)
    messages = [{"role": "system", "content": system_prompt}] if system_prompt else []
    messages.append({"role": "user", "content": prompt})
    text = tokenizer.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=True, **template_args
    )
    return tokenizer.encode(text, add_special_tokens=False)


def main(argv: Optional[List[str]] = None) -> None:
    parser = setup_arg_parser()
    args = parser.parse_args(argv)
    if args.max_tokens != -1 and args.max_tokens < 1:
        parser.error(f"--max-tokens must be positive, or -1 for no limit; got {args.max_tokens}")
    if args.prompt_cache_file is not None and args.max_kv_size is not None:
        parser.error("--max-kv-size cannot be combined with --prompt-cache-file: the cache file's size "
                     "was fixed when it was made (mlx_lm.cache_prompt --max-kv-size)")
    if args.prompt_lookup and args.draft_model is not None:
        parser.error("--prompt-lookup and --draft-model are two drafters; give one")
    if not args.prompt_lookup and args.max_ngram_size != parser.get_default("max_ngram_size"):
        parser.error("--max-ngram-size needs --prompt-lookup")
    if args.seed is not None:
        mx.random.seed(args.seed)
    try:
        text = run(args)
    except (ValueError, FileNotFoundError) as e:
        sys.exit(f"Error: {e}")
    if not args.verbose:
        print(text)


def run(args: argparse.Namespace) -> str:
    """Load the model (and draft) and generate as the parsed command line says."""
    from .cache_prompt import load_cached_prompt
    from .utils import compute_dtype, load, parameter_dtypes

    model, tokenizer = load(args.model, dtype=args.dtype)
    draft_model = None
    if args.draft_model is not None:
        draft_model, draft_tokenizer = load(args.draft_model, dtype=args.dtype)
        check_same_tokenizer(tokenizer, draft_tokenizer, args.model, args.draft_model)
    for token in args.extra_eos_token:
        tokenizer.add_eos_token(int(token) if token.isdigit() else token)
    sampler = make_sampler(
        args.temp, args.top_p, args.min_p, args.min_tokens_to_keep, top_k=args.top_k,
        xtc_probability=args.xtc_probability, xtc_threshold=args.xtc_threshold,
        xtc_special_tokens=list(tokenizer.eos_token_ids),
    )
    kwargs = dict(max_tokens=args.max_tokens, sampler=sampler)
    speculating = draft_model is not None or args.prompt_lookup
    if speculating:
        # Which sample a seed gives depends on the draft lengths: a seeded sampled run pins them.
        fixed = args.fixed_draft_length or (args.seed is not None and args.temp > 0)
        kwargs.update(draft_model=draft_model, num_draft_tokens=args.num_draft_tokens,
                      adaptive_draft_length=not fixed)
    if args.kv_bits is not None:
        kwargs.update(kv_bits=args.kv_bits, kv_group_size=args.kv_group_size,
                      quantized_kv_start=args.quantized_kv_start)

    def format_prompt(text: str) -> List[int]:
        return build_prompt(tokenizer, text, args.system_prompt, not args.ignore_chat_template,
                            args.chat_template_config or {})

    prompt = prompt_text(args.prompt)
    if args.prompt_cache_file is None:
        kwargs["max_kv_size"] = args.max_kv_size
        prompt_tokens = format_prompt(prompt)
    else:
        cached = load_cached_prompt(args.prompt_cache_file, model, args.model)
        kwargs["prompt_cache"], prompt_tokens = cached.resume(tokenizer, prompt, format_prompt)
    if not prompt_tokens:
        raise ValueError(
            f"The prompt is empty (--prompt {args.prompt!r} gives no tokens); give the text with "
            "--prompt, or --prompt - to read it from stdin"
        )
    if args.prompt_cache_file is not None and draft_model is not None:
        # Speculation's cache is the target's entries followed by the draft's; the file
        # holds the target's, the draft is brought to the same tokens here.
        target_cache = kwargs["prompt_cache"]
        quantize_kv = kv_quantizer(target_cache, args.kv_bits, args.kv_group_size, args.quantized_kv_start)
        kwargs["prompt_cache"] = target_cache + cached.cache_for(draft_model, quantize_kv)
    if args.prompt_lookup:
        # The lookup also sees what the prompt cache file holds.
        context = [] if args.prompt_cache_file is None else cached.tokens or []
        kwargs["drafter"] = PromptLookup(args.max_ngram_size, context=context)
    if args.verbose:
        print(f"Compute dtype: {parameter_dtypes(model)} ({compute_dtype(args.dtype)[1]})")
    return generate(model, tokenizer, prompt_tokens, verbose=args.verbose, **kwargs)


if __name__ == "__main__":
    main()
