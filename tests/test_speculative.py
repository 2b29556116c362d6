"""speculative_generate_step: lossless on every cache kind, consistent caches after.

Targets: a dense llama, gpt-oss past its sliding window, and the Gated-DeltaNet hybrids.
Drafts: a different random model (disagrees often, so nearly every round rolls back),
the target itself (agrees, so rounds accept everything), and a hybrid.
"""

import mlx.core as mx
import pytest
from checkpoints import TINY_CONFIGS, write_checkpoint
from conftest import FIXTURES

from mlx_lm import stream_generate
from mlx_lm.generate import SpeculationStats, generate_step, speculative_generate_step
from mlx_lm.models.cache import ArraysCache, KVCache, make_prompt_cache
from mlx_lm.utils import load_model

PROMPT = mx.array([(i * 37 + 11) % 256 for i in range(20)])  # longer than gpt-oss's window (8)
NUM_TOKENS = 40

TARGETS = ["llama_tf4", "gpt_oss_tf5", "qwen3_next_tf5", "qwen3_5_tf4", "qwen3_5_moe_tf5"]
DRAFTS = ["disagreeing", "self", "hybrid"]


def model(name):
    return load_model(FIXTURES / name)[0]


def plain(target, prompt=PROMPT, num_tokens=NUM_TOKENS, prompt_cache=None):
    return [t for t, _ in generate_step(prompt, target, max_tokens=num_tokens, prompt_cache=prompt_cache)]


def draft_for(kind, target_name):
    hybrid = "qwen3_next_tf4" if target_name.startswith("qwen3_next") else "qwen3_5_tf5"
    return {
        "disagreeing": lambda: model("qwen3_tf5"),
        "self": lambda: model(target_name),
        "hybrid": lambda: model(hybrid),
    }[kind]()


@pytest.mark.parametrize("target_name", TARGETS)
@pytest.mark.parametrize("draft_kind", DRAFTS)
def test_greedy_speculative_equals_plain(target_name, draft_kind):
    target, draft = model(target_name), draft_for(draft_kind, target_name)
    want = plain(target)
    for k in (1, 2, 4, 7):
        stats = SpeculationStats()
        out = list(speculative_generate_step(PROMPT, target, draft, num_draft_tokens=k,
                                             max_tokens=NUM_TOKENS, stats=stats))
        assert [t for t, _, _ in out] == want, f"k={k}"
        assert sum(from_draft for _, _, from_draft in out) == stats.num_accepted
        if draft_kind == "self":
            assert stats.num_accepted == stats.num_drafted  # the target agrees with itself
        else:
            assert stats.num_accepted < stats.num_drafted / 2  # mostly rolled back


@pytest.mark.parametrize("target_name", TARGETS)
def test_caches_after_speculation_equal_plain_caches(target_name):
    """Both caches hold prompt + every yielded token; plain generation continues from
    them exactly as from an uninterrupted run, also after closing early."""
    target, draft = model(target_name), draft_for("hybrid", target_name)
    for stop_after in (NUM_TOKENS, 13):
        cache = make_prompt_cache(target) + make_prompt_cache(draft)
        generator = speculative_generate_step(PROMPT, target, draft, num_draft_tokens=3,
                                              max_tokens=NUM_TOKENS, prompt_cache=cache)
        tokens = [t for t, _, _ in (next(generator) for _ in range(stop_after))]
        generator.close()
        target_cache, draft_cache = cache[: len(target.layers)], cache[len(target.layers):]
        held = PROMPT.size + stop_after
        assert all(c.offset == held for c in cache if not c.needs_layer_records)
        assert not any(c.is_trimmable() and c.needs_layer_records for c in cache)
        follow = mx.array([5, 9])
        everything = mx.concatenate([PROMPT, mx.array(tokens), follow])
        want = plain(target, everything, 8)
        assert plain(target, follow, 8, target_cache) == want
        assert plain(draft, follow, 8, draft_cache) == plain(draft, everything, 8)


class FlakyDraft:
    """A draft model that raises on its n-th forward."""

    def __init__(self, inner, fail_at):
        self.inner, self.fail_at, self.calls = inner, fail_at, 0
        self.args, self.layers = inner.args, inner.layers

    def make_cache(self):
        return self.inner.make_cache()

    def __call__(self, inputs, cache=None):
        self.calls += 1
        if self.calls == self.fail_at:
            raise RuntimeError("draft exploded")
        return self.inner(inputs, cache=cache)


