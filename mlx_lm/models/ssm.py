"""Mamba-2 (state space duality, SSD) math: the recurrence, its chunked form, the
depthwise causal conv in front of it and the gated RMSNorm after it. Pure functions.

Per head h (head dim P, state size N), heads grouped G ways (head h reads the B and C
of group h // (H / G)), with per-token inputs x (P), B, C (N) and a step dt > 0:

    a = dt * A_h                    (A_h = -exp(A_log_h) < 0: log of the decay)
    S <- exp(a) S + dt x B^T        (S: (P, N), fp32)
    y = S C                         (+ D_h x, added by the layer)

Three paths compute it:
- `ssd_sequential`: step by step (decode, short speculative verify windows).
- `ssd_chunked`: the SSD block decomposition for prefill: within a chunk the output
  is a masked "attention" (C_i . B_j) exp(gamma_i - gamma_j) dt_j x_j plus the
  chunk's start state read by C, and the state moves from chunk to chunk once.
- `ssd_replay`: only the state after T recorded steps (a speculative rollback): one
  read and one write of the state, however many tokens are replayed.
References: Dao and Gu, "Transformers are SSMs" (arXiv 2405.21060); transformers
`models/nemotron_h/modeling_nemotron_h.py` (torch reference of the same recurrence).
"""

import math
from functools import partial
from typing import Callable, List, Optional, Sequence, Tuple, Union

import mlx.core as mx

# Tokens per chunk of the chunked path (its intra-chunk matrices are CHUNK_SIZE^2 per head).
CHUNK_SIZE = 64
# Chunks handed to one `_chunk_block` call, so its temporaries stay bounded however long
# the prompt is.
CHUNKS_PER_BLOCK = 8
# Updates of at least this many tokens take the chunked path; shorter ones step.
CHUNKED_MIN_TOKENS = 16


def discretize_dt(dt: mx.array, dt_bias: mx.array, time_step_min: float = 0.0,
                  time_step_max: float = math.inf) -> mx.array:
    """The step of each token and head: clamp(softplus(dt + dt_bias)), in fp32.

    dt (B, T, H), dt_bias (H,) -> (B, T, H)."""
    step = mx.logaddexp(dt.astype(mx.float32) + dt_bias.astype(mx.float32), 0.0)
    return mx.clip(step, time_step_min, time_step_max if math.isfinite(time_step_max) else None)


def _check_shapes(x, dt, A, B, C, state):
    Bt, T, H, P = x.shape
    G, N = B.shape[-2:]
    if dt.shape != (Bt, T, H) or A.shape != (H,) or B.shape[:2] != (Bt, T) or (C is not None and C.shape != B.shape):
        raise ValueError(
            f"SSD inputs disagree: x {x.shape}, dt {dt.shape}, A {A.shape}, B {B.shape}, "
            f"C {None if C is None else C.shape}; expected x (B, T, H, P), dt (B, T, H), A (H,), B, C (B, T, G, N)"
        )
    if H % G:
        raise ValueError(f"heads ({H}) must be a multiple of groups ({G})")
    if state is not None and state.shape != (Bt, H, P, N):
        raise ValueError(f"SSD state has shape {state.shape}, expected {(Bt, H, P, N)}")


def _fp32_inputs(x, dt, A, B, C, state):
    """Checked inputs in fp32, with a zero state if None."""
    _check_shapes(x, dt, A, B, C, state)
    Bt, _, H, P = x.shape
    if state is None:
        state = mx.zeros((Bt, H, P, B.shape[-1]), mx.float32)
    f32 = mx.float32
    C = None if C is None else C.astype(f32)
    return x.astype(f32), dt.astype(f32), A.astype(f32), B.astype(f32), C, state.astype(f32)


@mx.compile
def _step(state, x, dt, A, B, C):
    """One token. state (b, G, r, P, N); x (b, G, r, P); dt (b, G, r); A (G, r);
    B, C (b, G, N) -> y (b, G, r, P), new state."""
    decay = mx.exp(dt * A)[..., None, None]  # (b, G, r, 1, 1)
    write = (dt[..., None] * x)[..., None] * B[:, :, None, None, :]  # (b, G, r, P, N)
    state = decay * state + write
    y = (state @ C[:, :, None, :, None])[..., 0]  # (b, G, r, P)
    return y, state


