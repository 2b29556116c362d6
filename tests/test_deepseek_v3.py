"""deepseek_v3.py: the shared family checks (family_checks.py) on the transformers
fixtures, plus what only DeepSeek-V3 has beyond deepseek_v2: the MoE block against the
naive group-limited sigmoid loop (moe_checks), the correction bias, groups, rope pair
layout and yarn softmax scale mattering on the fixtures, the config dialects and
errors, and sanitize on every layout (transformers' saved and in-memory ones, ours,
upstream mlx-lm's split kv_b_proj, the FP8 releases, the MTP layers). The latent
attention itself is tested in test_mla.py; two-rank sharding of FAMILY.tiny in
test_distributed.py.

Fixtures come from fixtures/make_deepseek_v3_reference.py: deepseek_v3_tf4 (hub
dialect, no q LoRA, yarn with mscale = mscale_all_dim, a dense first layer, 4 groups
keeping 2) and deepseek_v3_tf5 (as transformers 5 saves it: q LoRA, rotate-half rope,
yarn with both scales moving, 2 groups keeping 1, biases, tied).
"""

import mlx.core as mx
import numpy as np
import pytest
from checkpoints import VOCAB_SIZE
from family_checks import FIXTURES, PROMPT, Family, FamilyChecks, fixture_model, reference, relative_error
from moe_checks import assert_same, assert_sanitize_layouts, assert_shared_moe_equals_naive, fused_mlp_experts
from sliding_checks import assert_override_matters

from mlx_lm.models import deepseek_v3
from mlx_lm.models.cache import KVCache, make_prompt_cache
from mlx_lm.models.deepseek_v3 import ModelArgs, join_absorbed_kv_b_proj
from mlx_lm.models.llama import MLP
from mlx_lm.utils import get_model_classes

MLA = dict(kv_lora_rank=16, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16)
FAMILY = Family(
    fixtures=["deepseek_v3_tf4", "deepseek_v3_tf5"],
    tiny=dict(MLA, model_type="deepseek_v3", vocab_size=VOCAB_SIZE, hidden_size=64, intermediate_size=256,
              moe_intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, q_lora_rank=16,
              n_routed_experts=4, n_group=2, topk_group=1, num_experts_per_tok=2, first_k_dense_replace=1,
              rope_theta=10000.0, eos_token_id=0),
    small=dict(model_type="deepseek_v3", vocab_size=256, hidden_size=32, intermediate_size=48, moe_intermediate_size=16,
               num_hidden_layers=1, num_attention_heads=2, q_lora_rank=None, kv_lora_rank=8, qk_nope_head_dim=8,
               qk_rope_head_dim=8, v_head_dim=8, n_routed_experts=4, n_group=1, topk_group=1, num_experts_per_tok=2,
               first_k_dense_replace=0),
)
ARGS = dict(MLA, model_type="deepseek_v3", vocab_size=256, hidden_size=64, intermediate_size=96,
            moe_intermediate_size=16, num_hidden_layers=2, num_attention_heads=4, q_lora_rank=None,
            n_routed_experts=8, n_group=4, topk_group=2, num_experts_per_tok=2, first_k_dense_replace=1,
            max_position_embeddings=64)
YARN = {"factor": 4.0, "mscale": 1.0, "mscale_all_dim": 1.0, "original_max_position_embeddings": 16}


class TestDeepseekV3(FamilyChecks):
    family = FAMILY


# --- what the fixtures exercise -------------------------------------------------------------


@pytest.mark.parametrize("name", FAMILY.fixtures)
def test_moe_block_equals_a_naive_loop(name):
    model = fixture_model(name)
    assert_shared_moe_equals_naive(model.layers[1].mlp, model.args)


def test_fixtures_cover_both_query_paths_and_layer_kinds():
    tf4, tf5 = fixture_model("deepseek_v3_tf4"), fixture_model("deepseek_v3_tf5")
    assert "q_proj" in tf4.layers[0].self_attn and "q_a_proj" in tf5.layers[0].self_attn
    assert [type(layer.mlp) for layer in tf4.layers] == [MLP, deepseek_v3.MoE]
    assert [type(layer.mlp) for layer in tf5.layers] == [deepseek_v3.MoE] * 2
    assert (tf4.args.rope_traditional, tf5.args.rope_traditional) == (True, False)


