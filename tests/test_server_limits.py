"""server.py limits against hostile clients: prompts past the context, clients that
leave during a long prefill (of the target and the draft), too many or too long stop
strings, and the prompt cache's byte budget.

Each hostile request goes to a real server subprocess (dense and hybrid targets, with
and without a draft), and is followed by a normal request whose greedy answer must
equal plain in-process generation, from a server process still alive. Small limits
(`--max-prompt-tokens`, a one-token `--prefill-step-size`) make the long scenarios cost
a fraction of a second on the tiny models.
"""

import functools
import json
import logging
import re
import socket
import time
from datetime import datetime

import pytest
from checkpoints import TINY_CONFIGS, write_checkpoint
from server_harness import write_server_models, start_server, stop_all

from mlx_lm.generate import generate
from mlx_lm.openai_api import (
    MAX_STOP_LENGTH,
    MAX_STOP_STRINGS,
    RequestError,
    ServerDefaults,
    StopStringFilter,
    parse_request,
)
from mlx_lm import server as server_module
from mlx_lm import served_model
from mlx_lm.serving import (
    FALLBACK_PROMPT_CACHE_BYTES,
    PROMPT_CACHE_MEMORY_FRACTION,
    GenerationWorker,
    ModelProvider,
    available_memory,
    context_length,
    default_prompt_cache_bytes,
)
from mlx_lm.utils import load

MAX_TOKENS = 8
MAX_PROMPT_TOKENS = 8192
# A prompt that takes seconds to prefill one token at a time: a client leaving during
# it must free the worker long before it would end.
LONG_PROMPT = [10 + i % 490 for i in range(8000)]
SERVERS = {  # name -> (target, draft)
    "dense": ("dense", None),
    "dense_draft": ("dense", "draft"),
    "hybrid": ("hybrid", None),
    "hybrid_draft": ("hybrid", "draft"),
}


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory):
    return write_server_models(tmp_path_factory.mktemp("limit_models"))


@pytest.fixture(scope="module")
def servers(model_dirs, tmp_path_factory):
    logs = tmp_path_factory.mktemp("limit_logs")
    flags = ["--max-tokens", str(MAX_TOKENS), "--max-prompt-tokens", str(MAX_PROMPT_TOKENS),
             "--prefill-step-size", "1"]
    started = {name: start_server(name, model_dirs[target], logs / f"{name}.log", draft and model_dirs[draft], flags)
               for name, (target, draft) in SERVERS.items()}
    yield started
    stop_all(started.values())


@pytest.fixture(params=list(SERVERS))
def server(request, servers):
    return servers[request.param].wait_ready()


@functools.lru_cache(maxsize=None)
def loaded(model_dir):
    return load(str(model_dir))


def reference(model_dir, messages):
    model, tokenizer = loaded(model_dir)
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return generate(model, tokenizer, tokenizer.encode(text, add_special_tokens=False), max_tokens=MAX_TOKENS)


def user(text):
    return [{"role": "user", "content": text}]


def post(server, path, body):
    return server.raw("POST", path, json.dumps(body).encode(), {"Content-Type": "application/json"})


def still_serves_exactly(server, text="A normal question after that."):
    """The server process is alive and answers a normal request exactly; returns the
    seconds it took."""
    assert server.process.poll() is None, server.log()
    start = time.time()
    status, body = post(server, "/v1/chat/completions", {"messages": user(text), "temperature": 0})
    assert status == 200, body
    assert body["choices"][0]["message"]["content"] == reference(server.target_dir, user(text))
    return time.time() - start


