"""The gated delta rule (Gated DeltaNet), the recurrence of qwen3_next / qwen3_5 linear
attention layers.

Per value head, with an fp32 state S (Dv, Dk) and per-token inputs q, k (Dk), v (Dv),
gate g in (0, 1] and write strength beta in (0, 1), or in (0, 2) for the
negative-eigenvalue variant (OLMo Hybrid, `compute_beta(..., allow_neg_eigval=True)`):

    S <- g * S                      (forget)
    delta = beta * (v - S k)        (what the memory gets wrong about v)
    S <- S + delta k^T              (delta-rule write)
    y = S q                         (read)

Value heads share key heads: value head h reads query/key head h // (Hv // Hk).

With unit keys the write maps S to S (I - beta k k^T) + beta v k^T: along k the state is
scaled by 1 - beta, in (0, 1) for beta in (0, 1) and in (-1, 1) for beta in (0, 2), so a
write can also flip the sign of what the state holds along k (Grazzi et al., "Unlocking
State-Tracking in Linear RNNs Through Negative Eigenvalues", arXiv 2411.12537). Every
path below takes beta as an input and is exact for either range: the variant is chosen
only where beta is formed.

Two pure-MLX paths sit behind `gated_delta_recurrence` (and upstream's entry point
`gated_delta_update`, which takes the raw gate inputs):
- `gated_delta_sequential`: the recurrence step by step (decode, and short windows such
  as speculative verify chunks). Each step reads the state once for S k and S q (one
  batched matmul) and rewrites it once (one fused update).
- `gated_delta_chunked`: the chunked parallel form for long prefill. Inside a chunk of
  CHUNK_SIZE tokens the writes are condensed with the WY/UT transform, so the state is
  touched twice per chunk instead of twice per token, and the rest is batched matmuls.
References: Yang, Kautz, Hatamizadeh, "Gated Delta Networks" (arXiv 2412.06464);
Yang et al., "Parallelizing Linear Transformers with the Delta Rule" (arXiv 2406.06484).
"""

from functools import partial
from typing import Any, Callable, List, Optional, Sequence, Tuple, Union

import mlx.core as mx

from .ssm import conv_state_after, entries_after, select_state, steps_mask

# A GDN layer's cache entries (an ArraysCache of two).
CONV_STATE, RECURRENT_STATE = 0, 1
# Tokens per chunk of the chunked path (the intra-chunk matrices are CHUNK_SIZE^2).
CHUNK_SIZE = 32
# The chunked path handles this many chunks at a time, so that its per-chunk temporaries
# stay small (in cache) however long the prompt is.
CHUNKS_PER_BLOCK = 8
# Updates of at least this many tokens take the chunked path; shorter ones (decode,
# speculative verify windows) step sequentially, where the chunk set-up would dominate.
CHUNKED_MIN_TOKENS = 16
# log(g) is floored here: g underflows to 0 in fp32 for very strong forgetting, and
# exp(-30) ~ 1e-13 already erases the state as thoroughly as 0 does in fp32. A low floor
# would only grow the in-chunk cumulative sums, whose differences lose absolute precision.
_MIN_LOG_GATE = -30.0


def compute_g(A_log: mx.array, a: mx.array, dt_bias: mx.array) -> mx.array:
    """Per-token decay g = exp(-exp(A_log) * softplus(a + dt_bias)), in fp32.

    A_log, dt_bias (Hv,); a (B, T, Hv) -> g (B, T, Hv) in (0, 1].
    """
    x = a.astype(mx.float32) + dt_bias.astype(mx.float32)
    softplus = mx.logaddexp(x, 0.0)
    return mx.exp(-mx.exp(A_log.astype(mx.float32)) * softplus)


def compute_lower_bound_g(A_log: mx.array, a: mx.array, dt_bias: mx.array, lower_bound: float) -> mx.array:
    """Upstream's bounded decay g = exp(lower_bound * sigmoid(exp(A_log) * (a + dt_bias))),
    in fp32: log g stays in (lower_bound, 0) (lower_bound < 0).

    A_log, dt_bias (Hv,); a (B, T, Hv) -> g (B, T, Hv)."""
    x = a.astype(mx.float32) + dt_bias.astype(mx.float32)
    return mx.exp(lower_bound * mx.sigmoid(mx.exp(A_log.astype(mx.float32)) * x))


