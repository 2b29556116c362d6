"""phi3.py against transformers, through its caches, under speculation and quantized.

Fixtures come from fixtures/make_phi3_reference.py: tiny random Phi-3 checkpoints saved
by transformers, 24 tokens each. phi3_tf4 (plain rope, sliding window 8: every window
edge crossed), phi3_longrope_tf4 (Phi-3.5 style longrope, transformers-4 dialect) and
phi3_longrope_tf5 (Phi-4-mini style: partial rotary 0.75, tied embeddings, a window
beyond max positions; transformers-5 dialect); both longrope ones switch factors at
original_max_position_embeddings 16, inside the sequence.

Our rope is a function of the position, so every chunking gives transformers'
token-by-token logits (`incremental_logits`). transformers' one full forward over 24
tokens rotates positions 0..15 with the long factors too (it switches per call), so for
the longrope fixtures that reference is a different law, and the tests say so.
"""

import copy

import mlx.core as mx
import mlx.nn as nn
import pytest
from checkpoints import write_checkpoint
from conftest import FIXTURES
from mlx.utils import tree_flatten
from test_gpt_oss import decode_in_chunks, relative_error
from test_speculative import accepted_per_round

from mlx_lm.convert import convert
from mlx_lm.generate import SpeculationStats, generate_step, speculative_generate_step
from mlx_lm.models.cache import KVCache, RotatingKVCache
from mlx_lm.models.phi3 import ModelArgs
from mlx_lm.utils import load, load_model

FIXTURE_NAMES = ["phi3_tf4", "phi3_longrope_tf4", "phi3_longrope_tf5"]
LONGROPE = ["phi3_longrope_tf4", "phi3_longrope_tf5"]
TOLERANCE = 1e-4  # fp32 on both sides; observed errors are ~1e-6


def load_fixture(name, **override):
    model, _ = load_model(FIXTURES / name, model_config=override or None)
    reference = mx.load(str(FIXTURES / name / "reference.safetensors"))
    return model, reference


# --- against transformers -------------------------------------------------------------


@pytest.mark.parametrize("name", FIXTURE_NAMES)
def test_full_forward_matches_transformers(name):
    model, ref = load_fixture(name)
    assert relative_error(model(ref["input_ids"]), ref["incremental_logits"]) < TOLERANCE
    if name not in LONGROPE:  # one law for every chunking: both references agree
        assert relative_error(model(ref["input_ids"]), ref["logits"]) < TOLERANCE


@pytest.mark.parametrize("name", FIXTURE_NAMES)
@pytest.mark.parametrize("chunk", [1, 5])
def test_cached_decode_matches_transformers(name, chunk):
    """Token by token, and in chunks of 5 straddling the window edges and the longrope
    boundary (positions 15 | 16 fall inside the chunk 15..19)."""
    model, ref = load_fixture(name)
    assert relative_error(decode_in_chunks(model, ref["input_ids"], chunk), ref["incremental_logits"]) < TOLERANCE


@pytest.mark.parametrize("name", LONGROPE)
def test_longrope_fixtures_cross_the_boundary(name):
    """The sequence passes original_max_position_embeddings, where transformers' per-call
    switch makes its full forward differ from its own incremental decoding."""
    model, ref = load_fixture(name)
    assert ref["input_ids"].shape[1] > model.args.original_max_position_embeddings == 16
    assert relative_error(ref["logits"], ref["incremental_logits"]) > 1e-2
    # Before the boundary transformers' full forward used the long factors already.
    assert relative_error(model(ref["input_ids"])[:, :16], ref["logits"][:, :16]) > 1e-2


def test_fixtures_exercise_every_feature():
    """Without the window, the short factors, or the attention factor the logits are
    far off, so the tests above check each of them."""
    model, ref = load_fixture("phi3_tf4", sliding_window=None)
    assert relative_error(model(ref["input_ids"]), ref["logits"]) > 1e-2
    config = load_model(FIXTURES / "phi3_longrope_tf4")[1]
    only_long = dict(config["rope_scaling"], short_factor=config["rope_scaling"]["long_factor"])
    for override in ({"rope_scaling": only_long}, {"rope_scaling": None}, {"max_position_embeddings": 16}):
        model, ref = load_fixture("phi3_longrope_tf4", **override)
        assert relative_error(model(ref["input_ids"]), ref["incremental_logits"]) > 1e-2, override


