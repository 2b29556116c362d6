"""mimo_v2_flash.py (MiMo-V2-Flash): the shared family checks (family_checks.py) on the
transformers fixtures, plus what only MiMo-V2-Flash has: the window exactly as
transformers defines it (the hub's `sliding_window_size` + 1: a key at distance
window - 1 is seen, one at distance window is not, with and without the ring buffer),
that the fixtures depend on the sinks, the value scale, the partial rope and grouped
routing, the config dialects and errors, FP8 block dequantization against a naive decoder, and sanitize
over the hub (FP8 too), transformers, upstream-converted and MLX layouts (MTP layers
dropped). Its sharded sinks and experts are checked by
test_distributed.py, which shards FAMILY.tiny over two ranks.

Fixtures come from fixtures/make_mimo_v2_flash_reference.py (window 8, 40 tokens):
mimo_v2_flash_tf4 in the hub's dialect, mimo_v2_flash_tf5 as transformers 5 saves it.
"""

import mlx.core as mx
import numpy as np
import pytest
from checkpoints import VOCAB_SIZE
from family_checks import FIXTURES, Family, FamilyChecks, fixture_model, fresh_model, random_model, reference
from family_checks import relative_error
from sliding_checks import assert_override_matters, assert_sanitize_is_idempotent

from mlx_lm.models.cache import KVCache, RotatingKVCache, make_prompt_cache
from mlx_lm.models.mimo_v2_flash import DENSE, FULL, SLIDING, SPARSE, ModelArgs, dequantize_fp8_blocks

SHAPE = dict(model_type="mimo_v2_flash", hidden_size=64, intermediate_size=64, moe_intermediate_size=16,
             num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=24, v_head_dim=16,
             n_routed_experts=4, num_experts_per_tok=2, sliding_window=8)

FAMILY = Family(
    fixtures=["mimo_v2_flash_tf4", "mimo_v2_flash_tf5"],
    tiny=dict(SHAPE, layer_types=[FULL, SLIDING, SLIDING, FULL], vocab_size=VOCAB_SIZE, eos_token_id=0,
              n_group=2, topk_group=1),
    small=dict(SHAPE, hidden_size=32, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
               layer_types=[SLIDING, FULL], vocab_size=256),
)


class TestMimoV2Flash(FamilyChecks):
    family = FAMILY


def last_logits_change(model, ids: mx.array, position: int, cached: bool) -> float:
    """How much the last position's logits move when the token at `position` changes
    (fed at once, or token by token through the model's caches)."""
    changed = mx.array(ids)
    changed[0, position] = (ids[0, position].item() + 1) % 256

    def last(x):
        if not cached:
            return model(x)[:, -1]
        cache = make_prompt_cache(model)
        for i in range(x.shape[1]):
            out = model(x[:, i : i + 1], cache=cache)
        return out[:, -1]

    return mx.abs(last(ids) - last(changed)).max().item()


@pytest.mark.parametrize("cached", [False, True])
def test_window_is_sliding_window_size_plus_one(cached):
    """One sliding layer, window 8 from the hub's sliding_window_size 7: the last query
    sees the key 7 positions back (window - 1) and not the one 8 back (window)."""
    model = random_model(dict(SHAPE, num_hidden_layers=1, sliding_window_size=7, hybrid_layer_pattern=[1],
                              moe_layer_freq=[0], vocab_size=256))
    assert model.args.sliding_window == 8 and isinstance(model.make_cache()[0], RotatingKVCache)
    ids = mx.array([[(i * 37 + 11) % 256 for i in range(20)]])
    assert last_logits_change(model, ids, 19 - 7, cached) > 1e-3
    assert last_logits_change(model, ids, 19 - 8, cached) == 0.0


@pytest.mark.parametrize("name, override", [
    ("mimo_v2_flash_tf5", {"sliding_window": 1000}),
    ("mimo_v2_flash_tf4", {"sliding_window_size": 6}),  # one short (upstream mlx-lm's window)
    ("mimo_v2_flash_tf5", {"attention_value_scale": 1.0}),
    ("mimo_v2_flash_tf4", {"partial_rotary_factor": 1.0}),
    ("mimo_v2_flash_tf5", {"n_group": 1, "topk_group": 1}),
    ("mimo_v2_flash_tf5", {"routed_scaling_factor": 1.0}),
])
def test_fixtures_exercise_every_feature(name, override):
    assert_override_matters(name, override)


def test_sinks_matter_and_sit_on_sliding_layers_only():
    """Sinks pushed to -inf (no sink) are far from transformers' logits."""
    model = fresh_model("mimo_v2_flash_tf5")
    assert [layer.self_attn.has_sinks for layer in model.layers] == [True, False, True, True]
    ids, want = reference("mimo_v2_flash_tf5")
    for layer in model.layers:
        if layer.self_attn.has_sinks:
            layer.self_attn.sinks = mx.full(layer.self_attn.sinks.shape, -1e9)
    assert relative_error(model(ids), want) > 1e-2


