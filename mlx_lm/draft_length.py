"""The draft length of speculative decoding: how many tokens a round drafts, chosen per
round from the measured acceptance and the measured round costs (`DraftLengthPolicy`
for one sequence, `BatchDraftLengthPolicy` for a batch). `num_draft_tokens` is only
the cap, and k = 0 (a plain target step) is allowed when drafting would lose.

Model (Leviathan et al. 2023, arXiv:2211.17192, §3.1): each draft is accepted with
the same probability a, independently, until the first rejection. A round that
drafts k tokens then emits E(a, k) = 1 + a + ... + a^k tokens (the accepted prefix
plus the target's own token) for the price of k draft steps and one (k+1)-token
verify. The policy picks the k in 0..cap with the most expected tokens per second.

What the rounds of a (target, drafter) pair showed outlives the call: DRAFT_LENGTHS
keeps it for the process, so the next call with the pair (a second generate, a chat
turn, a server request) starts from it instead of from plain rounds and a slow start.
"""

import copy
import math
import weakref
from typing import Callable, Dict, Hashable, List, Optional, Sequence, Set, Tuple, TypeVar


def expected_tokens(a: float, k: int) -> float:
    """Expected tokens one round emits when it drafts k tokens, each accepted with
    probability a until the first rejection: (1 - a^(k+1)) / (1 - a), or k + 1 at a = 1.
    k = 0 is a plain step: one token."""
    if a >= 1.0:
        return k + 1.0
    return (1.0 - a ** (k + 1)) / (1.0 - a)


def acceptance_evidence(num_draft: int, num_accepted: int) -> Tuple[int, int]:
    """(successes, failures) that one round adds to the acceptance estimate.

    The accepted prefix is a geometric count truncated at num_draft: the round saw
    num_accepted acceptances, then one rejection unless every draft was accepted. The
    likelihood is a^successes (1 - a)^failures, so successes / (successes + failures)
    over many rounds is the maximum-likelihood a. (Accepted / drafted is biased low:
    it counts the drafts after the first rejection, which were never compared.)"""
    return num_accepted, int(num_accepted < num_draft)


def interpolated_costs(measured: List[Optional[float]], cost_per_draft: float) -> List[float]:
    """Relative round cost for every k from the ks measured so far (None: not yet).

    Between two measured ks: linear in k. Beyond the measured ones: the nearest
    measured cost scaled along the prior line 1 + cost_per_draft * k. Nothing measured:
    the prior line itself. The result is what the policy divides expected tokens by."""
    known = [k for k, cost in enumerate(measured) if cost is not None]
    if not known:
        return [1.0 + cost_per_draft * k for k in range(len(measured))]
    costs = []
    for k in range(len(measured)):
        below = max((m for m in known if m <= k), default=None)
        above = min((m for m in known if m >= k), default=None)
        if below is not None and above is not None:
            if below == above:
                costs.append(measured[k])
                continue
            weight = (k - below) / (above - below)
            costs.append((1 - weight) * measured[below] + weight * measured[above])
            continue
        nearest = below if below is not None else above
        costs.append(measured[nearest] * (1 + cost_per_draft * k) / (1 + cost_per_draft * nearest))
    return costs


def best_draft_length(tokens: Sequence[float], costs: List[float]) -> int:
    """The k maximizing tokens[k] / costs[k] (expected tokens per second of a round
    drafting k); the smaller k on a tie."""
    rates = [t / cost for t, cost in zip(tokens, costs)]
    return max(range(len(rates)), key=lambda k: (rates[k], -k))


