"""Upstream mlx-lm 0.32.2's model-level public names (issue 32), each against a naive
reference or an identity it must satisfy: the cache batch forms, activations, rope,
segsum, the expert layers, MultiLinear and the ops-only gated delta recurrence."""

import math

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest

from mlx_lm.models.activations import XIELU, SwigluOAI, XieLU, precise_swiglu, swiglu, swiglu_oai
from mlx_lm.models.base import gather_last_axis
from mlx_lm.models.batch_cache import merge_caches
from mlx_lm.models.cache import ArraysCache, CacheList, ChunkedKVCache, KVCache
from mlx_lm.models.gated_delta import gated_delta_ops
from mlx_lm.models.gpt_oss import clamped_swiglu
from mlx_lm.models.mla import MultiLinear, QuantizedMultiLinear
from mlx_lm.models.rope_utils import DynamicNTKScalingRoPE, Llama3RoPE, apply_yarn_mscale
from mlx_lm.models.ssm import segsum
from mlx_lm.models.switch_layers import QuantizedSwitchLinear, SwiGLU, SwitchGLU, SwitchLinear, SwitchMLP


def _filled_arrays(seed: int, rows: int = 1) -> ArraysCache:
    rng = np.random.default_rng(seed)
    cache = ArraysCache(2)
    cache[0] = mx.array(rng.standard_normal((rows, 3, 4)).astype(np.float32))
    cache[1] = mx.array(rng.standard_normal((rows, 2)).astype(np.float32))
    return cache


# --- ArraysCache / CacheList batch forms ----------------------------------------------


def test_arrays_cache_extend_equals_stacking_the_rows():
    a, b, c = _filled_arrays(0), _filled_arrays(1, rows=2), _filled_arrays(2)
    joined = a.extend(b)
    assert joined is a and a.batch_size == 3
    a.extend(c)
    for i in range(2):
        want = np.concatenate([np.array(_filled_arrays(s, r)[i]) for s, r in ((0, 1), (1, 2), (2, 1))])
        np.testing.assert_array_equal(np.array(a[i]), want)


def test_arrays_cache_filter_equals_taking_the_rows_in_place():
    batch = _filled_arrays(3, rows=4)
    before = [np.array(batch[i]) for i in range(2)]
    kept = batch.filter([3, 1])
    assert kept is batch and batch.batch_size == 2  # as upstream's: in place
    for i in range(2):
        np.testing.assert_array_equal(np.array(kept[i]), before[i][[3, 1]])
    assert batch.filter(mx.array([0])).batch_size == 1
    with pytest.raises(IndexError, match=r"rows \[4\] do not exist"):
        batch.filter([4])


def test_arrays_cache_filter_then_extend_equals_building_the_batch_directly():
    rows = [_filled_arrays(s) for s in range(3)]
    batch = merge_caches([[r] for r in rows])[0]
    rebuilt = batch.filter([0]).extend(rows[2])
    direct = merge_caches([[rows[0]], [rows[2]]])[0]
    for i in range(2):
        np.testing.assert_array_equal(np.array(rebuilt[i]), np.array(direct[i]))


def test_arrays_cache_extend_counts_rows_without_state_and_refuses_mixing():
    empty = ArraysCache(2).extend(ArraysCache(2))
    assert empty.empty() and empty.batch_size == 2
    with pytest.raises(ValueError, match="has seen no token cannot join"):
        _filled_arrays(0).extend(ArraysCache(2))
    with pytest.raises(ValueError, match="cannot join a batch of 2"):
        _filled_arrays(0).extend(ArraysCache(3))
    with pytest.raises(ValueError, match="ArraysCache cannot be extended by a KVCache"):
        _filled_arrays(0).extend(KVCache())


