"""Token samplers and logits processors.

A sampler maps log-probabilities ``(B, V)`` to token ids ``(B,)``. It is built
by :func:`make_sampler` from pure filters, each of which sets the entries it
removes to ``-inf`` and leaves the others untouched:

* :func:`apply_top_p`: nucleus sampling (Holtzman et al., 2019,
  arXiv:1904.09751).
* :func:`apply_min_p`: keep tokens at least ``min_p`` times as likely as the
  most likely one (Nguyen et al., 2024, arXiv:2407.01082).
* :func:`apply_xtc`: "exclude top choices" (the XTC sampler from
  text-generation-webui PR #6335).
* :func:`apply_top_k`: keep the ``k`` most likely tokens.

:class:`CategoricalSampler` (what ``make_sampler`` returns for ``temp > 0``)
also gives the law it draws from, for speculative sampling.

A logits processor maps ``(tokens, logits)`` to new logits before sampling;
:func:`make_logits_processors` builds the bias and penalty processors.
"""

import math
import numbers
from functools import partial
from typing import Callable, Dict, List, Optional, Sequence

import mlx.core as mx

Sampler = Callable[[mx.array], mx.array]
LogitsProcessor = Callable[[mx.array, mx.array], mx.array]


# ---------------------------------------------------------------------------
# Filters
# ---------------------------------------------------------------------------


def apply_top_p(logprobs: mx.array, top_p: float) -> mx.array:
    """Keep the smallest set of most likely tokens whose mass reaches ``top_p``.

    Args:
        logprobs: (B, V) log-probabilities (unnormalised log-weights work too:
            the mass is computed after a softmax).
        top_p: target cumulative probability in (0, 1].

    Returns:
        (B, V) ``logprobs`` with the tokens outside the nucleus set to -inf.
        The most likely token is always kept.
    """
    probs = mx.softmax(logprobs, axis=-1)
    order = mx.argsort(-logprobs, axis=-1)  # (B, V), most likely first
    sorted_probs = mx.take_along_axis(probs, order, axis=-1)
    # A token belongs to the nucleus iff the mass strictly before it is still
    # short of top_p; the exclusive sum avoids `cumsum - p` round-off.
    mass_before = mx.cumsum(sorted_probs, axis=-1, inclusive=False)
    # The most likely token stays whatever top_p is: in float16 a tiny top_p rounds to 0,
    # which no mass is below.
    keep_sorted = (mass_before < top_p) | (mx.arange(logprobs.shape[-1]) == 0)  # (B, V), in sorted order
    keep = mx.take_along_axis(keep_sorted, mx.argsort(order, axis=-1), axis=-1)
    return mx.where(keep, logprobs, -mx.inf)


def apply_min_p(
    logprobs: mx.array, min_p: float, min_tokens_to_keep: int = 1
) -> mx.array:
    """Keep tokens with ``p >= min_p * p_max``, and at least ``min_tokens_to_keep``.

    Args:
        logprobs: (B, V) log-probabilities (a shared offset per row does not
            change the result, since only differences to the row max matter).
        min_p: relative threshold in [0, 1].
        min_tokens_to_keep: the most likely tokens always kept (ties at the
            boundary are all kept).

    Returns:
        (B, V) ``logprobs`` with the filtered tokens set to -inf.
    """
    top = mx.max(logprobs, axis=-1, keepdims=True)  # (B, 1)
    # Compare in log space: p / p_max >= min_p  <=>  lp - lp_max >= log(min_p).
    threshold = top + (math.log(min_p) if min_p > 0 else -math.inf)
    keep = logprobs >= threshold
    if min_tokens_to_keep > 1:
        kth = _kth_largest(logprobs, min(min_tokens_to_keep, logprobs.shape[-1]))
        keep = keep | (logprobs >= kth)
    return mx.where(keep, logprobs, -mx.inf)


def apply_top_k(logprobs: mx.array, top_k: int) -> mx.array:
    """Keep exactly the ``top_k`` most likely tokens of each row.

    Args:
        logprobs: (B, V) log-probabilities.
        top_k: number of tokens kept, >= 1; ``top_k >= V`` keeps everything.

    Returns:
        (B, V) ``logprobs`` with all but the ``top_k`` largest set to -inf.
    """
    vocab_size = logprobs.shape[-1]
    if top_k >= vocab_size:
        return logprobs
    # After the partition, positions >= top_k hold the V - top_k smallest.
    dropped = mx.argpartition(-logprobs, kth=top_k - 1, axis=-1)[..., top_k:]
    return mx.put_along_axis(
        logprobs, dropped, mx.array(-mx.inf, logprobs.dtype), axis=-1
    )