def normalize_qk(q: mx.array, k: mx.array, *, inv_scale: float, eps: float) -> Tuple[mx.array, mx.array]:
    """Upstream's input contract of gated_delta_update: q and k L2-normalised over the
    head dim (eps added to the sum of squares), and q also scaled by `inv_scale` (the
    readout scale Dk^-0.5), which the recurrence does not apply itself.

    q, k (..., Dk) -> the same shapes, in their dtypes."""
    def unit(x):
        x32 = x.astype(mx.float32)
        return x32 * mx.rsqrt(mx.sum(x32 * x32, axis=-1, keepdims=True) + eps)

    return (unit(q) * inv_scale).astype(q.dtype), unit(k).astype(k.dtype)


def compute_beta(b: mx.array, allow_neg_eigval: bool = False) -> mx.array:
    """Per-token write strength beta = sigmoid(b), doubled with `allow_neg_eigval`
    (then in (0, 2): the write's eigenvalue 1 - beta along k may be negative), in fp32.

    b (B, T, Hv) -> beta (B, T, Hv).
    """
    beta = mx.sigmoid(b.astype(mx.float32))
    return 2.0 * beta if allow_neg_eigval else beta


def _check_shapes(q, k, v, g, beta, state, per_channel: bool = False):
    """ValueError unless the shapes fit; g is (B, T, Hv), or (B, T, Hv, Dk) `per_channel` (KDA)."""
    B, T, Hk, Dk = q.shape
    Hv, Dv = v.shape[-2:]
    what, gate = ("KDA", (B, T, Hv, Dk)) if per_channel else ("gated delta", (B, T, Hv))
    if k.shape != q.shape or v.shape[:2] != (B, T) or g.shape != gate or beta.shape != (B, T, Hv):
        gates = "g (B, T, Hv, Dk), beta (B, T, Hv)" if per_channel else "g, beta (B, T, Hv)"
        raise ValueError(
            f"{what} inputs disagree: q {q.shape}, k {k.shape}, v {v.shape}, g {g.shape}, "
            f"beta {beta.shape}; expected q, k (B, T, Hk, Dk), v (B, T, Hv, Dv), {gates}"
        )
    if Hv % Hk:
        raise ValueError(f"value heads ({Hv}) must be a multiple of key heads ({Hk})")
    if state is not None and state.shape != (B, Hv, Dv, Dk):
        raise ValueError(f"{what} state has shape {state.shape}, expected {(B, Hv, Dv, Dk)}")


@mx.compile
def _step(state_t, kq, k_column, k_dot_q, v, g, beta):
    """One token, every array with a leading axis of 1 (a Split's output) and laid out
    as it is read, so that the step is a matmul, a split and three fused updates (on
    the CPU a decode or verify step is bounded by how many operations it dispatches).
    state_t (1, B, Hk, r, Dk, Dv): S transposed; kq (1, B, Hk, 1, 2, Dk): k and q
    stacked; k_column (1, B, Hk, 1, Dk, 1); k_dot_q (1, B, Hk, 1, 1, 1); v (1, B, Hk,
    r, 1, Dv); g, beta (1, B, Hk, r, 1, 1) -> y (1, B, Hk, r, 1, Dv), new state_t."""
    # S k and S q of the *old* state in one matmul (rows k^T S^T, q^T S^T: on CPU BLAS the
    # row-vector form is the fast one); the decay is applied afterwards.
    read_k, read_q = mx.split(kq @ state_t, 2, axis=-2)  # (1, B, Hk, r, 1, Dv) each
    delta = beta * (v - g * read_k)
    # y = (g S + delta k^T) q = g (S q) + delta (k . q)
    y = g * read_q + delta * k_dot_q
    # S^T <- g S^T + k delta^T, one fused pass.
    return y, g * state_t + k_column * delta


