"""chat_output.py and the tokenizer's markers: an answer's text split into content,
reasoning and tool calls; what tool_choice does to the prompt; blocks that do not
parse come back as content; the response bodies carry it all in OpenAI's shape."""

import json
import re

import pytest
from tokenizer_fixture import write_tokenizer

from mlx_lm.chat_output import ChatTextRouter, ToolCallFormatter, forced_call_prefix, plan_chat, template_tools
from mlx_lm.openai_api import GenerationResult, RequestError, ResponseBuilder, ServerDefaults, parse_request
from mlx_lm.text_state_machine import TextStateMachine, thinking_and_tool_transitions
from mlx_lm.tokenizer_utils import load, with_chat_template
from mlx_lm.tool_parsers import json_tools

TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}},
         {"type": "function", "function": {"name": "get_time"}}]
CALL = '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>'
MARKERS = ("<tool_call>", "</tool_call>")


def router(max_tool_calls=None, streaming=False):
    machine = TextStateMachine(thinking_and_tool_transitions(("<think>", "</think>"), MARKERS))
    formatter = ToolCallFormatter(json_tools.parse_tool_call, TOOLS, streaming)
    return ChatTextRouter(machine, "normal", formatter, MARKERS, max_tool_calls)


def read(r, text):
    delta = r.add(text)
    delta.extend(r.finish())
    return delta


def test_calls_reasoning_and_content_are_split():
    delta = read(router(), "<think>hm</think>Checking." + CALL + CALL)
    assert (delta.content, delta.reasoning) == ("Checking.", "hm")
    assert [c["function"] for c in delta.tool_calls] == [{"name": "get_weather", "arguments": '{"city": "Paris"}'}] * 2
    assert all(c["type"] == "function" and c["id"].startswith("call_") for c in delta.tool_calls)


def test_a_block_that_does_not_parse_is_content_as_written():
    broken = '<tool_call>{"name": "get_weather", "arguments": {"ci</tool_call>'
    delta = read(router(), "a" + broken + "b")
    assert (delta.content, delta.tool_calls) == ("a" + broken + "b", [])
    cut_off = '<tool_call>{"name": "get_weather"'  # max_tokens ended the block
    assert read(router(), "a" + cut_off).content == "a" + cut_off
    # A format that reads Python literals can give values JSON has no words for.
    set_valued = ToolCallFormatter(lambda text, tools: {"name": "f", "arguments": {"x": {1, 2}}}, None)
    assert set_valued.parse("anything") is None and set_valued(["anything"]) == []


def test_one_call_when_parallel_calls_are_off():
    r = router(max_tool_calls=1)
    delta = read(r, CALL + CALL)
    assert len(delta.tool_calls) == 1 and delta.content == CALL and r.made_tool_call


def test_streamed_calls_are_numbered():
    delta = read(router(streaming=True), CALL + "x" + CALL)
    assert [c["index"] for c in delta.tool_calls] == [0, 1]


def test_tool_choice_is_validated():
    def parse(**fields):
        return parse_request({"messages": [{"role": "user", "content": "hi"}], **fields}, "chat", ServerDefaults())

    request = parse(tools=TOOLS, tool_choice={"type": "function", "function": {"name": "get_time"}})
    assert (request.tool_choice, request.named_tool) == ("required", "get_time")
    assert parse(tools=TOOLS).tool_choice == "auto" and parse(tool_choice="none").tool_choice == "none"
    assert not parse(tools=TOOLS, parallel_tool_calls=False).parallel_tool_calls
    bad = [({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "get_wether"}}},
            "names the function 'get_wether', which is not among the request's tools ('get_weather', 'get_time')"),
           ({"tool_choice": "required"}, "needs 'tools'"),
           ({"tools": TOOLS, "tool_choice": "always"}, "'tool_choice' must be \"auto\", \"none\", \"required\""),
           ({"tools": [{"type": "function", "function": {}}]}, "'tools[0]' must be"),
           ({"tools": TOOLS, "parallel_tool_calls": "yes"}, "'parallel_tool_calls' must be true or false")]
    for fields, message in bad:
        with pytest.raises(RequestError, match=re.escape(message)) as error:
            parse(**fields)
        assert error.value.status == 400


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    """The fixture tokenizer with <think> tokens and a template that knows tools."""
    directory = tmp_path_factory.mktemp("tokenizer")
    write_tokenizer(directory)
    config = json.loads((directory / "tokenizer_config.json").read_text())
    config["chat_template"] = ("{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
                               "{% if tools %}tools: {{ tools | map(attribute='function.name') | join(',') }}\n"
                               "Call them as <tool_call>{\"name\": ...}</tool_call>\n{% endif %}"
                               "{% if add_generation_prompt %}assistant: <think>{% endif %}")
    (directory / "tokenizer_config.json").write_text(json.dumps(config))
    hf = load(directory).tokenizer
    hf.add_tokens(["<think>", "</think>"])
    hf.save_pretrained(directory)
    return load(directory)


