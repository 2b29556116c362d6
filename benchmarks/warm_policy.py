"""Short speculative calls in one process: the draft-length policy cold (what every
call got before draft_length.DRAFT_LENGTHS) vs warm (starting from what the earlier
calls of the pair learned) vs fixed draft lengths vs plain decoding (issue 29 item 2).

    [MLX_LM_REFERENCE_BLAS=1] python benchmarks/warm_policy.py [--tokens 48] [--reps 3] [--label default]

Cases, each on spec_bench.py's 3 prompts, in process, configurations interleaved in
an order rotating between repetitions, speed = tokens / seconds summed over the
prompts, ratios per repetition then the median:
- the demo pair (distilled draft), greedy: plain, defaults cold (DRAFT_LENGTHS
  forgotten before each call), defaults warm, fixed k = 1..4 (cap 4);
- the same at T = 0.7, top_p 0.95 (cap 3, the CLI's default): plain, cold, warm;
- a random-weight draft (the draft's architecture, random weights), greedy: plain,
  cold, warm;
- the MTP head, greedy, 100 tokens a call (the CLI's `--mtp` run): cold (a fresh
  process's one call), warm and fixed k = 3; tokens per target forward and speed.
Which BLAS ran (fast_blas.blas_in_use: MKL on the default install, the wheel's
reference BLAS with MLX_LM_REFERENCE_BLAS=1) and the dtype are printed. Writes
results/warm_policy_<label>.md and .png.
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
from adaptive_draft import random_copy  # noqa: E402
from gdn_prefill import RESULTS  # noqa: E402
from spec_bench import DRAFT, PROMPTS, TARGET  # noqa: E402


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tokens", type=int, default=48)
    parser.add_argument("--mtp-tokens", type=int, default=100)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--label", default="default", help="names the output files (e.g. default, reference)")
    args = parser.parse_args()
    sys.path.insert(0, str(ROOT))
    from mlx_lm import load  # first: it loads the fast BLAS (fast_blas.py) before mlx.core

    import mlx.core as mx
    from mlx_lm.draft_length import DRAFT_LENGTHS
    from mlx_lm.fast_blas import blas_in_use
    from mlx_lm.generate import SpeculationStats, generate_step, speculative_generate_step
    from mlx_lm.sample_utils import make_sampler
    from mlx_lm.utils import parameter_dtypes

    target, tokenizer = load(str(TARGET))
    drafts = {"distilled": load(str(DRAFT))[0], "random": random_copy(load(str(DRAFT))[0])}
    prompts = [mx.array(tokenizer.encode(p)) for p in PROMPTS]
    blas = blas_in_use()
    dtype = parameter_dtypes(target)
    print(f"BLAS: {blas}; dtype {dtype}", flush=True)
    load_before = os.getloadavg()[0]
    greedy, sampled = make_sampler(), make_sampler(0.7, top_p=0.95)

    # config: (case, mode, k); mode: plain, cold, warm, fixed
    configs = [("greedy", "plain", 0), ("greedy", "cold", 4), ("greedy", "warm", 4)]
    configs += [("greedy", "fixed", k) for k in range(1, 5)]
    configs += [("T=0.7", "plain", 0), ("T=0.7", "cold", 3), ("T=0.7", "warm", 3)]
    configs += [("random draft", "plain", 0), ("random draft", "cold", 4), ("random draft", "warm", 4)]
    configs += [("mtp", "plain", 0), ("mtp", "cold", 3), ("mtp", "warm", 3), ("mtp", "fixed", 3)]

    def call(config, prompt, stats):
        case, mode, k = config
        sampler = sampled if case == "T=0.7" else greedy
        tokens = args.mtp_tokens if case == "mtp" else args.tokens
        if mode == "plain":
            return generate_step(prompt, target, max_tokens=tokens, sampler=sampler)
        if mode == "cold":
            DRAFT_LENGTHS.forget()
        drafter = dict(mtp=True) if case == "mtp" else dict(draft_model=drafts["random" if case == "random draft"
                                                                              else "distilled"])
        return speculative_generate_step(prompt, target, num_draft_tokens=k, max_tokens=tokens, sampler=sampler,
                                         adaptive_draft_length=mode != "fixed", stats=stats, **drafter)

    def timed(config):
        seconds, num_tokens, stats = 0.0, 0, SpeculationStats()
        for prompt in prompts:
            start = time.perf_counter()
            num_tokens += sum(1 for _ in call(config, prompt, stats))
            seconds += time.perf_counter() - start
        forwards = stats.num_target_forwards if config[1] != "plain" else num_tokens  # one a token
        return num_tokens / seconds, num_tokens / forwards, stats.draft_lengths

    for config in configs:  # warm up every path; the warm configurations learn here
        timed(config)
    speed = {c: [] for c in configs}
    per_forward = {c: [] for c in configs}
    lengths = {}
    started = time.time()
    for rep in range(args.reps):
        shift = rep * len(configs) // args.reps
        for config in configs[shift:] + configs[:shift]:
            tok_s, tpf, lengths[config] = timed(config)
            speed[config].append(tok_s)
            per_forward[config].append(tpf)
        print(f"rep {rep + 1}/{args.reps} done", flush=True)

    def ratio(config, base):
        return statistics.median(s / b for s, b in zip(speed[config], speed[base]))

    lines = [
        f"# Draft-length policy cold vs warm, short calls ({args.label})",
        "",
        f"- BLAS: {blas}; compute dtype {dtype}",
        f"- machine: {platform.machine()}, {os.cpu_count()} cores, load average {load_before:.2f} before the run and "
        f"{os.getloadavg()[0]:.2f} after (1 min; other users of the machine add to it), mlx {mx.__version__}",
        f"- {len(prompts)} prompts x {args.tokens} tokens a call (MTP: {args.mtp_tokens}), {args.reps} repetitions "
        f"interleaved ({(time.time() - started) / 60:.1f} min); ratios per repetition, then the median",
        "- command: `" + "".join(f"{k}={os.environ[k]} " for k in ("MLX_LM_REFERENCE_BLAS", "MKL_NUM_THREADS")
                                 if k in os.environ) + f"python benchmarks/warm_policy.py{''.join(' ' + a for a in sys.argv[1:])}`",
        "",
        "| case | draft length | tok/s | vs plain | tokens / target forward | rounds per k (last rep) |",
        "|---|---|---:|---:|---:|---|",
    ]
    for config in configs:
        case, mode, k = config
        base = (case, "plain", 0)
        label = "plain" if mode == "plain" else f"fixed k={k}" if mode == "fixed" else f"defaults {mode} (cap {k})"
        lines.append(f"| {case} | {label} | {statistics.median(speed[config]):.1f} | {ratio(config, base):.2f}x | "
                     f"{statistics.median(per_forward[config]):.2f} | {lengths[config]} |")
    best = max((("greedy", "fixed", k) for k in range(1, 5)), key=lambda c: ratio(c, ("greedy", "plain", 0)))
    summary = {
        "greedy defaults warm / plain": ratio(("greedy", "warm", 4), ("greedy", "plain", 0)),
        f"greedy defaults warm / best fixed (k={best[2]})": ratio(("greedy", "warm", 4), best),
        f"greedy defaults cold / best fixed (k={best[2]})": ratio(("greedy", "cold", 4), best),
        "T=0.7 defaults warm / plain": ratio(("T=0.7", "warm", 3), ("T=0.7", "plain", 0)),
        "random draft defaults warm / plain": ratio(("random draft", "warm", 4), ("random draft", "plain", 0)),
        "random draft defaults cold / plain": ratio(("random draft", "cold", 4), ("random draft", "plain", 0)),
        "MTP tokens per forward, defaults cold / fixed k=3": statistics.median(
            c / f for c, f in zip(per_forward[("mtp", "cold", 3)], per_forward[("mtp", "fixed", 3)])),
        "MTP tokens per forward, defaults warm / fixed k=3": statistics.median(
            c / f for c, f in zip(per_forward[("mtp", "warm", 3)], per_forward[("mtp", "fixed", 3)])),
        "MTP defaults warm / plain (speed)": ratio(("mtp", "warm", 3), ("mtp", "plain", 0)),
        "MTP fixed k=3 / plain (speed)": ratio(("mtp", "fixed", 3), ("mtp", "plain", 0)),
    }
    lines += ["", "| measure | value |", "|---|---:|"] + [f"| {k} | {v:.2f} |" for k, v in summary.items()]
    lines += ["", f"![warm policy](warm_policy_{args.label}.png)"]
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / f"warm_policy_{args.label}.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, ax = plt.subplots(figsize=(11, 4.5))
    shown = [c for c in configs if c[1] != "plain"]
    colors = {"cold": "C0", "warm": "C1", "fixed": "grey"}
    ax.bar(range(len(shown)), [ratio(c, (c[0], "plain", 0)) for c in shown], color=[colors[c[1]] for c in shown])
    ax.set_xticks(range(len(shown)), [f"{c[0]}\n{c[1]}" + (f" k={c[2]}" if c[1] == "fixed" else "") for c in shown],
                  fontsize=7)
    ax.axhline(1.0, color="black", linewidth=0.8)
    ax.set(ylabel="speed / plain decoding", title=f"Short calls, cold vs warm draft-length policy; {blas}, {dtype}")
    figure.tight_layout()
    figure.savefig(RESULTS / f"warm_policy_{args.label}.png", dpi=120)


if __name__ == "__main__":
    main()