def test_cache_kinds_and_layer_shapes():
    model = fixture_model("mimo_v2_flash_tf4")
    assert [type(c) for c in model.make_cache()] == [KVCache] + [RotatingKVCache] * 3
    assert [layer.self_attn.n_kv_heads for layer in model.layers] == [1, 2, 2, 2]  # sliding: twice the KV heads
    assert [type(layer.mlp).__name__ for layer in model.layers] == ["MLP", "MoE", "MoE", "MoE"]


HUB = dict(SHAPE, hybrid_layer_pattern=[0, 1, 1, 0], moe_layer_freq=[0, 1, 1, 1], sliding_window_size=7,
           sliding_window=7, rope_theta=1e6, swa_rope_theta=1e4, partial_rotary_factor=0.5,
           layernorm_epsilon=1e-6, swa_num_attention_heads=4, swa_num_key_value_heads=4, swa_head_dim=24,
           swa_v_head_dim=16, routed_scaling_factor=None)
TF5 = dict(SHAPE, layer_types=[FULL, SLIDING, SLIDING, FULL], mlp_layer_types=[DENSE] + [SPARSE] * 3,
           sliding_window=8, rms_norm_eps=1e-6, rope_parameters={
               FULL: {"rope_type": "default", "rope_theta": 1e6, "partial_rotary_factor": 0.5},
               SLIDING: {"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 0.5}})


def test_config_dialects_give_the_same_args():
    hub, tf5 = ModelArgs.from_dict(HUB), ModelArgs.from_dict(TF5)
    for field in ("layer_types", "mlp_layer_types", "sliding_window", "rms_norm_eps", "attention",
                  "routed_scaling_factor"):
        assert getattr(hub, field) == getattr(tf5, field), field
    assert hub.attention[SLIDING].num_kv_heads == 4 and hub.attention[SLIDING].rotary_dims == 12
    unwindowed = {k: v for k, v in SHAPE.items() if k != "sliding_window"}
    defaults = ModelArgs.from_dict(dict(unwindowed, num_hidden_layers=12))
    assert defaults.sliding_window == 129  # transformers' default: the hub's 128 previous tokens + the query
    assert defaults.layer_types == [FULL] + [SLIDING] * 4 + [FULL] + [SLIDING] * 5 + [FULL]
    assert defaults.attention[FULL].rope_theta == 5e6 and defaults.attention[SLIDING].rotary_dims == 8


@pytest.mark.parametrize("override, message", [
    ({"rope_parameters": {"rope_type": "default", "rope_theta": 1e4}}, "keyed by layer type"),
    ({"partial_rotary_factor": 0.3}, "rotates 7 of 24"),
    ({"hybrid_layer_pattern": [0, 2, 1, 1]}, r"\[0, 2, 1, 1\]"),
    ({"layer_types": [FULL] * 4, "hybrid_layer_pattern": [0, 1, 1, 1]}, "disagrees with hybrid_layer_pattern"),
    ({"moe_layer_freq": [0, 1]}, "2 entries"),
    ({"sliding_window": None}, "sliding_window is None"),
    ({"scoring_func": "softmax"}, "'softmax'"),
    ({"n_group": 3}, r"n_group \(3\)"),
    ({"num_key_value_heads": 3}, r"\(3\)"),
    ({"quantization_config": {"quant_method": "gptq"}}, "'gptq'"),
    ({"n_shared_experts": 1}, "n_shared_experts 1"),
    ({"topk_method": "greedy"}, "'greedy'"),
])
def test_config_errors_name_the_value(override, message):
    with pytest.raises(ValueError, match=message):
        ModelArgs.from_dict(dict(SHAPE, **override))


def test_sanitize_is_idempotent_and_drops_what_we_compute():
    assert_sanitize_is_idempotent(FAMILY.fixtures)


def test_sanitize_reads_transformers_fused_layout_and_drops_mtp():
    """transformers' in-memory layout (fused gate_up_proj, `sinks`) and a hub file with
    MTP layers sanitize to what the saved per-expert layout gives."""
    model = fixture_model("mimo_v2_flash_tf4")
    raw = mx.load(str(FIXTURES / "mimo_v2_flash_tf4" / "model.safetensors"))
    want = model.sanitize(dict(raw))
    fused = {k: v for k, v in raw.items() if ".mlp.experts." not in k}
    for i in (1, 2, 3):
        stem = f"model.layers.{i}.mlp.experts"
        gate = mx.stack([raw[f"{stem}.{e}.gate_proj.weight"] for e in range(4)])
        up = mx.stack([raw[f"{stem}.{e}.up_proj.weight"] for e in range(4)])
        fused[f"{stem}.gate_up_proj"] = mx.concatenate([gate, up], axis=1)  # (E, 2I, D)
        fused[f"{stem}.down_proj"] = mx.stack([raw[f"{stem}.{e}.down_proj.weight"] for e in range(4)])
        fused[f"model.layers.{i}.self_attn.sinks"] = fused.pop(f"model.layers.{i}.self_attn.attention_sink_bias")
    fused["model.mtp.layers.0.self_attn.q_proj.weight"] = mx.ones((4, 4))
    got = model.sanitize(fused)
    assert got.keys() == want.keys() and all(mx.array_equal(got[k], want[k]) for k in want)


def e4m3_value(byte: int) -> float:
    """Naive OCP FP8 E4M3 decoder: sign, 4 exponent bits (bias 7), 3 mantissa bits,
    subnormals at exponent 0; 0x7f/0xff are NaN."""
    sign = -1.0 if byte & 0x80 else 1.0
    exponent, mantissa = (byte >> 3) & 0xF, byte & 0x7
    if exponent == 0xF and mantissa == 0x7:
        return float("nan")
    if exponent == 0:
        return sign * mantissa / 8 * 2.0**-6
    return sign * (1 + mantissa / 8) * 2.0 ** (exponent - 7)


def test_fp8_block_dequantization_against_a_naive_loop():
    """Tiles of 4 x 8 over a (10, 20) weight: the last row and column tiles are partial."""
    weight = mx.to_fp8(mx.random.normal((10, 20), key=mx.random.key(0)) * 3)  # (10, 20) uint8
    scale_inv = mx.random.uniform(0.1, 2.0, (3, 3), key=mx.random.key(1))
    got = dequantize_fp8_blocks(weight, scale_inv, (4, 8), dtype=mx.float32)
    raw, scales = np.array(weight), np.array(scale_inv)
    want = np.array([[e4m3_value(int(raw[i, j])) * scales[i // 4, j // 8] for j in range(20)] for i in range(10)])
    assert np.array_equal(np.array(got), want.astype(np.float32))


def test_sanitize_dequantizes_the_fp8_release():
    """Every projection stored as e4m3 bytes with per-tile scales (tiles of 8 x 16, the
    fixture's sizes are not multiples of them) comes back dequantized, scales consumed."""
    model = fresh_model("mimo_v2_flash_tf4")
    model.args.quantization_config = {"quant_method": "fp8", "weight_block_size": [8, 16]}
    raw = mx.load(str(FIXTURES / "mimo_v2_flash_tf4" / "model.safetensors"))
    fp8 = dict(raw)
    for key in [k for k in raw if k.endswith("_proj.weight")]:
        rows, cols = -(-raw[key].shape[0] // 8), -(-raw[key].shape[1] // 16)
        scale_inv = mx.random.uniform(0.01, 0.1, (rows, cols), key=mx.random.key(len(key)))
        fp8[key + "_scale_inv"] = scale_inv
        tiles = mx.repeat(mx.repeat(scale_inv, 8, axis=0), 16, axis=1)[: raw[key].shape[0], : raw[key].shape[1]]
        fp8[key] = mx.to_fp8(raw[key] / tiles)
    got = model.sanitize(fp8)
    assert not any(k.endswith("_scale_inv") for k in got)
    q = "model.layers.1.self_attn.q_proj.weight"
    assert mx.array_equal(got[q], dequantize_fp8_blocks(fp8[q], fp8[q + "_scale_inv"], (8, 16)))
    want = model.sanitize(dict(raw))
    assert got.keys() == want.keys() and got[q].dtype == mx.bfloat16
    assert relative_error(got[q], want[q]) < 0.1  # e4m3 keeps 3 mantissa bits


def test_sanitize_reads_upstream_mlx_lm_layout():
    """upstream mlx-lm's conversion keeps the experts under `mlp.switch_mlp` and the
    sinks as `attention_sink_bias`."""
    model = fixture_model("mimo_v2_flash_tf4")
    ours = model.sanitize(dict(mx.load(str(FIXTURES / "mimo_v2_flash_tf4" / "model.safetensors"))))
    renames = ((".mlp.experts.", ".mlp.switch_mlp."), (".self_attn.sinks", ".self_attn.attention_sink_bias"))
    upstream = {}
    for key, value in ours.items():
        for old, new in renames:
            key = key.replace(old, new)
        upstream[key] = value
    got = model.sanitize(upstream)
    assert got.keys() == ours.keys() and all(mx.array_equal(got[k], ours[k]) for k in ours)
