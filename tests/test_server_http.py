"""server.py, the HTTP layer under hostile clients: cross-origin pages, malformed
bodies, slow and idle connections, bursts, half-closed and vanished clients, IPv6,
a busy port. Each hostile request is followed by a normal one, which must be answered
promptly and exactly (compared with plain in-process generation), by a live process.

Servers (subprocesses, shared by the module): a dense target with a dense draft and a
hybrid (Gated DeltaNet) target with the same draft, both with small connection limits
and timeouts so the tests run in seconds.
"""

import contextlib
import http.client
import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
import types

import pytest
from server_harness import write_server_models, start_server

from mlx_lm.generate import generate
from mlx_lm.openai_api import RequestError, ServerDefaults
from mlx_lm.server import APIServer, setup_arg_parser
from mlx_lm.metrics import Metrics
from mlx_lm.serving import Job
from mlx_lm.utils import load

MAX_TOKENS = 8
TIMEOUT = 2  # --request-timeout of the test servers, seconds
MAX_CONNECTIONS = 24
GOOD_ORIGIN = "http://good.example"
FLAGS = ["--max-tokens", str(MAX_TOKENS), "--request-timeout", str(TIMEOUT),
         "--max-connections", str(MAX_CONNECTIONS), "--allowed-origins", GOOD_ORIGIN,
         "--max-batch-size", "1"]  # one at a time: later requests queue (the probes, the backlog)
MESSAGES = [{"role": "user", "content": "Say something."}]


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory):
    return write_server_models(tmp_path_factory.mktemp("http_models"))


@pytest.fixture(scope="module")
def servers(model_dirs, tmp_path_factory):
    logs = tmp_path_factory.mktemp("http_logs")
    started = {name: start_server(name, model_dirs[name], logs / f"{name}.log", model_dirs["draft"], FLAGS)
               for name in ("dense", "hybrid")}
    yield started
    for server in started.values():
        server.process.terminate()
        server.process.wait(timeout=30)


@pytest.fixture(params=["dense", "hybrid"])
def server(request, servers):
    return servers[request.param].wait_ready()


@pytest.fixture
def dense(servers):
    return servers["dense"].wait_ready()


_references = {}


def reference(model_dir, messages=MESSAGES, max_tokens=MAX_TOKENS):
    """Plain greedy generation in this process."""
    key = (model_dir, json.dumps(messages), max_tokens)
    if key not in _references:
        model, tokenizer = load(str(model_dir))
        text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        tokens = tokenizer.encode(text, add_special_tokens=False)
        _references[key] = generate(model, tokenizer, tokens, max_tokens=max_tokens)
    return _references[key]


def assert_serves(server):
    """A normal request is answered within a few seconds, exactly, by a live process."""
    start = time.time()
    client = server.client
    try:
        response = client.chat.completions.create(model="default_model", messages=MESSAGES, temperature=0,
                                                  max_tokens=MAX_TOKENS)
    finally:
        client.close()
    assert time.time() - start < 10
    assert response.choices[0].message.content == reference(server.target_dir)
    assert server.process.poll() is None


def post(server, path, body, headers=None):
    """(status, headers, decoded JSON body) of one POST on a fresh connection."""
    connection = http.client.HTTPConnection(*server.address, timeout=30)
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    connection.request("POST", path, body=data, headers=headers or {})
    response = connection.getresponse()
    payload = response.read()
    connection.close()
    return response.status, response.headers, json.loads(payload) if payload else None


def options(server, headers):
    connection = http.client.HTTPConnection(*server.address, timeout=30)
    connection.request("OPTIONS", "/v1/chat/completions", headers=headers)
    response = connection.getresponse()
    response.read()
    connection.close()
    return response.status, response.headers


def read_until_closed(sock, limit=30):
    sock.settimeout(limit)
    data = b""
    while True:
        chunk = sock.recv(65536)
        if not chunk:
            return data
        data += chunk


def proc_status(server):
    fields = dict(line.split(":", 1) for line in open(f"/proc/{server.process.pid}/status"))
    return int(fields["Threads"]), int(fields["VmRSS"].split()[0]) // 1024  # threads, MiB


def wait_for(condition, timeout=10.0):
    deadline = time.time() + timeout
    while not condition():
        if time.time() > deadline:
            return False
        time.sleep(0.05)
    return True


