"""gpt-oss tool calls, in OpenAI's harmony format: a message addressed to the
function, its JSON arguments after <|message|>; the model ends it with <|call|>, one
of its end-of-sequence tokens. The recipient is written in one of two places, both
seen from gpt-oss: in the channel header, or in the message header before the
channel (the form gpt-oss's chat template renders past calls in):

    <|channel|>analysis<|message|>Need the weather.<|end|><|start|>assistant
    <|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{"city": "Paris"}<|call|>

    <|start|>assistant to=functions.get_weather<|channel|>commentary json<|message|>{"city": "Paris"}<|call|>

So a call starts at " to=functions.", which both forms hold; the message framing
before it ("<|start|>assistant", "<|channel|>commentary") is the tokenizer's
structural markers (tokenizer_utils), removed from the content, and the reasoning
(analysis channel) its thinking markers. What follows the name up to the last
<|message|> is the header's rest. A required call ends the prompt's
"<|start|>assistant" with the marker: the header form. Not one of upstream's
formats; this project serves the gpt_oss family."""

import json
import re
from typing import Any, Optional

from .schema import make_call

tool_call_start = " to=functions."
tool_call_end = "<|call|>"

_NAME = re.compile(r"([\w.\-]+)")


def parse_tool_call(text: str, tools: Optional[Any] = None):
    name = _NAME.match(text)
    if name is None or "<|message|>" not in text:
        raise ValueError(f"not a harmony tool call: {text[:80]!r}")
    arguments = text.rsplit("<|message|>", 1)[1].strip()
    return make_call(name.group(1), json.loads(arguments) if arguments else {})
