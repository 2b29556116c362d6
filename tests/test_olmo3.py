"""olmo3.py (OLMo 3): the shared family checks (family_checks.py) on the transformers
fixtures, plus what only OLMo 3 has: the QK-norm over the whole projection against a
naive formula, rope per layer type (YaRN on the global layers only in the tf4 dialect),
that the fixtures depend on the window, the rope and the layer pattern, the config
dialects and errors, and sanitize. Its sharded q/k norms (squares summed over ranks)
are checked by test_distributed.py, which shards FAMILY.tiny over two ranks.

Fixtures come from fixtures/make_olmo3_reference.py (sliding_window 8, 40 tokens):
olmo3_tf4 in the hub's transformers-4 dialect, olmo3_tf5 as transformers 5 saves it.
"""

import mlx.core as mx
import numpy as np
import pytest
from checkpoints import VOCAB_SIZE
from family_checks import Family, FamilyChecks, fixture_model
from sliding_checks import assert_override_matters, assert_sanitize_is_idempotent

from mlx_lm.models.cache import KVCache, RotatingKVCache
from mlx_lm.models.olmo3 import FULL, SLIDING, ModelArgs, projection_rms_norm
from mlx_lm.models.rope_utils import YarnRoPE

SHAPE = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
             num_key_value_heads=2, sliding_window=8)

FAMILY = Family(
    fixtures=["olmo3_tf4", "olmo3_tf5"],
    tiny=dict(SHAPE, model_type="olmo3", layer_types=[SLIDING, FULL] * 2, vocab_size=VOCAB_SIZE,
              tie_word_embeddings=False, eos_token_id=0),
    small=dict(model_type="olmo3", hidden_size=32, intermediate_size=48, num_hidden_layers=2,
               num_attention_heads=2, num_key_value_heads=1, sliding_window=8, layer_types=[SLIDING, FULL],
               vocab_size=256),
)


class TestOlmo3(FamilyChecks):
    family = FAMILY


def test_projection_rms_norm_spans_every_head():
    """One RMS over all H * D features of the projection (not one per head)."""
    x = mx.random.normal((2, 3, 64), key=mx.random.key(0)) * mx.arange(1, 65) / 16  # heads of unequal scale
    w = mx.random.normal((64,), key=mx.random.key(1))
    xs = np.array(x, dtype=np.float64)
    want = xs / np.sqrt((xs**2).mean(-1, keepdims=True) + 1e-6) * np.array(w)
    assert np.allclose(np.array(projection_rms_norm(x, w, 1e-6)), want, atol=1e-5)
    per_head = xs.reshape(2, 3, 4, 16)
    per_head = (per_head / np.sqrt((per_head**2).mean(-1, keepdims=True) + 1e-6)).reshape(2, 3, 64) * np.array(w)
    assert not np.allclose(want, per_head, atol=1e-2)


@pytest.mark.parametrize("override", [
    {"sliding_window": 1000}, {"rope_scaling": None}, {"rope_theta": 10000.0},
    {"layer_types": [SLIDING, FULL] * 2},
])
def test_tf4_fixture_exercises_every_feature(override):
    """Without the window, the global layers' YaRN, the shared rope theta or the default
    layer pattern the logits are far off."""
    assert_override_matters("olmo3_tf4", override)


def test_rope_per_layer_type():
    """tf4: YaRN on the global layers only; tf5: each type its own theta (swapping them
    is far off)."""
    tf4 = fixture_model("olmo3_tf4")
    assert [isinstance(layer.self_attn.rope, YarnRoPE) for layer in tf4.layers] == [False, False, False, True]
    assert tf4.args.rope[SLIDING] == (500000.0, None)
    swapped = {SLIDING: {"rope_type": "default", "rope_theta": 300.0},
               FULL: {"rope_type": "default", "rope_theta": 10000.0}}
    assert_override_matters("olmo3_tf5", {"rope_parameters": swapped})
    tf5 = fixture_model("olmo3_tf5")
    assert [type(c) for c in tf5.make_cache()] == [RotatingKVCache, KVCache, RotatingKVCache, KVCache]


def test_config_dialects_give_the_same_args():
    yarn = {"rope_type": "yarn", "factor": 8.0, "original_max_position_embeddings": 8192, "attention_factor": 1.2}
    tf4 = ModelArgs.from_dict(dict(SHAPE, model_type="olmo3", rope_theta=500000.0, rope_scaling=yarn))
    tf5 = ModelArgs.from_dict(dict(SHAPE, model_type="olmo3", layer_types=[SLIDING] * 3 + [FULL], rope_parameters={
        SLIDING: {"rope_type": "default", "rope_theta": 500000.0}, FULL: dict(yarn, rope_theta=500000.0)}))
    assert tf4.rope == tf5.rope and tf4.layer_types == tf5.layer_types and tf4.head_dim == 16
    assert ModelArgs.from_dict(dict(SHAPE, model_type="olmo3")).rope[FULL] == (500000.0, None)  # the default theta


@pytest.mark.parametrize("override, message", [
    ({"rope_parameters": {"rope_type": "default", "rope_theta": 1e4}}, "keyed by layer type"),
    ({"rope_parameters": {FULL: {"rope_theta": 1e4, "partial_rotary_factor": 0.5}}}, "0.5"),
    ({"layer_types": [SLIDING, "chunked_attention", FULL, FULL]}, "chunked_attention"),
    ({"sliding_window": None}, "sliding_window is None"),
    ({"hidden_act": "gelu"}, "'gelu'"),
    ({"num_key_value_heads": 3}, r"\(3\)"),
])
def test_config_errors_name_the_value(override, message):
    with pytest.raises(ValueError, match=message):
        ModelArgs.from_dict(dict(SHAPE, model_type="olmo3", **override))


def test_sanitize_is_idempotent_and_drops_what_we_compute():
    assert_sanitize_is_idempotent(FAMILY.fixtures)
