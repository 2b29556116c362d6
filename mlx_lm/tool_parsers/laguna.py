"""Poolside Laguna tool calls: GLM-4.7's format (glm47.py). Its converted
checkpoints name this parser in tokenizer_config.json ("tool_parser_type")."""

from .glm47 import parse_tool_call, tool_call_end, tool_call_start

__all__ = ["parse_tool_call", "tool_call_start", "tool_call_end"]
