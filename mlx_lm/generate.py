"""Text generation: the token loop, streaming with detokenization, and the CLI (the
speculative loop lives in speculative.py and is re-exported here, as upstream has it)."""

import argparse
import contextlib
import sys
import time
from dataclasses import dataclass, replace
from typing import Any, Callable, Generator, List, Optional, Tuple, Union

import mlx.core as mx
import mlx.nn as nn

from .cli_args import (
    DEFAULT_MODEL,
    DEFAULT_QUANTIZED_KV_START,  # noqa: F401  (upstream's generate.DEFAULT_QUANTIZED_KV_START)
    HelpFormatter,
    activation_model_config,
    add_drafter_arguments,
    add_dtype_argument,
    add_kv_quantization_arguments,
    add_upstream_generate_arguments,
    check_one_drafter,
    json_object,
    positive_int,
    prompt_text,
    str2bool,
    use_default_chat_template,
)
from .batch_phases import GenerationBatch, PromptProcessingBatch  # noqa: F401  (upstream's home)
from .batching import BatchGenerator, BatchResponse, BatchStats, batch_generate  # noqa: F401  (upstream's home)
from .drafters import PromptLookup, check_mtp_head
from .feeding import (
    DEFAULT_PREFILL_STEP_SIZE,
    StreamLike,
    check_generation_args,
    check_stream,
    generation_stream,
    kv_quantizer,
    on_generation_stream,
    prefill,
    runs_on_stream,
)
from .fast_blas import blas_line
from .generate_utils import BatchCounters, BatchCountersSnapshot  # noqa: F401  (upstream imports them here)
from .models import cache
from .models.cache import (  # noqa: F401  (upstream's generate.py imports them: code reaches them here)
    QuantizedKVCache,
    TokenBuffer,
    can_trim_prompt_cache,
    load_prompt_cache,
    make_prompt_cache, maybe_quantize_kv_cache,
    trim_prompt_cache,
)
from .sample_utils import LogitsProcessor, Sampler, greedy_sampler, make_sampler  # noqa: F401  (as above)
from .speculation_stats import SpeculationStats, telemetry_lines
from .speculative import check_same_tokenizer, speculative_generate_step  # noqa: F401  (upstream's home)
from .stop_sequences import StopSequences
from .tokenizer_utils import TokenizerWrapper
from .text_state_machine import TextStateMachine, make_text_state_machine  # noqa: F401  (upstream's home)
from .utils import does_model_support_input_embeddings, load, maybe_set_recommended_wired_limit  # noqa: F401
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


def make_stop_sequences(tokenizer, stop_words: Optional[List[str]] = None) -> StopSequences:
    """Upstream's builder: the tokenizer's EOS ids, each a one-token stop sequence, and
    each stop word as the tokens it encodes to (without special tokens)."""
    sequences = [(token,) for token in tokenizer.eos_token_ids]
    for word in stop_words or []:
        tokens = tuple(tokenizer.encode(word, add_special_tokens=False))
        if not tokens:
            raise ValueError(f"stop word {word!r} encodes to no tokens; give words with some text")
        sequences.append(tokens)
    return StopSequences(sequences)


@on_generation_stream
def sample_next(
    model: nn.Module,
    tokens: mx.array,
    prompt_cache: List[Any],
    sampler: Callable[[mx.array], mx.array],
    logits_processors: List[Callable[[mx.array, mx.array], mx.array]],
    history: Optional[mx.array],
    input_embeddings: Optional[mx.array] = None,
) -> Tuple[mx.array, mx.array]:
    """Feed `tokens` (1-D; or the rows of `input_embeddings` (T, hidden) in their
    place) and sample after the last: returns (token (1,), logprobs (V,))."""
    rows = {} if input_embeddings is None else {"input_embeddings": input_embeddings[None]}
    logits = model(tokens[None], cache=prompt_cache, **rows)[:, -1, :]
    for processor in logits_processors:
        logits = processor(history, logits)
    logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
    return sampler(logprobs), logprobs.squeeze(0)


