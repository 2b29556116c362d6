"""RG-LRU (Griffin's Real-Gated Linear Recurrent Unit) math. Pure functions.

Per channel, from the recurrent block's conv output x_t, two gates made by per-head
block-diagonal linear maps, gate_x = sigmoid(x W_x + b_x) and gate_a = sigmoid(x W_a + b_a),
and the learned per-channel Lambda (`recurrent_param`):

    log a_t = -c * gate_a_t * softplus(Lambda)      (c = 8)
    b_t     = x_t * gate_x_t * sqrt(1 - a_t^2)       (1 instead of the sqrt at position 0)
    h_t     = a_t * h_{t-1} + b_t                   (h in fp32; a_0 = 0: the reset)

The sqrt(1 - a^2) normalisation keeps h at the scale of x whatever the decay. The block
reads every h_t (its output), and h_T is the recurrent state its cache keeps.

Two paths compute the recurrence h_t = a_t h_{t-1} + b_t:
- `linear_scan_sequential`: step by step (the reference).
- `linear_scan`: a Hillis-Steele doubling scan, ceil(log2 T) whole-sequence steps of
  (a, b) o (a', b') = (a a', a' b + b'). Position t's result is built from positions
  <= t only, in an order fixed by t alone, so it is *prefix stable*: feeding m tokens
  in one forward gives bit for bit the first m positions of any longer forward. That
  is what makes `state_after` (a speculative rollback's replay of an accepted prefix)
  equal, bit for bit, both the verify forward's own state at m and a fresh feed of m.
References: De et al., "Griffin: Mixing Gated Linear Recurrences with Local Attention
for Efficient Language Models" (arXiv 2402.19427); transformers
`models/recurrent_gemma/modeling_recurrent_gemma.py` (RecurrentGemmaRglru).
"""

from typing import Optional, Sequence, Tuple, Union

import mlx.core as mx

# The gate constant c of log a = -c * gate_a * softplus(Lambda) (Griffin, section 2.4).
GATE_CONSTANT = 8.0


def block_diagonal_linear(x: mx.array, weight: mx.array, bias: mx.array) -> mx.array:
    """Each of H heads' channels through its own square map: x_h @ W_h + b_h.

    x (B, T, H * w), weight (H, w, w) (input rows, output columns), bias (H, w) ->
    (B, T, H * w)."""
    B, T, _ = x.shape
    H, w, _ = weight.shape
    heads = x.reshape(B * T, H, w).transpose(1, 0, 2)  # (H, B*T, w)
    out = heads @ weight + bias[:, None, :]  # (H, B*T, w)
    return out.transpose(1, 0, 2).reshape(B, T, H * w)


@mx.compile
def _decay_and_inputs(x: mx.array, gate_x_logits: mx.array, gate_a_logits: mx.array,
                      recurrent_param: mx.array) -> Tuple[mx.array, mx.array, mx.array]:
    """a, b and the unnormalised x * gate_x, (B, T, W) each: one fused kernel per call."""
    gate_x, gate_a = mx.sigmoid(gate_x_logits), mx.sigmoid(gate_a_logits)
    log_a = -GATE_CONSTANT * gate_a * mx.logaddexp(recurrent_param, 0.0)  # softplus
    multiplier = mx.sqrt(1 - mx.exp(2 * log_a))
    gated = x * gate_x
    return mx.exp(log_a), gated * multiplier.astype(x.dtype), gated


def rg_lru_inputs(x: mx.array, gate_x_logits: mx.array, gate_a_logits: mx.array, recurrent_param: mx.array,
                  starts_sequence: bool) -> Tuple[mx.array, mx.array]:
    """The recurrence's per-token decay a and input b, in x's dtype, as transformers
    computes them (gate = sigmoid(logits), a^2 as exp(2 log a), the sqrt of 1 - a^2).

    x, gate_x_logits, gate_a_logits (B, T, W) (the gates before their sigmoid),
    recurrent_param (W,) -> a, b (B, T, W). `starts_sequence`: token 0 of x is position
    0 of its sequence, where the state resets (a = 0) and b is x * gate_x, unnormalised."""
    a, b, gated = _decay_and_inputs(x, gate_x_logits, gate_a_logits, recurrent_param)
    if starts_sequence:
        first = mx.arange(x.shape[1])[None, :, None] == 0  # (1, T, 1)
        a, b = mx.where(first, mx.zeros_like(a), a), mx.where(first, gated, b)
    return a, b


