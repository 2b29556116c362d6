"""gemma3.py against transformers, through its sliding-window and global caches, its
config dialects and both checkpoint layouts, speculation past the window, and a
quantized round trip.

Fixtures come from fixtures/make_families_reference.py: tiny random checkpoints saved
by transformers 5 with sliding_window 8 and 24 tokens, so every window edge is crossed
twice: gemma3_text_tf4 (Gemma3ForCausalLM, transformers-4 config dialect,
sliding_window_pattern 3, linear rope scaling on the global layers, final softcap,
untied) and gemma3_tf5 (Gemma3ForConditionalGeneration with a vision tower,
transformers-5 dialect: text_config, layer_types, rope_parameters per layer type; tied).
Their norms are zero-centred with spread 0.5, so a missing or doubled +1 shows.
"""

import json

import mlx.core as mx
import numpy as np
import pytest
from checkpoints import TINY_CONFIGS, VOCAB_SIZE, write_checkpoint
from conftest import FIXTURES
from mlx.utils import tree_flatten, tree_unflatten
from test_gpt_oss import decode_in_chunks, load_fixture, relative_error
from test_speculative import accepted_per_round

from mlx_lm import convert, load
from mlx_lm.generate import SpeculationStats, generate_step, speculative_generate_step
from mlx_lm.models.cache import KVCache, RotatingKVCache
from mlx_lm.models.gemma3 import (
    FULL,
    SLIDING,
    ConditionalGeneration,
    LanguageModel,
    ModelArgs,
    TextModelArgs,
    rms_norm,
    scale_embeddings,
    softcap,
)
from mlx_lm.utils import load_model, quantize_model, quantized_layers, save_model

FIXTURE_NAMES = ["gemma3_text_tf4", "gemma3_tf5"]
TOLERANCE = 1e-4  # fp32 on both sides; observed errors are ~2e-6
WINDOW = 8

# A tiny Gemma 3 sharing the tiny qwen3's vocabulary, so either can draft for the other.
TINY_GEMMA3 = dict(
    model_type="gemma3_text", hidden_size=64, intermediate_size=128, num_hidden_layers=4,
    num_attention_heads=4, num_key_value_heads=2, head_dim=16, query_pre_attn_scalar=16,
    sliding_window=WINDOW, sliding_window_pattern=2, rope_theta=1e6, rope_local_base_freq=1e4,
    final_logit_softcapping=30.0, vocab_size=VOCAB_SIZE, tie_word_embeddings=False, eos_token_id=0,
)
PROMPT = mx.array([(i * 37 + 11) % VOCAB_SIZE for i in range(20)])
NUM_TOKENS = 40


def text_args(model) -> TextModelArgs:
    return model.args.text_args if isinstance(model, ConditionalGeneration) else model.args


# --- against transformers -------------------------------------------------------------


@pytest.mark.parametrize("name", FIXTURE_NAMES)
@pytest.mark.parametrize("chunk", [None, 1, 5, 24])
def test_logits_match_transformers(name, chunk):
    """A full forward without cache; through the caches token by token (ring writes, no
    mask), in chunks of 5 that straddle the window edges as a verify step does, and as
    one 24-token prefill into empty caches."""
    model, ids, want = load_fixture(name)
    assert ids.shape[1] >= 3 * text_args(model).sliding_window
    got = model(ids) if chunk is None else decode_in_chunks(model, ids, chunk)
    assert relative_error(got, want) < TOLERANCE


@pytest.mark.parametrize(
    "override",
    [
        {"sliding_window": 1000},
        {"rope_local_base_freq": 10000.0},
        {"rope_scaling": None},
        {"query_pre_attn_scalar": 16},
        {"final_logit_softcapping": None},
        {"sliding_window_pattern": 4},
    ],
)
def test_fixture_exercises_every_feature(override):
    """Without the window, the local rope theta, the global rope scaling, the query
    scalar, the final softcap or the layer pattern the logits are far off."""
    model, ids, want = load_fixture("gemma3_text_tf4")
    changed, _ = load_model(FIXTURES / "gemma3_text_tf4", model_config=override)
    assert relative_error(changed(ids), want) > 1e-2


