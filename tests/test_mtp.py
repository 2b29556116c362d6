"""Multi-token-prediction heads (qwen3_next, qwen3_5, qwen3_5_moe) and MTP drafting.

The fixtures are tiny checkpoints with a head, written here in the layout of the hub
checkpoints: `mtp.*` at the top level (also for Qwen3.5's ForConditionalGeneration
names), zero-centred norms, the transformers conv layout, experts per expert
(qwen3_next) or fused (qwen3_5_moe). Each head is first trained for a few steps on
the target's own greedy choices after its post-norm hidden states, so that drafts are
accepted in some rounds and rejected in others.
"""

import contextlib
import importlib
import io
import json
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import mlx.optimizers as optim
import numpy as np
import pytest
from mlx.utils import tree_flatten, tree_unflatten
from test_speculative_sampling import assert_law

from mlx_lm import convert
from mlx_lm.generate import SpeculationStats, generate_step, speculative_generate_step
from mlx_lm.models import qwen3_next
from mlx_lm.models.cache import KVCache, make_prompt_cache
from mlx_lm.sample_utils import make_sampler
from mlx_lm.utils import get_model_classes, load_model
from tokenizer_fixture import write_tokenizer
from checkpoints import TINY_CONFIGS, write_checkpoint

generate_module = importlib.import_module("mlx_lm.generate")  # the package's `generate` is the function

VOCAB = 320
TEXT = dict(
    hidden_size=64, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
    linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=16,
    linear_conv_kernel_dim=4, intermediate_size=96, vocab_size=VOCAB, rms_norm_eps=1e-6,
    full_attention_interval=2, rope_theta=10000.0, partial_rotary_factor=0.25,
)
MOE = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=32)
CONFIGS = {
    "qwen3_next": dict(TEXT, **MOE, model_type="qwen3_next", num_nextn_predict_layers=1, eos_token_id=None),
    "qwen3_5": dict(model_type="qwen3_5", tie_word_embeddings=False,
                    text_config=dict(TEXT, mtp_num_hidden_layers=1, eos_token_id=None)),
    "qwen3_5_moe": dict(model_type="qwen3_5_moe", tie_word_embeddings=True,
                        text_config=dict(TEXT, **MOE, mtp_num_hidden_layers=1, eos_token_id=None)),
}
FAMILIES = list(CONFIGS)
PROMPT = [5, 17, 99, 3, 42, 7, 200, 11]
NUM_TOKENS = 40


def build(config, seed=0):
    model_class, args_class = get_model_classes(config)
    model = model_class(args_class.from_dict(config))
    mx.random.seed(seed)
    model.update(tree_unflatten([(k, mx.random.normal(v.shape) * 0.3) for k, v in tree_flatten(model.parameters())]))
    mx.eval(model.parameters())
    return model


def head_of(model):
    return model.mtp_head


def train_head(model, steps=5):
    """A few Adam steps of the head on the target's own greedy choices after PROMPT:
    pair t (token t+1, post-norm hidden state t) learns the target's argmax at t+1."""
    plain = [t for t, _ in generate_step(mx.array(PROMPT), model, max_tokens=NUM_TOKENS)]
    ids = mx.array(PROMPT + plain)[None]
    hidden, logits = model.hidden_and_logits(ids)
    wanted = mx.argmax(logits[:, 1:], axis=-1)  # (1, T-1): the target's next token after t+1
    model.freeze()
    head_of(model).unfreeze()

    def loss(m):
        _, head_logits = m.mtp_forward(ids[:, 1:], hidden[:, :-1], None)
        return nn.losses.cross_entropy(head_logits, wanted).mean()

    optimizer = optim.Adam(learning_rate=3e-3)
    step = nn.value_and_grad(model, loss)
    for _ in range(steps):
        _, grads = step(model)
        optimizer.update(model, grads)
        mx.eval(model.parameters())
    model.unfreeze()
    return model


def hf_name(key: str) -> str:
    """Our parameter name -> the hub checkpoint's."""
    if key.startswith("language_model."):
        key = key[len("language_model."):]
        if key.startswith("model."):
            return "model.language_model." + key[len("model."):]
    return key


