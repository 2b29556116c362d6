"""mlx_lm.chat: every answer is what a fresh run on the whole conversation gives (on
the tokens fed, which decode to its rendering and keep earlier answers as generated),
the cache is reused from turn to turn (only new tokens are fed), and a draft model
changes nothing under greedy decoding. On 2 local ranks (tensor parallel, and --pipeline
with a draft) rank 0 reads the input and prints what one process prints, resets
included, and a rank that dies ends the chat with a clear error."""

import io
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import mlx.core as mx
import pytest

from checkpoints import TINY_CONFIGS, write_checkpoint
from tokenizer_fixture import write_spm_style_tokenizer
from mlx_lm import load, stream_generate
from mlx_lm.chat import ChatSession, chat_loop, read_system_prompt
from mlx_lm import tokenizer_utils
from mlx_lm.tokenizer_utils import TokenizerWrapper
from ranks import run_ranks, start_ranks

MAX_TOKENS = 10
TURNS = ["hello there", "tell me about the library"]
EOS = 0  # the fixture tokenizer's <|endoftext|>
STATS = re.compile(r"^\[prompt: (\d+) new tokens \+ (\d+) from the cache, .*\]\n", re.MULTILINE)


@pytest.fixture(scope="module")
def noisy_draft_dir(tmp_path_factory) -> Path:
    """The tiny qwen3 target's weights plus noise: a draft that is often rejected."""
    return write_checkpoint(tmp_path_factory.mktemp("noisy_draft"), TINY_CONFIGS["qwen3"], noise=0.02)


@pytest.fixture(scope="module")
def hybrid_dir(tmp_path_factory) -> Path:
    return write_checkpoint(tmp_path_factory.mktemp("tiny_qwen3_next"), TINY_CONFIGS["qwen3_next"], seed=2)


def render(tokenizer, messages):
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return tokenizer.encode(text, add_special_tokens=False)


def fresh_answer(model, tokenizer, messages, **kwargs) -> str:
    """The answer of a new run on the whole conversation, no cache carried over."""
    return "".join(r.text for r in stream_generate(model, tokenizer, render(tokenizer, messages),
                                                   max_tokens=MAX_TOKENS, **kwargs))


def fresh_conversation(model, tokenizer, turns):
    """(answers, token counts of each turn's rendering) from fresh runs."""
    messages, answers, lengths = [], [], []
    for text in turns:
        messages.append({"role": "user", "content": text})
        lengths.append(len(render(tokenizer, messages)))
        answers.append(fresh_answer(model, tokenizer, messages))
        messages.append({"role": "assistant", "content": answers[-1]})
    return answers, lengths


def common_prefix(cached, tokens) -> int:
    """How many tokens a cache holding `cached` can keep for `tokens` (one is left to feed)."""
    n = 0
    while n < min(len(cached), len(tokens) - 1) and cached[n] == tokens[n]:
        n += 1
    return n


def conversation_cache(session):
    """(the tokens the conversation's cache holds, a copy of that cache)."""
    key = list(session.stored.keys()[-1])
    return key, session.stored.fetch(key + [EOS]).prompt_cache  # a strict prefix: not trimmed


def chat_command(model_dir, *extra):
    return [sys.executable, "-m", "mlx_lm.chat", "--model", str(model_dir), "--max-tokens", str(MAX_TOKENS), *extra]


def rank_0_reads(path, command):
    """`command` with rank 0's stdin from `path` (the others' stays empty: they never read it)."""
    return ["sh", "-c", 'if [ "$MLX_RANK" = 0 ]; then exec "$@" < "$CHAT_INPUT"; else exec "$@"; fi', "sh",
            *command], {"CHAT_INPUT": str(path), "PYTHONIOENCODING": "utf-8"}