def test_cache_list_batch_forms_delegate_to_each_child():
    pair = CacheList(_filled_arrays(0, rows=3), _filled_arrays(1, rows=3))
    before = np.array(pair[1][0])
    kept = pair.filter([2, 0])
    assert kept is pair and [c.batch_size for c in pair.caches] == [2, 2]  # in place, as upstream's
    np.testing.assert_array_equal(np.array(pair[1][0]), before[[2, 0]])
    assert pair.extend(CacheList(_filled_arrays(2), _filled_arrays(3))) is pair
    assert [c.batch_size for c in pair.caches] == [3, 3]
    row = pair.extract(2)
    np.testing.assert_array_equal(np.array(row[0][1]), np.array(_filled_arrays(2)[1]))
    pair.prepare(lengths=[1, 1, 1])
    pair.finalize()
    with pytest.raises(ValueError, match="cannot be extended by 1 children"):
        pair.extend(CacheList(_filled_arrays(4)))


def test_batch_forms_on_a_one_sequence_cache_say_so():
    with pytest.raises(ValueError, match="KVCache holds one sequence, so it has no batch rows to filter"):
        CacheList(KVCache(), ArraysCache(2)).filter([0])
    with pytest.raises(ValueError, match="no batch rows to extend"):
        KVCache().extend(KVCache())


def test_batched_cache_list_keeps_its_kind_through_filter():
    rows = [[CacheList(KVCache(), _filled_arrays(s))] for s in range(2)]
    for entry, in rows:
        entry[0].update_and_fetch(mx.ones((1, 1, 2, 4)), mx.ones((1, 1, 2, 4)))
    batch = merge_caches(rows)[0]
    kept = batch.filter([1])
    assert type(kept) is type(batch) and kept[1].batch_size == 1


# --- ChunkedKVCache -----------------------------------------------------------------


def test_chunked_cache_start_position_is_the_oldest_position_held():
    cache = ChunkedKVCache(4)
    seen = []
    for _ in range(7):
        cache.maybe_trim_front()  # a no-op: the ring holds at most one chunk
        cache.update_and_fetch(mx.ones((1, 1, 1, 2)), mx.ones((1, 1, 1, 2)))
        seen.append(cache.start_position)
    assert seen == [max(0, n - 4) for n in range(1, 8)]
    keys, _ = cache.update_and_fetch(mx.ones((1, 1, 3, 2)), mx.ones((1, 1, 3, 2)))
    # A multi-token update returns the held window then the new tokens, in order.
    assert keys.shape[2] == 4 + 3


# --- activations ----------------------------------------------------------------------


def _np_silu(x):
    return x / (1 + np.exp(-x))


def test_swiglu_forms_match_their_formulas():
    rng = np.random.default_rng(0)
    gate, x = (rng.standard_normal((3, 8)).astype(np.float32) * 6 for _ in range(2))
    np.testing.assert_allclose(np.array(swiglu(mx.array(gate), mx.array(x))), _np_silu(gate) * x, rtol=1e-5, atol=1e-6)
    half = mx.array(x).astype(mx.float16)
    precise = precise_swiglu(half, mx.array(gate).astype(mx.float16), half)
    assert precise.dtype == mx.float16
    g16, x16 = (a.astype(np.float16).astype(np.float32) for a in (gate, x))
    np.testing.assert_allclose(np.array(precise.astype(mx.float32)), (_np_silu(g16) * x16).astype(np.float16), rtol=1e-3)
    alpha, limit = 1.5, 2.0
    clipped = np.minimum(gate, limit)
    want = clipped / (1 + np.exp(-alpha * clipped)) * (np.clip(x, -limit, limit) + 1)
    got = swiglu_oai(mx.array(gate), mx.array(x), alpha, limit)
    np.testing.assert_allclose(np.array(got), want, rtol=1e-5, atol=1e-6)
    np.testing.assert_array_equal(np.array(SwigluOAI(alpha, limit)(mx.array(x), mx.array(gate))), np.array(got))
    np.testing.assert_array_equal(np.array(clamped_swiglu(mx.array(x), mx.array(gate), alpha, limit)), np.array(got))


