"""server.py: servers started in subprocesses on tiny models, driven over HTTP with the
official `openai` client (and raw sockets for what a client library would not send).

Every greedy answer is compared with plain, uncached in-process generation, so prompt
cache reuse and speculation must both be exact. Servers: a dense target with a draft
that agrees about half the time, gpt-oss (sliding windows) with a dense draft, and a
hybrid (Gated DeltaNet) target with a dense draft. Plain (draft-free) serving runs
in process, through the same worker.
"""

import http.client
import json
import re
import socket
import time
from concurrent.futures import ThreadPoolExecutor

import mlx.core as mx
from mlx.utils import tree_flatten
import openai
import pytest
from checkpoints import TINY_CONFIGS, write_checkpoint
from server_harness import start_server

from mlx_lm.generate import generate
from mlx_lm.sample_utils import make_logits_processors
from mlx_lm.openai_api import ServerDefaults, StopStringFilter, parse_request
from mlx_lm.server import main, parse_size, setup_arg_parser
from mlx_lm.serving import GenerationWorker, Job, ModelProvider
from mlx_lm.utils import load

MAX_TOKENS = 12
# Server name -> (target, draft, extra flags).
SERVERS = {
    "dense_draft": ("dense", "dense_draft", ["--allow-other-models"]),
    "gpt_oss_draft": ("gpt_oss", "dense", []),
    "hybrid_draft": ("hybrid", "dense", []),
}


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("server_models")
    return {
        "dense": write_checkpoint(root / "dense", TINY_CONFIGS["qwen3"]),
        # Same weights shrunk: agrees with "dense" on about half the tokens.
        "dense_draft": write_checkpoint(root / "dense_draft", TINY_CONFIGS["qwen3"], scale=0.45),
        "gpt_oss": write_checkpoint(root / "gpt_oss", TINY_CONFIGS["gpt_oss"]),
        "hybrid": write_checkpoint(root / "hybrid", TINY_CONFIGS["qwen3_next"]),
    }


@pytest.fixture(scope="module")
def servers(model_dirs, tmp_path_factory):
    """All servers, started at once (startup is mostly imports) and stopped at the end."""
    logs = tmp_path_factory.mktemp("server_logs")
    started = {}
    for name, (target, draft, flags) in SERVERS.items():
        started[name] = start_server(name, model_dirs[target], logs / f"{name}.log",
                                     draft and model_dirs[draft], ["--max-tokens", str(MAX_TOKENS), *flags])
    yield started
    for server in started.values():
        server.process.terminate()
    for server in started.values():
        server.process.wait(timeout=30)


@pytest.fixture(params=list(SERVERS))
def server(request, servers):
    return servers[request.param].wait_ready()


@pytest.fixture
def dense_server(servers):
    return servers["dense_draft"].wait_ready()


_loaded = {}


def reference(model_dir, messages=None, prompt=None, max_tokens=MAX_TOKENS):
    """Plain greedy generation in this process, from an empty cache."""
    if model_dir not in _loaded:
        _loaded[model_dir] = load(str(model_dir))
    model, tokenizer = _loaded[model_dir]
    if messages is not None:
        text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        tokens = tokenizer.encode(text, add_special_tokens=False)
    else:
        tokens = tokenizer.encode(prompt)
    return generate(model, tokenizer, tokens, max_tokens=max_tokens)


def chat(server, messages, **kwargs):
    kwargs = {"model": "default_model", "max_tokens": MAX_TOKENS, "temperature": 0, **kwargs}
    return server.client.chat.completions.create(messages=messages, **kwargs)


def user(text):
    return [{"role": "user", "content": text}]


def speculation(usage):
    return (usage.model_extra or {}).get("speculation")


def test_chat_matches_plain_generation_and_repeats_exactly(server):
    messages = user("Tell me about caches.")
    expected = reference(server.target_dir, messages)
    first, second = chat(server, messages), chat(server, messages)
    for response in (first, second):
        assert response.object == "chat.completion"
        assert response.choices[0].message.content == expected
        assert response.choices[0].finish_reason in ("stop", "length")
    usage = second.usage
    assert usage.prompt_tokens == first.usage.prompt_tokens
    assert usage.total_tokens == usage.prompt_tokens + usage.completion_tokens
    assert usage.prompt_tokens_details.cached_tokens == usage.prompt_tokens - 1
    if server.draft_dir is None:
        assert speculation(usage) is None
    else:
        spec = speculation(usage)
        assert spec["num_drafted"] >= spec["num_accepted"] >= 0 and spec["num_target_forwards"] >= 1
        assert usage.completion_tokens_details.accepted_prediction_tokens == spec["num_accepted"]
        assert usage.completion_tokens_details.rejected_prediction_tokens == spec["num_drafted"] - spec["num_accepted"]


