"""mamba2.py: the shared family checks (family_checks.py) on the mamba2 fixtures, plus
its grouped gated norm against a naive reference, its config dialects and errors, and
its weight layouts.

Fixtures (tests/fixtures/make_mamba2_reference.py, 80 tokens, past the 64-token chunk
of ssm.py): `mamba2_tf5` as transformers 5 writes it (n_groups 4, infinity as
{"__float__": "Infinity"}); `mamba2_tf4` in the hub's dialect (time_step_limit [0.2,
Infinity] in plain json, biased projections, 3 taps, tied embeddings).
"""

import json

import mlx.core as mx
import numpy as np
import pytest
from family_checks import FIXTURES, Family, FamilyChecks, fixture_model, random_model, reference, relative_error

from mlx_lm.models.cache import ArraysCache, make_prompt_cache
from mlx_lm.models.mamba2 import ModelArgs

FAMILY = Family(
    fixtures=["mamba2_tf4", "mamba2_tf5"],
    tiny=dict(model_type="mamba2", vocab_size=512, hidden_size=64, expand=1, num_heads=8, head_dim=8,
              n_groups=2, state_size=8, num_hidden_layers=2, conv_kernel=4),
    small=dict(model_type="mamba2", vocab_size=256, hidden_size=32, expand=1, num_heads=4, head_dim=8,
               n_groups=2, state_size=8, num_hidden_layers=2, conv_kernel=4),
)


class TestMamba2(FamilyChecks):
    family = FAMILY


ARGS = dict(model_type="mamba2", vocab_size=64, hidden_size=32, num_hidden_layers=2, expand=2, num_heads=8,
            head_dim=8, n_groups=2, state_size=8)


def raw_weights(name):
    return mx.load(str(FIXTURES / name / "model.safetensors"))


def test_gated_norm_normalises_each_group():
    """The mixer's output norm is transformers' MambaRMSNormGated with group_size
    intermediate / n_groups: rmsnorm per group of y * silu(z), times the weight."""
    mixer = fixture_model("mamba2_tf5").layers[0].mixer  # 64 channels, 4 groups
    rng = np.random.default_rng(0)
    y, z = (rng.standard_normal((1, 5, 64)).astype(np.float32) for _ in range(2))
    gated = (y * z / (1 + np.exp(-z))).reshape(1, 5, 4, 16).astype(np.float64)
    want = (gated / np.sqrt((gated**2).mean(-1, keepdims=True) + 1e-5)).reshape(1, 5, 64) * np.array(mixer.norm.weight)
    got = np.array(mixer.gated_output(mx.array(y), mx.array(z)))
    assert np.abs(got - want).max() < 1e-5
    whole = (gated.reshape(1, 5, 64) / np.sqrt((gated**2).mean((-1, -2))[..., None] + 1e-5))
    assert np.abs(got - whole * np.array(mixer.norm.weight)).max() > 1e-2  # one group would differ


def test_config_dialects_normalise_alike():
    tf5 = json.loads((FIXTURES / "mamba2_tf5" / "config.json").read_text())
    tf4 = json.loads((FIXTURES / "mamba2_tf4" / "config.json").read_text())
    assert tf5["time_step_limit"][1] == {"__float__": "Infinity"} and tf4["time_step_limit"][1] == float("inf")
    assert ModelArgs.from_dict(tf5).time_step_limit == (0.0, float("inf"))
    assert ModelArgs.from_dict(tf4).time_step_limit == (0.2, float("inf"))
    assert ModelArgs.from_dict(ARGS).time_step_limit == (0.0, float("inf"))  # transformers' default
    # Mamba-Codestral's keys that transformers ignores are ignored here too.
    codestral = ModelArgs.from_dict(dict(ARGS, norm_before_gate=True, rms_norm=True, time_step_min=0.001))
    assert codestral.mamba_shape == ModelArgs.from_dict(ARGS).mamba_shape
    assert codestral.mamba_shape.norm_before_gate is False and codestral.mamba_shape.time_step_min == 0.0


def test_config_errors_name_the_value():
    with pytest.raises(ValueError, match=r"hidden_size \(32\) x expand \(1\) must equal num_heads \(8\) x head_dim"):
        ModelArgs.from_dict(dict(ARGS, expand=1))
    with pytest.raises(ValueError, match=r"num_heads \(8\) must be a multiple of n_groups \(3\)"):
        ModelArgs.from_dict(dict(ARGS, n_groups=3))
    with pytest.raises(ValueError, match="conv_kernel must be >= 2, got 1"):
        ModelArgs.from_dict(dict(ARGS, conv_kernel=1))
    with pytest.raises(ValueError, match="hidden_act 'gelu'"):
        ModelArgs.from_dict(dict(ARGS, hidden_act="gelu"))
    with pytest.raises(ValueError, match=r"time_step_limit needs \(min, max\), got \(0.1,\)"):
        ModelArgs.from_dict(dict(ARGS, time_step_limit=[0.1]))


def test_sanitize_converts_the_hf_layout_once():
    model = fixture_model("mamba2_tf4")  # tied, 3 taps
    raw = raw_weights("mamba2_tf4")
    older = {("backbone.embedding.weight" if k == "backbone.embeddings.weight" else k): v for k, v in raw.items()}
    older["lm_head.weight"] = raw["backbone.embeddings.weight"]  # saved tied copies are dropped
    once = model.sanitize(older)
    again = model.sanitize(dict(once))
    assert once.keys() == again.keys() and all(mx.array_equal(once[k], again[k]) for k in once)
    assert "lm_head.weight" not in once and "backbone.embedding.weight" not in once
    conv = "backbone.layers.1.mixer.conv1d.weight"
    assert raw[conv].shape == (96, 1, 3) and once[conv].shape == (96, 3, 1)
    assert mx.array_equal(once[conv][..., 0], raw[conv][:, 0])
    model.load_weights(list(once.items()))  # every parameter, each shape as the model has it


def test_cache_layout_and_clamped_decode():
    """One ArraysCache per layer holding the conv state and the fp32 SSM state; the
    tf4 fixture's time_step_limit floor applies when decoding too (transformers clamps
    on its full-sequence path, which wrote the reference)."""
    model = fixture_model("mamba2_tf4")
    cache = make_prompt_cache(model)
    assert [type(c) for c in cache] == [ArraysCache] * 3
    ids, want = reference("mamba2_tf4")
    for t in range(8):
        logits = model(ids[:, t : t + 1], cache=cache)
    assert relative_error(logits[0, -1], want[0, 7]) < 1e-4
    mixer = model.layers[0].mixer
    assert cache[0][0].shape == (1, 2, mixer.conv_dim)
    assert cache[0][1].shape == (1, 8, 8, 8) and cache[0][1].dtype == mx.float32


@pytest.mark.parametrize("residual_in_fp32", [True, False])
def test_residual_stream_dtype_follows_residual_in_fp32(residual_in_fp32):
    """In bfloat16 the residual stream stays float32 when residual_in_fp32 (each norm
    reads it cast to the weights' dtype), as transformers keeps it."""
    model = random_model(dict(FAMILY.small, residual_in_fp32=residual_in_fp32))
    model.set_dtype(mx.bfloat16)
    block = model.layers[0]
    out = block(model.backbone.embeddings(mx.array([[1, 2, 3]])))
    assert out.dtype == (mx.float32 if residual_in_fp32 else mx.bfloat16)
    assert model(mx.array([[1, 2, 3]])).shape == (1, 3, 256)
