"""Prefill speed of the Mamba-2 recurrence: chunked SSD vs sequential scan, by prompt length.

    python benchmarks/ssm_prefill.py [--lengths 4 8 16 64 256 1024 4096] [--blas auto|openblas|reference|both]
                                     [--dtype float32|bfloat16|float16]

`ssm.ssd_update` at the sizes of one Nemotron-H-8B Mamba-2 layer (128 heads of dim 64,
state 128, 8 groups), from a zero state over T prompt tokens, once with every update
forced onto the chunked SSD path (`ssd_chunked`, chunks of `ssm.CHUNK_SIZE`) and once
onto the sequential scan (`ssd_sequential`, one compiled step per token), by setting
`ssm.CHUNKED_MIN_TOKENS`. The projections, conv and gated norm around the recurrence
are the same whichever path runs, so they are left out. Each row also gives the largest
difference between the two paths' outputs and final states, relative to the largest
sequential value: the chunked path is a re-association of the same sums, so they agree
to float32 rounding.

The inputs are `--dtype`; the recurrence runs in float32 either way. Timings are the
best of `--repeats` runs after a warm-up (the machine is shared and noisy). The BLAS
matters most to the chunked path (batched matmuls), but the scan's per-token S C is a
matmul too. See gdn_prefill.py for how OpenBLAS is preloaded, here with one thread
(OPENBLAS_NUM_THREADS=1 unless set: the machine's cores are shared). Writes
results/ssm_prefill.md and results/ssm_prefill.png.
"""

import argparse
import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from gdn_prefill import RESULTS, best_time, resolve_blas_choices, run_worker  # noqa: E402

# One Mamba-2 layer of Nemotron-H-8B (NVIDIA, arXiv 2504.03624; its config.json).
HEADS, HEAD_DIM, STATE, GROUPS = 128, 64, 128, 8


def inputs(tokens: int, dtype: str):
    """x (1, T, H, P), dt (1, T, H) discretised, A (H,), B, C (1, T, G, N): trained-like
    ranges (dt in about [0.001, 0.1], A in [-16, -1])."""
    import mlx.core as mx

    from mlx_lm.models import ssm

    mx.random.seed(0)
    x = mx.random.normal((1, tokens, HEADS, HEAD_DIM))
    B, C = mx.random.normal((2, 1, tokens, GROUPS, STATE))
    dt_bias = mx.log(mx.expm1(mx.random.uniform(0.001, 0.1, (HEADS,))))  # softplus^-1
    dt = ssm.discretize_dt(mx.random.normal((1, tokens, HEADS)) * 0.5, dt_bias)
    A = -mx.random.uniform(1.0, 16.0, (HEADS,))
    cast = getattr(mx, dtype)
    arrays = (x.astype(cast), dt, A, B.astype(cast), C.astype(cast))
    mx.eval(*arrays)
    return arrays


def worker(lengths, repeats: int, dtype: str) -> dict:
    import mlx.core as mx

    from mlx_lm.models import ssm

    def run(path, arrays, tokens):
        """(y, state) of ssd_update with every update on `path`."""
        saved = ssm.CHUNKED_MIN_TOKENS
        ssm.CHUNKED_MIN_TOKENS = 1 if path == "chunked" else tokens + 1
        try:
            y, state = ssm.ssd_update(*arrays)
            mx.eval(y, state)
            return y, state
        finally:
            ssm.CHUNKED_MIN_TOKENS = saved

    rows = []
    for tokens in lengths:
        arrays = inputs(tokens, dtype)
        outs = {path: run(path, arrays, tokens) for path in ("chunked", "sequential")}  # warm-up too
        times = {path: best_time(lambda: run(path, arrays, tokens), repeats)
                 for path in outs}
        (y_c, s_c), (y_s, s_s) = outs["chunked"], outs["sequential"]

        def rel(a, b):
            return (mx.abs(a.astype(mx.float32) - b.astype(mx.float32)).max() / mx.abs(b).max()).item()

        rows.append({"tokens": tokens, **{f"{p}_s": t for p, t in times.items()},
                     "y_rel_diff": rel(y_c, y_s), "state_rel_diff": rel(s_c, s_s)})
        print(json.dumps(rows[-1]), file=sys.stderr, flush=True)
    return {"rows": rows, "dtype": dtype, "chunk_size": ssm.CHUNK_SIZE,
            "openblas_threads": os.environ.get("OPENBLAS_NUM_THREADS")}


