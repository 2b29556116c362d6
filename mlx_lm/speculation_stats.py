"""The counts of a speculative run (`SpeculationStats`), one type for a single sequence
and for each row of a batch, and the speedup bound they give (benchmarks/spec_bench.py's
E(a, k) t_plain / (k t_draft + t_verify(k + 1)))."""

from dataclasses import dataclass, field
from typing import List, Optional, Sequence, Tuple


def expected_round_tokens(depth_acceptance: Sequence[float], k: int) -> float:
    """Expected tokens a round drafting k emits: the target's own token, plus draft d
    whenever the first d drafts are all accepted, which `depth_acceptance[d - 1]` is
    the probability of (a survival curve; a^d when each draft is accepted with
    probability a independently, giving draft_length.expected_tokens)."""
    return 1.0 + sum(depth_acceptance[:k])


def speedup_bound(depth_acceptance: Sequence[float], k: int, round_seconds: float, plain_seconds: float) -> float:
    """The speedup over plain decoding that rounds drafting k reach, if each emits its
    expected tokens and costs `round_seconds` against a plain step's `plain_seconds`:
    expected_round_tokens / (round_seconds / plain_seconds). benchmarks/spec_bench.py's
    bound, E(a, k) t_plain / (k t_draft + t_verify(k+1)), with the survival a^d."""
    return expected_round_tokens(depth_acceptance, k) * plain_seconds / round_seconds


def _grow(counts: list, size: int, fill) -> None:
    counts += [fill] * (size - len(counts))


