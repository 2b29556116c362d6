"""llama4.py against transformers (the shared FamilyChecks), and what only Llama 4 has:
chunked attention against a naive loop, the NoPE query temperature, the sigmoid router
that scales each expert's input, its config dialects and weight layouts, and exact
rollback of the chunked caches across chunk boundaries.

Fixtures under tests/fixtures/llama4_<dialect>/ come from make_llama4_reference.py:
llama4_tf5 a Llama4ForCausalLM in the transformers-5 dialect (chunks of 8, top-2 MoE on
every 2nd layer, explicit NoPE layers, tied embeddings), llama4_tf4 a
Llama4ForConditionalGeneration whose text config is in the hub checkpoints' dialect
(chunks of 6, top-1 MoE everywhere, QK norm, llama3 rope), with a vision tower to drop.
T = 40 crosses every chunk edge several times.
"""

import json
import math

import mlx.core as mx
import numpy as np
import pytest
from checkpoints import perturb
from family_checks import (
    FIXTURES,
    PROMPT,
    Family,
    FamilyChecks,
    fixture_model,
    flat_state,
    fresh_model,
    plain,
    reference,
    relative_error,
    speculate,
)

from mlx_lm.generate import SpeculationStats
from mlx_lm.models.batch_cache import BatchChunkedKVCache, extract_caches, merge_caches
from mlx_lm.models.cache import ChunkedKVCache, KVCache, make_prompt_cache, trim_prompt_cache
from mlx_lm.models.llama4 import (
    CHUNKED,
    FULL,
    ModelArgs,
    TextModelArgs,
    attention_temperature,
    query_positions,
    sigmoid_top_k,
)
from mlx_lm.models.masks import chunked_mask_for_positions, create_chunked_mask
from mlx_lm.utils import load_model

TINY = dict(model_type="llama4_text", vocab_size=512, hidden_size=64, intermediate_size=32, intermediate_size_mlp=64,
            num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_local_experts=4,
            num_experts_per_tok=2, interleave_moe_layer_step=2, attention_chunk_size=8, floor_scale=8, attn_scale=0.5,
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0}, eos_token_id=0)
SMALL = dict(model_type="llama4_text", vocab_size=256, hidden_size=32, intermediate_size=16, intermediate_size_mlp=32,
             num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1, head_dim=16, num_local_experts=2,
             no_rope_layers=[1, 0], attention_chunk_size=4, floor_scale=4)

FAMILY = Family(fixtures=["llama4_tf4", "llama4_tf5"], tiny=TINY, small=SMALL)


class TestLlama4(FamilyChecks):
    family = FAMILY


def fixture_config(name):
    return json.loads((FIXTURES / name / "config.json").read_text())


# --- pure math against naive references --------------------------------------------------


