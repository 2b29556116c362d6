"""Text generation: the token loop, streaming with detokenization, and the CLI."""

import argparse
import contextlib
import functools
import sys
import time
from dataclasses import dataclass, replace
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
from .models import cache
from .models.cache import maybe_quantize_kv_cache
from .sample_utils import make_sampler
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
    """Counts of a speculative run: draft tokens proposed and accepted, target forwards."""

    num_drafted: int = 0
    num_accepted: int = 0
    num_target_forwards: int = 0

    @property
    def acceptance_rate(self) -> float:
        return self.num_accepted / self.num_drafted if self.num_drafted else 0.0


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


def prefill(
    model: nn.Module,
    prompt: mx.array,
    prompt_cache: List[Any],
    prefill_step_size: int,
    progress: Callable[[int, int], None],
    quantize_kv: Optional[Callable[[List[Any]], None]] = None,
) -> mx.array:
    """Feed all prompt tokens but the last through the model in chunks; return the
    tokens still to feed (the last one, whose logits start generation).
    `quantize_kv(prompt_cache)` runs after each chunk (see maybe_quantize_kv_cache)."""
    total = prompt.size
    while prompt.size > 1:
        n = min(prefill_step_size, prompt.size - 1)
        model(prompt[:n][None], cache=prompt_cache)
        if quantize_kv is not None:
            quantize_kv(prompt_cache)
        mx.eval([c.state for c in prompt_cache])
        prompt = prompt[n:]
        progress(total - prompt.size, total)
        mx.clear_cache()
    return prompt


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
) -> Generator[Tuple[int, mx.array], None, None]:
    """Yield (token, logprobs) for each generated token.

    The prompt (1-D token ids) is prefilled in `prefill_step_size` chunks, then decoding
    is pipelined: the forward of each token is queued before the token is yielded, so
    after every yield `prompt_cache` holds the prompt and every token yielded so far. `max_tokens=-1` generates without limit.
    Logits processors see the whole prompt plus the tokens generated so far.
    With `kv_bits`, each KVCache becomes a `kv_bits`-bit QuantizedKVCache (groups of
    `kv_group_size`) once it holds `quantized_kv_start` tokens, checked after every
    prefill chunk and every step.
    """
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


