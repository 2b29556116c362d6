"""NVIDIA Nemotron (Nemotron-H, Llama-Nemotron) tool calls: a JSON list of calls
between markers, read as json_tools reads its blocks:

    <TOOLCALL>[{"name": "get_weather", "arguments": {"city": "Paris"}}]</TOOLCALL>

Not one of upstream's formats; this project serves the nemotron_h family."""

from .json_tools import parse_tool_call  # noqa: F401  (the same JSON, other markers)

tool_call_start = "<TOOLCALL>"
tool_call_end = "</TOOLCALL>"