def test_prompts_past_the_limit_are_refused_before_any_work(server):
    limit = str(MAX_PROMPT_TOKENS)
    # 50 MB in one message: refused by its length in characters, without tokenizing.
    huge = "x" * 50_000_000
    start = time.time()
    status, body = post(server, "/v1/chat/completions", {"messages": user(huge)})
    refused_in = time.time() - start
    message = body["error"]["message"]
    assert status == 400 and body["error"]["type"] == "invalid_request_error", body
    assert limit in message and "characters" in message and "--max-prompt-tokens" in message, message
    assert refused_in < 15, refused_in  # seconds (the probe saw minutes and a stuck worker)
    # Few enough characters to be tokenized, too many tokens once tokenized.
    status, body = post(server, "/v1/completions", {"prompt": "a b c d " * 12000})
    assert status == 400 and re.search(rf"has \d+ tokens.*at most {limit} tokens", body["error"]["message"]), body
    # Token ids: counted as they are.
    status, body = post(server, "/v1/completions", {"prompt": [11] * (MAX_PROMPT_TOKENS + 1)})
    assert status == 400 and f"has {MAX_PROMPT_TOKENS + 1} tokens" in body["error"]["message"], body
    # Exactly at the limit: no room left for an answer (the context is the limit here).
    status, body = post(server, "/v1/completions", {"prompt": [11] * MAX_PROMPT_TOKENS})
    assert status == 400 and "no room for an answer" in body["error"]["message"], body
    assert f"Prompts of at most {limit} tokens (the server's --max-prompt-tokens)" in server.log()
    assert still_serves_exactly(server) < 10


def log_time(line):
    """Epoch seconds of a log line's `asctime` stamp (local time, milliseconds)."""
    stamp = re.match(r"(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d),(\d{3})", line)
    return datetime.strptime(stamp.group(1), "%Y-%m-%d %H:%M:%S").timestamp() + int(stamp.group(2)) / 1000


def test_a_client_leaving_during_a_long_prefill_frees_the_worker_at_once(server):
    before = server.log().count("during prefill")
    body = json.dumps({"prompt": LONG_PROMPT, "stream": True, "max_tokens": 5}).encode()
    sock = socket.create_connection(server.address)
    sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: test\r\nContent-Type: application/json\r\n"
                 b"Content-Length: %d\r\n\r\n" % len(body) + body)
    # Leave at the first keepalive (the prefill has begun), or after a second at most:
    # a draft prefilled before the target sends none until it is done.
    sock.settimeout(1.0)
    try:
        sock.recv(4096)
    except socket.timeout:
        pass
    sock.close()
    left_at = time.time()
    deadline = left_at + 30
    while server.log().count("during prefill") == before:
        assert time.time() < deadline, server.log()
        time.sleep(0.02)
    line = [x for x in server.log().splitlines() if "during prefill" in x][-1]
    fed, total = map(int, re.search(r"\((\d+) of (\d+) prompt tokens fed\)", line).groups())
    assert total == len(LONG_PROMPT) and fed < total / 2, line
    # Full prefill here takes seconds (longer with a draft); leaving frees it within ~1 s.
    assert log_time(line) - left_at < 2.5, line
    assert still_serves_exactly(server) < 10


def long_stops(count):
    return [f"{i:03d}" + "\u2603" * (MAX_STOP_LENGTH - 3) for i in range(count)]


def test_stop_string_limits(server):
    messages = user("Stop strings, please.")
    status, body = post(server, "/v1/chat/completions",
                        {"messages": messages, "temperature": 0, "stop": long_stops(MAX_STOP_STRINGS)})
    assert status == 200 and body["choices"][0]["message"]["content"] == reference(server.target_dir, messages)
    status, body = post(server, "/v1/chat/completions", {"messages": messages, "stop": long_stops(MAX_STOP_STRINGS + 1)})
    assert status == 400 and f"at most {MAX_STOP_STRINGS}" in body["error"]["message"], body
    status, body = post(server, "/v1/chat/completions", {"messages": messages, "stop": ["x" * (MAX_STOP_LENGTH + 1)]})
    assert status == 400 and f"'stop[0]' has {MAX_STOP_LENGTH + 1} characters" in body["error"]["message"], body
    assert still_serves_exactly(server) < 10


# ---------------------------------------------------------------------------
# In process.


