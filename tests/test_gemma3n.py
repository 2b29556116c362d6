"""gemma3n.py: the shared family checks (family_checks.py) on the transformers fixtures,
plus what only Gemma 3n has: KV-shared layers (no cache of their own, rolled back with
their source), AltUp's predict and correct, the Gaussian top-k and its constant, the
config dialects and errors, and sanitize on the multimodal layout.

Fixtures come from fixtures/make_gemma3n_reference.py (sliding window 8, 40 tokens, the
last 2 of 4 layers KV-shared): gemma3n_text_tf5 (Gemma3nForCausalLM as transformers 5
saves it) and gemma3n_tf4 (the multimodal hub layout and config dialect, with tower
stand-ins and the unused k/v weights of the shared layers).
"""

import math

import mlx.core as mx
import numpy as np
import pytest
from checkpoints import VOCAB_SIZE
from family_checks import FIXTURES, PROMPT, Family, FamilyChecks, fixture_model, reference, relative_error
from mlx.utils import tree_flatten, tree_unflatten

from mlx_lm.models.lru_prompt_cache import copy_prompt_cache
from mlx_lm.models.batch_cache import extract_caches, merge_caches
from mlx_lm.models.cache import (KVCache, RotatingKVCache, SharedKVReader, load_prompt_cache, make_prompt_cache,
                                 save_prompt_cache, trim_prompt_cache)
from mlx_lm.models.gemma3n import (
    FULL,
    SLIDING,
    AltUp,
    ConditionalGeneration,
    LanguageModel,
    ModelArgs,
    TextModelArgs,
    gaussian_topk,
    kv_sources,
    sparsity_multiplier,
)
from mlx_lm.utils import load_model

SHAPE = dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16, sliding_window=8,
             hidden_size_per_layer_input=8, laurel_rank=8, altup_num_inputs=2, num_kv_shared_layers=2)

FAMILY = Family(
    fixtures=["gemma3n_tf4", "gemma3n_text_tf5"],
    # MLP units dominate each layer, so a rank holds about half of the layer bytes.
    tiny=dict(SHAPE, model_type="gemma3n_text", num_hidden_layers=4, intermediate_size=512,
              layer_types=[SLIDING, FULL, SLIDING, FULL], activation_sparsity_pattern=[0.95, 0.0, 0.0, 0.0],
              vocab_size=VOCAB_SIZE, vocab_size_per_layer_input=VOCAB_SIZE, tie_word_embeddings=False,
              eos_token_id=0),
    small=dict(SHAPE, model_type="gemma3n_text", hidden_size=32, num_hidden_layers=3, intermediate_size=48,
               num_attention_heads=2, num_key_value_heads=1, layer_types=[SLIDING, FULL, SLIDING],
               num_kv_shared_layers=1, activation_sparsity_pattern=[0.9, 0.0, 0.0], vocab_size=256,
               vocab_size_per_layer_input=256),
)


class TestGemma3n(FamilyChecks):
    family = FAMILY


def text_args(model) -> TextModelArgs:
    return model.args.text_args if isinstance(model, ConditionalGeneration) else model.args


# --- KV-shared layers -------------------------------------------------------------------


def test_kv_shared_layers_read_their_source_and_own_no_cache():
    model = fixture_model("gemma3n_text_tf5")
    assert [layer.kv_source for layer in model.layers] == [None, None, 0, 1]
    assert [type(c) for c in model.make_cache()] == [RotatingKVCache, KVCache, SharedKVReader, SharedKVReader]
    shared = model.layers[2].self_attn
    assert shared.reads_kv and not any(name in shared for name in ("k_proj", "v_proj", "k_norm", "v_norm"))
    tf4 = fixture_model("gemma3n_tf4")
    assert [layer.kv_source for layer in tf4.layers] == [None, None, 1, 0]  # [F, S, S, F]


def test_kv_shared_layers_matter_without_a_cache():
    """The forward without a cache matches transformers (the shared check); and the
    shared layers really attend over their source's keys: changing the source's key
    projection changes the logits even where the source's own output is unchanged."""
    model, (ids, want) = fixture_model("gemma3n_text_tf5"), reference("gemma3n_text_tf5")
    assert relative_error(model(ids), want) < 1e-4
    source = model.layers[0].self_attn.k_proj
    original = source.weight
    source.weight = original + 1.0
    try:
        assert relative_error(model(ids), want) > 1e-2
    finally:
        source.weight = original
    assert relative_error(model(ids), want) < 1e-4


def test_rollback_of_the_source_is_seen_by_its_readers():
    assert_rollback_reaches_readers(fixture_model("gemma3n_text_tf5"))


