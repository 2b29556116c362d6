"""Prompt-lookup drafting end to end: speculative_generate_step(prompt_lookup=True) and
a reused PromptLookup, generate_step, stream_generate, the CLI and the server.

Greedy output must equal plain decoding on every family, with prompts that repeat so
that the lookup proposes drafts and some of them are rejected (its continuations are
the prompt's, the random models continue otherwise part of the time); sampled output
must have the target's law, and a lookup draft is accepted with the target's
probability of it (a point mass q: sum min(p, q) = p(x)).
"""

import math
import random

import mlx.core as mx
import numpy as np
import pytest
from checkpoints import TINY_CONFIGS, write_checkpoint
from server_harness import start_server, stop_all
from test_speculative import assert_holds, model, plain
from test_speculative_sampling import PROMPT as SMALL_PROMPT
from test_speculative_sampling import Z_CRITICAL, assert_law, laws_along, pit_histogram, tiny

from mlx_lm import load, stream_generate
from mlx_lm.drafters import PromptLookup
from mlx_lm.generate import SpeculationStats, generate_step, main as generate_main, speculative_generate_step
from mlx_lm.models.cache import make_prompt_cache
from mlx_lm.sample_utils import make_logits_processors, make_sampler
from mlx_lm.utils import load_model

# A 12-token phrase three times: from the second copy on the lookup has matches.
PHRASE = [(i * 37 + 11) % 256 for i in range(12)]
PROMPT = mx.array(PHRASE * 3)
NUM_TOKENS = 40

FAMILIES = ["llama_tf4", "qwen3_tf4", "gpt_oss_tf5", "qwen3_next_tf5", "qwen3_5_tf4", "qwen3_5_moe_tf5",
            "qwen3_moe_tf4", "gemma3_text_tf4", "phi3_tf4", "mistral_tf4", "lfm2_tf4", "nemotron_h_tf5",
            "falcon_h1_tf5"]


def lookup_run(target, k, prompt=PROMPT, num_tokens=NUM_TOKENS, **kwargs):
    stats = SpeculationStats()
    out = list(speculative_generate_step(prompt, target, prompt_lookup=True, num_draft_tokens=k,
                                         adaptive_draft_length=False, max_tokens=num_tokens, stats=stats, **kwargs))
    return [t for t, _, _ in out], stats


@pytest.mark.parametrize("name", FAMILIES)
def test_greedy_lookup_equals_plain_on_every_family(name):
    """Past gpt-oss's and gemma3's windows (8 < the prompt), through GDN, Mamba-2 and
    short-conv rollbacks: rounds with rejected lookup drafts on every family."""
    target = model(name)
    want = plain(target, prompt=PROMPT)
    rejected = 0
    for k in (2, 5):
        tokens, stats = lookup_run(target, k)
        assert tokens == want, (name, k)
        assert stats.num_drafted > 0, (name, k, stats)
        rejected += stats.num_drafted - stats.num_accepted
    assert rejected > 0, name


def test_quantized_kv_cache_with_lookup(tmp_path):
    """KV caches quantized from the prefill on still roll back rejected lookup drafts."""
    config = dict(TINY_CONFIGS["llama"], num_attention_heads=2, num_key_value_heads=1)  # head_dim 32
    target = load_model(write_checkpoint(tmp_path / "target", config, seed=3))[0]
    kv = dict(kv_bits=8, kv_group_size=32, quantized_kv_start=PROMPT.size - 8)
    want = [t for t, _ in generate_step(PROMPT, target, max_tokens=NUM_TOKENS, **kv)]
    cache = make_prompt_cache(target)
    tokens, stats = lookup_run(target, 3, prompt_cache=cache, **kv)
    assert tokens == want and stats.num_drafted > stats.num_accepted
    assert all(type(c).__name__ == "QuantizedKVCache" for c in cache)