def xtc_exclusion(
    logits: mx.array, xtc_threshold: float, xtc_special_tokens: Sequence[int]
) -> mx.array:
    """The tokens XTC removes from a row when it applies (no randomness).

    Args:
        logits: (B, V) logits or log-probabilities (the threshold applies to
            their softmax).
        xtc_threshold: probability threshold in [0, 0.5].
        xtc_special_tokens: token ids that are never removed.

    Returns:
        (B, V) bool: every token with probability ``>= xtc_threshold`` except
        the least likely of them and the special tokens.
    """
    probs = mx.softmax(logits, axis=-1)
    above = probs >= xtc_threshold  # (B, V)
    least_above = mx.min(mx.where(above, probs, mx.inf), axis=-1, keepdims=True)
    remove = above & (probs > least_above)
    if len(xtc_special_tokens) > 0:
        special = mx.array(list(xtc_special_tokens), dtype=mx.int32)
        protected = mx.zeros((logits.shape[-1],), dtype=mx.int32).at[special].add(1)
        remove = remove & (protected == 0)
    return remove


def apply_xtc(
    logits: mx.array,
    xtc_probability: float,
    xtc_threshold: float,
    xtc_special_tokens: Sequence[int],
    key: Optional[mx.array] = None,
) -> mx.array:
    """Exclude top choices: drop the likely tokens except the least likely of them.

    With probability ``xtc_probability`` (drawn independently per row), every
    token whose probability is ``>= xtc_threshold`` is removed except the least
    likely such token, so the output stays coherent while the most obvious
    continuations are avoided. Nothing is removed when fewer than two tokens
    reach the threshold, and ``xtc_special_tokens`` (e.g. EOS, newline) are
    never removed (see :func:`xtc_exclusion`).

    Args:
        logits: (B, V) logits or log-probabilities; the threshold applies to
            their softmax, i.e. to the distribution left by earlier filters.
        xtc_probability: chance in [0, 1] that the filter applies to a row.
        xtc_threshold: probability threshold in [0, 0.5].
        xtc_special_tokens: token ids that are never removed.
        key: PRNG key of the per-row draws; default the global ``mx.random`` state.

    Returns:
        (B, V) ``logits`` with the excluded tokens set to -inf.
    """
    remove = xtc_exclusion(logits, xtc_threshold, xtc_special_tokens)
    applies = mx.random.uniform(shape=(logits.shape[0], 1), key=key) < xtc_probability
    return mx.where(applies & remove, -mx.inf, logits)


def categorical_sampling(logits: mx.array, temp: float, key: Optional[mx.array] = None) -> mx.array:
    """Sample one token per row from ``softmax(logits / temp)``.

    Args:
        logits: (B, V) logits or log-probabilities; -inf entries are never drawn.
        temp: temperature > 0.
        key: PRNG key; default the global ``mx.random`` state.

    Returns:
        (B,) uint32 token ids.
    """
    return mx.random.categorical(logits * (1 / temp), key=key)


def _kth_largest(values: mx.array, k: int) -> mx.array:
    """(B, V) -> (B, 1): the k-th largest value of each row (k >= 1)."""
    partitioned = mx.partition(-values, kth=k - 1, axis=-1)
    return -partitioned[..., k - 1 : k]


# ---------------------------------------------------------------------------
# Sampler
# ---------------------------------------------------------------------------


def _is_int(value) -> bool:
    # bool is an Integral too, but True as a count or token id is a bug.
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def _check_range(name: str, value: float, low: float, high: float) -> None:
    if not low <= value <= high:
        raise ValueError(f"{name} must be in [{low}, {high}], got {value}")


