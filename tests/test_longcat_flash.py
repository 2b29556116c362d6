"""longcat_flash.py (LongCat-Flash): the shared family checks (family_checks.py) on the
transformers fixtures, plus what only this family has: the MoE with zero experts against
a naive per-token loop, zero experts being chosen on the fixtures, the LoRA scales
mattering, the two-block layer's caches, the layer-count and config dialects and
errors, and sanitize on every layout (the zero experts' unused rows dropped). The latent
attention itself is mla.py's (test_mla.py, test_minicpm3.py). Two-rank sharding of
FAMILY.tiny is in test_distributed.py.

Fixtures come from fixtures/make_longcat_flash_reference.py: longcat_flash_tf4 (hub
dialect, 4 + 2 zero experts, top 3, scaling 6, untied) and longcat_flash_tf5 (as
transformers 5 saves it: 4 + 4 zero experts, scaling 1.5, biases, tied).
"""

import mlx.core as mx
import numpy as np
import pytest
from checkpoints import VOCAB_SIZE
from family_checks import FIXTURES, PROMPT, Family, FamilyChecks, fixture_model, reference, relative_error
from moe_checks import assert_sanitize_layouts, fused_mlp_experts, naive_moe, np_softmax, relative
from sliding_checks import assert_override_matters

from mlx_lm.models.cache import CacheList, KVCache, make_prompt_cache
from mlx_lm.models.longcat_flash import ModelArgs
from mlx_lm.utils import load_model, quantize_model

MLA = dict(num_attention_heads=4, qk_nope_head_dim=8, qk_rope_head_dim=8, v_head_dim=8)
FAMILY = Family(
    fixtures=["longcat_flash_tf4", "longcat_flash_tf5"],
    tiny=dict(MLA, model_type="longcat_flash", hidden_size=64, num_layers=2, ffn_hidden_size=128, q_lora_rank=16,
              kv_lora_rank=16, n_routed_experts=4, zero_expert_num=2, moe_topk=2, expert_ffn_hidden_size=32,
              routed_scaling_factor=2.0, vocab_size=VOCAB_SIZE, eos_token_id=0),
    small=dict(MLA, model_type="longcat_flash", hidden_size=32, num_layers=1, num_attention_heads=2, ffn_hidden_size=48,
               q_lora_rank=16, kv_lora_rank=16, n_routed_experts=2, zero_expert_num=1, moe_topk=2,
               expert_ffn_hidden_size=16, vocab_size=256),
)
ARGS = dict(MLA, model_type="longcat_flash", vocab_size=256, hidden_size=64, num_layers=2, ffn_hidden_size=48,
            q_lora_rank=16, kv_lora_rank=16, n_routed_experts=4, zero_expert_num=2, moe_topk=3,
            expert_ffn_hidden_size=16)


class TestLongcatFlash(FamilyChecks):
    family = FAMILY


# --- the MoE --------------------------------------------------------------------------------


def zero_expert_router(block):
    """transformers' LongcatFlashTopkRouter for naive_moe, float64: softmax over real and
    zero experts, the k best p + bias, weighted by p times routed_scaling_factor; the
    zero experts' (id, weight) pairs come back separately."""
    weight = np.array(block.router.classifier.weight, dtype=np.float64)
    bias = np.array(block.router.e_score_correction_bias, dtype=np.float64)

    def choose(x):
        p = np_softmax(weight @ x)
        best = np.argsort(-(p + bias))[: block.top_k]
        return [(int(e), p[e] * block.scaling) for e in best]

    return choose


