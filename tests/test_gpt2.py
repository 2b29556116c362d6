"""gpt2.py (GPT-2): the shared family checks (family_checks.py) on the transformers
fixtures, plus what only GPT-2 has: sanitize transposing Conv1D weights and renaming
the hub's layouts once (the original upload's bare keys and mask buffers too), the
learned positions (and their end), the inverse-layer-index scale, and the config aliases
and errors. Two-rank sharding of FAMILY.tiny (c_attn split as three pieces) is in
test_distributed.py.

Fixtures come from fixtures/make_gpt2_reference.py: gpt2_tf4 (the original upload's
layout, tied) and gpt2_tf5 (as transformers 5 saves it, untied, exact gelu, the
inverse-layer-index scale); 128 learned positions.
"""

import mlx.core as mx
import pytest
from checkpoints import VOCAB_SIZE
from family_checks import FIXTURES, Family, FamilyChecks, fixture_model, reference, relative_error
from layout_checks import assert_sanitize_converts_once, raw_weights
from sliding_checks import assert_override_matters

from mlx_lm.models.cache import make_prompt_cache
from mlx_lm.models.gpt2 import ModelArgs
from mlx_lm.utils import load_model

FAMILY = Family(
    fixtures=["gpt2_tf4", "gpt2_tf5"],
    tiny=dict(model_type="gpt2", n_embd=64, n_head=4, n_layer=2, n_positions=128, vocab_size=VOCAB_SIZE,
              eos_token_id=0),
    small=dict(model_type="gpt2", n_embd=32, n_head=2, n_layer=1, n_positions=128, vocab_size=256),
)
ARGS = dict(model_type="gpt2", n_embd=64, n_head=4, n_layer=2, n_positions=128, vocab_size=256)


class TestGpt2(FamilyChecks):
    family = FAMILY


def test_sanitize_transposes_conv1d_and_renames_once():
    for name, prefix in (("gpt2_tf4", ""), ("gpt2_tf5", "transformer.")):
        raw = raw_weights(name)
        buffers = [k for k in raw if k.endswith((".attn.bias", ".attn.masked_bias"))]
        assert (len(buffers) == 4) == (name == "gpt2_tf4")
        once = assert_sanitize_converts_once(name, dropped=buffers)
        for piece in ("attn.c_attn", "attn.c_proj", "mlp.c_fc", "mlp.c_proj"):
            conv = raw[f"{prefix}h.1.{piece}.weight"]  # (in, out)
            assert mx.array_equal(once[f"model.h.1.{piece}.weight"], conv.T), (name, piece)
            assert mx.array_equal(once[f"model.h.1.{piece}.bias"], raw[f"{prefix}h.1.{piece}.bias"])
        assert mx.array_equal(once["model.wpe.weight"], raw[f"{prefix}wpe.weight"])
    tied = assert_sanitize_converts_once("gpt2_tf4", {"lm_head.weight": raw_weights("gpt2_tf4")["wte.weight"]},
                                         dropped=["lm_head.weight"])
    assert "model.wte.weight" in tied


def test_tf5_fixture_exercises_its_features():
    """Without the inverse-layer-index scale: far off. The tanh approximation instead of
    the exact gelu is close (within 5e-4 per unit) but clearly not what transformers ran."""
    assert_override_matters("gpt2_tf5", {"scale_attn_by_inverse_layer_idx": False})
    ids, want = reference("gpt2_tf5")
    approximate, _ = load_model(FIXTURES / "gpt2_tf5", model_config={"activation_function": "gelu_new"})
    assert relative_error(approximate(ids), want) > 10 * relative_error(fixture_model("gpt2_tf5")(ids), want)


def test_positions_are_learned_and_end():
    model = fixture_model("gpt2_tf4")
    ids = mx.array([[5, 5, 5]])
    logits = model(ids)
    assert not mx.allclose(logits[0, 0], logits[0, 2])  # same token, different positions
    cache = make_prompt_cache(model)
    model(mx.zeros((1, 127), dtype=mx.int32), cache=cache)
    model(mx.array([[1]]), cache=cache)  # position 127, the last of 128
    with pytest.raises(ValueError, match="exceed the model's 128 learned positions"):
        model(mx.array([[1]]), cache=cache)


def test_config_aliases_and_errors():
    short = ModelArgs.from_dict(ARGS)
    long = ModelArgs.from_dict(dict(model_type="gpt2", hidden_size=64, num_attention_heads=4, num_hidden_layers=2,
                                    max_position_embeddings=128, vocab_size=256))
    for args in (short, long):
        assert (args.n_embd, args.n_head, args.n_layer, args.n_positions, args.n_inner) == (64, 4, 2, 128, 256)
    defaults = ModelArgs(model_type="gpt2")
    assert (defaults.n_embd, defaults.n_positions, defaults.tie_word_embeddings) == (768, 1024, True)
    for override, match in (({"hidden_size": 32}, "n_embd=64 and hidden_size=32 disagree"),
                            ({"n_head": 5}, r"\(64\) must be a multiple of n_head \(5\)"),
                            ({"activation_function": "mish"}, "activation_function 'mish'"),
                            ({"add_cross_attention": True}, "add_cross_attention")):
        with pytest.raises(ValueError, match=match):
            ModelArgs.from_dict(dict(ARGS, **override))