@pytest.mark.parametrize("name", ["llama_tf4", "qwen3_next_tf5"])
def test_cache_and_index_after_finish_and_close(name):
    """At a close after any yield (mid-round too) and at the end, the target's cache and
    the lookup's index hold exactly the prompt and the yielded tokens."""
    target = model(name)
    want = plain(target, prompt=PROMPT, num_tokens=20)
    for num_taken in (1, 4, 9, 20):
        cache, drafter = make_prompt_cache(target), PromptLookup()
        generator = speculative_generate_step(PROMPT, target, drafter=drafter, num_draft_tokens=4, max_tokens=20,
                                              prompt_cache=cache)
        taken = [next(generator)[0] for _ in range(num_taken)]
        generator.close()
        tokens = PROMPT.tolist() + taken
        assert taken == want[:num_taken]
        assert drafter.tokens == tokens
        assert_holds(target, cache, tokens, exact=False, where=f"{name}: closed after {num_taken}")


def index_of(tokens, **sizes):
    fresh = PromptLookup(**sizes)
    fresh.extend(tokens)
    return fresh.latest


def test_a_reused_lookup_sees_earlier_turns_and_stays_exact():
    """Two turns on one prompt cache and one PromptLookup: the second turn's lookup
    also matches the first turn's text, its output equals a plain run over the whole
    conversation, and the index equals one built from scratch on the same tokens."""
    target = model("llama_tf4")
    cache, drafter = make_prompt_cache(target), PromptLookup()
    first = mx.array(PHRASE * 2)
    turn1 = [t for t, _, _ in speculative_generate_step(first, target, drafter=drafter, num_draft_tokens=3,
                                                        max_tokens=15, prompt_cache=cache)]
    second = mx.array(PHRASE[:6])  # the phrase again: the lookup continues it from turn 1
    stats = SpeculationStats()
    turn2 = [t for t, _, _ in speculative_generate_step(second, target, drafter=drafter, num_draft_tokens=3,
                                                        max_tokens=15, prompt_cache=cache, stats=stats)]
    whole = first.tolist() + turn1 + second.tolist()
    assert turn2 == plain(target, prompt=mx.array(whole), num_tokens=15)
    assert stats.num_accepted > 0
    assert drafter.tokens == whole + turn2
    assert drafter.latest == index_of(whole + turn2)


def test_an_exception_leaves_the_index_at_the_yielded_tokens_but_the_last():
    target = model("llama_tf4")
    drafter = PromptLookup()
    generator = speculative_generate_step(PROMPT, target, drafter=drafter, num_draft_tokens=4, max_tokens=30)
    taken = [next(generator)[0] for _ in range(7)]
    with pytest.raises(KeyError):
        generator.throw(KeyError("stop"))
    assert drafter.tokens == PROMPT.tolist() + taken[:-1]
    assert drafter.latest == index_of(drafter.tokens)


# ---------------------------------------------------------------------------
# Sampling: the target's law, acceptance p(x)


def sampled(target, k, num_tokens, sampler, processors, seed):
    """(token, logprobs, from_draft) of a seeded lookup run, and its statistics."""
    mx.random.seed(seed)
    stats = SpeculationStats()
    out = list(speculative_generate_step(SMALL_PROMPT, target, prompt_lookup=True, num_draft_tokens=k,
                                         adaptive_draft_length=False, max_tokens=num_tokens, sampler=sampler,
                                         logits_processors=processors, stats=stats))
    return out, stats


@pytest.mark.parametrize("kind,k", [("llama", 3), ("qwen3_next", 2)])
def test_sampled_lookup_has_the_target_law(kind, k):
    target = tiny(kind)
    sampler = make_sampler(temp=1.0, top_k=10, top_p=0.9, min_p=0.05)
    processors = make_logits_processors(repetition_penalty=1.3)
    out, stats = sampled(target, k, 900 if kind == "llama" else 600, sampler, processors, seed=5)
    tokens = [t for t, _, _ in out]
    assert stats.acceptance_rule == "speculative sampling"
    assert stats.num_accepted > 20 and stats.num_drafted - stats.num_accepted > 20, stats
    laws = laws_along(target, SMALL_PROMPT.tolist() + tokens, SMALL_PROMPT.size, sampler, processors)
    counts = pit_histogram(np.array(tokens), laws, seed=6)
    assert_law(counts, np.full(len(counts), 1 / len(counts)), f"{kind}: PIT histogram")


