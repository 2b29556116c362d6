"""speculative_generate_step: lossless on every cache kind, consistent caches after.

Targets: dense llama and qwen3, gpt-oss past its sliding window, and the Gated-DeltaNet
hybrids. Drafts: a different random model (disagrees: nearly every round rolls back all
it drafted), the target plus 5% noise (rounds end fully, partly and not at all accepted,
so rollbacks of several tokens run through the GDN replay and the sliding-window
re-append), the target itself (agrees: rounds accept everything), and a hybrid.

Cache checks compare with a fresh cache fed the same tokens (the prompt but its last
token in one forward, then one token at a time). Both sides take several tokens in
one forward at times (the target's verify; the draft catching up after a fully
accepted round, whose last proposal it is fed with the next token), so the logits
agree to 1e-4, not bit for bit; the sizes must be equal.
"""

import itertools
import json
import shutil
import subprocess
import sys

import mlx.core as mx
import mlx.nn as nn
import pytest
from checkpoints import TINY_CONFIGS, perturb, with_noise, write_checkpoint
from conftest import FIXTURES

from mlx_lm import load, stream_generate
from mlx_lm.draft_length import DraftLengthPolicy
from mlx_lm.generate import (
    SpeculationStats,
    check_same_tokenizer,
    generate_step,
    speculative_generate_step,
)
from mlx_lm.models.cache import ArraysCache, KVCache, make_prompt_cache
from mlx_lm.utils import load_model

PROMPT = mx.array([(i * 37 + 11) % 256 for i in range(20)])  # longer than gpt-oss's window (8)
NUM_TOKENS = 40
NOISE = 0.05
# Qwen3's tiny fixture keeps its greedy choices under more noise before rounds split.
NOISE_FOR = {"qwen3_tf4": 0.15}

TARGETS = ["llama_tf4", "qwen3_tf4", "gpt_oss_tf5", "qwen3_next_tf5", "qwen3_5_tf4", "qwen3_5_moe_tf5"]
# Draft kind -> the draft lengths it runs with (fewer where more would repeat a case).
DRAFT_LENGTHS = {"disagreeing": (1, 3, 7), "noisy": (2, 4, 7), "self": (1, 4), "hybrid": (2, 5)}


def model(name):
    return load_model(FIXTURES / name)[0]


def noisy(name, seed=0):
    """The target's own weights plus noise: agrees with it part of the time."""
    return perturb(model(name), NOISE_FOR.get(name, NOISE), seed)


def plain(target, prompt=PROMPT, num_tokens=NUM_TOKENS, prompt_cache=None):
    return [t for t, _ in generate_step(prompt, target, max_tokens=num_tokens, prompt_cache=prompt_cache)]


def draft_for(kind, target_name):
    hybrid = "qwen3_next_tf4" if target_name.startswith("qwen3_next") else "qwen3_5_tf5"
    return {
        "disagreeing": lambda: model("llama_tf4" if target_name.startswith("qwen3_tf") else "qwen3_tf5"),
        "noisy": lambda: noisy(target_name),
        "self": lambda: model(target_name),
        "hybrid": lambda: model(hybrid),
    }[kind]()


def accepted_per_round(out):
    """Drafts accepted in each round, read from the from_draft flags: a round yields
    its accepted drafts, then the target's own token. A last round that ends on drafts
    (max_tokens reached, its bonus token unused) is not counted: it drafted fewer."""
    rounds, run = [], 0
    for _, _, from_draft in out:
        if from_draft:
            run += 1
        else:
            rounds.append(run)
            run = 0
    return rounds


FOLLOW = mx.array([[5, 9, 200]])
_reference_logits = {}


def reference(side_model, tokens, max_kv_size=None):
    """Sizes and logits for FOLLOW of a fresh cache fed `tokens` the way the draft
    feeds them (all but the prompt's last token in one forward, then one by one).
    Memoised: the failure sweeps end at the same tokens many times. An entry keeps its
    model alive, so no other model can reuse the id it is filed under."""
    key = (id(side_model), tuple(tokens), max_kv_size)
    if key not in _reference_logits:
        fresh = make_prompt_cache(side_model, max_kv_size)
        head = min(PROMPT.size - 1, len(tokens))
        if head:
            side_model(mx.array(tokens[:head])[None], cache=fresh)
        for token in tokens[head:]:
            side_model(mx.array([[token]]), cache=fresh)
        sizes = [c.size() for c in fresh]
        _reference_logits[key] = side_model, sizes, side_model(FOLLOW, cache=fresh)
    return _reference_logits[key][1:]


