"""Drafters that run inside a batch (batching.BatchGenerator), one protocol for all:
prompt lookup on the host, and on the device a draft model or the target's own
multi-token-prediction head. A device drafter keeps its cache entries after the
target's in every row's cache list, drafts every row in K single-token steps (greedy
rows the argmax, a point mass; unseeded sampling rows a draw from their own law q, so
that speculative sampling accepts what q and the target's law share), and after the
verify keeps, per row, what the target kept.

Both sit out plain steps: what they missed is fed in one forward when they next draft,
before rows join or leave, and after MAX_LAG of them (`catch_up`), so that every row's
entries then hold what a solo run's would."""

from typing import Any, Callable, List, Optional, Tuple

import mlx.core as mx
import mlx.nn as nn

from .drafters import PromptLookup, check_mtp_head
from .feeding import ids_within
from .models.batch_cache import bookkeeping, make_room, trim_rows
from .models.cache import make_prompt_cache
from .sample_utils import CategoricalSampler

# Plain steps a drafter sits out before it is fed them anyway (in one forward), even
# while no row drafts (rows with logits processors never do): its caches stay those of
# the rows' tokens (a returned cache is whole), its lag's memory and the (B, L) forward
# that catches it up stay bounded.
MAX_LAG = 16

# What a round's drafting returns: the (B, K + 1) columns to verify (each row's token,
# its drafts, then its token again as padding), how to read the drafts, once run, and
# the (B, K, V) log-laws they were drawn from (None: point masses, every row greedy).
Drafts = Tuple[mx.array, Callable[[], List[List[int]]], Optional[mx.array]]

# Per row, the sampler whose law it drafts from (speculative sampling against its real
# q), or None: it drafts the argmax, a point mass (greedy rows, seeded rows, whose
# tokens must not depend on their drafts, and rows without a law to sample).
DraftSamplers = Optional[List[Optional[CategoricalSampler]]]


def _columns(fed: List[int], steps: List[mx.array], rooms: List[int], laws: List[Optional[mx.array]]) -> Drafts:
    """Columns built on the device (so the verify queues behind the drafts without a
    sync) from each draft step's (B,) tokens and (B, V) log-laws (draw_drafts); row i
    keeps its first rooms[i]."""
    drafted = mx.stack(steps, axis=1)  # (B, K)
    first = mx.array(fed, dtype=mx.uint32)[:, None]
    kept = mx.arange(drafted.shape[1])[None] < mx.array(rooms)[:, None]
    columns = mx.concatenate([first, mx.where(kept, drafted, first)], axis=1)
    stacked = None if laws[0] is None else mx.stack(laws, axis=1)
    return columns, lambda: [d[:room] for d, room in zip(drafted.tolist(), rooms)], stacked


def draw_drafts(logits: mx.array, samplers: DraftSamplers) -> Tuple[mx.array, Optional[mx.array]]:
    """(B, V) draft logits -> (B,) drafts and their (B, V) log-laws: the argmax for rows
    without a sampler (their law row is unused), a draw from the sampler's law for the
    others; laws None when no row samples."""
    greedy = mx.argmax(logits, axis=-1).astype(mx.uint32)
    if samplers is None or all(s is None for s in samplers):
        return greedy, None
    logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
    laws = [logprobs[i : i + 1] if s is None else s.distribution(logprobs[i : i + 1]) for i, s in enumerate(samplers)]
    tokens = [greedy[i : i + 1] if s is None else mx.random.categorical(law).astype(mx.uint32)
              for i, (s, law) in enumerate(zip(samplers, laws))]
    return mx.concatenate(tokens), mx.concatenate(laws)


def _host_columns(fed: List[int], drafts: List[List[int]]) -> Drafts:
    """Columns of drafts found on the host: each row's token, its drafts, then its token
    again as padding."""
    width = max(map(len, drafts))
    columns = mx.array([[t] + d + [t] * (width - len(d)) for t, d in zip(fed, drafts)], dtype=mx.uint32)
    return columns, lambda: drafts, None


