"""generate.py: the token loop, streaming, and the mlx_lm.generate CLI."""

import io
import subprocess
import sys

import mlx.core as mx
import pytest

from mlx_lm import generate, load, stream_generate
from mlx_lm.generate import generate_step, speculative_generate_step
from mlx_lm.models.cache import RotatingKVCache, make_prompt_cache

PROMPT = [5, 17, 260, 33, 101, 7, 99, 300, 12, 45, 8]


@pytest.fixture(scope="module")
def tiny(tiny_model_dir):
    return load(str(tiny_model_dir))


def greedy_without_cache(model, prompt, num_tokens):
    """Reference: recompute the whole sequence for every token."""
    tokens = list(prompt)
    for _ in range(num_tokens):
        logits = model(mx.array(tokens)[None])[0, -1]
        tokens.append(mx.argmax(logits).item())
    return tokens[len(prompt) :]


def test_greedy_matches_uncached_recomputation(tiny):
    model, _ = tiny
    want = greedy_without_cache(model, PROMPT, 12)
    for prefill_step_size in (2048, 3):
        got = [t for t, _ in generate_step(mx.array(PROMPT), model, max_tokens=12,
                                           prefill_step_size=prefill_step_size)]
        assert got == want


def test_logprobs_are_normalised_and_match_tokens(tiny):
    model, _ = tiny
    for token, logprobs in generate_step(mx.array(PROMPT), model, max_tokens=3):
        assert logprobs.shape == (model.args.vocab_size,)
        assert abs(mx.logsumexp(logprobs).item()) < 1e-4
        assert mx.argmax(logprobs).item() == token


def test_cache_holds_prompt_and_every_yielded_token(tiny):
    model, _ = tiny
    cache = make_prompt_cache(model)
    tokens = [t for t, _ in generate_step(mx.array(PROMPT), model, max_tokens=6, prompt_cache=cache)]
    assert cache[0].offset == len(PROMPT) + 6
    # Continuing from the cache equals generating from the concatenation.
    follow_up = [3, 44]
    continued = [t for t, _ in generate_step(mx.array(follow_up), model, max_tokens=4, prompt_cache=cache)]
    fresh = greedy_without_cache(model, PROMPT + tokens + follow_up, 4)
    assert continued == fresh


def test_closing_early_leaves_consumed_tokens_cached(tiny):
    model, _ = tiny
    cache = make_prompt_cache(model)
    generator = generate_step(mx.array(PROMPT), model, max_tokens=50, prompt_cache=cache)
    for _ in range(3):
        next(generator)
    generator.close()
    assert cache[0].offset == len(PROMPT) + 3


def test_logits_processors_see_prompt_and_generated_tokens(tiny):
    model, _ = tiny
    seen = []

    def record(history, logits):
        seen.append(history.tolist())
        return logits

    tokens = [t for t, _ in generate_step(mx.array(PROMPT), model, max_tokens=3, logits_processors=[record])]
    # The last token is fed (and processed) too: the loop is pipelined.
    assert seen == [PROMPT + tokens[:i] for i in range(4)]


def test_sampler_and_processor_change_the_output(tiny):
    model, _ = tiny
    banned = greedy_without_cache(model, PROMPT, 1)[0]

    def ban(history, logits):
        return logits.at[:, banned].add(-1e9)

    first, _ = next(generate_step(mx.array(PROMPT), model, logits_processors=[ban]))
    assert first != banned
    constant = next(generate_step(mx.array(PROMPT), model, sampler=lambda lp: mx.array([42])))
    assert constant[0] == 42


