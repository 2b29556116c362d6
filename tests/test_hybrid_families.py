"""Hybrid families with one another: Nemotron-H, Falcon-H1 and LFM2 as speculative
targets with drafts of their own family and of other hybrid families, and over HTTP.

The family files (test_nemotron_h.py, test_falcon_h1.py, test_lfm2.py) run each family
with dense, self and noisy-self drafts. Here:
- a same-family draft: a smaller random model of the target's family (fewer layers,
  hidden 32, the fixtures' vocabulary), so target and draft run the same kind of layers
  at different sizes;
- a cross-family hybrid draft: Nemotron-H drafted by LFM2, LFM2 by Falcon-H1, Falcon-H1
  by Qwen3-Next (Gated DeltaNet), so both caches roll back recurrent states of different
  kinds in the same round;
- the target plus noise, for rounds that keep part of what was drafted.
Random drafts disagree: nearly every round rolls back all it drafted, in target and
draft. Greedy output must equal plain output for k in {1, 3, 6}, and both caches must
afterwards hold exactly prompt + output.

Over HTTP, three `mlx_lm.server --draft-model` pairs put each family once in each role;
their worker thread is not the thread that loaded the models (a lazy constant built at
load once failed there: Falcon-H1's muP vector).
"""

import mlx.core as mx
import pytest
from checkpoints import write_checkpoint
from mlx.utils import tree_flatten, tree_map
from server_harness import start_server, stop_all
from test_falcon_h1 import ARGS as FALCON_H1_ARGS
from test_falcon_h1 import TINY as FALCON_H1_TINY
from test_lfm2 import TINY as LFM2_TINY
from test_nemotron_h import ARGS as NEMOTRON_H_ARGS
from test_nemotron_h import TINY as NEMOTRON_H_TINY
from test_server import reference, speculation
from test_speculative import PROMPT, accepted_per_round, assert_holds, model, noisy, plain, split

from mlx_lm.generate import SpeculationStats, speculative_generate_step
from mlx_lm.models.cache import make_prompt_cache
from mlx_lm.utils import get_model_classes

NUM_TOKENS = 40  # as test_speculative.plain
DRAFT_LENGTHS = (1, 3, 6)
FIXTURE_VOCAB = 256
TARGETS = ["nemotron_h_tf5", "falcon_h1_tf5", "lfm2_tf5"]
CROSS_FAMILY_DRAFT = {"nemotron_h_tf5": "lfm2_tf5", "lfm2_tf5": "falcon_h1_tf5", "falcon_h1_tf5": "qwen3_next_tf5"}
# Smaller configs of each family than its fixture (hidden 32 against 64, fewer layers),
# with the fixtures' vocabulary.
SMALL_CONFIGS = {
    "nemotron_h_tf5": dict(NEMOTRON_H_ARGS, vocab_size=FIXTURE_VOCAB, hybrid_override_pattern="M*-",
                           num_hidden_layers=3),
    "falcon_h1_tf5": dict(FALCON_H1_ARGS, vocab_size=FIXTURE_VOCAB, mamba_rms_norm=True),
    "lfm2_tf5": dict(model_type="lfm2", vocab_size=FIXTURE_VOCAB, hidden_size=32, num_hidden_layers=2,
                     num_attention_heads=2, num_key_value_heads=1, intermediate_size=64, conv_bias=True,
                     layer_types=["conv", "full_attention"]),
}


def small_model(target_name, scale=0.3, seed=7):
    """A random model of the target's family, smaller than the target."""
    config = SMALL_CONFIGS[target_name]
    model_class, args_class = get_model_classes(config)
    small = model_class(args_class.from_dict(config))
    mx.random.seed(seed)
    small.update(tree_map(lambda w: mx.random.normal(w.shape) * scale, small.parameters()))
    mx.eval(small.parameters())
    return small


def size(side_model):
    return sum(w.size for _, w in tree_flatten(side_model.parameters()))


def draft_for(kind, target_name):
    return {
        "same_family": lambda: small_model(target_name),
        "cross_family": lambda: model(CROSS_FAMILY_DRAFT[target_name]),
        "noisy_self": lambda: noisy(target_name, seed=2),
    }[kind]()


def speculate(target, draft, k, prompt_cache=None, stats=None):
    return speculative_generate_step(PROMPT, target, draft, num_draft_tokens=k, adaptive_draft_length=False,
                                     max_tokens=NUM_TOKENS, prompt_cache=prompt_cache, stats=stats)


