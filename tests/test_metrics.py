"""metrics.py and the telemetry of speculation: the Prometheus text a server's GET
/metrics answers (parsed strictly here), the counters moving with the requests the
workers finish (in process, as tests/test_server_batching.py drives them), per-depth
acceptance and the speedup bound of SpeculationStats against hand computations."""

import math
import re

import pytest
from checkpoints import TINY_CONFIGS, write_checkpoint
from test_server_batching import drive, result, user

from mlx_lm.draft_length import expected_tokens
from mlx_lm.metrics import Metrics
from mlx_lm.openai_api import GenerationResult, ServerDefaults, parse_request, usage
from mlx_lm.serving import BatchWorker, GenerationWorker, Job, ModelProvider
from mlx_lm.speculation_stats import SpeculationStats, speedup_bound

# ---------------------------------------------------------------------------
# A strict reader of the text exposition format (version 0.0.4).

NAME = r"[a-zA-Z_:][a-zA-Z0-9_:]*"
LABEL = r'[a-zA-Z_][a-zA-Z0-9_]*="(?:[^"\\\n]|\\["\\n])*"'
SAMPLE = re.compile(rf"({NAME})(?:\{{((?:{LABEL})(?:,{LABEL})*)?\}})? (\S+)")
VALUE = re.compile(r"[+-]?(?:\d+(?:\.\d*)?(?:[eE][+-]?\d+)?|Inf)|NaN")


def parse_exposition(text):
    """{name: {"type", "help", "samples": {frozenset of (label, value): float}}};
    fails on any line out of the format: a sample must follow its metric's HELP and
    TYPE, a metric is described once, counters end in _total, values are numbers."""
    assert text.endswith("\n"), "the last line must end with a newline"
    metrics, current = {}, None
    for line in text[:-1].split("\n"):
        if line.startswith("# HELP "):
            name, _, help_text = line[len("# HELP "):].partition(" ")
            assert re.fullmatch(NAME, name) and help_text, line
            assert name not in metrics, f"{name} described twice"
            metrics[name] = {"help": help_text, "type": None, "samples": {}}
            current = name
        elif line.startswith("# TYPE "):
            name, _, kind = line[len("# TYPE "):].partition(" ")
            assert name == current and metrics[name]["type"] is None, f"TYPE of {name} not right after its HELP"
            assert kind in ("counter", "gauge"), line
            if kind == "counter":
                assert name.endswith("_total"), f"counter {name} must end in _total"
            metrics[name]["type"] = kind
        else:
            match = SAMPLE.fullmatch(line)
            assert match, f"not a sample line: {line!r}"
            name, labels, value = match.groups()
            assert name == current and metrics[name]["type"] is not None, f"{name}'s sample before its HELP/TYPE"
            assert VALUE.fullmatch(value), line
            pairs = frozenset(re.findall(r'([a-zA-Z_][a-zA-Z0-9_]*)="((?:[^"\\]|\\.)*)"', labels or ""))
            assert pairs not in metrics[name]["samples"], f"{line!r} repeated"
            metrics[name]["samples"][pairs] = float(value)
    return metrics


def value(metrics, name, **labels):
    return metrics[name]["samples"].get(frozenset((k, str(v)) for k, v in labels.items()), 0.0)


def test_the_parser_refuses_what_is_out_of_the_format():
    good = "# HELP a_total A.\n# TYPE a_total counter\na_total{x=\"1\"} 2\n"
    assert value(parse_exposition(good), "a_total", x=1) == 2
    for bad in ["a_total 1\n",  # no HELP or TYPE
                "# HELP a A.\n# TYPE a counter\na 1\n",  # a counter without _total
                "# HELP a_total A.\n# TYPE a_total counter\na_total{x=1} 2\n",  # unquoted label
                "# HELP a_total A.\n# TYPE a_total counter\na_total 2"]:  # no final newline
        with pytest.raises(AssertionError):
            parse_exposition(bad)


def spec_stats(rounds, seconds):
    """Stats of `rounds` (num_draft, num_accepted) timed at `seconds` each."""
    stats = SpeculationStats()
    for (num_draft, num_accepted), s in zip(rounds, seconds):
        stats.count_round(num_draft, num_accepted, s)
        stats.num_drafted += num_draft
        stats.num_accepted += num_accepted
        stats.num_target_forwards += 1
        stats.draft_lengths += [0] * (num_draft + 1 - len(stats.draft_lengths))
        stats.draft_lengths[num_draft] += 1
    return stats


