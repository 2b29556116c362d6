"""SIMULATION, no model runs: the adaptive draft length against every fixed one.

    python benchmarks/draft_policy_sim.py [--rounds 2000] [--seed 0]

Each simulated round asks DraftLengthPolicy for k, accepts each draft with probability
a until the first rejection (seeded Bernoulli), charges the round its profile's cost
for k times a seeded log-normal jitter, and tells the policy. Cost profiles, seconds
per round for k = 0..8:

- float16 demo pair (measured, results/spec_bench.md, OpenBLAS): k = 0 is one target
  forward (37.2 ms); k >= 1 is k draft steps plus a (k+1)-token verify, as timed there.
- float32-like (assumed): a plain step of 10.8 ms, a draft step 0.45 of it and each
  verified token 0.45 more, so that speculation about breaks even at a ~ 0.9, as
  measured with float32 weights in issue 14.
- cheap draft (assumed, accelerator-like): a draft step 0.05 of a plain step and each
  verified token 0.05 more, so the cap is best when the draft agrees.

Reported: tokens per second of the policy over the whole run, and of each fixed k
(expected value, E(a, k) / t(k)), all relative to plain decoding (k = 0). Writes
results/draft_policy_sim.md and .png. tests/test_draft_length.py asserts on the same
simulation.
"""

import argparse
import math
import random
import sys
from pathlib import Path
from typing import Callable, Dict, List

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from mlx_lm.draft_length import DraftLengthPolicy, expected_tokens  # noqa: E402

RESULTS = Path(__file__).parent / "results"
CAP = 8


def float16_demo_pair() -> List[float]:
    draft_ms = [5.73, 10.89, 15.68, 19.40, 25.67, 29.16, 32.78, 38.51]
    verify_ms = [41.00, 54.58, 62.71, 65.32, 78.14, 80.47, 86.45, 94.80]
    return [37.20e-3] + [(d + v) * 1e-3 for d, v in zip(draft_ms, verify_ms)]


def linear_profile(plain_seconds: float, draft_step: float, per_verified_token: float) -> List[float]:
    """k draft steps of draft_step * plain, and a verify of (1 + per_verified_token * k) * plain."""
    return [plain_seconds * (1 + (draft_step + per_verified_token) * k) for k in range(CAP + 1)]


PROFILES: Dict[str, List[float]] = {
    "float16 demo pair (measured)": float16_demo_pair(),
    "float32-like (assumed)": linear_profile(10.8e-3, 0.45, 0.45),
    "cheap draft (assumed)": linear_profile(10.0e-3, 0.05, 0.05),
}


def accepted_prefix(a: float, k: int, rng: random.Random) -> int:
    """Leading acceptances among k drafts, each accepted with probability a."""
    n = 0
    while n < k and rng.random() < a:
        n += 1
    return n


def simulate(
    policy: DraftLengthPolicy,
    costs: List[float],
    acceptance: Callable[[int], float],
    num_rounds: int,
    *,
    seed: int = 0,
    jitter: float = 0.1,
    drift: float = 0.0,
    stalls: float = 0.0,
) -> dict:
    """Run `num_rounds` rounds; acceptance(round) is a, costs[k] the mean seconds of a
    round drafting k, scaled by 1 + drift * round / num_rounds (a growing context);
    a fraction `stalls` of the rounds take 3x as long (another process on the core).
    Returns tokens, seconds and the k chosen in each round."""
    rng = random.Random(seed)
    tokens, seconds, choices = 0, 0.0, []
    for r in range(num_rounds):
        k = policy.choose()
        n = accepted_prefix(acceptance(r), k, rng)
        round_seconds = costs[k] * (1 + drift * r / num_rounds) * math.exp(rng.gauss(0.0, jitter))
        round_seconds *= 3.0 if rng.random() < stalls else 1.0
        policy.update(k, n, round_seconds)
        tokens, seconds = tokens + n + 1, seconds + round_seconds
        choices.append(k)
    return dict(tokens=tokens, seconds=seconds, choices=choices)


def fixed_rates(a: float, costs: List[float]) -> List[float]:
    """Expected tokens per second of each fixed k."""
    return [expected_tokens(a, k) / cost for k, cost in enumerate(costs)]


def policy_rate(costs: List[float], a: float, num_rounds: int, seed: int, stalls: float = 0.0) -> tuple:
    """(tokens per second, mean k) of the adaptive policy at a constant a."""
    run = simulate(DraftLengthPolicy(CAP), costs, lambda r: a, num_rounds, seed=seed, stalls=stalls)
    return run["tokens"] / run["seconds"], sum(run["choices"]) / num_rounds


def short_and_stalled(seed: int) -> List[dict]:
    """Policy / best fixed k over short runs (50 rounds, ~ a 100-300 token answer,
    mean of 20 seeds) and over long runs where 5% of rounds stall 3x (a stall costs
    every k alike, so the best fixed k's rate is divided by the mean stall factor)."""
    rows = []
    for name, costs in PROFILES.items():
        for a in (0.0, 0.9):
            best = max(fixed_rates(a, costs))
            short = [policy_rate(costs, a, 50, seed + s)[0] / best for s in range(20)]
            stalled = policy_rate(costs, a, 2000, seed, stalls=0.05)[0] / (best / 1.1)
            rows.append(dict(profile=name, a=a, short=sum(short) / len(short), stalled=stalled))
    return rows


