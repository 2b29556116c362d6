"""Upstream mlx-lm's public names and signatures, each checked against a naive reference:
sample_utils penalty makers, base.py masks and attention, gated_delta_update, CacheList
files, RotatingKVCache masks for shorter windows, utils.make_shards."""

import itertools

import mlx.core as mx
import numpy as np
import pytest
from mlx.utils import tree_flatten

from mlx_lm.models.base import (
    create_attention_mask,
    create_causal_mask,
    create_ssm_mask,
    quantized_scaled_dot_product_attention,
)
from mlx_lm.models.cache import (
    ArraysCache,
    CacheList,
    KVCache,
    QuantizedKVCache,
    RotatingKVCache,
    load_prompt_cache,
    save_prompt_cache,
)
from mlx_lm.models.gated_delta import gated_delta_update, normalize_qk
from mlx_lm.sample_utils import (
    make_frequency_penalty,
    make_logits_processors,
    make_presence_penalty,
    make_repetition_penalty,
)
from mlx_lm.utils import make_shards

RNG = np.random.default_rng(0)


def randn(*shape):
    return mx.array(RNG.standard_normal(shape).astype(np.float32))


# ---------------------------------------------------------------------------
# sample_utils


def naive_penalties(tokens, logits, kind, penalty, context_size):
    out = logits.copy()
    recent = tokens[-context_size:]
    for t in sorted(set(recent)):
        if kind == "repetition":
            out[:, t] = np.where(out[:, t] < 0, out[:, t] * penalty, out[:, t] / penalty)
        elif kind == "presence":
            out[:, t] -= penalty
        else:
            out[:, t] -= penalty * recent.count(t)
    return out


MAKERS = {"repetition": make_repetition_penalty, "presence": make_presence_penalty, "frequency": make_frequency_penalty}


@pytest.mark.parametrize("kind", MAKERS)
@pytest.mark.parametrize("context_size", [3, 20])
def test_penalty_makers_match_naive(kind, context_size):
    tokens = [4, 1, 4, 7, 4, 2, 9, 1]
    logits = np.array(RNG.standard_normal((2, 12)), dtype=np.float32)
    processor = MAKERS[kind](1.5, context_size)
    got = processor(mx.array(tokens), mx.array(logits))
    np.testing.assert_allclose(np.array(got), naive_penalties(tokens, logits, kind, 1.5, context_size), rtol=1e-6)
    assert MAKERS[kind](1.5)(mx.array(tokens), mx.array(logits)).shape == (2, 12)  # default context 20


def test_make_logits_processors_uses_the_makers():
    tokens, logits = mx.array([3, 3, 5]), randn(1, 8)
    composed = make_logits_processors(repetition_penalty=1.3, presence_penalty=0.4, frequency_penalty=0.2,
                                      frequency_context_size=2)
    want = logits
    for processor in (make_repetition_penalty(1.3), make_presence_penalty(0.4), make_frequency_penalty(0.2, 2)):
        want = processor(tokens, want)
    got = logits
    for processor in composed:
        got = processor(tokens, got)
    assert mx.array_equal(got, want)


@pytest.mark.parametrize(
    "call, message",
    [
        (lambda: make_repetition_penalty(-0.5), "repetition_penalty must be >= 0"),
        (lambda: make_presence_penalty("a lot"), "presence_penalty must be a finite number"),
        (lambda: make_frequency_penalty(0.5, context_size=0), "frequency_context_size must be a positive int"),
    ],
)
def test_penalty_makers_reject_bad_values(call, message):
    with pytest.raises(ValueError, match=message):
        call()


# ---------------------------------------------------------------------------
# base.py


