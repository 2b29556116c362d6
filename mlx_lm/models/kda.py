"""Kimi Delta Attention (KDA): the gated delta rule (gated_delta.py) with a per-channel
decay, the recurrence of Kimi Linear's linear attention layers.

Kimi Linear's recurrence (Kimi Team, "Kimi Linear", arXiv 2510.26692) is the gated delta
rule whose forget gate is a vector over the key channels, g (Dk,) per head and token,
instead of one scalar:
    S <- S diag(g);  delta = beta (v - S k);  S <- S + delta k^T;  y = S q.
The paths below mirror the scalar ones (stepping, chunked, replay) with g (B, T, Hv, Dk).
The chunked form needs the decay between two tokens of a chunk per channel, a (C, C, Dk)
tensor per head: chunks are kept smaller.
"""

from typing import Callable, List, Optional, Sequence, Tuple, Union

import mlx.core as mx

from .gated_delta import (
    _MIN_LOG_GATE,
    _by_blocks,
    _by_length,
    _fp32_inputs,
    _scan_chunks,
    _to_chunks,
    channel_gated_sequential,
    recorded,
    unit_lower_inverse,
)
from .ssm import steps_mask

# Tokens per chunk and chunks per block of the per-channel chunked path: its decay tensor
# is KDA_CHUNK_SIZE^2 * Dk per head and chunk (128 KB at Dk = 128).
KDA_CHUNK_SIZE = 16
KDA_CHUNKS_PER_BLOCK = 4


def compute_kda_g(A_log: mx.array, a: mx.array, dt_bias: mx.array) -> mx.array:
    """KDA's per-channel decay g = exp(-exp(A_log) * softplus(a + dt_bias)), in fp32.

    A_log (Hv,) (one rate per head); a (B, T, Hv, Dk); dt_bias (Hv * Dk,) as the
    checkpoints store it -> g (B, T, Hv, Dk) in (0, 1]."""
    Hv, Dk = a.shape[-2:]
    x = a.astype(mx.float32) + dt_bias.astype(mx.float32).reshape(Hv, Dk)
    rate = mx.exp(A_log.astype(mx.float32).reshape(Hv, 1))
    return mx.exp(-rate * mx.logaddexp(x, 0.0))


def kda_sequential(
    q: mx.array, k: mx.array, v: mx.array, g: mx.array, beta: mx.array, state: mx.array,
    states_after: Optional[List[mx.array]] = None,
) -> Tuple[mx.array, mx.array]:
    """KDA one token at a time.

    q, k (B, T, Hk, Dk); v (B, T, Hv, Dv); g (B, T, Hv, Dk); beta (B, T, Hv); state
    (B, Hv, Dv, Dk) fp32 -> y (B, T, Hv, Dv) fp32, state (B, Hv, Dv, Dk) fp32.
    `states_after`, if given, gets the state after each step.
    """
    return channel_gated_sequential(q, k, v, g, beta, state, states_after)


def _kda_intra_chunk(k: mx.array, log_g: mx.array, beta: mx.array):
    """The per-chunk pieces every KDA chunk needs. k (N, C, Dk), log_g (N, C, Dk),
    beta (N, C) -> gamma (N, C, Dk) (cumulative log decay), decay (N, C, C, Dk)
    (exp(gamma_i - gamma_j) for i >= j, else 0) and (I + L)^-1 (N, C, C) with
    L[i, j] = beta_i sum_d k_i k_j decay[i, j] (i > j)."""
    C = k.shape[1]
    gamma = mx.cumsum(mx.maximum(log_g, _MIN_LOG_GATE), axis=1)  # (N, C, Dk)
    pos = mx.arange(C)
    # exp of a masked difference: above the diagonal the exponent would be positive.
    lower_eq = (pos[:, None] >= pos[None, :])[:, :, None]
    decay = mx.exp(mx.where(lower_eq, gamma[:, :, None] - gamma[:, None], -mx.inf))  # (N, C, C, Dk)
    kk = (k[:, :, None] * k[:, None] * decay).sum(-1)  # (N, C, C)
    L = mx.where(pos[:, None] > pos[None, :], kk, 0.0) * beta[:, :, None]
    return gamma, decay, unit_lower_inverse(L)


def kda_chunked(
    q: mx.array,
    k: mx.array,
    v: mx.array,
    g: mx.array,
    beta: mx.array,
    state: mx.array,
    chunk_size: int = KDA_CHUNK_SIZE,
) -> Tuple[mx.array, mx.array]:
    """KDA in chunks of `chunk_size` tokens (a power of two), KDA_CHUNKS_PER_BLOCK
    chunks at a time. Shapes as in kda_sequential.

    Within a chunk, with gamma_t (Dk,) the summed log decay up to t, S0 the state before:
        U = (I + L)^-1 (beta v),  W = (I + L)^-1 (beta exp(gamma) * k)
        v_new = U - W S0^T,  y = (exp(gamma) * q) S0^T + A v_new,
        A[i, j] = sum_d q_i k_j exp(gamma_i - gamma_j)  (i >= j)
        S = S0 diag(exp(gamma_C)) + v_new^T (exp(gamma_C - gamma) * k)
    Padding steps (g = 1, beta = 0, k = v = 0) leave the state unchanged.
    """
    return _by_blocks(_kda_chunk_block, q, k, v, g, beta, state, chunk_size, KDA_CHUNKS_PER_BLOCK)


