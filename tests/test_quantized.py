"""Quantized checkpoints in upstream's layout, quantized attention and KV caches.

The quantized checkpoints here are written by the tests straight from the documented
format (`<layer>.weight` packed uint32, `.scales`, `.biases`, config "quantization"),
not by our converter.
"""

import json

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from checkpoints import TINY_CONFIGS, write_checkpoint

from mlx_lm.generate import generate_step, maybe_quantize_kv_cache
from mlx_lm.models.base import quantized_scaled_dot_product_attention
from mlx_lm.models.cache import ArraysCache, KVCache, QuantizedKVCache, RotatingKVCache, make_prompt_cache
from mlx_lm.utils import load, load_model

PROMPT = [5, 17, 260, 33, 101, 7, 99, 300, 12, 45, 8, 200]
# head_dim 32: the smallest size MLX quantizes in groups (KV caches quantize per head row).
KV_CONFIG = dict(TINY_CONFIGS["llama"], num_attention_heads=2, num_key_value_heads=1)

DEFAULT = {"group_size": 64, "bits": 4}
OVERRIDES = {"model.layers.0.mlp.down_proj": {"group_size": 32, "bits": 8}, "lm_head": False}


def layer_params(block, path):
    return block.get(path, {k: block[k] for k in ("group_size", "bits")})


def quantize_weights(float_weights, block):
    """The documented layout, by hand: every 2-D weight not overridden to false becomes
    packed weight + scales + biases with the block's (or its override's) parameters."""
    weights = {}
    for name, w in float_weights.items():
        path = name[: -len(".weight")]
        params = layer_params(block, path)
        if not name.endswith(".weight") or w.ndim != 2 or params is False:
            weights[name] = w
            continue
        packed, scales, biases = mx.quantize(w, params["group_size"], params["bits"])
        weights.update({f"{path}.weight": packed, f"{path}.scales": scales, f"{path}.biases": biases})
    return weights


def dequantized_reference(float_weights, block):
    """The float weights the quantized checkpoint stands for."""
    quantized = quantize_weights(float_weights, block)
    weights = dict(float_weights)
    for name, scales in quantized.items():
        if name.endswith(".scales"):
            path = name[: -len(".scales")]
            params = layer_params(block, path)
            weights[f"{path}.weight"] = mx.dequantize(
                quantized[f"{path}.weight"], scales, quantized[f"{path}.biases"], params["group_size"], params["bits"]
            )
    return weights


def write_quantized(directory, block, config_key="quantization", weights_block=None):
    """A tiny llama quantized in upstream's layout; `weights_block` (default `block`)
    is what the weights are really quantized with, `block` what config.json says."""
    write_checkpoint(directory, TINY_CONFIGS["llama"], seed=2)
    float_weights = mx.load(str(directory / "model.safetensors"))
    mx.save_safetensors(str(directory / "model.safetensors"), quantize_weights(float_weights, weights_block or block))
    config = json.loads((directory / "config.json").read_text())
    if block is not None:
        config[config_key] = block
    (directory / "config.json").write_text(json.dumps(config))
    return float_weights


def greedy(model, prompt, num_tokens):
    return [t for t, _ in generate_step(mx.array(prompt), model, max_tokens=num_tokens)]


@pytest.mark.parametrize("config_key", ["quantization", "quantization_config"])
def test_upstream_layout_checkpoint_loads_and_generates(tmp_path, config_key):
    block = {**DEFAULT, **OVERRIDES}
    float_weights = write_quantized(tmp_path / "q", block, config_key)
    model, tokenizer = load(str(tmp_path / "q"))
    layers = model.model.layers
    assert isinstance(layers[0].mlp.down_proj, nn.QuantizedLinear)
    assert (layers[0].mlp.down_proj.bits, layers[0].mlp.down_proj.group_size) == (8, 32)
    assert (layers[1].mlp.down_proj.bits, layers[1].mlp.down_proj.group_size) == (4, 64)
    assert isinstance(model.model.embed_tokens, nn.QuantizedEmbedding)
    assert type(model.lm_head) is nn.Linear  # override false: kept float

    reference, _ = load_model(write_checkpoint(tmp_path / "f", TINY_CONFIGS["llama"], seed=2))
    reference.load_weights(list(dequantized_reference(float_weights, block).items()))
    tokens = mx.array([PROMPT])
    # Quantized matmuls and float matmuls on the dequantized weights differ only in
    # summation order (float32 rounding, ~1e-6 relative).
    assert mx.allclose(model(tokens), reference(tokens), atol=1e-4, rtol=1e-4)
    assert greedy(model, PROMPT, 8) == greedy(reference, PROMPT, 8)


