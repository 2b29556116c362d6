"""FunctionGemma tool calls: Gemma 4's call:name{key:value} syntax (gemma4.py) with
<escape> as the string quote:

    <start_function_call>call:get_weather{city:<escape>Paris<escape>}<end_function_call>"""

from typing import Any, Optional

from .gemma4 import parse_calls

tool_call_start = "<start_function_call>"
tool_call_end = "<end_function_call>"


def parse_tool_call(text: str, tools: Optional[Any] = None):
    return parse_calls(text, "<escape>")
