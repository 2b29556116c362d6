"""qwen3_next.py against transformers, plus its config dialects, weight layouts, caches
and pure helpers.

Fixtures under tests/fixtures/qwen3_next_<dialect>/ come from make_hybrid_reference.py:
tiny random checkpoints saved by transformers 5 (config in the transformers-5 dialect, or
rewritten into the transformers-4 one) and the transformers fp32 logits for 80 tokens,
which cross the chunked gated-delta path's chunk boundaries.
"""

import json

import mlx.core as mx
import numpy as np
import pytest
from checkpoints import TINY_CONFIGS
from conftest import FIXTURES

from mlx_lm.models import qwen3_next
from mlx_lm.models.cache import ArraysCache, KVCache, make_prompt_cache
from mlx_lm.models.gated_delta import CHUNK_SIZE, CHUNKED_MIN_TOKENS, CONV_STATE, RECURRENT_STATE
from mlx_lm.models.qwen3_next import (
    ModelArgs,
    causal_conv1d,
    l2_normalize,
    route,
)
from mlx_lm.utils import load_model

FIXTURE_NAMES = ["qwen3_next_tf4", "qwen3_next_tf5"]
TOLERANCE = 1e-4  # fp32 on both sides; observed errors are ~5e-6
L, F = "linear_attention", "full_attention"

ARGS = dict(
    model_type="qwen3_next", hidden_size=32, num_hidden_layers=4, num_attention_heads=2,
    num_key_value_heads=1, vocab_size=64, linear_num_key_heads=1, linear_num_value_heads=2,
    linear_key_head_dim=8, linear_value_head_dim=8, intermediate_size=16, head_dim=8,
)


def relative_error(got: mx.array, want: mx.array) -> float:
    return (mx.abs(got - want).max() / mx.abs(want).max()).item()


def load_fixture(name):
    model, _ = load_model(FIXTURES / name)
    reference = mx.load(str(FIXTURES / name / "reference.safetensors"))
    return model, reference["input_ids"], reference["logits"]


def raw_weights(name):
    return mx.load(str(FIXTURES / name / "model.safetensors"))


def decode(model, ids, pieces):
    """Logits for `ids` fed through the model's cache in pieces of the given lengths."""
    cache, start, logits = make_prompt_cache(model), 0, []
    for length in pieces:
        logits.append(model(ids[:, start : start + length], cache=cache))
        start += length
    assert start == ids.shape[1]
    return mx.concatenate(logits, axis=1), cache


# --- against transformers -------------------------------------------------------------


@pytest.mark.parametrize("name", FIXTURE_NAMES)
def test_full_forward_matches_transformers(name):
    model, ids, want = load_fixture(name)
    assert ids.shape[1] > 2 * CHUNK_SIZE
    assert relative_error(model(ids), want) < TOLERANCE


@pytest.mark.parametrize("name", FIXTURE_NAMES)
def test_cached_decode_matches_transformers(name):
    """Token by token (sequential path), and a chunked prefill followed by short pieces."""
    model, ids, want = load_fixture(name)
    T = ids.shape[1]
    for pieces in ([1] * T, [CHUNK_SIZE + 7, 3, 1, T - CHUNK_SIZE - 11]):
        logits, cache = decode(model, ids, pieces)
        assert relative_error(logits, want) < TOLERANCE
    assert max(pieces) >= CHUNKED_MIN_TOKENS


def test_dialects_normalise_alike():
    """A transformers-4 config (top-level rope keys, full_attention_interval) and its
    transformers-5 form (rope_parameters, layer_types) give the same arguments."""
    tf5 = ModelArgs.from_dict(dict(
        ARGS, layer_types=[L, F, L, F],
        rope_parameters={"rope_type": "default", "rope_theta": 5e5, "partial_rotary_factor": 0.5},
    ))
    tf4 = ModelArgs.from_dict(dict(ARGS, full_attention_interval=2, rope_theta=5e5, partial_rotary_factor=0.5))
    for field in ("layer_types", "rope_theta", "partial_rotary_factor", "rope_scaling"):
        assert getattr(tf4, field) == getattr(tf5, field)
    assert tf4.rotary_dims == 4


