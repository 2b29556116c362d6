"""Kimi K3 tool calls, in its XTML markup: per-key typed arguments, or one JSON
object block; a call that does not parse is skipped if others do:

    <|open|>tools<|sep|><|open|>call tool="get_weather" index="1"<|sep|>
    <|open|>argument key="city" type="string"<|sep|>Paris<|close|>argument<|sep|>
    <|close|>call<|sep|><|close|>tools<|sep|>"""

import json
import re
from typing import Any, Optional

from .schema import make_call

tool_call_start = "<|open|>tools<|sep|>"
tool_call_end = "<|close|>tools<|sep|>"

_ATTRS = r"((?:(?!<\|sep\|>).)*)<\|sep\|>"
_CALL = re.compile(r"<\|open\|>call" + _ATTRS + r"(.*?)<\|close\|>call<\|sep\|>", re.DOTALL)
_ARGUMENT = re.compile(r"<\|open\|>argument" + _ATTRS + r"(.*?)<\|close\|>argument<\|sep\|>", re.DOTALL)
_JSON_BLOCK = re.compile(r"<\|open\|>json" + _ATTRS + r"(.*?)<\|close\|>json<\|sep\|>", re.DOTALL)
_ATTR = re.compile(r'(\w+)="([^"]*)"')


def _attributes(text: str) -> dict:
    return {k: v.replace("&quot;", '"').replace("&amp;", "&") for k, v in _ATTR.findall(text)}


def _value(text: str, json_type: str) -> Any:
    if json_type == "string":
        return text
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return text


def _call(attributes: str, body: str):
    name = _attributes(attributes).get("tool")
    block = _JSON_BLOCK.search(body)
    if block is not None:
        return make_call(name, json.loads(block.group(2)))
    arguments = {}
    for argument_attributes, value in _ARGUMENT.findall(body):
        attrs = _attributes(argument_attributes)
        if "key" not in attrs:
            raise ValueError("a Kimi K3 argument without a key")
        arguments[attrs["key"]] = _value(value, attrs.get("type", "string"))
    return make_call(name, arguments)


def parse_tool_call(text: str, tools: Optional[Any] = None):
    calls = []
    for attributes, body in _CALL.findall(text):
        try:
            calls.append(_call(attributes, body))
        except ValueError:  # json.JSONDecodeError included
            continue
    if not calls:
        raise ValueError("no Kimi K3 tool call found")
    return calls
