"""Speculative decoding: the one loop (draft -> verify -> accept -> rewind -> emit) for
every drafter in drafters.py, and the checks that come before it. Re-exported by
generate.py, where upstream mlx-lm keeps `speculative_generate_step`."""

import time
from dataclasses import dataclass
from typing import Any, Callable, Generator, List, Optional, Tuple

import mlx.core as mx
import mlx.nn as nn

from .draft_length import DRAFT_LENGTHS, DraftLengthPolicy, LearnedDraftLength
from .speculation_stats import SpeculationStats
from .acceptance import accept, acceptance_rule, point_masses
from .drafters import DraftModel, Drafter, MTPHead, PromptLookup, check_mtp_head
from .feeding import (
    check_can_speculate,
    DEFAULT_PREFILL_STEP_SIZE,
    CachedModel,
    Processors,
    StreamLike,
    check_generation_args,
    generation_stream,
    kv_quantizer,
    on_generation_stream,
    processed_logprobs,
    put_back,
    put_back_first,
    runs_on_stream,
)
from .models import cache
from .models.checkpoints import CheckpointedCache, SnapshottingProgress
from .sample_utils import CategoricalSampler, make_sampler
from .utils import parameter_dtypes


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


def _speculation_prompt_cache(prompt_cache, model, draft_model, max_kv_size, mtp: bool = False) -> List[Any]:
    """The target's cache entries followed by the draft model's or the MTP head's (if
    any): fresh, or checked."""
    models = [model] if draft_model is None else [model, draft_model]
    if prompt_cache is None:
        head = model.make_mtp_cache() if mtp else []
        return [entry for m in models for entry in cache.make_prompt_cache(m, max_kv_size)] + head
    if max_kv_size is not None:
        raise ValueError("max_kv_size cannot be combined with a prompt_cache; size the cache when making it")
    sizes = [len(m.layers) for m in models] + ([len(model.mtp_head.layers)] if mtp else [])
    if len(prompt_cache) != sum(sizes):
        wanted = f"the target's {sizes[0]}" + ("" if len(sizes) == 1 else
                                               f" followed by the {'MTP head' if mtp else 'draft'}'s {sizes[1]}")
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
    mtp: bool = False,
) -> Drafter:
    """The one drafter of a speculative run, from speculative_generate_step's arguments
    (checked before any work); `prompt_cache` is the target's entries, then the draft
    model's or the MTP head's."""
    given = [name for name, present in [("a draft_model", draft_model is not None),
                                        ("prompt_lookup=True", prompt_lookup),
                                        ("mtp=True", mtp),
                                        ("a drafter", drafter is not None)] if present]
    if len(given) != 1:
        raise ValueError(
            "speculative decoding takes exactly one drafter: a draft_model, prompt_lookup=True, mtp=True or a "
            f"drafter; got {' and '.join(given) if given else 'none'}"
        )
    if mtp:
        num_target = len(model.layers)
        # A CheckpointedCache keeps the hidden state the head's next pair reads (MTPHead).
        checkpoints = prompt_cache if isinstance(prompt_cache, CheckpointedCache) else None
        return MTPHead(model, prompt_cache[:num_target], prompt_cache[num_target:], model.args.vocab_size,
                       checkpoints=checkpoints)
    if draft_model is not None:
        draft_cache = prompt_cache[len(model.layers) :]
        check_can_speculate(draft_model, draft_cache, "draft model")
        return DraftModel(draft_model, draft_cache, model.args.vocab_size)
    if prompt_lookup:
        return PromptLookup(max_ngram_size, min_ngram_size)
    if not isinstance(drafter, Drafter):
        raise ValueError(f"drafter must be a Drafter (e.g. PromptLookup()), got {type(drafter).__name__}")
    return drafter


