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
exactly (see serving.py). With --kv-bits the KV caches are quantized as
`stream_generate(..., kv_bits=...)` quantizes them, and requests are served one at a
time, as upstream's are (generation_worker.py).

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

Modules: here the command line and APIServer (connections); api_handler.py the handler,
whose routes call upstream's hook methods (handle_completion, handle_chat_completions,
...), so that a subclass's overrides are served; http_input.py a connection's input
(deadlines, body framing); server_embedding.py upstream's embedding API;
chat_messages.py upstream's convert_chat and process_message_content.

Extensions to OpenAI's schema: request `num_draft_tokens`; in `usage`,
`speculation: {num_drafted, num_accepted, num_target_forwards, ...}` (with the
per-depth acceptance, round costs and the speedup bound: openai_api.usage) and
`completion_tokens_details.{accepted,rejected}_prediction_tokens` (draft tokens the
target accepted / rejected).
"""

import argparse
import json
import logging
import math
import re
import socket
import sys
import time
from http.server import ThreadingHTTPServer
from typing import List, Optional

import mlx.core as mx

from . import distributed, distributed_serving, server_embedding
from .api_handler import APIHandler, WORKER_STOPPED  # noqa: F401  (WORKER_STOPPED: the handler's 503)
from .chat_messages import convert_chat, process_message_content  # noqa: F401  (upstream's helpers)
from .chat_output import ToolCallFormatter  # noqa: F401  (upstream's home of the name)
from .cli_args import (
    HelpFormatter,
    add_default_chat_template_argument,
    add_drafter_arguments,
    add_dtype_argument,
    add_kv_quantization_arguments,
    check_one_drafter,
    json_object,
    positive_float,
    positive_int,
    use_default_chat_template,
)
from .connection_slots import ConnectionSlots
from .fast_blas import blas_line
from .feeding import DEFAULT_PREFILL_STEP_SIZE
from .http_input import body_size  # noqa: F401  (was defined here)
from .models.cache import check_kv_quantization
from .openai_api import MAX_TOKENS_LIMIT, ServerDefaults, error_body
from .openai_api import get_system_fingerprint  # noqa: F401  (upstream's name)
# Upstream's embedding API, for `from mlx_lm.server import ...` (server_embedding.py).
from .server_embedding import LRUPromptCache, ModelProvider, ResponseGenerator, SamplingArguments  # noqa: F401
from .server_embedding import (  # noqa: F401  (upstream's request API of ResponseGenerator.generate)
    CompletionRequest, GenerationArguments, GenerationContext, LogitsProcessorArguments, ModelDescription, Response,
)
from .server_upstream import TimeBudget, Vision  # noqa: F401  (upstream's names; unused by this server)
from .serving import (
    PROMPT_CACHE_MEMORY_FRACTION,
    BatchWorker,
    GenerationWorker,
    ModelProvider as ServingModelProvider,
    ServedModel,
)
from .utils import compute_dtype, parameter_dtypes

log = logging.getLogger("mlx_lm.server")


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
    parser.add_argument("--adapter-path", default=None,
                        help="LoRA/DoRA adapters for --model (adapter_config.json + adapters.safetensors)")
    parser.add_argument("--trust-remote-code", action="store_true",
                        help="Let the tokenizers run their repo's own code (transformers' option)")
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
    add_default_chat_template_argument(parser)
    add_kv_quantization_arguments(parser, "; less memory for long contexts. Turns batching off, as upstream's: "
                                          "requests are served one at a time")
    parser.add_argument("--prompt-cache-size", type=int, default=10, help="Prompt caches kept for reuse (0: none)")
    parser.add_argument("--prompt-cache-bytes", type=parse_size, default=None,
                        help="Memory bound of the kept prompt caches, e.g. 8GB "
                             f"(default: {PROMPT_CACHE_MEMORY_FRACTION * 100:.0f}%% of the memory free after loading)")
    parser.add_argument("--max-prompt-tokens", type=positive_int, default=None,
                        help="Refuse longer prompts (default: the model's context, max_position_embeddings)")
    parser.add_argument("--prefill-step-size", type=positive_int, default=DEFAULT_PREFILL_STEP_SIZE,
                        help="Prompt tokens per prefill forward")
    parser.add_argument("--max-batch-size", "--decode-concurrency", type=positive_int, default=8,
                        help="Requests decoded together (continuous batching; with --prompt-lookup or a "
                             "--draft-model or --mtp they speculate inside the batch; 1: one at a time). "
                             "mlx.launch serves one at a time. --decode-concurrency: upstream's name")
    parser.add_argument("--prompt-concurrency", type=positive_int, default=8,
                        help="Prompts prefilled together in the batch (upstream's flag)")
    parser.add_argument("--pipeline", action="store_true",
                        help="Under mlx.launch, split the model's layers across the ranks (pipeline parallel) "
                             "instead of sharding every layer")
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
    if args.kv_bits is not None:
        try:
            check_kv_quantization([], args.kv_group_size, args.kv_bits, args.quantized_kv_start)
        except ValueError as e:
            parser.error(f"--kv-bits {args.kv_bits} --kv-group-size {args.kv_group_size} --quantized-kv-start "
                         f"{args.quantized_kv_start}: {e}")
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
    """The served models. --adapter-path and --use-default-chat-template apply to --model,
    --trust-remote-code to it and the draft; other models that requests may name
    (--allow-other-models) load without them."""
    load_options = {"adapter_path": args.adapter_path, "trust_remote_code": args.trust_remote_code}
    provider = ServingModelProvider(args.model, args.draft_model, args.allow_other_models, args.prompt_cache_size,
                                    args.prompt_cache_bytes, args.chat_template or None, args.max_prompt_tokens,
                                    args.dtype, mtp=args.mtp, group=group, pipeline=args.pipeline,
                                    load_options=load_options)
    if args.use_default_chat_template:
        use_default_chat_template(provider.default.tokenizer)
    return provider


def make_worker(args: argparse.Namespace, group: mx.distributed.Group,
                provider: ServingModelProvider) -> GenerationWorker:
    """The continuous batch, or one request at a time: under mlx.launch
    (distributed_serving.py), with --max-batch-size 1, or with --kv-bits (the batch
    keeps float KV caches; upstream turns batching off for it too)."""
    if args.kv_bits is not None and args.max_batch_size > 1:
        log.info("--kv-bits: batching is off, requests are served one at a time")
    if group.size() == 1 and args.max_batch_size > 1 and args.kv_bits is None:
        return BatchWorker(provider, args.prefill_step_size, args.max_batch_size, args.num_draft_tokens,
                           args.prompt_lookup, args.max_ngram_size, args.fixed_draft_length, args.prompt_concurrency)
    return distributed_serving.make_worker(group, provider, args)


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
    if group.size() > 1 and args.adapter_path is not None:
        parser.error(f"--adapter-path {args.adapter_path!r}: adapters are not sharded; under mlx.launch fuse them "
                     "first (mlx_lm.fuse) and serve the fused model")
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
        log.info("%s parallel over %d ranks: %d decoder layers on rank 0", "Pipeline" if args.pipeline else "Tensor",
                 group.size(), len(server.provider.default.model.layers))
    _log_limits(server.provider.default, args.max_prompt_tokens)
    log.info("Compute dtype: %s (%s)", parameter_dtypes(server.provider.default.model), compute_dtype(args.dtype)[1])
    line = blas_line()
    if line is not None:
        log.info(line)
    try:
        server.worker = make_worker(args, group, server.provider)
    except ValueError as e:  # e.g. --prompt-lookup on a model whose caches cannot roll back
        server.server_close()
        sys.exit(f"Error: {e}")
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
