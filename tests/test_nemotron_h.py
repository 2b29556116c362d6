"""nemotron_h.py against transformers, its config dialects and weight layouts, and exact
speculative rollback of its Mamba-2 layers.

Fixtures under tests/fixtures/nemotron_h_<dialect>/ come from make_mamba2_reference.py:
tiny random checkpoints saved by transformers 5 (`backbone.*` names, per-expert MoE
tensors) with the transformers fp32 logits for 80 tokens, which cross a chunk boundary
of the chunked SSD path. tf5: Mamba-2, MoE (group-limited routing, latent projection),
attention and MLP blocks; tf4: `hybrid_override_pattern` "M*M-".
"""

import json

import mlx.core as mx
import numpy as np
import pytest
from checkpoints import write_checkpoint
from conftest import FIXTURES
from test_qwen3_next import decode, relative_error
from test_speculative import NOISE, PROMPT, accepted_per_round, model, noisy, plain
from test_speculative import test_caches_after_speculation_equal_a_fresh_feed as check_caches_after_speculation
from test_speculative_rollback import flat_state, prefilled
from test_speculative_rollback import test_tail_independence_and_replay_equals_feed as check_tail_independence

from mlx_lm import load
from mlx_lm.convert import main as convert_main
from mlx_lm.generate import SpeculationStats, generate_step, speculative_generate_step
from mlx_lm.generate import main as generate_main
from mlx_lm.models.cache import ArraysCache, KVCache, make_prompt_cache, trim_prompt_cache
from mlx_lm.models.nemotron_h import CONV_STATE, SSM_STATE, ModelArgs, route
from mlx_lm.models.ssm import CHUNK_SIZE, CHUNKED_MIN_TOKENS
from mlx_lm.utils import load_model

FIXTURE_NAMES = ["nemotron_h_tf4", "nemotron_h_tf5"]
TOLERANCE = 1e-4  # fp32 on both sides; observed errors are ~1e-6
M, A, P, E = "linear_attention", "full_attention", "mlp", "moe"
ARGS = dict(model_type="nemotron_h", vocab_size=64, hidden_size=32, num_attention_heads=2, num_key_value_heads=1,
            head_dim=16, mamba_num_heads=4, mamba_head_dim=8, ssm_state_size=8, n_groups=2, intermediate_size=32)


def load_fixture(name):
    reference = mx.load(str(FIXTURES / name / "reference.safetensors"))
    return model(name), reference["input_ids"], reference["logits"]


def raw_weights(name):
    return mx.load(str(FIXTURES / name / "model.safetensors"))


# --- against transformers -------------------------------------------------------------


def check_matches_transformers(name):
    """Full forward; token by token (sequential path); a chunked prefill then short pieces."""
    target, ids, want = load_fixture(name)
    T = ids.shape[1]
    assert T > CHUNK_SIZE
    assert relative_error(target(ids), want) < TOLERANCE
    for pieces in ([1] * T, [CHUNKED_MIN_TOKENS + 5, 3, 1, T - CHUNKED_MIN_TOKENS - 9]):
        assert relative_error(decode(target, ids, pieces)[0], want) < TOLERANCE, pieces


@pytest.mark.parametrize("name", FIXTURE_NAMES)
def test_logits_match_transformers(name):
    check_matches_transformers(name)


# --- config -----------------------------------------------------------------------------


def test_dialects_normalise_alike():
    tf5 = ModelArgs.from_dict(dict(ARGS, layers_block_type=[M, E, A, P], n_routed_experts=4, num_experts_per_tok=2))
    tf4 = ModelArgs.from_dict(dict(ARGS, hybrid_override_pattern="ME*-", num_hidden_layers=4, n_routed_experts=4,
                                   num_experts_per_tok=2))
    legacy = ModelArgs.from_dict(dict(ARGS, layers_block_type=["mamba", E, "attention", P], n_routed_experts=4,
                                      num_experts_per_tok=2))
    assert tf5.layers_block_type == tf4.layers_block_type == legacy.layers_block_type == [M, E, A, P]
    assert tf5.num_hidden_layers == 4
    saved = json.loads((FIXTURES / "nemotron_h_tf4" / "config.json").read_text())
    assert "layers_block_type" not in saved and saved["hybrid_override_pattern"] == "M*M-"