def test_layer_types_win_over_the_interval():
    args = ModelArgs.from_dict(dict(ARGS, layer_types=[F, L, L, L], full_attention_interval=4))
    assert args.layer_types == [F, L, L, L]
    assert ModelArgs.from_dict(ARGS).layer_types == [L, L, L, F]  # interval 4 by default
    with pytest.raises(ValueError, match="layer_types has 3 entries"):
        ModelArgs.from_dict(dict(ARGS, layer_types=[L, L, F]))
    with pytest.raises(ValueError, match="unknown kinds"):
        ModelArgs.from_dict(dict(ARGS, layer_types=[L, L, "sliding_attention", F]))


def test_config_errors_name_the_value():
    with pytest.raises(ValueError, match="linear_num_value_heads \\(3\\)"):
        ModelArgs.from_dict(dict(ARGS, linear_num_key_heads=2, linear_num_value_heads=3))
    with pytest.raises(ValueError, match="hidden_act 'gelu'"):
        ModelArgs.from_dict(dict(ARGS, hidden_act="gelu"))
    with pytest.raises(ValueError, match="linear_conv_kernel_dim must be >= 1, got 0"):
        ModelArgs.from_dict(dict(ARGS, linear_conv_kernel_dim=0))
    with pytest.raises(ValueError, match="num_experts_per_tok \\(5\\)"):
        ModelArgs.from_dict(dict(ARGS, num_experts=4, num_experts_per_tok=5, moe_intermediate_size=8))


def test_moe_and_dense_layers_follow_the_config():
    model, _ = load_model(FIXTURES / "qwen3_next_tf4")  # mlp_only_layers [2], sparse step 1
    assert [type(layer.mlp).__name__ for layer in model.layers] == ["SparseMoeBlock", "SparseMoeBlock", "MLP", "SparseMoeBlock"]
    model, _ = load_model(FIXTURES / "qwen3_next_tf5")  # decoder_sparse_step 2
    assert [type(layer.mlp).__name__ for layer in model.layers] == ["MLP", "SparseMoeBlock", "MLP", "SparseMoeBlock"]
    assert [layer.is_linear for layer in model.layers] == [True, True, True, False]


def test_transformers5_config_keys_are_read():
    """Upstream 0.32 crashes on this config (rope values only inside rope_parameters)."""
    config = json.loads((FIXTURES / "qwen3_next_tf5" / "config.json").read_text())
    assert "rope_theta" not in config and "layer_types" in config
    args = ModelArgs.from_dict(config)
    assert (args.rope_theta, args.partial_rotary_factor) == (5000.0, 0.5)


# --- caches -----------------------------------------------------------------------------


def test_cache_layout():
    model, ids, _ = load_fixture("qwen3_next_tf5")
    cache = make_prompt_cache(model)
    assert [type(c) for c in cache] == [ArraysCache, ArraysCache, ArraysCache, KVCache]
    model(ids[:, :10], cache=cache)
    gdn = model.layers[0].linear_attn
    conv_state, recurrent = cache[0][CONV_STATE], cache[0][RECURRENT_STATE]
    assert conv_state.shape == (1, gdn.conv_kernel_size - 1, gdn.conv_dim)
    assert recurrent.shape == (1, gdn.num_value_heads, gdn.value_head_dim, gdn.key_head_dim)
    assert recurrent.dtype == mx.float32
    assert cache[3].offset == 10


def test_conv_state_is_a_slice_of_the_conv_input():
    """After m of T tokens the conv state is rows [m, m+K-1) of [old state ; new rows] (the
    rollback contract), and both paths leave the same recurrent state."""
    model, ids, _ = load_fixture("qwen3_next_tf4")
    gdn, norm = model.layers[0].linear_attn, model.layers[0].input_layernorm
    x = norm(model.model.embed_tokens(ids[:, :12]))
    whole = ArraysCache(2)
    gdn(x[:, :5], whole)
    before = whole[CONV_STATE]
    gdn(x[:, 5:], whole)
    conv_input = gdn.conv_input(gdn.project(x[:, 5:])[0], ArraysCache(2))
    conv_input = mx.concatenate([before, conv_input[:, gdn.conv_kernel_size - 1 :]], axis=1)
    stepped = ArraysCache(2)
    for t in range(12):
        gdn(x[:, t : t + 1], stepped)
        if t >= 5:
            m = t - 4
            assert mx.array_equal(stepped[CONV_STATE], conv_input[:, m : m + gdn.conv_kernel_size - 1])
    assert mx.array_equal(stepped[CONV_STATE], whole[CONV_STATE])
    assert relative_error(stepped[RECURRENT_STATE], whole[RECURRENT_STATE]) < 1e-5