@pytest.mark.parametrize("name, override", [
    ("deepseek_v3_tf4", {"topk_group": 4}),  # every group allowed: other experts win
    ("deepseek_v3_tf5", {"topk_group": 2}),
    ("deepseek_v3_tf4", {"rope_interleave": False}),  # the other pair layout
    ("deepseek_v3_tf5", {"rope_interleave": True}),
    # mscale_all_dim 0: no softmax rescale (and the rotated features get the plain get_mscale(f))
    ("deepseek_v3_tf4", {"rope_scaling": dict(YARN, type="yarn", mscale_all_dim=0.0)}),
    ("deepseek_v3_tf5", {"rope_parameters": {"rope_type": "default", "rope_theta": 500.0}}),  # no yarn
])
def test_the_fixtures_depend_on_the_router_and_rope_features(name, override):
    assert_override_matters(name, override)


def test_the_correction_bias_changes_the_choice():
    model, (ids, want) = fixture_model("deepseek_v3_tf4"), reference("deepseek_v3_tf4")
    gate = model.layers[1].mlp.gate
    bias = gate.e_score_correction_bias
    try:
        gate.e_score_correction_bias = mx.zeros_like(bias)
        assert relative_error(model(ids), want) > 1e-2
    finally:
        gate.e_score_correction_bias = bias
    assert relative_error(model(ids), want) < FAMILY.tolerance


def test_the_cache_holds_the_latent_and_the_rotated_rope_key():
    model = fixture_model("deepseek_v3_tf5")
    cache = make_prompt_cache(model)
    assert [type(c) for c in cache] == [KVCache, KVCache]
    model(PROMPT[None], cache=cache)
    latent, k_rot = cache[0].state
    assert latent.shape == (1, 1, PROMPT.size, 16) and k_rot.shape == (1, 1, PROMPT.size, 8)


# --- config ---------------------------------------------------------------------------------


def test_config_dialects_give_the_same_args():
    tf4 = ModelArgs.from_dict(dict(ARGS, rope_theta=1e4, rope_scaling=dict(YARN, type="yarn"), moe_layer_freq=1,
                                   scoring_func="sigmoid", topk_method="noaux_tc", num_nextn_predict_layers=1))
    tf5 = ModelArgs.from_dict(dict(ARGS, rope_parameters=dict(YARN, rope_type="yarn", rope_theta=1e4),
                                   rope_interleave=True, head_dim=8, qk_head_dim=24))
    for field in ("rope_theta", "rope_scaling", "rope_traditional", "first_k_dense_replace", "n_group",
                  "num_nextn_predict_layers"):
        assert getattr(tf4, field) == getattr(tf5, field), field


def test_defaults_are_transformers_and_aliases_map_here():
    args = ModelArgs(model_type="deepseek_v3")
    assert (args.first_k_dense_replace, args.n_group, args.topk_group, args.num_experts_per_tok) == (3, 8, 4, 8)
    assert (args.routed_scaling_factor, args.norm_topk_prob, args.rope_interleave) == (2.5, True, True)
    for model_type in ("kimi_k2", "joyai_llm_flash"):
        assert get_model_classes({"model_type": model_type}) == (deepseek_v3.Model, ModelArgs)


@pytest.mark.parametrize("override, message", [
    ({"n_group": 3}, r"n_group \(3\) must divide n_routed_experts \(8\)"),
    ({"topk_group": 5}, r"topk_group \(5\) must be in 1..n_group \(4\)"),
    ({"n_group": 8, "topk_group": 1}, r"n_group \(8\) leaves 1 expert per group"),
    ({"num_experts_per_tok": 5}, r"num_experts_per_tok \(5\) must be at most 4"),
    ({"scoring_func": "softmax"}, "scoring_func 'softmax' is not supported"),
    ({"topk_method": "greedy"}, "topk_method 'greedy' is not supported"),
    ({"mlp_bias": True}, "mlp_bias True is not supported"),
    ({"num_key_value_heads": 2}, r"num_key_value_heads \(2\) must equal num_attention_heads \(4\)"),
    ({"quantization_config": {"quant_method": "compressed-tensors"}}, "compressed-tensors"),
])
def test_config_errors_name_the_value(override, message):
    with pytest.raises(ValueError, match=message):
        ModelArgs.from_dict(dict(ARGS, **override))


# --- sanitize -------------------------------------------------------------------------------


def test_sanitize_takes_every_layout_once():
    assert_sanitize_layouts(FAMILY.fixtures, fused_mlp_experts)