def test_older_spellings_are_read_and_must_agree():
    args = ModelArgs.from_dict(dict(ARGS, n_groups=None, hybrid_override_pattern="M", mamba_n_groups=4, mamba_d_conv=3,
                                    mamba_conv_bias=False, mamba_dt_min=0.01))
    assert (args.n_groups, args.conv_kernel, args.use_conv_bias, args.time_step_min) == (4, 3, False, 0.01)
    defaults = ModelArgs.from_dict(dict(ARGS, n_groups=None, hybrid_override_pattern="M", mamba_num_heads=8))
    assert (defaults.n_groups, defaults.conv_kernel, defaults.use_conv_bias, defaults.time_step_min) == (8, 4, True, 0.001)
    with pytest.raises(ValueError, match="n_groups \\(2\\) and its older spelling mamba_n_groups \\(4\\) disagree"):
        ModelArgs.from_dict(dict(ARGS, hybrid_override_pattern="M", mamba_n_groups=4))


def test_config_errors_name_the_value():
    with pytest.raises(ValueError, match="unknown characters \\['X'\\]"):
        ModelArgs.from_dict(dict(ARGS, hybrid_override_pattern="M*X"))
    with pytest.raises(ValueError, match="layer_types has 3 entries but num_hidden_layers is 4"):
        ModelArgs.from_dict(dict(ARGS, hybrid_override_pattern="M*-", num_hidden_layers=4))
    with pytest.raises(ValueError, match="needs layers_block_type or hybrid_override_pattern"):
        ModelArgs.from_dict(ARGS)
    with pytest.raises(ValueError, match="mamba_num_heads \\(4\\) must be a multiple of n_groups \\(3\\)"):
        ModelArgs.from_dict(dict(ARGS, hybrid_override_pattern="M", n_groups=3))
    with pytest.raises(ValueError, match="mlp_hidden_act 'silu'"):
        ModelArgs.from_dict(dict(ARGS, hybrid_override_pattern="M-", mlp_hidden_act="silu"))
    with pytest.raises(ValueError, match="num_experts_per_tok \\(0\\)"):
        ModelArgs.from_dict(dict(ARGS, hybrid_override_pattern="ME", n_routed_experts=4))


def test_blocks_and_cache_layout_follow_the_pattern():
    target = model("nemotron_h_tf5")  # M E * M -
    assert [b.block_type for b in target.model.layers] == [M, E, A, M, P]
    assert [b.block_type for b in target.layers] == [M, A, M]  # the blocks with a cache entry
    cache = make_prompt_cache(target)
    assert [type(c) for c in cache] == [ArraysCache, KVCache, ArraysCache]
    target(mx.array([[1, 2, 3, 4, 5]]), cache=cache)
    mixer = target.layers[0].mixer
    assert cache[0][CONV_STATE].shape == (1, mixer.conv_kernel_size - 1, mixer.conv_dim)
    assert cache[0][SSM_STATE].shape == (1, 8, 8, 16) and cache[0][SSM_STATE].dtype == mx.float32
    assert cache[1].offset == 5
    with pytest.raises(ValueError, match="cache has 2 entries; this model needs 3"):
        target(mx.array([[1]]), cache=cache[:2])


def test_route_matches_naive_group_limited_top_k():
    rng = np.random.default_rng(0)
    logits = rng.standard_normal((3, 8)).astype(np.float32)
    bias = rng.standard_normal(8).astype(np.float32) * 0.1
    experts, weights = route(mx.array(logits), mx.array(bias), 2, 4, 2, True, 2.5)
    scores = 1 / (1 + np.exp(-logits))
    for row in range(3):
        choice = (scores[row] + bias).reshape(4, 2)
        groups = np.argsort(-choice.sum(-1))[:2]  # two experts per group: the top-2 sum is the sum
        allowed = np.full(8, -np.inf)
        for g in groups:
            allowed[2 * g : 2 * g + 2] = choice[g]
        want = np.argsort(-allowed)[:2]
        got = np.array(experts[row])
        assert sorted(got.tolist()) == sorted(want.tolist())
        w = scores[row][got] / scores[row][got].sum() * 2.5
        assert np.allclose(np.array(weights[row]), w, atol=1e-6)


# --- weights ----------------------------------------------------------------------------


def assert_same(a, b):
    assert a.keys() == b.keys()
    for k in a:
        assert a[k].shape == b[k].shape and mx.array_equal(a[k], b[k]), k


@pytest.mark.parametrize("name", FIXTURE_NAMES)
def test_sanitize_is_idempotent(name):
    target = model(name)
    once = target.sanitize(raw_weights(name))
    assert_same(target.sanitize(dict(once)), once)