# --- weights ----------------------------------------------------------------------------


def assert_same(a, b):
    assert a.keys() == b.keys()
    for k in a:
        assert a[k].shape == b[k].shape and mx.array_equal(a[k], b[k]), k


@pytest.mark.parametrize("name", FIXTURE_NAMES)
def test_sanitize_is_idempotent(name):
    model, _ = load_model(FIXTURES / name)
    once = model.sanitize(raw_weights(name))
    assert_same(model.sanitize(dict(once)), once)


def test_sanitize_converts_the_hf_layout_once():
    name = "qwen3_next_tf5"
    model, _ = load_model(FIXTURES / name)
    raw = raw_weights(name)
    once = model.sanitize(raw)
    conv = "model.layers.0.linear_attn.conv1d.weight"
    assert raw[conv].shape[1] == 1 and once[conv].shape[2] == 1
    assert mx.array_equal(once[conv][..., 0], raw[conv][:, 0])
    for key in ("model.norm.weight", "model.layers.3.self_attn.q_norm.weight", "model.layers.0.input_layernorm.weight"):
        assert mx.array_equal(once[key], raw[key] + 1.0)
    gated = "model.layers.0.linear_attn.norm.weight"  # plain weight, not zero-centred
    assert mx.array_equal(once[gated], raw[gated])
    experts = once["model.layers.1.mlp.switch_mlp.gate_proj.weight"]
    assert experts.shape == (4, 16, 64)
    assert mx.array_equal(experts[2], raw["model.layers.1.mlp.experts.2.gate_proj.weight"])


def test_fused_experts_load_like_per_expert_ones():
    """transformers 5 keeps experts fused in memory (gate_up_proj, down_proj)."""
    name = "qwen3_next_tf5"
    model, _ = load_model(FIXTURES / name)
    raw = raw_weights(name)
    fused = {k: v for k, v in raw.items() if ".experts." not in k}
    for layer in (1, 3):
        prefix = f"model.layers.{layer}.mlp.experts"
        stack = {p: mx.stack([raw[f"{prefix}.{e}.{p}.weight"] for e in range(4)]) for p in ("gate_proj", "up_proj", "down_proj")}
        fused[f"{prefix}.gate_up_proj"] = mx.concatenate([stack["gate_proj"], stack["up_proj"]], axis=1)
        fused[f"{prefix}.down_proj"] = stack["down_proj"]
    assert_same(model.sanitize(fused), model.sanitize(raw))


def assert_converted_checkpoint_loads(name, directory):
    """Sanitized weights saved as an MLX converter would: loading them again must neither
    add the norm +1 twice (upstream #1623) nor transpose the conv again."""
    model, ids, want = load_fixture(name)
    mx.save_safetensors(str(directory / "model.safetensors"), model.sanitize(raw_weights(name)))
    (directory / "config.json").write_text((FIXTURES / name / "config.json").read_text())
    converted, _ = load_model(directory)
    assert relative_error(converted(ids), want) < TOLERANCE


def test_converted_checkpoint_loads(tmp_path):
    assert_converted_checkpoint_loads("qwen3_next_tf4", tmp_path)


def test_mtp_weights_without_a_declared_head_are_dropped():
    """The fixture's config declares no head (num_nextn_predict_layers 0): transformers
    ignores `mtp.*`, and so do we (tests/test_mtp.py loads declared heads)."""
    name = "qwen3_next_tf4"
    model, _ = load_model(FIXTURES / name)
    raw = raw_weights(name)
    raw["mtp.fc.weight"] = mx.ones((64, 128))
    raw["mtp.norm.weight"] = mx.zeros((64,))
    sanitized = model.sanitize(raw)
    assert not any(k.startswith("mtp.") for k in sanitized)
    assert model.mtp_head is None and "mtp" not in str(list(model.parameters()))


