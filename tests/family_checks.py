"""The checks every model family passes, shared by the family test modules.

A family's test module describes its fixtures and configs in a `Family` and subclasses
`FamilyChecks` (pytest collects the subclass, `TestGemma2(FamilyChecks)`, and runs every
check below for it); checks of what only that family has (its recurrence against a
naive reference, its config dialects, its sanitize quirks) stay plain tests beside it.

Fixtures: tests/fixtures/<name>/ holds a tiny checkpoint as transformers saves it
(`config.json`, `model.safetensors`) and `reference.safetensors` with `input_ids` (1, T)
and transformers' float32 `logits` (1, T, V), written by a `make_<family>_reference.py`
beside them (torch is needed only to regenerate them). Fixture vocabularies have 256
tokens; T is longer than every window and chunk of the family's config.

What is checked (DESIGN.md §2 and the "every cache kind" issue):
- logits against transformers, full forward and fed through the caches in pieces;
- a model saved in the MLX layout (`save_model`) loads back to the same logits
  (sanitize takes its own output);
- rollback: two verify chunks sharing m tokens, each trimmed back to m, leave
  bit-identical caches and next logits (tail independence), and equal a feed of just
  the m tokens (replay equals feed), for every m;
- greedy speculative output equals plain output as target (dense, same-family smaller,
  self and noisy-self drafts, each at the draft lengths of TARGET_SWEEP) and as draft
  (for a dense target), and the caches after finishing and after closing inside a round
  hold exactly prompt + output; prompt lookup likewise;
- continuous batching: rows with joins, leaves and speculation equal their solo runs;
- `mlx_lm.convert -q` round trip: loads, equals in-memory quantization, speculates;
- prompt-cache files: a saved and reloaded prefilled cache continues like the original.
Tensor parallel (`shard()`) is checked over two ranks in test_distributed.py, which
takes every family's `Family.tiny` config from `family_specs()`.
"""

import importlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence

import mlx.core as mx
import pytest
from checkpoints import perturb, with_noise, write_checkpoint
from mlx.utils import tree_flatten, tree_map, tree_unflatten

from mlx_lm import convert
from mlx_lm.batching import BatchGenerator
from mlx_lm.generate import SpeculationStats, generate_step, speculative_generate_step
from mlx_lm.models.cache import load_prompt_cache, make_prompt_cache, save_prompt_cache, trim_prompt_cache
from mlx_lm.utils import get_model_classes, load_model, quantize_model, save_model

FIXTURES = Path(__file__).parent / "fixtures"
TESTS = Path(__file__).parent
FIXTURE_VOCAB = 256
# Longer than the windows and chunks of the tiny configs (keep those at 8 or less).
PROMPT = mx.array([(i * 37 + 11) % FIXTURE_VOCAB for i in range(20)])
NUM_TOKENS = 30
FOLLOW = mx.array([[5, 9, 200]])
# The speculative runs of the target check: 5 where a sweep of the 4 draft kinds over
# k in 1, 3, 6 took 10 (and twice as long), each there for a fault only it reaches.
# - noisy_self at 3 and 6: rounds kept fully, partly and not at all, so the target and
#   the family draft roll back by amounts from 1 to 6, at two lengths (a rollback
#   that confuses rejected with drafted, or pops one record too few, shows at either),
#   always past a sliding window's wrap (PROMPT is longer than every window);
# - same_family at 1: the shortest verify (2 tokens), drafted by a smaller config of the
#   family, both rolled back whole each round;
# - dense at 3: a draft of another family (its rounds rejected whole; cheap to draft);
# - self at 6: every round accepted (no rollback: the bonus token, the draft's catch-up).
# A run costs about the same per round, and a draft that loses every round needs one
# round a token; as its rounds all roll back alike (and past the wrap: PROMPT fills every
# window), WHOLE_REJECTION_TOKENS of them show a fault as NUM_TOKENS would.
WHOLE_REJECTION_TOKENS = 10
TARGET_SWEEP = (  # (draft kind, k, tokens)
    ("noisy_self", 3, NUM_TOKENS), ("noisy_self", 6, NUM_TOKENS), ("same_family", 1, WHOLE_REJECTION_TOKENS),
    ("dense", 3, WHOLE_REJECTION_TOKENS), ("self", 6, NUM_TOKENS),
)
# The family as the draft of another family's target, whose rounds it loses whole: the
# draft rolls back several single-token records each round. One length: the noisy_self
# runs above already roll the family draft back by every amount, at two lengths.
AS_DRAFT_LENGTH = 3
# The quantized round trip speculates through quantized layers; a few rounds show it.
QUANTIZED_TOKENS = 12


