"""The server's batch worker (serving.BatchWorker): concurrent requests decode together,
each greedy answer equal to its solo run, for dense, sliding-window and hybrid targets;
stop strings, a cancelled request, prompt cache reuse and seeded sampling per request.
Driven in process step by step, then once over HTTP with concurrent clients."""

import functools
import json
import socket
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import mlx.core as mx
import pytest
from checkpoints import TINY_CONFIGS, write_checkpoint
from server_harness import start_server

from mlx_lm.generate import generate, generate_step
from mlx_lm.openai_api import ServerDefaults, parse_request
from mlx_lm.server import setup_arg_parser
from mlx_lm.serving import BatchWorker, ModelProvider

MAX_TOKENS = 10
QUESTIONS = ["Hi.", "Client number one asks a rather longer question than the others do.", "What now?",
             "Tell me a story about a cat", "x"]


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("batch_server_models")
    return {name: write_checkpoint(root / name, TINY_CONFIGS[config])
            for name, config in [("dense", "qwen3"), ("gpt_oss", "gpt_oss"), ("hybrid", "qwen3_next")]}


_workers = {}


def worker_for(model_dirs, name, max_batch_size=3, prompt_lookup=False, fixed_draft_length=False):
    key = (name, max_batch_size, prompt_lookup, fixed_draft_length)
    if key not in _workers:
        provider = ModelProvider(str(model_dirs[name]), None, False, 10, 1 << 40, None)
        _workers[key] = BatchWorker(provider, prefill_step_size=8, max_batch_size=max_batch_size,
                                    prompt_lookup=prompt_lookup, fixed_draft_length=fixed_draft_length)
    return _workers[key]


def user(text):
    return [{"role": "user", "content": text}]


def reference(served, messages, max_tokens=MAX_TOKENS):
    text = served.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    tokens = served.tokenizer.encode(text, add_special_tokens=False)
    return generate(served.model, served.tokenizer, tokens, max_tokens=max_tokens, prefill_step_size=8)


def drive(worker, bodies, on_step=None, kind="chat"):
    """Submit every request at once and step the worker until all are answered;
    returns each job's events."""
    jobs = [worker.provider.make_job(parse_request({"max_tokens": MAX_TOKENS, "temperature": 0, **b}, kind,
                                                   ServerDefaults(max_tokens=MAX_TOKENS))) for b in bodies]
    for job in jobs:
        worker.submit(job)
    worker._take_jobs(wait=False)
    step = 0
    while worker.streams or worker.backlog:
        worker._admit()
        worker.step()
        step += 1
        if on_step is not None:
            on_step(step, jobs)
    events = []
    for job in jobs:
        got = []
        while not job.events.empty():
            got.append(job.events.get())
        events.append(got)
    return events


def result(events):
    assert events[-1][0] == "done", events[-1]
    return events[-1][1]


@pytest.mark.parametrize("name", ["dense", "gpt_oss", "hybrid"])
def test_concurrent_greedy_answers_equal_solo(model_dirs, name):
    worker = worker_for(model_dirs, name)
    served = worker.provider.default
    served.prompt_cache = type(served.prompt_cache)(0)  # no reuse: every answer from scratch
    bodies = [{"messages": user(q), "stream": i % 2 == 1} for i, q in enumerate(QUESTIONS)]
    events = drive(worker, bodies)  # 5 requests, 3 at a time: later ones join as others finish
    for body, got in zip(bodies, events):
        answer = result(got)
        want = reference(served, body["messages"])
        assert answer.text == (want[: want.index(body["stop"])] if "stop" in body else want), (name, body)
        if body["stream"]:
            assert "".join(e[1] for e in got if e[0] == "delta") == answer.text


def continues_like_a_fresh_feed(served, key, prompt_cache):
    """One more token through a stored cache gives the logits of feeding key + it afresh."""
    probe = mx.array([[7]])
    got = served.model(probe, cache=prompt_cache)[0, -1]
    want = served.model(mx.array([list(key) + [7]]))[0, -1]
    return mx.allclose(got, want, rtol=1e-4, atol=1e-4).item()


