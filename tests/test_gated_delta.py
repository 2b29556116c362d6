"""gated_delta.py and kda.py: both paths against a float64 NumPy reference of the recurrence, and
against each other across lengths, head ratios, chunk boundaries and carried state."""

import math

import mlx.core as mx
import numpy as np
import pytest

from mlx_lm.models.gated_delta import (
    CHUNK_SIZE,
    CHUNKED_MIN_TOKENS,
    CHUNKS_PER_BLOCK,
    compute_beta,
    compute_g,
    gated_delta_chunked,
    gated_delta_recorded,
    gated_delta_recurrence,
    gated_delta_replay,
    gated_delta_sequential,
    gated_delta_update,
    unit_lower_inverse,
)
from mlx_lm.models.kda import (
    KDA_CHUNK_SIZE,
    KDA_CHUNKS_PER_BLOCK,
    compute_kda_g,
    kda_chunked,
    kda_recorded,
    kda_recurrence,
    kda_replay,
    kda_sequential,
)

FP32_TOLERANCE = 1e-5  # max |error| / max |reference|; observed ~1e-6


def reference(q, k, v, g, beta, state):
    """The recurrence token by token in float64: S <- g S; S <- S + beta (v - S k) k^T; y = S q.
    (KDA's loop with the one gate on every channel.)"""
    g = np.broadcast_to(np.array(g, dtype=np.float64)[..., None], (*np.shape(g), q.shape[-1]))
    return kda_reference(q, k, v, g, beta, state)


