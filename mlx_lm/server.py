"""`mlx_lm.server`: an OpenAI-compatible HTTP server on the standard library.

Endpoints: POST /v1/chat/completions (also /chat/completions), POST /v1/completions,
GET /v1/models, GET /health. Streaming is by server-sent events: `data: {json}` chunks,
a last chunk carrying finish_reason, a usage chunk when `stream_options.include_usage`,
then `data: [DONE]`; `: keepalive <done>/<total>` comments go out during prefill.

Serving. The model (and `--draft-model`) is loaded once. Request handler threads
parse, validate and tokenize (tokenizing needs no MLX); every MLX computation runs on
one worker thread that takes jobs from a queue, so generation is serialised and
responses never interleave.

Limits. A prompt longer than the model's context (`--max-prompt-tokens`) is refused
with a 400 on the handler thread, before any model work; a text too long to fit even
at the vocabulary's longest token per token is refused before tokenizing. Answers are
clipped to the context left after the prompt. Stop strings are bounded in number and
length (openai_api.py), and the prompt cache in entries and bytes (by default a
quarter of the memory free after loading).

Cancellation. A client that disconnects (noticed at a failed write, or while waiting by
polling the socket: end of input may be a half-close, so it is tested with a write the
client ignores) has its job cancelled. The worker checks after every prefill
step, of the target and the draft alike (the server prefills both itself, a step of
each at a time, because `stream_generate` cannot cancel a draft prefill), and after
every generated token; it then closes the generator, or stops prefilling, and stores
the cache under exactly the tokens it holds (a retry of a long prompt resumes there).

Connections. The port is bound before the model loads. One thread per connection, at
most --max-connections (past that: 503 and close); every read and write waits at most
--request-timeout (408 for a body that stops short); every refusal is a JSON error in
OpenAI's shape. Web pages get in only from --allowed-origins (CORS): a request whose
Origin header is not listed is refused with 403 before any work.

Prompt cache (`lru_prompt_cache.LRUPromptCache`). After `stream_generate` stops (EOS,
length, a stop string or a cancel) the cache holds the prompt plus every generated
token it returned (for speculation: target and draft alike, rollback included), so
the cache is stored under `prompt + generated tokens`. Caches that may become
untrimmable (recurrent ArraysCache layers, sliding-window RotatingKVCache layers) can
only be reused through keys that are strict prefixes of a later prompt, so for them
the worker also stores, after prefill, a copy under `prompt[:-1]`: it serves an
identical request and the next turn of a chat, whose prompt extends this one even
when the chat template renders the answer differently from the generated tokens (that
turn prefills its new tokens plus one). A copy under the whole prompt would save that
one token at the cost of a second copy of the cache and a one-token forward on every
request, so there is none. Reuse is exact: identical greedy requests give identical
outputs, with or without a draft model.

Extensions to OpenAI's schema: request `num_draft_tokens`; in `usage`,
`speculation: {num_drafted, num_accepted, num_target_forwards}` and
`completion_tokens_details.{accepted,rejected}_prediction_tokens` (draft tokens the
target accepted / rejected).
"""

import argparse
import json
import logging
import math
import os
import queue
import re
import select
import socket
import sys
import threading
import time
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any, Callable, Generator, List, Optional
from urllib.parse import unquote

import mlx.core as mx

from .generate import (
    GenerationResponse,
    check_can_speculate,
    check_same_tokenizer,
    json_object,
    positive_int,
    prefill,
    stream_generate,
)
from .lru_prompt_cache import LRUPromptCache, copy_prompt_cache
from .openai_api import (
    DEFAULT_MODEL_NAME,
    MAX_BODY_BYTES,
    MAX_JSON_DEPTH,
    MAX_TOKENS_LIMIT,
    GenerationRequest,
    GenerationResult,
    RequestError,
    ResponseBuilder,
    ServerDefaults,
    StopStringFilter,
    TokenLogprob,
    error_body,
    parse_request,
)
from .models.cache import CacheList, KVCache, QuantizedKVCache, make_prompt_cache
from .sample_utils import make_logits_processors, make_sampler

log = logging.getLogger("mlx_lm.server")


# ---------------------------------------------------------------------------
# Models and the generation worker (the only thread that runs MLX).


def _always_trimmable(entry: Any) -> bool:
    if isinstance(entry, CacheList):
        return all(_always_trimmable(c) for c in entry.caches)
    return isinstance(entry, (KVCache, QuantizedKVCache))


# The prompt limit of a model whose config.json names no context length.
FALLBACK_CONTEXT_LENGTH = 32768
# The share of free memory the prompt cache may fill by default: the rest is left for
# the running request's own cache and activations.
PROMPT_CACHE_MEMORY_FRACTION = 0.25
FALLBACK_PROMPT_CACHE_BYTES = 2 << 30


def context_length(config: dict) -> Optional[int]:
    """The context a checkpoint was trained for: `max_position_embeddings`, at the top
    level (llama, qwen2, qwen3, qwen3_next, gpt_oss) or in `text_config` (qwen3_5,
    qwen3_5_moe); None if the config names none."""
    for section in (config, config.get("text_config") or {}):
        value = section.get("max_position_embeddings")
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            return value
    return None


def available_memory() -> Optional[int]:
    """Bytes free for caches now: on a GPU its free memory (CUDA), or what Metal
    recommends the GPU use of unified memory less what MLX holds (the weights);
    otherwise the operating system's available memory. None if unknown."""
    try:
        info = mx.device_info()
    except AttributeError:  # older mlx: only mx.metal.device_info, absent off macOS
        info = {}
    if "free_memory" in info:
        return int(info["free_memory"])
    if "max_recommended_working_set_size" in info:
        return max(0, int(info["max_recommended_working_set_size"]) - mx.get_active_memory())
    try:
        with open("/proc/meminfo") as meminfo:
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return None


