"""Qwen3-Coder and Qwen3.5 tool calls, XML-style, each argument as text typed by
the request's schema:

    <tool_call>
    <function=get_weather>
    <parameter=city>
    Paris
    </parameter>
    </function>
    </tool_call>

A name whose closing ">" the model dropped ends at the first whitespace."""

import re
from typing import Any, Optional

from .schema import make_call, one_or_many, parameter_schemas, typed_value

tool_call_start = "<tool_call>"
tool_call_end = "</tool_call>"

_FUNCTION = re.compile(r"<function=(.*?)</function>", re.DOTALL)
_PARAMETER = re.compile(r"<parameter=(.*?)</parameter>", re.DOTALL)
_NAME = re.compile(r"\s*([^\s<>]+)>?")


def _name_and_rest(text: str):
    match = _NAME.match(text)
    if match is None:
        raise ValueError(f"no name in {text[:80]!r}")
    return match.group(1), text[match.end():]


def _strip_one_newline(value: str) -> str:
    """The template puts the value on lines of its own: one newline each side is markup."""
    value = value[1:] if value.startswith("\n") else value
    return value[:-1] if value.endswith("\n") else value


def _function(body: str, tools: Optional[Any]):
    name, rest = _name_and_rest(body)
    schemas = parameter_schemas(tools, name)
    arguments = {}
    for parameter in _PARAMETER.findall(rest):
        key, value = _name_and_rest(parameter)
        arguments[key] = typed_value(_strip_one_newline(value), schemas.get(key))
    return make_call(name, arguments)


def parse_tool_call(text: str, tools: Optional[Any] = None):
    return one_or_many([_function(body, tools) for body in _FUNCTION.findall(text)])
