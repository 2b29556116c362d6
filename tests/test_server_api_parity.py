"""Upstream mlx-lm 0.32.2's server names that this server's own path does not use
(server_upstream.py: Vision, TimeBudget, APIHandler.generate_response and
completion_usage_response), pythonic.ToolCall, and upstream's server flags
(--decode-concurrency, --prompt-concurrency, --pipeline, --adapter-path,
--trust-remote-code, --use-default-chat-template, --kv-bits and its two companions:
answers equal stream_generate's with them, also resumed from the prompt cache), on the
command line and in an embedding namespace."""

import argparse
import json
import shutil

import mlx.core as mx
import pytest

from checkpoints import TINY_CONFIGS, write_checkpoint
from server_harness import start_server

from mlx_lm import distributed, server_upstream, tokenizer_utils
from mlx_lm.generate import stream_generate
from mlx_lm.openai_api import RequestError, ServerDefaults, parse_request
from mlx_lm.server import APIHandler, TimeBudget, Vision, main, make_provider, setup_arg_parser
from mlx_lm.server import ModelProvider as EmbeddedProvider
from mlx_lm.server_embedding import EmbeddingSettings, LRUPromptCache, ResponseGenerator
from mlx_lm.serving import BatchWorker, GenerationWorker, Job, ModelProvider
from mlx_lm.tool_parsers.pythonic import ToolCall, parse_tool_call
from mlx_lm.utils import load
from test_adapters import TOKENS, base_weights, relative_error, write_adapters


def test_vision_refuses_images_as_a_request_with_an_image_does():
    with pytest.raises(ValueError, match="loads no vision models"):
        Vision(pixel_values=[mx.zeros((2, 2, 3))], starts=[0], cache_key=[-5])
    image = {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}
    body = {"messages": [{"role": "user", "content": [{"type": "text", "text": "what is it?"}, image]}]}
    with pytest.raises(RequestError) as refused:
        parse_request(body, "chat", ServerDefaults())
    assert refused.value.status == 400
    assert refused.value.message.startswith("'messages[0].content[]': an image part: this project loads no vision")


class Clock:
    """A fake perf_counter that the loop body advances."""

    def __init__(self):
        self.now = 0.0

    def __call__(self):
        return self.now


def test_time_budget_alone_stops_when_the_budget_is_spent(monkeypatch):
    clock = Clock()
    monkeypatch.setattr(server_upstream.time, "perf_counter", clock)
    steps = 0
    for _ in TimeBudget(budget=0.5):
        steps += 1
        clock.now += 0.125  # exact in binary: 0.5 itself is still inside the budget
    assert steps == 5
    for _ in TimeBudget(budget=0.5):  # a new slice starts its own clock
        clock.now += 1.0
        steps += 1
    assert steps == 6


class TwoRanks:
    def size(self):
        return 2


def test_time_budget_under_mlx_launch_counts_steps_and_refits_them(monkeypatch):
    clock = Clock()
    monkeypatch.setattr(server_upstream.time, "perf_counter", clock)
    monkeypatch.setattr(server_upstream.distributed, "world", TwoRanks)
    summed = []

    def all_sum(x, group):
        summed.append(x.item())
        return x * 2  # the other rank took as long

    monkeypatch.setattr(server_upstream.mx.distributed, "all_sum", all_sum)
    budget = TimeBudget(budget=0.5, iterations=4, sync_frequency=2)
    counts = []
    for _ in range(3):
        counts.append(0)
        for _ in budget:
            counts[-1] += 1
            clock.now += 0.25
    # Two slices of 4 steps took 1 s each, twice the budget: the next slice is 2 steps.
    assert counts == [4, 4, 2] and summed == [2.0] and budget.iterations == 2


@pytest.mark.parametrize("kwargs, message", [
    ({"budget": 0}, "budget must be > 0 seconds, got 0"),
    ({"iterations": 0}, "iterations must be a positive integer, got 0"),
    ({"sync_frequency": 1.5}, "sync_frequency must be a positive integer, got 1.5"),
])
def test_time_budget_refuses_bad_settings(kwargs, message):
    with pytest.raises(ValueError, match=message):
        TimeBudget(**kwargs)