def test_create_attention_mask_answers_causal_when_it_is_exact():
    h = mx.zeros((1, 5, 8))
    assert create_attention_mask(h[:, :1]) is None
    assert create_attention_mask(h) == "causal"
    assert create_attention_mask(h, window_size=5) == "causal"
    assert mx.array_equal(create_attention_mask(h, window_size=3), create_causal_mask(5, window_size=3))
    assert mx.array_equal(create_attention_mask(h, return_array=True), create_causal_mask(5))
    cache = KVCache()
    cache.update_and_fetch(randn(1, 2, 4, 8), randn(1, 2, 4, 8))
    assert create_attention_mask(h, cache) == "causal"
    assert create_attention_mask(h, cache, window_size=6).shape == (5, 9)
    assert create_attention_mask(h, CacheList(ArraysCache(2), cache)) == "causal"
    assert create_attention_mask(h, CacheList(ArraysCache(2), cache), return_array=True).shape == (5, 9)
    assert create_ssm_mask(h) is None and create_ssm_mask(h, ArraysCache(2)) is None


def test_create_causal_mask_with_padding_matches_naive():
    N, offset = 3, 4
    left, right = mx.array([0, 2]), mx.array([1, 0])
    got = np.array(create_causal_mask(N, offset, window_size=5, right_padding=right, left_padding=left))
    assert got.shape == (2, 1, N, offset + N)
    for b, i, j in itertools.product(range(2), range(N), range(offset + N)):
        q = offset + i
        want = j <= q and q - j < 5 and j >= int(left[b]) and j < offset + N - int(right[b])
        assert got[b, 0, i, j] == want, (b, i, j)


@pytest.mark.parametrize("num_queries", [1, 4])
def test_quantized_attention_takes_upstreams_keywords_and_causal(num_queries):
    B, H, H_kv, S, D = 1, 4, 2, 9, 64
    q, k, v = randn(B, H, num_queries, D), randn(B, H_kv, S, D), randn(B, H_kv, S, D)
    q_keys, q_values = mx.quantize(k, group_size=64, bits=8), mx.quantize(v, group_size=64, bits=8)
    array_mask = create_causal_mask(num_queries, S - num_queries)
    want = quantized_scaled_dot_product_attention(q, q_keys, q_values, 0.125, array_mask, 64, 8)
    got = quantized_scaled_dot_product_attention(q, q_keys, q_values, scale=0.125, mask="causal")
    assert mx.allclose(got, want, atol=1e-6)
    dense = mx.fast.scaled_dot_product_attention(
        q, mx.dequantize(*q_keys, 64, 8), mx.dequantize(*q_values, 64, 8), scale=0.125, mask="causal"
    )
    assert mx.allclose(got, dense, atol=1e-4)
    with pytest.raises(ValueError, match="'upper'"):
        quantized_scaled_dot_product_attention(q, q_keys, q_values, scale=0.125, mask="upper")


def test_quantized_cache_mask_is_causal():
    cache = QuantizedKVCache(64, 8)
    cache.update_and_fetch(randn(1, 2, 3, 64), randn(1, 2, 3, 64))
    assert cache.make_mask(2) == "causal" and cache.make_mask(2, return_array=True).shape == (2, 5)


def test_cache_masks_default_to_causal_as_upstream():
    """Called bare, as upstream's callers do, a cache's make_mask answers "causal" where
    the plain causal mask is exact (upstream's default return_array=False)."""
    assert KVCache().make_mask(4) == "causal"
    rotating = RotatingKVCache(max_size=8)
    assert rotating.make_mask(4, window_size=5) == "causal"
    assert rotating.make_mask(6, window_size=5).dtype == mx.bool_  # the window cuts in
    assert rotating.make_mask(4, window_size=5, return_array=True).shape == (4, 4)
    assert CacheList(ArraysCache(2), KVCache()).make_mask(3) == "causal"


# ---------------------------------------------------------------------------
# gated_delta.py


