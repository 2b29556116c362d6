"""lfm2.py against transformers, its config dialects and weight layouts, and exact
speculation with LFM2 as target and as draft.

Fixtures under tests/fixtures/lfm2_<dialect>/ come from make_lfm2_reference.py: tiny
random checkpoints saved by transformers 5 (config in the transformers-5 dialect, or
rewritten into the transformers-4 one of Liquid's checkpoints) and the transformers fp32
logits for 40 tokens. Speculation checks follow DESIGN.md §2: tail independence bit for
bit, replay equals feed, greedy speculative output equals plain output, and the caches
afterwards hold exactly what a fresh feed of the same tokens gives.
"""

import mlx.core as mx
import numpy as np
import pytest
from checkpoints import perturb, write_checkpoint
from conftest import FIXTURES
from mlx.utils import tree_flatten

from mlx_lm import convert
from mlx_lm.generate import SpeculationStats, generate_step, speculative_generate_step
from mlx_lm.generate import main as generate_main
from mlx_lm.models.cache import ArraysCache, KVCache, make_prompt_cache, trim_prompt_cache
from mlx_lm.models.lfm2 import CONV_STATE, ModelArgs, conv_prefix_state, feed_forward_dim
from mlx_lm.utils import load_model, quantize_model

FIXTURE_NAMES = ["lfm2_tf4", "lfm2_tf5"]
TOLERANCE = 1e-4  # fp32 on both sides; observed errors are ~2e-6
C, F = "conv", "full_attention"
ARGS = dict(model_type="lfm2", vocab_size=64, hidden_size=32, num_hidden_layers=4, num_attention_heads=4,
            num_key_value_heads=2)
PROMPT = mx.array([(i * 37 + 11) % 256 for i in range(20)])
NUM_TOKENS = 30
NOISE = 0.05
# A tiny LFM2 written by the tests (MLX conv layout), with a tokenizer, for the CLI.
TINY = dict(ARGS, vocab_size=512, hidden_size=64, intermediate_size=128, block_auto_adjust_ff_dim=False,
            layer_types=[C, F, C, F], eos_token_id=0)


def model(name):
    return load_model(FIXTURES / name)[0]


def relative_error(got, want):
    return (mx.abs(got - want).max() / mx.abs(want).max()).item()


def reference(name):
    data = mx.load(str(FIXTURES / name / "reference.safetensors"))
    return data["input_ids"], data["logits"]


def raw_weights(name):
    return mx.load(str(FIXTURES / name / "model.safetensors"))


def decode(lfm2, ids, pieces):
    """Logits for `ids` fed through the model's cache in pieces of the given lengths."""
    cache, start, logits = make_prompt_cache(lfm2), 0, []
    for length in pieces:
        logits.append(lfm2(ids[:, start : start + length], cache=cache))
        start += length
    assert start == ids.shape[1]
    return mx.concatenate(logits, axis=1)


# --- against transformers ---------------------------------------------------------------


@pytest.mark.parametrize("name", FIXTURE_NAMES)
def test_logits_match_transformers_full_and_cached(name):
    lfm2, (ids, want) = model(name), reference(name)
    T = ids.shape[1]
    assert relative_error(lfm2(ids), want) < TOLERANCE
    for pieces in ([1] * T, [7, 1, 3, T - 11]):
        assert relative_error(decode(lfm2, ids, pieces), want) < TOLERANCE, pieces


def test_fixtures_cover_both_dialects_and_layouts():
    tf4, tf5 = model("lfm2_tf4"), model("lfm2_tf5")
    assert [layer.is_attention for layer in tf4.layers] == [False, True, False, True]  # full_attn_idxs [1, 3]
    assert [layer.is_attention for layer in tf5.layers] == [False, False, True, False]  # layer_types
    assert "lm_head" not in tf4 and "lm_head" in tf5  # tie_embedding / tie_word_embeddings
    assert tf4.layers[0].feed_forward.w1.weight.shape == (96, 64)  # block_ff_dim as is
    assert tf5.layers[0].feed_forward.w1.weight.shape == (144, 64)  # 160 * 2/3 rounded up to 48s
    assert tf5.layers[0].conv.conv.weight.shape == (64, 4, 1) and "bias" in tf5.layers[0].conv.conv
    assert (tf4.args.rope_theta, tf5.args.rope_theta) == (1e6, 5000.0)


# --- config -----------------------------------------------------------------------------