def handler(object_type, stream):
    """An APIHandler after handle_*_completions set a request's attributes."""
    h = APIHandler.__new__(APIHandler)
    h.request_id, h.system_fingerprint, h.created = "chatcmpl-1", "fp", 1700000000
    h.object_type, h.requested_model, h.stream = object_type, "default_model", stream
    return h


HEADER = {"id": "chatcmpl-1", "system_fingerprint": "fp", "model": "default_model", "created": 1700000000}


def test_generate_response_builds_a_complete_chat_message():
    call = {"function": {"name": "f", "arguments": "{}"}, "type": "function", "id": "c1"}
    packet = handler("chat.completion", False).generate_response(
        "hi", "stop", prompt_token_count=7, completion_token_count=2, prompt_cache_count=3,
        token_logprobs=[-0.5, -0.25], tokens=[11, 12], tool_calls=[call], reasoning_text="thought")
    assert packet == {**HEADER, "object": "chat.completion", "choices": [{
        "index": 0, "finish_reason": "stop",
        "logprobs": {"content": [{"id": 11, "logprob": -0.5}, {"id": 12, "logprob": -0.25}]},
        "message": {"role": "assistant", "content": "hi", "reasoning": "thought", "tool_calls": [call]}}],
        "usage": {"prompt_tokens": 7, "completion_tokens": 2, "total_tokens": 9,
                  "prompt_tokens_details": {"cached_tokens": 3}}}


def test_generate_response_streams_deltas_without_usage():
    h = handler("chat.completion.chunk", True)
    top = ({"id": 5, "token": "a", "logprob": -0.1}, {"id": 6, "token": "b", "logprob": -2.0})
    chunk = h.generate_response("a", None, top_tokens=[top])
    assert chunk["object"] == "chat.completion.chunk" and "usage" not in chunk
    assert chunk["choices"][0]["delta"] == {"role": "assistant", "content": "a"}
    assert chunk["choices"][0]["logprobs"] == {"content": [{**top[0], "top_logprobs": top}]}
    # An empty delta has no content field; an empty complete message has content None.
    assert h.generate_response("", "length")["choices"][0]["delta"] == {"role": "assistant"}
    complete = handler("chat.completion", False).generate_response("", "length", 1, 0, prompt_cache_count=-1)
    assert complete["choices"][0]["message"] == {"role": "assistant", "content": None}
    assert "prompt_tokens_details" not in complete["usage"]  # -1: unknown


def test_generate_response_of_a_text_completion_and_its_errors():
    packet = handler("text_completion", False).generate_response("abc", "stop", 3, 1)
    assert packet["choices"] == [{"index": 0, "finish_reason": "stop", "text": "abc"}]
    with pytest.raises(ValueError, match="needs prompt_token_count and completion_token_count, got None, None"):
        handler("text_completion", False).generate_response("abc", "stop")
    with pytest.raises(ValueError, match="token_logprobs \\(2\\) need as many tokens, got None"):
        handler("text_completion", True).generate_response("abc", None, token_logprobs=[-1.0, -2.0])
    with pytest.raises(ValueError, match="unsupported response object 'embedding'"):
        handler("embedding", True).generate_response("abc", None)


def test_completion_usage_response():
    packet = handler("chat.completion.chunk", True).completion_usage_response(5, 4, 2)
    assert packet == {**HEADER, "object": "chat.completion", "choices": [],
                      "usage": {"prompt_tokens": 5, "completion_tokens": 4, "total_tokens": 9,
                                "prompt_tokens_details": {"cached_tokens": 2}}}


def test_pythonic_tool_call_type():
    call = parse_tool_call('[get_weather(city="Paris")]')
    assert ToolCall.__origin__ is dict and isinstance(call, dict)
    assert call["name"] == "get_weather" and call["arguments"] == {"city": "Paris"}


def test_upstream_concurrency_flags():
    args = setup_arg_parser().parse_args(["--model", "m", "--decode-concurrency", "3", "--prompt-concurrency", "2"])
    assert (args.max_batch_size, args.prompt_concurrency, args.pipeline) == (3, 2, False)
    assert setup_arg_parser().parse_args(["--model", "m"]).prompt_concurrency == 8