def naive_gated_delta(q, k, v, a, b, A_log, dt_bias, state, mask, lower_bound=None):
    """The recurrence per batch row, value head and step, in float64 numpy; with
    `lower_bound`, upstream's bounded gate exp(lower_bound sigmoid(exp(A_log) (a + dt_bias)))."""
    q, k, v, a, b = (np.array(x, dtype=np.float64) for x in (q, k, v, a, b))
    B, T, Hk, Dk = q.shape
    Hv, Dv = v.shape[2:]
    A, bias = np.exp(np.array(A_log, np.float64)), np.array(dt_bias, np.float64)
    if lower_bound is None:
        g = np.exp(-A * np.log1p(np.exp(a + bias)))
    else:
        g = np.exp(lower_bound / (1 + np.exp(-A * (a + bias))))
    beta = 1 / (1 + np.exp(-b))
    S = np.array(state, np.float64).copy()
    y = np.zeros((B, T, Hv, Dv))
    for n, t, h in itertools.product(range(B), range(T), range(Hv)):
        if not mask[n, t]:
            continue
        kh = h // (Hv // Hk)
        S[n, h] *= g[n, t, h]
        delta = beta[n, t, h] * (v[n, t, h] - S[n, h] @ k[n, t, kh])
        S[n, h] += np.outer(delta, k[n, t, kh])
        y[n, t, h] = S[n, h] @ q[n, t, kh]
    return y, S


def gdn_inputs(B, T, Hk=2, Hv=4, Dk=8, Dv=8):
    q, k = randn(B, T, Hk, Dk), randn(B, T, Hk, Dk)
    q, k = q / mx.linalg.norm(q, axis=-1, keepdims=True), k / mx.linalg.norm(k, axis=-1, keepdims=True)
    return q, k, randn(B, T, Hv, Dv), randn(B, T, Hv), randn(B, T, Hv), randn(Hv) * 0.5, randn(Hv)


@pytest.mark.parametrize("T", [5, 40])  # stepping and chunked paths
@pytest.mark.parametrize("use_kernel", [True, False])
@pytest.mark.parametrize("masked", [False, True])
def test_gated_delta_update_matches_naive(T, use_kernel, masked):
    B = 2
    q, k, v, a, b, A_log, dt_bias = gdn_inputs(B, T)
    state = randn(B, 4, 8, 8) * 0.3
    mask = np.ones((B, T), bool)
    if masked:
        mask[1, :3] = False  # a left-padded row
    y, new_state = gated_delta_update(q, k, v, a, b, A_log, dt_bias, state, mx.array(mask) if masked else None,
                                      use_kernel=use_kernel)
    want_y, want_state = naive_gated_delta(q, k, v, a, b, A_log, dt_bias, state, mask)
    assert np.abs(np.array(y) - want_y).max() < 1e-4 * max(1, np.abs(want_y).max())
    assert np.abs(np.array(new_state) - want_state).max() < 1e-4 * max(1, np.abs(want_state).max())
    assert new_state.dtype == mx.float32 and y.dtype == mx.float32


def test_gated_delta_update_with_upstreams_lower_bound_and_normalize_qk():
    q, k, v, a, b, A_log, dt_bias = gdn_inputs(2, 6)
    q, k = normalize_qk(q * 3, k * 2, inv_scale=8**-0.5, eps=1e-6)
    assert np.allclose(np.linalg.norm(np.array(k), axis=-1), 1, atol=1e-5)
    assert np.allclose(np.linalg.norm(np.array(q), axis=-1), 8**-0.5, atol=1e-5)  # the readout scale in q
    state = randn(2, 4, 8, 8) * 0.3
    y, new_state = gated_delta_update(q, k, v, a, b, A_log, dt_bias, state, lower_bound=-5.0)
    want_y, want_state = naive_gated_delta(q, k, v, a, b, A_log, dt_bias, state, np.ones((2, 6), bool), -5.0)
    assert np.abs(np.array(y) - want_y).max() < 1e-4 * max(1, np.abs(want_y).max())
    assert np.abs(np.array(new_state) - want_state).max() < 1e-4 * max(1, np.abs(want_state).max())