def is_zero_centred(hf_key: str) -> bool:
    return (hf_key.endswith(qwen3_next.ZERO_CENTRED_NORMS) or hf_key in qwen3_next.MTP_NORMS
            or hf_key in ("model.norm.weight", "model.language_model.norm.weight"))


def hf_weights(model, fused_experts: bool):
    """The model's weights as the hub stores them."""
    out = {}
    for key, value in tree_flatten(model.parameters()):
        name = hf_name(key)
        if name.endswith("linear_attn.conv1d.weight"):
            value = value.swapaxes(1, 2)  # (C, K, 1) -> (C, 1, K)
        elif is_zero_centred(name):
            value = value - 1.0
        if ".switch_mlp." in name:
            prefix, proj = name.split(".switch_mlp.")
            proj = proj[: -len(".weight")]
            if fused_experts:
                if proj == "gate_proj":
                    up = dict(tree_flatten(model.parameters()))[key.replace("gate_proj", "up_proj")]
                    out[prefix + ".experts.gate_up_proj"] = mx.concatenate([value, up], axis=1)
                elif proj == "down_proj":
                    out[prefix + ".experts.down_proj"] = value
                continue
            for e in range(value.shape[0]):
                out[f"{prefix}.experts.{e}.{proj}.weight"] = value[e]
            continue
        out[name] = value
    return out


def write_hf(directory: Path, config, weights):
    directory.mkdir(parents=True, exist_ok=True)
    mx.save_safetensors(str(directory / "model.safetensors"), weights)
    (directory / "config.json").write_text(json.dumps(config, indent=2))
    write_tokenizer(directory, vocab_size=VOCAB)
    return directory


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """family -> (directory of the checkpoint with its trained head, the model it was made from)."""
    out = {}
    for i, family in enumerate(FAMILIES):
        model = train_head(build(CONFIGS[family], seed=i))
        directory = tmp_path_factory.mktemp(family)
        out[family] = write_hf(directory, CONFIGS[family], hf_weights(model, fused_experts=family == "qwen3_5_moe"))
    return out


def load_family(checkpoints, family):
    model, _ = load_model(checkpoints[family])
    return model


def greedy(model, **kwargs):
    return [t for t, *_ in speculative_generate_step(mx.array(PROMPT), model, max_tokens=NUM_TOKENS, **kwargs)] \
        if kwargs else [t for t, _ in generate_step(mx.array(PROMPT), model, max_tokens=NUM_TOKENS)]


# --- loading ----------------------------------------------------------------------


@pytest.mark.parametrize("family", FAMILIES)
def test_the_head_loads_and_leaves_plain_output_alone(checkpoints, family, tmp_path):
    model = load_family(checkpoints, family)
    head = model.mtp_head
    assert head is not None and len(head.layers) == 1 and not head.layers[0].is_linear
    moe = family != "qwen3_5"
    assert type(head.layers[0].mlp).__name__ == ("SparseMoeBlock" if moe else "MLP")
    # The zero-centred norms got their 1 once: a second sanitize changes nothing.
    raw = mx.load(str(checkpoints[family] / "model.safetensors"))
    once = model.sanitize(dict(raw))
    twice = model.sanitize(dict(once))
    assert sorted(once) == sorted(twice) and all(mx.array_equal(once[k], twice[k]) for k in once)
    mtp_keys = [k for k in once if ".mtp." in k or k.startswith("mtp.")]
    assert any(k.endswith("mtp.fc.weight") for k in mtp_keys)
    # Without the head (neither weights nor config entry) the logits are the same.
    config = json.loads((checkpoints[family] / "config.json").read_text())
    if "text_config" in config:
        config["text_config"].pop("mtp_num_hidden_layers")
    else:
        config.pop("num_nextn_predict_layers")
    write_hf(tmp_path, config, {k: v for k, v in raw.items() if not k.startswith("mtp.")})
    headless, _ = load_model(tmp_path)
    assert headless.mtp_head is None
    ids = mx.array([PROMPT])
    assert mx.array_equal(model(ids), headless(ids))
    assert greedy(model) == greedy(headless)