BAD_CHECKPOINTS = [
    # (config block, block the weights really use, error)
    (DEFAULT, False, "no weight has .scales"),
    (None, DEFAULT, 'no "quantization" block'),
    ({"group_size": 64, "bits": 7}, {"group_size": 64, "bits": 4}, r"supports bits \[2, 3, 4, 5, 6, 8\], got 7"),
    ({"group_size": 48, "bits": 4}, DEFAULT, "supports group sizes"),
    ({"group_size": 64, "bits": 4, "mode": "int4"}, DEFAULT, "unsupported quantization mode 'int4'"),
    ({"group_size": 64, "bits": 8}, DEFAULT, "disagree with the weights"),
    ({"group_size": 32, "bits": 4}, DEFAULT, "disagree with the weights"),
    ({**DEFAULT, "lm_head": False}, DEFAULT, "keeps lm_head in float"),
    ({**DEFAULT, "model.norm": {"group_size": 64, "bits": 4}}, DEFAULT, None),  # unused override: fine
    ({**DEFAULT, "model.layers.0.self_attn.q_proj": {"group_size": 128, "bits": 4}}, DEFAULT,
     "group_size 128 does not divide its input width 64"),
    ({**DEFAULT, "lm_head": "yes"}, DEFAULT, "entry 'lm_head' = 'yes'"),
]


@pytest.mark.parametrize("block, weights_block, error", BAD_CHECKPOINTS)
def test_config_and_weights_that_disagree_get_clear_errors(tmp_path, block, weights_block, error):
    if weights_block is False:  # float weights, quantized config
        write_checkpoint(tmp_path, TINY_CONFIGS["llama"], seed=2)
        config = json.loads((tmp_path / "config.json").read_text())
        (tmp_path / "config.json").write_text(json.dumps({**config, "quantization": block}))
    else:
        write_quantized(tmp_path, block, weights_block=weights_block)
    if error is None:
        load_model(tmp_path)
        return
    with pytest.raises(ValueError, match=error):
        load_model(tmp_path)


