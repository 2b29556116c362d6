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
- `linear_scan`: in chunks of CHUNK_SIZE positions: every chunk steps from a zero
  state at once (C steps over all chunks), then the state is carried from chunk to
  chunk (T / C steps) and added in, scaled by the decay since the chunk's start. A
  position's result is built from positions <= t only, in an order fixed by t alone,
  so the scan is *prefix stable*: feeding m tokens in one forward gives bit for bit
  the first m positions of any longer forward. That makes `state_after` (a
  speculative rollback's replay of an accepted prefix) equal, bit for bit, both the
  verify forward's own state at m and a fresh feed of those m tokens.
  (A doubling, Hillis-Steele scan is prefix stable too, but T log T work made it 4x
  slower than stepping for 2048 tokens on the CPU.)
References: De et al., "Griffin: Mixing Gated Linear Recurrences with Local Attention
for Efficient Language Models" (arXiv 2402.19427); transformers
`models/recurrent_gemma/modeling_recurrent_gemma.py` (RecurrentGemmaRglru).
"""

from typing import Optional, Sequence, Tuple, Union

import mlx.core as mx

# The gate constant c of log a = -c * gate_a * softplus(Lambda) (Griffin, section 2.4).
GATE_CONSTANT = 8.0
# Positions per chunk of linear_scan: a prefill of T tokens takes C + T / C sequential
# steps instead of T. Fixed (never chosen from T), which keeps the scan prefix stable.
# 16 measured fastest of 16 / 32 / 64 for 2048 tokens of width 2560 on the CPU.
CHUNK_SIZE = 16


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


def _to_chunks(x: mx.array, num_chunks: int, chunk_size: int, fill: float) -> mx.array:
    """(B, T, W) padded at the end with `fill` to num_chunks * chunk_size -> (B, n, C, W)."""
    B, T, W = x.shape
    pad = num_chunks * chunk_size - T
    if pad:
        x = mx.concatenate([x, mx.full((B, pad, W), fill, x.dtype)], axis=1)
    return x.reshape(B, num_chunks, chunk_size, W)


def linear_scan(a: mx.array, b: mx.array, state: Optional[mx.array] = None,
                chunk_size: int = CHUNK_SIZE) -> Tuple[mx.array, mx.array]:
    """h_t = a_t h_{t-1} + b_t in chunks, prefix stable (see the module docstring).

    a, b (B, T, W); state (B, W) or None (zeros) -> every h (B, T, W) fp32, h_T (B, W) fp32.
    Every chunk c first runs from a zero state, all chunks in one loop of C steps:
    local h~_t and the decay product A_t = prod of a since the chunk's start; then the
    state H entering each chunk is carried across chunks (n steps), and
    h_t = h~_t + A_t H_{c-1}. Padding (a = 1, b = 0) leaves h and A exactly as they are."""
    a, b, state = _fp32(a, b, state)
    B, T, W = a.shape
    C = min(chunk_size, T)  # a shorter update is one chunk: the same steps as chunk 0
    n = -(-T // C)
    a, b = _to_chunks(a, n, C, 1.0), _to_chunks(b, n, C, 0.0)  # (B, n, C, W)
    h, decay = b[:, :, 0], a[:, :, 0]  # (B, n, W)
    local, decays = [h], [decay]
    for t in range(1, C):
        h, decay = a[:, :, t] * h + b[:, :, t], decay * a[:, :, t]
        local.append(h)
        decays.append(decay)
    local, decays = mx.stack(local, axis=2), mx.stack(decays, axis=2)  # (B, n, C, W)
    entering = [state]
    for c in range(n - 1):
        entering.append(decays[:, c, -1] * entering[-1] + local[:, c, -1])
    hs = local + decays * mx.stack(entering, axis=1)[:, :, None]  # (B, n, C, W)
    hs = hs.reshape(B, n * C, W)[:, :T]
    return hs, hs[:, -1]


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