def test_xielu_upstream_spelling_is_the_same_class():
    assert XieLU is XIELU


# --- base.gather_last_axis ------------------------------------------------------------


class _FakeGroup:
    def __init__(self, size):
        self._size = size

    def size(self):
        return self._size


def test_gather_last_axis_puts_rank_r_at_columns_r(monkeypatch):
    x = mx.arange(6, dtype=mx.float32).reshape(2, 3)
    assert np.array_equal(np.array(gather_last_axis(x, mx.distributed.init())), np.array(x))
    # Three ranks whose slices are x + 10 r, as all_gather stacks them (rank-major on axis 0).
    monkeypatch.setattr(mx.distributed, "all_gather",
                        lambda a, group: mx.concatenate([a + 10 * r for r in range(group.size())]))
    got = gather_last_axis(x, _FakeGroup(3))
    want = np.concatenate([np.array(x) + 10 * r for r in range(3)], axis=-1)
    np.testing.assert_array_equal(np.array(got), want)
    with pytest.raises(ValueError, match="got a scalar"):
        gather_last_axis(mx.array(1.0), _FakeGroup(1))


# --- rope_utils -----------------------------------------------------------------------


def test_dynamic_ntk_scaling_rope_decodes_with_the_base_of_its_length():
    dims, max_pos, base, factor = 8, 16, 10000.0, 2.0
    rope = DynamicNTKScalingRoPE(dims, max_pos, False, base, factor)
    x = mx.array(np.random.default_rng(1).standard_normal((1, 2, 1, dims)).astype(np.float32))
    for offset in (3, 15, 16, 40):
        seq_len = max(offset + 1, max_pos)  # upstream's per-call rule, one token
        ntk_base = base * (factor * seq_len / max_pos - (factor - 1)) ** (dims / (dims - 2))
        want = mx.fast.rope(x, dims, traditional=False, base=ntk_base, scale=1.0, offset=offset)
        np.testing.assert_allclose(np.array(rope(x, offset=offset)), np.array(want), rtol=1e-4, atol=1e-5)
    within = mx.array(np.random.default_rng(2).standard_normal((1, 2, 10, dims)).astype(np.float32))
    np.testing.assert_allclose(np.array(rope(within, offset=2)),
                               np.array(nn.RoPE(dims, base=base)(within, offset=2)), rtol=1e-5, atol=1e-6)
    assert rope.extra_repr() == "8, traditional=False, max_position_embeddings=16, factor=2.0"


def test_llama3_rope_extra_repr():
    rope = Llama3RoPE(16, 2048, False, 500000.0, {"factor": 8.0})
    assert rope.extra_repr() == "16, traditional=False, max_position_embeddings=2048"


def test_apply_yarn_mscale_is_the_squared_mscale_of_mscale_all_dim():
    factor, all_dim = 40.0, 0.707
    s = 0.1 * all_dim * math.log(factor) + 1.0
    for config in ({"type": "yarn", "factor": factor, "mscale_all_dim": all_dim},
                   {"rope_type": "yarn", "factor": factor, "mscale_all_dim": all_dim}):
        assert math.isclose(apply_yarn_mscale(0.125, config), 0.125 * s * s)
    for config in (None, {}, {"rope_type": "default", "factor": factor, "mscale_all_dim": all_dim},
                   {"rope_type": "yarn", "factor": factor}, {"rope_type": "yarn", "factor": 1.0, "mscale_all_dim": 1}):
        assert apply_yarn_mscale(0.125, config) == 0.125


# --- ssm.segsum -----------------------------------------------------------------------


def _np_segsum(x, mask=None):
    T = x.shape[-1]
    out = np.zeros(x.shape + (T,), np.float64)
    for i in range(T):
        for j in range(T):
            if i > j:
                out[..., i, j] = x[..., j + 1 : i + 1].sum(-1)
    if mask is not None:
        both = mask[:, None, :, None] & mask[:, None, None, :]
        out = np.where(both, out, -np.inf)
    return out


