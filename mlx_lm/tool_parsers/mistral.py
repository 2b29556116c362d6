"""Mistral tool calls. The format has a start marker and no end marker, so the
text runs to the end of the answer and may hold several calls:

    [TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}[TOOL_CALLS]get_time[ARGS]{}
    [TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris"}}]   (before v11)

`name[CALL_ID]id[ARGS]{...}` carries the model's call id. Text after the last
call's JSON is ignored."""

import json
import re
from typing import Any, Optional

from .schema import make_call, one_or_many

tool_call_start = "[TOOL_CALLS]"
tool_call_end = ""

_HEADER = re.compile(r"\s*(?:\[TOOL_CALLS\])?\s*([\w.\-]+)\s*(?:\[CALL_ID\]\s*([\w\-]+)\s*)?\[ARGS\]\s*")


def _json_list(text: str):
    payload, _ = json.JSONDecoder().raw_decode(text)
    if not isinstance(payload, list):
        raise ValueError("expected a JSON list of calls")
    return [make_call(c.get("name"), c.get("arguments"), c.get("id")) if isinstance(c, dict)
            else make_call(None, None) for c in payload]


def _headed_calls(text: str):
    decoder, calls, position = json.JSONDecoder(), [], 0
    while (header := _HEADER.match(text, position)) is not None:
        arguments, position = decoder.raw_decode(text, header.end())
        calls.append(make_call(header.group(1), arguments, header.group(2)))
    return calls


def parse_tool_call(text: str, tools: Optional[Any] = None):
    stripped = text.strip()
    calls = _json_list(stripped) if stripped.startswith("[") else _headed_calls(stripped)
    return one_or_many(calls)
