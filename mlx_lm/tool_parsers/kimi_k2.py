"""Kimi K2 tool calls: a section of calls, each with an id naming the function and
its JSON arguments; the id is kept as the call's id:

    <|tool_calls_section_begin|><|tool_call_begin|>functions.get_weather:0
    <|tool_call_argument_begin|>{"city": "Paris"}<|tool_call_end|><|tool_calls_section_end|>"""

import re
from typing import Any, Optional

from .schema import loose_value, make_call

tool_call_start = "<|tool_calls_section_begin|>"
tool_call_end = "<|tool_calls_section_end|>"

_CALL = re.compile(r"<\|tool_call_begin\|>(.*?)(?:<\|tool_call_end\|>|$)", re.DOTALL)
_HEAD = re.compile(r"\s*((?:functions\.)?([\w.\-]+?):\d+)\s*<\|tool_call_argument_begin\|>(.*)", re.DOTALL)


def _call(text: str):
    match = _HEAD.match(text)
    if match is None:
        raise ValueError(f"not a Kimi tool call: {text[:80]!r}")
    return make_call(match.group(2), loose_value(match.group(3).strip()), match.group(1))


def parse_tool_call(text: str, tools: Optional[Any] = None):
    bodies = _CALL.findall(text) or [text]
    return [_call(body) for body in bodies]