def default_prompt_cache_bytes() -> int:
    free = available_memory()
    return FALLBACK_PROMPT_CACHE_BYTES if free is None else int(free * PROMPT_CACHE_MEMORY_FRACTION)


class ServedModel:
    """A loaded model (plus optional draft), its tokenizer and its prompt cache.

    Prompt limit: `max_prompt_tokens`, by default the target's context (see
    `context_length`). A draft with a shorter context does not lower it: every emitted
    token is the target's, so past its context a draft only guesses worse. Requests ask
    for at most `max_tokens`, clipped so that prompt and answer fit in the larger of the
    context and `max_prompt_tokens` (the answer then ends with finish_reason "length").
    `cache_bytes` None: PROMPT_CACHE_MEMORY_FRACTION of the memory free after loading."""

    def __init__(self, path: str, draft_path: Optional[str], cache_size: int, cache_bytes: Optional[int],
                 chat_template: Optional[str] = None, max_prompt_tokens: Optional[int] = None):
        from .utils import load

        self.name = path
        self.model, self.tokenizer, config = load(path, return_config=True)
        if chat_template:
            self.tokenizer.chat_template = chat_template
        self.draft_model = None
        self.draft_name = draft_path
        self.draft_context_length = None
        if draft_path is not None:
            self.draft_model, draft_tokenizer, draft_config = load(draft_path, return_config=True)
            check_same_tokenizer(self.tokenizer, draft_tokenizer, path, draft_path)
            self.draft_context_length = context_length(draft_config)
        self.context_length = context_length(config)
        if max_prompt_tokens is not None:
            self.max_prompt_tokens, self.prompt_limit_source = max_prompt_tokens, "the server's --max-prompt-tokens"
        elif self.context_length is not None:
            self.max_prompt_tokens = self.context_length
            self.prompt_limit_source = "the model's context, max_position_embeddings in its config.json"
        else:
            self.max_prompt_tokens = FALLBACK_CONTEXT_LENGTH
            self.prompt_limit_source = "a default: the model's config.json names no context length"
        self.max_total_tokens = max(self.max_prompt_tokens, self.context_length or 0)
        # A text longer than this many characters per allowed token cannot fit: refused
        # before tokenizing. Vocabulary spellings are at least as long as the text a
        # token covers (byte-level BPE spells each byte as one character).
        self.longest_token_chars = max(len(t) for t in self.tokenizer.get_vocab())
        if cache_bytes is None:
            cache_bytes = default_prompt_cache_bytes()
        self.prompt_cache = LRUPromptCache(cache_size, cache_bytes)
        fresh = self.make_cache()
        if self.draft_model is not None:
            # Validate before serving: otherwise every request would fail (upstream #1446).
            num_target = len(self.model.layers)
            check_can_speculate(self.model, fresh[:num_target], "target model")
            check_can_speculate(self.draft_model, fresh[num_target:], "draft model")
        # Only strict-prefix keys can reuse a cache that may not trim (module docstring).
        self.snapshot_prompts = cache_size > 0 and not all(_always_trimmable(c) for c in fresh)

    @property
    def vocab_size(self) -> int:
        return self.model.args.vocab_size

    def make_cache(self) -> List[Any]:
        """The target's cache entries, then the draft's."""
        prompt_cache = make_prompt_cache(self.model)
        if self.draft_model is not None:
            prompt_cache += make_prompt_cache(self.draft_model)
        return prompt_cache

    def _too_long(self, size: str) -> RequestError:
        return RequestError(400, f"the prompt has {size}; this server accepts prompts of at most "
                                 f"{self.max_prompt_tokens} tokens ({self.prompt_limit_source}): shorten it")

    def encode(self, request: GenerationRequest) -> List[int]:
        """The request's prompt tokens, refused (400) past the prompt limit or when they
        leave no room for an answer. Needs no MLX, so the server calls it on the
        request's own thread: a huge prompt never occupies the generation worker."""
        tokens = self._tokenize(request)
        if not tokens:
            raise RequestError(400, "the prompt is empty after tokenization")
        if len(tokens) > self.max_prompt_tokens:
            raise self._too_long(f"{len(tokens)} tokens")
        self.max_new_tokens(len(tokens), 1)
        return tokens

    def _tokenize(self, request: GenerationRequest) -> List[int]:
        if request.kind == "text" and isinstance(request.prompt, list):
            if len(request.prompt) > self.max_prompt_tokens:  # before looking at each id
                raise self._too_long(f"{len(request.prompt)} tokens")
            bad = [t for t in request.prompt if t >= self.vocab_size]
            if bad:
                raise RequestError(400, f"prompt token ids {bad[:5]} are outside the vocabulary (size {self.vocab_size})")
            return list(request.prompt)
        if request.kind == "text":
            text, kwargs = request.prompt, {}
        else:
            text, kwargs = self._render(request), {"add_special_tokens": False}
        if len(text) > self.max_prompt_tokens * self.longest_token_chars:
            raise self._too_long(f"{len(text)} characters, more than {self.max_prompt_tokens} tokens of at most "
                                 f"{self.longest_token_chars} characters each can hold")
        return self.tokenizer.encode(text, **kwargs)

    def _render(self, request: GenerationRequest) -> str:
        if not self.tokenizer.has_chat_template:
            raise RequestError(400, f"{self.name} has no chat template: use /v1/completions, or start the server with --chat-template")
        kwargs = dict(request.chat_template_kwargs)
        if request.tools:
            kwargs["tools"] = request.tools
        try:
            return self.tokenizer.apply_chat_template(
                request.messages, tokenize=False, add_generation_prompt=True, **kwargs
            )
        except Exception as e:  # jinja raises its own types, templates call raise_exception
            raise RequestError(400, f"the chat template could not render these messages: {e}") from None

    def max_new_tokens(self, num_prompt: int, requested: int) -> int:
        """`requested`, clipped to the room the context leaves after the prompt."""
        room = self.max_total_tokens - num_prompt
        if room < 1:
            raise RequestError(400, f"the prompt's {num_prompt} tokens fill this server's context of "
                                    f"{self.max_total_tokens} tokens and leave no room for an answer: shorten it")
        return min(requested, room)

    def prefill(self, tokens: List[int], prompt_cache: List[Any], step: int,
                progress: Callable[[int, int], None]) -> List[int]:
        """Feed all of `tokens` but the last to the target and the draft, `step` tokens
        at a time and each step to both, calling `progress(done, total)` after each
        (it may raise to cancel); returns the last token. Same chunks as
        `generate.prefill`, so the caches are the ones `stream_generate` would build."""
        num_target = len(self.model.layers)
        parts = [(self.model, prompt_cache[:num_target])]
        if self.draft_model is not None:
            parts.append((self.draft_model, prompt_cache[num_target:]))
        prompt = mx.array(tokens)
        for start in range(0, len(tokens) - 1, step):
            end = min(start + step, len(tokens) - 1)
            for model, cache in parts:
                # generate.prefill feeds all it is given but the last: tokens[start:end].
                prefill(model, prompt[start : end + 1], cache, step, lambda done, total: None)
            progress(end, len(tokens))
        return tokens[-1:]