@runs_on_stream
def generate_step(
    prompt: mx.array,
    model: nn.Module,
    stream: Optional[StreamLike] = generation_stream,
    *,
    max_tokens: int = 256,
    sampler: Optional[Callable[[mx.array], mx.array]] = None,
    logits_processors: Optional[List[Callable[[mx.array, mx.array], mx.array]]] = None,
    max_kv_size: Optional[int] = None,
    prompt_cache: Optional[List[Any]] = None,
    prefill_step_size: int = DEFAULT_PREFILL_STEP_SIZE,
    kv_bits: Optional[int] = None,
    kv_group_size: int = 64,
    quantized_kv_start: int = 0,
    prompt_progress_callback: Optional[Callable[[int, int], None]] = None,
    input_embeddings: Optional[mx.array] = None,
    prompt_lookup: bool = False,
    max_ngram_size: int = 3,
    num_draft_tokens: Optional[int] = None,
    mtp: bool = False,
) -> Generator[Tuple[int, mx.array], None, None]:
    """Yield (token, logprobs) for each generated token.

    The prompt (1-D token ids) is prefilled in `prefill_step_size` chunks, then decoding
    is pipelined: the forward of each token is queued before the token is yielded, so
    after every yield `prompt_cache` holds the prompt and every token yielded so far.
    `max_tokens=-1` generates without limit.
    Logits processors see the whole prompt plus the tokens generated so far.
    With `kv_bits`, each KVCache becomes a `kv_bits`-bit QuantizedKVCache (groups of
    `kv_group_size`) once it holds `quantized_kv_start` tokens, checked after every
    prefill chunk and every step. `input_embeddings` (T, hidden) are fed in place of
    the prompt's token embeddings (the prompt is then the T tokens they stand for, which
    processors see, or empty); the model must take them (does_model_support_input_embeddings).

    `prompt_lookup=True` decodes speculatively with prompt-lookup drafts (see
    speculative_generate_step; at most `num_draft_tokens`, default 3, a round, looking
    up suffixes of up to `max_ngram_size` tokens): the same tokens under greedy
    decoding and the same law under sampling, faster where the output repeats the
    prompt or itself. `mtp=True` likewise drafts with the model's own
    multi-token-prediction head (drafters.MTPHead), applied up to `num_draft_tokens`
    times a round.

    `stream` (upstream's third argument): what the work runs on, an mx.Stream, a
    thread-local stream or a device such as mx.cpu (None or the default: this thread's
    generation_stream). It is the default stream while the generator computes, and not
    while the caller holds a token.
    """
    if input_embeddings is not None and (prompt_lookup or mtp):
        raise ValueError("prompt_lookup and mtp cannot take input_embeddings: drafting needs the prompt's token ids")
    if prompt_lookup or mtp:
        yield from (
            (token, logprobs)
            for token, logprobs, _ in speculative_generate_step(
                prompt, model, None, stream, prompt_lookup=prompt_lookup, mtp=mtp, max_ngram_size=max_ngram_size,
                num_draft_tokens=DEFAULT_NUM_DRAFT_TOKENS if num_draft_tokens is None else num_draft_tokens,
                max_tokens=max_tokens, sampler=sampler, logits_processors=logits_processors,
                max_kv_size=max_kv_size, prompt_cache=prompt_cache, prefill_step_size=prefill_step_size,
                kv_bits=kv_bits, kv_group_size=kv_group_size, quantized_kv_start=quantized_kv_start,
                prompt_progress_callback=prompt_progress_callback,
            )
        )
        return
    if num_draft_tokens is not None:
        raise ValueError(
            "num_draft_tokens needs prompt_lookup=True or mtp=True (or a draft model: speculative_generate_step)"
        )
    check_generation_args(prompt, max_tokens, prefill_step_size, input_embeddings)
    if input_embeddings is not None and not does_model_support_input_embeddings(model):
        raise ValueError(f"{type(model).__module__} does not take input_embeddings")
    if prompt_cache is None:
        prompt_cache = cache.make_prompt_cache(model, max_kv_size=max_kv_size)
    elif max_kv_size is not None:
        raise ValueError("max_kv_size cannot be combined with a prompt_cache; size the cache when making it")
    quantize_kv = kv_quantizer(prompt_cache, kv_bits, kv_group_size, quantized_kv_start)
    sampler = sampler or make_sampler()
    logits_processors = logits_processors or []
    history = prompt if logits_processors else None
    progress = prompt_progress_callback or (lambda done, total: None)

    num_prompt = prompt.size if input_embeddings is None else input_embeddings.shape[0]
    remaining = prefill(model, prompt, prompt_cache, prefill_step_size, progress, quantize_kv, input_embeddings)
    last_rows = None if input_embeddings is None else input_embeddings[-1:]
    y, logprobs = sample_next(model, remaining, prompt_cache, sampler, logits_processors, history, last_rows)
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
            progress(num_prompt, num_prompt)
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
    draft_model: Optional[nn.Module] = None,
    stream: Optional[StreamLike] = generation_stream,
    **kwargs,
) -> Generator[GenerationResponse, None, None]:
    """Generate text, yielding a GenerationResponse per token. kwargs go to
    `generate_step`, or with a `draft_model` to `speculative_generate_step`
    (`num_draft_tokens` among them), also with `prompt_lookup=True`, `mtp=True` or a `drafter`.
    Stops at an EOS token or after `max_tokens`; the last response carries the
    finish_reason. When it stops, a passed `prompt_cache` holds the prompt and every
    generated token. `stream`: what generation runs on (see generate_step)."""
    stream = check_stream(stream)
    if not isinstance(tokenizer, TokenizerWrapper):
        tokenizer = TokenizerWrapper(tokenizer)
    prompt = _encode_prompt(tokenizer, prompt)
    detokenizer = tokenizer.detokenizer
    stats = None
    drafting = draft_model is not None or kwargs.get("prompt_lookup") or kwargs.get("mtp")
    if not drafting and kwargs.get("drafter") is None:
        if "num_draft_tokens" in kwargs:
            raise ValueError("num_draft_tokens needs a draft_model, prompt_lookup=True, mtp=True or a drafter")
        kwargs.pop("drafter", None)
        kwargs.pop("mtp", None)
        token_generator = (
            (token, logprobs, False)
            for token, logprobs in generate_step(prompt, model, stream, max_tokens=max_tokens, **kwargs)
        )
    else:
        if "input_embeddings" in kwargs:
            raise ValueError("speculative decoding cannot take input_embeddings: drafters need the prompt's token ids")
        stats = SpeculationStats()
        token_generator = speculative_generate_step(
            prompt, model, draft_model, stream, max_tokens=max_tokens, stats=stats, **kwargs
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

    with wired_limit(model, [stream]), contextlib.closing(token_generator):
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
            for line in telemetry_lines(spec):
                print(line)
        print(f"Peak memory: {response.peak_memory:.3f} GB")
    return text


def setup_arg_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="mlx_lm.generate", description="Generate text with an LLM", formatter_class=HelpFormatter
    )
    parser.add_argument("--model", type=str, default=DEFAULT_MODEL,
                        help="Local model directory or Hugging Face repo id")
    parser.add_argument("--adapter-path", type=str, default=None,
                        help="LoRA/DoRA adapters for --model (adapter_config.json + adapters.safetensors)")
    parser.add_argument("--extra-eos-token", type=str, nargs="+", default=(),
                        help="Extra tokens (strings or ids) that end generation")
    parser.add_argument("--system-prompt", default=None, help="System prompt for the chat template")
    parser.add_argument("--prefill-response", default=None,
                        help="The start of the answer, which the model continues (needs the chat template)")
    parser.add_argument("--trust-remote-code", action="store_true",
                        help="Let the tokenizers run their repo's own code (transformers' option)")
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
    parser.add_argument("--prefill-step-size", type=positive_int, default=DEFAULT_PREFILL_STEP_SIZE,
                        help="Prompt tokens per forward; fewer lower the peak memory of long prompts")
    parser.add_argument("--max-kv-size", type=positive_int, default=None,
                        help="Bound every KV cache to this many tokens, keeping the first 4 (default: unbounded)")
    parser.add_argument("--prompt-cache-file", default=None,
                        help="Continue from a prompt cache made by mlx_lm.cache_prompt for this --model "
                        "(also with --draft-model)")
    add_kv_quantization_arguments(parser)
    parser.add_argument("--draft-model", type=str, default=None,
                        help="A smaller model sharing the tokenizer, for speculative decoding (default: none)")
    add_drafter_arguments(parser)
    parser.add_argument("--num-draft-tokens", type=positive_int, default=DEFAULT_NUM_DRAFT_TOKENS,
                        help="At most this many tokens drafted per target forward (each round picks 0..N "
                        "from the measured acceptance and speed)")
    parser.add_argument("--fixed-draft-length", action="store_true",
                        help="Draft exactly --num-draft-tokens every round (also implied by --seed with "
                        "--temp > 0, so that a seeded sampled run replays exactly)")
    parser.add_argument("--pipeline", action="store_true", help="Under mlx.launch, split the model's layers "
                        "across the ranks (pipeline parallel) instead of sharding every layer")
    add_dtype_argument(parser)
    add_upstream_generate_arguments(parser)
    return parser