def test_a_lookup_draft_is_accepted_with_the_targets_probability_of_it():
    """k = 1: each round proposes lookup(committed tokens) and keeps it with probability
    p(x): the accepted count minus the sum of p(x) is a martingale. (For a point mass
    the ratio test and token matching accept alike: min(p, q) and p * q both sum to p(x).)"""
    target = tiny("llama")
    sampler = make_sampler(temp=1.0, top_p=0.95)
    out, _ = sampled(target, 1, 1200, sampler, [], seed=9)
    sequence = SMALL_PROMPT.tolist() + [t for t, _, _ in out]
    laws = laws_along(target, sequence, SMALL_PROMPT.size, sampler, [])
    index = PromptLookup()
    index.extend(SMALL_PROMPT.tolist())
    accepted, probs, i = [], [], 0
    while i < len(out) - 1:
        proposal = index.lookup(1)
        if proposal:  # a drafting round: its draft, then the target's token if accepted
            accepted.append(out[i][2])
            probs.append(laws[i, proposal[0]])
            assert out[i][2] == (out[i][0] == proposal[0]) or not out[i][2]
        step = 2 if out[i][2] else 1
        index.extend([t for t, _, _ in out[i : i + step]])
        i += step
    probs = np.array(probs)
    spread = math.sqrt((probs * (1 - probs)).sum())
    assert len(probs) > 500
    assert abs(sum(accepted) - probs.sum()) < Z_CRITICAL * spread, (sum(accepted), probs.sum(), spread)


# ---------------------------------------------------------------------------
# The other entry points and bad arguments


def test_generate_step_and_stream_generate_with_prompt_lookup(tiny_model_dir):
    target = model("qwen3_next_tf5")
    want = plain(target, prompt=PROMPT)
    assert [t for t, _ in generate_step(PROMPT, target, max_tokens=NUM_TOKENS, prompt_lookup=True)] == want
    assert [t for t, _ in generate_step(PROMPT, target, max_tokens=NUM_TOKENS, prompt_lookup=True,
                                        num_draft_tokens=1, max_ngram_size=2)] == want
    dense, tokenizer = load(str(tiny_model_dir))
    text = "the cat sat on the mat, the cat sat on the mat, the cat sat"
    plain_text = [r.text for r in stream_generate(dense, tokenizer, text, max_tokens=20)]
    responses = list(stream_generate(dense, tokenizer, text, max_tokens=20, prompt_lookup=True, num_draft_tokens=3))
    assert [r.text for r in responses] == plain_text
    assert responses[-1].speculation is not None and responses[-1].speculation.num_target_forwards > 0


def test_bad_arguments_fail_before_any_work():
    target, draft = model("llama_tf4"), model("qwen3_tf4")
    cases = [
        (dict(draft_model=draft, prompt_lookup=True), "exactly one drafter.*a draft_model and prompt_lookup=True"),
        (dict(), "exactly one drafter.*got none"),
        (dict(drafter="lookup"), "drafter must be a Drafter"),
        (dict(prompt_lookup=True, max_ngram_size=2, min_ngram_size=3), "min_ngram_size <= max_ngram_size"),
        (dict(prompt_lookup=True, min_ngram_size=0), "1 <= min_ngram_size"),
    ]
    for kwargs, message in cases:
        with pytest.raises(ValueError, match=message):
            next(speculative_generate_step(PROMPT, target, **kwargs))
    with pytest.raises(ValueError, match="num_draft_tokens needs prompt_lookup=True"):
        next(generate_step(PROMPT, target, num_draft_tokens=2))


