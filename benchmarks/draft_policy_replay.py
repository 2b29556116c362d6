"""The adaptive draft length replayed on recorded demo-pair outputs: deterministic,
so settings can be compared without the machine's noise.

    python benchmarks/draft_policy_replay.py [--tokens 80 160] [--seeds 5] [--blas default|reference]

1. Record, for each of 8 code prompts and 160 tokens, what a draft at each position
   would do: greedy, whether the draft's argmax equals the target's token (the
   target's own greedy output; in greedy decoding a draft is accepted exactly when
   it matches, so a round's outcome follows from these flags); sampled (T = 0.7 and
   1.0, top_p 0.95, along a seeded sample of the target), the acceptance probability
   sum min(p, q) of speculative sampling at that position.
2. Measure round costs on this machine: a plain step, and a round drafting k = 1..cap
   (greedy: cap 4, as adaptive_draft.py; sampled: cap 3, the CLI's default), the
   median of the round times the loop reports to its policy (fixed k, 3 prompts).
3. Replay: each 'call' decodes `--tokens` tokens of one recorded output with a fresh
   policy; a round drafting k at position p accepts the flags' agreeing prefix
   (greedy) or Bernoulli draws of the recorded probabilities (sampled, seeded), and
   costs its measured seconds times 5% log-normal jitter. Reported per setting: speed
   relative to plain decoding and to the best fixed k (chosen with hindsight over all
   calls), and the mean k, summed over prompts and `--seeds` jitter seeds.

What the replay leaves out: the loop's own overhead beyond round times (the draft's
prefill, setup; a few % of an 80-token call, see spec_sampling.py), and
that the flags of a sampled run belong to one sample path. Writes
results/draft_policy_replay.md and .png.
"""

import argparse
import math
import platform
import random
import statistics
import sys
import time
from pathlib import Path
from typing import Dict, List, Tuple

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(Path(__file__).parent))
from gdn_prefill import RESULTS  # noqa: E402
from spec_bench import DRAFT, PROMPTS, TARGET, BLAS_CHOICES, loaded_blas, reexec_with_blas  # noqa: E402

MORE_PROMPTS = ["def quicksort(items):", "def read_json(path):\n    with open(path) as f:",
                "class Node:\n    def __init__(self, value):", "def is_prime(n):", "for i in range(10):"]
RECORDED_TOKENS = 160
SETTINGS = {  # name -> DraftLengthPolicy keyword arguments
    "defaults": {},
    "no plain rounds first": dict(plain_rounds_first=0),
    "no optimism": dict(optimism=0.0),
    "neither": dict(plain_rounds_first=0, optimism=0.0),
}


def record(target, draft, tokenizer, temp: float) -> list:
    """Per prompt, per position: the draft's acceptance (see the module docstring)."""
    import mlx.core as mx
    from mlx_lm.generate import generate_step
    from mlx_lm.sample_utils import make_sampler

    sampler = make_sampler(temp, top_p=0.95)
    traces = []
    for i, prompt in enumerate(PROMPTS + MORE_PROMPTS):
        ids = tokenizer.encode(prompt)
        mx.random.seed(i)
        steps = generate_step(mx.array(ids), target, max_tokens=RECORDED_TOKENS, sampler=sampler)
        output = [token for token, _ in steps]
        sequence = mx.array(ids + output)[None]
        target_logits = target(sequence)[0, len(ids) - 1 : -1]
        draft_logits = draft(sequence)[0, len(ids) - 1 : -1]
        if temp == 0:
            traces.append((mx.argmax(draft_logits, axis=-1) == mx.array(output)).astype(mx.float32).tolist())
            continue
        laws = [mx.exp(sampler.distribution(x - mx.logsumexp(x, axis=-1, keepdims=True)))
                for x in (target_logits, draft_logits)]
        traces.append(mx.minimum(*laws).sum(axis=-1).tolist())
    return traces