def test_progress_callback_and_max_kv_size(tiny):
    model, _ = tiny
    calls = []
    list(generate_step(mx.array(PROMPT), model, max_tokens=2, prefill_step_size=4,
                       prompt_progress_callback=lambda done, total: calls.append((done, total))))
    assert calls == [(4, 11), (8, 11), (10, 11), (11, 11)]
    # A window larger than the whole run changes nothing.
    plain = [t for t, _ in generate_step(mx.array(PROMPT), model, max_tokens=8)]
    bounded = [t for t, _ in generate_step(mx.array(PROMPT), model, max_tokens=8, max_kv_size=64)]
    assert plain == bounded
    cache = make_prompt_cache(model, max_kv_size=8)
    list(generate_step(mx.array(PROMPT), model, max_tokens=8, prompt_cache=cache))
    assert isinstance(cache[0], RotatingKVCache) and cache[0].size() == 8


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(max_tokens=0), "max_tokens"),
        (dict(prefill_step_size=0), "prefill_step_size"),
        (dict(max_kv_size=8, prompt_cache=[]), "max_kv_size"),
    ],
)
def test_generate_step_rejects_bad_arguments(tiny, kwargs, message):
    model, _ = tiny
    with pytest.raises(ValueError, match=message):
        next(generate_step(mx.array(PROMPT), model, **kwargs))
    with pytest.raises(ValueError, match="prompt"):
        next(generate_step(mx.array([], dtype=mx.int32), model))


def test_stream_generate_text_and_finish_reasons(tiny):
    model, tokenizer = tiny
    responses = list(stream_generate(model, tokenizer, PROMPT, max_tokens=7))
    assert len(responses) == 7 and responses[-1].finish_reason == "length"
    assert all(r.finish_reason is None for r in responses[:-1])
    tokens = [r.token for r in responses]
    assert tokens == greedy_without_cache(model, PROMPT, 7)
    assert "".join(r.text for r in responses) == tokenizer.decode(tokens)
    assert responses[-1].generation_tokens == 7 and responses[-1].prompt_tokens == len(PROMPT)
    assert not any(r.from_draft for r in responses)

    # Make the first greedy token an EOS: one response, finish_reason "stop", no text.
    tokenizer.eos_token_ids = {tokens[0]}
    try:
        stopped = list(stream_generate(model, tokenizer, PROMPT, max_tokens=7))
    finally:
        tokenizer.eos_token_ids = {0}
    assert len(stopped) == 1 and stopped[0].finish_reason == "stop" and stopped[0].text == ""


def test_generate_returns_text_and_prints_stats(tiny, capsys):
    model, tokenizer = tiny
    text = generate(model, tokenizer, "def add(a, b):", max_tokens=5, verbose=True)
    out = capsys.readouterr().out
    assert text in out and "Prompt:" in out and "tokens-per-sec" in out and "Peak memory" in out
    assert text == generate(model, tokenizer, "def add(a, b):", max_tokens=5)


def run_main(argv, capsys, monkeypatch):
    """`mlx_lm <argv>` in this process (cli.main, which the console scripts and -m run),
    finished as the interpreter finishes a script: (exit status, stdout, stderr). An
    exception other than SystemExit escapes: on a command line it would be a traceback.
    A subprocess costs seconds of imports: only test_cli_generates_and_reports_speed
    starts one (test_imports runs every console script)."""
    from mlx_lm import cli

    monkeypatch.setattr(sys, "argv", ["mlx_lm", *argv])  # cli.main sets it for the command
    capsys.readouterr()
    try:
        cli.main(list(argv))
        status = 0
    except SystemExit as e:
        status = e.code
    out, err = capsys.readouterr()
    if isinstance(status, str):  # sys.exit("message"): printed to stderr, status 1
        return 1, out, err + status + "\n"
    return status or 0, out, err


def test_cli_generates_and_reports_speed(tiny_model_dir):
    result = subprocess.run([sys.executable, "-m", "mlx_lm.generate", "--model", str(tiny_model_dir), "--prompt", "hi",
                             "--max-tokens", "5", "--system-prompt", "be brief"], capture_output=True, text=True,
                            timeout=120)
    assert result.returncode == 0, result.stderr
    assert "Generation: " in result.stdout and "tokens-per-sec" in result.stdout
    assert "Compute dtype: float32 (auto: " in result.stdout
    assert "PyTorch was not found" not in result.stderr and "RuntimeWarning" not in result.stderr


def test_cli_reads_stdin_and_stays_quiet(tiny_model_dir, capsys, monkeypatch):
    monkeypatch.setattr(sys, "stdin", io.StringIO("import os\n"))
    status, out, err = run_main(["generate", "--model", str(tiny_model_dir), "--prompt", "-", "--max-tokens", "4",
                                 "--verbose", "false", "--ignore-chat-template", "--temp", "0.8", "--seed", "3"],
                                capsys, monkeypatch)
    assert status == 0, err
    assert "tokens-per-sec" not in out and out.strip()