def _validate_sampler_args(
    temp,
    top_p,
    min_p,
    min_tokens_to_keep,
    top_k,
    xtc_probability,
    xtc_threshold,
    xtc_special_tokens,
) -> None:
    if temp < 0:
        raise ValueError(f"temp must be >= 0 (0 means greedy), got {temp}")
    _check_range("top_p", top_p, 0.0, 1.0)
    _check_range("min_p", min_p, 0.0, 1.0)
    _check_range("xtc_probability", xtc_probability, 0.0, 1.0)
    _check_range("xtc_threshold", xtc_threshold, 0.0, 0.5)
    if not _is_int(top_k) or top_k < 0:
        raise ValueError(f"top_k must be an int >= 0 (0 disables it), got {top_k!r}")
    if not _is_int(min_tokens_to_keep) or min_tokens_to_keep < 1:
        raise ValueError(
            f"min_tokens_to_keep must be an int >= 1, got {min_tokens_to_keep!r}"
        )
    bad_ids = [t for t in xtc_special_tokens if not _is_int(t) or t < 0]
    if bad_ids:
        raise ValueError(f"xtc_special_tokens must be token ids >= 0, got {bad_ids}")


def greedy_sampler(logprobs: mx.array) -> mx.array:
    """(B, V) -> (B,) uint32: the most likely token of each row (upstream's name; what
    make_sampler(temp=0) returns)."""
    return mx.argmax(logprobs, axis=-1).astype(mx.uint32)


class CategoricalSampler:
    """The sampler :func:`make_sampler` builds for ``temp > 0``.

    Called like any sampler, ``(B, V) log-probabilities -> (B,) token ids``.
    :meth:`distribution` gives the law those tokens are drawn from, which is
    what speculative sampling needs (``speculative_generate_step`` accepts a
    draft token with probability ``min(1, p / q)`` for the target's and the
    draft's laws ``p`` and ``q``; with any other sampler it falls back to
    matching tokens, which is exact too).

    Filters run in this order: top-p, min-p, XTC, top-k, then categorical
    sampling of ``logprobs / temp``. XTC removes its top choices at random, so
    its law is the mixture of the unfiltered and the filtered law, weighted by
    ``xtc_probability``: exact, with no fallback.
    """

    def __init__(
        self,
        temp: float,
        leading: Sequence[Callable[[mx.array], mx.array]],
        xtc: Optional[tuple],
        trailing: Sequence[Callable[[mx.array], mx.array]],
    ):
        # leading: the filters before XTC; xtc: (probability, threshold,
        # special ids) or None; trailing: the filters after XTC.
        self.temp, self.leading, self.xtc, self.trailing = temp, tuple(leading), xtc, tuple(trailing)

    def __call__(self, logprobs: mx.array, key: Optional[mx.array] = None) -> mx.array:
        """(B, V) -> (B,) uint32 token ids, one draw per row; with `key` (a PRNG key)
        the draws are a function of it alone, else of the global ``mx.random`` state."""
        xtc_key, draw_key = mx.random.split(key) if key is not None else (None, None)
        for apply_filter in self.leading:
            logprobs = apply_filter(logprobs)
        if self.xtc is not None:
            logprobs = apply_xtc(logprobs, *self.xtc, key=xtc_key)
        for apply_filter in self.trailing:
            logprobs = apply_filter(logprobs)
        return categorical_sampling(logprobs, self.temp, key=draw_key)

    def distribution(self, logprobs: mx.array) -> mx.array:
        """(B, V) log-probabilities -> (B, V) normalised float32 log-probabilities
        of the law ``self(logprobs)`` draws from (-inf where it never draws)."""
        # The filters run in the input's dtype, as in __call__, so both keep the
        # same tokens; the law itself is computed in float32.
        for apply_filter in self.leading:
            logprobs = apply_filter(logprobs)
        # (weight, logits) per branch: XTC applies to a row with its probability.
        branches = [(1.0, logprobs)]
        if self.xtc is not None:
            probability, threshold, special = self.xtc
            excluded = mx.where(xtc_exclusion(logprobs, threshold, special), -mx.inf, logprobs)
            branches = [(1 - probability, logprobs), (probability, excluded)]
        law = None
        for weight, branch in branches:
            if weight == 0:
                continue
            for apply_filter in self.trailing:
                branch = apply_filter(branch)
            branch = branch.astype(mx.float32) * (1 / self.temp)  # as categorical_sampling scales
            branch = branch - mx.logsumexp(branch, axis=-1, keepdims=True) + math.log(weight)
            law = branch if law is None else mx.logaddexp(law, branch)
        return law


