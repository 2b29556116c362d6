"""ssm.py: the Mamba-2 recurrence (sequential, chunked, replay), the causal conv and the
gated norm, each against a naive numpy reference or against each other."""

import mlx.core as mx
import numpy as np
import pytest

from mlx_lm.models import ssm
from mlx_lm.models.ssm import (
    causal_conv1d,
    conv_state_after,
    discretize_dt,
    gated_rms_norm,
    ssd_chunked,
    ssd_recorded,
    ssd_replay,
    ssd_sequential,
    ssd_update,
)


def inputs(T, b=2, H=4, P=3, G=2, N=5, seed=0):
    """Random recurrence inputs with decays in the range trained models have."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((b, T, H, P)).astype(np.float32)
    dt = np.log1p(np.exp(rng.standard_normal((b, T, H)) - 1.0)).astype(np.float32)
    A = -rng.uniform(0.1, 1.0, H).astype(np.float32)
    B = rng.standard_normal((b, T, G, N)).astype(np.float32)
    C = rng.standard_normal((b, T, G, N)).astype(np.float32)
    state = rng.standard_normal((b, H, P, N)).astype(np.float32)
    return x, dt, A, B, C, state


def naive(x, dt, A, B, C, state):
    """The recurrence written out per head and token in numpy."""
    b, T, H, P = x.shape
    r = H // B.shape[2]
    S = state.astype(np.float64).copy()
    y = np.zeros((b, T, H, P))
    for t in range(T):
        for h in range(H):
            g = h // r
            S[:, h] = np.exp(dt[:, t, h] * A[h])[:, None, None] * S[:, h] + (
                (dt[:, t, h, None] * x[:, t, h])[:, :, None] * B[:, t, g, None, :]
            )
            y[:, t, h] = (S[:, h] @ C[:, t, g, :, None])[..., 0]
    return y, S


def rel(got, want):
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    return np.abs(got - want).max() / np.abs(want).max()


def test_sequential_matches_naive():
    args = inputs(7)
    y, S = ssd_sequential(*map(mx.array, args))
    want_y, want_S = naive(*args)
    assert rel(y, want_y) < 1e-5 and rel(S, want_S) < 1e-5


@pytest.mark.parametrize("T, chunk", [(5, 8), (16, 8), (37, 8), (70, 4), (130, 16)])
def test_chunked_equals_sequential(T, chunk):
    """Partial last chunks, several blocks of CHUNKS_PER_BLOCK chunks, heads sharing groups."""
    args = [mx.array(a) for a in inputs(T, seed=T)]
    y, S = ssd_chunked(*args, chunk_size=chunk)
    want_y, want_S = ssd_sequential(*args)
    assert y.shape == want_y.shape and S.shape == want_S.shape
    assert rel(y, want_y) < 1e-5 and rel(S, want_S) < 1e-5


def test_update_picks_a_path_by_length_and_starts_from_zeros():
    short = [mx.array(a) for a in inputs(ssm.CHUNKED_MIN_TOKENS - 1)]
    y, S = ssd_update(*short)
    want_y, want_S = ssd_sequential(*short)
    assert mx.array_equal(y, want_y) and mx.array_equal(S, want_S)  # the same steps
    long = [mx.array(a) for a in inputs(ssm.CHUNK_SIZE + 9, seed=3)]
    zero = mx.zeros_like(long[-1])
    y, S = ssd_update(*long[:-1], None)
    want_y, want_S = ssd_sequential(*long[:-1], zero)
    assert rel(y, want_y) < 1e-5 and rel(S, want_S) < 1e-5


@pytest.mark.parametrize("T", [1, 2, 5, 9])
def test_replay_gives_the_state_after_the_steps(T):
    x, dt, A, B, C, state = (mx.array(a) for a in inputs(T, seed=10 + T))
    got = ssd_replay(x, dt, A, B, state)
    _, want = ssd_sequential(x, dt, A, B, C, state)
    if T == 1:  # the decode step itself: a draft's one-token rollback is bit-exact
        assert mx.array_equal(got, want)
    else:
        assert rel(got, want) < 1e-5


def test_shape_errors_name_the_shapes():
    x, dt, A, B, C, state = (mx.array(a) for a in inputs(3))
    with pytest.raises(ValueError, match=r"dt \(2, 2, 4\)"):
        ssd_update(x, dt[:, :2], A, B, C, state)
    with pytest.raises(ValueError, match="heads \\(4\\) must be a multiple of groups \\(3\\)"):
        ssd_update(x, dt, A, mx.zeros((2, 3, 3, 5)), mx.zeros((2, 3, 3, 5)), state)
    with pytest.raises(ValueError, match="state has shape \\(2, 4, 3, 6\\)"):
        ssd_update(x, dt, A, B, C, mx.zeros((2, 4, 3, 6)))


def test_discretize_dt_is_a_clamped_softplus():
    dt = mx.array([[[-20.0, 0.0, 3.0]]])
    bias = mx.array([0.0, 1.0, -1.0])
    got = np.array(discretize_dt(dt, bias, 0.01))
    softplus = np.log1p(np.exp(np.array([-20.0, 1.0, 2.0])))
    assert np.allclose(got[0, 0], np.maximum(softplus, 0.01), atol=1e-6)
    assert np.allclose(np.array(discretize_dt(dt, bias, 0.0, 0.5))[0, 0], np.minimum(softplus, 0.5), atol=1e-6)


@pytest.mark.parametrize("T", [1, 6])
def test_causal_conv1d_matches_naive(T):
    rng = np.random.default_rng(T)
    b, ch, K = 2, 5, 4
    x = rng.standard_normal((b, K - 1 + T, ch)).astype(np.float32)
    w = rng.standard_normal((ch, K, 1)).astype(np.float32)
    bias = rng.standard_normal(ch).astype(np.float32)
    want = np.stack([(x[:, t : t + K] * w[:, :, 0].T).sum(1) for t in range(T)], axis=1)
    assert np.allclose(np.array(causal_conv1d(mx.array(x), mx.array(w))), want, atol=1e-5)
    assert np.allclose(np.array(causal_conv1d(mx.array(x), mx.array(w), mx.array(bias))), want + bias, atol=1e-5)


def test_conv_state_after_m_rows_is_what_feeding_m_rows_leaves():
    """Feeding rows one at a time, the state is the last K-1 rows of [state ; rows so far]."""
    rng = np.random.default_rng(4)
    K, T = 4, 6
    conv_input = mx.array(rng.standard_normal((1, K - 1 + T, 3)).astype(np.float32))
    state = conv_input[:, : K - 1]
    for m in range(T + 1):
        assert mx.array_equal(conv_state_after(conv_input, m, K), state)
        if m < T:
            state = mx.concatenate([state, conv_input[:, K - 1 + m : K + m]], axis=1)[:, 1:]


def test_gated_rms_norm_matches_naive_per_group():
    rng = np.random.default_rng(5)
    y, z = (rng.standard_normal((2, 3, 12)).astype(np.float32) for _ in range(2))
    w = rng.standard_normal(12).astype(np.float32)
    h = y * z / (1 + np.exp(-z))
    groups = h.reshape(2, 3, 3, 4)
    want = (groups / np.sqrt((groups**2).mean(-1, keepdims=True) + 1e-5)).reshape(2, 3, 12) * w
    got = gated_rms_norm(mx.array(y), mx.array(z), mx.array(w), 4, 1e-5)
    assert np.allclose(np.array(got), want, atol=1e-5)
    whole = gated_rms_norm(mx.array(y), mx.array(z), mx.array(w), 12, 1e-5)
    assert not np.allclose(np.array(whole), want, atol=1e-3)  # groups matter
    normed = y.reshape(2, 3, 3, 4)
    normed = (normed / np.sqrt((normed**2).mean(-1, keepdims=True) + 1e-5)).reshape(2, 3, 12)
    after = gated_rms_norm(mx.array(y), mx.array(z), mx.array(w), 4, 1e-5, norm_before_gate=True)
    assert np.allclose(np.array(after), normed * w * z / (1 + np.exp(-z)), atol=1e-5)
    with pytest.raises(ValueError, match="12 channels do not split into groups of 5"):
        gated_rms_norm(mx.array(y), mx.array(z), mx.array(w), 5, 1e-5)


# --- upstream's ssm_update ------------------------------------------------------------


def naive_ssm_update(x, A_log, B, C, D, dt, dt_bias, limits, valid):
    """Upstream's semantics in float64 numpy: step = clip(softplus(dt + dt_bias)); a step
    that is not `valid` leaves the state alone; y = S C + D x."""
    x, B, C, dt = (np.array(a, dtype=np.float64) for a in (x, B, C, dt))
    b, T, H, P = x.shape
    G, N = B.shape[-2:]
    step = np.clip(np.logaddexp(dt + np.array(dt_bias, np.float64), 0.0), *limits)
    A = -np.exp(np.array(A_log, np.float64))
    S, ys = np.zeros((b, H, P, N)), np.zeros((b, T, H, P))
    for i in range(b):
        for t in range(T):
            for h in range(H):
                g = h // (H // G)
                if valid[i, t]:
                    S[i, h] = np.exp(step[i, t, h] * A[h]) * S[i, h] + step[i, t, h] * np.outer(x[i, t, h], B[i, t, g])
                ys[i, t, h] = S[i, h] @ C[i, t, g] + np.array(D, np.float64)[h] * x[i, t, h]
    return ys, S


@pytest.mark.parametrize("T", [5, 40])  # the stepping and the chunked path
@pytest.mark.parametrize("padding", ["none", "mask", "lengths"])
def test_upstream_ssm_update_matches_naive(T, padding):
    x, dt, _, B, C, _ = (mx.array(a) for a in inputs(T))
    rng = np.random.default_rng(1)
    A_log, D, dt_bias = (mx.array(rng.standard_normal(4).astype(np.float32)) for _ in range(3))
    lengths = np.array([T, T - 3])
    valid = np.arange(T)[None] < lengths[:, None] if padding != "none" else np.ones((2, T), bool)
    kwargs = {"mask": mx.array(valid)} if padding == "mask" else (
        {"lengths": mx.array(lengths)} if padding == "lengths" else {})
    y, state = ssm.ssm_update(x, A_log, B, C, D, dt, dt_bias, time_step_limit=(0.01, 10.0), **kwargs)
    want_y, want_state = naive_ssm_update(x, A_log, B, C, D, dt, dt_bias, (0.01, 10.0), valid)
    assert rel(state, want_state) < 1e-4
    assert rel(mx.array(np.array(y)[valid]), want_y[valid]) < 1e-4  # real tokens only
    want_dt = np.clip(np.logaddexp(np.array(dt) + np.array(dt_bias), 0), 0.01, 10)
    assert ssm.ssm_attn is ssm.ssm_update and rel(ssm.compute_dt(dt, dt_bias, (0.01, 10.0)), want_dt) < 1e-6


def test_recorded_verify_rewinds_to_the_state_feeding_gives():
    """A verify-length forward keeps each step's state: rewinding to m (one m, or one
    per row) is bit for bit feeding only those m tokens; a prefill-length forward
    replays (to rounding)."""
    x, dt, A, B, C, state = (mx.array(a) for a in inputs(5, b=3, seed=7))
    y, final, state_after = ssd_recorded(x, dt, A, B, C, state)
    plain_y, plain_final = ssd_update(x, dt, A, B, C, state)
    assert mx.array_equal(y, plain_y) and mx.array_equal(final, plain_final)
    fed = [state] + [ssd_update(x[:, :m], dt[:, :m], A, B[:, :m], C[:, :m], state)[1] for m in range(1, 6)]
    for m in range(6):
        assert mx.array_equal(state_after(m), fed[m])
    per_row = state_after([4, 0, 2])
    for b, m in enumerate([4, 0, 2]):
        assert mx.array_equal(per_row[b], fed[m][b])
    T = ssm.CHUNKED_MIN_TOKENS + 3
    x, dt, A, B, C, state = (mx.array(a) for a in inputs(T, seed=8))
    _, final, state_after = ssd_recorded(x, dt, A, B, C, state)
    want = ssd_update(x[:, :7], dt[:, :7], A, B[:, :7], C[:, :7], state)[1]
    assert mx.allclose(state_after(7), want, atol=1e-5)
    assert mx.allclose(state_after([7, T])[1], final[1], atol=1e-5)
