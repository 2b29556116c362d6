"""What a single-token write into a sliding window costs while speculating, in one run.

    python benchmarks/rotating_write.py [--windows 512 2048 8192] [--repeats 25] [--blas auto|openblas|reference]

One RotatingKVCache at gpt-oss shapes (8 KV heads x head dim 64, batch 1) filled past its
window, then single-token `update_and_fetch` + eval (a draft model's step), three ways:

- plain: not speculating; MLX writes the ring buffers in place.
- speculating (ours): `start_speculation(rollback_window=8)`; the record of each write
  is a copy of the row it overwrites, taken 32 rows ahead in one gather, so the
  buffers are still written in place.
- previous log: each record held the pre-write buffers, as the log before this change
  did (emulated here by keeping references to them, the last 8 writes' worth), so every
  write copies the whole window.

A sample is the mean time of 64 writes per way: plain and speculating take turns write
by write (alternating which goes first) so that load on a shared machine hits both
alike; the previous log runs its 64 right after (interleaved, its window-sized copies
would slow the other ways' writes). Ratios are the median over samples of the ratio
within one; times are the best sample. "peak added" is mx.get_peak_memory() over 16
writes minus the active memory before them. Also timed (median): a rollback of 8
single-token writes (trim(8) + eval). Writes results/rotating_write.md and .png.
"""

import argparse
import gc
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from gdn_prefill import RESULTS, resolve_blas_choices, run_worker  # noqa: E402

HEADS, HEAD_DIM = 8, 64  # gpt-oss KV heads and head dim
ROLLBACK_WINDOW = 8
WRITES_PER_SAMPLE = 64  # two refills of the 32-row lookahead
MODES = ("plain", "speculating", "previous log")


def worker(windows, repeats: int) -> dict:
    import mlx.core as mx

    from mlx_lm.models.cache import RotatingKVCache

    def full_cache(window, dtype):
        cache = RotatingKVCache(window)
        rows = mx.random.normal((2, 1, HEADS, window + 3, HEAD_DIM)).astype(dtype)
        cache.update_and_fetch(rows[0], rows[1])
        mx.eval(cache.keys, cache.values)
        return cache

    def writer(cache, mode, row):
        """A function doing one recorded (or plain) write and evaluating what it returns."""
        if mode == "speculating":
            cache.start_speculation(rollback_window=ROLLBACK_WINDOW)
        held = []  # previous log: the pre-write buffers of the last ROLLBACK_WINDOW writes

        def write():
            if mode == "previous log":
                held.append((cache.keys, cache.values))
                del held[:-ROLLBACK_WINDOW]
            mx.eval(cache.update_and_fetch(row, row))

        return write

    def sample_ms(writes):
        """Mean ms per write of each way (see the module docstring for the order)."""
        totals = dict.fromkeys(writes, 0.0)

        def timed(mode):
            start = time.perf_counter()
            writes[mode]()
            totals[mode] += time.perf_counter() - start

        for i in range(WRITES_PER_SAMPLE):
            for mode in ("plain", "speculating")[:: 1 if i % 2 else -1]:
                timed(mode)
        for _ in range(WRITES_PER_SAMPLE):
            timed("previous log")
        return {mode: total * 1e3 / WRITES_PER_SAMPLE for mode, total in totals.items()}

    def peak_added(window, dtype, mode, row):
        cache = full_cache(window, dtype)
        write = writer(cache, mode, row)
        gc.collect()
        mx.synchronize()
        mx.reset_peak_memory()
        base = mx.get_active_memory()
        for _ in range(16):
            write()
        return mx.get_peak_memory() - base

    def trim_ms(window, dtype, row):
        times = []
        for _ in range(repeats):
            cache = full_cache(window, dtype)
            write = writer(cache, "speculating", row)
            for _ in range(ROLLBACK_WINDOW):
                write()
            start = time.perf_counter()
            cache.trim(ROLLBACK_WINDOW)
            mx.eval(cache.keys, cache.values)
            times.append((time.perf_counter() - start) * 1e3)
        return statistics.median(times)

    rows = []
    for dtype_name in ("float16", "float32"):
        dtype = getattr(mx, dtype_name)
        row = mx.random.normal((1, HEADS, 1, HEAD_DIM)).astype(dtype)
        mx.eval(row)
        for window in windows:
            caches = {mode: full_cache(window, dtype) for mode in MODES}
            writes = {mode: writer(caches[mode], mode, row) for mode in MODES}
            samples = [sample_ms(writes) for _ in range(repeats)]
            result = dict(dtype=dtype_name, window=window, buffer_bytes=caches["plain"].keys.nbytes)
            for mode in MODES:
                result[f"{mode} ms"] = min(s[mode] for s in samples)
                result[f"{mode} ratio"] = statistics.median(s[mode] / s["plain"] for s in samples)
                result[f"{mode} peak"] = peak_added(window, dtype, mode, row)
            result["trim ms"] = trim_ms(window, dtype, row)
            rows.append(result)
            print(json.dumps(result), file=sys.stderr, flush=True)
    return dict(rows=rows)