@pytest.mark.parametrize("name", FAMILY.fixtures)
def test_moe_with_zero_experts_equals_a_naive_loop(name):
    """Routed experts by the naive loop, plus weight * x for every chosen zero expert;
    on the fixture's inputs the zero experts are chosen often."""
    block = fixture_model(name).layers[1].mlp
    x = mx.random.normal((2, 5, 64), key=mx.random.key(0))
    choose = zero_expert_router(block)
    s = block.switch_mlp
    real = lambda token: [(e, w) for e, w in choose(token) if e < block.num_real]  # noqa: E731
    want = naive_moe(x, real, s.gate_proj.weight, s.up_proj.weight, s.down_proj.weight)
    xs = np.array(x, dtype=np.float64)
    num_zero = 0
    for b, t in np.ndindex(2, 5):
        for e, w in choose(xs[b, t]):
            if e >= block.num_real:
                want[b, t] += w * xs[b, t]
                num_zero += 1
    assert relative(block(x), want) < 1e-5
    assert 0 < num_zero < 2 * 5 * block.top_k, num_zero  # both kinds of expert are chosen


def test_the_router_bias_and_lora_scales_matter():
    for override in ({"mla_scale_q_lora": False}, {"mla_scale_kv_lora": False}, {"routed_scaling_factor": 1.0}):
        assert_override_matters("longcat_flash_tf4", override)
    model = fixture_model("longcat_flash_tf5")
    ids, want = reference("longcat_flash_tf5")
    saved = [layer.mlp.router.e_score_correction_bias for layer in model.layers]
    try:
        for layer in model.layers:
            layer.mlp.router.e_score_correction_bias = mx.zeros_like(layer.mlp.router.e_score_correction_bias)
        assert relative_error(model(ids), want) > 1e-2
    finally:
        for layer, bias in zip(model.layers, saved):
            layer.mlp.router.e_score_correction_bias = bias
    assert relative_error(model(ids), want) < FAMILY.tolerance


# --- caches and quantization ----------------------------------------------------------------


def test_each_layer_caches_two_latents():
    model = fixture_model("longcat_flash_tf4")
    cache = make_prompt_cache(model)
    assert len(cache) == len(model.layers) == 2 and all(type(c) is CacheList for c in cache)
    model(PROMPT[None], cache=cache)
    for block in cache[1].caches:
        assert type(block) is KVCache
        latent, k_rot = block.state
        assert latent.shape == (1, 1, PROMPT.size, 16) and k_rot.shape == (1, 1, PROMPT.size, 8)
    assert not mx.array_equal(cache[1][0].state[0], cache[1][1].state[0])  # each block its own latent


def test_quantization_keeps_kv_b_proj_and_the_router_float():
    model, config = load_model(FIXTURES / "longcat_flash_tf4")
    quantize_model(model, config, 32, 8)
    layer = model.layers[0]
    assert "scales" not in layer.self_attn[1].kv_b_proj and "scales" not in layer.mlp.router.classifier
    assert "scales" in layer.self_attn[1].q_a_proj and "scales" in layer.mlps[0].gate_proj
    assert mx.isfinite(model(PROMPT[None])).all().item()


# --- config ---------------------------------------------------------------------------------


def test_config_dialects_give_the_same_args():
    hub = ModelArgs.from_dict(dict(ARGS, rope_theta=500.0, attention_method="MLA", zero_expert_type="identity",
                                   mla_scale_q_lora=True, mla_scale_kv_lora=True, router_bias=False))
    tf5 = ModelArgs.from_dict(dict(ARGS, rope_parameters={"rope_type": "default", "rope_theta": 500.0},
                                   head_dim=8, qk_head_dim=16))
    for field in ("rope_theta", "rope_scaling", "num_layers", "num_hidden_layers", "head_dim", "qk_head_dim"):
        assert getattr(hub, field) == getattr(tf5, field), field
    by_blocks = ModelArgs.from_dict(dict({k: v for k, v in ARGS.items() if k != "num_layers"}, num_hidden_layers=4))
    assert (by_blocks.num_layers, by_blocks.num_hidden_layers) == (2, 4)  # transformers' num_hidden_layers // 2


