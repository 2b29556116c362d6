"""hunyuan_v1_dense.py (Hunyuan dense): the shared family checks (family_checks.py) on
the transformers fixtures, plus what only this family has: the NTK-alpha rope base
against transformers' formula (and that the fixture depends on it), the q/k norms
applied after rope, the config dialects, and sanitize. Two-rank sharding of
FAMILY.tiny is in test_distributed.py.

Fixtures come from fixtures/make_hunyuan_v1_dense_reference.py: hunyuan_v1_dense_tf4
(hub dialect, NTK-alpha rope) and hunyuan_v1_dense_tf5 (as transformers 5 saves it,
default rope, biases, tied).
"""

import mlx.core as mx
import numpy as np
import pytest
from checkpoints import VOCAB_SIZE
from family_checks import Family, FamilyChecks, fixture_model
from sliding_checks import assert_override_matters, assert_sanitize_is_idempotent

from mlx_lm.models.hunyuan_v1_dense import ModelArgs, ntk_alpha_base

SHAPE = dict(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2, head_dim=16)
FAMILY = Family(
    fixtures=["hunyuan_v1_dense_tf4", "hunyuan_v1_dense_tf5"],
    tiny=dict(SHAPE, model_type="hunyuan_v1_dense", num_hidden_layers=2, vocab_size=VOCAB_SIZE,
              rope_scaling={"type": "dynamic", "alpha": 1000.0, "factor": 1.0}, tie_word_embeddings=False,
              eos_token_id=0),
    small=dict(model_type="hunyuan_v1_dense", hidden_size=32, intermediate_size=48, num_hidden_layers=1,
               num_attention_heads=2, num_key_value_heads=1, head_dim=16, vocab_size=256),
)
ARGS = dict(SHAPE, model_type="hunyuan_v1_dense", num_hidden_layers=2, vocab_size=256)


class TestHunyuanV1Dense(FamilyChecks):
    family = FAMILY


def test_ntk_alpha_rope_matches_transformers():
    """transformers' compute_ntk_alpha_rope_parameters: base theta * alpha^(D / (D - 2))."""
    rope = fixture_model("hunyuan_v1_dense_tf4").layers[0].self_attn.rope
    base = 10000.0 * 1000.0 ** (16 / 14)
    assert ntk_alpha_base(10000.0, 1000.0, 16) == pytest.approx(base)
    x = mx.random.normal((1, 1, 5, 16), key=mx.random.key(0))
    inv_freq = base ** -(np.arange(0, 16, 2) / 16)
    angles = (3 + np.arange(5))[:, None] * inv_freq
    xs = np.array(x[0, 0], dtype=np.float64)
    half = np.concatenate([-xs[:, 8:], xs[:, :8]], axis=-1)
    want = xs * np.cos(np.concatenate([angles] * 2, -1)) + half * np.sin(np.concatenate([angles] * 2, -1))
    assert np.allclose(np.array(rope(x, offset=3)[0, 0]), want, atol=1e-5)
    assert_override_matters("hunyuan_v1_dense_tf4", {"rope_scaling": None})


def test_qk_norms_follow_rope():
    attn = fixture_model("hunyuan_v1_dense_tf5").layers[0].self_attn
    assert attn.query_layernorm.weight.shape == (16,) and "q_norm" not in attn


def test_config_dialects_give_the_same_args():
    tf4 = ModelArgs.from_dict(dict(ARGS, rope_theta=1e4, rope_scaling={"type": "dynamic", "alpha": 1000.0}))
    tf5 = ModelArgs.from_dict(dict(ARGS, rope_parameters={"rope_type": "dynamic", "rope_theta": 1e4, "alpha": 1000.0}))
    for field in ("rope_theta", "rope_scaling", "ntk_alpha"):
        assert getattr(tf4, field) == getattr(tf5, field), field
    assert tf4.ntk_alpha == 1000.0 and ModelArgs.from_dict(ARGS).ntk_alpha is None
    with pytest.raises(ValueError, match=r"\(3\)"):
        ModelArgs.from_dict(dict(ARGS, num_key_value_heads=3))


def test_sanitize_is_idempotent_and_drops_what_we_compute():
    assert_sanitize_is_idempotent(FAMILY.fixtures)
