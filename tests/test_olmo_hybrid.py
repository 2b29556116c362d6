"""olmo_hybrid.py: the shared family checks (family_checks.py) on the transformers
fixtures, plus what only OLMo Hybrid has: betas in (0, 2) in the fixtures' forward, the
whole-projection q/k norm, NoPE attention, the config dialects, and sanitize over the
layout transformers saves (split q/k/v convs, renamed norms) and the one it holds in
memory. The negative-eigenvalue recurrence itself is tested against the float64
reference in test_gated_delta.py.

Fixtures come from fixtures/make_olmo_hybrid_reference.py (40 tokens, chunked
prefill): olmo_hybrid_tf4 in the released checkpoints' dialect (top-level
rope_theta: null, so NoPE), olmo_hybrid_tf5 as transformers 5 saves it (rope).
"""

import mlx.core as mx
import numpy as np
import pytest
from checkpoints import VOCAB_SIZE
from family_checks import FIXTURES, PROMPT, Family, FamilyChecks, fixture_model, reference, relative_error

from mlx_lm.models.cache import ArraysCache, KVCache, make_prompt_cache
from mlx_lm.models.gated_delta import compute_beta
from mlx_lm.models.olmo_hybrid import ModelArgs, ProjectionRMSNorm, default_layer_types
from mlx_lm.utils import load_model

L, F = "linear_attention", "full_attention"
SHAPE = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=4, num_attention_heads=4,
             num_key_value_heads=2, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16,
             linear_value_head_dim=16, linear_conv_kernel_dim=4)

FAMILY = Family(
    fixtures=["olmo_hybrid_tf4", "olmo_hybrid_tf5"],
    tiny=dict(SHAPE, model_type="olmo_hybrid", vocab_size=VOCAB_SIZE, layer_types=[L, F, L, F],
              rope_parameters={"rope_type": "default", "rope_theta": 10000.0}, eos_token_id=0),
    small=dict(model_type="olmo_hybrid", hidden_size=32, intermediate_size=48, num_hidden_layers=2,
               num_attention_heads=2, linear_num_key_heads=1, linear_num_value_heads=2, linear_key_head_dim=16,
               linear_value_head_dim=16, layer_types=[L, F], rope_theta=None, vocab_size=256),
)


class TestOlmoHybrid(FamilyChecks):
    family = FAMILY


ARGS = dict(SHAPE, model_type="olmo_hybrid", vocab_size=64, layer_types=[L, L, F, L])


# --- what the fixtures exercise -------------------------------------------------------------


def test_fixtures_cover_nope_rope_and_betas_above_one():
    tf4, tf5 = fixture_model("olmo_hybrid_tf4"), fixture_model("olmo_hybrid_tf5")
    assert tf4.args.rope_theta is None and tf4.layers[1].self_attn.rope is None  # the released NoPE
    assert tf5.args.rope_theta == 10000.0 and tf5.layers[2].self_attn.rope is not None
    assert [type(c) for c in make_prompt_cache(tf5)] == [ArraysCache, ArraysCache, KVCache, ArraysCache]
    assert "lm_head" not in tf4 and "lm_head" in tf5
    for model in (tf4, tf5):
        layer = model.layers[0]
        h = layer.input_layernorm(model.model.embed_tokens(PROMPT[None]))
        beta = compute_beta(layer.linear_attn.b_proj(h), layer.linear_attn.allow_neg_eigval)
        assert (beta > 1).mean().item() > 0.3  # much of the write range is the negative-eigenvalue one


def test_without_negative_eigenvalues_the_logits_move():
    """The variant matters on the fixture: betas halved back into (0, 1) change the output."""
    model, (ids, want) = fixture_model("olmo_hybrid_tf5"), reference("olmo_hybrid_tf5")
    try:
        for layer in model.layers[::3]:
            layer.linear_attn.allow_neg_eigval = False
        assert relative_error(model(ids), want) > 0.05
    finally:
        for layer in model.layers[::3]:
            layer.linear_attn.allow_neg_eigval = True
    assert relative_error(model(ids), want) < FAMILY.tolerance


def test_projection_norm_spans_every_head():
    """The q/k norm is one RMSNorm over all heads, unlike a per-head one."""
    x = mx.random.normal((2, 3, 32), key=mx.random.key(0)) * mx.array([1.0] * 16 + [4.0] * 16)
    norm = ProjectionRMSNorm(32, 1e-6)
    norm.weight = mx.random.normal((32,), key=mx.random.key(1))
    xs = np.array(x, dtype=np.float64)
    want = xs / np.sqrt((xs**2).mean(-1, keepdims=True) + 1e-6) * np.array(norm.weight)
    assert relative_error(norm(x), mx.array(want.astype(np.float32))) < 1e-6


# --- config ---------------------------------------------------------------------------------


