"""selective_scan.py against a naive float64 loop of the Mamba-1 recurrence: the
sequential reference, the chunked prefill form and the rollback replay (per-row counts;
both the same bits as stepping) and the cache entries a rollback restores."""

import mlx.core as mx
import numpy as np
import pytest

from mlx_lm.models.selective_scan import (
    CHUNKED_MIN_TOKENS,
    replay_prefix,
    scan_chunked,
    scan_replay,
    scan_sequential,
    selective_scan,
)
from mlx_lm.models.ssm import causal_conv1d


def inputs(b=2, T=45, I=12, N=6, seed=0):
    """x, dt > 0, A in (-16, -0.5) (strong and weak decays), B, C, a nonzero state."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((b, T, I))
    dt = rng.uniform(0.01, 1.0, (b, T, I))
    A = -rng.uniform(0.5, 16.0, (I, N))
    B, C = rng.standard_normal((b, T, N)), rng.standard_normal((b, T, N))
    state = rng.standard_normal((b, I, N))
    return x, dt, A, B, C, state


def as_mx(*arrays):
    return [mx.array(a.astype(np.float32)) for a in arrays]


def naive(x, dt, A, B, C, state):
    """The recurrence written out per batch row, channel and token, in float64."""
    b, T, I = x.shape
    S, y = state.copy(), np.zeros((b, T, I))
    for r in range(b):
        for t in range(T):
            for d in range(I):
                S[r, d] = np.exp(dt[r, t, d] * A[d]) * S[r, d] + dt[r, t, d] * x[r, t, d] * B[r, t]
                y[r, t, d] = S[r, d] @ C[r, t]
    return y, S


def test_sequential_matches_the_naive_loop():
    arrays = inputs()
    want_y, want_S = naive(*arrays)
    y, S = scan_sequential(*as_mx(*arrays))
    assert np.abs(np.array(y) - want_y).max() < 1e-4 * np.abs(want_y).max()
    assert np.abs(np.array(S) - want_S).max() < 1e-4 * np.abs(want_S).max()


@pytest.mark.parametrize("chunk_size", [1, 5, 8, 32, 64])
def test_chunked_equals_sequential_bit_for_bit(chunk_size):
    """Every chunking (crossing chunks several times, a ragged last one, one chunk
    longer than T) computes the decode step's arithmetic: the same bits."""
    x, dt, A, B, C, S = as_mx(*inputs())
    y_seq, S_seq = scan_sequential(x, dt, A, B, C, S)
    y, S_chunked = scan_chunked(x, dt, A, B, C, S, chunk_size=chunk_size)
    assert mx.array_equal(y, y_seq) and mx.array_equal(S_chunked, S_seq)
    with pytest.raises(ValueError, match="chunk_size must be positive, got 0"):
        scan_chunked(x, dt, A, B, C, S, chunk_size=0)


def test_selective_scan_dispatch_dtypes_and_zero_state():
    x, dt, A, B, C, _ = as_mx(*inputs(T=CHUNKED_MIN_TOKENS + 3))
    y, S = selective_scan(x, dt, A, B, C)  # chunked, from zeros
    y_ref, S_ref = scan_sequential(x, dt, A, B, C, mx.zeros(S.shape))
    assert mx.array_equal(y, y_ref) and mx.array_equal(S, S_ref)
    y16, S16 = selective_scan(x.astype(mx.bfloat16), dt, A, B, C)
    assert y16.dtype == mx.bfloat16 and S16.dtype == mx.float32
    with pytest.raises(ValueError, match=r"expected x, dt \(b, T, I\), A \(I, N\)"):
        selective_scan(x, dt[:, :3], A, B, C)
    with pytest.raises(ValueError, match=r"state has shape \(1, 12, 6\), expected \(2, 12, 6\)"):
        selective_scan(x, dt, A, B, C, mx.zeros((1, 12, 6)))


def test_replay_is_the_state_after_the_prefix():
    x, dt, A, B, C, S = as_mx(*inputs(T=7))
    for m in range(1, 8):
        _, want = scan_sequential(x[:, :m], dt[:, :m], A, B[:, :m], C[:, :m], S)
        got = scan_replay(x[:, :m], dt[:, :m], A, B[:, :m], S)
        assert mx.array_equal(got, want), m  # the decode step's arithmetic: the same bits


def test_replay_rows_by_their_own_counts():
    x, dt, A, B, C, S = as_mx(*inputs(b=3, T=6))
    got = scan_replay(x, dt, A, B, S, num_steps=[0, 2, 6])
    assert mx.array_equal(got[0], S[0])  # dt = 0: untouched
    for row, m in ((1, 2), (2, 6)):
        _, want = scan_sequential(x[row : row + 1, :m], dt[row : row + 1, :m], A, B[row : row + 1, :m],
                                  C[row : row + 1, :m], S[row : row + 1])
        assert mx.array_equal(got[row], want[0]), row


def test_replay_prefix_restores_conv_and_ssm_state():
    """After m of T tokens: the conv state is the last K-1 conv inputs up to m (what a
    feed of m tokens leaves), the SSM state the replay's; m = 0 is the pre-forward state."""
    K, T = 4, 6
    x, dt, A, B, C, S = as_mx(*inputs(b=2, T=T))
    rng = np.random.default_rng(1)
    conv_input = mx.array(rng.standard_normal((2, K - 1 + T, 12)).astype(np.float32))
    conv, ssm = replay_prefix(conv_input, x, dt, A, B, S, K, 0)
    assert mx.array_equal(conv, conv_input[:, : K - 1]) and mx.array_equal(ssm, S)
    conv, ssm = replay_prefix(conv_input, x, dt, A, B, S, K, 4)
    assert mx.array_equal(conv, conv_input[:, 4 : 4 + K - 1])
    assert mx.array_equal(ssm, scan_sequential(x[:, :4], dt[:, :4], A, B[:, :4], C[:, :4], S)[1])
    conv, ssm = replay_prefix(conv_input, x, dt, A, B, S, K, [1, 5])
    assert mx.array_equal(conv[0], conv_input[0, 1:4]) and mx.array_equal(conv[1], conv_input[1, 5:8])
    # The conv of the held rows continues exactly as over the whole input.
    weight = mx.array(rng.standard_normal((12, K, 1)).astype(np.float32))
    whole = causal_conv1d(conv_input, weight)
    resumed = causal_conv1d(mx.concatenate([conv_input[:, 4:7], conv_input[:, 7:]], axis=1), weight)
    assert mx.allclose(resumed, whole[:, 4:], atol=1e-6)