def test_metrics_text_parses_and_counts():
    metrics = Metrics()
    metrics.count_request("chat", "completed")
    metrics.count_error("text", 400)
    metrics.count_error("text", 500)
    speculation = spec_stats([(3, 1), (2, 2)], [0.1, 0.1])
    metrics.count_result("chat", GenerationResult("", "stop", 10, 4, 5, speculation, []), cancelled=False)
    metrics.count_result("text", GenerationResult("", "length", 7, 0, 2, None, []), cancelled=True)
    text = metrics.exposition(batch_size=2, queue_length=1)
    parsed = parse_exposition(text)
    assert value(parsed, "mlx_lm_requests_total", endpoint="/v1/chat/completions", outcome="completed") == 2
    assert value(parsed, "mlx_lm_requests_total", endpoint="/v1/completions", outcome="rejected") == 1
    assert value(parsed, "mlx_lm_requests_total", endpoint="/v1/completions", outcome="failed") == 1
    assert value(parsed, "mlx_lm_requests_total", endpoint="/v1/completions", outcome="cancelled") == 1
    assert value(parsed, "mlx_lm_requests_total", endpoint="/v1/completions", outcome="completed") == 0
    assert len(parsed["mlx_lm_requests_total"]["samples"]) == 8  # every endpoint and outcome, from 0
    assert value(parsed, "mlx_lm_prompt_tokens_total") == 17
    assert value(parsed, "mlx_lm_cached_prompt_tokens_total") == 4
    assert value(parsed, "mlx_lm_generated_tokens_total") == 7
    assert value(parsed, "mlx_lm_draft_tokens_total") == 5
    assert value(parsed, "mlx_lm_draft_accepted_tokens_total") == 3
    assert [value(parsed, "mlx_lm_drafted_at_depth_total", depth=d) for d in (1, 2, 3)] == [2, 2, 1]
    assert [value(parsed, "mlx_lm_accepted_at_depth_total", depth=d) for d in (1, 2, 3)] == [2, 1, 0]
    assert parsed["mlx_lm_batch_size"]["type"] == "gauge" and value(parsed, "mlx_lm_batch_size") == 2
    assert value(parsed, "mlx_lm_queue_length") == 1
    with pytest.raises(ValueError, match="outcome"):
        metrics.count_request("chat", "fine")
    assert "\n\n" not in text and text.count("# HELP") == len(parsed) == 10


# ---------------------------------------------------------------------------
# The bound and the stats it comes from.


def test_speedup_bound_by_hand():
    # Depth 1 accepted in 80% of rounds, depth 2 in 50%: a round of 2 emits
    # 1 + 0.8 + 0.5 = 2.3 tokens for 2 plain steps' time.
    assert speedup_bound([0.8, 0.5], 2, round_seconds=0.02, plain_seconds=0.01) == pytest.approx(1.15)
    assert speedup_bound([0.8, 0.5], 1, round_seconds=0.015, plain_seconds=0.01) == pytest.approx(1.2)
    assert speedup_bound([0.8, 0.5], 0, round_seconds=0.01, plain_seconds=0.01) == 1.0
    # With geometric survival a^d it is benchmarks/spec_bench.py's bound, E(a, k) t_plain / t_round.
    a = 0.7
    assert speedup_bound([a, a * a, a ** 3], 3, 0.05, 0.02) == pytest.approx(expected_tokens(a, 3) * 0.02 / 0.05)


def test_stats_per_depth_acceptance_costs_and_efficiency_by_hand():
    # Two plain steps of 10 ms, rounds of 2 at 20 ms accepting 2, 1, 0, a round of 1
    # at 16 ms accepting 1.
    stats = spec_stats([(0, 0), (0, 0), (2, 2), (2, 1), (2, 0), (1, 1)],
                       [0.010, 0.010, 0.020, 0.020, 0.020, 0.016])
    assert stats.drafted_at_depth == [4, 3] and stats.accepted_at_depth == [3, 1]
    assert stats.depth_acceptance == pytest.approx([0.75, 1 / 3])
    assert stats.mean_round_seconds == pytest.approx([0.010, 0.016, 0.020])
    assert stats.plain_step_seconds == pytest.approx(0.010)
    assert stats.tokens_per_forward == pytest.approx((4 + 6) / 6)
    # k = 1: 1.75 tokens / 1.6 plain steps = 1.09375; k = 2: (1 + 0.75 + 1/3) / 2 = 1.0417.
    assert stats.bound_draft_length == 1
    assert stats.bound == pytest.approx(1.09375)
    # The run: 10 tokens in 96 ms, a plain step 10 ms: x1.0417 measured.
    assert stats.measured_speedup == pytest.approx(10 * 0.010 / 0.096)
    assert stats.efficiency == pytest.approx((10 * 0.010 / 0.096) / 1.09375)


def test_stats_without_plain_steps_have_no_bound():
    stats = spec_stats([(2, 1), (2, 2)], [0.02, 0.02])
    assert stats.plain_step_seconds is None
    assert stats.bound is None and stats.measured_speedup is None and stats.efficiency is None
    assert SpeculationStats().depth_acceptance == [] and SpeculationStats().bound is None


def test_usage_reports_the_telemetry():
    stats = spec_stats([(0, 0), (2, 1)], [0.01, 0.02])
    body = usage(GenerationResult("", "stop", 3, 0, 3, stats, []))["speculation"]
    assert body["num_drafted"] == 2 and body["num_accepted"] == 1 and body["draft_lengths"] == [1, 0, 1]
    assert body["drafted_at_depth"] == [1, 1] and body["accepted_at_depth"] == [1, 0]
    assert body["depth_acceptance"] == [1.0, 0.0]
    assert body["round_seconds"][1] is None  # no round drafted 1
    assert [body["round_seconds"][k] for k in (0, 2)] == pytest.approx([0.01, 0.02])
    assert body["plain_step_seconds"] == pytest.approx(0.01)
    assert body["bound"] == pytest.approx(1.0) and body["bound_draft_length"] == 0
    assert body["measured_speedup"] == pytest.approx(3 * 0.01 / 0.03)
    assert math.isclose(body["efficiency"], body["measured_speedup"] / body["bound"])
    assert body["tokens_per_target_forward"] == pytest.approx(1.5)