def run_chat(model_dir, stdin, *extra) -> str:
    """stdout of mlx_lm.chat, bytes decoded as they are (answers may hold a lone \\r)."""
    env = dict(os.environ, PYTHONPATH=str(Path(__file__).parents[1]), HF_HUB_OFFLINE="1", PYTHONIOENCODING="utf-8")
    result = subprocess.run(
        chat_command(model_dir, *extra), input=stdin.encode(), capture_output=True, timeout=120, env=env,
    )
    assert result.returncode == 0, result.stderr.decode()
    return result.stdout.decode("utf-8")


def test_cli_answers_each_turn_as_a_fresh_run_would_with_or_without_a_draft(tiny_model_dir, noisy_draft_dir):
    model, tokenizer = load(str(tiny_model_dir))
    answers, lengths = fresh_conversation(model, tokenizer, TURNS)
    assert all(answers) and answers[0] != answers[1]
    header = run_chat(tiny_model_dir, "", "--verbose", "false").rstrip("\n") + "\n"  # banner, then ">> " at EOF
    assert header.startswith("[INFO] Chatting with") and header.endswith(">> \n")
    expected = header[: -len(">> \n")] + "".join(f">> {a}\n" for a in answers) + ">> \n"

    plain = run_chat(tiny_model_dir, f"{TURNS[0]}\n\nh\n{TURNS[1]}\n")
    commands = header.splitlines()[1] + "\n"  # `h` prints the command list again
    assert plain == expected.replace(f"{answers[0]}\n>> ", f"{answers[0]}\n>> >> {commands}>> ", 1)

    spec = run_chat(tiny_model_dir, f"{TURNS[0]}\n{TURNS[1]}\nq\nnot read\n",
                    "--draft-model", str(noisy_draft_dir), "--num-draft-tokens", "3", "--verbose")
    stats = STATS.findall(spec)
    assert STATS.sub("", spec) + "\n" == expected  # `q` ends without the newline EOF prints
    assert len(stats) == 2 and "drafts accepted" in spec
    # Turn 1 feeds its whole rendering; turn 2 only what follows the cached conversation.
    assert [int(n) for n in stats[0]] == [lengths[0], 0]
    fed, reused = (int(n) for n in stats[1])
    assert reused > lengths[0] and fed + reused == lengths[1]


def test_second_turn_feeds_only_new_tokens_and_answers_as_a_fresh_run(tiny_model_dir, noisy_draft_dir):
    model, tokenizer = load(str(tiny_model_dir))
    draft_model, _ = load(str(noisy_draft_dir))
    answers, lengths = fresh_conversation(model, tokenizer, TURNS)
    for speculation in ({}, {"draft_model": draft_model, "num_draft_tokens": 2},
                        {"prompt_lookup": True, "num_draft_tokens": 3}):
        session = ChatSession(model, tokenizer, max_tokens=MAX_TOKENS, generation_kwargs=speculation)
        held = []
        for i, text in enumerate(TURNS):
            responses = list(session.reply(text))
            assert "".join(r.text for r in responses) == answers[i]
            tokens = render(tokenizer, session.messages[:-1])
            turn = session.last_turn
            assert turn.num_reused == common_prefix(held, tokens) and turn.num_fed + turn.num_reused == lengths[i]
            assert responses[-1].prompt_tokens == turn.num_fed  # stream_generate was given only those
            # The cache (the draft's entries too) holds exactly the conversation so far.
            held, prompt_cache = conversation_cache(session)
            assert held == tokens + [r.token for r in responses] and session.stored.keys() == [tuple(held)]
            assert {c.offset for c in prompt_cache} == {len(held)}
        assert session.last_turn.num_reused > lengths[0]  # turn 1's prompt and (some of) its answer
        session.reset()
        list(session.reply(TURNS[1]))
        assert session.last_turn.num_reused == 0 and len(session.messages) == 2