# ---------------------------------------------------------------------------
# Cross-origin requests.


def test_web_pages_from_other_origins_are_refused(dense):
    generations = dense.log().count("prompt tokens")
    # The "simple" request a page may send without a preflight: refused before any work.
    status, headers, body = post(dense, "/v1/completions", {"prompt": "x", "max_tokens": 2},
                                 {"Origin": "http://evil.example", "Content-Type": "text/plain"})
    assert status == 403 and body["error"]["type"] == "permission_error"
    assert "'http://evil.example'" in body["error"]["message"] and "--allowed-origins" in body["error"]["message"]
    assert "Access-Control-Allow-Origin" not in headers
    status, headers = options(dense, {"Origin": "http://evil.example", "Access-Control-Request-Method": "POST"})
    assert status == 403 and "Access-Control-Allow-Origin" not in headers
    assert dense.log().count("prompt tokens") == generations
    # The listed origin is granted, by name.
    status, headers = options(dense, {"Origin": GOOD_ORIGIN, "Access-Control-Request-Method": "POST",
                                      "Access-Control-Request-Headers": "content-type"})
    assert status == 204 and headers["Access-Control-Allow-Origin"] == GOOD_ORIGIN
    assert "POST" in headers["Access-Control-Allow-Methods"] and headers["Vary"] == "Origin"
    status, headers, body = post(dense, "/v1/chat/completions", {"messages": MESSAGES, "temperature": 0},
                                 {"Origin": GOOD_ORIGIN, "Content-Type": "application/json"})
    assert status == 200 and headers["Access-Control-Allow-Origin"] == GOOD_ORIGIN
    assert body["choices"][0]["message"]["content"] == reference(dense.target_dir)
    # Clients that are not web pages send no Origin and get no grant.
    status, headers, _ = post(dense, "/v1/chat/completions", {"messages": MESSAGES})
    assert status == 200 and "Access-Control-Allow-Origin" not in headers
    assert_serves(dense)


# ---------------------------------------------------------------------------
# Malformed requests: always a JSON error, never a dropped connection.

DEEP = b'{"messages": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"
MALFORMED = [
    ({"messages": [{"role": "assistant", "content": "x", "tool_calls": 5}]}, 400, "'messages[0].tool_calls'"),
    ({"messages": [{"role": "assistant", "content": "x", "tool_calls": [5]}]}, 400, "'messages[0].tool_calls[0]'"),
    ({"messages": [{"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": 5}}]}]}, 400,
     "tool_calls[0].function.arguments"),
    ({"messages": MESSAGES, "tools": [5]}, 400, "'tools[0]'"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, 400, "'messages[0].content[]'"),
    (DEEP, 400, "deeper than 64 levels"),
    ({"messages": MESSAGES, "x": json.loads("[" * 200 + "]" * 200)}, 400, "deeper than 64 levels (at 'x[0][0]"),
    (b'{"messages": [{"role": "user", "content": "\\ud800"}]}', 400, "'messages[0].content' is not valid Unicode"),
    (b'{"messages": [{"role": "user", "content": [{"type": "text", "text": "a\\udfff"}]}]}', 400,
     "'messages[0].content[0].text' is not valid Unicode"),
    (b'{"messages": [{"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": '
     b'"{\\"a\\": \\"\\\\ud800\\"}"}}]}]}', 400, "'messages[0].tool_calls[0].function.arguments.a'"),
    (b'{"messages": [], "seed": ' + b"1" * 5000 + b"}", 400, "not valid JSON"),
]


@pytest.mark.parametrize("body, status, message", MALFORMED, ids=range(len(MALFORMED)))
def test_malformed_bodies_get_json_errors(server, body, status, message):
    got_status, headers, got = post(server, "/v1/chat/completions", body, {"Content-Type": "application/json"})
    assert got_status == status and headers["Content-Type"] == "application/json"
    assert message in got["error"]["message"] and got["error"]["type"] == "invalid_request_error", got
    assert_serves(server)


def test_protocol_errors_get_json_errors_and_close(dense):
    for raw, status in [(b"NONSENSE\r\n\r\n", 400), (b"PUT /v1/models HTTP/1.1\r\nHost: x\r\n\r\n", 405),
                        (b"POST /v1/completions HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\n0\r\n\r\n", 411),
                        (b"GET /health HTTP/1.1\r\nX: " + b"y" * 70_000 + b"\r\n\r\n", 431)]:
        assert protocol_error(dense, raw)["code"] == status
    assert_serves(dense)