def test_norms_are_shifted_exactly_once():
    """The fixtures' norms are far from zero, so x_hat * w (no shift) or x_hat * (2 + w)
    (a second shift) would be far off."""
    for shift in (-1.0, 1.0):
        model, ids, want = load_fixture("gemma3_tf5")
        norms = [(k, v + shift) for k, v in tree_flatten(model.parameters()) if k.endswith("norm.weight")]
        model.update(tree_unflatten(norms))
        assert relative_error(model(ids), want) > 1e-2


def test_layer_types_and_caches():
    tf4, _ = load_model(FIXTURES / "gemma3_text_tf4")
    assert isinstance(tf4, LanguageModel) and tf4.args.layer_types == [SLIDING, SLIDING, FULL, SLIDING]
    tf5, _ = load_model(FIXTURES / "gemma3_tf5")
    assert isinstance(tf5, ConditionalGeneration)
    assert tf5.args.text_args.layer_types == [SLIDING, FULL, SLIDING, SLIDING]
    cache = tf5.make_cache()
    assert [type(c) for c in cache] == [RotatingKVCache, KVCache, RotatingKVCache, RotatingKVCache]
    assert all(c.max_size == WINDOW and c.keep == 0 for c in cache if isinstance(c, RotatingKVCache))


# --- config -----------------------------------------------------------------------------

TEXT = dict(hidden_size=32, intermediate_size=48, num_hidden_layers=6, num_attention_heads=2,
            num_key_value_heads=1, head_dim=16, vocab_size=64)


def test_dialects_normalise_alike():
    tf4 = TextModelArgs.from_dict(dict(TEXT, rope_theta=1e6, rope_local_base_freq=1e4,
                                       rope_scaling={"rope_type": "linear", "factor": 8.0}))
    tf5 = TextModelArgs.from_dict(dict(TEXT, layer_types=[SLIDING] * 5 + [FULL], rope_parameters={
        FULL: {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6},
        SLIDING: {"rope_type": "default", "rope_theta": 1e4}}))
    assert tf4.layer_types == tf5.layer_types == [SLIDING] * 5 + [FULL]  # pattern 6 by default
    assert tf4.rope == tf5.rope == {FULL: (1e6, {"rope_type": "linear", "factor": 8.0}), SLIDING: (1e4, None)}
    assert TextModelArgs.from_dict(TEXT).rope == {FULL: (1e6, None), SLIDING: (1e4, None)}  # transformers' defaults


def test_both_model_types_read_their_configs():
    text = ModelArgs.from_dict(dict(TEXT, model_type="gemma3_text", tie_word_embeddings=False))
    assert not text.vision_language and not text.text_args.tie_word_embeddings
    nested = ModelArgs.from_dict({"model_type": "gemma3", "text_config": dict(TEXT), "vision_config": {}})
    assert nested.vision_language and nested.text_args.tie_word_embeddings and nested.vocab_size == 64
    untied = ModelArgs.from_dict({"model_type": "gemma3", "text_config": dict(TEXT), "tie_word_embeddings": False})
    assert not untied.text_args.tie_word_embeddings  # the top-level key is the one transformers ties by


def test_config_errors_name_the_value():
    cases = [
        ({"attn_logit_softcapping": 50.0}, "attn_logit_softcapping=50.0"),
        ({"use_bidirectional_attention": True}, "use_bidirectional_attention=True"),
        ({"hidden_activation": "gelu"}, "hidden_activation 'gelu'"),
        ({"rope_parameters": {"rope_type": "default", "rope_theta": 1e4}}, r"got keys \['rope_theta', 'rope_type'\]"),
        ({"layer_types": [SLIDING, FULL]}, "2 entries but num_hidden_layers is 6"),
        ({"sliding_window_pattern": 0}, "sliding_window_pattern must be >= 1, got 0"),
    ]
    for override, message in cases:
        with pytest.raises(ValueError, match=message):
            TextModelArgs.from_dict(dict(TEXT, **override))
    with pytest.raises(ValueError, match="final_logit_softcapping=30.0"):
        ModelArgs.from_dict({"model_type": "gemma3", "text_config": dict(TEXT, final_logit_softcapping=30.0)})
    with pytest.raises(ValueError, match="needs a text_config dict"):
        ModelArgs.from_dict({"model_type": "gemma3"})


# --- pure helpers -------------------------------------------------------------------------


