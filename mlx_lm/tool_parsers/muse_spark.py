"""Muse Spark tool calls (XML_ATEM): invoke blocks with named parameters whose values
are JSON, or text:

    <atem:function_calls><atem:invoke name="get_weather">
    <atem:parameter name="city">Paris</atem:parameter></atem:invoke></atem:function_calls>"""

import json
import re
from typing import Any, Optional

from .schema import make_call, one_or_many

tool_call_start = "<atem:function_calls>"
tool_call_end = "</atem:function_calls>"

_OPEN = re.compile(r"<atem:invoke\b[^>]*?\bname=\"([^\"]+)\"[^>]*>")
_PARAMETER = re.compile(r"\s*<atem:parameter\b[^>]*?\bname=\"([^\"]+)\"[^>]*>(.*?)</atem:parameter>", re.DOTALL)


def _parameters(text: str, position: int):
    """The parameters from `position` on, and where they end. Taken one after the
    other, so a value may hold "</atem:invoke>" itself."""
    arguments = {}
    while (match := _PARAMETER.match(text, position)) is not None:
        arguments[match.group(1)] = _value(match.group(2))
        position = match.end()
    return arguments, position


def _value(raw: str) -> Any:
    try:
        return json.loads(raw)
    except ValueError:
        return raw.strip()


def parse_tool_call(text: str, tools: Optional[Any] = None):
    calls, position = [], 0
    while (invoke := _OPEN.search(text, position)) is not None:
        arguments, position = _parameters(text, invoke.end())
        calls.append(make_call(invoke.group(1), arguments))
    return one_or_many(calls)
