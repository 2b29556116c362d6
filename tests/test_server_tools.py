"""Tool calling over HTTP with the `openai` client: a request with tools, the streamed
tool call, the tool's result sent back, the final answer; with speculation (prompt
lookup, a draft model) the answers are the ones plain decoding gives.

The model is an oracle: a tiny qwen3 checkpoint whose layers add nothing (their
output projections are zero), so its next token depends on the current token alone,
and whose embeddings and lm_head spell out chains of added tokens:

    <|assistant|> <think> REASON </think> <tool_call> {"name": "get_weather", ...} </tool_call> EOS
    <|answer|> It is sunny ... in Paris. EOS

Its chat template knows tools (json_tools markers) and renders tool results; it ends
the prompt with <|answer|> after a tool result, because a model that sees only the
last token cannot tell the turns apart otherwise. Real weights, real tokenizer and
template, the real server: only the weights are chosen rather than trained.
"""

import json
import shutil

import mlx.core as mx
import openai
import pytest
from mlx.utils import tree_flatten
from server_harness import start_server, stop_all
from tokenizer_fixture import write_tokenizer
from transformers import AutoTokenizer

from checkpoints import TINY_CONFIGS
from mlx_lm.utils import get_model_classes

REASON = "The user asks for the weather."
CALL_PIECES = ['{"name": "get_weather", ', '"arguments": {"city": "Paris"}}']
ANSWER_PIECES = ["It is sunny", " in Paris."]
CHAINS = [["<|assistant|>", "<think>", REASON, "</think>", "<tool_call>", *CALL_PIECES, "</tool_call>"],
          ["<|answer|>", *ANSWER_PIECES]]
TEMPLATE = (
    "{%- if tools %}<|tools|>{{ tools | tojson }}{% endif %}"
    "{%- for m in messages %}"
    "{%- if m.role == 'tool' %}<tool_response>{{ m.content }}</tool_response>"
    "{%- elif m.role == 'assistant' %}<|assistant|>{{ m.content or '' }}"
    "{%- for c in m.tool_calls or [] %}<tool_call>"
    "{{ {'name': c.function.name, 'arguments': c.function.arguments} | tojson }}</tool_call>{% endfor %}"
    "{%- else %}<|{{ m.role }}|>{{ m.content }}{% endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{ '<|answer|>' if messages[-1].role == 'tool' else '<|assistant|>' }}"
    "{%- endif %}"
)
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "The weather in a city.",
                                           "parameters": {"type": "object", "properties": {
                                               "city": {"type": "string"}}}}}]
