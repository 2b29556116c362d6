"""gpt-oss tool calls, in OpenAI's harmony format: a message on the commentary
channel addressed to the function, its JSON arguments after <|message|>; the model
ends it with <|call|>, one of its end-of-sequence tokens:

    <|channel|>analysis<|message|>Need the weather.<|end|><|start|>assistant
    <|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{"city": "Paris"}<|call|>

The reasoning (analysis channel) and the message headers are the tokenizer's
thinking and structural markers (tokenizer_utils). Not one of upstream's formats;
this project serves the gpt_oss family."""

import json
import re
from typing import Any, Optional

from .schema import make_call

tool_call_start = "<|channel|>commentary to=functions."
tool_call_end = "<|call|>"

_NAME = re.compile(r"([\w.\-]+)")


def parse_tool_call(text: str, tools: Optional[Any] = None):
    name = _NAME.match(text)
    if name is None or "<|message|>" not in text:
        raise ValueError(f"not a harmony tool call: {text[:80]!r}")
    arguments = text.rsplit("<|message|>", 1)[1].strip()
    return make_call(name.group(1), json.loads(arguments) if arguments else {})
