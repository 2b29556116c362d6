"""tool_parsers/: each format's calls, read from the text between its markers; text
a format cannot read raises ValueError; and a whole answer (content, a call, more
content) reads the same however the stream is cut."""

import itertools
import json

import pytest

from mlx_lm.chat_output import ChatTextRouter, ToolCallFormatter
from mlx_lm.text_state_machine import TextStateMachine, thinking_and_tool_transitions
from mlx_lm.tool_parsers import PARSER_NAMES, load_parser, parser_for_model, parser_for_template

TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object", "properties": {
    "city": {"type": "string"}, "days": {"type": "integer"}, "metric": {"type": "boolean"},
    "hours": {"type": "array"}}}}},
    {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object", "properties": {
        "zone": {"type": "string"}}}}}]
WEATHER = {"name": "get_weather", "arguments": {"city": "Paris", "days": 3}}
TIME = {"name": "get_time", "arguments": {"zone": "UTC"}}

# (format, the text between its markers, the calls it holds)
CALLS = [
    ("json_tools", '\n{"name": "get_weather", "arguments": {"city": "Paris", "days": 3}}\n', [WEATHER]),
    ("json_tools", '[{"name": "get_weather", "arguments": "{\\"city\\": \\"Paris\\", \\"days\\": 3}"}, '
                   '{"name": "get_time", "parameters": {"zone": "UTC"}}]', [WEATHER, TIME]),
    ("qwen3_coder", "\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n<parameter=days>\n3\n"
                    "</parameter>\n</function>\n", [WEATHER]),
    ("qwen3_coder", "<function=get_weather><parameter=city>Paris</parameter><parameter=days>3</parameter></function>"
                    "<function=get_time><parameter=zone>UTC</parameter></function>", [WEATHER, TIME]),
    ("mistral", 'get_weather[ARGS]{"city": "Paris", "days": 3}', [WEATHER]),
    ("mistral", 'get_weather[CALL_ID]a1b2c3d4e[ARGS]{"city": "Paris", "days": 3}[TOOL_CALLS]get_time[ARGS]'
                '{"zone": "UTC"}', [{**WEATHER, "id": "a1b2c3d4e"}, TIME]),
    ("mistral", '[{"name": "get_weather", "arguments": {"city": "Paris", "days": 3}}]', [WEATHER]),
    ("pythonic", '[get_weather(city="Paris", days=3)]', [WEATHER]),
    ("pythonic", "[get_weather(city='Paris', days=3), get_time(zone=\"UTC\")]", [WEATHER, TIME]),
    ("gemma4", 'call:get_weather{city:<|"|>Paris<|"|>,days:3}', [WEATHER]),
    ("gemma4", 'call:get_weather{city:<|"|>Paris<|"|>,days:3}call:get_time{zone:<|"|>UTC<|"|>}', [WEATHER, TIME]),
    ("function_gemma", "call:get_weather{city:<escape>Paris<escape>,days:3}", [WEATHER]),
    ("glm47", "get_weather\n<arg_key>city</arg_key>\n<arg_value>Paris</arg_value>\n<arg_key>days</arg_key>\n"
              "<arg_value>3</arg_value>\n", [WEATHER]),
    ("laguna", "get_weather<arg_key>city</arg_key><arg_value>Paris</arg_value><arg_key>days</arg_key>"
               "<arg_value>3</arg_value>", [WEATHER]),
    ("longcat", "get_weather<longcat_arg_key>city</longcat_arg_key><longcat_arg_value>Paris</longcat_arg_value>"
                "<longcat_arg_key>days</longcat_arg_key><longcat_arg_value>3</longcat_arg_value>", [WEATHER]),
    ("harmony", 'get_weather <|constrain|>json<|message|>{"city": "Paris", "days": 3}', [WEATHER]),
    ("kimi_k2", '<|tool_call_begin|>functions.get_weather:0<|tool_call_argument_begin|>{"city": "Paris", "days": 3}'
                '<|tool_call_end|><|tool_call_begin|>functions.get_time:1<|tool_call_argument_begin|>'
                '{"zone": "UTC"}<|tool_call_end|>',
     [{**WEATHER, "id": "functions.get_weather:0"}, {**TIME, "id": "functions.get_time:1"}]),
    ("kimi_k3", '<|open|>call tool="get_weather" index="1"<|sep|><|open|>argument key="city" type="string"<|sep|>'
                'Paris<|close|>argument<|sep|><|open|>argument key="days" type="number"<|sep|>3<|close|>argument'
                '<|sep|><|close|>call<|sep|>', [WEATHER]),
    ("minimax_m2", '\n<invoke name="get_weather">\n<parameter name="city">Paris</parameter>\n<parameter name="days">3'
                   '</parameter>\n</invoke>\n<invoke name="get_time">\n<parameter name="zone">UTC</parameter>\n'
                   '</invoke>\n', [WEATHER, TIME]),
    ("nemotron_json", '[{"name": "get_weather", "arguments": {"city": "Paris", "days": 3}}, '
                      '{"name": "get_time", "arguments": {"zone": "UTC"}}]', [WEATHER, TIME]),
    ("minicpm5", '"get_weather"><param name="city">Paris</param><param name="days">3</param>', [WEATHER]),
    # The looser forms models write too (after the first of each format, which the cut test takes):
    ("harmony", 'get_weather<|channel|>commentary json<|message|>{"city": "Paris", "days": 3}', [WEATHER]),
    ("pythonic", "[get_weather(city=Paris, days=3)]", [WEATHER]),
    ("pythonic", "[get_weather(city=New York, days=3), get_time(zone='UTC')]",
     [{**WEATHER, "arguments": {"city": "New York", "days": 3}}, TIME]),
    ("glm47", 'get_weather\n{"city": "Paris", "days": "3"}', [WEATHER]),
    ("glm47", 'get_weather {"city": "Paris", "days": 3}', [WEATHER]),
    ("glm47", 'get_weather city="Paris" days=3', [WEATHER]),
    ("glm47", '{"function": "get_weather", "arguments": "{\\"city\\": \\"Paris\\", \\"days\\": 3}"}', [WEATHER]),
    ("glm47", '[{"name": "get_weather", "arguments": {"city": "Paris", "days": 3}}, '
              '{"tool": {"name": "get_time", "arguments": {"zone": "UTC"}}}]', [WEATHER, TIME]),
    ("glm47", "get_time", [{"name": "get_time", "arguments": {}}]),
    ("muse_spark", '\n<atem:invoke name="get_weather">\n<atem:parameter name="city">Paris</atem:parameter>'
                   '<atem:parameter name="days">3</atem:parameter>\n</atem:invoke>\n'
                   '<atem:invoke name="get_time"><atem:parameter name="zone">UTC</atem:parameter></atem:invoke>',
     [WEATHER, TIME]),
]

