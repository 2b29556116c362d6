"""The OpenAI-compatible request/response layer of `mlx_lm.server`: request validation
(every field checked, errors as HTTP status + message), stop strings, and the
chat.completion / text_completion bodies and stream chunks, with usage and logprobs.
No model work happens here.
"""

import json
import math
import platform
import re
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional, Tuple

import mlx.core as mx

from ._version import __version__
from .chat_messages import IMAGE_PART_TYPES
from .chat_output import ChatDelta, ChatPlan, ChatTextRouter, plain_router
from .generate import SpeculationStats
from .server_upstream import NO_VISION

DEFAULT_MODEL_NAME = "default_model"  # what OpenAI-style clients send for "the model"
MAX_BODY_BYTES = 64 << 20
# Request limits beyond which a value is a mistake rather than a wish.
MAX_TOKENS_LIMIT = 1 << 20
MAX_TOP_LOGPROBS = 20
MAX_NUM_DRAFT_TOKENS = 64
MAX_CONTEXT_SIZE = 1 << 20
# Validators, chat templates and json.dumps recurse; real requests nest a handful of levels.
MAX_JSON_DEPTH = 64
# Stop strings are matched against every generated token: bounded so that a request
# cannot make that check expensive (OpenAI itself allows 4).
MAX_STOP_STRINGS = 16
MAX_STOP_LENGTH = 256

class RequestError(Exception):
    """A request the server refuses: HTTP `status` with an OpenAI-style error body."""

    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status = status
        self.message = message


# ---------------------------------------------------------------------------
# Request parsing and validation (handler threads; no MLX).


@dataclass
class ServerDefaults:
    """Values a request falls back to (from the command line)."""

    max_tokens: int = 512
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    chat_template_args: Dict[str, Any] = field(default_factory=dict)


@dataclass
class GenerationRequest:
    kind: str  # "chat" or "text"
    model: Optional[str]
    draft_model: Optional[str]
    messages: Optional[List[Dict[str, Any]]]
    prompt: Any  # text: a string or token ids
    tools: Optional[List[Any]]
    tool_choice: str  # "auto", "none" or "required" (also for a named function)
    named_tool: Optional[str]  # the function tool_choice names
    parallel_tool_calls: bool
    chat_template_kwargs: Dict[str, Any]
    max_tokens: int
    sampling: Dict[str, Any]  # make_sampler keyword arguments
    penalties: Dict[str, Any]  # make_logits_processors keyword arguments (but logit_bias)
    logit_bias: Dict[int, float]
    logprobs: bool
    top_logprobs: int
    seed: Optional[int]
    stop: List[str]
    stream: bool
    include_usage: bool
    num_draft_tokens: Optional[int]


_SURROGATE = re.compile("[\ud800-\udfff]")


def _child_path(parent: str, key: Any) -> str:
    if isinstance(key, int):
        return f"{parent}[{key}]"
    return f"{parent}.{key}" if parent else str(key)


def check_json_tree(body: Any) -> None:
    """Refuse a decoded body nested deeper than MAX_JSON_DEPTH, or holding text that
    cannot be UTF-8 encoded (a lone surrogate, from an unpaired \\ud800-\\udfff
    escape): the tokenizer would fail on it after the request was accepted. Iterative,
    so any depth json.loads returns is safe to walk."""
    stack = [(body, "", 1)]
    while stack:
        value, path, depth = stack.pop()
        if depth > MAX_JSON_DEPTH:
            where = path if len(path) <= 60 else path[:60] + "..."
            raise RequestError(400, f"the request body nests JSON deeper than {MAX_JSON_DEPTH} levels "
                                    f"(at '{where}'): send a flatter body")
        items = value.items() if isinstance(value, dict) else enumerate(value)
        for key, item in items:
            if isinstance(key, str) and not key.isascii() and _SURROGATE.search(key):
                raise RequestError(400, f"a key in '{path or 'the request body'}' is not valid Unicode: "
                                        "it holds a lone surrogate (\\ud800-\\udfff escapes must come in pairs)")
            if isinstance(item, str):
                if not item.isascii() and _SURROGATE.search(item):
                    raise RequestError(400, f"'{_child_path(path, key)}' is not valid Unicode text: it holds a lone "
                                            "surrogate (\\ud800-\\udfff escapes must come in pairs)")
            elif isinstance(item, (dict, list)):
                stack.append((item, _child_path(path, key), depth + 1))


