"""gemma4_text.py: the shared family checks (family_checks.py) on the transformers
fixtures, plus what only Gemma 4 has: proportional rope and the expert router against
naive references, KV-shared layers rolled back with their source, global layers' own
head shapes (both config dialects), config errors, and sanitize (fused experts, the
multimodal layout).

Fixtures come from fixtures/make_gemma4_text_reference.py (sliding window 8, 40
tokens, the last 2 of 4 layers KV-shared): gemma4_text_tf4 (Gemma4ForCausalLM, hub
config keys, k = v global attention, experts, double-wide shared MLPs, soft-cap) and
gemma4_tf5 (Gemma4ForConditionalGeneration as transformers 5 saves it, per-layer
inputs).
"""

import mlx.core as mx
import numpy as np
import pytest
from checkpoints import VOCAB_SIZE
from family_checks import FIXTURES, Family, FamilyChecks, fixture_model, reference, relative_error
from mlx.utils import tree_flatten
from test_gemma3n import assert_rollback_reaches_readers

from mlx_lm.models.cache import KVCache, RotatingKVCache, SharedKVReader
from mlx_lm.models.gemma4_text import (
    FULL,
    SLIDING,
    ConditionalGeneration,
    LanguageModel,
    ModelArgs,
    Router,
    TextModelArgs,
    layer_rope,
    unfuse_experts,
)

SHAPE = dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16, global_head_dim=32,
             sliding_window=8, layer_types=[SLIDING, FULL, SLIDING, FULL], num_kv_shared_layers=2,
             rope_parameters={SLIDING: {"rope_type": "default", "rope_theta": 100.0},
                              FULL: {"rope_type": "proportional", "partial_rotary_factor": 0.25, "rope_theta": 1e4}})

FAMILY = Family(
    fixtures=["gemma4_text_tf4", "gemma4_tf5"],
    # Attention, MLP and expert units dominate each layer: a rank holds about half.
    tiny=dict(SHAPE, model_type="gemma4_text", num_hidden_layers=4, intermediate_size=256, attention_k_eq_v=True,
              num_global_key_value_heads=2, enable_moe_block=True, num_experts=4, top_k_experts=2,
              moe_intermediate_size=64, hidden_size_per_layer_input=8, vocab_size_per_layer_input=VOCAB_SIZE,
              vocab_size=VOCAB_SIZE, tie_word_embeddings=False, final_logit_softcapping=10.0, eos_token_id=0),
    small=dict(model_type="gemma4_text", hidden_size=32, intermediate_size=48, num_hidden_layers=3,
               num_attention_heads=2, num_key_value_heads=1, head_dim=16, global_head_dim=16, sliding_window=8,
               layer_types=[SLIDING, FULL, FULL], num_kv_shared_layers=1, hidden_size_per_layer_input=0,
               vocab_size=256),
    noise=0.2,  # at 0.05 the noisy draft of gemma4_tf5 is never rejected at k = 1
)


class TestGemma4Text(FamilyChecks):
    family = FAMILY


# --- rope, router -----------------------------------------------------------------------