class Job:
    """One request on its way through the worker. `events` carries, in order:
    ("keepalive", done, total)* and ("delta", text, [TokenLogprob])* (streams only),
    then ("done", GenerationResult) or ("error", status, message). `tokens`: the
    prompt, if already tokenized (and checked against the prompt limit)."""

    def __init__(self, request: GenerationRequest, model_key: Optional[str], tokens: Optional[List[int]] = None):
        self.request = request
        self.model_key = model_key
        self.tokens = tokens
        self.events: "queue.Queue[tuple]" = queue.Queue()
        self.cancelled = threading.Event()


def model_id(path: str) -> str:
    """The public name of a model: a local directory's name (never its path, which
    tells clients about the server's disk), or the repo id as given."""
    local = Path(path).expanduser()
    return local.resolve().name if local.exists() else path


class ModelProvider:
    """Maps request model names to the served model. With `allow_other_models`,
    requests may also name another local model directory, loaded on demand in place of
    the previous such model (never downloaded; no draft model)."""

    def __init__(self, model_path: str, draft_path: Optional[str], allow_other_models: bool,
                 cache_size: int, cache_bytes: Optional[int], chat_template: Optional[str],
                 max_prompt_tokens: Optional[int] = None):
        self.default = ServedModel(model_path, draft_path, cache_size, cache_bytes, chat_template, max_prompt_tokens)
        self.model_id = model_id(model_path)
        self.names = {model_path, self.model_id, Path(model_path).name, str(Path(model_path).expanduser().resolve()),
                      DEFAULT_MODEL_NAME}
        self.draft_names = {None, DEFAULT_MODEL_NAME}
        if draft_path is not None:
            self.draft_names |= {draft_path, Path(draft_path).name, str(Path(draft_path).expanduser().resolve())}
        self.allow_other_models = allow_other_models
        self.cache_size, self.cache_bytes, self.chat_template = cache_size, cache_bytes, chat_template
        self.max_prompt_tokens = max_prompt_tokens
        self.other: Optional[ServedModel] = None  # touched by the worker only

    def resolve(self, request: GenerationRequest) -> Optional[str]:
        """None for the served model, else the path of another local model; raises 404."""
        if request.draft_model not in self.draft_names:
            served = "no draft model" if self.default.draft_name is None else model_id(self.default.draft_name)
            raise RequestError(404, f"draft model {request.draft_model!r} is not served here (this server uses {served})")
        if request.model is None or request.model in self.names:
            return None
        hint = f"this server serves {self.model_id!r}; name it or {DEFAULT_MODEL_NAME!r}"
        if not self.allow_other_models:
            raise RequestError(404, f"model {request.model!r} is not served here: {hint} "
                                    "(the operator can allow other local models with --allow-other-models)")
        path = Path(request.model).expanduser()
        if not (path / "config.json").is_file():
            raise RequestError(404, f"model {request.model!r} is not a local model directory with a config.json "
                                    f"(the server never downloads models): {hint}")
        if request.draft_model not in (None, DEFAULT_MODEL_NAME) or request.num_draft_tokens is not None:
            raise RequestError(400, f"speculative decoding is only available with {self.model_id!r}")
        return str(path.resolve())

    def get(self, key: Optional[str]) -> ServedModel:
        if key is None:
            return self.default
        if self.other is None or self.other.name != key:
            self.other = None  # free the previous one before loading
            log.info("Loading %s", key)
            try:
                self.other = ServedModel(key, None, self.cache_size, self.cache_bytes, self.chat_template,
                                         self.max_prompt_tokens)
            except (ValueError, FileNotFoundError) as e:
                raise RequestError(400, f"could not load model {key!r}: {e}") from None
        return self.other

    def make_job(self, request: GenerationRequest) -> Job:
        """Resolve the model and, for the served one, tokenize on the calling (request)
        thread; another model's prompt is tokenized by the worker once it is loaded."""
        key = self.resolve(request)
        return Job(request, key, self.default.encode(request) if key is None else None)


class _Cancelled(Exception):
    """The client went away during prefill, after `num_fed` of `total` prompt tokens."""

    def __init__(self, num_fed: int, total: int):
        super().__init__(num_fed, total)
        self.num_fed, self.total = num_fed, total


