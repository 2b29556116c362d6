"""What a batched generator counts, and the statistics of an interval (upstream's
`generate_utils.py`: `BatchCounters`, `BatchCountersSnapshot`, `BatchStats`).

A generator keeps one `BatchCounters`: totals that never decrease. A reading of them
(`BatchCountersSnapshot`) is stamped with the time and the process's peak memory, and
two readings subtract into the `BatchStats` of the interval between them
(`BatchCountersSnapshot.between`), so windows can nest. Within an interval
`prompt_time`, `decode_time` and `overhead_time` add up to `wall_time`.

Beyond upstream's fields, a speculating generator counts the draft tokens it verified
(`draft_tokens`) and how many of them were accepted (`accepted_tokens`).
"""

import time
from dataclasses import dataclass, field, fields

import mlx.core as mx

__all__ = ["BatchCounters", "BatchCountersSnapshot", "BatchStats"]


def _peak_memory_gb() -> float:
    return mx.get_peak_memory() / 1e9


def _rate(count: float, seconds: float) -> float:
    """count / seconds, 0 for an interval without time."""
    return count / seconds if seconds > 0 else 0.0


@dataclass
class BatchCounters:
    """Totals a generator keeps as it works, none ever decreasing.

    prompt_tokens, prompt_time: prompt tokens fed and the seconds spent feeding them;
    generation_tokens: tokens generated; generation_steps: target forwards that
    generated them (one per row or more each: a plain step gives every row one token,
    a speculative round up to its draft length + 1); decode_time: seconds in those
    steps; draft_tokens, accepted_tokens: drafts verified, and of them accepted."""

    prompt_tokens: int = 0
    prompt_time: float = 0.0
    generation_tokens: int = 0
    generation_steps: int = 0
    decode_time: float = 0.0
    draft_tokens: int = 0
    accepted_tokens: int = 0

    @property
    def prompt_tps(self) -> float:
        """Prompt tokens per second of prompt processing."""
        return _rate(self.prompt_tokens, self.prompt_time)

    @property
    def decode_tps(self) -> float:
        """Generated tokens per second of the decode steps (the caller's work left out)."""
        return _rate(self.generation_tokens, self.decode_time)


COUNTED = tuple(f.name for f in fields(BatchCounters))  # what two readings subtract


@dataclass
class BatchCountersSnapshot(BatchCounters):
    """The counters at one moment: `measured_at` (time.perf_counter seconds) and
    `peak_memory` (GB, the process's high-water mark so far) default to now."""

    measured_at: float = field(default_factory=time.perf_counter)
    peak_memory: float = field(default_factory=_peak_memory_gb)

    @staticmethod
    def between(start: "BatchCountersSnapshot", end: "BatchCountersSnapshot") -> "BatchStats":
        """What was counted from `start` to `end` (a later reading of the same counters)."""
        if end.measured_at < start.measured_at:
            raise ValueError(f"the end reading ({end.measured_at}) was taken before the start ({start.measured_at})")
        counts = {name: getattr(end, name) - getattr(start, name) for name in COUNTED}
        decreased = sorted(name for name, count in counts.items() if count < 0)
        if decreased:
            raise ValueError(f"counters never decrease, but {', '.join(decreased)} did: the readings are of "
                             "different counters, or in the wrong order")
        # Peak memory is a high-water mark, not a total: the interval's is the later one.
        return BatchStats(**counts, wall_time=end.measured_at - start.measured_at,
                          peak_memory=max(start.peak_memory, end.peak_memory))


@dataclass
class BatchStats(BatchCounters):
    """What a generator did over an interval (make one with
    BatchCountersSnapshot.between, or add intervals with `+=`): its counters' growth,
    `wall_time` seconds and `peak_memory` GB."""

    wall_time: float = 0.0
    peak_memory: float = 0.0

    @property
    def generation_time(self) -> float:
        """Seconds of the interval not spent on prompts."""
        return max(0.0, self.wall_time - self.prompt_time)

    @property
    def generation_tps(self) -> float:
        """Generated tokens per second of generation_time."""
        return _rate(self.generation_tokens, self.generation_time)

    @property
    def overhead_time(self) -> float:
        """Seconds spent neither on prompts nor in decode steps (the caller's, mostly)."""
        return max(0.0, self.wall_time - self.prompt_time - self.decode_time)

    def __iadd__(self, other: "BatchStats") -> "BatchStats":
        """Another interval's work added to this one's (peak memory: the larger)."""
        if not isinstance(other, BatchStats):
            return NotImplemented
        for name in COUNTED + ("wall_time",):
            setattr(self, name, getattr(self, name) + getattr(other, name))
        self.peak_memory = max(self.peak_memory, other.peak_memory)
        return self


class StatsWindow(BatchStats):
    """What `BatchGenerator.stats()` returns: what `counters` counted since the reading
    `since` (the generator's totals since it was made), and, used as a context manager
    (upstream's `with generator.stats() as stats:`), a fresh BatchStats that receives
    what is counted inside the block (windows nest)."""

    def __init__(self, since: BatchCountersSnapshot, counters: BatchCounters):
        self._counters, self._opened = counters, []
        totals = BatchCountersSnapshot.between(since, self._reading())
        super().__init__(**{f.name: getattr(totals, f.name) for f in fields(BatchStats)})

    def _reading(self) -> BatchCountersSnapshot:
        return BatchCountersSnapshot(**{name: getattr(self._counters, name) for name in COUNTED})

    def __enter__(self) -> BatchStats:
        window = BatchStats()
        self._opened.append((self._reading(), window))
        return window

    def __exit__(self, *exc) -> bool:
        start, window = self._opened.pop()
        window += BatchCountersSnapshot.between(start, self._reading())
        return False
