"""afmoe.py (AFMoE, Arcee's Trinity): the shared family checks (family_checks.py) on the
transformers fixtures, plus what only AFMoE has: the window as transformers defines it
(a key at distance window - 1 is seen, one at distance window is not, with and without
the ring buffer), NoPE on the global layers, that the fixtures depend on the window,
muP scaling, route_scale, the rope and the layer pattern, the config dialects and
errors, and sanitize over the saved, fused and MLX layouts. Its sharded output gate,
shared expert and experts are checked by test_distributed.py, which shards FAMILY.tiny
over two ranks.

Fixtures come from fixtures/make_afmoe_reference.py (sliding_window 8, 40 tokens):
afmoe_tf4 in the transformers-4 dialect, afmoe_tf5 as transformers 5 saves it.
"""

import mlx.core as mx
import pytest
from checkpoints import VOCAB_SIZE
from family_checks import FIXTURES, Family, FamilyChecks, fixture_model, random_model
from sliding_checks import assert_override_matters, assert_sanitize_is_idempotent

from mlx_lm.models.afmoe import FULL, SLIDING, ModelArgs
from mlx_lm.models.cache import KVCache, RotatingKVCache, make_prompt_cache

SHAPE = dict(model_type="afmoe", hidden_size=64, intermediate_size=64, moe_intermediate_size=16,
             num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_experts=4,
             num_experts_per_tok=2, num_shared_experts=1, sliding_window=8)

FAMILY = Family(
    fixtures=["afmoe_tf4", "afmoe_tf5"],
    tiny=dict(SHAPE, layer_types=[SLIDING, FULL] * 2, vocab_size=VOCAB_SIZE, eos_token_id=0, mup_enabled=True,
              route_scale=2.0),
    small=dict(SHAPE, hidden_size=32, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
               layer_types=[SLIDING, FULL], vocab_size=256),
)


class TestAfmoe(FamilyChecks):
    family = FAMILY


IDS = mx.array([[(i * 37 + 11) % 256 for i in range(20)]])


def last_logits(model, ids: mx.array, cached: bool) -> mx.array:
    """The last position's logits, fed at once or token by token through the caches."""
    if not cached:
        return model(ids)[:, -1]
    cache = make_prompt_cache(model)
    for i in range(ids.shape[1]):
        out = model(ids[:, i : i + 1], cache=cache)
    return out[:, -1]


def one_layer(kind: str):
    return random_model(dict(SHAPE, num_hidden_layers=1, num_dense_layers=1, layer_types=[kind], vocab_size=256))


@pytest.mark.parametrize("cached", [False, True])
def test_window_sees_distance_window_minus_one_only(cached):
    model = one_layer(SLIDING)
    assert isinstance(model.make_cache()[0], RotatingKVCache)
    base = last_logits(model, IDS, cached)
    for distance, seen in ((7, True), (8, False)):
        changed = mx.array(IDS)
        changed[0, 19 - distance] = (IDS[0, 19 - distance].item() + 1) % 256
        moved = mx.abs(last_logits(model, changed, cached) - base).max().item()
        assert (moved > 1e-3) if seen else moved == 0.0, (distance, moved)


@pytest.mark.parametrize("cached", [False, True])
def test_global_layers_have_no_positions(cached):
    """NoPE: the last query of a global layer attends to a set of keys, so reordering
    the earlier tokens leaves its logits unchanged (up to summation order)."""
    model = one_layer(FULL)
    assert isinstance(model.make_cache()[0], KVCache) and not model.layers[0].self_attn.uses_rope
    shuffled = mx.concatenate([IDS[:, :-1][:, ::-1], IDS[:, -1:]], axis=1)
    assert mx.allclose(last_logits(model, IDS, cached), last_logits(model, shuffled, cached), atol=1e-4)
    sliding = one_layer(SLIDING)
    assert not mx.allclose(sliding(IDS)[:, -1], sliding(shuffled)[:, -1], atol=1e-2)


@pytest.mark.parametrize("name, override", [
    ("afmoe_tf5", {"sliding_window": 1000}),
    ("afmoe_tf4", {"mup_enabled": False}),
    ("afmoe_tf4", {"route_scale": 1.0}),
    ("afmoe_tf4", {"rope_theta": 10000.0}),
    ("afmoe_tf4", {"global_attn_every_n_layers": 4}),
    ("afmoe_tf5", {"layer_types": [FULL, SLIDING, SLIDING, SLIDING]}),
])
def test_fixtures_exercise_every_feature(name, override):
    assert_override_matters(name, override)


