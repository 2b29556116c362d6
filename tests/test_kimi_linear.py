"""kimi_linear.py: the shared family checks (family_checks.py) on the transformers
fixtures, plus what only Kimi Linear has: the latent (absorbed) MLA against attention
over expanded keys and values, its latent KV cache, the group-limited router mattering
on the fixture, an lm_head that transformers never ties, the config dialects (hub
linear_attn_config and MoE key names vs transformers 5's), and sanitize over the saved
(hub) layout and the one transformers holds in memory. The KDA recurrence itself is
tested against the float64 loop in test_gated_delta.py.

Fixtures come from fixtures/make_kimi_linear_reference.py (40 tokens: KDA prefill crosses
its chunks of 16): kimi_linear_tf4 in the hub checkpoints' dialect (no q LoRA, one expert
group), kimi_linear_tf5 as transformers 5 saves it (q LoRA, 2 expert groups, tie flag set).
"""

import math

import mlx.core as mx
import numpy as np
import pytest
from checkpoints import VOCAB_SIZE
from family_checks import FIXTURES, PROMPT, Family, FamilyChecks, fixture_model, reference, relative_error

from mlx_lm.models.cache import ArraysCache, KVCache, QuantizedKVCache, make_prompt_cache
from mlx_lm.models.kimi_linear import ModelArgs
from mlx_lm.models.mla import LatentAttention, latent_attention
from mlx_lm.utils import load_model, quantize_model

L, F = "linear_attention", "full_attention"
SHAPE = dict(hidden_size=64, intermediate_size=64, moe_intermediate_size=32, num_hidden_layers=4,
             num_attention_heads=4, kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=8, v_head_dim=16,
             linear_num_heads=4, linear_head_dim=16, linear_conv_kernel_dim=4)

FAMILY = Family(
    fixtures=["kimi_linear_tf4", "kimi_linear_tf5"],
    tiny=dict(SHAPE, model_type="kimi_linear", vocab_size=VOCAB_SIZE, layer_types=[L, F, L, F],
              mlp_layer_types=["dense", "sparse", "sparse", "sparse"], num_experts=8, num_experts_per_token=2,
              num_expert_group=2, topk_group=1, q_lora_rank=32, eos_token_id=0),
    small=dict(model_type="kimi_linear", vocab_size=256, hidden_size=32, intermediate_size=48,
               moe_intermediate_size=16, num_hidden_layers=2, num_attention_heads=2, kv_lora_rank=8,
               qk_nope_head_dim=8, qk_rope_head_dim=8, v_head_dim=8, layer_types=[L, F], num_experts=4,
               num_experts_per_token=2, linear_attn_config={"num_heads": 1, "head_dim": 16}),
)


class TestKimiLinear(FamilyChecks):
    family = FAMILY


HUB = dict(SHAPE, model_type="kimi_linear", vocab_size=64, num_experts=6, num_experts_per_token=2,
           num_shared_experts=2, num_expert_group=2, topk_group=1, moe_renormalize=False, first_k_dense_replace=2,
           linear_attn_config={"kda_layers": [1, 2, 4], "full_attn_layers": [3], "num_heads": 2, "head_dim": 8,
                               "short_conv_kernel_size": 3})
for key in ("linear_num_heads", "linear_head_dim", "linear_conv_kernel_dim"):
    HUB.pop(key)
TF5 = dict(SHAPE, model_type="kimi_linear", vocab_size=64, num_local_experts=6, num_experts_per_tok=2,
           n_shared_experts=2, n_group=2, topk_group=1, norm_topk_prob=False, layer_types=[L, L, F, L],
           mlp_layer_types=["dense", "dense", "sparse", "sparse"], linear_num_heads=2, linear_head_dim=8,
           linear_conv_kernel_dim=3)


# --- what the fixtures exercise -------------------------------------------------------------


