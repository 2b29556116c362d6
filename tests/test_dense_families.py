"""The dense families of issue 34 group 3 (part 1): gemma, phi, olmo2, granite, smollm3,
internlm3, starcoder2, cohere, stablelm, helium. One table (FAMILIES) drives the shared
family checks (family_checks.py: logits against transformers, rollback, speculation,
batching, the quantized round trip, prompt-cache files) for each family; two-rank
sharding of every `tiny` config is in test_distributed.py, which reads FAMILIES.

Beside them, what only some of these families have: the rope kinds (partial
rotate-half, interleaved) and the per-head LayerNorm against naive formulas, that the
fixtures depend on each family's quirks (multipliers, NoPE layers, windows, logit scale),
the transformers-4 and -5 config dialects, errors that name the value, and sanitize
(idempotent; StableLM's per-head norms stacked once).

Fixtures come from fixtures/make_dense_families_reference.py, which lists what each
<family>_tf4 (hub dialect) and <family>_tf5 (as transformers 5 saves it) covers.
"""

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from checkpoints import VOCAB_SIZE
from family_checks import FIXTURES, Family, FamilyChecks, fixture_model
from sliding_checks import assert_override_matters, assert_sanitize_is_idempotent

from mlx_lm.models.cohere import head_layer_norm
from mlx_lm.models.granitemoehybrid import NoPositions
from mlx_lm.models.rope_utils import resolve_whole_head_rope
from mlx_lm.utils import get_model_classes, quantize_model

TINY = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            vocab_size=VOCAB_SIZE, eos_token_id=0)
SMALL = dict(hidden_size=32, intermediate_size=48, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
             vocab_size=256)
# (model_type, test class name, what its tiny and small configs add: each family's
# features, so sharding and the same-family draft meet them).
TABLE = [
    ("gemma", "TestGemma", dict(head_dim=16, tie_word_embeddings=False)),
    ("phi", "TestPhi", dict(qk_layernorm=True, partial_rotary_factor=0.5)),
    ("olmo2", "TestOlmo2", dict(attention_bias=True)),
    ("granite", "TestGranite", dict(embedding_multiplier=6.0, attention_multiplier=0.2, residual_multiplier=0.5,
                                    logits_scaling=4.0)),
    ("smollm3", "TestSmolLM3", dict(no_rope_layer_interval=2)),
    ("internlm3", "TestInternLM3", dict(head_dim=16, qkv_bias=True, bias=True)),
    ("starcoder2", "TestStarcoder2", dict(sliding_window=8)),
    ("cohere", "TestCohere", dict(use_qk_norm=True, logit_scale=0.5)),
    ("stablelm", "TestStableLm", dict(qk_layernorm=True, use_qkv_bias=True, partial_rotary_factor=0.5)),
    ("helium", "TestHelium", dict(head_dim=16, attention_bias=True)),
]
FAMILIES = {
    name: Family(fixtures=[f"{name}_tf4", f"{name}_tf5"], tiny=dict(TINY, model_type=name, **extra),
                 small=dict(SMALL, model_type=name, **extra))
    for name, _, extra in TABLE
}
# One FamilyChecks subclass per family (`class TestGemma(FamilyChecks): family = ...`),
# which pytest collects from the module's names.
for _name, _class_name, _ in TABLE:
    globals()[_class_name] = type(_class_name, (FamilyChecks,), {"family": FAMILIES[_name]})


def args_of(config):
    return get_model_classes(config)[1].from_dict(config)


# --- the math: rope kinds and per-head LayerNorm against naive formulas -------------


def np_rope(x: np.ndarray, offset: int, rotary_dims: int, base: float, interleaved: bool) -> np.ndarray:
    """transformers' rope on the first rotary_dims features of x (..., L, D): frequency i
    = base^(-2i / rotary_dims) turns the pair (x[i], x[i + rotary_dims/2]) (rotate_half:
    phi, stablelm) or (x[2i], x[2i+1]) (interleaved: cohere, helium); the rest pass."""
    half = rotary_dims // 2
    angles = (offset + np.arange(x.shape[-2]))[:, None] / base ** (np.arange(half) * 2 / rotary_dims)
    cos, sin = np.cos(angles), np.sin(angles)
    first, second = (slice(0, rotary_dims, 2), slice(1, rotary_dims, 2)) if interleaved else (
        slice(0, half), slice(half, rotary_dims))
    out = x.copy()
    out[..., first] = x[..., first] * cos - x[..., second] * sin
    out[..., second] = x[..., second] * cos + x[..., first] * sin
    return out