def write_report(result: dict, command: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = result["rows"]
    mib = 2**20
    lines = [
        "# Sliding-window writes while speculating: in place vs the previous log",
        "",
        f"`{command}`; BLAS: {result['blas']} (no matmul here; printed for comparability).",
        f"One RotatingKVCache, batch 1, {HEADS} KV heads x head dim {HEAD_DIM}, filled past its "
        f"window; per single-token write (update_and_fetch + eval). Rollback window {ROLLBACK_WINDOW}. "
        "'peak added': peak memory over 16 writes above the memory held before them.",
        "",
        "| dtype | window | plain (ms) | speculating (ms) | speculating / plain "
        "| previous log (ms) | previous / plain | peak added: plain | speculating | previous log "
        "| trim 8 writes (ms) |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        plain, spec, old = r["plain ms"], r["speculating ms"], r["previous log ms"]
        lines.append(
            f"| {r['dtype']} | {r['window']} | {plain:.4f} | {spec:.4f} | {r['speculating ratio']:.2f}x "
            f"| {old:.3f} | {r['previous log ratio']:.0f}x | {r['plain peak'] / mib:.2f} MiB "
            f"| {r['speculating peak'] / mib:.2f} MiB | {r['previous log peak'] / mib:.1f} MiB "
            f"| {r['trim ms']:.3f} |"
        )
    lines += [
        "",
        "Times: best sample (mean of 64 writes) over the repeats; ratios: median over the "
        "samples of the ratio within one. Speculating copies the rows the next writes overwrite, "
        "32 at a time, and waits for that copy so that the writes can reuse the buffer; "
        "the previous log kept the pre-write buffers alive, so MLX copied the whole window "
        "on every write. One key buffer at the largest window: "
        f"{rows[-1]['buffer_bytes'] / mib:.0f} MiB ({rows[-1]['dtype']}).",
    ]
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "rotating_write.md").write_text("\n".join(lines) + "\n")

    dtypes = sorted({r["dtype"] for r in rows})
    fig, axes = plt.subplots(1, len(dtypes) + 1, figsize=(5 * (len(dtypes) + 1), 4))
    for ax, dtype in zip(axes, dtypes):
        mine = [r for r in rows if r["dtype"] == dtype]
        windows = [r["window"] for r in mine]
        for mode, style in zip(MODES, ("k--", "o-", "s-")):
            ax.plot(windows, [r[f"{mode} ms"] for r in mine], style, label=mode)
        ax.set(xscale="log", yscale="log", xlabel="window (tokens)", ylabel="ms per single-token write",
               title=dtype)
        ax.minorticks_off()
        ax.set_xticks(windows, [str(w) for w in windows])
        ax.legend(fontsize=8)
    ax = axes[-1]
    largest = [r for r in rows if r["window"] == max(r["window"] for r in rows)]
    xs = range(len(largest))
    for i, mode in enumerate(MODES):
        added = [r[f"{mode} peak"] / mib for r in largest]
        bars = ax.bar([x + (i - 1) * 0.27 for x in xs], [max(a, 1e-3) for a in added], 0.27, label=mode)
        ax.bar_label(bars, [f"{a:.3g}" for a in added], fontsize=7)
    ax.set_xticks(list(xs), [f"{r['dtype']}, window {r['window']}" for r in largest])
    ax.set(yscale="log", ylabel="peak memory added over 16 writes (MiB)", title="memory (0 drawn at 1e-3)")
    ax.legend(fontsize=8)
    fig.suptitle(f"RotatingKVCache single-token writes, {HEADS}x{HEAD_DIM} heads ({result['blas'].split(' (')[0]})",
                 fontsize=9)
    fig.tight_layout()
    fig.savefig(RESULTS / "rotating_write.png", dpi=120)
    print("\n".join(lines))


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--windows", type=int, nargs="+", default=[512, 2048, 8192])
    parser.add_argument("--repeats", type=int, default=25)
    parser.add_argument("--blas", choices=["auto", "openblas", "reference"], default="auto")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        print(json.dumps(worker(args.windows, args.repeats)))
        return
    (blas,) = resolve_blas_choices(args.blas)
    worker_args = ["--repeats", str(args.repeats), "--windows", *map(str, args.windows)]
    write_report(run_worker(__file__, blas, worker_args), "python " + " ".join(sys.argv))


if __name__ == "__main__":
    main()
