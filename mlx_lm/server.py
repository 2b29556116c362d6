"""`mlx_lm.server`: an OpenAI-compatible HTTP server on the standard library.

Endpoints: POST /v1/chat/completions (also /chat/completions), POST /v1/completions,
GET /v1/models, GET /health. Streaming is by server-sent events: `data: {json}` chunks,
a last chunk carrying finish_reason, a usage chunk when `stream_options.include_usage`,
then `data: [DONE]`; `: keepalive <done>/<total>` comments go out during prefill.

Serving. The model (and `--draft-model`) is loaded once. Request handler threads only
parse and validate; every MLX computation runs on one worker thread that takes jobs
from a queue, so generation is serialised and responses never interleave. A client
that disconnects (noticed at the next write, or by polling the socket while waiting)
has its job cancelled: the worker closes the generator at the next token and stores
the cache under exactly the tokens it holds.

Prompt cache (`lru_prompt_cache.LRUPromptCache`). After `stream_generate` stops (EOS,
length, a stop string or a cancel) the cache holds the prompt plus every generated
token it returned (for speculation: target and draft alike, rollback included), so
the cache is stored under `prompt + generated tokens`. Caches that may become
untrimmable (recurrent ArraysCache layers, sliding-window RotatingKVCache layers) can
only be reused through keys that are strict prefixes of a later prompt, so for them
the worker also stores, before generating, a copy under `prompt[:-1]` (reused by an
identical request) and one under `prompt` (reused by the next turn of a chat, whose
prompt extends this one even when the chat template renders the answer differently
from the generated tokens: that turn prefills only its new tokens). Reuse is exact:
identical greedy requests give identical outputs, with or without a draft model.

Extensions to OpenAI's schema: request `num_draft_tokens`; in `usage`,
`speculation: {num_drafted, num_accepted, num_target_forwards}` and
`completion_tokens_details.{accepted,rejected}_prediction_tokens` (draft tokens the
target accepted / rejected).
"""

import argparse
import json
import logging
import math
import queue
import re
import select
import socket
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any, Callable, Generator, List, Optional

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


class ServedModel:
    """A loaded model (plus optional draft), its tokenizer and its prompt cache."""

    def __init__(self, path: str, draft_path: Optional[str], cache_size: int, cache_bytes: int,
                 chat_template: Optional[str] = None):
        from .utils import load

        self.name = path
        self.model, self.tokenizer = load(path)
        if chat_template:
            self.tokenizer.chat_template = chat_template
        self.draft_model = None
        self.draft_name = draft_path
        if draft_path is not None:
            self.draft_model, draft_tokenizer = load(draft_path)
            check_same_tokenizer(self.tokenizer, draft_tokenizer, path, draft_path)
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

    def encode(self, request: GenerationRequest) -> List[int]:
        if request.kind == "text":
            if isinstance(request.prompt, list):
                bad = [t for t in request.prompt if t >= self.vocab_size]
                if bad:
                    raise RequestError(400, f"prompt token ids {bad[:5]} are outside the vocabulary (size {self.vocab_size})")
                return list(request.prompt)
            tokens = self.tokenizer.encode(request.prompt)
        else:
            if not self.tokenizer.has_chat_template:
                raise RequestError(400, f"{self.name} has no chat template: use /v1/completions, or start the server with --chat-template")
            kwargs = dict(request.chat_template_kwargs)
            if request.tools:
                kwargs["tools"] = request.tools
            try:
                text = self.tokenizer.apply_chat_template(
                    request.messages, tokenize=False, add_generation_prompt=True, **kwargs
                )
            except Exception as e:  # jinja raises its own types, templates call raise_exception
                raise RequestError(400, f"the chat template could not render these messages: {e}") from None
            tokens = self.tokenizer.encode(text, add_special_tokens=False)
        if not tokens:
            raise RequestError(400, "the prompt is empty after tokenization")
        return tokens

    def feed(self, tokens: List[int], prompt_cache: List[Any]) -> None:
        """Feed `tokens` to the target (and draft) in one forward."""
        num_target = len(self.model.layers)
        inputs = mx.array(tokens)[None]
        self.model(inputs, cache=prompt_cache[:num_target])
        if self.draft_model is not None:
            self.draft_model(inputs, cache=prompt_cache[num_target:])
        mx.eval([c.state for c in prompt_cache])

    def prefill(self, tokens: List[int], prompt_cache: List[Any], step: int, progress) -> List[int]:
        """Feed all of `tokens` but the last to the target (and draft); return the last."""
        num_target = len(self.model.layers)
        prompt = mx.array(tokens)
        if self.draft_model is not None:
            prefill(self.draft_model, prompt, prompt_cache[num_target:], step, lambda done, total: None)
        return prefill(self.model, prompt, prompt_cache[:num_target], step, progress).tolist()