def test_caches_and_rotary_dims():
    sliding, _ = load_fixture("phi3_tf4")
    assert [type(c) for c in sliding.make_cache()] == [RotatingKVCache, RotatingKVCache]
    assert all(c.max_size == 8 for c in sliding.make_cache())
    phi4, _ = load_fixture("phi3_longrope_tf5")  # window 128 >= 64 positions: never binds
    assert [type(c) for c in phi4.make_cache()] == [KVCache, KVCache]
    assert phi4.args.rotary_dims == 12 and phi4.args.tie_word_embeddings and "lm_head" not in phi4


# --- config ---------------------------------------------------------------------------

BASE = dict(model_type="phi3", hidden_size=64, intermediate_size=96, num_hidden_layers=2,
            num_attention_heads=4, vocab_size=256, max_position_embeddings=64)
FACTORS = dict(short_factor=[1.0] * 6, long_factor=[2.0] * 6)


def test_config_dialects_agree_and_are_not_mutated():
    tf4 = dict(BASE, rope_theta=300.0, partial_rotary_factor=0.75, original_max_position_embeddings=16,
               rope_scaling=dict(FACTORS, type="longrope"))
    tf5 = dict(BASE, original_max_position_embeddings=16, rope_parameters=dict(
        FACTORS, rope_type="longrope", rope_theta=300.0, partial_rotary_factor=0.75,
        original_max_position_embeddings=16))
    frozen = copy.deepcopy((tf4, tf5))
    a, b = ModelArgs.from_dict(tf4), ModelArgs.from_dict(tf5)
    assert (tf4, tf5) == frozen
    assert (a.rope_theta, a.rope_scaling, a.rotary_dims) == (b.rope_theta, b.rope_scaling, b.rotary_dims)
    assert a.rope_scaling["rope_type"] == "longrope" and a.rotary_dims == 12
    assert a.num_key_value_heads == 4 and a.head_dim == 16


@pytest.mark.parametrize("alias", ["su", "yarn"])
def test_old_rope_type_names_mean_longrope(alias):
    args = ModelArgs.from_dict(dict(BASE, rope_scaling=dict(FACTORS, type=alias), partial_rotary_factor=0.75))
    assert args.rope_scaling["rope_type"] == "longrope"


def test_top_level_original_context_wins():
    """As transformers' Phi3Config: the top-level key overrides the rope dict's."""
    args = ModelArgs.from_dict(dict(BASE, original_max_position_embeddings=32, partial_rotary_factor=0.75,
                                    rope_scaling=dict(FACTORS, type="longrope", original_max_position_embeddings=8)))
    assert args.rope_scaling["original_max_position_embeddings"] == 32


def test_config_errors_name_the_value():
    with pytest.raises(ValueError, match="'gelu_new'"):
        ModelArgs.from_dict(dict(BASE, hidden_act="gelu_new"))
    with pytest.raises(ValueError, match="'llama3'"):
        ModelArgs.from_dict(dict(BASE, rope_scaling={"rope_type": "llama3", "factor": 8.0}))
    with pytest.raises(ValueError, match="sliding_window .* got 0"):
        ModelArgs.from_dict(dict(BASE, sliding_window=0))


# --- weights --------------------------------------------------------------------------


def assert_same_weights(a, b):
    assert a.keys() == b.keys()
    assert all(mx.array_equal(a[k], b[k]) for k in a)


@pytest.mark.parametrize("name", ["phi3_tf4", "phi3_longrope_tf5"])
def test_sanitize_is_idempotent(name):
    model, _ = load_fixture(name)
    raw = mx.load(str(FIXTURES / name / "model.safetensors"))
    raw["model.layers.0.self_attn.rotary_emb.inv_freq"] = mx.ones((8,))
    raw["lm_head.weight"] = raw["model.embed_tokens.weight"]  # a tied checkpoint may store it
    once = model.sanitize(raw)
    assert_same_weights(model.sanitize(dict(once)), once)
    assert not any("rotary_emb" in k for k in once)
    assert ("lm_head.weight" in once) == (not model.args.tie_word_embeddings)
    assert "model.layers.1.self_attn.qkv_proj.weight" in once and "model.layers.1.mlp.gate_up_proj.weight" in once
    converted = dict(tree_flatten(model.parameters()))
    assert_same_weights(model.sanitize(converted), converted)