def test_a_declared_head_missing_from_the_checkpoint_leaves_the_model_without_one(checkpoints, tmp_path):
    raw = mx.load(str(checkpoints["qwen3_next"] / "model.safetensors"))
    write_hf(tmp_path, CONFIGS["qwen3_next"], {k: v for k, v in raw.items() if not k.startswith("mtp.")})
    model, _ = load_model(tmp_path)
    assert model.mtp_head is None
    with pytest.raises(ValueError, match=r"qwen3_next model \(mlx_lm.models.qwen3_next\) has none.*mtp.fc.weight"):
        list(speculative_generate_step(mx.array(PROMPT), model, mtp=True, max_tokens=4))


def test_a_model_without_a_head_gives_a_clear_error(tmp_path):
    from mlx_lm.batching import BatchGenerator

    directory = write_checkpoint(tmp_path, TINY_CONFIGS["qwen3"])
    model, _ = load_model(directory)
    for call in (lambda: list(generate_step(mx.array(PROMPT), model, mtp=True, max_tokens=4)),
                 lambda: list(speculative_generate_step(mx.array(PROMPT), model, mtp=True, max_tokens=4)),
                 lambda: BatchGenerator(model, mtp=True)):
        with pytest.raises(ValueError, match=r"needs a multi-token-prediction head.*qwen3 model.*mtp\.\* weights"):
            call()


# --- greedy drafting ----------------------------------------------------------------


@pytest.mark.parametrize("family", FAMILIES)
def test_greedy_mtp_output_equals_plain(checkpoints, family):
    model = load_family(checkpoints, family)
    plain = greedy(model)
    for k in (1, 2, 3, 4):
        stats = SpeculationStats()
        tokens = greedy(model, mtp=True, num_draft_tokens=k, adaptive_draft_length=False, stats=stats)
        assert tokens == plain, k
        # Rounds both accepted and rejected drafts (so rollbacks of target and head ran).
        assert 0 < stats.num_accepted < stats.num_drafted, (k, stats)
        assert stats.num_target_forwards < NUM_TOKENS, (k, stats)


def test_greedy_mtp_with_the_adaptive_draft_length(checkpoints):
    model = load_family(checkpoints, "qwen3_next")
    tokens = greedy(model, mtp=True, num_draft_tokens=3)
    assert tokens == greedy(model)


@pytest.mark.parametrize("quantize", [False, True])
def test_convert_keeps_the_head(checkpoints, tmp_path, quantize):
    source = checkpoints["qwen3_5_moe"]
    options = dict(quantize=True, q_group_size=32, q_bits=8) if quantize else {}
    convert(str(source), str(tmp_path / "out"), **options)
    saved = mx.load(str(tmp_path / "out" / "model.safetensors"))
    assert "language_model.mtp.fc.weight" in saved
    assert ("language_model.mtp.fc.scales" in saved) == quantize
    converted, _ = load_model(tmp_path / "out")
    assert converted.mtp_head is not None
    if not quantize:  # float: the very same head
        original = load_family(checkpoints, "qwen3_5_moe")
        for (k, a), (_, b) in zip(tree_flatten(original.mtp_head.parameters()),
                                  tree_flatten(converted.mtp_head.parameters())):
            assert mx.array_equal(a, b), k
    assert greedy(converted, mtp=True, num_draft_tokens=2, adaptive_draft_length=False) == greedy(converted)


# --- the head's cache -------------------------------------------------------------


def reference_head_cache(model, tokens):
    """The head's KV cache after the pairs of `tokens` from one plain forward."""
    hidden, _ = model.hidden_and_logits(mx.array(tokens)[None])
    head_cache = model.make_mtp_cache()
    model.mtp_forward(mx.array(tokens[1:])[None], hidden[:, :-1], head_cache)
    return head_cache