def gated_delta_sequential(
    q: mx.array,
    k: mx.array,
    v: mx.array,
    g: mx.array,
    beta: mx.array,
    state: mx.array,
    states_after: Optional[List[mx.array]] = None,
) -> Tuple[mx.array, mx.array]:
    """The recurrence one token at a time.

    q, k (B, T, Hk, Dk); v (B, T, Hv, Dv); g, beta (B, T, Hv); state (B, Hv, Dv, Dk) fp32
    -> y (B, T, Hv, Dv) fp32, state (B, Hv, Dv, Dk) fp32 (a transposed view of what the
    steps computed). `states_after`, if given, gets the state after each step (computed
    anyway: no extra work).

    The inputs are laid out token-major once, so each step's are one Split's outputs:
    a step costs a handful of operations instead of a slice, squeeze and expand per
    input.
    """
    B, T, Hk, Dk = q.shape
    Hv, Dv = v.shape[-2:]
    r = Hv // Hk
    q, k, v = (x.astype(mx.float32) for x in (q, k, v))

    def token_major(x, *shape):  # (B, T, ...) -> T arrays (1, B, *shape)
        if T == 1:
            return [x.reshape(1, B, *shape)]
        return mx.split(mx.swapaxes(x, 0, 1).reshape(T, B, *shape), T)

    kq = token_major(mx.stack([k, q], axis=-2), Hk, 1, 2, Dk)
    k_column = token_major(k, Hk, 1, Dk, 1)
    k_dot_q = token_major((k * q).sum(-1), Hk, 1, 1, 1)
    v = token_major(v, Hk, r, 1, Dv)
    g, beta = token_major(g, Hk, r, 1, 1), token_major(beta, Hk, r, 1, 1)
    state_t = state.reshape(1, B, Hk, r, Dv, Dk).swapaxes(-1, -2)
    ys = []
    for t in range(T):
        y, state_t = _step(state_t, kq[t], k_column[t], k_dot_q[t], v[t], g[t], beta[t])
        ys.append(y)
        if states_after is not None:
            states_after.append(state_t.swapaxes(-1, -2).reshape(B, Hv, Dv, Dk))
    if T == 1:
        y = ys[0].reshape(B, 1, Hv, Dv)
    else:
        y = mx.swapaxes(mx.concatenate(ys).reshape(T, B, Hv, Dv), 0, 1)  # from (T, B, Hk, r, 1, Dv)
    return y, state_t.swapaxes(-1, -2).reshape(B, Hv, Dv, Dk)


@mx.compile
def _channel_gated_step(state, q, k, v, g, beta):
    """One token. state (B, Hk, r, Dv, Dk); q, k (B, Hk, Dk); v (B, Hk, r, Dv);
    g (B, Hk, r, Dk); beta (B, Hk, r) -> y (B, Hk, r, Dv), new state."""
    # With S' = S diag(g): S' k = S (g * k) and S' q = S (g * q), read in one matmul.
    kq = mx.stack([g * k[:, :, None], g * q[:, :, None]], axis=-2)  # (B, Hk, r, 2, Dk)
    reads = kq @ state.swapaxes(-1, -2)  # (B, Hk, r, 2, Dv)
    delta = beta[..., None] * (v - reads[..., 0, :])  # (B, Hk, r, Dv)
    y = reads[..., 1, :] + delta * (k * q).sum(-1)[:, :, None, None]
    state = g[..., None, :] * state + delta[..., None] * k[:, :, None, None, :]
    return y, state


def channel_gated_sequential(q, k, v, g, beta, state, states_after=None):
    """The recurrence with a gate per key channel (KDA's; kda.py) one token at a time:
    q, k (B, T, Hk, Dk); v (B, T, Hv, Dv); g (B, T, Hv, Dk); beta (B, T, Hv); state
    (B, Hv, Dv, Dk) fp32 -> y (B, T, Hv, Dv) fp32, state. Value heads are grouped by key
    head (B, Hk, r, ...); `states_after`, if given, gets the state after each step."""
    B, T, Hk, Dk = q.shape
    Hv, Dv = v.shape[-2:]
    r = Hv // Hk
    q, k, v = (x.astype(mx.float32) for x in (q, k, v))
    v = v.reshape(B, T, Hk, r, Dv)
    g, beta = g.reshape(B, T, Hk, r, Dk), beta.reshape(B, T, Hk, r)
    S = state.reshape(B, Hk, r, Dv, Dk)
    ys = []
    for t in range(T):
        y, S = _channel_gated_step(S, q[:, t], k[:, t], v[:, t], g[:, t], beta[:, t])
        ys.append(y)
        if states_after is not None:
            states_after.append(S.reshape(B, Hv, Dv, Dk))
    y = mx.stack(ys, axis=1)  # (B, T, Hk, r, Dv)
    return y.reshape(B, T, Hv, Dv), S.reshape(B, Hv, Dv, Dk)