class AcceptanceEstimate:
    """Per-draft acceptance probability from exponentially weighted (successes,
    failures) of drafting rounds (acceptance_evidence), each round weighing
    1 - 1/memory of the one after it; the counts start at the prior, which is
    forgotten like old evidence. `num_seen` counts the same evidence unweighted."""

    def __init__(self, prior_accepted: float = 1.0, prior_rejected: float = 1.0, memory: float = 8.0):
        self.successes, self.failures = prior_accepted, prior_rejected
        self.num_seen = prior_accepted + prior_rejected
        self.decay = 1.0 - 1.0 / memory

    def update(self, num_draft: int, num_accepted: int) -> None:
        successes, failures = acceptance_evidence(num_draft, num_accepted)
        self.successes = self.decay * self.successes + successes
        self.failures = self.decay * self.failures + failures
        self.num_seen += successes + failures

    @property
    def value(self) -> float:
        return self.successes / (self.successes + self.failures)

    def optimistic(self, num_deviations: float) -> float:
        """The estimate plus `num_deviations` standard deviations of a belief about a
        resting on `num_seen` trials (as a Beta's), at most 1: high while few drafts
        were compared, close to `value` once many were. (The weighted counts stay
        few however long the run, by design, so they would keep it optimistic.)"""
        a = self.value
        return min(1.0, a + num_deviations * math.sqrt(a * (1 - a) / (self.num_seen + 1)))


class RoundCosts:
    """Seconds of a round per draft length k (0..max_draft_tokens): an exponentially
    weighted mean of the log seconds of the rounds that drafted k, which follows falls
    quickly (over about `memory_falling` rounds) and rises slowly (about
    `memory_rising` rounds, each rise clipped to a factor of 2). Interference only
    ever adds time, so it tracks what k costs undisturbed. Unmeasured ks are
    interpolated (interpolated_costs)."""

    def __init__(self, max_draft_tokens: int, memory_falling: float = 2.0, memory_rising: float = 8.0,
                 prior_cost_per_draft: float = 0.3):
        self.rate_falling, self.rate_rising = 1.0 / memory_falling, 1.0 / memory_rising
        self.prior_cost_per_draft = prior_cost_per_draft
        self.log_seconds: List[Optional[float]] = [None] * (max_draft_tokens + 1)

    def learn(self, k: int, seconds: float) -> None:
        log_seconds = math.log(seconds)
        self.log_seconds += [None] * (k + 1 - len(self.log_seconds))
        if self.log_seconds[k] is None:
            self.log_seconds[k] = log_seconds
            return
        error = log_seconds - self.log_seconds[k]
        if error < 0:
            self.log_seconds[k] += self.rate_falling * error
        else:
            self.log_seconds[k] += self.rate_rising * min(error, math.log(2))

    @property
    def measured(self) -> bool:
        return any(s is not None for s in self.log_seconds)

    def costs(self, max_draft_tokens: Optional[int] = None) -> List[float]:
        """Seconds of a round drafting k, for every k up to max_draft_tokens (default:
        the largest learned or set up): measured or interpolated (in units of nothing
        in particular before any round was measured)."""
        size = len(self.log_seconds) if max_draft_tokens is None else max_draft_tokens + 1
        logs = (self.log_seconds + [None] * size)[:size]
        return interpolated_costs([None if s is None else math.exp(s) for s in logs], self.prior_cost_per_draft)


class LearnedDraftLength:
    """What the drafting of one (target, drafter, setting) showed so far in this
    process: round costs, acceptance, the draft lengths whose first round (with its
    one-off work: first calls of its shapes) is behind it, and the interval between
    probes. The policies of successive calls share one (DRAFT_LENGTHS) and learn into
    it, so each starts where the last one stopped."""

    def __init__(self, costs: RoundCosts, acceptance: AcceptanceEstimate, probe_interval: int):
        self.costs, self.acceptance, self.probe_interval = costs, acceptance, probe_interval
        self.lengths_seen: Set[int] = set()
        self.num_drafting_rounds = 0

    @property
    def warm(self) -> bool:
        """Enough to choose from: a round cost and a drafting round's acceptance."""
        return self.costs.measured and self.num_drafting_rounds > 0


Learned = TypeVar("Learned")


class DraftLengthMemory:
    """Process-wide memory of what draft-length policies learned, one entry per
    (models, setting): the ids of the target and the draft model (if any) and a
    hashable setting (the drafter kind, the loop, the acceptance rule, the KV
    quantization: whatever costs or acceptance depend on). A new call with the same
    models and setting starts warm; any other starts fresh. It holds no reference to
    a model: an entry is dropped when one of its models is collected
    (weakref.finalize), so a later model that reuses the id starts fresh too."""

    def __init__(self):
        self._entries: Dict[Tuple[Tuple[int, ...], Hashable], object] = {}

    def get(self, models: Sequence[object], setting: Hashable, make: Callable[[], Learned]) -> Learned:
        """The entry of `models` and `setting`, made by `make()` the first time."""
        key = (tuple(id(m) for m in models), setting)
        entry = self._entries.get(key)
        if entry is None:
            entry = self._entries[key] = make()
            for m in models:
                weakref.finalize(m, self._entries.pop, key, None)
        return entry

    def forget(self) -> None:
        """Drop every entry: the next call of every pair starts cold (benchmarks, tests)."""
        self._entries.clear()

    def __len__(self) -> int:
        return len(self._entries)