def _bad(name: str, expected: str, value: Any) -> RequestError:
    return RequestError(400, f"'{name}' must be {expected}, got {json.dumps(value)[:200]}")


def _get(body: dict, name: str, types: tuple, expected: str, default: Any = None) -> Any:
    """body[name] checked against `types` (a JSON null means absent); bool is never
    accepted as a number."""
    value = body.get(name)
    if value is None:
        return default
    if (isinstance(value, bool) and bool not in types) or not isinstance(value, types):
        raise _bad(name, expected, value)
    return value


def _integer(body: dict, name: str, default: Optional[int], low: int, high: int) -> Optional[int]:
    value = _get(body, name, (int,), f"an integer in [{low}, {high}]", default)
    if value is not None and not low <= value <= high:
        raise _bad(name, f"an integer in [{low}, {high}]", value)
    return value


def _real(body: dict, name: str, default: Optional[float], low: float, high: float) -> Optional[float]:
    value = _get(body, name, (int, float), f"a number in [{low}, {high}]", default)
    if value is not None and not (math.isfinite(value) and low <= value <= high):
        raise _bad(name, f"a number in [{low}, {high}]", value)
    return None if value is None else float(value)


def _stop_strings(body: dict) -> List[str]:
    stop = body.get("stop")
    if stop is None:
        return []
    stops = [stop] if isinstance(stop, str) else stop
    if not isinstance(stops, list) or not all(isinstance(s, str) and s for s in stops):
        raise _bad("stop", "a non-empty string or a list of them", stop)
    if len(stops) > MAX_STOP_STRINGS:
        raise RequestError(400, f"'stop' has {len(stops)} strings; at most {MAX_STOP_STRINGS} are allowed")
    for i, s in enumerate(stops):
        if len(s) > MAX_STOP_LENGTH:
            raise RequestError(400, f"'stop[{i}]' has {len(s)} characters; at most {MAX_STOP_LENGTH} are allowed")
    return stops


def _logit_bias(body: dict) -> Dict[int, float]:
    bias = _get(body, "logit_bias", (dict,), "an object mapping token ids to numbers", {})
    parsed = {}
    for key, value in bias.items():
        if not re.fullmatch(r"\d{1,9}", str(key)):
            raise _bad("logit_bias", "an object whose keys are token ids", bias)
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not -100 <= value <= 100:
            raise _bad(f"logit_bias[{key}]", "a number in [-100, 100]", value)
        parsed[int(key)] = float(value)
    return parsed


def _message_content(index: int, content: Any) -> Optional[str]:
    """A message's content as text: a string, or a list of text parts joined."""
    if content is None or isinstance(content, str):
        return content
    if isinstance(content, list):
        texts = []
        for part in content:
            if isinstance(part, dict) and part.get("type") in IMAGE_PART_TYPES:
                raise RequestError(400, f"'messages[{index}].content[]': an image part: {NO_VISION}")
            if not (isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str)):
                raise _bad(f"messages[{index}].content[]", 'a text part {"type": "text", "text": ...}', part)
            texts.append(part["text"])
        return "".join(texts)
    raise _bad(f"messages[{index}].content", "a string or a list of text parts", content)


