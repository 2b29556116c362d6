"""Gemma 4 tool calls: `call:name{key:value,...}` with bare keys, strings between
<|"|> quotes and JSON numbers, booleans, lists and nested objects; several calls
may follow each other in one block:

    <|tool_call>call:get_weather{city:<|"|>Paris<|"|>,days:3}<tool_call|>

FunctionGemma writes the same with <escape> as the quote (function_gemma.py)."""

import json
import re
from typing import Any, List, Optional

from .schema import make_call, one_or_many

tool_call_start = "<|tool_call>"
tool_call_end = "<tool_call|>"

QUOTE = '<|"|>'
_CALL = re.compile(r"call:([\w.\-]+)\{")


def _closing_brace(text: str, start: int, quote: str) -> int:
    """Index of the "}" that closes the "{" at `start`; braces inside quoted strings
    do not count. ValueError if the text ends first (a cut-off call)."""
    depth, i = 0, start
    while i < len(text):
        if text.startswith(quote, i):
            end = text.find(quote, i + len(quote))
            if end < 0:
                break
            i = end + len(quote)
            continue
        depth += {"{": 1, "}": -1}.get(text[i], 0)
        if depth == 0:
            return i
        i += 1
    raise ValueError("a tool call's braces are not closed")


def _to_json(arguments: str, quote: str) -> Any:
    """The {key:value} text as JSON: quoted strings set aside, bare keys quoted."""
    strings: List[str] = []

    def set_aside(match: re.Match) -> str:
        strings.append(match.group(1))
        return f"\x00{len(strings) - 1}\x00"

    text = re.sub(re.escape(quote) + r"(.*?)" + re.escape(quote), set_aside, arguments, flags=re.DOTALL)
    text = re.sub(r"([{,]\s*)([A-Za-z_][\w\-]*)\s*:", r'\1"\2":', text)
    text = re.sub(r"\x00(\d+)\x00", lambda m: json.dumps(strings[int(m.group(1))]), text)
    return json.loads(text)


def parse_calls(text: str, quote: str):
    """Every call:name{...} in `text`, its strings delimited by `quote`."""
    calls, position = [], 0
    while (match := _CALL.search(text, position)) is not None:
        end = _closing_brace(text, match.end() - 1, quote)
        calls.append(make_call(match.group(1), _to_json(text[match.end() - 1 : end + 1], quote)))
        position = end + 1
    return one_or_many(calls)


def parse_tool_call(text: str, tools: Optional[Any] = None):
    return parse_calls(text, QUOTE)