def test_layer_kinds_and_caches():
    model = fixture_model("afmoe_tf5")
    assert [type(c) for c in model.make_cache()] == [RotatingKVCache, RotatingKVCache, KVCache, RotatingKVCache]
    assert [type(layer.mlp).__name__ for layer in model.layers] == ["MLP", "MLP", "MoE", "MoE"]
    assert [layer.self_attn.uses_rope for layer in model.layers] == [True, True, False, True]


def test_config_dialects_give_the_same_args():
    yarn = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 1024}
    tf4 = ModelArgs.from_dict(dict(SHAPE, rope_theta=5e4, rope_scaling=yarn, global_attn_every_n_layers=2))
    tf5 = ModelArgs.from_dict(dict(SHAPE, layer_types=[SLIDING, FULL] * 2, rope_parameters=dict(yarn, rope_theta=5e4)))
    for field in ("layer_types", "rope_theta", "rope_scaling", "num_key_value_heads"):
        assert getattr(tf4, field) == getattr(tf5, field), field
    defaults = ModelArgs.from_dict({k: v for k, v in SHAPE.items() if k != "num_key_value_heads"})
    assert defaults.layer_types == [SLIDING] * 3 + [FULL] and defaults.rope_theta == 10000.0
    assert defaults.num_key_value_heads == 4


@pytest.mark.parametrize("override, message", [
    ({"score_func": "softmax"}, "'softmax'"),
    ({"route_norm": False}, "route_norm False"),
    ({"n_group": 2, "topk_group": 1}, "n_group 2"),
    ({"global_attn_every_n_layers": 0}, "got 0"),
    ({"layer_types": [SLIDING, "chunked_attention", FULL, FULL]}, "chunked_attention"),
    ({"sliding_window": None}, "sliding_window is None"),
    ({"num_key_value_heads": 3}, r"\(3\)"),
    ({"rope_parameters": {"rope_theta": 1e4, "partial_rotary_factor": 0.5}}, "0.5"),
    ({"num_dense_layers": 5}, "num_dense_layers 5"),
    ({"hidden_act": "gelu"}, "'gelu'"),
    ({"num_shared_experts": -1}, "got -1"),
])
def test_config_errors_name_the_value(override, message):
    with pytest.raises(ValueError, match=message):
        ModelArgs.from_dict(dict(SHAPE, **override))


def test_sanitize_is_idempotent_and_drops_what_we_compute():
    assert_sanitize_is_idempotent(FAMILY.fixtures)


def test_sanitize_reads_transformers_fused_layout():
    """transformers' in-memory experts (gate_up_proj (E, 2I, D), down_proj (E, D, I))
    sanitize to what the saved per-expert layout gives."""
    model = fixture_model("afmoe_tf4")
    raw = mx.load(str(FIXTURES / "afmoe_tf4" / "model.safetensors"))
    want = model.sanitize(dict(raw))
    fused = {k: v for k, v in raw.items() if ".mlp.experts." not in k}
    for i in (1, 2, 3):
        stem = f"model.layers.{i}.mlp.experts"
        stack = {p: mx.stack([raw[f"{stem}.{e}.{p}.weight"] for e in range(4)]) for p in ("gate_proj", "up_proj")}
        fused[f"{stem}.gate_up_proj"] = mx.concatenate([stack["gate_proj"], stack["up_proj"]], axis=1)
        fused[f"{stem}.down_proj"] = mx.stack([raw[f"{stem}.{e}.down_proj.weight"] for e in range(4)])
    got = model.sanitize(fused)
    assert got.keys() == want.keys() and all(mx.array_equal(got[k], want[k]) for k in want)


def test_no_shared_expert_when_there_are_none():
    """num_shared_experts 0: transformers' zero-unit MLP adds zeros; we build none."""
    model = random_model(dict(SHAPE, num_shared_experts=0, vocab_size=256))
    moe = model.layers[-1].mlp
    assert not moe.has_shared and "shared_experts" not in moe
    assert model(IDS).shape == (1, 20, 256)
