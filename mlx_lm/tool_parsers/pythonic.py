"""Python-call-list tool calls (LFM2, Llama 3.2 / 4 style):

    <|tool_call_start|>[get_weather(city="Paris"), get_time(zone='UTC')]<|tool_call_end|>

Keyword arguments only; values are Python literals, and the JSON literals true,
false and null that templates write into nested values are read as such. Dotted
names (`grocery.order(...)`) are kept whole.

Models also write the list loosely, as upstream reads it: strings unquoted
(`[get_weather(city=Paris, note=New York)]`). A list that is not Python, or holds a
value that is no literal, is read again by text: calls and arguments split at the
commas outside quotes and brackets, each value a literal if it is one, else its text
(surrounding quotes dropped). Positional arguments are refused either way: their
parameter names are unknown (upstream drops them)."""

import ast
import re
from typing import Any, List, Optional, Union

from .schema import ToolCall, make_call, one_or_many  # ToolCall: upstream's name here too

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


def _call(node: ast.expr) -> ToolCall:
    if not isinstance(node, ast.Call) or node.args or any(k.arg is None for k in node.keywords):
        raise ValueError("each tool call must be name(key=value, ...)")
    return make_call(_dotted_name(node.func), {k.arg: _literal(k.value) for k in node.keywords})


def parse_tool_call(text: str, tools: Optional[Any] = None) -> Union[ToolCall, List[ToolCall]]:
    start, end = text.find("["), text.rfind("]")
    if start < 0 or end < start:
        raise ValueError("no [call(...)] list")
    try:
        tree = ast.parse(text[start : end + 1], mode="eval").body
        if not isinstance(tree, ast.List):
            raise ValueError("not a Python list of calls")
        return one_or_many([_call(node) for node in tree.elts])
    except (SyntaxError, ValueError, RecursionError, MemoryError):
        return one_or_many(_loose_calls(text[start + 1 : end]))


_LOOSE_CALL = re.compile(r"\s*([A-Za-z_][\w.]*)\s*\((.*)\)\s*", re.DOTALL)
_KEY = re.compile(r"\s*([A-Za-z_]\w*)\s*=(.*)", re.DOTALL)
_CLOSERS = {"(": ")", "[": "]", "{": "}"}


def split_top_level(text: str) -> List[str]:
    """`text` cut at the commas outside quotes and brackets; ValueError when a quote or
    bracket is left open."""
    parts, depth, quote, begin = [], [], None, 0
    for i, char in enumerate(text):
        if quote is not None:
            quote = None if char == quote and text[i - 1] != "\\" else quote
        elif char in "\"'":
            quote = char
        elif char in _CLOSERS:
            depth.append(_CLOSERS[char])
        elif depth and char == depth[-1]:
            depth.pop()
        elif char in ")]}":
            raise ValueError(f"unbalanced {char!r} in a tool call")
        elif char == "," and not depth:
            parts.append(text[begin:i])
            begin = i + 1
    if quote is not None or depth:
        raise ValueError("a quote or bracket left open in a tool call")
    return parts + [text[begin:]]


def _loose_value(raw: str) -> Any:
    """A literal (JSON's true/false/null too), else the text, quotes dropped."""
    raw = raw.strip()
    try:
        return _literal(ast.parse(raw, mode="eval").body)
    except (SyntaxError, ValueError, RecursionError, MemoryError):
        pass
    if len(raw) >= 2 and raw[0] == raw[-1] and raw[0] in "\"'":
        return raw[1:-1]
    return raw


def _loose_calls(body: str) -> List[ToolCall]:
    """The calls of a loosely written list body (module docstring)."""
    calls = []
    for part in split_top_level(body):
        match = _LOOSE_CALL.fullmatch(part)
        if match is None:
            raise ValueError(f"not a call: {part.strip()[:80]!r}")
        arguments = {}
        for argument in split_top_level(match.group(2)) if match.group(2).strip() else []:
            pair = _KEY.fullmatch(argument)
            if pair is None:
                raise ValueError(f"a positional argument {argument.strip()[:40]!r}: tool calls name their arguments")
            arguments[pair.group(1)] = _loose_value(pair.group(2))
        calls.append(make_call(match.group(1), arguments))
    return calls