class GenerationWorker:
    """Runs jobs one at a time (call `run_forever` on its own thread)."""

    def __init__(self, provider: ModelProvider, prefill_step_size: int = 2048, default_num_draft_tokens: int = 3):
        self.provider = provider
        self.prefill_step_size = prefill_step_size
        self.default_num_draft_tokens = default_num_draft_tokens
        self.jobs: "queue.Queue[Job]" = queue.Queue()

    def submit(self, job: Job) -> None:
        self.jobs.put(job)

    def run_forever(self) -> None:
        while True:
            self.run(self.jobs.get())

    def run(self, job: Job) -> None:
        if job.cancelled.is_set():
            log.info("Client disconnected while queued; request dropped")
            return
        try:
            job.events.put(("done", self.generate(job)))
        except RequestError as e:
            job.events.put(("error", e.status, e.message))
        except _Cancelled as e:
            log.info("Client disconnected during prefill (%d of %d prompt tokens fed); request dropped",
                     e.num_fed, e.total)
        except Exception as e:  # the server stays up; the client learns why
            log.exception("Generation failed")
            job.events.put(("error", 500, f"generation failed: {type(e).__name__}: {e}"))

    def _sampling(self, served: ServedModel, request: GenerationRequest):
        bad = [t for t in request.logit_bias if t >= served.vocab_size]
        if bad:
            raise RequestError(400, f"logit_bias token ids {bad[:5]} are outside the vocabulary (size {served.vocab_size})")
        try:
            sampler = make_sampler(**request.sampling, xtc_special_tokens=sorted(served.tokenizer.eos_token_ids))
            processors = make_logits_processors(request.logit_bias, **request.penalties)
        except ValueError as e:
            raise RequestError(400, str(e)) from None
        return sampler, processors

    def _progress(self, job: Job, num_fed: int, total: int) -> Callable[[int, int], None]:
        """Prefill callback: keepalives for streams, and the cancel check."""
        def progress(done: int, _: int) -> None:
            if job.cancelled.is_set():
                raise _Cancelled(num_fed + done, total)
            if job.request.stream:
                job.events.put(("keepalive", num_fed + done, total))

        return progress

    def generate(self, job: Job) -> GenerationResult:
        request = job.request
        served = self.provider.get(job.model_key)
        if request.num_draft_tokens is not None and served.draft_model is None:
            raise RequestError(400, "num_draft_tokens needs a server started with --draft-model")
        tokens = job.tokens if job.tokens is not None else served.encode(request)
        max_tokens = served.max_new_tokens(len(tokens), request.max_tokens)
        sampler, processors = self._sampling(served, request)
        if request.seed is not None:
            mx.random.seed(request.seed % (1 << 64))
        fetched = served.prompt_cache.fetch(tokens)
        prompt_cache = fetched.prompt_cache or served.make_cache()
        # Prefilled here, not by stream_generate, whose draft prefill cannot be cancelled.
        progress = self._progress(job, fetched.num_cached, len(tokens))
        lru = served.prompt_cache
        try:
            remaining = served.prefill(fetched.remaining, prompt_cache, self.prefill_step_size, progress)
        except _Cancelled as e:
            # Both halves hold exactly the tokens fed so far: keep them, so a client that
            # retries the prompt (after its own timeout, say) resumes rather than restarts.
            if e.num_fed > fetched.num_cached:
                lru.insert(tokens[: e.num_fed], prompt_cache)
            raise
        if served.snapshot_prompts and len(tokens) > 1 and tokens[:-1] not in lru:
            lru.insert(tokens[:-1], copy_prompt_cache(prompt_cache))  # see the module docstring
        num_fed = len(tokens) - 1
        if processors and num_fed:
            # The generator sees only the tokens it is fed; penalties must also see the
            # part of the prompt already in the cache.
            seen = mx.array(tokens[:num_fed])
            processors = [lambda history, logits, p=p: p(mx.concatenate([seen, history]), logits) for p in processors]
        kwargs = {}
        if served.draft_model is not None:
            kwargs = dict(draft_model=served.draft_model,
                          num_draft_tokens=request.num_draft_tokens or self.default_num_draft_tokens)
        responses = stream_generate(
            served.model, served.tokenizer, mx.array(remaining), max_tokens,
            sampler=sampler, logits_processors=processors, prompt_cache=prompt_cache,
            prefill_step_size=self.prefill_step_size,
            prompt_progress_callback=self._progress(job, num_fed, len(tokens)), **kwargs,
        )
        return self._consume(job, served, responses, tokens, prompt_cache, fetched.num_cached)

    def _consume(self, job: Job, served: ServedModel, responses: Generator[GenerationResponse, None, None],
                 tokens: List[int], prompt_cache: List[Any], num_cached: int) -> GenerationResult:
        """Stream the responses out; afterwards store the cache under what it holds."""
        request, stops = job.request, StopStringFilter(job.request.stop)
        generated, text, logprobs = [], "", []
        finish_reason, speculation = None, None
        try:
            for response in responses:
                generated.append(response.token)
                speculation = response.speculation
                entries = []
                if response.finish_reason != "stop" and request.logprobs:
                    entries = [self._logprob(served, response, request.top_logprobs)]
                delta, stopped = stops.add(response.text)
                finish_reason = "stop" if stopped else response.finish_reason
                if finish_reason is not None:
                    delta += stops.flush()
                text += delta
                logprobs += entries
                if request.stream and (delta or entries):
                    job.events.put(("delta", delta, entries))
                if finish_reason is not None or job.cancelled.is_set():
                    break
        finally:
            responses.close()  # settles the caches at exactly prompt + generated
        served.prompt_cache.insert(tokens + generated, prompt_cache)
        if job.cancelled.is_set():
            log.info("Client disconnected; stopped after %d generated tokens", len(generated))
        result = GenerationResult(text, finish_reason or "stop", len(tokens), num_cached, len(generated),
                                  speculation, logprobs)
        log.info("%s: %d prompt tokens (%d cached), %d generated at %.1f tokens/s%s", served.name,
                 result.prompt_tokens, num_cached, len(generated), response.generation_tps,
                 "" if speculation is None else
                 f", {speculation.num_accepted}/{speculation.num_drafted} draft tokens accepted")
        return result

    @staticmethod
    def _logprob(served: ServedModel, response, top_n: int) -> TokenLogprob:
        row = response.logprobs
        decode = served.tokenizer.decode
        top = []
        if top_n:
            ids = mx.argpartition(-row, kth=top_n - 1)[:top_n]
            values = row[ids].tolist()
            top = sorted(((decode([i]), v) for i, v in zip(ids.tolist(), values)), key=lambda tv: -tv[1])
        return TokenLogprob(decode([response.token]), row[response.token].item(), top)


