"""cohere2.py (Command R7B): the shared family checks (family_checks.py) on the
transformers fixtures, plus what only Cohere2 has: its bias-free LayerNorm against a
naive formula, that the fixtures exercise the window, the global layers' missing rope,
the interleaved rope and the logit scale, the config dialects and errors, and sanitize.

Fixtures come from fixtures/make_cohere2_reference.py (sliding_window 8, 40 tokens):
cohere2_tf4 in the hub's transformers-4 dialect, cohere2_tf5 as transformers 5 saves it.
"""

import mlx.core as mx
import numpy as np
import pytest
from checkpoints import VOCAB_SIZE
from family_checks import Family, FamilyChecks, fixture_model
from sliding_checks import assert_override_matters, assert_sanitize_is_idempotent

from mlx_lm.models.cache import KVCache, RotatingKVCache
from mlx_lm.models.cohere2 import FULL, SLIDING, ModelArgs, layer_norm

SHAPE = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
             num_key_value_heads=2, sliding_window=8)

FAMILY = Family(
    fixtures=["cohere2_tf4", "cohere2_tf5"],
    tiny=dict(SHAPE, model_type="cohere2", sliding_window_pattern=2, logit_scale=0.5, vocab_size=VOCAB_SIZE,
              tie_word_embeddings=False, eos_token_id=0),
    small=dict(model_type="cohere2", hidden_size=32, intermediate_size=48, num_hidden_layers=2,
               num_attention_heads=2, num_key_value_heads=1, sliding_window=8, sliding_window_pattern=2,
               logit_scale=0.5, vocab_size=256),
)


class TestCohere2(FamilyChecks):
    family = FAMILY


def test_layer_norm_matches_the_formula():
    """(x - mean) / sqrt(var + eps) * w, no bias; float32 inside, x's dtype out."""
    x = mx.random.normal((2, 3, 16), key=mx.random.key(0)) * 3 + 1
    w = mx.random.normal((16,), key=mx.random.key(1))
    xs = np.array(x, dtype=np.float64)
    want = (xs - xs.mean(-1, keepdims=True)) / np.sqrt(xs.var(-1, keepdims=True) + 1e-5) * np.array(w)
    assert np.allclose(np.array(layer_norm(x, w, 1e-5)), want, atol=1e-5)
    assert layer_norm(x.astype(mx.bfloat16), w, 1e-5).dtype == mx.bfloat16


@pytest.mark.parametrize("override", [
    {"sliding_window": 1000}, {"logit_scale": 1.0}, {"rope_theta": 10000.0}, {"sliding_window_pattern": 2},
])
def test_tf4_fixture_exercises_every_feature(override):
    """Without the window, the logit scale, the rope theta or the tf4 layer pattern the
    logits are far off."""
    assert_override_matters("cohere2_tf4", override)


def test_global_layers_have_no_rope_and_sliding_ones_interleave():
    """All layers sliding with a window past the sequence turns the global layers into
    roped ones: far off. De-interleaved rope on the sliding layers: far off."""
    assert_override_matters("cohere2_tf5", {"layer_types": [SLIDING] * 4, "sliding_window": 1000})
    model = fixture_model("cohere2_tf5")
    sliding = [layer.self_attn for layer in model.layers if layer.layer_type == SLIDING]
    assert all(a.use_rope and a.rope.traditional for a in sliding)
    assert not any(layer.self_attn.use_rope for layer in model.layers if layer.layer_type == FULL)
    assert [type(c) for c in model.make_cache()] == [RotatingKVCache, KVCache, RotatingKVCache, KVCache]


def test_config_dialects_give_the_same_args():
    tf4 = ModelArgs.from_dict(dict(SHAPE, model_type="cohere2", rope_theta=50000.0, sliding_window_pattern=4,
                                   head_dim=16, use_qk_norm=False, position_embedding_type="rope_gptj"))
    tf5 = ModelArgs.from_dict(dict(SHAPE, model_type="cohere2", layer_types=[SLIDING] * 3 + [FULL],
                                   rope_parameters={"rope_type": "default", "rope_theta": 50000.0}))
    tf5.rope_parameters = None  # the raw key; everything read from it must agree
    assert tf4 == tf5 and tf4.head_dim == 16 and tf4.num_key_value_heads == 2
    assert ModelArgs.from_dict(dict(SHAPE, model_type="cohere2", num_key_value_heads=None)).num_key_value_heads == 4


@pytest.mark.parametrize("override, message", [
    ({"head_dim": 32}, "head_dim=32"),
    ({"use_qk_norm": True}, "use_qk_norm"),
    ({"sliding_window_pattern": 0}, "got 0"),
    ({"layer_types": [SLIDING, "chunked_attention", FULL, FULL]}, "chunked_attention"),
    ({"sliding_window": None}, "sliding_window is None"),
    ({"hidden_act": "gelu"}, "'gelu'"),
    ({"num_key_value_heads": 3}, r"\(3\)"),
])
def test_config_errors_name_the_value(override, message):
    with pytest.raises(ValueError, match=message):
        ModelArgs.from_dict(dict(SHAPE, model_type="cohere2", **override))


def test_sanitize_is_idempotent_and_drops_what_we_compute():
    assert_sanitize_is_idempotent(FAMILY.fixtures)
