"""GLM-4.5 / 4.7 tool calls: the function name, then key/value pairs in tags,
string arguments written bare and the others as JSON:

    <tool_call>get_weather
    <arg_key>city</arg_key>
    <arg_value>Paris</arg_value>
    </tool_call>

An argument the request declares as a string stays text. A block without pairs is
a call without arguments when it is a bare name, or a JSON {"name", "arguments"}
object (both seen from GLM models)."""

import json
import re
from typing import Any, Optional

from .schema import declared_types, make_call, parameter_schemas, loose_value

tool_call_start = "<tool_call>"
tool_call_end = "</tool_call>"

_NAME = re.compile(r"[\w.\-]+")


def parse_keyed_call(text: str, tools: Optional[Any], key_tag: str, value_tag: str):
    """One call written as name<key_tag>k</key_tag><value_tag>v</value_tag>..."""
    stripped = text.strip()
    if f"<{key_tag}>" not in stripped:
        if stripped.startswith("{"):
            payload = json.loads(stripped)
            return make_call(payload.get("name"), payload.get("arguments"))
        if _NAME.fullmatch(stripped) is None:
            raise ValueError(f"not a tool call: {stripped[:80]!r}")
        return make_call(stripped, {})
    name = stripped[: stripped.index(f"<{key_tag}>")].strip()
    schemas = parameter_schemas(tools, name)
    pair = re.compile(rf"<{key_tag}>(.*?)</{key_tag}>\s*<{value_tag}>(.*?)</{value_tag}>", re.DOTALL)
    arguments = {}
    for key, value in pair.findall(stripped):
        key, value = key.strip(), value.strip()
        is_string = "string" in declared_types(schemas.get(key))
        arguments[key] = value if is_string else loose_value(value)
    return make_call(name, arguments)


def parse_tool_call(text: str, tools: Optional[Any] = None):
    return parse_keyed_call(text, tools, "arg_key", "arg_value")