def naive_proportional_rope(x, offset, head_dim, base, partial):
    """transformers' rotate_half rope with proportional inverse frequencies, in float64."""
    x = np.array(x, np.float64)
    angles = int(partial * head_dim // 2)
    inv_freq = np.zeros(head_dim // 2)
    inv_freq[:angles] = 1.0 / base ** (np.arange(0, 2 * angles, 2) / head_dim)
    positions = np.arange(offset, offset + x.shape[-2])[:, None]
    emb = np.concatenate([positions * inv_freq, positions * inv_freq], axis=-1)  # (L, D)
    rotated = np.concatenate([-x[..., head_dim // 2:], x[..., : head_dim // 2]], axis=-1)
    return x * np.cos(emb) + rotated * np.sin(emb)


@pytest.mark.parametrize("partial", [0.25, 0.5, 1.0])
def test_layer_rope_matches_transformers_formula(partial):
    x = mx.random.normal((1, 2, 7, 32), key=mx.random.key(0))
    for offset in (0, 13):
        got = layer_rope(32, 1e4, partial, 1.0)(x, offset=offset)
        want = naive_proportional_rope(x, offset, 32, 1e4, partial)
        assert np.allclose(np.array(got), want, atol=1e-5), (partial, offset)
    if partial < 1:  # the pairs past the rotated ones pass through
        unturned = int(partial * 16)
        assert mx.array_equal(got[..., unturned:16], x[..., unturned:16])


def test_router_matches_a_naive_loop():
    args = TextModelArgs.from_dict(dict(SHAPE, num_hidden_layers=4, enable_moe_block=True, num_experts=5,
                                        top_k_experts=2, moe_intermediate_size=16))
    router = Router(args)
    keys = mx.random.split(mx.random.key(3), 4)
    router.proj.weight = mx.random.normal(router.proj.weight.shape, key=keys[0])
    router.scale = 1 + 0.3 * mx.random.normal((64,), key=keys[1])
    router.per_expert_scale = 1 + 0.3 * mx.random.normal((5,), key=keys[2])
    x = mx.random.normal((2, 3, 64), key=keys[3])
    ids, weights = router(x)
    P, scale, per_expert = (np.array(a, np.float64) for a in (router.proj.weight, router.scale,
                                                             router.per_expert_scale))
    for token, (row_ids, row_weights) in enumerate(zip(np.array(ids).reshape(-1, 2), np.array(weights).reshape(-1, 2))):
        v = np.array(x, np.float64).reshape(-1, 64)[token]
        scores = P @ (v / np.sqrt(np.mean(v * v) + 1e-6) * scale / 8.0)
        probs = np.exp(scores - scores.max()) / np.exp(scores - scores.max()).sum()
        top = np.argsort(-probs)[:2]
        order = np.argsort(row_ids)
        assert sorted(row_ids) == sorted(top)
        want = probs[top] / probs[top].sum() * per_expert[top]
        assert np.allclose(row_weights[order], want[np.argsort(top)], atol=1e-5)


# --- KV sharing, layer shapes ---------------------------------------------------------------


def test_layers_caches_and_shapes():
    tf4 = fixture_model("gemma4_text_tf4")
    assert isinstance(tf4, LanguageModel)
    assert [layer.kv_source for layer in tf4.layers] == [None, None, 0, 1]
    assert [type(c) for c in tf4.make_cache()] == [RotatingKVCache, KVCache, SharedKVReader, SharedKVReader]
    assert [layer.self_attn.n_kv_heads for layer in tf4.layers] == [2, 1, 2, 1]  # k = v global: 1 KV head
    assert "v_proj" not in tf4.layers[1].self_attn and "v_proj" in tf4.layers[0].self_attn
    assert [layer.mlp.gate_proj.weight.shape[0] for layer in tf4.layers] == [64, 64, 128, 128]  # double-wide
    tf5 = fixture_model("gemma4_tf5")
    assert isinstance(tf5, ConditionalGeneration)
    assert tf5.args.text_args.head_dims == [16, 32, 16, 32] and tf5.args.text_args.kv_heads == [2, 2, 2, 2]


@pytest.mark.parametrize("name", ["gemma4_text_tf4", "gemma4_tf5"])
def test_rollback_of_the_source_is_seen_by_its_readers(name):
    assert_rollback_reaches_readers(fixture_model(name))


def test_layer_scalar_and_experts_matter():
    """The fixtures' layer scalars and experts are far from neutral."""
    model, (ids, want) = fixture_model("gemma4_text_tf4"), reference("gemma4_text_tf4")
    layer = model.layers[1]
    for name in ("layer_scalar", "per_expert_scale"):
        owner = layer if name == "layer_scalar" else layer.router
        original = owner[name]
        owner[name] = mx.ones_like(original)
        try:
            assert relative_error(model(ids), want) > 1e-3, name
        finally:
            owner[name] = original
    assert relative_error(model(ids), want) < 1e-4


# --- config -------------------------------------------------------------------------------

TEXT = dict(hidden_size=32, intermediate_size=48, num_hidden_layers=6, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, vocab_size=64)


def test_dialects_normalise_alike():
    hub = TextModelArgs.from_dict(dict(TEXT, global_head_dim=32, num_global_key_value_heads=1, attention_k_eq_v=True))
    tf5 = TextModelArgs.from_dict(dict(TEXT, attention_k_eq_v=True,
                                       per_layer_config={"5": {"head_dim": 32, "num_key_value_heads": 1}}))
    assert hub.layer_types == tf5.layer_types == [SLIDING] * 5 + [FULL]  # every sixth layer global
    assert hub.head_dims == tf5.head_dims == [16] * 5 + [32]
    assert hub.kv_heads == tf5.kv_heads == [2] * 5 + [1]
    assert hub.rope == tf5.rope
    assert hub.rope[FULL] == dict(head_dim=32, base=1e6, partial_rotary_factor=0.25, factor=1.0)  # the default
    untyped = TextModelArgs.from_dict(dict(TEXT, rope_parameters={
        FULL: {"rope_theta": 1e6, "partial_rotary_factor": 0.25}, SLIDING: {"rope_theta": 1e4}}))
    assert untyped.rope[FULL]["partial_rotary_factor"] == 1.0  # no rope_type: default rope, whole head (transformers)
    plain = TextModelArgs.from_dict(dict(TEXT, num_global_key_value_heads=1))
    assert plain.head_dims[-1] == 512 and plain.kv_heads[-1] == 2  # the KV-head override needs k = v


def test_both_model_types_read_their_configs():
    text = ModelArgs.from_dict(dict(TEXT, model_type="gemma4_text", tie_word_embeddings=False))
    assert not text.vision_language and not text.text_args.tie_word_embeddings
    nested = ModelArgs.from_dict({"model_type": "gemma4", "text_config": dict(TEXT), "vision_config": None})
    assert nested.vision_language and nested.text_args.tie_word_embeddings and nested.vocab_size == 64


def test_config_errors_name_the_value():
    cases = [
        ({"layer_types": [SLIDING] * 6}, "layer_types\\[-1\\] must be 'full_attention' .* got 'sliding_attention'"),
        ({"use_bidirectional_attention": "all"}, "use_bidirectional_attention='all'"),
        ({"enable_moe_block": True, "num_experts": 4}, "needs num_experts, top_k_experts and moe_intermediate_size; "
                                                        "got 4, None, None"),
        ({"per_layer_config": {"5": {"sliding_window": 4}}}, "per_layer_config may set"),
        ({"rope_parameters": {SLIDING: {"rope_type": "yarn", "rope_theta": 1.0}, FULL: {}}},
         "rope_parameters\\['sliding_attention'\\] must be a 'default' or 'proportional' rope"),
        ({"num_kv_shared_layers": 6}, "num_kv_shared_layers must be in \\[0, 6\\) for 6 layers, got 6"),
        ({"hidden_activation": "gelu"}, "hidden_activation 'gelu'"),
    ]
    for override, message in cases:
        with pytest.raises(ValueError, match=message):
            TextModelArgs.from_dict(dict(TEXT, **override))


# --- sanitize -------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["gemma4_text_tf4", "gemma4_tf5"])
def test_sanitize_converts_once(name):
    model = fixture_model(name)
    raw = mx.load(str(FIXTURES / name / "model.safetensors"))
    once = model.sanitize(raw)
    assert sorted(once) == sorted(k for k, _ in tree_flatten(model.parameters()))
    twice = model.sanitize(once)
    assert sorted(twice) == sorted(once) and all(mx.array_equal(twice[k], once[k]) for k in once)


def test_unfuse_experts_splits_gate_and_up():
    fused = mx.arange(2 * 6 * 3).reshape(2, 6, 3)  # (E, 2I, D): gate rows, then up rows
    out = unfuse_experts({"model.layers.0.experts.gate_up_proj": fused,
                          "model.layers.0.experts.down_proj": mx.zeros((2, 3, 3))})
    assert mx.array_equal(out["model.layers.0.experts.gate_proj.weight"], fused[:, :3])
    assert mx.array_equal(out["model.layers.0.experts.up_proj.weight"], fused[:, 3:])
    assert sorted(out) == ["model.layers.0.experts.down_proj.weight", "model.layers.0.experts.gate_proj.weight",
                           "model.layers.0.experts.up_proj.weight"]
