"""minicpm3.py (MiniCPM3): the shared family checks (family_checks.py) on the transformers
fixtures, plus what only this family has: its latent attention with rotate-half rope
against transformers' attention over expanded keys and values (float64), the longrope
long factors against transformers, the latent cache, each muP multiplier mattering, the
config dialects, defaults and errors, and sanitize. Two-rank sharding of FAMILY.tiny is
in test_distributed.py; the batched longrope is in test_rope_utils.py.

Fixtures come from fixtures/make_minicpm3_reference.py: minicpm3_tf4 (hub dialect,
longrope, q LoRA, tied by default) and minicpm3_tf5 (as transformers 5 saves it: q_proj,
biases, v_head_dim 12, untied). Both switch longrope factors past 64 positions, beyond
the 40 tokens; minicpm3_tf4's reference also holds transformers' logits with the switch
at 16 (`long_logits`).
"""

import json
import math

import mlx.core as mx
import numpy as np
import pytest
from checkpoints import VOCAB_SIZE
from family_checks import FIXTURES, PROMPT, Family, FamilyChecks, fixture_model, random_model, relative_error
from mlx.utils import tree_flatten
from sliding_checks import assert_override_matters

from mlx_lm.models.cache import KVCache, make_prompt_cache
from mlx_lm.models.minicpm3 import ModelArgs
from mlx_lm.models.rope_utils import SuScaledRoPE
from mlx_lm.utils import load_model, quantize_model

LONGROPE = {"type": "longrope", "short_factor": [1.0, 1.5, 2.0, 3.0], "long_factor": [2.0, 3.0, 5.0, 8.0],
            "original_max_position_embeddings": 64}
MLA = dict(num_attention_heads=4, num_key_value_heads=4, kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=8)
FAMILY = Family(
    fixtures=["minicpm3_tf4", "minicpm3_tf5"],
    tiny=dict(MLA, model_type="minicpm3", hidden_size=64, intermediate_size=256, num_hidden_layers=2,
              q_lora_rank=32, scale_emb=2.0, dim_model_base=16, max_position_embeddings=128, rope_theta=10000.0,
              rope_scaling=LONGROPE, vocab_size=VOCAB_SIZE, tie_word_embeddings=False, eos_token_id=0),
    small=dict(MLA, model_type="minicpm3", hidden_size=32, intermediate_size=48, num_hidden_layers=1,
               q_lora_rank=16, vocab_size=256),
)
ARGS = dict(MLA, model_type="minicpm3", vocab_size=256, hidden_size=64, intermediate_size=96, num_hidden_layers=2)


class TestMiniCPM3(FamilyChecks):
    family = FAMILY


# --- attention ------------------------------------------------------------------------------


def naive_rotate_half(x: np.ndarray, positions: np.ndarray, inv_freq: np.ndarray, mscale: float) -> np.ndarray:
    """transformers' apply_rotary_pos_emb: x cos + rotate_half(x) sin, cos and sin of
    cat(freqs, freqs) times the attention factor; x (..., T, d)."""
    angles = positions[:, None] * inv_freq[None]  # (T, d / 2)
    cos, sin = (np.concatenate([f(angles)] * 2, axis=-1) * mscale for f in (np.cos, np.sin))
    half = x.shape[-1] // 2
    rotated = np.concatenate([-x[..., half:], x[..., :half]], axis=-1)
    return x * cos + rotated * sin


def linear(layer, x: np.ndarray) -> np.ndarray:
    out = x @ np.array(layer.weight, dtype=np.float64).T
    return out + np.array(layer.bias, dtype=np.float64) if "bias" in layer else out