def test_truncated_quantized_weights_file(tmp_path):
    write_quantized(tmp_path, DEFAULT)
    data = (tmp_path / "model.safetensors").read_bytes()
    (tmp_path / "model.safetensors").write_bytes(data[: len(data) // 2])
    with pytest.raises(ValueError, match="Could not read weights file .*model.safetensors"):
        load_model(tmp_path)


# ---------------------------------------------------------------------------
# Quantized attention and KV caches.


def random_qkv(num_queries, num_keys, heads=4, kv_heads=2, dim=64, seed=0):
    rng = np.random.default_rng(seed)
    q = mx.array(rng.standard_normal((1, heads, num_queries, dim)), dtype=mx.float32)
    k = mx.array(rng.standard_normal((1, kv_heads, num_keys, dim)), dtype=mx.float32)
    v = mx.array(rng.standard_normal((1, kv_heads, num_keys, dim)), dtype=mx.float32)
    return q, k, v


@pytest.mark.parametrize("bits, group_size", [(4, 64), (8, 32), (3, 32)])
@pytest.mark.parametrize("num_queries", [1, 5])
@pytest.mark.parametrize("with_sinks", [False, True])
def test_quantized_attention_equals_attention_on_dequantized_cache(bits, group_size, num_queries, with_sinks):
    cache = QuantizedKVCache(group_size=group_size, bits=bits)
    q, k, v = random_qkv(num_queries, 20)
    cache.update_and_fetch(k[..., :15, :], v[..., :15, :])
    mask = cache.make_mask(num_queries, return_array=True)  # None for one query, else causal at offset 15
    k, v = k[..., : 15 + num_queries, :], v[..., : 15 + num_queries, :]
    q_keys, q_values = cache.update_and_fetch(k[..., 15:, :], v[..., 15:, :])
    sinks = mx.array([0.5, -1.0, 2.0, 0.0]) if with_sinks else None
    got = quantized_scaled_dot_product_attention(q, q_keys, q_values, 0.125, mask, group_size, bits, sinks=sinks)
    deq_k = mx.dequantize(*q_keys, group_size=group_size, bits=bits)
    deq_v = mx.dequantize(*q_values, group_size=group_size, bits=bits)
    want = mx.fast.scaled_dot_product_attention(q, deq_k, deq_v, scale=0.125, mask=mask, sinks=sinks)
    assert got.shape == want.shape == q.shape
    # Same dequantized values on both sides: only float32 summation order differs.
    assert mx.allclose(got, want, atol=1e-5, rtol=1e-4)


def test_quantized_cache_grows_trims_and_restores():
    cache = QuantizedKVCache(group_size=32, bits=4)
    _, k, v = random_qkv(1, 300, seed=1)
    cache.update_and_fetch(k[..., :299, :], v[..., :299, :])
    keys, values = cache.update_and_fetch(k[..., 299:, :], v[..., 299:, :])
    assert cache.offset == 300 and cache.keys[0].shape[2] == 512  # grown in blocks of 256
    assert keys[0].shape == (1, 2, 300, 64 * 4 // 32) and keys[0].dtype == mx.uint32
    assert keys[1].shape == (1, 2, 300, 2)
    # Each row is quantized on its own: as if quantized all at once.
    whole = mx.quantize(k, 32, 4)
    assert all(mx.array_equal(a, b) for a, b in zip(keys, whole))
    assert cache.is_trimmable() and cache.trim(10) == 10 and cache.offset == 290
    with pytest.raises(ValueError, match="Cannot trim 291"):
        cache.trim(291)
    clone = QuantizedKVCache.from_state(cache.state, cache.meta_state)
    assert (clone.offset, clone.group_size, clone.bits) == (290, 32, 4)
    step_k, step_v = k[..., :1, :], v[..., :1, :]
    a, b = cache.update_and_fetch(step_k, step_v), clone.update_and_fetch(step_k, step_v)
    assert all(mx.array_equal(x, y) for x, y in zip(a[0] + a[1], b[0] + b[1]))
    assert cache.nbytes == sum(t.nbytes for t in cache.keys + cache.values)


def test_kv_cache_to_quantized_and_refusals():
    kv_cache = KVCache()
    _, k, v = random_qkv(1, 7)
    kv_cache.update_and_fetch(k, v)
    quantized = kv_cache.to_quantized(group_size=64, bits=8)
    assert isinstance(quantized, QuantizedKVCache) and quantized.offset == 7
    assert all(mx.array_equal(a, b) for a, b in zip(quantized.state[0], mx.quantize(k, 64, 8)))
    assert KVCache().to_quantized().empty()
    with pytest.raises(ValueError, match="cannot be quantized"):
        RotatingKVCache(8).to_quantized()
    with pytest.raises(ValueError, match="got kv_bits=7"):
        QuantizedKVCache(bits=7)
    with pytest.raises(ValueError, match="got kv_group_size=16"):
        QuantizedKVCache(group_size=16)
    with pytest.raises(ValueError, match="does not divide the head dimension 16"):
        QuantizedKVCache(group_size=32).update_and_fetch(k[..., :16], v[..., :16])


def test_maybe_quantize_kv_cache_leaves_other_entries():
    kv_cache, arrays = KVCache(), ArraysCache(2)
    _, k, v = random_qkv(1, 6)
    kv_cache.update_and_fetch(k, v)
    entries = [kv_cache, arrays]
    maybe_quantize_kv_cache(entries, quantized_kv_start=7, kv_group_size=64, kv_bits=4)
    assert entries[0] is kv_cache  # 6 tokens < start
    maybe_quantize_kv_cache(entries, quantized_kv_start=6, kv_group_size=64, kv_bits=None)
    assert entries[0] is kv_cache  # no kv_bits: nothing to do
    maybe_quantize_kv_cache(entries, quantized_kv_start=6, kv_group_size=64, kv_bits=4)
    assert isinstance(entries[0], QuantizedKVCache) and entries[1] is arrays


@pytest.fixture(scope="module")
def kv_model(tmp_path_factory):
    model, _ = load_model(write_checkpoint(tmp_path_factory.mktemp("kv"), KV_CONFIG, seed=4))
    return model


def test_generate_with_quantized_kv_cache(kv_model):
    plain = list(generate_step(mx.array(PROMPT), kv_model, max_tokens=8))
    prompt_cache = make_prompt_cache(kv_model)
    quantized = list(generate_step(mx.array(PROMPT), kv_model, max_tokens=8, prompt_cache=prompt_cache,
                                   kv_bits=8, kv_group_size=32, quantized_kv_start=0))
    assert all(isinstance(c, QuantizedKVCache) and c.offset == len(PROMPT) + 8 for c in prompt_cache)
    # 8-bit keys/values (a step of ~1/255 of each 32-value group's range) move this
    # random model's log-probabilities by at most 0.24 (measured; its attention logits
    # are large, so softmax amplifies key errors): bound 0.5, and greedy tokens agree.
    # Exactness of the quantized attention itself is tested above.
    assert [t for t, _ in quantized] == [t for t, _ in plain]
    for (_, lp_q), (_, lp_f) in zip(quantized, plain):
        assert mx.abs(lp_q - lp_f).max().item() < 0.5

    # Switching mid-generation: float until the cache holds 15 tokens.
    prompt_cache = make_prompt_cache(kv_model)
    generator = generate_step(mx.array(PROMPT), kv_model, max_tokens=8, prompt_cache=prompt_cache,
                              kv_bits=4, kv_group_size=32, quantized_kv_start=len(PROMPT) + 3)
    next(generator)
    assert type(prompt_cache[0]) is KVCache
    for _ in range(3):
        next(generator)
    assert isinstance(prompt_cache[0], QuantizedKVCache) and prompt_cache[0].bits == 4


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(kv_bits=8, max_kv_size=32), "RotatingKVCache"),
        (dict(kv_bits=7), "got kv_bits=7"),
        (dict(kv_bits=4, kv_group_size=48), "got kv_group_size=48"),
        (dict(kv_bits=4, quantized_kv_start=-1), "quantized_kv_start"),
    ],
)
def test_generate_rejects_bad_kv_options(kv_model, kwargs, message):
    with pytest.raises(ValueError, match=message):
        next(generate_step(mx.array(PROMPT), kv_model, **kwargs))


def test_quantized_cache_must_match_kv_options(kv_model):
    prompt_cache = [QuantizedKVCache(32, 4) for _ in kv_model.layers]
    with pytest.raises(ValueError, match="quantized with kv_bits=4, kv_group_size=32"):
        next(generate_step(mx.array(PROMPT), kv_model, prompt_cache=prompt_cache, kv_bits=8, kv_group_size=32))
