"""falcon_mamba.py: the shared family checks (family_checks.py) on the falcon_mamba
fixtures, plus its weightless dt/B/C norms against a naive reference, its config
dialects and errors, and its weights.

Fixtures (tests/fixtures/make_mamba_reference.py, 40 tokens): `falcon_mamba_tf5` as
transformers 5 writes it (mixer_rms_eps 1e-2, untied head); `falcon_mamba_tf4` in
falcon-mamba-7b's dialect (no mixer_rms_eps key: 1e-6; tied by default; 3 layers).
"""

import json

import mlx.core as mx
import numpy as np
import pytest
from family_checks import FIXTURES, Family, FamilyChecks, fixture_model, reference, relative_error

from mlx_lm.models.falcon_mamba import ModelArgs

FAMILY = Family(
    fixtures=["falcon_mamba_tf4", "falcon_mamba_tf5"],
    tiny=dict(model_type="falcon_mamba", vocab_size=512, hidden_size=64, num_hidden_layers=2, state_size=8,
              mixer_rms_eps=1e-3, eos_token_id=0),
    small=dict(model_type="falcon_mamba", vocab_size=256, hidden_size=32, num_hidden_layers=1, state_size=8),
)


class TestFalconMamba(FamilyChecks):
    family = FAMILY


ARGS = dict(model_type="falcon_mamba", vocab_size=64, hidden_size=32, num_hidden_layers=2, state_size=8)


def test_dt_b_c_are_rms_normalised_without_weight():
    """ssm_inputs: x_proj's dt, B and C each divided by sqrt(mean square + eps) in fp32,
    no weight (transformers' FalconMambaWeightlessRMSNorm); then dt_proj and softplus."""
    mixer = fixture_model("falcon_mamba_tf5").layers[0].mixer  # eps 1e-2, rank 4, state 8
    assert mixer.norm_eps == 1e-2 and "b_layernorm" not in mixer
    x = mx.array(np.random.default_rng(0).standard_normal((1, 3, 128)).astype(np.float32))
    dt, B, C = mixer.ssm_inputs(x)
    raw = np.array(mixer.x_proj(x)).astype(np.float64)

    def rms(v):
        return v / np.sqrt((v**2).mean(-1, keepdims=True) + 1e-2)

    r, n = mixer.dt_rank, mixer.state_size
    assert np.abs(np.array(B) - rms(raw[..., r : r + n])).max() < 1e-5
    assert np.abs(np.array(C) - rms(raw[..., r + n :])).max() < 1e-5
    pre = rms(raw[..., :r]) @ np.array(mixer.dt_proj.weight).T + np.array(mixer.dt_proj.bias)
    assert np.abs(np.array(dt) - np.log1p(np.exp(pre))).max() < 1e-5


def test_config_dialects_normalise_alike():
    tf4 = json.loads((FIXTURES / "falcon_mamba_tf4" / "config.json").read_text())
    tf5 = json.loads((FIXTURES / "falcon_mamba_tf5" / "config.json").read_text())
    assert "mixer_rms_eps" not in tf4 and "tie_word_embeddings" not in tf4
    args4, args5 = ModelArgs.from_dict(tf4), ModelArgs.from_dict(tf5)
    assert (args4.mixer_rms_eps, args5.mixer_rms_eps) == (1e-6, 1e-2)
    assert args4.tie_word_embeddings and not args5.tie_word_embeddings
    assert args4.mamba_shape.bcdt_norm == "weightless" and args4.mamba_shape.norm_eps == 1e-6


def test_falcon_mamba_7b_config_reads_as_transformers_reads_it():
    """tiiuae/falcon-mamba-7b's config.json (transformers 4.43): expand 16 is stale, the
    written intermediate_size 8192 is what its weights (and transformers) use."""
    hub = dict(architectures=["FalconMambaForCausalLM"], bos_token_id=0, conv_kernel=4, eos_token_id=11, expand=16,
               hidden_act="silu", hidden_size=4096, initializer_range=0.1, intermediate_size=8192,
               layer_norm_epsilon=1e-05, model_type="falcon_mamba", num_hidden_layers=64, pad_token_id=11,
               rescale_prenorm_residual=False, residual_in_fp32=True, state_size=16, tie_word_embeddings=False,
               time_step_floor=0.0001, time_step_init_scheme="random", time_step_max=0.1, time_step_min=0.001,
               time_step_rank=256, time_step_scale=1.0, torch_dtype="bfloat16", use_bias=False, use_cache=True,
               use_conv_bias=True, vocab_size=65024)
    shape = ModelArgs.from_dict(hub).mamba_shape
    assert (shape.intermediate_size, shape.dt_rank, shape.state_size, shape.norm_eps) == (8192, 256, 16, 1e-6)


def test_config_errors_name_the_value():
    with pytest.raises(ValueError, match="mixer_rms_eps must be > 0, got 0"):
        ModelArgs.from_dict(dict(ARGS, mixer_rms_eps=0))
    with pytest.raises(ValueError, match="hidden_act 'relu'"):
        ModelArgs.from_dict(dict(ARGS, hidden_act="relu"))


def test_sanitize_drops_the_dummy_norm_weights_once():
    model = fixture_model("falcon_mamba_tf5")
    raw = mx.load(str(FIXTURES / "falcon_mamba_tf5" / "model.safetensors"))
    with_dummies = dict(raw, **{"backbone.layers.0.mixer.b_layernorm.weight": mx.ones((8,))})
    once = model.sanitize(with_dummies)
    again = model.sanitize(dict(once))
    assert once.keys() == again.keys() and all(mx.array_equal(once[k], again[k]) for k in once)
    assert not any("layernorm" in k for k in once)
    model.load_weights(list(once.items()))
    ids, want = reference("falcon_mamba_tf5")
    assert relative_error(model(ids), want) < 1e-4
