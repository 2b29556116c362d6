"""Mamba-1 selective scan: the recurrence, a chunked form for prefill and the
replay a speculative rollback runs. Pure functions.

Per channel d of the expanded stream (I channels, state size N), with per-token
inputs x (I), B, C (N) and a step dt (I) > 0, and A (I, N) < 0:

    S <- exp(dt A) * S + (dt x) B^T        (S: (I, N), fp32; A per channel and state)
    y = S C                                (+ D x, added by the layer)

Unlike Mamba-2 the decay differs per (channel, state) entry, so the SSD block
decomposition (one scalar decay per head) does not apply. Three paths compute it:
- `scan_sequential`: step by step (decode, short speculative verify windows).
- `scan_chunked`: prefill. Per chunk of L tokens, the decays exp(dt A) and writes
  (dt x) B^T of all its tokens are computed at once, the L state updates run as one
  compiled chain of multiply-adds and the outputs as one batched product: the same
  arithmetic as stepping (the same bits), in L times fewer dispatches. On the CPU
  backend the T * I * N exponentials of dt A are the cost whatever the form (at
  mamba-130m sizes, 1024 tokens: 0.81 s of CPU chunked, 0.82 s stepping), so there it
  only matches stepping; the saving is the dispatches, which a GPU pays per step.
  (A log-depth associative scan over the chunk, (a1, b1) . (a2, b2) = (a1 a2,
  a2 b1 + b2), does log2(L) times the elementwise work and measured 1.4x slower than
  stepping on the CPU; a two-pass form running all chunks at once, 1.7x; neither is used.)
- `scan_replay`: only the state after T recorded steps (a rollback): the same chain
  without outputs, so a rollback is bit for bit a feed of the accepted tokens.
The conv in front of the scan and its state are ssm.py's (`causal_conv1d`,
`conv_state_after`): Mamba-1 convolves the x channels only.
References: Gu and Dao, "Mamba: Linear-Time Sequence Modeling with Selective State
Spaces" (arXiv 2312.00752); transformers `models/mamba/modeling_mamba.py`
(`mamba_selective_scan`, `mamba_selective_state_update`).
"""

from typing import List, Optional, Sequence, Tuple, Union

import mlx.core as mx

from .ssm import conv_state_after, steps_mask

# Tokens per chunk of the chunked path: its temporaries are (b, CHUNK_SIZE, I, N).
CHUNK_SIZE = 32
# Updates of at least this many tokens take the chunked path; shorter ones step (so a
# speculative verify runs the decode step's arithmetic).
CHUNKED_MIN_TOKENS = 16


def discretize_dt(dt: mx.array) -> mx.array:
    """The step of each token and channel: softplus of dt_proj's output (bias included),
    in fp32. (b, T, I) -> (b, T, I). Mamba-1 does not clamp it (its time_step_min/max
    only initialise dt_proj's bias)."""
    return mx.logaddexp(dt.astype(mx.float32), 0.0)


def _check_shapes(x, dt, A, B, C, state):
    b, T, I = x.shape
    N = A.shape[-1]
    if dt.shape != x.shape or A.shape != (I, N) or B.shape != (b, T, N) or (C is not None and C.shape != B.shape):
        raise ValueError(
            f"selective scan inputs disagree: x {x.shape}, dt {dt.shape}, A {A.shape}, B {B.shape}, "
            f"C {None if C is None else C.shape}; expected x, dt (b, T, I), A (I, N), B, C (b, T, N)"
        )
    if state is not None and state.shape != (b, I, N):
        raise ValueError(f"selective scan state has shape {state.shape}, expected {(b, I, N)}")


def _fp32_inputs(x, dt, A, B, C, state):
    """Checked inputs in fp32, with a zero state if None."""
    _check_shapes(x, dt, A, B, C, state)
    f32 = mx.float32
    if state is None:
        state = mx.zeros((x.shape[0], *A.shape), f32)
    C = None if C is None else C.astype(f32)
    return x.astype(f32), dt.astype(f32), A.astype(f32), B.astype(f32), C, state.astype(f32)


@mx.compile
def _step(state, x, dt, A, B, C):
    """One token. state (b, I, N); x, dt (b, I); A (I, N); B, C (b, N) -> y (b, I), state."""
    decay = mx.exp(dt[..., None] * A)  # (b, I, N)
    state = decay * state + (dt * x)[..., None] * B[:, None, :]
    y = (state @ C[:, :, None])[..., 0]  # (b, I)
    return y, state


def scan_sequential(x: mx.array, dt: mx.array, A: mx.array, B: mx.array, C: mx.array,
                    state: mx.array) -> Tuple[mx.array, mx.array]:
    """The recurrence one token at a time (the reference).

    x, dt (b, T, I) (dt discretised); A (I, N); B, C (b, T, N); state (b, I, N) fp32
    -> y (b, T, I) fp32 (no D term), state (b, I, N) fp32."""
    ys = []
    for t in range(x.shape[1]):
        y, state = _step(state, x[:, t], dt[:, t], A, B[:, t], C[:, t])
        ys.append(y)
    return mx.stack(ys, axis=1), state