def expanded_attention(attn, x: np.ndarray, rope_scaling, base: float, mscale: float) -> np.ndarray:
    """transformers' MiniCPM3Attention in float64 over x (B, T, hidden): per-head keys
    [W_k c, rope(k_rot)], values W_v c, causal softmax at (dn + dr)^-1/2; rope with the
    short factors (T < original_max_position_embeddings)."""
    H, dn, dr, dv, r = attn.num_heads, attn.nope_dim, attn.rope_dim, attn.v_dim, attn.kv_lora_rank
    B, T, _ = x.shape
    q = np.array(attn.queries(mx.array(x.astype(np.float32))), dtype=np.float64)  # (B, H, T, dn + dr)
    kv = linear(attn.kv_a_proj_with_mqa, x)
    c, k_rot = kv[..., :r], kv[..., r:][:, None]  # (B, T, r), (B, 1, T, dr)
    c = c / np.sqrt((c**2).mean(-1, keepdims=True) + 1e-6) * np.array(attn.kv_a_layernorm.weight, dtype=np.float64)
    inv_freq = 1.0 / (np.array(rope_scaling["short_factor"]) * base ** (np.arange(0, dr, 2) / dr))
    positions = np.arange(T, dtype=np.float64)
    q_rot = naive_rotate_half(q[..., dn:], positions, inv_freq, mscale)
    k_rot = naive_rotate_half(k_rot, positions, inv_freq, mscale)
    kv_b = linear(attn.kv_b_proj, c).reshape(B, T, H, dn + dv).transpose(0, 2, 1, 3)  # (B, H, T, dn + dv)
    keys = np.concatenate([kv_b[..., :dn], np.broadcast_to(k_rot, (B, H, T, dr))], axis=-1)
    queries = np.concatenate([q[..., :dn], q_rot], axis=-1)
    scores = queries @ keys.swapaxes(-1, -2) / math.sqrt(dn + dr) + np.triu(np.full((T, T), -np.inf), 1)
    p = np.exp(scores - scores.max(-1, keepdims=True))
    out = (p / p.sum(-1, keepdims=True)) @ kv_b[..., dn:]  # (B, H, T, dv)
    return linear(attn.o_proj, out.transpose(0, 2, 1, 3).reshape(B, T, -1))


@pytest.mark.parametrize("name", FAMILY.fixtures)
def test_latent_attention_with_rope_equals_expanded_keys_and_values(name):
    """Full and through the latent cache in pieces (q LoRA on tf4, q_proj and biases on tf5)."""
    model = fixture_model(name)
    attn, args = model.layers[1].self_attn, model.args
    assert type(attn.rope) is SuScaledRoPE and attn.rope.dims == args.qk_rope_head_dim
    x = np.random.default_rng(5).standard_normal((2, 11, 64))
    want = mx.array(expanded_attention(attn, x, args.rope_scaling, args.rope_theta, attn.rope.short_mscale)
                    .astype(np.float32))
    assert relative_error(attn(mx.array(x.astype(np.float32)), "causal"), want) < 1e-5
    cache, pieces = KVCache(), []
    for start, stop in ((0, 4), (4, 5), (5, 11)):
        piece = mx.array(x[:, start:stop].astype(np.float32))
        pieces.append(attn(piece, cache.make_mask(stop - start), cache))
    assert relative_error(mx.concatenate(pieces, axis=1), want) < 1e-5


def test_the_cache_holds_the_latent_and_the_rotated_key():
    model = fixture_model("minicpm3_tf5")
    cache = make_prompt_cache(model)
    model(PROMPT[None], cache=cache)
    latent, k_rot = cache[1].state
    assert latent.shape == (1, 1, PROMPT.size, 16) and k_rot.shape == (1, 1, PROMPT.size, 8)


def test_quantization_keeps_kv_b_proj_float():
    model, config = load_model(FIXTURES / "minicpm3_tf4")
    quantize_model(model, config, 32, 8)
    attn = model.layers[0].self_attn
    assert "scales" not in attn.kv_b_proj and "scales" in attn.q_a_proj and "scales" in attn.o_proj
    assert relative_error(model(PROMPT[None]), fixture_model("minicpm3_tf4")(PROMPT[None])) < 0.05


# --- rope and multipliers -------------------------------------------------------------------


def test_longrope_long_factors_match_transformers():
    """With the switch at 16, the 40-token call turns every position with the long
    factors and the attention factor of max / 16 (transformers' `long_logits`)."""
    scaling = json.loads((FIXTURES / "minicpm3_tf4" / "config.json").read_text())["rope_scaling"]
    model, _ = load_model(FIXTURES / "minicpm3_tf4",
                          model_config={"rope_scaling": dict(scaling, original_max_position_embeddings=16)})
    data = mx.load(str(FIXTURES / "minicpm3_tf4" / "reference.safetensors"))
    assert relative_error(model(data["input_ids"]), data["long_logits"]) < FAMILY.tolerance
    assert relative_error(data["logits"], data["long_logits"]) > 1e-2
    rope = model.layers[0].self_attn.rope
    assert rope.long_mscale == pytest.approx(math.sqrt(1 + math.log(256 / 16) / math.log(16)))