def test_fixtures_cover_both_query_paths_kinds_and_untied_heads():
    tf4, tf5 = fixture_model("kimi_linear_tf4"), fixture_model("kimi_linear_tf5")
    assert [type(c) for c in make_prompt_cache(tf4)] == [ArraysCache, ArraysCache, KVCache, ArraysCache]
    assert [type(c) for c in make_prompt_cache(tf5)] == [ArraysCache, KVCache, ArraysCache, KVCache]
    assert "q_proj" in tf4.layers[2].self_attn and "q_a_proj" in tf5.layers[1].self_attn
    assert (tf4.args.n_group, tf5.args.n_group, tf5.args.topk_group) == (1, 2, 1)
    # tf5's config says tie_word_embeddings, yet transformers keeps (and uses) its own head.
    raw = mx.load(str(FIXTURES / "kimi_linear_tf5" / "model.safetensors"))
    assert not mx.array_equal(raw["lm_head.weight"], raw["model.embed_tokens.weight"])
    assert mx.array_equal(tf5.lm_head.weight, raw["lm_head.weight"])


def test_fixture_decays_differ_across_channels():
    """The per-channel decay spreads within a head on the fixture (not a scalar gate)."""
    model = fixture_model("kimi_linear_tf4")
    attn = model.layers[0].self_attn
    h = model.layers[0].input_layernorm(model.model.embed_tokens(PROMPT[None]))
    g = attn.inputs(h, mx.zeros((1, PROMPT.size, 3 * attn.qkv_dim)))[3]  # (1, T, H, Dk)
    spread = (g.max(axis=-1) - g.min(axis=-1)).mean().item()
    assert spread > 0.1 and g.min().item() > 0 and g.max().item() <= 1


def test_group_limited_routing_matters_on_the_fixture():
    model, (ids, want) = fixture_model("kimi_linear_tf5"), reference("kimi_linear_tf5")
    try:
        model.args.topk_group = 2  # every group allowed: other experts win
        assert relative_error(model(ids), want) > 1e-3
    finally:
        model.args.topk_group = 1
    assert relative_error(model(ids), want) < FAMILY.tolerance


# --- latent attention -----------------------------------------------------------------------


def expanded_attention(attn: LatentAttention, x: np.ndarray) -> np.ndarray:
    """transformers' MLA in float64: per-head keys [W_k c, k_rot], values W_v c, causal softmax."""
    H, dn, dv, r = attn.num_heads, attn.nope_dim, attn.v_dim, attn.kv_lora_rank
    B, T, _ = x.shape
    q = np.array(attn.queries(mx.array(x.astype(np.float32))), dtype=np.float64)  # (B, H, T, dn + dr)
    kv = x @ np.array(attn.kv_a_proj_with_mqa.weight, dtype=np.float64).T
    c, k_rot = kv[..., :r], kv[..., r:]
    c = c / np.sqrt((c**2).mean(-1, keepdims=True) + 1e-6) * np.array(attn.kv_a_layernorm.weight, dtype=np.float64)
    kv_b = (c @ np.array(attn.kv_b_proj.weight, dtype=np.float64).T).reshape(B, T, H, dn + dv).transpose(0, 2, 1, 3)
    keys = np.concatenate([kv_b[..., :dn], np.broadcast_to(k_rot[:, None], (B, H, T, k_rot.shape[-1]))], axis=-1)
    scores = q @ keys.swapaxes(-1, -2) / math.sqrt(q.shape[-1]) + np.triu(np.full((T, T), -np.inf), 1)
    p = np.exp(scores - scores.max(-1, keepdims=True))
    out = (p / p.sum(-1, keepdims=True)) @ kv_b[..., dn:]  # (B, H, T, dv)
    return out.transpose(0, 2, 1, 3).reshape(B, T, -1) @ np.array(attn.o_proj.weight, dtype=np.float64).T


@pytest.mark.parametrize("name,layer", [("kimi_linear_tf4", 2), ("kimi_linear_tf5", 1)])
def test_latent_attention_equals_expanded_keys_and_values(name, layer):
    attn = fixture_model(name).layers[layer].self_attn
    x = np.random.default_rng(5).standard_normal((2, 11, 64))
    want = expanded_attention(attn, x)
    assert relative_error(attn(mx.array(x.astype(np.float32)), "causal"), mx.array(want.astype(np.float32))) < 1e-5
    # The same through the latent cache, in pieces.
    cache, pieces = KVCache(), []
    for start, stop in ((0, 4), (4, 5), (5, 11)):
        piece = mx.array(x[:, start:stop].astype(np.float32))
        pieces.append(attn(piece, cache.make_mask(stop - start), cache))
    assert relative_error(mx.concatenate(pieces, axis=1), mx.array(want.astype(np.float32))) < 1e-5