class Forced:
    """A logits processor that makes the model answer `tokens` (one per call, the last
    one repeated)."""

    def __init__(self, tokens):
        self.tokens, self.calls = list(tokens), 0

    def __call__(self, history, logits):
        token = self.tokens[min(self.calls, len(self.tokens) - 1)]
        self.calls += 1
        return mx.where(mx.arange(logits.shape[-1]) == token, 1e4, logits)


def fed_tokens(session, responses):
    """The tokens the session fed for the turn that gave `responses` (cached ones too)."""
    held = list(session.stored.keys()[-1])
    return held[: len(held) - len(responses)]


# Like the demo model's (examples/models/qwen3-next-stdlib): the messages joined by
# newlines, and no generation prompt, so an answer follows a newline the prompt lacks.
NEWLINE_TEMPLATE = "{% for m in messages %}{{ m['content'] }}{% if not loop.last %}{{ '\\n' }}{% endif %}{% endfor %}"


def test_a_template_without_a_generation_prompt_reuses_the_whole_answer(hybrid_dir):
    """The model starts its answer with the newline the template puts before an answer,
    so that newline is the template's and not the answer's: recorded without it, the
    conversation renders as the model saw it, and the next turn feeds only what follows
    (a recurrent cache cannot trim). The generated tokens are kept though the answer's
    text encodes otherwise."""
    model, loaded = load(str(hybrid_dir))
    tokenizer = TokenizerWrapper(loaded.tokenizer, chat_template=NEWLINE_TEMPLATE)
    answer = "\nhello world"
    forced = [t for c in answer for t in tokenizer.encode(c, add_special_tokens=False)]
    assert forced != tokenizer.encode(answer, add_special_tokens=False)  # the kept tokens are not re-encoded
    session = ChatSession(model, tokenizer, max_tokens=len(forced),
                          generation_kwargs={"logits_processors": [Forced(forced)]})
    assert "".join(r.text for r in session.reply(TURNS[0])) == answer
    assert session.messages[-1] == {"role": "assistant", "content": answer[1:]}
    held = list(session.stored.keys()[-1])
    session.generation_kwargs.clear()
    responses = list(session.reply(TURNS[1]))
    new = tokenizer.encode("\n" + TURNS[1], add_special_tokens=False)
    assert (session.last_turn.num_reused, session.last_turn.num_fed) == (len(held), len(new))
    fed = fed_tokens(session, responses)
    assert fed == held + new
    assert tokenizer.decode(fed) == tokenizer.apply_chat_template(session.messages[:-1], tokenize=False)
    assert "".join(r.text for r in responses) == "".join(
        r.text for r in stream_generate(model, tokenizer, fed, max_tokens=len(forced)))


def test_held_tokens_are_kept_only_where_they_decode_to_the_rendering(tmp_path, tiny_model_dir):
    """Not where encoding the rest on its own adds to it (SentencePiece's leading space),
    nor where the held text shows U+FFFD for bytes that are no UTF-8 (an answer cut
    inside a character): the whole rendering is encoded then."""
    model, bpe = load(str(tiny_model_dir))
    write_spm_style_tokenizer(tmp_path)
    spm = tokenizer_utils.load(tmp_path)
    cases = [(bpe, "hello", None, True), (spm, "hello", None, False),
             (bpe, "\ufffd", [bpe.convert_tokens_to_ids("\u00c3")], False)]  # byte 0xC3 alone
    for loaded, first, held, keeps in cases:
        tokenizer = TokenizerWrapper(loaded.tokenizer, chat_template=NEWLINE_TEMPLATE)
        session = ChatSession(model, tokenizer)
        session.held = held or tokenizer.encode(first, add_special_tokens=False)
        assert tokenizer.decode(session.held) == first
        text, tokens = session.render([{"role": "user", "content": first}, {"role": "user", "content": "world"}])
        assert text == f"{first}\nworld"
        kept = session.held + tokenizer.encode("\nworld", add_special_tokens=False)
        assert tokens == (kept if keeps else tokenizer.encode(text, add_special_tokens=False)), first
    assert spm.decode(spm.encode("hello", add_special_tokens=False) + spm.encode("\nworld", add_special_tokens=False)) \
        == "hello \nworld"  # why the SentencePiece case encodes it all


