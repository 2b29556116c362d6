"""exaone.py (EXAONE 3.0 / 3.5): the shared family checks (family_checks.py) on the
transformers fixtures, plus what only EXAONE 3 has: the hub's weight names renamed to
llama's once (what transformers does on load), the hub's config aliases (num_layers,
layer_norm_epsilon, activation_function) and errors, and the default theta 5e5.

Fixtures come from fixtures/make_exaone_reference.py: exaone_tf4 (hub dialect, llama3
rope scaling) and exaone_tf5 (as transformers 5 saves it, tied); both hold the hub's
weight names, as transformers saves them.
"""

import mlx.core as mx
import pytest
from checkpoints import VOCAB_SIZE
from family_checks import Family, FamilyChecks
from layout_checks import assert_sanitize_converts_once, raw_weights
from sliding_checks import assert_override_matters

from mlx_lm.models.exaone import ModelArgs, rename_hub_weights

SHAPE = dict(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2)
FAMILY = Family(
    fixtures=["exaone_tf4", "exaone_tf5"],
    tiny=dict(SHAPE, model_type="exaone", num_layers=2, vocab_size=VOCAB_SIZE, tie_word_embeddings=False,
              eos_token_id=0),
    small=dict(model_type="exaone", hidden_size=32, intermediate_size=48, num_layers=1, num_attention_heads=2,
               num_key_value_heads=1, vocab_size=256),
)
ARGS = dict(SHAPE, model_type="exaone", vocab_size=256)


class TestExaone(FamilyChecks):
    family = FAMILY


def test_hub_names_become_llamas_once():
    raw = raw_weights("exaone_tf4")
    assert "transformer.h.0.attn.attention.out_proj.weight" in raw and "transformer.wte.weight" in raw
    once = assert_sanitize_converts_once("exaone_tf4")
    pairs = {"transformer.h.1.attn.attention.out_proj.weight": "model.layers.1.self_attn.o_proj.weight",
             "transformer.h.1.attn.attention.q_proj.weight": "model.layers.1.self_attn.q_proj.weight",
             "transformer.h.0.mlp.c_fc_0.weight": "model.layers.0.mlp.gate_proj.weight",
             "transformer.h.0.mlp.c_fc_1.weight": "model.layers.0.mlp.up_proj.weight",
             "transformer.h.0.mlp.c_proj.weight": "model.layers.0.mlp.down_proj.weight",
             "transformer.h.0.ln_1.weight": "model.layers.0.input_layernorm.weight",
             "transformer.h.0.ln_2.weight": "model.layers.0.post_attention_layernorm.weight",
             "transformer.ln_f.weight": "model.norm.weight", "transformer.wte.weight": "model.embed_tokens.weight"}
    assert all(mx.array_equal(raw[hub], once[ours]) for hub, ours in pairs.items())
    tied = assert_sanitize_converts_once("exaone_tf5", {"lm_head.weight": raw["transformer.wte.weight"]},
                                         dropped=["lm_head.weight"])
    assert "model.embed_tokens.weight" in tied
    assert rename_hub_weights({"lm_head.weight": raw["lm_head.weight"]}).keys() == {"lm_head.weight"}


def test_tf4_fixture_exercises_its_rope():
    assert_override_matters("exaone_tf4", {"rope_scaling": None})


def test_config_aliases_and_defaults():
    hub = ModelArgs.from_dict(dict(ARGS, num_layers=3, layer_norm_epsilon=1e-4, activation_function="silu",
                                   rope_theta=1e6, rope_scaling={"rope_type": "llama3", "factor": 8.0}))
    tf5 = ModelArgs.from_dict(dict(ARGS, num_hidden_layers=3, rms_norm_eps=1e-4, hidden_act="silu",
                                   rope_parameters={"rope_type": "llama3", "factor": 8.0, "rope_theta": 1e6}))
    for args in (hub, tf5):
        assert (args.num_hidden_layers, args.rms_norm_eps, args.rope_theta) == (3, 1e-4, 1e6)
        assert args.rope_scaling == {"rope_type": "llama3", "factor": 8.0}
    defaults = ModelArgs(model_type="exaone")
    assert (defaults.num_hidden_layers, defaults.rms_norm_eps, defaults.rope_theta, defaults.num_key_value_heads,
            defaults.tie_word_embeddings) == (32, 1e-5, 5e5, 8, False)


@pytest.mark.parametrize("override, match", [
    ({"num_layers": 2, "num_hidden_layers": 3}, "num_hidden_layers=3 and num_layers=2 disagree"),
    ({"activation_function": "gelu"}, "'gelu'"),
    ({"num_key_value_heads": 3}, r"\(3\)"),
])
def test_config_errors_name_the_value(override, match):
    with pytest.raises(ValueError, match=match):
        ModelArgs.from_dict(dict(ARGS, **override))
