"""qwen3_5.py and qwen3_5_moe.py against transformers, plus their nested config, the
checkpoint prefixes, the dropped vision tower and the expert layouts.

Fixtures come from make_hybrid_reference.py (see test_qwen3_next.py). qwen3_5_moe_tf5
stores its experts fused (`mlp.experts.gate_up_proj`), as the Qwen3.5 MoE hub
checkpoints do; qwen3_5_moe_tf4 per expert, as transformers saves them.
"""

import json

import mlx.core as mx
import pytest
from conftest import FIXTURES
from test_qwen3_next import (
    assert_converted_checkpoint_loads,
    assert_same,
    decode,
    load_fixture,
    raw_weights,
    relative_error,
)

from mlx_lm.models import qwen3_5, qwen3_5_moe
from mlx_lm.models.cache import ArraysCache, KVCache, make_prompt_cache
from mlx_lm.models.gated_delta import CHUNK_SIZE
from mlx_lm.utils import load_model

FIXTURE_NAMES = ["qwen3_5_tf4", "qwen3_5_tf5", "qwen3_5_moe_tf4", "qwen3_5_moe_tf5"]
TOLERANCE = 1e-4  # fp32 on both sides; observed errors are ~5e-6

TEXT = dict(
    hidden_size=32, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
    vocab_size=64, linear_num_key_heads=1, linear_num_value_heads=2, linear_key_head_dim=8,
    linear_value_head_dim=8, intermediate_size=16, head_dim=8, full_attention_interval=2,
)


@pytest.mark.parametrize("name", FIXTURE_NAMES)
def test_full_forward_matches_transformers(name):
    model, ids, want = load_fixture(name)
    assert relative_error(model(ids), want) < TOLERANCE


@pytest.mark.parametrize("name", FIXTURE_NAMES)
def test_cached_decode_matches_transformers(name):
    """Token by token, and a chunked prefill followed by short pieces."""
    model, ids, want = load_fixture(name)
    T = ids.shape[1]
    for pieces in ([1] * T, [CHUNK_SIZE + 9, 2, T - CHUNK_SIZE - 11]):
        logits, _ = decode(model, ids, pieces)
        assert relative_error(logits, want) < TOLERANCE


@pytest.mark.parametrize("name", FIXTURE_NAMES)
def test_sanitize_is_idempotent(name):
    model, _ = load_model(FIXTURES / name)
    once = model.sanitize(raw_weights(name))
    assert_same(model.sanitize(dict(once)), once)


def test_sanitize_maps_prefixes_and_drops_vision():
    name = "qwen3_5_tf5"
    model, _ = load_model(FIXTURES / name)
    raw = raw_weights(name)
    assert any(k.startswith("model.visual.") for k in raw)
    raw["vision_tower.blocks.0.attn.qkv.weight"] = mx.zeros((4, 4))  # MLX-VLM naming
    once = model.sanitize(raw)
    assert all(k.startswith("language_model.") for k in once)
    assert not any("visual" in k or "vision" in k for k in once)
    key = "layers.0.linear_attn.in_proj_qkv.weight"
    assert mx.array_equal(once[f"language_model.model.{key}"], raw[f"model.language_model.{key}"])
    assert mx.array_equal(once["language_model.lm_head.weight"], raw["lm_head.weight"])
    norm = "norm.weight"
    assert mx.array_equal(once[f"language_model.model.{norm}"], raw[f"model.language_model.{norm}"] + 1.0)


@pytest.mark.parametrize("name", ["qwen3_5_moe_tf4", "qwen3_5_moe_tf5"])
def test_experts_become_switch_mlp(name):
    """Fused (hub) and per-expert (transformers save) layouts give the same tensors."""
    model, _ = load_model(FIXTURES / name)
    raw = raw_weights(name)
    once = model.sanitize(raw)
    prefix = "model.language_model.layers.0.mlp.experts"
    gate = once["language_model.model.layers.0.mlp.switch_mlp.gate_proj.weight"]
    up = once["language_model.model.layers.0.mlp.switch_mlp.up_proj.weight"]
    down = once["language_model.model.layers.0.mlp.switch_mlp.down_proj.weight"]
    if f"{prefix}.gate_up_proj" in raw:
        fused = raw[f"{prefix}.gate_up_proj"]  # (E, 2I, H): first half gate
        intermediate = fused.shape[1] // 2
        assert mx.array_equal(gate, fused[:, :intermediate]) and mx.array_equal(up, fused[:, intermediate:])
        assert mx.array_equal(down, raw[f"{prefix}.down_proj"])
    else:
        assert mx.array_equal(gate[1], raw[f"{prefix}.1.gate_proj.weight"])
        assert mx.array_equal(down[3], raw[f"{prefix}.3.down_proj.weight"])
    assert not any(".experts." in k for k in once)


