"""text_state_machine.py: markers route text between states and are removed, and
the result never depends on how the text is cut into pieces."""

import itertools
import random

import pytest

from mlx_lm.generate import TextStateMachine as ReExported
from mlx_lm.text_state_machine import TextStateMachine, make_text_state_machine, thinking_and_tool_transitions

THINK_AND_TOOLS = thinking_and_tool_transitions(("<think>", "</think>"), ("<tool_call>", "</tool_call>"))


def run(machine, pieces, initial="normal"):
    """The (state, text) segments of feeding `pieces` one after the other, then the
    end of the stream, with neighbouring pieces of one visit joined."""
    state, visits = machine.make_state(initial), []
    for piece in pieces:
        state, segments = TextStateMachine.split(state, piece)
        visits = _join(visits, segments)
    state, rest, name = TextStateMachine.flush(state)
    return _join(visits, [(name, rest)])


def _join(visits, segments):
    """The first segment of a split continues the last visit; later ones begin visits."""
    visits = list(visits)
    for i, (name, text) in enumerate(segments):
        if i == 0 and visits:
            assert visits[-1][0] == name
            visits[-1] = (name, visits[-1][1] + text)
        else:
            visits.append((name, text))
    return visits


def every_cut(text, max_cuts=2):
    """Every way to cut `text` into at most max_cuts + 1 pieces, then one character a piece."""
    for k in range(1, max_cuts + 1):
        for cuts in itertools.combinations(range(1, len(text)), k):
            bounds = (0, *cuts, len(text))
            yield [text[a:b] for a, b in zip(bounds, bounds[1:])]
    yield list(text)


def test_markers_route_text_and_disappear():
    machine = TextStateMachine(THINK_AND_TOOLS)
    text = "<think>plan</think>Sure.<tool_call>{\"a\": 1}</tool_call>Done"
    assert run(machine, [text]) == [("normal", ""), ("reasoning", "plan"), ("normal", "Sure."),
                                    ("tool", '{"a": 1}'), ("normal", "Done")]


def test_a_tool_call_may_begin_inside_reasoning():
    machine = TextStateMachine(THINK_AND_TOOLS)
    assert run(machine, ["hmm<tool_call>x</tool_call>ok"], initial="reasoning") == [
        ("reasoning", "hmm"), ("tool", "x"), ("normal", "ok")]


@pytest.mark.parametrize("text", [
    "<think>a<b</think>c<tool_call>{\"x\": \"</tool\"}</tool_call>d",
    "<<think>>x</think</think><tool_call><tool_call></tool_call>",
    "<thin<think>k</think>",
    "plain text with < and </ and <tool but no marker<",
])
def test_every_cut_gives_the_same_segments(text):
    machine = TextStateMachine(THINK_AND_TOOLS)
    whole = run(machine, [text])
    for pieces in every_cut(text):
        assert run(machine, pieces) == whole, pieces


def test_a_marker_inside_a_longer_one_waits_for_the_longer():
    # "bc" completes inside "abcd"; leftmost-longest takes "abcd" whether or not the
    # "d" comes in the same piece.
    machine = TextStateMachine({"normal": [("abcd", "long"), ("bc", "short")]})
    assert run(machine, ["xabcdy"]) == [("normal", "x"), ("long", "y")]
    assert run(machine, ["xabc", "dy"]) == [("normal", "x"), ("long", "y")]
    assert run(machine, ["xabc", "e"]) == [("normal", "xa"), ("short", "e")]
    assert run(machine, ["xabce"]) == [("normal", "xa"), ("short", "e")]


def test_random_cuts_of_a_long_text():
    machine = TextStateMachine(THINK_AND_TOOLS)
    rng = random.Random(0)
    atoms = ["<think>", "</think>", "<tool_call>", "</tool_call>", "<", "</", "<th", "a", "b", " ", "think>"]
    for _ in range(30):
        text = "".join(rng.choice(atoms) for _ in range(40))
        whole = run(machine, [text])
        cuts = sorted(rng.sample(range(1, len(text)), 12))
        bounds = (0, *cuts, len(text))
        assert run(machine, [text[a:b] for a, b in zip(bounds, bounds[1:])]) == whole


def test_held_back_text_is_flushed_or_discarded_at_the_end():
    machine = TextStateMachine(THINK_AND_TOOLS)
    state, text, name = TextStateMachine.step(machine.make_state(), "answer <thi")
    assert (text, name) == ("answer ", "normal")
    assert TextStateMachine.flush(state)[1:] == ("<thi", "normal")
    state, name = TextStateMachine.discard(state)
    assert state.pending == "" and name == "normal" and state[0] == "normal"


def test_a_format_without_an_end_marker_stays_in_its_state():
    machine = TextStateMachine(thinking_and_tool_transitions(None, ("[TOOL_CALLS]", "")))
    assert run(machine, ["Hi[TOOL_CALLS]f[ARGS]{}[TOOL_CALLS]g[ARGS]{}"]) == [
        ("normal", "Hi"), ("tool", "f[ARGS]{}[TOOL_CALLS]g[ARGS]{}")]


class _Markers:
    has_thinking, think_start, think_end = True, "<think>", "</think>"
    has_tool_calling, tool_call_start, tool_call_end = True, "<tool_call>", "</tool_call>"
    structural_markers = ("<|frame|>",)
    response_transitions = {}


def test_make_text_state_machine_removes_stop_words_in_every_state():
    machine = make_text_state_machine(_Markers(), stop_words=["STOP"])
    assert ReExported is TextStateMachine
    # Each removal is a transition (to the same state), so it begins a new visit.
    assert run(machine, ["aSTOPb<think>cSTOPd</think>e<|frame|>f"]) == [
        ("normal", "a"), ("normal", "b"), ("reasoning", "c"), ("reasoning", "d"), ("normal", "e"), ("normal", "f")]


class _ResponseFormat(_Markers):
    """A chat format with states of its own (upstream's Muse Spark RESPONSE_FORMAT, cut down)."""

    has_thinking, structural_markers = False, ()
    tool_call_start, tool_call_end = "<atem:function_calls>", "</atem:function_calls>"
    response_transitions = {
        "header": [("to=self<|message|>", "reasoning"), ("to=user<|message|>", "normal"),
                   ("<atem:function_calls>", "tool")],
        "reasoning": [("<|eom|>", "header")],
        "normal": [("<|eom|>", "header")],
    }


def test_make_text_state_machine_takes_the_chat_format_states():
    machine = make_text_state_machine(_ResponseFormat())
    text = "to=self<|message|>hmm<|eom|>to=user<|message|>Hi <atem:function_calls> x<|eom|><atem:function_calls>f()"
    # The format's header starts calls, so in "normal" the call marker is plain text.
    assert run(machine, [text], initial="header") == [
        ("header", ""), ("reasoning", "hmm"), ("header", ""), ("normal", "Hi <atem:function_calls> x"),
        ("header", ""), ("tool", "f()")]
    assert run(make_text_state_machine(_Markers()), ["a<tool_call>f</tool_call>"]) == [
        ("normal", "a"), ("tool", "f"), ("normal", "")]


def test_bad_transitions_are_refused():
    with pytest.raises(ValueError, match="expected a \\(marker string, state name\\) pair"):
        TextStateMachine({"normal": [("<think>", None)]})
