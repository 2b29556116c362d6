"""Feeding models for generation: the generation stream, argument checks, chunked
prefill, the KV quantizer, and `CachedModel` (a model with its cache and what that
cache holds). Every loop uses these (generate, speculative, batching, serving), so a
prompt gives the same caches, bit for bit, in each; drafters.py keeps the drafters."""

import contextlib
import functools
import inspect
import threading
from dataclasses import dataclass
from typing import Any, Callable, Generator, List, Optional, Sequence, Tuple, TypeVar, Union

import mlx.core as mx
import mlx.nn as nn

from .models.cache import check_kv_quantization, maybe_quantize_kv_cache, trim_prompt_cache
from .models.checkpoints import PrefillChunks, maybe_snapshot

Processors = List[Callable[[mx.array, mx.array], mx.array]]

# Generation runs on this stream unless a caller gives another (upstream's name;
# `mlx_lm.generate.generation_stream`), one per thread, so that a server's worker thread
# never shares it.
generation_stream = mx.new_thread_local_stream(mx.default_device())

StreamLike = Union[mx.Stream, mx.ThreadLocalStream, mx.Device, mx.DeviceType]
Item = TypeVar("Item")

# What this thread's generation runs on while a generator given a stream is stepping.
_running = threading.local()


def current_generation_stream() -> StreamLike:
    """The stream this thread's generation work goes to: generation_stream, or the
    `stream` given to the generator that is running a step now (runs_on_stream)."""
    return getattr(_running, "stream", generation_stream)


def on_generation_stream(fn):
    """Build (and evaluate) `fn`'s work on the current generation stream."""

    @functools.wraps(fn)
    def run(*args, **kwargs):
        with mx.stream(current_generation_stream()):
            return fn(*args, **kwargs)

    return run


def check_stream(stream: Optional[StreamLike]) -> StreamLike:
    """`stream` as upstream's generate_step takes it (an mx.Stream, a thread-local stream,
    a device or device type such as mx.cpu; None: generation_stream), checked: returned,
    or ValueError naming the value."""
    if stream is None:
        return generation_stream
    if not isinstance(stream, (mx.Stream, mx.ThreadLocalStream, mx.Device, mx.DeviceType)):
        raise ValueError(
            f"stream must be an mx.Stream, an mx.ThreadLocalStream or a device (e.g. mx.cpu, "
            f"mx.new_stream(mx.default_device())), got {stream!r} ({type(stream).__name__})"
        )
    device = stream if isinstance(stream, mx.Device) else (
        mx.Device(stream) if isinstance(stream, mx.DeviceType) else stream.device)
    if not mx.is_available(device):
        raise ValueError(f"stream {stream!r} is on {device}, which this machine does not have; "
                         f"use mx.cpu or leave stream at its default")
    return stream


def run_on_stream(steps: Generator[Item, None, None], stream: Optional[StreamLike]) -> Generator[Item, None, None]:
    """Yield what `steps` yields, each of its steps (and its close, or an exception
    thrown in at a yield) running with `stream` as the default stream and the current
    generation stream. Between steps the consumer's own default stream is back (upstream
    enters the stream around its whole loop, so its consumers run on it too)."""
    stream = check_stream(stream)
    advance = steps.__next__
    while True:
        with generating_on(stream):
            try:
                item = advance()
            except StopIteration:
                return
        try:
            yield item
            advance = steps.__next__
        except GeneratorExit:
            with generating_on(stream):
                steps.close()
            raise
        except BaseException as error:  # thrown in at the yield: the steps hear of it there
            advance = functools.partial(steps.throw, error)


@contextlib.contextmanager
def generating_on(stream: StreamLike):
    """Within the block, `stream` is this thread's default stream and its generation
    stream (what on_generation_stream functions use): for a loop that is given a stream
    and calls them (run_on_stream; a batch's `next`)."""
    previous = current_generation_stream()
    _running.stream = stream
    try:
        with mx.stream(stream):
            yield
    finally:
        _running.stream = previous