@dataclass
class Family:
    """What the shared checks need to know about a family.

    fixtures: names under tests/fixtures/ (one per config dialect or layout).
    tiny: a config with the 512-token vocabulary of checkpoints.write_checkpoint (convert,
      the command line, two-rank sharding); keep it small.
    small: a config of the same family smaller than the fixtures (hidden 32, fewer
      layers), vocabulary FIXTURE_VOCAB: the same-family draft.
    tolerance: relative error against transformers (max |diff| / max |want|).
    noise: relative weight noise of the noisy-self draft: enough that rounds end
      fully, partly and not at all accepted.
    """

    fixtures: Sequence[str]
    tiny: Dict[str, Any]
    small: Dict[str, Any]
    tolerance: float = 1e-4
    noise: float = 0.05
    quantize_bits: int = 8
    quantize_group_size: int = 32
    extra: Dict[str, Any] = field(default_factory=dict)


_models: Dict[Any, Any] = {}


def fixture_model(name: str):
    """The fixture loaded once per session (tests must not change its weights)."""
    if name not in _models:
        _models[name] = load_model(FIXTURES / name)[0]
    return _models[name]


def fresh_model(name: str):
    return load_model(FIXTURES / name)[0]


_noisy: Dict[Any, Any] = {}


def noisy_model(name: str, noise: float):
    """The fixture plus `noise` (perturb, seed 1), built once per session: the draft that
    agrees with the fixture part of the time (tests must not change its weights)."""
    if (name, noise) not in _noisy:
        _noisy[name, noise] = perturb(fresh_model(name), noise, seed=1)
    return _noisy[name, noise]


def random_model(config: Dict[str, Any], seed: int = 7, scale: float = 0.3):
    model_class, args_class = get_model_classes(config)
    model = model_class(args_class.from_dict(config))
    mx.random.seed(seed)
    model.update(tree_map(lambda w: mx.random.normal(w.shape) * scale, model.parameters()))
    mx.eval(model.parameters())
    return model


def reference(name: str):
    data = mx.load(str(FIXTURES / name / "reference.safetensors"))
    return data["input_ids"], data["logits"]


def relative_error(got: mx.array, want: mx.array) -> float:
    return (mx.abs(got.astype(mx.float32) - want).max() / mx.abs(want).max()).item()


def decode(model, ids: mx.array, pieces: Sequence[int]) -> mx.array:
    """Logits for `ids` fed through a fresh cache in pieces of the given lengths."""
    cache, start, logits = make_prompt_cache(model), 0, []
    for length in pieces:
        logits.append(model(ids[:, start : start + length], cache=cache))
        start += length
    assert start == ids.shape[1]
    return mx.concatenate(logits, axis=1)


def plain(model, prompt=PROMPT, num_tokens=NUM_TOKENS, prompt_cache=None) -> List[int]:
    return [t for t, _ in generate_step(prompt, model, max_tokens=num_tokens, prompt_cache=prompt_cache)]


_plain_outputs: Dict[Any, List[int]] = {}


def fixture_plain(name: str, prompt=PROMPT, num_tokens=NUM_TOKENS) -> List[int]:
    """plain() of fixture_model(name), decoded once per session: every family's draft
    check compares against the same llama_tf4 output."""
    key = (name, tuple(prompt.tolist()), num_tokens)
    if key not in _plain_outputs:
        _plain_outputs[key] = plain(fixture_model(name), prompt, num_tokens)
    return _plain_outputs[key]


def speculate(target, draft, k, prompt_cache=None, stats=None, num_tokens=NUM_TOKENS, **kwargs):
    return list(speculative_generate_step(PROMPT, target, draft, num_draft_tokens=k, adaptive_draft_length=False,
                                          max_tokens=num_tokens, prompt_cache=prompt_cache, stats=stats, **kwargs))