DRAFT_LENGTHS = DraftLengthMemory()


class DraftLengthPolicy:
    """Chooses how many tokens to draft each round, from what past rounds showed.

    The loop calls `choose()` at the top of a round and `update(num_draft,
    num_accepted, round_seconds)` after its verify has synced: `num_draft` is the k it
    actually drafted (it may clip the choice, e.g. near max_tokens), `round_seconds`
    the wall clock from the top of the round to after that sync (no extra syncs; the
    time spent at the consumer's yields excluded).

    Acceptance: exponentially weighted (successes, failures) of the rounds that
    drafted (acceptance_evidence), each round weighing `1 - 1 / acceptance_memory` of
    the one after it, so a is (successes) / (successes + failures) over about the last
    acceptance_memory drafting rounds. The counts start at (prior_accepted,
    prior_rejected) and that prior is forgotten like old evidence: a prior that stayed
    would hold the estimate above 0 for good, and a draft that never agrees would
    still look worth a cheap draft step. Plain rounds (k = 0) tell nothing about a
    and leave the counts as they were.

    Cost: for each k, the seconds rounds drafting k took (RoundCosts): k draft steps
    and a (k+1)-token verify, whatever the loop around them costs, no model of the
    split needed. Interference (another process, a page fault, the previous round's
    lazy rewind evaluated in this one) only ever adds time, so the estimate follows
    falls quickly (over about `cost_memory_falling` rounds) and rises slowly (about
    `cost_memory_rising` rounds): one slow round cannot make a k look bad for long.
    The first round of each draft length is not learned from: it carries one-off
    work (the first calls of its shapes: compiled functions, allocations), which in a
    fresh process made a good draft's first rounds look several times their cost.

    Choice: first `plain_rounds_first` plain rounds (k = 0): they cost nothing
    against plain decoding and measure what the policy compares every draft length
    with (the first one's time is not learned, hence two). Then a slow start: k = 1,
    then twice the last k while every draft was accepted, up to the cap; the first
    rejection (or the cap) ends it. A draft that never agrees so costs one draft step,
    not a round at the cap, and a good one reaches the cap in about log2(cap) + 1
    rounds, its costs measured on the way. Then the k maximizing expected tokens per
    second, taking a as the estimate plus `optimism` standard deviations of the
    belief the counts give (AcceptanceEstimate.optimistic): while few rounds were
    seen, drafting gets the benefit of the doubt, which is also how it learns a (a
    plain round tells nothing, and judged on the bare estimate a good draft's early
    misses sent it to plain steps for 16 rounds at a time: 0.86 of the best fixed k
    instead of 0.93 in benchmarks/draft_policy_replay.py's greedy 80-token calls). At
    probe rounds a neighbour of the best k instead (k + 1 and k - 1 in turn; k = 1
    from k = 0), so costs stay measured around the choice and a draft that starts
    agreeing again after a run of plain rounds is noticed. Probes come every `probe_interval` rounds; a probe after
    which plain rounds are still the best doubles the interval to the next (up to
    `max_probe_interval`: a draft that never agrees, or agrees too rarely to pay,
    then costs one draft step every 64 rounds, and one that starts agreeing again is
    noticed within as many), any other probe resets it. While the choice is k = 0, a
    probe whose drafts were all accepted is followed by another at once, so recovery
    takes a few rounds after the first good probe, not a few intervals.

    Warm start: given `learned` (what earlier calls of the same pair learned:
    DRAFT_LENGTHS), the policy takes its costs, acceptance and probe interval and
    goes on learning into them; once it holds a cost and a drafting round's
    acceptance, the plain rounds first and the slow start are skipped and the first
    round drafts the best k. (Cold, a 48-token call spent about a quarter of its gain
    finding that out.) Without it the policy learns alone, from the priors.

    Deterministic: the same inputs give the same choices; but the inputs include
    wall-clock times, so the choices differ from run to run. Under greedy decoding k
    changes only the speed, never the tokens. Under sampling the output's law is the
    target's whatever k is, but which sample a seed gives depends on k: a run that must
    replay exactly from a seed uses fixed().
    """

    def __init__(
        self,
        max_draft_tokens: int,
        *,
        adaptive: bool = True,
        probe_interval: int = 16,
        max_probe_interval: int = 64,
        plain_rounds_first: int = 2,
        optimism: float = 1.0,
        acceptance_memory: float = 8.0,
        cost_memory_falling: float = 2.0,
        cost_memory_rising: float = 8.0,
        prior_accepted: float = 1.0,
        prior_rejected: float = 1.0,
        prior_cost_per_draft: float = 0.3,
        learned: Optional[LearnedDraftLength] = None,
    ):
        if max_draft_tokens < 0:
            raise ValueError(f"max_draft_tokens must be at least 0, got {max_draft_tokens}")
        if not 2 <= probe_interval <= max_probe_interval:
            raise ValueError(f"need 2 <= probe_interval <= max_probe_interval, got {probe_interval} and "
                             f"{max_probe_interval}")
        if plain_rounds_first < 0 or optimism < 0:
            raise ValueError(f"plain_rounds_first and optimism must be at least 0, got {plain_rounds_first} and "
                             f"{optimism}")
        if min(acceptance_memory, cost_memory_falling, cost_memory_rising) < 1:
            raise ValueError(
                "acceptance_memory, cost_memory_falling and cost_memory_rising are counts of rounds >= 1, "
                f"got {acceptance_memory}, {cost_memory_falling} and {cost_memory_rising}"
            )
        if prior_accepted <= 0 or prior_rejected <= 0 or prior_cost_per_draft < 0:
            raise ValueError(
                "prior_accepted and prior_rejected must be > 0 and prior_cost_per_draft >= 0, "
                f"got {prior_accepted}, {prior_rejected}, {prior_cost_per_draft}"
            )
        self.max_draft_tokens = max_draft_tokens
        self.adaptive = adaptive
        self.probe_interval, self.max_probe_interval = probe_interval, max_probe_interval
        self.plain_rounds_first, self.optimism = plain_rounds_first, optimism
        self.learned = learned if learned is not None else LearnedDraftLength(
            RoundCosts(max_draft_tokens, cost_memory_falling, cost_memory_rising, prior_cost_per_draft),
            AcceptanceEstimate(prior_accepted, prior_rejected, acceptance_memory), probe_interval)
        self.acceptance, self.costs = self.learned.acceptance, self.learned.costs  # shared with `learned`
        warm = adaptive and self.learned.warm
        self.counts = [0] * (max_draft_tokens + 1)  # rounds that drafted k, per k
        self.num_accepted = 0
        self.last_round_all_accepted = False
        self.last_num_draft = 0
        self.slow_start_rounds: Optional[int] = 0 if warm else None  # rounds it took; None while in it
        self.interval = self.learned.probe_interval if warm else probe_interval  # rounds between probes
        self.next_probe = self.interval if warm else 0  # the round of the next probe, after the slow start
        self.num_probes = 0

    @classmethod
    def fixed(cls, num_draft_tokens: int) -> "DraftLengthPolicy":
        """A policy that always drafts `num_draft_tokens` (benchmarks, tests, and
        sampled runs that must replay exactly from a seed); it still keeps the
        statistics and estimates."""
        return cls(num_draft_tokens, adaptive=False)

    # --- what the loop calls ---------------------------------------------------

    def choose(self) -> int:
        """The number of tokens to draft this round, in 0..max_draft_tokens. Reads
        only what update() learned: calling it twice in a round gives the same k."""
        if not self.adaptive:
            return self.max_draft_tokens
        if self.slow_start_rounds is None:
            if self.num_rounds < self.plain_rounds_first:
                return 0
            return min(max(1, 2 * self.last_num_draft), self.max_draft_tokens)
        best = self._best()
        if (best == 0 and self.last_round_all_accepted) or self.num_rounds >= self.next_probe:
            return self._neighbour(best, upward=self.num_probes % 2 == 0)
        return best

    def choose_after_plain(self) -> int:
        """What choose() will say once one more plain round (k = 0) is learned, its
        time aside. Pipelined plain steps need it: whether the step after this one is
        plain too is decided before this one's result (and time) is in."""
        ahead = copy.copy(self)
        ahead.counts = self.counts[:]
        ahead._advance(0, 0)
        return ahead.choose()

    def update(self, num_draft: int, num_accepted: int, round_seconds: float) -> None:
        """Learn from a finished round: it drafted `num_draft`, the target accepted
        `num_accepted` of them, and it took `round_seconds` of wall clock."""
        if not 0 <= num_accepted <= num_draft <= self.max_draft_tokens:
            raise ValueError(
                "need 0 <= num_accepted <= num_draft <= max_draft_tokens, got "
                f"{num_accepted}, {num_draft}, {self.max_draft_tokens}"
            )
        if not round_seconds > 0:
            raise ValueError(f"round_seconds must be > 0, got {round_seconds}")
        if num_draft in self.learned.lengths_seen:
            self.costs.learn(num_draft, round_seconds)
        self.learned.lengths_seen.add(num_draft)  # its first round carried one-off work
        if num_draft > 0:
            self.acceptance.update(num_draft, num_accepted)
            self.learned.num_drafting_rounds += 1
        self._advance(num_draft, num_accepted)
        self.learned.probe_interval = self.interval

    def _advance(self, num_draft: int, num_accepted: int) -> None:
        """The round counts and the schedule (plain rounds first, slow start, probes)
        after a round: what update() learns besides acceptance and cost."""
        was_probe = self.slow_start_rounds is not None and self.num_rounds >= self.next_probe
        self.counts[num_draft] += 1
        self.num_accepted += num_accepted
        self.last_round_all_accepted = 0 < num_draft == num_accepted
        self.last_num_draft = num_draft
        if self.slow_start_rounds is None:
            plain_first = num_draft == 0 and self.num_rounds <= self.plain_rounds_first
            still_doubling = self.last_round_all_accepted and num_draft < self.max_draft_tokens
            if not (plain_first or still_doubling):
                self.slow_start_rounds = self.num_rounds
                self.next_probe = self.num_rounds + self.interval
        elif was_probe:
            self.num_probes += 1
            still_plain = self._best() == 0
            self.interval = min(2 * self.interval, self.max_probe_interval) if still_plain else self.probe_interval
            self.next_probe = self.num_rounds - 1 + self.interval

    # --- estimates and statistics ----------------------------------------------

    @property
    def acceptance_estimate(self) -> float:
        """The per-draft acceptance probability a, from the weighted counts."""
        return self.acceptance.value

    def round_costs(self) -> List[float]:
        """Seconds of a round drafting k, for every k up to the cap (RoundCosts.costs)."""
        return self.costs.costs(self.max_draft_tokens)

    def expected_round_seconds(self, k: int) -> Optional[float]:
        """Predicted seconds of a round drafting k; None before any cost was learned."""
        return self.round_costs()[k] if self.costs.measured else None

    @property
    def num_rounds(self) -> int:
        return sum(self.counts)

    @property
    def mean_draft_length(self) -> float:
        """Mean k over the rounds so far (0 before any)."""
        rounds = self.num_rounds
        return sum(k * n for k, n in enumerate(self.counts)) / rounds if rounds else 0.0

    # --- internals ---------------------------------------------------------------

    def _best(self) -> int:
        costs, a = self.round_costs(), self.acceptance.optimistic(self.optimism)
        return best_draft_length([expected_tokens(a, k) for k in range(len(costs))], costs)

    def _neighbour(self, k: int, *, upward: bool) -> int:
        """k + 1 if upward else k - 1, or the other one at the ends of 0..max."""
        candidate = k + 1 if upward else k - 1
        if not 0 <= candidate <= self.max_draft_tokens:
            candidate = k - 1 if upward else k + 1
        return min(max(candidate, 0), self.max_draft_tokens)