def protocol_error(server, raw):
    """The JSON error a raw request gets; the server closes the connection after it
    (no second reading of the stream)."""
    sock = socket.create_connection(server.address)
    sock.sendall(raw)
    reply = read_until_closed(sock)
    sock.close()
    head, body = reply.split(b"\r\n\r\n", 1)
    assert head.startswith(b"HTTP/1.") and b"Content-Type: application/json" in head, reply[:200]
    error = json.loads(body)["error"]
    assert int(head.split()[1]) == error["code"], reply[:200]
    return error


BODY = json.dumps({"messages": MESSAGES, "max_tokens": 1}).encode()
BAD_LENGTHS = [
    ([b"1" * 5000], "more than 18 digits"),  # once a 500 with a traceback: int() refuses 4300+ digits
    ([b"\xb2"], "'\u00b2'"),  # a Latin-1 superscript two: str.isdigit() says yes, int() says no
    ([b"-5"], "'-5'"),
    ([b"%d" % len(BODY), b"%d" % (len(BODY) - 1)], "2 Content-Length headers"),
    ([b"%d" % len(BODY)] * 2, "2 Content-Length headers"),  # identical duplicates too: send exactly one
]


@pytest.mark.parametrize("lengths, message", BAD_LENGTHS, ids=range(len(BAD_LENGTHS)))
def test_bad_content_lengths_are_400_naming_the_header(dense, lengths, message):
    head = b"".join(b"Content-Length: %s\r\n" % value for value in lengths)
    error = protocol_error(dense, b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n" + head + b"\r\n" + BODY)
    assert error["code"] == 400 and error["type"] == "invalid_request_error", error
    assert "Content-Length" in error["message"] and message in error["message"], error
    assert len(error["message"]) < 300  # the 5000 digits are not echoed back
    assert_serves(dense)


def test_a_zero_padded_content_length_is_its_value(dense):
    status, _, body = post(dense, "/v1/chat/completions", BODY, {"Content-Length": "0" * 5000 + str(len(BODY))})
    assert status == 200 and body["usage"]["completion_tokens"] == 1, body


def test_unread_bodies_are_never_parsed_as_requests(dense):
    """Bytes the server did not read as a body (a refused request's, or a body sent
    to GET) must not be answered as a second, smuggled request."""
    smuggled = b"GET /v1/models HTTP/1.1\r\nHost: x\r\n\r\n"
    for head in [b"POST /v1/completions HTTP/1.1\r\nOrigin: http://evil.example\r\n",
                 b"GET /health HTTP/1.1\r\n",
                 b"GET /health HTTP/1.1\r\nContent-Length: 0\r\n",  # and a second one: the body's length
                 b"POST /v1/completions HTTP/1.1\r\nContent-Length: 10\r\nTransfer-Encoding: chunked\r\n"]:
        sock = socket.create_connection(dense.address)
        length = b"" if b"Transfer-Encoding" in head else b"Content-Length: %d\r\n" % len(smuggled)
        sock.sendall(head + length + b"Host: x\r\n\r\n" + smuggled)
        reply = read_until_closed(sock)
        sock.close()
        assert reply.count(b"HTTP/1.1 ") == 1 and b'"object": "list"' not in reply, reply
    assert_serves(dense)


# ---------------------------------------------------------------------------
# Slow, idle and numerous connections.


def test_short_body_times_out_with_408(server):
    sock = socket.create_connection(server.address)
    start = time.time()
    sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\n{\"messages\"")
    reply = read_until_closed(sock, limit=TIMEOUT + 10)  # the server closes it
    elapsed = time.time() - start
    sock.close()
    head, body = reply.split(b"\r\n\r\n", 1)
    assert head.startswith(b"HTTP/1.1 408") and b"--request-timeout" in body
    assert TIMEOUT - 0.5 < elapsed < TIMEOUT + 5
    assert_serves(server)


@pytest.mark.parametrize("case", ["request_line", "headers", "second_request"])
def test_a_request_trickling_in_is_dropped_at_the_deadline(dense, case):
    """A byte every TIMEOUT/4 s never trips the per-read timeout; the request line and
    headers get TIMEOUT seconds in all, counted from the connect or, on a keep-alive
    connection, from the end of the previous answer. Then a 408 and a close."""
    sock = socket.create_connection(dense.address)
    if case == "second_request":
        sock.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
        answer = b""
        while not answer.endswith(b'{"status": "ok"}'):
            answer += sock.recv(65536)
    began = time.time()
    sock.sendall(b"" if case == "request_line" else b"GET /health HTTP/1.1\r\n")
    # The last byte goes out a little before the deadline, so that none is in flight
    # when the server closes (unread bytes would turn its close into a reset).
    while time.time() - began < TIMEOUT - 0.25:
        sock.send(b"y")
        time.sleep(TIMEOUT / 4)
    reply = read_until_closed(sock, limit=TIMEOUT + 5)
    closed_after = time.time() - began
    sock.close()
    head, body = reply.split(b"\r\n\r\n", 1)
    assert head.startswith(b"HTTP/1.1 408") and b"Connection: close" in head, reply[:300]
    assert "--request-timeout" in json.loads(body)["error"]["message"]
    assert TIMEOUT - 0.2 < closed_after < TIMEOUT + 0.75  # not a per-read timeout after the last byte
    assert_serves(dense)


def test_idle_connections_neither_pile_up_threads_nor_memory(dense):
    assert_serves(dense)
    time.sleep(TIMEOUT + 0.5)  # keep-alive connections of earlier tests time out
    threads_before, rss_before = proc_status(dense)
    # 200 connections opened and dropped at once.
    socks = [socket.create_connection(dense.address) for _ in range(200)]
    for sock in socks:
        sock.close()
    assert wait_for(lambda: proc_status(dense)[0] <= threads_before, 5)
    # A keep-alive connection left idle after its request, then 199 more held open and
    # silent: past the cap each new one takes the slot of the one that has waited
    # longest for a request (the kept one first), which is closed without a word.
    kept = socket.create_connection(dense.address)
    kept.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
    answer = b""
    while not answer.endswith(b'{"status": "ok"}'):  # headers and body may come in separate reads
        answer += kept.recv(65536)
    assert answer.startswith(b"HTTP/1.1 200")
    began = time.time()
    socks = [socket.create_connection(dense.address) for _ in range(200 - 1)]
    num_evicted = 200 - MAX_CONNECTIONS
    evicted = [read_until_closed(sock, limit=TIMEOUT + 10) for sock in [kept] + socks[:num_evicted - 1]]
    assert evicted == [b""] * num_evicted and time.time() - began < TIMEOUT - 0.5  # before any deadline
    assert wait_for(lambda: proc_status(dense)[0] <= threads_before + MAX_CONNECTIONS, 5)
    threads_held = proc_status(dense)[0]
    # The rest hold their slots until the deadline, and close without a word too.
    assert [read_until_closed(sock, limit=TIMEOUT + 10) for sock in socks[num_evicted - 1:]] == [b""] * MAX_CONNECTIONS
    assert time.time() - began > TIMEOUT - 0.2
    for sock in socks + [kept]:
        sock.close()
    assert wait_for(lambda: proc_status(dense)[0] <= threads_before, 5)
    threads_after, rss_after = proc_status(dense)
    print(f"threads {threads_before} -> {threads_held} (holding) -> {threads_after}; "
          f"RSS {rss_before} -> {rss_after} MiB")
    assert rss_after - rss_before < 20
    assert_serves(dense)


class _FakeProvider:
    """What the handler asks a provider before make_job: which model serves the
    request (the default), and whether its tokenizer renders chats."""

    default = types.SimpleNamespace(tokenizer=types.SimpleNamespace(has_chat_template=True))

    def resolve(self, request):
        return None


class _HeldProvider(_FakeProvider):
    """Holds each request in make_job (its connection is being served) until released."""

    model_id = "held"
    names = {"held"}

    def __init__(self):
        self.entered = threading.Semaphore(0)
        self.released = threading.Event()

    def make_job(self, request):
        self.entered.release()
        self.released.wait(30)
        raise RequestError(400, "released")


class _Worker:
    """Takes jobs and never answers them; `alive` as given."""

    def __init__(self, alive=True):
        self.alive, self.jobs, self.metrics = alive, [], Metrics()

    def submit(self, job):
        self.jobs.append(job)


@contextlib.contextmanager
def in_process(provider, max_connections, worker=None):
    """An APIServer in this process, serving `provider` with a stand-in worker."""
    server = APIServer("127.0.0.1", 0, ServerDefaults(), [], max_connections=max_connections, request_timeout=TIMEOUT)
    server.provider, server.worker = provider, worker or _Worker()
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield server
    finally:
        server.shutdown()
        server.server_close()


def get_health(address):
    connection = http.client.HTTPConnection(*address, timeout=30)
    connection.request("GET", "/health")
    response = connection.getresponse()
    body = json.loads(response.read())
    connection.close()
    return response.status, body


def test_waiting_connections_give_way_and_only_served_ones_refuse():
    """At --max-connections a new connection takes the slot of the one waiting longest
    for a request; only when every connection is being served is it refused with 503,
    by the accepting thread, at once."""
    provider = _HeldProvider()
    with in_process(provider, max_connections=3) as server:
        began = time.time()
        # Every slot held by a connection waiting for a request: a silent one, one with
        # part of a request line, one with part of its headers.
        waiting = [socket.create_connection(server.server_address) for _ in range(3)]
        waiting[1].sendall(b"GET /hea")
        waiting[2].sendall(b"GET /health HTTP/1.1\r\nHo")
        assert get_health(server.server_address) == (200, {"status": "ok"})
        assert read_until_closed(waiting[0], limit=TIMEOUT) == b""
        # Three requests being served take the other slots, one after the other.
        served = []
        for _ in range(3):
            served.append(socket.create_connection(server.server_address))
            served[-1].sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n%s"
                               % (len(b'{"prompt": "x"}'), b'{"prompt": "x"}'))
            assert provider.entered.acquire(timeout=10)
        assert [read_until_closed(sock, limit=TIMEOUT) for sock in waiting[1:]] == [b"", b""]
        with socket.create_connection(server.server_address) as sock:
            refused = read_until_closed(sock, limit=TIMEOUT)
        head, body = refused.split(b"\r\n\r\n", 1)
        assert head.startswith(b"HTTP/1.1 503") and b"Retry-After: 1" in head
        assert json.loads(body)["error"]["code"] == 503 and b"--max-connections" in body
        assert time.time() - began < TIMEOUT - 0.5  # nothing waited for a timeout
        provider.released.set()
        for sock in served:
            assert b'"released"' in read_until_closed(sock, limit=TIMEOUT + 5)
            sock.close()
        assert get_health(server.server_address) == (200, {"status": "ok"})
        for sock in waiting:
            sock.close()