# ---------------------------------------------------------------------------
# HTTP.


class APIServer(ThreadingHTTPServer):
    """Binds at construction (before any model loads); `provider` and `worker` are set
    once loaded. One thread per connection, at most `max_connections` at once: past
    that a connection gets a 503 from the accepting thread and is closed."""

    daemon_threads = True  # a hung client never keeps the process alive
    request_queue_size = 128  # listen backlog: a burst of connects waits here, not for a SYN retry

    def __init__(self, host: str, port: int, defaults: ServerDefaults, allowed_origins: List[str],
                 max_connections: int, request_timeout: float):
        # Hostnames never contain ':', IPv6 literals always do.
        self.address_family = socket.AF_INET6 if ":" in host else socket.AF_INET
        super().__init__((host, port), APIHandler)
        self.provider: Optional[ModelProvider] = None
        self.worker: Optional[GenerationWorker] = None
        self.defaults = defaults
        self.allowed_origins = allowed_origins
        self.request_timeout = request_timeout
        self.max_connections = max_connections
        self._slots = threading.BoundedSemaphore(max_connections)
        self._num_refused, self._last_refusal_log = 0, -math.inf
        body = json.dumps(error_body(503, f"the server already has {max_connections} open connections "
                                          "(--max-connections); retry shortly")).encode()
        self._busy_response = (b"HTTP/1.1 503 Service Unavailable\r\nContent-Type: application/json\r\n"
                               b"Retry-After: 1\r\nConnection: close\r\nContent-Length: %d\r\n\r\n" % len(body) + body)

    @property
    def url(self) -> str:
        host, port = self.server_address[:2]
        return f"http://[{host}]:{port}" if self.address_family == socket.AF_INET6 else f"http://{host}:{port}"

    def process_request(self, request, client_address) -> None:
        if not self._slots.acquire(blocking=False):
            self._refuse(request, client_address)
            return
        try:
            super().process_request(request, client_address)
        except BaseException:  # no thread took the slot
            self._slots.release()
            raise

    def process_request_thread(self, request, client_address) -> None:
        try:
            super().process_request_thread(request, client_address)
        finally:
            self._slots.release()

    def _refuse(self, sock: socket.socket, client_address) -> None:
        """Answer 503 without a thread. The response is smaller than any send buffer, so
        the non-blocking send never stalls the accept loop."""
        self._num_refused += 1
        if time.monotonic() - self._last_refusal_log > 10:  # a flood must not flood the log
            self._last_refusal_log = time.monotonic()
            log.warning("At --max-connections (%d): refusing connections (%d so far, latest from %s)",
                        self.max_connections, self._num_refused, client_address[0])
        try:
            sock.setblocking(False)
            sock.send(self._busy_response)
            sock.shutdown(socket.SHUT_WR)
            while sock.recv(65536):  # drop what the client already sent, so close sends FIN, not RST
                pass
        except OSError:
            pass
        finally:
            sock.close()


class _ClientGone(Exception):
    pass