class BatchPromptLookup:
    """Prompt lookup (drafters.PromptLookup), one index per row over its own tokens: the
    given ones, its prompt, then each token it is to be fed. No cache entries, nothing
    to roll back: drafts are never indexed, only tokens the target chose."""

    needs_hidden = False

    def __init__(self, max_ngram_size: int):
        self.max_ngram_size = max_ngram_size
        self.lookups: List[PromptLookup] = []  # row order
        self.lag: List[mx.array] = []  # (B,) tokens sampled by plain steps, not yet indexed

    def make_cache(self) -> List[Any]:
        return []

    def prefill(self, cache: List[Any], tokens: mx.array, hidden: Optional[mx.array], pending: Any) -> Any:
        return None

    def first_alone(self, cache: List[Any], prompt: mx.array, hidden: Optional[mx.array], first: mx.array,
                    pending: Any) -> Any:
        return None

    def join(self, rows: List[Any], tokens: mx.array) -> None:
        """Each joining row's index: its tokens so far and the one it is to be fed if
        sampled (else that is its prompt's last, already among them)."""
        for row in rows:
            lookup = PromptLookup(self.max_ngram_size, context=row.tokens)
            if row.first:
                lookup.extend([row.first[0].item()])
            self.lookups.append(lookup)

    def filter(self, keep: List[int]) -> None:
        self.lookups = [self.lookups[i] for i in keep]

    def plain_step(self, fed: mx.array, sampled: mx.array, hidden: Optional[mx.array]) -> None:
        self.lag.append(sampled)  # indexed when it next drafts, or once MAX_LAG wait

    def catch_up(self, cache: List[Any]) -> None:
        for sampled in self.lag:
            for lookup, token in zip(self.lookups, sampled.tolist()):
                lookup.extend([token])
        self.lag = []

    def draft(self, cache: List[Any], fed: List[int], rooms: List[int],
              samplers: DraftSamplers = None) -> Optional[Drafts]:
        """Each row's continuation of its latest n-gram (at most its room), point
        masses; None if no row found one (the step is then plain)."""
        self.catch_up(cache)
        drafts = [lookup.lookup(room) if room > 0 else [] for lookup, room in zip(self.lookups, rooms)]
        return _host_columns(fed, drafts) if any(drafts) else None

    def settle(self, cache: List[Any], columns: mx.array, num_accepted: List[int], kept: List[int],
               sampled: mx.array, hidden: Optional[mx.array]) -> None:
        """Each row indexes its accepted drafts and the token after them."""
        drafts = columns[:, 1:].tolist()
        for lookup, row_drafts, n, token in zip(self.lookups, drafts, num_accepted, sampled.tolist()):
            lookup.extend(row_drafts[:n] + [token])

    def cancel(self, cache: List[Any]) -> None:
        pass  # nothing was indexed

    def rollback_window(self, num_draft_tokens: int) -> int:
        return 1

    def close(self) -> None:
        self.lookups, self.lag = [], []


