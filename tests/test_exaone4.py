"""exaone4.py (EXAONE 4.0): the shared family checks (family_checks.py) on the
transformers fixtures, plus what only EXAONE 4 has: the layer pattern from an int or an
"L"/"G" string, rope on sliding layers only (every layer without a window), the
post-norm block and QK-norm (the fixtures depend on each), the config dialects and
errors, and sanitize.

Fixtures come from fixtures/make_exaone4_reference.py (sliding_window 8, 40 tokens):
exaone4_tf4 in the hub's transformers-4 dialect (llama3 rope scaling), exaone4_tf5 as
transformers 5 saves it.
"""

import mlx.core as mx
import pytest
from checkpoints import VOCAB_SIZE
from family_checks import FIXTURES, Family, FamilyChecks, fixture_model, reference, relative_error
from mlx.utils import tree_flatten, tree_unflatten
from sliding_checks import assert_override_matters, assert_sanitize_is_idempotent

from mlx_lm.models.cache import KVCache, RotatingKVCache
from mlx_lm.models.exaone4 import FULL, SLIDING, Model, ModelArgs, layer_types_from_pattern
from mlx_lm.utils import load_model

SHAPE = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
             num_key_value_heads=2, head_dim=16, sliding_window=8)

FAMILY = Family(
    fixtures=["exaone4_tf4", "exaone4_tf5"],
    tiny=dict(SHAPE, model_type="exaone4", sliding_window_pattern=2, vocab_size=VOCAB_SIZE,
              tie_word_embeddings=False, eos_token_id=0),
    small=dict(model_type="exaone4", hidden_size=32, intermediate_size=48, num_hidden_layers=2,
               num_attention_heads=2, num_key_value_heads=1, head_dim=16, sliding_window=8,
               sliding_window_pattern=2, vocab_size=256),
)


class TestExaone4(FamilyChecks):
    family = FAMILY


@pytest.mark.parametrize("override", [
    {"sliding_window": 1000}, {"rope_scaling": None}, {"rope_theta": 10000.0},
    {"layer_types": [SLIDING, FULL, SLIDING, FULL]},
])
def test_tf4_fixture_exercises_every_feature(override):
    """Without the window, the llama3 scaling, the rope theta or the layer pattern the
    logits are far off."""
    assert_override_matters("exaone4_tf4", override)


@pytest.mark.parametrize("norm", ["post_attention_layernorm", "post_feedforward_layernorm", "q_norm", "k_norm"])
def test_post_norms_and_qk_norms_matter(norm):
    """Unit weights on one kind of norm (the fixture's spread 0.2 around 1): far off."""
    ids, want = reference("exaone4_tf5")
    model, _ = load_model(FIXTURES / "exaone4_tf5")
    unit = [(k, mx.ones_like(v)) for k, v in tree_flatten(model.parameters()) if k.endswith(norm + ".weight")]
    assert len(unit) == 4
    model.update(tree_unflatten(unit))
    assert relative_error(model(ids), want) > 1e-2


def test_rope_only_on_sliding_layers_unless_there_is_no_window():
    model = fixture_model("exaone4_tf5")
    assert [layer.self_attn.use_rope for layer in model.layers] == [True, False, True, False]
    assert [type(c) for c in model.make_cache()] == [RotatingKVCache, KVCache, RotatingKVCache, KVCache]
    windowless = ModelArgs.from_dict(dict(SHAPE, model_type="exaone4", sliding_window=None,
                                          sliding_window_pattern=None))
    assert windowless.layer_types == [FULL] * 4
    assert all(layer.self_attn.use_rope for layer in Model(windowless).layers)


def test_layer_pattern_from_an_int_or_a_string():
    assert layer_types_from_pattern(4, 6) == [SLIDING, SLIDING, SLIDING, FULL, SLIDING, SLIDING]
    assert layer_types_from_pattern("LLLG", 6) == [SLIDING, SLIDING, SLIDING, FULL, SLIDING, FULL]  # last global
    assert layer_types_from_pattern("LG", 3) == [SLIDING, FULL, FULL]


def test_config_dialects_give_the_same_args():
    """EXAONE-4.0-32B's transformers-4 keys (string pattern, no layer_types) and
    transformers 5's for one model."""
    scaling = {"rope_type": "llama3", "factor": 16.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 8192}
    tf4 = ModelArgs.from_dict(dict(SHAPE, model_type="exaone4", rope_theta=1e6, rope_scaling=scaling,
                                   sliding_window_pattern="LLLG"))
    tf5 = ModelArgs.from_dict(dict(SHAPE, model_type="exaone4", layer_types=[SLIDING] * 3 + [FULL],
                                   rope_parameters=dict(scaling, rope_theta=1e6)))
    tf5.rope_parameters, tf5.sliding_window_pattern = None, "LLLG"  # the raw keys
    assert tf4 == tf5 and tf4.rope_scaling == scaling and tf4.rope_theta == 1e6


@pytest.mark.parametrize("override, message", [
    ({"sliding_window_pattern": "LLXG"}, "'LLXG'"),
    ({"sliding_window_pattern": 0}, "got 0"),
    ({"sliding_window_pattern": None}, "got None"),
    ({"layer_types": [SLIDING] * 3}, "has 3 entries"),
    ({"sliding_window": None, "layer_types": [SLIDING, FULL] * 2}, "sliding_window is None"),
    ({"hidden_act": "gelu"}, "'gelu'"),
    ({"num_key_value_heads": 3}, r"\(3\)"),
])
def test_config_errors_name_the_value(override, message):
    with pytest.raises(ValueError, match=message):
        ModelArgs.from_dict(dict(SHAPE, model_type="exaone4", **override))


def test_sanitize_is_idempotent_and_drops_what_we_compute():
    assert_sanitize_is_idempotent(FAMILY.fixtures)