def unit_lower_inverse(L: mx.array) -> mx.array:
    """(I + L)^-1 for strictly lower-triangular L (N, C, C), C a power of two.

    Blockwise: inv([[A, 0], [M, D]]) = [[A^-1, 0], [-D^-1 M A^-1, D^-1]], doubling the
    block size from 1 to C: log2(C) rounds of batched matmuls. Unlike the Neumann series
    sum (-L)^i this stays accurate when the keys of a chunk nearly coincide, where the
    powers of L grow binomially and cancel.
    """
    N, C, _ = L.shape
    L = mx.contiguous(L)
    # Level 1: the 1x1 diagonal blocks are 1, so each 2x2 block is [[1, 0], [-l, 1]].
    inv = mx.ones((N, C, 1, 1), L.dtype)
    b = 1
    while b < C:
        n = C // (2 * b)
        # Lower-left b x b block M of each diagonal 2b x 2b block, as a strided view.
        M = mx.as_strided(L, (N, n, b, b), (C * C, 2 * b * (C + 1), C, 1), offset=b * C)
        A_inv, D_inv = inv[:, 0::2], inv[:, 1::2]  # (N, n, b, b)
        lower_left = -(D_inv @ (M @ A_inv))
        top = mx.concatenate([A_inv, mx.zeros_like(A_inv)], axis=-1)
        bottom = mx.concatenate([lower_left, D_inv], axis=-1)
        inv = mx.concatenate([top, bottom], axis=-2)  # (N, n, 2b, 2b)
        b *= 2
    return inv.reshape(N, C, C)


def _to_chunks(x: mx.array, num_chunks: int, chunk_size: int) -> mx.array:
    """(B, T, H, ...) zero-padded to num_chunks * chunk_size tokens -> (n, B * H, C, ...),
    chunk-major so the scan over chunks slices contiguous blocks."""
    B, T, H = x.shape[:3]
    pad = num_chunks * chunk_size - T
    if pad:
        x = mx.pad(x, [(0, 0), (0, pad)] + [(0, 0)] * (x.ndim - 2))
    x = x.reshape(B, num_chunks, chunk_size, H, *x.shape[3:])
    x = mx.moveaxis(mx.moveaxis(x, 1, 0), 3, 2)  # (n, B, H, C, ...)
    return x.reshape(num_chunks, B * H, chunk_size, *x.shape[4:])


def gated_delta_chunked(
    q: mx.array,
    k: mx.array,
    v: mx.array,
    g: mx.array,
    beta: mx.array,
    state: mx.array,
    chunk_size: int = CHUNK_SIZE,
) -> Tuple[mx.array, mx.array]:
    """The recurrence in chunks of `chunk_size` tokens (a power of two).

    q, k (B, T, Hk, Dk); v (B, T, Hv, Dv); g, beta (B, T, Hv); state (B, Hv, Dv, Dk) fp32
    -> y (B, T, Hv, Dv) fp32, state (B, Hv, Dv, Dk) fp32.

    Blocks of CHUNKS_PER_BLOCK chunks are handed to `_chunk_block` one after the other,
    so its temporaries (C x C per chunk and head) stay small whatever the length.
    """
    return _by_blocks(_chunk_block, q, k, v, g, beta, state, chunk_size, CHUNKS_PER_BLOCK)


def _by_blocks(block_fn, q, k, v, g, beta, state, chunk_size, chunks_per_block):
    """Hand `block_fn` (_chunk_block or _kda_chunk_block) the tokens in blocks of
    chunks_per_block chunks, one after the other, carrying the state."""
    if chunk_size < 1 or chunk_size & (chunk_size - 1):
        raise ValueError(f"chunk_size must be a power of two, got {chunk_size}")
    block = chunk_size * chunks_per_block
    ys = []
    for start in range(0, q.shape[1], block):
        piece = slice(start, start + block)
        y, state = block_fn(q[:, piece], k[:, piece], v[:, piece], g[:, piece], beta[:, piece], state, chunk_size)
        ys.append(y)
    return mx.concatenate(ys, axis=1) if len(ys) > 1 else ys[0], state