def test_rms_norm_and_softcap_against_naive_references():
    rng = np.random.default_rng(0)
    x, w = rng.normal(size=(2, 3, 16)).astype(np.float32), rng.normal(size=16).astype(np.float32)
    want = x / np.sqrt((x**2).mean(-1, keepdims=True) + 1e-6) * (1 + w)
    np.testing.assert_allclose(np.array(rms_norm(mx.array(x), mx.array(w), 1e-6)), want, rtol=1e-5, atol=1e-5)
    half = rms_norm(mx.array(x, dtype=mx.bfloat16), mx.array(w, dtype=mx.bfloat16), 1e-6)
    assert half.dtype == mx.bfloat16
    capped = softcap(mx.array(x * 10), 3.0)
    np.testing.assert_allclose(np.array(capped), 3.0 * np.tanh(x * 10 / 3.0), rtol=1e-5, atol=1e-6)


def test_embedding_scale_is_rounded_to_the_compute_dtype():
    """sqrt(3840) = 61.97 is 62.0 in bfloat16, and transformers scales by that."""
    h = scale_embeddings(mx.ones((1, 2, 4), dtype=mx.bfloat16), 3840)
    assert h.dtype == mx.bfloat16 and mx.all(h == 62.0).item()
    assert mx.allclose(scale_embeddings(mx.ones((3,)), 3840), mx.array(3840**0.5)).item()


# --- weights ------------------------------------------------------------------------------


def assert_same_weights(a, b):
    assert a.keys() == b.keys()
    assert all(a[k].dtype == b[k].dtype and mx.array_equal(a[k], b[k]) for k in a)


def raw(name):
    return mx.load(str(FIXTURES / name / "model.safetensors"))


@pytest.mark.parametrize("name", FIXTURE_NAMES)
def test_sanitize_is_idempotent(name):
    """On raw transformers weights, converted float weights and quantized ones; the
    norms pass through unchanged (the +1 lives in the forward)."""
    model, config = load_model(FIXTURES / name)
    weights = raw(name)
    once = model.sanitize(weights)
    assert_same_weights(model.sanitize(once), once)
    norms = [k for k in weights if k.endswith("norm.weight") and k.startswith(("model.", "language_model."))]
    assert norms and all(mx.array_equal(once[k], weights[k]) for k in norms)
    converted = dict(tree_flatten(model.parameters()))
    assert_same_weights(model.sanitize(converted), converted)
    quantize_model(model, config, group_size=32, bits=4)
    quantized = dict(tree_flatten(model.parameters()))
    assert any(k.endswith("mlp.down_proj.scales") for k in quantized)
    assert_same_weights(model.sanitize(quantized), quantized)


def write_variant(directory, name, weights, config=None):
    directory.mkdir()
    config = config or json.loads((FIXTURES / name / "config.json").read_text())
    (directory / "config.json").write_text(json.dumps(config))
    mx.save_safetensors(str(directory / "model.safetensors"), weights)
    return directory


def test_conditional_generation_layouts_load(tmp_path):
    """gemma3_tf5 as transformers 4.5x saves it (`model.language_model.*`,
    `model.vision_tower.*`, a top-level `lm_head`) and as upstream mlx-lm converts it
    (`language_model.lm_head` written out although tied) give the same logits."""
    _, ids, want = load_fixture("gemma3_tf5")
    weights = raw("gemma3_tf5")
    embed = weights["language_model.model.embed_tokens.weight"]
    renamed = {k.replace("language_model.model.", "language_model.", 1): v for k, v in weights.items()}
    renamed = {"model." + k: v for k, v in renamed.items()}
    assert "model.language_model.layers.0.mlp.up_proj.weight" in renamed and "model.vision_tower.head.probe" in renamed
    variants = {"tf4_5x": dict(renamed, **{"lm_head.weight": embed}),
                "upstream": dict(weights, **{"language_model.lm_head.weight": embed})}
    for label, variant in variants.items():
        model, _ = load_model(write_variant(tmp_path / label, "gemma3_tf5", variant))
        assert relative_error(model(ids), want) < TOLERANCE, label


@pytest.mark.parametrize("name", FIXTURE_NAMES)
def test_saved_model_reloads_identically(tmp_path, name):
    """Our converted layout (save_model of the loaded model) is what upstream writes:
    nested names for gemma3, zero-centred norms; it reloads bit for bit."""
    model, config = load_model(FIXTURES / name)
    save_model(tmp_path, model)
    (tmp_path / "config.json").write_text(json.dumps(config))
    saved = mx.load(str(tmp_path / "model.safetensors"))
    prefix = "language_model.model." if name == "gemma3_tf5" else "model."
    assert all(k.startswith((prefix, "lm_head.")) for k in saved)
    reloaded, _ = load_model(tmp_path)
    ids = mx.load(str(FIXTURES / name / "reference.safetensors"))["input_ids"]
    assert mx.array_equal(reloaded(ids), model(ids))