def test_segsum_matches_the_naive_sums():
    x = np.random.default_rng(3).standard_normal((2, 3, 5)).astype(np.float32)
    np.testing.assert_allclose(np.array(segsum(mx.array(x))), _np_segsum(x), rtol=1e-5, atol=1e-5)
    mask = np.array([[True] * 5, [False, False, True, True, True]])
    masked = np.where(mask[:, None], x, 0)
    np.testing.assert_allclose(np.array(segsum(mx.array(x), mx.array(mask))), _np_segsum(masked, mask), rtol=1e-5, atol=1e-5)


# --- switch_layers --------------------------------------------------------------------


@pytest.mark.parametrize("num_tokens", [3, 40])  # 40 tokens x 2 experts: the sorted path
def test_switch_mlp_equals_per_expert_mlps(num_tokens):
    mx.random.seed(4)
    mlp = SwitchMLP(8, 12, 4, bias=True)
    mlp.update({"fc1": {"bias": mx.random.normal((4, 12))}, "fc2": {"bias": mx.random.normal((4, 8))}})
    x = mx.random.normal((1, num_tokens, 8))
    indices = mx.random.randint(0, 4, (1, num_tokens, 2))
    got = np.array(mlp(x, indices))
    w1, b1, w2, b2 = (np.array(a, dtype=np.float64) for a in (mlp.fc1.weight, mlp.fc1.bias, mlp.fc2.weight, mlp.fc2.bias))
    gelu = nn.GELU(approx="precise")
    for t in range(num_tokens):
        for slot in range(2):
            e = int(indices[0, t, slot])
            hidden = np.array(gelu(mx.array((w1[e] @ np.array(x[0, t]) + b1[e]).astype(np.float32))))
            np.testing.assert_allclose(got[0, t, slot], w2[e] @ hidden + b2[e], rtol=1e-4, atol=1e-4)


def test_swiglu_module_is_switch_glus_default():
    glu = SwitchGLU(8, 4, 2)
    assert isinstance(glu.activation, SwiGLU)
    up, gate = mx.array([1.0, -2.0]), mx.array([0.5, 3.0])
    np.testing.assert_array_equal(np.array(SwiGLU()(up, gate)), np.array(nn.silu(gate) * up))


@pytest.mark.parametrize("options", [{}, {"group_size": 32, "bits": 8}, {"mode": "mxfp4"}])
def test_switch_linear_shape_properties_survive_quantization(options):
    layer = SwitchLinear(64, 16, 3)
    assert (layer.input_dims, layer.output_dims, layer.num_experts) == (64, 16, 3)
    mode = options.get("mode", "affine")
    quantized = layer.to_quantized(options.get("group_size"), options.get("bits"), mode)
    assert isinstance(quantized, QuantizedSwitchLinear)
    assert (quantized.input_dims, quantized.output_dims, quantized.num_experts) == (64, 16, 3)


# --- mla.MultiLinear ------------------------------------------------------------------


def _per_head(x: mx.array, w: np.ndarray, transpose: bool) -> np.ndarray:
    """x (B, H, L, .) times each head's matrix w[h] (out, in): x W^T, or x W."""
    return np.stack([np.array(x)[:, h] @ (w[h].T if transpose else w[h]) for h in range(w.shape[0])], axis=1)


def _check_multi_linear(layer, w: np.ndarray, rtol: float) -> None:
    heads, out_dims, in_dims = w.shape
    for transpose, dims in ((True, in_dims), (False, out_dims)):
        x = mx.random.normal((2, heads, 4, dims))
        np.testing.assert_allclose(np.array(layer(x, transpose=transpose)), _per_head(x, w, transpose),
                                   rtol=rtol, atol=rtol)