@pytest.mark.parametrize("family", ["qwen3", "qwen3_next"])
@pytest.mark.parametrize("ends_with_eos", [False, True], ids=["length", "eos"])
def test_the_next_turn_keeps_the_answer_as_generated(family, ends_with_eos, tiny_model_dir, hybrid_dir):
    """Turn 1's answer is spelled a character a token, which its text does not encode to.
    Turn 2 keeps those tokens and feeds only the template's text after them: all of turn
    1 is reused. Only an EOS token the template renders otherwise (<|endoftext|> where
    ChatML closes with <|im_end|>) is dropped: trimmed from a KV cache, while a recurrent
    one restarts from its copy at turn 1's prompt. Either way the tokens fed decode to
    the rendering, and the answer is a fresh run's on them."""
    model, tokenizer = load(str(tiny_model_dir if family == "qwen3" else hybrid_dir))
    answer = "hello world"
    spelled = [t for c in answer for t in tokenizer.encode(c, add_special_tokens=False)]
    assert spelled != tokenizer.encode(answer, add_special_tokens=False)
    forced = spelled + [EOS] if ends_with_eos else spelled
    session = ChatSession(model, tokenizer, max_tokens=len(spelled) + 1,
                          generation_kwargs={"logits_processors": [Forced(forced)]})
    first = list(session.reply(TURNS[0]))
    assert [r.token for r in first] == forced + [forced[-1]] * (len(spelled) + 1 - len(forced))
    prompt = fed_tokens(session, first)
    held = list(session.stored.keys()[-1])
    session.generation_kwargs.clear()
    responses = list(session.reply(TURNS[1]))
    fed = fed_tokens(session, responses)
    kept = held[:-1] if ends_with_eos else held
    assert fed[: len(kept)] == kept
    reused = len(prompt) - 1 if ends_with_eos and family == "qwen3_next" else len(kept)
    assert (session.last_turn.num_reused, session.last_turn.num_fed) == (reused, len(fed) - reused)
    assert tokenizer.decode(fed) == tokenizer.apply_chat_template(session.messages[:-1], tokenize=False,
                                                                  add_generation_prompt=True)
    assert "".join(r.text for r in responses) == "".join(
        r.text for r in stream_generate(model, tokenizer, fed, max_tokens=len(spelled) + 1))


def force_eos(tokens, logits):
    return mx.where(mx.arange(logits.shape[-1]) == EOS, 1e4, logits)


@pytest.mark.parametrize("family, max_kv_size", [("qwen3", None), ("qwen3_next", None), ("qwen3", 12)])
def test_a_cache_that_differs_from_the_rendering_is_trimmed_back_or_restarted(
    family, max_kv_size, tiny_model_dir, hybrid_dir
):
    """Turn 1 ends at EOS, where the template closes the answer with <|im_end|>: a KV
    cache is trimmed back to turn 1's prompt; one that cannot trim (recurrent states, a
    window that has wrapped) restarts from its copy at that prompt but its last token."""
    model, tokenizer = load(str(tiny_model_dir if family == "qwen3" else hybrid_dir))
    session = ChatSession(model, tokenizer, system_prompt="Be brief.", max_tokens=MAX_TOKENS,
                          max_kv_size=max_kv_size, generation_kwargs={"logits_processors": [force_eos]})
    responses = list(session.reply(TURNS[0]))
    assert [r.token for r in responses] == [EOS] and responses[-1].finish_reason == "stop"
    prompt = render(tokenizer, session.messages[:-1])
    trimmable = family == "qwen3" and max_kv_size is None
    copies = [] if trimmable else [tuple(prompt[:-1])]
    assert session.stored.keys() == copies + [tuple(prompt + [EOS])]
    session.generation_kwargs.clear()
    answer = "".join(r.text for r in session.reply(TURNS[1]))
    assert session.last_turn.num_reused == (len(prompt) if trimmable else len(prompt) - 1)
    if max_kv_size is None:  # a window that has dropped tokens answers otherwise than a fresh run
        assert answer == fresh_answer(model, tokenizer, session.messages[:-1])


