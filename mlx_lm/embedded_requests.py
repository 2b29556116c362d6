"""Upstream mlx-lm 0.32.2's in-process request API of its server, over this project's
worker: `ResponseGenerator.generate(request, generation_args, progress_callback)`
returns (GenerationContext, iterator of Response), with upstream's dataclasses
(CompletionRequest, GenerationArguments, ModelDescription, SamplingArguments,
LogitsProcessorArguments). The request becomes the GenerationRequest an HTTP body with
the same fields would (openai_api.parse_request validates it), and the worker's events
become Responses.

What differs from upstream, on purpose:
- A Response is a piece of text as the worker sends it: one token's, or a run of
  tokens' when speculation accepts several, with stop strings already cut; the pieces
  add up to the answer, and the last Response (text "") carries finish_reason. The
  worker reports text, not ids: `token` is None, top_tokens entries are
  {"token", "logprob"} without "id".
- A request this server refuses (bad values, a model it does not serve, a prompt past
  the context) raises ValueError from generate, before anything is generated; upstream
  raises what its checks raise.
- `role_mapping` (upstream's rendering for models without a chat template) and
  `adapter` are refused when set.
"""

from dataclasses import dataclass, field
from typing import Any, Callable, Dict, Iterator, List, Literal, Optional, Tuple

from .openai_api import GenerationRequest, RequestError, ServerDefaults, TokenLogprob, parse_request
from .sample_utils import make_sampler
from .text_state_machine import TextStateMachine


@dataclass
class ModelDescription:
    """Upstream's names of the requested model, draft and adapter."""

    model: str
    draft: Optional[str]
    adapter: Optional[str]


@dataclass
class SamplingArguments:
    """Upstream's sampling settings of one request."""

    temperature: float
    top_p: float
    top_k: int
    min_p: float
    xtc_probability: float
    xtc_threshold: float

    def make_sampler(self, tokenizer: Any):
        """The sampler, keeping newlines and end-of-sequence tokens out of XTC's reach
        as upstream's server does (XTC would otherwise cut answers short)."""
        special = list(tokenizer.encode("\n", add_special_tokens=False)) + sorted(tokenizer.eos_token_ids)
        return make_sampler(self.temperature, top_p=self.top_p, top_k=self.top_k, min_p=self.min_p,
                            xtc_probability=self.xtc_probability, xtc_threshold=self.xtc_threshold,
                            xtc_special_tokens=special)


@dataclass
class LogitsProcessorArguments:
    """Upstream's penalties; a penalty of 0 (upstream's default) is none."""

    logit_bias: Optional[Dict[int, float]]
    repetition_penalty: float
    repetition_context_size: int
    presence_penalty: float
    presence_context_size: int
    frequency_penalty: float
    frequency_context_size: int


@dataclass
class GenerationArguments:
    model: ModelDescription
    sampling: SamplingArguments
    logits: LogitsProcessorArguments
    stop_words: List[str]
    max_tokens: int
    num_draft_tokens: int
    logprobs: bool
    top_logprobs: int
    seed: Optional[int]
    chat_template_kwargs: Optional[Dict[str, Any]]


@dataclass
class CompletionRequest:
    request_type: Literal["chat", "text"]
    prompt: str
    messages: List[Any]
    tools: Optional[List[Any]]
    role_mapping: Optional[Dict[str, Any]]


@dataclass
class GenerationContext:
    """What upstream's handler reads beside the Responses: how to split the text
    (text_sm from initial_state; tool_parser reads a tool-call block), the prompt's
    tokens, and, once the answer is complete, how many of them the cache held."""

    has_tool_calling: bool
    has_thinking: bool
    tool_parser: Optional[Callable[[str, Any], Any]]
    text_sm: TextStateMachine
    initial_state: str
    prompt: List[int]
    prompt_cache_count: int = -1
    cancel: Callable[[], None] = field(default=lambda: None, repr=False)

    def stop(self) -> None:
        """Stop generating (the worker stores the cache as far as it got)."""
        self.cancel()