def test_cli_prompt_lookup_prints_what_plain_decoding_prints(tiny_model_dir, capsys):
    common = ["--model", str(tiny_model_dir), "--ignore-chat-template", "--max-tokens", "24", "--prompt",
              "the cat sat on the mat, the cat sat on the mat, the cat"]
    generate_main([*common, "--verbose", "false"])
    want = capsys.readouterr().out
    generate_main([*common, "--verbose", "false", "--prompt-lookup", "--max-ngram-size", "2"])
    assert capsys.readouterr().out == want
    generate_main([*common, "--prompt-lookup"])
    out = capsys.readouterr().out
    assert want.strip() in out and "Speculation:" in out and "Draft length:" in out
    for flags, message in [(["--prompt-lookup", "--draft-model", str(tiny_model_dir)], "--prompt-lookup and --draft-model are 2 drafters"),
                           (["--max-ngram-size", "2"], "--max-ngram-size needs --prompt-lookup")]:
        with pytest.raises(SystemExit):
            generate_main([*common, *flags])
        assert message in capsys.readouterr().err


def test_server_with_prompt_lookup(tmp_path):
    """A hybrid target served with --prompt-lookup answers as plain decoding does and
    reports the lookup's drafts; requests may set num_draft_tokens."""
    target_dir = write_checkpoint(tmp_path / "hybrid", TINY_CONFIGS["qwen3_next"])
    server = start_server("lookup", target_dir, tmp_path / "lookup.log", flags=["--prompt-lookup", "--max-tokens", "24"])
    try:
        server.wait_ready()
        model_, tokenizer = load(str(target_dir))
        prompt = "ab ab ab ab ab ab ab ab ab ab"
        want = "".join(r.text for r in stream_generate(model_, tokenizer, prompt, max_tokens=24))
        for extra in ({}, {"num_draft_tokens": 1}):
            response = server.client.completions.create(model="default_model", prompt=prompt, max_tokens=24,
                                                        temperature=0, extra_body=extra)
            assert response.choices[0].text == want
            spec = (response.usage.model_extra or {})["speculation"]
            assert spec["num_target_forwards"] >= 1 and spec["num_drafted"] >= spec["num_accepted"] >= 0
    finally:
        stop_all([server])


# --- the lookup itself, against a scan -----------------------------------------------


def naive_lookup(tokens, num_draft, max_n, min_n):
    """The continuation of the latest earlier occurrence of the longest suffix, by
    scanning, repeated with its period where it runs into the end."""
    end = len(tokens)
    for n in range(max_n, min_n - 1, -1):
        if end < n:
            continue
        starts = [p for p in range(n, end) if tokens[p - n : p] == tokens[end - n :]]
        if starts:
            start = starts[-1]
            return [tokens[start + i % (end - start)] for i in range(num_draft)]
    return []


@pytest.mark.parametrize("max_n,min_n", [(3, 1), (4, 2), (1, 1)])
def test_prompt_lookup_matches_a_scan_after_every_token(max_n, min_n):
    rng = random.Random(max_n * 10 + min_n)
    tokens = [rng.choice([1, 2, 3, 4, 5, 6]) if rng.random() < 0.6 else rng.randrange(50) for _ in range(300)]
    lookup = PromptLookup(max_n, min_n)
    for i, token in enumerate(tokens):
        lookup.extend([token])
        for num_draft in (1, 4):
            assert lookup.lookup(num_draft) == naive_lookup(tokens[: i + 1], num_draft, max_n, min_n), (i, num_draft)


def test_truncating_the_index_undoes_exactly_what_extending_did():
    rng = random.Random(3)
    tokens = [rng.randrange(8) for _ in range(200)]
    lookup = PromptLookup(3, 1, context=tokens[:50])
    for cut in (199, 120, 50, 7, 0):
        lookup.extend(tokens[len(lookup.tokens) :])
        lookup.truncate(cut)
        fresh = PromptLookup(3, 1, context=tokens[:cut])
        assert lookup.tokens == fresh.tokens and lookup.latest == fresh.latest
        assert lookup.replaced == fresh.replaced, cut


def test_prompt_lookup_rejects_bad_sizes():
    for sizes in ((0, 1), (2, 3), (3, 0)):
        with pytest.raises(ValueError, match="min_ngram_size <= max_ngram_size"):
            PromptLookup(*sizes)