def test_draft_exception_surfaces_and_caches_rewind():
    target = model("gpt_oss_tf5")
    draft = FlakyDraft(model("qwen3_tf5"), fail_at=8)
    cache = make_prompt_cache(target) + make_prompt_cache(draft)
    yielded = []
    with pytest.raises(RuntimeError, match="draft exploded"):
        for token, _, _ in speculative_generate_step(PROMPT, target, draft, num_draft_tokens=3,
                                                     max_tokens=NUM_TOKENS, prompt_cache=cache):
            yielded.append(token)
    assert yielded  # it failed mid-run, after some rounds
    # After an exception the caches hold the delivered sequence minus its last token.
    held = PROMPT.size + len(yielded) - 1
    assert all(c.offset == held for c in cache)
    target_cache = cache[: len(target.layers)]
    resume = mx.array(yielded[-1:])
    everything = mx.concatenate([PROMPT, mx.array(yielded)])
    assert plain(target, resume, 6, target_cache) == plain(target, everything, 6)


class RecurrentOnly:
    """A model whose cache is recurrent but whose layers do not record rollbacks."""

    def __init__(self, inner):
        self.inner, self.args, self.layers, self.calls = inner, inner.args, inner.layers, 0

    def make_cache(self):
        return [ArraysCache(2) for _ in self.layers]

    def __call__(self, inputs, cache=None):
        self.calls += 1
        return self.inner(inputs)


def test_unsupported_caches_and_vocabularies_fail_before_any_work():
    target = model("llama_tf4")
    recurrent = RecurrentOnly(model("qwen3_tf5"))
    for t, d, role in ((target, recurrent, "draft model"), (recurrent, target, "target model")):
        with pytest.raises(ValueError, match=f"every cache of the {role}.*ArraysCache"):
            next(speculative_generate_step(PROMPT, t, d))
    assert recurrent.calls == 0
    other_vocab = model("llama_tf4")
    other_vocab.args.vocab_size = 300
    with pytest.raises(ValueError, match=r"Draft model vocabulary \(300\) != target vocabulary \(256\)"):
        next(speculative_generate_step(PROMPT, target, other_vocab))
    with pytest.raises(ValueError, match="num_draft_tokens"):
        next(speculative_generate_step(PROMPT, target, target, num_draft_tokens=0))
    with pytest.raises(ValueError, match="speculation needs the target's 2 followed by the draft's 2"):
        next(speculative_generate_step(PROMPT, target, target, prompt_cache=[KVCache()]))


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
    from mlx_lm import load

    target, tokenizer = load(str(tiny_model_dir))
    draft, _ = load(str(tiny_model_dir))
    plain_text = [r.text for r in stream_generate(target, tokenizer, "def f(x):", max_tokens=16)]
    responses = list(stream_generate(target, tokenizer, "def f(x):", max_tokens=16,
                                     draft_model=draft, num_draft_tokens=4))
    assert [r.text for r in responses] == plain_text
    last = responses[-1].speculation
    assert last.num_accepted == last.num_drafted > 0 and last.num_target_forwards < 16
    with pytest.raises(ValueError, match="num_draft_tokens needs a draft_model"):
        next(stream_generate(target, tokenizer, "x", num_draft_tokens=2))


def test_quantized_kv_cache_with_speculation(tmp_path):
    """--kv-bits with a draft: caches turn quantized mid-run and still roll back; greedy
    output equals plain generation with the same quantized caches."""
    config = dict(TINY_CONFIGS["llama"], num_attention_heads=2, num_key_value_heads=1)  # head_dim 32
    target = load_model(write_checkpoint(tmp_path / "target", config, seed=3))[0]
    draft = load_model(write_checkpoint(tmp_path / "draft", config, seed=4))[0]
    kv = dict(kv_bits=8, kv_group_size=32, quantized_kv_start=24)
    want = [t for t, _ in generate_step(PROMPT, target, max_tokens=20, **kv)]
    cache = make_prompt_cache(target) + make_prompt_cache(draft)
    got = [t for t, _, _ in speculative_generate_step(PROMPT, target, draft, num_draft_tokens=3,
                                                      max_tokens=20, prompt_cache=cache, **kv)]
    assert got == want
    assert all(type(c).__name__ == "QuantizedKVCache" and c.offset == PROMPT.size + 20 for c in cache)


def test_logits_processors_apply_as_in_plain_generation():
    """A repetition penalty changes the greedy output; speculation applies it per verified
    position with the history that position would have had, so outputs still match."""
    from mlx_lm.sample_utils import make_logits_processors

    target, draft = model("qwen3_next_tf5"), model("qwen3_tf5")
    processors = make_logits_processors(repetition_penalty=3.0, repetition_context_size=8)
    want = [t for t, _ in generate_step(PROMPT, target, max_tokens=24, logits_processors=processors)]
    assert want != plain(target, num_tokens=24)
    got = speculative_generate_step(PROMPT, target, draft, num_draft_tokens=3, max_tokens=24,
                                    logits_processors=processors)
    assert [t for t, _, _ in got] == want