def check_same_vocabulary(model: nn.Module, draft_model: nn.Module) -> None:
    target_vocab, draft_vocab = model.args.vocab_size, draft_model.args.vocab_size
    if target_vocab != draft_vocab:
        raise ValueError(
            f"Draft model vocabulary ({draft_vocab}) != target vocabulary ({target_vocab}); "
            "the draft must share the target's tokenizer"
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
    """The target's cache entries followed by the draft's: fresh, or checked."""
    if prompt_cache is None:
        return cache.make_prompt_cache(model, max_kv_size) + cache.make_prompt_cache(draft_model, max_kv_size)
    if max_kv_size is not None:
        raise ValueError("max_kv_size cannot be combined with a prompt_cache; size the cache when making it")
    num_target, num_draft = len(model.layers), len(draft_model.layers)
    if len(prompt_cache) != num_target + num_draft:
        raise ValueError(
            f"prompt_cache has {len(prompt_cache)} entries; speculation needs the target's "
            f"{num_target} followed by the draft's {num_draft}"
        )
    return prompt_cache


def verify(
    model: nn.Module,
    tokens: mx.array,
    drafts: mx.array,
    prompt_cache: List[Any],
    sampler: Callable[[mx.array], mx.array],
    logits_processors: List[Callable[[mx.array, mx.array], mx.array]],
    history: List[int],
) -> Tuple[List[int], mx.array]:
    """One target forward over `tokens` then the `drafts` (1-D, possibly empty); sample
    the target's own token after each of the last drafts.size + 1 positions.
    Returns (tokens, logprobs (drafts.size + 1, V))."""
    num_scored = drafts.size + 1
    logits = model(mx.concatenate([tokens, drafts])[None], cache=prompt_cache)[0, -num_scored:]
    if logits_processors:
        rows = []
        for i in range(num_scored):
            row, seen = logits[i : i + 1], mx.concatenate([mx.array(history), drafts[:i]])
            for processor in logits_processors:
                row = processor(seen, row)
            rows.append(row)
        logits = mx.concatenate(rows)
    logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
    return sampler(logprobs).tolist(), logprobs


def accepted_prefix(drafts: List[int], targets: List[int]) -> int:
    """How many leading drafts equal the target's own choices."""
    n = 0
    while n < len(drafts) and drafts[n] == targets[n]:
        n += 1
    return n


def sync_cache(model: nn.Module, prompt_cache: List[Any], num_held: int, tokens: List[int]) -> None:
    """Make a cache that holds tokens[:num_held] (or more) hold exactly `tokens`. A feed
    stays lazy: it is computed when the cache is next used, never if it is not."""
    if num_held > len(tokens):
        cache.trim_prompt_cache(prompt_cache, num_held - len(tokens))
    elif num_held < len(tokens):
        model(mx.array(tokens[num_held:])[None], cache=prompt_cache)


def speculative_generate_step(
    prompt: mx.array,
    model: nn.Module,
    draft_model: nn.Module,
    *,
    num_draft_tokens: int = 2,
    max_tokens: int = 256,
    sampler: Optional[Callable[[mx.array], mx.array]] = None,
    logits_processors: Optional[List[Callable[[mx.array, mx.array], mx.array]]] = None,
    prompt_cache: Optional[List[Any]] = None,
    prefill_step_size: int = 512,
    kv_bits: Optional[int] = None,
    kv_group_size: int = 64,
    quantized_kv_start: int = 0,
    max_kv_size: Optional[int] = None,
    prompt_progress_callback: Optional[Callable[[int, int], None]] = None,
    stats: Optional[SpeculationStats] = None,
) -> Generator[Tuple[int, mx.array, bool], None, None]:
    """Yield (token, logprobs, from_draft): the target's tokens, several per target
    forward when the draft guesses them.

    Each round the draft proposes up to `num_draft_tokens`, one target forward scores
    them all, the longest prefix equal to the target's own samples is accepted and the
    target's next token follows it. Every emitted token is the target's choice, so greedy
    output equals `generate_step`'s. Rejected tokens are rolled back exactly on every
    cache kind (DESIGN.md §2). `prompt_cache` is the target's entries followed by the
    draft's. When the generator finishes or is closed, both caches hold the prompt and
    every yielded token, exactly as after `generate_step`; after an exception they hold
    that sequence minus its last token. `stats` (optional) receives the counts;
    `kv_bits` etc. quantize KV caches as in `generate_step`.
    """
    _check_generation_args(prompt, max_tokens, prefill_step_size)
    if num_draft_tokens < 1:
        raise ValueError(f"num_draft_tokens must be at least 1, got {num_draft_tokens}")
    check_same_vocabulary(model, draft_model)
    prompt_cache = _speculation_prompt_cache(prompt_cache, model, draft_model, max_kv_size)
    num_target = len(model.layers)
    target_cache, draft_cache = prompt_cache[:num_target], prompt_cache[num_target:]
    check_can_speculate(model, target_cache, "target model")
    check_can_speculate(draft_model, draft_cache, "draft model")
    sampler = sampler or make_sampler()
    processors = logits_processors or []
    stats = stats if stats is not None else SpeculationStats()
    progress = prompt_progress_callback or (lambda done, total: None)
    quantize_kv = kv_quantizer(prompt_cache, kv_bits, kv_group_size, quantized_kv_start)

    prefill(draft_model, prompt, draft_cache, prefill_step_size, lambda done, total: None, quantize_kv)
    prefill(model, prompt, target_cache, prefill_step_size, progress, quantize_kv)
    sequence = prompt.tolist()  # the prompt, then every token the target committed to
    num_prompt = len(sequence)
    target_len = draft_len = num_prompt - 1  # tokens of `sequence` each cache holds
    num_yielded = target_fed = draft_fed = 0
    for c in target_cache + draft_cache:
        c.start_speculation(rollback_window=num_draft_tokens + 1)
    clean_stop = False
    try:
        while max_tokens == -1 or num_yielded < max_tokens:
            # Round counters first: `finally` undoes exactly what this round fed.
            target_fed = draft_fed = 0
            remaining = num_draft_tokens + 1 if max_tokens == -1 else max_tokens - num_yielded
            num_draft = min(num_draft_tokens, remaining - 1)

            # Draft: catch up on committed tokens, then propose num_draft.
            draft_input, drafts = mx.array(sequence[draft_len:], mx.uint32), []
            for _ in range(num_draft):
                history = mx.concatenate([mx.array(sequence), *drafts]) if processors else None
                token, _ = sample_next(draft_model, draft_input, draft_cache, sampler, processors, history)
                draft_fed += draft_input.size
                drafts.append(token.astype(mx.uint32))
                # Start computing each draft as soon as it is built, so building the next
                # step overlaps it (measured 6-12% faster per round than one eval).
                mx.async_eval(drafts[-1])
                draft_input = drafts[-1]
            drafts = mx.concatenate(drafts) if drafts else mx.array([], mx.uint32)

            # Verify all drafts in one target forward (queued behind the lazy drafts, no
            # sync between), accept the agreeing prefix.
            targets, logprobs = verify(
                model, mx.array(sequence[target_len:], mx.uint32), drafts, target_cache, sampler,
                processors, sequence,
            )
            drafts = drafts.tolist()
            target_fed = len(sequence) - target_len + len(drafts)
            num_accepted = accepted_prefix(drafts, targets)

            # Rewind both caches to what the target accepted, then commit.
            target_keep = min(target_fed, len(sequence) - target_len + num_accepted)
            draft_keep = min(draft_fed, len(sequence) - draft_len + num_accepted)
            cache.trim_prompt_cache(target_cache, target_fed - target_keep)
            cache.trim_prompt_cache(draft_cache, draft_fed - draft_keep)
            target_len, draft_len = target_len + target_keep, draft_len + draft_keep
            target_fed = draft_fed = 0
            new_tokens = drafts[:num_accepted] + [targets[num_accepted]]
            sequence += new_tokens
            stats.num_drafted += num_draft
            stats.num_accepted += num_accepted
            stats.num_target_forwards += 1
            quantize_kv(target_cache)
            quantize_kv(draft_cache)

            for i, token in enumerate(new_tokens):
                num_yielded += 1
                yield token, logprobs[i], i < num_accepted
        clean_stop = True
    except GeneratorExit:
        clean_stop = True  # closed by the consumer at a yield
        raise
    finally:
        sides = [(model, target_cache, target_len, target_fed), (draft_model, draft_cache, draft_len, draft_fed)]
        _finish_speculation(sides, sequence[: num_prompt + num_yielded], clean_stop)
        prompt_cache[:] = target_cache + draft_cache  # entries quantized on the way


def _finish_speculation(sides, delivered: List[int], clean_stop: bool) -> None:
    """Undo the unfinished round of each side (model, cache, tokens held, tokens fed this
    round); after a clean stop also bring both caches to exactly the delivered tokens.
    After an exception nothing may mask it: rewinding is best effort, no model runs."""
    try:
        for _, prompt_cache, _, num_fed in sides:
            cache.trim_prompt_cache(prompt_cache, num_fed)
        if clean_stop:
            for side_model, prompt_cache, num_held, _ in sides:
                sync_cache(side_model, prompt_cache, num_held, delivered)
    except Exception:
        if clean_stop:
            raise
    finally:
        for _, prompt_cache, _, _ in sides:
            for c in prompt_cache:
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
    (`num_draft_tokens` among them). Stops at an EOS token or after `max_tokens`; the
    last response carries the finish_reason. When it stops, a passed `prompt_cache`
    holds the prompt and every generated token."""
    if not isinstance(tokenizer, TokenizerWrapper):
        tokenizer = TokenizerWrapper(tokenizer)
    prompt = _encode_prompt(tokenizer, prompt)
    detokenizer = tokenizer.detokenizer
    stats = None
    if draft_model is None:
        if "num_draft_tokens" in kwargs:
            raise ValueError("num_draft_tokens needs a draft_model")
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
                f"({spec.acceptance_rate:.1%}), {per_forward:.2f} tokens per target forward"
            )
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
    parser.add_argument("--num-draft-tokens", type=positive_int, default=3,
                        help="Tokens the draft model proposes per target forward")
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
    draft_model = None if args.draft_model is None else load(args.draft_model, dtype=args.dtype)[0]
    for token in args.extra_eos_token:
        tokenizer.add_eos_token(int(token) if token.isdigit() else token)
    sampler = make_sampler(
        args.temp, args.top_p, args.min_p, args.min_tokens_to_keep, top_k=args.top_k,
        xtc_probability=args.xtc_probability, xtc_threshold=args.xtc_threshold,
        xtc_special_tokens=list(tokenizer.eos_token_ids),
    )
    kwargs = dict(max_tokens=args.max_tokens, sampler=sampler)
    if draft_model is not None:
        kwargs.update(draft_model=draft_model, num_draft_tokens=args.num_draft_tokens)
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
    if args.verbose:
        print(f"Compute dtype: {parameter_dtypes(model)} ({compute_dtype(args.dtype)[1]})")
    return generate(model, tokenizer, prompt_tokens, verbose=args.verbose, **kwargs)


if __name__ == "__main__":
    main()
