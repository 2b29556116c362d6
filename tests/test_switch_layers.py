"""switch_layers.py: expert matmuls by gather, against a per-expert loop."""

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest

from mlx_lm.models.switch_layers import SORT_THRESHOLD, SwitchGLU, gather_mm_runs_in

E, D, H, K = 6, 32, 64, 2


def naive_switch_glu(layer, x, indices):
    """Each (token, slot) through its expert with plain matmuls: (B, L, D) -> (B, L, k, D)."""
    weights = {n: np.array(getattr(layer, n).weight) for n in ("gate_proj", "up_proj", "down_proj")}
    biases = {n: np.array(getattr(layer, n).bias) for n in ("gate_proj", "up_proj", "down_proj")}
    x, indices = np.array(x), np.array(indices)
    out = np.zeros(indices.shape + (D,), np.float32)
    for b, t, j in np.ndindex(*indices.shape):
        e = indices[b, t, j]
        gate = weights["gate_proj"][e] @ x[b, t] + biases["gate_proj"][e]
        up = weights["up_proj"][e] @ x[b, t] + biases["up_proj"][e]
        out[b, t, j] = weights["down_proj"][e] @ (gate / (1 + np.exp(-gate)) * up) + biases["down_proj"][e]
    return out


@pytest.mark.parametrize("num_tokens", [3, SORT_THRESHOLD])  # unsorted decode, sorted prefill
def test_switch_glu_matches_per_expert_loop(num_tokens):
    mx.random.seed(0)
    layer = SwitchGLU(D, H, E, bias=True)
    for name in ("gate_proj", "up_proj", "down_proj"):
        proj = getattr(layer, name)
        proj.bias = mx.random.normal(proj.bias.shape)
    x = mx.random.normal((1, num_tokens, D))
    indices = mx.random.randint(0, E, (1, num_tokens, K))
    assert np.abs(np.array(layer(x, indices)) - naive_switch_glu(layer, x, indices)).max() < 1e-4


def test_half_precision_experts_run_everywhere():
    """Where the backend has no half-precision gather kernel (MLX's CPU), the product runs
    in float32 and equals the float32 layer's to half precision."""
    mx.random.seed(1)
    layer = SwitchGLU(D, H, E)
    x = mx.random.normal((1, 5, D))
    indices = mx.random.randint(0, E, (1, 5, K))
    want = layer(x, indices)
    assert gather_mm_runs_in(mx.float32, mx.default_device())
    layer.set_dtype(mx.float16)
    got = layer(x.astype(mx.float16), indices)
    assert got.dtype == mx.float16
    assert mx.allclose(got.astype(mx.float32), want, atol=2e-2, rtol=2e-2)


def test_quantized_experts_match_float_within_quantization_error():
    mx.random.seed(2)
    layer = SwitchGLU(D, H, E)
    x = mx.random.normal((1, 4, D))
    indices = mx.random.randint(0, E, (1, 4, K))
    want = layer(x, indices)
    nn.quantize(layer, group_size=32, bits=8)
    assert type(layer.gate_proj).__name__ == "QuantizedSwitchLinear"
    assert mx.abs(layer(x, indices) - want).max().item() < 0.02 * mx.abs(want).max().item()