@pytest.mark.parametrize("name", ["dense", "hybrid"])
def test_prompt_lookup_speculates_inside_the_batch(model_dirs, name):
    worker = worker_for(model_dirs, name, prompt_lookup=True)
    served = worker.provider.default
    served.prompt_cache = type(served.prompt_cache)(10)
    questions = [q + " " + q for q in QUESTIONS]  # something to look up
    bodies = [{"messages": user(q), "num_draft_tokens": 1 + i % 3} for i, q in enumerate(questions)]
    bodies[1]["stream"] = True
    full = reference(served, bodies[3]["messages"])
    bodies[3]["stop"] = full[3:5]  # a stop string inside accepted drafts leaves the rest out of the answer
    events = drive(worker, bodies)
    for body, got in zip(bodies, events):
        answer = result(got)
        want = reference(served, body["messages"])
        assert answer.text == (want[: want.index(body["stop"])] if "stop" in body else want), (name, body)
        spec = answer.speculation  # per request, as the one-at-a-time worker reports it
        assert spec.num_target_forwards == sum(spec.draft_lengths)
        assert len(spec.draft_lengths) <= 1 + body["num_draft_tokens"]  # the request's cap
    assert worker.generator.stats().draft_tokens > 0
    assert sum(result(e).speculation.num_drafted for e in events) > 0
    # Every stored cache holds exactly the tokens of its key (past a stop string too).
    for key in served.prompt_cache.keys():
        fetched = served.prompt_cache.fetch(list(key) + [1])
        assert fetched.num_cached == len(key) and continues_like_a_fresh_feed(served, key, fetched.prompt_cache)


def test_stop_string_and_cancel_leave_the_others_alone(model_dirs):
    worker = worker_for(model_dirs, "hybrid")
    served = worker.provider.default
    full = reference(served, user(QUESTIONS[1]))
    stop = full[3:5]
    bodies = [{"messages": user(QUESTIONS[0])}, {"messages": user(QUESTIONS[1]), "stop": stop},
              {"messages": user(QUESTIONS[3]), "stream": True}]

    def cancel_third(step, jobs):
        if sum(e[0] == "delta" for e in list(jobs[2].events.queue)) >= 2:  # mid-generation
            jobs[2].cancelled.set()

    events = drive(worker, bodies, cancel_third)
    assert result(events[0]).text == reference(served, bodies[0]["messages"])
    stopped = result(events[1])
    assert stopped.text == full[: full.index(stop)] and stopped.finish_reason == "stop"
    cancelled = result(events[2])
    assert 0 < cancelled.completion_tokens < MAX_TOKENS
    assert reference(served, bodies[2]["messages"]).startswith(cancelled.text)


def test_cancel_during_prefill_keeps_what_was_fed(model_dirs):
    worker = worker_for(model_dirs, "dense")
    served = worker.provider.default
    served.prompt_cache = type(served.prompt_cache)(10)
    messages = user(" ".join(QUESTIONS))

    def cancel(step, jobs):
        if step == 1:  # noticed after the next step's chunk
            jobs[0].cancelled.set()

    assert drive(worker, [{"messages": messages}], cancel) == [[]]  # the client is gone: nothing sent
    (key,) = served.prompt_cache.keys()
    tokens = worker.provider.make_job(parse_request({"messages": messages}, "chat", ServerDefaults())).tokens
    assert len(key) == 16 and list(key) == tokens[:16]  # two chunks of 8 went in
    again = result(drive(worker, [{"messages": messages}])[0])
    assert again.cached_tokens == 16 and again.text == reference(served, messages)