def build_prompt(tokenizer: TokenizerWrapper, prompt: str, system_prompt: Optional[str],
                 use_chat_template: bool, template_args: dict, prefill_response: Optional[str] = None) -> List[int]:
    """The prompt's ids: under the chat template (a user turn after `system_prompt`,
    then the answer's start: the generation prompt, or `prefill_response` continued),
    else the text as it is."""
    if not (use_chat_template and tokenizer.has_chat_template):
        if prefill_response is not None:
            raise ValueError(f"--prefill-response {prefill_response!r} needs the chat template; this one is "
                             + ("off (--ignore-chat-template)" if tokenizer.has_chat_template else "missing"))
        return tokenizer.encode(prompt)
    messages = [{"role": "system", "content": system_prompt}] if system_prompt else []
    messages.append({"role": "user", "content": prompt})
    continuing = {} if prefill_response is None else {"continue_final_message": True}
    if prefill_response is not None:
        messages.append({"role": "assistant", "content": prefill_response})
    text = tokenizer.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=prefill_response is None, **continuing, **template_args
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
    check_one_drafter(parser, args)
    if not args.prompt_lookup and args.max_ngram_size != parser.get_default("max_ngram_size"):
        parser.error("--max-ngram-size needs --prompt-lookup")
    from . import distributed

    group = distributed.world()
    if group.size() > 1 and args.prompt_cache_file is not None:
        parser.error("--prompt-cache-file holds an unsharded cache; it cannot be used under mlx.launch")
    if group.size() > 1 and args.mtp:
        parser.error("--mtp cannot be used under mlx.launch: the MTP head is not sharded")
    try:
        with distributed.fail_together(group):
            if group.size() > 1:  # every rank samples from rank 0's seed
                args.seed = distributed.shared_seed(args.seed, group)
            if args.seed is not None:
                mx.random.seed(args.seed)
            text = run(args)
            if group.size() > 1:
                distributed.wait_for_all(group)
    except (ValueError, FileNotFoundError) as e:
        sys.exit(f"Error: {e}")
    if not args.verbose and group.rank() == 0:
        print(text)


