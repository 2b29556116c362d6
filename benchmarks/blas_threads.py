"""Which BLAS and how many threads for MLX's CPU backend: the reference BLAS of the
mlx[cpu] wheel against MKL (what `import mlx_lm` loads, fast_blas.py) with 1 and 2
threads, on the demo pair.

    python benchmarks/blas_threads.py [--rounds 3] [--tokens 64]

Each setting runs in its own fresh interpreter (the BLAS is bound when mlx.core loads),
the settings in turn, `--rounds` times (medians), so noise from other users of the
machine hits every row alike. Per setting: a plain step of the target (one token, the
cache holding the prompt), a verify of 4 tokens, greedy tokens/s of plain decoding and
of speculative decoding with the demo draft at a fixed k = 3 (float32, the CPU default).
Writes results/blas_threads.md and .png.
"""

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"
TARGET = ROOT / "examples" / "models" / "qwen3-next-stdlib"
DRAFT = ROOT / "examples" / "models" / "qwen3-draft-stdlib"
PROMPT = "def fibonacci(n):"
SETTINGS = {  # name -> environment
    "reference BLAS": {"MLX_LM_REFERENCE_BLAS": "1"},
    "MKL, 1 thread (default)": {"MKL_NUM_THREADS": "1"},
    "MKL, 2 threads": {"MKL_NUM_THREADS": "2"},
}


def worker(tokens: int) -> dict:
    """One setting's measurements, in this (fresh) process."""
    import mlx_lm  # first: it loads the BLAS
    import mlx.core as mx
    from mlx_lm import fast_blas, load, stream_generate
    from mlx_lm.models.cache import make_prompt_cache

    target, tokenizer = load(str(TARGET))
    draft, _ = load(str(DRAFT))
    prompt = tokenizer.encode(PROMPT)

    def seconds(fn, repeats=20):
        fn()
        start = time.perf_counter()
        for _ in range(repeats):
            fn()
        return (time.perf_counter() - start) / repeats

    cache = make_prompt_cache(target)
    target(mx.array(prompt)[None], cache=cache)
    mx.eval([c.state for c in cache])

    def forward(width):
        def run():
            for c in cache:
                c.start_speculation()
            mx.eval(target(mx.array([prompt[:width]]), cache=cache))
            for c in cache:
                c.trim(width)
                c.stop_speculation()
        return run

    def decode(**kwargs):
        start = time.perf_counter()
        n = sum(1 for _ in stream_generate(target, tokenizer, prompt, max_tokens=tokens, **kwargs))
        return n / (time.perf_counter() - start)

    decode(), decode(draft_model=draft, num_draft_tokens=3, adaptive_draft_length=False)  # warm up
    return {"blas": fast_blas.blas_in_use(), "plain_step_ms": 1e3 * seconds(forward(1)),
            "verify4_ms": 1e3 * seconds(forward(4)), "plain_tps": decode(),
            "spec_tps": decode(draft_model=draft, num_draft_tokens=3, adaptive_draft_length=False)}


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        print(json.dumps(worker(args.tokens)))
        return
    runs = {name: [] for name in SETTINGS}
    for r in range(args.rounds):
        for name, env in SETTINGS.items():
            clean = {k: v for k, v in os.environ.items() if k not in ("MLX_LM_REFERENCE_BLAS", "MKL_NUM_THREADS",
                                                                   "MKL_THREADING_LAYER", "LD_PRELOAD")}
            out = subprocess.run([sys.executable, __file__, "--worker", "--tokens", str(args.tokens)],
                                 env={**clean, **env}, capture_output=True, text=True, check=True)
            runs[name].append(json.loads(out.stdout.strip().splitlines()[-1]))
            print(f"round {r + 1}: {name}: {runs[name][-1]}", flush=True)
    keys = ["plain_step_ms", "verify4_ms", "plain_tps", "spec_tps"]
    med = {name: {k: statistics.median(run[k] for run in rs) for k in keys} for name, rs in runs.items()}
    lines = [
        "# BLAS and threads for MLX's CPU backend (demo pair)", "",
        f"`python benchmarks/blas_threads.py --rounds {args.rounds} --tokens {args.tokens}`: {platform.machine()}, "
        f"{os.cpu_count()} cores, float32, mlx {__import__('mlx.core').core.__version__}; each setting in its own "
        f"fresh process, settings in turn, medians of {args.rounds} rounds. Prompt {PROMPT!r}, {args.tokens} "
        "tokens greedy; speculative: the demo draft, fixed k = 3.", "",
        "| setting | BLAS reported | plain step ms | verify of 4 ms | verify / step | plain tok/s | speculative tok/s | speculative / plain |",
        "|---|---|---:|---:|---:|---:|---:|---:|",
    ]
    for name, m in med.items():
        lines.append(f"| {name} | {runs[name][0]['blas'].split(' (')[0]} | {m['plain_step_ms']:.2f} | {m['verify4_ms']:.2f} | "
                     f"{m['verify4_ms'] / m['plain_step_ms']:.2f} | {m['plain_tps']:.1f} | {m['spec_tps']:.1f} | "
                     f"{m['spec_tps'] / m['plain_tps']:.2f}x |")
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "blas_threads.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(10, 3.8))
    names = list(med)
    axes[0].bar(names, [med[n]["verify4_ms"] / med[n]["plain_step_ms"] for n in names], color="tab:orange")
    axes[0].set_ylabel("verify of 4 tokens / plain step")
    axes[1].bar(names, [med[n]["spec_tps"] / med[n]["plain_tps"] for n in names], color="tab:green")
    axes[1].axhline(1.0, color="grey", lw=0.8)
    axes[1].set_ylabel("speculative / plain tokens/s (k = 3)")
    for ax in axes:
        ax.tick_params(axis="x", labelsize=8, rotation=12)
    fig.suptitle("Demo pair on MLX's CPU backend, by BLAS")
    fig.tight_layout()
    fig.savefig(RESULTS / "blas_threads.png", dpi=120)


if __name__ == "__main__":
    main()