def test_pipeline_flag_is_taken():  # what it does under mlx.launch: tests/test_pipeline.py
    assert setup_arg_parser().parse_args(["--model", "m", "--pipeline"]).pipeline is True


def test_prompt_concurrency_sizes_the_batch_prefill(tiny_model_dir):
    provider = ModelProvider(str(tiny_model_dir), None, False, 10, 1 << 40, None)
    assert BatchWorker(provider, max_batch_size=4, prefill_batch_size=2).generator.prefill_batch_size == 2
    assert BatchWorker(provider).generator.prefill_batch_size == 8


def test_embedding_reads_prompt_concurrency_and_refuses_pipeline():
    namespace = argparse.Namespace(model="m", prompt_concurrency=3)
    assert EmbeddingSettings.from_cli_args(namespace).prefill_batch_size == 3
    with pytest.raises(ValueError, match="pipeline=True is not supported: pipeline-parallel loading"):
        EmbeddingSettings.from_cli_args(argparse.Namespace(model="m", pipeline=True))


def served_by_flags(*flags):
    """The served model that `mlx_lm.server --model ... <flags>` loads (no HTTP)."""
    return make_provider(setup_arg_parser().parse_args(list(flags)), distributed.world()).default


def test_adapter_path_serves_the_adapted_model_also_embedded(tiny_llama_dir, tmp_path):
    adapters, _ = write_adapters(tmp_path / "adapters", base_weights(tiny_llama_dir))
    adapted = load(str(tiny_llama_dir), adapter_path=str(adapters))[0](TOKENS)
    served = served_by_flags("--model", str(tiny_llama_dir), "--adapter-path", str(adapters))
    assert relative_error(served.model(TOKENS), adapted) < 1e-6
    assert relative_error(served_by_flags("--model", str(tiny_llama_dir)).model(TOKENS), adapted) > 1e-2
    provider = EmbeddedProvider(argparse.Namespace(model=str(tiny_llama_dir), adapter_path=str(adapters)))
    provider.serve(LRUPromptCache(0))
    assert relative_error(provider.model(TOKENS), adapted) < 1e-6
    assert provider.model_key == (str(tiny_llama_dir), str(adapters), None)
    assert provider.load("default_model", str(adapters))[0] is provider.model
    with pytest.raises(ValueError, match="adapter_path='other': this provider serves its model with the adapters"):
        provider.load("default_model", "other")


def test_trust_remote_code_reaches_the_tokenizer_also_embedded(tiny_model_dir, monkeypatch):
    asked = []
    real_load = tokenizer_utils.load
    monkeypatch.setattr(tokenizer_utils, "load",
                        lambda path, extra=None, **kw: asked.append(dict(extra or {})) or real_load(path, extra, **kw))
    served_by_flags("--model", str(tiny_model_dir), "--trust-remote-code")
    served_by_flags("--model", str(tiny_model_dir))
    EmbeddedProvider(argparse.Namespace(model=str(tiny_model_dir), trust_remote_code=True)).serve(LRUPromptCache(0))
    assert [options.get("trust_remote_code") for options in asked] == [True, None, True]


def test_use_default_chat_template_renders_chatml_without_a_template(tiny_model_dir, tmp_path):
    bare = shutil.copytree(tiny_model_dir, tmp_path / "bare")
    config = json.loads((bare / "tokenizer_config.json").read_text())
    config["chat_template"] = None
    (bare / "tokenizer_config.json").write_text(json.dumps(config))
    request = parse_request({"messages": [{"role": "user", "content": "hi"}]}, "chat", ServerDefaults())
    with pytest.raises(RequestError, match="has no chat template"):
        served_by_flags("--model", str(bare)).encode(request)
    served = served_by_flags("--model", str(bare), "--use-default-chat-template")
    chatml = "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    assert served.encode(request) == served.tokenizer.encode(chatml, add_special_tokens=False)
    own = "{% for m in messages %}[{{ m['content'] }}]{% endfor %}"
    served = served_by_flags("--model", str(bare), "--use-default-chat-template", "--chat-template", own)
    assert served.encode(request) == served.tokenizer.encode("[hi]", add_special_tokens=False)
    provider = EmbeddedProvider(argparse.Namespace(model=str(bare), use_default_chat_template=True))
    provider.serve(LRUPromptCache(0))
    assert provider.models.default.encode(request) == served.tokenizer.encode(chatml, add_special_tokens=False)


