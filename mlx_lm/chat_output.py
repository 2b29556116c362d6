"""A chat answer's text split into what OpenAI clients read: `content`, the reasoning
(`reasoning_content`, and upstream's `reasoning`) and `tool_calls`.

The generated text goes through a TextStateMachine (text_state_machine.py) built
from the model's markers: text between the reasoning markers is reasoning, text
between the tool-call markers is one block of tool calls, parsed by the model's
format (tool_parsers/) when the block closes. A block that does not parse is
returned as content, markers included, exactly as the model wrote it; so are calls
after the first when the request asks for one (`parallel_tool_calls: false`).

How the text was cut (one token a step, several with speculation, the whole answer
at once) changes only when pieces go out, never what they add up to.

Per request (`ChatPlan`): which tools the template sees and whether the answer must
be a tool call (`tool_choice`). "none" renders no tools and parses none; "required"
and a named function end the prompt with the format's start marker, so the model
continues inside a call (a named one sees only that function).
"""

import json
import logging
import uuid
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional, Tuple

from .text_state_machine import MachineState, TextStateMachine, thinking_and_tool_transitions

log = logging.getLogger("mlx_lm.server")

ToolParser = Callable[[str, Any], Any]


@dataclass
class ChatDelta:
    """What a chat answer adds at one point: text, reasoning and finished tool calls."""

    content: str = ""
    reasoning: str = ""
    tool_calls: List[dict] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.content or self.reasoning or self.tool_calls)

    def extend(self, other: "ChatDelta") -> None:
        self.content += other.content
        self.reasoning += other.reasoning
        self.tool_calls += other.tool_calls

    def fields(self) -> Dict[str, Any]:
        """The message / delta fields with something in them."""
        body: Dict[str, Any] = {}
        if self.content:
            body["content"] = self.content
        if self.reasoning:
            body["reasoning_content"] = body["reasoning"] = self.reasoning
        if self.tool_calls:
            body["tool_calls"] = self.tool_calls
        return body


class ToolCallFormatter:
    """Parsed tool calls in OpenAI's shape: {"id", "type": "function", "function":
    {"name", "arguments": JSON text}}, plus a running "index" when streaming.
    Upstream's interface: calling it with a list of block texts returns the calls of
    the blocks that parse (the others are logged and left out)."""

    def __init__(self, tool_parser: ToolParser, tools: Optional[List[Any]], streaming: bool = False):
        self._tool_parser = tool_parser
        self._tools = tools
        self._streaming = streaming
        self._index = 0

    def parse(self, text: str) -> Optional[List[dict]]:
        """The calls of one block, or None if it is not one the format can read (or
        its arguments are not JSON values, e.g. a Python set a literal gave)."""
        try:
            parsed = self._tool_parser(text, self._tools)
            calls = parsed if isinstance(parsed, list) else [parsed]
            if not calls or not all(isinstance(c, dict) and isinstance(c.get("name"), str) for c in calls):
                raise ValueError(f"the format's parser returned {parsed!r}, not calls")
            encoded = [json.dumps(c.get("arguments", {}), ensure_ascii=False) for c in calls]
        except (ValueError, TypeError, KeyError, AttributeError, RecursionError) as e:
            log.warning("The model's tool call did not parse (%s: %s); returned as content", type(e).__name__, e)
            return None
        return [self._format(call, arguments) for call, arguments in zip(calls, encoded)]

    def _format(self, call: dict, arguments: str) -> dict:
        out = {"id": call.get("id") or f"call_{uuid.uuid4().hex[:24]}", "type": "function",
               "function": {"name": call["name"], "arguments": arguments}}
        if self._streaming:
            out["index"] = self._index
            self._index += 1
        return out

    def __call__(self, tool_texts: List[str]) -> List[dict]:
        return [call for text in tool_texts for call in self.parse(text) or []]


