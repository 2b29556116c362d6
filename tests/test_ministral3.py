"""ministral3.py (Ministral 3): the shared family checks (family_checks.py) on the
transformers fixtures, plus what only Ministral 3 has: Llama 4's query scale against
its formula, that the fixtures depend on it and on YaRN's attention factor, the default
rope, every layer sliding with a window, the config dialects and errors.

Fixtures come from fixtures/make_ministral3_reference.py (YaRN original context 8, so
the query scale changes every 8 positions): ministral3_tf4 (hub dialect, beta 0.3,
attention factor 1) and ministral3_tf5 (as transformers 5 saves it, beta 0.5, attention
factor 1.07, sliding window 8 on every layer, tied).
"""

import math

import mlx.core as mx
import pytest
from checkpoints import VOCAB_SIZE
from family_checks import Family, FamilyChecks, fixture_model
from sliding_checks import assert_override_matters, assert_sanitize_is_idempotent

from mlx_lm.models.cache import KVCache, RotatingKVCache
from mlx_lm.models.ministral3 import DEFAULT_ROPE, ModelArgs, query_scale

SHAPE = dict(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2, head_dim=16)
YARN = {"rope_type": "yarn", "rope_theta": 1e6, "factor": 4.0, "original_max_position_embeddings": 8,
        "beta_fast": 32.0, "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0, "llama_4_scaling_beta": 0.3}
FAMILY = Family(
    fixtures=["ministral3_tf4", "ministral3_tf5"],
    tiny=dict(SHAPE, model_type="ministral3", num_hidden_layers=2, vocab_size=VOCAB_SIZE, tie_word_embeddings=False,
              rope_parameters=YARN, eos_token_id=0),
    small=dict(model_type="ministral3", hidden_size=32, intermediate_size=48, num_hidden_layers=1,
               num_attention_heads=2, num_key_value_heads=1, head_dim=16, vocab_size=256, rope_parameters=YARN),
)
ARGS = dict(SHAPE, model_type="ministral3", num_hidden_layers=2, vocab_size=256)


class TestMinistral3(FamilyChecks):
    family = FAMILY


def test_query_scale_matches_its_formula():
    positions = mx.array([[0, 7, 8, 15, 16, 39, 1000]])
    got = query_scale(positions, 0.3, 8).tolist()[0]
    want = [1 + 0.3 * math.log(1 + math.floor(p / 8)) for p in positions.tolist()[0]]
    assert all(math.isclose(g, w, rel_tol=1e-6) for g, w in zip(got, want))


@pytest.mark.parametrize("name, override", [
    ("ministral3_tf4", {"rope_scaling": dict({k: v for k, v in YARN.items() if k != "rope_theta"},
                                             llama_4_scaling_beta=0.0)}),
    ("ministral3_tf5", {"rope_parameters": dict(YARN, rope_theta=1000.0, factor=2.0, llama_4_scaling_beta=0.5)}),
    ("ministral3_tf5", {"sliding_window": None}),
])
def test_fixtures_exercise_query_scale_attention_factor_and_window(name, override):
    """No query scale (beta 0); attention factor 1 instead of 1.07 (mscale_all_dim 1); no
    window: each far off."""
    assert_override_matters(name, override)


def test_a_window_slides_every_layer():
    assert [type(c) for c in fixture_model("ministral3_tf5").make_cache()] == [RotatingKVCache] * 2
    assert [type(c) for c in fixture_model("ministral3_tf4").make_cache()] == [KVCache] * 2


def test_config_dialects_and_default_rope():
    scaling = {k: v for k, v in YARN.items() if k != "rope_theta"}
    tf4 = ModelArgs.from_dict(dict(ARGS, rope_theta=1e6, rope_scaling=scaling))
    tf5 = ModelArgs.from_dict(dict(ARGS, rope_parameters=YARN))
    for args in (tf4, tf5):
        assert (args.rope_theta, args.scaling_beta, args.scaling_context) == (1e6, 0.3, 8)
        assert args.rope_scaling["rope_type"] == "yarn"
    # transformers 5: no rope_scaling / rope_parameters -> its YaRN default, whatever rope_theta says
    default = ModelArgs.from_dict(dict(ARGS, rope_theta=5.0))
    assert (default.rope_theta, default.scaling_beta, default.scaling_context) == (1e6, 0.1, 16384)
    assert default.rope_scaling["factor"] == DEFAULT_ROPE["factor"] == 16.0
    plain = ModelArgs.from_dict(dict(ARGS, rope_parameters={"rope_type": "default", "rope_theta": 1e4}))
    assert plain.scaling_beta is None  # no beta: no query scale


@pytest.mark.parametrize("override, match", [
    ({"rope_parameters": {"rope_type": "default", "rope_theta": 1e4, "llama_4_scaling_beta": 0.1}},
     "original_max_position_embeddings"),
    ({"sliding_window": 8, "layer_types": ["sliding_attention", "full_attention"]}, "disagree with sliding_window 8"),
    ({"num_key_value_heads": 3}, r"\(3\)"),
])
def test_config_errors_name_the_value(override, match):
    with pytest.raises(ValueError, match=match):
        ModelArgs.from_dict(dict(ARGS, **override))


def test_sanitize_is_idempotent_and_drops_what_we_compute():
    assert_sanitize_is_idempotent(FAMILY.fixtures)