def test_burst_of_connects_waits_in_the_backlog(dense):
    """With the server stopped, 16 connects must all complete in the kernel's accept
    queue (with the old backlog of 5, only 6 could until the server accepted)."""
    os.kill(dense.process.pid, signal.SIGSTOP)
    try:
        socks = [socket.socket() for _ in range(16)]
        for sock in socks:
            sock.setblocking(False)
            sock.connect_ex(dense.address)

        def connected():
            return sum(sock.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR) == 0 and _is_connected(sock)
                       for sock in socks)
        assert wait_for(lambda: connected() == 16, 5), connected()
    finally:
        os.kill(dense.process.pid, signal.SIGCONT)
    for sock in socks:
        sock.setblocking(True)
        sock.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
    for sock in socks:
        assert read_until_closed(sock, limit=10).startswith(b"HTTP/1.1 200")
        sock.close()
    assert_serves(dense)


def _is_connected(sock):
    try:
        sock.getpeername()
        return True
    except OSError:
        return False


# ---------------------------------------------------------------------------
# Clients that half-close or vanish.


NO_EOS = {"logit_bias": {"0": -100}}  # the tiny models' EOS id: long answers run their full length


def raw_chat(server, body):
    data = json.dumps({"messages": MESSAGES, "temperature": 0, **body}).encode()
    sock = socket.create_connection(server.address)
    sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                 b"Content-Length: %d\r\n\r\n" % len(data) + data)
    return sock


