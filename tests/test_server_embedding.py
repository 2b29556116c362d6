"""server_embedding.py: the server embedded as upstream mlx-lm 0.32.2's users do, a
stock `http.server` server whose handler is `APIHandler(response_generator, ...)`,
on tiny checkpoints. Answers must equal plain in-process generation (the draft makes
the worker speculate), and the hardening limits must hold through the adapters."""

import argparse
import http.client
import json
import shutil
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from http.server import HTTPServer, ThreadingHTTPServer

import openai
import pytest
from checkpoints import TINY_CONFIGS, write_checkpoint
from test_server import reference as plain_reference

from mlx_lm.openai_api import MAX_BODY_BYTES
from mlx_lm.server import APIHandler, LRUPromptCache, ModelProvider, ResponseGenerator, SamplingArguments, run
from mlx_lm.server import get_system_fingerprint
from mlx_lm.server import ToolCallFormatter  # noqa: F401  (upstream's import list, all of it)
from mlx_lm.utils import load

MAX_TOKENS = 10
MESSAGES = [{"role": "user", "content": "Tell me about caches."}]


def upstream_cli_args(**overrides):
    """What upstream 0.32.2's `mlx_lm.server` parser returns for its defaults."""
    args = dict(model=None, adapter_path=None, host="127.0.0.1", port=8080, allowed_origins="*", draft_model=None,
                num_draft_tokens=3, trust_remote_code=False, log_level="INFO", chat_template="",
                use_default_chat_template=False, temp=0.0, top_p=1.0, top_k=0, min_p=0.0, max_tokens=MAX_TOKENS,
                chat_template_args={}, decode_concurrency=32, prompt_concurrency=8, prefill_step_size=2048,
                prompt_cache_size=10, prompt_cache_bytes=None, kv_bits=None, kv_group_size=64,
                quantized_kv_start=5000, pipeline=False)
    return argparse.Namespace(**{**args, **overrides})


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("embedding_models")
    return {"dense": write_checkpoint(root / "dense", TINY_CONFIGS["qwen3"]),
            # The same weights shrunk: agrees with "dense" on about half the tokens.
            "draft": write_checkpoint(root / "draft", TINY_CONFIGS["qwen3"], scale=0.45)}


def serve(response_generator, server_class, handler_class=APIHandler, **handler_kwargs):
    """Upstream's embedding, line for line: a stock server on a free port, in a thread."""
    httpd = server_class(("localhost", 0), lambda *args, **kwargs: handler_class(response_generator, *args,
                                                                                 **handler_kwargs, **kwargs))
    httpd.response_generator = response_generator  # for the tests' own use
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    return httpd, thread


@pytest.fixture(scope="module")
def embedded(model_dirs):
    """A stock single-threaded HTTPServer, the model speculating with a draft."""
    args = upstream_cli_args(model=str(model_dirs["dense"]), draft_model=str(model_dirs["draft"]))
    response_generator = ResponseGenerator(ModelProvider(args), LRUPromptCache(args.prompt_cache_size))
    httpd, thread = serve(response_generator, HTTPServer)
    yield httpd
    httpd.shutdown()
    httpd.server_close()
    thread.join()
    response_generator.stop_and_join()


def client(httpd):
    return openai.OpenAI(base_url=f"http://localhost:{httpd.server_port}/v1", api_key="unused", max_retries=0,
                         timeout=60)


def raw(httpd, body, headers=None):
    """(status, decoded JSON) of a POST to /v1/chat/completions sent as is."""
    connection = http.client.HTTPConnection("localhost", httpd.server_port, timeout=60)
    connection.request("POST", "/v1/chat/completions", body=body, headers=headers or {})
    response = connection.getresponse()
    data = response.read()
    connection.close()
    return response.status, json.loads(data)


def reference(model_dir, messages=None, prompt=None):
    """Plain greedy generation in this process, from an empty cache."""
    return plain_reference(model_dir, messages, prompt, max_tokens=MAX_TOKENS)