def test_the_loader_finds_the_format_and_the_reasoning_markers(tmp_path):
    write_tokenizer(tmp_path)
    config = json.loads((tmp_path / "tokenizer_config.json").read_text())
    config["chat_template"] = "{{ '<tool_call>' }}{{ tool_call.name }}"
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    wrapper = load(tmp_path)
    assert wrapper.has_tool_calling and wrapper.tool_parser is json_tools.parse_tool_call
    assert (wrapper.tool_call_start, wrapper.tool_call_end) == MARKERS and not wrapper.has_thinking
    config["tool_parser_type"] = "mistral"
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    assert load(tmp_path).tool_call_start == "[TOOL_CALLS]"
    config["tool_parser_type"] = "hermes"
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="unknown tool parser 'hermes'"):
        load(tmp_path)


def test_a_replaced_template_brings_its_own_format(tmp_path):
    write_tokenizer(tmp_path)
    plain = load(tmp_path)
    assert not plain.has_tool_calling
    served = with_chat_template(plain, "{{ '[TOOL_CALLS]' }}{% for m in messages %}{{ m.content }}{% endfor %}")
    assert served.tool_call_start == "[TOOL_CALLS]" and served.eos_token_ids == plain.eos_token_ids
    assert served.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False) == "[TOOL_CALLS]hi"


def test_the_plan_follows_the_prompt_and_tool_choice(tokenizer):
    assert tokenizer.has_thinking and tokenizer.think_start_id is not None
    plan = plan_chat(tokenizer, "user: hi\nassistant: <think>", "auto", TOOLS)
    assert plan.initial_state == "reasoning"
    delta = read(plan.router(False), "thinking</think>It is sunny." + CALL)
    assert (delta.reasoning, delta.content, len(delta.tool_calls)) == ("thinking", "It is sunny.", 1)
    none = plan_chat(tokenizer, "assistant: ", "none", TOOLS)
    assert read(none.router(False), CALL).content == CALL
    prefix = forced_call_prefix(tokenizer, "required")
    forced = plan_chat(tokenizer, "assistant: <think></think>" + prefix, "required", TOOLS)
    assert forced.initial_state == "tool"
    assert len(read(forced.router(False), CALL[len(prefix):]).tool_calls) == 1
    assert template_tools(TOOLS, "required", "get_time") == TOOLS[1:]
    assert template_tools(TOOLS, "none", None) is None and template_tools(TOOLS, "auto", None) == TOOLS


def test_a_required_call_needs_a_format(tmp_path):
    write_tokenizer(tmp_path)
    with pytest.raises(ValueError, match="name no tool-call format"):
        forced_call_prefix(load(tmp_path), "required")
    assert forced_call_prefix(load(tmp_path), "auto") == ""


def test_gpt_oss_harmony_answers(tmp_path):
    write_tokenizer(tmp_path)
    hf = load(tmp_path).tokenizer
    hf.add_tokens(["<|start|>", "<|channel|>", "<|message|>", "<|end|>", "<|call|>", "<|constrain|>"], True)
    hf.save_pretrained(tmp_path)
    tokenizer = load(tmp_path)
    assert tokenizer.think_start == "<|channel|>analysis<|message|>" and tokenizer.tool_call_end == "<|call|>"
    plan = plan_chat(tokenizer, "<|start|>user<|message|>weather?<|end|><|start|>assistant", "auto", TOOLS)
    call = read(plan.router(False), "<|channel|>analysis<|message|>Need it.<|end|><|start|>assistant<|channel|>"
                                    'commentary to=functions.get_weather <|constrain|>json<|message|>{"city": "Paris"}')
    assert (call.reasoning, call.content, call.tool_calls[0]["function"]["name"]) == ("Need it.", "", "get_weather")
    answer = read(plan.router(False), "<|channel|>analysis<|message|>ok<|end|><|start|>assistant<|channel|>final"
                                      "<|message|>It is sunny.")
    assert (answer.reasoning, answer.content, answer.tool_calls) == ("ok", "It is sunny.", [])


