"""Names of upstream mlx-lm 0.32.2's `mlx_lm.server` that this server's own request
path does not use, for code written against upstream that reaches for them:

- `Vision`: upstream's images of a prompt (VLM input). This project loads no vision
  models, so making one raises ValueError, as an image part of a request does (400).
- `TimeBudget`: upstream's time slice of its worker loop, an iterator that ends after
  `budget` seconds (under mlx.launch: after a number of iterations that every rank
  agrees on, refitted to the budget every `sync_frequency` slices).
- `response_packet` and `usage_packet`: the bodies of upstream's
  `APIHandler.generate_response` and `completion_usage_response`, which APIHandler
  exposes. This server builds its own answers with openai_api.ResponseBuilder (with
  its usage extensions), so overriding those two methods changes nothing it sends.
"""

import time
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Tuple

import mlx.core as mx

from . import distributed

NO_VISION = ("this project loads no vision models (upstream's Vision holds a VLM's images): "
             "send text content only")


@dataclass
class Vision:
    """Upstream's fields: each image's pixel values, the position of its first patch
    token, and the prompt with patch tokens replaced by negative image ids."""

    pixel_values: List[mx.array]
    starts: List[int]
    cache_key: List[int]

    def __post_init__(self) -> None:
        raise ValueError(NO_VISION)


class TimeBudget:
    """`for _ in TimeBudget(budget): step()` runs steps for about `budget` seconds.
    Alone, the clock ends each slice. Under mlx.launch the ranks must run the same
    number of steps, so a slice is `iterations` steps, and every `sync_frequency`
    slices the ranks' mean slice time (one all_sum) rescales `iterations` to the budget."""

    def __init__(self, budget: float = 0.5, iterations: int = 25, sync_frequency: int = 10):
        if not budget > 0:
            raise ValueError(f"TimeBudget: budget must be > 0 seconds, got {budget!r}")
        for name, value in (("iterations", iterations), ("sync_frequency", sync_frequency)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"TimeBudget: {name} must be a positive integer, got {value!r}")
        self._group = distributed.world()
        self._budget = budget
        self._iterations = iterations
        self._sync_frequency = sync_frequency
        self._start = 0.0
        self._steps = 0
        self._slices = 0
        self._slice_seconds = 0.0

    @property
    def iterations(self) -> int:
        """Steps per slice under mlx.launch (refitted as slices are timed)."""
        return self._iterations

    def __iter__(self) -> "TimeBudget":
        self._start = time.perf_counter()
        self._steps = 0
        return self

    def __next__(self) -> None:
        if self._group.size() == 1:
            if time.perf_counter() - self._start > self._budget:
                raise StopIteration
            return None
        self._steps += 1
        if self._steps <= self._iterations:
            return None
        self._end_distributed_slice()
        raise StopIteration

    def _end_distributed_slice(self) -> None:
        self._slices += 1
        self._slice_seconds += time.perf_counter() - self._start
        if self._slices % self._sync_frequency:
            return
        total = mx.distributed.all_sum(mx.array(self._slice_seconds), group=self._group).item()
        mean = total / (self._group.size() * self._sync_frequency)
        self._iterations = max(round(self._iterations * self._budget / max(mean, 1e-9)), 1)
        self._slices, self._slice_seconds = 0, 0.0


def usage_fields(prompt_tokens: int, completion_tokens: int, cached_tokens: Optional[int]) -> Dict[str, Any]:
    """Upstream's `usage`: cached tokens only when known (>= 0)."""
    usage = {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
             "total_tokens": prompt_tokens + completion_tokens}
    if cached_tokens is not None and cached_tokens >= 0:
        usage["prompt_tokens_details"] = {"cached_tokens": cached_tokens}
    return usage


def _logprobs(token_logprobs: List[float], top_tokens: List[Tuple[Dict[str, Any], ...]],
              tokens: Optional[List[int]]) -> Optional[Dict[str, Any]]:
    """Upstream's logprobs content: each position's top entries (the first is the
    chosen token), or else (id, logprob) pairs of the chosen tokens."""
    if top_tokens:
        return {"content": [dict(top[0], top_logprobs=top) if top else {} for top in top_tokens]}
    if token_logprobs:
        if tokens is None or len(tokens) != len(token_logprobs):
            raise ValueError(f"token_logprobs ({len(token_logprobs)}) need as many tokens, got "
                             f"{None if tokens is None else len(tokens)}")
        return {"content": [{"id": t, "logprob": p} for t, p in zip(tokens, token_logprobs)]}
    return None


def response_packet(header: Dict[str, Any], stream: bool, text: str, finish_reason: Optional[str], *,
                    prompt_token_count: Optional[int] = None, completion_token_count: Optional[int] = None,
                    prompt_cache_count: Optional[int] = None, token_logprobs: Optional[List[float]] = None,
                    top_tokens: Optional[List[Tuple[Dict[str, Any], ...]]] = None,
                    tokens: Optional[List[int]] = None, tool_calls: Optional[List[Any]] = None,
                    reasoning_text: Optional[str] = None) -> Dict[str, Any]:
    """Upstream's generate_response body. `header`: id, system_fingerprint, object
    ("chat.completion", "chat.completion.chunk" or "text_completion"), model, created.
    A complete (not streamed) answer needs both token counts, for its usage."""
    kind = header["object"]
    choice: Dict[str, Any] = {"index": 0, "finish_reason": finish_reason}
    logprobs = _logprobs(token_logprobs or [], top_tokens or [], tokens)
    if logprobs is not None:
        choice["logprobs"] = logprobs
    packet = {**header, "choices": [choice]}
    if not stream:
        if not (isinstance(prompt_token_count, int) and isinstance(completion_token_count, int)):
            raise ValueError("a complete (not streamed) response needs prompt_token_count and "
                             f"completion_token_count, got {prompt_token_count!r}, {completion_token_count!r}")
        packet["usage"] = usage_fields(prompt_token_count, completion_token_count, prompt_cache_count)
    if kind.startswith("chat.completion"):
        message: Dict[str, Any] = {"role": "assistant"}
        if not stream or text:
            message["content"] = text or None  # a complete message always has the field
        if reasoning_text:
            message["reasoning"] = reasoning_text
        if tool_calls:
            message["tool_calls"] = tool_calls
        choice["delta" if stream else "message"] = message
    elif kind == "text_completion":
        choice["text"] = text
    else:
        raise ValueError(f"unsupported response object {kind!r}: chat.completion[.chunk] or text_completion")
    return packet


def usage_packet(header: Dict[str, Any], prompt_token_count: int, completion_token_count: int,
                 prompt_cache_count: Optional[int] = None) -> Dict[str, Any]:
    """Upstream's completion_usage_response body: no choices, the usage (its object is
    always "chat.completion", as upstream's)."""
    return {**header, "object": "chat.completion", "choices": [],
            "usage": usage_fields(prompt_token_count, completion_token_count, prompt_cache_count)}