def sse_events(reply):
    """The events of a raw streamed reply, after any interim responses."""
    body = reply.split(b"HTTP/1.1 200 OK\r\n", 1)[1].split(b"\r\n\r\n", 1)[1]
    return body.decode().split("\n\n")


def test_half_closed_clients_get_their_answers(server):
    """A client that shuts down its sending side after the request still reads the
    answer, streamed or not. A stream outlasting --request-timeout is not cut."""
    # Queued behind a long stream, the half-closed ones see the interim 100 probes.
    blocker = raw_chat(server, {"max_tokens": 100_000, "stream": True, **NO_EOS})
    start = time.time()
    time.sleep(0.3)
    plain = raw_chat(server, {"max_tokens": MAX_TOKENS})
    plain.shutdown(socket.SHUT_WR)
    streamed = raw_chat(server, {"max_tokens": MAX_TOKENS, "stream": True})
    streamed.shutdown(socket.SHUT_WR)
    blocker.settimeout(TIMEOUT + 10)
    while time.time() - start < TIMEOUT + 1:
        assert b"data: {" in blocker.recv(65536)  # still streaming past the read timeout
    blocker.close()  # cancels it: the queue moves on
    replies = [read_until_closed(sock) for sock in (plain, streamed)]
    waited = time.time() - start
    expected = reference(server.target_dir)
    for reply in replies:
        assert reply.startswith(b"HTTP/1.1 100 Continue\r\n\r\n")  # the probe was exercised
    final = replies[0].split(b"HTTP/1.1 200 OK\r\n", 1)[1]
    assert json.loads(final.split(b"\r\n\r\n", 1)[1])["choices"][0]["message"]["content"] == expected
    events = sse_events(replies[1])
    chunks = [json.loads(e[len("data: "):]) for e in events if e.startswith("data: {")]
    assert "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks) == expected
    assert events[-2] == "data: [DONE]"
    print(f"half-closed clients answered after {waited:.1f} s in the queue")
    assert_serves(server)