def test_gated_delta_update_keeps_dtypes_and_zero_state():
    q, k, v, a, b, A_log, dt_bias = gdn_inputs(1, 3)
    y, state = gated_delta_update(q, k, v.astype(mx.bfloat16), a, b, A_log, dt_bias)
    assert y.dtype == mx.bfloat16 and state.dtype == mx.float32 and state.shape == (1, 4, 8, 8)
    _, half_state = gated_delta_update(q, k, v, a, b, A_log, dt_bias, state=mx.zeros((1, 4, 8, 8), mx.float16))
    assert half_state.dtype == mx.float16
    with pytest.raises(TypeError, match="dt_bias"):
        gated_delta_update(q, k, v, a, b, A_log)


# ---------------------------------------------------------------------------
# cache.py: CacheList files, RotatingKVCache windows


def _filled(kind):
    if kind == "kv":
        cache = KVCache()
        cache.update_and_fetch(randn(1, 2, 5, 8), randn(1, 2, 5, 8))
    elif kind == "rotating":
        cache = RotatingKVCache(4, keep=1)
        cache.update_and_fetch(randn(1, 2, 6, 8), randn(1, 2, 6, 8))
        cache.update_and_fetch(randn(1, 2, 1, 8), randn(1, 2, 1, 8))
    elif kind == "quantized":
        cache = QuantizedKVCache(32, 4)
        cache.update_and_fetch(randn(1, 2, 3, 32), randn(1, 2, 3, 32))
    elif kind == "arrays":
        cache = ArraysCache(2)
        cache[0] = randn(1, 3, 6)
    elif kind == "nested":
        cache = CacheList(_filled("arrays"), KVCache())
    return cache


EMPTY = {"kv": KVCache, "rotating": lambda: RotatingKVCache(4), "quantized": lambda: QuantizedKVCache(32, 4),
         "arrays": lambda: ArraysCache(2), "nested": lambda: CacheList(KVCache(), ArraysCache(1))}
KINDS = [f"{kind}-{fill}" for kind in EMPTY for fill in ("empty", "full")]


def _make(spec):
    kind, fill = spec.split("-")
    return EMPTY[kind]() if fill == "empty" else _filled(kind)


def _leaves(tree):
    if isinstance(tree, (list, tuple)):
        return [leaf for sub in tree for leaf in _leaves(sub)]
    return [tree]


@pytest.mark.parametrize("first, second", list(itertools.combinations_with_replacement(KINDS, 2)))
def test_cache_list_of_any_mix_round_trips(tmp_path, first, second):
    original = CacheList(_make(first), _make(second))
    save_prompt_cache(str(tmp_path / "c.safetensors"), [original, _filled("kv")], {"model": "m"})
    loaded, metadata = load_prompt_cache(str(tmp_path / "c.safetensors"), return_metadata=True)
    assert metadata == {"model": "m"} and isinstance(loaded[0], CacheList)
    assert [type(c) for c in loaded[0].caches] == [type(c) for c in original.caches]
    assert loaded[0].meta_state == original.meta_state
    want, got = _leaves(original.state), _leaves(loaded[0].state)
    assert len(want) == len(got)
    assert all((w is None and g is None) or mx.array_equal(w, g) for w, g in zip(want, got))


@pytest.mark.parametrize("window", [2, 3, 5])
@pytest.mark.parametrize("keep", [0, 2])
@pytest.mark.parametrize("pattern", [[1] * 14, [6, 1, 1, 3, 1, 1, 1, 4, 1, 1]])
def test_rotating_cache_masks_a_shorter_window(window, keep, pattern):
    """Attention through a RotatingKVCache(max_size 7) with window_size < its window
    equals attention over the whole history under that window (sinks visible)."""
    cache = RotatingKVCache(7, keep=keep)
    total = sum(pattern)
    all_k, all_v, queries = randn(1, 2, total, 8), randn(1, 2, total, 8), randn(1, 2, total, 8)
    start = 0
    for num in pattern:
        mask = cache.make_mask(num, window_size=window, return_array=num > 1 and start % 2 == 0)
        keys, values = cache.update_and_fetch(all_k[..., start:start + num, :], all_v[..., start:start + num, :])
        q = queries[..., start:start + num, :]
        got = mx.fast.scaled_dot_product_attention(q, keys, values, scale=0.35, mask=mask)
        query_pos, key_pos = np.arange(start, start + num)[:, None], np.arange(start + num)[None]
        ref = (key_pos <= query_pos) & ((query_pos - key_pos < window) | (key_pos < keep))
        want = mx.fast.scaled_dot_product_attention(
            q, all_k[..., :start + num, :], all_v[..., :start + num, :], scale=0.35, mask=mx.array(ref)
        )
        assert mx.allclose(got, want, atol=1e-5), (start, num)
        start += num