def test_dialects_normalise_alike():
    tf5 = ModelArgs.from_dict(dict(ARGS, layer_types=[C, F, C, F], intermediate_size=96, tie_word_embeddings=False,
                                   rope_parameters={"rope_type": "default", "rope_theta": 5e5}))
    tf4 = ModelArgs.from_dict(dict(ARGS, full_attn_idxs=[1, 3], block_ff_dim=96, tie_embedding=False, rope_theta=5e5))
    for field in ("layer_types", "full_attn_idxs", "intermediate_size", "block_ff_dim", "tie_word_embeddings",
                  "rope_theta", "rope_scaling", "feed_forward_dim"):
        assert getattr(tf4, field) == getattr(tf5, field), field
    defaults = ModelArgs.from_dict(dict(ARGS, intermediate_size=96))
    assert defaults.layer_types == [F] * 4  # transformers: every layer attends without a pattern
    assert (defaults.rope_theta, defaults.tie_word_embeddings, defaults.head_dim) == (1e6, True, 8)


@pytest.mark.parametrize("extra, message", [
    (dict(), "neither intermediate_size nor block_ff_dim"),
    (dict(intermediate_size=96, block_ff_dim=64), "intermediate_size is 96 but block_ff_dim is 64"),
    (dict(intermediate_size=96, tie_word_embeddings=True, tie_embedding=False), "tie_word_embeddings is True"),
    (dict(intermediate_size=96, layer_types=[C, F, C, F], full_attn_idxs=[1]), "full_attn_idxs \\[1\\] disagrees"),
    (dict(intermediate_size=96, layer_types=[C, "mamba", C, F]), "unknown kinds \\['mamba'\\]"),
    (dict(intermediate_size=96, conv_L_cache=1), "conv_L_cache must be >= 2, got 1"),
    (dict(intermediate_size=96, num_key_value_heads=3), "num_key_value_heads \\(3\\)"),
])
def test_config_errors_name_the_value(extra, message):
    with pytest.raises(ValueError, match=message):
        ModelArgs.from_dict(dict(ARGS, **extra))


def test_feed_forward_dim_follows_transformers():
    # LFM2-1.2B and -350M: block_ff_dim 12288 and 6656 give the trained 8192 and 4608.
    assert feed_forward_dim(12288, True, 1.0, 256) == 8192
    assert feed_forward_dim(6656, True, 1.0, 256) == 4608
    assert feed_forward_dim(100, True, None, 256) == 66  # no multiplier: no rounding either
    assert feed_forward_dim(96, True, 1.5, 32) == 96
    assert feed_forward_dim(100, False, 1.5, 256) == 100


# --- weights ----------------------------------------------------------------------------


def assert_same(a, b):
    assert a.keys() == b.keys()
    for k in a:
        assert a[k].shape == b[k].shape and mx.array_equal(a[k], b[k]), k


@pytest.mark.parametrize("name", FIXTURE_NAMES)
def test_sanitize_converts_the_hf_layout_once(name, tmp_path):
    lfm2, raw = model(name), raw_weights(name)
    once = lfm2.sanitize(raw)
    assert_same(lfm2.sanitize(dict(once)), once)
    conv = "model.layers.0.conv.conv.weight"
    assert raw[conv].shape[1] == 1 and once[conv].shape[2] == 1
    assert mx.array_equal(once[conv][..., 0], raw[conv][:, 0])
    tied = dict(raw, **{"lm_head.weight": raw["model.embed_tokens.weight"]})
    assert ("lm_head.weight" in lfm2.sanitize(tied)) == (name == "lfm2_tf5")
    # Saved as an MLX converter saves them, the weights load to the same logits.
    mx.save_safetensors(str(tmp_path / "model.safetensors"), once)
    (tmp_path / "config.json").write_text((FIXTURES / name / "config.json").read_text())
    ids, want = reference(name)
    assert relative_error(load_model(tmp_path)[0](ids), want) < TOLERANCE


# --- caches and rollback ----------------------------------------------------------------


def flat_state(cache):
    return [x for c in cache for _, x in tree_flatten(c.state) if x is not None]


def test_cache_layout_and_conv_state():
    """The conv state is the last K-1 rows of B * x, and conv_prefix_state(m) is the
    state after m tokens (equal to a token-by-token feed up to BLAS rounding)."""
    lfm2 = model("lfm2_tf5")  # K = 4
    cache = make_prompt_cache(lfm2)
    assert [type(c) for c in cache] == [ArraysCache, ArraysCache, KVCache, ArraysCache]
    conv, norm = lfm2.layers[0].conv, lfm2.layers[0].operator_norm
    x = norm(lfm2.model.embed_tokens(PROMPT[None, :9]))
    whole = ArraysCache(1)
    conv(x[:, :3], whole)
    b, _, v = mx.split(conv.in_proj(x[:, 3:]), 3, axis=-1)
    conv_input = mx.concatenate([whole[CONV_STATE], b * v], axis=1)
    conv(x[:, 3:], whole)
    assert whole[CONV_STATE].shape == (1, 3, 64)
    assert mx.array_equal(whole[CONV_STATE], conv_prefix_state(conv_input, 6, 6)[0])
    stepped = ArraysCache(1)
    for t in range(9):
        conv(x[:, t : t + 1], stepped)
        if t >= 3:
            want = conv_prefix_state(conv_input, 6, t - 2)[0]
            assert mx.allclose(stepped[CONV_STATE], want, atol=1e-5, rtol=1e-5), t