def assert_holds(side_model, prompt_cache, tokens, exact, where="", max_kv_size=None):
    """`prompt_cache` holds exactly `tokens`: the sizes of a fresh feed, and its logits
    for a 3-token continuation (bit for bit when `exact`, else within 1e-4); and it no
    longer speculates. Feeds the continuation."""
    sizes, want = reference(side_model, tokens, max_kv_size)
    assert [c.size() for c in prompt_cache] == sizes, where
    assert not any(c.is_trimmable() and c.needs_layer_records for c in prompt_cache), where
    got = side_model(FOLLOW, cache=prompt_cache)
    if exact:
        assert mx.array_equal(got, want), f"{where}: max diff {mx.abs(got - want).max().item()}"
    else:
        assert mx.allclose(got, want, atol=1e-4, rtol=1e-4), f"{where}: max diff {mx.abs(got - want).max().item()}"


def split(target, prompt_cache):
    return prompt_cache[: len(target.layers)], prompt_cache[len(target.layers) :]


@pytest.mark.parametrize("target_name", TARGETS)
@pytest.mark.parametrize("draft_kind", DRAFT_LENGTHS)
def test_greedy_speculative_equals_plain(target_name, draft_kind):
    target, draft = model(target_name), draft_for(draft_kind, target_name)
    want = plain(target)
    rounds = {}
    for k in DRAFT_LENGTHS[draft_kind]:
        stats = SpeculationStats()
        out = list(speculative_generate_step(PROMPT, target, draft, num_draft_tokens=k, adaptive_draft_length=False,
                                             max_tokens=NUM_TOKENS, stats=stats))
        assert [t for t, _, _ in out] == want, f"k={k}"
        assert sum(from_draft for _, _, from_draft in out) == stats.num_accepted
        rounds[k] = accepted_per_round(out)
        if draft_kind == "self":
            assert stats.num_accepted == stats.num_drafted  # the target agrees with itself
        elif draft_kind != "noisy":
            assert stats.num_accepted < stats.num_drafted / 2  # mostly rolled back
    if draft_kind == "noisy":
        # Partly accepted rounds at every k: the target keeps 2..k of its k + 1 verified
        # tokens (a multi-token GDN replay, a multi-token sliding-window re-append).
        assert all(any(0 < n < k for n in rounds[k]) for k in rounds), rounds
        assert any(n == k for k in rounds for n in rounds[k]), rounds  # fully accepted too
        assert any(n == 0 for k in rounds for n in rounds[k]), rounds  # and nothing accepted


@pytest.mark.parametrize("target_name", TARGETS)
def test_caches_after_speculation_equal_a_fresh_feed(target_name):
    """After finishing, and after closing at a yield inside a multi-token round, both
    caches hold exactly prompt + every yielded token."""
    target, draft = model(target_name), noisy(target_name)
    for stop_after in (NUM_TOKENS, 13):
        cache = make_prompt_cache(target) + make_prompt_cache(draft)
        generator = speculative_generate_step(PROMPT, target, draft, num_draft_tokens=3, adaptive_draft_length=False,
                                              max_tokens=NUM_TOKENS, prompt_cache=cache)
        tokens = PROMPT.tolist() + [t for t, _, _ in (next(generator) for _ in range(stop_after))]
        generator.close()
        target_cache, draft_cache = split(target, cache)
        assert_holds(target, target_cache, tokens, exact=False)
        assert_holds(draft, draft_cache, tokens, exact=False)


# ---------------------------------------------------------------------------
# Failures at every point of a round, and closing or throwing at every yield.


class Faults:
    """Numbers, in order, every call a round makes into code that can fail (the two
    models' forwards, the logits processor, the sampler, the sync of the target's
    samples) and raises `error` at call number `fail_at` (0: never)."""

    def __init__(self, fail_at=0, error=RuntimeError):
        self.fail_at, self.error, self.events = fail_at, error, []

    def tick(self, event):
        self.events.append(event)
        if len(self.events) == self.fail_at:
            raise self.error(f"injected at call {self.fail_at}: {event}")

    def processor(self, history, logits):
        self.tick("processor")
        return logits

    def sampler(self, logprobs):
        self.tick("sampler")
        return WatchedSync(mx.argmax(logprobs, axis=-1), self)