# ---------------------------------------------------------------------------
# KV cache quantization: --kv-bits, --kv-group-size, --quantized-kv-start.

# head_dim 64: the default group size (64) divides it.
KV_CONFIGS = {"dense": dict(TINY_CONFIGS["qwen3"], head_dim=64),
              "hybrid": dict(TINY_CONFIGS["qwen3_next"], head_dim=64)}
KV = dict(kv_bits=8, kv_group_size=64, quantized_kv_start=0)


@pytest.fixture(scope="module")
def kv_model_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("kv_models")
    dirs = {name: write_checkpoint(root / name, config) for name, config in KV_CONFIGS.items()}
    dirs["draft"] = write_checkpoint(root / "draft", KV_CONFIGS["dense"], scale=0.45)
    return dirs


def test_kv_flags_take_upstreams_defaults():
    args = setup_arg_parser().parse_args(["--model", "m"])
    assert (args.kv_bits, args.kv_group_size, args.quantized_kv_start) == (None, 64, 5000)
    args = setup_arg_parser().parse_args(["--model", "m", "--kv-bits", "4", "--kv-group-size", "32",
                                          "--quantized-kv-start", "0"])
    assert (args.kv_bits, args.kv_group_size, args.quantized_kv_start) == (4, 32, 0)
    settings = EmbeddingSettings.from_cli_args(argparse.Namespace(model="m", kv_bits=4))
    assert settings.kv_options == dict(kv_bits=4, kv_group_size=64, quantized_kv_start=5000)


@pytest.mark.parametrize("flags, message", [
    (["--kv-bits", "7"], "got kv_bits=7"),
    (["--kv-bits", "4", "--kv-group-size", "48"], "got kv_group_size=48"),
    (["--kv-bits", "4", "--quantized-kv-start", "-1"], "quantized_kv_start must be >= 0, got -1"),
])
def test_bad_kv_settings_are_usage_errors(flags, message, capsys):
    with pytest.raises(SystemExit) as exited:
        main(["--model", "m", *flags])
    assert exited.value.code == 2
    assert message in capsys.readouterr().err
    namespace = {"--kv-bits": "kv_bits", "--kv-group-size": "kv_group_size", "--quantized-kv-start": "quantized_kv_start"}
    options = {namespace[flag]: int(value) for flag, value in zip(flags[::2], flags[1::2])}
    with pytest.raises(ValueError, match=message):
        EmbeddingSettings.from_cli_args(argparse.Namespace(model="m", **options))


def test_kv_bits_on_a_model_with_sliding_windows_fails_at_startup_or_per_request(kv_model_dirs, tmp_path):
    gpt_oss = write_checkpoint(tmp_path / "gpt_oss", dict(TINY_CONFIGS["gpt_oss"], head_dim=64))
    with pytest.raises(ValueError, match="RotatingKVCache"):
        GenerationWorker(ModelProvider(str(gpt_oss), None, False, 10, 1 << 40, None), **KV)
    # Another model a request names (--allow-other-models) is checked when it is loaded.
    provider = ModelProvider(str(kv_model_dirs["dense"]), None, True, 10, 1 << 40, None)
    job = provider.make_job(parse_request({"prompt": "x", "model": str(gpt_oss)}, "text", ServerDefaults()))
    GenerationWorker(provider, **KV).run(job)
    kind, status, message = job.events.get()
    assert (kind, status) == ("error", 400)
    assert message.startswith(f"{gpt_oss} cannot be served with this server's KV quantization (--kv-bits 8): ")
    assert "RotatingKVCache" in message