def run(args: argparse.Namespace) -> str:
    """Load the model (and draft) and generate as the parsed command line says.

    Under mlx.launch (more than one rank) the target is sharded over all ranks (split
    by layers with --pipeline), the draft runs whole on each, the draft length is
    pinned to --num-draft-tokens (see `distributed`) and only rank 0 prints."""
    from . import distributed
    from .cache_prompt import load_cached_prompt
    from .utils import compute_dtype, parameter_dtypes, sharded_load

    group = distributed.world()
    if group.size() > 1:
        if args.adapter_path is not None:
            raise ValueError(f"--adapter-path {args.adapter_path!r}: adapters are not sharded; under mlx.launch "
                             "fuse them first (mlx_lm.fuse) and give the fused model")
        tokenizer_config = {"trust_remote_code": True} if args.trust_remote_code else None
        model, tokenizer = sharded_load(args.model, **distributed.split_groups(group, args.pipeline), dtype=args.dtype,
                                        tokenizer_config=tokenizer_config, model_config=activation_model_config(args))
    else:
        model, tokenizer = load(args.model, adapter_path=args.adapter_path, dtype=args.dtype,
                                trust_remote_code=args.trust_remote_code, model_config=activation_model_config(args))
    verbose = args.verbose and group.rank() == 0
    draft_model = None
    if args.draft_model is not None:
        draft_model, draft_tokenizer = load(args.draft_model, dtype=args.dtype,
                                            trust_remote_code=args.trust_remote_code)
        check_same_tokenizer(tokenizer, draft_tokenizer, args.model, args.draft_model)
    if args.use_default_chat_template:
        use_default_chat_template(tokenizer)
    for token in args.extra_eos_token:
        tokenizer.add_eos_token(int(token) if token.isdigit() else token)
    sampler = make_sampler(
        args.temp, args.top_p, args.min_p, args.min_tokens_to_keep, top_k=args.top_k,
        xtc_probability=args.xtc_probability, xtc_threshold=args.xtc_threshold,
        xtc_special_tokens=list(tokenizer.eos_token_ids),
    )
    kwargs = dict(max_tokens=args.max_tokens, sampler=sampler, prefill_step_size=args.prefill_step_size)
    speculating = draft_model is not None or args.prompt_lookup or args.mtp
    if speculating:
        # Which sample a seed gives depends on the draft lengths: a seeded sampled run pins
        # them. Ranks pin them too: the adaptive policy times rounds on each rank's clock.
        fixed = args.fixed_draft_length or (args.seed is not None and args.temp > 0) or group.size() > 1
        kwargs.update(draft_model=draft_model, num_draft_tokens=args.num_draft_tokens,
                      adaptive_draft_length=not fixed)
    if args.mtp:
        kwargs["mtp"] = True
    if args.kv_bits is not None:
        kwargs.update(kv_bits=args.kv_bits, kv_group_size=args.kv_group_size,
                      quantized_kv_start=args.quantized_kv_start)

    def format_prompt(text: str) -> List[int]:
        return build_prompt(tokenizer, text, args.system_prompt, not args.ignore_chat_template,
                            args.chat_template_config or {}, args.prefill_response)

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
    if args.prompt_cache_file is not None and args.mtp:
        # The file holds the target's entries; the head starts empty (it attends to the
        # pairs of this run only).
        check_mtp_head(model)
        kwargs["prompt_cache"] = kwargs["prompt_cache"] + model.make_mtp_cache()
    if args.prompt_lookup:
        # The lookup also sees what the prompt cache file holds.
        context = [] if args.prompt_cache_file is None else cached.tokens or []
        kwargs["drafter"] = PromptLookup(args.max_ngram_size, context=context)
    if verbose:
        print(f"Compute dtype: {parameter_dtypes(model)} ({compute_dtype(args.dtype)[1]})")
        line = blas_line()
        if line is not None:
            print(line)
        if group.size() > 1:
            print(distributed.split_line(model, group, args.pipeline))
    return generate(model, tokenizer, prompt_tokens, verbose=verbose, **kwargs)


if __name__ == "__main__":
    main()