@pytest.mark.parametrize("name, rotary_dims, interleaved", [
    ("phi_tf4", 6, False), ("phi_tf5", 12, False), ("stablelm_tf4", 4, False), ("stablelm_tf5", 8, False),
    ("cohere_tf4", 16, True), ("helium_tf5", 16, True), ("gemma_tf5", 24, False),
])
def test_rope_matches_transformers_formula(name, rotary_dims, interleaved):
    model = fixture_model(name)
    attn = model.layers[0].self_attn
    head_dim = attn.q_proj.weight.shape[0] // attn.n_heads
    x = mx.random.normal((1, 2, 6, head_dim), key=mx.random.key(0))
    want = np_rope(np.array(x, dtype=np.float64), 5, rotary_dims, model.args.rope_theta, interleaved)
    assert np.allclose(np.array(attn.rope(x, offset=5)), want, atol=1e-5), name


def test_head_layer_norm_matches_a_loop_over_heads():
    """Each head (its own weights, no bias) normalised over its D features, as
    transformers' CohereLayerNorm((H, D)) and StableLmLayerNormPerHead do."""
    x = mx.random.normal((2, 3, 4, 8), key=mx.random.key(1)) * 3 + 1  # (B, L, H, D)
    weight = mx.random.normal((4, 8), key=mx.random.key(2))
    xs, ws = np.array(x, dtype=np.float64), np.array(weight, dtype=np.float64)
    want = np.empty_like(xs)
    for h in range(4):
        head = xs[:, :, h]
        centred = head - head.mean(-1, keepdims=True)
        want[:, :, h] = centred / np.sqrt((centred**2).mean(-1, keepdims=True) + 1e-5) * ws[h]
    assert np.allclose(np.array(head_layer_norm(x, weight, 1e-5)), want, atol=1e-5)


# --- each family's quirks are exercised by its fixtures -------------------------------


@pytest.mark.parametrize("name, override", [
    ("phi_tf4", {"partial_rotary_factor": 1.0}), ("stablelm_tf4", {"partial_rotary_factor": 0.5}),
    ("granite_tf4", {"embedding_multiplier": 1.0}), ("granite_tf4", {"attention_multiplier": 0.25}),
    ("granite_tf4", {"residual_multiplier": 1.0}), ("granite_tf4", {"logits_scaling": 1.0}),
    ("smollm3_tf4", {"no_rope_layer_interval": 4}), ("smollm3_tf5", {"no_rope_layers": [1, 1]}),
    ("smollm3_tf5", {"layer_types": ["full_attention"] * 2}), ("starcoder2_tf5", {"sliding_window": None}),
    ("cohere_tf4", {"logit_scale": 0.5}), ("cohere_tf4", {"rope_theta": 500.0}),
    ("helium_tf4", {"rope_theta": 500.0}), ("internlm3_tf4", {"rope_theta": 500.0}),
])
def test_fixtures_exercise_the_family_quirks(name, override):
    assert_override_matters(name, override)


def test_layer_kinds_and_caches():
    """NoPE layers drop rope (smollm3: the interval's and the list's, the list's sliding);
    starcoder2 slides everywhere or nowhere; the rest are global KV caches."""
    kinds = {}
    for name in ("smollm3_tf4", "smollm3_tf5", "starcoder2_tf4", "starcoder2_tf5", "olmo2_tf4", "cohere_tf4"):
        model = fixture_model(name)
        kinds[name] = [(isinstance(layer.self_attn.rope, NoPositions), type(cache).__name__)
                       for layer, cache in zip(model.layers, model.make_cache())]
    assert kinds["smollm3_tf4"] == [(False, "KVCache"), (True, "KVCache")]
    assert kinds["smollm3_tf5"] == [(True, "RotatingKVCache"), (False, "KVCache")]
    assert kinds["starcoder2_tf4"] == [(False, "KVCache")] * 2
    assert kinds["starcoder2_tf5"] == [(False, "RotatingKVCache")] * 2
    assert kinds["olmo2_tf4"] == kinds["cohere_tf4"] == [(False, "KVCache")] * 2
    assert fixture_model("starcoder2_tf5").make_cache()[0].max_size == 8


