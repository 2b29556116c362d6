"""glm4.py (GLM-4-0414): the shared family checks (family_checks.py) on the transformers
fixtures, plus what only GLM-4 has: the partial interleaved rope against transformers'
formula, that the fixtures depend on the rotated fraction and the post-norms, the config
dialects and errors, and sanitize. Two-rank sharding of FAMILY.tiny (the fused
gate_up_proj split in two pieces) is in test_distributed.py.

Fixtures come from fixtures/make_glm4_reference.py: glm4_tf4 (hub dialect, top-level
partial_rotary_factor 0.5, biases) and glm4_tf5 (as transformers 5 saves it, 0.75 in
rope_parameters, tied).
"""

import mlx.core as mx
import numpy as np
import pytest
from checkpoints import VOCAB_SIZE
from family_checks import FIXTURES, Family, FamilyChecks, fixture_model, reference, relative_error
from sliding_checks import assert_override_matters, assert_sanitize_is_idempotent

from mlx_lm.models.glm4 import ModelArgs
from mlx_lm.utils import load_model

SHAPE = dict(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2, head_dim=16)
FAMILY = Family(
    fixtures=["glm4_tf4", "glm4_tf5"],
    tiny=dict(SHAPE, model_type="glm4", num_hidden_layers=2, vocab_size=VOCAB_SIZE, tie_word_embeddings=False,
              eos_token_id=0),
    small=dict(model_type="glm4", hidden_size=32, intermediate_size=48, num_hidden_layers=1,
               num_attention_heads=2, num_key_value_heads=1, vocab_size=256),
)
ARGS = dict(SHAPE, model_type="glm4", num_hidden_layers=2, vocab_size=256)


class TestGlm4(FamilyChecks):
    family = FAMILY


def np_partial_interleaved_rope(x: np.ndarray, offset: int, rotary_dims: int, base: float) -> np.ndarray:
    """transformers' Glm4 apply_rotary_pos_emb: pairs (x[2i], x[2i+1]) of the first
    rotary_dims features turn by position * base^(-2i / rotary_dims); the rest pass."""
    L = x.shape[-2]
    inv_freq = 1.0 / base ** (np.arange(0, rotary_dims, 2) / rotary_dims)
    angles = (offset + np.arange(L))[:, None] * inv_freq  # (L, rotary_dims / 2)
    cos, sin = np.cos(angles), np.sin(angles)
    out = x.copy()
    even, odd = x[..., 0:rotary_dims:2], x[..., 1:rotary_dims:2]
    out[..., 0:rotary_dims:2] = even * cos - odd * sin
    out[..., 1:rotary_dims:2] = odd * cos + even * sin
    return out


@pytest.mark.parametrize("name", FAMILY.fixtures)
def test_partial_interleaved_rope_matches_transformers(name):
    model = fixture_model(name)
    rope, args = model.layers[0].self_attn.rope, model.args
    x = mx.random.normal((1, 2, 6, 16), key=mx.random.key(0))
    want = np_partial_interleaved_rope(np.array(x, dtype=np.float64), 5, args.rotary_dims, args.rope_theta)
    assert np.allclose(np.array(rope(x, offset=5)), want, atol=1e-5)
    assert args.rotary_dims == {"glm4_tf4": 8, "glm4_tf5": 12}[name]


@pytest.mark.parametrize("name, override", [
    ("glm4_tf4", {"partial_rotary_factor": 1.0}), ("glm4_tf5", {"partial_rotary_factor": 0.5}),
    ("glm4_tf4", {"rope_theta": 100.0}),
])
def test_fixtures_exercise_the_rope(name, override):
    assert_override_matters(name, override)


def test_post_norms_are_applied():
    """Setting the post-norms' weights to 1 (no longer the fixture's) moves the logits."""
    model, _ = load_model(FIXTURES / "glm4_tf4")
    for layer in model.layers:
        layer.post_self_attn_layernorm.weight = mx.ones_like(layer.post_self_attn_layernorm.weight)
        layer.post_mlp_layernorm.weight = mx.ones_like(layer.post_mlp_layernorm.weight)
    ids, want = reference("glm4_tf4")
    assert relative_error(model(ids), want) > 1e-2


def test_config_dialects_give_the_same_args():
    tf4 = ModelArgs.from_dict(dict(ARGS, rope_theta=1e4, partial_rotary_factor=0.5))
    tf5 = ModelArgs.from_dict(dict(ARGS, rope_parameters={"rope_type": "default", "rope_theta": 1e4,
                                                          "partial_rotary_factor": 0.5}))
    for field in ("rope_theta", "rope_scaling", "partial_rotary_factor", "rotary_dims", "attention_bias"):
        assert getattr(tf4, field) == getattr(tf5, field), field
    defaults = ModelArgs.from_dict(ARGS)
    assert (defaults.partial_rotary_factor, defaults.attention_bias, defaults.rms_norm_eps) == (0.5, True, 1.5625e-07)


@pytest.mark.parametrize("override, message", [
    ({"partial_rotary_factor": 1.5}, r"partial_rotary_factor must be in \(0, 1\], got 1.5"),
    ({"rope_parameters": {"rope_theta": 1e4, "partial_rotary_factor": 0}}, "got 0"),
    ({"num_key_value_heads": 3}, r"\(3\)"),
])
def test_config_errors_name_the_value(override, message):
    with pytest.raises(ValueError, match=message):
        ModelArgs.from_dict(dict(ARGS, **override))


def test_sanitize_is_idempotent_and_drops_what_we_compute():
    assert_sanitize_is_idempotent(FAMILY.fixtures)
