"""dots1.py (dots.llm1): the shared family checks (family_checks.py) on the transformers
fixtures, plus what only this family has beyond glm4_moe: the MoE block against the
naive loop (glm4_moe's router), the sliding layers from max_window_layers on, the
whole-head rope with q/k norms and o_proj biases, the config dialects and errors, and
sanitize on every layout. Two-rank sharding of FAMILY.tiny is in test_distributed.py.

Fixtures come from fixtures/make_dots1_reference.py: dots1_tf4 (hub dialect, a dense
first layer, a sliding second one, 2 groups keeping 1, scaling 2) and dots1_tf5 (as
transformers 5 saves it, layer_types all full, renormalised, biases, tied).
"""

import pytest
from checkpoints import VOCAB_SIZE
from family_checks import Family, FamilyChecks, fixture_model
from moe_checks import assert_sanitize_layouts, assert_shared_moe_equals_naive, fused_mlp_experts
from sliding_checks import assert_override_matters

from mlx_lm.models.cache import KVCache, RotatingKVCache
from mlx_lm.models.dots1 import ModelArgs

MOE = dict(n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, n_shared_experts=1)
FAMILY = Family(
    fixtures=["dots1_tf4", "dots1_tf5"],
    tiny=dict(MOE, model_type="dots1", hidden_size=64, intermediate_size=128, num_hidden_layers=2,
              num_attention_heads=4, num_key_value_heads=2, head_dim=16, first_k_dense_replace=1,
              sliding_window=8, max_window_layers=1, attention_bias=True, vocab_size=VOCAB_SIZE,
              tie_word_embeddings=False, eos_token_id=0),
    small=dict(MOE, model_type="dots1", hidden_size=32, intermediate_size=48, num_hidden_layers=1,
               num_attention_heads=2, num_key_value_heads=1, vocab_size=256),
)
ARGS = dict(MOE, model_type="dots1", hidden_size=64, intermediate_size=96, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, head_dim=16, vocab_size=256)


class TestDots1(FamilyChecks):
    family = FAMILY


@pytest.mark.parametrize("name", FAMILY.fixtures)
def test_moe_block_equals_a_naive_loop(name):
    model = fixture_model(name)
    assert_shared_moe_equals_naive(model.layers[1].mlp, model.args)


def test_layers_slide_from_max_window_layers_on():
    assert [type(c) for c in fixture_model("dots1_tf4").make_cache()] == [KVCache, RotatingKVCache]
    assert [type(c) for c in fixture_model("dots1_tf5").make_cache()] == [KVCache, KVCache]
    assert_override_matters("dots1_tf4", {"sliding_window": None})
    assert_override_matters("dots1_tf4", {"topk_group": 2})


def test_whole_head_rope_norms_and_biases():
    model = fixture_model("dots1_tf5")
    assert model.args.rotary_dims == 16 and "q_norm" in model.layers[0].self_attn
    assert "bias" in model.layers[0].self_attn.o_proj


def test_config_dialects_give_the_same_args():
    tf4 = ModelArgs.from_dict(dict(ARGS, rope_theta=1e4))
    tf5 = ModelArgs.from_dict(dict(ARGS, rope_parameters={"rope_type": "default", "rope_theta": 1e4},
                                   layer_types=["full_attention"] * 2))
    for field in ("rope_theta", "rope_scaling", "rotary_dims", "layer_types", "first_k_dense_replace"):
        assert getattr(tf4, field) == getattr(tf5, field), field


@pytest.mark.parametrize("override, message", [
    ({"n_shared_experts": None}, "dots1 configs must give n_shared_experts"),
    ({"n_group": 3}, r"n_group \(3\) must divide n_routed_experts \(4\)"),
    ({"sliding_window": 0, "max_window_layers": 0}, "sliding_window is 0"),
])
def test_config_errors_name_the_value(override, message):
    with pytest.raises(ValueError, match=message):
        ModelArgs.from_dict(dict(ARGS, **override))


def test_sanitize_takes_every_layout_once():
    assert_sanitize_layouts(FAMILY.fixtures, fused_mlp_experts)