class WatchedSync:
    """The sampler's tokens; reading them (`.tolist()`, `.item()`; `.astype()`, where
    acceptance takes them on the device before the round's sync) counts as a call that
    can fail."""

    def __init__(self, tokens, faults):
        self.tokens, self.faults = tokens, faults

    def astype(self, dtype):
        self.faults.tick("sync")
        return self.tokens.astype(dtype)

    def tolist(self):
        self.faults.tick("sync")
        return self.tokens.tolist()

    def item(self):  # a plain step's sync
        self.faults.tick("sync")
        return self.tokens.item()


class Watched:
    """A model whose forwards after the first (the prefill) count as calls that can fail."""

    supports_speculative_rollback = True  # the wrapped models' layers record

    def __init__(self, inner, faults, role):
        self.inner, self.faults, self.role, self.calls = inner, faults, role, 0
        self.args, self.layers = inner.args, inner.layers

    def make_cache(self):
        return self.inner.make_cache()

    def __call__(self, inputs, cache=None):
        self.calls += 1
        if self.calls > 1:
            self.faults.tick(f"{self.role} forward")
        return self.inner(inputs, cache=cache)


# (target, max_kv_size, draft noise): GDN + KV layers; sliding windows (12 < the prompt)
# on a fast model. With these noises (seed 1) round 1 accepts everything, round 2 part.
FAULT_PAIRS = [("qwen3_5_tf4", None, 0.02), ("llama_tf4", 12, NOISE)]
FAULT_K, FAULT_TOKENS = 2, 14


def faulty_run(target, draft, faults, max_kv_size):
    """Run with `faults`; returns (tokens yielded, the exception raised or None, cache)."""
    cache = make_prompt_cache(target, max_kv_size) + make_prompt_cache(draft, max_kv_size)
    yielded, raised = [], None
    generator = speculative_generate_step(
        PROMPT, Watched(target, faults, "target"), Watched(draft, faults, "draft"),
        num_draft_tokens=FAULT_K, adaptive_draft_length=False, max_tokens=FAULT_TOKENS, prompt_cache=cache,
        sampler=faults.sampler, logits_processors=[faults.processor],
    )
    try:
        for token, _, from_draft in generator:
            yielded.append((token, from_draft))
    except BaseException as e:  # KeyboardInterrupt too
        raised = e
    return yielded, raised, cache


@pytest.fixture(scope="module", params=FAULT_PAIRS, ids=lambda pair: f"{pair[0]}-window{pair[1]}")
def fault_pair(request):
    name, max_kv_size, noise = request.param
    return name, model(name), perturb(model(name), noise, seed=1), max_kv_size


def test_failure_at_every_call_of_a_round_leaves_both_caches_consistent(fault_pair):
    """Each call of the first rounds fails once (RuntimeError or KeyboardInterrupt,
    alternately): the error surfaces unchanged, and target and draft both hold the
    prompt + yielded tokens but the last, also after a fully accepted round."""
    name, target, draft, window = fault_pair
    baseline = Faults()
    out, raised, _ = faulty_run(target, draft, baseline, window)
    assert raised is None
    rounds = accepted_per_round([(t, None, d) for t, d in out])
    # Sweep three rounds: the second follows a fully accepted one (before the fix the
    # draft was two tokens behind there) and rolls back part of its drafts.
    assert rounds[0] == FAULT_K and 0 < rounds[1] < FAULT_K, rounds
    last_call = [i for i, e in enumerate(baseline.events) if e == "sync"][2] + 2
    assert {"processor", "sampler", "sync", "draft forward", "target forward"} <= set(baseline.events[:last_call])
    for fail_at in range(1, last_call + 1):
        error = KeyboardInterrupt if fail_at % 2 else RuntimeError
        faults = Faults(fail_at, error)
        yielded, raised, cache = faulty_run(target, draft, faults, window)
        where = f"{name}: failed at call {fail_at} ({faults.events[-1]})"
        assert type(raised) is error and str(raised).startswith(f"injected at call {fail_at}:"), where
        tokens = (PROMPT.tolist() + [t for t, _ in yielded])[:-1]
        target_cache, draft_cache = split(target, cache)
        assert_holds(target, target_cache, tokens, exact=False, where=where, max_kv_size=window)
        assert_holds(draft, draft_cache, tokens, exact=False, where=where, max_kv_size=window)