def test_the_cache_holds_the_latent_not_expanded_keys():
    model = fixture_model("kimi_linear_tf4")
    cache = make_prompt_cache(model)
    model(PROMPT[None], cache=cache)
    latent, k_rot = cache[2].state
    assert latent.shape == (1, 1, PROMPT.size, model.args.kv_lora_rank)
    assert k_rot.shape == (1, 1, PROMPT.size, model.args.qk_rope_head_dim)


def test_latent_attention_one_query_over_the_latents():
    """A single decode query: the absorbed form against its definition, by hand."""
    rng = np.random.default_rng(6)
    H, r, dr, dv, S = 3, 5, 2, 4, 7
    q_lat, q_rot = rng.standard_normal((1, H, 1, r)), rng.standard_normal((1, H, 1, dr))
    c, k_rot, w_v = rng.standard_normal((1, 1, S, r)), rng.standard_normal((1, 1, S, dr)), rng.standard_normal((H, dv, r))
    got = latent_attention(*(mx.array(t.astype(np.float32)) for t in (q_lat, q_rot, c, k_rot, w_v)), 0.5, None)
    scores = 0.5 * (q_lat @ c.swapaxes(-1, -2) + q_rot @ k_rot.swapaxes(-1, -2))  # (1, H, 1, S)
    p = np.exp(scores) / np.exp(scores).sum(-1, keepdims=True)
    want = (p @ c) @ w_v.swapaxes(-1, -2)
    assert relative_error(got, mx.array(want.astype(np.float32))) < 1e-6


def test_quantization_keeps_kv_b_proj_float_and_refuses_a_quantized_cache():
    model, config = load_model(FIXTURES / "kimi_linear_tf4")
    quantize_model(model, config, 32, 8)
    attn = model.layers[2].self_attn
    assert "scales" not in attn.kv_b_proj and "scales" in attn.o_proj
    assert mx.isfinite(model(PROMPT[None])).all().item()
    with pytest.raises(ValueError, match="quantized KV cache"):
        attn(mx.zeros((1, 2, 64)), None, QuantizedKVCache(group_size=32, bits=8))


# --- config ---------------------------------------------------------------------------------


def test_dialects_normalise_alike():
    hub, tf5 = ModelArgs.from_dict(HUB), ModelArgs.from_dict(TF5)
    for field in ("layer_types", "mlp_layer_types", "num_local_experts", "num_experts_per_tok", "n_shared_experts",
                  "n_group", "topk_group", "norm_topk_prob", "linear_num_heads", "linear_head_dim",
                  "linear_conv_kernel_dim"):
        assert getattr(hub, field) == getattr(tf5, field), field
    assert hub.layer_types == [L, L, F, L] and hub.mlp_layer_types == ["dense", "dense", "sparse", "sparse"]
    assert (hub.num_experts, hub.moe_renormalize) == (6, False)  # both spellings read the same
    again = ModelArgs.from_dict(vars(hub))  # normalised args read back the same
    assert again.layer_types == hub.layer_types and again.num_local_experts == 6


def test_transformers_defaults():
    args = ModelArgs.from_dict(dict(model_type="kimi_linear", vocab_size=64, hidden_size=32, num_hidden_layers=6,
                                    num_attention_heads=2))
    assert args.layer_types == [L, L, L, L, F, L]  # every 4th after the first
    assert args.mlp_layer_types == ["dense"] + ["sparse"] * 5  # first_k_dense_replace 1
    assert (args.num_local_experts, args.num_experts_per_tok, args.n_shared_experts, args.n_group) == (256, 8, 1, 1)
    assert (args.linear_num_heads, args.linear_head_dim, args.linear_conv_kernel_dim) == (32, 128, 4)
    assert args.norm_topk_prob and args.q_lora_rank is None and args.num_key_value_heads == 2


