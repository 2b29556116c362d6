"""mixtral.py: the shared family checks (family_checks.py) on the transformers fixtures,
plus what only Mixtral has: the MoE block (softmax top-k, always renormalised) against
a naive per-token loop, the window on every layer, the config dialects and errors, and
sanitize on every layout. Two-rank sharding of FAMILY.tiny is in test_distributed.py.

Fixtures come from fixtures/make_mixtral_reference.py: mixtral_tf4 (hub dialect,
sliding_window 8) and mixtral_tf5 (as transformers 5 saves it, no window, tied).
"""

import pytest
from checkpoints import VOCAB_SIZE
from family_checks import Family, FamilyChecks, fixture_model
from moe_checks import assert_block_equals_naive, assert_sanitize_layouts, fuse_per_expert, softmax_top_k
from sliding_checks import assert_override_matters

from mlx_lm.models.cache import KVCache, RotatingKVCache
from mlx_lm.models.mixtral import ModelArgs
from mlx_lm.models.switch_layers import SwitchLinear

MOE = dict(num_local_experts=4, num_experts_per_tok=2)
FAMILY = Family(
    fixtures=["mixtral_tf4", "mixtral_tf5"],
    tiny=dict(MOE, model_type="mixtral", hidden_size=64, intermediate_size=64, num_hidden_layers=2,
              num_attention_heads=4, num_key_value_heads=2, vocab_size=VOCAB_SIZE, sliding_window=8,
              tie_word_embeddings=False, eos_token_id=0),
    small=dict(MOE, model_type="mixtral", hidden_size=32, intermediate_size=32, num_hidden_layers=1,
               num_attention_heads=2, num_key_value_heads=1, vocab_size=256),
)
ARGS = dict(model_type="mixtral", hidden_size=64, intermediate_size=32, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, vocab_size=256, **MOE)


class TestMixtral(FamilyChecks):
    family = FAMILY


@pytest.mark.parametrize("name", FAMILY.fixtures)
def test_moe_block_equals_a_naive_loop(name):
    """Softmax over all experts, the k best renormalised to sum to 1."""
    block = fixture_model(name).layers[1].block_sparse_moe
    assert_block_equals_naive(block, softmax_top_k(block.gate.weight, 2, normalize=True), 64)


def test_a_window_makes_every_layer_slide():
    assert [type(c) for c in fixture_model("mixtral_tf4").make_cache()] == [RotatingKVCache] * 2
    assert [type(c) for c in fixture_model("mixtral_tf5").make_cache()] == [KVCache] * 2
    assert_override_matters("mixtral_tf4", {"sliding_window": None})
    assert_override_matters("mixtral_tf4", {"rope_theta": 10000.0})


def test_config_dialects_give_the_same_args():
    tf4 = ModelArgs.from_dict(dict(ARGS, rope_theta=1e6, sliding_window=8))
    tf5 = ModelArgs.from_dict(dict(ARGS, rope_parameters={"rope_type": "default", "rope_theta": 1e6}, sliding_window=8))
    for field in ("rope_theta", "rope_scaling", "layer_types", "num_local_experts", "rms_norm_eps"):
        assert getattr(tf4, field) == getattr(tf5, field), field
    assert tf4.rms_norm_eps == 1e-5  # Mixtral's default, not llama's
    assert ModelArgs.from_dict(ARGS).layer_types == ["full_attention"] * 2  # no window: full attention


@pytest.mark.parametrize("override, message", [
    ({"num_experts_per_tok": 5}, r"num_experts_per_tok \(5\) must be in 1..num_local_experts \(4\)"),
    ({"num_experts_per_tok": 0}, r"num_experts_per_tok \(0\)"),
    ({"sliding_window": 0}, "sliding_window is 0"),
    ({"num_key_value_heads": 3}, r"\(3\)"),
])
def test_config_errors_name_the_value(override, message):
    with pytest.raises(ValueError, match=message):
        ModelArgs.from_dict(dict(ARGS, **override))


def in_memory(weights):
    """transformers 5's in-memory names: block_sparse_moe -> mlp, experts fused."""
    fused = fuse_per_expert(weights, "block_sparse_moe", "w1", "w3", "w2", into="mlp")
    return {k.replace(".block_sparse_moe.", ".mlp."): v for k, v in fused.items()}


def test_sanitize_takes_every_layout_once():
    assert_sanitize_layouts(FAMILY.fixtures, in_memory)


def test_quant_predicate_keeps_the_router_at_8_bits():
    model = fixture_model("mixtral_tf4")
    assert model.quant_predicate("model.layers.0.block_sparse_moe.gate", model.layers[0].block_sparse_moe.gate) == {
        "group_size": 64, "bits": 8}
    assert model.quant_predicate("model.layers.0.block_sparse_moe.switch_mlp.up_proj", SwitchLinear(4, 4, 2)) is True