@pytest.mark.parametrize("chunk", [1, 3, 8])
def test_chunked_mask_matches_a_naive_loop(chunk):
    offset, num_queries = 5, 13
    got = np.array(create_chunked_mask(num_queries, offset, chunk))
    want = np.array([[j <= offset + i and j // chunk == (offset + i) // chunk for j in range(offset + num_queries)]
                     for i in range(num_queries)])
    assert (got == want).all()
    # A column holding no token (position -1) is in no chunk.
    assert not chunked_mask_for_positions(mx.array([[0]]), mx.array([[-1, 0]]), chunk)[0, 0].item()
    with pytest.raises(ValueError, match="chunk_size must be at least 1, got 0"):
        create_chunked_mask(2, 0, 0)


def test_attention_temperature_matches_the_formula():
    positions = mx.array([[0, 3, 4, 8, 9, 40, 99]])
    got = attention_temperature(positions, floor_scale=5, attn_scale=0.5).tolist()[0]
    want = [1 + 0.5 * math.log1p(math.floor((p + 1) / 5)) for p in positions.tolist()[0]]
    assert np.allclose(got, want, rtol=1e-6)
    assert query_positions(7, 3).tolist() == [[7, 8, 9]]
    assert query_positions(mx.array([2, 5]), 2).tolist() == [[2, 3], [5, 6]]


def naive_moe(moe, x):
    """Transformers' rule token by token: every expert sees the token times its score
    (0 unless in the top k), plus the shared expert."""
    logits = moe.router(x)
    out = moe.shared_expert(x)
    rows = []
    E = logits.shape[-1]
    for t in range(x.shape[1]):
        token, top = x[0, t], np.argsort(-np.array(logits[0, t]))[: moe.top_k]
        total = out[0, t]
        for e in range(E):
            score = 1 / (1 + math.exp(-logits[0, t, e].item())) if e in top else 0.0
            scaled = token * score
            gate, up = scaled @ moe.experts.gate_proj.weight[e].T, scaled @ moe.experts.up_proj.weight[e].T
            total = total + (mx.sigmoid(gate) * gate * up) @ moe.experts.down_proj.weight[e].T
        rows.append(total)
    return mx.stack(rows)[None]


@pytest.mark.parametrize("name", ["llama4_tf4", "llama4_tf5"])
def test_moe_matches_a_naive_loop(name):
    model = fixture_model(name)
    moe = next(layer.feed_forward for layer in model.layers if hasattr(layer.feed_forward, "router"))
    x = mx.random.normal((1, 9, 64), key=mx.random.key(3))
    assert mx.allclose(moe(x), naive_moe(moe, x), atol=1e-5, rtol=1e-5)
    experts, scores = sigmoid_top_k(mx.array([[0.5, -1.0, 2.0]]), 2)
    assert sorted(experts.tolist()[0]) == [0, 2]
    assert np.allclose(sorted(scores.tolist()[0]), sorted([1 / (1 + math.exp(-0.5)), 1 / (1 + math.exp(-2.0))]))


# --- config dialects and errors -------------------------------------------------------------


def test_fixtures_cover_both_layouts_and_layer_kinds():
    tf4, tf5 = fixture_model("llama4_tf4"), fixture_model("llama4_tf5")
    assert type(tf4).__name__ == "ConditionalGeneration" and type(tf5).__name__ == "LanguageModel"
    # tf4: hub's empty no_rope_layers -> NoPE every 4th layer, which is then full attention.
    assert [layer.layer_type for layer in tf4.layers] == [CHUNKED, CHUNKED, CHUNKED, FULL]
    assert [layer.self_attn.use_rope for layer in tf4.layers] == [True, True, True, False]
    assert [layer.self_attn.temperature_tuning for layer in tf4.layers] == [False, False, False, True]
    assert all(layer.self_attn.use_qk_norm == layer.self_attn.use_rope for layer in tf4.layers)
    assert [hasattr(layer.feed_forward, "router") for layer in tf5.layers] == [False, True, False, True]
    assert [type(c) for c in tf5.make_cache()] == [ChunkedKVCache, KVCache, ChunkedKVCache, KVCache]
    assert tf5.make_cache()[0].chunk_size == 8 and tf4.make_cache()[0].chunk_size == 6


def tf5_dialect(text: dict) -> dict:
    """The hub text config as transformers 5 would write it."""
    out = dict(text)
    rope = dict(out.pop("rope_scaling"), rope_theta=out.pop("rope_theta"))
    n = out["num_hidden_layers"]
    no_rope = [int((i + 1) % out["no_rope_layer_interval"] != 0) for i in range(n)]
    return dict(out, rope_parameters=rope, no_rope_layers=no_rope, attn_temperature_tuning=True,
                layer_types=[CHUNKED if r else FULL for r in no_rope], moe_layers=list(range(n)))


def test_tf4_and_tf5_configs_read_the_same():
    hub = fixture_config("llama4_tf4")
    scout_style = dict(hub, text_config=dict(hub["text_config"], attn_temperature_tuning=4))  # Scout writes an int
    tf4 = ModelArgs.from_dict(scout_style).text_args
    tf5 = ModelArgs.from_dict(dict(hub, text_config=tf5_dialect(hub["text_config"]))).text_args
    text_only = ModelArgs.from_dict(dict(tf5_dialect(hub["text_config"]), model_type="llama4_text")).text_args
    for field in ("no_rope_layers", "layer_types", "moe_layers", "rope_theta", "rope_scaling", "attention_chunk_size"):
        assert getattr(tf4, field) == getattr(tf5, field) == getattr(text_only, field), field
    assert bool(tf4.attn_temperature_tuning) and tf4.rope_scaling["rope_type"] == "llama3"
    assert TextModelArgs().rope_theta == 500000.0  # transformers' default theta


@pytest.mark.parametrize("change, message", [
    (dict(attention_chunk_size=None, layer_types=[CHUNKED, FULL]), "attention_chunk_size is None"),
    (dict(layer_types=[CHUNKED, "sliding_attention"]), r"unknown kinds \['sliding_attention'\]"),
    (dict(no_rope_layers=[1, 2]), r"got \[1, 2\]"),
    (dict(no_rope_layers=None, no_rope_layer_interval=0), "no_rope_layer_interval must be >= 1, got 0"),
    (dict(interleave_moe_layer_step=0), "interleave_moe_layer_step must be >= 1, got 0"),
    (dict(moe_layers=[5]), r"moe_layers \[5\]"),
    (dict(num_experts_per_tok=3), r"num_experts_per_tok \(3\)"),
    (dict(hidden_act="gelu"), "hidden_act 'gelu'"),
    (dict(num_key_value_heads=3), r"num_key_value_heads \(3\)"),
])
def test_config_errors_name_the_value(change, message):
    with pytest.raises(ValueError, match=message):
        ModelArgs.from_dict(dict(SMALL, **change))


def test_conditional_config_errors():
    hub = fixture_config("llama4_tf4")
    with pytest.raises(ValueError, match="needs a text_config dict"):
        ModelArgs.from_dict(dict(hub, text_config=None))
    with pytest.raises(ValueError, match="tie_word_embeddings is True but text_config.tie_word_embeddings is False"):
        ModelArgs.from_dict(dict(hub, tie_word_embeddings=True))


# --- weights ------------------------------------------------------------------------------


def assert_same(a, b):
    assert sorted(a) == sorted(b) and all(mx.array_equal(a[k], b[k]) for k in a)


@pytest.mark.parametrize("name", ["llama4_tf4", "llama4_tf5"])
def test_sanitize_converts_the_hf_layout_once(name):
    model = fixture_model(name)
    raw = mx.load(str(FIXTURES / name / "model.safetensors"))
    once = model.sanitize(raw)
    assert_same(model.sanitize(dict(once)), once)
    assert not any(k.startswith(("vision_model.", "multi_modal_projector.")) for k in once)
    prefix = "language_model.model" if name == "llama4_tf4" else "model"
    moe = f"{prefix}.layers.1.feed_forward.experts"
    gate_up, down = raw[f"{moe}.gate_up_proj"], raw[f"{moe}.down_proj"]  # (E, hidden, 2I), (E, I, hidden)
    I = down.shape[1]
    assert mx.array_equal(once[f"{moe}.gate_proj.weight"], gate_up[..., :I].swapaxes(1, 2))
    assert mx.array_equal(once[f"{moe}.up_proj.weight"], gate_up[..., I:].swapaxes(1, 2))
    assert mx.array_equal(once[f"{moe}.down_proj.weight"], down.swapaxes(1, 2))
    # A tied checkpoint's lm_head copy (upstream converters write one) is dropped.
    head = "lm_head.weight" if name == "llama4_tf5" else "language_model.lm_head.weight"
    with_head = model.sanitize(dict(raw, **{head: raw[f"{prefix}.embed_tokens.weight"]}))
    assert (head in with_head) == (name == "llama4_tf4")


def test_text_tower_weights_load_as_llama4_text(tmp_path):
    """The text model of a Llama4ForConditionalGeneration checkpoint, saved as a
    Llama4ForCausalLM one (`model.*` names, the text config at the top level), gives the
    same logits."""
    hub = fixture_config("llama4_tf4")
    model = fixture_model("llama4_tf4")
    ids, want = reference("llama4_tf4")
    weights = model.language_model.sanitize({k[len("language_model."):]: v for k, v in
                                             model.sanitize(mx.load(str(FIXTURES / "llama4_tf4" /
                                                                        "model.safetensors"))).items()})
    mx.save_safetensors(str(tmp_path / "model.safetensors"), weights)
    (tmp_path / "config.json").write_text(json.dumps(dict(hub["text_config"], model_type="llama4_text")))
    text_only = load_model(tmp_path)[0]
    assert relative_error(text_only(ids), want) < 1e-4


# --- chunked caches: rollback across chunk boundaries ----------------------------------------


def test_verify_across_a_chunk_edge_rolls_back_bit_for_bit():
    """A verify that enters the next chunk (evicting the old chunk's rows from the ring),
    trimmed back into the old chunk, restores every cache bit for bit and continues
    like a cache that never saw it."""
    model = fixture_model("llama4_tf5")  # chunks of 8; PROMPT is 20 tokens: 4 into chunk 2
    for k in (1, 3, 6):
        for fill in (3, 4):  # the verify starts 1 or 0 tokens before the edge at 24
            base = make_prompt_cache(model)
            model(mx.array([PROMPT.tolist() + PROMPT.tolist()[:fill]]), cache=base)
            before = [mx.array(x) for x in flat_state(base)]
            for c in base:
                c.start_speculation()
            model(mx.array([[7, 8, 9, 10, 11, 12, 13][: k + 1]]), cache=base)
            trim_prompt_cache(base, k + 1)
            assert all(mx.array_equal(x, y) for x, y in zip(flat_state(base), before)), (k, fill)
            fresh = make_prompt_cache(model)
            model(mx.array([PROMPT.tolist() + PROMPT.tolist()[:fill]]), cache=fresh)
            follow = mx.array([[1, 2, 3, 4, 5, 6, 7, 8, 9]])
            assert mx.array_equal(model(follow, cache=base), model(follow, cache=fresh)), (k, fill)


def test_batched_chunked_cache_masks_per_row_and_extracts():
    """Rows of different lengths masked by their own chunks (counted from each row's
    first token) equal their solo logits; extract gives ChunkedKVCache rows back."""
    model = fixture_model("llama4_tf5")
    prompts = [PROMPT.tolist()[:11], PROMPT.tolist()[:3]]
    rows = []
    for p in prompts:
        cache = make_prompt_cache(model)
        model(mx.array([p]), cache=cache)
        rows.append(cache)
    batched = merge_caches(rows)
    assert isinstance(batched[0], BatchChunkedKVCache)
    step = mx.array([[5, 6, 7, 8, 9, 10]] * 2)
    got = model(step, cache=batched)
    for b, p in enumerate(prompts):
        want = model(mx.array([p + step[b].tolist()]))[:, len(p):]
        assert relative_error(got[b : b + 1], want) < 1e-5, b
    back = extract_caches(batched, 1)
    assert [type(c) for c in back] == [ChunkedKVCache, KVCache, ChunkedKVCache, KVCache]
    assert back[0].offset == 9 and back[0].size() == 8


def test_hub_dialect_target_speculates_exactly_across_chunks_of_six():
    """The Scout-like fixture (chunks of 6: the 50 tokens cross 8 edges) as target of its
    noisy self at k = 6: greedy output equals plain, with partial acceptance."""
    target = fixture_model("llama4_tf4")
    draft = perturb(fresh_model("llama4_tf4"), FAMILY.noise, seed=2)
    stats = SpeculationStats()
    assert [t for t, _, _ in speculate(target, draft, 6, stats=stats)] == plain(target)
    assert 0 < stats.num_accepted < stats.num_drafted


def test_chunked_layers_hold_one_chunk():
    """40 tokens through chunks of 8: each chunked layer's buffers hold 8 rows, the full
    layers' all 40."""
    model = fixture_model("llama4_tf5")
    ids, _ = reference("llama4_tf5")
    cache = make_prompt_cache(model)
    model(ids, cache=cache)
    assert [c.keys.shape[2] for c in cache[:2]] == [8, 256]  # KVCache grows in blocks of 256
    assert [c.size() for c in cache] == [8, 40, 8, 40]
