"""Decoding speed on the CPU backend by compute dtype: what `load`'s `auto` policy buys.

    python benchmarks/cpu_dtype.py [--tokens 48] [--rounds 5] [--blas default|reference]

MLX's CPU backend runs half precision by conversion: float16 matmuls cost ~3x float32,
and `quantized_matmul` with float16 scales ~40x float32 scales. `load(dtype="auto")`
therefore casts half-precision parameters (scales included) to float32 on the CPU.
This measures plain greedy decoding of the demo target (examples/models, float16 on
disk) as loaded in each way, all in one process, in alternating rounds (median of
`--rounds`), so noise from other users of the machine hits every row alike:

- float32 copy: the checkpoint converted to float32 on disk (the reference speed);
- float16 checkpoint, `auto` (float32 compute) and `float16` (the old behaviour);
- 4-bit convert of it (`mlx_lm.convert -q`, float16 scales), `auto` and `float16`;
- speculative decoding with the demo pair (k=4), both models under `auto`.

Goal (issue 21): the float16 and 4-bit checkpoints under `auto` within 20% of the
float32 copy's tokens/s. Writes results/cpu_dtype_<blas>.md and .png (`default`: the
library's fast BLAS, or `reference`): run it once per BLAS, since which one MLX calls changes the ratios (dense
float32 matmuls gain ~3-4x from a fast BLAS, `quantized_matmul` is MLX's own kernel).
"""

import argparse
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(Path(__file__).parent))
from gdn_prefill import RESULTS  # noqa: E402
from spec_bench import DRAFT, PROMPTS, TARGET, BLAS_CHOICES, loaded_blas, reexec_with_blas  # noqa: E402


def tokens_per_second(decode, prompts, tokens: int) -> float:
    """Greedy tokens/s of `decode(prompt)` (a token generator) over all prompts."""
    import mlx.core as mx

    seconds = 0.0
    for prompt in prompts:
        start = time.perf_counter()
        for n, _ in enumerate(decode(mx.array(prompt)), start=1):
            if n == tokens:
                break
        seconds += time.perf_counter() - start
    return len(prompts) * tokens / seconds


def build_checkpoints(scratch: Path) -> dict:
    from mlx_lm.convert import convert

    float32, quantized = scratch / "float32", scratch / "q4"
    convert(str(TARGET), str(float32), dtype="float32")
    convert(str(TARGET), str(quantized), quantize=True)
    return {"float32": float32, "float16": TARGET, "q4": quantized}


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tokens", type=int, default=48, help="tokens generated per prompt")
    parser.add_argument("--rounds", type=int, default=5, help="alternating rounds (median)")
    parser.add_argument("--blas", choices=BLAS_CHOICES, default="default")
    args = parser.parse_args()
    reexec_with_blas(args.blas)
    sys.path.insert(0, str(ROOT))
    import mlx.core as mx
    from mlx_lm.generate import generate_step, speculative_generate_step
    from mlx_lm.tokenizer_utils import load as load_tokenizer
    from mlx_lm.utils import load, parameter_dtypes

    blas = loaded_blas()
    print(f"BLAS: {blas}", flush=True)
    tokenizer = load_tokenizer(TARGET)
    prompts = [tokenizer.encode(p) for p in PROMPTS]
    with tempfile.TemporaryDirectory() as scratch:
        paths = build_checkpoints(Path(scratch))
        rows = {
            "float32 copy, auto": load(str(paths["float32"]))[0],
            "float16 checkpoint, auto": load(str(paths["float16"]))[0],
            "float16 checkpoint, dtype=float16": load(str(paths["float16"]), dtype="float16")[0],
            "4-bit (float16 scales), auto": load(str(paths["q4"]))[0],
            "4-bit (float16 scales), dtype=float16": load(str(paths["q4"]), dtype="float16")[0],
        }
    draft = load(str(DRAFT))[0]
    speculative = "demo pair speculative k=4, auto"
    decoders = {name: (lambda p, m=model: generate_step(p, m, max_tokens=args.tokens)) for name, model in rows.items()}
    decoders[speculative] = lambda p: speculative_generate_step(
        p, rows["float16 checkpoint, auto"], draft, num_draft_tokens=4, adaptive_draft_length=False,
        max_tokens=args.tokens)
    for decode in decoders.values():  # warm up every path once
        tokens_per_second(decode, prompts[:1], 8)
    samples = {name: [] for name in decoders}
    started = time.time()
    for _ in range(args.rounds):
        for name, decode in decoders.items():
            samples[name].append(tokens_per_second(decode, prompts, args.tokens))
    speeds = {name: statistics.median(v) for name, v in samples.items()}
    reference = speeds["float32 copy, auto"]

    dtypes = {name: parameter_dtypes(model) for name, model in rows.items()}
    dtypes[speculative] = f"{parameter_dtypes(rows['float16 checkpoint, auto'])} (draft {parameter_dtypes(draft)})"
    lines = [
        "# Decoding speed by compute dtype on the CPU backend",
        "",
        f"- BLAS: {blas}",
        f"- machine: {platform.processor() or platform.machine()}, {os.cpu_count()} cores (shared), mlx {mx.__version__}",
        f"- model: the demo target `examples/models/qwen3-next-stdlib` (float16 on disk); greedy, "
        f"{len(prompts)} prompts x {args.tokens} tokens, median of {args.rounds} alternating rounds "
        f"({(time.time() - started) / 60:.1f} min)",
        "- command: `python benchmarks/cpu_dtype.py" + "".join(f" {a}" for a in sys.argv[1:]) + "`",
        "",
        "| checkpoint, load dtype | parameters compute in | tokens/s | vs float32 copy |",
        "|---|---|---:|---:|",
    ]
    for name, speed in speeds.items():
        lines.append(f"| {name} | {dtypes[name]} | {speed:.1f} | {speed / reference:.2f}x |")
    for name in ("float16 checkpoint, auto", "4-bit (float16 scales), auto"):
        ratio = speeds[name] / reference
        lines.append(f"\nGoal (within 20% of the float32 copy): {name}: {ratio:.2f}x -> {'met' if ratio >= 0.8 else 'MISSED'}")
    report = "\n".join(lines) + "\n"
    RESULTS.mkdir(exist_ok=True)
    stem = "cpu_dtype_" + ("reference" if "reference BLAS" in blas else "default")
    (RESULTS / f"{stem}.md").write_text(report)
    print(report)
    write_plot(speeds, reference, blas, RESULTS / f"{stem}.png")


def write_plot(speeds: dict, reference: float, blas: str, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(speeds)
    fig, ax = plt.subplots(figsize=(9, 4))
    bars = ax.barh(names[::-1], [speeds[n] for n in names[::-1]],
                   color=["tab:green" if "auto" in n else "tab:gray" for n in names[::-1]])
    ax.axvline(reference, color="k", linestyle="--", linewidth=1, label="float32 copy")
    ax.axvline(0.8 * reference, color="tab:red", linestyle=":", linewidth=1, label="goal: 80% of float32")
    for bar, name in zip(bars, names[::-1]):
        ax.text(bar.get_width(), bar.get_y() + bar.get_height() / 2, f" {speeds[name] / reference:.2f}x", va="center")
    ax.set_xlabel("tokens/s (greedy decoding)")
    ax.set_title(f"Demo target on the CPU backend by compute dtype\n{blas.split(' preloaded')[0]}", fontsize=9)
    ax.legend(loc="lower right", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    main()
