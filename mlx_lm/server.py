"""`mlx_lm.server`: an OpenAI-compatible HTTP server on the standard library.

Endpoints: POST /v1/chat/completions (also /chat/completions), POST /v1/completions,
GET /v1/models, GET /health, GET /metrics (Prometheus text format; metrics.py).
Streaming is by server-sent events: `data: {json}` chunks, a last chunk carrying
finish_reason, a usage chunk when `stream_options.include_usage`, then `data: [DONE]`;
`: keepalive <done>/<total>` comments go out during prefill.

Serving (serving.py). The model (and `--draft-model`) is loaded once; request handler
threads parse, validate and tokenize; one worker thread runs every MLX computation,
so generation is serialised. Prompts past the model's context are refused before any
work, a client that disconnects has its job cancelled, and prompt caches are reused
exactly (see serving.py).

Connections. The port is bound before the model loads. One thread per connection, at
most --max-connections. A connection waiting for a request (just opened, idle between
keep-alive requests, or with a request line and headers still arriving) keeps its slot
only until a new connection needs one: at the limit the one that has waited longest is
closed. Only when every slot serves a request is a new connection refused (503 and
close, from the accepting thread). --request-timeout bounds, in all, the wait for a
request's line and headers, counted from the connect or the end of the previous answer
(then 408 and close, or a silent close if nothing came), and bounds each read of a body
(408 for a body that stops short) and each write. Every refusal is a JSON error in
OpenAI's shape. A request must carry exactly one Content-Length (a repeated one is
refused even when the copies agree). Web pages get in only from --allowed-origins
(CORS): a request whose Origin header is not listed is refused with 403 before any work.

Tool calls and reasoning (chat_output.py): `tools`, `tool_choice` and
`parallel_tool_calls` as OpenAI's; the model's tool-call text (its format from
tool_parsers/) becomes `tool_calls` (streamed when a call is complete; finish_reason
"tool_calls"), and text between its reasoning markers `reasoning_content` (also
upstream's `reasoning`). Tool-call text that does not parse is returned as content.

Extensions to OpenAI's schema: request `num_draft_tokens`; in `usage`,
`speculation: {num_drafted, num_accepted, num_target_forwards, ...}` (with the
per-depth acceptance, round costs and the speedup bound: openai_api.usage) and
`completion_tokens_details.{accepted,rejected}_prediction_tokens` (draft tokens the
target accepted / rejected).
"""

import argparse
import io
import json
import logging
import math
import queue
import re
import select
import socket
import sys
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
    SYSTEM_FINGERPRINT,
    ServerDefaults,
    error_body,
    parse_request,
)
from .chat_output import ToolCallFormatter  # noqa: F401  (upstream's home of the name)
from .connection_slots import ConnectionSlot, ConnectionSlots, Evicted
from . import server_embedding
# Upstream's embedding API, for `from mlx_lm.server import ...` (server_embedding.py).
from .server_embedding import LRUPromptCache, ModelProvider, ResponseGenerator, SamplingArguments  # noqa: F401
from .server_embedding import (  # noqa: F401  (upstream's request API of ResponseGenerator.generate)
    CompletionRequest, GenerationArguments, GenerationContext, LogitsProcessorArguments, ModelDescription, Response,
)
from .utils import compute_dtype, parameter_dtypes
from .feeding import DEFAULT_PREFILL_STEP_SIZE
from .fast_blas import blas_line
from .metrics import CONTENT_TYPE
from .serving import (
    PROMPT_CACHE_MEMORY_FRACTION,
    BatchWorker,
    GenerationWorker,
    Job,
    ModelProvider as ServingModelProvider,
    ServedModel,
    model_id,
)

log = logging.getLogger("mlx_lm.server")


# ---------------------------------------------------------------------------
# Connection slots.


class _RequestLate(Exception):
    """A request line and headers not all there by the connection's deadline."""