def test_dialects_normalise_alike():
    tf5 = ModelArgs.from_dict(dict(ARGS, rope_parameters={"rope_type": "default", "rope_theta": 5e5}))
    tf4 = ModelArgs.from_dict(dict(ARGS, rope_theta=5e5, rope_scaling=None))
    assert (tf4.rope_theta, tf4.rope_scaling) == (tf5.rope_theta, tf5.rope_scaling) == (5e5, None)
    nope_tf4 = ModelArgs.from_dict(dict(ARGS, rope_theta=None))
    nope_tf5 = ModelArgs.from_dict(dict(ARGS, rope_parameters={"rope_type": "default", "rope_theta": None}))
    assert nope_tf4.rope_theta is None and nope_tf5.rope_theta is None
    # No rope key at all, or rope_parameters null: transformers' default theta.
    assert ModelArgs.from_dict(ARGS).rope_theta == ModelArgs.from_dict(dict(ARGS, rope_parameters=None)).rope_theta
    assert ModelArgs.from_dict(ARGS).rope_theta == 10000.0
    again = ModelArgs.from_dict(vars(nope_tf4))  # normalised args read back the same
    assert again.rope_theta is None and again.layer_types == nope_tf4.layer_types


def test_transformers_defaults():
    args = ModelArgs.from_dict(dict(model_type="olmo_hybrid", vocab_size=64, hidden_size=96, intermediate_size=64,
                                    num_hidden_layers=6, num_attention_heads=4))
    assert args.layer_types == [L, L, L, F, L, L] == default_layer_types(6)
    assert default_layer_types(2) == [L, F]  # the last layer attends when no 4th would
    assert (args.num_key_value_heads, args.head_dim) == (4, 24)
    assert (args.linear_num_key_heads, args.linear_num_value_heads) == (4, 4)
    assert (args.linear_key_head_dim, args.linear_value_head_dim) == (18, 36)  # 0.75 * 96 / 4, twice that
    assert args.linear_allow_neg_eigval and args.linear_conv_kernel_dim == 4


@pytest.mark.parametrize("extra, message", [
    (dict(layer_types=[L, "mamba", F, L]), "unknown kinds \\['mamba'\\]"),
    (dict(layer_types=[L, F]), "layer_types has 2 entries but num_hidden_layers is 4"),
    (dict(hidden_act="gelu"), "hidden_act 'gelu' is not supported"),
    (dict(num_key_value_heads=3), "num_key_value_heads \\(3\\)"),
    (dict(linear_num_value_heads=3), "linear_num_value_heads \\(3\\) must be a multiple of linear_num_key_heads \\(2\\)"),
    (dict(linear_conv_kernel_dim=1), "linear_conv_kernel_dim must be >= 2, got 1"),
    (dict(rope_theta=-5.0), "rope_theta must be positive \\(or null for no rope\\), got -5.0"),
])
def test_config_errors_name_the_value(extra, message):
    with pytest.raises(ValueError, match=message):
        ModelArgs.from_dict(dict(ARGS, **extra))


# --- weights --------------------------------------------------------------------------------


def assert_same(a, b):
    assert a.keys() == b.keys()
    for k in a:
        assert a[k].shape == b[k].shape and mx.array_equal(a[k], b[k]), k


def in_memory_layout(raw):
    """What transformers holds after loading: renamed norms, one conv1d (C, 1, K)."""
    out = {}
    for key, value in raw.items():
        key = key.replace(".attention_layer_norm.", ".input_layernorm.")
        out[key.replace(".feedforward_layer_norm.", ".post_attention_layernorm.")] = value
    for key in [k for k in out if k.endswith("q_conv1d.weight")]:
        prefix = key[: -len("q_conv1d.weight")]
        out[prefix + "conv1d.weight"] = mx.concatenate([out.pop(f"{prefix}{n}_conv1d.weight") for n in "qkv"])
    return out


@pytest.mark.parametrize("name", FAMILY.fixtures)
def test_sanitize_converts_each_hf_layout_once(name, tmp_path):
    model, raw = fixture_model(name), mx.load(str(FIXTURES / name / "model.safetensors"))
    once = model.sanitize(raw)
    assert_same(model.sanitize(dict(once)), once)
    assert_same(model.sanitize(in_memory_layout(raw)), once)
    prefix = "model.layers.0."
    # transformers saves the conv in three near-equal pieces, not at the q/k/v widths.
    pieces = [raw[f"{prefix}linear_attn.{n}_conv1d.weight"] for n in "qkv"]
    assert [p.shape[0] for p in pieces] == [43, 43, 42]  # of [q 32 | k 32 | v 64]
    conv = once[prefix + "linear_attn.conv1d.weight"]
    assert conv.shape == (sum(p.shape[0] for p in pieces), 4, 1)
    assert mx.array_equal(conv[:, :, 0], mx.concatenate(pieces)[:, 0])
    assert mx.array_equal(once[prefix + "input_layernorm.weight"], raw[prefix + "attention_layer_norm.weight"])
    assert not any("_layer_norm" in k or "q_conv1d" in k for k in once)
    # Saved in the MLX layout, the weights load to the same logits.
    mx.save_safetensors(str(tmp_path / "model.safetensors"), once)
    (tmp_path / "config.json").write_text((FIXTURES / name / "config.json").read_text())
    ids, want = reference(name)
    assert relative_error(load_model(tmp_path)[0](ids), want) < FAMILY.tolerance