class CountingFilter(StopStringFilter):
    """Records how many characters each add() scans."""

    def __init__(self, stops):
        super().__init__(stops)
        self.scanned = []

    def _tail(self, start):
        tail = super()._tail(start)
        self.scanned.append(len(tail))
        return tail


def test_stop_matching_work_per_token_does_not_grow_with_the_text():
    stops = long_stops(MAX_STOP_STRINGS)
    stops[5] = "THE END"
    stops_filter = CountingFilter(stops)
    sent = ""
    for i in range(3000):
        segment = "\u2603" * (i % 7) + "ab "  # runs of the stop strings' letter, never a whole one
        out, stopped = stops_filter.add(segment)
        assert not stopped
        sent += out
        assert stops_filter.scanned[-1] <= MAX_STOP_LENGTH - 1 + len(segment)
    assert len(stops_filter.text) > 10 * MAX_STOP_LENGTH
    assert stops_filter.add("so THE EN") == ("so ", False)  # "THE EN" may begin a stop: held back
    assert stops_filter.add("D and more") == ("", True)
    assert stops_filter.text.endswith("ab so ") and stops_filter.text == sent + "so "
    # The held-back tail is at most the longest stop string less one character.
    held = CountingFilter(["abcdef"])
    assert held.add("xyz abcde") == ("xyz ", False) and held.scanned == [9]


def test_context_length_from_each_config_style():
    assert context_length({"max_position_embeddings": 40960}) == 40960
    assert context_length({"model_type": "qwen3_5", "text_config": {"max_position_embeddings": 262144}}) == 262144
    assert context_length({"model_type": "llama"}) is None
    assert context_length({"max_position_embeddings": None, "text_config": None}) is None


def run_job(worker, body, kind="chat"):
    job = worker.provider.make_job(parse_request(body, kind, ServerDefaults(max_tokens=MAX_TOKENS)))
    worker.run(job)
    events = []
    while not job.events.empty():
        events.append(job.events.get())
    return events[-1]


@pytest.fixture(scope="module")
def short_context_dir(tmp_path_factory):
    config = dict(TINY_CONFIGS["qwen3"], max_position_embeddings=40)
    return write_checkpoint(tmp_path_factory.mktemp("short") / "dense", config)


def test_the_model_context_limits_prompts_and_clips_answers(short_context_dir):
    provider = ModelProvider(str(short_context_dir), None, False, 10, 1 << 30, None)
    served = provider.default
    assert served.max_prompt_tokens == served.max_total_tokens == 40
    # The served model's prompt is tokenized, and a long one refused, by make_job: on
    # the request's thread, never reaching the worker.
    request = parse_request({"prompt": "Once upon a time"}, "text", ServerDefaults())
    assert provider.make_job(request).tokens == served.encode(request)
    worker = GenerationWorker(provider)
    prompt = list(range(10, 10 + 36))  # leaves room for 4 tokens
    kind, result = run_job(worker, {"prompt": prompt, "max_tokens": 100, "logit_bias": {"0": -100}}, "text")
    assert kind == "done" and result.completion_tokens == 4 and result.finish_reason == "length"
    with pytest.raises(RequestError, match="has 41 tokens; this server accepts prompts of at most 40 tokens "
                                        r"\(the model's context"):
        provider.make_job(parse_request({"prompt": list(range(10, 51))}, "text", ServerDefaults()))
    # --max-prompt-tokens overrides the context, both ways.
    assert ModelProvider(str(short_context_dir), None, False, 10, 1 << 30, None, 8).default.max_total_tokens == 40
    assert ModelProvider(str(short_context_dir), None, False, 10, 1 << 30, None, 100).default.max_total_tokens == 100