def test_prompt_cache_reuse_per_sequence(model_dirs):
    worker = worker_for(model_dirs, "hybrid")
    served = worker.provider.default
    served.prompt_cache = type(served.prompt_cache)(10)
    first = [{"messages": user(QUESTIONS[3])}, {"messages": user(QUESTIONS[2])}]
    answers = [result(e) for e in drive(worker, first)]
    # The hybrid cache cannot trim: each prompt was also stored without its last token.
    again = [result(e) for e in drive(worker, first)]
    assert [a.text for a in again] == [a.text for a in answers]
    assert all(a.cached_tokens > 0 for a in again) and all(a.cached_tokens == 0 for a in answers)
    # The next turn of a chat extends the stored prompt + answer.
    turn = user(QUESTIONS[3]) + [{"role": "assistant", "content": answers[0].text}, *user("And then?")]
    follow = result(drive(worker, [{"messages": turn}])[0])
    assert follow.cached_tokens > 0 and follow.text == reference(served, turn)


def test_seeded_sampling_is_reproducible_per_request(model_dirs):
    worker = worker_for(model_dirs, "dense")
    seeded = {"messages": user("Sample me."), "temperature": 1.0, "seed": 11}
    alone = result(drive(worker, [seeded])[0]).text
    crowd = drive(worker, [{"messages": user(q), "temperature": 1.0} for q in QUESTIONS[:2]] + [seeded])
    assert result(crowd[2]).text == alone


def test_logprobs_and_bad_requests(model_dirs):
    worker = worker_for(model_dirs, "dense")
    events = drive(worker, [{"messages": user("Hi."), "logprobs": True, "top_logprobs": 2},
                            {"messages": user("Hi."), "num_draft_tokens": 2}])  # no --prompt-lookup
    answer = result(events[0])
    assert len(answer.logprobs) == answer.completion_tokens and all(len(e.top) == 2 for e in answer.logprobs)
    assert events[1][-1][0] == "error" and events[1][-1][1] == 400


def test_max_batch_size_flag():
    assert setup_arg_parser().parse_args(["--model", "m"]).max_batch_size == 8
    assert setup_arg_parser().parse_args(["--model", "m", "--max-batch-size", "1"]).max_batch_size == 1


@pytest.mark.parametrize("flags", [[], ["--prompt-lookup"], ["--draft-model"]])
def test_http_concurrent_clients(model_dirs, tmp_path, flags):
    if flags == ["--draft-model"]:  # an attention-only draft speculates inside the batch
        flags = flags + [str(write_checkpoint(tmp_path / "draft", TINY_CONFIGS["qwen3"], scale=0.45))]
    server = start_server("batched", model_dirs["dense"], tmp_path / "server.log",
                          flags=["--max-tokens", str(MAX_TOKENS), "--max-batch-size", "4", *flags]).wait_ready()
    try:
        served = worker_for(model_dirs, "dense").provider.default
        prompts = [user(f"Client number {i} asks a question.") for i in range(6)]

        def ask(i):
            kwargs = dict(model="default_model", max_tokens=MAX_TOKENS, temperature=0, messages=prompts[i])
            if i % 2:
                chunks = server.client.chat.completions.create(stream=True, **kwargs)
                return "".join(c.choices[0].delta.content or "" for c in chunks)
            return server.client.chat.completions.create(**kwargs).choices[0].message.content

        with ThreadPoolExecutor(6) as pool:
            got = list(pool.map(ask, range(6)))
        assert got == [reference(served, p) for p in prompts]
        assert "batch of" in server.log()
    finally:
        server.process.terminate()
        server.process.wait(timeout=30)


def test_worker_fails_fast_and_stays_up(model_dirs, monkeypatch):
    worker = worker_for(model_dirs, "hybrid")
    model_class = type(worker.provider.default.model)
    monkeypatch.setattr(model_class, "supports_speculative_rollback", False)
    with pytest.raises(ValueError, match="roll back"):
        BatchWorker(worker.provider, prompt_lookup=True)  # at startup, not at the first request
    monkeypatch.undo()

    def broken(tokens, **options):
        raise RuntimeError("disk on fire")

    served = worker.provider.default
    monkeypatch.setattr(served.prompt_cache, "fetch", broken)
    events = drive(worker, [{"messages": user("Hi.")}])
    assert events[0][-1][:2] == ("error", 500) and "disk on fire" in events[0][-1][2]
    monkeypatch.undo()
    assert result(drive(worker, [{"messages": user("Hi.")}])[0]).text == reference(served, user("Hi."))