class BatchDraftModel:
    """A draft model's caches batched beside the target's: it drafts every row in K
    steps, the first feeding its lag (below) and the row's token in one forward, each
    other one token. After the verify every row holds what it kept but its last token,
    which joins the lag: a row that kept all K drafts was never fed the K-th, and
    rolling the others back one more keeps the batch aligned, so that the next round's
    first step feeds every row [that token, the new one] instead of a forward of its
    own for the rows that kept all (which was one draft forward in four at K = 3)."""

    needs_hidden = False  # of the target

    def __init__(self, draft_model: nn.Module, target_vocab_size: int):
        self.model, self.target_vocab_size = draft_model, target_vocab_size
        self.lag: List[mx.array] = []  # (B,) tokens the draft has not seen yet (plain steps', a round's last)
        self.drafted: Optional[mx.array] = None  # (B, K) the last round's drafts

    def make_cache(self) -> List[Any]:
        return make_prompt_cache(self.model)

    def _ids(self, tokens: mx.array) -> mx.array:
        """Ids beyond the draft's table fed as 0 (as speculative decoding feeds them)."""
        return ids_within(tokens, self.model.args.vocab_size)

    # A row before it joins: its own caches, its pending state (None here).

    def prefill(self, cache: List[Any], tokens: mx.array, hidden: Optional[mx.array], pending: Any) -> Any:
        """Feed all of `tokens` (a prefill chunk and the token after it) but the last."""
        self.model(self._ids(tokens)[None, :-1], cache=cache)
        return None

    def first_alone(self, cache: List[Any], prompt: mx.array, hidden: Optional[mx.array], first: mx.array,
                    pending: Any) -> Any:
        """The row's one prompt token (after it, the target samples its first token alone)."""
        self.model(self._ids(prompt)[None], cache=cache)
        return None

    # The batch.

    def join(self, rows: List[Any], tokens: mx.array) -> None:
        pass  # caught up before rows join: nothing per row

    def filter(self, keep: List[int]) -> None:
        pass

    def plain_step(self, fed: mx.array, sampled: mx.array, hidden: Optional[mx.array]) -> None:
        self.lag.append(fed)  # fed when it next drafts (catch_up), or once MAX_LAG wait

    def catch_up(self, cache: List[Any]) -> None:
        """Feed the tokens plain steps gave the target alone, in one forward (every
        row lags by as many)."""
        if not self.lag:
            return
        tokens, self.lag = mx.stack(self.lag, axis=1), []
        make_room(cache, tokens.shape[1])
        self.model(self._ids(tokens), cache=cache)
        mx.async_eval([c.state for c in cache], bookkeeping(cache))

    def draft(self, cache: List[Any], fed: List[int], rooms: List[int], samplers: DraftSamplers = None) -> Drafts:
        """K = the largest room steps for all rows at once; the first feeds the lag too."""
        num_steps = max(rooms)
        tokens, self.lag = mx.stack(self.lag + [mx.array(fed, dtype=mx.uint32)], axis=1), []  # (B, lag + 1)
        # Room for the whole round now: a window may only drop columns before it begins
        # (the rollback goes back to its start).
        make_room(cache, tokens.shape[1] + num_steps)
        steps, laws = [], []
        for _ in range(num_steps):
            logits = self.model(self._ids(tokens), cache=cache)[:, -1, : self.target_vocab_size]
            token, law = draw_drafts(logits, samplers)
            mx.async_eval(token)  # computes while the next step's graph is built
            steps.append(token)
            laws.append(law)
            tokens = token[:, None]
        self.drafted = mx.stack(steps, axis=1)  # (B, K): the draft fed all but the last
        return _columns(fed, steps, rooms, laws)

    def settle(self, cache: List[Any], columns: mx.array, num_accepted: List[int], kept: List[int],
               sampled: mx.array, hidden: Optional[mx.array]) -> None:
        """Row i kept kept[i] >= 1 of the round's K + 1 columns (its token and drafts),
        of which the draft was fed the first K: it keeps all but the last, which it is
        fed with the next round's token (or at the next catch_up)."""
        num_fed = self.drafted.shape[1]
        trim_rows(cache, [num_fed + 1 - k for k in kept])
        last = mx.array(kept, dtype=mx.int32)[:, None] - 1
        self.lag = [mx.take_along_axis(columns, last, axis=1)[:, 0]]

    def cancel(self, cache: List[Any]) -> None:
        """Undo a drafting round that will not be verified (its lag stays fed)."""
        trim_rows(cache, [self.drafted.shape[1]] * self.drafted.shape[0])

    def rollback_window(self, num_draft_tokens: int) -> int:
        return num_draft_tokens + 1  # K steps, and up to K tokens rolled back

    def close(self) -> None:
        self.lag, self.drafted = [], None