class ModelProvider:
    """Maps request model names to the served model. With `allow_other_models`,
    requests may also name another local model directory, loaded on demand in place of
    the previous such model (never downloaded; no draft model)."""

    def __init__(self, model_path: str, draft_path: Optional[str], allow_other_models: bool,
                 cache_size: int, cache_bytes: int, chat_template: Optional[str]):
        self.default = ServedModel(model_path, draft_path, cache_size, cache_bytes, chat_template)
        self.names = {model_path, Path(model_path).name, str(Path(model_path).expanduser().resolve()),
                      DEFAULT_MODEL_NAME}
        self.draft_names = {None, DEFAULT_MODEL_NAME}
        if draft_path is not None:
            self.draft_names |= {draft_path, Path(draft_path).name, str(Path(draft_path).expanduser().resolve())}
        self.allow_other_models = allow_other_models
        self.cache_size, self.cache_bytes, self.chat_template = cache_size, cache_bytes, chat_template
        self.other: Optional[ServedModel] = None  # touched by the worker only

    def resolve(self, request: GenerationRequest) -> Optional[str]:
        """None for the served model, else the path of another local model; raises 404."""
        if request.draft_model not in self.draft_names:
            served = self.default.draft_name or "no draft model"
            raise RequestError(404, f"draft model {request.draft_model!r} is not served here (this server uses {served})")
        if request.model is None or request.model in self.names:
            return None
        hint = f"this server serves {self.default.name!r}; name it, its directory name or {DEFAULT_MODEL_NAME!r}"
        if not self.allow_other_models:
            raise RequestError(404, f"model {request.model!r} is not served here: {hint} "
                                    "(the operator can allow other local models with --allow-other-models)")
        path = Path(request.model).expanduser()
        if not (path / "config.json").is_file():
            raise RequestError(404, f"model {request.model!r} is not a local model directory with a config.json "
                                    f"(the server never downloads models): {hint}")
        if request.draft_model not in (None, DEFAULT_MODEL_NAME) or request.num_draft_tokens is not None:
            raise RequestError(400, f"speculative decoding is only available with {self.default.name!r}")
        return str(path.resolve())

    def get(self, key: Optional[str]) -> ServedModel:
        if key is None:
            return self.default
        if self.other is None or self.other.name != key:
            self.other = None  # free the previous one before loading
            log.info("Loading %s", key)
            try:
                self.other = ServedModel(key, None, self.cache_size, self.cache_bytes, self.chat_template)
            except (ValueError, FileNotFoundError) as e:
                raise RequestError(400, f"could not load model {key!r}: {e}") from None
        return self.other


class Job:
    """One request on its way through the worker. `events` carries, in order:
    ("keepalive", done, total)* and ("delta", text, [TokenLogprob])* (streams only),
    then ("done", GenerationResult) or ("error", status, message)."""

    def __init__(self, request: GenerationRequest, model_key: Optional[str]):
        self.request = request
        self.model_key = model_key
        self.events: "queue.Queue[tuple]" = queue.Queue()
        self.cancelled = threading.Event()