def prefilled(lfm2):
    cache = make_prompt_cache(lfm2)
    lfm2(PROMPT[None], cache=cache)
    for c in cache:
        c.start_speculation()
    return cache


@pytest.mark.parametrize("name", FIXTURE_NAMES)
def test_tail_independence_and_replay_equals_feed(name):
    lfm2, T = model(name), 6
    assert type(lfm2).supports_speculative_rollback
    rng = np.random.default_rng(0)
    prefix_all, next_token = [11, 22, 33, 44, 55, 66], mx.array([[99]])
    for m in range(T + 1):
        caches = []
        for _ in range(2):
            cache = prefilled(lfm2)
            lfm2(mx.array([prefix_all[:m] + rng.integers(0, 256, T - m).tolist()]), cache=cache)
            assert trim_prompt_cache(cache, T - m) == T - m
            caches.append(cache)
        a, b = (flat_state(c) for c in caches)
        assert len(a) == len(b) and all(mx.array_equal(x, y) for x, y in zip(a, b)), f"m={m}"
        logits = [lfm2(next_token, cache=c) for c in caches]
        assert mx.array_equal(logits[0], logits[1]), f"m={m}"
        fed = prefilled(lfm2)
        if m:
            lfm2(mx.array([prefix_all[:m]]), cache=fed)
        fed_logits = lfm2(next_token, cache=fed)
        assert all(mx.allclose(x, y, atol=1e-5, rtol=1e-5) for x, y in zip(flat_state(caches[0]), flat_state(fed)))
        assert mx.allclose(logits[0], fed_logits, atol=1e-4, rtol=1e-4), f"m={m}"


def test_draft_steps_roll_back_together_and_prefill_records_nothing():
    lfm2 = model("lfm2_tf4")
    cache = prefilled(lfm2)
    convs = [c for c in cache if isinstance(c, ArraysCache)]
    assert all(c._rollbacks.num_tokens == 0 for c in convs)  # the prefill left no record
    before, after_one = flat_state(cache), None
    for i, token in enumerate([5, 6, 7]):
        lfm2(mx.array([[token]]), cache=cache)
        after_one = flat_state(cache) if i == 0 else after_one
    trim_prompt_cache(cache, 2)
    assert all(mx.array_equal(x, y) for x, y in zip(flat_state(cache), after_one))
    trim_prompt_cache(cache, 1)
    assert all(mx.array_equal(x, y) for x, y in zip(flat_state(cache), before))
    with pytest.raises(RuntimeError, match="Cannot roll back 1 tokens"):
        trim_prompt_cache(cache, 1)


# --- speculative decoding ---------------------------------------------------------------


def plain(target, num_tokens=NUM_TOKENS):
    return [t for t, _ in generate_step(PROMPT, target, max_tokens=num_tokens)]


def accepted_per_round(out):
    """Drafts accepted per round, from the from_draft flags (the last round may draft fewer)."""
    rounds, run = [], 0
    for _, _, from_draft in out:
        if from_draft:
            run += 1
        else:  # the target's own token closes a round
            rounds.append(run)
            run = 0
    return rounds[:-1]


def speculate(target, draft, k, prompt_cache=None, stats=None):
    return list(speculative_generate_step(PROMPT, target, draft, num_draft_tokens=k, adaptive_draft_length=False,
                                          max_tokens=NUM_TOKENS, prompt_cache=prompt_cache, stats=stats))


def drafts_for(name):
    return {"dense": model("qwen3_tf5"), "self": model(name), "noisy": perturb(model(name), NOISE, seed=1)}


@pytest.mark.parametrize("name", FIXTURE_NAMES)
def test_greedy_speculation_with_lfm2_target_equals_plain(name):
    target = model(name)
    want = plain(target)
    for kind, draft in drafts_for(name).items():
        partly = 0
        for k in (1, 3, 6):
            stats = SpeculationStats()
            out = speculate(target, draft, k, stats=stats)
            assert [t for t, _, _ in out] == want, f"{kind} k={k}"
            assert sum(from_draft for _, _, from_draft in out) == stats.num_accepted
            partly += sum(0 < n < k for n in accepted_per_round(out))
            if kind == "noisy":
                assert 0 < stats.num_accepted < stats.num_drafted, k
            elif kind == "self":
                assert stats.num_accepted == stats.num_drafted, k
            elif kind == "dense":
                assert stats.num_accepted < stats.num_drafted / 2, k
        if kind == "noisy":
            assert partly > 0  # rounds whose rollback keeps part of what the target verified