def test_text_completion(server):
    prompt = "Once upon a time there was"
    response = server.client.completions.create(model="default_model", prompt=prompt, max_tokens=MAX_TOKENS,
                                                temperature=0, logprobs=2)
    assert response.object == "text_completion"
    choice = response.choices[0]
    assert choice.text == reference(server.target_dir, prompt=prompt)
    assert len(choice.logprobs.tokens) == len(choice.logprobs.token_logprobs) == len(choice.logprobs.top_logprobs)
    assert all(len(top) <= 2 for top in choice.logprobs.top_logprobs)
    assert choice.logprobs.text_offset[0] == 0


def test_streaming_equals_non_streaming(server):
    messages = user("Stream me a story.")
    whole = chat(server, messages).choices[0].message.content
    chunks = list(chat(server, messages, stream=True, stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == whole
    assert chunks[-2].choices[0].finish_reason in ("stop", "length")
    assert chunks[-1].choices == [] and chunks[-1].usage.prompt_tokens_details.cached_tokens > 0
    assert (speculation(chunks[-1].usage) is None) == (server.draft_dir is None)
    texts = server.client.completions.create(model="default_model", prompt="Stream", max_tokens=MAX_TOKENS,
                                             temperature=0, stream=True)
    assert "".join(c.choices[0].text for c in texts) == reference(server.target_dir, prompt="Stream")


def test_multi_turn_reuses_the_previous_turn(server):
    turn1 = user("What is a prompt cache?")
    first = chat(server, turn1)
    turn2 = turn1 + [{"role": "assistant", "content": first.choices[0].message.content},
                     {"role": "user", "content": "And why reuse it?"}]
    second = chat(server, turn2)
    # At least the first prompt but its last token (a re-rendered answer may differ from
    # its tokens): the second turn prefills little more than its new tokens.
    assert second.usage.prompt_tokens_details.cached_tokens >= first.usage.prompt_tokens - 1
    assert second.choices[0].message.content == reference(server.target_dir, turn2)


def test_stop_strings(server):
    messages = user("Count for me.")
    full = reference(server.target_dir, messages)
    stop = full[4:6]
    expected = full[: full.index(stop)]
    response = chat(server, messages, stop=[stop, "never appears"])
    assert response.choices[0].message.content == expected
    assert response.choices[0].finish_reason == "stop"
    streamed = "".join(c.choices[0].delta.content or "" for c in chat(server, messages, stop=stop, stream=True))
    assert streamed == expected


def send_raw(server, messages, **fields):
    body = json.dumps({"messages": messages, "temperature": 0, **fields}).encode()
    sock = socket.create_connection(server.address)
    sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: test\r\nContent-Type: application/json\r\n"
                 b"Content-Length: %d\r\n\r\n" % len(body) + body)
    return sock


def wait_for_disconnects(server, count):
    """Generated-token counts of the logged disconnects, once there are `count`."""
    deadline = time.time() + 30
    while time.time() < deadline:
        stopped = re.findall(r"Client disconnected; stopped after (\d+)", server.log())
        if len(stopped) >= count:
            return [int(n) for n in stopped]
        time.sleep(0.05)
    pytest.fail(f"no disconnect logged:\n{server.log()}")


def test_client_disconnect_mid_stream(server):
    messages = user("Talk for a long time.")
    before = len(re.findall("Client disconnected; stopped", server.log()))
    sock, received = send_raw(server, messages, max_tokens=5000, stream=True), b""
    while received.count(b"data: ") < 4:
        received += sock.recv(65536)
    sock.close()
    assert wait_for_disconnects(server, before + 1)[-1] < 5000
    # The next request is answered exactly, from the cache the cancelled stream left.
    response = chat(server, messages)
    assert response.choices[0].message.content == reference(server.target_dir, messages)
    assert response.usage.prompt_tokens_details.cached_tokens == response.usage.prompt_tokens - 1
    # A non-streaming client that hangs up is noticed too.
    sock = send_raw(server, user("Never mind."), max_tokens=5000)
    time.sleep(0.3)
    sock.close()
    assert wait_for_disconnects(server, before + 2)[-1] < 5000
    assert chat(server, messages).choices[0].message.content == response.choices[0].message.content


def test_logprobs(dense_server):
    response = chat(dense_server, user("Log probabilities, please."), logprobs=True, top_logprobs=3)
    content = response.choices[0].logprobs.content
    assert 0 < len(content) <= response.usage.completion_tokens
    for entry in content:
        tops = [t.logprob for t in entry.top_logprobs]
        assert len(tops) == 3 and tops == sorted(tops, reverse=True)
        assert entry.top_logprobs[0].token == entry.token  # greedy: the chosen token is the best
        assert entry.logprob == pytest.approx(tops[0]) and entry.logprob <= 0


def test_num_draft_tokens_per_request(dense_server):
    response = chat(dense_server, user("Draft one at a time."), extra_body={"num_draft_tokens": 1})
    spec = speculation(response.usage)
    assert spec["num_drafted"] <= spec["num_target_forwards"]
    assert response.choices[0].message.content == reference(dense_server.target_dir, user("Draft one at a time."))


def test_penalties_see_the_cached_prompt_and_seeds_repeat(dense_server):
    messages = user("Repeat repeat repeat the word repeat.")
    penalties = dict(repetition_penalty=1.5, presence_penalty=0.5, frequency_penalty=0.5)
    model, tokenizer = _loaded.get(dense_server.target_dir) or load(str(dense_server.target_dir))
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    expected = generate(model, tokenizer, tokenizer.encode(text, add_special_tokens=False), max_tokens=MAX_TOKENS,
                        logits_processors=make_logits_processors(**penalties))
    for _ in range(2):  # the second request starts from the cache
        response = chat(dense_server, messages, extra_body=penalties)
        assert response.choices[0].message.content == expected
    assert response.usage.prompt_tokens_details.cached_tokens > 0
    sampled = [chat(dense_server, messages, temperature=1.0, seed=7).choices[0].message.content for _ in range(2)]
    assert sampled[0] == sampled[1]


MESSAGES = [{"role": "user", "content": "hi"}]
BAD_REQUESTS = [
    ("/v1/chat/completions", b"{not json", 400, "not valid JSON"),
    ("/v1/chat/completions", b"[1, 2]", 400, "JSON object"),
    ("/v1/chat/completions", b"\xff\xfe", 400, "not valid JSON"),
    ("/v1/chat/completions", {}, 400, "'messages'"),
    ("/v1/chat/completions", {"messages": "hi"}, 400, "'messages'"),
    ("/v1/chat/completions", {"messages": [{"role": 5}]}, 400, "messages[0]"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": 5}]}, 400, "content"),
    ("/v1/chat/completions", {"messages": [{"role": "wizard", "content": "x"}]}, 400, "chat template"),
    ("/v1/chat/completions", {"messages": MESSAGES, "max_tokens": -1}, 400, "'max_tokens'"),
    ("/v1/chat/completions", {"messages": MESSAGES, "max_tokens": 0}, 400, "'max_tokens'"),
    ("/v1/chat/completions", {"messages": MESSAGES, "max_tokens": 10**12}, 400, "'max_tokens'"),
    ("/v1/chat/completions", {"messages": MESSAGES, "max_tokens": "10"}, 400, "'max_tokens'"),
    ("/v1/chat/completions", {"messages": MESSAGES, "max_completion_tokens": True}, 400, "'max_completion_tokens'"),
    ("/v1/chat/completions", {"messages": MESSAGES, "temperature": "hot"}, 400, "'temperature'"),
    ("/v1/chat/completions", {"messages": MESSAGES, "temperature": -1}, 400, "'temperature'"),
    ("/v1/chat/completions", {"messages": MESSAGES, "top_p": 2}, 400, "'top_p'"),
    ("/v1/chat/completions", {"messages": MESSAGES, "top_logprobs": 100}, 400, "'top_logprobs'"),
    ("/v1/chat/completions", {"messages": MESSAGES, "logprobs": 1}, 400, "'logprobs'"),
    ("/v1/chat/completions", {"messages": MESSAGES, "logit_bias": {"abc": 1}}, 400, "'logit_bias'"),
    ("/v1/chat/completions", {"messages": MESSAGES, "logit_bias": {"100000": 1}}, 400, "outside the vocabulary"),
    ("/v1/chat/completions", {"messages": MESSAGES, "stop": [1]}, 400, "'stop'"),
    ("/v1/chat/completions", {"messages": MESSAGES, "stream": "yes"}, 400, "'stream'"),
    ("/v1/chat/completions", {"messages": MESSAGES, "seed": 1.5}, 400, "'seed'"),
    ("/v1/chat/completions", {"messages": MESSAGES, "n": 2}, 400, "'n'"),
    ("/v1/chat/completions", {"messages": MESSAGES, "num_draft_tokens": 0}, 400, "'num_draft_tokens'"),
    ("/v1/chat/completions", {"messages": MESSAGES, "repetition_context_size": -3}, 400, "repetition_context_size"),
    ("/v1/completions", {"prompt": 5}, 400, "'prompt'"),
    ("/v1/completions", {"prompt": []}, 400, "'prompt'"),
    ("/v1/completions", {"prompt": [1, 999999]}, 400, "outside the vocabulary"),
    ("/v1/completions", {"prompt": "x", "model": "no-such-model"}, 404, "'no-such-model' is not"),
    ("/v1/completions", {"prompt": "x", "model": "/no/such/dir"}, 404, "not a local model directory"),
    ("/v1/completions", {"prompt": "x", "draft_model": "other"}, 404, "draft model"),
    ("/v1/embeddings", {"input": "x"}, 404, "no such endpoint"),
]


def test_bad_requests_get_json_errors_and_the_server_stays_up(dense_server):
    for path, body, status, message in BAD_REQUESTS:
        data = body if isinstance(body, bytes) else json.dumps(body).encode()
        got_status, got = dense_server.raw("POST", path, data, {"Content-Type": "application/json"})
        assert (got_status, path, body) == (status, path, body) and message in got["error"]["message"], got
    # No Content-Length, bad GET paths, CORS preflight.
    sock = socket.create_connection(dense_server.address)
    sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: test\r\n\r\n")
    assert sock.recv(1024).startswith(b"HTTP/1.1 411")
    sock.close()
    assert dense_server.raw("GET", "/v1/nothing")[0] == 404
    assert dense_server.raw("OPTIONS", "/v1/chat/completions")[0] == 204
    assert dense_server.raw("GET", "/health") == (200, {"status": "ok"})
    models = dense_server.client.models.list().data
    assert [m.id for m in models] == [dense_server.target_dir.name]  # an id, never a path
    with pytest.raises(openai.NotFoundError, match="gpt-4. is not"):
        dense_server.client.chat.completions.create(model="gpt-4", messages=MESSAGES)
    assert chat(dense_server, MESSAGES).choices[0].message.content == reference(dense_server.target_dir, MESSAGES)


def test_model_names(servers, model_dirs):
    gpt_oss = servers["gpt_oss_draft"].wait_ready()
    for name in [str(model_dirs["gpt_oss"]), model_dirs["gpt_oss"].name, "default_model"]:
        assert chat(gpt_oss, MESSAGES, model=name, max_tokens=2).choices[0].message.content is not None
    status, body = gpt_oss.raw("POST", "/v1/completions", json.dumps({"prompt": "x", "model": str(model_dirs["dense"])}))
    assert status == 404 and "--allow-other-models" in body["error"]["message"]
    # A server started with --allow-other-models serves other local directories.
    dense = servers["dense_draft"].wait_ready()
    response = dense.client.completions.create(model=str(model_dirs["gpt_oss"]), prompt="Other", max_tokens=MAX_TOKENS,
                                                temperature=0)
    assert response.choices[0].text == reference(model_dirs["gpt_oss"], prompt="Other")
    assert response.model == model_dirs["gpt_oss"].name
    assert "Compute dtype: float32 (auto: " in dense.log()  # the start-up log says what --dtype chose


def test_concurrent_clients_get_their_own_answers(dense_server):
    prompts = [user(f"Client number {i} asks a question.") for i in range(8)]
    expected = [reference(dense_server.target_dir, p) for p in prompts]

    def ask(i):
        if i % 2:
            stream = chat(dense_server, prompts[i], stream=True)
            return "".join(c.choices[0].delta.content or "" for c in stream)
        return chat(dense_server, prompts[i]).choices[0].message.content

    with ThreadPoolExecutor(8) as pool:
        assert list(pool.map(ask, range(8))) == expected


def scrape_metrics(server):
    """GET /metrics, parsed strictly (tests/test_metrics.py)."""
    from test_metrics import parse_exposition

    connection = http.client.HTTPConnection(*server.address, timeout=60)
    connection.request("GET", "/metrics")
    response = connection.getresponse()
    text = response.read().decode()
    connection.close()
    assert response.status == 200
    assert response.getheader("Content-Type") == "text/plain; version=0.0.4; charset=utf-8"
    return parse_exposition(text)


def test_metrics_move_with_requests(dense_server):
    from test_metrics import value

    before = scrape_metrics(dense_server)
    answers = [chat(dense_server, user("Count the draft tokens.")),
               dense_server.client.completions.create(model="default_model", prompt="Once upon", temperature=0,
                                                      max_tokens=MAX_TOKENS)]
    status, _ = dense_server.raw("POST", "/v1/completions", json.dumps({"prompt": "x", "max_tokens": -5}))
    assert status == 400
    after = scrape_metrics(dense_server)

    def moved(name, **labels):
        return value(after, name, **labels) - value(before, name, **labels)

    assert moved("mlx_lm_requests_total", endpoint="/v1/chat/completions", outcome="completed") == 1
    assert moved("mlx_lm_requests_total", endpoint="/v1/completions", outcome="completed") == 1
    assert moved("mlx_lm_requests_total", endpoint="/v1/completions", outcome="rejected") == 1
    assert moved("mlx_lm_generated_tokens_total") == sum(a.usage.completion_tokens for a in answers)
    assert moved("mlx_lm_prompt_tokens_total") == sum(a.usage.prompt_tokens for a in answers)
    specs = [speculation(a.usage) for a in answers]
    # (> 0 not asked: the server's policy may rightly have stopped drafting this draft)
    assert moved("mlx_lm_draft_tokens_total") == sum(s["num_drafted"] for s in specs)
    assert moved("mlx_lm_draft_accepted_tokens_total") == sum(s["num_accepted"] for s in specs)
    for depth in (1, 2):  # (a request may have drafted nothing, or not that deep)
        for counts in ("drafted_at_depth", "accepted_at_depth"):
            want = sum(s[counts][depth - 1] for s in specs if len(s[counts]) >= depth)
            assert moved(f"mlx_lm_{counts}_total", depth=depth) == want, (counts, depth)
    assert value(after, "mlx_lm_batch_size") == 0 and value(after, "mlx_lm_queue_length") == 0
    for spec in specs:
        assert (spec["drafted_at_depth"] or [0])[0] == sum(spec["draft_lengths"][1:])
        assert len(spec["depth_acceptance"]) == len(spec["drafted_at_depth"])


# ---------------------------------------------------------------------------
# In process: request parsing and the cache entries the worker stores.


def test_parse_request_defaults_and_fields():
    defaults = ServerDefaults(max_tokens=7, temperature=0.5, chat_template_args={"enable_thinking": False})
    request = parse_request({"messages": MESSAGES, "chat_template_kwargs": {"x": 1}, "stop": "END",
                             "max_completion_tokens": 3, "max_tokens": 9, "logit_bias": {"5": -100}}, "chat", defaults)
    assert request.max_tokens == 3 and request.sampling["temp"] == 0.5 and request.stop == ["END"]
    assert request.chat_template_kwargs == {"enable_thinking": False, "x": 1} and request.logit_bias == {5: -100.0}
    text = parse_request({"prompt": ["only one"], "logprobs": 0, "temperature": None}, "text", defaults)
    assert (text.prompt, text.logprobs, text.top_logprobs, text.max_tokens) == ("only one", True, 0, 7)
    assert text.sampling["temp"] == 0.5  # null means "use the default"


def test_stop_string_filter_holds_back_partial_matches():
    stops = StopStringFilter(["STOP", "xyz"])
    assert stops.add("hello S") == ("hello ", False)
    assert stops.add("T") == ("", False)
    assert stops.add("ill here x") == ("STill here ", False)
    assert stops.add("yz and more") == ("", True)
    assert stops.text == "hello STill here x"[:-1]


def test_parse_size():
    assert parse_size("8GB") == 8 * 10**9 and parse_size("512MiB") == 512 << 20 and parse_size("1000") == 1000


def run_job(worker, body):
    request = parse_request(body, "chat", ServerDefaults(max_tokens=MAX_TOKENS))
    job = Job(request, None)
    worker.run(job)
    events = []
    while not job.events.empty():
        events.append(job.events.get())
    assert events[-1][0] == "done", events[-1]
    return events[-1][1]


def continues_like_a_fresh_feed(served, key, prompt_cache):
    """Feeding one more token through the stored cache gives the logits of feeding the
    whole key plus that token from scratch (to float tolerance: different chunks), for
    the target and, with speculation, for the draft half of the entry too."""
    num_target = len(served.model.layers)
    halves = [(served.model, prompt_cache[:num_target])]
    if served.draft_model is not None:
        halves.append((served.draft_model, prompt_cache[num_target:]))
    probe = mx.array([[7]])
    for model, cache in halves:
        got = model(probe, cache=cache)[0, -1]
        want = model(mx.array([list(key) + [7]]))[0, -1]
        if not mx.allclose(got, want, rtol=1e-4, atol=1e-4).item():
            return False
    return True


@pytest.mark.parametrize("target, draft", [("hybrid", None), ("hybrid", "dense"), ("gpt_oss", "dense"),
                                           ("dense", "dense_draft")])
def test_worker_stores_caches_under_exactly_the_tokens_they_hold(model_dirs, target, draft):
    provider = ModelProvider(str(model_dirs[target]), draft and str(model_dirs[draft]), False, 10, 1 << 40, None)
    worker = GenerationWorker(provider)
    served = provider.default
    result = run_job(worker, {"messages": user("Store me.")})
    tokens = served.encode(parse_request({"messages": user("Store me.")}, "chat", ServerDefaults()))
    keys = served.prompt_cache.keys()
    if target == "dense":  # trimmable: the generation entry covers the prompt
        assert len(keys) == 1
    else:  # untrimmable once wrapped or recurrent: also the prompt without its last token
        assert keys == [tuple(tokens[:-1]), keys[-1]]
    assert len(keys[-1]) == len(tokens) + result.completion_tokens and keys[-1][: len(tokens)] == tuple(tokens)
    for key in keys:
        fetched = served.prompt_cache.fetch(list(key) + [1])
        assert fetched.num_cached == len(key)
        assert len(fetched.prompt_cache) == len(served.make_cache())  # the draft's entries are stored too
        assert continues_like_a_fresh_feed(served, key, fetched.prompt_cache)
    # A seeded sampled request repeats exactly, cache or not.
    sampled = {"messages": user("Sample me."), "temperature": 1.0, "seed": 3}
    assert run_job(worker, sampled).text == run_job(worker, sampled).text
    # ... and does not fix what is drawn after it: that follows the state before it.
    after = []
    for _ in range(2):
        mx.random.seed(5)
        run_job(worker, sampled)
        after.append(mx.random.uniform().item())
    mx.random.seed(3)
    assert after[0] == after[1] and after[0] != mx.random.uniform().item()
    mx.random.seed(6)
    run_job(worker, sampled)
    assert mx.random.uniform().item() != after[0]


def test_chat_template_override_and_cli_defaults(model_dirs):
    template = "{% for m in messages %}{{ m['content'] }}!{% endfor %}"
    served = ModelProvider(str(model_dirs["dense"]), None, False, 10, 1 << 40, template).default
    request = parse_request({"messages": user("hi")}, "chat", ServerDefaults())
    assert served.encode(request) == served.tokenizer.encode("hi!", add_special_tokens=False)
    assert not served.snapshot_prompts  # KV caches only: trimming covers every reuse
    args = setup_arg_parser().parse_args(["--model", "m"])
    assert (args.host, args.port, args.max_tokens, args.num_draft_tokens, args.prompt_cache_size, args.dtype) == (
        "127.0.0.1", 8080, 512, 3, 10, "auto")
    half = ModelProvider(str(model_dirs["dense"]), None, False, 10, 1 << 40, None, dtype="float16").default
    assert {p.dtype for _, p in tree_flatten(half.model.parameters())} == {mx.float16}
    with pytest.raises(SystemExit):
        main(["--model", "m", "--temp", "-1"])