def _grouped(x, dt, A, B, state):
    """Heads split into (G, r): x (b, T, G, r, P), dt (b, T, G, r), A (G, r), state
    (b, G, r, P, N)."""
    Bt, T, H, P = x.shape
    G, N = B.shape[-2:]
    r = H // G
    return (x.reshape(Bt, T, G, r, P), dt.reshape(Bt, T, G, r), A.reshape(G, r),
            state.reshape(Bt, G, r, P, N))


def ssd_sequential(x: mx.array, dt: mx.array, A: mx.array, B: mx.array, C: mx.array,
                   state: mx.array, states_after: Optional[List[mx.array]] = None) -> Tuple[mx.array, mx.array]:
    """The recurrence one token at a time (the reference).

    x (b, T, H, P); dt (b, T, H) discretised; A (H,); B, C (b, T, G, N); state
    (b, H, P, N) fp32 -> y (b, T, H, P) fp32 (no D term), state (b, H, P, N) fp32.
    `states_after`, if given, gets the state after each step."""
    Bt, T, H, P = x.shape
    xg, dtg, Ag, S = _grouped(x, dt, A, B, state)
    ys = []
    for t in range(T):
        y, S = _step(S, xg[:, t], dtg[:, t], Ag, B[:, t], C[:, t])
        ys.append(y)
        if states_after is not None:
            states_after.append(S.reshape(state.shape))
    return mx.stack(ys, axis=1).reshape(Bt, T, H, P), S.reshape(state.shape)


def _to_chunks(x: mx.array, num_chunks: int, chunk_size: int) -> mx.array:
    """(b, T, ...) zero-padded to num_chunks * chunk_size tokens -> (b, n, C, ...)."""
    pad = num_chunks * chunk_size - x.shape[1]
    if pad:
        x = mx.pad(x, [(0, 0), (0, pad)] + [(0, 0)] * (x.ndim - 2))
    return x.reshape(x.shape[0], num_chunks, chunk_size, *x.shape[2:])


def segsum(x: mx.array, mask: Optional[mx.array] = None) -> mx.array:
    """Upstream's segment sums: x (..., T) -> (..., T, T), [..., i, j] = x[j+1] + ... +
    x[i] for i > j and 0 on and above the diagonal (exp of it is the decay from step j
    to step i; the caller masks the upper triangle). Summed term by term, not as
    differences of a running sum, which lose precision to cancellation. With a mask
    (B, T) for x (B, H, T), masked steps add nothing and a pair with a masked end is -inf."""
    T = x.shape[-1]
    if mask is not None:
        mask = mx.expand_dims(mask.astype(mx.bool_), 1)  # (B, 1, T)
        x = x * mask
    later = mx.arange(T)[:, None] > mx.arange(T)[None]  # (T, T): k > j
    terms = mx.where(later, x[..., :, None], 0)  # (..., T, T): [k, j] = x[k] for k > j
    sums = mx.cumsum(terms, axis=-2)  # [i, j] = the terms k <= i
    if mask is not None:
        sums = mx.where(mask[..., :, None] & mask[..., None, :], sums, -mx.inf)
    return sums


