"""phi3.py against transformers, through its caches, under speculation and quantized.

Fixtures come from fixtures/make_phi3_reference.py: tiny random Phi-3 checkpoints saved
by transformers, 24 tokens each. phi3_tf4 (plain rope, sliding window 8: every window
edge crossed), phi3_longrope_tf4 (Phi-3.5 style longrope, transformers-4 dialect) and
its partial50 / partial75 variants (a top-level partial_rotary_factor, as Phi-4-mini's
hub config), and phi3_longrope_tf5 (Phi-4-mini style: partial rotary 0.75, tied
embeddings, a window beyond max positions; transformers-5 dialect); the longrope ones
switch factors at original_max_position_embeddings 16, inside the sequence.

transformers picks the longrope factors once per forward call, by the sequence length
the call reaches, so its logits depend on how the tokens were split into calls. Each
reference records one split (SPLITS); we feed the same split through our caches.
"""

import copy
import math

import mlx.core as mx
import mlx.nn as nn
import pytest
from checkpoints import write_checkpoint
from conftest import FIXTURES
from mlx.utils import tree_flatten
from test_gpt_oss import relative_error
from test_speculative import accepted_per_round

from mlx_lm.convert import convert
from mlx_lm.generate import SpeculationStats, generate_step, speculative_generate_step
from mlx_lm.models.cache import KVCache, RotatingKVCache
from mlx_lm.models.phi3 import ModelArgs
from mlx_lm.models.rope_utils import SuScaledRoPE
from mlx_lm.utils import load, load_model

LONGROPE_TF4 = {0.5: "phi3_longrope_tf4_partial50", 0.75: "phi3_longrope_tf4_partial75", 1.0: "phi3_longrope_tf4"}
LONGROPE = [*LONGROPE_TF4.values(), "phi3_longrope_tf5"]
FIXTURE_NAMES = ["phi3_tf4", *LONGROPE]
# reference key -> sizes of the forward calls that produced it (make_phi3_reference.SPLITS)
SPLITS = {"incremental_logits": [1] * 24, "chunked_logits": [5, 5, 5, 5, 4], "prefill_logits": [20, 1, 1, 1, 1]}
TOLERANCE = 1e-4  # fp32 on both sides; observed errors are ~1e-6


def load_fixture(name, **override):
    model, _ = load_model(FIXTURES / name, model_config=override or None)
    reference = mx.load(str(FIXTURES / name / "reference.safetensors"))
    return model, reference


def decode_in_pieces(model, ids: mx.array, sizes) -> mx.array:
    """Logits of ids fed through one set of caches in calls of the given sizes."""
    cache = model.make_cache()
    starts = [sum(sizes[:i]) for i in range(len(sizes))]
    pieces = [model(ids[:, start : start + size], cache=cache) for start, size in zip(starts, sizes)]
    assert all(c.offset == ids.shape[1] for c in cache)
    return mx.concatenate(pieces, axis=1)


# --- against transformers -------------------------------------------------------------


@pytest.mark.parametrize("name", FIXTURE_NAMES)
def test_full_forward_matches_transformers(name):
    model, ref = load_fixture(name)
    assert relative_error(model(ref["input_ids"]), ref["logits"]) < TOLERANCE


@pytest.mark.parametrize("name", FIXTURE_NAMES)
@pytest.mark.parametrize("split", SPLITS)
def test_cached_decode_matches_transformers(name, split):
    """Token by token, in chunks of 5 (the chunk 15..19 straddles the longrope switch
    and the window edges) and a 20-token prefill then single tokens, each against
    transformers fed the same way through its cache."""
    model, ref = load_fixture(name)
    assert relative_error(decode_in_pieces(model, ref["input_ids"], SPLITS[split]), ref[split]) < TOLERANCE


@pytest.mark.parametrize("partial", LONGROPE_TF4)
def test_longrope_tf4_dialect_reads_as_transformers(partial):
    """Phi-3.5 / Phi-4-mini hub configs: rope_scaling {"type": "longrope", ...} beside a
    top-level partial_rotary_factor and original_max_position_embeddings, one factor per
    rotated pair, the attention factor from max / original positions (their logits: the
    two tests above)."""
    model, _ = load_fixture(LONGROPE_TF4[partial])
    rope = model.layers[0].self_attn.rope
    assert type(rope) is SuScaledRoPE and model.args.rotary_dims == rope.dims == int(16 * partial)
    assert rope.original_max_position_embeddings == 16
    assert rope.short_mscale == rope.long_mscale == pytest.approx(math.sqrt(1 + math.log(64 / 16) / math.log(16)))


@pytest.mark.parametrize("name", LONGROPE)
def test_longrope_fixtures_cross_the_boundary(name):
    """The sequence passes original_max_position_embeddings, so the splits disagree: a
    call reaching past 16 rotates all its positions with the long factors (the full
    forward, the 20-token prefill), single tokens before 16 keep the short ones."""
    model, ref = load_fixture(name)
    assert ref["input_ids"].shape[1] > model.args.original_max_position_embeddings == 16
    assert relative_error(ref["incremental_logits"], ref["logits"]) > 1e-2
    assert relative_error(ref["chunked_logits"], ref["logits"]) > 1e-2
    assert relative_error(ref["prefill_logits"], ref["logits"]) < TOLERANCE  # all long either way


def test_fixtures_exercise_every_feature():
    """Without the window, the short factors, the long factors or the attention factor
    the logits are far off, so the tests above check each of them."""
    model, ref = load_fixture("phi3_tf4", sliding_window=None)
    assert relative_error(model(ref["input_ids"]), ref["logits"]) > 1e-2
    scaling = load_model(FIXTURES / "phi3_longrope_tf4")[1]["rope_scaling"]
    only_long = dict(scaling, short_factor=scaling["long_factor"])
    only_short = dict(scaling, long_factor=scaling["short_factor"])
    # Single tokens before 16 are the only ones turned with the short factors.
    model, ref = load_fixture("phi3_longrope_tf4", rope_scaling=only_long)
    assert relative_error(decode_in_pieces(model, ref["input_ids"], [1] * 24), ref["incremental_logits"]) > 1e-2
    for override in ({"rope_scaling": only_short}, {"rope_scaling": None}, {"max_position_embeddings": 16}):
        model, ref = load_fixture("phi3_longrope_tf4", **override)
        assert relative_error(model(ref["input_ids"]), ref["logits"]) > 1e-2, override


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

# A window of 12, crossed while generating, and longrope switching at 8, inside the
# prompt: every call from the prefill (9 tokens) on reaches past 8, so all use the long
# factors however they are split. (A call ending before the switch keeps the short ones,
# as in transformers, so a verify round straddling it would differ from plain decoding.)
TINY = dict(BASE, intermediate_size=128, num_key_value_heads=2, vocab_size=512, max_position_embeddings=128,
            original_max_position_embeddings=8, sliding_window=12, rope_theta=1e4,
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
    sliding-window caches past the wrap, rotated with the long factors."""
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
    assert relative_error(decode_in_pieces(model, ids, [9, 3, 3, 3, 2]), model(ids)) < 1e-4
    error = (mx.linalg.norm(model(ids) - float_model(ids)) / mx.linalg.norm(float_model(ids))).item()
    assert error < 0.7, error  # 4-bit random weights: see test_convert.py's measurements
