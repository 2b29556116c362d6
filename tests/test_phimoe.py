"""phimoe.py (Phi-3.5-MoE): the shared family checks (family_checks.py) on the
transformers fixtures, plus what only this family has: SparseMixer routing against a
per-token transcription of transformers' sparsemixer, the MoE block against a naive
loop, that the fixtures depend on the margin, the LongRoPE mscales, the window and the
biases, the config dialects and errors, and sanitize on every layout. Two-rank
sharding of FAMILY.tiny is in test_distributed.py.

Fixtures come from fixtures/make_phimoe_reference.py: phimoe_tf4 (hub dialect,
LongRoPE, biases) and phimoe_tf5 (as transformers 5 saves it, window 8, margin 0.3).
"""

import mlx.core as mx
import numpy as np
import pytest
from checkpoints import VOCAB_SIZE
from family_checks import Family, FamilyChecks, fixture_model
from moe_checks import assert_sanitize_layouts, fuse_per_expert, naive_moe, np_softmax, relative
from sliding_checks import assert_override_matters

from mlx_lm.models.cache import RotatingKVCache
from mlx_lm.models.phimoe import ModelArgs, sparsemixer

MOE = dict(num_local_experts=4, num_experts_per_tok=2)
FAMILY = Family(
    fixtures=["phimoe_tf4", "phimoe_tf5"],
    tiny=dict(MOE, model_type="phimoe", hidden_size=64, intermediate_size=64, num_hidden_layers=2,
              num_attention_heads=4, num_key_value_heads=2, vocab_size=VOCAB_SIZE, attention_bias=True,
              lm_head_bias=True, router_jitter_noise=0.3, tie_word_embeddings=False, eos_token_id=0),
    small=dict(MOE, model_type="phimoe", hidden_size=32, intermediate_size=32, num_hidden_layers=1,
               num_attention_heads=2, num_key_value_heads=1, vocab_size=256),
    noise=0.12,  # at 0.05 the noisy draft of phimoe_tf5 agrees on every token at k = 1
)
ARGS = dict(model_type="phimoe", hidden_size=64, intermediate_size=32, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, vocab_size=256, **MOE)


class TestPhimoe(FamilyChecks):
    family = FAMILY


def np_sparsemixer(scores: np.ndarray, eps: float):
    """transformers' sparsemixer at inference for one token's logits (E,), line by line."""
    top = scores.max()
    first = int(scores.argmax())
    masked = np.where((top - scores) / np.maximum(np.abs(scores), top) > 2 * eps, -np.inf, scores)
    w1 = np_softmax(masked)[first]
    rest = scores.copy()
    rest[first] = -np.inf
    top2, second = rest.max(), int(rest.argmax())
    masked = np.where((top2 - scores) / np.maximum(np.abs(scores), top2) > 2 * eps, -np.inf, rest)
    return [(first, w1), (second, np_softmax(masked)[second])]


@pytest.mark.parametrize("eps", [0.01, 0.3, 2.0])
def test_sparsemixer_equals_transformers_formula(eps):
    logits = mx.random.normal((3, 7, 8), key=mx.random.key(1)) * 2
    experts, weights = sparsemixer(logits, eps)
    for b, t in np.ndindex(3, 7):
        want = np_sparsemixer(np.array(logits[b, t], dtype=np.float64), eps)
        assert experts[b, t].tolist() == [e for e, _ in want]
        assert np.allclose(np.array(weights[b, t]), [w for _, w in want], atol=1e-6)
    assert mx.all(weights <= 1).item() and mx.any(weights < 0.99).item()  # the margin matters


@pytest.mark.parametrize("name", FAMILY.fixtures)
def test_moe_block_equals_a_naive_loop(name):
    model = fixture_model(name)
    block = model.layers[1].block_sparse_moe
    router = np.array(block.gate.weight, dtype=np.float64)
    x = mx.random.normal((2, 5, 64), key=mx.random.key(0))
    s = block.switch_mlp
    want = naive_moe(x, lambda v: np_sparsemixer(router @ v, model.args.router_jitter_noise),
                     s.gate_proj.weight, s.up_proj.weight, s.down_proj.weight)
    assert relative(block(x), want) < 1e-5


@pytest.mark.parametrize("name, override", [
    ("phimoe_tf5", {"router_jitter_noise": 0.01}), ("phimoe_tf5", {"sliding_window": None}),
    ("phimoe_tf4", {"rope_scaling": None}),
])
def test_fixtures_exercise_the_config(name, override):
    assert_override_matters(name, override)


def test_biases_and_norms_are_read():
    tf4 = fixture_model("phimoe_tf4")
    assert "bias" in tf4.lm_head and "bias" in tf4.layers[0].self_attn.o_proj
    assert "bias" in tf4.model.norm and "bias" in tf4.layers[0].input_layernorm
    assert [type(c) for c in fixture_model("phimoe_tf5").make_cache()] == [RotatingKVCache] * 2


def test_config_dialects_give_the_same_args():
    rope = {"rope_type": "longrope", "short_factor": [1.0] * 8, "long_factor": [2.0] * 8, "short_mscale": 1.1,
            "long_mscale": 1.3, "original_max_position_embeddings": 64}
    tf4 = ModelArgs.from_dict(dict(ARGS, rope_theta=1e4, rope_scaling=rope))
    tf5 = ModelArgs.from_dict(dict(ARGS, rope_parameters=dict(rope, rope_theta=1e4)))
    for field in ("rope_theta", "rope_scaling", "layer_types", "num_local_experts", "router_jitter_noise"):
        assert getattr(tf4, field) == getattr(tf5, field), field
    assert ModelArgs.from_dict(ARGS).router_jitter_noise == 0.01  # transformers' default


@pytest.mark.parametrize("override, message", [
    ({"num_experts_per_tok": 1}, "num_experts_per_tok is 1; phimoe's sparsemixer routes to 2"),
    ({"tie_word_embeddings": True, "lm_head_bias": True}, "lm_head_bias=True with tie_word_embeddings=True"),
    ({"sliding_window": -1}, "sliding_window is -1"),
])
def test_config_errors_name_the_value(override, message):
    with pytest.raises(ValueError, match=message):
        ModelArgs.from_dict(dict(ARGS, **override))


def in_memory(weights):
    """transformers 5's in-memory names: block_sparse_moe -> mlp, gate -> router, experts fused."""
    fused = fuse_per_expert(weights, "block_sparse_moe", "w1", "w3", "w2", into="mlp")
    return {k.replace(".block_sparse_moe.gate.", ".mlp.router."): v for k, v in fused.items()}


def test_sanitize_takes_every_layout_once():
    assert_sanitize_layouts(FAMILY.fixtures, in_memory)