def runs_on_stream(generator_function):
    """For a generator function with a `stream` parameter (upstream's: what generation
    runs on, default generation_stream): the generators it makes run on that stream
    (run_on_stream; the value is checked at the first step, with the other arguments)."""
    signature = inspect.signature(generator_function)

    @functools.wraps(generator_function)
    def make(*args, **kwargs):
        stream = signature.bind(*args, **kwargs).arguments.get("stream", generation_stream)
        return run_on_stream(generator_function(*args, **kwargs), stream)

    return make


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


def put_back(prompt_cache: List[Any], parts: Tuple[List[Any], List[Any]]) -> None:
    """A cache list's entries from its two parts (the target's, the drafter's), which
    the loops feed as copies of its slices: quantizing replaces entries of the lists
    it is given, and the list must hold the quantized ones."""
    prompt_cache[: len(parts[0])], prompt_cache[len(parts[0]) :] = parts


def put_back_first(prompt_cache: List[Any], parts: Tuple[List[Any], List[Any]],
                   progress: Callable[[int, int], None]) -> Callable[[int, int], None]:
    """`progress`, called once `prompt_cache` holds the entries of `parts` (put_back):
    a CheckpointedCache's snapshots (SnapshottingProgress) and a cancelled prefill's
    stored cache must see what was fed. Every chunk's quantizing precedes its progress."""
    def put_back_then_progress(done: int, total: int) -> None:
        put_back(prompt_cache, parts)
        progress(done, total)

    return put_back_then_progress


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
    *,
    also: Sequence[Tuple[nn.Module, List[Any], mx.array]] = (),
    chunks: Optional[PrefillChunks] = None,
) -> mx.array:
    """Feed all prompt positions but the last through the model in chunks; return the
    tokens still to feed (the last one, whose logits start generation).
    `quantize_kv(cache)` runs after each chunk (see maybe_quantize_kv_cache), and
    `progress(done, total)` (it may raise to cancel: the caches then hold whole chunks).
    With `input_embeddings` (T, hidden) the model takes those rows instead of the
    tokens' embeddings; `prompt` is then the T tokens they stand for, or empty.
    `also`: more (model, cache, ids) fed the same chunks of their own ids for the
    prompt (a draft model's), each chunk before `progress` hears of it.
    Chunks: `prefill_step_size` tokens, cut where models/checkpoints.py says for caches
    with untrimmable entries (`chunks`: as for the whole list, where `prompt_cache` is
    a part of it)."""
    total = prompt.size if input_embeddings is None else input_embeddings.shape[0]
    done = 0
    maybe_snapshot(prompt_cache, 0)  # a CheckpointedCache's snapshots (issue 33)
    chunks = chunks or PrefillChunks(prompt_cache, prefill_step_size)
    while total - done > 1:
        n = chunks.size(done, total - done - 1)
        rows = {} if input_embeddings is None else {"input_embeddings": input_embeddings[done : done + n][None]}
        model(prompt[done : done + n][None], cache=prompt_cache, **rows)
        for other, cache, ids in also:
            other(ids[done : done + n][None], cache=cache)
        for cache in [prompt_cache] + [cache for _, cache, _ in also]:
            if quantize_kv is not None:
                quantize_kv(cache)
            mx.eval([c.state for c in cache])
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


def check_can_speculate(model: nn.Module, prompt_cache: List[Any], role: str,
                        who: str = "Speculative decoding") -> None:
    """Every entry must be able to give back rejected tokens: trimmable caches, caches
    that record themselves (sliding windows), or recurrent states whose model's layers
    record rollbacks (`supports_speculative_rollback`). `role`: "target model" or
    "draft model"; `who` asks (e.g. "a draft model in a batch")."""
    # Models written for upstream mlx-lm do not declare the attribute: they don't record.
    layers_record = getattr(type(model), "supports_speculative_rollback", False)
    blocked = sorted({type(c).__name__ for c in prompt_cache if c.needs_layer_records and not layers_record})
    if blocked:
        raise ValueError(
            f"{who} needs every cache of the {role} ({type(model).__module__}) to roll back, but "
            f"{', '.join(blocked)} entries cannot: its layers do not record rollbacks"
        )
