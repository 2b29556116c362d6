"""apertus.py (Apertus): the shared family checks (family_checks.py) on the transformers
fixtures, plus what only Apertus has: xIELU against its formula and with the
checkpoint's own scalars, the q/k norms, transformers 5's default rope, the config
dialects and errors, and sanitize (alpha_p / alpha_n (1,) -> ()). Two-rank sharding of
FAMILY.tiny (the gateless MLP) is in test_distributed.py.

Fixtures come from fixtures/make_apertus_reference.py: apertus_tf4 (hub dialect, llama3
rope scaling over an original context of 16) and apertus_tf5 (as transformers 5 saves
it, biases, tied); every layer's xIELU scalars random.
"""

import math

import mlx.core as mx
import pytest
from checkpoints import VOCAB_SIZE
from family_checks import FIXTURES, Family, FamilyChecks, fixture_model, reference, relative_error
from layout_checks import assert_sanitize_converts_once, raw_weights
from mlx.utils import tree_flatten, tree_unflatten
from sliding_checks import assert_override_matters

from mlx_lm.models.activations import XIELU, xielu
from mlx_lm.models.apertus import DEFAULT_ROPE, ModelArgs
from mlx_lm.utils import load_model

SHAPE = dict(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2)
FAMILY = Family(
    fixtures=["apertus_tf4", "apertus_tf5"],
    tiny=dict(SHAPE, model_type="apertus", num_hidden_layers=2, vocab_size=VOCAB_SIZE, tie_word_embeddings=False,
              eos_token_id=0),
    small=dict(model_type="apertus", hidden_size=32, intermediate_size=48, num_hidden_layers=1,
               num_attention_heads=2, num_key_value_heads=1, vocab_size=256),
)
ARGS = dict(SHAPE, model_type="apertus", num_hidden_layers=2, vocab_size=256)


class TestApertus(FamilyChecks):
    family = FAMILY


def naive_xielu(x: float, alpha_p: float, alpha_n: float, beta: float, eps: float) -> float:
    softplus = lambda y: math.log1p(math.exp(y))  # noqa: E731
    if x > 0:
        return softplus(alpha_p) * x * x + beta * x
    return (beta + softplus(alpha_n)) * (math.expm1(min(x, eps)) - x) + beta * x


def test_xielu_matches_its_formula():
    x = mx.array([-6.0, -1.0, -1e-3, -1e-7, 0.0, 1e-7, 0.3, 2.0, 5.0])
    for params in ((0.2, -0.4, 0.5, -1e-6), (1.1, 0.3, 0.8, -0.05)):
        got = xielu(x, *(mx.array(p) for p in params)).tolist()
        want = [naive_xielu(v, *params) for v in x.tolist()]
        assert all(math.isclose(g, w, rel_tol=1e-5, abs_tol=1e-7) for g, w in zip(got, want)), (params, got, want)
    # transformers' initialisation: alpha_p, alpha_n are softplus^-1 of 0.8 and 0.8 - beta
    module = XIELU()
    assert math.isclose(math.log1p(math.exp(module.alpha_p.item())), 0.8, rel_tol=1e-6)
    assert math.isclose(math.log1p(math.exp(module.alpha_n.item())), 0.3, rel_tol=1e-6)


@pytest.mark.parametrize("scalar", ["alpha_p", "alpha_n", "beta", "eps"])
def test_every_xielu_scalar_comes_from_the_checkpoint(scalar):
    """The fixture's per-layer scalars are random: resetting one kind to XIELU's initial
    value moves the logits off transformers'."""
    ids, want = reference("apertus_tf4")
    model, _ = load_model(FIXTURES / "apertus_tf4")
    init = getattr(XIELU(), scalar)
    model.update(tree_unflatten([(k, init) for k, _ in tree_flatten(model.parameters()) if k.endswith(scalar)]))
    assert relative_error(model(ids), want) > 1e-3


@pytest.mark.parametrize("norm", ["q_norm", "k_norm"])
def test_qk_norms_matter(norm):
    ids, want = reference("apertus_tf4")
    model, _ = load_model(FIXTURES / "apertus_tf4")
    unit = [(k, mx.zeros_like(v) + 2.0) for k, v in tree_flatten(model.parameters()) if k.endswith(norm + ".weight")]
    assert len(unit) == 2
    model.update(tree_unflatten(unit))
    assert relative_error(model(ids), want) > 1e-2


def test_tf4_fixture_exercises_its_rope():
    assert_override_matters("apertus_tf4", {"rope_scaling": {"rope_type": "default"}})


def test_config_dialects_and_default_rope():
    scaling = {k: v for k, v in DEFAULT_ROPE.items() if k != "rope_theta"}
    tf4 = ModelArgs.from_dict(dict(ARGS, rope_theta=12e6, rope_scaling=scaling, qk_norm=True, post_norm=False,
                                   mlp_bias=False))
    tf5 = ModelArgs.from_dict(dict(ARGS, rope_parameters=DEFAULT_ROPE))
    assert (tf4.rope_theta, tf4.rope_scaling) == (tf5.rope_theta, tf5.rope_scaling)
    assert tf5.rope_scaling["rope_type"] == "llama3" and tf4.qk_norm and tf5.qk_norm
    # transformers 5: no rope_scaling / rope_parameters -> the llama3 default, whatever rope_theta says
    bare = ModelArgs.from_dict(dict(ARGS, rope_theta=1000.0))
    assert (bare.rope_theta, bare.rope_scaling) == (tf5.rope_theta, tf5.rope_scaling)


@pytest.mark.parametrize("override, match", [
    ({"qk_norm": False}, "qk_norm=False"), ({"post_norm": True}, "post_norm=True"),
    ({"mlp_bias": True}, "mlp_bias=True"), ({"hidden_act": "gelu_tanh"}, "'gelu_tanh'"),
    ({"num_key_value_heads": 3}, r"\(3\)"),
])
def test_config_errors_name_the_value(override, match):
    with pytest.raises(ValueError, match=match):
        ModelArgs.from_dict(dict(ARGS, **override))


def test_sanitize_takes_both_alpha_shapes_once():
    raw = raw_weights("apertus_tf4")
    assert raw["model.layers.0.mlp.act_fn.alpha_p"].shape == (1,)  # transformers'
    once = assert_sanitize_converts_once("apertus_tf4", {"model.rotary_emb.inv_freq": mx.ones((8,))},
                                         dropped=["model.rotary_emb.inv_freq"])
    assert once["model.layers.0.mlp.act_fn.alpha_p"].shape == once["model.layers.0.mlp.act_fn.beta"].shape == ()
    assert_sanitize_converts_once("apertus_tf5", {"lm_head.weight": raw["model.embed_tokens.weight"]},
                                  dropped=["lm_head.weight"])
    assert fixture_model("apertus_tf5").args.tie_word_embeddings
