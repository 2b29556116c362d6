"""Text generation: the token loop, streaming with detokenization, and the CLI."""

import argparse
import contextlib
import json
import sys
import time
from dataclasses import dataclass
from typing import Any, Callable, Generator, List, Optional, Tuple, Union

import mlx.core as mx
import mlx.nn as nn

from .models import cache
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
DEFAULT_MODEL = "mlx-community/Llama-3.2-3B-Instruct-4bit"


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
class GenerationResponse:
    """One step of `stream_generate`.

    text: the new text segment; token: the token id; logprobs: log-probabilities over
    the vocabulary for this step; from_draft: proposed by a draft model and accepted;
    prompt_tokens / prompt_tps: prompt size and prefill speed; generation_tokens /
    generation_tps: tokens so far and decode speed; peak_memory: GB;
    finish_reason: "stop" (EOS), "length" (max_tokens) or None while generating.
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
) -> mx.array:
    """Feed all prompt tokens but the last through the model in chunks; return the
    tokens still to feed (the last one, whose logits start generation)."""
    total = prompt.size
    while prompt.size > 1:
        n = min(prefill_step_size, prompt.size - 1)
        model(prompt[:n][None], cache=prompt_cache)
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
    prompt_progress_callback: Optional[Callable[[int, int], None]] = None,
) -> Generator[Tuple[int, mx.array], None, None]:
    """Yield (token, logprobs) for each generated token.

    The prompt (1-D token ids) is prefilled in `prefill_step_size` chunks, then decoding
    is pipelined: the forward of each token is queued before the token is yielded, so
    after every yield `prompt_cache` holds the prompt and every token yielded so far. `max_tokens=-1` generates without limit.
    Logits processors see the whole prompt plus the tokens generated so far.
    """
    _check_generation_args(prompt, max_tokens, prefill_step_size)
    if prompt_cache is None:
        prompt_cache = cache.make_prompt_cache(model, max_kv_size=max_kv_size)
    elif max_kv_size is not None:
        raise ValueError("max_kv_size cannot be combined with a prompt_cache; size the cache when making it")
    sampler = sampler or make_sampler()
    logits_processors = logits_processors or []
    history = prompt if logits_processors else None
    progress = prompt_progress_callback or (lambda done, total: None)

    remaining = prefill(model, prompt, prompt_cache, prefill_step_size, progress)
    y, logprobs = sample_next(model, remaining, prompt_cache, sampler, logits_processors, history)
    mx.async_eval(y, logprobs)
    num_generated = 0
    while True:
        # Feed y before yielding it, so the caller finds it in the cache (and the
        # model computes while the caller handles the token).
        if history is not None:
            history = mx.concatenate([history, y])
        next_y, next_logprobs = sample_next(model, y, prompt_cache, sampler, logits_processors, history)
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
    **kwargs,
) -> Generator[GenerationResponse, None, None]:
    """Generate text, yielding a GenerationResponse per token (see `generate_step` for
    kwargs). Stops at an EOS token or after `max_tokens`; the last response carries
    the finish_reason."""
    if not isinstance(tokenizer, TokenizerWrapper):
        tokenizer = TokenizerWrapper(tokenizer)
    prompt = _encode_prompt(tokenizer, prompt)
    detokenizer = tokenizer.detokenizer
    token_generator = generate_step(prompt, model, max_tokens=max_tokens, **kwargs)

    with wired_limit(model):
        tic = time.perf_counter()
        finish_reason = None
        for n, (token, logprobs) in enumerate(token_generator):
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
            yield GenerationResponse(
                text=detokenizer.last_segment,
                token=token,
                logprobs=logprobs,
                from_draft=False,
                prompt_tokens=prompt.size,
                prompt_tps=prompt_tps,
                generation_tokens=n + 1,
                generation_tps=(n + 1) / (time.perf_counter() - tic),
                peak_memory=mx.get_peak_memory() / 1e9,
            )
        detokenizer.finalize()
        yield GenerationResponse(
            text=detokenizer.last_segment,
            token=token,
            logprobs=logprobs,
            from_draft=False,
            prompt_tokens=prompt.size,
            prompt_tps=prompt_tps,
            generation_tokens=n + 1,
            generation_tps=(n + 1) / (time.perf_counter() - tic),
            peak_memory=mx.get_peak_memory() / 1e9,
            finish_reason=finish_reason,
        )


def generate(
    model: nn.Module,
    tokenizer,
    prompt: Union[str, List[int], mx.array],
    verbose: bool = False,
    **kwargs,
) -> str:
    """Generate and return the whole completion; `verbose` prints it as it streams,
    then the prompt and generation speeds and peak memory."""
    if verbose:
        print("=" * 10)
    text = ""
    for response in stream_generate(model, tokenizer, prompt, **kwargs):
        if verbose:
            print(response.text, end="", flush=True)
        text += response.text
    if verbose:
        print()
        print("=" * 10)
        if not text:
            print("No text generated for this prompt")
        print(f"Prompt: {response.prompt_tokens} tokens, {response.prompt_tps:.3f} tokens-per-sec")
        print(f"Generation: {response.generation_tokens} tokens, {response.generation_tps:.3f} tokens-per-sec")
        print(f"Peak memory: {response.peak_memory:.3f} GB")
    return text


def str2bool(value: str) -> bool:
    lowered = value.lower()
    if lowered in ("true", "t", "yes", "y", "1"):
        return True
    if lowered in ("false", "f", "no", "n", "0"):
        return False
    raise argparse.ArgumentTypeError(f"expected true or false, got {value!r}")


def json_object(value: str) -> dict:
    try:
        parsed = json.loads(value)
    except json.JSONDecodeError as e:
        raise argparse.ArgumentTypeError(f"not valid JSON ({e}): {value!r}") from None
    if not isinstance(parsed, dict):
        raise argparse.ArgumentTypeError(f"expected a JSON object, got {value!r}")
    return parsed


def positive_int(value: str) -> int:
    number = int(value)
    if number < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {value}")
    return number


def setup_arg_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description="Generate text with an LLM")
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
    parser.add_argument("--seed", type=int, default=DEFAULT_SEED, help="PRNG seed")
    parser.add_argument("--ignore-chat-template", action="store_true",
                        help="Feed the prompt as is, without the chat template")
    parser.add_argument("--chat-template-config", type=json_object, default=None,
                        help="JSON object of extra chat template arguments")
    parser.add_argument("--verbose", type=str2bool, default=True,
                        help="Print the text as it streams plus speed and memory (true/false)")
    parser.add_argument("--max-kv-size", type=positive_int, default=None,
                        help="Bound every KV cache to this many tokens (keeps the first 4)")
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
    args = setup_arg_parser().parse_args(argv)
    if args.seed is not None:
        mx.random.seed(args.seed)
    try:
        from .utils import load

        model, tokenizer = load(args.model)
        for token in args.extra_eos_token:
            tokenizer.add_eos_token(int(token) if token.isdigit() else token)
        prompt = sys.stdin.read() if args.prompt == "-" else args.prompt.replace("\\n", "\n").replace("\\t", "\t")
        prompt_tokens = build_prompt(
            tokenizer, prompt, args.system_prompt, not args.ignore_chat_template,
            args.chat_template_config or {},
        )
        sampler = make_sampler(
            args.temp, args.top_p, args.min_p, args.min_tokens_to_keep, top_k=args.top_k,
            xtc_probability=args.xtc_probability, xtc_threshold=args.xtc_threshold,
            xtc_special_tokens=list(tokenizer.eos_token_ids),
        )
        text = generate(
            model, tokenizer, prompt_tokens, verbose=args.verbose, max_tokens=args.max_tokens,
            sampler=sampler, max_kv_size=args.max_kv_size,
        )
    except (ValueError, FileNotFoundError) as e:
        sys.exit(f"Error: {e}")
    if not args.verbose:
        print(text)


if __name__ == "__main__":
    main()