def assert_rollback_reaches_readers(model):
    """Past the window's wrap: a verify of 6 tokens trimmed back by 4 then decoding
    equals a fresh feed of the prompt and the 2 kept tokens, token after token."""
    assert any(layer.kv_source is not None for layer in model.layers)
    verify, kept = [7, 8, 9, 10, 11, 12], 2
    cache = make_prompt_cache(model)
    model(PROMPT[None], cache=cache)
    for c in cache:
        c.start_speculation()
    model(mx.array([verify]), cache=cache)
    assert trim_prompt_cache(cache, len(verify) - kept) == len(verify) - kept
    fresh = make_prompt_cache(model)
    model(mx.array([PROMPT.tolist() + verify[:kept]]), cache=fresh)
    for token in (40, 41, 42):
        got, want = model(mx.array([[token]]), cache=cache), model(mx.array([[token]]), cache=fresh)
        assert mx.allclose(got, want, atol=1e-5, rtol=1e-5), token


def test_shared_kv_reader_holds_nothing(tmp_path):
    """A KV-shared layer's entry: trims any amount, never waits for tokens, saves,
    copies, batches and comes back out of a batch as itself, beside real caches."""
    model = fixture_model("gemma3n_text_tf5")
    cache = make_prompt_cache(model)
    model(PROMPT[None], cache=cache)
    reader = cache[2]
    assert reader.is_trimmable() and reader.trim(5) == 5 and reader.size() == 0 and not reader.empty()
    assert reader.state == [] and reader.nbytes == 0 and reader.make_mask(3) is None
    with pytest.raises(ValueError, match="holds no arrays; got a state of 1"):
        reader.state = [mx.zeros((1,))]
    save_prompt_cache(str(tmp_path / "c.safetensors"), cache)
    assert [type(c) for c in load_prompt_cache(str(tmp_path / "c.safetensors"))] == [type(c) for c in cache]
    assert type(copy_prompt_cache(cache)[2]) is SharedKVReader
    batched = merge_caches([cache, copy_prompt_cache(cache)])
    assert isinstance(batched[2], SharedKVReader) and batched[2].bookkeeping == []
    assert [type(c) for c in extract_caches(batched, 1)] == [type(c) for c in cache]


def test_kv_sources_naive_and_errors():
    """The last n layers read the last earlier layer of their type; a type with no
    producer before the shared layers is refused."""
    types = [SLIDING, SLIDING, FULL, SLIDING, FULL, SLIDING, SLIDING, FULL]
    for n in range(0, 6):
        first = len(types) - n
        want = [None] * first + [max(j for j in range(first) if types[j] == types[i]) for i in range(first, len(types))]
        assert kv_sources(types, n) == want, n
    with pytest.raises(ValueError, match=r"num_kv_shared_layers=2: the shared layers' types"):
        kv_sources([SLIDING, SLIDING, FULL, FULL], 2)
    with pytest.raises(ValueError, match=r"num_kv_shared_layers must be in \[0, 4\) for 4 layers, got 4"):
        kv_sources([SLIDING, FULL, SLIDING, FULL], 4)


# --- AltUp, sparsity ----------------------------------------------------------------------


def test_altup_predict_and_correct_match_naive_loops():
    args = TextModelArgs.from_dict(dict(SHAPE, num_hidden_layers=2, altup_num_inputs=3, altup_active_idx=1,
                                        num_kv_shared_layers=0, intermediate_size=32))
    altup = AltUp(args)
    keys = mx.random.split(mx.random.key(1), 6)
    params = sorted(tree_flatten(altup.parameters()))
    altup.update(tree_unflatten([(name, mx.random.normal(value.shape, key=key) * 0.5)
                                 for (name, value), key in zip(params, keys)]))
    stack = mx.random.normal((3, 2, 5, 64), key=keys[-1])  # (n, B, L, D)
    got = altup.predict(stack)
    modalities = np.array(altup.modalities(stack[1]), np.float64)  # (B, L, n)
    P, x = np.array(altup.prediction_coefs.weight, np.float64), np.array(stack, np.float64)
    want = np.zeros_like(x)
    for b in range(2):
        for t in range(5):
            c = (P @ modalities[b, t]).reshape(3, 3)  # c[j, i]
            for j in range(3):
                want[j, b, t] = x[j, b, t] + sum(c[j, i] * x[i, b, t] for i in range(3))
    assert np.allclose(np.array(got), want, atol=1e-4)
    activated = mx.random.normal((2, 5, 64), key=keys[0])
    corrected = np.array(altup.correct(got, activated), np.float64)
    m = np.array(altup.modalities(activated), np.float64)
    C, a, pred = np.array(altup.correction_coefs.weight, np.float64), np.array(activated), np.array(got)
    for b in range(2):
        for t in range(5):
            coefs = C @ m[b, t] + 1.0
            for i in range(3):
                assert np.allclose(corrected[i, b, t], pred[i, b, t] + coefs[i] * (a[b, t] - pred[1, b, t]), atol=1e-4)


def test_sparsity_constant_is_torchs_float32_quantile():
    """torch.distributions.Normal(0, 1).icdf(torch.tensor(p)) in float32, as hex."""
    assert sparsity_multiplier(0.95).hex() == "0x1.a515200000000p+0"
    assert sparsity_multiplier(0.8).hex() == "0x1.aee8fc0000000p-1"
    assert sparsity_multiplier(0.5) == 0.0