def learned_draft_length(model: nn.Module, draft_model: Optional[nn.Module], drafter_kind: str,
                         sampler: Callable[[mx.array], mx.array], kv_quantization: Tuple,
                         num_draft_tokens: int) -> LearnedDraftLength:
    """What earlier calls of this target and drafter learned about draft lengths in
    this process (draft_length.DRAFT_LENGTHS), fresh for a new pair. Keyed by what
    costs and acceptance depend on: the models (a draft model by identity; an MTP head
    or a lookup by `drafter_kind`, the drafter's class name, with the target), the
    compute dtypes, the KV quantization (kv_bits, kv_group_size, quantized_kv_start)
    and the temperature (None: token matching)."""
    models = [model] if draft_model is None else [model, draft_model]
    temperature = sampler.temp if isinstance(sampler, CategoricalSampler) else None
    setting = ("sequence", drafter_kind, tuple(parameter_dtypes(m) for m in models), kv_quantization, temperature)
    return DRAFT_LENGTHS.get(models, setting, lambda: DraftLengthPolicy(num_draft_tokens).learned)


def verify(target: CachedModel, sequence: List[int], drafts: mx.array, logits_processors: Processors) -> mx.array:
    """One target forward over the last token of `sequence` then the `drafts` (1-D,
    possibly empty): the target's log-probabilities (drafts.size + 1, V) after each of
    those positions, processed (lazy)."""
    inputs = mx.concatenate([mx.array(sequence[target.num_held :], mx.uint32), drafts])
    logits = target.forward(inputs)[-(drafts.size + 1) :]
    history = mx.array(sequence) if logits_processors else None
    return processed_logprobs(logits, history, drafts, logits_processors)


@on_generation_stream
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
    history = mx.array(sequence) if logits_processors else None
    if pending is None:
        inputs = mx.array(sequence[num_in_cache:], mx.uint32)
    else:  # in a stretch the target holds all of `sequence`: feed the pending token alone
        missing = sequence[num_in_cache:]
        inputs = pending.astype(mx.uint32)
        inputs = mx.concatenate([mx.array(missing, mx.uint32), inputs]) if missing else inputs
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
        step_seconds = time.perf_counter() - start  # this interval: summed, the stretch's time
        num_steps, seconds = num_steps + 1, seconds + step_seconds
        policy.update(0, 0, seconds / (num_steps + more))
        stats.add_round(0, 0, step_seconds)
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


@on_generation_stream
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


@on_generation_stream
def decide(round: QueuedRound, sampler: Callable[[mx.array], mx.array]) -> Tuple[int, List[int]]:
    """Decide a round (acceptance.accept), syncing once: (number of drafts accepted,
    the tokens to emit: those drafts and the target's token after them)."""
    num_accepted, token = accept(round.logprobs, round.drafts, round.draft_laws, sampler)
    mx.eval(num_accepted, token, round.drafts)
    num_accepted = num_accepted.item()
    return num_accepted, round.drafts.tolist()[:num_accepted] + [token.item()]