def test_cli_errors_are_clear(tiny_model_dir, tmp_path, capsys, monkeypatch):
    model = ["generate", "--model", str(tiny_model_dir)]
    status, _, err = run_main(["generate", "--model", str(tmp_path / "nope"), "--max-tokens", "2"], capsys, monkeypatch)
    assert status == 1 and "nope" in err
    status, _, err = run_main(["generate", "--model", "some-org/some-model"], capsys, monkeypatch)
    assert status == 1 and "some-org/some-model" in err
    status, _, err = run_main(model + ["--chat-template-config", "[1]"], capsys, monkeypatch)
    assert status == 2 and "JSON object" in err
    status, _, err = run_main(model + ["--verbose", "maybe"], capsys, monkeypatch)
    assert status == 2 and "true or false" in err
    status, _, err = run_main(["fly"], capsys, monkeypatch)
    assert status == 1 and "unknown command 'fly'" in err


def test_cli_speculative_prints_acceptance(tiny_model_dir, capsys, monkeypatch):
    status, out, err = run_main(["generate", "--model", str(tiny_model_dir), "--draft-model", str(tiny_model_dir),
                                 "--num-draft-tokens", "4", "--prompt", "def f(x):", "--max-tokens", "12",
                                 "--dtype", "float16"], capsys, monkeypatch)
    assert status == 0, err
    assert "Compute dtype: float16 (float16, as asked)" in out
    assert "Speculation:" in out and "accepted (100.0%)" in out
    assert "tokens per target forward" in out


def test_cli_prefill_response_step_size_and_remote_code(tiny, tiny_model_dir, capsys, monkeypatch):
    """Upstream's --prefill-response (the answer's start, continued under the chat
    template), --prefill-step-size and --trust-remote-code reach what they set."""
    import importlib

    from mlx_lm.generate import build_prompt

    generate_module = importlib.import_module("mlx_lm.generate")  # `mlx_lm.generate` is also the function

    model, tokenizer = tiny
    prompt = build_prompt(tokenizer, "hi", None, True, {}, prefill_response="Sure, here")
    assert tokenizer.decode(prompt).endswith("Sure, here") and prompt != build_prompt(tokenizer, "hi", None, True, {})
    want = generate(model, tokenizer, prompt, max_tokens=4)
    loads, widths, forward = [], [], type(model).__call__
    real_load = generate_module.load

    def recording_forward(self, inputs, **kwargs):
        widths.append(inputs.shape[1])
        return forward(self, inputs, **kwargs)

    def recording_load(*args, **kwargs):
        loads.append(kwargs.get("trust_remote_code"))
        loaded = real_load(*args, **kwargs)
        monkeypatch.setattr(type(loaded[0]), "__call__", recording_forward)
        return loaded

    monkeypatch.setattr(generate_module, "load", recording_load)
    status, out, err = run_main(["generate", "--model", str(tiny_model_dir), "--prompt", "hi", "--max-tokens", "4",
                                 "--prefill-response", "Sure, here", "--prefill-step-size", "3",
                                 "--trust-remote-code", "--verbose", "false"], capsys, monkeypatch)
    assert (status, out) == (0, want + "\n"), err
    assert loads == [True] and max(widths) == 3 and sum(widths) >= len(prompt)  # prefill chunks of 3
    status, _, err = run_main(["generate", "--model", str(tiny_model_dir), "--prefill-response", "Sure",
                               "--ignore-chat-template"], capsys, monkeypatch)
    assert status == 1 and "--prefill-response 'Sure' needs the chat template; this one is off" in err


def test_input_embeddings_stand_in_for_the_prompt(tiny):
    """Rows fed in place of the prompt's token embeddings: the model's own embeddings
    give the plain output, with the prompt given or empty, prefilled in any chunks."""
    model, _ = tiny
    prompt = mx.array([5, 17, 42, 7, 99, 3, 250])
    embeddings = model.model.embed_tokens(prompt)
    want = [t for t, _ in generate_step(prompt, model, max_tokens=8)]
    for given in (prompt, mx.array([], mx.uint32)):
        for step in (2, 2048):
            got = generate_step(given, model, max_tokens=8, input_embeddings=embeddings, prefill_step_size=step)
            assert [t for t, _ in got] == want
    changed = [t for t, _ in generate_step(prompt, model, max_tokens=8, input_embeddings=embeddings * 3)]
    assert changed != want


