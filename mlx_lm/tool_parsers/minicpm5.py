"""MiniCPM5 tool calls: consecutive function blocks with no wrapper; values holding
"<", "&" or newlines come in CDATA. Each value is text typed by the request's schema:

    <function name="get_weather"><param name="city">Paris</param></function>

The start marker is `<function name=`, so the text this parser gets begins with the
quoted name; a whole block is accepted too."""

import re
from typing import Any, Optional

from .minimax_m2 import unquote
from .schema import make_call, one_or_many, parameter_schemas, typed_value

tool_call_start = "<function name="
tool_call_end = "</function>"

_NAME = r"(\"[^\"]*\"|'[^']*'|[^\s\"'<>]+)"
_FUNCTION = re.compile(r"(?:<function\s+name\s*=\s*)?" + _NAME + r"\s*>(.*?)(?:</function>|$)", re.DOTALL)
_PARAM = re.compile(r"<param\s+name\s*=\s*" + _NAME + r"\s*>(.*?)</param>", re.DOTALL)
_CDATA = re.compile(r"\s*<!\[CDATA\[(.*?)\]\]>\s*", re.DOTALL)


def _text(raw: str) -> str:
    cdata = _CDATA.fullmatch(raw)
    return cdata.group(1) if cdata else raw.strip()


def parse_tool_call(text: str, tools: Optional[Any] = None):
    calls = []
    for quoted_name, body in _FUNCTION.findall(text.strip()):
        name = unquote(quoted_name)
        schemas = parameter_schemas(tools, name)
        arguments = {unquote(k): typed_value(_text(v), schemas.get(unquote(k), {"type": "string"}))
                     for k, v in _PARAM.findall(body)}
        calls.append(make_call(name, arguments))
    return one_or_many(calls)
