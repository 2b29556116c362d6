"""MTP self-speculation on the demo target (examples/models/qwen3-next-stdlib and its
trained head, `mtp.*`) against plain decoding and against the demo draft model, side by
side in one run.

    python benchmarks/mtp_bench.py [--tokens 80] [--reps 3] [--blas auto|openblas|reference]

Greedy throughout, so every speculative output must equal the plain one token for token
(checked). For every configuration and prompt, plain decoding and the speculative run
go back to back, so load from the machine's other users hits both alike; a speedup is
the ratio of the paired times summed over the prompts (spec_bench.py's prompts), the
median over repetitions. Configurations: the MTP head at a fixed k = 1..--max-k (the
head applied k times a round, each time to its own output hidden state), the MTP head
with the adaptive draft length (cap --max-k), and the demo draft model at fixed k = 3
and 4 (its README settings). Acceptance per depth j (fixed k): of the rounds whose
first j - 1 drafts were accepted, the fraction whose j-th was too. As spec_bench.py,
it re-executes itself with OpenBLAS preloaded when installed (one thread) and prints
which BLAS and dtype ran. Writes results/mtp_bench.md and results/mtp_bench.png.
"""

import argparse
import os
import platform
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from spec_bench import (  # noqa: E402
    DRAFT,
    PROMPTS,
    RESULTS,
    ROOT,
    TARGET,
    loaded_blas,
    model_line,
    reexec_with_blas,
    round_stats,
    timed_generation,
)

DRAFT_KS = (3, 4)


def per_depth(flags, k: int, tokens: int) -> list:
    """Acceptance at depth 1..k: accepted / reached, from rounds rebuilt from the flags."""
    reached, accepted = [0] * k, [0] * k
    for run in flags:
        done = n = 0
        for from_draft in run:
            if from_draft:
                n += 1
                continue
            for j in range(min(k, tokens - done - 1)):
                reached[j] += n >= j
                accepted[j] += n > j
            done += n + 1
            n = 0
    return [a / r if r else None for a, r in zip(accepted, reached)]


def configurations(target, draft, args) -> dict:
    from mlx_lm.generate import speculative_generate_step

    def spec(**kwargs):
        return lambda p: speculative_generate_step(p, target, max_tokens=args.tokens, **kwargs)

    configs = {f"MTP k={k}": (k, spec(mtp=True, num_draft_tokens=k, adaptive_draft_length=False))
               for k in range(1, args.max_k + 1)}
    configs[f"MTP adaptive (cap {args.max_k})"] = (None, spec(mtp=True, num_draft_tokens=args.max_k))
    for k in DRAFT_KS:
        configs[f"draft model k={k}"] = (k, spec(draft_model=draft, num_draft_tokens=k, adaptive_draft_length=False))
    return configs


def measure(target, draft, prompts, args) -> dict:
    from mlx_lm.generate import generate_step

    def plain(p):
        return generate_step(p, target, max_tokens=args.tokens)

    configs = configurations(target, draft, args)
    timed_generation(plain, prompts[:1], 8)  # warm-up
    results = {name: dict(speedups=[], plain_tps=[], spec_tps=[], plain_seconds=[], spec_seconds=[])
               for name in configs}
    reference = None
    for rep in range(args.reps):
        for name, (k, step_fn) in configs.items():
            plain_seconds = spec_seconds = 0.0
            outputs, flags = [], []
            for prompt in prompts:
                seconds, out, _ = timed_generation(plain, [prompt], args.tokens)
                plain_seconds += seconds
                seconds, spec_out, spec_flags = timed_generation(step_fn, [prompt], args.tokens)
                spec_seconds += seconds
                assert spec_out == out, f"{name}: speculative output differs from plain"
                outputs += out
                flags += spec_flags
            reference = reference or outputs
            total = sum(len(o) for o in outputs)
            row = results[name]
            row["speedups"].append(plain_seconds / spec_seconds)
            row["plain_seconds"].append(plain_seconds)
            row["spec_seconds"].append(spec_seconds)
            row["plain_tps"].append(total / plain_seconds)
            row["spec_tps"].append(total / spec_seconds)
            if k is not None:
                row.update(round_stats(flags, k, args.tokens), depth=per_depth(flags, k, args.tokens))
            print(f"rep {rep + 1}/{args.reps} {name}: {row['speedups'][-1]:.2f}x", flush=True)
    for row in results.values():
        row["speedup"] = statistics.median(row["speedups"])
        # Interference from the machine's other users only adds time: best against best.
        row["best_speedup"] = min(row["plain_seconds"]) / min(row["spec_seconds"])
    return results


def adaptive_stats(target, prompts, args) -> dict:
    """Acceptance and mean draft length of the adaptive MTP run (one pass)."""
    import mlx.core as mx
    from mlx_lm.generate import SpeculationStats, speculative_generate_step

    stats = SpeculationStats()
    for prompt in prompts:
        for _ in speculative_generate_step(mx.array(prompt), target, mtp=True, num_draft_tokens=args.max_k,
                                           max_tokens=args.tokens, stats=stats):
            pass
    return dict(rate=stats.acceptance_rate, mean_k=stats.mean_draft_length, lengths=stats.draft_lengths)


