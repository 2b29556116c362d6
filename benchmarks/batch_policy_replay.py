"""The batch draft-length policy replayed on recorded demo-pair outputs: deterministic,
so its settings can be compared without the machine's noise.

    python benchmarks/batch_policy_replay.py [--runs 400] [--costs-ms 11.7 16.7 20.6 24.7]

1. Record, for 8 code prompts and 160 greedy tokens each, whether the demo draft's argmax
   equals the target's token at each position (draft_policy_replay.record): in greedy
   decoding a row accepts exactly the agreeing prefix of its drafts.
2. Replay the 4-client workload of batch_speculation.py: 4 clients x 4 requests of 64
   tokens, each request a window of a recorded output; every round the policy picks K
   from the rows' acceptance and its learned costs, each row accepts its prefix, and
   the round costs `--costs-ms[K]` (default: the parts batch_speculation.py measured at
   batch 4 on this machine: a plain step, verifies of K + 1 columns plus K draft steps),
   scaled by sqrt(rows / 4) when fewer rows are left, times log-normal jitter (`--noise`)
   and, in a share of rounds (`--spikes`), a stall of 1.3-2x (another job on the machine).
3. The runs follow one another with ONE learned state, as a server's requests or the
   benchmark's repeats do, and the machine's speed changes from run to run by a
   log-normal factor (`--drift`s): what a draft length cost long ago stops being true.

Reported per drift: tokens/s of adaptive K over plain steps (median and 10th percentile
over runs) against fixed K = cap, for the policy as shipped (a K's cost moves by a share
of each measurement of it, however long ago the last one was), for round costs that
forget by rounds instead (a K measured `gap` rounds ago moves 1 - (1 - rate)^gap of the
way: fresher but resting on fewer measurements; tried in f7c36b0, reverted: it lost
1-2% here), for each K's cost the median of its last 9 measurements (robust to stalls;
no better here), and with the true costs given (what perfect estimates would reach).
Writes results/batch_policy_replay.md and .png.
"""

import argparse
import json
import math
import random
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from draft_policy_replay import plot_groups, record  # noqa: E402
from gdn_prefill import RESULTS  # noqa: E402
from spec_bench import DRAFT, TARGET  # noqa: E402

CLIENTS, REQUESTS, MAX_TOKENS = 4, 4, 64


def record_traces() -> list:
    from mlx_lm import load

    target, tokenizer = load(str(TARGET))
    return record(target, load(str(DRAFT))[0], tokenizer, 0.0)


def replay(policy, traces, costs, seed: int, noise: float, spikes: float, fixed_k=None) -> tuple:
    """(tokens/s, rounds per K) of one workload run; fixed_k pins K."""
    rng = random.Random(seed)
    cap = len(costs) - 1
    sent = [0] * CLIENTS

    def request(client):
        trace = traces[(client + 3 * sent[client] + seed) % len(traces)]
        start = rng.randrange(0, len(trace) - MAX_TOKENS)
        sent[client] += 1
        return dict(trace=trace, at=start, end=start + MAX_TOKENS, estimate=policy.new_row(), client=client)

    rows = [request(c) for c in range(CLIENTS)]
    seconds = tokens = 0.0
    rounds = [0] * (cap + 1)
    while rows:
        rooms = [min(cap, r["end"] - r["at"] - 1) for r in rows]
        k = fixed_k if fixed_k is not None else policy.choose(
            len(rows), [(r["estimate"].value, room) for r, room in zip(rows, rooms)])
        accepted, all_accepted = 0, True
        for r, room in zip(rows, rooms):
            drafted = min(k, max(room, 0))
            n = 0
            while n < drafted and r["trace"][r["at"] + n] == 1.0:
                n += 1
            if drafted:
                policy.learn_row(r["estimate"], drafted, n)
            accepted, all_accepted = accepted + n, all_accepted and n == drafted
            r["at"] += n + 1
            tokens += n + 1
        stall = rng.uniform(1.3, 2.0) if rng.random() < spikes else 1.0
        round_seconds = costs[k] * math.sqrt(len(rows) / CLIENTS) * math.exp(rng.gauss(0.0, noise)) * stall
        seconds += round_seconds
        policy.update(k, accepted, all_accepted and k > 0)
        policy.learn_round_time(len(rows), k, round_seconds)
        rounds[k] += 1
        rows = [r for r in rows if r["at"] < r["end"]] + [
            request(r["client"]) for r in rows if r["at"] >= r["end"] and sent[r["client"]] < REQUESTS]
    return tokens / seconds, rounds