def test_same_family_drafts_are_smaller_models_of_the_family():
    for name in TARGETS:
        target, draft = model(name), small_model(name)
        assert type(draft) is type(target) and draft.args.vocab_size == target.args.vocab_size
        assert draft.args.hidden_size < target.args.hidden_size
        assert len(draft.layers) < len(target.layers)  # the layers with a cache
        assert size(draft) < size(target) / 2


@pytest.mark.parametrize("target_name", TARGETS)
@pytest.mark.parametrize("kind", ["same_family", "cross_family", "noisy_self"])
def test_greedy_speculative_equals_plain(target_name, kind):
    target, draft = model(target_name), draft_for(kind, target_name)
    want = plain(target)
    rounds = {}
    for k in DRAFT_LENGTHS:
        stats = SpeculationStats()
        out = list(speculate(target, draft, k, stats=stats))
        assert [t for t, _, _ in out] == want, f"{kind} draft, k={k}"
        assert sum(from_draft for _, _, from_draft in out) == stats.num_accepted
        rounds[k] = accepted_per_round(out)
        if kind != "noisy_self":
            assert stats.num_accepted < stats.num_drafted / 2, (k, stats)  # mostly rolled back
    if kind == "noisy_self":
        # Rounds that keep 1..k-1 of k drafts (multi-token replays of the recurrent layers)
        # at every k > 1, and rounds accepting all and nothing.
        assert all(any(0 < n < k for n in rounds[k]) for k in DRAFT_LENGTHS if k > 1), rounds
        assert any(n == k for k in rounds for n in rounds[k]), rounds
        assert any(n == 0 for k in rounds for n in rounds[k]), rounds


@pytest.mark.parametrize("target_name", TARGETS)
@pytest.mark.parametrize("kind", ["same_family", "cross_family"])
def test_caches_after_speculation_equal_a_fresh_feed(target_name, kind):
    """After finishing, and after closing at a yield inside a round, target and draft
    caches hold exactly prompt + every yielded token."""
    target, draft = model(target_name), draft_for(kind, target_name)
    for stop_after in (NUM_TOKENS, 13):
        cache = make_prompt_cache(target) + make_prompt_cache(draft)
        generator = speculate(target, draft, 3, prompt_cache=cache)
        tokens = PROMPT.tolist() + [t for t, _, _ in (next(generator) for _ in range(stop_after))]
        generator.close()
        target_cache, draft_cache = split(target, cache)
        assert_holds(target, target_cache, tokens, exact=False, where=f"target, stop after {stop_after}")
        assert_holds(draft, draft_cache, tokens, exact=False, where=f"draft, stop after {stop_after}")


# --- over HTTP ----------------------------------------------------------------------------

# Each family once as target and once as draft: server -> (target, draft).
SERVER_PAIRS = {"nemotron_h+lfm2": ("nemotron_h", "lfm2"), "lfm2+falcon_h1": ("lfm2", "falcon_h1"),
                "falcon_h1+nemotron_h": ("falcon_h1", "nemotron_h")}
SERVER_MAX_TOKENS = 12


@pytest.fixture(scope="module")
def servers(tmp_path_factory):
    """Tiny checkpoints of each family (the tokenizer fixture's 512-token vocabulary) and
    one server per pair, all started at once (start-up is mostly imports)."""
    root = tmp_path_factory.mktemp("hybrid_servers")
    configs = {"nemotron_h": NEMOTRON_H_TINY, "falcon_h1": FALCON_H1_TINY, "lfm2": LFM2_TINY}
    dirs = {name: write_checkpoint(root / name, config, seed=3) for name, config in configs.items()}
    started = {name: start_server(name, dirs[target], root / f"{name}.log", dirs[draft])
               for name, (target, draft) in SERVER_PAIRS.items()}
    yield started
    stop_all(list(started.values()))


@pytest.mark.parametrize("name", SERVER_PAIRS)
def test_server_with_hybrid_target_and_draft_matches_plain_generation(servers, name):
    """mlx_lm.server --draft-model: the completion equals plain generation in this
    process, and the usage reports the speculation (random drafts: mostly rejected)."""
    server = servers[name].wait_ready()
    prompt = "The state space"
    response = server.client.completions.create(model="default_model", prompt=prompt,
                                                max_tokens=SERVER_MAX_TOKENS, temperature=0)
    assert response.choices[0].text == reference(server.target_dir, prompt=prompt, max_tokens=SERVER_MAX_TOKENS)
    spec = speculation(response.usage)
    assert spec is not None and spec["num_drafted"] > spec["num_accepted"] >= 0, spec
    details = response.usage.completion_tokens_details
    assert details.rejected_prediction_tokens == spec["num_drafted"] - spec["num_accepted"] > 0