@dataclass
class Response:
    text: str
    token: Optional[int]
    logprob: float
    finish_reason: Optional[str]
    top_tokens: Tuple[Dict[str, Any], ...]


def _penalties(logits: LogitsProcessorArguments) -> Dict[str, Any]:
    body: Dict[str, Any] = {}
    for name in ("repetition", "presence", "frequency"):
        penalty = getattr(logits, f"{name}_penalty")
        if penalty:  # upstream: 0 (its default) turns it off
            body[f"{name}_penalty"] = penalty
            body[f"{name}_context_size"] = getattr(logits, f"{name}_context_size")
    if logits.logit_bias:
        body["logit_bias"] = {str(k): v for k, v in logits.logit_bias.items()}
    return body


def request_body(request: CompletionRequest, args: GenerationArguments, speculating: bool) -> Dict[str, Any]:
    """The OpenAI body with the same fields as upstream's request and arguments.
    num_draft_tokens goes along only to a worker that speculates (upstream ignores it
    otherwise; here it would be refused)."""
    if args.model.adapter is not None:
        raise ValueError(f"adapter {args.model.adapter!r}: this server serves models without adapters")
    if request.request_type not in ("chat", "text"):
        raise ValueError(f"request_type must be 'chat' or 'text', got {request.request_type!r}")
    sampling = args.sampling
    body: Dict[str, Any] = {
        "model": args.model.model, "draft_model": args.model.draft, "max_tokens": args.max_tokens,
        "temperature": sampling.temperature, "top_p": sampling.top_p, "top_k": sampling.top_k,
        "min_p": sampling.min_p, "xtc_probability": sampling.xtc_probability,
        "xtc_threshold": sampling.xtc_threshold, "stop": list(args.stop_words or []), "seed": args.seed,
        "chat_template_kwargs": args.chat_template_kwargs or {}, "stream": True, **_penalties(args.logits),
    }
    if speculating:
        body["num_draft_tokens"] = args.num_draft_tokens
    top = max(args.top_logprobs or 0, 0)
    if request.request_type == "chat":
        if request.role_mapping is not None:
            raise ValueError("role_mapping is not supported: this server renders chats with the model's chat "
                             "template (give the model one, or send a text completion)")
        body.update(messages=request.messages, logprobs=bool(args.logprobs), top_logprobs=top)
        if request.tools:
            body["tools"] = request.tools
    else:
        body["prompt"] = request.prompt
        if args.logprobs:
            body["logprobs"] = top  # the completions API's logprobs: the number of alternatives
    return {k: v for k, v in body.items() if v is not None}


def to_generation_request(request: CompletionRequest, args: GenerationArguments, defaults: ServerDefaults,
                          speculating: bool) -> GenerationRequest:
    """The validated request; ValueError names what this server refuses."""
    try:
        return parse_request(request_body(request, args, speculating), request.request_type, defaults)
    except RequestError as e:
        raise ValueError(e.message) from None


def _top_tokens(entry: Optional[TokenLogprob]) -> Tuple[Dict[str, Any], ...]:
    return () if entry is None else tuple({"token": text, "logprob": value} for text, value in entry.top)


def responses(next_event: Callable[[], tuple], context: GenerationContext,
              progress_callback: Optional[Callable[[int, int], None]]) -> Iterator[Response]:
    """Upstream's Responses from a job's events (`next_event` returns them in order:
    keepalives, deltas, then done or error). Closing the iterator early stops the job."""
    finished = False
    try:
        while True:
            event = next_event()
            if event[0] == "keepalive":
                if progress_callback is not None:
                    progress_callback(event[1], event[2])
            elif event[0] == "delta":
                entries = event[2]
                last = entries[-1] if entries else None
                yield Response(event[1], None, 0.0 if last is None else last.logprob, None, _top_tokens(last))
            elif event[0] == "error":
                finished = True
                raise RuntimeError(f"generation failed ({event[1]}): {event[2]}")
            else:
                finished, result = True, event[1]
                context.prompt_cache_count = result.cached_tokens
                yield Response("", None, 0.0, result.finish_reason, ())
                return
    finally:
        if not finished:
            context.stop()

