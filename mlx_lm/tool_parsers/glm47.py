"""GLM-4.5 / 4.7 tool calls: the function name, then key/value pairs in tags,
string arguments written bare and the others as JSON:

    <tool_call>get_weather
    <arg_key>city</arg_key>
    <arg_value>Paris</arg_value>
    </tool_call>

An argument the request declares as a string stays text. A block without pairs is
one of the bare forms GLM models also write (upstream reads the same ones):
- a bare name: a call without arguments;
- the name, then a JSON object of arguments (on the next line or after a space);
- the name, then key=value words (shell quoting: `city="New York" days=3`);
- JSON: {"name", "arguments"}, {"function", "arguments"}, {"tool": {"name",
  "arguments"}}, or a list of them (every call; upstream keeps the first).
Anything else is not a call (upstream makes it a call named "unknown"; here the
server returns it as content)."""

import json
import re
import shlex
from typing import Any, Optional

from .schema import declared_types, loose_value, make_call, one_or_many, parameter_schemas

tool_call_start = "<tool_call>"
tool_call_end = "</tool_call>"

_NAME = re.compile(r"[\w.\-]+")


def parse_keyed_call(text: str, tools: Optional[Any], key_tag: str, value_tag: str):
    """One call written as name<key_tag>k</key_tag><value_tag>v</value_tag>..."""
    stripped = text.strip()
    if f"<{key_tag}>" not in stripped:
        return parse_bare_call(stripped, tools)
    name = stripped[: stripped.index(f"<{key_tag}>")].strip()
    schemas = parameter_schemas(tools, name)
    pair = re.compile(rf"<{key_tag}>(.*?)</{key_tag}>\s*<{value_tag}>(.*?)</{value_tag}>", re.DOTALL)
    arguments = {}
    for key, value in pair.findall(stripped):
        key, value = key.strip(), value.strip()
        is_string = "string" in declared_types(schemas.get(key))
        arguments[key] = value if is_string else loose_value(value)
    return make_call(name, arguments)


def _typed(name: str, arguments: Any, tools: Optional[Any]) -> Any:
    """Arguments given as JSON, typed as upstream: a declared string stays (or becomes)
    text, another value written as text is read as a value."""
    if not isinstance(arguments, dict):
        return arguments
    schemas = parameter_schemas(tools, name)
    typed = {}
    for key, value in arguments.items():
        if "string" in declared_types(schemas.get(key)):
            typed[key] = value if isinstance(value, str) else json.dumps(value)
        else:
            typed[key] = loose_value(value) if isinstance(value, str) else value
    return typed


def _json_call(payload: Any, tools: Optional[Any]):
    """One call from a JSON object of the shapes the module docstring lists."""
    if not isinstance(payload, dict):
        raise ValueError(f"a JSON tool call must be an object, got {type(payload).__name__}")
    if isinstance(payload.get("tool"), dict):
        payload = payload["tool"]
    name, arguments = payload.get("name", payload.get("function")), payload.get("arguments")
    if isinstance(name, dict):  # {"function": {"name", "arguments"}}
        name, arguments = name.get("name"), arguments if arguments is not None else name.get("arguments")
    if isinstance(arguments, str):
        arguments = loose_value(arguments)
    return make_call(name, _typed(name, arguments, tools) if isinstance(name, str) else arguments)


def _key_value_words(name: str, words: str, tools: Optional[Any]) -> dict:
    """`k=v k2="v 2"` (shell quoting) as arguments; ValueError for a word without "="."""
    try:
        tokens = shlex.split(words)
    except ValueError as e:
        raise ValueError(f"not key=value words: {e}") from None
    schemas, arguments = parameter_schemas(tools, name), {}
    for token in tokens:
        key, equals, value = token.partition("=")
        if not equals or not key.strip():
            raise ValueError(f"not a tool call: {words[:80]!r} (expected key=value words)")
        arguments[key.strip()] = value if "string" in declared_types(schemas.get(key.strip())) else loose_value(value)
    return arguments


def parse_bare_call(text: str, tools: Optional[Any]):
    """A block without key/value tags, in one of the module docstring's bare forms."""
    if text.startswith(("{", "[")):
        payload = json.loads(text)
        return one_or_many([_json_call(p, tools) for p in (payload if isinstance(payload, list) else [payload])])
    name, rest = _NAME.match(text), ""
    if name is not None:
        name, rest = name.group(0), text[name.end():].strip()
    if name is None or (rest and not text[len(name)].isspace()):
        raise ValueError(f"not a tool call: {text[:80]!r}")
    if not rest:
        return make_call(name, {})
    if rest.startswith("{"):
        arguments = json.loads(rest)
        if not isinstance(arguments, dict):
            raise ValueError(f"the arguments of {name!r} must be an object")
        return make_call(name, _typed(name, arguments, tools))
    return make_call(name, _key_value_words(name, rest, tools))


def parse_tool_call(text: str, tools: Optional[Any] = None):
    return parse_keyed_call(text, tools, "arg_key", "arg_value")