def test_gaussian_topk_matches_a_naive_loop():
    x = mx.random.normal((3, 4, 50), key=mx.random.key(2)) * 2 + 0.5
    got = np.array(gaussian_topk(x, sparsity_multiplier(0.9)))
    z = np.float64(sparsity_multiplier(0.9))
    rows = np.array(x, np.float64).reshape(-1, 50)
    want = np.stack([np.maximum(r - (r.mean() + z * math.sqrt(((r - r.mean()) ** 2).mean())), 0) for r in rows])
    assert np.allclose(got.reshape(-1, 50), want, atol=1e-5)
    assert 0 < (got > 0).mean() < 0.2  # about the top 10% survive


def test_fixtures_exercise_sparsity_and_the_per_layer_table():
    """Without the sparsity, or with a full-size per-layer table lookup, the logits are off."""
    ids, want = reference("gemma3n_text_tf5")
    dense, _ = load_model(FIXTURES / "gemma3n_text_tf5", model_config={"activation_sparsity_pattern": [0.0] * 4})
    assert relative_error(dense(ids), want) > 1e-2
    assert (ids >= 200).any().item()  # ids past the 200-row per-layer table read row 0


# --- config -------------------------------------------------------------------------------

TEXT = dict(hidden_size=32, intermediate_size=48, num_hidden_layers=10, num_attention_heads=2,
            num_key_value_heads=1, head_dim=16, vocab_size=64, num_kv_shared_layers=5)


def test_dialects_normalise_alike():
    tf4 = TextModelArgs.from_dict(dict(TEXT, rope_theta=1e6, rope_local_base_freq=1e4))
    tf5 = TextModelArgs.from_dict(dict(TEXT, layer_types=([SLIDING] * 4 + [FULL]) * 2, rope_parameters={
        FULL: {"rope_type": "default", "rope_theta": 1e6}, SLIDING: {"rope_type": "default", "rope_theta": 1e4}}))
    assert tf4.layer_types == tf5.layer_types == ([SLIDING] * 4 + [FULL]) * 2  # every fifth layer global
    assert tf4.rope == tf5.rope == {FULL: (1e6, None), SLIDING: (1e4, None)}
    assert tf4.kv_sources == tf5.kv_sources == [None] * 5 + [3, 3, 3, 3, 4]
    assert tf4.intermediate_sizes == [48] * 10 and tf4.activation_sparsity_pattern == [0.0] * 10
    eleven = TextModelArgs.from_dict(dict(TEXT, num_hidden_layers=11))
    assert eleven.activation_sparsity_pattern == [0.95] * 10 + [0.0]  # transformers' default


def test_both_model_types_read_their_configs():
    text = ModelArgs.from_dict(dict(TEXT, model_type="gemma3n_text", tie_word_embeddings=False))
    assert not text.vision_language and not text.text_args.tie_word_embeddings
    nested = ModelArgs.from_dict({"model_type": "gemma3n", "text_config": dict(TEXT), "audio_config": {}})
    assert nested.vision_language and nested.text_args.tie_word_embeddings and nested.vocab_size == 64
    assert isinstance(fixture_model("gemma3n_tf4"), ConditionalGeneration)
    assert isinstance(fixture_model("gemma3n_text_tf5"), LanguageModel)


def test_config_errors_name_the_value():
    cases = [
        ({"intermediate_size": [48, 48]}, r"intermediate_size must list one value per layer \(10\), got \[48, 48\]"),
        ({"activation_sparsity_pattern": 0.9}, "activation_sparsity_pattern must list one value per layer"),
        ({"hidden_activation": "gelu"}, "hidden_activation 'gelu'"),
        ({"altup_active_idx": 4}, r"altup_active_idx must be in \[0, 4\), got 4"),
        ({"num_kv_shared_layers": 10}, r"num_kv_shared_layers must be in \[0, 10\) for 10 layers, got 10"),
        ({"layer_types": [SLIDING]}, "1 entries but num_hidden_layers is 10"),
    ]
    for override, message in cases:
        with pytest.raises(ValueError, match=message):
            TextModelArgs.from_dict(dict(TEXT, **override))


# --- sanitize -------------------------------------------------------------------------------


def test_sanitize_converts_the_multimodal_layout_once():
    model = fixture_model("gemma3n_tf4")
    raw = mx.load(str(FIXTURES / "gemma3n_tf4" / "model.safetensors"))
    once = model.sanitize(raw)
    assert not any(k.startswith(("model.", "vision", "audio")) or "embed_vision" in k for k in once)
    assert not any(f"layers.{i}.self_attn.{n}" in k for k in once for i in (2, 3) for n in ("k_proj", "v_proj"))
    assert sorted(once) == sorted(k for k, _ in tree_flatten(model.parameters()))
    twice = model.sanitize(once)
    assert sorted(twice) == sorted(once) and all(mx.array_equal(twice[k], once[k]) for k in once)