class ChatTextRouter:
    """Routes one answer's text (`add`, then `finish`) to content, reasoning and
    tool calls. `tool_markers` (start, end) rebuild a block that does not parse."""

    def __init__(self, machine: TextStateMachine, initial_state: str = "normal",
                 formatter: Optional[ToolCallFormatter] = None, tool_markers: Tuple[str, str] = ("", ""),
                 max_tool_calls: Optional[int] = None):
        self.state: MachineState = machine.make_state(initial_state)
        self.formatter = formatter
        self.tool_markers = tool_markers
        self.max_tool_calls = max_tool_calls
        self.num_tool_calls = 0
        self.block = ""  # the text of the tool-call block being read

    @property
    def made_tool_call(self) -> bool:
        return self.num_tool_calls > 0

    def add(self, text: str) -> ChatDelta:
        self.state, segments = TextStateMachine.split(self.state, text)
        return self._route(segments)

    def finish(self) -> ChatDelta:
        """The end of the answer: held-back text, and a block still open (cut off, or
        a format without an end marker)."""
        self.state, rest, name = TextStateMachine.flush(self.state)
        delta = self._route([(name, rest)])
        if name == "tool":
            delta.extend(self._close_block(closed=False))
        return delta

    def _route(self, segments: List[Tuple[str, str]]) -> ChatDelta:
        """The first segment continues the current visit of its state; each later
        one begins a new visit, so a block ends where a segment of another state
        follows one of "tool" (a stop word removed inside a block leaves it open)."""
        delta = ChatDelta()
        for i, (name, text) in enumerate(segments):
            if i > 0 and segments[i - 1][0] == "tool" and name != "tool":
                delta.extend(self._close_block(closed=True))
            if name == "tool":
                self.block += text
            elif name == "reasoning":
                delta.reasoning += text
            else:
                delta.content += text
        return delta

    def _close_block(self, closed: bool) -> ChatDelta:
        block, self.block = self.block, ""
        calls = self.formatter.parse(block) if self.formatter is not None else None
        room = None if self.max_tool_calls is None else self.max_tool_calls - self.num_tool_calls
        if calls is None or (room is not None and len(calls) > room):
            start, end = self.tool_markers
            return ChatDelta(content=start + block + (end if closed else ""))
        self.num_tool_calls += len(calls)
        return ChatDelta(tool_calls=calls)


@dataclass
class ChatPlan:
    """How one chat request's answer is read (module docstring)."""

    transitions: Dict[str, List[Tuple[str, str]]]
    initial_state: str
    tool_parser: Optional[ToolParser]
    tools: Optional[List[Any]]
    tool_markers: Tuple[str, str]
    parallel_tool_calls: bool = True

    def router(self, streaming: bool) -> ChatTextRouter:
        formatter = None if self.tool_parser is None else ToolCallFormatter(self.tool_parser, self.tools, streaming)
        return ChatTextRouter(TextStateMachine(self.transitions), self.initial_state, formatter, self.tool_markers,
                              None if self.parallel_tool_calls else 1)


def template_tools(tools: Optional[List[Any]], tool_choice: str, named_tool: Optional[str]) -> Optional[List[Any]]:
    """The tools the chat template renders: none for "none", only the named function
    for a named tool_choice."""
    if tool_choice == "none" or not tools:
        return None
    if named_tool is not None:
        return [t for t in tools if t["function"]["name"] == named_tool]
    return tools


def forced_call_prefix(tokenizer, tool_choice: str) -> str:
    """What the prompt ends with so that the answer is a tool call ("" unless
    tool_choice is "required" or names a function); ValueError for a model without a
    tool-call format."""
    if tool_choice != "required":
        return ""
    if not tokenizer.has_tool_calling:
        raise ValueError("tool_choice asks for a tool call, but this model's chat template and tokenizer name no "
                         "tool-call format (set tool_parser_type in its tokenizer_config.json): use "
                         "tool_choice \"auto\" or \"none\"")
    return tokenizer.tool_call_start


def plan_chat(tokenizer, prompt: str, tool_choice: str, tools: Optional[List[Any]],
              parallel_tool_calls: bool = True) -> ChatPlan:
    """The plan of a chat answer that continues the rendered `prompt` (which ends with
    forced_call_prefix when a call is required)."""
    think = (tokenizer.think_start, tokenizer.think_end) if tokenizer.has_thinking else None
    parse_tools = tokenizer.has_tool_calling and tool_choice != "none"
    markers = (tokenizer.tool_call_start, tokenizer.tool_call_end) if parse_tools else ("", "")
    initial = "normal"
    if think is not None and prompt.rfind(think[0]) > prompt.rfind(think[1]):
        initial = "reasoning"  # the template opened the reasoning (Qwen3, DeepSeek-R1 thinking templates)
    if tool_choice == "required" and parse_tools:
        initial = "tool"  # the prompt ends with the start marker
    transitions = thinking_and_tool_transitions(think, markers if parse_tools else None, tokenizer.structural_markers)
    return ChatPlan(transitions, initial,
                    tokenizer.tool_parser if parse_tools else None, tools, markers, parallel_tool_calls)


def plain_router() -> ChatTextRouter:
    """All text is content (completions, and chats of models without markers)."""
    return ChatTextRouter(TextStateMachine())
