"""`mlx_lm.server`: an OpenAI-compatible HTTP server on the standard library.

Endpoints: POST /v1/chat/completions (also /chat/completions), POST /v1/completions,
GET /v1/models, GET /health. Streaming is by server-sent events: `data: {json}` chunks,
a last chunk carrying finish_reason, a usage chunk when `stream_options.include_usage`,
then `data: [DONE]`; `: keepalive <done>/<total>` comments go out during prefill.

Serving (serving.py). The model (and `--draft-model`) is loaded once; request handler
threads parse, validate and tokenize; one worker thread runs every MLX computation,
so generation is serialised. Prompts past the model's context are refused before any
work, a client that disconnects has its job cancelled, and prompt caches are reused
exactly (see serving.py).

Connections. The port is bound before the model loads. One thread per connection, at
most --max-connections (past that: 503 and close); every read and write waits at most
--request-timeout (408 for a body that stops short); every refusal is a JSON error in
OpenAI's shape. Web pages get in only from --allowed-origins (CORS): a request whose
Origin header is not listed is refused with 403 before any work.

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
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Callable, List, Optional
from urllib.parse import unquote

import mlx.core as mx

from . import distributed, distributed_serving
from .cli_args import (
    HelpFormatter,
    add_drafter_arguments,
    add_dtype_argument,
    check_one_drafter,
    json_object,
    positive_float,
    positive_int,
)
from .openai_api import (
    MAX_BODY_BYTES,
    MAX_JSON_DEPTH,
    MAX_TOKENS_LIMIT,
    RequestError,
    ResponseBuilder,
    ServerDefaults,
    error_body,
    parse_request,
)
from .utils import compute_dtype, parameter_dtypes
from .serving import (
    PROMPT_CACHE_MEMORY_FRACTION,
    BatchWorker,
    GenerationWorker,
    Job,
    ModelProvider,
    ServedModel,
    model_id,
)

log = logging.getLogger("mlx_lm.server")


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


def setup_arg_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description="OpenAI-compatible HTTP server for an MLX language model",
                                     formatter_class=HelpFormatter)
    parser.add_argument("--model", required=True, help="Local model directory or Hugging Face repo id to serve")
    parser.add_argument("--draft-model", default=None,
                        help="A smaller model sharing the tokenizer, for speculative decoding")
    add_drafter_arguments(parser)
    parser.add_argument("--num-draft-tokens", type=positive_int, default=3,
                        help="At most this many tokens drafted per target forward, each round choosing 0..N from "
                        "the measured acceptance and speed (requests may override N)")
    parser.add_argument("--fixed-draft-length", action="store_true",
                        help="Draft exactly N tokens every round (requests with a seed and temperature > 0 "
                        "always do, so that they replay exactly)")
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
    parser.add_argument("--max-batch-size", type=positive_int, default=8,
                        help="Requests decoded together (continuous batching; with --prompt-lookup or a "
                             "--draft-model or --mtp they speculate inside the batch; 1: one at a time). "
                             "mlx.launch serves one at a time")
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
    add_dtype_argument(parser)
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


def make_provider(args: argparse.Namespace, group: mx.distributed.Group) -> ModelProvider:
    return ModelProvider(args.model, args.draft_model, args.allow_other_models, args.prompt_cache_size,
                         args.prompt_cache_bytes, args.chat_template or None, args.max_prompt_tokens, args.dtype,
                         mtp=args.mtp, group=group)


def main(argv: Optional[List[str]] = None) -> None:
    parser = setup_arg_parser()
    args = parser.parse_args(argv)
    defaults = _check_defaults(parser, args)
    check_one_drafter(parser, args)
    origins = _parse_origins(parser, args.allowed_origins)
    logging.basicConfig(level=args.log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    group = distributed.world()
    if group.size() > 1:  # under mlx.launch: rank 0 serves, the others follow (distributed_serving.py)
        distributed_serving.agree_on_settings(parser, args, group)
        if group.rank() != 0:
            return distributed_serving.follow(args, group, make_provider(args, group))
    # Bind first: a busy port or a bad address is reported before a long model load.
    try:
        server = APIServer(args.host, args.port, defaults, origins, args.max_connections, args.request_timeout)
    except OSError as e:
        where = f"[{args.host}]:{args.port}" if ":" in args.host else f"{args.host}:{args.port}"
        sys.exit(f"Error: cannot listen on {where}: {(e.strerror or str(e)).lower()}")
    try:
        server.provider = make_provider(args, group)
    except (ValueError, FileNotFoundError) as e:
        server.server_close()
        sys.exit(f"Error: {e}")
    if group.size() > 1:
        distributed_serving.agree_on_cache_bytes(server.provider, group)
    _log_limits(server.provider.default, args.max_prompt_tokens)
    log.info("Compute dtype: %s (%s)", parameter_dtypes(server.provider.default.model), compute_dtype(args.dtype)[1])
    # A server under mlx.launch serves one request at a time (distributed_serving.py).
    if group.size() == 1 and args.max_batch_size > 1:
        try:
            server.worker = BatchWorker(server.provider, args.prefill_step_size, args.max_batch_size,
                                        args.num_draft_tokens, args.prompt_lookup, args.max_ngram_size,
                                        args.fixed_draft_length)
        except ValueError as e:  # e.g. --prompt-lookup on a model whose caches cannot roll back
            server.server_close()
            sys.exit(f"Error: {e}")
    else:
        server.worker = distributed_serving.make_worker(group, server.provider, args)
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
