"""Prefill speed of the gated delta rule: chunked vs sequential path, in one run.

    python benchmarks/gdn_prefill.py [--tokens 2048] [--blas auto|openblas|reference|both]

Two measurements at T tokens (default 2048), each timed for both paths:
- `recurrence`: `gated_delta_update` alone at Qwen3-Next dimensions (16 key heads, 32
  value heads, head dim 128);
- `hybrid prefill`: a 4-layer qwen3_next model ([linear, linear, linear, full], hidden
  512, the same linear-attention dims, dense MLP) prefilling T tokens into its cache.
The sequential path is forced by raising `gated_delta.CHUNKED_MIN_TOKENS` past T.

The chunked path is matmul-bound, so its speed depends on the BLAS under MLX. The
mlx-cpu wheel links the netlib reference BLAS; with `--blas openblas` (or `auto` when it
is installed: `apt-get install libopenblas0-pthread`) each measurement runs in a child
process with OpenBLAS preloaded, and OPENBLAS_CORETYPE=SkylakeX on AVX-512 machines
(OpenBLAS 0.3.21 does not recognise Sapphire Rapids and falls back to a slow kernel).
Writes results/gdn_prefill.md and results/gdn_prefill.png.
"""

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

RESULTS = Path(__file__).parent / "results"
OPENBLAS_PATHS = [
    "/usr/lib/x86_64-linux-gnu/openblas-pthread/libopenblas.so.0",
    "/usr/lib/aarch64-linux-gnu/openblas-pthread/libopenblas.so.0",
]


# --- BLAS selection (shared with hybrid_decode_vs_upstream.py) ------------------------


def find_openblas():
    return next((p for p in OPENBLAS_PATHS if os.path.exists(p)), None)


def blas_env(blas: str) -> dict:
    """Environment for a child process running MLX on `blas` ("openblas" or "reference")."""
    env = dict(os.environ)
    env.pop("LD_PRELOAD", None)
    if blas == "openblas":
        path = find_openblas()
        if path is None:
            raise SystemExit("OpenBLAS not found; apt-get install libopenblas0-pthread, or use --blas reference")
        env["LD_PRELOAD"] = path
        if "avx512f" in Path("/proc/cpuinfo").read_text() and "OPENBLAS_CORETYPE" not in env:
            env["OPENBLAS_CORETYPE"] = "SkylakeX"
    return env


def blas_label(blas: str, env: dict) -> str:
    if blas == "reference":
        return "reference BLAS (mlx-cpu wheel)"
    core = env.get("OPENBLAS_CORETYPE")
    return f"OpenBLAS {env['LD_PRELOAD']}" + (f" (OPENBLAS_CORETYPE={core})" if core else "")


def resolve_blas_choices(choice: str):
    if choice == "both":
        return ["openblas", "reference"]
    if choice == "auto":
        return ["openblas"] if find_openblas() else ["reference"]
    return [choice]


def run_worker(script: str, blas: str, args, python=sys.executable) -> dict:
    """Run `script --worker ...` under `blas`; it prints one JSON line last."""
    env = blas_env(blas)
    out = subprocess.run([python, script, "--worker", *args], env=env, capture_output=True, text=True)
    if out.returncode:
        raise SystemExit(f"worker failed ({blas}):\n{out.stderr[-4000:]}")
    result = json.loads(out.stdout.strip().splitlines()[-1])
    result["blas"] = blas_label(blas, env)
    return result


def best_time(fn, repeats: int) -> float:
    """Minimum wall time of `fn()` over `repeats` runs (the machine is shared and noisy)."""
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


# --- the worker ---------------------------------------------------------------------------

HYBRID = dict(
    model_type="qwen3_next", hidden_size=512, num_hidden_layers=4, num_attention_heads=8,
    num_key_value_heads=2, head_dim=64, vocab_size=1024, intermediate_size=1024,
    linear_num_key_heads=16, linear_num_value_heads=32, linear_key_head_dim=128,
    linear_value_head_dim=128, linear_conv_kernel_dim=4, full_attention_interval=4,
    rope_theta=1e7, partial_rotary_factor=0.25,
)