class BatchMTPHead:
    """The target's multi-token-prediction head (drafters.MTPHead, one sequence) for a
    batch. Pair p of a row is (token p + 1, the target's final hidden state at p); the
    head's KV cache holds the pairs of every row's committed tokens but the last pair,
    which is kept back (`pending`, one per row) because drafting starts from the head's
    output on it. So a row's head holds one entry fewer than its target, as after a
    solo run.

    Pairs become known as the target computes: a plain step gives each row one, a
    verify up to K + 1 (the accepted drafts and the token after them). They wait in
    `lag` as chunks (tokens (B, L), hidden (B, L, H), how many of the L each row
    keeps, or None for all) and are fed when the head next drafts or rows join or leave.
    A round feeds the pending pairs, then drafts K - 1 more single-token steps on the
    head's own output, whose entries settle() gives back. (The pending pairs are fed
    on their own, after the lag, so that a cancelled round can give them back: a
    batched KV row forgets only its last columns, and the lag's padding leaves holes.)"""

    needs_hidden = True

    def __init__(self, model: nn.Module):
        check_mtp_head(model)
        self.model = model
        self.lag: List[Tuple[mx.array, mx.array, Optional[List[int]]]] = []
        self.pending: Optional[Tuple[mx.array, mx.array]] = None  # (B, 1), (B, 1, H): fed by draft()
        self.num_drafting = 0  # entries the last round's drafting added beyond the pending pairs

    def make_cache(self) -> List[Any]:
        return self.model.make_mtp_cache()

    def _feed(self, cache: List[Any], tokens: mx.array, hidden: mx.array) -> Tuple[mx.array, mx.array]:
        make_room(cache, tokens.shape[1])
        return self.model.mtp_forward(tokens, hidden, cache)

    # A row before it joins: its own caches and its kept-back pair.

    def prefill(self, cache: List[Any], tokens: mx.array, hidden: mx.array, pending: Any) -> Any:
        """The target just took all of `tokens` but the last (hidden (1, n, H)): pairs
        (tokens[j + 1], hidden[j]) are known. Feed all but the last of them (and the
        one kept back before) to the row's head; returns the new kept-back pair."""
        pair_tokens, pair_hidden = tokens[None, 1:], hidden
        if pending is not None:
            pair_tokens = mx.concatenate([pending[0], pair_tokens], axis=1)
            pair_hidden = mx.concatenate([pending[1], pair_hidden], axis=1)
        if pair_tokens.shape[1] > 1:
            self.model.mtp_forward(pair_tokens[:, :-1], pair_hidden[:, :-1], cache)
        return pair_tokens[:, -1:], pair_hidden[:, -1:]

    def first_alone(self, cache: List[Any], prompt: mx.array, hidden: mx.array, first: mx.array,
                    pending: Any) -> Any:
        """The target took the row's last prompt token alone (hidden (1, 1, H)) and
        sampled `first` (1,) after it."""
        return self.prefill(cache, mx.concatenate([prompt, first.astype(prompt.dtype)]), hidden, pending)

    # The batch.

    def join(self, joining: List[Any], tokens: mx.array) -> None:
        """Rows joined the batch (after it caught up), each with its kept-back pair
        (`draft_pending`). A
        row whose prompt was one token after a given cache has none: the target's
        hidden state at the cache's last token is gone, so that pair gets a zero state
        (it only makes the row's drafts worse); `tokens` (n,): their tokens to feed."""
        norm = self.model.mtp_head.pre_fc_norm_hidden.weight  # (H,)
        blank = mx.zeros((1, 1, norm.shape[0]), norm.dtype)
        pendings = [r.draft_pending for r in joining]
        rows = [p if p is not None else (tokens[i : i + 1, None], blank) for i, p in enumerate(pendings)]
        rows = ([self.pending] if self.pending is not None else []) + rows
        self.pending = (mx.concatenate([t for t, _ in rows]), mx.concatenate([h for _, h in rows]))

    def filter(self, keep: List[int]) -> None:
        """Only rows `keep` stay (after a catch_up)."""
        if not keep:
            self.pending = None
            return
        at = mx.array(keep, dtype=mx.int32)
        self.pending = (mx.take(self.pending[0], at, axis=0), mx.take(self.pending[1], at, axis=0))

    def plain_step(self, fed: mx.array, sampled: mx.array, hidden: mx.array) -> None:
        self.lag.append((sampled[:, None], hidden, None))

    def catch_up(self, cache: List[Any]) -> None:
        """Feed the pending pairs and every pair in the lag but each row's last, which
        becomes the pending pair."""
        if not self.lag:
            return
        waiting = [(*self.pending, None)] if self.pending is not None else []  # None: fed by the last round
        chunks, self.lag = self._merged(waiting + self.lag), []
        tokens, hidden, keep = chunks[-1]
        if keep is None:
            self.pending = tokens[:, -1:], hidden[:, -1:]
        else:  # row i's last pair is its keep[i] - 1-th
            at = (mx.array(keep, dtype=mx.int32) - 1)[:, None]
            self.pending = (mx.take_along_axis(tokens, at, axis=1),
                            mx.take_along_axis(hidden, at[:, :, None], axis=1))
        for i, (tokens, hidden, keep) in enumerate(chunks):
            width, last = tokens.shape[1], i == len(chunks) - 1
            self._feed(cache, tokens, hidden)
            keeps = [width] * tokens.shape[0] if keep is None else keep
            trim_rows(cache, [width - k + last for k in keeps])
        mx.async_eval([c.state for c in cache], bookkeeping(cache))

    @staticmethod
    def _merged(chunks):
        """Runs of chunks every row keeps whole joined into one (one forward each)."""
        merged = []
        for tokens, hidden, keep in chunks:
            if merged and keep is None and merged[-1][2] is None:
                tokens = mx.concatenate([merged[-1][0], tokens], axis=1)
                hidden = mx.concatenate([merged[-1][1], hidden], axis=1)
                merged.pop()
            merged.append((tokens, hidden, keep))
        return merged

    def draft(self, cache: List[Any], fed: List[int], rooms: List[int], samplers: DraftSamplers = None) -> Drafts:
        """The pending pair of each row (fed: it predicts the token after `fed`), then
        the head on its own output and its last draft, K = the largest room."""
        self.catch_up(cache)
        out, logits = self._feed(cache, *self.pending)  # the target's own table
        token, law = draw_drafts(logits[:, -1], samplers)
        mx.async_eval(token)  # computes while the next step's graph is built
        steps, laws = [token], [law]
        for _ in range(max(rooms) - 1):
            out, logits = self._feed(cache, steps[-1][:, None], out)
            token, law = draw_drafts(logits[:, -1], samplers)
            mx.async_eval(token)
            steps.append(token)
            laws.append(law)
        self.num_drafting = len(steps) - 1
        return _columns(fed, steps, rooms, laws)

    def settle(self, cache: List[Any], columns: mx.array, num_accepted: List[int], kept: List[int],
               sampled: mx.array, hidden: mx.array) -> None:
        """The drafting entries given back; the round's pairs wait in the lag: row i's
        are its first kept[i] of (its accepted drafts, then `sampled` (B,), the token
        after them) with the verify's hidden states (B, K + 1, H). The pending pairs
        stay fed."""
        trim_rows(cache, [self.num_drafting] * hidden.shape[0])
        shifted = mx.concatenate([columns[:, 1:], columns[:, :1]], axis=1)
        after_accepted = mx.arange(columns.shape[1])[None] == mx.array(num_accepted)[:, None]
        tokens = mx.where(after_accepted, sampled.astype(shifted.dtype)[:, None], shifted)
        self.lag, self.pending = [(tokens, hidden, list(kept))], None

    def cancel(self, cache: List[Any]) -> None:
        """Undo a drafting round that will not be verified: the pending pairs are fed
        again by the next round."""
        trim_rows(cache, [self.num_drafting + 1] * self.pending[0].shape[0])

    def rollback_window(self, num_draft_tokens: int) -> int:
        return 0  # attention entries only

    def close(self) -> None:
        self.lag, self.pending = [], None