class RightLookup:
    """Drafts the solo answer: every draft accepted, several tokens a step."""

    def __init__(self, answer):
        self.answer, self.committed = answer or [], -1  # the first extend is the prompt's last token

    def extend(self, tokens):
        self.committed += len(tokens)

    def lookup(self, k):
        start = max(self.committed, 0)
        return self.answer[start : start + k]


def test_stop_string_inside_a_speculated_step(model_dirs, monkeypatch):
    from mlx_lm import batch_drafters
    from mlx_lm.generate import generate_step

    worker = worker_for(model_dirs, "dense", prompt_lookup=True, fixed_draft_length=True)  # 3 drafts a round
    served = worker.provider.default
    served.prompt_cache = type(served.prompt_cache)(10)
    messages = user("Stop me in the middle.")
    tokens = worker.provider.make_job(parse_request({"messages": messages}, "chat", ServerDefaults())).tokens
    answer = [t for t, _ in generate_step(mx.array(tokens), served.model, max_tokens=MAX_TOKENS)]
    monkeypatch.setattr(batch_drafters, "PromptLookup", lambda n, context=(): RightLookup(
        answer if list(context) == tokens else None))
    full = reference(served, messages)
    stop = served.tokenizer.decode(answer[1:2])  # reported with the draft after it, in one step
    got = result(drive(worker, [{"messages": messages, "stop": stop, "num_draft_tokens": 3}])[0])
    assert got.text == full[: full.index(stop)] and got.finish_reason == "stop"
    (key,) = [k for k in served.prompt_cache.keys() if len(k) > len(tokens)]
    assert len(key) > len(tokens) + got.completion_tokens  # the drafts past the stop string are in the cache
    fetched = served.prompt_cache.fetch(list(key) + [1])
    assert fetched.num_cached == len(key) and continues_like_a_fresh_feed(served, key, fetched.prompt_cache)


@pytest.mark.parametrize("draft", ["dense", "hybrid"])
def test_draft_model_speculates_inside_the_batch(draft, model_dirs, tmp_path):
    if draft == "dense":
        draft_dir = write_checkpoint(tmp_path / "draft", TINY_CONFIGS["qwen3"], scale=0.45)  # agrees about half the time
    else:
        draft_dir = model_dirs["hybrid"]  # recurrent rows roll back from its layers' records
    provider = ModelProvider(str(model_dirs["dense"]), str(draft_dir), False, 10, 1 << 40, None)
    worker = BatchWorker(provider, prefill_step_size=8, max_batch_size=3)
    served = provider.default
    bodies = [{"messages": user(q), "stream": i == 1} for i, q in enumerate(QUESTIONS)]
    for body, got in zip(bodies, drive(worker, bodies)):
        answer = result(got)
        assert answer.text == reference(served, body["messages"])
        assert answer.speculation.num_target_forwards >= 1
    assert worker.generator.stats().draft_tokens > 0
    assert worker.generator.stats().accepted_tokens > 0 or draft == "hybrid"


DEMO = Path(__file__).resolve().parent.parent / "examples" / "models"
_demo_workers = {}


def demo_worker(drafter):
    """A batch worker on the demo target speculating with `drafter`: its trained draft
    model, prompt lookup or its MTP head (each accepted most of the time), drafting
    its cap every round."""
    if drafter not in _demo_workers:
        target = str(DEMO / "qwen3-next-stdlib")
        draft = str(DEMO / "qwen3-draft-stdlib") if drafter == "draft" else None
        provider = ModelProvider(target, draft, False, 10, 1 << 40, None, mtp=drafter == "mtp")
        _demo_workers[drafter] = BatchWorker(provider, prefill_step_size=8, max_batch_size=4,
                                             prompt_lookup=drafter == "lookup", fixed_draft_length=True)
    return _demo_workers[drafter]