def test_quantized_round_trip_loads_and_generates(tmp_path):
    """mlx_lm.convert -q, then load: exactly the in-memory quantization, and it generates
    past the sliding window."""
    source = write_checkpoint(tmp_path / "float", TINY_GEMMA3, seed=3)
    convert(str(source), tmp_path / "q", quantize=True, q_bits=4, q_group_size=32)
    model, _ = load(str(tmp_path / "q"))
    assert quantized_layers(model)["model.layers.1.self_attn.q_proj"] == {"group_size": 32, "bits": 4, "mode": "affine"}
    reference, config = load_model(source)
    quantize_model(reference, config, group_size=32, bits=4)
    assert mx.array_equal(model(PROMPT[None]), reference(PROMPT[None]))
    tokens = [t for t, _ in generate_step(PROMPT, model, max_tokens=2 * WINDOW)]
    assert tokens == [t for t, _ in generate_step(PROMPT, reference, max_tokens=2 * WINDOW)]


# --- speculation ----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def spec_models(tmp_path_factory):
    root = tmp_path_factory.mktemp("gemma3_spec")
    return {
        "gemma3": load_model(write_checkpoint(root / "gemma3", TINY_GEMMA3, seed=1))[0],
        "noisy": load_model(write_checkpoint(root / "noisy", TINY_GEMMA3, seed=1, noise=0.1))[0],
        "qwen3": load_model(write_checkpoint(root / "qwen3", TINY_CONFIGS["qwen3"], seed=2))[0],
        "tf5": load_model(FIXTURES / "gemma3_tf5")[0],
        "tf4": load_model(FIXTURES / "gemma3_text_tf4")[0],
    }


@pytest.mark.parametrize(
    "target, draft",
    [("gemma3", "noisy"), ("gemma3", "qwen3"), ("noisy", "gemma3"), ("qwen3", "gemma3"), ("tf5", "tf4")],
)
@pytest.mark.parametrize("k", [1, 3])
def test_greedy_speculation_equals_plain(spec_models, target, draft, k):
    """Gemma 3 as target (noisy-self and dense qwen3 drafts), as draft (of its noisy copy
    and of a dense qwen3), and the vision-language layout drafted by the text one; 20 +
    40 tokens run far past the window of 8, so the sliding layers' ring buffers wrap
    and roll back."""
    target_model, draft_model = spec_models[target], spec_models[draft]
    prompt = PROMPT % text_args(target_model).vocab_size
    want = [t for t, _ in generate_step(prompt, target_model, max_tokens=NUM_TOKENS)]
    stats = SpeculationStats()
    out = list(speculative_generate_step(prompt, target_model, draft_model, num_draft_tokens=k, max_tokens=NUM_TOKENS,
                                         adaptive_draft_length=False, stats=stats))
    assert [t for t, _, _ in out] == want
    assert stats.num_accepted < stats.num_drafted  # some drafts were rolled back
    rounds = accepted_per_round(out)
    if "noisy" in (target, draft) and k == 3:
        # Rounds end fully, partly (a multi-token ring-buffer re-append) and not at all accepted.
        assert {0, 3} <= set(rounds) and any(0 < n < k for n in rounds), rounds


def test_greedy_speculation_with_a_bounded_cache_equals_plain(spec_models):
    """max_kv_size 16 turns the global layers' caches into rings of 16 (4 sinks) beside
    the sliding layers' rings of 8: two window sizes, one mask each, both rolled back."""
    target, draft = spec_models["gemma3"], spec_models["noisy"]
    want = [t for t, _ in generate_step(PROMPT, target, max_tokens=NUM_TOKENS, max_kv_size=16)]
    stats = SpeculationStats()
    out = list(speculative_generate_step(PROMPT, target, draft, num_draft_tokens=3, max_tokens=NUM_TOKENS,
                                         adaptive_draft_length=False, max_kv_size=16, stats=stats))
    assert [t for t, _, _ in out] == want
    assert want != [t for t, _ in generate_step(PROMPT, target, max_tokens=NUM_TOKENS)]  # the bound matters
    assert any(0 < n < 3 for n in accepted_per_round(out)), accepted_per_round(out)