def _chunk_block(x, dt, A, B, C, state, chunk_size):
    """ssd_chunked on at most CHUNKS_PER_BLOCK chunks.

    Within a chunk, gamma_i = sum of a up to i and S0 the state before it:
        y_i = exp(gamma_i) S0 C_i + sum_{j <= i} exp(gamma_i - gamma_j) (C_i . B_j) dt_j x_j
        S = exp(gamma_last) S0 + sum_j exp(gamma_last - gamma_j) dt_j x_j B_j^T
    Every chunk's terms without S0 are batched; the scan over chunks then reads and
    writes S0 once each. Padding (dt = 0, x = B = C = 0) leaves the state unchanged.
    """
    Bt, T, H, P = x.shape
    G, N = B.shape[-2:]
    r, Cs = H // G, chunk_size
    n = -(-T // Cs)
    xdt = _to_chunks((x * dt[..., None]).reshape(Bt, T, G, r, P), n, Cs)  # (b, n, C, G, r, P)
    xdt = xdt.transpose(0, 1, 3, 4, 2, 5)  # (b, n, G, r, C, P)
    a = _to_chunks((dt * A).reshape(Bt, T, G, r), n, Cs).transpose(0, 1, 3, 4, 2)  # (b, n, G, r, C)
    Bc = _to_chunks(B, n, Cs).transpose(0, 1, 3, 2, 4)[:, :, :, None]  # (b, n, G, 1, C, N)
    Cc = _to_chunks(C, n, Cs).transpose(0, 1, 3, 2, 4)[:, :, :, None]
    gamma = mx.cumsum(a, axis=-1)  # (b, n, G, r, C)
    pos = mx.arange(Cs)
    # exp of a masked difference: above the diagonal it would be positive.
    diff = gamma[..., :, None] - gamma[..., None, :]
    decay = mx.exp(mx.where(pos[:, None] >= pos[None, :], diff, -mx.inf))  # (b, n, G, r, C, C)
    y_intra = ((Cc @ Bc.swapaxes(-1, -2)) * decay) @ xdt  # (b, n, G, r, C, P)
    tail = mx.exp(gamma[..., -1:] - gamma)[..., None]  # (b, n, G, r, C, 1)
    chunk_writes = (xdt * tail).swapaxes(-1, -2) @ Bc  # (b, n, G, r, P, N)
    chunk_decay = mx.exp(gamma[..., -1])[..., None, None]  # (b, n, G, r, 1, 1)
    S = state.reshape(Bt, G, r, P, N)
    starts = []
    for c in range(n):
        starts.append(S)
        S = chunk_decay[:, c] * S + chunk_writes[:, c]
    starts = mx.stack(starts, axis=1)  # (b, n, G, r, P, N)
    y_start = mx.exp(gamma)[..., None] * (Cc @ starts.swapaxes(-1, -2))  # (b, n, G, r, C, P)
    y = (y_intra + y_start).transpose(0, 1, 4, 2, 3, 5).reshape(Bt, n * Cs, H, P)[:, :T]
    return y, S.reshape(Bt, H, P, N)


def ssd_chunked(x: mx.array, dt: mx.array, A: mx.array, B: mx.array, C: mx.array,
                state: mx.array, chunk_size: int = CHUNK_SIZE) -> Tuple[mx.array, mx.array]:
    """The recurrence in chunks of `chunk_size` tokens; shapes as in ssd_sequential.

    Blocks of CHUNKS_PER_BLOCK chunks run one after the other, carrying the state, so
    the (C x C per chunk and head) temporaries stay small whatever the length."""
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be positive, got {chunk_size}")
    block = chunk_size * CHUNKS_PER_BLOCK
    ys = []
    for start in range(0, x.shape[1], block):
        piece = slice(start, start + block)
        y, state = _chunk_block(x[:, piece], dt[:, piece], A, B[:, piece], C[:, piece], state, chunk_size)
        ys.append(y)
    return mx.concatenate(ys, axis=1) if len(ys) > 1 else ys[0], state


def ssd_update(x: mx.array, dt: mx.array, A: mx.array, B: mx.array, C: mx.array,
               state: Optional[mx.array] = None) -> Tuple[mx.array, mx.array]:
    """Run the recurrence over T tokens from `state` (zeros if None).

    x (b, T, H, P); dt (b, T, H) already discretised; A (H,) negative; B, C (b, T, G, N);
    state (b, H, P, N). Returns y (b, T, H, P) in x's dtype (no D term) and the new state
    in fp32. Fewer than CHUNKED_MIN_TOKENS tokens step, more go through the chunks."""
    dtype = x.dtype
    x, dt, A, B, C, state = _fp32_inputs(x, dt, A, B, C, state)
    if x.shape[1] < CHUNKED_MIN_TOKENS:
        y, state = ssd_sequential(x, dt, A, B, C, state)
    else:
        y, state = ssd_chunked(x, dt, A, B, C, state)
    return y.astype(dtype), state


def ssd_recorded(x: mx.array, dt: mx.array, A: mx.array, B: mx.array, C: mx.array,
                 state: Optional[mx.array] = None) -> Tuple[mx.array, mx.array, Callable]:
    """ssd_update for a forward a speculative rollback may undo: also `state_after(m)`,
    the state after its first m tokens (m a list: row b after its own m[b]). A short
    forward (a verify) steps anyway, so each step's state is kept and a rollback
    selects one: bit for bit what feeding those m tokens gives (ssd_replay's closed
    form agrees only to rounding). Long forwards replay."""
    dtype = x.dtype
    x, dt, A, B, C, state = _fp32_inputs(x, dt, A, B, C, state)
    if x.shape[1] < CHUNKED_MIN_TOKENS:
        states = [state]
        y, new_state = ssd_sequential(x, dt, A, B, C, state, states_after=states)
        return y.astype(dtype), new_state, partial(select_state, states)
    y, new_state = ssd_chunked(x, dt, A, B, C, state)
    return y.astype(dtype), new_state, partial(_replayed_state, x, dt, A, B, state)


def _replayed_state(x, dt, A, B, state, m):
    n = m if isinstance(m, int) else max(m)
    return ssd_replay(x[:, :n], dt[:, :n], A, B[:, :n], state, num_steps=None if isinstance(m, int) else m)


def ssd_replay(x: mx.array, dt: mx.array, A: mx.array, B: mx.array,
               state: Optional[mx.array] = None, num_steps: Optional[Sequence[int]] = None) -> mx.array:
    """Only the state after T recorded steps from `state`: a speculative rollback
    replaying the accepted prefix of a verify forward. Shapes as in ssd_update; returns
    (b, H, P, N) fp32. `num_steps`: row i replays only its first num_steps[i] steps
    (a batch whose rows roll back by different counts, in one replay): dt = 0 leaves
    the state exactly as it is.

    One step runs the decode step itself, so a draft's rollback to one token is bit for
    bit what feeding that token gives. Several steps use the closed form
        S_T = exp(gamma_T) S + sum_j exp(gamma_T - gamma_j) dt_j x_j B_j^T,
    which reads and writes the state once where stepping does so T times."""
    x, dt, A, B, _, state = _fp32_inputs(x, dt, A, B, None, state)
    Bt, T, H, P = x.shape
    if num_steps is not None:
        dt = mx.where(steps_mask(num_steps, T)[..., None], dt, 0.0)
    xg, dtg, Ag, S = _grouped(x, dt, A, B, state)
    if T == 1:
        return _step(S, xg[:, 0], dtg[:, 0], Ag, B[:, 0], mx.zeros_like(B[:, 0]))[1].reshape(state.shape)
    gamma = mx.cumsum(dtg * Ag, axis=1)  # (b, T, G, r)
    weight = mx.exp(gamma[:, -1:] - gamma) * dtg  # (b, T, G, r)
    xw = (xg * weight[..., None]).transpose(0, 2, 3, 4, 1)  # (b, G, r, P, T)
    writes = xw @ B.transpose(0, 2, 1, 3)[:, :, None]  # (b, G, r, P, N)
    S = mx.exp(gamma[:, -1])[..., None, None] * S + writes
    return S.reshape(state.shape)


def select_state(states: List[mx.array], m: Union[int, Sequence[int]]) -> mx.array:
    """states[m] (states[t]: after t steps, (B, ...)), or row b of states[m[b]] for each b."""
    if isinstance(m, int):
        return states[m]
    if len(set(m)) == 1:
        return states[m[0]]
    return mx.concatenate([states[m_b][b : b + 1] for b, m_b in enumerate(m)])


def entries_after(conv_input: mx.array, num_tokens: int, state_after: Callable, m: Union[int, List[int]]) -> List[mx.array]:
    """The cache entries of a layer with a short conv before its recurrence (GDN, KDA,
    Mamba-2) after only the first m of the num_tokens tokens of a recorded forward (m a
    list: row b after its own m[b]): the conv state is rows [m, m+K-1) of the conv input
    (B, K-1+T, C) (causality), the recurrent state `state_after(m)` (a `*_recorded`
    forward's). [conv, recurrent]."""
    kernel_size = conv_input.shape[1] - num_tokens + 1
    return [conv_state_after(conv_input, m, kernel_size), state_after(m)]


def steps_mask(num_steps: Sequence[int], num_tokens: int) -> mx.array:
    """(b, T) bool: True for the first num_steps[i] of row i's T steps."""
    return mx.arange(num_tokens)[None] < mx.array(num_steps, dtype=mx.int32)[:, None]


def causal_conv1d(conv_input: mx.array, weight: mx.array, bias: Optional[mx.array] = None) -> mx.array:
    """Depthwise causal convolution over an input that starts with its K-1 rows of
    history (the conv state; zeros at the start of a sequence), no padding.

    conv_input (b, K-1+T, ch), weight (ch, K, 1) (MLX layout), bias (ch,) -> (b, T, ch).
    Written as K shifted multiply-adds: on the CPU backend a grouped mx.conv1d with one
    channel per group is several times slower."""
    K = weight.shape[1]
    T = conv_input.shape[1] - K + 1
    taps = weight[:, :, 0].T  # (K, ch)
    out = conv_input[:, :T] * taps[0]
    for j in range(1, K):
        out = out + conv_input[:, j : j + T] * taps[j]
    return out if bias is None else out + bias


def conv_state_after(conv_input: mx.array, num_tokens: Union[int, Sequence[int]], kernel_size: int) -> mx.array:
    """The conv state after the first `num_tokens` new rows of a conv input: its rows
    [m, m+K-1), or for a list of per-row counts each row's own. (b, K-1+T, ch) -> (b, K-1, ch)."""
    if isinstance(num_tokens, int):
        return conv_input[:, num_tokens : num_tokens + kernel_size - 1]
    rows = mx.array(num_tokens, dtype=mx.int32)[:, None] + mx.arange(kernel_size - 1, dtype=mx.int32)  # (b, K-1)
    return mx.take_along_axis(conv_input, rows[:, :, None], axis=1)


def gated_rms_norm(y: mx.array, gate: mx.array, weight: mx.array, group_size: int, eps: float, *,
                   norm_before_gate: bool = False) -> mx.array:
    """Mamba-2's gated output norm over groups of `group_size` channels, in fp32, cast
    back to y's dtype, times weight: rmsnorm(y * silu(gate)) (the default, as Mamba-2 and
    Nemotron-H), or rmsnorm(y) * silu(gate) when `norm_before_gate`.

    y, gate (..., D), weight (D,), D a multiple of group_size -> (..., D)."""
    D = y.shape[-1]
    if D % group_size:
        raise ValueError(f"gated_rms_norm: {D} channels do not split into groups of {group_size}")
    gate = gate.astype(mx.float32)
    silu_gate = gate * mx.sigmoid(gate)
    h = y.astype(mx.float32)
    if not norm_before_gate:
        h = h * silu_gate
    h = h.reshape(*h.shape[:-1], D // group_size, group_size)  # (..., groups, group_size)
    h = mx.fast.rms_norm(h, None, eps).reshape(*y.shape)
    if norm_before_gate:
        h = h * silu_gate
    return weight * h.astype(y.dtype)


# --- upstream mlx-lm's names for the same recurrence --------------------------------------


def compute_dt(dt: mx.array, dt_bias: mx.array, time_step_limit: Tuple[float, float]) -> mx.array:
    """Upstream's name: discretize_dt with (min, max) limits. (B, T, H) fp32."""
    return discretize_dt(dt, dt_bias, *time_step_limit)


def ssm_update(hidden_states: mx.array, A_log: mx.array, B: mx.array, C: mx.array, D: mx.array, dt: mx.array,
               dt_bias: mx.array, state: Optional[mx.array] = None,
               time_step_limit: Tuple[float, float] = (0.001, 100.0), mask: Optional[mx.array] = None,
               lengths: Optional[mx.array] = None) -> Tuple[mx.array, mx.array]:
    """Upstream's entry point: the Mamba-2 layer's recurrence from raw dt and A_log,
    with the D skip term. hidden_states (b, T, H, P); A_log, D, dt_bias (H,); B, C
    (b, T, G, N); dt (b, T, H); state (b, H, P, N) or None. `mask` (b, T), true for
    real tokens, and right-padded `lengths` (b,) leave the state as it was at every
    other step (their step is 0: no decay, no write), so the returned state is the one
    after each row's last real token; outputs at those steps are meaningless, as
    upstream's. Returns y (b, T, H, P) in the input's dtype, the state in fp32."""
    step = compute_dt(dt, dt_bias, time_step_limit)
    T = hidden_states.shape[1]
    if mask is not None:
        step = mx.where(mask[..., None].astype(mx.bool_), step, 0.0)
    if lengths is not None:
        step = mx.where((mx.arange(T)[None] < lengths[:, None])[..., None], step, 0.0)
    A = -mx.exp(A_log.astype(mx.float32))
    y, state = ssd_update(hidden_states, step, A, B, C, state)
    y = y + (hidden_states * D.reshape(1, 1, -1, 1)).astype(y.dtype)
    return y, state


# Upstream's chunked prefill function: here the same entry point picks its path.
ssm_attn = ssm_update