def test_weights_take_the_family_layouts():
    """Phi's tied head keeps its bias; Command R's per-head q/k norms are (H, D); OLMo 2's
    span the whole projection; Helium's o_proj has no bias, its q/k/v do."""
    tied_phi = fixture_model("phi_tf4")
    assert "weight" not in tied_phi.lm_head and tied_phi.lm_head.bias.shape == (256,)
    assert "bias" in fixture_model("phi_tf5").lm_head
    cohere_attn = fixture_model("cohere_tf4").layers[0].self_attn
    assert (cohere_attn.q_norm.weight.shape, cohere_attn.k_norm.weight.shape) == ((4, 16), (2, 16))
    olmo2_attn = fixture_model("olmo2_tf4").layers[0].self_attn
    assert (olmo2_attn.q_norm.weight.shape, olmo2_attn.k_norm.weight.shape) == ((64,), (32,))
    helium_attn = fixture_model("helium_tf4").layers[0].self_attn
    assert "bias" in helium_attn.q_proj and "bias" not in helium_attn.o_proj


def test_stablelm_sanitize_stacks_per_head_norms_once():
    model = fixture_model("stablelm_tf4")
    raw = mx.load(str(FIXTURES / "stablelm_tf4" / "model.safetensors"))
    prefix = "model.layers.1.self_attn."
    heads = [raw[f"{prefix}k_layernorm.norms.{h}.weight"] for h in range(2)]
    once = model.sanitize(raw)
    assert not any(".norms." in k for k in once)
    assert mx.array_equal(once[prefix + "k_norm.weight"], mx.stack(heads))  # (H_kv, D)
    again = model.sanitize(dict(once))
    assert again.keys() == once.keys() and all(mx.array_equal(again[k], once[k]) for k in once)


@pytest.mark.parametrize("name", list(FAMILIES))
def test_sanitize_is_idempotent_and_drops_what_we_compute(name):
    assert_sanitize_is_idempotent(FAMILIES[name].fixtures)


def test_granite_keeps_its_small_output_projections_at_8_bits():
    config = dict(FAMILIES["granite"].tiny, tie_word_embeddings=False)
    model = get_model_classes(config)[0](args_of(config))
    quantize_model(model, config, group_size=32, bits=4)
    layer = model.layers[0]
    for quantized, bits in ((layer.self_attn.o_proj, 8), (layer.mlp.down_proj, 8), (model.lm_head, 8),
                            (layer.self_attn.q_proj, 4), (layer.mlp.up_proj, 4)):
        assert isinstance(quantized, nn.QuantizedLinear) and quantized.bits == bits


# --- config dialects and errors -------------------------------------------------------

BASE = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            vocab_size=256)
ROPE5 = {"rope_type": "default", "rope_theta": 5000.0}
# Per family: (transformers-4 keys, transformers-5 keys, the fields that must agree).
DIALECTS = {
    "gemma": ({"rope_theta": 5000.0, "hidden_act": "gelu"}, {"rope_parameters": ROPE5}, ["rope_theta", "head_dim"]),
    "phi": ({"rope_theta": 5000.0, "partial_rotary_factor": 0.4},
            {"rope_parameters": dict(ROPE5, partial_rotary_factor=0.4)}, ["rope_theta", "rotary_dims"]),
    "olmo2": ({"rope_theta": 5000.0}, {"rope_parameters": ROPE5}, ["rope_theta", "rope", "layer_types"]),
    "granite": ({"rope_theta": 5000.0}, {"rope_parameters": ROPE5}, ["rope_theta", "attention_multiplier"]),
    "smollm3": ({"rope_theta": 5000.0, "no_rope_layer_interval": 2},
                {"rope_parameters": ROPE5, "no_rope_layers": [1, 0], "layer_types": ["full_attention"] * 2},
                ["rope_theta", "ropes", "layer_types"]),
    "internlm3": ({"rope_theta": 5000.0, "qkv_bias": True, "bias": True},
                  {"rope_parameters": ROPE5, "attention_bias": True, "mlp_bias": True},
                  ["rope_theta", "qkv_bias", "o_bias", "mlp_bias"]),
    "starcoder2": ({"rope_theta": 5000.0}, {"rope_parameters": ROPE5}, ["rope_theta", "layer_types"]),
    "cohere": ({"rope_theta": 5000.0}, {"rope_parameters": ROPE5}, ["rope_theta", "logit_scale"]),
    "stablelm": ({"rope_theta": 5000.0, "partial_rotary_factor": 0.5},
                 {"rope_parameters": dict(ROPE5, partial_rotary_factor=0.5)}, ["rope_theta", "rotary_dims"]),
    "helium": ({"rope_theta": 5000.0}, {"rope_parameters": ROPE5}, ["rope_theta", "o_bias"]),
}
# transformers' defaults where a config names no theta, rotated fraction or head_dim.
DEFAULTS = {
    "gemma": {"rope_theta": 10000.0, "head_dim": 256, "tie_word_embeddings": True},
    "phi": {"rope_theta": 10000.0, "partial_rotary_factor": 0.5, "tie_word_embeddings": False},
    "smollm3": {"rope_theta": 2e6, "ropes": [True, True], "tie_word_embeddings": True},
    "internlm3": {"head_dim": 128, "qkv_bias": False, "mlp_bias": False},
    "starcoder2": {"use_bias": True, "tie_word_embeddings": True, "layer_types": ["full_attention"] * 2},
    "cohere": {"rope_theta": 500000.0, "logit_scale": 0.0625, "tie_word_embeddings": True},
    "stablelm": {"partial_rotary_factor": 0.25, "rotary_dims": 4},
    "helium": {"rope_theta": 100000.0, "head_dim": 128, "rms_norm_eps": 1e-8},
}