def test_vanished_non_streaming_client_is_cancelled(server):
    before = server.log().count("Client disconnected; stopped after")
    sock = raw_chat(server, {"max_tokens": 5000, **NO_EOS})
    time.sleep(0.5)
    closed = time.time()
    sock.close()
    assert wait_for(lambda: server.log().count("Client disconnected; stopped after") > before, 5)
    noticed = time.time() - closed
    stopped = int(re.findall(r"Client disconnected; stopped after (\d+)", server.log())[-1])
    print(f"vanished client noticed after {noticed:.2f} s, {stopped} tokens generated")
    assert stopped < 5000
    assert_serves(server)


def test_an_empty_answer_is_an_empty_string_never_null(dense):
    """An answer ended by EOS at once: OpenAI sends "content": "" (null is for a reply
    that is only tool calls), and no stream delta carries a null either."""
    first_eos = {"logit_bias": {"0": 100}, "temperature": 0}  # token 0 is the tiny models' EOS
    status, _, body = post(dense, "/v1/chat/completions", {"messages": MESSAGES, **first_eos})
    assert status == 200 and body["choices"][0]["message"] == {"role": "assistant", "content": ""}, body
    assert body["choices"][0]["finish_reason"] == "stop"
    status, _, body = post(dense, "/v1/completions", {"prompt": "Say", **first_eos})
    assert status == 200 and body["choices"][0]["text"] == "" and body["choices"][0]["finish_reason"] == "stop"
    sock = raw_chat(dense, {"stream": True, **first_eos})
    events = sse_events(read_until_closed(sock))
    sock.close()
    deltas = [json.loads(e[len("data: "):])["choices"][0]["delta"] for e in events if e.startswith("data: {")]
    assert deltas[0] == {"role": "assistant", "content": ""} and deltas[-1] == {}, deltas
    assert all(isinstance(d.get("content", ""), str) for d in deltas), deltas


# ---------------------------------------------------------------------------
# Addresses, ports, names, help.


def test_ipv6_loopback_serves_or_is_refused_before_loading(model_dirs, tmp_path):
    try:
        socket.socket(socket.AF_INET6).bind(("::1", 0))
        has_ipv6 = True
    except OSError:
        has_ipv6 = False
    server = start_server("ipv6", model_dirs["dense"], tmp_path / "ipv6.log", flags=["--host", "::1"])
    try:
        if not has_ipv6:
            assert server.process.wait(timeout=60) != 0
            assert server.log().strip().splitlines()[-1].startswith("Error: cannot listen on [::1]:0")
            return
        assert wait_for(lambda: re.search(r"on http://\[::1\]:(\d+)", server.log()) or server.process.poll(), 60)
        port = int(re.search(r"on http://\[::1\]:(\d+)", server.log()).group(1))
        connection = http.client.HTTPConnection("::1", port, timeout=30)
        connection.request("POST", "/v1/chat/completions", json.dumps({"messages": MESSAGES, "temperature": 0,
                                                                      "max_tokens": MAX_TOKENS}))
        response = connection.getresponse()
        assert response.status == 200
        assert json.loads(response.read())["choices"][0]["message"]["content"] == reference(model_dirs["dense"])
    finally:
        server.process.terminate()
        server.process.wait(timeout=30)


