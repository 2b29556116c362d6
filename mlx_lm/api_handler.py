"""`mlx_lm.server.APIHandler`: the HTTP handler of `mlx_lm.server` (on its APIServer) and
of upstream-style embedding (on a stock `http.server` server, server_embedding.py).

Requests go through upstream mlx-lm 0.32.2's handler methods, so that a subclass
overriding one is called and its result served: GET /health -> handle_health_check,
GET /v1/models[/<name>] -> handle_models_request; POST -> validate_model_parameters,
then handle_chat_completions or handle_text_completions (each returns a
CompletionRequest), then handle_completion(request, stop_words), which hands the request
to this project's worker (batching, speculation and every limit still apply). The
attributes upstream's hooks read are set as upstream's handler sets them (`body`,
`stream`, `max_tokens`, `temperature`, ..., `request_id`, `object_type`, `created`,
`response_generator` when embedded), and the header helpers upstream's overrides call
(`_set_completion_headers`, `_set_stream_headers`).

What differs from upstream, on purpose: a hook that raises ValueError (or an assert)
gets a 400 in OpenAI's error shape; handle_chat_completions returns the messages
checked (content parts joined, tool-call arguments decoded) rather than as sent; and
handle_models_request lists the served model only (upstream scans the Hugging Face cache);
/health's 503 is an error body naming why (upstream's: {"status": "unavailable"}).
Upstream's generate_response and completion_usage_response build upstream's bodies
from the request's attributes (server_upstream.py), but are not hooks here: answers
are openai_api.ResponseBuilder's, with this project's usage extensions.
"""

import dataclasses
import io
import json
import logging
import math
import queue
import select
import socket
import time
import uuid
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler
from typing import Any, Callable, Dict, List, Optional, Tuple
from urllib.parse import unquote

from . import server_embedding, server_upstream
from .chat_messages import convert_chat
from .connection_slots import Evicted
from .embedded_requests import CompletionRequest
from .http_input import RequestLate, RequestReader, body_size
from .metrics import CONTENT_TYPE
from .openai_api import (
    MAX_JSON_DEPTH,
    GenerationRequest,
    RequestError,
    ResponseBuilder,
    SYSTEM_FINGERPRINT,
    error_body,
    parse_request,
)
from .serving import Job, model_id

log = logging.getLogger("mlx_lm.server")

WORKER_STOPPED = "the generation worker stopped (see the server's log): this server answers no more requests; restart it"


class _ClientGone(Exception):
    pass


def upstream_fields(request: GenerationRequest, body: Dict[str, Any]) -> Dict[str, Any]:
    """Upstream's handler attributes for a checked request, with upstream's values
    for what the body leaves out (penalties 0, no logit bias, top_logprobs -1)."""
    sampling, penalties = request.sampling, request.penalties
    fields = dict(stream=request.stream, stream_options=body.get("stream_options"),
                  requested_model=request.model or "default_model",
                  requested_draft_model=request.draft_model or "default_model",
                  num_draft_tokens=request.num_draft_tokens, adapter=None, max_tokens=request.max_tokens,
                  temperature=sampling["temp"], top_p=sampling["top_p"], top_k=sampling["top_k"],
                  min_p=sampling["min_p"], xtc_probability=sampling["xtc_probability"],
                  xtc_threshold=sampling["xtc_threshold"], logit_bias=request.logit_bias or None,
                  logprobs=request.logprobs, top_logprobs=request.top_logprobs if request.logprobs else -1,
                  seed=request.seed, chat_template_kwargs=body.get("chat_template_kwargs"))
    for name in ("repetition", "presence", "frequency"):
        fields[f"{name}_penalty"] = penalties[f"{name}_penalty"] or 0.0
        fields[f"{name}_context_size"] = penalties[f"{name}_context_size"]
    return fields


