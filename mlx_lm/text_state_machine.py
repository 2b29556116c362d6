"""Routing generated text between states (content, reasoning, tool calls) by the
marker strings that switch them, e.g. "<think>" ... "</think>" or "<tool_call>".

Upstream's `generate.TextStateMachine` API (`make_state`, `split`, `step`, `flush`,
`discard`, `make_text_state_machine`), matched on decoded text rather than token
ids, so a marker split across tokens, or merged with the next character, is found.

The result does not depend on how the text is cut into pieces: feeding it whole,
token by token, or several tokens a step (speculative decoding) gives the same
segments. The rule that makes it so is leftmost-longest: a marker is acted on only
once no other marker that starts at or before it could still complete; until then
the text from the earliest possible marker start is held back.
"""

from typing import Dict, List, NamedTuple, Optional, Sequence, Tuple

Transitions = Dict[str, List[Tuple[str, str]]]  # state -> [(marker, next state)]
Segment = Tuple[str, str]  # (state, text)


class MachineState(NamedTuple):
    """A stream's place in a TextStateMachine: its state (`state[0]`, as upstream's
    tuple), the text held back because it may begin a marker, and the machine."""

    name: str
    pending: str
    machine: "TextStateMachine"


def _pending_start(text: str, markers: Sequence[str]) -> int:
    """The first index from which `text` runs to its end as a proper prefix of a
    marker (len(text) if none): text from there may still become a marker."""
    longest = max((len(m) for m in markers), default=0)
    for i in range(max(0, len(text) - longest + 1), len(text)):
        tail = text[i:]
        if any(len(m) > len(tail) and m.startswith(tail) for m in markers):
            return i
    return len(text)


def _next_marker(text: str, markers: Sequence[str]) -> Tuple[int, Optional[str]]:
    """(where, marker): the leftmost-longest marker of `text` if it is decided, or
    (where text must wait, None) when a marker starting at or before it could still
    complete, or (len(text), None) when `text` holds no marker at all."""
    found = [(i, m) for m in markers for i in [text.find(m)] if i >= 0]
    wait = _pending_start(text, markers)
    if not found:
        return wait, None
    start = min(i for i, _ in found)
    if wait <= start:
        return wait, None
    return start, max((m for i, m in found if i == start), key=len)


class TextStateMachine:
    """States joined by marker strings; the markers themselves are removed.

    `transitions` maps a state to its (marker, next state) pairs, e.g.
    {"normal": [("<think>", "reasoning")], "reasoning": [("</think>", "normal")]}.
    Empty markers are ignored (a format with no end marker stays in its state)."""

    def __init__(self, transitions: Optional[Transitions] = None):
        self.transitions: Dict[str, Dict[str, str]] = {}
        for state, edges in (transitions or {}).items():
            for marker, target in edges:
                if not isinstance(marker, str) or not isinstance(target, str):
                    raise ValueError(f"transition {(marker, target)!r} of state {state!r}: "
                                     "expected a (marker string, state name) pair")
                if marker:
                    self.transitions.setdefault(state, {})[marker] = target

    def markers(self, state: str) -> List[str]:
        return list(self.transitions.get(state, {}))

    def make_state(self, initial: str = "normal") -> MachineState:
        return MachineState(initial, "", self)

    @staticmethod
    def split(state: MachineState, text: str) -> Tuple[MachineState, List[Segment]]:
        """Consume `text`: (new state, segments). One (state, text) segment per state
        visited, the first continuing the state the stream was in, the last being the
        state it is in now; text that may begin a marker is held back."""
        name, buffer, machine = state.name, state.pending + text, state.machine
        segments: List[Segment] = []
        while True:
            where, marker = _next_marker(buffer, machine.markers(name))
            segments.append((name, buffer[:where]))
            if marker is None:
                return MachineState(name, buffer[where:], machine), segments
            buffer = buffer[where + len(marker):]
            name = machine.transitions[name][marker]

    @staticmethod
    def step(state: MachineState, text: str) -> Tuple[MachineState, str, str]:
        """As `split`, but the segments' texts joined: (new state, text, state name)."""
        state, segments = TextStateMachine.split(state, text)
        return state, "".join(t for _, t in segments), state.name

    @staticmethod
    def flush(state: MachineState) -> Tuple[MachineState, str, str]:
        """End of the stream: the held-back text is plain text of the current state.
        Returns (state, that text, state name)."""
        return state._replace(pending=""), state.pending, state.name

    @staticmethod
    def discard(state: MachineState) -> Tuple[MachineState, str]:
        """Drop the held-back text (upstream's use: a stop sequence ended the stream)."""
        return state._replace(pending=""), state.name


def thinking_and_tool_transitions(think: Optional[Tuple[str, str]], tool: Optional[Tuple[str, str]],
                                  structural: Sequence[str] = ()) -> Transitions:
    """Reasoning between the `think` (start, end) markers; a tool call between the
    `tool` markers, which may also begin inside reasoning (some models call tools
    before closing their thoughts); `structural` markers (message framing) removed
    from the content."""
    transitions: Transitions = {"normal": [(m, "normal") for m in structural]}
    if think is not None:
        transitions["normal"].append((think[0], "reasoning"))
        transitions["reasoning"] = [(think[1], "normal")]
    if tool is not None:
        transitions.setdefault("normal", []).append((tool[0], "tool"))
        if think is not None:
            transitions["reasoning"].append((tool[0], "tool"))
        transitions["tool"] = [(tool[1], "normal")] if tool[1] else []
    return transitions


def make_text_state_machine(tokenizer, stop_words: Optional[Sequence[str]] = None) -> TextStateMachine:
    """Upstream's builder: reasoning and tool transitions from `tokenizer`
    (`has_thinking`, `think_start/end`, `has_tool_calling`, `tool_call_start/end`,
    `structural_markers`), the chat format's own states (`response_transitions`),
    and each stop word as a transition from every state to itself (it is removed)."""
    think = (tokenizer.think_start, tokenizer.think_end) if tokenizer.has_thinking else None
    tool = (tokenizer.tool_call_start, tokenizer.tool_call_end) if tokenizer.has_tool_calling else None
    transitions = thinking_and_tool_transitions(think, tool, tokenizer.structural_markers)
    response = tokenizer.response_transitions
    if tool is not None and any(target == "tool" for edges in response.values() for _, target in edges):
        # A format whose own states lead to "tool" decides where calls start, as upstream.
        transitions["normal"].remove((tool[0], "tool"))
    for state, edges in response.items():
        transitions.setdefault(state, []).extend(edges)
    for state in set(transitions) | {"normal"}:
        transitions.setdefault(state, []).extend((w, state) for w in stop_words or [])
    return TextStateMachine(transitions)