def test_a_draft_with_a_shorter_context_does_not_lower_the_limit(model_dirs, short_context_dir, caplog):
    provider = ModelProvider(str(model_dirs["hybrid"]), str(short_context_dir), False, 10, 1 << 30, None, 100)
    served = provider.default
    assert served.draft_context_length == 40 and served.max_prompt_tokens == 100
    with caplog.at_level(logging.INFO, logger="mlx_lm.server"):
        server_module._log_limits(served, 100)
    assert "draft model's context (40 tokens) is shorter than the prompt limit" in caplog.text
    assert "Prompts of at most 100 tokens (the server's --max-prompt-tokens)" in caplog.text
    # Past the draft's context the answer is still the target's own.
    body = {"prompt": LONG_PROMPT[:60], "max_tokens": MAX_TOKENS}
    kind, result = run_job(GenerationWorker(provider), body, "text")
    model, tokenizer = loaded(model_dirs["hybrid"])
    assert kind == "done" and result.prompt_tokens == 60
    assert result.text == generate(model, tokenizer, LONG_PROMPT[:60], max_tokens=MAX_TOKENS)


def test_prompt_cache_byte_budget(model_dirs, monkeypatch):
    free = available_memory()
    assert free is not None and free > 0  # Linux: /proc/meminfo here
    served = ModelProvider(str(model_dirs["dense"]), None, False, 10, None, None).default
    assert 0 < served.prompt_cache.max_bytes <= free
    monkeypatch.setattr(served_model, "available_memory", lambda: 4000)
    assert default_prompt_cache_bytes() == 4000 * PROMPT_CACHE_MEMORY_FRACTION
    monkeypatch.setattr(served_model, "available_memory", lambda: None)
    assert default_prompt_cache_bytes() == FALLBACK_PROMPT_CACHE_BYTES
    # A budget smaller than any entry: nothing is stored, answers stay exact.
    provider = ModelProvider(str(model_dirs["hybrid"]), str(model_dirs["draft"]), False, 10, 1000, None)
    worker = GenerationWorker(provider)
    messages = user("Nothing fits.")
    for _ in range(2):
        kind, result = run_job(worker, {"messages": messages, "temperature": 0})
        assert kind == "done" and result.cached_tokens == 0
        assert result.text == reference(model_dirs["hybrid"], messages)
    assert len(provider.default.prompt_cache) == 0


def test_a_cancelled_prefill_stops_within_one_step_of_both_models(model_dirs):
    """Cancelled mid-prefill, the worker stops after the step it is in, the draft fed
    step by step with the target (not ahead of it), and stores what both hold: a retry
    resumes there and answers exactly as from scratch."""
    provider = ModelProvider(str(model_dirs["hybrid"]), str(model_dirs["draft"]), False, 10, 1 << 30, None)
    worker = GenerationWorker(provider, prefill_step_size=4)
    served = provider.default
    num_target = len(served.model.layers)
    offsets = []
    prefill = served.prefill

    def watched_prefill(tokens, prompt_cache, step, progress, quantize_kv):
        def watched(done, total):
            # The hybrid's first layer is recurrent: its full-attention layer tells the offset.
            offsets.append((done, prompt_cache[num_target - 1].offset, prompt_cache[num_target].offset))
            if done == 48:
                job.cancelled.set()
            progress(done, total)
        return prefill(tokens, prompt_cache, step, watched, quantize_kv)

    served.prefill = watched_prefill
    body = {"prompt": LONG_PROMPT[:100], "logit_bias": {"0": -100}}
    job = provider.make_job(parse_request(body, "text", ServerDefaults()))
    worker.run(job)
    assert job.events.empty()
    assert offsets == [(done, done, done) for done in range(4, 49, 4)]
    assert served.prompt_cache.keys() == [tuple(LONG_PROMPT[:48])]
    del served.prefill
    kind, resumed = run_job(worker, body, "text")
    assert kind == "done" and resumed.cached_tokens == 48
    fresh = GenerationWorker(ModelProvider(str(model_dirs["hybrid"]), str(model_dirs["draft"]), False, 0, 0, None))
    assert resumed.text == run_job(fresh, body, "text")[1].text
