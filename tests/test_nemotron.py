"""nemotron.py (Nemotron-4 / Minitron): the shared family checks (family_checks.py) on the
transformers fixtures, plus what only Nemotron has: the "1p" LayerNorm (1 + weight, with
a bias) against its formula, relu2, that the fixtures depend on the partial rope and
the norms' +1, the config dialects (the rotated fraction top-level or in
rope_parameters, which wins) and errors, and sanitize. Two-rank sharding of FAMILY.tiny
(the gateless MLP) is in test_distributed.py.

Fixtures come from fixtures/make_nemotron_reference.py: nemotron_tf4 (hub dialect,
partial_rotary_factor 0.5) and nemotron_tf5 (as transformers 5 saves it, 0.25 in
rope_parameters, biases, tied); the norms' weights and biases random around 0.
"""

import mlx.core as mx
import numpy as np
import pytest
from checkpoints import VOCAB_SIZE
from family_checks import FIXTURES, Family, FamilyChecks, reference, relative_error
from mlx.utils import tree_flatten, tree_unflatten
from sliding_checks import assert_override_matters, assert_sanitize_is_idempotent

from mlx_lm.models.activations import relu_squared
from mlx_lm.models.nemotron import LayerNorm1P, ModelArgs
from mlx_lm.utils import load_model

SHAPE = dict(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2, head_dim=16)
FAMILY = Family(
    fixtures=["nemotron_tf4", "nemotron_tf5"],
    tiny=dict(SHAPE, model_type="nemotron", num_hidden_layers=2, vocab_size=VOCAB_SIZE, tie_word_embeddings=False,
              eos_token_id=0),
    small=dict(model_type="nemotron", hidden_size=32, intermediate_size=48, num_hidden_layers=1,
               num_attention_heads=2, num_key_value_heads=1, head_dim=16, vocab_size=256),
)
ARGS = dict(SHAPE, model_type="nemotron", num_hidden_layers=2, vocab_size=256)


class TestNemotron(FamilyChecks):
    family = FAMILY


def test_layernorm_1p_and_relu2_match_their_formulas():
    rng = np.random.default_rng(0)
    x, weight, bias = rng.normal(size=(2, 3, 8)), rng.normal(size=8) * 0.3, rng.normal(size=8) * 0.3
    norm = LayerNorm1P(8, eps=1e-5)
    norm.weight, norm.bias = mx.array(weight, dtype=mx.float32), mx.array(bias, dtype=mx.float32)
    centred = x - x.mean(-1, keepdims=True)
    want = centred / np.sqrt((centred**2).mean(-1, keepdims=True) + 1e-5) * (1 + weight) + bias
    np.testing.assert_allclose(np.array(norm(mx.array(x, dtype=mx.float32))), want, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(np.array(relu_squared(mx.array(x, dtype=mx.float32))), np.maximum(x, 0) ** 2,
                               rtol=1e-6)


@pytest.mark.parametrize("name, override", [
    ("nemotron_tf4", {"partial_rotary_factor": 1.0}),
    ("nemotron_tf5", {"rope_parameters": {"rope_type": "default", "rope_theta": 500.0, "partial_rotary_factor": 1.0}}),
    ("nemotron_tf4", {"hidden_act": "relu"}),
])
def test_fixtures_exercise_partial_rope_and_relu2(name, override):
    assert_override_matters(name, override)


def test_norms_add_one_to_their_weight():
    """Norm weights as the fixture stores them (random around 0) applied without the
    +1, i.e. as weight - 1 under LayerNorm1P: far off."""
    ids, want = reference("nemotron_tf4")
    model, _ = load_model(FIXTURES / "nemotron_tf4")
    shifted = [(k, v - 1.0) for k, v in tree_flatten(model.parameters()) if "layernorm.weight" in k]
    model.update(tree_unflatten(shifted))
    assert relative_error(model(ids), want) > 1e-2


def test_config_dialects_and_errors():
    tf4 = ModelArgs.from_dict(dict(ARGS, rope_theta=500.0, partial_rotary_factor=0.25))
    tf5 = ModelArgs.from_dict(dict(ARGS, rope_parameters={"rope_type": "default", "rope_theta": 500.0,
                                                          "partial_rotary_factor": 0.25}))
    assert (tf4.rope_theta, tf4.partial_rotary_factor, tf4.rotary_dims) == (tf5.rope_theta, 0.25, 4) == \
           (tf5.rope_theta, tf5.partial_rotary_factor, tf5.rotary_dims)
    assert ModelArgs.from_dict(ARGS).partial_rotary_factor == 0.5  # NemotronConfig's default
    both = ModelArgs.from_dict(dict(ARGS, partial_rotary_factor=0.75,
                                    rope_parameters={"rope_type": "default", "partial_rotary_factor": 0.25}))
    assert both.partial_rotary_factor == 0.25  # as transformers: rope_parameters' wins
    with pytest.raises(ValueError, match="'swiglu'"):
        ModelArgs.from_dict(dict(ARGS, hidden_act="swiglu"))
    with pytest.raises(ValueError, match="1.5"):
        ModelArgs.from_dict(dict(ARGS, partial_rotary_factor=1.5))


def test_sanitize_is_idempotent_and_keeps_norm_weights():
    assert_sanitize_is_idempotent(FAMILY.fixtures)
    raw = mx.load(str(FIXTURES / "nemotron_tf4" / "model.safetensors"))
    model, _ = load_model(FIXTURES / "nemotron_tf4")
    assert mx.array_equal(model.model.norm.weight, raw["model.norm.weight"])  # the +1 is in the forward only