def measure_costs(target, draft, tokenizer, temp: float, cap: int) -> list:
    """Median seconds of a round drafting k = 0..cap, as the loop times it."""
    import mlx.core as mx
    import mlx_lm.speculative as speculative
    from mlx_lm.draft_length import DraftLengthPolicy
    from mlx_lm.generate import speculative_generate_step
    from mlx_lm.sample_utils import make_sampler

    times = {k: [] for k in range(cap + 1)}

    class Pinned(DraftLengthPolicy):
        def __init__(self, max_draft_tokens, **_):
            super().__init__(max_draft_tokens, adaptive=False)
            self.pinned = Pinned.k

        def choose(self):
            return self.pinned

        def choose_after_plain(self):
            return self.pinned

        def update(self, num_draft, num_accepted, round_seconds):
            super().update(num_draft, num_accepted, round_seconds)
            if self.num_rounds > 2:
                times[num_draft].append(round_seconds)

    sampler = make_sampler(temp, top_p=0.95)
    original = speculative.DraftLengthPolicy
    speculative.DraftLengthPolicy = Pinned
    try:
        for k in [0] + list(range(1, cap + 1)):
            Pinned.k = k
            for i, prompt in enumerate(PROMPTS * 2):
                mx.random.seed(i)
                for _ in speculative_generate_step(mx.array(tokenizer.encode(prompt)), target, draft,
                                                   num_draft_tokens=cap, max_tokens=80, sampler=sampler):
                    pass
    finally:
        speculative.DraftLengthPolicy = original
    return [statistics.median(times[k]) for k in range(cap + 1)]


def replay(policy, trace: list, costs: list, num_tokens: int, rng: random.Random, fixed_k=None):
    """(seconds, choices) of one call decoding num_tokens tokens of `trace`."""
    greedy = all(x in (0.0, 1.0) for x in trace)
    position, seconds, choices = 0, 0.0, []
    while position < num_tokens:
        k = min(policy.choose() if fixed_k is None else fixed_k, num_tokens - position)
        n = 0
        while n < k and (trace[position + n] == 1.0 if greedy else rng.random() < trace[position + n]):
            n += 1
        round_seconds = costs[k] * math.exp(rng.gauss(0.0, 0.05))
        policy.update(k, n, round_seconds)
        seconds, position = seconds + round_seconds, position + n + 1
        choices.append(k)
    return seconds, choices


def evaluate(traces, costs, num_tokens: int, seeds: int) -> dict:
    from mlx_lm.draft_length import DraftLengthPolicy

    cap = len(costs) - 1
    plain = num_tokens * costs[0] * seeds * len(traces)
    fixed = {k: 0.0 for k in range(1, cap + 1)}
    results = {}
    for name, settings in SETTINGS.items():
        seconds, choices = 0.0, []
        for seed in range(seeds):
            for trace in traces:
                spent, chosen = replay(DraftLengthPolicy(cap, **settings), trace, costs, num_tokens, random.Random(seed))
                seconds, choices = seconds + spent, choices + chosen
                if name == "defaults":
                    for k in fixed:
                        fixed[k] += replay(DraftLengthPolicy.fixed(k), trace, costs, num_tokens,
                                           random.Random(seed), fixed_k=k)[0]
        results[name] = dict(vs_plain=plain / seconds, mean_k=statistics.mean(choices))
    best_k = min(fixed, key=fixed.get)
    for row in results.values():
        row["vs_best"] = row["vs_plain"] * fixed[best_k] / plain
    return dict(settings=results, best_k=best_k, best_vs_plain=plain / fixed[best_k])