def test_close_or_throw_at_every_yield(fault_pair):
    """close() at any yield leaves prompt + yielded tokens; an exception thrown in at
    a yield leaves them minus the last (the round may have committed more)."""
    name, target, draft, window = fault_pair
    for num_taken in range(1, 8):
        for how in ("close", "throw"):
            cache = make_prompt_cache(target, window) + make_prompt_cache(draft, window)
            generator = speculative_generate_step(PROMPT, target, draft, num_draft_tokens=FAULT_K, adaptive_draft_length=False,
                                                  max_tokens=FAULT_TOKENS, prompt_cache=cache)
            tokens = PROMPT.tolist() + [t for t, _, _ in (next(generator) for _ in range(num_taken))]
            if how == "close":
                generator.close()
            else:
                with pytest.raises(ValueError, match="thrown in"):
                    generator.throw(ValueError("thrown in"))
                tokens = tokens[:-1]
            target_cache, draft_cache = split(target, cache)
            where = f"{name}: {how} after {num_taken} tokens"
            assert_holds(target, target_cache, tokens, exact=False, where=where, max_kv_size=window)
            assert_holds(draft, draft_cache, tokens, exact=False, where=where, max_kv_size=window)


class RecurrentOnly:
    """A model whose cache is recurrent but whose layers do not record rollbacks."""

    def __init__(self, inner):
        self.inner, self.args, self.layers, self.calls = inner, inner.args, inner.layers, 0

    def make_cache(self):
        return [ArraysCache(2) for _ in self.layers]

    def __call__(self, inputs, cache=None):
        self.calls += 1
        return self.inner(inputs)


def test_unsupported_caches_and_arguments_fail_before_any_work():
    target = model("llama_tf4")
    recurrent = RecurrentOnly(model("qwen3_tf5"))
    for t, d, role in ((target, recurrent, "draft model"), (recurrent, target, "target model")):
        with pytest.raises(ValueError, match=f"every cache of the {role}.*ArraysCache"):
            next(speculative_generate_step(PROMPT, t, d))
    assert recurrent.calls == 0
    with pytest.raises(ValueError, match="num_draft_tokens"):
        next(speculative_generate_step(PROMPT, target, target, num_draft_tokens=0))
    with pytest.raises(ValueError, match="speculation needs the target's 2 followed by the draft's 2"):
        next(speculative_generate_step(PROMPT, target, target, prompt_cache=[KVCache()]))


# ---------------------------------------------------------------------------
# Drafts whose embedding table is padded to another size; tokenizers that differ.


def with_table(source, rows):
    """`source` (a llama) with its embedding and output tables cut or padded to `rows`.
    Padding rows of the output table are 3x the first rows', so whenever the best
    logit is positive a padding id would beat it: proposals beyond the target's table
    would follow at once if the loop did not mask them."""
    embed, head = source.model.embed_tokens.weight, source.lm_head.weight
    if rows > embed.shape[0]:
        extra = rows - embed.shape[0]
        embed = mx.concatenate([embed, embed[:extra]])
        head = mx.concatenate([head, 3 * head[:extra]])
    source.model.embed_tokens = nn.Embedding(rows, embed.shape[1])
    source.model.embed_tokens.weight = embed[:rows]
    source.lm_head = nn.Linear(head.shape[1], rows, bias=False)
    source.lm_head.weight = head[:rows]
    source.args.vocab_size = rows
    return source


def test_draft_tables_of_another_size_use_the_shared_range():
    """A larger draft table never proposes ids the target lacks; a smaller one is fed
    id 0 for committed ids beyond it, and its logits are widened with -inf so logits
    processors (built for the target's ids) apply to it too. Output is the target's."""
    from mlx_lm.sample_utils import make_logits_processors

    target = model("llama_tf4")
    processors = make_logits_processors(logit_bias={250: 1.0}, repetition_penalty=1.5)
    want = plain(target)
    want_processed = [t for t, _ in generate_step(PROMPT, target, max_tokens=16, logits_processors=processors)]
    for rows in (512, 200):
        draft = with_table(noisy("llama_tf4"), rows)
        cache = make_prompt_cache(target) + make_prompt_cache(draft)
        stats = SpeculationStats()
        out = list(speculative_generate_step(PROMPT, target, draft, num_draft_tokens=3, adaptive_draft_length=False,
                                             max_tokens=NUM_TOKENS, prompt_cache=cache, stats=stats))
        assert [t for t, _, _ in out] == want, f"draft table {rows}"
        assert stats.num_accepted > 0, f"draft table {rows}"
        tokens = PROMPT.tolist() + want
        target_cache, draft_cache = split(target, cache)
        assert_holds(target, target_cache, tokens, exact=False)
        if rows < 256:
            assert any(t >= rows for t in tokens)  # the draft was fed ids beyond its table
            tokens = [t if t < rows else 0 for t in tokens]
        assert_holds(draft, draft_cache, tokens, exact=False)
        processed = speculative_generate_step(PROMPT, target, draft, num_draft_tokens=3, adaptive_draft_length=False,
                                              max_tokens=16,
                                              logits_processors=processors)
        assert [t for t, _, _ in processed] == want_processed, f"draft table {rows}"


