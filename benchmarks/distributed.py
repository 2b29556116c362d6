"""Tensor parallel on this machine: 1 rank vs 2 ranks (ring backend over loopback).

    python benchmarks/distributed.py [--tokens 32] [--repeats 3] [--mlx-launch]

One dense llama with random weights (fp32; hidden 1024, 8 layers, 16 heads / 8 KV
heads, MLP 2816, vocab 8192: ~111M parameters, 0.44 GB) is built identically on
every rank and sharded (`model.shard`) when there are 2. Per run, rank 0 reports:
- parameter bytes on the rank (embeddings, norms and lm_head stay whole);
- greedy decode tokens/s after a 32-token prompt, plain and with prompt-lookup
  speculation (3 drafts a round, pinned), median of --repeats;
- all_sum latency for a (1, 1, hidden) fp32 vector (what each of the 2 all-reduces
  per layer of a decode step moves), a (1, 4, hidden) one (a verify of 3 drafts) and
  1 MiB (bandwidth), medians of 200 (after warm-up).
Ranks start through tests/ranks.py (MLX_RANK + MLX_HOSTFILE, what mlx.launch sets
up); `--mlx-launch` also times the 2-rank run through mlx.launch itself.
Then a written model of N-host scaling from those measurements. Writes
results/distributed.md, .json and .png (matplotlib).
"""

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
CONFIG = dict(
    model_type="llama", hidden_size=1024, intermediate_size=2816, num_hidden_layers=8,
    num_attention_heads=16, num_key_value_heads=8, vocab_size=8192, rms_norm_eps=1e-5,
    tie_word_embeddings=False,
)
PROMPT = [(i * 37 + 11) % 8192 for i in range(32)]


# --- one rank ---------------------------------------------------------------------------

def build_model(group):
    import mlx.core as mx
    from mlx.utils import tree_map

    from mlx_lm.utils import get_model_classes

    model_class, args_class = get_model_classes(CONFIG)
    mx.random.seed(0)
    model = model_class(args_class.from_dict(CONFIG))
    model.update(tree_map(lambda v: mx.random.normal(v.shape) * 0.05, model.parameters()))
    if group.size() > 1:
        model.shard(group)
    mx.eval(model.parameters())
    return model


def decode_rate(model, tokens, repeats, lookup):
    """Median tokens/s after the first token, and tokens per target forward."""
    import mlx.core as mx

    from mlx_lm.generate import SpeculationStats, generate_step, speculative_generate_step

    prompt, rates = mx.array(PROMPT), []
    for _ in range(repeats + 1):  # the first run warms up
        stats = SpeculationStats()
        if lookup:
            steps = speculative_generate_step(prompt, model, prompt_lookup=True, num_draft_tokens=3, stats=stats,
                                              adaptive_draft_length=False, max_tokens=tokens + 1)
        else:
            steps = generate_step(prompt, model, max_tokens=tokens + 1)
        next(steps)  # prefill and the first token
        tic = time.perf_counter()
        count = sum(1 for _ in steps)
        rates.append(count / (time.perf_counter() - tic))
    per_forward = (tokens + 1) / stats.num_target_forwards if lookup else 1.0
    return statistics.median(rates[1:]), per_forward


def all_sum_seconds(group, shape, iterations=200):
    import mlx.core as mx

    x = mx.ones(shape)
    for _ in range(20):
        mx.eval(mx.distributed.all_sum(x, group=group))
    times = []
    for _ in range(iterations):
        tic = time.perf_counter()
        mx.eval(mx.distributed.all_sum(x, group=group))
        times.append(time.perf_counter() - tic)
    return statistics.median(times)


def rank_job(args):
    import mlx.core as mx

    from mlx_lm.models.sharding import parameter_bytes

    group = mx.distributed.init()
    model = build_model(group)
    hidden = CONFIG["hidden_size"]
    result = dict(
        ranks=group.size(),
        bytes=parameter_bytes(model),
        plain_tps=decode_rate(model, args.tokens, args.repeats, lookup=False)[0],
    )
    result["lookup_tps"], result["lookup_tokens_per_forward"] = decode_rate(
        model, args.tokens, args.repeats, lookup=True
    )
    if group.size() > 1:
        result["all_sum_s"] = {
            "decode (1x1x1024 fp32, 4 KiB)": all_sum_seconds(group, (1, 1, hidden)),
            "verify (1x4x1024 fp32, 16 KiB)": all_sum_seconds(group, (1, 4, hidden)),
            "1 MiB": all_sum_seconds(group, (256, 1024)),
        }
    if group.rank() == 0:
        Path(args.out).write_text(json.dumps(result))


# --- driver -----------------------------------------------------------------------------