def kda_reference(q, k, v, g, beta, state):
    """KDA token by token in float64: S <- S diag(g); S <- S + beta (v - S k) k^T; y = S q."""
    q, k, v, g, beta, S = (np.array(x, dtype=np.float64) for x in (q, k, v, g, beta, state))
    B, T, Hk, _ = q.shape
    Hv, Dv = v.shape[-2:]
    y = np.zeros((B, T, Hv, Dv))
    for t in range(T):
        for h in range(Hv):
            kh, qh = k[:, t, h // (Hv // Hk)], q[:, t, h // (Hv // Hk)]
            S[:, h] *= g[:, t, h][:, None, :]
            delta = beta[:, t, h][:, None] * (v[:, t, h] - np.einsum("bvk,bk->bv", S[:, h], kh))
            S[:, h] += delta[:, :, None] * kh[:, None, :]
            y[:, t, h] = np.einsum("bvk,bk->bv", S[:, h], qh)
    return y, S


def make_inputs(B=1, T=8, Hk=2, Hv=4, Dk=16, Dv=8, seed=0, similar_keys=False, g_range=(0.5, 1.0), beta_max=1.0):
    """Normalised q (scaled by Dk^-1/2) and k, as the models feed them, and an initial
    state; beta in (0, beta_max) (2: the negative-eigenvalue variant)."""
    rng = np.random.default_rng(seed)
    q, k = rng.standard_normal((2, B, T, Hk, Dk))
    if similar_keys:  # every key nearly the same direction: the UT system is near-singular
        k = k[:, :1] + 0.01 * k
    q /= np.linalg.norm(q, axis=-1, keepdims=True) * math.sqrt(Dk)
    k /= np.linalg.norm(k, axis=-1, keepdims=True)
    v = rng.standard_normal((B, T, Hv, Dv))
    g = rng.uniform(*g_range, (B, T, Hv))
    beta = rng.uniform(0, beta_max, (B, T, Hv))
    state = rng.standard_normal((B, Hv, Dv, Dk)) * 0.3
    return [mx.array(x.astype(np.float32)) for x in (q, k, v, g, beta, state)]


def relative_error(got, want) -> float:
    got, want = np.array(got, dtype=np.float64), np.array(want, dtype=np.float64)
    return float(np.abs(got - want).max() / np.abs(want).max())


def test_compute_g_matches_formula():
    rng = np.random.default_rng(1)
    A_log, dt_bias = rng.standard_normal((2, 3))
    a = rng.standard_normal((2, 5, 3)) * 4
    want = np.exp(-np.exp(A_log) * np.log1p(np.exp(a + dt_bias)))
    got = compute_g(*(mx.array(x.astype(np.float32)) for x in (A_log, a, dt_bias)))
    assert got.dtype == mx.float32
    assert relative_error(got, want) < 1e-6


def test_compute_g_is_fp32_for_bf16_inputs():
    g = compute_g(mx.zeros((2,), mx.bfloat16), mx.ones((1, 3, 2), mx.bfloat16), mx.zeros((2,), mx.bfloat16))
    assert g.dtype == mx.float32


@pytest.mark.parametrize("Hk,Hv", [(2, 2), (2, 4), (1, 3)])
def test_sequential_matches_reference(Hk, Hv):
    inputs = make_inputs(B=2, T=7, Hk=Hk, Hv=Hv, seed=Hv)
    y, state = gated_delta_sequential(*inputs)
    y_ref, state_ref = reference(*inputs)
    assert relative_error(y, y_ref) < FP32_TOLERANCE
    assert relative_error(state, state_ref) < FP32_TOLERANCE


@pytest.mark.parametrize(
    "T,Hk,Hv,similar_keys",
    [(5, 2, 4, False), (CHUNK_SIZE, 2, 2, False), (2 * CHUNK_SIZE + 3, 2, 4, False), (70, 1, 3, True)],
)
def test_chunked_matches_reference(T, Hk, Hv, similar_keys):
    inputs = make_inputs(T=T, Hk=Hk, Hv=Hv, seed=T, similar_keys=similar_keys)
    y, state = gated_delta_chunked(*inputs)
    y_ref, state_ref = reference(*inputs)
    assert relative_error(y, y_ref) < FP32_TOLERANCE
    assert relative_error(state, state_ref) < FP32_TOLERANCE


@pytest.mark.parametrize("T", [1, CHUNK_SIZE - 1, CHUNK_SIZE, CHUNK_SIZE + 1, 3 * CHUNK_SIZE + 5])
@pytest.mark.parametrize("Hk,Hv", [(4, 4), (2, 6)])
def test_chunked_equals_sequential(T, Hk, Hv):
    inputs = make_inputs(B=2, T=T, Hk=Hk, Hv=Hv, Dk=32, Dv=16, seed=T + Hv)
    y_seq, state_seq = gated_delta_sequential(*inputs)
    y_chunk, state_chunk = gated_delta_chunked(*inputs)
    assert relative_error(y_chunk, y_seq) < FP32_TOLERANCE
    assert relative_error(state_chunk, state_seq) < FP32_TOLERANCE


def test_chunked_equals_sequential_across_blocks():
    """Longer than one block of CHUNKS_PER_BLOCK chunks: the state passes between blocks."""
    inputs = make_inputs(T=CHUNK_SIZE * CHUNKS_PER_BLOCK + 37, Hk=1, Hv=2, Dk=8, Dv=8, seed=6)
    y_seq, state_seq = gated_delta_sequential(*inputs)
    y_chunk, state_chunk = gated_delta_chunked(*inputs)
    assert relative_error(y_chunk, y_seq) < FP32_TOLERANCE
    assert relative_error(state_chunk, state_seq) < FP32_TOLERANCE


def test_state_carried_between_calls():
    """Splitting a sequence anywhere, through either path, gives the one-call result."""
    q, k, v, g, beta, state = make_inputs(T=100, seed=3)
    y_all, state_all = gated_delta_sequential(q, k, v, g, beta, state)
    for split in (1, CHUNK_SIZE, 57):
        pieces, s = [], state
        for piece in (slice(0, split), slice(split, None)):
            y, s = gated_delta_recurrence(q[:, piece], k[:, piece], v[:, piece], g[:, piece], beta[:, piece], s)
            pieces.append(y)
        assert relative_error(mx.concatenate(pieces, axis=1), y_all) < FP32_TOLERANCE
        assert relative_error(s, state_all) < FP32_TOLERANCE


def test_strong_forgetting_stays_finite():
    """g underflowing to 0 (exp of a large negative number) erases the state in both paths.
    The chunked path's in-chunk cumulative log-decays then grow large, and differences of
    large fp32 numbers lose absolute precision: hence a looser bound (observed ~6e-6)."""
    q, k, v, g, beta, state = make_inputs(T=40, seed=4)
    g = mx.where(mx.arange(40)[None, :, None] % 7 == 3, 0.0, g)
    y_seq, s_seq = gated_delta_sequential(q, k, v, g, beta, state)
    y_chunk, s_chunk = gated_delta_chunked(q, k, v, g, beta, state)
    assert np.isfinite(np.array(y_chunk)).all()
    assert relative_error(y_chunk, y_seq) < 5e-5
    assert relative_error(s_chunk, s_seq) < 5e-5


def test_recurrence_dispatches_by_length():
    """Below CHUNKED_MIN_TOKENS the dispatcher is the sequential path, bit for bit; from
    it on, the chunked one."""
    for T, path in ((CHUNKED_MIN_TOKENS - 1, gated_delta_sequential), (CHUNKED_MIN_TOKENS, gated_delta_chunked)):
        inputs = make_inputs(T=T, seed=T)
        y, state = gated_delta_recurrence(*inputs)
        y_path, state_path = path(*inputs)
        assert mx.array_equal(y, y_path) and mx.array_equal(state, state_path)


def test_recurrence_defaults_to_zero_state_and_keeps_dtypes():
    q, k, v, g, beta, _ = make_inputs(T=3)
    y, state = gated_delta_recurrence(q, k, v, g, beta)
    y_zero, _ = gated_delta_recurrence(q, k, v, g, beta, mx.zeros(state.shape))
    assert mx.array_equal(y, y_zero)
    y, state = gated_delta_recurrence(q, k, v.astype(mx.bfloat16), g, beta)
    assert y.dtype == mx.bfloat16 and state.dtype == mx.float32


def test_recurrence_rejects_bad_shapes():
    q, k, v, g, beta, state = make_inputs(Hk=2, Hv=4)
    with pytest.raises(ValueError, match="multiple of key heads"):
        gated_delta_recurrence(q, k, v[:, :, :3], g[..., :3], beta[..., :3])
    with pytest.raises(ValueError, match="state has shape"):
        gated_delta_recurrence(q, k, v, g, beta, state[:, :2])
    with pytest.raises(ValueError, match="disagree"):
        gated_delta_recurrence(q, k, v, g[:, :2], beta)


def test_unit_lower_inverse_matches_numpy():
    rng = np.random.default_rng(5)
    C = 16
    L = np.tril(rng.standard_normal((3, C, C)), -1)
    L[1] = np.tril(np.ones((C, C)), -1)  # (I + L)^-1 is bidiagonal; L's powers are binomial
    got = unit_lower_inverse(mx.array(L.astype(np.float32)))
    want = np.linalg.inv(np.eye(C) + L)
    assert relative_error(got, want) < 1e-5


def test_chunk_constants_are_consistent():
    assert CHUNK_SIZE & (CHUNK_SIZE - 1) == 0  # unit_lower_inverse doubles block sizes
    assert 1 < CHUNKED_MIN_TOKENS


@pytest.mark.parametrize("T", [1, 2, 3, 5, 8, 9])
def test_replay_equals_reference_final_state(T):
    """The rollback replay (one chunk of the next power of two) gives the state the
    recurrence reaches after T steps."""
    inputs = make_inputs(T=T, Hk=2, Hv=4, Dk=32, Dv=16, seed=100 + T)
    _, want = reference(*inputs)
    assert relative_error(gated_delta_replay(*inputs), want) < FP32_TOLERANCE
    q, k, v, g, beta, _ = inputs
    zero_start = gated_delta_replay(q, k, v, g, beta, None)
    assert relative_error(zero_start, reference(q, k, v, g, beta, np.zeros(inputs[5].shape))[1]) < FP32_TOLERANCE


# --- the negative-eigenvalue variant (OLMo Hybrid): beta in (0, 2) --------------------------


def test_recorded_short_forward_rewinds_to_the_state_feeding_gives():
    """A verify-length forward keeps each step's state: rewinding to m is bit for bit
    feeding only those m tokens, for one m or a different m per row."""
    assert_rewinds_as_feeding(gated_delta_recorded, gated_delta_recurrence, make_inputs(B=3, T=5))


def assert_rewinds_as_feeding(recorded, recurrence, inputs):
    """A 5-token `recorded` forward over 3 rows equals `recurrence`, and its
    state_after(m) is bit for bit the state feeding only m tokens gives, for one m or
    a different m per row."""
    q, k, v, g, beta, state = inputs
    y, final, state_after = recorded(q, k, v, g, beta, state)
    plain_y, plain_final = recurrence(q, k, v, g, beta, state)
    assert mx.array_equal(y, plain_y) and mx.array_equal(final, plain_final)
    fed = [state] + [recurrence(q[:, :m], k[:, :m], v[:, :m], g[:, :m], beta[:, :m], state)[1]
                     for m in range(1, 6)]
    for m in range(6):
        assert mx.array_equal(state_after(m), fed[m])
    per_row = state_after([4, 0, 2])
    for b, m in enumerate([4, 0, 2]):
        assert mx.array_equal(per_row[b], fed[m][b])


def test_recorded_long_forward_rewinds_by_replay():
    """A prefill-length forward (chunked) keeps no per-step states: it replays."""
    T = CHUNKED_MIN_TOKENS + 3
    q, k, v, g, beta, state = make_inputs(B=2, T=T)
    _, final, state_after = gated_delta_recorded(q, k, v, g, beta, state)
    want = reference(*[x[:, :7] for x in (q, k, v, g, beta)], state)[1]
    assert relative_error(state_after(7), want) < FP32_TOLERANCE
    assert relative_error(state_after([7, T])[1], final[1]) < FP32_TOLERANCE


def test_compute_beta_doubles_the_sigmoid_for_negative_eigenvalues():
    b = mx.array(np.linspace(-8, 8, 33, dtype=np.float32)).reshape(1, 11, 3)
    plain, doubled = compute_beta(b), compute_beta(b, allow_neg_eigval=True)
    assert plain.dtype == doubled.dtype == mx.float32
    want = 1 / (1 + np.exp(-np.array(b, dtype=np.float64)))
    assert relative_error(plain, want) < 1e-6 and relative_error(doubled, 2 * want) < 1e-6
    assert 1.9 < mx.max(doubled).item() < 2.0 and mx.min(doubled).item() > 0
    assert compute_beta(b.astype(mx.bfloat16), True).dtype == mx.float32


def test_betas_above_one_flip_the_state_along_the_key():
    """One write with beta = 1.5 along a unit key k, v = 0: the state's k-component goes
    from S k to (1 - beta) S k = -0.5 S k (a negative eigenvalue), in every path."""
    q, k, v, g, beta, state = make_inputs(T=1, Hk=1, Hv=1, seed=9)
    v, g, beta = mx.zeros_like(v), mx.ones_like(g), mx.full(beta.shape, 1.5)
    before = state[0, 0] @ k[0, 0, 0]
    for path in (gated_delta_sequential, gated_delta_chunked):
        after = path(q, k, v, g, beta, state)[1][0, 0] @ k[0, 0, 0]
        assert mx.allclose(after, -0.5 * before, atol=1e-5).item()


@pytest.mark.parametrize("Hk,Hv", [(2, 2), (2, 4)])
def test_sequential_matches_reference_with_negative_eigenvalues(Hk, Hv):
    inputs = make_inputs(B=2, T=9, Hk=Hk, Hv=Hv, seed=30 + Hv, beta_max=2.0)
    assert mx.max(inputs[4]).item() > 1.5
    y, state = gated_delta_sequential(*inputs)
    y_ref, state_ref = reference(*inputs)
    assert relative_error(y, y_ref) < FP32_TOLERANCE
    assert relative_error(state, state_ref) < FP32_TOLERANCE


@pytest.mark.parametrize(
    "T,Hk,Hv,similar_keys", [(CHUNK_SIZE, 2, 2, False), (2 * CHUNK_SIZE + 3, 2, 4, False), (70, 1, 3, True)]
)
def test_chunked_matches_reference_with_negative_eigenvalues(T, Hk, Hv, similar_keys):
    """Near-parallel keys with beta up to 2 keep the UT system well-conditioned: each
    write's factor along the shared key is 1 - beta, of modulus below 1."""
    inputs = make_inputs(T=T, Hk=Hk, Hv=Hv, seed=40 + T, similar_keys=similar_keys, beta_max=2.0)
    y, state = gated_delta_chunked(*inputs)
    y_ref, state_ref = reference(*inputs)
    assert relative_error(y, y_ref) < FP32_TOLERANCE
    assert relative_error(state, state_ref) < FP32_TOLERANCE


@pytest.mark.parametrize("T", [1, 3, 5, 8])
def test_replay_equals_reference_with_negative_eigenvalues(T):
    """The whole recorded window, and per-row prefixes (rows T and T - 1) in one replay."""
    inputs = make_inputs(B=2, T=T, Hk=2, Hv=4, Dk=32, Dv=16, seed=200 + T, beta_max=2.0)
    assert relative_error(gated_delta_replay(*inputs), reference(*inputs)[1]) < FP32_TOLERANCE
    per_row = gated_delta_replay(*inputs, num_steps=[T, T - 1])
    for row, n in ((0, T), (1, T - 1)):
        sliced = [x[row : row + 1, :n] for x in inputs[:5]] + [inputs[5][row : row + 1]]
        assert relative_error(per_row[row : row + 1], reference(*sliced)[1]) < FP32_TOLERANCE


def test_update_takes_the_variant_as_an_option():
    q, k, v, _, _, state = make_inputs(T=6, Hk=2, Hv=4, seed=11)
    rng = np.random.default_rng(12)
    a, b = (mx.array(rng.standard_normal((1, 6, 4)).astype(np.float32)) for _ in range(2))
    A_log, dt_bias = mx.zeros((4,)), mx.ones((4,))
    g = compute_g(A_log, a, dt_bias)
    for allow in (False, True):
        y, new_state = gated_delta_update(q, k, v, a, b, A_log, dt_bias, state, allow_neg_eigval=allow)
        y_ref, state_ref = reference(q, k, v, g, compute_beta(b, allow), state)
        assert relative_error(y, y_ref) < FP32_TOLERANCE and relative_error(new_state, state_ref) < FP32_TOLERANCE


# --- KDA (Kimi Linear): the per-channel decay g (B, T, Hv, Dk) ------------------------------


def make_kda_inputs(B=1, T=8, Hk=2, Hv=2, Dk=16, Dv=8, seed=0, g_range=(0.3, 1.0)):
    """make_inputs with a decay per key channel, spread over g_range."""
    q, k, v, _, beta, state = make_inputs(B, T, Hk, Hv, Dk, Dv, seed)
    g = np.random.default_rng(seed + 1).uniform(*g_range, (B, T, Hv, Dk))
    return [q, k, v, mx.array(g.astype(np.float32)), beta, state]


def test_compute_kda_g_matches_formula():
    rng = np.random.default_rng(3)
    A_log = rng.standard_normal(2)
    a, dt_bias = rng.standard_normal((2, 5, 2, 4)) * 4, rng.standard_normal(8)
    want = np.exp(-np.exp(A_log)[:, None] * np.log1p(np.exp(a + dt_bias.reshape(2, 4))))
    got = compute_kda_g(*(mx.array(x.astype(np.float32)) for x in (A_log, a, dt_bias)))
    assert got.dtype == mx.float32 and got.shape == (2, 5, 2, 4)
    assert relative_error(got, want) < 1e-6


@pytest.mark.parametrize("Hk,Hv", [(2, 2), (1, 3)])
def test_kda_sequential_matches_reference(Hk, Hv):
    inputs = make_kda_inputs(B=2, T=7, Hk=Hk, Hv=Hv, seed=300 + Hv)
    y, state = kda_sequential(*inputs)
    y_ref, state_ref = kda_reference(*inputs)
    assert relative_error(y, y_ref) < FP32_TOLERANCE and relative_error(state, state_ref) < FP32_TOLERANCE


@pytest.mark.parametrize("T,chunk_size", [(5, 4), (16, 16), (37, 8), (KDA_CHUNK_SIZE * KDA_CHUNKS_PER_BLOCK + 3, KDA_CHUNK_SIZE)])
def test_kda_chunked_matches_reference(T, chunk_size):
    """Within one chunk, across chunks, and across blocks of chunks, from a carried state."""
    inputs = make_kda_inputs(T=T, Hk=1, Hv=2, Dk=16, seed=310 + T)
    y, state = kda_chunked(*inputs, chunk_size=chunk_size)
    y_ref, state_ref = kda_reference(*inputs)
    assert relative_error(y, y_ref) < FP32_TOLERANCE and relative_error(state, state_ref) < FP32_TOLERANCE


def test_kda_per_channel_decay_differs_from_its_mean():
    """The vector gate matters: a decay averaged over the channels gives another state."""
    inputs = make_kda_inputs(T=6, seed=320, g_range=(0.05, 1.0))
    mean_gate = mx.broadcast_to(inputs[3].mean(-1, keepdims=True), inputs[3].shape)
    _, state = kda_sequential(*inputs)
    _, averaged = kda_sequential(*inputs[:3], mean_gate, *inputs[4:])
    assert relative_error(averaged, state) > 0.05


def test_kda_strong_forgetting_stays_finite():
    """Decays that underflow in fp32 (log g below the floor) stay finite in every path."""
    inputs = make_kda_inputs(T=20, seed=330, g_range=(1e-30, 1e-20))
    for y, state in (kda_chunked(*inputs, chunk_size=8), kda_sequential(*inputs)):
        assert np.isfinite(np.array(y)).all() and np.isfinite(np.array(state)).all()
    y_ref, _ = kda_reference(*inputs)
    assert relative_error(kda_chunked(*inputs, chunk_size=8)[0], y_ref) < FP32_TOLERANCE


def test_kda_recurrence_dispatches_and_checks_shapes():
    inputs = make_kda_inputs(T=CHUNKED_MIN_TOKENS + 2, seed=340)
    y, state = kda_recurrence(*inputs)
    y_ref, state_ref = kda_reference(*inputs)
    assert relative_error(y, y_ref) < FP32_TOLERANCE and relative_error(state, state_ref) < FP32_TOLERANCE
    q, k, v, g, beta, _ = inputs
    assert kda_recurrence(q, k, v, g, beta)[1].shape == inputs[5].shape  # zero state
    with pytest.raises(ValueError, match="KDA inputs disagree"):
        kda_recurrence(q, k, v, g[..., 0], beta)  # a scalar gate is the other path


def test_kda_recorded_short_forward_rewinds_to_the_state_feeding_gives():
    """As for the scalar gate: a verify-length KDA forward keeps each step's state,
    and rewinding to m (one m, or one per row) is bit for bit feeding those m tokens;
    a prefill-length one replays."""
    assert_rewinds_as_feeding(kda_recorded, kda_recurrence, make_kda_inputs(B=3, T=5, seed=350))
    T = CHUNKED_MIN_TOKENS + 3
    q, k, v, g, beta, state = make_kda_inputs(B=2, T=T, seed=351)
    _, final, state_after = kda_recorded(q, k, v, g, beta, state)
    want = kda_recurrence(*[x[:, :7] for x in (q, k, v, g, beta)], state)[1]
    assert relative_error(state_after(7), want) < FP32_TOLERANCE
    assert relative_error(state_after([7, T])[1], final[1]) < FP32_TOLERANCE


@pytest.mark.parametrize("T", [1, 3, 5, 8])
def test_kda_replay_equals_reference(T):
    """The whole recorded window, and per-row prefixes (rows T and T - 1) in one replay."""
    inputs = make_kda_inputs(B=2, T=T, Hk=1, Hv=2, Dk=32, Dv=16, seed=350 + T)
    assert relative_error(kda_replay(*inputs), kda_reference(*inputs)[1]) < FP32_TOLERANCE
    per_row = kda_replay(*inputs, num_steps=[T, T - 1])
    for row, n in ((0, T), (1, T - 1)):
        sliced = [x[row : row + 1, :n] for x in inputs[:5]] + [inputs[5][row : row + 1]]
        assert relative_error(per_row[row : row + 1], kda_reference(*sliced)[1]) < FP32_TOLERANCE