def _tool_calls(index: int, calls: Any) -> None:
    """An assistant message's tool calls: a list of {"type": "function", "function":
    {"name": str, "arguments": str or object}}. Arguments sent as JSON text become
    objects, because chat templates index them as objects."""
    name = f"messages[{index}].tool_calls"
    if calls is None:
        return
    if not isinstance(calls, list):
        raise _bad(name, "a list of tool calls", calls)
    for j, call in enumerate(calls):
        function = call.get("function") if isinstance(call, dict) else None
        if not (isinstance(function, dict) and isinstance(function.get("name"), str)):
            raise _bad(f"{name}[{j}]", 'an object {"type": "function", "function": {"name": ..., "arguments": ...}}',
                       call)
        arguments = function.get("arguments")
        if isinstance(arguments, str):
            try:
                parsed = json.loads(arguments)
            except (json.JSONDecodeError, RecursionError):
                continue  # the template gets the string as sent
            check_json_tree({f"{name}[{j}].function.arguments": parsed})  # decoded text: check it too
            function["arguments"] = parsed
        elif arguments is not None and not isinstance(arguments, dict):
            raise _bad(f"{name}[{j}].function.arguments", "a JSON string or an object", arguments)


def _messages(body: dict) -> List[Dict[str, Any]]:
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise _bad("messages", "a non-empty list of messages", messages)
    parsed = []
    for i, message in enumerate(messages):
        if not isinstance(message, dict) or not isinstance(message.get("role"), str):
            raise _bad(f"messages[{i}]", 'an object with a string "role"', message)
        message = dict(message, content=_message_content(i, message.get("content")))
        _tool_calls(i, message.get("tool_calls"))
        parsed.append(message)
    return parsed


def _tools(body: dict) -> Optional[List[Dict[str, Any]]]:
    tools = _get(body, "tools", (list,), "a list of tools")
    for i, tool in enumerate(tools or []):
        function = tool.get("function") if isinstance(tool, dict) else None
        if not (isinstance(function, dict) and isinstance(function.get("name"), str) and function["name"]):
            raise _bad(f"tools[{i}]", 'an object {"type": "function", "function": {"name": ..., ...}}', tool)
    return tools


def _tool_choice(body: dict, tools: Optional[List[Dict[str, Any]]]) -> Tuple[str, Optional[str]]:
    """(choice, named function): "auto" (the default), "none", "required", or
    {"type": "function", "function": {"name": ...}}, which is "required" of that one."""
    choice = body.get("tool_choice")
    if choice is None:
        return "auto", None
    expected = '"auto", "none", "required" or {"type": "function", "function": {"name": ...}}'
    if isinstance(choice, str):
        if choice not in ("auto", "none", "required"):
            raise _bad("tool_choice", expected, choice)
        named = None
    else:
        function = choice.get("function") if isinstance(choice, dict) else None
        named = function.get("name") if isinstance(function, dict) else None
        if not isinstance(named, str) or choice.get("type", "function") != "function":
            raise _bad("tool_choice", expected, choice)
    if choice not in ("auto", "none") and not tools:
        raise RequestError(400, f"'tool_choice' {json.dumps(choice)[:100]} needs 'tools': send the functions "
                                "the model may call")
    names = [t["function"]["name"] for t in tools or []]
    if named is not None and named not in names:
        raise RequestError(400, f"'tool_choice' names the function {named!r}, which is not among the request's "
                                f"tools ({', '.join(map(repr, names))})")
    return ("required", named) if named is not None else (choice, None)


def _prompt(body: dict) -> Any:
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
        prompt = prompt[0]
    if isinstance(prompt, str) and prompt:
        return prompt
    if isinstance(prompt, list) and prompt and all(type(t) is int and t >= 0 for t in prompt):
        return prompt
    raise _bad("prompt", "a non-empty string or a non-empty list of token ids (one prompt per request)", prompt)


def _sampling_fields(body: dict, defaults: ServerDefaults) -> Dict[str, Any]:
    return dict(
        temp=_real(body, "temperature", defaults.temperature, 0.0, 100.0),
        top_p=_real(body, "top_p", defaults.top_p, 0.0, 1.0),
        top_k=_integer(body, "top_k", defaults.top_k, 0, 1 << 31),
        min_p=_real(body, "min_p", defaults.min_p, 0.0, 1.0),
        xtc_probability=_real(body, "xtc_probability", 0.0, 0.0, 1.0),
        xtc_threshold=_real(body, "xtc_threshold", 0.1, 0.0, 0.5),
    )