def test_input_embeddings_are_checked(tiny, tmp_path):
    from checkpoints import TINY_CONFIGS, write_checkpoint

    from mlx_lm.utils import load_model

    model, tokenizer = tiny
    prompt = mx.array([5, 17, 42])
    embeddings = model.model.embed_tokens(prompt)
    cases = [
        (dict(prompt=prompt[:2], input_embeddings=embeddings), "same length"),
        (dict(prompt=prompt, input_embeddings=embeddings[None]), "must be \\(prompt length, hidden size\\)"),
        (dict(prompt=prompt, input_embeddings=embeddings, prompt_lookup=True), "drafting needs the prompt's token ids"),
    ]
    for kwargs, message in cases:
        with pytest.raises(ValueError, match=message):
            next(generate_step(model=model, **kwargs))
    hybrid = load_model(write_checkpoint(tmp_path / "hybrid", TINY_CONFIGS["qwen3_next"]))[0]
    with pytest.raises(ValueError, match="qwen3_next does not take input_embeddings"):
        next(generate_step(prompt, hybrid, input_embeddings=mx.zeros((3, 64))))
    with pytest.raises(ValueError, match="speculative decoding cannot take input_embeddings"):
        next(stream_generate(model, tokenizer, [5, 17, 42], draft_model=model, input_embeddings=embeddings))


def test_generation_runs_on_generation_stream():
    from mlx_lm import feeding
    from mlx_lm.generate import generation_stream

    assert generation_stream is feeding.generation_stream and isinstance(generation_stream, mx.ThreadLocalStream)
    seen = []

    @feeding.on_generation_stream
    def probe():
        seen.append(mx.default_stream(mx.default_device()))

    probe()
    with mx.stream(generation_stream):
        inside = mx.default_stream(mx.default_device())
    assert seen == [inside] and mx.default_stream(mx.default_device()) != inside


def stream_inside(stream):
    """The default stream within `with mx.stream(stream)`."""
    with mx.stream(stream):
        return mx.default_stream(mx.default_device())


def make_stream(kind):
    return {"device": mx.cpu, "stream": mx.new_stream(mx.default_device()),
            "thread-local": mx.new_thread_local_stream(mx.default_device()), "default": None}[kind]


@pytest.fixture
def streams_seen(tiny, monkeypatch):
    """The default stream at every forward of the tiny model, in order."""
    model, _ = tiny
    seen, forward = [], type(model).__call__

    def recording_forward(self, *args, **kwargs):
        seen.append(mx.default_stream(mx.default_device()))
        return forward(self, *args, **kwargs)

    monkeypatch.setattr(type(model), "__call__", recording_forward)
    return seen


@pytest.mark.parametrize("kind", ["device", "stream", "thread-local", "default"])
def test_generate_step_runs_on_the_given_stream(tiny, streams_seen, kind):
    """Upstream's third argument: every forward runs on it, the tokens are the same, and
    the caller's own default stream is back at each yield."""
    from mlx_lm.generate import generation_stream

    model, _ = tiny
    want = greedy_without_cache(model, PROMPT, 6)
    streams_seen.clear()
    stream = make_stream(kind)
    callers = mx.default_stream(mx.default_device())
    got = []
    for token, logprobs in generate_step(mx.array(PROMPT), model, stream, max_tokens=6):
        assert mx.default_stream(mx.default_device()) == callers
        got.append((token, mx.argmax(logprobs).item()))
    assert got == [(t, t) for t in want]
    expected = stream_inside(generation_stream if stream is None else stream)
    assert len(streams_seen) >= 6 and all(seen == expected for seen in streams_seen)  # Stream hashes by identity