def test_sanitize_converts_the_hf_layout_once():
    name = "nemotron_h_tf5"
    raw = raw_weights(name)
    once = model(name).sanitize(dict(raw, **{"mtp.layers.0.norm.weight": mx.ones((64,))}))
    conv = "layers.0.mixer.conv1d.weight"
    assert raw["backbone." + conv].shape == (128, 1, 4) and once["model." + conv].shape == (128, 4, 1)
    assert mx.array_equal(once["model." + conv][..., 0], raw["backbone." + conv][:, 0])
    assert not any(k.startswith(("backbone.", "mtp.")) for k in once)
    up = once["model.layers.1.mixer.experts.up_proj.weight"]
    assert up.shape == (4, 32, 32)
    assert mx.array_equal(up[2], raw["backbone.layers.1.mixer.experts.2.up_proj.weight"])


def test_fused_experts_load_like_per_expert_ones():
    """transformers 5 holds the experts fused in memory: mixer.experts.up_proj (E, I, D)."""
    name = "nemotron_h_tf5"
    raw = raw_weights(name)
    fused = {k.replace("backbone.", "model."): v for k, v in raw.items() if ".experts." not in k}
    for proj in ("up_proj", "down_proj"):
        fused[f"model.layers.1.mixer.experts.{proj}"] = mx.stack(
            [raw[f"backbone.layers.1.mixer.experts.{e}.{proj}.weight"] for e in range(4)])
    target = model(name)
    assert_same(target.sanitize(fused), target.sanitize(raw))


def test_converted_checkpoint_loads(tmp_path):
    """Sanitized weights saved as an MLX converter would load to the same logits."""
    name = "nemotron_h_tf5"
    target, ids, want = load_fixture(name)
    mx.save_safetensors(str(tmp_path / "model.safetensors"), target.sanitize(raw_weights(name)))
    (tmp_path / "config.json").write_text((FIXTURES / name / "config.json").read_text())
    assert relative_error(load_model(tmp_path)[0](ids), want) < TOLERANCE


# --- exact rollback of the Mamba-2 layers ------------------------------------------------

def test_prefill_records_nothing_and_speculation_records_each_forward():
    target = model("nemotron_h_tf5")
    cache = make_prompt_cache(target)
    target(PROMPT[None], cache=cache)
    assert not any(c.is_trimmable() for c in cache if isinstance(c, ArraysCache))
    with pytest.raises(RuntimeError, match="outside speculation"):
        cache[0].trim(1)
    for c in cache:
        c.start_speculation()
    target(mx.array([[1, 2, 3]]), cache=cache)
    target(mx.array([[4]]), cache=cache)
    assert [n for n, _ in cache[0]._rollbacks.records] == [3, 1]


@pytest.mark.parametrize("name", FIXTURE_NAMES)
def test_tail_independence_and_replay_equals_feed(name):
    """For every m in 0..T (the shared check of test_speculative_rollback.py): two verify
    chunks sharing m tokens, each rolled back to m, leave bit-identical caches and next
    logits; and the cache equals feeding just the m tokens, to fp32 tolerance."""
    check_tail_independence(name)


def test_one_token_rollbacks_are_bit_exact():
    """A draft's single-token forwards, rolled back one at a time, equal feeding fewer."""
    target = model("nemotron_h_tf5")
    cache, fed = prefilled(target), prefilled(target)
    for token in (7, 8, 9):
        target(mx.array([[token]]), cache=cache)
    target(mx.array([[7]]), cache=fed)
    trim_prompt_cache(cache, 2)
    assert all(mx.array_equal(x, y) for x, y in zip(flat_state(cache), flat_state(fed)))
    with pytest.raises(RuntimeError, match="Cannot roll back 2 tokens: only 1 are recorded"):
        trim_prompt_cache(cache, 2)


# --- speculative decoding ------------------------------------------------------------------

NUM_TOKENS = 40  # test_speculative's plain() runs this many
DRAFT_LENGTHS = (1, 3, 6)


def speculate(target, draft, k, stats=None):
    return list(speculative_generate_step(PROMPT, target, draft, num_draft_tokens=k, adaptive_draft_length=False,
                                          max_tokens=NUM_TOKENS, stats=stats))


DRAFT_KINDS = ["dense", "self", "noisy"]