@pytest.mark.parametrize("stop_after", [5, 7, NUM_TOKENS])
def test_the_head_cache_after_finish_or_close_holds_the_committed_pairs(checkpoints, stop_after):
    model = load_family(checkpoints, "qwen3_5")
    prompt_cache = make_prompt_cache(model) + model.make_mtp_cache()
    num_target = len(model.layers)
    generator = speculative_generate_step(mx.array(PROMPT), model, mtp=True, num_draft_tokens=3,
                                          adaptive_draft_length=False, prompt_cache=prompt_cache,
                                          max_tokens=NUM_TOKENS)
    tokens = []
    for token, _, _ in generator:
        tokens.append(token)
        if len(tokens) == stop_after:
            break
    generator.close()
    held = PROMPT + tokens
    attention = [c for c in prompt_cache[:num_target] if isinstance(c, KVCache)][0]
    head = prompt_cache[num_target:]
    assert len(head) == 1 and attention.offset == len(held) and head[0].offset == len(held) - 1
    want = reference_head_cache(model, held)[0]
    for got, expected in zip(head[0].state, want.state):
        np.testing.assert_allclose(np.array(got), np.array(expected), rtol=1e-4, atol=1e-4)


# --- sampling -----------------------------------------------------------------------


def test_sampled_mtp_has_the_target_law_on_the_first_two_tokens(checkpoints):
    """800 runs of two tokens at temperature 1: the first token's histogram against
    the target's p(x1), the second's PIT values given the first (as
    test_speculative_sampling.py does it) uniform."""
    model = load_family(checkpoints, "qwen3_next")
    sampler = make_sampler(temp=1.0, top_k=8)
    prompt = mx.array(PROMPT)
    hidden_logits = model(prompt[None])[0, -1:]
    p1 = np.array(mx.exp(sampler.distribution(hidden_logits - mx.logsumexp(hidden_logits, -1, keepdims=True))))[0]
    mx.random.seed(3)
    stats = SpeculationStats()
    firsts, seconds = [], []
    for _ in range(800):
        pair = [t for t, _, _ in speculative_generate_step(prompt, model, mtp=True, num_draft_tokens=1, stats=stats,
                                                           adaptive_draft_length=False, max_tokens=2, sampler=sampler)]
        firsts.append(pair[0])
        seconds.append(pair[1])
    assert stats.acceptance_rule == "speculative sampling"
    assert 0.05 < stats.acceptance_rate < 0.95, stats
    assert_law(np.bincount(firsts, minlength=VOCAB), p1, "first token")
    # Second token: PIT under p(x2 | x1), one forward per distinct first token.
    rng = np.random.default_rng(4)
    u = []
    laws = {}
    for first, second in zip(firsts, seconds):
        if first not in laws:
            logits = model(mx.array(PROMPT + [first])[None])[0, -1:]
            laws[first] = np.array(mx.exp(sampler.distribution(logits - mx.logsumexp(logits, -1, keepdims=True))))[0]
        law = laws[first]
        u.append(law[:second].sum() + rng.random() * law[second])
    counts = np.bincount(np.minimum((np.array(u) * 10).astype(int), 9), minlength=10)
    assert_law(counts, np.full(10, 0.1), "second token PIT")


# --- CLI ----------------------------------------------------------------------------


def test_cli_mtp_prints_the_same_text(checkpoints):
    def run(*extra):
        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            generate_module.main(["--model", str(checkpoints["qwen3_next"]), "--prompt", "hello world",
                                  "--max-tokens", "24", "--ignore-chat-template", *extra])
        return out.getvalue()

    plain, with_mtp = run("--verbose", "false"), run("--verbose", "false", "--mtp")
    assert plain == with_mtp and plain.strip()
    verbose = run("--mtp", "--num-draft-tokens", "2")
    assert "Speculation:" in verbose and "draft tokens accepted" in verbose