class _RequestReader(io.RawIOBase):
    """A connection's input under the handler's buffered `rfile`. While `deadline` is
    set (reading a request line and headers) each read waits only for what is left of
    it, so a client trickling a byte at a time cannot stretch the wait; otherwise each
    read waits at most `timeout` (the socket's own)."""

    def __init__(self, sock: socket.socket, slot: ConnectionSlot, timeout: float):
        self._sock, self._slot, self._timeout = sock, slot, timeout
        self.deadline: Optional[float] = None  # time.monotonic() seconds
        self.received = 0  # bytes read since the deadline was set

    def readable(self) -> bool:
        return True

    def readinto(self, buffer) -> int:
        if self.deadline is None:
            return self._sock.recv_into(buffer)
        if self._slot.evicted:
            raise Evicted()
        left = self.deadline - time.monotonic()
        if left <= 0:
            raise _RequestLate()
        self._sock.settimeout(left)
        try:
            count = self._sock.recv_into(buffer)
        except TimeoutError:
            raise _RequestLate() from None
        finally:
            self._sock.settimeout(self._timeout)
        if self._slot.evicted:  # its end of input came from the eviction, not the peer
            raise Evicted()
        self.received += count
        return count


def body_size(headers) -> int:
    """The byte count of a request body from its headers; RequestError unless exactly
    one Content-Length (of ASCII digits, and no Transfer-Encoding) gives it."""
    if headers.get("Transfer-Encoding") is not None:
        raise RequestError(411, "chunked request bodies are not supported: send a Content-Length header")
    lengths = headers.get_all("Content-Length", [])
    if not lengths:
        raise RequestError(411, "a Content-Length header is required")
    if len(lengths) > 1:  # which one frames the body is exactly what request smuggling plays on
        raise RequestError(400, f"the request has {len(lengths)} Content-Length headers: send exactly one")
    length = lengths[0].strip()
    if not (length.isascii() and length.isdigit()):  # str.isdigit() alone takes "\u00b2"
        shown = repr(length) if len(length) <= 40 else repr(length[:40]) + "..."
        raise RequestError(400, f"invalid Content-Length header {shown}: expected a byte count")
    digits = length.lstrip("0") or "0"  # int() refuses over 4300 digits, even zeros
    if len(digits) > 18:
        raise RequestError(400, f"invalid Content-Length header: {len(digits)} digits, more than 18 digits "
                                "(no body is that long)")
    size = int(digits)
    if size > MAX_BODY_BYTES:
        raise RequestError(413, f"the request body exceeds {MAX_BODY_BYTES} bytes")
    return size


# ---------------------------------------------------------------------------
# HTTP.