# --- report -------------------------------------------------------------------------------


def blas_name(result) -> str:
    threads = result["openblas_threads"]
    return result["blas"] + (f", OPENBLAS_NUM_THREADS={threads}" if threads and "OpenBLAS" in result["blas"] else "")


def write_report(results) -> None:
    RESULTS.mkdir(exist_ok=True)
    first = results[0]
    lines = [
        "# Mamba-2 prefill: chunked SSD vs sequential scan",
        "",
        f"`ssm.ssd_update` at one Nemotron-H-8B Mamba-2 layer's sizes ({HEADS} heads x {HEAD_DIM}, state {STATE}, "
        f"{GROUPS} groups), batch 1, from a zero state; inputs {first['dtype']}, recurrence float32, "
        f"chunks of {first['chunk_size']}. Relative difference: max |chunked - sequential| / max |sequential| "
        "of the outputs y and of the final state.",
        "",
        "| BLAS | tokens | chunked s | sequential s | chunked tok/s | sequential tok/s | speed-up | y rel diff | state rel diff |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for result in results:
        for row in result["rows"]:
            t, c, s = row["tokens"], row["chunked_s"], row["sequential_s"]
            lines.append(f"| {blas_name(result)} | {t} | {c:.3f} | {s:.3f} | {t / c:.0f} | {t / s:.0f} | {s / c:.1f}x | "
                         f"{row['y_rel_diff']:.1e} | {row['state_rel_diff']:.1e} |")
    (RESULTS / "ssm_prefill.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    plot(results)


def plot(results) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (times, speedup) = plt.subplots(1, 2, figsize=(11, 4))
    for result in results:
        label = result["blas"].split(" ")[0]
        tokens = [row["tokens"] for row in result["rows"]]
        for path, style in (("chunked", "o-"), ("sequential", "s--")):
            times.plot(tokens, [row[f"{path}_s"] for row in result["rows"]], style, label=f"{path} ({label})")
        speedup.plot(tokens, [row["sequential_s"] / row["chunked_s"] for row in result["rows"]], "o-", label=label)
    times.set(xscale="log", yscale="log", xlabel="prompt tokens", ylabel="seconds (log)",
              title=f"Mamba-2 recurrence, H {HEADS}, P {HEAD_DIM}, N {STATE}")
    speedup.axhline(1.0, color="gray", lw=0.8)
    speedup.set(xscale="log", xlabel="prompt tokens", ylabel="sequential / chunked time", title="chunked SSD speed-up")
    for ax in (times, speedup):
        ax.set_xticks(tokens, [str(t) for t in tokens])
        ax.legend()
    fig.tight_layout()
    fig.savefig(RESULTS / "ssm_prefill.png", dpi=120)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--lengths", type=int, nargs="+", default=[4, 8, 16, 64, 256, 1024, 4096])
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], default="float32")
    parser.add_argument("--blas", choices=["auto", "openblas", "reference", "both"], default="auto")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        print(json.dumps(worker(args.lengths, args.repeats, args.dtype)))
        return
    os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
    results = []
    for blas in resolve_blas_choices(args.blas):
        print(f"measuring with {blas} BLAS, inputs {args.dtype} ...", flush=True)
        results.append(run_worker(__file__, blas, ["--lengths", *map(str, args.lengths), "--repeats",
                                                   str(args.repeats), "--dtype", args.dtype]))
        print(f"BLAS: {blas_name(results[-1])}", flush=True)
    write_report(results)


if __name__ == "__main__":
    main()