@pytest.mark.parametrize("target_name", ["llama_tf4", "qwen3_next_tf5"])
def test_lfm2_as_draft_keeps_the_target_output(target_name):
    target, draft = model(target_name), model("lfm2_tf5")
    want = plain(target)
    for k in (2, 5):
        stats = SpeculationStats()
        assert [t for t, _, _ in speculate(target, draft, k, stats=stats)] == want, k
        assert stats.num_drafted > stats.num_accepted  # rolled back


def fresh_feed(side_model, tokens):
    """A fresh cache fed `tokens` as the draft feeds them: all but the prompt's last in one
    forward, then one by one."""
    cache = make_prompt_cache(side_model)
    side_model(mx.array([tokens[: PROMPT.size - 1]]), cache=cache)
    for token in tokens[PROMPT.size - 1 :]:
        side_model(mx.array([[token]]), cache=cache)
    return cache


def assert_holds(side_model, cache, tokens, exact):
    """`cache` holds exactly `tokens`: the sizes of a fresh feed and its logits for a
    continuation (bit for bit when `exact`); and it no longer speculates."""
    fresh, follow = fresh_feed(side_model, tokens), mx.array([[5, 9, 200]])
    assert [c.size() for c in cache] == [c.size() for c in fresh]
    assert not any(c.is_trimmable() and c.needs_layer_records for c in cache)
    got, want = side_model(follow, cache=cache), side_model(follow, cache=fresh)
    assert mx.array_equal(got, want) if exact else mx.allclose(got, want, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("target_name, draft_name", [("lfm2_tf4", None), ("qwen3_next_tf5", "lfm2_tf5")])
def test_caches_after_speculation_equal_a_fresh_feed(target_name, draft_name):
    """After finishing, and after closing inside a multi-token round, target and draft
    caches hold exactly prompt + every yielded token (hybrid target, hybrid draft)."""
    target = model(target_name)
    draft = perturb(model(target_name), NOISE, seed=1) if draft_name is None else model(draft_name)
    for stop_after in (NUM_TOKENS, 13):
        cache = make_prompt_cache(target) + make_prompt_cache(draft)
        generator = speculative_generate_step(PROMPT, target, draft, num_draft_tokens=3, adaptive_draft_length=False,
                                              max_tokens=NUM_TOKENS, prompt_cache=cache)
        tokens = PROMPT.tolist() + [t for t, _, _ in (next(generator) for _ in range(stop_after))]
        generator.close()
        split = len(target.layers)
        assert_holds(target, cache[:split], tokens, exact=False)
        assert_holds(draft, cache[split:], tokens, exact=True)


# --- quantization and the command line --------------------------------------------------


def test_quantized_round_trip_generates_and_speculates(tmp_path):
    """convert -q (MLX-layout source) -> load rebuilds the in-memory quantization bit for
    bit; the quantized model, a target with a noisy float draft, keeps its greedy output."""
    source = write_checkpoint(tmp_path / "hf", TINY, seed=4)
    convert(str(source), tmp_path / "q", quantize=True, q_bits=8, q_group_size=32)
    quantized, _ = load_model(tmp_path / "q")
    in_memory, config = load_model(source)
    quantize_model(in_memory, config, 32, 8)
    tokens = PROMPT[None]
    assert mx.array_equal(quantized(tokens), in_memory(tokens))
    # 8 bits, group 32 against the float model: 0.033 measured (4 bits: 0.60).
    assert relative_error(quantized(tokens), load_model(source)[0](tokens)) < 0.05
    want = plain(quantized)
    draft = perturb(load_model(source)[0], NOISE, seed=1)
    assert [t for t, _, _ in speculate(quantized, draft, 3)] == want


def run_generate(capsys, argv):
    """(generated text, the report after it) of one `mlx_lm.generate` run."""
    generate_main(argv)
    _, text, report = capsys.readouterr().out.split("=" * 10)
    return text, report


def test_cli_with_an_lfm2_draft_prints_the_plain_text(tmp_path, capsys):
    target = write_checkpoint(tmp_path / "target", TINY, seed=5)
    draft = write_checkpoint(tmp_path / "draft", TINY, seed=5, noise=NOISE)
    common = ["--model", str(target), "--prompt", "def add(a, b):", "--max-tokens", "24", "--ignore-chat-template"]
    plain_text, _ = run_generate(capsys, common)
    assert plain_text.strip()
    text, report = run_generate(capsys, [*common, "--draft-model", str(draft), "--num-draft-tokens", "3"])
    assert text == plain_text
    assert "Speculation:" in report and "(0.0%)" not in report and "(100.0%)" not in report, report
