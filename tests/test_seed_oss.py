"""seed_oss.py (Seed-OSS): the shared family checks (family_checks.py) on the
transformers fixtures, plus what only this family has: the separate q/k/v and o_proj
bias switches, the config dialects and defaults, and sanitize. Two-rank sharding of
FAMILY.tiny is in test_distributed.py.

Fixtures come from fixtures/make_seed_oss_reference.py: seed_oss_tf4 (hub dialect, q/k/v
biases only) and seed_oss_tf5 (as transformers 5 saves it, o_proj and MLP biases, tied).
"""

import pytest
from checkpoints import VOCAB_SIZE
from family_checks import Family, FamilyChecks, fixture_model
from sliding_checks import assert_override_matters, assert_sanitize_is_idempotent

from mlx_lm.models.seed_oss import ModelArgs

SHAPE = dict(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2, head_dim=16)
FAMILY = Family(
    fixtures=["seed_oss_tf4", "seed_oss_tf5"],
    tiny=dict(SHAPE, model_type="seed_oss", num_hidden_layers=2, vocab_size=VOCAB_SIZE, attention_out_bias=True,
              tie_word_embeddings=False, eos_token_id=0),
    small=dict(model_type="seed_oss", hidden_size=32, intermediate_size=48, num_hidden_layers=1,
               num_attention_heads=2, num_key_value_heads=1, head_dim=16, vocab_size=256),
)
ARGS = dict(SHAPE, model_type="seed_oss", num_hidden_layers=2, vocab_size=256)


class TestSeedOss(FamilyChecks):
    family = FAMILY


def test_bias_switches_are_separate():
    tf4, tf5 = fixture_model("seed_oss_tf4").layers[0], fixture_model("seed_oss_tf5").layers[0]
    assert "bias" in tf4.self_attn.q_proj and "bias" not in tf4.self_attn.o_proj and "bias" not in tf4.mlp.up_proj
    assert "bias" in tf5.self_attn.o_proj and "bias" in tf5.mlp.down_proj
    assert_override_matters("seed_oss_tf4", {"rope_theta": 10000.0})


def test_config_dialects_and_defaults():
    tf4 = ModelArgs.from_dict(dict(ARGS, rope_theta=1e7))
    tf5 = ModelArgs.from_dict(dict(ARGS, rope_parameters={"rope_type": "default", "rope_theta": 1e7}))
    assert (tf4.rope_theta, tf4.rope_scaling) == (tf5.rope_theta, tf5.rope_scaling) == (1e7, None)
    defaults = ModelArgs.from_dict({k: v for k, v in ARGS.items() if k != "head_dim"})
    assert (defaults.head_dim, defaults.qkv_bias, defaults.o_bias) == (128, True, False)
    with pytest.raises(ValueError, match=r"\(3\)"):
        ModelArgs.from_dict(dict(ARGS, num_key_value_heads=3))


def test_sanitize_is_idempotent_and_drops_what_we_compute():
    assert_sanitize_is_idempotent(FAMILY.fixtures)