def make_sampler(
    temp: float = 0.0,
    top_p: float = 0.0,
    min_p: float = 0.0,
    min_tokens_to_keep: int = 1,
    top_k: int = 0,
    xtc_probability: float = 0.0,
    xtc_threshold: float = 0.1,
    xtc_special_tokens: List[int] = [],
) -> Sampler:
    """Build a sampler ``(B, V) log-probabilities -> (B,) token ids``.

    ``temp == 0`` is greedy (argmax; the filters are irrelevant). Otherwise the
    enabled filters run in this order: top-p (``0 < top_p < 1``), min-p
    (``min_p != 0``), XTC (``xtc_probability > 0``), top-k (``top_k > 0``),
    followed by categorical sampling of ``logprobs / temp``; the result is a
    :class:`CategoricalSampler`, whose ``distribution`` gives that law.
    Randomness comes from the global ``mx.random`` state, so
    ``mx.random.seed`` makes it reproducible, or from a PRNG key passed with
    the call (``sampler(logprobs, key=key)``).

    Raises:
        ValueError: an argument is out of range (the message names it).
    """
    _validate_sampler_args(
        temp,
        top_p,
        min_p,
        min_tokens_to_keep,
        top_k,
        xtc_probability,
        xtc_threshold,
        xtc_special_tokens,
    )
    if temp == 0:
        return greedy_sampler

    leading, trailing, xtc = [], [], None
    if 0 < top_p < 1:
        leading.append(partial(apply_top_p, top_p=top_p))
    if min_p != 0:
        leading.append(
            partial(apply_min_p, min_p=min_p, min_tokens_to_keep=min_tokens_to_keep)
        )
    if xtc_probability > 0:
        # Copy: the default list is shared between calls, and callers may
        # mutate theirs after building the sampler.
        xtc = (xtc_probability, xtc_threshold, tuple(xtc_special_tokens))
    if top_k > 0:
        trailing.append(partial(apply_top_k, top_k=top_k))
    return CategoricalSampler(temp, leading, xtc, trailing)


# ---------------------------------------------------------------------------
# Logits processors
# ---------------------------------------------------------------------------


def _recent_token_counts(
    tokens: mx.array, context_size: int, vocab_size: int, dtype: mx.Dtype
) -> mx.array:
    """Occurrences of each id among the last ``context_size`` tokens.

    Args:
        tokens: (T,) previous token ids, possibly T == 0.

    Returns:
        (V,) counts in ``dtype``.
    """
    recent = tokens[-context_size:].astype(mx.int32)
    counts = mx.zeros((vocab_size,), dtype=dtype)
    # `.at[].add` accumulates repeated ids, unlike a plain scatter assignment.
    return counts.at[recent].add(mx.ones(recent.shape, dtype=dtype))


def apply_logit_bias(
    tokens: mx.array, logits: mx.array, token_ids: mx.array, bias: mx.array
) -> mx.array:
    """Add ``bias`` (N,) to the columns ``token_ids`` (N,) of ``logits`` (B, V)."""
    return logits.at[:, token_ids].add(bias.astype(logits.dtype))


def apply_repetition_penalty(
    tokens: mx.array, logits: mx.array, penalty: float, context_size: int
) -> mx.array:
    """Penalise tokens seen in the last ``context_size`` of ``tokens`` (T,).

    Positive logits are divided by ``penalty`` and negative ones multiplied by
    it (Keskar et al., 2019, arXiv:1909.05858), so ``penalty > 1`` always makes
    a seen token less likely. Returns the new (B, V) logits.
    """
    if tokens.size == 0:
        return logits
    seen = _recent_token_counts(tokens, context_size, logits.shape[-1], mx.int32) > 0
    penalised = mx.where(logits < 0, logits * penalty, logits / penalty)
    return mx.where(seen, penalised, logits)


def apply_presence_penalty(
    tokens: mx.array, logits: mx.array, penalty: float, context_size: int
) -> mx.array:
    """Subtract ``penalty`` once from every token present in the recent context.

    ``tokens``: (T,) previous ids; ``logits``: (B, V). Returns (B, V).
    """
    if tokens.size == 0:
        return logits
    counts = _recent_token_counts(tokens, context_size, logits.shape[-1], mx.int32)
    return logits - penalty * (counts > 0).astype(logits.dtype)