def check_greedy_speculation(target_name, draft_kind):
    """Greedy speculative output == plain output for k in DRAFT_LENGTHS, with a dense
    draft (mostly rejected), the target itself (all accepted) or the target plus noise
    (rounds partly accepted: multi-token replays of the Mamba-2 layers)."""
    target = model(target_name)
    draft = {"dense": lambda: model("llama_tf4"), "self": lambda: model(target_name),
             "noisy": lambda: noisy(target_name)}[draft_kind]()
    want = plain(target)
    for k in DRAFT_LENGTHS:
        stats = SpeculationStats()
        out = speculate(target, draft, k, stats)
        assert [t for t, _, _ in out] == want, f"k={k}"
        assert sum(from_draft for _, _, from_draft in out) == stats.num_accepted
        rounds = accepted_per_round(out)
        if draft_kind == "self":
            assert stats.num_accepted == stats.num_drafted
        elif draft_kind == "dense":
            assert stats.num_accepted < stats.num_drafted / 2
        elif k > 1:
            assert any(0 < n < k for n in rounds), (k, rounds)
            assert 0 < stats.num_accepted < stats.num_drafted, (k, stats)


def check_drafts_for_a_dense_target(draft_name):
    target, draft = model("llama_tf4"), noisy(draft_name)
    want = plain(target)
    for k in (2, 5):
        assert [t for t, _, _ in speculate(target, draft, k)] == want, f"k={k}"


@pytest.mark.parametrize("draft_kind", DRAFT_KINDS)
def test_greedy_speculative_equals_plain(draft_kind):
    check_greedy_speculation("nemotron_h_tf5", draft_kind)


def test_nemotron_h_drafts_for_a_dense_target():
    check_drafts_for_a_dense_target("nemotron_h_tf4")


@pytest.mark.parametrize("name", FIXTURE_NAMES)
def test_caches_after_speculation_equal_a_fresh_feed(name):
    """The shared check of test_speculative.py: after finishing, and after closing inside
    a round, target and noisy-draft caches hold exactly prompt + every yielded token (the
    draft's bit for bit: it runs the same computation)."""
    check_caches_after_speculation(name)


# --- command line and quantization -----------------------------------------------------------

TINY = dict(model_type="nemotron_h", vocab_size=512, hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
            head_dim=16, mamba_num_heads=8, mamba_head_dim=8, ssm_state_size=16, n_groups=2,
            intermediate_size=128, hybrid_override_pattern="M*M-", num_hidden_layers=4, eos_token_id=0)


def check_cli_with_a_noisy_draft(tmp_path, capsys, config):
    """mlx_lm.generate with --draft-model (the target plus noise) prints what it prints alone."""
    target = write_checkpoint(tmp_path / "target", config, seed=3)
    draft = write_checkpoint(tmp_path / "draft", config, seed=3, noise=NOISE)
    common = ["--model", str(target), "--prompt", "The state space", "--max-tokens", "12", "--verbose", "false",
              "--ignore-chat-template"]
    generate_main(common)
    alone = capsys.readouterr().out
    generate_main([*common, "--draft-model", str(draft), "--num-draft-tokens", "3", "--fixed-draft-length"])
    assert capsys.readouterr().out == alone and alone.strip()


def check_quantized_round_trip(tmp_path, config):
    """mlx_lm.convert -q (8 bits) loads and generates, close to the float model; returns it."""
    source = write_checkpoint(tmp_path / "float", config, seed=4)
    convert_main(["--hf-path", str(source), "--mlx-path", str(tmp_path / "q"), "-q", "--q-bits", "8"])
    quantized, tokenizer = load(str(tmp_path / "q"))
    floating, _ = load(str(source))
    prompt = mx.array(tokenizer.encode("The state space"))
    assert len([t for t, _ in generate_step(prompt, quantized, max_tokens=8)]) == 8
    # Random weights at scale 0.5 amplify rounding through the layers; 8 bits stay within 25%.
    assert relative_error(quantized(prompt[None]), floating(prompt[None])) < 0.25
    return quantized


def test_cli_with_a_noisy_draft_prints_the_same_text(tmp_path, capsys):
    check_cli_with_a_noisy_draft(tmp_path, capsys, TINY)


def test_quantized_round_trip_loads_and_generates(tmp_path):
    quantized = check_quantized_round_trip(tmp_path, TINY)
    assert quantized.layers[0].mixer.in_proj.bits == 8
    assert quantized.layers[0].mixer.conv1d.weight.shape == (128, 4, 1)  # float, transposed once
