"""What the tool parsers share: a parsed call's checked shape, and argument values
typed by the JSON schema the request declared for them (formats that write every
argument as text: qwen3_coder, minimax_m2, minicpm5)."""

import ast
import json
from typing import Any, Dict, List, Optional, Set

ToolCall = Dict[str, Any]  # {"name": str, "arguments": dict[, "id": str]}

# Type names models and schemas use, by the JSON schema type they mean.
_ALIASES = {"str": "string", "text": "string", "varchar": "string", "char": "string", "enum": "string",
            "int": "integer", "uint": "integer", "long": "integer", "short": "integer", "unsigned": "integer",
            "float": "number", "double": "number", "num": "number", "bool": "boolean", "binary": "boolean",
            "dict": "object", "list": "array", "arr": "array"}
# Tried most specific first: "7" declared as integer-or-string is the integer 7.
_PRIORITY = ["null", "integer", "number", "boolean", "object", "array", "string"]
_JSON_TYPES = {type(None): "null", bool: "boolean", int: "integer", float: "number", str: "string",
               list: "array", dict: "object"}


def make_call(name: Any, arguments: Any, call_id: Any = None) -> ToolCall:
    """A tool call after checking its shape; arguments sent as JSON text are decoded.
    ValueError names what is wrong (the server then returns the text as content)."""
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except json.JSONDecodeError:
            raise ValueError(f"the arguments of {name!r} are neither an object nor JSON text: {arguments[:80]!r}")
    if arguments is None:
        arguments = {}
    if not isinstance(name, str) or not name:
        raise ValueError(f"a tool call needs a function name, got {name!r}")
    if not isinstance(arguments, dict):
        raise ValueError(f"the arguments of {name!r} must be an object, got {type(arguments).__name__}")
    call = {"name": name, "arguments": arguments}
    if isinstance(call_id, str) and call_id:
        call["id"] = call_id
    return call


def one_or_many(calls: List[ToolCall]) -> Any:
    """Upstream's return shape: a single call as a dict, several as a list."""
    if not calls:
        raise ValueError("no tool call found")
    return calls[0] if len(calls) == 1 else calls


def parameter_schemas(tools: Optional[List[Any]], name: str) -> Dict[str, Any]:
    """The `properties` of function `name` among the request's tools ({} if unknown)."""
    for tool in tools or []:
        function = tool.get("function") if isinstance(tool, dict) else None
        if isinstance(function, dict) and function.get("name") == name:
            parameters = function.get("parameters") or {}
            properties = parameters.get("properties") if isinstance(parameters, dict) else None
            return properties if isinstance(properties, dict) else {}
    return {}


def _canonical(type_name: str) -> str:
    name = type_name.strip().lower()
    for prefix in ("uint", "int", "long", "short", "unsigned", "num", "float", "double", "dict", "list"):
        if name.startswith(prefix):
            return _ALIASES.get(prefix, name)
    return _ALIASES.get(name, name)


def declared_types(schema: Any) -> Set[str]:
    """The JSON types a parameter schema allows: `type` (a name or a list), the types of
    its `enum` values, and those of its anyOf / oneOf / allOf branches."""
    if not isinstance(schema, dict):
        return set()
    declared = schema.get("type")
    names = declared if isinstance(declared, list) else [declared]
    types = {_canonical(t) for t in names if isinstance(t, str)}
    enum = schema.get("enum")
    if isinstance(enum, list):
        types |= {_JSON_TYPES.get(type(v), "string") for v in enum}
    for key in ("anyOf", "oneOf", "allOf"):
        branches = schema.get(key)
        for branch in branches if isinstance(branches, list) else []:
            types |= declared_types(branch)
    return types


def _container(raw: str, kind: type) -> Any:
    """raw as a JSON (or, as chat histories render them, Python) object or list."""
    for decode in (lambda s: json.loads(s, strict=False), ast.literal_eval):
        try:
            value = decode(raw)
        except (ValueError, SyntaxError, TypeError, MemoryError, RecursionError):
            continue
        if isinstance(value, kind):
            return value
    raise ValueError(f"not a JSON {kind.__name__}")


def _as_type(raw: str, json_type: str) -> Any:
    """raw converted to `json_type`; ValueError when it is not one."""
    text = raw.strip()
    if json_type == "null" and text.lower() in ("null", "none"):
        return None
    if json_type == "integer":
        number = float(text)
        if not number.is_integer():
            raise ValueError(f"{text!r} is not an integer")
        return int(text) if text.lstrip("+-").isdigit() else int(number)
    if json_type == "number":
        number = float(text)
        return int(number) if number.is_integer() and "." not in text and "e" not in text.lower() else number
    if json_type == "boolean":
        if text.lower() in ("true", "1", "yes"):
            return True
        if text.lower() in ("false", "0", "no"):
            return False
        raise ValueError(f"{text!r} is not a boolean")
    if json_type in ("object", "array"):
        return _container(text, dict if json_type == "object" else list)
    if json_type == "string":
        return raw
    raise ValueError(f"unknown type {json_type!r}")


def typed_value(raw: str, schema: Any) -> Any:
    """An argument written as text, as the type its schema declares: the first of the
    declared types (most specific first) that the text is. "null" is None. Without
    a schema it stays text; with a schema that declares no type, or none that fits,
    a JSON object or list is decoded and anything else stays text."""
    if raw.strip().lower() == "null":
        return None
    if schema is None:
        return raw
    for json_type in [t for t in _PRIORITY if t in declared_types(schema)]:
        try:
            return _as_type(raw, json_type)
        except (ValueError, OverflowError):
            continue
    for kind in (dict, list):
        try:
            return _container(raw.strip(), kind)
        except ValueError:
            pass
    return raw


def loose_value(raw: str) -> Any:
    """An argument of a format that writes JSON values but strings bare (glm47,
    longcat): JSON, else a Python literal, else the text itself."""
    for decode in (json.loads, ast.literal_eval):
        try:
            return decode(raw)
        except (ValueError, SyntaxError, TypeError, MemoryError, RecursionError):
            continue
    return raw
