"""Counters and interval statistics of batched generation (mlx_lm/generate_utils.py):
readings subtract into an interval's stats, times partition its wall time, intervals
add up, and readings that cannot be of one generator's counters are refused."""

from dataclasses import asdict

import pytest

from mlx_lm.generate_utils import BatchCounters, BatchCountersSnapshot, BatchStats


def reading(at, peak, **counts):
    return BatchCountersSnapshot(measured_at=at, peak_memory=peak, **counts)


def test_between_two_readings_is_what_was_counted_in_between():
    start = reading(10.0, 2.0, prompt_tokens=5, prompt_time=0.5, generation_tokens=3, generation_steps=3,
                    decode_time=0.25, draft_tokens=4, accepted_tokens=1)
    end = reading(12.0, 1.5, prompt_tokens=25, prompt_time=1.0, generation_tokens=43, generation_steps=13,
                  decode_time=1.25, draft_tokens=24, accepted_tokens=11)
    stats = BatchCountersSnapshot.between(start, end)
    assert isinstance(stats, BatchStats)
    assert asdict(stats) == dict(prompt_tokens=20, prompt_time=0.5, generation_tokens=40, generation_steps=10,
                                 decode_time=1.0, draft_tokens=20, accepted_tokens=10, wall_time=2.0, peak_memory=2.0)
    assert stats.prompt_tps == 40.0 and stats.decode_tps == 40.0
    assert stats.generation_time == 1.5 and stats.generation_tps == pytest.approx(40 / 1.5)
    assert stats.overhead_time == 0.5
    assert stats.prompt_time + stats.decode_time + stats.overhead_time == stats.wall_time


def test_a_counter_reads_as_a_snapshot_and_empty_intervals_have_no_rates():
    counters = BatchCounters(prompt_tokens=7)
    counters.generation_tokens += 2
    snapshot = BatchCountersSnapshot(**asdict(counters))
    assert snapshot.prompt_tokens == 7 and snapshot.generation_tokens == 2 and snapshot.peak_memory >= 0
    empty = BatchCountersSnapshot.between(snapshot, snapshot)
    assert (empty.prompt_tps, empty.decode_tps, empty.generation_tps) == (0.0, 0.0, 0.0)
    assert BatchStats().overhead_time == 0.0


def test_intervals_add_up():
    total = BatchStats(prompt_tokens=1, wall_time=1.0, peak_memory=3.0, accepted_tokens=2)
    total += BatchStats(prompt_tokens=2, generation_steps=4, wall_time=0.5, peak_memory=1.0, accepted_tokens=1)
    assert (total.prompt_tokens, total.generation_steps, total.wall_time) == (3, 4, 1.5)
    assert total.peak_memory == 3.0 and total.accepted_tokens == 3
    with pytest.raises(TypeError):
        total += 1


def test_readings_out_of_order_are_refused():
    early, late = reading(1.0, 0.0, generation_tokens=5), reading(2.0, 0.0, generation_tokens=9)
    with pytest.raises(ValueError, match="taken before the start"):
        BatchCountersSnapshot.between(late, early)
    with pytest.raises(ValueError, match="generation_tokens did"):
        BatchCountersSnapshot.between(reading(1.0, 0.0, generation_tokens=9), reading(2.0, 0.0, generation_tokens=5))