def table(num_rounds: int, seed: int) -> List[dict]:
    rows = []
    for name, costs in PROFILES.items():
        for a in (0.0, 0.3, 0.5, 0.7, 0.8, 0.9, 0.95):
            rates = fixed_rates(a, costs)
            best = max(range(len(rates)), key=lambda k: rates[k])
            rate, mean_k = policy_rate(costs, a, num_rounds, seed)
            rows.append(dict(profile=name, a=a, policy=rate / rates[0], mean_k=mean_k, best_k=best,
                             best=rates[best] / rates[0], cap=rates[CAP] / rates[0],
                             of_best=rate / rates[best]))
    return rows


def change_run(num_rounds: int, seed: int) -> dict:
    """a = 0.9, then 0, then 0.9 again, a third of the run each, float16 profile."""
    third = num_rounds // 3
    schedule = lambda r: 0.0 if third <= r < 2 * third else 0.9  # noqa: E731
    run = simulate(DraftLengthPolicy(CAP), PROFILES["float16 demo pair (measured)"], schedule, num_rounds, seed=seed)
    return dict(run, third=third)


def write_report(rows: List[dict], extra: List[dict], change: dict, num_rounds: int, seed: int) -> str:
    lines = [
        "# Adaptive draft length: SIMULATION (no model runs)",
        "",
        f"`python benchmarks/draft_policy_sim.py --rounds {num_rounds} --seed {seed}`: synthetic "
        "per-token acceptance a (seeded Bernoulli), synthetic round costs with 10% log-normal "
        "jitter; cap 8. Speeds are tokens per second relative to plain decoding (k = 0 every "
        "round); 'best fixed' is the best k chosen with hindsight (expected value), 'fixed 8' "
        "the cap. See the script's docstring for the cost profiles.",
        "",
        "| cost profile | a | policy | mean k | best fixed k | best fixed | fixed 8 | policy / best |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        lines.append(
            f"| {r['profile']} | {r['a']:.2f} | **{r['policy']:.2f}x** | {r['mean_k']:.2f} | {r['best_k']} "
            f"| {r['best']:.2f}x | {r['cap']:.2f}x | {r['of_best']:.1%} |"
        )
    lines += [
        "",
        "Policy / best fixed k: over short runs of 50 rounds (mean of 20 seeds; the slow start "
        "and the first estimates weigh more), and over long runs where 5% of rounds stall 3x.",
        "",
        "| cost profile | a | short runs | with stalls |",
        "|---|---:|---:|---:|",
    ]
    for r in extra:
        lines.append(f"| {r['profile']} | {r['a']:.2f} | {r['short']:.1%} | {r['stalled']:.1%} |")
    third, choices = change["third"], change["choices"]
    back = next(i for i, k in enumerate(choices[2 * third :]) if k >= 2)
    down = next(i for i, k in enumerate(choices[third:]) if k == 0)
    lines += [
        "",
        f"Acceptance change (float16 profile, {num_rounds} rounds): a = 0.9, then 0 from round {third}, "
        f"then 0.9 from round {2 * third}. The policy reaches k = 0 {down} rounds after the drop and "
        f"drafts k >= 2 again {back} rounds after acceptance returns (probes every 16 rounds, the interval "
        "doubling up to 64 while plain steps stay the best). "
        "Mean k per third: "
        + ", ".join(f"{sum(choices[i * third:(i + 1) * third]) / third:.2f}" for i in range(3))
        + ".",
        "",
        "![k per round](draft_policy_sim.png)",
    ]
    return "\n".join(lines) + "\n"


def write_plot(rows: List[dict], change: dict) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, (left, right) = plt.subplots(1, 2, figsize=(12, 4.5))
    for name in PROFILES:
        mine = [r for r in rows if r["profile"] == name]
        a = [r["a"] for r in mine]
        (line,) = left.plot(a, [r["policy"] for r in mine], "o-", label=f"{name}: policy")
        left.plot(a, [r["best"] for r in mine], "--", color=line.get_color(), label=f"{name}: best fixed k")
    left.axhline(1.0, color="grey", linewidth=0.8)
    left.set(xlabel="per-token acceptance a", ylabel="speed / plain", title="SIMULATION: policy vs best fixed k")
    left.legend(fontsize=7)
    right.plot(change["choices"], linewidth=0.8)
    for boundary in (change["third"], 2 * change["third"]):
        right.axvline(boundary, color="grey", linestyle=":")
    right.set(xlabel="round", ylabel="k chosen", title="SIMULATION: a = 0.9 -> 0 -> 0.9 (float16 costs)")
    figure.tight_layout()
    figure.savefig(RESULTS / "draft_policy_sim.png", dpi=110)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=2000)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    rows = table(args.rounds, args.seed)
    change = change_run(args.rounds, args.seed)
    report = write_report(rows, short_and_stalled(args.seed), change, args.rounds, args.seed)
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "draft_policy_sim.md").write_text(report)
    write_plot(rows, change)
    print(report)


if __name__ == "__main__":
    main()
