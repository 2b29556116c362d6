"""mlx_lm.chat: every answer is what a fresh run on the whole conversation gives, the
cache is reused from turn to turn (only new tokens are fed), and a draft model changes
nothing under greedy decoding."""

import io
import os
import re
import subprocess
import sys
from pathlib import Path

import mlx.core as mx
import pytest

from checkpoints import TINY_CONFIGS, write_checkpoint
from mlx_lm import load, stream_generate
from mlx_lm.chat import ChatSession, chat_loop, read_system_prompt

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


def run_chat(model_dir, stdin, *extra) -> str:
    """stdout of mlx_lm.chat, bytes decoded as they are (answers may hold a lone \\r)."""
    env = dict(os.environ, PYTHONPATH=str(Path(__file__).parents[1]), HF_HUB_OFFLINE="1", PYTHONIOENCODING="utf-8")
    result = subprocess.run(
        [sys.executable, "-m", "mlx_lm.chat", "--model", str(model_dir), "--max-tokens", str(MAX_TOKENS), *extra],
        input=stdin.encode(), capture_output=True, timeout=120, env=env,
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
                          (["--max-tokens", "0"], "argument --max-tokens/-m: expected a positive integer, got 0")):
        with pytest.raises(SystemExit) as exited:
            cli.main(["chat", *argv])
        assert exited.value.code == 2 and f"mlx_lm.chat: error: {message}" in capsys.readouterr().err