# --- speculation and quantization -----------------------------------------------------

# Longrope switching at 24 and a window of 12, both crossed while generating.
TINY = dict(BASE, intermediate_size=128, num_key_value_heads=2, vocab_size=512, max_position_embeddings=128,
            original_max_position_embeddings=24, sliding_window=12, rope_theta=1e4,
            rope_scaling={"type": "longrope", "short_factor": [1.0, 1.2, 1.5, 2.0, 2.5, 3.0, 3.5, 4.0],
                          "long_factor": [1.5, 2.0, 3.0, 4.0, 5.0, 6.0, 8.0, 10.0]})
TINY_MISTRAL = dict(model_type="mistral", hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                    num_attention_heads=4, num_key_value_heads=2, vocab_size=512, sliding_window=12)
PROMPT = mx.array([(i * 37 + 11) % 512 for i in range(10)])
NUM_TOKENS = 30


@pytest.fixture(scope="module")
def phi3_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("phi3")
    return {
        "target": write_checkpoint(root / "target", TINY),
        "noisy": write_checkpoint(root / "noisy", TINY, noise=0.02),
        "mistral": write_checkpoint(root / "mistral", TINY_MISTRAL, seed=3),
    }


def plain(model, prompt=PROMPT):
    return [t for t, _ in generate_step(prompt, model, max_tokens=NUM_TOKENS)]


@pytest.mark.parametrize("k", [1, 3])
def test_greedy_speculative_equals_plain_phi3_target(phi3_dirs, k):
    """A noisy copy drafts: rounds end partly accepted, rollbacks run through the
    sliding-window caches past the wrap and across the longrope boundary."""
    target, draft = load_model(phi3_dirs["target"])[0], load_model(phi3_dirs["noisy"])[0]
    assert isinstance(target.make_cache()[0], RotatingKVCache)
    stats = SpeculationStats()
    out = list(speculative_generate_step(PROMPT, target, draft, num_draft_tokens=k, max_tokens=NUM_TOKENS,
                                         adaptive_draft_length=False, stats=stats))
    assert [t for t, _, _ in out] == plain(target)
    assert 0 < stats.num_accepted < stats.num_drafted, stats
    if k > 1:
        assert any(0 < n < k for n in accepted_per_round(out)), accepted_per_round(out)


@pytest.mark.parametrize("k", [1, 3])
def test_greedy_speculative_equals_plain_phi3_draft(phi3_dirs, k):
    """phi3 drafting for a Mistral target with a sliding window (a different random
    model: nearly every round rolls back)."""
    target, draft = load_model(phi3_dirs["mistral"])[0], load_model(phi3_dirs["target"])[0]
    assert all(isinstance(c, RotatingKVCache) for c in target.make_cache())
    stats = SpeculationStats()
    out = list(speculative_generate_step(PROMPT, target, draft, num_draft_tokens=k, max_tokens=NUM_TOKENS,
                                         adaptive_draft_length=False, stats=stats))
    assert [t for t, _, _ in out] == plain(target)
    assert stats.num_drafted >= NUM_TOKENS // (k + 1)


def test_quantized_round_trip_loads_and_generates(phi3_dirs, tmp_path):
    out = tmp_path / "q4"
    convert(str(phi3_dirs["target"]), out, quantize=True, q_bits=4, q_group_size=32)
    model, _ = load(str(out))
    float_model = load_model(phi3_dirs["target"])[0]
    attn, mlp = model.layers[1].self_attn, model.layers[1].mlp
    assert all(isinstance(m, nn.QuantizedLinear) for m in (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj))
    tokens = plain(model)
    assert len(tokens) == NUM_TOKENS
    # Greedy decoding through the caches picks the argmax of the model's own full forward.
    sequence = mx.concatenate([PROMPT, mx.array(tokens)])[None]
    logits = model(sequence)
    assert mx.argmax(logits[0, PROMPT.size - 1 : -1], axis=-1).tolist() == tokens
    ids = sequence[:, :20]
    assert relative_error(decode_in_chunks(model, ids, 3), model(ids)) < 1e-4
    error = (mx.linalg.norm(model(ids) - float_model(ids)) / mx.linalg.norm(float_model(ids))).item()
    assert error < 0.7, error  # 4-bit random weights: see test_convert.py's measurements