def test_a_hybrid_with_a_draft_answers_each_turn_as_a_fresh_run(hybrid_dir, tiny_model_dir):
    model, tokenizer = load(str(hybrid_dir))
    draft_model, _ = load(str(tiny_model_dir))
    turns = TURNS + ["and then?"]
    answers, lengths = fresh_conversation(model, tokenizer, turns)
    session = ChatSession(model, tokenizer, max_tokens=MAX_TOKENS,
                          generation_kwargs={"draft_model": draft_model, "num_draft_tokens": 3})
    for i, text in enumerate(turns):
        assert "".join(r.text for r in session.reply(text)) == answers[i]
        # At least the last prompt but its last token comes from the cache (its copy).
        assert session.last_turn.num_reused >= (lengths[i - 1] - 1 if i else 0)
        assert session.last_turn.num_reused + session.last_turn.num_fed == lengths[i]
        held, prompt_cache = conversation_cache(session)  # the draft (KVCache entries) is in step
        assert {c.offset for c in prompt_cache[len(model.layers):]} == {len(held)}


def test_closing_an_answer_early_keeps_it_and_the_caches_in_step(tiny_model_dir, noisy_draft_dir):
    model, tokenizer = load(str(tiny_model_dir))
    draft_model, _ = load(str(noisy_draft_dir))
    session = ChatSession(model, tokenizer, max_tokens=MAX_TOKENS,
                          generation_kwargs={"draft_model": draft_model, "num_draft_tokens": 3})
    replies = session.reply(TURNS[0])
    partial = [next(replies) for _ in range(4)]
    replies.close()
    prompt = render(tokenizer, session.messages[:1])
    held, prompt_cache = conversation_cache(session)
    assert held == prompt + [r.token for r in partial] and {c.offset for c in prompt_cache} == {len(prompt) + 4}
    assert session.messages[-1] == {"role": "assistant", "content": "".join(r.text for r in partial)}
    answer = "".join(r.text for r in session.reply(TURNS[1]))
    assert session.last_turn.num_reused >= len(prompt)
    assert answer == fresh_answer(model, tokenizer, session.messages[:-1])


def test_a_failed_turn_leaves_the_conversation_as_it_was(tiny_model_dir):
    model, tokenizer = load(str(tiny_model_dir))
    session = ChatSession(model, tokenizer, max_tokens=MAX_TOKENS)
    list(session.reply(TURNS[0]))
    before = list(session.messages)

    def fail(tokens, logits):
        raise RuntimeError("processor failed")

    session.generation_kwargs["logits_processors"] = [fail]
    with pytest.raises(RuntimeError, match="processor failed"):
        list(session.reply(TURNS[1]))
    assert session.messages == before and len(session.stored) == 0
    session.generation_kwargs.clear()
    assert "".join(r.text for r in session.reply(TURNS[1])) == fresh_answer(model, tokenizer, session.messages[:-1])


def test_ctrl_c_drops_the_answer_and_the_chat_goes_on(tiny_model_dir, monkeypatch, capsys):
    model, tokenizer = load(str(tiny_model_dir))
    session = ChatSession(model, tokenizer, max_tokens=MAX_TOKENS)

    def interrupt(tokens, logits):
        session.generation_kwargs.clear()  # only the first answer is interrupted
        raise KeyboardInterrupt

    session.generation_kwargs["logits_processors"] = [interrupt]
    monkeypatch.setattr(sys, "stdin", io.StringIO(f"{TURNS[0]}\n{TURNS[1]}\nexit\n"))
    chat_loop(session, verbose=False)
    answer = fresh_answer(model, tokenizer, [{"role": "user", "content": TURNS[1]}])
    notice = "[answer interrupted; this turn is left out of the conversation]"
    assert capsys.readouterr().out == f">> \n{notice}\n>> {answer}\n>> "
    assert [m["content"] for m in session.messages] == [TURNS[1], answer]