def test_tied_embeddings_have_no_lm_head():
    tied, _ = load_model(FIXTURES / "qwen3_next_tf4")
    untied, _ = load_model(FIXTURES / "qwen3_next_tf5")
    assert "lm_head" not in tied and "lm_head" in untied


def test_quant_predicate_keeps_routers_at_8_bits():
    model, _ = load_model(FIXTURES / "qwen3_next_tf5")
    eight_bits = {"group_size": 64, "bits": 8}
    assert model.quant_predicate("model.layers.1.mlp.gate", model.layers[1].mlp.gate) == eight_bits
    assert model.quant_predicate("model.layers.1.mlp.shared_expert_gate", model.layers[1].mlp.shared_expert_gate) == eight_bits
    assert model.quant_predicate("model.layers.1.mlp.shared_expert.gate_proj", None) is True
    assert model.quant_predicate("model.layers.0.linear_attn.in_proj_qkvz", None) is True


# --- pure helpers -----------------------------------------------------------------------


def test_route_matches_naive_top_k():
    rng = np.random.default_rng(0)
    logits = rng.standard_normal((2, 5, 8)).astype(np.float32)
    for normalize in (False, True):
        experts, weights = route(mx.array(logits), 3, normalize)
        probs = np.exp(logits) / np.exp(logits).sum(-1, keepdims=True)
        want_experts = np.argsort(-probs, axis=-1)[..., :3]
        want = np.take_along_axis(probs, want_experts, -1)
        if normalize:
            want = want / want.sum(-1, keepdims=True)
        order = np.argsort(-np.array(weights), axis=-1)
        assert (np.take_along_axis(np.array(experts), order, -1) == want_experts).all()
        assert np.allclose(np.take_along_axis(np.array(weights), order, -1), want, atol=1e-6)


@pytest.mark.parametrize("T", [1, 6])
def test_causal_conv1d_matches_naive(T):
    rng = np.random.default_rng(T)
    B, C, K = 2, 5, 4
    x = rng.standard_normal((B, K - 1 + T, C)).astype(np.float32)
    w = rng.standard_normal((C, K, 1)).astype(np.float32)
    want = np.stack([(x[:, t : t + K] * w[:, :, 0].T).sum(1) for t in range(T)], axis=1)
    assert np.allclose(np.array(causal_conv1d(mx.array(x), mx.array(w))), want, atol=1e-5)


def test_l2_normalize_matches_transformers_formula():
    x = np.random.default_rng(2).standard_normal((3, 4, 16)).astype(np.float32)
    want = 0.25 * x / np.sqrt((x * x).sum(-1, keepdims=True) + qwen3_next.L2_NORM_EPS)
    assert np.allclose(np.array(l2_normalize(mx.array(x), 0.25)), want, atol=1e-6)


def test_a_conv_kernel_of_one_keeps_no_conv_state_and_speculates_exactly():
    """Upstream loads qwen3_5 with linear_conv_kernel_dim = 1 (a per-channel scale): the
    conv state is empty, both conv layouts are (C, 1, 1), and decoding through the
    caches and greedy speculation still equal the full forward and plain decoding."""
    from family_checks import decode, plain, random_model, speculate
    from checkpoints import perturb

    config = dict(TINY_CONFIGS["qwen3_next"], linear_conv_kernel_dim=1, vocab_size=256)
    target = random_model(config, scale=0.5)
    ids = mx.array([[(i * 37 + 11) % 256 for i in range(20)]])
    full = target(ids)
    assert (mx.abs(decode(target, ids, [1] * 20) - full).max() / mx.abs(full).max()).item() < 1e-5
    conv = next(layer.linear_attn.conv1d.weight for layer in target.layers if layer.is_linear)
    assert conv.shape[1:] == (1, 1)
    weights = {"model.layers.0.linear_attn.conv1d.weight": conv}
    assert target.sanitize(dict(weights))["model.layers.0.linear_attn.conv1d.weight"].shape == conv.shape
    draft = perturb(random_model(config, scale=0.5), 0.05, seed=1)
    want = plain(target)
    for k in (1, 3, 6):
        assert [t for t, _, _ in speculate(target, draft, k)] == want, k