def apply_frequency_penalty(
    tokens: mx.array, logits: mx.array, penalty: float, context_size: int
) -> mx.array:
    """Subtract ``penalty`` times each token's count in the recent context.

    ``tokens``: (T,) previous ids; ``logits``: (B, V). Returns (B, V).
    """
    if tokens.size == 0:
        return logits
    counts = _recent_token_counts(tokens, context_size, logits.shape[-1], logits.dtype)
    return logits - penalty * counts


def _check_context_size(name: str, value: int) -> None:
    if not _is_int(value) or value < 1:
        raise ValueError(f"{name} must be a positive int, got {value!r}")


def _logit_bias_processor(logit_bias: Dict[int, float]) -> LogitsProcessor:
    for token_id in logit_bias:
        if not _is_int(token_id) or token_id < 0:
            raise ValueError(
                f"logit_bias keys must be token ids (ints >= 0), got {token_id!r}"
            )
    token_ids = mx.array(list(logit_bias.keys()), dtype=mx.int32)
    bias = mx.array(list(logit_bias.values()), dtype=mx.float32)
    return partial(apply_logit_bias, token_ids=token_ids, bias=bias)


def _check_penalty(name: str, value: float) -> None:
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not math.isfinite(value):
        raise ValueError(f"{name} must be a finite number, got {value!r}")


def make_repetition_penalty(penalty: float, context_size: int = 20) -> LogitsProcessor:
    """``fn(tokens, logits)`` applying :func:`apply_repetition_penalty` over the last
    ``context_size`` tokens; ``penalty`` >= 0 (1 is neutral, > 1 discourages)."""
    _check_penalty("repetition_penalty", penalty)
    if penalty < 0:
        raise ValueError(f"repetition_penalty must be >= 0 (1 is neutral), got {penalty}")
    _check_context_size("repetition_context_size", context_size)
    return partial(apply_repetition_penalty, penalty=penalty, context_size=context_size)


def make_presence_penalty(penalty: float, context_size: int = 20) -> LogitsProcessor:
    """``fn(tokens, logits)`` subtracting ``penalty`` once from every token present in
    the last ``context_size`` tokens (negative values encourage them)."""
    _check_penalty("presence_penalty", penalty)
    _check_context_size("presence_context_size", context_size)
    return partial(apply_presence_penalty, penalty=penalty, context_size=context_size)


def make_frequency_penalty(penalty: float, context_size: int = 20) -> LogitsProcessor:
    """``fn(tokens, logits)`` subtracting ``penalty`` per occurrence of each token in
    the last ``context_size`` tokens (negative values encourage them)."""
    _check_penalty("frequency_penalty", penalty)
    _check_context_size("frequency_context_size", context_size)
    return partial(apply_frequency_penalty, penalty=penalty, context_size=context_size)


def make_logits_processors(
    logit_bias: Optional[Dict[int, float]] = None,
    repetition_penalty: Optional[float] = None,
    repetition_context_size: Optional[int] = 20,
    presence_penalty: Optional[float] = None,
    presence_context_size: Optional[int] = 20,
    frequency_penalty: Optional[float] = None,
    frequency_context_size: Optional[int] = 20,
) -> List[LogitsProcessor]:
    """Build the processors ``fn(tokens (T,), logits (B, V)) -> logits (B, V)``.

    Order: logit bias, repetition, presence, frequency penalty. A penalty that
    is ``None`` or 0 is skipped; an empty ``logit_bias`` adds nothing.

    Raises:
        ValueError: ``repetition_penalty < 0``, a context size that is not a
            positive int, or a ``logit_bias`` key that is not a token id.
    """
    # Context sizes are checked even for a skipped penalty: a bad value is a bug anyway.
    _check_context_size("repetition_context_size", repetition_context_size)
    _check_context_size("presence_context_size", presence_context_size)
    _check_context_size("frequency_context_size", frequency_context_size)

    processors: List[LogitsProcessor] = []
    if logit_bias:
        processors.append(_logit_bias_processor(logit_bias))
    if repetition_penalty:
        processors.append(make_repetition_penalty(repetition_penalty, repetition_context_size))
    if presence_penalty:
        processors.append(make_presence_penalty(presence_penalty, presence_context_size))
    if frequency_penalty:
        processors.append(make_frequency_penalty(frequency_penalty, frequency_context_size))
    return processors
