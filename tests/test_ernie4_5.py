"""ernie4_5.py (ERNIE 4.5 dense): the shared family checks (family_checks.py) on the
transformers fixtures, plus what only this family has: the interleaved full-head rope
against transformers' formula, the biases `use_bias` switches on, the config dialects
and defaults, and sanitize. Two-rank sharding of FAMILY.tiny is in test_distributed.py.

Fixtures come from fixtures/make_ernie4_5_reference.py: ernie4_5_tf4 (hub dialect,
biases, tied) and ernie4_5_tf5 (as transformers 5 saves it, head_dim 24, untied).
"""

import mlx.core as mx
import numpy as np
import pytest
from checkpoints import VOCAB_SIZE
from family_checks import Family, FamilyChecks, fixture_model
from sliding_checks import assert_override_matters, assert_sanitize_is_idempotent
from test_glm4 import np_partial_interleaved_rope

from mlx_lm.models.ernie4_5 import ModelArgs

SHAPE = dict(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2, head_dim=16)
FAMILY = Family(
    fixtures=["ernie4_5_tf4", "ernie4_5_tf5"],
    tiny=dict(SHAPE, model_type="ernie4_5", num_hidden_layers=2, vocab_size=VOCAB_SIZE, use_bias=True,
              tie_word_embeddings=False, eos_token_id=0),
    small=dict(model_type="ernie4_5", hidden_size=32, intermediate_size=48, num_hidden_layers=1,
               num_attention_heads=2, num_key_value_heads=1, head_dim=16, vocab_size=256),
)
ARGS = dict(SHAPE, model_type="ernie4_5", num_hidden_layers=2, vocab_size=256)


class TestErnie4_5(FamilyChecks):
    family = FAMILY


@pytest.mark.parametrize("name", FAMILY.fixtures)
def test_interleaved_rope_turns_the_whole_head(name):
    model = fixture_model(name)
    rope, args = model.layers[0].self_attn.rope, model.args
    x = mx.random.normal((1, 2, 6, args.head_dim), key=mx.random.key(0))
    want = np_partial_interleaved_rope(np.array(x, dtype=np.float64), 5, args.head_dim, args.rope_theta)
    assert np.allclose(np.array(rope(x, offset=5)), want, atol=1e-5)


def test_use_bias_reaches_every_projection():
    layer = fixture_model("ernie4_5_tf4").layers[0]
    projections = [layer.self_attn.q_proj, layer.self_attn.o_proj, layer.mlp.gate_proj, layer.mlp.down_proj]
    assert all("bias" in p for p in projections)
    assert not any("bias" in p for p in (fixture_model("ernie4_5_tf5").layers[0].self_attn.q_proj,
                                          fixture_model("ernie4_5_tf5").layers[0].mlp.up_proj))
    assert_override_matters("ernie4_5_tf4", {"rope_theta": 10000.0})


def test_config_dialects_and_defaults():
    tf4 = ModelArgs.from_dict(dict(ARGS, rope_theta=5e5))
    tf5 = ModelArgs.from_dict(dict(ARGS, rope_parameters={"rope_type": "default", "rope_theta": 5e5}))
    for field in ("rope_theta", "rope_scaling", "rotary_dims", "qkv_bias", "mlp_bias"):
        assert getattr(tf4, field) == getattr(tf5, field), field
    defaults = ModelArgs.from_dict({k: v for k, v in ARGS.items() if k != "head_dim"})
    assert (defaults.head_dim, defaults.tie_word_embeddings, defaults.rms_norm_eps) == (128, True, 1e-5)
    with pytest.raises(ValueError, match=r"\(3\)"):
        ModelArgs.from_dict(dict(ARGS, num_key_value_heads=3))


def test_sanitize_is_idempotent_and_drops_what_we_compute():
    assert_sanitize_is_idempotent(FAMILY.fixtures)