# An earlier exchange, so that prompt lookup finds the call and the answer in the prompt.
HISTORY = [
    {"role": "user", "content": "Weather in Paris?"},
    {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_0", "type": "function",
         "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
    {"role": "tool", "tool_call_id": "call_0", "content": "sunny"},
    {"role": "assistant", "content": "".join(ANSWER_PIECES)},
    {"role": "user", "content": "And now?"},
]


def write_oracle(directory):
    """The checkpoint of the module docstring."""
    write_tokenizer(directory)
    tokenizer = AutoTokenizer.from_pretrained(directory)
    tokenizer.add_tokens(sorted({piece for chain in CHAINS for piece in chain} | {"<tool_response>", "</tool_response>",
                                                                                   "<|user|>", "<|tools|>"}))
    tokenizer.chat_template = TEMPLATE
    tokenizer.save_pretrained(directory)
    config = dict(TINY_CONFIGS["qwen3"], tie_word_embeddings=False, vocab_size=-(-len(tokenizer) // 64) * 64)
    model_class, args_class = get_model_classes(config)
    shapes = {k: v.shape for k, v in tree_flatten(model_class(args_class.from_dict(config)).parameters())}
    weights = {k: mx.ones(s) if k.endswith("norm.weight") else mx.zeros(s) for k, s in shapes.items()}
    embed, head = weights["model.embed_tokens.weight"], weights["lm_head.weight"]
    links = [(chain[i], chain[i + 1] if i + 1 < len(chain) else None) for chain in CHAINS for i in range(len(chain))]
    for dim, (token, successor) in enumerate(links):  # one embedding direction per chain token
        embed[tokenizer.convert_tokens_to_ids(token), dim] = 1.0
        next_id = config["eos_token_id"] if successor is None else tokenizer.convert_tokens_to_ids(successor)
        head[next_id, dim] = 1.0
    mx.save_safetensors(str(directory / "model.safetensors"), weights)
    (directory / "config.json").write_text(json.dumps(config))
    return directory


# Prompt lookup inside the batch, and a draft model (the oracle itself) one request at a
# time. Plain greedy decoding of the oracle gives exactly its chains, which the tests
# expect; so speculation giving them too is speculation giving what plain decoding does.
# A fixed draft length: the adaptive one follows round times, and on a loaded machine it
# may go plain for a whole answer (then nothing is accepted, and the test checks nothing).
SERVERS = {"lookup": ["--prompt-lookup", "--allow-other-models", "--fixed-draft-length"],
           "draft": ["--draft-model", "ORACLE", "--max-batch-size", "1", "--fixed-draft-length"]}


@pytest.fixture(scope="module")
def oracle(tmp_path_factory):
    return write_oracle(tmp_path_factory.mktemp("oracle"))


@pytest.fixture(scope="module")
def servers(oracle, tmp_path_factory):
    logs = tmp_path_factory.mktemp("tool_logs")
    started = {name: start_server(name, oracle, logs / f"{name}.log", None,
                                  [str(oracle) if f == "ORACLE" else f for f in flags])
               for name, flags in SERVERS.items()}
    yield {name: server.wait_ready() for name, server in started.items()}
    stop_all(started.values())


def stream_turn(client, messages, **options):
    """(content, reasoning, tool calls, finish_reason, usage) of one streamed answer,
    the calls assembled from their deltas as OpenAI clients do."""
    content, reasoning, calls, finish_reason, usage = "", "", {}, None, None
    for chunk in client.chat.completions.create(model="default_model", messages=messages, stream=True,
                                                stream_options={"include_usage": True}, **options):
        usage = chunk.usage or usage
        if not chunk.choices:
            continue
        delta = chunk.choices[0].delta
        content += delta.content or ""
        reasoning += getattr(delta, "reasoning_content", None) or ""
        for call in delta.tool_calls or []:
            entry = calls.setdefault(call.index, {"id": call.id, "name": "", "arguments": ""})
            entry["name"] += call.function.name or ""
            entry["arguments"] += call.function.arguments or ""
        finish_reason = chunk.choices[0].finish_reason or finish_reason
    return content, reasoning, [calls[i] for i in sorted(calls)], finish_reason, usage


def round_trip(server):
    """Ask, get the streamed call, send the tool's result, get the final answer."""
    client = server.client
    try:
        content, reasoning, calls, finish_reason, usage = stream_turn(client, HISTORY, tools=TOOLS)
        assert (content, reasoning, finish_reason) == ("", REASON, "tool_calls")
        assert [(c["name"], json.loads(c["arguments"])) for c in calls] == [("get_weather", {"city": "Paris"})]
        messages = HISTORY + [
            {"role": "assistant", "content": None, "tool_calls": [
                {"id": calls[0]["id"], "type": "function",
                 "function": {"name": calls[0]["name"], "arguments": calls[0]["arguments"]}}]},
            {"role": "tool", "tool_call_id": calls[0]["id"], "content": "sunny"}]
        final = client.chat.completions.create(model="default_model", messages=messages, tools=TOOLS)
    finally:
        client.close()
    return final, usage


@pytest.mark.parametrize("name", SERVERS)
def test_the_round_trip_with_speculation(servers, name):
    final, first_usage = round_trip(servers[name])
    choice = final.choices[0]
    assert (choice.message.content, choice.message.tool_calls, choice.finish_reason) == (
        "".join(ANSWER_PIECES), None, "stop")
    for usage in (first_usage, final.usage):  # several tokens a step were accepted, in both turns
        assert usage.completion_tokens_details.accepted_prediction_tokens > 0


def test_a_non_streamed_call_equals_the_streamed_one(servers):
    client = servers["lookup"].client
    try:
        response = client.chat.completions.create(model="default_model", messages=HISTORY, tools=TOOLS)
    finally:
        client.close()
    message = response.choices[0].message
    assert (message.content, message.model_extra["reasoning_content"], message.model_extra["reasoning"]) == (
        None, REASON, REASON)
    assert [(c.function.name, json.loads(c.function.arguments)) for c in message.tool_calls] == [
        ("get_weather", {"city": "Paris"})]
    assert response.choices[0].finish_reason == "tool_calls"


def test_another_models_answer_is_read_by_its_own_plan(servers, oracle, tmp_path):
    # The worker renders the prompt of a model it loads on demand (--allow-other-models).
    other = shutil.copytree(oracle, tmp_path / "other")
    client = servers["lookup"].client
    try:
        response = client.chat.completions.create(model=str(other), messages=HISTORY, tools=TOOLS)
    finally:
        client.close()
    message = response.choices[0].message
    assert (message.content, message.tool_calls[0].function.name, response.choices[0].finish_reason) == (
        None, "get_weather", "tool_calls")


def test_tool_choice(servers):
    client = servers["draft"].client
    named = {"type": "function", "function": {"name": "get_weather"}}
    try:
        # Named (and "required"): the prompt ends with <tool_call>, so the answer is the call itself.
        for choice in (named, "required"):
            content, reasoning, calls, finish_reason, _ = stream_turn(client, HISTORY, tools=TOOLS, tool_choice=choice)
            assert (content, reasoning, finish_reason, calls[0]["name"]) == ("", "", "tool_calls", "get_weather")
        # "none": the tool-call text is not parsed, so it is content.
        content, _, calls, finish_reason, _ = stream_turn(client, HISTORY, tools=TOOLS, tool_choice="none")
        assert (content, calls, finish_reason) == ("<tool_call>" + "".join(CALL_PIECES) + "</tool_call>", [], "stop")
        with pytest.raises(openai.BadRequestError, match="names the function 'get_wether'"):
            client.chat.completions.create(model="default_model", messages=HISTORY, tools=TOOLS,
                                           tool_choice={"type": "function", "function": {"name": "get_wether"}})
    finally:
        client.close()


def test_a_call_cut_off_by_max_tokens_is_content(servers):
    client = servers["lookup"].client
    try:
        content, reasoning, calls, finish_reason, _ = stream_turn(client, HISTORY, tools=TOOLS, max_tokens=5)
    finally:
        client.close()
    assert (content, reasoning, calls, finish_reason) == ("<tool_call>" + CALL_PIECES[0], REASON, [], "length")