def test_chat_and_text_equal_plain_generation_streamed_or_not(embedded, model_dirs):
    openai_client = client(embedded)
    expected_chat = reference(model_dirs["dense"], messages=MESSAGES)
    whole = openai_client.chat.completions.create(model="default_model", messages=MESSAGES, temperature=0)
    assert whole.choices[0].message.content == expected_chat
    assert whole.usage.model_extra["speculation"]["num_drafted"] > 0  # the draft ran
    assert whole.system_fingerprint == get_system_fingerprint()
    chunks = openai_client.chat.completions.create(model="default_model", messages=MESSAGES, temperature=0,
                                                   stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == expected_chat

    prompt = "Once upon a time there was"
    expected_text = reference(model_dirs["dense"], prompt=prompt)
    text = openai_client.completions.create(model="default_model", prompt=prompt, temperature=0)
    assert text.choices[0].text == expected_text
    streamed = openai_client.completions.create(model="default_model", prompt=prompt, temperature=0, stream=True)
    assert "".join(c.choices[0].text for c in streamed) == expected_text


def test_malformed_and_oversized_requests_are_refused_and_the_server_goes_on(embedded, model_dirs):
    status, body = raw(embedded, b'{"messages": [', {"Content-Type": "application/json"})
    assert status == 400 and "not valid JSON" in body["error"]["message"]
    status, body = raw(embedded, json.dumps({"messages": "hi"}))
    assert status == 400
    status, body = raw(embedded, b"", {"Content-Length": str(MAX_BODY_BYTES + 1)})
    assert status == 413
    status, body = raw(embedded, json.dumps({"messages": MESSAGES, "temperature": 0}))
    assert status == 200 and body["choices"][0]["message"]["content"] == reference(model_dirs["dense"], MESSAGES)


def test_threading_server_batches_concurrent_requests_within_deadlines(model_dirs):
    # request_timeout: this project's own option, read from the same namespace.
    args = upstream_cli_args(model=str(model_dirs["dense"]), decode_concurrency=4, request_timeout=1.0)
    provider = ModelProvider(args)
    response_generator = ResponseGenerator(provider, LRUPromptCache())
    assert provider.is_batchable and provider.model_key == (str(model_dirs["dense"]), None, None)
    httpd, thread = serve(response_generator, ThreadingHTTPServer, system_fingerprint="fp-embedded")
    try:
        questions = [[{"role": "user", "content": f"Question {i}?"}] for i in range(3)]
        with ThreadPoolExecutor(3) as pool:
            answers = list(pool.map(lambda m: client(httpd).chat.completions.create(
                model="default_model", messages=m, temperature=0), questions))
        assert [a.choices[0].message.content for a in answers] == [
            reference(model_dirs["dense"], messages=m) for m in questions]
        assert {a.system_fingerprint for a in answers} == {"fp-embedded"}
        with socket.create_connection(("localhost", httpd.server_port)) as slow:
            slow.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n")  # and no more
            slow.settimeout(10)
            assert slow.recv(4096).startswith(b"HTTP/1.0 408")
        assert response_generator.prompt_cache.nbytes > 0  # the cache given is the one used
    finally:
        httpd.shutdown()
        httpd.server_close()
        thread.join()
        response_generator.stop_and_join()
    assert not response_generator.generation_available()


def test_run_serves_until_the_server_shuts_down(model_dirs):
    started = []

    class RecordingServer(ThreadingHTTPServer):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            started.append(self)

    provider = ModelProvider(upstream_cli_args(model=str(model_dirs["dense"])))
    thread = threading.Thread(target=run, args=("localhost", 0, provider, RecordingServer), daemon=True)
    thread.start()
    deadline = time.monotonic() + 60
    while not started and thread.is_alive() and time.monotonic() < deadline:
        time.sleep(0.05)
    httpd = started[0]
    prompt = "Once upon a time there was"
    text = client(httpd).completions.create(model="default_model", prompt=prompt, temperature=0)
    assert text.choices[0].text == reference(model_dirs["dense"], prompt=prompt)
    httpd.shutdown()
    thread.join(timeout=30)
    assert not thread.is_alive()


@pytest.mark.parametrize("option, value, message", [
    ("kv_bits", 7, "got kv_bits=7"), ("pipeline", True, "pipeline-parallel"), ("model", None, "must name the model"),
    ("decode_concurrency", 0, "positive integer"), ("allowed_origins", 5, "allowed_origins"),
    ("temp", -1.0, "temperature"), ("top_p", 2.0, "top_p"),
])
def test_options_it_cannot_honour_are_refused_before_loading(option, value, message):
    with pytest.raises(ValueError, match=message):
        ModelProvider(upstream_cli_args(**{"model": "never-loaded", option: value}))


def test_a_provider_of_another_kind_is_refused():
    with pytest.raises(TypeError, match="ModelProvider"):
        ResponseGenerator(object(), LRUPromptCache())


def test_sampling_arguments_make_upstreams_sampler(model_dirs):
    import mlx.core as mx

    tokenizer = load(str(model_dirs["dense"]))[1]
    sampling = SamplingArguments(temperature=0.0, top_p=1.0, top_k=0, min_p=0.0, xtc_probability=0.0,
                                 xtc_threshold=0.1)
    logprobs = mx.log(mx.array([[0.1, 0.6, 0.3]]))
    assert sampling.make_sampler(tokenizer)(logprobs).item() == 1


# ---------------------------------------------------------------------------
# Upstream's handler hooks: a subclass's override is called and what it returns is served.


@pytest.fixture
def hooked(embedded):
    """serve_with(handler_class): a stock HTTPServer on the embedded fixture's
    ResponseGenerator (speculating with a draft), with that APIHandler subclass."""
    servers = []

    def serve_with(handler_class):
        httpd, thread = serve(embedded.response_generator, HTTPServer, handler_class=handler_class)
        servers.append((httpd, thread))
        return httpd

    yield serve_with
    for httpd, thread in servers:
        httpd.shutdown()
        httpd.server_close()
        thread.join()


def test_a_chat_hook_changes_what_is_generated(hooked, model_dirs):
    calls = []

    class PirateHandler(APIHandler):
        def handle_chat_completions(self):
            request = super().handle_chat_completions()
            calls.append((self.temperature, self.max_tokens, self.stream, request.messages[-1]["content"]))
            request.messages.insert(0, {"role": "system", "content": "Speak like a pirate."})
            self.request_id = "chatcmpl-pirate"  # upstream's hooks name the answer
            return request

    httpd = hooked(PirateHandler)
    messages = [{"role": "user", "content": [{"type": "text", "text": "Tell me "}, {"type": "text", "text": "more."}]}]
    answer = client(httpd).chat.completions.create(model="default_model", messages=messages, temperature=0,
                                                   max_tokens=MAX_TOKENS)
    # The hook saw upstream's attributes and the checked messages (content parts joined).
    assert calls == [(0.0, MAX_TOKENS, False, "Tell me more.")]
    expected = reference(model_dirs["dense"], messages=[{"role": "system", "content": "Speak like a pirate."},
                                                        {"role": "user", "content": "Tell me more."}])
    assert answer.choices[0].message.content == expected != reference(model_dirs["dense"],
                                                                      [{"role": "user", "content": "Tell me more."}])
    assert answer.id == "chatcmpl-pirate"
    # (That the worker speculates through these hooks: the first test. Here the adaptive
    # policy, having measured the earlier requests, may rightly draft nothing.)
    assert "speculation" in answer.usage.model_extra


def test_text_and_completion_hooks_wrap_the_worker(hooked, model_dirs):
    stops = []

    class PrefixHandler(APIHandler):
        def handle_text_completions(self):
            request = super().handle_text_completions()
            request.prompt = "Once upon a time " + request.prompt
            return request

        def handle_completion(self, request, stop_words):
            stops.append((request.prompt, stop_words))
            super().handle_completion(request, stop_words + ["zzz-never"])

    httpd = hooked(PrefixHandler)
    streamed = client(httpd).completions.create(model="default_model", prompt="there was", temperature=0,
                                                stream=True, stop=["qqq-never"], max_tokens=MAX_TOKENS)
    assert "".join(c.choices[0].text for c in streamed) == reference(model_dirs["dense"],
                                                                     prompt="Once upon a time there was")
    assert stops == [("Once upon a time there was", ["qqq-never"])]


def test_a_validation_hook_refuses_with_its_message_and_the_server_goes_on(hooked):
    class CappedHandler(APIHandler):
        def validate_model_parameters(self):
            super().validate_model_parameters()
            if self.max_tokens > 4:
                raise ValueError(f"max_tokens must be at most 4 here, got {self.max_tokens}")

    httpd = hooked(CappedHandler)
    status, body = raw(httpd, json.dumps({"messages": MESSAGES, "max_tokens": 5}))
    assert status == 400 and body["error"]["message"] == "max_tokens must be at most 4 here, got 5"
    status, body = raw(httpd, json.dumps({"messages": MESSAGES, "max_tokens": 4, "temperature": 0}))
    assert status == 200 and body["usage"]["completion_tokens"] == 4


def test_a_hook_that_changes_request_attributes_changes_the_generation(hooked, model_dirs):
    class ClampingHandler(APIHandler):
        def validate_model_parameters(self):  # upstream's handle_completion generates with these
            self.max_tokens, self.temperature = min(self.max_tokens, 3), 0.0

    httpd = hooked(ClampingHandler)
    status, body = raw(httpd, json.dumps({"messages": MESSAGES, "max_completion_tokens": 9, "temperature": 1.5}))
    assert status == 200 and body["usage"]["completion_tokens"] == 3
    assert body["choices"][0]["message"]["content"] == plain_reference(model_dirs["dense"], MESSAGES, max_tokens=3)
    # Overriding the hook without super() leaves this project's own checks in force.
    status, body = raw(httpd, json.dumps({"messages": MESSAGES, "max_tokens": 0}))
    assert status == 400 and "max_tokens" in body["error"]["message"]
    # The project's own checks come first.
    status, body = raw(httpd, json.dumps({"messages": MESSAGES, "temperature": "hot"}))
    assert status == 400 and "temperature" in body["error"]["message"]


def test_get_hooks_answer_health_and_models(hooked):
    class CatalogueHandler(APIHandler):  # written as upstream's own handlers write answers
        def handle_models_request(self):
            self._set_completion_headers(200)
            self.end_headers()
            self.wfile.write(json.dumps({"object": "list", "data": [{"id": "catalogue", "object": "model"}]}).encode())

        def handle_health_check(self):
            self._set_completion_headers(200)
            self.end_headers()
            self.wfile.write(json.dumps({"status": "ok", "generation": self.response_generator.is_healthy}).encode())
            self.wfile.flush()

    httpd = hooked(CatalogueHandler)
    assert [m.id for m in client(httpd).models.list()] == ["catalogue"]
    connection = http.client.HTTPConnection("localhost", httpd.server_port, timeout=60)
    connection.request("GET", "/health")
    assert json.loads(connection.getresponse().read()) == {"status": "ok", "generation": True}
    connection.close()


def test_the_default_get_hooks(embedded, model_dirs):
    assert [m.id for m in client(embedded).models.list()] == ["dense"]
    connection = http.client.HTTPConnection("localhost", embedded.server_port, timeout=60)
    connection.request("GET", "/v1/models/elsewhere")
    response = connection.getresponse()
    assert response.status == 404 and "no such model" in json.loads(response.read())["error"]["message"]
    connection.close()


def test_a_model_without_a_chat_template_gets_upstreams_convert_chat(model_dirs, tmp_path):
    plain = tmp_path / "no_template"
    shutil.copytree(model_dirs["dense"], plain)
    config = json.loads((plain / "tokenizer_config.json").read_text())
    del config["chat_template"]
    (plain / "tokenizer_config.json").write_text(json.dumps(config))
    args = upstream_cli_args(model=str(plain), decode_concurrency=1)
    response_generator = ResponseGenerator(ModelProvider(args), LRUPromptCache())
    assert not response_generator.models.default.tokenizer.has_chat_template
    httpd, thread = serve(response_generator, HTTPServer)
    try:
        mapping = {"user": "Q: ", "assistant": "A: ", "stop": "\n"}
        status, body = raw(httpd, json.dumps({"messages": MESSAGES, "role_mapping": mapping, "temperature": 0}))
        assert status == 200 and body["object"] == "chat.completion"
        expected = reference(plain, prompt="Q: Tell me about caches.\nA:")  # convert_chat strips the last space
        assert body["choices"][0]["message"]["content"] == expected
        status, body = raw(httpd, json.dumps({"messages": MESSAGES, "role_mapping": {"user": 3}}))
        assert status == 400 and "role_mapping" in body["error"]["message"]
    finally:
        httpd.shutdown()
        httpd.server_close()
        thread.join()
        response_generator.stop_and_join()


def test_a_hook_returning_something_else_is_a_500_naming_it(hooked):
    class WrongHandler(APIHandler):
        def handle_chat_completions(self):
            return {"messages": MESSAGES}

    status, body = raw(hooked(WrongHandler), json.dumps({"messages": MESSAGES}))
    assert status == 500 and "expected a CompletionRequest" in body["error"]["message"]
    assert "{'messages'" in body["error"]["message"]


# Upstream 0.32.2's public functions and methods in mlx_lm/server.py with their parameters
# (read from its source), but what this project leaves out on purpose: Vision (image
# inputs), TimeBudget (its generation loop's), APIHandler.generate_response and
# completion_usage_response (answers are openai_api.ResponseBuilder's). APIHandler's
# __init__ takes (response_generator, request, client_address, server) as *args.
UPSTREAM_SIGNATURES = {
    "get_system_fingerprint": [], "convert_chat": ["messages", "role_mapping"],
    "process_message_content": ["messages", "keep_images"], "run": ["host", "port", "model_provider",
                                                                   "server_class", "handler_class"],
    "ToolCallFormatter.__init__": ["self", "tool_parser", "tools", "streaming"],
    "GenerationContext.stop": ["self"], "ModelProvider.__init__": ["self", "cli_args"],
    "ModelProvider.reset": ["self"], "ModelProvider.load_default": ["self"],
    "ModelProvider.load": ["self", "model_path", "adapter_path", "draft_model_path"],
    "ResponseGenerator.__init__": ["self", "model_provider", "prompt_cache"],
    "ResponseGenerator.generation_available": ["self"], "ResponseGenerator.stop_and_join": ["self"],
    "ResponseGenerator.join": ["self"],
    "ResponseGenerator.generate": ["self", "request", "generation_args", "progress_callback"],
    **{f"APIHandler.{name}": ["self"] for name in ("do_OPTIONS", "do_POST", "do_GET", "validate_model_parameters",
                                                   "handle_chat_completions", "handle_text_completions",
                                                   "handle_health_check", "handle_models_request")},
    "APIHandler.handle_completion": ["self", "request", "stop_words"],
}


@pytest.mark.parametrize("name", sorted(UPSTREAM_SIGNATURES))
def test_upstreams_server_api_is_here_with_its_parameters(name):
    import inspect

    import mlx_lm.server

    target = mlx_lm.server
    for part in name.split("."):
        target = getattr(target, part)
    parameters = [p for p in inspect.signature(target).parameters.values()
                  if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]
    assert [p.name for p in parameters] == UPSTREAM_SIGNATURES[name]