@pytest.fixture(scope="module")
def tokenizer_dirs(tmp_path_factory):
    """Tiny qwen3 checkpoints: a target; a draft with the same tokenizer and a larger
    table; drafts whose tokenizer swaps two tokens, or names another EOS."""
    root = tmp_path_factory.mktemp("tokenizers")
    target = write_checkpoint(root / "target", TINY_CONFIGS["qwen3"], seed=5)
    padded = root / "padded"
    shutil.copytree(target, padded)
    weights = with_noise(mx.load(str(target / "model.safetensors")), NOISE)
    embed = weights["model.embed_tokens.weight"]  # tied: also the output table
    weights["model.embed_tokens.weight"] = mx.concatenate([embed, embed[:64]])
    mx.save_safetensors(str(padded / "model.safetensors"), weights)
    config = json.loads((padded / "config.json").read_text())
    (padded / "config.json").write_text(json.dumps(dict(config, vocab_size=576)))
    swapped = root / "swapped"
    shutil.copytree(target, swapped)
    tokenizer = json.loads((swapped / "tokenizer.json").read_text())
    vocab = tokenizer["model"]["vocab"]
    first, second = [token for token, i in vocab.items() if i in (300, 301)]
    vocab[first], vocab[second] = vocab[second], vocab[first]
    (swapped / "tokenizer.json").write_text(json.dumps(tokenizer))
    other_eos = root / "other_eos"
    shutil.copytree(target, other_eos)
    config = json.loads((other_eos / "tokenizer_config.json").read_text())
    config["eos_token"] = "<|im_end|>"
    (other_eos / "tokenizer_config.json").write_text(json.dumps(config))
    return dict(target=target, padded=padded, swapped=swapped, other_eos=other_eos)


def test_tokenizer_check_compares_tokens_not_table_sizes(tokenizer_dirs):
    target, tokenizer = load(str(tokenizer_dirs["target"]))
    padded, padded_tokenizer = load(str(tokenizer_dirs["padded"]))
    assert padded.args.vocab_size != target.args.vocab_size
    check_same_tokenizer(tokenizer, padded_tokenizer, "target", "padded")
    prompt = "def fibonacci(n):"
    want = [r.text for r in stream_generate(target, tokenizer, prompt, max_tokens=16)]
    got = list(stream_generate(target, tokenizer, prompt, max_tokens=16, draft_model=padded, num_draft_tokens=3, adaptive_draft_length=False))
    assert [r.text for r in got] == want and got[-1].speculation.num_accepted > 0

    swapped_tokenizer = load(str(tokenizer_dirs["swapped"]))[1]
    message = r"draft tokenizer \(B\) differs from the target's \(A\): 2 of 512 token ids differ, e\.g\. id 300 is"
    with pytest.raises(ValueError, match=message):
        check_same_tokenizer(tokenizer, swapped_tokenizer, "A", "B")
    other_eos_tokenizer = load(str(tokenizer_dirs["other_eos"]))[1]
    with pytest.raises(ValueError, match=r"differs from the target's \(A\): EOS id 0 for the target, 2 for the draft"):
        check_same_tokenizer(tokenizer, other_eos_tokenizer, "A", "B")


def test_loaders_refuse_a_draft_with_another_tokenizer(tokenizer_dirs):
    from mlx_lm.serving import ServedModel

    target, swapped = str(tokenizer_dirs["target"]), str(tokenizer_dirs["swapped"])
    with pytest.raises(ValueError, match=f"draft tokenizer \\({swapped}\\) differs from the target's"):
        ServedModel(target, swapped, cache_size=0, cache_bytes=0)
    ServedModel(target, str(tokenizer_dirs["padded"]), cache_size=0, cache_bytes=0)
    result = subprocess.run(
        [sys.executable, "-m", "mlx_lm.generate", "--model", target, "--draft-model", swapped,
         "--max-tokens", "4"], capture_output=True, text=True, timeout=120,
    )
    assert result.returncode != 0 and "Traceback" not in result.stderr
    errors = [line for line in result.stderr.splitlines() if line.startswith("Error:")]
    assert len(errors) == 1 and f"draft tokenizer ({swapped}) differs from the target's ({target})" in errors[0]


# ---------------------------------------------------------------------------


