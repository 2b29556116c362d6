"""MiniMax-M2 tool calls: invoke blocks with named parameters, each value text typed
by the request's schema:

    <minimax:tool_call>
    <invoke name="get_weather">
    <parameter name="city">Paris</parameter>
    </invoke>
    </minimax:tool_call>"""

import re
from typing import Any, Optional

from .schema import make_call, one_or_many, parameter_schemas, typed_value

tool_call_start = "<minimax:tool_call>"
tool_call_end = "</minimax:tool_call>"

_INVOKE = re.compile(r"<invoke name=([^>]+)>(.*?)</invoke>", re.DOTALL)
_PARAMETER = re.compile(r"<parameter name=([^>]+)>(.*?)</parameter>", re.DOTALL)


def unquote(name: str) -> str:
    name = name.strip()
    return name[1:-1] if len(name) >= 2 and name[0] == name[-1] and name[0] in "\"'" else name


def parse_tool_call(text: str, tools: Optional[Any] = None):
    calls = []
    for quoted_name, body in _INVOKE.findall(text):
        name = unquote(quoted_name)
        schemas = parameter_schemas(tools, name)
        arguments = {}
        for quoted_key, value in _PARAMETER.findall(body):
            key = unquote(quoted_key)
            arguments[key] = typed_value(value.strip(), schemas.get(key, {"type": "string"}))
        calls.append(make_call(name, arguments))
    return one_or_many(calls)