def _penalty_fields(body: dict) -> Dict[str, Any]:
    return dict(
        repetition_penalty=_real(body, "repetition_penalty", None, 0.0, 100.0),
        repetition_context_size=_integer(body, "repetition_context_size", 20, 1, MAX_CONTEXT_SIZE),
        presence_penalty=_real(body, "presence_penalty", None, -2.0, 2.0),
        presence_context_size=_integer(body, "presence_context_size", 20, 1, MAX_CONTEXT_SIZE),
        frequency_penalty=_real(body, "frequency_penalty", None, -2.0, 2.0),
        frequency_context_size=_integer(body, "frequency_context_size", 20, 1, MAX_CONTEXT_SIZE),
    )


def parse_request(body: Any, kind: str, defaults: ServerDefaults) -> GenerationRequest:
    """Validate a decoded JSON body for the chat ("chat") or completions ("text")
    endpoint; RequestError(400) names the first bad field and its value."""
    if not isinstance(body, dict):
        raise RequestError(400, f"the request body must be a JSON object, got {type(body).__name__}")
    check_json_tree(body)
    _integer(body, "n", 1, 1, 1)  # one choice per request
    max_tokens = _integer(body, "max_completion_tokens", None, 1, MAX_TOKENS_LIMIT)
    if max_tokens is None:
        max_tokens = _integer(body, "max_tokens", defaults.max_tokens, 1, MAX_TOKENS_LIMIT)
    if kind == "chat":
        logprobs = _get(body, "logprobs", (bool,), "true or false", False)
        top_logprobs = _integer(body, "top_logprobs", 0, 0, MAX_TOP_LOGPROBS)
    else:  # the completions API's `logprobs` is the number of alternatives
        top_logprobs = _integer(body, "logprobs", None, 0, MAX_TOP_LOGPROBS)
        logprobs, top_logprobs = top_logprobs is not None, top_logprobs or 0
    stream_options = _get(body, "stream_options", (dict,), "an object", {})
    template_kwargs = _get(body, "chat_template_kwargs", (dict,), "an object", {})
    tools = _tools(body)
    tool_choice, named_tool = _tool_choice(body, tools) if kind == "chat" else ("auto", None)
    return GenerationRequest(
        kind=kind,
        model=_get(body, "model", (str,), "a string"),
        draft_model=_get(body, "draft_model", (str,), "a string"),
        messages=_messages(body) if kind == "chat" else None,
        prompt=_prompt(body) if kind == "text" else None,
        tools=tools,
        tool_choice=tool_choice,
        named_tool=named_tool,
        parallel_tool_calls=_get(body, "parallel_tool_calls", (bool,), "true or false", True),
        chat_template_kwargs={**defaults.chat_template_args, **template_kwargs},
        max_tokens=max_tokens,
        sampling=_sampling_fields(body, defaults),
        penalties=_penalty_fields(body),
        logit_bias=_logit_bias(body),
        logprobs=logprobs,
        top_logprobs=top_logprobs,
        seed=_integer(body, "seed", None, -(1 << 63), (1 << 64) - 1),
        stop=_stop_strings(body),
        stream=_get(body, "stream", (bool,), "true or false", False),
        include_usage=_get(stream_options, "include_usage", (bool,), "true or false", False),
        num_draft_tokens=_integer(body, "num_draft_tokens", None, 1, MAX_NUM_DRAFT_TOKENS),
    )