class APIHandler(BaseHTTPRequestHandler):
    server: APIServer
    protocol_version = "HTTP/1.1"
    # Until a request line names its version; http.server's HTTP/0.9 default would send
    # error bodies without a status line. Nobody speaks HTTP/0.9.
    default_request_version = "HTTP/1.0"
    POST_ROUTES = {"/v1/chat/completions": "chat", "/chat/completions": "chat", "/v1/completions": "text"}
    PROBE_INTERVAL = 1.0  # seconds between writes that test a client whose side reads as closed

    def setup(self) -> None:
        # Bounds every read (request line, headers, body, idle keep-alive) and every write.
        self.timeout = self.server.request_timeout
        super().setup()

    def log_message(self, format: str, *args: Any) -> None:
        log.debug("%s - %s", self.address_string(), format % args)

    # -- plumbing

    def end_headers(self) -> None:
        super().end_headers()
        self._response_started = True

    def _origin_allowed(self) -> bool:
        """Requests without an Origin (curl, SDKs) are not from a web page."""
        origin = self.headers.get("Origin")
        return origin is None or "*" in self.server.allowed_origins or origin in self.server.allowed_origins

    def _cors(self) -> None:
        origin = self.headers.get("Origin") if getattr(self, "headers", None) is not None else None
        if origin is None or not self._origin_allowed():
            return
        if "*" in self.server.allowed_origins:
            self.send_header("Access-Control-Allow-Origin", "*")
        else:
            self.send_header("Access-Control-Allow-Origin", origin)
            self.send_header("Vary", "Origin")

    def _send_json(self, status: int, body: dict) -> None:
        data = json.dumps(body).encode()
        self.send_response(status)
        if status == HTTPStatus.METHOD_NOT_ALLOWED:
            self.send_header("Allow", "GET, POST, OPTIONS")
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        if self.close_connection:
            self.send_header("Connection", "close")
        self._cors()
        self.end_headers()
        self.wfile.write(data)
        self.wfile.flush()

    def _send_error(self, status: int, message: str) -> None:
        self._send_json(status, error_body(status, message))

    def send_error(self, code: int, message: Optional[str] = None, explain: Optional[str] = None) -> None:
        """http.server's own refusals (bad request line, oversized headers, unknown
        method) in the OpenAI error shape. The stream position is unknown after them."""
        self.close_connection = True
        if code == HTTPStatus.NOT_IMPLEMENTED:  # http.server's answer to a method it has no do_ for
            code, message = HTTPStatus.METHOD_NOT_ALLOWED, f"method {self.command} is not supported: use GET or POST"
        self._send_error(code, message or HTTPStatus(code).phrase)

    def _write_event(self, data: str) -> None:
        self.wfile.write(data.encode())
        self.wfile.flush()

    def _read_body(self) -> Any:
        if self.headers.get("Transfer-Encoding") is not None:
            self.close_connection = True
            raise RequestError(411, "chunked request bodies are not supported: send a Content-Length header")
        length = self.headers.get("Content-Length")
        if length is None:
            self.close_connection = True
            raise RequestError(411, "a Content-Length header is required")
        if not length.strip().isdigit():
            self.close_connection = True
            raise RequestError(400, f"invalid Content-Length header {length!r}")
        size = int(length)
        if size > MAX_BODY_BYTES:
            self.close_connection = True
            raise RequestError(413, f"the request body exceeds {MAX_BODY_BYTES} bytes")
        try:
            raw = self.rfile.read(size)
        except TimeoutError:
            self.close_connection = True
            raise RequestError(408, f"the {size}-byte request body (Content-Length) did not arrive: nothing came "
                                    f"for {self.server.request_timeout:g} s (--request-timeout)") from None
        if len(raw) < size:
            self.close_connection = True
            raise RequestError(400, f"the request body ended after {len(raw)} of its {size} bytes (Content-Length)")
        try:
            return json.loads(raw)
        except ValueError as e:  # bad syntax, bad UTF-8, an integer of over 4300 digits
            raise RequestError(400, f"the request body is not valid JSON: {e}") from None
        except RecursionError:
            raise RequestError(400, f"the request body nests JSON deeper than {MAX_JSON_DEPTH} levels: "
                                    "send a flatter body") from None

    def _discard_body(self) -> None:
        """Routes that take no body: one sent anyway would be read as the next request."""
        if self.headers.get("Transfer-Encoding") is not None or self.headers.get("Content-Length", "0") != "0":
            self.close_connection = True

    def _guarded(self, route: Callable[[], None]) -> None:
        """Every failure becomes a JSON error, never a silently dropped connection."""
        self._response_started = False
        try:
            if not self._origin_allowed():
                self.close_connection = True  # the body, if any, stays unread
                origin = self.headers.get("Origin")
                raise RequestError(403, f"requests from web pages at {origin!r} are not allowed: the operator "
                                        "can allow this origin with --allowed-origins")
            route()
        except RequestError as e:
            self._reply_error(e.status, e.message)
        except OSError:  # the client went away or a write timed out: nobody to tell
            self.close_connection = True
        except Exception as e:
            log.exception("Request handler failed")
            self.close_connection = True
            self._reply_error(500, f"internal server error: {type(e).__name__}: {e}")

    def _reply_error(self, status: int, message: str) -> None:
        if self._response_started:
            return  # too late for a status line
        try:
            self._send_error(status, message)
        except OSError:
            self.close_connection = True

    # -- routes

    def do_OPTIONS(self) -> None:
        self._guarded(self._options)

    def do_GET(self) -> None:
        self._guarded(self._get)

    def do_POST(self) -> None:
        self._guarded(self._post)

    def _options(self) -> None:
        self._discard_body()
        self.send_response(204)
        self._cors()
        self.send_header("Allow", "GET, POST, OPTIONS")
        if self.headers.get("Origin") is not None:  # a CORS preflight from an allowed origin
            self.send_header("Access-Control-Allow-Methods", "GET, POST, OPTIONS")
            self.send_header("Access-Control-Allow-Headers", "Content-Type, Authorization")
            self.send_header("Access-Control-Max-Age", "600")
        self.send_header("Content-Length", "0")
        self.end_headers()

    def _get(self) -> None:
        self._discard_body()
        path = unquote(self.path.split("?", 1)[0]).rstrip("/")
        provider = self.server.provider
        model = {"id": provider.model_id, "object": "model", "created": int(time.time()), "owned_by": "mlx_lm"}
        if path == "/health":
            self._send_json(200, {"status": "ok"})
        elif path == "/v1/models":
            self._send_json(200, {"object": "list", "data": [model]})
        elif path.startswith("/v1/models/") and path[len("/v1/models/"):] in provider.names:
            self._send_json(200, model)
        else:
            raise RequestError(404, f"no such endpoint: GET {path}")

    def _post(self) -> None:
        body = self._read_body()
        kind = self.POST_ROUTES.get(self.path.split("?", 1)[0].rstrip("/"))
        if kind is None:
            raise RequestError(404, f"no such endpoint: POST {self.path}")
        request = parse_request(body, kind, self.server.defaults)
        job = self.server.provider.make_job(request)  # tokenizes here, not on the worker
        self.server.worker.submit(job)
        name = self.server.provider.model_id if job.model_key is None else model_id(job.model_key)
        builder = ResponseBuilder(request, name)
        self._last_probe = -math.inf
        try:
            if request.stream:
                self._stream(job, builder)
            else:
                self._complete(job, builder)
        except (_ClientGone, OSError):
            job.cancelled.set()
            self.close_connection = True

    def _next_event(self, job: Job) -> tuple:
        """The job's next event; _ClientGone if the client hangs up while waiting (a
        non-streaming client, or a stream during a long prefill or queue wait)."""
        while True:
            try:
                return job.events.get(timeout=0.25)
            except queue.Empty:
                if self._client_gone():
                    raise _ClientGone() from None

    def _client_gone(self) -> bool:
        """A reset connection is gone. End of input alone is not: a client may half-close
        after sending its request and still read the answer. Only a write tells the two
        apart (a closed peer answers it with a reset), so then write something every
        client ignores: before the response an interim `100 Continue` (RFC 9110 15.2:
        clients must accept unexpected 1xx responses), inside an event stream a comment."""
        try:
            readable, _, _ = select.select([self.connection], [], [], 0)
            if not readable or self.connection.recv(1, socket.MSG_PEEK):
                return False  # nothing new, or bytes of a next request
            # After end of input, recv keeps returning b"" even once a reset has come.
            if self.connection.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR):
                return True
        except OSError:
            return True
        if self.request_version == "HTTP/1.0":
            return True  # no 1xx may go to an HTTP/1.0 client: take end of input as goodbye
        if time.monotonic() - self._last_probe >= self.PROBE_INTERVAL:
            self._last_probe = time.monotonic()
            self.wfile.write(b": probe\n\n" if self._response_started else b"HTTP/1.1 100 Continue\r\n\r\n")
            self.wfile.flush()
        return False

    def _complete(self, job: Job, builder: ResponseBuilder) -> None:
        event = self._next_event(job)  # no deltas or keepalives: the job does not stream
        if event[0] == "error":
            self._send_error(event[1], event[2])
        else:
            self._send_json(200, builder.completion(event[1]))

    def _start_stream(self, builder: ResponseBuilder) -> None:
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Cache-Control", "no-cache")
        self.send_header("Connection", "close")  # the end of the stream ends the response
        self._cors()
        self.end_headers()
        self.close_connection = True
        if builder.chat:
            self._write_event(f"data: {json.dumps(builder.role_chunk())}\n\n")

    def _stream(self, job: Job, builder: ResponseBuilder) -> None:
        while True:
            event = self._next_event(job)
            if event[0] == "error" and not self._response_started:
                self._send_error(event[1], event[2])
                return
            if not self._response_started:
                self._start_stream(builder)
            if event[0] == "keepalive":
                self._write_event(f": keepalive {event[1]}/{event[2]}\n\n")
            elif event[0] == "delta":
                self._write_event(f"data: {json.dumps(builder.chunk(event[1], event[2]))}\n\n")
            elif event[0] == "error":  # after the headers: report in band
                self._write_event(f"data: {json.dumps(error_body(event[1], event[2]))}\n\ndata: [DONE]\n\n")
                return
            else:
                result = event[1]
                self._write_event(f"data: {json.dumps(builder.chunk('', [], result.finish_reason))}\n\n")
                if job.request.include_usage:
                    self._write_event(f"data: {json.dumps(builder.usage_chunk(result))}\n\n")
                self._write_event("data: [DONE]\n\n")
                return