def write_report(results, adaptive, header, args) -> str:
    lines = ["# MTP self-speculation on the demo target", "", *header, "",
             f"Greedy, {len(PROMPTS)} prompts x {args.tokens} tokens, median of {args.reps} repetitions; "
             "speedup = paired plain time / speculative time (same prompts, back to back), median over "
             "repetitions; best-time speedup = the fastest plain repetition / the fastest speculative one "
             "(the machine is shared: other load only adds time). Output equal to plain decoding in every run.", "",
             "| drafter | speedup (median of pairs) | best-time speedup | plain tok/s | speculative tok/s | "
             "accepted / drafted | tokens per forward | acceptance at depth 1, 2, ... |",
             "|---|---:|---:|---:|---:|---:|---:|---|"]
    for name, row in results.items():
        depth = ", ".join("-" if d is None else f"{d:.2f}" for d in row.get("depth", []))
        rate = f"{row['rate']:.1%}" if "rate" in row else f"{adaptive['rate']:.1%} (mean k {adaptive['mean_k']:.2f})"
        per_forward = f"{row['tokens_per_round']:.2f}" if "tokens_per_round" in row else "-"
        lines.append(f"| {name} | {row['speedup']:.2f}x | {row['best_speedup']:.2f}x | "
                     f"{statistics.median(row['plain_tps']):.1f} | "
                     f"{statistics.median(row['spec_tps']):.1f} | {rate} | {per_forward} | {depth or '-'} |")
    best_mtp = max((n for n in results if n.startswith("MTP")), key=lambda n: results[n]["speedup"])
    best_draft = max((n for n in results if n.startswith("draft")), key=lambda n: results[n]["speedup"])
    lines += ["", f"Best MTP: {best_mtp}, {results[best_mtp]['speedup']:.2f}x (goal >= 1.3x: "
              f"{'met' if results[best_mtp]['speedup'] >= 1.3 else 'not met'}); best draft model: {best_draft}, "
              f"{results[best_draft]['speedup']:.2f}x.",
              f"Adaptive MTP draft lengths (rounds per k): {adaptive['lengths']}.", "",
              "Command: `python benchmarks/mtp_bench.py "
              f"--tokens {args.tokens} --reps {args.reps} --max-k {args.max_k}`"]
    text = "\n".join(lines) + "\n"
    (RESULTS / "mtp_bench.md").write_text(text)
    return text


def write_plot(results, args) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.2))
    names = list(results)
    left.barh(names, [results[n]["speedup"] for n in names],
              color=["C0" if n.startswith("MTP") else "C1" for n in names])
    left.axvline(1, color="grey", lw=0.8)
    left.axvline(1.3, color="C3", lw=0.8, ls="--", label="goal 1.3x")
    left.set_xlabel("speedup over plain decoding (greedy)")
    left.invert_yaxis()
    left.legend()
    for name in names:
        depth = results[name].get("depth")
        if depth:
            right.plot(range(1, len(depth) + 1), depth, "o-", label=name)
    right.set_xlabel("draft depth j")
    right.set_ylabel("P(draft j accepted | drafts before it were)")
    right.set_ylim(0, 1)
    right.legend(fontsize=8)
    fig.suptitle("demo qwen3_next target: its MTP head vs the demo draft model")
    fig.tight_layout()
    fig.savefig(RESULTS / "mtp_bench.png", dpi=120)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tokens", type=int, default=80, help="tokens generated per prompt")
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--max-k", type=int, default=3, help="largest fixed MTP depth, and the adaptive cap")
    parser.add_argument("--blas", choices=["auto", "openblas", "reference"], default="auto")
    args = parser.parse_args()
    reexec_with_blas(args.blas)
    sys.path.insert(0, str(ROOT))
    import mlx.core as mx
    from mlx_lm import load
    from mlx_lm.utils import compute_dtype, parameter_dtypes

    target, tokenizer = load(str(TARGET))
    draft, _ = load(str(DRAFT))
    prompts = [tokenizer.encode(p) for p in PROMPTS]
    blas = loaded_blas()
    dtype = f"{parameter_dtypes(target)} ({compute_dtype(None)[1]})"
    print(f"BLAS: {blas}\ndtype: {dtype}", flush=True)
    header = [f"- BLAS: {blas}", f"- dtype: {dtype}",
              f"- machine: {platform.processor() or platform.machine()}, {os.cpu_count()} cores (shared), "
              f"mlx {mx.__version__}",
              f"- target {model_line(TARGET, target)} (the MTP head included)",
              f"- draft {model_line(DRAFT, draft)}"]
    started = time.time()
    results = measure(target, draft, prompts, args)
    adaptive = adaptive_stats(target, prompts, args)
    header.append(f"- benchmark wall time {(time.time() - started) / 60:.1f} min")
    RESULTS.mkdir(exist_ok=True)
    print(write_report(results, adaptive, header, args))
    write_plot(results, args)


if __name__ == "__main__":
    main()