def test_multi_linear_is_one_matmul_per_head_both_ways():
    mx.random.seed(5)
    layer = MultiLinear(16, 6, 3)  # weight (H, out, in)
    assert layer.weight.shape == (3, 6, 16)
    _check_multi_linear(layer, np.array(layer.weight), 1e-5)
    x = mx.random.normal((1, 3, 2, 16))
    np.testing.assert_array_equal(np.array(layer(x)), np.array(layer(x, transpose=True)))


def test_quantized_multi_linear_computes_with_the_dequantized_weight():
    mx.random.seed(6)
    model = nn.Sequential(MultiLinear(64, 8, 2))
    nn.quantize(model, group_size=32, bits=8)
    layer = model.layers[0]
    assert isinstance(layer, QuantizedMultiLinear) and (layer.group_size, layer.bits) == (32, 8)
    dequantized = np.array(mx.dequantize(layer.weight, layer.scales, layer.biases, 32, 8))  # (H, out, in)
    _check_multi_linear(layer, dequantized, 1e-4)
    assert set(QuantizedMultiLinear(64, 8, 2, mode="mxfp4").parameters()) == {"weight", "scales"}


# --- gated_delta.gated_delta_ops ------------------------------------------------------


def _np_gated_delta(q, k, v, g, beta, state, mask):
    B, T, Hk, _ = q.shape
    Hv = v.shape[2]
    state, ys = state.astype(np.float64).copy(), np.zeros(v.shape[:3] + (v.shape[3],))
    for t in range(T):
        for b in range(B):
            for h in range(Hv):
                kh, qh = k[b, t, h // (Hv // Hk)], q[b, t, h // (Hv // Hk)]
                S = state[b, h] * g[b, t, h]  # a scalar, or one gate per key channel (Dk,)
                S = S + np.outer(beta[b, t, h] * (v[b, t, h] - S @ kh), kh)
                ys[b, t, h] = S @ qh
                if mask is None or mask[b, t]:
                    state[b, h] = S
                else:
                    ys[b, t, h] = 0
    return ys, state


@pytest.mark.parametrize("per_channel", [False, True])
def test_gated_delta_ops_matches_the_naive_recurrence(per_channel):
    """Scalar gates (B, T, Hv) and, as upstream's, a gate per key channel (B, T, Hv, Dk)."""
    rng = np.random.default_rng(7)
    B, T, Hk, Hv, Dk, Dv = 2, 5, 1, 2, 4, 3
    q, k = (rng.standard_normal((B, T, Hk, Dk)).astype(np.float32) * 0.5 for _ in range(2))
    v = rng.standard_normal((B, T, Hv, Dv)).astype(np.float32)
    gate_shape = (B, T, Hv, Dk) if per_channel else (B, T, Hv)
    g, beta = rng.uniform(0.5, 1.0, gate_shape).astype(np.float32), rng.uniform(0, 1, (B, T, Hv)).astype(np.float32)
    state = rng.standard_normal((B, Hv, Dv, Dk)).astype(np.float32)
    mask = np.array([[True] * T, [False, True, True, False, True]])
    for m in (None, mask):
        y, new_state = gated_delta_ops(*map(mx.array, (q, k, v, g, beta, state)), None if m is None else mx.array(m))
        want_y, want_state = _np_gated_delta(q, k, v, g, beta, state, m)
        np.testing.assert_allclose(np.array(y), want_y, rtol=1e-4, atol=1e-5)
        np.testing.assert_allclose(np.array(new_state), want_state, rtol=1e-4, atol=1e-5)
    y, zero_start = gated_delta_ops(*map(mx.array, (q, k, v, g, beta)))
    assert zero_start.dtype == mx.float32
    np.testing.assert_allclose(np.array(zero_start), _np_gated_delta(q, k, v, g, beta, 0 * state, None)[1],
                               rtol=1e-4, atol=1e-5)
    with pytest.raises(ValueError, match="inputs disagree"):
        gated_delta_ops(*map(mx.array, (q, k, v, np.ones((B, T, Hv, Dk + 1), np.float32), beta)))