@runs_on_stream
def speculative_generate_step(
    prompt: mx.array,
    model: nn.Module,
    draft_model: Optional[nn.Module] = None,
    stream: Optional[StreamLike] = generation_stream,
    *,
    num_draft_tokens: int = 2,
    max_tokens: int = 256,
    sampler: Optional[Callable[[mx.array], mx.array]] = None,
    logits_processors: Optional[Processors] = None,
    prompt_cache: Optional[List[Any]] = None,
    prefill_step_size: int = DEFAULT_PREFILL_STEP_SIZE,
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
    mtp: bool = False,
) -> Generator[Tuple[int, mx.array, bool], None, None]:
    """Yield (token, logprobs, from_draft): the target's tokens, several per target
    forward when the drafter guesses them.

    The drafter, exactly one of: `draft_model` (a smaller model with the target's
    tokenizer), `prompt_lookup=True` (drafts the tokens that followed the latest
    earlier occurrence of the last `max_ngram_size` .. `min_ngram_size` tokens in the
    prompt and the output; drafters.PromptLookup), or a `drafter` object (e.g. a
    PromptLookup passed to every turn of a conversation continued from a prompt
    cache, so its lookups see the earlier turns too), or `mtp=True` (the target's own
    multi-token-prediction head, Qwen3-Next / Qwen3.5: drafters.MTPHead; the target
    forwards also return their hidden states, which the head is fed).

    Each round the drafter proposes k tokens, k chosen by a DraftLengthPolicy
    (draft_length.py) from the measured acceptance and round times, between 0 (a plain
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
    `prompt_cache` is the target's entries followed by the draft model's or the MTP
    head's (`model.make_mtp_cache()`; none for other drafters). `stats` (optional)
    receives the counts; `kv_bits` etc. quantize KV caches as in `generate_step`. A draft model must use the target's tokenizer (the
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

    `stream` (upstream's fourth argument): what the work runs on, as in generate_step.
    """
    check_generation_args(prompt, max_tokens, prefill_step_size)
    if num_draft_tokens < 1:
        raise ValueError(f"num_draft_tokens must be at least 1, got {num_draft_tokens}")
    if mtp:
        check_mtp_head(model)
    prompt_cache = _speculation_prompt_cache(prompt_cache, model, draft_model, max_kv_size, mtp)
    drafter = make_drafter(model, draft_model, prompt_cache, prompt_lookup=prompt_lookup,
                           max_ngram_size=max_ngram_size, min_ngram_size=min_ngram_size, drafter=drafter, mtp=mtp)
    num_target = len(model.layers)
    target = drafter.run_target(
        CachedModel(model, prompt_cache[:num_target], model.args.vocab_size, model.args.vocab_size)
    )
    check_can_speculate(model, target.cache, "target model")
    sampler = sampler or make_sampler()
    processors = logits_processors or []
    stats = stats if stats is not None else SpeculationStats()
    stats.draft_lengths += [0] * (num_draft_tokens + 1 - len(stats.draft_lengths))  # rounds per k = 0..cap
    stats.acceptance_rule = acceptance_rule(sampler)
    # Adaptive: start from what earlier calls of this pair learned; pinned: from nothing,
    # so a seeded sampled run gives the same tokens whatever ran before it.
    learned = learned_draft_length(model, draft_model, type(drafter).__name__, sampler,
                                   (kv_bits, kv_group_size, quantized_kv_start),
                                   num_draft_tokens) if adaptive_draft_length else None
    policy = DraftLengthPolicy(num_draft_tokens, adaptive=adaptive_draft_length, learned=learned)
    progress = prompt_progress_callback or (lambda done, total: None)
    # The list's two parts, fed as copies (a prompt lookup has no entries of its own).
    parts = (target.cache, drafter.cache if draft_model is not None or mtp else prompt_cache[num_target:])
    if isinstance(prompt_cache, CheckpointedCache):  # the drafter feeds the list in parts: told once a chunk
        progress = put_back_first(prompt_cache, parts, SnapshottingProgress(prompt_cache, progress))
    quantize_kv = kv_quantizer(prompt_cache, kv_bits, kv_group_size, quantized_kv_start)

    drafter.prefill(target, prompt, prefill_step_size, progress, quantize_kv)
    sequence = prompt.tolist()  # the prompt, then every token the target committed to
    num_prompt = len(sequence)
    target.num_held = num_prompt - 1
    num_yielded = 0

    def next_round(num_left: Optional[int]) -> Optional[QueuedRound]:
        """The next drafting round, queued; None if it should be plain (k = 0 or nothing
        to draft). Near max_tokens it drafts at most the tokens left, as upstream does
        (a fully accepted last round then ends on a draft, its bonus token unused)."""
        num_draft = policy.choose() if num_left is None else min(policy.choose(), num_left)
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
            num_accepted, new_tokens = decide(queued, sampler)
            num_draft, logprobs = queued.drafts.size, queued.logprobs
            sequence += new_tokens
            round_seconds = queued.build_seconds + time.perf_counter() - wait_start
            policy.update(num_draft, num_accepted, round_seconds)

            # Rewind to the sequence minus its last token (the drafter may lag behind).
            target.settle(sequence[:-1], feed=False)
            drafter.settle(sequence[:-1])
            stats.add_round(num_draft, num_accepted, round_seconds)
            quantize_kv(target.cache)
            quantize_kv(drafter.cache)

            # Queue the next round, so that it computes while these tokens are handled.
            queued = None
            if num_left is None or len(new_tokens) < num_left:
                queued = next_round(None if num_left is None else num_left - len(new_tokens))

            # Emit.
            for i, token in enumerate(new_tokens[:num_left]):
                num_yielded += 1
                yield token, logprobs[i], i < num_accepted
        clean_stop = True
    except GeneratorExit:
        clean_stop = True  # closed by the consumer at a yield
        raise
    finally:
        _finish_speculation(target, drafter, sequence[: num_prompt + num_yielded], clean_stop)
        put_back(prompt_cache, parts)  # entries quantized on the way


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