class StopStringFilter:
    """Streams text while holding back any tail that could begin a stop string, and
    cuts the text before the first stop string.

    Each `add` looks only at the new segment and the `longest - 1` characters before
    it: a stop string not found earlier must end inside the segment. So the work per
    token depends on the stop strings and the segment, never on the text so far."""

    def __init__(self, stops: List[str]):
        self.stops = stops
        self.longest = max((len(s) for s in stops), default=0)
        self.text = ""
        self.sent = 0  # characters of `text` already returned

    def _tail(self, start: int) -> str:
        """text[start:], the only part of the text a call scans."""
        return self.text[start:]

    def add(self, segment: str) -> Tuple[str, bool]:
        """Append `segment`; returns (text now safe to send, whether a stop string ended it)."""
        start = max(self.sent, len(self.text) - self.longest + 1)
        self.text += segment
        if not self.stops:
            return self.flush(), False
        window = self._tail(start)
        hits = [i for i in (window.find(s) for s in self.stops) if i >= 0]
        if hits:
            self.text = self.text[: start + min(hits)]
            return self.flush(), True
        end = max(self.sent, len(self.text) - self._held(window))
        out, self.sent = self.text[self.sent : end], end
        return out, False

    def _held(self, window: str) -> int:
        """Length of the longest end of `window` that is a proper prefix of a stop string."""
        held = 0
        for s in self.stops:
            for k in range(min(len(s) - 1, len(window)), held, -1):
                if window.endswith(s[:k]):
                    held = k
                    break
        return held

    def flush(self) -> str:
        out, self.sent = self.text[self.sent :], len(self.text)
        return out


@dataclass
class TokenLogprob:
    token: str
    logprob: float
    top: List[Tuple[str, float]]


@dataclass
class GenerationResult:
    text: str
    finish_reason: str
    prompt_tokens: int
    cached_tokens: int
    completion_tokens: int
    speculation: Optional[SpeculationStats]
    logprobs: List[TokenLogprob]


# ---------------------------------------------------------------------------
# OpenAI response bodies (handler threads).


def _utf8(text: str) -> Optional[List[int]]:
    # A token holding part of a character decodes to U+FFFD: its bytes are unknown here.
    return None if "\ufffd" in text else list(text.encode("utf-8"))


def chat_logprobs(entries: List[TokenLogprob]) -> dict:
    return {"content": [
        {"token": e.token, "logprob": e.logprob, "bytes": _utf8(e.token),
         "top_logprobs": [{"token": t, "logprob": v, "bytes": _utf8(t)} for t, v in e.top]}
        for e in entries
    ]}


def text_logprobs(entries: List[TokenLogprob], offset: int) -> dict:
    offsets = []
    for e in entries:
        offsets.append(offset)
        offset += len(e.token)
    return {
        "tokens": [e.token for e in entries],
        "token_logprobs": [e.logprob for e in entries],
        "top_logprobs": [dict(e.top) for e in entries],
        "text_offset": offsets,
    }


def usage(result: GenerationResult) -> dict:
    body = {
        "prompt_tokens": result.prompt_tokens,
        "completion_tokens": result.completion_tokens,
        "total_tokens": result.prompt_tokens + result.completion_tokens,
        "prompt_tokens_details": {"cached_tokens": result.cached_tokens},
    }
    spec = result.speculation
    if spec is not None:
        body["completion_tokens_details"] = {"accepted_prediction_tokens": spec.num_accepted,
                                             "rejected_prediction_tokens": spec.num_drafted - spec.num_accepted}
        body["speculation"] = {"num_drafted": spec.num_drafted, "num_accepted": spec.num_accepted,
                               "num_target_forwards": spec.num_target_forwards,
                               "draft_lengths": spec.draft_lengths,
                               "tokens_per_target_forward": spec.tokens_per_forward,
                               "drafted_at_depth": spec.drafted_at_depth,
                               "accepted_at_depth": spec.accepted_at_depth,
                               "depth_acceptance": spec.depth_acceptance,
                               "round_seconds": spec.mean_round_seconds,  # mean per draft length k; null: untimed
                               "plain_step_seconds": spec.plain_step_seconds,
                               "measured_speedup": spec.measured_speedup,
                               "bound": spec.bound,
                               "bound_draft_length": spec.bound_draft_length,
                               "efficiency": spec.efficiency}
    return body


SYSTEM_FINGERPRINT = f"mlx_lm-{__version__}-mlx-{mx.__version__}-{platform.system().lower()}-{platform.machine()}"


def get_system_fingerprint() -> str:
    """Upstream's name for the answers' system_fingerprint: this project's version,
    MLX's, the OS and the machine (upstream's names the platform and GPU instead)."""
    return SYSTEM_FINGERPRINT