# ---------------------------------------------------------------------------
# Command line.


def parse_size(value: str) -> int:
    """"8GB", "512MiB", "1.5G", "1000" -> bytes (decimal units; "i" units binary)."""
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]?)(I?)B?\s*", value.upper())
    if match is None:
        raise argparse.ArgumentTypeError(f"expected a size such as 8GB, 512MiB or 1000000, got {value!r}")
    number, unit, binary = match.groups()
    base = 1024 if binary else 1000
    return int(float(number) * base ** " KMGT".index(unit or " "))


class _HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Shows each default, except an absent or empty one (the help says what it means)."""

    def _get_help_string(self, action: argparse.Action) -> str:
        return action.help if action.default in (None, "") else super()._get_help_string(action)


def positive_float(value: str) -> float:
    number = float(value)
    if not (math.isfinite(number) and number > 0):
        raise argparse.ArgumentTypeError(f"expected a positive number of seconds, got {value!r}")
    return number


def setup_arg_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description="OpenAI-compatible HTTP server for an MLX language model",
                                     formatter_class=_HelpFormatter)
    parser.add_argument("--model", required=True, help="Local model directory or Hugging Face repo id to serve")
    parser.add_argument("--draft-model", default=None,
                        help="A smaller model sharing the tokenizer, for speculative decoding")
    parser.add_argument("--num-draft-tokens", type=positive_int, default=3,
                        help="Tokens the draft proposes per target forward (requests may override)")
    parser.add_argument("--host", default="127.0.0.1",
                        help="Address to bind: 127.0.0.1 or ::1 take local connections only; an IPv6 address binds IPv6")
    parser.add_argument("--port", type=int, default=8080, help="Port to listen on (0: any free port)")
    parser.add_argument("--max-tokens", type=positive_int, default=512, help="Default maximum tokens per response")
    parser.add_argument("--temp", type=float, default=0.0, help="Default sampling temperature")
    parser.add_argument("--top-p", type=float, default=1.0, help="Default nucleus sampling threshold")
    parser.add_argument("--top-k", type=int, default=0, help="Default top-k sampling (0: off)")
    parser.add_argument("--min-p", type=float, default=0.0, help="Default min-p sampling threshold")
    parser.add_argument("--chat-template", default="", help="A chat template (jinja text) replacing the tokenizer's")
    parser.add_argument("--chat-template-args", type=json_object, default={},
                        help="JSON object of chat template arguments (requests' chat_template_kwargs override it)")
    parser.add_argument("--prompt-cache-size", type=int, default=10, help="Prompt caches kept for reuse (0: none)")
    parser.add_argument("--prompt-cache-bytes", type=parse_size, default=None,
                        help="Memory bound of the kept prompt caches, e.g. 8GB "
                             f"(default: {PROMPT_CACHE_MEMORY_FRACTION * 100:.0f}%% of the memory free after loading)")
    parser.add_argument("--max-prompt-tokens", type=positive_int, default=None,
                        help="Refuse longer prompts (default: the model's context, max_position_embeddings)")
    parser.add_argument("--prefill-step-size", type=positive_int, default=2048, help="Prompt tokens per prefill forward")
    parser.add_argument("--allowed-origins", default="",
                        help="Comma-separated web origins (e.g. http://localhost:3000) whose pages may call the "
                             "server, or '*' for any; requests from other pages (they carry an Origin header) "
                             "are refused with 403, requests without one are served (default: none)")
    parser.add_argument("--max-connections", type=positive_int, default=64,
                        help="Open connections served at once (one thread each); more get 503 and are closed")
    parser.add_argument("--request-timeout", type=positive_float, default=30.0,
                        help="Seconds a connection may stay silent while the server reads (request line, headers, "
                             "body, idle keep-alive) or blocked while it writes, before it is closed")
    parser.add_argument("--allow-other-models", action="store_true",
                        help="Let requests name other local model directories (loaded on demand, one at a time)")
    parser.add_argument("--log-level", default="INFO", choices=["DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL"],
                        help="Logging level")
    return parser


def _check_defaults(parser: argparse.ArgumentParser, args: argparse.Namespace) -> ServerDefaults:
    """The request defaults, held to the bounds a request's own values get."""
    for flag, value, low, high in [("--temp", args.temp, 0, 100), ("--top-p", args.top_p, 0, 1),
                                   ("--top-k", args.top_k, 0, 1 << 31), ("--min-p", args.min_p, 0, 1),
                                   ("--max-tokens", args.max_tokens, 1, MAX_TOKENS_LIMIT),
                                   ("--prompt-cache-size", args.prompt_cache_size, 0, 1 << 31),
                                   ("--port", args.port, 0, 65535)]:
        if not (math.isfinite(value) and low <= value <= high):
            parser.error(f"{flag} must be in [{low}, {high}], got {value}")
    return ServerDefaults(max_tokens=args.max_tokens, temperature=args.temp, top_p=args.top_p, top_k=args.top_k,
                          min_p=args.min_p, chat_template_args=args.chat_template_args)