# (format, text it cannot read)
MALFORMED = [
    ("json_tools", '{"name": "get_weather", "arguments": {"city": "Par'),
    ("json_tools", '{"arguments": {}}'),
    ("json_tools", '{"name": "get_weather", "arguments": 5}'),
    ("qwen3_coder", "<function=get_weather>\n<parameter=city>\nParis"),
    ("mistral", 'get_weather[ARGS]{"city": '),
    ("mistral", "I will not call anything."),
    ("pythonic", '[get_weather("Paris")]'),  # positional: its parameter is unknown (upstream drops it)
    ("pythonic", '[get_weather(city=Paris, "x")]'),
    ("pythonic", '[get_weather(city="Paris)]'),
    ("pythonic", "[get_weather(city=(Paris]]"),
    ("gemma4", "call:get_weather{city:<|\"|>Paris"),
    ("function_gemma", "no call here"),
    ("glm47", "this is prose, not a call"),  # upstream: a call named "unknown"
    ("glm47", "get_weather: Paris"),
    ("glm47", 'get_weather city="Paris'),
    ("glm47", 'get_weather ["Paris"]'),
    ("glm47", '{"arguments": {"city": "Paris"}}'),
    ("harmony", "get_weather <|constrain|>json"),
    ("kimi_k2", "functions.get_weather{}"),
    ("kimi_k3", '<|open|>call index="1"<|sep|><|close|>call<|sep|>'),
    ("minimax_m2", '<invoke name="get_weather">'),
    ("minicpm5", "no call"),
    ("muse_spark", "no call"),
    ("nemotron_json", '[{"name": "get_weather", "arguments": {"city": "Paris"}'),
]


def as_list(parsed):
    return parsed if isinstance(parsed, list) else [parsed]


def test_every_format_has_a_module():
    for name in PARSER_NAMES:
        module = load_parser(name)
        assert isinstance(module.tool_call_start, str) and module.tool_call_start
        assert isinstance(module.tool_call_end, str) and callable(module.parse_tool_call)
    assert {name for name, _, _ in CALLS} == set(PARSER_NAMES)
    with pytest.raises(ValueError, match="unknown tool parser 'hermes'.*json_tools"):
        load_parser("hermes")


@pytest.mark.parametrize("name, text, expected", CALLS, ids=[c[0] for c in CALLS])
def test_calls_and_their_arguments(name, text, expected):
    assert as_list(load_parser(name).parse_tool_call(text, TOOLS)) == expected


@pytest.mark.parametrize("name, text", MALFORMED, ids=[m[0] for m in MALFORMED])
def test_text_a_format_cannot_read_raises_value_error(name, text):
    with pytest.raises(ValueError):
        load_parser(name).parse_tool_call(text, TOOLS)