def test_plain_generation_unchanged_by_a_speculation_cycle():
    """Caches that went through start/stop_speculation decode bit-identically."""
    target = model("gpt_oss_tf5")
    fresh, cycled = make_prompt_cache(target), make_prompt_cache(target)
    for c in cycled:
        c.start_speculation()
        c.stop_speculation()
    a = list(generate_step(PROMPT, target, max_tokens=12, prompt_cache=fresh))
    b = list(generate_step(PROMPT, target, max_tokens=12, prompt_cache=cycled))
    assert all(x[0] == y[0] and mx.array_equal(x[1], y[1]) for x, y in zip(a, b))


def test_stream_generate_with_draft_reports_speculation(tiny_model_dir):
    target, tokenizer = load(str(tiny_model_dir))
    draft, _ = load(str(tiny_model_dir))
    plain_text = [r.text for r in stream_generate(target, tokenizer, "def f(x):", max_tokens=16)]
    responses = list(stream_generate(target, tokenizer, "def f(x):", max_tokens=16,
                                     draft_model=draft, num_draft_tokens=4, adaptive_draft_length=False))
    assert [r.text for r in responses] == plain_text
    last = responses[-1].speculation
    assert last.num_accepted == last.num_drafted > 0 and last.num_target_forwards < 16
    with pytest.raises(ValueError, match="num_draft_tokens needs a draft_model"):
        next(stream_generate(target, tokenizer, "x", num_draft_tokens=2))


def test_quantized_kv_cache_with_speculation(tmp_path):
    """--kv-bits with a draft: caches turn quantized mid-run and still roll back, also
    several tokens at once; greedy output equals plain generation with the same
    quantized caches."""
    config = dict(TINY_CONFIGS["llama"], num_attention_heads=2, num_key_value_heads=1)  # head_dim 32
    target = load_model(write_checkpoint(tmp_path / "target", config, seed=3))[0]
    draft = load_model(write_checkpoint(tmp_path / "draft", config, seed=3, noise=NOISE))[0]
    kv = dict(kv_bits=8, kv_group_size=32, quantized_kv_start=24)
    want = [t for t, _ in generate_step(PROMPT, target, max_tokens=20, **kv)]
    cache = make_prompt_cache(target) + make_prompt_cache(draft)
    out = list(speculative_generate_step(PROMPT, target, draft, num_draft_tokens=3, adaptive_draft_length=False,
                                         max_tokens=20, prompt_cache=cache, **kv))
    assert [t for t, _, _ in out] == want
    assert any(0 < n < 3 for n in accepted_per_round(out)), accepted_per_round(out)
    assert all(type(c).__name__ == "QuantizedKVCache" and c.offset == PROMPT.size + 20 for c in cache)


def test_logits_processors_apply_as_in_plain_generation():
    """A repetition penalty changes the greedy output; speculation applies it per verified
    position with the history that position would have had, so outputs still match."""
    from mlx_lm.sample_utils import make_logits_processors

    target, draft = model("qwen3_next_tf5"), noisy("qwen3_next_tf5")
    processors = make_logits_processors(repetition_penalty=3.0, repetition_context_size=8)
    want = [t for t, _ in generate_step(PROMPT, target, max_tokens=24, logits_processors=processors)]
    assert want != plain(target, num_tokens=24)
    out = list(speculative_generate_step(PROMPT, target, draft, num_draft_tokens=3, adaptive_draft_length=False,
                                         max_tokens=24,
                                         logits_processors=processors))
    assert [t for t, _, _ in out] == want
    assert any(0 < n < 3 for n in accepted_per_round(out)), accepted_per_round(out)


# ---------------------------------------------------------------------------
# Adaptive draft length (the default): speed only, never the tokens.


@pytest.mark.parametrize("target_name", ["llama_tf4", "qwen3_next_tf5"])
def test_adaptive_draft_length_keeps_greedy_output_and_stops_drafting_for_a_useless_draft(target_name, monkeypatch):
    # A deterministic clock (a round drafting k costs 1 + k/2 plain steps): on a loaded
    # host measured plain steps came out as slow as k = 1 rounds, and a free draft step
    # then looked worth taking.
    update = DraftLengthPolicy.update
    monkeypatch.setattr(DraftLengthPolicy, "update",
                        lambda self, k, accepted, seconds: update(self, k, accepted, 1 + k / 2))
    target = model(target_name)
    for kind in ("disagreeing", "noisy"):
        stats = SpeculationStats()
        out = list(speculative_generate_step(PROMPT, target, draft_for(kind, target_name), num_draft_tokens=4,
                                             max_tokens=60, stats=stats))
        assert [t for t, _, _ in out] == plain(target, num_tokens=60), kind
        rounds = sum(stats.draft_lengths)
        assert rounds == stats.num_target_forwards and len(stats.draft_lengths) == 5  # k = 0..4
        if kind == "disagreeing":  # acceptance ~0: plain steps but for the slow start and the probes
            assert stats.draft_lengths[0] >= 0.75 * rounds, stats
            assert stats.mean_draft_length < 0.5