# ---------------------------------------------------------------------------
# utils.make_shards


def test_make_shards_takes_gigabytes():
    weights = {f"w{i}": mx.zeros((256, 256)) for i in range(4)}  # 256 KiB each
    assert len(make_shards(weights, 5)) == 1  # 5 GiB, not 5 bytes
    assert len(make_shards(weights)) == 1
    shards = make_shards(weights, max_file_size_gb=600 / (1 << 20))  # 600 KiB: two tensors a shard
    assert [list(s) for s in shards] == [["w0", "w1"], ["w2", "w3"]]
    with pytest.raises(ValueError, match="max_file_size_gb"):
        make_shards(weights, 0)
    # A tensor larger than a shard gets one of its own, in order; no weights, no shards.
    small, big = mx.zeros((128, 128)), mx.zeros((512, 512))  # 64 KiB, 1 MiB
    shards = make_shards({"a": small, "b": big, "c": small}, max_file_size_gb=600 / (1 << 20))
    assert [list(s) for s in shards] == [["a"], ["b"], ["c"]]
    assert make_shards({"b": big}, max_file_size_gb=600 / (1 << 20)) == [{"b": big}]
    assert make_shards({}, 1) == []


def test_keys_and_values_are_what_update_and_fetch_returned():
    """Upstream's keys_and_values(): a layer reading another layer's cache (KV sharing)
    gets the held keys and values; quantized ones as (packed, scales, biases) triples
    for quantized attention."""
    for cache in (KVCache(), QuantizedKVCache(32, 8)):
        assert cache.keys_and_values() == (None, None)
        fetched = cache.update_and_fetch(randn(1, 2, 5, 64), randn(1, 2, 5, 64))
        held = [x for _, x in tree_flatten(cache.keys_and_values())]
        assert len(held) in (2, 6) and all(mx.array_equal(a, b) for a, b in zip(held, (x for _, x in tree_flatten(fetched))))
        cache.trim(2)
        assert tree_flatten(cache.keys_and_values())[0][1].shape[2] == 3  # up to the offset


# ---------------------------------------------------------------------------
# the CLI modules' public names and the generation functions' `stream`