def _fp32(a: mx.array, b: mx.array, state: Optional[mx.array]) -> Tuple[mx.array, mx.array, mx.array]:
    if a.shape != b.shape or a.ndim != 3:
        raise ValueError(f"linear scan inputs must be (B, T, W) alike, got a {a.shape} and b {b.shape}")
    if state is None:
        state = mx.zeros((a.shape[0], a.shape[2]), mx.float32)
    if state.shape != (a.shape[0], a.shape[2]):
        raise ValueError(f"linear scan state has shape {state.shape}, expected {(a.shape[0], a.shape[2])}")
    return a.astype(mx.float32), b.astype(mx.float32), state.astype(mx.float32)


def linear_scan_sequential(a: mx.array, b: mx.array, state: Optional[mx.array] = None) -> Tuple[mx.array, mx.array]:
    """h_t = a_t h_{t-1} + b_t one token at a time, in fp32 (the reference).

    a, b (B, T, W); state (B, W) or None (zeros) -> every h (B, T, W) fp32, h_T (B, W) fp32."""
    a, b, h = _fp32(a, b, state)
    hs = []
    for t in range(a.shape[1]):
        h = a[:, t] * h + b[:, t]
        hs.append(h)
    return mx.stack(hs, axis=1), h


def _shifted(x: mx.array, by: int, fill: float) -> mx.array:
    """x moved `by` positions later along axis 1, the first `by` positions `fill`."""
    B, T, W = x.shape
    pad = mx.full((B, min(by, T), W), fill, x.dtype)
    return mx.concatenate([pad, x[:, : T - by]], axis=1) if by < T else pad


def linear_scan(a: mx.array, b: mx.array, state: Optional[mx.array] = None) -> Tuple[mx.array, mx.array]:
    """h_t = a_t h_{t-1} + b_t by doubling, prefix stable (see the module docstring).

    a, b (B, T, W); state (B, W) or None (zeros) -> every h (B, T, W) fp32, h_T (B, W) fp32.
    After the step of shift s, position t holds the composition of positions
    (t - 2s, t]; positions before s combine with the identity (1, 0), which leaves
    them exactly as they are."""
    a, b, state = _fp32(a, b, state)
    first = a[:, :1] * state[:, None] + b[:, :1]  # the state folded into position 0
    b = first if b.shape[1] == 1 else mx.concatenate([first, b[:, 1:]], axis=1)
    shift = 1
    while shift < a.shape[1]:
        b = b + a * _shifted(b, shift, 0.0)
        a = a * _shifted(a, shift, 1.0)
        shift *= 2
    return b, b[:, -1]


def state_after(a: mx.array, b: mx.array, state: Optional[mx.array], m: Union[int, Sequence[int]]) -> mx.array:
    """The recurrent state after only the first m of a recorded forward's tokens (a
    speculative rollback), from the pre-forward `state` (None: zeros) and the forward's
    own a, b (B, T, W); m a list: row i after its own m[i] (0 <= m[i] <= T). -> (B, W) fp32.

    Replays linear_scan over the prefix: by prefix stability it is bit for bit the
    state the verify forward had at m, and what feeding those m tokens gives."""
    if isinstance(m, int):
        return linear_scan(a[:, :m], b[:, :m], state)[1]
    n = max(m)
    start = _fp32(a[:, :0], b[:, :0], state)[2]
    if n == 0:
        return start
    hs = mx.concatenate([start[:, None], linear_scan(a[:, :n], b[:, :n], state)[0]], axis=1)  # (B, 1+n, W)
    at = mx.array(list(m), dtype=mx.int32)[:, None, None]
    return mx.take_along_axis(hs, at, axis=1)[:, 0]
