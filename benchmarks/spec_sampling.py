"""Sampled speculative decoding on the demo pair (examples/models/): speculative
(rejection) sampling vs token matching vs plain sampled decoding, in one run.

    python benchmarks/spec_sampling.py [--tokens 80] [--reps 3] [--temps 0.7 1.0] [--blas auto|openblas|reference]

Both models load with `mlx_lm.utils.load` (dtype auto: float32 on the CPU). The sampler
is make_sampler(temp, top_p=0.95) for every run. Speculative sampling is what
speculative_generate_step does with that sampler (a CategoricalSampler: it knows its
law); token matching is the same sampler wrapped in a plain function, which hides the
law, so the loop falls back to accepting the drafts equal to the target's own draws.

For each temperature and each repetition the configurations run back to back in an
order that rotates between repetitions (plain; the defaults, an adaptive draft length of
at most 3; then for k = 1..max-k, pinned, rejection and matching), every one with the same seed per prompt, so load from other users of the
machine hits all alike. tok/s is the generated tokens over the wall time of the whole
call (prefill included; the prompts are short), summed over the code prompts; a speedup
is the ratio to plain decoding's time in the same repetition, then the median over
repetitions. Acceptance = accepted / drafted tokens, summed over prompts and
repetitions. OpenBLAS is preloaded when installed (one thread), as in spec_bench.py.
Writes results/spec_sampling.md and results/spec_sampling.png.
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
from spec_bench import DRAFT, PROMPTS, TARGET, loaded_blas, model_line, reexec_with_blas  # noqa: E402

TOP_P = 0.95
CLI_DEFAULT_K = 3  # mlx_lm.generate --num-draft-tokens


def run_once(step_fn, prompts, tokens: int, seed: int):
    """Seconds for `tokens` tokens from each prompt, every prompt seeded alike."""
    import mlx.core as mx

    seconds = 0.0
    for i, prompt in enumerate(prompts):
        mx.random.seed(seed + i)
        start = time.perf_counter()
        for n, _ in enumerate(step_fn(mx.array(prompt)), 1):
            if n == tokens:
                break
        seconds += time.perf_counter() - start
    return seconds


def measure(target, draft, prompts, temp: float, args) -> dict:
    """{config: {"seconds": [per rep], "accepted", "drafted", "forwards"}} for one temperature."""
    from mlx_lm.generate import SpeculationStats, generate_step, speculative_generate_step
    from mlx_lm.sample_utils import make_sampler

    sampler = make_sampler(temp, top_p=TOP_P)

    def matching(logprobs):  # a plain function: no law, so token matching
        return sampler(logprobs)

    configs = [("plain", 0), ("adaptive", CLI_DEFAULT_K)]
    configs += [(rule, k) for k in range(1, args.max_k + 1) for rule in ("rejection", "matching")]
    results = {c: dict(seconds=[], accepted=0, drafted=0, forwards=0) for c in configs}

    def step_fn(rule, k, stats):
        if rule == "plain":
            return lambda p: generate_step(p, target, max_tokens=args.tokens, sampler=sampler)
        # "adaptive": the defaults (draft length chosen per round, at most k); the others pin k.
        chosen = matching if rule == "matching" else sampler
        return lambda p: speculative_generate_step(p, target, draft, num_draft_tokens=k, max_tokens=args.tokens,
                                                   sampler=chosen, stats=stats,
                                                   adaptive_draft_length=rule == "adaptive")

    run_once(step_fn("rejection", 2, SpeculationStats()), prompts[:1], 8, 0)  # warm-up
    for rep in range(args.reps):
        shift = rep * len(configs) // args.reps
        for rule, k in configs[shift:] + configs[:shift]:
            stats = SpeculationStats()
            seconds = run_once(step_fn(rule, k, stats), prompts, args.tokens, seed=1000 * rep)
            row = results[(rule, k)]
            row["seconds"].append(seconds)
            row["accepted"] += stats.num_accepted
            row["drafted"] += stats.num_drafted
            row["forwards"] += stats.num_target_forwards
            row.setdefault("draft_lengths", []).append(stats.mean_draft_length)
        print(f"T={temp} rep {rep + 1}/{args.reps} done", flush=True)
    total_tokens = args.tokens * len(prompts)
    plain = results[("plain", 0)]["seconds"]
    for (rule, k), row in results.items():
        row["tok_s"] = total_tokens / statistics.median(row["seconds"])
        row["speedup"] = statistics.median(p / s for p, s in zip(plain, row["seconds"]))
        row["rate"] = row["accepted"] / row["drafted"] if row["drafted"] else None
        row["per_forward"] = total_tokens * args.reps / row["forwards"] if row["forwards"] else None
        row["mean_k"] = statistics.mean(row["draft_lengths"]) if row.get("draft_lengths") else 0.0
    return results


def write_report(all_results, header, args) -> str:
    lines = ["# Speculative sampling on the demo pair", "", *header, ""]
    at = all_results.get(0.7) or next(iter(all_results.values()))
    temp_at = 0.7 if 0.7 in all_results else next(iter(all_results))
    best = max(range(1, args.max_k + 1), key=lambda k: at[("rejection", k)]["speedup"])
    lines += [
        "## Goal (issue 14): sampled speculative decoding >= 1.0x plain at T=0.7",
        "",
        f"- T={temp_at}, top_p {TOP_P}, k={CLI_DEFAULT_K} (the CLI's default): rejection sampling "
        f"**{at[('rejection', CLI_DEFAULT_K)]['speedup']:.2f}x** plain "
        f"(token matching {at[('matching', CLI_DEFAULT_K)]['speedup']:.2f}x)"
        if args.max_k >= CLI_DEFAULT_K else f"- k={CLI_DEFAULT_K} not measured",
        f"- best fixed k: k={best}, **{at[('rejection', best)]['speedup']:.2f}x** "
        f"(acceptance {at[('rejection', best)]['rate']:.1%})",
        f"- defaults (adaptive draft length, at most {CLI_DEFAULT_K}): "
        f"**{at[('adaptive', CLI_DEFAULT_K)]['speedup']:.2f}x** plain, mean draft length "
        f"{at[('adaptive', CLI_DEFAULT_K)]['mean_k']:.2f}",
        "",
    ]
    for temp, results in all_results.items():
        plain = results[("plain", 0)]
        lines += [
            f"## T = {temp}, top_p {TOP_P}: plain sampled decoding {plain['tok_s']:.1f} tok/s",
            "",
            f"Defaults (adaptive draft length, at most {CLI_DEFAULT_K}, speculative sampling): "
            f"{results[('adaptive', CLI_DEFAULT_K)]['tok_s']:.1f} tok/s, "
            f"**{results[('adaptive', CLI_DEFAULT_K)]['speedup']:.2f}x**, acceptance "
            f"{results[('adaptive', CLI_DEFAULT_K)]['rate'] or 0:.1%}, mean draft length "
            f"{results[('adaptive', CLI_DEFAULT_K)]['mean_k']:.2f}. Fixed draft lengths:",
            "",
            "| k | acceptance: rejection | acceptance: matching | tokens / forward: rejection | "
            "tok/s: rejection | tok/s: matching | speedup: rejection | speedup: matching |",
            "|---:|---:|---:|---:|---:|---:|---:|---:|",
        ]
        for k in range(1, args.max_k + 1):
            r, m = results[("rejection", k)], results[("matching", k)]
            lines.append(
                f"| {k} | {r['rate']:.1%} | {m['rate']:.1%} | {r['per_forward']:.2f} | {r['tok_s']:.1f} | "
                f"{m['tok_s']:.1f} | **{r['speedup']:.2f}x** | {m['speedup']:.2f}x |"
            )
        lines.append("")
    text = "\n".join(lines)
    (RESULTS / "spec_sampling.md").write_text(text)
    return text


def write_plot(all_results, args) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ks = list(range(1, args.max_k + 1))
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.2))
    for i, (temp, results) in enumerate(all_results.items()):
        for rule, style in (("rejection", "o-"), ("matching", "s--")):
            label = f"T={temp}, {'speculative sampling' if rule == 'rejection' else 'token matching'}"
            left.plot(ks, [results[(rule, k)]["speedup"] for k in ks], style, color=f"C{i}", label=label)
            right.plot(ks, [results[(rule, k)]["rate"] for k in ks], style, color=f"C{i}", label=label)
    for axis in (left, right):
        axis.set_xticks(ks)
    left.axhline(1, color="grey", lw=0.8)
    left.set_xlabel("num_draft_tokens k")
    left.set_ylabel("speedup over plain sampled decoding")
    left.set_title(f"demo pair, top_p {TOP_P}")
    left.legend(fontsize=8)
    right.set_xlabel("num_draft_tokens k")
    right.set_ylabel("acceptance (accepted / drafted)")
    right.set_ylim(0, 1)
    right.set_title("acceptance")
    fig.tight_layout()
    fig.savefig(RESULTS / "spec_sampling.png", dpi=120)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tokens", type=int, default=80, help="tokens generated per prompt")
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--max-k", type=int, default=4)
    parser.add_argument("--temps", type=float, nargs="+", default=[0.7, 1.0])
    parser.add_argument("--blas", choices=["auto", "openblas", "reference"], default="auto")
    args = parser.parse_args()
    reexec_with_blas(args.blas)
    sys.path.insert(0, str(ROOT))
    import mlx.core as mx
    from mlx_lm.utils import compute_dtype, load, parameter_dtypes

    target, tokenizer = load(str(TARGET))
    draft, _ = load(str(DRAFT))
    prompts = [tokenizer.encode(p) for p in PROMPTS]
    blas = loaded_blas()
    dtype = f"{parameter_dtypes(target)} ({compute_dtype(None)[1]})"
    print(f"BLAS: {blas}\nCompute dtype: {dtype}", flush=True)
    header = [
        f"- BLAS: {blas}",
        f"- compute dtype: {dtype}",
        f"- machine: {platform.processor() or platform.machine()}, {os.cpu_count()} cores (shared), mlx {mx.__version__}",
        f"- target {model_line(TARGET, target)}",
        f"- draft {model_line(DRAFT, draft)}",
        f"- {len(PROMPTS)} code prompts x {args.tokens} tokens, {args.reps} repetitions (configurations in "
        "rotating order, same seeds), speedup = median of per-repetition time ratios to plain sampled decoding",
    ]
    started = time.time()
    all_results = {temp: measure(target, draft, prompts, temp, args) for temp in args.temps}
    header.append(f"- benchmark wall time {(time.time() - started) / 60:.1f} min")
    RESULTS.mkdir(exist_ok=True)
    print(write_report(all_results, header, args))
    write_plot(all_results, args)


if __name__ == "__main__":
    main()