def accepted_per_round(out) -> List[int]:
    """Drafts accepted in each finished round, from the from_draft flags."""
    rounds, run = [], 0
    for _, _, from_draft in out:
        if from_draft:
            run += 1
        else:
            rounds.append(run)
            run = 0
    return rounds


def flat_state(cache) -> List[mx.array]:
    return [x for c in cache for _, x in tree_flatten(c.state) if x is not None]


def fresh_feed(model, tokens: Sequence[int]):
    """A fresh cache fed `tokens` in one forward. Not one by one as a draft feeds them:
    that costs a forward a token, and on every family's fixture the next logits of the
    two differ by at most 1.1e-5 (kimi_linear), well inside assert_holds' 1e-4."""
    cache = make_prompt_cache(model)
    model(mx.array([tokens]), cache=cache)
    return cache


def assert_holds(model, cache, tokens, exact: bool, where: str = ""):
    """`cache` holds exactly `tokens`: the sizes of a fresh feed and its logits for a
    3-token continuation (bit for bit when `exact`, else within 1e-4); and it no longer
    speculates. Feeds the continuation."""
    fresh = fresh_feed(model, tokens)
    assert [c.size() for c in cache] == [c.size() for c in fresh], where
    assert not any(c.is_trimmable() and c.needs_layer_records for c in cache), where
    got, want = model(FOLLOW, cache=cache), model(FOLLOW, cache=fresh)
    diff = mx.abs(got - want).max().item()
    assert mx.array_equal(got, want) if exact else mx.allclose(got, want, atol=1e-4, rtol=1e-4), f"{where}: {diff}"


def speculate_with_cache(target, draft, k, stats=None, stop_after=NUM_TOKENS):
    """speculate() through one prompt cache for target + draft, closed after
    `stop_after` yields: (what it yielded, the cache)."""
    cache = make_prompt_cache(target) + make_prompt_cache(draft)
    generator = speculative_generate_step(PROMPT, target, draft, num_draft_tokens=k, adaptive_draft_length=False,
                                          max_tokens=NUM_TOKENS, prompt_cache=cache, stats=stats)
    out = [step for _, step in zip(range(stop_after), generator)]  # range first: no step past stop_after
    generator.close()
    return out, cache


def assert_caches_hold(target, draft, cache, out, where: str):
    """The target's and the draft's parts of `cache` hold exactly PROMPT + the tokens of
    `out` (assert_holds, to float tolerance)."""
    tokens, split = PROMPT.tolist() + [t for t, _, _ in out], len(target.layers)
    assert_holds(target, cache[:split], tokens, exact=False, where=f"target, {where}")
    assert_holds(draft, cache[split:], tokens, exact=False, where=f"draft, {where}")


def family_specs() -> Dict[str, Family]:
    """Every `Family` declared by a test module (its module-level FAMILY, by module name,
    or each of a FAMILIES dict, by its key): what test_distributed.py shards."""
    specs = {}
    for path in sorted(TESTS.glob("test_*.py")):
        if "FamilyChecks" in path.read_text():
            module = importlib.import_module(path.stem)
            if isinstance(getattr(module, "FAMILY", None), Family):
                specs[path.stem[len("test_"):]] = module.FAMILY
            families = getattr(module, "FAMILIES", None)
            if isinstance(families, dict):
                specs.update({name: f for name, f in families.items() if isinstance(f, Family)})
    return specs