def test_a_draft_left_behind_by_plain_rounds_still_meets_the_cache_contract(monkeypatch):
    """Plain rounds (k = 0) do not feed the draft; closing, finishing or failing after
    them must still leave it holding exactly what the target holds. The policy is
    pinned to two plain rounds in every four (what it chooses on its own depends on
    measured times)."""
    monkeypatch.setattr(DraftLengthPolicy, "choose",
                        lambda self: 0 if self.num_rounds % 4 < 2 else self.max_draft_tokens)
    target, draft = model("llama_tf4"), draft_for("disagreeing", "llama_tf4")
    for ending in ("close", "finish", "raise"):
        cache = make_prompt_cache(target) + make_prompt_cache(draft)
        stats = SpeculationStats()
        generator = speculative_generate_step(PROMPT, target, draft, num_draft_tokens=4, max_tokens=30,
                                              prompt_cache=cache, stats=stats)
        yielded = []
        for token, _, _ in generator:
            yielded.append(token)
            if len(yielded) == 20 and ending != "finish":
                break
        if ending == "close":
            generator.close()
            expected = PROMPT.size + len(yielded)
        elif ending == "raise":
            with pytest.raises(KeyError):
                generator.throw(KeyError("stop"))
            expected = PROMPT.size + len(yielded) - 1
        else:
            expected = PROMPT.size + len(yielded)
        assert stats.draft_lengths[0] > 0, stats  # the draft was left behind at some point
        num_target = len(target.layers)
        assert {c.offset for c in cache[:num_target]} == {expected}, ending
        assert {c.offset for c in cache[num_target:]} == {expected}, ending


def test_plain_stretches_keep_the_contract_at_every_failure_and_close():
    """The pipelined plain steps (k = 0) hold one more token than a round does between
    yields; a processor failing at any call, or a close at any yield, must still leave
    both caches at the contract."""
    target, draft = model("llama_tf4"), draft_for("disagreeing", "llama_tf4")
    want = plain(target, num_tokens=30)
    num_target = len(target.layers)
    for fail_at in range(1, 31, 2):  # every token takes at least one call: 30 tokens, >= 30 calls
        calls = []

        def processor(history, logits):
            calls.append(1)
            if len(calls) == fail_at:
                raise RuntimeError("boom")
            return logits

        cache = make_prompt_cache(target) + make_prompt_cache(draft)
        stats, yielded = SpeculationStats(), []
        with pytest.raises(RuntimeError, match="boom"):
            for token, _, _ in speculative_generate_step(PROMPT, target, draft, num_draft_tokens=4, max_tokens=30,
                                                         prompt_cache=cache, stats=stats,
                                                         logits_processors=[processor]):
                yielded.append(token)
        assert yielded == want[: len(yielded)]
        expected = PROMPT.size + len(yielded) - 1  # before the first yield: the prompt but its last token
        assert {c.offset for c in cache[:num_target]} == {expected}, (fail_at, len(yielded))
        assert {c.offset for c in cache[num_target:]} == {expected}, (fail_at, len(yielded))
    for close_at in (1, 5, 17, 29):
        cache = make_prompt_cache(target) + make_prompt_cache(draft)
        generator = speculative_generate_step(PROMPT, target, draft, num_draft_tokens=4, max_tokens=30,
                                              prompt_cache=cache, stats=stats)
        yielded = [token for token, _, _ in itertools.islice(generator, close_at)]
        generator.close()
        assert yielded == want[:close_at]
        assert {c.offset for c in cache} == {PROMPT.size + close_at}, close_at