class _Cancelled(Exception):
    """The client went away during prefill."""


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
            return
        try:
            job.events.put(("done", self.generate(job)))
        except RequestError as e:
            job.events.put(("error", e.status, e.message))
        except _Cancelled:
            log.info("Client disconnected during prefill; request dropped")
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
                raise _Cancelled()
            if job.request.stream:
                job.events.put(("keepalive", num_fed + done, total))

        return progress

    def _store_prompt(self, served: ServedModel, job: Job, tokens: List[int], remaining: List[int],
                      prompt_cache: List[Any], num_cached: int) -> List[int]:
        """For caches that may not trim: prefill all prompt tokens but the last and store
        the cache there (for an identical request) and, fed the last token on a copy,
        at the whole prompt (for a next turn extending it: it then prefills only its
        new tokens). The copy costs one extra single-token forward. Returns the tokens
        still to feed."""
        if len(remaining) > 1:
            progress = self._progress(job, num_cached, len(tokens))
            remaining = served.prefill(remaining, prompt_cache, self.prefill_step_size, progress)
        lru = served.prompt_cache
        if len(tokens) > 1 and tokens[:-1] not in lru:
            lru.insert(tokens[:-1], copy_prompt_cache(prompt_cache))
        if tokens not in lru:
            whole = copy_prompt_cache(prompt_cache)
            served.feed(remaining, whole)
            lru.insert(tokens, whole)
        return remaining

    def generate(self, job: Job) -> GenerationResult:
        request = job.request
        served = self.provider.get(job.model_key)
        if request.num_draft_tokens is not None and served.draft_model is None:
            raise RequestError(400, "num_draft_tokens needs a server started with --draft-model")
        tokens = served.encode(request)
        sampler, processors = self._sampling(served, request)
        if request.seed is not None:
            mx.random.seed(request.seed % (1 << 64))
        fetched = served.prompt_cache.fetch(tokens)
        prompt_cache = fetched.prompt_cache or served.make_cache()
        remaining = fetched.remaining
        if served.snapshot_prompts:
            remaining = self._store_prompt(served, job, tokens, remaining, prompt_cache, fetched.num_cached)
        num_fed = len(tokens) - len(remaining)
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
            served.model, served.tokenizer, mx.array(remaining), request.max_tokens,
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
    daemon_threads = True  # a hung client never keeps the process alive

    def __init__(self, address, provider: ModelProvider, worker: GenerationWorker, defaults: ServerDefaults,
                 allowed_origins: List[str]):
        super().__init__(address, APIHandler)
        self.provider = provider
        self.worker = worker
        self.defaults = defaults
        self.allowed_origins = allowed_origins


class _ClientGone(Exception):
    pass