def test_sanitize_drops_the_mtp_layers_only():
    model = fixture_model("deepseek_v3_tf4")  # 2 layers, num_nextn_predict_layers 1
    raw = mx.load(str(FIXTURES / "deepseek_v3_tf4" / "model.safetensors"))
    extra = {"model.layers.2.eh_proj.weight": mx.zeros((4, 4)), "model.layers.2.self_attn.q_proj.weight": mx.zeros(2),
             "model.layers.3.eh_proj.weight": mx.zeros((4, 4))}
    once = model.sanitize(dict(raw, **extra))
    assert "model.layers.3.eh_proj.weight" in once  # not an MTP layer: left for the strict load to refuse
    assert not any(k.startswith("model.layers.2.") for k in once)


def to_fp8_blocks(w: mx.array, block: int) -> tuple:
    """w (out, in) -> e4m3 bytes and one scale per block x block tile (the releases' layout)."""
    rows, cols = -(-w.shape[0] // block), -(-w.shape[1] // block)
    padded = mx.pad(w, [(0, rows * block - w.shape[0]), (0, cols * block - w.shape[1])])
    tiles = padded.reshape(rows, block, cols, block)
    scale = mx.abs(tiles).max(axis=(1, 3)) / 448.0  # e4m3's largest value
    scaled = (tiles / scale[:, None, :, None]).reshape(padded.shape)[: w.shape[0], : w.shape[1]]
    return mx.to_fp8(scaled), scale


def test_sanitize_dequantizes_the_fp8_release():
    config = dict(ARGS, quantization_config={"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [32, 32]})
    model = deepseek_v3.Model(ModelArgs.from_dict(config))
    raw = mx.load(str(FIXTURES / "deepseek_v3_tf4" / "model.safetensors"))
    want = model.sanitize(dict(raw))
    fp8 = dict(raw)
    for key in ("model.layers.0.self_attn.o_proj.weight", "model.layers.1.mlp.experts.3.down_proj.weight"):
        fp8[key], fp8[key + "_scale_inv"] = to_fp8_blocks(raw[key], 32)  # 64 x 64 and 64 x 16: whole and partial tiles
    got = model.sanitize(fp8)
    assert sorted(got) == sorted(want) and not any(k.endswith("_scale_inv") for k in got)
    o_proj = got["model.layers.0.self_attn.o_proj.weight"]
    assert o_proj.dtype == mx.bfloat16
    assert relative_error(o_proj, want["model.layers.0.self_attn.o_proj.weight"]) < 2 ** -4  # e4m3's 3-bit mantissa
    assert relative_error(got["model.layers.1.mlp.switch_mlp.down_proj.weight"],
                          want["model.layers.1.mlp.switch_mlp.down_proj.weight"]) < 2 ** -4


def test_sanitize_joins_upstream_mlx_lms_split_kv_b_proj():
    model = fixture_model("deepseek_v3_tf5")
    ours = model.sanitize(dict(mx.load(str(FIXTURES / "deepseek_v3_tf5" / "model.safetensors"))))
    upstream = dict(ours)
    for layer in range(2):
        prefix = f"model.layers.{layer}.self_attn."
        w = upstream.pop(prefix + "kv_b_proj.weight").reshape(4, 8 + 16, 16)  # (H, dn + dv, r)
        upstream[prefix + "embed_q.weight"] = mx.contiguous(w[:, :8].swapaxes(-1, -2))  # (H, r, dn)
        upstream[prefix + "unembed_out.weight"] = w[:, 8:]  # (H, dv, r)
    assert_same(model.sanitize(upstream), ours, "upstream's split kv_b_proj")


def test_join_dequantizes_a_quantized_split():
    """Bits and group size follow from the packed shapes: 4 bits in groups of 32 here."""
    H, r, dn, dv = 2, 64, 32, 48
    w_k_t, w_v = mx.random.normal((H, r, dn), key=mx.random.key(1)), mx.random.normal((H, dv, r), key=mx.random.key(2))
    weights, want = {}, []
    for name, w in (("embed_q", w_k_t), ("unembed_out", w_v)):
        packed, scales, biases = mx.quantize(w, group_size=32, bits=4)
        weights.update({f"l.self_attn.{name}.weight": packed, f"l.self_attn.{name}.scales": scales,
                        f"l.self_attn.{name}.biases": biases})
        want.append(mx.dequantize(packed, scales, biases, group_size=32, bits=4))
    got = join_absorbed_kv_b_proj(weights, dn, r)
    assert sorted(got) == ["l.self_attn.kv_b_proj.weight"]
    kv_b = np.array(got["l.self_attn.kv_b_proj.weight"]).reshape(H, dn + dv, r)
    np.testing.assert_array_equal(kv_b[:, :dn], np.array(want[0]).swapaxes(-1, -2))
    np.testing.assert_array_equal(kv_b[:, dn:], np.array(want[1]))