@mx.compile
def _chunk(state, x, dt, A, B, C):
    """scan_chunked on one chunk of L tokens. The decays and writes of all L tokens
    come from one vectorised op each, the L state updates are one fused chain of
    multiply-adds (the decode step's arithmetic, so the states are the same bits), and
    the outputs one batched product. x, dt (b, L, I); B, C (b, L, N); state (b, I, N)."""
    decay = mx.exp(dt[..., None] * A)  # (b, L, I, N)
    write = (dt * x)[..., None] * B[:, :, None, :]  # (b, L, I, N)
    states = []
    for t in range(x.shape[1]):
        state = decay[:, t] * state + write[:, t]
        states.append(state)
    y = (mx.stack(states, axis=1) @ C[..., None])[..., 0]  # (b, L, I)
    return y, state


def scan_chunked(x: mx.array, dt: mx.array, A: mx.array, B: mx.array, C: mx.array,
                 state: mx.array, chunk_size: int = CHUNK_SIZE) -> Tuple[mx.array, mx.array]:
    """The recurrence in chunks of `chunk_size` tokens (see _chunk); shapes as in
    scan_sequential. The chunks run one after the other, carrying the state, so the
    temporaries stay (b, chunk_size, I, N) whatever the length."""
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be positive, got {chunk_size}")
    ys = []
    for start in range(0, x.shape[1], chunk_size):
        piece = slice(start, start + chunk_size)
        y, state = _chunk(state, x[:, piece], dt[:, piece], A, B[:, piece], C[:, piece])
        ys.append(y)
    return mx.concatenate(ys, axis=1) if len(ys) > 1 else ys[0], state


def selective_scan(x: mx.array, dt: mx.array, A: mx.array, B: mx.array, C: mx.array,
                   state: Optional[mx.array] = None) -> Tuple[mx.array, mx.array]:
    """Run the recurrence over T tokens from `state` (zeros if None).

    x, dt (b, T, I) (dt discretised); A (I, N) negative; B, C (b, T, N); state (b, I, N).
    Returns y (b, T, I) in x's dtype (no D term) and the new state in fp32. Fewer than
    CHUNKED_MIN_TOKENS tokens step, more go through the chunks."""
    dtype = x.dtype
    x, dt, A, B, C, state = _fp32_inputs(x, dt, A, B, C, state)
    if x.shape[1] < CHUNKED_MIN_TOKENS:
        y, state = scan_sequential(x, dt, A, B, C, state)
    else:
        y, state = scan_chunked(x, dt, A, B, C, state)
    return y.astype(dtype), state


@mx.compile
def _advance(state, x, dt, A, B):
    """Only the state after the tokens of x: _chunk's chain of multiply-adds without the
    outputs. Shapes as in _chunk."""
    decay = mx.exp(dt[..., None] * A)  # (b, T, I, N)
    write = (dt * x)[..., None] * B[:, :, None, :]
    for t in range(x.shape[1]):
        state = decay[:, t] * state + write[:, t]
    return state


def scan_replay(x: mx.array, dt: mx.array, A: mx.array, B: mx.array, state: Optional[mx.array] = None,
                num_steps: Optional[Sequence[int]] = None) -> mx.array:
    """Only the state after T recorded steps from `state`: a speculative rollback
    replaying the accepted prefix of a verify forward. Shapes as in selective_scan;
    returns (b, I, N) fp32. `num_steps`: row i replays only its first num_steps[i] steps
    (dt = 0 is a decay of exactly 1 and a write of exactly 0: the row's state stays as
    it is), so rows rolled back by different counts share one replay.

    The decode step's arithmetic in one compiled chain, so a rollback gives bit for bit
    the state a feed of the accepted tokens gives. (Mamba-2's closed form, which reads
    the state once, saves little here: Mamba-1's decay is per state entry, so the closed
    form does more elementwise work than the T steps, and the state is no larger than
    one token's inputs times N.)"""
    x, dt, A, B, _, state = _fp32_inputs(x, dt, A, B, None, state)
    if num_steps is not None:
        dt = mx.where(steps_mask(num_steps, x.shape[1])[..., None], dt, 0.0)
    return _advance(state, x, dt, A, B)


def replay_prefix(conv_input: mx.array, x: mx.array, dt: mx.array, A: mx.array, B: mx.array,
                  state: Optional[mx.array], kernel_size: int, m: Union[int, List[int]]) -> List[mx.array]:
    """A Mamba-1 layer's cache entries after only the first m tokens of a recorded
    forward (m a list: row b after its own m[b], in one replay).

    The forward's scan inputs (x, dt (b, T, I) discretised, A (I, N), B (b, T, N)) are
    replayed for m steps from the pre-forward `state`; by causality that is the state
    after m tokens (C only reads the state). The conv state is rows [m, m+K-1) of the
    conv input (b, K-1+T, I). Returns [conv_state, ssm_state]."""
    per_row = None if isinstance(m, int) else list(m)
    n = m if per_row is None else max(per_row)
    if n == 0:
        ssm_state = state if state is not None else mx.zeros((x.shape[0], *A.shape), mx.float32)
    else:
        ssm_state = scan_replay(x[:, :n], dt[:, :n], A, B[:, :n], state, num_steps=per_row)
    return [conv_state_after(conv_input, m, kernel_size), ssm_state]
