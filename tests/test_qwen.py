"""qwen.py (Qwen 1): the shared family checks (family_checks.py) on the fixtures of an
independent torch reference (Qwen 1 is remote code, not in transformers), plus what
only Qwen 1 has: the logn query scale against its formula, w2 as the gate, the biases of
no_bias false, dynamic NTK (exact for a first call within seq_length, an error past it),
sanitize and the config. Two-rank sharding of FAMILY.tiny is in test_distributed.py.

Fixtures come from fixtures/make_qwen_reference.py: qwen_tf4 (the released layout,
logn attention past a seq_length of 16) and qwen_bias (no_bias false, half the head
rotated, dynamic NTK on with seq_length 64).
"""

import math

import mlx.core as mx
import pytest
from checkpoints import VOCAB_SIZE
from family_checks import Family, FamilyChecks, fixture_model
from layout_checks import assert_sanitize_converts_once
from sliding_checks import assert_override_matters

from mlx_lm.models.cache import make_prompt_cache
from mlx_lm.models.qwen import ModelArgs, logn_scale

FAMILY = Family(
    fixtures=["qwen_bias", "qwen_tf4"],
    tiny=dict(model_type="qwen", hidden_size=64, num_attention_heads=4, kv_channels=16, num_hidden_layers=2,
              intermediate_size=256, seq_length=16, use_dynamic_ntk=False, vocab_size=VOCAB_SIZE, eos_token_id=0),
    small=dict(model_type="qwen", hidden_size=32, num_attention_heads=2, kv_channels=16, num_hidden_layers=1,
               intermediate_size=96, seq_length=16, use_dynamic_ntk=False, vocab_size=256),
)
ARGS = dict(model_type="qwen", hidden_size=64, num_attention_heads=4, kv_channels=16, num_hidden_layers=2,
            intermediate_size=192, vocab_size=256)


class TestQwen(FamilyChecks):
    family = FAMILY


def test_logn_scale_matches_its_formula():
    positions = mx.arange(40)
    got = logn_scale(positions, 16).tolist()
    want = [math.log(p + 1, 16) if p + 1 > 16 else 1.0 for p in range(40)]
    assert all(math.isclose(g, w, rel_tol=1e-6) for g, w in zip(got, want))


@pytest.mark.parametrize("name, override", [
    ("qwen_tf4", {"use_logn_attn": False}), ("qwen_bias", {"rotary_pct": 1.0}),
])
def test_fixtures_exercise_logn_and_partial_rope(name, override):
    assert_override_matters(name, override)


def test_w2_is_the_gate():
    mlp = fixture_model("qwen_bias").layers[0].mlp
    x = mx.random.normal((1, 2, 64), key=mx.random.key(0))
    want = mlp.c_proj(mlp.w1(x) * (mlp.w2(x) * mx.sigmoid(mlp.w2(x))))
    assert mx.allclose(mlp(x), want, atol=1e-5)
    assert "bias" in mlp.w1 and "bias" in fixture_model("qwen_bias").layers[0].attn.c_proj
    assert "bias" not in fixture_model("qwen_tf4").layers[0].mlp.w1


def test_dynamic_ntk_within_seq_length_only():
    """qwen_bias has seq_length 64 and dynamic NTK on: a first call of 64 tokens runs
    (the remote code keeps plain rope), cached decoding past 64 too (it keeps the first
    call's base), a first call of 65 raises."""
    model = fixture_model("qwen_bias")
    cache = make_prompt_cache(model)
    model(mx.zeros((1, 64), dtype=mx.int32), cache=cache)
    model(mx.zeros((1, 8), dtype=mx.int32), cache=cache)
    with pytest.raises(ValueError, match="first forward of 65 tokens is longer than seq_length"):
        model(mx.zeros((1, 65), dtype=mx.int32))


def test_config_defaults_and_errors():
    defaults = ModelArgs(model_type="qwen")
    assert (defaults.no_bias, defaults.use_logn_attn, defaults.use_dynamic_ntk, defaults.rotary_pct,
            defaults.kv_channels, defaults.seq_length) == (True, True, True, 1.0, 128, 8192)
    for override, match in (({"kv_channels": 8}, r"4 \* 8\) must equal hidden_size \(64\)"),
                            ({"intermediate_size": 191}, r"\(191\) must be even"),
                            ({"rotary_pct": 0.0}, "got 0.0")):
        with pytest.raises(ValueError, match=match):
            ModelArgs.from_dict(dict(ARGS, **override))


def test_sanitize_is_idempotent():
    assert_sanitize_converts_once("qwen_tf4", {"transformer.rotary_emb.inv_freq": mx.ones((8,))},
                                  dropped=["transformer.rotary_emb.inv_freq"])
    assert_sanitize_converts_once("qwen_bias")