class APIHandler(BaseHTTPRequestHandler):
    server: APIServer
    protocol_version = "HTTP/1.1"
    POST_ROUTES = {"/v1/chat/completions": "chat", "/chat/completions": "chat", "/v1/completions": "text"}

    def log_message(self, format: str, *args: Any) -> None:
        log.debug("%s - %s", self.address_string(), format % args)

    # -- plumbing

    def _cors(self) -> None:
        origins = self.server.allowed_origins
        origin = self.headers.get("Origin")
        if "*" in origins:
            self.send_header("Access-Control-Allow-Origin", "*")
        elif origin in origins:
            self.send_header("Access-Control-Allow-Origin", origin)
            self.send_header("Vary", "Origin")

    def _send_json(self, status: int, body: dict) -> None:
        data = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self._cors()
        self.end_headers()
        self.wfile.write(data)
        self.wfile.flush()

    def _send_error(self, status: int, message: str) -> None:
        self._send_json(status, error_body(status, message))

    def _write_event(self, data: str) -> None:
        self.wfile.write(data.encode())
        self.wfile.flush()

    def _read_body(self) -> Any:
        length = self.headers.get("Content-Length")
        if length is None:
            self.close_connection = True
            raise RequestError(411, "a Content-Length header is required")
        if not length.strip().isdigit():
            self.close_connection = True
            raise RequestError(400, f"invalid Content-Length header {length!r}")
        if int(length) > MAX_BODY_BYTES:
            self.close_connection = True
            raise RequestError(413, f"the request body exceeds {MAX_BODY_BYTES} bytes")
        raw = self.rfile.read(int(length))
        try:
            return json.loads(raw)
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise RequestError(400, f"the request body is not valid JSON: {e}") from None

    # -- routes

    def do_OPTIONS(self) -> None:
        self.send_response(204)
        self._cors()
        self.send_header("Access-Control-Allow-Methods", "GET, POST, OPTIONS")
        self.send_header("Access-Control-Allow-Headers", "Content-Type, Authorization")
        self.send_header("Content-Length", "0")
        self.end_headers()

    def do_GET(self) -> None:
        path = self.path.split("?", 1)[0].rstrip("/")
        name = self.server.provider.default.name
        model = {"id": name, "object": "model", "created": int(time.time()), "owned_by": "mlx_lm"}
        if path == "/health":
            self._send_json(200, {"status": "ok"})
        elif path == "/v1/models":
            self._send_json(200, {"object": "list", "data": [model]})
        elif path.startswith("/v1/models/") and path[len("/v1/models/"):] in self.server.provider.names:
            self._send_json(200, model)
        else:
            self._send_error(404, f"no such endpoint: GET {path}")

    def do_POST(self) -> None:
        try:
            body = self._read_body()
            kind = self.POST_ROUTES.get(self.path.split("?", 1)[0].rstrip("/"))
            if kind is None:
                raise RequestError(404, f"no such endpoint: POST {self.path}")
            request = parse_request(body, kind, self.server.defaults)
            job = Job(request, self.server.provider.resolve(request))
        except RequestError as e:
            self._send_error(e.status, e.message)
            return
        self.server.worker.submit(job)
        name = self.server.provider.default.name if job.model_key is None else job.model_key
        builder = ResponseBuilder(request, name)
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
                if self._client_closed():
                    raise _ClientGone() from None

    def _client_closed(self) -> bool:
        try:
            readable, _, _ = select.select([self.connection], [], [], 0)
            return bool(readable) and self.connection.recv(1, socket.MSG_PEEK) == b""
        except OSError:
            return True

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
        started = False
        while True:
            event = self._next_event(job)
            if event[0] == "error" and not started:
                self._send_error(event[1], event[2])
                return
            if not started:
                self._start_stream(builder)
                started = True
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


def setup_arg_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description="OpenAI-compatible HTTP server for an MLX language model")
    parser.add_argument("--model", required=True, help="Local model directory or Hugging Face repo id to serve")
    parser.add_argument("--draft-model", default=None,
                        help="A smaller model sharing the tokenizer, for speculative decoding")
    parser.add_argument("--num-draft-tokens", type=positive_int, default=3,
                        help="Tokens the draft proposes per target forward (requests may override)")
    parser.add_argument("--host", default="127.0.0.1", help="Address to bind (default: local connections only)")
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
                        help="Memory bound of the kept prompt caches, e.g. 8GB")
    parser.add_argument("--prefill-step-size", type=positive_int, default=2048, help="Prompt tokens per prefill forward")
    parser.add_argument("--allowed-origins", default="*", help="CORS: '*' or a comma-separated list of origins")
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


def main(argv: Optional[List[str]] = None) -> None:
    parser = setup_arg_parser()
    args = parser.parse_args(argv)
    defaults = _check_defaults(parser, args)
    logging.basicConfig(level=args.log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    cache_bytes = (1 << 63) if args.prompt_cache_bytes is None else args.prompt_cache_bytes
    try:
        provider = ModelProvider(args.model, args.draft_model, args.allow_other_models, args.prompt_cache_size,
                                 cache_bytes, args.chat_template or None)
    except (ValueError, FileNotFoundError) as e:
        sys.exit(f"Error: {e}")
    worker = GenerationWorker(provider, args.prefill_step_size, args.num_draft_tokens)
    origins = [o.strip() for o in args.allowed_origins.split(",") if o.strip()]
    server = APIServer((args.host, args.port), provider, worker, defaults, origins)
    threading.Thread(target=worker.run_forever, name="generation", daemon=True).start()
    if args.host not in ("127.0.0.1", "localhost", "::1"):
        log.warning("Listening on %s: the server has no authentication; anyone who can reach it can use it", args.host)
    host, port = server.server_address[:2]
    log.info("Serving %s%s on http://%s:%d", args.model,
             f" with draft {args.draft_model}" if args.draft_model else "", host, port)
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        server.server_close()


if __name__ == "__main__":
    main()