@pytest.mark.parametrize("name, override", [
    ("minicpm3_tf4", {"scale_emb": 1.0}),
    ("minicpm3_tf4", {"scale_depth": None}),
    ("minicpm3_tf5", {"dim_model_base": None}),
    ("minicpm3_tf4", {"rope_scaling": None}),
    ("minicpm3_tf5", {"rope_parameters": {"rope_type": "default", "rope_theta": 1000.0}}),
])
def test_each_multiplier_and_the_rope_scaling_matter(name, override):
    assert_override_matters(name, override)


# --- config ---------------------------------------------------------------------------------


def test_config_dialects_give_the_same_args():
    hub = ModelArgs.from_dict(dict(ARGS, rope_theta=1e4, rope_scaling=LONGROPE))
    tf5 = ModelArgs.from_dict(dict(ARGS, head_dim=8, qk_head_dim=16, rope_parameters=dict(
        {k: v for k, v in LONGROPE.items() if k != "type"}, rope_type="longrope", rope_theta=1e4)))
    for field in ("rope_theta", "rope_scaling", "v_head_dim", "tie_word_embeddings", "scale_depth"):
        assert getattr(hub, field) == getattr(tf5, field), field
    assert hub.rope_scaling["rope_type"] == "longrope"


def test_transformers_defaults():
    args = ModelArgs.from_dict(dict(ARGS, scale_depth=None, dim_model_base=None))
    assert args.v_head_dim == 16 and args.tie_word_embeddings and args.rope_theta == 10000.0
    assert args.scale_depth == math.sqrt(2) and args.logits_scaling == 1.0  # the no-op scalings
    full = ModelArgs.from_dict({"model_type": "minicpm3"})  # openbmb/MiniCPM3-4B's shape
    assert (full.hidden_size, full.q_lora_rank, full.kv_lora_rank, full.v_head_dim) == (2560, 768, 256, 64)
    assert (full.scale_emb, full.scale_depth, full.logits_scaling) == (12.0, 1.4, 10.0)


@pytest.mark.parametrize("override, message", [
    ({"num_key_value_heads": 2}, r"num_key_value_heads \(2\) must equal num_attention_heads \(4\)"),
    ({"hidden_act": "gelu"}, "hidden_act 'gelu' is not supported"),
    ({"hidden_size": 66}, r"hidden_size \(66\) is not a multiple of num_attention_heads \(4\)"),
    ({"dim_model_base": 0}, "dim_model_base must be positive, got 0"),
])
def test_config_errors_name_the_value(override, message):
    with pytest.raises(ValueError, match=message):
        ModelArgs.from_dict(dict(ARGS, **override))


# --- weights --------------------------------------------------------------------------------


@pytest.mark.parametrize("name", FAMILY.fixtures)
def test_sanitize_converts_once(name):
    """transformers' saved weights are ours; a tied head's lm_head.weight and stored rope
    frequencies are dropped; a second pass changes nothing."""
    model = fixture_model(name)
    raw = mx.load(str(FIXTURES / name / "model.safetensors"))
    extra = {"lm_head.weight": mx.zeros((256, 64)), "model.layers.0.self_attn.rotary_emb.inv_freq": mx.zeros((4,))}
    once = model.sanitize(dict(raw, **extra) if model.args.tie_word_embeddings else dict(raw))
    assert sorted(once) == sorted(k for k, _ in tree_flatten(model.parameters()))
    again = model.sanitize(dict(once))
    assert once.keys() == again.keys() and all(mx.array_equal(once[k], again[k]) for k in once)
    assert ("lm_head.weight" in once) == (not model.args.tie_word_embeddings)


def test_sanitize_dequantizes_upstream_mlx_lms_quantized_kv_b_proj():
    """Upstream mlx-lm quantizes kv_b_proj (it expands keys and values with it); the
    latent attention reads it as a matrix, so it comes back float (bits and group size
    from the packed shape: 4 bits in groups of 32 over kv_lora_rank 64)."""
    model = random_model(dict(ARGS, kv_lora_rank=64))
    ours = dict(tree_flatten(model.parameters()))
    upstream, prefix = dict(ours), "model.layers.1.self_attn.kv_b_proj"
    packed, scales, biases = mx.quantize(upstream.pop(prefix + ".weight"), group_size=32, bits=4)
    upstream.update({prefix + ".weight": packed, prefix + ".scales": scales, prefix + ".biases": biases})
    got = model.sanitize(upstream)
    assert sorted(got) == sorted(ours)
    assert mx.array_equal(got[prefix + ".weight"], mx.dequantize(packed, scales, biases, group_size=32, bits=4))
    assert all(mx.array_equal(got[k], ours[k]) for k in ours if not k.startswith(prefix))