def test_server_mtp_answers_like_plain_serving_and_keeps_the_head_cache(checkpoints):
    """In-process worker of mlx_lm.server --mtp: the same answers as plain serving, a
    second turn continues the stored cache (target and head entries)."""
    from test_server import run_job, user

    from mlx_lm.serving import GenerationWorker, ModelProvider

    directory = str(checkpoints["qwen3_5"])
    answers = {}
    for mtp in (False, True):
        provider = ModelProvider(directory, None, False, 10, 1 << 40, None, mtp=mtp)
        worker = GenerationWorker(provider, default_num_draft_tokens=2, fixed_draft_length=True)
        first = run_job(worker, {"messages": user("hello there"), "max_tokens": 16})
        messages = user("hello there") + [{"role": "assistant", "content": first.text}] + user("and again")
        second = run_job(worker, {"messages": messages, "max_tokens": 16})
        answers[mtp] = (first.text, second.text)
        if mtp:
            assert first.speculation.num_drafted > 0 and second.cached_tokens > 0
            assert len(provider.default.make_cache()) == len(provider.default.model.layers) + 1
    assert answers[True] == answers[False]


def test_the_demo_target_drafts_for_itself():
    """examples/models/qwen3-next-stdlib carries a trained head (train_demo.py --stage mtp)."""
    from mlx_lm import load, stream_generate

    demo = Path(__file__).resolve().parent.parent / "examples" / "models" / "qwen3-next-stdlib"
    model, tokenizer = load(str(demo))
    prompt = tokenizer.encode("def fibonacci(n):")
    plain = [r.token for r in stream_generate(model, tokenizer, prompt, max_tokens=48)]
    responses = list(stream_generate(model, tokenizer, prompt, max_tokens=48, mtp=True, num_draft_tokens=2,
                                     adaptive_draft_length=False))
    assert [r.token for r in responses] == plain
    stats = responses[-1].speculation
    assert stats.acceptance_rate > 0.5 and stats.num_target_forwards <= len(plain) / 1.5, stats
    # 8-bit KV caches, the head's included: the tokens of plain decoding with them.
    quantized = dict(kv_bits=8, kv_group_size=64, max_tokens=24)
    want = [r.token for r in stream_generate(model, tokenizer, prompt, **quantized)]
    assert [r.token for r in stream_generate(model, tokenizer, prompt, mtp=True, **quantized)] == want


def test_a_second_turn_continues_the_prompt_cache(checkpoints):
    """A run continuing a speculative prompt cache (target and head entries) gives the
    tokens plain decoding gives from the same cache."""
    model = load_family(checkpoints, "qwen3_next")
    caches = {name: make_prompt_cache(model) + (model.make_mtp_cache() if name == "mtp" else [])
              for name in ("plain", "mtp")}
    for turn in ([5, 6, 7, 8], [9, 10, 11]):
        kwargs = dict(mtp=True, num_draft_tokens=2, adaptive_draft_length=False, prompt_cache=caches["mtp"])
        got = [t for t, *_ in speculative_generate_step(mx.array(PROMPT + turn), model, max_tokens=12, **kwargs)]
        want = [t for t, _ in generate_step(mx.array(PROMPT + turn), model, max_tokens=12,
                                            prompt_cache=caches["plain"])]
        assert got == want
    assert caches["mtp"][-1].offset > 0


# --- inside a batch ------------------------------------------------------------------


def batch_prompts():
    """Prompts of mixed lengths (one of a single token: its first token is sampled alone)."""
    return [PROMPT, PROMPT[:3] + [250, 17], [9], PROMPT[2:] + PROMPT[:5] + [33, 21]]


