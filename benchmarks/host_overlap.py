"""How far the host can run ahead of the device on this backend: whether queueing the
next round before reading this one (issue 31's "decisions on the device") can hide
host work at all.

    python benchmarks/host_overlap.py [--ops 10,100,1000,3000] [--size 64]

For graphs of N small dependent operations (a matmul, a scale and a tanh each, on (size, size)
float32 arrays: about what a decode step of a small model dispatches), it times how
long `mx.async_eval` takes to return and how long the result takes to be ready. Where
async_eval returns at once, host work placed after it overlaps the computation (what a
GPU's command queue allows); where it returns only when nearly everything has run, the
host cannot get ahead by more than a few operations and pipelining rounds hides
nothing. A model's forward is fewer, larger operations, and there the host does get
ahead: batch_speculation.py times a plain step queued before the last one is read
against one read at once, and a drafting round queued step by step against one
queued whole. Writes results/host_overlap.md.
"""

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from server_bench import RESULTS, machine  # noqa: E402


def chain(x, num_ops: int):
    import mlx.core as mx

    y = x
    for _ in range(max(num_ops // 3, 1)):
        y = mx.tanh(y @ x * 0.01)
    return y


def measure(num_ops: int, size: int, repeats: int):
    import mlx.core as mx

    x = mx.random.normal((size, size))
    mx.eval(x)
    mx.eval(chain(x, num_ops))  # warm up
    returned, done = [], []
    for _ in range(repeats):
        y = chain(x, num_ops)
        start = time.perf_counter()
        mx.async_eval(y)
        returned.append(time.perf_counter() - start)
        mx.eval(y)
        done.append(time.perf_counter() - start)
    return statistics.median(returned), statistics.median(done)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--ops", default="10,100,1000,3000")
    parser.add_argument("--size", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    import mlx_lm  # noqa: F401  (its fast BLAS, before mlx.core)
    rows = []
    for num_ops in (int(n) for n in args.ops.split(",")):
        returned, done = measure(num_ops, args.size, args.repeats)
        rows.append((num_ops, returned * 1e3, done * 1e3))
        print(f"{num_ops} ops: async_eval returned after {returned * 1e3:.2f} ms, ready after {done * 1e3:.2f} ms",
              flush=True)
    lines = [
        "# How far the host runs ahead of the device",
        "",
        f"`python benchmarks/host_overlap.py --ops {args.ops} --size {args.size}`: chains of N dependent "
        f"operations (matmul, scale and tanh on ({args.size}, {args.size}) float32), medians of {args.repeats}. "
        "Host work after `mx.async_eval` overlaps the computation only for the time async_eval takes less "
        "than the whole.",
        "",
        "| operations | async_eval returns (ms) | ready (ms) | share of the time the host could overlap |",
        "|---:|---:|---:|---:|",
    ]
    lines += [f"| {n} | {r:.2f} | {d:.2f} | {max(d - r, 0) / d:.0%} |" for n, r, d in rows]
    lines += ["", f"{machine()}", ""]
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "host_overlap.md").write_text("\n".join(lines))
    print("\n".join(lines))


if __name__ == "__main__":
    main()