@pytest.mark.parametrize("drafter", ["draft", "lookup", "mtp"])
def test_a_stop_string_in_a_step_that_also_ends_the_row(drafter):
    """A stop string met on a token before the last of a speculated step whose last
    token also reaches max_tokens: the batch retires the row in that step, the answer
    is cut at the stop, and the worker goes on (it used to die on a KeyError)."""
    worker = demo_worker(drafter)
    served = worker.provider.default
    base = "def fibonacci(n):\n    "
    before = generate_step(mx.array(served.tokenizer.encode(base)), served.model, max_tokens=8)
    prompt = base + served.tokenizer.decode([t for t, _ in before]) + "\n\n" + base  # a lookup finds drafts
    answer = [t for t, _ in generate_step(mx.array(served.tokenizer.encode(prompt)), served.model, max_tokens=8)]
    bodies, wanted = [], []
    for max_tokens in range(1, 7):
        full = served.tokenizer.decode(answer[:max_tokens])
        for i in range(max_tokens):
            stop = served.tokenizer.decode(answer[i : i + 1])
            if stop.strip() and "\ufffd" not in stop:
                bodies.append({"prompt": prompt, "max_tokens": max_tokens, "stop": [stop], "stream": i % 2 == 1})
                wanted.append((full[: full.index(stop)], "stop"))
    assert len(bodies) >= 10
    for body, want, got in zip(bodies, wanted, drive(worker, bodies, kind="text")):
        answer_ = result(got)
        assert (answer_.text, answer_.finish_reason) == want, body
        if body["stream"]:
            assert "".join(e[1] for e in got if e[0] == "delta") == answer_.text
    plain = {"prompt": prompt, "max_tokens": 6}
    assert result(drive(worker, [plain], kind="text")[0]).text == served.tokenizer.decode(answer[:6])
    assert not worker.streams and len(worker.generator) == 0


def test_a_failure_anywhere_in_a_step_fails_its_requests_and_the_worker_goes_on(model_dirs, monkeypatch):
    worker = worker_for(model_dirs, "dense")
    served = worker.provider.default

    def broken(response):
        raise RuntimeError("lost the thread")

    monkeypatch.setattr(worker, "_deliver", broken)  # past generator.next(): the step's own handling
    events = drive(worker, [{"messages": user(q)} for q in QUESTIONS[:2]])
    assert all(e[-1][:2] == ("error", 500) and "lost the thread" in e[-1][2] for e in events)
    monkeypatch.undo()
    assert result(drive(worker, [{"messages": user("Hi.")}])[0]).text == reference(served, user("Hi."))


def test_a_started_worker_says_whether_it_runs(model_dirs, monkeypatch):
    provider = worker_for(model_dirs, "dense").provider
    worker = BatchWorker(provider, prefill_step_size=8)
    assert not worker.alive  # not started

    def dies(wait):
        raise SystemExit("gone")

    monkeypatch.setattr(worker, "_take_jobs", dies)
    worker.start()
    worker._thread.join(timeout=30)
    assert not worker.alive