@pytest.mark.parametrize("family", ["qwen3_next", "qwen3_5"])
def test_mtp_in_the_batch_equals_solo_and_drafts_as_solo(checkpoints, family):
    """Rows join as others run (two at a time) and leave at their own lengths; each
    answer equals its plain solo run, each row accepts exactly as many drafts as a
    solo MTP run with the same fixed draft length (so the head sees the same pairs),
    and each returned head cache holds the pairs of the row's tokens but the last."""
    from mlx_lm.batching import BatchGenerator

    model = load_family(checkpoints, family)
    prompts, budgets = batch_prompts(), [14, 9, 12, 16]
    plain = [[t for t, _ in generate_step(mx.array(p), model, max_tokens=b)] for p, b in zip(prompts, budgets)]
    solo = []
    for p, b in zip(prompts, budgets):
        stats = SpeculationStats()
        list(speculative_generate_step(mx.array(p), model, mtp=True, num_draft_tokens=3,
                                       adaptive_draft_length=False, max_tokens=b, stats=stats))
        solo.append(stats)
    generator = BatchGenerator(model, mtp=True, num_draft_tokens=3, fixed_draft_length=True,
                               completion_batch_size=2, prefill_step_size=4, return_prompt_caches=True)
    uids = generator.insert(prompts, max_tokens=budgets)
    out, last = {u: [] for u in uids}, {}
    while len(generator):
        for r in generator.next_generated():
            out[r.uid].append(r.token)
            if r.finish_reason:
                last[r.uid] = r
    num_target = len(model.layers)
    for i, u in enumerate(uids):
        assert out[u] == plain[i], i
        assert last[u].speculation.num_accepted == solo[i].num_accepted, (i, last[u].speculation, solo[i])
        held = prompts[i] + out[u]
        head = last[u].prompt_cache[num_target:]
        assert len(head) == 1 and head[0].offset == len(held) - 1
        want = reference_head_cache(model, held)[0]
        for got, expected in zip(head[0].state, want.state):
            np.testing.assert_allclose(np.array(got), np.array(expected), rtol=1e-4, atol=1e-4)
    assert 0 < generator.stats().accepted_tokens < generator.stats().draft_tokens


def test_a_head_no_row_uses_lags_by_a_bounded_chunk(checkpoints, monkeypatch):
    """A head no round drafts with (the policy pinned to plain steps, as it chooses when
    drafting does not pay) still gets the rows' pairs, at most MAX_LAG plain steps late
    (not all at the end in one (B, L) forward), so a returned head cache holds the
    pairs of the row's tokens but the last."""
    from mlx_lm import batch_drafters
    from mlx_lm.batching import BatchGenerator
    from mlx_lm.draft_length import BatchDraftLengthPolicy
    from mlx_lm.sample_utils import make_repetition_penalty

    monkeypatch.setattr(BatchDraftLengthPolicy, "choose", lambda self, batch_size, rows: 0)

    model = load_family(checkpoints, "qwen3_next")
    penalty = [make_repetition_penalty(1.3)]
    plain = [t for t, _ in generate_step(mx.array(PROMPT), model, max_tokens=40, logits_processors=penalty)]
    generator = BatchGenerator(model, mtp=True, return_prompt_caches=True)
    (uid,) = generator.insert([PROMPT], max_tokens=40, logits_processors=[penalty])
    out, lags = [], []
    while len(generator):
        for r in generator.next_generated():
            out.append(r.token)
            last = r
        lags.append(len(generator._drafter.lag))
    assert out == plain and max(lags) == batch_drafters.MAX_LAG - 1
    head = last.prompt_cache[len(model.layers):]
    want = reference_head_cache(model, PROMPT + out)[0]
    assert head[0].offset == len(PROMPT + out) - 1
    for got, expected in zip(head[0].state, want.state):
        np.testing.assert_allclose(np.array(got), np.array(expected), rtol=1e-4, atol=1e-4)


