"""Hermes / Qwen2.5 / Qwen3 tool calls: a JSON object (or a list of them) between
markers, `<tool_call>{"name": "f", "arguments": {...}}</tool_call>`. Llama 3.1 style
"parameters" is taken for "arguments"."""

import json
from typing import Any, Optional

from .schema import make_call, one_or_many

tool_call_start = "<tool_call>"
tool_call_end = "</tool_call>"


def _call(payload: Any):
    if not isinstance(payload, dict):
        raise ValueError(f"a tool call must be a JSON object, got {type(payload).__name__}")
    arguments = payload.get("arguments", payload.get("parameters"))
    return make_call(payload.get("name"), arguments, payload.get("id"))


def parse_tool_call(text: str, tools: Optional[Any] = None):
    payload = json.loads(text.strip())
    calls = payload if isinstance(payload, list) else [payload]
    return one_or_many([_call(c) for c in calls])