class FamilyChecks:
    """Subclass as `class Test<Family>(FamilyChecks): family = FAMILY`."""

    family: Family

    # --- against transformers -------------------------------------------------------

    def test_logits_match_transformers_full_and_cached(self):
        for name in self.family.fixtures:
            model, (ids, want) = fixture_model(name), reference(name)
            T = ids.shape[1]
            assert relative_error(model(ids), want) < self.family.tolerance, name
            for pieces in ([1] * T, [7, 1, 3, T - 11]):
                assert relative_error(decode(model, ids, pieces), want) < self.family.tolerance, (name, pieces)

    def test_mlx_layout_reloads_identically(self, tmp_path):
        for name in self.family.fixtures:
            model, (ids, _) = fixture_model(name), reference(name)
            save_model(tmp_path / name, model)
            (tmp_path / name / "config.json").write_text((FIXTURES / name / "config.json").read_text())
            again = load_model(tmp_path / name)[0]
            assert mx.array_equal(again(ids), model(ids)), name

    # --- rollback -------------------------------------------------------------------

    def test_tail_independence_and_replay_equals_feed(self):
        model = fixture_model(self.family.fixtures[-1])
        assert type(model).supports_speculative_rollback
        T, prefix_all, next_token = 5, [11, 22, 33, 44, 55], mx.array([[99]])

        def prefilled():
            cache = make_prompt_cache(model)
            model(PROMPT[None], cache=cache)
            for c in cache:
                c.start_speculation()
            return cache

        def chunk(prefix, seed):
            key = mx.random.key(seed)
            return mx.array([prefix + mx.random.randint(0, FIXTURE_VOCAB, (T - len(prefix),), key=key).tolist()])

        for m in range(T + 1):
            prefix, caches = prefix_all[:m], []
            for seed in (1, 2):
                cache = prefilled()
                model(chunk(prefix, seed), cache=cache)
                assert trim_prompt_cache(cache, T - m) == T - m
                caches.append(cache)
            a, b = (flat_state(c) for c in caches)
            assert len(a) == len(b) and all(mx.array_equal(x, y) for x, y in zip(a, b)), f"m={m}"
            logits = [model(next_token, cache=c) for c in caches]
            assert mx.array_equal(logits[0], logits[1]), f"m={m}"
            # Replay equals feed, against the first rolled-back cache (which has had
            # next_token too): a third chunk would roll back the same way.
            fed = prefilled()
            if m:
                model(mx.array([prefix]), cache=fed)
            want = model(next_token, cache=fed)
            assert [c.size() for c in caches[0]] == [c.size() for c in fed], f"m={m}"
            assert mx.allclose(logits[0], want, atol=1e-4, rtol=1e-4), f"m={m}"

    # --- speculation ----------------------------------------------------------------

    def drafts(self):
        name = self.family.fixtures[-1]
        return {
            "dense": fixture_model("qwen3_tf5"),
            "same_family": random_model(self.family.small),
            "self": fixture_model(name),
            "noisy_self": noisy_model(name, self.family.noise),
        }

    def test_greedy_speculation_as_target_equals_plain(self):
        """TARGET_SWEEP says why these runs; the noisy k=3 one also checks the caches
        after finishing (test_caches_after_... checks them after a close)."""
        target = fixture_model(self.family.fixtures[-1])
        want, drafts, partly = plain(target), self.drafts(), 0
        for kind, k, num_tokens in TARGET_SWEEP:
            stats, draft = SpeculationStats(), drafts[kind]
            out, cache = speculate_with_cache(target, draft, k, stats=stats, stop_after=num_tokens)
            assert [t for t, _, _ in out] == want[:num_tokens], f"{kind} draft, k={k}"
            assert sum(from_draft for _, _, from_draft in out) == stats.num_accepted
            if kind == "self":
                assert stats.num_accepted == stats.num_drafted, k
            elif kind == "noisy_self":
                assert 0 < stats.num_accepted < stats.num_drafted, k
                partly += sum(0 < n < k for n in accepted_per_round(out))
                if k == 3:
                    assert_caches_hold(target, draft, cache, out, "noisy_self draft, finished")
        assert partly > 0, "no round kept part of its drafts"

    def test_as_draft_for_a_dense_target_keeps_its_output(self):
        """At AS_DRAFT_LENGTH (which says why one); the caches after finishing too."""
        target, draft = fixture_model("llama_tf4"), fixture_model(self.family.fixtures[-1])
        stats = SpeculationStats()
        out, cache = speculate_with_cache(target, draft, AS_DRAFT_LENGTH, stats=stats)
        assert [t for t, _, _ in out] == fixture_plain("llama_tf4")
        assert stats.num_drafted > stats.num_accepted  # rolled back
        assert_caches_hold(target, draft, cache, out, "as draft, finished")

    def test_caches_after_speculation_equal_a_fresh_feed(self):
        """After closing at a yield inside a round, the family's caches hold exactly
        prompt + every yielded token, as target and as draft (after finishing: the two
        checks above, on runs they make anyway)."""
        family_model = fixture_model(self.family.fixtures[-1])
        noisy = noisy_model(self.family.fixtures[-1], self.family.noise)
        for target, draft in ((family_model, noisy), (fixture_model("llama_tf4"), family_model)):
            out, cache = speculate_with_cache(target, draft, 3, stop_after=13)
            assert_caches_hold(target, draft, cache, out, "closed after 13")

    def test_prompt_lookup_equals_plain(self):
        target = fixture_model(self.family.fixtures[-1])
        prompt = mx.array(PROMPT.tolist() * 2)  # repeats: lookup finds matches
        want = plain(target, prompt=prompt)
        stats = SpeculationStats()
        out = list(speculative_generate_step(prompt, target, None, prompt_lookup=True, num_draft_tokens=3,
                                             adaptive_draft_length=False, max_tokens=NUM_TOKENS, stats=stats))
        assert [t for t, _, _ in out] == want
        assert stats.num_drafted > 0

    # --- batching -------------------------------------------------------------------

    def test_batch_with_joins_and_speculation_equals_solo(self):
        model = fixture_model(self.family.fixtures[-1])
        lengths, budgets = [3, 13, 1, 9], [9, 4, 7, 11]
        prompts = [[(7 * i + 3 * n + 1) % FIXTURE_VOCAB for i in range(n)] for n in lengths]
        want = [plain(model, prompt=mx.array(p), num_tokens=b) for p, b in zip(prompts, budgets)]
        for draft in (None, noisy_model(self.family.fixtures[-1], self.family.noise)):
            generator = BatchGenerator(model, completion_batch_size=2, prefill_step_size=4, draft_model=draft,
                                       num_draft_tokens=3)
            uids = generator.insert(prompts[:2], max_tokens=budgets[:2])
            out: Dict[int, List[int]] = {}
            for step in range(200):
                if step == 2:
                    uids += generator.insert(prompts[2:], max_tokens=budgets[2:])  # join mid-flight
                if not len(generator):
                    break
                for r in generator.next_generated():
                    out.setdefault(r.uid, []).append(r.token)
            assert [out[u] for u in uids] == want, f"draft: {draft is not None}"
            if draft is not None:
                stats = generator.stats()
                assert 0 < stats.accepted_tokens < stats.draft_tokens, stats  # rows rolled back

    # --- files ----------------------------------------------------------------------

    def test_quantized_round_trip_generates_and_speculates(self, tmp_path):
        family = self.family
        source = write_checkpoint(tmp_path / "hf", family.tiny, seed=4)
        convert(str(source), tmp_path / "q", quantize=True, q_bits=family.quantize_bits,
                q_group_size=family.quantize_group_size)
        quantized, _ = load_model(tmp_path / "q")
        in_memory, config = load_model(source)
        quantize_model(in_memory, config, family.quantize_group_size, family.quantize_bits)
        tokens = PROMPT[None]
        assert mx.array_equal(quantized(tokens), in_memory(tokens))
        want = plain(quantized, num_tokens=QUANTIZED_TOKENS)
        draft = perturb(load_model(source)[0], family.noise, seed=1)
        assert [t for t, _, _ in speculate(quantized, draft, 3, num_tokens=QUANTIZED_TOKENS)] == want

    def test_prompt_cache_file_continues_like_the_cache(self, tmp_path):
        model = fixture_model(self.family.fixtures[-1])
        cache = make_prompt_cache(model)
        model(PROMPT[None], cache=cache)
        mx.eval([c.state for c in cache])
        save_prompt_cache(str(tmp_path / "cache.safetensors"), cache)
        loaded = load_prompt_cache(str(tmp_path / "cache.safetensors"))
        assert [type(c) for c in loaded] == [type(c) for c in cache]
        follow = mx.array([1, 2, 3])
        assert plain(model, prompt=follow, num_tokens=8, prompt_cache=loaded) == plain(
            model, prompt=follow, num_tokens=8, prompt_cache=cache)

