"""provided_models.py: the server embedded with a model provider of the embedding
code's own making, as upstream 0.32.2's tests build one (a class with the provider's
attributes, its cli_args a plain object): answers equal plain generation, the draft
makes it speculate, request names go to the provider's own load, and stopping lets
the provider drop its models."""

import http.client
import json
from http.server import HTTPServer, ThreadingHTTPServer

import pytest
from test_server_embedding import client, model_dirs, reference, serve  # noqa: F401  (model_dirs: a fixture)

from mlx_lm.server import APIHandler, LRUPromptCache, ResponseGenerator
from mlx_lm.utils import load

MESSAGES = [{"role": "user", "content": "Tell me about caches."}]


class HandMadeProvider:
    """Upstream's DummyModelProvider, in this project's fixtures: models loaded by
    mlx_lm.utils.load, the options upstream's server reads as attributes of a class."""

    def __init__(self, model_dir, draft_dir=None, is_batchable=True):
        self.model, self.tokenizer = load(str(model_dir))
        self.processor = None
        self.model_key = (str(model_dir), None)
        self.is_batchable = is_batchable
        self.draft_model = None if draft_dir is None else load(str(draft_dir))[0]
        self.loads = []
        self.cli_args = type("obj", (object,), {
            "adapter_path": None, "chat_template": None, "use_default_chat_template": False,
            "trust_remote_code": False, "draft_model": None if draft_dir is None else str(draft_dir),
            "num_draft_tokens": 3, "temp": 0.0, "top_p": 1.0, "top_k": 0, "min_p": 0.0, "max_tokens": 10,
            "chat_template_args": {}, "model": None, "decode_concurrency": 32, "prompt_concurrency": 8,
            "prefill_step_size": 2048, "prompt_cache_size": 10, "prompt_cache_bytes": 1 << 63,
            "allowed_origins": ["*"], "kv_bits": None, "kv_group_size": 64, "quantized_kv_start": 0})

    def load(self, model, adapter=None, draft_model=None):
        self.loads.append(model)
        assert model in ["default_model", "chat_model"]
        return self.model, self.tokenizer

    def load_default(self):
        return self.load("default_model", None, "default_model")

    def reset(self):
        self.model_key = self.model = self.tokenizer = self.draft_model = None
        self.is_batchable = False


def post(httpd, body):
    connection = http.client.HTTPConnection("localhost", httpd.server_port, timeout=60)
    connection.request("POST", "/v1/chat/completions", body=json.dumps(body))
    response = connection.getresponse()
    status, data = response.status, json.loads(response.read())
    connection.close()
    return status, data


def test_a_hand_made_provider_serves_its_model_by_upstreams_names(model_dirs):  # noqa: F811
    provider = HandMadeProvider(model_dirs["dense"])
    generator = ResponseGenerator(provider, LRUPromptCache())
    httpd, thread = serve(generator, ThreadingHTTPServer)
    try:
        expected = reference(model_dirs["dense"], messages=MESSAGES)
        for name in ("default_model", "chat_model", str(model_dirs["dense"])):
            answer = client(httpd).chat.completions.create(model=name, messages=MESSAGES, temperature=0)
            assert answer.choices[0].message.content == expected, name
        status, body = post(httpd, {"model": "another_model", "messages": MESSAGES})
        assert status == 404 and "another_model" in body["error"]["message"]
        assert provider.loads.count("chat_model") == 1 and provider.loads.count("another_model") == 1  # asked once
        assert type(generator.worker).__name__ == "BatchWorker"  # is_batchable: requests decode together
    finally:
        httpd.shutdown()
        httpd.server_close()
        thread.join()
        generator.stop_and_join()
    # As upstream's generation thread does when it exits: the provider drops its models.
    assert provider.model is None and provider.tokenizer is None and not provider.is_batchable
    assert generator.cli_args.allowed_origins == ["*"] and not generator.generation_available()


def test_its_draft_model_speculates_one_request_at_a_time(model_dirs):  # noqa: F811
    provider = HandMadeProvider(model_dirs["dense"], model_dirs["draft"], is_batchable=False)
    generator = ResponseGenerator(provider, LRUPromptCache())
    httpd, thread = serve(generator, HTTPServer)
    try:
        answer = client(httpd).chat.completions.create(model="default_model", messages=MESSAGES, temperature=0)
        assert answer.choices[0].message.content == reference(model_dirs["dense"], messages=MESSAGES)
        assert answer.usage.model_extra["speculation"]["num_drafted"] > 0
        assert type(generator.worker).__name__ == "GenerationWorker"
        status, _ = post(httpd, {"messages": MESSAGES, "draft_model": str(model_dirs["draft"]), "max_tokens": 2})
        assert status == 200  # the draft answers to the name its cli_args give
    finally:
        httpd.shutdown()
        httpd.server_close()
        thread.join()
        generator.stop_and_join()


def test_providers_without_upstreams_attributes_or_a_model_are_refused(model_dirs):  # noqa: F811
    class FailingModelProvider:  # upstream's: its generator starts and its thread dies
        def load_default(self):
            raise RuntimeError("simulated generate crash")

    with pytest.raises(TypeError, match="upstream's provider attributes"):
        ResponseGenerator(FailingModelProvider(), LRUPromptCache())
    provider = HandMadeProvider(model_dirs["dense"])
    provider.load_default = lambda: (_ for _ in ()).throw(RuntimeError("simulated load failure"))
    with pytest.raises(RuntimeError, match="simulated load failure"):  # here, before anything is served
        ResponseGenerator(provider, LRUPromptCache())
    provider = HandMadeProvider(model_dirs["dense"])
    provider.tokenizer = provider.tokenizer.tokenizer  # the Hugging Face tokenizer, unwrapped
    with pytest.raises(TypeError, match="TokenizerWrapper"):
        ResponseGenerator(provider, LRUPromptCache())
    provider = HandMadeProvider(model_dirs["dense"])
    provider.cli_args.pipeline = True
    with pytest.raises(ValueError, match="pipeline=True is not supported"):
        ResponseGenerator(provider, LRUPromptCache())