class APIServer(ThreadingHTTPServer):
    """Binds at construction (before any model loads); `provider` and `worker` are set
    once loaded. One thread per connection, at most `max_connections` at once (see
    ConnectionSlots): past that a connection gets a 503 from the accepting thread and
    is closed."""

    daemon_threads = True  # a hung client never keeps the process alive
    request_queue_size = 128  # listen backlog: a burst of connects waits here, not for a SYN retry

    def __init__(self, host: str, port: int, defaults: ServerDefaults, allowed_origins: List[str],
                 max_connections: int, request_timeout: float):
        # Hostnames never contain ':', IPv6 literals always do.
        self.address_family = socket.AF_INET6 if ":" in host else socket.AF_INET
        super().__init__((host, port), APIHandler)
        self.provider: Optional[ServingModelProvider] = None
        self.worker: Optional[GenerationWorker] = None
        self.defaults = defaults
        self.allowed_origins = allowed_origins
        self.request_timeout = request_timeout
        self.max_connections = max_connections
        self.slots = ConnectionSlots(max_connections)
        self._num_refused, self._last_refusal_log = 0, -math.inf
        body = json.dumps(error_body(503, f"the server is already serving {max_connections} requests "
                                          "(--max-connections); retry shortly")).encode()
        self._busy_response = (b"HTTP/1.1 503 Service Unavailable\r\nContent-Type: application/json\r\n"
                               b"Retry-After: 1\r\nConnection: close\r\nContent-Length: %d\r\n\r\n" % len(body) + body)

    @property
    def url(self) -> str:
        host, port = self.server_address[:2]
        return f"http://[{host}]:{port}" if self.address_family == socket.AF_INET6 else f"http://{host}:{port}"

    def process_request(self, request, client_address) -> None:
        if not self.slots.admit(request):
            self._refuse(request, client_address)
            return
        try:
            super().process_request(request, client_address)
        except BaseException:  # no thread took the slot
            self.slots.release(request)
            raise

    def process_request_thread(self, request, client_address) -> None:
        try:
            super().process_request_thread(request, client_address)
        finally:
            self.slots.release(request)

    def _refuse(self, sock: socket.socket, client_address) -> None:
        """Answer 503 without a thread. The response is smaller than any send buffer, so
        the non-blocking send never stalls the accept loop."""
        self._num_refused += 1
        if time.monotonic() - self._last_refusal_log > 10:  # a flood must not flood the log
            self._last_refusal_log = time.monotonic()
            log.warning("At --max-connections (%d), all serving: refusing connections (%d so far, latest from %s)",
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


WORKER_STOPPED = "the generation worker stopped (see the server's log): this server answers no more requests; restart it"


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

    def __init__(self, *args: Any, system_fingerprint: Optional[str] = None, **kwargs: Any):
        """APIServer's form, (request, client_address, server), or upstream's embedding
        form with a ResponseGenerator first, served by a stock http.server server
        (server_embedding.py), whose system_fingerprint replaces this project's in answers."""
        self.system_fingerprint = system_fingerprint or SYSTEM_FINGERPRINT  # set before super() serves
        if len(args) == 4:  # BaseRequestHandler takes three
            args = server_embedding.split_handler_args(args)
            self.protocol_version = "HTTP/1.0"  # one request per connection, as upstream's handler
        super().__init__(*args, **kwargs)

    def setup(self) -> None:
        # Bounds each read and write; the request line and headers have a deadline too.
        self.timeout = self.server.request_timeout
        super().setup()
        self._slot = self.server.slots.slot(self.connection)
        self._reader = _RequestReader(self.connection, self._slot, self.timeout)
        self.rfile.close()  # socketserver's reader, replaced by one that keeps the deadline
        self.rfile = io.BufferedReader(self._reader)

    def handle_one_request(self) -> None:
        """One request. Its line and headers must all arrive within --request-timeout of
        when the connection began waiting for them: a request late by then gets a 408
        (nothing if none of it came); a connection evicted meanwhile, nothing."""
        # Until this request's line is parsed, a reply or a log line must not show the last one's.
        self.requestline, self.command, self.request_version, self.headers = "", "", self.default_request_version, None
        self._response_started = False
        self._reader.deadline = self.server.slots.wait_for_request(self._slot) + self.server.request_timeout
        self._reader.received = 0
        try:
            super().handle_one_request()
        except Evicted:
            self.close_connection = True
        except _RequestLate:
            self.close_connection = True
            if self._reader.received:
                self._reply_error(408, "the request line and headers did not all arrive within "
                                       f"{self.server.request_timeout:g} s (--request-timeout)")

    def parse_request(self) -> bool:
        """http.server's, then the body and the answer get per-read timeouts only."""
        parsed = super().parse_request()
        self._reader.deadline = None
        self.server.slots.serve(self._slot)
        return parsed

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
        self._send(status, json.dumps(body).encode(), "application/json")

    def _send(self, status: int, data: bytes, content_type: str) -> None:
        self.send_response(status)
        if status == HTTPStatus.METHOD_NOT_ALLOWED:
            self.send_header("Allow", "GET, POST, OPTIONS")
        self.send_header("Content-Type", content_type)
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
        try:
            size = body_size(self.headers)
        except RequestError:
            self.close_connection = True  # where the body ends is unknown
            raise
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
        lengths = self.headers.get_all("Content-Length", [])
        if self.headers.get("Transfer-Encoding") is not None or lengths not in ([], ["0"]):
            self.close_connection = True

    def _guarded(self, route: Callable[[], None]) -> None:
        """Every failure becomes a JSON error, never a silently dropped connection."""
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
            if not self.server.worker.alive:
                raise RequestError(503, WORKER_STOPPED)
            self._send_json(200, {"status": "ok"})
        elif path == "/v1/models":
            self._send_json(200, {"object": "list", "data": [model]})
        elif path == "/metrics":
            worker = self.server.worker
            self._send(200, worker.metrics.exposition(worker.batch_size, worker.queue_length).encode(), CONTENT_TYPE)
        elif path.startswith("/v1/models/") and path[len("/v1/models/"):] in provider.names:
            self._send_json(200, model)
        else:
            raise RequestError(404, f"no such endpoint: GET {path}")

    def _post(self) -> None:
        kind = self.POST_ROUTES.get(self.path.split("?", 1)[0].rstrip("/"))
        try:
            body = self._read_body()
            if kind is None:
                raise RequestError(404, f"no such endpoint: POST {self.path}")
            request = parse_request(body, kind, self.server.defaults)
            job = self.server.provider.make_job(request)  # tokenizes here, not on the worker
        except Exception as e:
            if kind is not None:  # refused before the worker saw it (the worker counts the rest)
                self.server.worker.metrics.count_error(kind, e.status if isinstance(e, RequestError) else 500)
            raise
        self.server.worker.submit(job)
        name = self.server.provider.model_id if job.model_key is None else model_id(job.model_key)
        builder = ResponseBuilder(request, name, lambda: job.chat_plan, system_fingerprint=self.system_fingerprint)
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
                if not self.server.worker.alive:  # it would never answer
                    return ("error", 503, WORKER_STOPPED)

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
                chunk = builder.chunk(event[1], event[2])
                if chunk is not None:  # None: nothing to send yet (a tool call still being written)
                    self._write_event(f"data: {json.dumps(chunk)}\n\n")
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
    parser.add_argument("--prefill-step-size", type=positive_int, default=DEFAULT_PREFILL_STEP_SIZE,
                        help="Prompt tokens per prefill forward")
    parser.add_argument("--max-batch-size", type=positive_int, default=8,
                        help="Requests decoded together (continuous batching; with --prompt-lookup or a "
                             "--draft-model or --mtp they speculate inside the batch; 1: one at a time). "
                             "mlx.launch serves one at a time")
    parser.add_argument("--allowed-origins", default="",
                        help="Comma-separated web origins (e.g. http://localhost:3000) whose pages may call the "
                             "server, or '*' for any; requests from other pages (they carry an Origin header) "
                             "are refused with 403, requests without one are served (default: none)")
    parser.add_argument("--max-connections", type=positive_int, default=64,
                        help="Open connections at once (one thread each). At the limit a new connection takes "
                             "the slot of the one that has waited longest for a request (idle keep-alive, or "
                             "headers still arriving); only when all are serving does it get 503 and a close")
    parser.add_argument("--request-timeout", type=positive_float, default=30.0,
                        help="Seconds a request's line and headers may take in all (from the connect, or from the "
                             "end of the previous answer on a keep-alive connection), and that one read of a body "
                             "or one write may take, before the connection is closed")
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


def make_provider(args: argparse.Namespace, group: mx.distributed.Group) -> ServingModelProvider:
    return ServingModelProvider(args.model, args.draft_model, args.allow_other_models, args.prompt_cache_size,
                                args.prompt_cache_bytes, args.chat_template or None, args.max_prompt_tokens,
                                args.dtype, mtp=args.mtp, group=group)


def run(host: str, port: int, model_provider: ModelProvider, server_class: type = ThreadingHTTPServer,
        handler_class: type = APIHandler) -> None:
    """Upstream's `run`: serve `model_provider`'s model on host:port with a stock server
    class until interrupted (server_embedding.serve)."""
    server_embedding.serve(host, port, model_provider, server_class, handler_class)


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
    line = blas_line()
    if line is not None:
        log.info(line)
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
    server.worker.start()
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