def worker(tokens: int, repeats: int) -> dict:
    import mlx.core as mx
    from mlx.utils import tree_flatten, tree_unflatten

    from mlx_lm.models import gated_delta, qwen3_next
    from mlx_lm.models.cache import make_prompt_cache

    def forced(path, fn):
        """Run fn with every update taking `path` ("chunked" or "sequential")."""
        saved = gated_delta.CHUNKED_MIN_TOKENS
        gated_delta.CHUNKED_MIN_TOKENS = 1 if path == "chunked" else tokens + 1
        try:
            return best_time(fn, repeats)
        finally:
            gated_delta.CHUNKED_MIN_TOKENS = saved

    mx.random.seed(0)
    B, Hk, Hv, D = 1, 16, 32, 128
    q, k = (x / mx.linalg.norm(x, axis=-1, keepdims=True) for x in mx.random.normal((2, B, tokens, Hk, D)))
    v = mx.random.normal((B, tokens, Hv, D))
    g, beta = mx.random.uniform(0.7, 1.0, (B, tokens, Hv)), mx.random.uniform(0, 1, (B, tokens, Hv))
    mx.eval(q, k, v, g, beta)
    results = {"tokens": tokens, "rows": []}

    def recurrence():
        mx.eval(gated_delta.gated_delta_update(q * D**-0.5, k, v, g, beta))

    model = qwen3_next.Model(qwen3_next.ModelArgs.from_dict(HYBRID))
    params = tree_flatten(model.parameters())
    model.update(tree_unflatten([(name, mx.random.normal(p.shape) * 0.02) for name, p in params]))
    prompt = mx.random.randint(0, HYBRID["vocab_size"], (1, tokens))
    mx.eval(model.parameters(), prompt)

    def prefill():
        cache = make_prompt_cache(model)
        mx.eval(model(prompt, cache=cache)[:, -1], [c.state for c in cache])

    for name, fn in (("recurrence (Hk 16, Hv 32, D 128)", recurrence), ("hybrid prefill (4 layers, hidden 512)", prefill)):
        fn()  # warm-up
        seconds = {path: forced(path, fn) for path in ("chunked", "sequential")}
        results["rows"].append({"name": name, **{f"{p}_tok_s": tokens / s for p, s in seconds.items()}})
    return results


# --- report -------------------------------------------------------------------------------


def write_report(results, tokens: int) -> None:
    RESULTS.mkdir(exist_ok=True)
    lines = [
        f"# Gated delta prefill at T={tokens}: chunked vs sequential path",
        "",
        "`recurrence`: gated_delta_update alone; `hybrid prefill`: a whole 4-layer qwen3_next",
        "model (3 Gated DeltaNet + 1 attention layer) prefilling into its cache, where the",
        "projections, convolutions, SiLU gates and attention are the same for both paths.",
        "The chunked path is matmul-bound: its gain needs a fast BLAS.",
        "",
        "| BLAS | measurement | chunked tok/s | sequential tok/s | chunked / sequential |",
        "|---|---|---:|---:|---:|",
    ]
    for result in results:
        for row in result["rows"]:
            ratio = row["chunked_tok_s"] / row["sequential_tok_s"]
            lines.append(
                f"| {result['blas']} | {row['name']} | {row['chunked_tok_s']:.0f} | "
                f"{row['sequential_tok_s']:.0f} | {ratio:.2f}x |"
            )
    (RESULTS / "gdn_prefill.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels, chunked, sequential = [], [], []
    for result in results:
        for row in result["rows"]:
            labels.append(f"{row['name'].split(' (')[0]}\n{result['blas'].split(' ')[0]}")
            chunked.append(row["chunked_tok_s"])
            sequential.append(row["sequential_tok_s"])
    xs = range(len(labels))
    fig, ax = plt.subplots(figsize=(1.8 + 2.2 * len(labels), 4))
    ax.bar([x - 0.2 for x in xs], chunked, 0.4, label="chunked")
    ax.bar([x + 0.2 for x in xs], sequential, 0.4, label="sequential")
    for x, c, s in zip(xs, chunked, sequential):
        ax.annotate(f"{c / s:.1f}x", (x - 0.2, c), ha="center", va="bottom")
    ax.set_xticks(list(xs), labels)
    ax.set_yscale("log")
    ax.set_ylabel("prefill tokens / s (log)")
    ax.set_title(f"Gated delta prefill, T={tokens}")
    ax.legend()
    fig.tight_layout()
    fig.savefig(RESULTS / "gdn_prefill.png", dpi=120)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tokens", type=int, default=2048)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--blas", choices=["auto", "openblas", "reference", "both"], default="auto")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        print(json.dumps(worker(args.tokens, args.repeats)))
        return
    results = []
    for blas in resolve_blas_choices(args.blas):
        print(f"measuring with {blas} BLAS ...", flush=True)
        results.append(run_worker(__file__, blas, ["--tokens", str(args.tokens), "--repeats", str(args.repeats)]))
    write_report(results, args.tokens)


if __name__ == "__main__":
    main()