@pytest.mark.parametrize("name", ["qwen3_5_tf4", "qwen3_5_moe_tf5"])
def test_converted_checkpoint_loads(name, tmp_path):
    assert_converted_checkpoint_loads(name, tmp_path)


def test_mtp_weights_without_a_declared_head_are_dropped():
    name = "qwen3_5_moe_tf4"
    model, _ = load_model(FIXTURES / name)
    raw = raw_weights(name)
    raw["mtp.pre_fc_norm_hidden.weight"] = mx.zeros((64,))
    assert not any(k.startswith(("mtp", "language_model.mtp")) for k in model.sanitize(raw))
    assert model.mtp_head is None


def test_layers_caches_and_mlps():
    dense, _ = load_model(FIXTURES / "qwen3_5_tf5")  # layer_types [L, L, F, L]
    assert [type(c) for c in make_prompt_cache(dense)] == [ArraysCache, ArraysCache, KVCache, ArraysCache]
    assert all(type(layer.mlp).__name__ == "MLP" for layer in dense.layers)
    moe, _ = load_model(FIXTURES / "qwen3_5_moe_tf4")  # full_attention_interval 2
    assert [layer.is_linear for layer in moe.layers] == [True, False, True, False]
    assert all(type(layer.mlp).__name__ == "SparseMoeBlock" for layer in moe.layers)
    eight_bits = {"group_size": 64, "bits": 8}
    assert moe.quant_predicate("language_model.model.layers.0.mlp.gate", moe.layers[0].mlp.gate) == eight_bits


def test_top_level_tie_word_embeddings_wins():
    config = json.loads((FIXTURES / "qwen3_5_tf4" / "config.json").read_text())
    assert config["tie_word_embeddings"] is True
    model, _ = load_model(FIXTURES / "qwen3_5_tf4")
    assert "lm_head" not in model.language_model
    args = qwen3_5.ModelArgs.from_dict(dict(config, tie_word_embeddings=False))
    assert args.text_args.tie_word_embeddings is False
    args = qwen3_5.ModelArgs.from_dict({"model_type": "qwen3_5", "text_config": dict(TEXT, tie_word_embeddings=True)})
    assert args.tie_word_embeddings is True
    assert args.vocab_size == TEXT["vocab_size"]


def test_mrope_keys_reduce_to_plain_rope():
    """Text positions are equal on every mrope axis, so both dialects give plain rope."""
    for rope in (
        {"rope_parameters": {"rope_type": "default", "rope_theta": 1e4, "mrope_section": [1, 1, 0], "mrope_interleaved": True}},
        {"rope_theta": 1e4, "rope_scaling": {"type": "mrope", "mrope_section": [1, 1, 0]}},
    ):
        args = qwen3_5.ModelArgs.from_dict({"model_type": "qwen3_5", "text_config": dict(TEXT, **rope)})
        assert args.text_args.rope_scaling is None and args.text_args.rope_theta == 1e4
        assert args.text_args.partial_rotary_factor == 0.25


def test_config_errors():
    with pytest.raises(ValueError, match="needs a text_config"):
        qwen3_5.ModelArgs.from_dict({"model_type": "qwen3_5", "hidden_size": 32})
    with pytest.raises(ValueError, match="layer_types has 1 entries"):
        qwen3_5.ModelArgs.from_dict({"model_type": "qwen3_5", "text_config": dict(TEXT, layer_types=["full_attention"])})
    moe_text = dict(TEXT, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=8, shared_expert_intermediate_size=8)
    with pytest.raises(ValueError, match="norm_topk_prob=False"):
        qwen3_5_moe.ModelArgs.from_dict({"model_type": "qwen3_5_moe", "text_config": dict(moe_text, norm_topk_prob=False)})
    with pytest.raises(ValueError, match="num_experts_per_tok"):
        qwen3_5_moe.ModelArgs.from_dict({"model_type": "qwen3_5_moe", "text_config": TEXT})


def test_dense_family_ignores_moe_keys():
    """transformers' Qwen3.5 text config drops the MoE keys, so a dense model stays dense."""
    text = dict(TEXT, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=8)
    model = qwen3_5.Model(qwen3_5.ModelArgs.from_dict({"model_type": "qwen3_5", "text_config": text}))
    assert all(type(layer.mlp).__name__ == "MLP" for layer in model.layers)