def _kda_chunk_block(q, k, v, g, beta, state, C):
    """kda_chunked on at most KDA_CHUNKS_PER_BLOCK chunks (see there)."""
    B, T, Hk, Dk = q.shape
    Hv, Dv = v.shape[-2:]
    n = -(-T // C)
    f32 = mx.float32
    if Hv != Hk:  # value head h reads key head h // (Hv // Hk)
        q, k = mx.repeat(q, Hv // Hk, axis=2), mx.repeat(k, Hv // Hk, axis=2)
    # Every head of every chunk as one batch N = n * B * Hv of (C, D) blocks.
    q, k, v = (_to_chunks(x.astype(f32), n, C).reshape(-1, C, x.shape[-1]) for x in (q, k, v))
    log_g = _to_chunks(mx.log(g.astype(f32)), n, C).reshape(-1, C, Dk)  # padding: log 1 = 0
    beta = _to_chunks(beta.astype(f32), n, C).reshape(-1, C)
    gamma, decay, T_inv = _kda_intra_chunk(k, log_g, beta)
    u = T_inv @ (beta[..., None] * v)  # (N, C, Dv)
    w = T_inv @ (beta[..., None] * mx.exp(gamma) * k)  # (N, C, Dk)
    attn = (q[:, :, None] * k[:, None] * decay).sum(-1)  # (N, C, C), 0 above the diagonal
    q_eff = q * mx.exp(gamma) - attn @ w  # (N, C, Dk)
    k_tail = k * mx.exp(gamma[:, -1:] - gamma)  # (N, C, Dk)
    return _scan_chunks(w, q_eff, u, attn @ u, k_tail, mx.exp(gamma[:, -1]), state, T)


def kda_recurrence(
    q: mx.array,
    k: mx.array,
    v: mx.array,
    g: mx.array,
    beta: mx.array,
    state: Optional[mx.array] = None,
) -> Tuple[mx.array, mx.array]:
    """Run KDA over T tokens from `state` (zeros if None).

    q, k (B, T, Hk, Dk) already normalised (and q scaled); v (B, T, Hv, Dv); g (B, T,
    Hv, Dk); beta (B, T, Hv); state (B, Hv, Dv, Dk). Returns y (B, T, Hv, Dv) in v's
    dtype and the new state in fp32: stepping below CHUNKED_MIN_TOKENS tokens, chunked
    from there (the same recurrence).
    """
    g, beta, state = _fp32_inputs(q, k, v, g, beta, state, per_channel=True)
    return _by_length(kda_sequential, kda_chunked, q, k, v, g, beta, state)


def kda_recorded(
    q: mx.array,
    k: mx.array,
    v: mx.array,
    g: mx.array,
    beta: mx.array,
    state: Optional[mx.array] = None,
) -> Tuple[mx.array, mx.array, Callable[[Union[int, Sequence[int]]], mx.array]]:
    """kda_recurrence for a forward a speculative rollback may undo, as
    gated_delta_recorded: also `state_after(m)`, the state after its first m tokens (m
    a list: row b after its own m[b]), selected from the steps' states when it stepped
    (bit for bit what feeding those m tokens gives), replayed after a long forward."""
    g, beta, state = _fp32_inputs(q, k, v, g, beta, state, per_channel=True)
    return recorded(kda_sequential, kda_chunked, kda_replay, q, k, v, g, beta, state)


def kda_replay(
    q: mx.array,
    k: mx.array,
    v: mx.array,
    g: mx.array,
    beta: mx.array,
    state: Optional[mx.array] = None,
    num_steps: Optional[Sequence[int]] = None,
) -> mx.array:
    """Only the state after T recorded KDA steps from `state` (a speculative rollback),
    as gated_delta_replay for the scalar gate: row b replays only its first
    num_steps[b] steps when given; several steps run as one chunk of the next power of
    two. Shapes as in kda_recurrence; returns (B, Hv, Dv, Dk) fp32."""
    g, beta, state = _fp32_inputs(q, k, v, g, beta, state, per_channel=True)
    B, T, Hk, Dk = q.shape
    Hv, Dv = v.shape[-2:]
    if num_steps is not None:  # g = 1, beta = 0: the step leaves the state as it is
        replayed = steps_mask(num_steps, T)[..., None]  # (B, T, 1)
        g, beta = mx.where(replayed[..., None], g, 1.0), mx.where(replayed, beta, 0.0)
    if T == 1:
        return kda_sequential(q, k, v, g, beta, state)[1]
    k = mx.repeat(k, Hv // Hk, axis=2) if Hv != Hk else k  # value head h reads key head h // r
    C = 1 << (T - 1).bit_length()
    k, v, log_g = (_to_chunks(x.astype(mx.float32), 1, C)[0] for x in (k, v, mx.log(g)))  # padding: log g = 0
    beta = _to_chunks(beta, 1, C)[0]
    return _kda_chunk_final_state(k, v, log_g, beta, state.reshape(B * Hv, Dv, Dk)).reshape(B, Hv, Dv, Dk)


@mx.compile
def _kda_chunk_final_state(k: mx.array, v: mx.array, log_g: mx.array, beta: mx.array, S: mx.array) -> mx.array:
    """The state after one KDA chunk, nothing else. k (N, C, Dk), v (N, C, Dv),
    log_g (N, C, Dk), beta (N, C), S (N, Dv, Dk) -> (N, Dv, Dk)."""
    gamma, _, T_inv = _kda_intra_chunk(k, log_g, beta)
    u = T_inv @ (beta[..., None] * v)  # (N, C, Dv)
    w = T_inv @ (beta[..., None] * mx.exp(gamma) * k)  # (N, C, Dk)
    v_new = u - w @ S.swapaxes(-1, -2)  # (N, C, Dv): what S mispredicts
    k_tail = k * mx.exp(gamma[:, -1:] - gamma)  # (N, C, Dk)
    return mx.exp(gamma[:, -1])[:, None, :] * S + v_new.swapaxes(-1, -2) @ k_tail