def test_a_seeded_sample_depends_on_nothing_else():
    """The same seed and prompt give the same text fresh, after a request that ended
    on a stop at its first token, beside other requests (seeded or not), and cut short
    by a smaller max_tokens; an unseeded request is not fixed by a seeded one."""
    worker = demo_worker("draft")
    worker.provider.default.prompt_cache = type(worker.provider.default.prompt_cache)(10)
    seeded = {"prompt": "def fibonacci(n):", "temperature": 0.9, "seed": 3, "max_tokens": 12}
    alone = result(drive(worker, [seeded], kind="text")[0]).text
    stopped = result(drive(worker, [{"prompt": "def fibonacci(n):", "max_tokens": 12, "stop": ["\n", " "]}],
                           kind="text")[0])
    assert stopped.completion_tokens <= 2
    crowd = [{"prompt": "import os", "temperature": 0.9}, seeded, {"prompt": "class A:", "seed": 8, "temperature": 1}]
    again = drive(worker, crowd, kind="text")
    assert result(again[1]).text == alone and len(alone) > 10
    short = result(drive(worker, [dict(seeded, max_tokens=2)], kind="text")[0]).text
    assert alone.startswith(short) and short
    mx.random.seed(5)
    expected = mx.random.uniform().item()
    mx.random.seed(5)
    drive(worker, [seeded], kind="text")
    assert mx.random.uniform().item() == expected


@pytest.mark.parametrize("drafter", ["--draft-model", "--prompt-lookup", "--mtp"])
def test_the_batch_server_survives_careless_clients(drafter, tmp_path):
    """A batch server on the demo target speculating with each drafter, hit at once by
    the requests that used to stop it or corrupt it: stop strings met inside a
    speculated step that also ends the row, clients leaving mid-stream (their caches
    stored with a round queued), requests with penalties (they never draft), seeded
    and malformed ones. Then it answers exactly and /health says ok."""
    flags = [drafter] + ([str(DEMO / "qwen3-draft-stdlib")] if drafter == "--draft-model" else [])
    server = start_server(drafter, DEMO / "qwen3-next-stdlib", tmp_path / "server.log",
                          flags=flags + ["--max-batch-size", "4", "--fixed-draft-length"]).wait_ready()
    prompt = "def fibonacci(n):"
    try:
        def complete(**body):
            return server.raw("POST", "/v1/completions", json.dumps({"prompt": prompt, **body}))

        def leave_mid_stream(max_tokens):
            connection = socket.create_connection(server.address)
            body = json.dumps({"prompt": prompt, "max_tokens": max_tokens, "stream": True}).encode()
            connection.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n%s"
                               % (len(body), body))
            connection.recv(200)  # the headers, maybe a chunk
            connection.close()
            return None

        careless = [lambda m=m: complete(max_tokens=m, stop=["\n"], temperature=0) for m in (1, 2, 3, 5)]
        careless += [lambda m=m: complete(max_tokens=m, stop=["\n", " "], seed=4, temperature=0.9) for m in (2, 6)]
        careless += [lambda m=m: leave_mid_stream(m) for m in (30, 60)]
        careless += [lambda: complete(max_tokens=60, presence_penalty=0.5),
                     lambda: server.raw("POST", "/v1/completions", b'{"prompt": "x", "max_tokens": "many"}')]
        with ThreadPoolExecutor(6) as pool:
            answers = list(pool.map(lambda ask: ask(), careless))
        for answer in answers[:6] + answers[8:9]:
            assert answer[0] == 200 and answer[1]["choices"][0]["finish_reason"] in ("stop", "length"), answer
        assert answers[9][0] == 400
        for max_tokens in (1, 2, 3, 5):
            got = complete(max_tokens=max_tokens, stop=["\n"], temperature=0)[1]["choices"][0]["text"]
            assert "\n" not in got
        seeded = complete(max_tokens=6, stop=["\n", " "], seed=4, temperature=0.9)[1]["choices"][0]["text"]
        assert seeded == answers[5][1]["choices"][0]["text"]
        status, body = complete(max_tokens=24, temperature=0)
        model, tokenizer = demo_model()
        assert status == 200 and body["choices"][0]["text"] == generate(model, tokenizer, prompt, max_tokens=24)
        assert server.raw("GET", "/health") == (200, {"status": "ok"})
    finally:
        server.process.terminate()
        server.process.wait(timeout=30)


@functools.lru_cache(maxsize=None)
def demo_model():
    from mlx_lm import load

    return load(str(DEMO / "qwen3-next-stdlib"))