def test_busy_port_is_a_one_line_error_before_loading(tmp_path):
    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen()
    port = taken.getsockname()[1]
    # A model that does not exist: reaching the load would give another error.
    command = [sys.executable, "-m", "mlx_lm.server", "--model", str(tmp_path / "missing"), "--port", str(port)]
    done = subprocess.run(command, capture_output=True, text=True, timeout=60)
    taken.close()
    lines = [line for line in done.stderr.splitlines() if not line.startswith("[transformers]")]
    assert done.returncode != 0
    assert lines == [f"Error: cannot listen on 127.0.0.1:{port}: address already in use"], done.stderr


def test_models_are_named_by_id_never_by_path(dense, model_dirs):
    connection = http.client.HTTPConnection(*dense.address, timeout=30)
    connection.request("GET", "/v1/models")
    listing = connection.getresponse().read().decode()
    assert [m["id"] for m in json.loads(listing)["data"]] == ["dense"]
    assert str(model_dirs["dense"].parent) not in listing
    connection.request("GET", "/v1/models/dense")
    response = connection.getresponse()
    assert response.status == 200 and json.loads(response.read())["id"] == "dense"
    connection.close()
    for name in ["dense", str(model_dirs["dense"]), "default_model"]:
        status, _, body = post(dense, "/v1/chat/completions", {"messages": MESSAGES, "model": name})
        assert status == 200 and body["model"] == "dense"
    status, _, body = post(dense, "/v1/chat/completions", {"messages": MESSAGES, "model": "other"})
    assert status == 404 and str(model_dirs["dense"].parent) not in body["error"]["message"]


def test_help_shows_defaults():
    text = " ".join(setup_arg_parser().format_help().split())
    for flag, default in [("--max-connections", "64"), ("--request-timeout", "30.0"), ("--host", "127.0.0.1"),
                          ("--port", "8080"), ("--allowed-origins", "none")]:
        entry = text[text.rindex(flag + " "):]  # its help entry (the usage line comes first)
        assert re.search(r"\(default: ([^)]*)\)", entry).group(1) == default, flag


class _BrokenProvider(_FakeProvider):
    """Fails in a way no request validation foresees."""

    model_id = "broken"
    names = {"broken"}

    def make_job(self, request):
        raise RuntimeError("an unforeseen bug")


def test_unexpected_handler_failures_are_500_json_and_the_server_lives_on():
    with in_process(_BrokenProvider(), max_connections=4) as server:
        connection = http.client.HTTPConnection(*server.server_address, timeout=30)
        for _ in range(2):  # the server, and a new connection, still work afterwards
            connection.request("POST", "/v1/chat/completions", json.dumps({"messages": MESSAGES}))
            response = connection.getresponse()
            body = json.loads(response.read())
            assert response.status == 500 and response.headers["Connection"] == "close"
            assert body["error"] == {"message": "internal server error: RuntimeError: an unforeseen bug",
                                     "type": "server_error", "param": None, "code": 500}
            connection.close()


class _JobProvider(_FakeProvider):
    model_id = "jobs"
    names = {"jobs"}

    def make_job(self, request):
        return Job(request, None, [1, 2, 3])


def test_a_dead_worker_is_reported_not_waited_for():
    """If the generation worker's thread has died, /health says so (503) and a request
    gets a 503 naming it at once, instead of waiting forever."""
    with in_process(_JobProvider(), max_connections=4, worker=_Worker(alive=False)) as server:
        status, body = get_health(server.server_address)
        assert status == 503 and "generation worker stopped" in body["error"]["message"]
        connection = http.client.HTTPConnection(*server.server_address, timeout=30)
        began = time.time()
        connection.request("POST", "/v1/chat/completions", json.dumps({"messages": MESSAGES}))
        response = connection.getresponse()
        body = json.loads(response.read())
        assert response.status == 503 and "generation worker stopped" in body["error"]["message"]
        assert time.time() - began < 5
        connection.close()