def test_stream_reaches_speculation_and_stream_generate(tiny, streams_seen):
    model, tokenizer = tiny
    plain = [t for t, _ in generate_step(mx.array(PROMPT), model, max_tokens=6)]
    text = generate(model, tokenizer, PROMPT, max_tokens=6)
    stream = mx.new_stream(mx.default_device())
    streams_seen.clear()
    runs = {
        "draft": [t for t, _, _ in speculative_generate_step(mx.array(PROMPT), model, model, stream,
                                                              num_draft_tokens=2, max_tokens=6)],
        "lookup": [t for t, _ in generate_step(mx.array(PROMPT), model, stream, prompt_lookup=True, max_tokens=6)],
        "stream_generate": [r.token for r in stream_generate(model, tokenizer, PROMPT, 6, None, stream)],
        "stream_generate draft": [r.token for r in stream_generate(model, tokenizer, PROMPT, 6, model, stream)],
    }
    assert runs == {name: plain for name in runs}
    assert generate(model, tokenizer, PROMPT, max_tokens=6, stream=stream) == text
    assert streams_seen and all(seen == stream for seen in streams_seen)


@pytest.mark.parametrize("bad, message", [
    ("gpu", "stream must be an mx.Stream, an mx.ThreadLocalStream or a device .*got 'gpu' \\(str\\)"),
    (0, "stream must be .*got 0 \\(int\\)"),
])
def test_bad_streams_are_refused_before_any_work(tiny, bad, message):
    model, tokenizer = tiny
    cache = make_prompt_cache(model)
    calls = [
        lambda: generate_step(mx.array(PROMPT), model, bad, prompt_cache=cache),
        lambda: speculative_generate_step(mx.array(PROMPT), model, model, bad),
        lambda: stream_generate(model, tokenizer, PROMPT, 4, None, bad, prompt_cache=cache),
        lambda: stream_generate(model, tokenizer, PROMPT, stream=bad, prompt_lookup=True),
    ]
    for call in calls:
        with pytest.raises(ValueError, match=message):
            next(call())
    assert cache[0].offset == 0


def test_a_stream_on_a_missing_device_is_refused(tiny):
    model, _ = tiny
    missing = [device for device in (mx.cpu, mx.gpu) if not mx.is_available(mx.Device(device))]
    for device in missing:  # on a machine with both there is nothing to refuse
        with pytest.raises(ValueError, match="which this machine does not have"):
            next(generate_step(mx.array(PROMPT), model, device))
    assert missing or mx.is_available(mx.Device(mx.gpu))


def test_generation_on_a_worker_thread_with_its_own_streams(tiny):
    """A server's worker thread (upstream's tests: a thread that makes its own default
    stream): the default generation_stream is that thread's, and a stream made there
    may be given too; the tokens are the main thread's."""
    import concurrent.futures

    model, tokenizer = tiny
    want = [t for t, _ in generate_step(mx.array(PROMPT), model, max_tokens=4)]

    def on_worker():
        mx.set_default_stream(mx.new_stream(mx.default_device()))
        own = mx.new_stream(mx.default_device())
        return ([t for t, _ in generate_step(mx.array(PROMPT), model, max_tokens=4)],
                [t for t, _ in generate_step(mx.array(PROMPT), model, own, max_tokens=4)],
                [r.token for r in stream_generate(model, tokenizer, PROMPT, 4, model, own)])

    with concurrent.futures.ThreadPoolExecutor(max_workers=1) as pool:
        assert pool.submit(on_worker).result(timeout=120) == (want, want, want)


def test_from_draft_flags_with_an_explicit_draft_length(tiny):
    """Upstream 0.32.2 drafts num_draft_tokens every round: with the target as its own
    draft and num_draft_tokens=2 its flags are [T, T, F, T, T]. Here that length is a
    cap and the adaptive policy starts cold with two plain rounds and a slow start
    (README, Differences from upstream); adaptive_draft_length=False (the CLI's
    --fixed-draft-length) drafts the cap every round, as upstream."""
    model, tokenizer = tiny

    def flags(**kwargs):
        return [r.from_draft for r in stream_generate(model, tokenizer, "hello", max_tokens=5, draft_model=model,
                                                      num_draft_tokens=2, **kwargs)]

    assert flags(adaptive_draft_length=False) == [True, True, False, True, True]
    assert flags() == [False, False, True, False, True]