def test_transformers_defaults():
    args = ModelArgs.from_dict({"model_type": "longcat_flash"})  # LongCat-Flash-Chat's shape
    assert (args.num_layers, args.num_hidden_layers, args.rope_theta) == (28, 56, 1e7)
    experts = (args.n_routed_experts, args.zero_expert_num, args.moe_topk, args.routed_scaling_factor)
    assert experts == (512, 256, 12, 6.0)
    assert args.head_dim == 64 and args.qk_head_dim == 192 and not args.tie_word_embeddings
    assert ModelArgs.from_dict(dict(ARGS, zero_expert_num=None)).zero_expert_num == 0


@pytest.mark.parametrize("override, message", [
    ({"num_hidden_layers": 6}, r"num_hidden_layers \(6\) and num_layers \(2\) disagree"),
    ({"num_layers": None, "num_hidden_layers": 3}, r"num_hidden_layers \(3\) must be even"),
    ({"head_dim": 16}, r"head_dim \(16\) must be 8"),
    ({"qk_head_dim": 12}, r"qk_head_dim \(12\) must be 16"),
    ({"num_key_value_heads": 2}, r"num_key_value_heads \(2\) must equal num_attention_heads \(4\)"),
    ({"attention_method": "MHA"}, "attention_method 'MHA' is not supported"),
    ({"zero_expert_type": "zero"}, "zero_expert_type 'zero' is not supported"),
    ({"router_bias": True}, "router_bias True is not supported"),
    ({"q_lora_rank": None}, "q_lora_rank must be a positive int"),
    ({"moe_topk": 7}, r"moe_topk \(7\) must be in 1..n_routed_experts \+ zero_expert_num \(6\)"),
    ({"n_routed_experts": 0}, "n_routed_experts must be >= 1, got 0"),
])
def test_config_errors_name_the_value(override, message):
    with pytest.raises(ValueError, match=message):
        ModelArgs.from_dict(dict(ARGS, **override))


# --- weights --------------------------------------------------------------------------------


def test_sanitize_takes_every_layout_once():
    """transformers' save (with the zero experts' unused gate/up rows), its in-memory
    fused layout ((E + Z, 2I, H) gate_up_proj) and ours; MTP weights dropped."""
    raw = mx.load(str(FIXTURES / "longcat_flash_tf4" / "model.safetensors"))
    assert "model.layers.0.mlp.experts.5.gate_proj.weight" in raw  # a zero expert's rows, as transformers saves
    assert "model.layers.0.mlp.experts.5.down_proj.weight" not in raw
    assert_sanitize_layouts(FAMILY.fixtures, fused_mlp_experts)
    model = fixture_model("longcat_flash_tf4")
    with_mtp = dict(raw, **{"model.mtp.layers.0.eh_proj.weight": mx.zeros((64, 128))})
    assert sorted(model.sanitize(with_mtp)) == sorted(model.sanitize(dict(raw)))


def test_sanitize_joins_upstream_mlx_lms_split_kv_b_proj():
    """Upstream mlx-lm converts each block's kv_b_proj into embed_q (H, r, dn) and
    unembed_out (H, dv, r): joined back (deepseek_v3.join_absorbed_kv_b_proj)."""
    model = fixture_model("longcat_flash_tf4")
    ours = model.sanitize(dict(mx.load(str(FIXTURES / "longcat_flash_tf4" / "model.safetensors"))))
    upstream = dict(ours)
    for layer, block in np.ndindex(2, 2):
        prefix = f"model.layers.{layer}.self_attn.{block}."
        w = upstream.pop(prefix + "kv_b_proj.weight").reshape(4, 8 + 8, 16)  # (H, dn + dv, r)
        upstream[prefix + "embed_q.weight"] = mx.contiguous(w[:, :8].swapaxes(-1, -2))  # (H, r, dn)
        upstream[prefix + "unembed_out.weight"] = w[:, 8:]  # (H, dv, r)
    got = model.sanitize(upstream)
    assert sorted(got) == sorted(ours) and all(mx.array_equal(got[k], ours[k]) for k in ours)
