"""Drafting for speculative decoding: the acceptance rules.

Speculative sampling (Leviathan et al. 2023, arXiv:2211.17192; Chen et al. 2023,
arXiv:2302.01318): the draft proposes x_1..x_K, each drawn from its law q_i; the
target's laws p_1..p_{K+1} come from one forward. x_i is accepted with probability
min(1, p_i(x_i) / q_i(x_i)); at the first rejection the token is drawn from
norm(max(0, p_i - q_i)) instead, and after K acceptances a bonus token is drawn from
p_{K+1}. Each emitted token then has exactly the target's law, and a draft is accepted
with probability sum_x min(p_i(x), q_i(x)).

All functions take log-probabilities and allow leading batch dimensions (`...`).
"""

from typing import Optional, Tuple

import mlx.core as mx

# ---------------------------------------------------------------------------
# Acceptance rules (speculative sampling)
# ---------------------------------------------------------------------------


def accepted_count(
    target_logprobs: mx.array, draft_logprobs: mx.array, drafts: mx.array, uniforms: mx.array
) -> mx.array:
    """How many leading drafts pass the ratio test u_i < p_i(x_i) / q_i(x_i).

    Args:
        target_logprobs: (..., K or K + 1, V) log p; only the first K rows are read.
        draft_logprobs: (..., K, V) log q, the laws the drafts were drawn from.
        drafts: (..., K) the drafted ids x_i.
        uniforms: (..., K) independent draws from [0, 1).

    Returns:
        (...,) int32 in [0, K]. P(u < p/q) = min(1, p/q) for u uniform on [0, 1).
    """
    num_drafts = drafts.shape[-1]
    ids = drafts[..., None].astype(mx.int32)  # (..., K, 1)
    p = mx.take_along_axis(target_logprobs[..., :num_drafts, :], ids, axis=-1)[..., 0]
    q = mx.take_along_axis(draft_logprobs, ids, axis=-1)[..., 0]
    passed = (uniforms < mx.exp(p.astype(mx.float32) - q.astype(mx.float32))).astype(mx.int32)
    return mx.cumprod(passed, axis=-1).sum(axis=-1)


def correction_logprobs(target_logprobs: mx.array, draft_logprobs: mx.array) -> mx.array:
    """The law of the token emitted after n accepted drafts, for every n.

    Args:
        target_logprobs: (..., K + 1, V) log p.
        draft_logprobs: (..., K, V) log q.

    Returns:
        (..., K + 1, V) float32 log-probabilities: row i < K is
        log norm(max(0, p_i - q_i)) (the token after a rejection at i), row K is
        log p_K (the bonus). Where p_i <= q_i everywhere (p_i == q_i up to round-off)
        a rejection has probability ~0 and row i is p_i, so it is always a law.
    """
    num_drafts = draft_logprobs.shape[-2]
    target_logprobs = target_logprobs.astype(mx.float32)
    p = mx.exp(target_logprobs[..., :num_drafts, :])
    residual = mx.maximum(p - mx.exp(draft_logprobs.astype(mx.float32)), 0)  # (..., K, V)
    mass = residual.sum(axis=-1, keepdims=True)
    rows = mx.where(mass > 0, mx.log(residual) - mx.log(mass), target_logprobs[..., :num_drafts, :])
    return mx.concatenate([rows, target_logprobs[..., num_drafts:, :]], axis=-2)


def speculative_sample(
    target_logprobs: mx.array, draft_logprobs: mx.array, drafts: mx.array, key: Optional[mx.array] = None
) -> Tuple[mx.array, mx.array]:
    """One round of speculative sampling.

    Args:
        target_logprobs: (..., K + 1, V) log p after each draft position and the bonus.
        draft_logprobs: (..., K, V) log q; drafts[..., i] must have been drawn from row i.
        drafts: (..., K) drafted ids.
        key: PRNG key; default the global mx.random state.

    Returns:
        (num_accepted (...,) int32, token (...,) uint32): the drafts kept, and the
        token that follows them (a correction or the bonus). Lazy.
    """
    accept_key, token_key = mx.random.split(key) if key is not None else (None, None)
    uniforms = mx.random.uniform(shape=drafts.shape, key=accept_key)
    num_accepted = accepted_count(target_logprobs, draft_logprobs, drafts, uniforms)
    laws = correction_logprobs(target_logprobs, draft_logprobs)  # (..., K + 1, V)
    law = mx.take_along_axis(laws, num_accepted[..., None, None], axis=-2)[..., 0, :]
    return num_accepted, mx.random.categorical(law, key=token_key).astype(mx.uint32)