def test_arguments_are_typed_by_the_schema():
    qwen = load_parser("qwen3_coder").parse_tool_call
    call = qwen("<function=get_weather><parameter=city>42</parameter><parameter=days>7</parameter>"
                "<parameter=metric>true</parameter><parameter=hours>[1, 2]</parameter>"
                "<parameter=note>null</parameter><parameter=other>{'a': 1}</parameter></function>", TOOLS)
    # A declared string stays text, and so does an undeclared argument; "null" is None.
    assert call["arguments"] == {"city": "42", "days": 7, "metric": True, "hours": [1, 2], "note": None,
                                 "other": "{'a': 1}"}
    glm = load_parser("glm47").parse_tool_call
    assert glm("get_weather<arg_key>city</arg_key><arg_value>123</arg_value><arg_key>days</arg_key>"
               "<arg_value>4</arg_value>", TOOLS)["arguments"] == {"city": "123", "days": 4}
    pythonic = load_parser("pythonic").parse_tool_call
    assert pythonic('[a.b(x=[{"k": true, "n": null}], y=-1.5)]', None) == {
        "name": "a.b", "arguments": {"x": [{"k": True, "n": None}], "y": -1.5}}
    gemma = load_parser("gemma4").parse_tool_call
    assert gemma('call:f{s:<|"|>a {b}, c:d<|"|>,o:{k:[1,true]}}', None) == {
        "name": "f", "arguments": {"s": "a {b}, c:d", "o": {"k": [1, True]}}}


def read_answer(name, pieces):
    """(content, OpenAI tool calls) of an answer fed to the router in `pieces`."""
    module = load_parser(name)
    markers = (module.tool_call_start, module.tool_call_end)
    machine = TextStateMachine(thinking_and_tool_transitions(("<think>", "</think>"), markers))
    router = ChatTextRouter(machine, "normal", ToolCallFormatter(module.parse_tool_call, TOOLS), markers)
    content, reasoning, calls = "", "", []
    for delta in [router.add(p) for p in pieces] + [router.finish()]:
        content, reasoning, calls = content + delta.content, reasoning + delta.reasoning, calls + delta.tool_calls
    return content, reasoning, [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls]


def answer_text(name, text):
    module = load_parser(name)
    trailer = "" if not module.tool_call_end else " Done."  # with no end marker the call runs to the end
    return f"<think>Need weather.</think>Let me check. {module.tool_call_start}{text}{module.tool_call_end}{trailer}"


FIRST_OF_EACH = [c for i, c in enumerate(CALLS) if c[0] not in [d[0] for d in CALLS[:i]]]
# and the loose forms of issue 32: harmony's recipient in the message header, pythonic
# with bare strings, glm47's bare forms (the harmony framing itself: test_chat_output)
LOOSE = [c for c in CALLS if c[0] in ("harmony", "pythonic", "glm47") and c not in FIRST_OF_EACH]
CUT = FIRST_OF_EACH + LOOSE


@pytest.mark.parametrize("name, text, expected", CUT, ids=[f"{c[0]}-{i}" for i, c in enumerate(CUT)])
def test_every_cut_of_an_answer_reads_as_the_whole(name, text, expected):
    answer = answer_text(name, text)
    whole = read_answer(name, [answer])
    assert whole[1] == "Need weather."
    assert whole[2] == [(c["name"], c["arguments"]) for c in expected]
    assert whole[0] == "Let me check. " + ("" if not load_parser(name).tool_call_end else " Done.")
    for cut in range(1, len(answer)):
        assert read_answer(name, [answer[:cut], answer[cut:]]) == whole, cut
    for a, b in itertools.combinations(range(1, len(answer), 17), 2):  # three pieces, cuts 17 apart
        assert read_answer(name, [answer[:a], answer[a:b], answer[b:]]) == whole, (a, b)
    assert read_answer(name, list(answer)) == whole


def test_formats_from_template_markers_and_model_types():
    qwen3 = '{{- "<tool_call>\\n" }}{"name": {{ tool_call.name | tojson }}}{{- "</tool_call>" }}'
    assert parser_for_template(qwen3) == "json_tools"
    assert parser_for_template("{{ '<tool_call>\\n<function=' + name }}") == "qwen3_coder"
    assert parser_for_template("<tool_call>{{ name }}<arg_key>k</arg_key>") == "glm47"
    assert parser_for_template("{{ '[TOOL_CALLS]' }}") == "mistral"
    assert parser_for_template("<|tool_call_start|>[") == "pythonic"
    assert parser_for_template("{{ '<TOOLCALL>' + calls | tojson + '</TOOLCALL>' }}") == "nemotron_json"
    assert parser_for_template("plain chat") is None and parser_for_template(None) is None
    assert parser_for_model(["<|tool_call_start|>", "<|tool_call_end|>"], None) == "pythonic"
    assert parser_for_model([], "gemma4_text") == "gemma4"
    assert parser_for_model([], "llama") is None