def test_prefill_step_size_chunks_every_forward_and_changes_no_answer(tiny_model_dir, hybrid_dir, monkeypatch):
    """Upstream's --prefill-step-size (DEFAULT_PREFILL_STEP_SIZE): no forward of a turn,
    the caches kept for a hybrid included, takes more prompt tokens than it."""
    from mlx_lm import chat, feeding

    assert chat.DEFAULT_PREFILL_STEP_SIZE == feeding.DEFAULT_PREFILL_STEP_SIZE == 2048
    assert chat.setup_arg_parser().parse_args([]).prefill_step_size == 2048
    for model_dir in (tiny_model_dir, hybrid_dir):
        model, tokenizer = load(str(model_dir))
        answers, lengths = fresh_conversation(model, tokenizer, TURNS)
        widths, forward = [], type(model).__call__

        def recording_forward(self, inputs, *args, **kwargs):
            widths.append(inputs.shape[1])
            return forward(self, inputs, *args, **kwargs)

        monkeypatch.setattr(type(model), "__call__", recording_forward)
        session = ChatSession(model, tokenizer, max_tokens=MAX_TOKENS, prefill_step_size=3)
        assert ["".join(r.text for r in session.reply(text)) for text in TURNS] == answers
        monkeypatch.undo()
        assert max(widths) == 3 and sum(widths) >= lengths[1]


def test_adapter_path_and_remote_code_reach_the_loader(tiny_model_dir, tmp_path, monkeypatch, capsys):
    """Upstream's --adapter-path (here one that is missing, so the loader's error names
    it) and --trust-remote-code, for --model and the draft."""
    from mlx_lm import chat, cli

    monkeypatch.setattr(sys, "argv", list(sys.argv))
    missing = tmp_path / "no_adapters"
    with pytest.raises(SystemExit) as exited:
        cli.main(["chat", "--model", str(tiny_model_dir), "--adapter-path", str(missing)])
    assert str(exited.value.code).startswith("Error: ") and str(missing) in str(exited.value.code)
    asked = []
    monkeypatch.setattr(chat, "load", lambda *args, **kwargs: asked.append(kwargs) or load(str(tiny_model_dir)))
    args = chat.setup_arg_parser().parse_args(["--trust-remote-code", "--draft-model", str(tiny_model_dir)])
    chat.load_with_speculation(args)
    assert [kwargs["trust_remote_code"] for kwargs in asked] == [True, True]


def test_bad_prefill_step_sizes_are_refused(tiny_model_dir):
    model, tokenizer = load(str(tiny_model_dir))
    with pytest.raises(ValueError, match="prefill_step_size must be positive, got 0"):
        ChatSession(model, tokenizer, prefill_step_size=0)
    with pytest.raises(ValueError, match="give prefill_step_size as ChatSession's own argument"):
        ChatSession(model, tokenizer, generation_kwargs={"prefill_step_size": 8})


def test_system_prompt_is_text_or_a_file(tmp_path):
    path = tmp_path / "system.txt"
    path.write_text("You are terse.\n")
    assert read_system_prompt(str(path)) == "You are terse."
    assert read_system_prompt("Be kind.") == "Be kind." and read_system_prompt(None) is None