def cold(model_dir, prompt, draft_dir=None, max_tokens=8, **options):
    """stream_generate's greedy (tokens, logprob of each) for `prompt`, from a fresh
    cache, up to an EOS (which answers leave out)."""
    model, tokenizer = load(str(model_dir))
    draft = None if draft_dir is None else load(str(draft_dir))[0]
    responses = [r for r in stream_generate(model, tokenizer, mx.array(prompt), max_tokens, draft_model=draft,
                                            **options) if r.finish_reason != "stop"]
    return [r.token for r in responses], [r.logprobs[r.token].item() for r in responses]


def test_a_server_with_kv_bits_answers_as_stream_generate_does(kv_model_dirs, tmp_path):
    prompt = list(range(40, 61))
    server = start_server("kv", kv_model_dirs["dense"], tmp_path / "kv.log",
                          flags=["--kv-bits", "8", "--quantized-kv-start", "0"]).wait_ready()
    try:
        answer = server.client.completions.create(model="default_model", prompt=prompt, max_tokens=8,
                                                  temperature=0, logprobs=1)
    finally:
        server.process.terminate()
        server.process.wait(timeout=30)
    assert "--kv-bits: batching is off, requests are served one at a time" in server.log()
    tokens, logprobs = cold(kv_model_dirs["dense"], prompt, **KV)
    tokenizer = load(str(kv_model_dirs["dense"]))[1]
    assert answer.choices[0].text == tokenizer.decode(tokens)
    # To float tolerance: the server process may compute on another BLAS (fast_blas.py).
    assert answer.choices[0].logprobs.token_logprobs == pytest.approx(logprobs, abs=1e-5)
    assert cold(kv_model_dirs["dense"], prompt)[1] != pytest.approx(logprobs, abs=1e-3)  # the quantization shows


def completion(worker, prompt):
    request = parse_request({"prompt": prompt, "max_tokens": 8, "logprobs": 1}, "text", ServerDefaults())
    job = Job(request, None, list(prompt))
    worker.run(job)
    kind, result = job.events.get()
    assert kind == "done", result
    return result


@pytest.mark.parametrize("target, draft", [("dense", None), ("hybrid", None), ("dense", "draft"), ("hybrid", "draft")])
def test_kv_bits_prompt_cache_reuse_answers_as_a_cold_run(kv_model_dirs, target, draft):
    """A second prompt sharing 8 tokens (two chunks of 4) resumes from the quantized
    cache the first one left, and answers, logprobs included, as a cold run does."""
    step = 4
    provider = ModelProvider(str(kv_model_dirs[target]), draft and str(kv_model_dirs[draft]), False, 10, 1 << 40,
                             None)
    worker = GenerationWorker(provider, step, **KV)
    first, second = list(range(40, 53)), list(range(40, 48)) + list(range(90, 97))
    for prompt, num_cached in [(first, 0), (second, 8)]:
        result = completion(worker, prompt)
        assert result.cached_tokens == num_cached
        tokens, logprobs = cold(kv_model_dirs[target], prompt, draft and kv_model_dirs[draft],
                                prefill_step_size=step, **KV)
        assert (result.text, [entry.logprob for entry in result.logprobs]) == (
            provider.default.tokenizer.decode(tokens), logprobs)
    stored = provider.default.prompt_cache.fetch(second + [1]).prompt_cache
    kinds = {type(entry).__name__ for entry in stored}
    assert "QuantizedKVCache" in kinds and "KVCache" not in kinds


def test_an_embedded_server_honours_kv_bits(kv_model_dirs):
    provider = EmbeddedProvider(argparse.Namespace(model=str(kv_model_dirs["dense"]), kv_bits=8,
                                                   quantized_kv_start=0, decode_concurrency=4))
    assert not provider.is_batchable
    generator = ResponseGenerator(provider, LRUPromptCache(10))
    try:
        assert type(generator.worker) is GenerationWorker
        prompt = list(range(40, 61))
        job = Job(parse_request({"prompt": prompt, "max_tokens": 8, "logprobs": 1}, "text", ServerDefaults()),
                  None, prompt)
        generator.worker.submit(job)
        kind, result = job.events.get(timeout=60)
    finally:
        generator.stop_and_join()
    assert kind == "done", result
    tokens, logprobs = cold(kv_model_dirs["dense"], prompt, **KV)
    assert [entry.logprob for entry in result.logprobs] == logprobs