def _chunk_block(q, k, v, g, beta, state, chunk_size):
    """gated_delta_chunked on one block of at most CHUNKS_PER_BLOCK chunks.

    Within a chunk, with gamma_t = sum of log g up to t and S0 the state before it:
        L[i, j] = beta_i (k_i . k_j) exp(gamma_i - gamma_j)  (i > j)
        U = (I + L)^-1 (beta v),  W = (I + L)^-1 (beta exp(gamma) k)      (UT transform)
        v_new = U - W S0^T                                         (what S0 mispredicts)
        y = exp(gamma) q S0^T + A v_new,  A[i, j] = (q_i . k_j) exp(gamma_i - gamma_j) (i >= j)
        S = exp(gamma_C) S0 + v_new^T (exp(gamma_C - gamma) k)
    All but the S0 terms are computed for every chunk of the block at once; the scan over
    chunks then reads S0 once (for W and q together) and writes it once per chunk.
    Padding steps (g = 1, beta = 0, k = v = 0) leave the state unchanged.
    """
    B, T, Hk, Dk = q.shape
    Hv, Dv = v.shape[-2:]
    C = chunk_size
    n = -(-T // C)
    f32 = mx.float32
    if Hv != Hk:  # value head h reads key head h // (Hv // Hk)
        q, k = mx.repeat(q, Hv // Hk, axis=2), mx.repeat(k, Hv // Hk, axis=2)
    log_g = mx.maximum(mx.log(g.astype(f32)), _MIN_LOG_GATE)
    # Every head of every chunk as one batch N = n * B * Hv of (C, D) blocks: the
    # elementwise work below then broadcasts over 3-D arrays only.
    q, k, v = (_to_chunks(x.astype(f32), n, C).reshape(-1, C, x.shape[-1]) for x in (q, k, v))
    log_g, beta = (_to_chunks(x.astype(f32), n, C).reshape(-1, C) for x in (log_g, beta))

    gamma = mx.cumsum(log_g, axis=-1)  # (N, C)
    pos = mx.arange(C)
    # exp of a masked difference: above the diagonal the exponent would be positive.
    diff = gamma[:, :, None] - gamma[:, None, :]  # (N, C, C)
    decay = mx.exp(mx.where(pos[:, None] >= pos[None, :], diff, -mx.inf))
    L = mx.where(pos[:, None] > pos[None, :], (k @ k.swapaxes(-1, -2)) * decay, 0.0) * beta[:, :, None]
    T_inv = unit_lower_inverse(L)  # (N, C, C)
    u = T_inv @ (beta[..., None] * v)  # (N, C, Dv)
    w = T_inv @ ((beta * mx.exp(gamma))[..., None] * k)  # (N, C, Dk)
    attn = (q @ k.swapaxes(-1, -2)) * decay  # (N, C, C)
    # y = exp(gamma) q S0^T + A (U - W S0^T) = (exp(gamma) q - A W) S0^T + A U
    q_eff = q * mx.exp(gamma)[..., None] - attn @ w  # (N, C, Dk)
    k_tail = k * mx.exp(gamma[:, -1:] - gamma)[..., None]  # (N, C, Dk)
    return _scan_chunks(w, q_eff, u, attn @ u, k_tail, mx.exp(gamma[:, -1:]), state, T)


def _scan_chunks(w, q_eff, u, y_intra, k_tail, chunk_decay, state, T):
    """The pass over the chunks that reads and writes the state (after the per-chunk
    work of _chunk_block or _kda_chunk_block): per chunk, x = [W ; q_eff] S0^T,
    v_new = U - W S0^T, y = y_intra + q_eff S0^T, S = chunk_decay * S0 + v_new^T k_tail.

    w, q_eff, k_tail (N, C, Dk); u, y_intra (N, C, Dv); chunk_decay (N, 1) or (N, Dk),
    N = n * B * Hv chunk-major; state (B, Hv, Dv, Dk) -> y (B, T, Hv, Dv), state."""
    B, Hv, Dv, Dk = state.shape
    N, C = w.shape[:2]
    n = N // (B * Hv)
    reads = mx.concatenate([w, q_eff], axis=1).reshape(n, B * Hv, 2 * C, Dk)
    u, y_intra = u.reshape(n, B * Hv, C, Dv), y_intra.reshape(n, B * Hv, C, Dv)
    k_tail, chunk_decay = k_tail.reshape(n, B * Hv, C, Dk), chunk_decay.reshape(n, B * Hv, 1, -1)
    S = state.reshape(B * Hv, Dv, Dk)
    ys = []
    for c in range(n):
        x = reads[c] @ S.swapaxes(-1, -2)  # (B * Hv, 2C, Dv)
        v_new = u[c] - x[:, :C]
        ys.append(y_intra[c] + x[:, C:])
        S = chunk_decay[c] * S + v_new.swapaxes(-1, -2) @ k_tail[c]
    y = mx.stack(ys).reshape(n, B, Hv, C, Dv)
    y = mx.moveaxis(mx.moveaxis(y, 0, 1), 2, 3).reshape(B, n * C, Hv, Dv)[:, :T]
    return y, S.reshape(B, Hv, Dv, Dk)


def gated_delta_recurrence(
    q: mx.array,
    k: mx.array,
    v: mx.array,
    g: mx.array,
    beta: mx.array,
    state: Optional[mx.array] = None,
) -> Tuple[mx.array, mx.array]:
    """Run the gated delta rule over T tokens from `state` (zeros if None).

    q, k (B, T, Hk, Dk) already normalised (and q scaled); v (B, T, Hv, Dv); g, beta
    (B, T, Hv); state (B, Hv, Dv, Dk). Returns y (B, T, Hv, Dv) in v's dtype and the new
    state in fp32. Fewer than CHUNKED_MIN_TOKENS tokens step sequentially, more go
    through the chunked form; both compute the same recurrence.
    """
    g, beta, state = _fp32_inputs(q, k, v, g, beta, state)
    return _by_length(gated_delta_sequential, gated_delta_chunked, q, k, v, g, beta, state)


def gated_delta_recorded(
    q: mx.array,
    k: mx.array,
    v: mx.array,
    g: mx.array,
    beta: mx.array,
    state: Optional[mx.array] = None,
) -> Tuple[mx.array, mx.array, Callable[[Union[int, Sequence[int]]], mx.array]]:
    """gated_delta_recurrence for a forward a speculative rollback may undo: also
    `state_after(m)`, the state after only its first m tokens (m a list: row b after
    its own m[b]). A short forward (a verify) steps anyway, so each step's state is kept
    and a rollback selects one: bit for bit what feeding those m tokens gives, at the
    cost of a gather instead of a replay (a replay is dozens of small ops a layer, the
    larger part of a batch round's rollback on the CPU). Long forwards replay."""
    g, beta, fp32_state = _fp32_inputs(q, k, v, g, beta, state)
    return recorded(gated_delta_sequential, gated_delta_chunked, gated_delta_replay, q, k, v, g, beta, fp32_state)


def recorded(sequential: Callable, chunked: Callable, replay: Callable, q, k, v, g, beta, state):
    """A delta rule's forward (its `sequential` and `chunked` paths, inputs already as
    they take them) with `state_after(m)`: selected from the steps' states when it
    stepped, else `replay`ed."""
    states = [state]
    y, new_state = _by_length(partial(sequential, states_after=states), chunked, q, k, v, g, beta, state)
    if len(states) > q.shape[1]:  # it stepped: the state after every prefix is kept
        return y, new_state, partial(select_state, states)
    return y, new_state, partial(_replayed_state, replay, q, k, v, g, beta, state)


def _replayed_state(replay, q, k, v, g, beta, state, m):
    n = m if isinstance(m, int) else max(m)
    return replay(q[:, :n], k[:, :n], v[:, :n], g[:, :n], beta[:, :n], state,
                  num_steps=None if isinstance(m, int) else m)


def gated_delta_cached(conv_input: mx.array, q: mx.array, k: mx.array, v: mx.array, g: mx.array, beta: mx.array,
                       cache: Optional[Any]) -> mx.array:
    """The gated delta rule over T tokens from the cache's state, the cache then past
    them (conv state: the conv input's last K-1 rows); while speculating the forward is
    recorded so that it can be rolled back to any prefix. Returns y (B, T, Hv, Dv)."""
    if cache is None:
        return gated_delta_recurrence(q, k, v, g, beta)[0]
    T, state = q.shape[1], cache[RECURRENT_STATE]
    if cache.speculating:
        y, new_state, state_after = gated_delta_recorded(q, k, v, g, beta, state)
        cache.record_rollback(T, partial(entries_after, conv_input, T, state_after), [cache[CONV_STATE], state])
    else:
        y, new_state = gated_delta_recurrence(q, k, v, g, beta, state)
    cache[CONV_STATE] = conv_input[:, T:]
    cache[RECURRENT_STATE] = new_state
    return y


def _by_length(sequential, chunked, q, k, v, g, beta, state):
    """Step through short inputs (below CHUNKED_MIN_TOKENS), chunk long ones; y in v's dtype."""
    if q.shape[1] < CHUNKED_MIN_TOKENS:
        y, state = sequential(q, k, v, g, beta, state)
    else:
        y, state = chunked(q, k, v, g, beta, state)
    return y.astype(v.dtype), state


def gated_delta_update(
    q: mx.array,
    k: mx.array,
    v: mx.array,
    a: mx.array,
    b: mx.array,
    A_log: mx.array,
    dt_bias: mx.array,
    state: Optional[mx.array] = None,
    mask: Optional[mx.array] = None,
    use_kernel: bool = True,
    *,
    lower_bound: Optional[float] = None,
    allow_neg_eigval: bool = False,
) -> Tuple[mx.array, mx.array]:
    """Upstream mlx-lm's entry point: the recurrence from the layer's raw gate inputs.

    q, k (B, T, Hk, Dk) as normalize_qk leaves them (no scale is applied here); v (B,
    T, Hv, Dv); a, b (B, T, Hv) with g = compute_g(A_log, a, dt_bias), or
    compute_lower_bound_g(..., lower_bound) when given, and beta = compute_beta(b, allow_neg_eigval)
    (sigmoid(b), doubled for the negative-eigenvalue variant); A_log, dt_bias (Hv,);
    state (B, Hv, Dv, Dk), zeros in fp32 if None; mask (B, T) bool, False marking
    padding steps, which leave the state unchanged and output 0. Returns y (B, T, Hv,
    Dv) in v's dtype and the state in its own dtype. `use_kernel` picks this package's
    fast path (`gated_delta_recurrence`: stepping or chunked by length); False runs the
    plain step-by-step recurrence, the reference (there is no Metal kernel here).
    """
    g = compute_g(A_log, a, dt_bias) if lower_bound is None else compute_lower_bound_g(A_log, a, dt_bias, lower_bound)
    beta = compute_beta(b, allow_neg_eigval)  # (B, T, Hv)
    if use_kernel:
        y, new_state = gated_delta_recurrence(q, k, v, *_masked_gates(g, beta, mask), state)
        y = _masked_outputs(y, mask)
    else:
        y, new_state = gated_delta_ops(q, k, v, g, beta, state, mask)
    return y.astype(v.dtype), new_state if state is None else new_state.astype(state.dtype)


def _masked_gates(g: mx.array, beta: mx.array, mask: Optional[mx.array]) -> Tuple[mx.array, mx.array]:
    """g (B, T, Hv) or (B, T, Hv, Dk), beta (B, T, Hv) with a padding step's (mask (B, T)
    False) g = 1 and beta = 0, which keep the state as it is."""
    if mask is None:
        return g, beta
    return mx.where(mask.reshape(mask.shape + (1,) * (g.ndim - 2)), g, 1.0), mx.where(mask[..., None], beta, 0.0)


def _masked_outputs(y: mx.array, mask: Optional[mx.array]) -> mx.array:
    """y (B, T, Hv, Dv) with a padding step's outputs 0."""
    return y if mask is None else mx.where(mask[..., None, None], y, 0.0)


def gated_delta_ops(q: mx.array, k: mx.array, v: mx.array, g: mx.array, beta: mx.array,
                    state: Optional[mx.array] = None, mask: Optional[mx.array] = None) -> Tuple[mx.array, mx.array]:
    """Upstream's ops-only reference: the recurrence one token at a time, from gates
    already formed (there is no kernel here to check against).

    q, k (B, T, Hk, Dk); v (B, T, Hv, Dv); g (B, T, Hv), or (B, T, Hv, Dk) for a gate per
    key channel (KDA's); beta (B, T, Hv); state (B, Hv, Dv, Dk), zeros in fp32 if None;
    mask (B, T) bool, False marking padding steps, which leave the state unchanged
    (their outputs are 0; upstream's are those of the step it then drops, as
    meaningless). Returns y (B, T, Hv, Dv) in q's dtype and the fp32 state."""
    per_channel = g.ndim == 4
    g, beta, fp32_state = _fp32_inputs(q, k, v, *_masked_gates(g, beta, mask), state, per_channel)
    sequential = channel_gated_sequential if per_channel else gated_delta_sequential
    y, new_state = sequential(q, k, v, g, beta, fp32_state)
    return _masked_outputs(y, mask).astype(q.dtype), new_state


def gated_delta_replay(
    q: mx.array,
    k: mx.array,
    v: mx.array,
    g: mx.array,
    beta: mx.array,
    state: Optional[mx.array] = None,
    num_steps: Optional[Sequence[int]] = None,
) -> mx.array:
    """Only the state after T recorded steps from `state`: a speculative rollback
    replaying the accepted prefix of a verify forward. Shapes as in gated_delta_recurrence;
    returns (B, Hv, Dv, Dk) fp32. `num_steps`: row b replays only its first num_steps[b]
    steps (a batch whose rows roll back by different counts, in one replay): g = 1,
    beta = 0 leave the state exactly as it is.

    Several steps run as one chunk of the next power of two, which reads and rewrites
    the state once where stepping does so T times (the state dominates the cost: 2 MB a
    layer at Qwen3-Next sizes against a few KB of inputs per step)."""
    g, beta, state = _fp32_inputs(q, k, v, g, beta, state)
    B, T, Hk, Dk = q.shape
    Hv, Dv = v.shape[-2:]
    if num_steps is not None:
        replayed = steps_mask(num_steps, T)[..., None]  # (B, T, 1)
        g, beta = mx.where(replayed, g, 1.0), mx.where(replayed, beta, 0.0)
    if T == 1:
        return gated_delta_sequential(q, k, v, g, beta, state)[1]
    k = mx.repeat(k, Hv // Hk, axis=2) if Hv != Hk else k  # value head h reads key head h // r
    C = 1 << (T - 1).bit_length()
    # (B, T, H, ...) -> (B * Hv, C, ...), padded with steps that leave the state alone
    # (g = 1, beta = 0, k = v = 0).
    k, v = (_to_chunks(x.astype(mx.float32), 1, C)[0] for x in (k, v))
    g, beta = (_to_chunks(x, 1, C)[0] for x in (g, beta))
    g = mx.where(mx.arange(C) < T, g, 1.0)
    S = _chunk_final_state(k, v, g, beta, state.reshape(B * Hv, Dv, Dk))
    return S.reshape(B, Hv, Dv, Dk)


@mx.compile
def _chunk_final_state(k: mx.array, v: mx.array, g: mx.array, beta: mx.array, S: mx.array) -> mx.array:
    """The state after one chunk, nothing else (the UT form of `_chunk_block` without
    the outputs). k (N, C, Dk), v (N, C, Dv), g, beta (N, C), S (N, Dv, Dk) -> (N, Dv, Dk)."""
    C = k.shape[1]
    gamma = mx.cumsum(mx.maximum(mx.log(g), _MIN_LOG_GATE), axis=-1)  # (N, C)
    pos = mx.arange(C)
    lower = pos[:, None] > pos[None, :]
    decay = mx.exp(mx.where(lower, gamma[:, :, None] - gamma[:, None, :], -mx.inf))  # (N, C, C)
    T_inv = unit_lower_inverse((k @ k.swapaxes(-1, -2)) * decay * beta[:, :, None])
    u = T_inv @ (beta[..., None] * v)  # (N, C, Dv)
    w = T_inv @ ((beta * mx.exp(gamma))[..., None] * k)  # (N, C, Dk)
    v_new = u - w @ S.swapaxes(-1, -2)  # (N, C, Dv): what S mispredicts
    k_tail = k * mx.exp(gamma[:, -1:] - gamma)[..., None]  # (N, C, Dk)
    return mx.exp(gamma[:, -1])[:, None, None] * S + v_new.swapaxes(-1, -2) @ k_tail


def _fp32_inputs(q, k, v, g, beta, state, per_channel: bool = False):
    """Checked g, beta and state in fp32 (a zero state if None)."""
    _check_shapes(q, k, v, g, beta, state, per_channel)
    B, _, _, Dk = q.shape
    Hv, Dv = v.shape[-2:]
    if state is None:
        state = mx.zeros((B, Hv, Dv, Dk), mx.float32)
    return g.astype(mx.float32), beta.astype(mx.float32), state.astype(mx.float32)