def test_bad_flags_are_usage_errors_also_through_the_dispatcher(monkeypatch, capsys):
    from mlx_lm import cli

    monkeypatch.setattr(sys, "argv", list(sys.argv))  # the dispatcher rewrites it
    for argv, message in ((["--num-draft-tokens", "2"], "--num-draft-tokens 2 needs --draft-model or --prompt-lookup"),
                          (["--prompt-lookup", "--draft-model", "d"], "--prompt-lookup and --draft-model are two drafters; give one"),
                          (["--max-tokens", "0"], "argument --max-tokens/-m: expected a positive integer, got 0"),
                          (["--prefill-step-size", "0"], "argument --prefill-step-size: expected a positive integer, got 0")):
        with pytest.raises(SystemExit) as exited:
            cli.main(["chat", *argv])
        assert exited.value.code == 2 and f"mlx_lm.chat: error: {message}" in capsys.readouterr().err


@pytest.mark.parametrize("split", ["tensor", "pipeline"])
def test_two_ranks_answer_as_one_process(split, hybrid_dir, tmp_path):
    """Two turns, a reset and the second turn again, on a hybrid (its caches kept at the
    end of each prompt, too); with --pipeline also speculating with a draft."""
    extra = ["--draft-model", str(write_checkpoint(tmp_path / "draft", TINY_CONFIGS["qwen3_next"], seed=2,
                                                   noise=0.02))] if split == "pipeline" else []
    stdin = f"{TURNS[0]}\n{TURNS[1]}\nr\n{TURNS[1]}\n"
    single = run_chat(hybrid_dir, stdin, *extra)
    answers = [line for line in single.split(">> ")[1:] if line.strip() and line != "[chat reset]\n"]
    assert len(answers) == 3 and answers[1] != answers[2], single  # the reset reached the model
    (tmp_path / "input").write_text(stdin)
    command, env = rank_0_reads(tmp_path / "input", chat_command(hybrid_dir, *extra, *["--pipeline"] * (split == "pipeline")))
    ranks = run_ranks(command, timeout=180, env=env)
    assert [r.returncode for r in ranks] == [0, 0], [r.stderr[-2000:] for r in ranks]
    assert ranks[0].stdout == single and ranks[1].stdout == ""


def test_a_rank_that_dies_ends_the_chat_with_a_clear_error(tiny_llama_dir, tmp_path):
    """Rank 1 dies while rank 0 waits for input: rank 0 fails at the next line it sends."""
    fifo = tmp_path / "input"
    os.mkfifo(fifo)
    writer = os.open(fifo, os.O_RDWR)  # read-write: opening does not wait for rank 0
    try:
        command, env = rank_0_reads(fifo, chat_command(tiny_llama_dir))
        ranks = start_ranks(command, env=env)
        os.write(writer, f"{TURNS[0]}\n".encode())
        out, deadline = "", time.monotonic() + 120
        while out.count(">> ") < 2 and time.monotonic() < deadline:  # answered, waiting for the next line
            time.sleep(0.1)
            out = (ranks.workdir / "0.out").read_text()
        assert out.count(">> ") >= 2, ranks.stderr(0)[-2000:]
        ranks.processes[1].kill()
        ranks.processes[1].wait()
        os.write(writer, f"{TURNS[1]}\n".encode())
        results = ranks.wait(60, stop_others_on_failure=False)
    finally:
        os.close(writer)
    assert results[0].returncode == 1, results[0].stderr[-2000:]  # by itself, not the timeout
    assert "Error: rank 0 of 2 stopped" in results[0].stderr


def test_adapters_under_mlx_launch_are_refused_before_loading(tmp_path):
    from types import SimpleNamespace

    from mlx_lm import chat

    two_ranks = SimpleNamespace(size=lambda: 2, rank=lambda: 0)  # enough to choose sharded loading
    args = chat.setup_arg_parser().parse_args(["--model", str(tmp_path / "none"), "--adapter-path", "lora"])
    with pytest.raises(ValueError, match=r"--adapter-path 'lora': adapters are not sharded; under mlx.launch "
                                         r"fuse them first \(mlx_lm.fuse\)"):
        chat.load_with_speculation(args, two_ranks)