def run(n, args, via_mlx_launch=False):
    out = Path(tempfile.mkdtemp()) / "result.json"
    job = [sys.executable, __file__, "--rank-job", "--out", str(out), "--tokens", str(args.tokens),
           "--repeats", str(args.repeats)]
    tic = time.perf_counter()
    if via_mlx_launch:
        subprocess.run(["mlx.launch", "--backend", "ring", "-n", str(n), "--", *job], check=True, timeout=1200,
                       cwd=ROOT, env=dict(__import__("os").environ, PYTHONPATH=str(ROOT)))
    else:
        sys.path.insert(0, str(ROOT / "tests"))
        from ranks import run_ranks

        ranks = run_ranks(job, n=n, timeout=1200)
        if any(r.returncode != 0 for r in ranks):
            raise RuntimeError(f"{n}-rank run failed: {[r.stderr[-2000:] for r in ranks]}")
    result = json.loads(out.read_text())
    result["wall_s"] = time.perf_counter() - tic
    return result


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--mlx-launch", action="store_true", help="also time 2 ranks through mlx.launch")
    parser.add_argument("--replot", action="store_true", help="rewrite the .md and .png from the .json")
    parser.add_argument("--rank-job", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.rank_job:
        return rank_job(args)
    if args.replot:
        saved = json.loads((RESULTS / "distributed.json").read_text())
        return write_report(saved["runs"], argparse.Namespace(**saved["args"]))
    runs = {"1 rank": run(1, args), "2 ranks": run(2, args)}
    if args.mlx_launch:
        runs["2 ranks (mlx.launch)"] = run(2, args, via_mlx_launch=True)
    RESULTS.mkdir(parents=True, exist_ok=True)
    saved_args = dict(tokens=args.tokens, repeats=args.repeats, mlx_launch=args.mlx_launch)
    (RESULTS / "distributed.json").write_text(json.dumps(dict(runs=runs, args=saved_args), indent=2))
    write_report(runs, args)


# --- the scaling model ------------------------------------------------------------------
#
# Decode is memory-bound: a step reads every weight once. On N hosts, each with its own
# memory, a rank reads its 1/N of the sharded weights plus all of the replicated ones
# (embedding row, norms, lm_head), then waits for 2 all-reduces per layer (attention,
# MLP) of one hidden-size vector, which at these sizes cost latency, not bandwidth:
#     t(N) = t1 * (1 - f) + t1 * f / N + 2 * L * a(N),
# t1 the one-host step time, f the sharded fraction of the weight bytes, L layers, a(N)
# the all-reduce latency. A ring all-reduce of a small vector takes 2(N - 1) hops of
# latency h; the measured 2-rank all_sum (2 hops) gives h = a(2) / 2.
# A verify forward of k + 1 tokens moves (k + 1) vectors in the same 2L all-reduces, so
# with E tokens accepted per forward the communication per token is 2 L a(N) / E.

def step_seconds(t1, f, layers, hop, n, tokens_per_forward=1.0):
    all_reduce = 2 * (n - 1) * hop
    return t1 * (1 - f) + t1 * f / n + 2 * layers * all_reduce / tokens_per_forward


# An illustration, not a measurement: a 70B-class dense model at 4 bits (~35 GB, 80
# layers, ~97% of the bytes in the layers) on hosts reading ~400 GB/s, at assumed
# per-hop latencies.
LARGE = dict(name="70B-class, 4-bit, 80 layers, 400 GB/s per host", t1=35 / 400, f=0.97, layers=80)
ASSUMED_HOPS_US = (10, 50, 200)


def write_report(runs, args):
    one, two = runs["1 rank"], runs["2 ranks"]
    t1, layers = 1 / one["plain_tps"], CONFIG["num_hidden_layers"]
    f = 2 * (1 - two["bytes"] / one["bytes"])
    latency = two["all_sum_s"]
    hop = list(latency.values())[0] / 2
    lines = [
        "# Tensor parallel: 1 vs 2 ranks on this machine",
        "",
        f"`python benchmarks/distributed.py --tokens {args.tokens} --repeats {args.repeats}"
        f"{' --mlx-launch' if args.mlx_launch else ''}`: llama, hidden {CONFIG['hidden_size']}, "
        f"{layers} layers, MLP {CONFIG['intermediate_size']}, vocab {CONFIG['vocab_size']}, fp32, random "
        f"weights; greedy decode after a {len(PROMPT)}-token prompt, median of {args.repeats}. Both ranks "
        "share this machine's cores and memory, so no speedup is expected here: the 2-rank numbers "
        "show what sharding costs, the model below what it buys on separate hosts. The machine "
        "was shared with other jobs while measuring, so single numbers move by tens of percent between "
        "runs; on its CPU backend a 4-token verify forward also costs several single-token ones, so "
        "prompt lookup does not pay here.",
        "",
        "| run | bytes per rank | plain tok/s | prompt-lookup tok/s (tokens per forward) | wall s (incl. start) |",
        "|---|---:|---:|---:|---:|",
    ]
    for name, r in runs.items():
        lines.append(f"| {name} | {r['bytes'] / 1e6:.1f} MB ({r['bytes'] / one['bytes']:.0%}) | "
                     f"{r['plain_tps']:.1f} | {r['lookup_tps']:.1f} ({r['lookup_tokens_per_forward']:.2f}) | "
                     f"{r['wall_s']:.1f} |")
    lines += ["", "all_sum latency, 2 ranks over loopback (median of 200):", ""]
    lines += [f"- {name}: {seconds * 1e6:.0f} us" for name, seconds in latency.items()]
    lines += [
        "",
        "## Scaling model",
        "",
        "Decode reads every weight once per step, so on N hosts with their own memory",
        "",
        "    t(N) = t1 (1 - f) + t1 f / N + 2 L a(N),   a(N) = 2 (N - 1) h",
        "",
        "t1 = one-host step time, f = sharded fraction of the weight bytes, L = layers (2 all-reduces",
        "each), h = per-hop latency of a ring all-reduce of one hidden vector (a(2) = 2 hops). A verify",
        "forward moves its k + 1 vectors in the same 2L all-reduces, so with E tokens per forward the",
        "communication term is divided by E: speculation pays more across hosts than on one.",
        "",
        f"Measured here: t1 = {t1 * 1e3:.1f} ms, f = {f:.2f}, L = {layers}, h = {hop * 1e6:.0f} us "
        f"(loopback). On one box the compute term does not shrink (both ranks share the cores), so "
        f"the model's one-box estimate is t1 + 2 L a(2) = {(t1 + 2 * layers * 2 * hop) * 1e3:.1f} ms "
        f"({1 / (t1 + 2 * layers * 2 * hop):.1f} tok/s) against {1 / two['plain_tps'] * 1e3:.1f} ms "
        f"({two['plain_tps']:.1f} tok/s) measured.",
        "",
        f"Predicted tok/s, {LARGE['name']} (t1 = {LARGE['t1'] * 1e3:.0f} ms if it fitted on one host; "
        "assumed hop latencies, not measured):",
        "",
        "| hop latency | " + " | ".join(f"N={n}" for n in (1, 2, 4, 8)) + " | N=4, E=2.5 tokens/forward |",
        "|---|" + "---:|" * 5,
    ]
    for hop_us in ASSUMED_HOPS_US:
        cells = [1 / step_seconds(LARGE["t1"], LARGE["f"], LARGE["layers"], hop_us * 1e-6, n) for n in (1, 2, 4, 8)]
        spec = 1 / step_seconds(LARGE["t1"], LARGE["f"], LARGE["layers"], hop_us * 1e-6, 4, 2.5)
        lines.append(f"| {hop_us} us | " + " | ".join(f"{c:.1f}" for c in cells) + f" | {spec:.1f} |")
    lines += ["", "(E = 2.5: the communication term only; the draft's own cost is left out.)", ""]
    (RESULTS / "distributed.md").write_text("\n".join(lines))
    plot(runs, t1, f, layers, hop)


def plot(runs, t1, f, layers, hop):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    names = list(runs)
    xs = list(range(len(names)))
    left.bar([x - 0.2 for x in xs], [runs[n]["plain_tps"] for n in names], width=0.4, label="plain")
    left.bar([x + 0.2 for x in xs], [runs[n]["lookup_tps"] for n in names], width=0.4, label="prompt lookup")
    left.set_xticks(xs, names)
    left.set_ylabel("tokens/s (this machine)")
    left.set_title("measured, 111M llama fp32")
    left.legend()
    ns = [1, 2, 4, 8, 16]
    for hop_us in ASSUMED_HOPS_US:
        right.plot(ns, [1 / step_seconds(LARGE["t1"], LARGE["f"], LARGE["layers"], hop_us * 1e-6, n) for n in ns],
                   marker="o", label=f"hop {hop_us} us (assumed)")
    right.plot(ns, [1 / step_seconds(LARGE["t1"], LARGE["f"], LARGE["layers"], hop, n) for n in ns],
               marker="s", linestyle="--", label=f"hop {hop * 1e6:.0f} us (measured loopback)")
    right.set_xscale("log", base=2)
    right.set_xlabel("hosts N")
    right.set_ylabel("predicted tokens/s")
    right.set_title("model: 70B-class 4-bit, 400 GB/s per host")
    right.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(RESULTS / "distributed.png", dpi=110)


if __name__ == "__main__":
    main()