class ResponseBuilder:
    """Builds the chat.completion / text_completion bodies and chunks of one request.
    A chat's text is split into content, reasoning and tool calls by the router of its
    ChatPlan (chat_output.py), which `plan` returns once the prompt is rendered (the
    worker renders another model's prompt, so it is asked for at the first text).
    `response_id`: the answer's id (the handler's request_id), else a new one."""

    def __init__(self, request: GenerationRequest, model_name: str,
                 plan: Callable[[], Optional[ChatPlan]] = lambda: None, *,
                 system_fingerprint: str = SYSTEM_FINGERPRINT, response_id: Optional[str] = None):
        self.chat = request.kind == "chat"
        self.stream = request.stream
        self.logprobs = request.logprobs
        response_id = response_id or f"{'chatcmpl' if self.chat else 'cmpl'}-{uuid.uuid4()}"
        self.header = {"id": response_id, "created": int(time.time()),
                       "model": model_name, "system_fingerprint": system_fingerprint}
        self.chunk_header = {**self.header, "object": "chat.completion.chunk" if self.chat else "text_completion"}
        self.text_offset = 0
        self._plan = plan
        self._router: Optional[ChatTextRouter] = None

    @property
    def router(self) -> ChatTextRouter:
        if self._router is None:
            plan = self._plan() if self.chat else None
            self._router = plain_router() if plan is None else plan.router(self.stream)
        return self._router

    def _read(self, text: str, finish_reason: Optional[str]) -> Tuple[ChatDelta, Optional[str]]:
        """What `text` adds to the answer; at the end, the rest, and "tool_calls" for
        an answer that stopped after calling tools."""
        delta = self.router.add(text)
        if finish_reason is not None:
            delta.extend(self.router.finish())
            if finish_reason == "stop" and self.router.made_tool_call:
                finish_reason = "tool_calls"
        return delta, finish_reason

    def _choice(self, text: str, entries: List[TokenLogprob], finish_reason: Optional[str]) -> Optional[dict]:
        delta, finish_reason = self._read(text, finish_reason) if self.chat else (ChatDelta(text), finish_reason)
        if self.stream and not (delta or entries or finish_reason):
            return None  # e.g. text of a tool call still being written
        choice: Dict[str, Any] = {"index": 0, "finish_reason": finish_reason, "logprobs": None}
        if self.logprobs:
            choice["logprobs"] = chat_logprobs(entries) if self.chat else text_logprobs(entries, self.text_offset)
        self.text_offset += len(text)
        if not self.chat:
            choice["text"] = delta.content
        elif self.stream:
            choice["delta"] = delta.fields() if delta or finish_reason else {"content": ""}
        else:  # an empty answer is "" as in OpenAI's; null is for a reply of tool calls only
            content = None if delta.tool_calls and not delta.content else delta.content
            choice["message"] = {"role": "assistant", **delta.fields(), "content": content}
        return choice

    def completion(self, result: GenerationResult) -> dict:
        obj = "chat.completion" if self.chat else "text_completion"
        choice = self._choice(result.text, result.logprobs, result.finish_reason)
        return {**self.header, "object": obj, "choices": [choice], "usage": usage(result)}

    def chunk(self, text: str, entries: List[TokenLogprob], finish_reason: Optional[str] = None) -> Optional[dict]:
        """A stream chunk, or None when there is nothing to send yet."""
        choice = self._choice(text, entries, finish_reason)
        return None if choice is None else {**self.chunk_header, "choices": [choice]}

    def role_chunk(self) -> dict:
        delta = {"role": "assistant", "content": ""}
        return {**self.chunk_header, "choices": [{"index": 0, "delta": delta, "finish_reason": None, "logprobs": None}]}

    def usage_chunk(self, result: GenerationResult) -> dict:
        return {**self.chunk_header, "choices": [], "usage": usage(result)}


def error_body(status: int, message: str) -> dict:
    kind = {401: "authentication_error", 403: "permission_error", 404: "not_found_error"}.get(
        status, "invalid_request_error" if status < 500 else "server_error")
    return {"error": {"message": message, "type": kind, "param": None, "code": status}}