def policies(costs):
    """name -> a factory of policies sharing one learned state."""
    from mlx_lm import draft_length as dl

    class ForgetByRounds(dl.RoundCosts):
        """A k measured `gap` rounds ago moves 1 - (1 - rate)^gap of the way."""

        def learn(self, k, seconds):
            self.num_rounds = getattr(self, "num_rounds", 0) + 1
            self.learned_at = getattr(self, "learned_at", {})
            gap, self.learned_at[k] = self.num_rounds - self.learned_at.get(k, self.num_rounds - 1), self.num_rounds
            rates = self.rate_falling, self.rate_rising
            self.rate_falling, self.rate_rising = (1 - (1 - r) ** gap for r in rates)
            super().learn(k, seconds)
            self.rate_falling, self.rate_rising = rates

    class CostsByRounds(dl.BatchDraftLengthPolicy):
        def learn_cost(self, batch_size, k, round_seconds):
            self.costs.setdefault(batch_size, ForgetByRounds(k, *self._cost_settings))
            super().learn_cost(batch_size, k, round_seconds)

    class MedianCosts(dl.RoundCosts):
        """Each k's cost: the median of its last 9 measurements."""

        def learn(self, k, seconds):
            self.recent = getattr(self, "recent", {})
            self.recent.setdefault(k, []).append(math.log(seconds))
            self.recent[k] = self.recent[k][-9:]
            self.log_seconds += [None] * (k + 1 - len(self.log_seconds))
            self.log_seconds[k] = statistics.median(self.recent[k])

    class CostsByMedian(dl.BatchDraftLengthPolicy):
        def learn_cost(self, batch_size, k, round_seconds):
            self.costs.setdefault(batch_size, MedianCosts(k, *self._cost_settings))
            super().learn_cost(batch_size, k, round_seconds)

    class TrueCosts(dl.BatchDraftLengthPolicy):
        def _costs_near(self, batch_size):
            known = dl.RoundCosts(len(costs) - 1)
            known.log_seconds = [math.log(c * math.sqrt(batch_size / CLIENTS)) for c in costs]
            return known

    return {"as shipped": dl.BatchDraftLengthPolicy, "costs forget by rounds": CostsByRounds,
            "median of the last 9": CostsByMedian,
            "true costs given": TrueCosts}


def evaluate(traces, costs, args, drift: float) -> dict:
    from mlx_lm.draft_length import BatchDraftLengthPolicy, LearnedBatchDraftLength

    cap = len(costs) - 1
    results = {}
    for name, make in policies(costs).items():
        learned, speed = LearnedBatchDraftLength(), random.Random(1234)
        ratios, fixed, rounds = [], [], [0] * (cap + 1)
        for run in range(args.runs):
            factor = math.exp(speed.gauss(0.0, drift))  # the machine's speed this run
            scaled = [c * factor for c in costs]
            plain = replay(BatchDraftLengthPolicy(), traces, scaled, run, args.noise, args.spikes, fixed_k=0)[0]
            adaptive, chosen = replay(make(learned=learned), traces, scaled, run, args.noise, args.spikes)
            fixed.append(replay(BatchDraftLengthPolicy(), traces, scaled, run, args.noise, args.spikes,
                                fixed_k=cap)[0] / plain)
            ratios.append(adaptive / plain)
            rounds = [a + b for a, b in zip(rounds, chosen)]
        results[name] = dict(median=statistics.median(ratios), p10=sorted(ratios)[len(ratios) // 10],
                             fixed=statistics.median(fixed), rounds=rounds)
    return results


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--runs", type=int, default=400)
    parser.add_argument("--costs-ms", type=float, nargs="+", default=[11.7, 16.7, 20.6, 24.7])
    parser.add_argument("--noise", type=float, default=0.1)
    parser.add_argument("--spikes", type=float, default=0.1)
    parser.add_argument("--drifts", type=float, nargs="+", default=[0.0, 0.1, 0.2])
    parser.add_argument("--traces", type=Path, help="a JSON file of recorded traces (written if missing)")
    args = parser.parse_args()
    if len(args.costs_ms) < 2 or min(args.costs_ms) <= 0:
        parser.error("--costs-ms needs a positive cost for K = 0 and at least one K > 0")
    started = time.time()
    if args.traces is not None and args.traces.exists():
        traces = json.loads(args.traces.read_text())
    else:
        traces = record_traces()
        if args.traces is not None:
            args.traces.write_text(json.dumps(traces))
    costs = [ms / 1000 for ms in args.costs_ms]
    table = {drift: evaluate(traces, costs, args, drift) for drift in args.drifts}

    cap = len(costs) - 1
    lines = [
        "# The batch draft-length policy replayed on recorded demo-pair outputs (4 clients)",
        "",
        f"- command: `python benchmarks/batch_policy_replay.py{''.join(' ' + a for a in sys.argv[1:])}` "
        f"({(time.time() - started) / 60:.1f} min); no timing is taken: the round costs are given",
        f"- round ms, K = 0..{cap}: {', '.join(f'{c:g}' for c in args.costs_ms)}; jitter {args.noise:g} "
        f"(log-normal sigma), stalls in {args.spikes:.0%} of rounds; {args.runs} runs in a row, one learned state",
        f"- mean acceptance of the recorded drafts: {statistics.mean(x for t in traces for x in t):.2f}",
        "",
        f"| machine drift per run | policy | adaptive / plain, median | 10th percentile | fixed K={cap} / plain "
        "| rounds per K |",
        "|---:|---|---:|---:|---:|---|",
    ]
    for drift, results in table.items():
        for name, r in results.items():
            lines.append(f"| {drift:g} | {name} | **{r['median']:.3f}x** | {r['p10']:.3f}x | {r['fixed']:.3f}x | "
                         f"{', '.join(f'{k}: {n}' for k, n in enumerate(r['rounds']))} |")
    lines += ["", "![replay](batch_policy_replay.png)"]
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "batch_policy_replay.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))

    names = list(next(iter(table.values())))
    plot_groups(RESULTS / "batch_policy_replay.png", [f"drift {d:g}" for d in table],
                {name: [r[name]["median"] for r in table.values()] for name in names},
                (f"fixed K={cap}", [next(iter(r.values()))["fixed"] for r in table.values()]),
                ylabel="tokens/s / plain batched steps", title="Batch policy replayed (4 clients, demo pair, greedy)",
                bottom=1.0)


if __name__ == "__main__":
    main()