@pytest.mark.parametrize("name", list(DIALECTS))
def test_config_dialects_give_the_same_args(name):
    tf4, tf5, fields = DIALECTS[name]
    a, b = args_of(dict(BASE, model_type=name, **tf4)), args_of(dict(BASE, model_type=name, **tf5))
    assert all(getattr(a, f) == getattr(b, f) for f in fields), [(f, getattr(a, f), getattr(b, f)) for f in fields]


@pytest.mark.parametrize("name", list(DEFAULTS))
def test_config_defaults_are_transformers(name):
    args = args_of(dict(BASE, model_type=name))
    assert {f: getattr(args, f) for f in DEFAULTS[name]} == DEFAULTS[name]


@pytest.mark.parametrize("name, override, message", [
    ("gemma", {"hidden_act": "silu"}, "'silu'"),
    ("gemma", {"use_bidirectional_attention": True}, "use_bidirectional_attention"),
    ("phi", {"partial_rotary_factor": 1.5}, "got 1.5"),
    ("phi", {"hidden_act": "relu"}, "'relu'"),
    ("olmo2", {"rope_parameters": dict(ROPE5, partial_rotary_factor=0.5)}, "partial_rotary_factor=0.5"),
    ("granite", {"logits_scaling": 0}, "logits_scaling is 0"),
    ("smollm3", {"no_rope_layers": [1]}, r"\[1\]"),
    ("smollm3", {"no_rope_layer_interval": 0}, "got 0"),
    ("smollm3", {"layer_types": ["sliding_attention"] * 2}, "sliding_window is None"),
    ("internlm3", {"qkv_bias": True, "attention_bias": False}, "attention_bias=False contradicts qkv_bias=True"),
    ("internlm3", {"qkv_bias": True, "bias": False}, "qkv_bias=True but bias=False"),
    ("starcoder2", {"sliding_window": 0}, "got 0"),
    ("starcoder2", {"hidden_act": "gelu"}, "'gelu'"),
    ("cohere", {"logit_scale": None}, "got None"),
    ("cohere", {"num_key_value_heads": 3}, r"\(3\)"),
    ("stablelm", {"hidden_size": 66}, r"hidden_size \(66\)"),
    ("helium", {"num_key_value_heads": 3}, r"\(3\)"),
])
def test_config_errors_name_the_value(name, override, message):
    with pytest.raises(ValueError, match=message):
        args_of(dict(BASE, model_type=name, **override))


def test_whole_head_rope_reads_both_dialects_and_refuses_a_fraction():
    """rope_utils.resolve_whole_head_rope, which olmo2, cohere and starcoder2 parse by."""
    scaling = {"rope_type": "linear", "factor": 2.0}
    assert resolve_whole_head_rope("x", 5e3, scaling, None) == resolve_whole_head_rope(
        "x", None, None, dict(scaling, rope_theta=5e3)) == (5e3, scaling)
    assert resolve_whole_head_rope("x", None, None, None, default_theta=7.0) == (7.0, None)
    with pytest.raises(ValueError, match="cohere rotates whole heads; got partial_rotary_factor=0.5"):
        resolve_whole_head_rope("cohere", None, None, {"rope_theta": 1.0, "partial_rotary_factor": 0.5})