def test_server_prefill_feeds_a_smaller_draft_table_in_range(tmp_path):
    """The server prefills the draft itself: prompt ids beyond a smaller draft table
    must reach it as speculation feeds them (0), not past its embedding table."""
    from mlx_lm.serving import ServedModel

    source = write_checkpoint(tmp_path / "llama", TINY_CONFIGS["llama"])
    served = ServedModel(str(source), str(source), 10, 1 << 30)
    served.draft_model = with_table(served.draft_model, 200)
    prompt = [5, 300, 17, 450, 9, 2]  # ids 300 and 450 lie beyond the draft's 200 rows
    cache = served.make_cache()
    assert served.prefill(prompt, cache, 2, lambda done, total: None) == prompt[-1:]
    num_target = len(served.model.layers)
    fresh = make_prompt_cache(served.draft_model)
    served.draft_model(mx.array([[5, 0, 17, 0, 9]]), cache=fresh)
    for fed, want in zip(cache[num_target:], fresh):
        assert all(mx.array_equal(a, b) for a, b in zip(fed.state, want.state))


def test_the_last_round_drafts_the_tokens_left_as_upstream_does():
    """A draft that always agrees, k = 3, 10 tokens: rounds of 3 drafts and a bonus, then
    2 drafts for the last 2 tokens (upstream's min(k, remaining)), so the run ends on
    drafted tokens and the from_draft flags are upstream's; the caches hold exactly the
    10 tokens."""
    target = model("llama_tf4")
    cache = make_prompt_cache(target) + make_prompt_cache(target)
    out = list(speculative_generate_step(PROMPT, target, target, num_draft_tokens=3, adaptive_draft_length=False,
                                         max_tokens=10, prompt_cache=cache))
    assert [d for _, _, d in out] == [True, True, True, False, True, True, True, False, True, True]
    assert [t for t, _, _ in out] == plain(target, num_tokens=10)
    assert {c.offset for c in cache} == {PROMPT.size + 10}


def test_speculation_prefills_in_the_chunks_plain_decoding_does(monkeypatch):
    """Over 512 prompt tokens, with the defaults: the target gets the same forwards
    as in plain decoding (both prefill in the chunks feeding.prefill cuts: for a hybrid,
    ending at multiples of models/checkpoints.SNAPSHOT_GRID; the speculative loop used
    512, so its caches rounded otherwise), and the first token's logprobs are bit for
    bit plain decoding's."""
    target = model("qwen3_next_tf5")
    prompt = mx.array([(i * 53 + 7) % 256 for i in range(700)])
    calls = []
    forward = type(target).__call__
    monkeypatch.setattr(type(target), "__call__", lambda self, inputs, *a, **k: (
        calls.append(inputs.shape[1]), forward(self, inputs, *a, **k))[1])
    _, plain_logprobs = next(generate_step(prompt, target))
    plain_calls, calls[:] = calls[:], []
    _, spec_logprobs, _ = next(speculative_generate_step(prompt, target, prompt_lookup=True))
    assert calls[:6] == plain_calls[:6] == [128] * 5 + [59]  # the whole prompt but its last token
    assert mx.array_equal(plain_logprobs, spec_logprobs)


@pytest.mark.parametrize("kind", ["noisy", "self"])
def test_stats_count_acceptance_by_depth_and_time_every_round(kind):
    """Per-depth counts agree with the rounds (read back from the from_draft flags) and
    with the totals; every round is timed, plain steps included, so the bound and the
    measured speedup exist (the adaptive policy starts with plain steps)."""
    target = model("llama_tf4")
    stats = SpeculationStats()
    out = list(speculative_generate_step(PROMPT, target, draft_for(kind, "llama_tf4"), num_draft_tokens=4,
                                         max_tokens=NUM_TOKENS, stats=stats))
    assert [t for t, _, _ in out] == plain(target)
    assert stats.drafted_at_depth[0] == sum(stats.draft_lengths[1:])  # every drafting round drafted depth 1
    assert sum(stats.drafted_at_depth) == stats.num_drafted and sum(stats.accepted_at_depth) == stats.num_accepted
    assert all(a >= b for a, b in zip(stats.accepted_at_depth, stats.accepted_at_depth[1:]))
    assert all(a >= b for a, b in zip(stats.drafted_at_depth, stats.drafted_at_depth[1:]))
    # The rounds' accepted prefixes, depth by depth (a last round ending on drafts aside).
    prefixes = accepted_per_round(out)
    assert stats.accepted_at_depth[0] >= sum(n >= 1 for n in prefixes)
    assert stats.timed_rounds == stats.draft_lengths[: len(stats.timed_rounds)]
    assert sum(stats.timed_rounds) == stats.num_target_forwards
    assert stats.plain_step_seconds > 0 and stats.bound >= 1.0
    assert stats.measured_speedup > 0 and stats.efficiency == pytest.approx(stats.measured_speedup / stats.bound)
    if kind == "self":  # everything drafted is accepted
        assert stats.depth_acceptance == [1.0] * len(stats.drafted_at_depth)