class LearnedBatchDraftLength:
    """What the rounds of one (target, drafter) showed in batches so far in this
    process (DRAFT_LENGTHS): round costs per batch size and the acceptance pooled
    over rows; the policies of successive generators share one and learn into it."""

    def __init__(self):
        self.costs: Dict[int, RoundCosts] = {}  # batch size -> its round costs
        self.pooled = AcceptanceEstimate(memory=32.0)  # every row's drafting rounds
        self.shapes_seen: Set[Tuple[int, int]] = set()  # (batch size, K) whose first round is behind


class BatchDraftLengthPolicy:
    """Chooses how many draft steps a batch takes each round (`batching.BatchGenerator`):
    every row that follows it drafts min(K, its room), one forward verifies all rows.

    A round's tokens come from every row, its cost from the whole batch: a B-row
    verify of K + 1 columns costs what B(K + 1) tokens cost, padding included, and on
    a machine where a wide forward is compute bound that can exceed what the accepted
    drafts save. So K maximizes the batch's expected tokens per second,

        sum over rows of expected_tokens(a_row, min(K, room_row)) / cost_B(K),

    with each row's own acceptance a_row (an AcceptanceEstimate per row, from
    `new_row`: a joining row starts at what the batch's rows showed lately, with the
    weight of `row_prior_weight` comparisons (about three rounds of a good draft; at
    most the comparisons the batch's rows made, so a cold pool commits no row), and
    remembers about `row_memory` rounds: misses come in runs, and with 8 rounds and a
    weight of 2 two of them took a row of the demo pair (92% accepted overall) below
    what drafting needs at batch 4)
    and the round costs learned per batch size B (a RoundCosts each, from
    the generator's timings; a B not measured yet borrows the nearest measured B's,
    since only their ratios across K matter). K = 0 is a plain step. After every
    `probe_interval` rounds another K is tried instead: the one chosen least recently
    (a plain step too: a batch that drafts well still learns what plain steps cost,
    not only the prior's guess), the largest room from 0 (rows back in agreeing text
    then show it by up to K acceptances each; a K = 1 probe, at batch 4 a round that
    never pays, showed one, and the batch stayed plain). So costs stay measured and
    rows whose drafts start agreeing again are noticed. While the best is 0, a probe
    that had nothing accepted doubles the interval to the next (up to `max_probe_interval`: a
    draft that never agrees then costs a probe every few hundred rounds), one that had
    anything accepted resets it, and one whose drafts were all accepted while the
    rows' mean acceptance was under 1/2 is followed by another at once. The choice is
    called once a round: it counts the rounds to the next probe. With adaptive=False,
    K is the largest room (every row drafts its cap).

    The generator calls `update` once a round (its K and outcome) and
    `learn_round_time` with the round's seconds when it was timed (at the next round's
    top). Given `learned` (DRAFT_LENGTHS: what earlier generators of the same target and drafter
    learned), its costs and pooled acceptance are shared with them, so a new
    generator's first rounds choose from measured costs and its first rows start at
    the acceptance rows showed before.
    """

    def __init__(self, *, adaptive: bool = True, probe_interval: int = 16, max_probe_interval: int = 256,
                 cost_memory_falling: float = 8.0, cost_memory_rising: float = 8.0, prior_cost_per_draft: float = 0.3,
                 row_prior_weight: float = 8.0, row_memory: float = 32.0,
                 learned: Optional[LearnedBatchDraftLength] = None):
        if not 2 <= probe_interval <= max_probe_interval:
            raise ValueError(f"need 2 <= probe_interval <= max_probe_interval, got {probe_interval} and "
                             f"{max_probe_interval}")
        self.adaptive, self.probe_interval, self.max_probe_interval = adaptive, probe_interval, max_probe_interval
        self._cost_settings = (cost_memory_falling, cost_memory_rising, prior_cost_per_draft)
        self.row_prior_weight, self.row_memory = row_prior_weight, row_memory
        learned = learned if learned is not None else LearnedBatchDraftLength()
        self.costs: Dict[int, RoundCosts] = learned.costs  # batch size -> its round costs
        self.counts: List[int] = []  # rounds per K
        self.last_round_all_accepted = False
        self.interval = probe_interval  # rounds from one probe to the next
        self._rounds_to_probe = probe_interval
        self._chosen_at: Dict[int, int] = {}  # K -> the round it was last chosen
        self._probe_from_plain = False  # the last choice was a probe while the best was 0
        self.pooled = learned.pooled  # every row's drafting rounds
        self.shapes_seen = learned.shapes_seen

    @property
    def num_rounds(self) -> int:
        return sum(self.counts)

    def choose(self, batch_size: int, rows: Sequence[Tuple[float, int]]) -> int:
        """K for a round of `batch_size` rows, of which `rows` (acceptance, room) follow
        the policy."""
        max_k = max((room for _, room in rows), default=0)
        if not max_k or not self.adaptive:
            return max_k
        costs = self._costs_near(batch_size).costs(max_k)
        rates = [sum(expected_tokens(a, min(k, room)) for a, room in rows) / costs[k] for k in range(max_k + 1)]
        best = max(range(max_k + 1), key=lambda k: (rates[k], -k))
        self._rounds_to_probe -= 1
        choice, self._probe_from_plain = best, False
        # A plain batch whose probe was all accepted though its rows looked unlikely to
        # be: their drafts agree again, so probe at once (not while it is cost that
        # keeps the batch plain: then more probes would only cost).
        unlikely = sum(a for a, _ in rows) < 0.5 * len(rows)
        if (best == 0 and self.last_round_all_accepted and unlikely) or self._rounds_to_probe <= 0:
            self._rounds_to_probe, self._probe_from_plain = self.interval, best == 0
            others = [k for k in range(max_k + 1) if k != best]
            choice = max_k if best == 0 else min(others, key=lambda k: self._chosen_at.get(k, -1))
        self._chosen_at[choice] = self.num_rounds
        return choice

    def update(self, k: int, num_accepted: int, all_accepted: bool) -> None:
        """Learn from a round that took k draft steps: how many drafts the rows
        accepted and whether every draft was."""
        self.counts += [0] * (k + 1 - len(self.counts))
        self.counts[k] += 1
        self.last_round_all_accepted = k > 0 and all_accepted
        if k > 0 and self._probe_from_plain:
            self._probe_from_plain = False
            self.interval = self.probe_interval if num_accepted else min(2 * self.interval, self.max_probe_interval)
            self._rounds_to_probe = self.interval

    def learn_cost(self, batch_size: int, k: int, round_seconds: float) -> None:
        """A round of `batch_size` rows that took k draft steps took round_seconds."""
        if round_seconds > 0:
            if batch_size not in self.costs:
                self.costs[batch_size] = RoundCosts(k, *self._cost_settings)
            self.costs[batch_size].learn(k, round_seconds)

    def learn_round_time(self, batch_size: int, k: int, round_seconds: float) -> None:
        """learn_cost from a timed round, but not from the first of each (batch size,
        K): it carries one-off work (first calls at new shapes, such as a compiled
        activation's), and a K measured dear is rarely chosen again, so only the odd
        probe would bring its cost back down."""
        if (batch_size, k) in self.shapes_seen:
            self.learn_cost(batch_size, k, round_seconds)
        self.shapes_seen.add((batch_size, k))

    def new_row(self) -> AcceptanceEstimate:
        """The acceptance estimate of a row joining the batch."""
        # No surer of a row than the pool is of all of them: at first, the pool's prior.
        a, weight = self.pooled.value, min(self.row_prior_weight, self.pooled.num_seen)
        return AcceptanceEstimate(weight * a, weight * (1 - a), memory=self.row_memory)

    def learn_row(self, row: AcceptanceEstimate, num_draft: int, num_accepted: int) -> None:
        """A row drafted num_draft tokens this round and num_accepted were accepted."""
        row.update(num_draft, num_accepted)
        self.pooled.update(num_draft, num_accepted)

    def _costs_near(self, batch_size: int) -> RoundCosts:
        if batch_size in self.costs:
            return self.costs[batch_size]
        if not self.costs:
            return RoundCosts(0, *self._cost_settings)
        return self.costs[min(self.costs, key=lambda b: (abs(b - batch_size), b))]
