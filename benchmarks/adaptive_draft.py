"""Adaptive draft length vs fixed k vs plain decoding, greedy, on the demo target with a
good draft (the demo's distilled draft) and a useless one (the same architecture with
random weights), in one run.

    python benchmarks/adaptive_draft.py [--tokens 80] [--reps 3] [--cap 4] [--blas default|reference]

Issue 14's goals: with a useless draft the defaults stay >= 0.9x plain; with a good one
they are within 5% of the best fixed k (or faster). Configurations run back to back in
an order rotating between repetitions; speedups are per repetition, then the median.
Both models load with `load` (dtype auto: float32 on the CPU). Writes
results/adaptive_draft.md and results/adaptive_draft.png.
"""

import argparse
import os
import platform
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(Path(__file__).parent))
from gdn_prefill import RESULTS  # noqa: E402
from cpu_dtype import tokens_per_second  # noqa: E402
from spec_bench import DRAFT, PROMPTS, TARGET, BLAS_CHOICES, loaded_blas, reexec_with_blas  # noqa: E402


def random_copy(draft):
    """The draft's architecture with random weights: it (almost) never agrees."""
    import mlx.core as mx
    from mlx.utils import tree_flatten, tree_unflatten

    mx.random.seed(0)
    weights = [(k, mx.random.normal(v.shape).astype(v.dtype) * 0.05) for k, v in tree_flatten(draft.parameters())]
    draft.update(tree_unflatten(weights))
    return draft


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tokens", type=int, default=80)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--cap", type=int, default=4, help="num_draft_tokens: the adaptive cap and the largest fixed k")
    parser.add_argument("--blas", choices=BLAS_CHOICES, default="default")
    args = parser.parse_args()
    reexec_with_blas(args.blas)
    sys.path.insert(0, str(ROOT))
    import mlx.core as mx
    from mlx_lm import load
    from mlx_lm.generate import SpeculationStats, generate_step, speculative_generate_step

    target, tokenizer = load(str(TARGET))
    drafts = {"distilled draft": load(str(DRAFT))[0], "random-weight draft": random_copy(load(str(DRAFT))[0])}
    prompts = [tokenizer.encode(p) for p in PROMPTS]
    blas = loaded_blas()
    print(f"BLAS: {blas}", flush=True)
    configs = [("plain", None, None)]
    for name in drafts:
        configs += [(name, "adaptive", args.cap)] + [(name, "fixed", k) for k in range(1, args.cap + 1)]
    samples = {c: [] for c in configs}
    mean_k = {c: [] for c in configs}

    def step_fn(config, stats):
        name, mode, k = config
        if mode is None:
            return lambda p: generate_step(p, target, max_tokens=args.tokens)
        return lambda p: speculative_generate_step(p, target, drafts[name], num_draft_tokens=k, max_tokens=args.tokens,
                                                   adaptive_draft_length=mode == "adaptive", stats=stats)

    for config in configs:  # warm up every path
        tokens_per_second(step_fn(config, SpeculationStats()), prompts[:1], 8)
    started = time.time()
    for rep in range(args.reps):
        shift = rep * len(configs) // args.reps
        for config in configs[shift:] + configs[:shift]:
            stats = SpeculationStats()
            samples[config].append(tokens_per_second(step_fn(config, stats), prompts, args.tokens))
            mean_k[config].append(stats.mean_draft_length)
        print(f"rep {rep + 1}/{args.reps} done", flush=True)
    plain = samples[configs[0]]  # tokens/s per repetition
    speedup = {c: statistics.median(s / p for p, s in zip(plain, samples[c])) for c in configs}

    lines = [
        "# Adaptive draft length vs fixed k (greedy, demo target)",
        "",
        f"- BLAS: {blas}",
        f"- machine: {platform.processor() or platform.machine()}, {os.cpu_count()} cores (shared), mlx {mx.__version__}",
        f"- {len(prompts)} prompts x {args.tokens} tokens, {args.reps} repetitions "
        f"({(time.time() - started) / 60:.1f} min); float32 (load's auto dtype on the CPU)",
        "- command: `python benchmarks/adaptive_draft.py" + "".join(f" {a}" for a in sys.argv[1:]) + "`",
        f"- plain decoding: {statistics.median(plain):.1f} tok/s",
        "",
        "| draft | draft length | tok/s | vs plain | mean k |",
        "|---|---|---:|---:|---:|",
    ]
    for config in configs[1:]:
        name, mode, k = config
        label = f"adaptive, cap {k}" if mode == "adaptive" else f"fixed k={k}"
        lines.append(f"| {name} | {label} | {statistics.median(samples[config]):.1f} | "
                     f"**{speedup[config]:.2f}x** | {statistics.mean(mean_k[config]):.2f} |")
    lines.append("")
    for name in drafts:
        adaptive = speedup[(name, "adaptive", args.cap)]
        best = max(speedup[(name, "fixed", k)] for k in range(1, args.cap + 1))
        lines.append(f"- {name}: adaptive {adaptive:.2f}x plain, best fixed k {best:.2f}x "
                     f"(adaptive / best fixed: {adaptive / best:.0%})")
    report = "\n".join(lines) + "\n"
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "adaptive_draft.md").write_text(report)
    print(report)

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4))
    ks = list(range(1, args.cap + 1))
    for i, name in enumerate(drafts):
        ax.plot(ks, [speedup[(name, "fixed", k)] for k in ks], "o-", color=f"C{i}", label=f"{name}, fixed k")
        ax.axhline(speedup[(name, "adaptive", args.cap)], color=f"C{i}", linestyle="--",
                   label=f"{name}, adaptive (cap {args.cap})")
    ax.axhline(1.0, color="grey", lw=0.8)
    ax.set_xticks(ks)
    ax.set_xlabel("draft length k")
    ax.set_ylabel("speedup over plain greedy decoding")
    ax.set_title(f"demo target, float32; {blas.split(' preloaded')[0]}", fontsize=9)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(RESULTS / "adaptive_draft.png", dpi=120)


if __name__ == "__main__":
    main()