def test_a_queued_mtp_round_is_undone_when_rows_are_removed_or_copied(checkpoints):
    """A copy of a row's caches or a removal between steps (a round queued) holds the
    reported tokens: the target's, and the head's pairs of them but the last; the rows
    that stay go on as alone, with the drafts of a solo run."""
    from mlx_lm.batching import BatchGenerator

    model = load_family(checkpoints, "qwen3_next")
    prompts = batch_prompts()[:3]
    plain = [[t for t, _ in generate_step(mx.array(p), model, max_tokens=16)] for p in prompts]
    generator = BatchGenerator(model, max_tokens=16, mtp=True, num_draft_tokens=3, fixed_draft_length=True)
    uids = generator.insert(prompts)
    out = {u: [] for u in uids}

    def step_until_queued(min_tokens):
        while not generator._rounds.queued or min(len(out[u]) for u in uids) < min_tokens:
            for r in generator.next_generated():
                out[r.uid].append(r.token)

    num_target = len(model.layers)

    def assert_holds(cache, tokens):
        attention = [c for c in cache[:num_target] if isinstance(c, KVCache)][0]
        assert attention.offset == len(tokens) and cache[num_target].offset == len(tokens) - 1
        want = reference_head_cache(model, tokens)[0]
        for got, expected in zip(cache[num_target].state, want.state):
            np.testing.assert_allclose(np.array(got), np.array(expected), rtol=1e-4, atol=1e-4)

    step_until_queued(3)
    copy, held = generator.extract_cache([uids[0]])[uids[0]]
    assert held == prompts[0] + out[uids[0]]
    assert_holds(copy, prompts[0] + out[uids[0]])
    step_until_queued(4)
    cache, held = generator.remove([uids[1]], return_prompt_caches=True)[uids[1]]
    assert held == prompts[1] + out[uids[1]]
    assert_holds(cache, prompts[1] + out[uids[1]])
    while len(generator):
        for r in generator.next_generated():
            out[r.uid].append(r.token)
    assert out[uids[0]] == plain[0] and out[uids[2]] == plain[2]
    assert out[uids[1]] == plain[1][: len(out[uids[1]])]


def test_the_batch_server_speculates_with_the_head(checkpoints):
    """mlx_lm.server --mtp batches: concurrent requests answer as plain serving does,
    each drafting with the head inside the batch; a second turn reuses the stored cache."""
    from test_server_batching import drive, reference, result, user

    from mlx_lm.serving import BatchWorker, ModelProvider

    provider = ModelProvider(str(checkpoints["qwen3_5"]), None, False, 10, 1 << 40, None, mtp=True)
    worker = BatchWorker(provider, prefill_step_size=8, max_batch_size=3, fixed_draft_length=True)
    served = provider.default
    questions = ["hello there", "a longer question, with more words in it", "x", "and again"]
    bodies = [{"messages": user(q), "stream": i == 1} for i, q in enumerate(questions)]
    for body, got in zip(bodies, drive(worker, bodies)):
        answer = result(got)
        assert answer.text == reference(served, body["messages"])
        assert answer.speculation.num_drafted > 0
    assert worker.generator.stats().accepted_tokens > 0
    follow_up = user("hello there") + [{"role": "assistant", "content": result(drive(worker, bodies[:1])[0]).text}] \
        + user("and more")
    answer = result(drive(worker, [{"messages": follow_up}])[0])
    assert answer.text == reference(served, follow_up) and answer.cached_tokens > 0


def test_a_batch_row_continues_a_returned_cache(checkpoints):
    """A row inserted with a cache the batch returned (target and head entries) and a
    continuation of one token or several: the tokens plain decoding gives from the same
    cache, the head still drafting (its pair at the cache's last token is unknown)."""
    from mlx_lm.batching import BatchGenerator
    from mlx_lm.models.lru_prompt_cache import copy_prompt_cache

    model = load_family(checkpoints, "qwen3_next")
    generator = BatchGenerator(model, mtp=True, num_draft_tokens=2, fixed_draft_length=True,
                               return_prompt_caches=True)
    uid, = generator.insert([PROMPT], max_tokens=6)
    first, cache = [], None
    while len(generator):
        for r in generator.next_generated():
            first.append(r.token)
            cache = r.prompt_cache if r.finish_reason else cache
    num_target = len(model.layers)
    for turn in ([77], [9, 10, 11]):
        plain_cache = make_prompt_cache(model)
        model(mx.array(PROMPT + first)[None], cache=plain_cache)
        want = [t for t, _ in generate_step(mx.array(turn), model, max_tokens=10, prompt_cache=plain_cache)]
        uid, = generator.insert([turn], max_tokens=10, caches=[copy_prompt_cache(cache)],
                                all_tokens=[PROMPT + first])
        got = []
        while len(generator):
            for r in generator.next_generated():
                got.append(r.token)
                speculation = r.speculation
        assert got == want, turn
        assert speculation.num_drafted > 0
    assert len(cache) == num_target + 1