HARMONY_REASONING = "<|channel|>analysis<|message|>Need it.<|end|>"
HARMONY_CALLS = {  # the recipient in the channel header, and in the message header
    "channel": '<|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>'
               '{"city": "Paris"}',
    "header": '<|start|>assistant to=functions.get_weather<|channel|>commentary json<|message|>{"city": "Paris"}',
}


def harmony_tokenizer(directory):
    write_tokenizer(directory)
    hf = load(directory).tokenizer
    hf.add_tokens(["<|start|>", "<|channel|>", "<|message|>", "<|end|>", "<|call|>", "<|constrain|>"], True)
    hf.save_pretrained(directory)
    return load(directory)


def harmony_read(plan, pieces):
    r = plan.router(False)
    delta = r.add("")
    for piece in pieces:
        delta.extend(r.add(piece))
    delta.extend(r.finish())
    return delta.reasoning, delta.content, [(c["function"]["name"], c["function"]["arguments"]) for c in delta.tool_calls]


@pytest.mark.parametrize("form", HARMONY_CALLS)
@pytest.mark.parametrize("ending", ["", "<|call|>"])  # <|call|> is an end-of-sequence token: often not in the text
def test_harmony_calls_read_the_same_however_many_tokens_a_step(tmp_path, form, ending):
    """As speculation delivers them: the answer's tokens decoded 1, 2, 3 or 4 at a time."""
    tokenizer = harmony_tokenizer(tmp_path)
    plan = plan_chat(tokenizer, "<|start|>user<|message|>weather?<|end|><|start|>assistant", "auto", TOOLS)
    answer = HARMONY_REASONING + HARMONY_CALLS[form] + ending
    whole = harmony_read(plan, [answer])
    assert whole == ("Need it.", "", [("get_weather", '{"city": "Paris"}')])
    ids = tokenizer.encode(answer, add_special_tokens=False)
    for per_step in (1, 2, 3, 4):
        pieces = [tokenizer.decode(ids[i : i + per_step]) for i in range(0, len(ids), per_step)]
        assert "".join(pieces) == answer
        assert harmony_read(plan, pieces) == whole, per_step


def test_a_required_harmony_call_continues_the_message_header(tmp_path):
    tokenizer = harmony_tokenizer(tmp_path)
    prompt = "<|start|>user<|message|>weather?<|end|><|start|>assistant" + forced_call_prefix(tokenizer, "required")
    assert prompt.endswith("<|start|>assistant to=functions.")  # the header form
    plan = plan_chat(tokenizer, prompt, "required", TOOLS)
    answer = 'get_weather<|channel|>commentary json<|message|>{"city": "Paris"}'
    assert harmony_read(plan, [answer]) == ("", "", [("get_weather", '{"city": "Paris"}')])
    assert harmony_read(plan, list(answer)) == ("", "", [("get_weather", '{"city": "Paris"}')])
    # Commentary without a recipient is a preamble to the user: content.
    plan = plan_chat(tokenizer, prompt[: -len(" to=functions.")], "auto", TOOLS)
    assert harmony_read(plan, ["<|channel|>commentary<|message|>Checking.<|end|>"]) == ("", "Checking.", [])


def result(text, finish_reason="stop"):
    return GenerationResult(text, finish_reason, 5, 0, 7, None, [])


def test_response_bodies(tokenizer):
    messages = [{"role": "user", "content": "weather?"}]
    plan = plan_chat(tokenizer, "assistant: <think>", "auto", TOOLS)
    request = parse_request({"messages": messages, "tools": TOOLS}, "chat", ServerDefaults())
    body = ResponseBuilder(request, "m", lambda: plan).completion(result("hm</think>" + CALL))
    message = body["choices"][0]["message"]
    assert body["choices"][0]["finish_reason"] == "tool_calls"
    assert message["content"] is None and message["reasoning_content"] == message["reasoning"] == "hm"
    assert json.loads(message["tool_calls"][0]["function"]["arguments"]) == {"city": "Paris"}
    request.stream = True
    builder = ResponseBuilder(request, "m", lambda: plan)
    chunks = [builder.chunk(piece, []) for piece in ["h", "m</think>", CALL[:9], CALL[9:], "ok"]]
    final = builder.chunk("", [], "stop")
    assert chunks[2] is None and chunks[0]["choices"][0]["delta"] == {"reasoning_content": "h", "reasoning": "h"}
    assert chunks[3]["choices"][0]["delta"]["tool_calls"][0]["index"] == 0
    assert chunks[4]["choices"][0]["delta"] == {"content": "ok"}
    assert final["choices"][0] == {"index": 0, "finish_reason": "tool_calls", "logprobs": None, "delta": {}}
