"""Python-call-list tool calls (LFM2, Llama 3.2 / 4 style):

    <|tool_call_start|>[get_weather(city="Paris"), get_time(zone='UTC')]<|tool_call_end|>

Keyword arguments only; values are Python literals, and the JSON literals true,
false and null that templates write into nested values are read as such. Dotted
names (`grocery.order(...)`) are kept whole."""

import ast
from typing import Any, Optional

from .schema import make_call, one_or_many

tool_call_start = "<|tool_call_start|>"
tool_call_end = "<|tool_call_end|>"

_JSON_NAMES = {"true": True, "false": False, "null": None}


def _literal(node: ast.expr) -> Any:
    if isinstance(node, ast.Name) and node.id in _JSON_NAMES:
        return _JSON_NAMES[node.id]
    if isinstance(node, (ast.List, ast.Tuple)):
        return [_literal(e) for e in node.elts]
    if isinstance(node, ast.Dict):
        return {_literal(k): _literal(v) for k, v in zip(node.keys, node.values)}
    return ast.literal_eval(node)


def _dotted_name(node: ast.expr) -> str:
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        return f"{_dotted_name(node.value)}.{node.attr}"
    raise ValueError("a tool call's function must be a (dotted) name")


def _call(node: ast.expr):
    if not isinstance(node, ast.Call) or node.args or any(k.arg is None for k in node.keywords):
        raise ValueError("each tool call must be name(key=value, ...)")
    return make_call(_dotted_name(node.func), {k.arg: _literal(k.value) for k in node.keywords})


def parse_tool_call(text: str, tools: Optional[Any] = None):
    start, end = text.find("["), text.rfind("]")
    if start < 0 or end < start:
        raise ValueError("no [call(...)] list")
    try:
        tree = ast.parse(text[start : end + 1], mode="eval").body
    except (SyntaxError, RecursionError, MemoryError) as e:
        raise ValueError(f"not a Python list of calls: {e}") from None
    if not isinstance(tree, ast.List):
        raise ValueError("not a Python list of calls")
    return one_or_many([_call(node) for node in tree.elts])