def plot_groups(path: Path, groups: List[str], series: Dict[str, List[float]], reference: Tuple[str, List[float]],
                *, ylabel: str, title: str, figsize=(8, 4), group_fontsize=None, bottom=None) -> None:
    """A bar per series in each group, then the reference's (grey), and a line at 1.0;
    written to `path` (also batch_policy_replay.py's plot)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, ax = plt.subplots(figsize=figsize)
    width = 0.8 / (len(series) + 1)
    positions = range(len(groups))
    for i, (name, values) in enumerate(series.items()):
        ax.bar([g + i * width for g in positions], values, width, label=name)
    ax.bar([g + len(series) * width for g in positions], reference[1], width, label=reference[0], color="grey")
    ax.axhline(1.0, color="black", linewidth=0.8)
    ax.set_xticks([g + 0.4 - width / 2 for g in positions], groups, fontsize=group_fontsize)
    if bottom is not None:
        ax.set_ylim(bottom=bottom)
    ax.set(ylabel=ylabel, title=title)
    ax.legend(fontsize=8)
    figure.tight_layout()
    figure.savefig(path, dpi=120)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tokens", type=int, nargs="+", default=[80, 160])
    parser.add_argument("--seeds", type=int, default=5)
    parser.add_argument("--blas", choices=BLAS_CHOICES, default="default")
    args = parser.parse_args()
    if max(args.tokens) > RECORDED_TOKENS:
        parser.error(f"--tokens at most {RECORDED_TOKENS}, the recorded length")
    reexec_with_blas(args.blas)
    sys.path.insert(0, str(ROOT))
    import mlx.core as mx
    from mlx_lm import load

    started = time.time()
    target, tokenizer = load(str(TARGET))
    draft = load(str(DRAFT))[0]
    cases = {"greedy": (0.0, 4), "T=0.7, top_p 0.95": (0.7, 3), "T=1.0, top_p 0.95": (1.0, 3)}
    rows = []
    for label, (temp, cap) in cases.items():
        traces = record(target, draft, tokenizer, temp)
        costs = measure_costs(target, draft, tokenizer, temp, cap)
        mean_acceptance = statistics.mean(x for trace in traces for x in trace)
        for num_tokens in args.tokens:
            rows.append(dict(case=label, tokens=num_tokens, costs=costs, acceptance=mean_acceptance,
                             **evaluate(traces, costs, num_tokens, args.seeds)))
        print(f"{label} done", flush=True)

    lines = [
        "# Adaptive draft length replayed on recorded demo-pair outputs",
        "",
        f"- command: `python benchmarks/draft_policy_replay.py{''.join(' ' + a for a in sys.argv[1:])}` "
        f"({(time.time() - started) / 60:.1f} min)",
        f"- BLAS (round costs): {loaded_blas()}; mlx {mx.__version__}, {platform.machine()}, float32",
        f"- {len(PROMPTS + MORE_PROMPTS)} code prompts, {RECORDED_TOKENS} tokens recorded each; "
        f"{args.seeds} jitter seeds; see the script's docstring for what is replayed",
        "",
        "| decoding | tokens / call | mean acceptance | round ms, k = 0.. | best fixed k (vs plain) | setting "
        "| vs plain | vs best fixed k | mean k |",
        "|---|---:|---:|---|---|---|---:|---:|---:|",
    ]
    for row in rows:
        for name, result in row["settings"].items():
            lines.append(
                f"| {row['case']} | {row['tokens']} | {row['acceptance']:.2f} | "
                f"{', '.join(f'{c * 1e3:.1f}' for c in row['costs'])} | k={row['best_k']} "
                f"({row['best_vs_plain']:.2f}x) | {name} | **{result['vs_plain']:.3f}x** | "
                f"{result['vs_best']:.3f} | {result['mean_k']:.2f} |")
    lines += ["", "![replay](draft_policy_replay.png)"]
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "draft_policy_replay.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))

    plot_groups(RESULTS / "draft_policy_replay.png", [f"{r['case']}\n{r['tokens']} tokens" for r in rows],
                {name: [r["settings"][name]["vs_plain"] for r in rows] for name in SETTINGS},
                ("best fixed k (hindsight)", [r["best_vs_plain"] for r in rows]),
                ylabel="speed / plain decoding", title="Draft-length policy replayed on recorded outputs (demo pair)",
                figsize=(10, 4.5), group_fontsize=8)


if __name__ == "__main__":
    main()
