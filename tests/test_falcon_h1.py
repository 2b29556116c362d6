"""falcon_h1.py against transformers, its config dialects and weights, and exact
speculation through its parallel Mamba-2 + attention layers.

Fixtures under tests/fixtures/falcon_h1_<dialect>/ come from make_mamba2_reference.py:
tiny random checkpoints saved by transformers 5 with every muP multiplier away from 1,
and the transformers fp32 logits for 80 tokens. tf5: `rope_parameters`, the Mamba output
through a group-wise RMSNorm; tf4: top-level `rope_theta`, no Mamba norm, tied
embeddings, a time_step_limit floor that clamps most steps. The shared checks live in
test_nemotron_h.py (the same Mamba-2 mixer) and test_speculative*.py.
"""

import json

import mlx.core as mx
import numpy as np
import pytest
from conftest import FIXTURES
from test_nemotron_h import (
    DRAFT_KINDS,
    check_cli_with_a_noisy_draft,
    check_drafts_for_a_dense_target,
    check_greedy_speculation,
    check_matches_transformers,
    check_quantized_round_trip,
    raw_weights,
)
from test_speculative import model
from test_speculative import test_caches_after_speculation_equal_a_fresh_feed as check_caches_after_speculation
from test_speculative_rollback import test_tail_independence_and_replay_equals_feed as check_tail_independence

from mlx_lm.models.cache import ArraysCache, CacheList, KVCache, make_prompt_cache
from mlx_lm.models.falcon_h1 import ModelArgs, mup_vector
from mlx_lm.models.nemotron_h import SSM_STATE
from mlx_lm.utils import load_model

FIXTURE_NAMES = ["falcon_h1_tf4", "falcon_h1_tf5"]
ARGS = dict(model_type="falcon_h1", vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
            num_attention_heads=2, num_key_value_heads=1, mamba_d_ssm=32, mamba_n_heads=4, mamba_n_groups=2,
            mamba_d_state=8)


@pytest.mark.parametrize("name", FIXTURE_NAMES)
def test_logits_match_transformers(name):
    check_matches_transformers(name)


def test_dialects_normalise_alike():
    tf4 = ModelArgs.from_dict(json.loads((FIXTURES / "falcon_h1_tf4" / "config.json").read_text()))
    tf5 = ModelArgs.from_dict(json.loads((FIXTURES / "falcon_h1_tf5" / "config.json").read_text()))
    assert (tf4.rope_theta, tf5.rope_theta) == (1e6, 5000.0)
    assert tf4.time_step_limit == (0.3, float("inf")) and tf5.time_step_limit == (0.0, float("inf"))
    assert tf5.mamba_d_head == 8 and tf5.mamba_shape.norm_before_gate is True
    assert tf4.mamba_shape.norm_before_gate is None  # mamba_rms_norm false: y * silu(gate)
    auto = ModelArgs.from_dict(dict(ARGS, mamba_d_ssm=None, mamba_expand=2))
    assert (auto.mamba_d_ssm, auto.mamba_d_head, auto.head_dim) == (64, 16, 16)


def test_config_errors_name_the_value():
    with pytest.raises(ValueError, match=r"mamba_d_head \(5\) x mamba_n_heads \(4\) must equal mamba_d_ssm \(32\)"):
        ModelArgs.from_dict(dict(ARGS, mamba_d_head=5))
    with pytest.raises(ValueError, match="mamba_n_heads \\(4\\) must be a multiple of mamba_n_groups \\(3\\)"):
        ModelArgs.from_dict(dict(ARGS, mamba_n_groups=3))
    with pytest.raises(ValueError, match="ssm_multipliers needs 5 values, got \\[1.0\\]"):
        ModelArgs.from_dict(dict(ARGS, ssm_multipliers=[1.0]))