@dataclass
class SpeculationStats:
    """Counts of a speculative run: draft tokens proposed and accepted, target forwards;
    and how drafts were accepted: "speculative sampling" (the sampler gives its law) or
    "token matching" (greedy, or a sampler function).

    Telemetry against the bound, from counts (rates are derived):
    - `drafted_at_depth[d - 1]`: rounds that drafted at least d tokens;
      `accepted_at_depth[d - 1]`: those whose d-th draft was accepted (so all before
      it too). Their ratio, `depth_acceptance`, is the survival of the accepted prefix
      past depth d, given a round drafted that deep.
    - `round_seconds[k]`: seconds of the timed rounds that drafted k (0: a plain step),
      `timed_rounds[k]` how many; the loop's own round timings (the draft-length
      policy's), no sync added for them. A batch row's rounds are the batch's, and
      those around a row joining or leaving are not timed.
    From them `bound` (the best speedup a fixed draft length would reach at these
    acceptances and costs: speedup_bound), `measured_speedup` (the run's tokens per
    second against a plain step's) and `efficiency`, their ratio; None without a
    plain step to compare with (a run with `adaptive_draft_length=False` takes none
    unless the drafter had nothing to propose)."""

    num_drafted: int = 0
    num_accepted: int = 0
    num_target_forwards: int = 0
    acceptance_rule: str = "token matching"
    draft_lengths: List[int] = field(default_factory=list)  # rounds that drafted k, per k
    drafted_at_depth: List[int] = field(default_factory=list)
    accepted_at_depth: List[int] = field(default_factory=list)
    round_seconds: List[float] = field(default_factory=list)
    timed_rounds: List[int] = field(default_factory=list)
    _last_draft_length: int = field(default=0, repr=False, compare=False)

    def add_round(self, num_draft: int, num_accepted: int, seconds: Optional[float] = None) -> None:
        """A target forward that verified `num_draft` drafts (0: a plain step) and
        accepted the first `num_accepted`; `seconds`: its time, None if not timed (a
        batch row's rounds are timed once the next one begins: add_seconds)."""
        self.num_drafted += num_draft
        self.num_accepted += num_accepted
        self.num_target_forwards += 1
        _grow(self.draft_lengths, num_draft + 1, 0)
        self.draft_lengths[num_draft] += 1
        self.count_round(num_draft, num_accepted, seconds)
        self._last_draft_length = num_draft

    def add_seconds(self, seconds: float) -> None:
        """The last round took `seconds`."""
        self.count_seconds(self._last_draft_length, seconds)

    def count_round(self, num_draft: int, num_accepted: int, seconds: Optional[float]) -> None:
        """Add a round's depths (it drafted `num_draft`, the first `num_accepted` were
        accepted) and its time (None: not timed). The totals above are the caller's."""
        _grow(self.drafted_at_depth, num_draft, 0)
        _grow(self.accepted_at_depth, num_draft, 0)
        for d in range(num_draft):
            self.drafted_at_depth[d] += 1
            self.accepted_at_depth[d] += d < num_accepted
        if seconds is not None:
            self.count_seconds(num_draft, seconds)

    def count_seconds(self, k: int, seconds: float) -> None:
        """A round that drafted k took `seconds`."""
        _grow(self.round_seconds, k + 1, 0.0)
        _grow(self.timed_rounds, k + 1, 0)
        self.round_seconds[k] += seconds
        self.timed_rounds[k] += 1

    @property
    def acceptance_rate(self) -> float:
        return self.num_accepted / self.num_drafted if self.num_drafted else 0.0

    @property
    def mean_draft_length(self) -> float:
        rounds = sum(self.draft_lengths)
        return sum(k * n for k, n in enumerate(self.draft_lengths)) / rounds if rounds else 0.0

    @property
    def tokens_per_forward(self) -> float:
        """Tokens per target forward: each round's accepted drafts and the target's own
        token (which a run cut short by max_tokens may not emit)."""
        forwards = self.num_target_forwards
        return (self.num_accepted + forwards) / forwards if forwards else 0.0

    @property
    def depth_acceptance(self) -> List[float]:
        return [a / n for a, n in zip(self.accepted_at_depth, self.drafted_at_depth)]

    @property
    def mean_round_seconds(self) -> List[Optional[float]]:
        """Mean seconds of a round drafting k, per k (None: none timed)."""
        return [s / n if n else None for s, n in zip(self.round_seconds, self.timed_rounds)]

    @property
    def plain_step_seconds(self) -> Optional[float]:
        return (self.mean_round_seconds or [None])[0]

    def _bounds(self) -> List[Tuple[float, int]]:
        """(speedup_bound, k) for every k timed (0 included); [] without a plain step."""
        plain = self.plain_step_seconds
        if not plain:
            return []
        rates = self.depth_acceptance
        return [(speedup_bound(rates, k, seconds, plain), k)
                for k, seconds in enumerate(self.mean_round_seconds) if seconds]

    @property
    def bound(self) -> Optional[float]:
        """The best speedup_bound over the draft lengths measured (at least 1: plain)."""
        return max(self._bounds(), key=lambda b: (b[0], -b[1]), default=(None, None))[0]

    @property
    def bound_draft_length(self) -> Optional[int]:
        """The draft length that reaches `bound` (the smaller on a tie)."""
        return max(self._bounds(), key=lambda b: (b[0], -b[1]), default=(None, None))[1]

    @property
    def measured_speedup(self) -> Optional[float]:
        """The run's tokens per second (tokens_per_forward over the mean seconds of a
        timed round) against one token per plain step; None without a plain step."""
        plain, num_timed = self.plain_step_seconds, sum(self.timed_rounds)
        if not plain:
            return None
        return self.tokens_per_forward * plain * num_timed / sum(self.round_seconds)

    @property
    def efficiency(self) -> Optional[float]:
        """measured_speedup / bound: what the run got of what the best fixed draft
        length would at the measured acceptance and costs."""
        measured, bound = self.measured_speedup, self.bound
        return None if measured is None or bound is None else measured / bound


def telemetry_lines(spec: SpeculationStats) -> List[str]:
    """generate --verbose's lines on acceptance by depth, round costs and the speedup bound."""
    depths = ", ".join(f"d={d + 1}: {a}/{n} ({a / n:.0%})"
                       for d, (a, n) in enumerate(zip(spec.accepted_at_depth, spec.drafted_at_depth)))
    costs = ", ".join(f"k={k}: {s * 1e3:.2f} ms" for k, s in enumerate(spec.mean_round_seconds) if s is not None)
    lines = [f"Acceptance by depth: {depths or 'nothing drafted'}", f"Round cost: {costs or 'not measured'}"]
    if spec.bound is None:
        lines[-1] += " (no plain step to compare with, so no bound)"
    else:
        lines.append(f"Speedup: x{spec.measured_speedup:.2f} measured, bound x{spec.bound:.2f} at "
                     f"k={spec.bound_draft_length}, efficiency {spec.efficiency:.0%}")
    return lines
