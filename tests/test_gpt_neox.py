"""gpt_neox.py (GPT-NeoX, Pythia): the shared family checks (family_checks.py) on the
transformers fixtures, plus what only GPT-NeoX has: the per-head fused q/k/v rows, the
parallel and sequential residuals, the partial rope and its dialects (rotary_pct /
rotary_emb_base or rope_parameters), sanitize (upstream mlx-lm's names, old buffers) and
the config errors. Two-rank sharding of FAMILY.tiny is in test_distributed.py.

Fixtures come from fixtures/make_gpt_neox_reference.py: gpt_neox_tf4 (hub dialect,
rotary_pct 0.25, parallel residual, untied) and gpt_neox_tf5 (as transformers 5 saves
it, linear rope scaling, 0.5 rotated, sequential residual, no attention biases, tied).
"""

import mlx.core as mx
import pytest
from checkpoints import VOCAB_SIZE
from family_checks import Family, FamilyChecks, fixture_model
from layout_checks import assert_sanitize_converts_once, raw_weights
from sliding_checks import assert_override_matters

from mlx_lm.models.gpt_neox import ModelArgs

FAMILY = Family(
    fixtures=["gpt_neox_tf4", "gpt_neox_tf5"],
    tiny=dict(model_type="gpt_neox", hidden_size=64, num_attention_heads=4, num_hidden_layers=2,
              intermediate_size=128, rotary_pct=0.25, vocab_size=VOCAB_SIZE, eos_token_id=0),
    small=dict(model_type="gpt_neox", hidden_size=32, num_attention_heads=2, num_hidden_layers=1,
               intermediate_size=64, vocab_size=256),
)
ARGS = dict(model_type="gpt_neox", hidden_size=64, num_attention_heads=4, num_hidden_layers=2, intermediate_size=96,
            vocab_size=256)


class TestGptNeox(FamilyChecks):
    family = FAMILY


def test_query_key_value_rows_are_per_head():
    attn = fixture_model("gpt_neox_tf4").layers[0].attention
    x = mx.random.normal((1, 3, 64), key=mx.random.key(0))
    fused = attn.query_key_value(x)  # (1, 3, 4 heads * [q_h | k_h | v_h])
    values = fused.reshape(1, 3, 4, 48)[..., 32:].transpose(0, 2, 1, 3)  # (1, H, L, D)
    # one position: attention returns its own value, mixed by dense
    out = attn(x[:, :1])
    assert mx.allclose(out, attn.dense(values[:, :, :1].transpose(0, 2, 1, 3).reshape(1, 1, 64)), atol=1e-5)


@pytest.mark.parametrize("name, override", [
    ("gpt_neox_tf4", {"use_parallel_residual": False}), ("gpt_neox_tf5", {"use_parallel_residual": True}),
    ("gpt_neox_tf4", {"rotary_pct": 1.0}),
    ("gpt_neox_tf5", {"rope_parameters": {"rope_type": "default", "rope_theta": 500.0, "partial_rotary_factor": 0.5}}),
])
def test_fixtures_exercise_residuals_and_rope(name, override):
    assert_override_matters(name, override)


def test_config_dialects():
    hub = ModelArgs.from_dict(dict(ARGS, rotary_pct=0.5, rotary_emb_base=500, rope_scaling={"type": "linear",
                                                                                           "factor": 2.0}))
    tf5 = ModelArgs.from_dict(dict(ARGS, rope_parameters={"rope_type": "linear", "factor": 2.0, "rope_theta": 500.0,
                                                          "partial_rotary_factor": 0.5}))
    for args in (hub, tf5):
        assert (args.rope_theta, args.rotary_pct, args.rotary_dims) == (500, 0.5, 8)
        assert args.rope_scaling == {"rope_type": "linear", "factor": 2.0}
    defaults = ModelArgs.from_dict(dict(ARGS, rope_theta=5.0))  # transformers reads no top-level rope_theta
    assert (defaults.rope_theta, defaults.rotary_pct, defaults.rope_scaling) == (10000.0, 0.25, None)
    with pytest.raises(ValueError, match="got 0"):
        ModelArgs.from_dict(dict(ARGS, rotary_pct=0))
    with pytest.raises(ValueError, match="'gelu_10'"):
        ModelArgs.from_dict(dict(ARGS, hidden_act="gelu_10"))


def test_sanitize_takes_upstream_names_and_drops_buffers():
    raw = raw_weights("gpt_neox_tf4")
    buffers = {"gpt_neox.layers.0.attention.bias": mx.ones((1, 1, 4, 4)),
               "gpt_neox.layers.0.attention.masked_bias": mx.array(-1e4),
               "gpt_neox.layers.0.attention.rotary_emb.inv_freq": mx.ones((2,))}
    assert_sanitize_converts_once("gpt_neox_tf4", buffers, dropped=list(buffers))
    upstream = {"model." + k.removeprefix("gpt_neox.").replace("layers.", "h.") if k.startswith("gpt_neox.")
                else "model." + k: v for k, v in raw.items()}
    assert "model.embed_out.weight" in upstream and "model.h.1.attention.dense.weight" in upstream
    once = assert_sanitize_converts_once("gpt_neox_tf4", upstream, dropped=list(upstream))
    assert all(mx.array_equal(once[k], v) for k, v in raw.items())
    assert_sanitize_converts_once("gpt_neox_tf5", {"embed_out.weight": raw["embed_out.weight"]},
                                  dropped=["embed_out.weight"])