def test_mup_vector_scales_each_segment():
    args = ModelArgs.from_dict(dict(ARGS, ssm_multipliers=[1, 2, 3, 4, 5]))
    got = np.array(mup_vector(args.mamba_shape, args.ssm_multipliers))
    want = np.repeat([1, 2, 3, 4, 5], [32, 32, 16, 16, 4])
    assert got.shape == (2 * 32 + 2 * 2 * 8 + 4,) and (got == want).all()


def test_cache_layout_and_tied_head():
    tied, untied = model("falcon_h1_tf4"), model("falcon_h1_tf5")
    assert "lm_head" not in tied and "lm_head" in untied
    cache = make_prompt_cache(untied)
    assert len(cache) == 3 and all(isinstance(c, CacheList) for c in cache)
    assert [type(c) for c in cache[0].caches] == [ArraysCache, KVCache]
    untied(mx.array([[1, 2, 3]]), cache=cache)
    assert cache[0][0][SSM_STATE].shape == (1, 8, 8, 16) and cache[0][1].offset == 3
    assert "_mup_vector" not in dict(untied.layers[0].mamba.parameters())


@pytest.mark.parametrize("name", FIXTURE_NAMES)
def test_sanitize_is_idempotent_and_converts_the_hf_layout_once(name):
    target, raw = model(name), raw_weights(name)
    raw["model.layers.0.mamba.mup_vector"] = mx.ones((1, 1, 212))  # transformers' buffer, if a file holds it
    raw["lm_head.weight"] = mx.zeros((256, 64))
    once = target.sanitize(raw)
    twice = target.sanitize(dict(once))
    assert once.keys() == twice.keys() and all(mx.array_equal(once[k], twice[k]) for k in once)
    assert "model.layers.0.mamba.mup_vector" not in once
    assert ("lm_head.weight" in once) == (not target.args.tie_word_embeddings)
    conv = "model.layers.0.mamba.conv1d.weight"
    assert raw[conv].shape == (128, 1, 4) and once[conv].shape == (128, 4, 1)


def test_converted_checkpoint_loads(tmp_path):
    name = "falcon_h1_tf5"
    target = model(name)
    reference = mx.load(str(FIXTURES / name / "reference.safetensors"))
    mx.save_safetensors(str(tmp_path / "model.safetensors"), target.sanitize(raw_weights(name)))
    (tmp_path / "config.json").write_text((FIXTURES / name / "config.json").read_text())
    converted, _ = load_model(tmp_path)
    assert mx.allclose(converted(reference["input_ids"]), target(reference["input_ids"]))


@pytest.mark.parametrize("name", FIXTURE_NAMES)
def test_tail_independence_and_replay_equals_feed(name):
    """Every m in 0..T: bit-identical caches and logits after rolling two verify chunks
    that share m tokens back to m; the cache equals feeding the m tokens (fp32 tolerance)."""
    check_tail_independence(name)


@pytest.mark.parametrize("draft_kind", DRAFT_KINDS)
def test_greedy_speculative_equals_plain(draft_kind):
    check_greedy_speculation("falcon_h1_tf5", draft_kind)


def test_falcon_h1_drafts_for_a_dense_target():
    check_drafts_for_a_dense_target("falcon_h1_tf4")


@pytest.mark.parametrize("name", FIXTURE_NAMES)
def test_caches_after_speculation_equal_a_fresh_feed(name):
    check_caches_after_speculation(name)


TINY = dict(model_type="falcon_h1", vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, mamba_d_ssm=64, mamba_n_heads=8, mamba_n_groups=2,
            mamba_d_state=16, mamba_rms_norm=True, ssm_multipliers=[0.5, 1.2, 0.8, 1.1, 0.9], eos_token_id=0)


def test_cli_with_a_noisy_draft_prints_the_same_text(tmp_path, capsys):
    check_cli_with_a_noisy_draft(tmp_path, capsys, TINY)


def test_quantized_round_trip_loads_and_generates(tmp_path):
    quantized = check_quantized_round_trip(tmp_path, TINY)
    assert quantized.layers[0].mamba.in_proj.bits == 8 and quantized.layers[0].self_attn.q_proj.bits == 8