@pytest.mark.parametrize("extra, message", [
    (dict(layer_types=[L, "mamba", F, L]), "unknown kinds \\['mamba'\\]"),
    (dict(layer_types=[L, F]), "layer_types has 2 entries but num_hidden_layers is 4"),
    (dict(mlp_layer_types=["dense", "moe", "sparse", "sparse"]), "mlp_layer_types \\['dense', 'moe'"),
    (dict(hidden_act="gelu"), "hidden_act 'gelu' is not supported"),
    (dict(mla_use_nope=False), "mla_use_nope False"),
    (dict(num_key_value_heads=2), "num_key_value_heads \\(2\\) must equal num_attention_heads \\(4\\)"),
    (dict(linear_conv_kernel_dim=1), "linear_conv_kernel_dim must be >= 2, got 1"),
    (dict(num_experts=8), "num_local_experts \\(6\\) and num_experts \\(8\\) disagree"),
    (dict(n_group=4), "num_local_experts \\(6\\) is not divisible by n_group \\(4\\)"),
    (dict(topk_group=3), "topk_group \\(3\\) must be in 1..n_group \\(2\\)"),
    (dict(num_experts_per_tok=4), "num_experts_per_tok \\(4\\) must be in 1..3"),
    (dict(linear_attn_config={"kda_layers": [1, 2, 5], "full_attn_layers": [3]}), "names layer 5"),
    (dict(linear_attn_config={"kda_layers": [1, 2], "full_attn_layers": [3]}), "leaves layer 4 without a kind"),
])
def test_config_errors_name_the_value(extra, message):
    config = dict(TF5, **extra)
    if "linear_attn_config" in extra:
        config.pop("layer_types")
    with pytest.raises(ValueError, match=message):
        ModelArgs.from_dict(config)


# --- weights --------------------------------------------------------------------------------


def assert_same(a, b):
    assert a.keys() == b.keys()
    for k in a:
        assert a[k].shape == b[k].shape and mx.array_equal(a[k], b[k]), k


def in_memory_layout(raw):
    """What transformers holds after loading (its conversion_mapping): mlp.*, forget_gate.*,
    one conv1d (C, 1, K), fused experts gate_up_proj (E, 2I, H) and down_proj (E, H, I)."""
    out = {}
    for key, value in raw.items():
        key = key.replace(".block_sparse_moe.", ".mlp.")
        for name in ("f_a_proj", "f_b_proj", "dt_bias", "A_log"):
            key = key.replace(f".self_attn.{name}", f".self_attn.forget_gate.{name}")
        out[key] = value
    for key in [k for k in out if k.endswith("q_conv1d.weight")]:
        prefix = key[: -len("q_conv1d.weight")]
        out[prefix + "conv1d.weight"] = mx.concatenate([out.pop(f"{prefix}{n}_conv1d.weight") for n in "qkv"])
    for key in [k for k in out if k.endswith(".experts.0.w1.weight")]:
        prefix = key[: -len("0.w1.weight")]
        count = sum(1 for k in out if k.startswith(prefix) and k.endswith(".w1.weight"))
        pop = lambda w: [out.pop(f"{prefix}{e}.{w}.weight") for e in range(count)]  # noqa: E731
        gate, down, up = pop("w1"), pop("w2"), pop("w3")
        out[prefix + "gate_up_proj"] = mx.concatenate([mx.stack(gate), mx.stack(up)], axis=1)
        out[prefix + "down_proj"] = mx.stack(down)
    return out


@pytest.mark.parametrize("name", FAMILY.fixtures)
def test_sanitize_converts_each_hf_layout_once(name, tmp_path):
    model, raw = fixture_model(name), mx.load(str(FIXTURES / name / "model.safetensors"))
    once = model.sanitize(raw)
    assert_same(model.sanitize(dict(once)), once)
    assert_same(model.sanitize(in_memory_layout(raw)), once)
    prefix = "model.layers.0.self_attn."
    conv = once[prefix + "conv1d.weight"]
    pieces = [raw[f"{prefix}{n}_conv1d.weight"] for n in "qkv"]
    assert conv.shape == (3 * pieces[0].shape[0], 4, 1)
    assert mx.array_equal(conv[:, :, 0], mx.concatenate(pieces)[:, 0])
    assert raw[prefix + "A_log"].shape == (1, 1, 2, 1) and once[prefix + "A_log"].shape == (2,)
    assert not any("block_sparse_moe" in k or "_conv1d" in k or ".experts." in k for k in once)
    # Saved in the MLX layout, the weights load to the same logits.
    mx.save_safetensors(str(tmp_path / "model.safetensors"), once)
    (tmp_path / "config.json").write_text((FIXTURES / name / "config.json").read_text())
    ids, want = reference(name)
    assert relative_error(load_model(tmp_path)[0](ids), want) < FAMILY.tolerance