# ---------------------------------------------------------------------------
# The workers count what they finish.


@pytest.fixture(scope="module")
def dense_dir(tmp_path_factory):
    return write_checkpoint(tmp_path_factory.mktemp("metrics_models") / "dense", TINY_CONFIGS["qwen3"])


def scrape(worker):
    return parse_exposition(worker.metrics.exposition(worker.batch_size, worker.queue_length))


def test_batch_worker_counters_move_with_requests(dense_dir):
    provider = ModelProvider(str(dense_dir), None, False, 10, 1 << 40, None)
    worker = BatchWorker(provider, prefill_step_size=8, max_batch_size=3, prompt_lookup=True)
    before = scrape(worker)
    assert value(before, "mlx_lm_batch_size") == 0 and value(before, "mlx_lm_queue_length") == 0
    bodies = [{"messages": user("Tell me a story about a cat. Tell me a story about a cat.")},
              {"messages": user("What now? What now? What now?"), "stream": True},
              {"messages": user("x"), "logit_bias": {"999999": 1}}]  # refused by the worker (400)
    sizes = []
    events = drive(worker, bodies, on_step=lambda step, jobs: sizes.append(worker.batch_size))
    answers = [result(e) for e in events[:2]]
    assert events[2][-1][0] == "error" and events[2][-1][1] == 400
    after = scrape(worker)
    chat = "/v1/chat/completions"
    assert value(after, "mlx_lm_requests_total", endpoint=chat, outcome="completed") == 2
    assert value(after, "mlx_lm_requests_total", endpoint=chat, outcome="rejected") == 1
    assert value(after, "mlx_lm_generated_tokens_total") == sum(a.completion_tokens for a in answers)
    assert value(after, "mlx_lm_prompt_tokens_total") == sum(a.prompt_tokens for a in answers)
    assert value(after, "mlx_lm_cached_prompt_tokens_total") == sum(a.cached_tokens for a in answers)
    specs = [usage(a)["speculation"] for a in answers]
    assert value(after, "mlx_lm_draft_tokens_total") == sum(s["num_drafted"] for s in specs) > 0
    assert value(after, "mlx_lm_draft_accepted_tokens_total") == sum(s["num_accepted"] for s in specs)
    for d in range(1, max(len(s["drafted_at_depth"]) for s in specs) + 1):
        want = sum(s["drafted_at_depth"][d - 1] for s in specs if len(s["drafted_at_depth"]) >= d)
        assert value(after, "mlx_lm_drafted_at_depth_total", depth=d) == want
    assert max(sizes) == 2 and value(after, "mlx_lm_batch_size") == 0
    for spec in (a.speculation for a in answers):  # a row's stats are consistent
        check_consistent(spec)


def check_consistent(stats):
    """What holds of the stats of any speculative run."""
    rounds_drafting = sum(stats.draft_lengths[1:])
    assert (stats.drafted_at_depth or [0])[0] == rounds_drafting
    assert sum(stats.drafted_at_depth) == stats.num_drafted and sum(stats.accepted_at_depth) == stats.num_accepted
    assert all(a >= b for a, b in zip(stats.accepted_at_depth, stats.accepted_at_depth[1:]))
    assert all(a >= b for a, b in zip(stats.drafted_at_depth, stats.drafted_at_depth[1:]))
    assert all(a <= d for a, d in zip(stats.accepted_at_depth, stats.drafted_at_depth))
    assert all(t <= n for t, n in zip(stats.timed_rounds, stats.draft_lengths))


def test_generation_worker_counts_a_cancelled_request(dense_dir):
    provider = ModelProvider(str(dense_dir), None, False, 10, 1 << 40, None)
    worker = GenerationWorker(provider, prefill_step_size=8)
    jobs = [Job(parse_request({"prompt": "hello", "max_tokens": 4}, "text", ServerDefaults(max_tokens=4)), None)
            for _ in range(2)]
    jobs[1].cancelled.set()  # gone while queued
    for job in jobs:
        worker.submit(job)
    assert worker.queue_length == 2
    for _ in jobs:
        worker.run(worker.jobs.get())
    answer = jobs[0].events.get()[1]
    after = scrape(worker)
    assert value(after, "mlx_lm_requests_total", endpoint="/v1/completions", outcome="completed") == 1
    assert value(after, "mlx_lm_requests_total", endpoint="/v1/completions", outcome="cancelled") == 1
    assert value(after, "mlx_lm_generated_tokens_total") == answer.completion_tokens == 4
    assert value(after, "mlx_lm_queue_length") == 0 and value(after, "mlx_lm_batch_size") == 0