def _as_request_error(hook: Callable[[], Any]) -> Any:
    """`hook()`; a ValueError or failed assert of an upstream-style hook is the
    request's fault, as upstream's handler takes it: a 400 carrying its message."""
    try:
        return hook()
    except (ValueError, AssertionError) as e:
        raise RequestError(400, str(e) or f"the request was refused ({type(e).__name__})") from None


def _role_mapping(value: Any) -> Optional[Dict[str, str]]:
    if value is None or (isinstance(value, dict) and all(isinstance(v, str) for v in value.values())):
        return value
    raise RequestError(400, f"'role_mapping' must be an object of strings (role -> prefix), got {value!r}"[:300])


class APIHandler(BaseHTTPRequestHandler):
    server: Any  # server.APIServer, or server_embedding.EmbeddedServer when embedded
    protocol_version = "HTTP/1.1"
    # Until a request line names its version; http.server's HTTP/0.9 default would send
    # error bodies without a status line. Nobody speaks HTTP/0.9.
    default_request_version = "HTTP/1.0"
    POST_ROUTES = {"/v1/chat/completions": "chat", "/chat/completions": "chat", "/v1/completions": "text"}
    PROBE_INTERVAL = 1.0  # seconds between writes that test a client whose side reads as closed
    request_id: Optional[str] = None  # upstream's: the answer's id, which handle_*_completions set

    def __init__(self, *args: Any, system_fingerprint: Optional[str] = None, **kwargs: Any):
        """APIServer's form, (request, client_address, server), or upstream's embedding
        form with a ResponseGenerator first, served by a stock http.server server
        (server_embedding.py), whose system_fingerprint replaces this project's in answers."""
        # Set before super() serves the request: upstream's hooks read them.
        self.system_fingerprint = system_fingerprint or SYSTEM_FINGERPRINT
        self.created = int(time.time())
        self.response_generator = None  # upstream's ResponseGenerator, when embedded
        if len(args) == 4:  # BaseRequestHandler takes three
            self.response_generator = args[0]
            args = server_embedding.split_handler_args(args)
            self.protocol_version = "HTTP/1.0"  # one request per connection, as upstream's handler
        super().__init__(*args, **kwargs)

    def setup(self) -> None:
        # Bounds each read and write; the request line and headers have a deadline too.
        self.timeout = self.server.request_timeout
        super().setup()
        self._slot = self.server.slots.slot(self.connection)
        self._reader = RequestReader(self.connection, self._slot, self.timeout)
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
        except RequestLate:
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

    def _set_completion_headers(self, status_code: int = 200) -> None:
        """Upstream's: a JSON answer's status line and headers, which the caller ends
        (end_headers) and follows with the body. It sends no Content-Length, so the
        connection closes after the body."""
        self._set_headers(status_code, "application/json")

    def _set_stream_headers(self, status_code: int = 200) -> None:
        """Upstream's: an event stream's status line and headers (as _set_completion_headers)."""
        self._set_headers(status_code, "text/event-stream")
        self.send_header("Cache-Control", "no-cache")

    def _set_headers(self, status: int, content_type: str) -> None:
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Connection", "close")
        self.close_connection = True
        self._cors()

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
        path = self._get_path()
        if path == "/health":
            self.handle_health_check()
        elif path == "/v1/models" or path.startswith("/v1/models/"):
            self.handle_models_request()
        elif path == "/metrics":
            worker = self.server.worker
            self._send(200, worker.metrics.exposition(worker.batch_size, worker.queue_length).encode(), CONTENT_TYPE)
        else:
            raise RequestError(404, f"no such endpoint: GET {path}")

    def _get_path(self) -> str:
        return unquote(self.path.split("?", 1)[0]).rstrip("/")

    def _post(self) -> None:
        """Upstream's order of hooks: validate_model_parameters, then
        handle_chat_completions or handle_text_completions make the CompletionRequest
        that handle_completion answers, with the body's stop strings."""
        self._kind = self.POST_ROUTES.get(self.path.split("?", 1)[0].rstrip("/"))
        if self._kind is None:
            self._read_body()  # a bad body is refused as such, even on a wrong path
            raise RequestError(404, f"no such endpoint: POST {self.path}")

        def completion_request() -> CompletionRequest:
            self.body = self._read_body()
            # Checked here, not in the hook: a subclass's validate_model_parameters cannot skip the limits.
            self.generation_request = parse_request(self.body, self._kind, self.server.defaults)
            vars(self).update(upstream_fields(self.generation_request, self.body))
            self.request_id = None  # a keep-alive connection's previous request had its own
            _as_request_error(self.validate_model_parameters)
            factory = self.handle_chat_completions if self._kind == "chat" else self.handle_text_completions
            return _as_request_error(factory)

        request = self._counted(completion_request)
        self.handle_completion(request, list(self.generation_request.stop))

    def _counted(self, work: Callable[[], Any]) -> Any:
        """`work()`; a refusal before the worker sees the request is counted in the
        metrics here (the worker counts the rest)."""
        try:
            return work()
        except Exception as e:
            self.server.worker.metrics.count_error(self._kind, e.status if isinstance(e, RequestError) else 500)
            raise

    def _job_requests(self, request: CompletionRequest, stop_words: List[str]
                      ) -> Tuple[GenerationRequest, GenerationRequest]:
        """(what the worker generates, what the answer is shaped as) for `request`: the
        body with the request attributes' values, and its messages or prompt, tools and
        stop strings replaced by the hooks' (all checked again). A chat for a model
        without a chat template is rendered as upstream renders it (convert_chat with
        the request's role_mapping) and generated as text."""
        if not (isinstance(request, CompletionRequest) and request.request_type in ("chat", "text")):
            raise RequestError(500, f"handle_*_completions returned {request!r}"[:300] + ": expected a "
                                    "CompletionRequest of request_type 'chat' or 'text'")
        kind = request.request_type
        body = {k: v for k, v in self._body_of_fields().items() if k not in ("messages", "prompt", "tools", "stop")}
        body.update({"messages": request.messages, "tools": request.tools} if kind == "chat"
                    else {"prompt": request.prompt})
        body["stop"] = stop_words
        answer = parse_request({k: v for k, v in body.items() if v is not None}, kind, self.server.defaults)
        provider = self.server.provider
        if kind == "text" or provider.resolve(answer) is not None or provider.default.tokenizer.has_chat_template:
            return answer, answer  # (another model's worker renders its own prompt)
        prompt = convert_chat(answer.messages, _role_mapping(request.role_mapping))
        return dataclasses.replace(answer, kind="text", messages=None, prompt=prompt), answer

    def _body_of_fields(self) -> Dict[str, Any]:
        """The body with the values of upstream's request attributes, which a hook may
        have changed (upstream's handle_completion generates with those)."""
        body = {k: v for k, v in self.body.items() if k != "max_completion_tokens"}
        body.update({name: getattr(self, name) for name in ("stream", "max_tokens", "temperature", "top_p", "top_k",
                                                          "min_p", "xtc_probability", "xtc_threshold", "seed",
                                                          "num_draft_tokens")})
        body["logit_bias"] = {str(k): v for k, v in self.logit_bias.items()} if self.logit_bias else None
        for name in ("repetition", "presence", "frequency"):
            body[f"{name}_penalty"] = getattr(self, f"{name}_penalty") or None  # upstream's 0: off
            body[f"{name}_context_size"] = getattr(self, f"{name}_context_size")
        return body

    # -- upstream's hooks: a subclass may override any of them, and the routes call each

    def validate_model_parameters(self) -> None:
        """Upstream's check of the request attributes (self.max_tokens, self.temperature,
        ...), for a subclass to extend (ValueError -> 400) or to change them. This
        project's checks of every field (openai_api.parse_request) have run already."""

    def _upstream_header(self) -> Dict[str, Any]:
        return {"id": self.request_id, "system_fingerprint": self.system_fingerprint, "object": self.object_type,
                "model": self.requested_model, "created": self.created}

    def generate_response(self, text: str, finish_reason: Optional[str], prompt_token_count: Optional[int] = None,
                          completion_token_count: Optional[int] = None, prompt_cache_count: Optional[int] = None,
                          token_logprobs: Optional[List[float]] = None, top_tokens: Optional[List[Tuple]] = None,
                          tokens: Optional[List[int]] = None, tool_calls: Optional[List[Any]] = None,
                          reasoning_text: Optional[str] = None) -> dict:
        """Upstream's answer packet (a chunk when the request streams) for this request,
        after handle_*_completions set its id and object type."""
        return server_upstream.response_packet(
            self._upstream_header(), self.stream, text, finish_reason, prompt_token_count=prompt_token_count,
            completion_token_count=completion_token_count, prompt_cache_count=prompt_cache_count,
            token_logprobs=token_logprobs, top_tokens=top_tokens, tokens=tokens, tool_calls=tool_calls,
            reasoning_text=reasoning_text)

    def completion_usage_response(self, prompt_token_count: int, completion_token_count: int,
                                  prompt_cache_count: Optional[int] = None) -> dict:
        """Upstream's usage-only packet (a stream's include_usage chunk)."""
        return server_upstream.usage_packet(self._upstream_header(), prompt_token_count, completion_token_count,
                                            prompt_cache_count)

    def handle_chat_completions(self) -> CompletionRequest:
        """The chat request of the body (its messages already checked: content as text,
        tool-call arguments as objects)."""
        self.request_id = f"chatcmpl-{uuid.uuid4()}"
        self.object_type = "chat.completion.chunk" if self.stream else "chat.completion"
        checked = self.generation_request
        return CompletionRequest("chat", "", checked.messages, checked.tools, self.body.get("role_mapping"))

    def handle_text_completions(self) -> CompletionRequest:
        """The completion request of the body (its prompt: text or token ids)."""
        self.request_id = f"cmpl-{uuid.uuid4()}"
        self.object_type = "text_completion"
        return CompletionRequest("text", self.generation_request.prompt, [], None, None)

    def handle_completion(self, request: CompletionRequest, stop_words: List[str]) -> None:
        """Answer `request` (as handle_*_completions returned it), streamed or not as the
        body asks. The worker generates it like any other request: batched with the
        others, speculating, within the server's limits."""
        job_request, answer_request = self._counted(lambda: self._job_requests(request, stop_words))
        job = self._counted(lambda: self.server.provider.make_job(job_request))  # tokenizes here
        self.server.worker.submit(job)
        name = self.server.provider.model_id if job.model_key is None else model_id(job.model_key)
        builder = ResponseBuilder(answer_request, name, lambda: job.chat_plan, system_fingerprint=self.system_fingerprint,
                                  response_id=self.request_id)
        self._last_probe = -math.inf
        try:
            if answer_request.stream:
                self._stream(job, builder)
            else:
                self._complete(job, builder)
        except (_ClientGone, OSError):
            job.cancelled.set()
            self.close_connection = True

    def handle_health_check(self) -> None:
        """GET /health: {"status": "ok"}, or 503 once the worker has stopped."""
        if not self.server.worker.alive:
            raise RequestError(503, WORKER_STOPPED)
        self._send_json(200, {"status": "ok"})

    def handle_models_request(self) -> None:
        """GET /v1/models: the served model; /v1/models/<name>: it, if `name` is one of
        its names (no other models are listed: requests may name only this one)."""
        provider, path = self.server.provider, self._get_path()
        model = {"id": provider.model_id, "object": "model", "created": self.created, "owned_by": "mlx_lm"}
        if path == "/v1/models":
            self._send_json(200, {"object": "list", "data": [model]})
        elif path[len("/v1/models/"):] in provider.names:
            self._send_json(200, model)
        else:
            raise RequestError(404, f"no such model: GET {path} (this server serves {provider.model_id!r})")

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
        self._set_stream_headers(200)  # the end of the stream ends the response: the connection closes
        self.end_headers()
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