def _parse_origins(parser: argparse.ArgumentParser, value: str) -> List[str]:
    """Browsers send an origin as scheme://host[:port]; anything else would never match."""
    origins = [o.strip() for o in value.split(",") if o.strip()]
    for origin in origins:
        if not re.fullmatch(r"\*|null|[A-Za-z][A-Za-z0-9+.-]*://[^/?#\s]+", origin):
            parser.error(f"--allowed-origins: {origin!r} is not an origin: write scheme://host[:port] "
                         "without a path, e.g. http://localhost:3000")
    return origins


def _log_limits(served: ServedModel, max_prompt_tokens: Optional[int]) -> None:
    log.info("Prompts of at most %d tokens (%s); answers clipped to a total of %d tokens", served.max_prompt_tokens,
             served.prompt_limit_source, served.max_total_tokens)
    if served.context_length is None and max_prompt_tokens is None:
        log.warning("%s names no max_position_embeddings: set --max-prompt-tokens to its context", served.name)
    if served.draft_context_length is not None and served.draft_context_length < served.max_prompt_tokens:
        log.warning("The draft model's context (%d tokens) is shorter than the prompt limit: past it, its drafts "
                    "are accepted less often (answers stay exact)", served.draft_context_length)
    lru = served.prompt_cache
    log.info("Prompt cache: at most %d entries and %.2f GB (--prompt-cache-size, --prompt-cache-bytes)",
             lru.max_size, lru.max_bytes / 1e9)


def main(argv: Optional[List[str]] = None) -> None:
    parser = setup_arg_parser()
    args = parser.parse_args(argv)
    defaults = _check_defaults(parser, args)
    origins = _parse_origins(parser, args.allowed_origins)
    logging.basicConfig(level=args.log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    # Bind first: a busy port or a bad address is reported before a long model load.
    try:
        server = APIServer(args.host, args.port, defaults, origins, args.max_connections, args.request_timeout)
    except OSError as e:
        where = f"[{args.host}]:{args.port}" if ":" in args.host else f"{args.host}:{args.port}"
        sys.exit(f"Error: cannot listen on {where}: {(e.strerror or str(e)).lower()}")
    try:
        server.provider = ModelProvider(args.model, args.draft_model, args.allow_other_models,
                                        args.prompt_cache_size, args.prompt_cache_bytes, args.chat_template or None,
                                        args.max_prompt_tokens)
    except (ValueError, FileNotFoundError) as e:
        server.server_close()
        sys.exit(f"Error: {e}")
    _log_limits(server.provider.default, args.max_prompt_tokens)
    server.worker = GenerationWorker(server.provider, args.prefill_step_size, args.num_draft_tokens)
    threading.Thread(target=server.worker.run_forever, name="generation", daemon=True).start()
    if args.host not in ("127.0.0.1", "localhost", "::1"):
        log.warning("Listening on %s: the server has no authentication; anyone who can reach it can use it", args.host)
    log.info("Serving %s%s on %s", args.model, f" with draft {args.draft_model}" if args.draft_model else "",
             server.url)
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        server.server_close()


if __name__ == "__main__":
    main()
