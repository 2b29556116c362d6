"""Acceptance: which drafted tokens a round keeps, and the target's token after them.
One set of pure functions from arrays to arrays for every driver (the single-sequence
loop in speculative.py, a batch of rows in batching.py) and every drafter.

Two rules:
- token matching: the target's own choices at every verified position (greedy: the
  argmax; any other sampler: its draws); the longest agreeing prefix of the drafts is
  kept and the target's choice after it follows. Greedy output equals plain decoding
  token for token.
- speculative sampling (Leviathan et al. 2023, arXiv:2211.17192; Chen et al. 2023,
  arXiv:2302.01318): the draft proposes x_1..x_K, each drawn from its law q_i; the
  target's laws p_1..p_{K+1} come from one forward. x_i is accepted with probability
  min(1, p_i(x_i) / q_i(x_i)); at the first rejection the token is drawn from
  norm(max(0, p_i - q_i)) instead, and after K acceptances a bonus token is drawn from
  p_{K+1}. Each emitted token then has exactly the target's law, and a draft is
  accepted with probability sum_x min(p_i(x), q_i(x)). A point-mass drafter (prompt
  lookup, a greedy draft) is the case q_i = one-hot(x_i): x_i is accepted with
  probability p_i(x_i).
The functions take log-probabilities and allow leading batch dimensions (`...`).
"""

from typing import Callable, Optional, Tuple

import mlx.core as mx

from .sample_utils import CategoricalSampler

def point_masses(tokens: mx.array, num_columns: int) -> mx.array:
    """(n, num_columns) log-laws putting all mass on each of `tokens` (n,)."""
    columns = mx.arange(num_columns, dtype=mx.uint32)
    return mx.where(columns[None, :] == tokens[:, None], 0.0, -mx.inf)


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


def matched_prefix(drafts: mx.array, targets: mx.array) -> Tuple[mx.array, mx.array]:
    """Token matching.

    Args:
        drafts: (..., K) drafted ids.
        targets: (..., K + 1) the target's own choice at each verified position.

    Returns:
        (num_accepted (...,) int32, token (...,) uint32): how many leading drafts equal
        the target's choices, and the target's choice after them. Lazy.
    """
    agree = (drafts.astype(mx.uint32) == targets[..., : drafts.shape[-1]].astype(mx.uint32)).astype(mx.int32)
    num_accepted = mx.cumprod(agree, axis=-1).sum(axis=-1) if drafts.shape[-1] else mx.zeros(drafts.shape[:-1], mx.int32)
    token = mx.take_along_axis(targets, num_accepted[..., None], axis=-1)[..., 0]
    return num_accepted, token.astype(mx.uint32)


def acceptance_rule(sampler: Callable) -> str:
    """The rule a run with this sampler accepts drafts by (SpeculationStats.acceptance_rule):
    a CategoricalSampler gives its law, so speculative sampling (a batch row's own draws
    against point-mass drafts are that too); any other sampler, token matching."""
    return "speculative sampling" if isinstance(sampler, CategoricalSampler) else "token matching"


def accept(
    logprobs: mx.array,
    drafts: mx.array,
    draft_laws: Optional[mx.array],
    sampler: Callable[..., mx.array],
    draw: Optional[Callable[[mx.array], mx.array]] = None,
    key: Optional[mx.array] = None,
) -> Tuple[mx.array, mx.array]:
    """Decide one sequence's round (lazy): (num_accepted () int32, token () uint32).

    `logprobs` (K + 1, V) are the target's, processed, after its last committed token
    and each of the K `drafts`. With a CategoricalSampler and the laws (K, V) the
    drafts were drawn from: speculative sampling (with `key`, else the global state).
    Otherwise token matching against the sampler's draws at each position (`draw`,
    default the sampler itself: a batch row passes its seeded draws)."""
    if draft_laws is not None and isinstance(sampler, CategoricalSampler):
        return speculative_sample(sampler.distribution(logprobs), draft_laws, drafts, key)
    targets = (draw or sampler)(logprobs).astype(mx.uint32)
    return matched_prefix(drafts, targets)