# Upstream 0.32.2's top-level public names (its source, read with ast) that code may
# import from these modules, and the values of its constants. Left out, each for a
# reason the README gives: chat's sharded_load and ChatUI,
# and what benchmark and cache_prompt merely import (load, batch_generate, generate_step).
UPSTREAM_NAMES = {
    "mlx_lm.generate": [
        "str2bool", "setup_arg_parser", "generation_stream", "wired_limit", "GenerationResponse",
        "maybe_quantize_kv_cache", "generate_step", "speculative_generate_step", "stream_generate", "generate",
        "StopSequences", "TextStateMachine", "make_stop_sequences", "make_text_state_machine", "BatchGenerator",
        "BatchResponse", "batch_generate", "main", "PromptProcessingBatch", "GenerationBatch",
        # what its source imports, reached through it by code written for it
        "BatchCounters", "BatchCountersSnapshot", "QuantizedKVCache", "TokenBuffer", "can_trim_prompt_cache",
        "load_prompt_cache", "make_prompt_cache", "trim_prompt_cache", "LogitsProcessor", "Sampler",
        "greedy_sampler", "does_model_support_input_embeddings", "load", "maybe_set_recommended_wired_limit",
    ],
    "mlx_lm.chat": ["setup_arg_parser", "main", "stream_generate", "make_prompt_cache", "make_sampler", "load"],
    "mlx_lm.benchmark": ["setup_arg_parser", "main"],
    "mlx_lm.cache_prompt": ["setup_arg_parser", "main"],
    "mlx_lm.fuse": ["parse_arguments", "main"],
}
UPSTREAM_CONSTANTS = {
    "mlx_lm.generate": dict(DEFAULT_PROMPT="hello", DEFAULT_MAX_TOKENS=100, DEFAULT_TEMP=0.0, DEFAULT_TOP_P=1.0,
                            DEFAULT_MIN_P=0.0, DEFAULT_TOP_K=0, DEFAULT_XTC_PROBABILITY=0.0,
                            DEFAULT_XTC_THRESHOLD=0.1, DEFAULT_MIN_TOKENS_TO_KEEP=1, DEFAULT_SEED=None,
                            DEFAULT_MODEL="mlx-community/Llama-3.2-3B-Instruct-4bit",
                            DEFAULT_QUANTIZED_KV_START=5000, DEFAULT_PREFILL_STEP_SIZE=2048),
    "mlx_lm.chat": dict(DEFAULT_TEMP=0.0, DEFAULT_TOP_P=1.0, DEFAULT_XTC_PROBABILITY=0.0, DEFAULT_XTC_THRESHOLD=0.0,
                        DEFAULT_SEED=0, DEFAULT_MAX_TOKENS=256, DEFAULT_PREFILL_STEP_SIZE=2048,
                        DEFAULT_MODEL="mlx-community/Llama-3.2-3B-Instruct-4bit"),
    "mlx_lm.cache_prompt": dict(DEFAULT_QUANTIZED_KV_START=5000),
}


@pytest.mark.parametrize("module_name", sorted(UPSTREAM_NAMES.keys() | UPSTREAM_CONSTANTS.keys()))
def test_cli_modules_have_upstreams_names_and_constants(module_name):
    import importlib

    module = importlib.import_module(module_name)
    assert [n for n in UPSTREAM_NAMES.get(module_name, []) if not hasattr(module, n)] == []
    constants = UPSTREAM_CONSTANTS.get(module_name, {})
    assert {name: getattr(module, name, "missing") for name in constants} == constants


def test_stream_is_where_upstream_puts_it():
    """Upstream passes it positionally: generate_step(prompt, model, stream),
    speculative_generate_step(prompt, model, draft_model, stream) and
    stream_generate(model, tokenizer, prompt, max_tokens, draft_model, stream)."""
    import inspect

    from mlx_lm.generate import generate_step, generation_stream, speculative_generate_step, stream_generate

    for function, position in ((generate_step, 2), (speculative_generate_step, 3), (stream_generate, 5)):
        parameter = list(inspect.signature(function).parameters.values())[position]
        assert (parameter.name, parameter.default, parameter.kind) == \
            ("stream", generation_stream, inspect.Parameter.POSITIONAL_OR_KEYWORD)


def test_make_stop_sequences_holds_eos_ids_and_stop_words(tiny_model_dir):
    from mlx_lm import load
    from mlx_lm.generate import make_stop_sequences

    _, tokenizer = load(str(tiny_model_dir))
    stops = make_stop_sequences(tokenizer, ["the end", "\n"])
    words = {tuple(tokenizer.encode(w, add_special_tokens=False)) for w in ["the end", "\n"]}
    assert stops.sequences == {(t,) for t in tokenizer.eos_token_ids} | words and len(stops.sequences) >= 3
    assert make_stop_sequences(tokenizer).sequences == {(t,) for t in tokenizer.eos_token_ids}
    with pytest.raises(ValueError, match="stop word '' encodes to no tokens"):
        make_stop_sequences(tokenizer, [""])
