"""LongCat-Flash tool calls: GLM-4.7's keyed format (glm47.py) with its own tags,
or a JSON object:

    <longcat_tool_call>get_weather<longcat_arg_key>city</longcat_arg_key>
    <longcat_arg_value>Paris</longcat_arg_value></longcat_tool_call>"""

from typing import Any, Optional

from .glm47 import parse_keyed_call

tool_call_start = "<longcat_tool_call>"
tool_call_end = "</longcat_tool_call>"


def parse_tool_call(text: str, tools: Optional[Any] = None):
    return parse_keyed_call(text, tools, "longcat_arg_key", "longcat_arg_value")
