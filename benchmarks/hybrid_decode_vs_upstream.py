"""Decode speed of a hybrid (Gated DeltaNet + attention) model: this fork vs upstream
mlx-lm, on the same local checkpoint, side by side.

    python benchmarks/hybrid_decode_vs_upstream.py [--blas auto|openblas|reference|both]

Upstream is installed from PyPI (`mlx-lm` with `mlx[cpu]`) into its own virtual
environment, benchmarks/.venv-upstream, created on first use. The benchmark writes a
random qwen3_next checkpoint in the transformers layout (config in the transformers-4
dialect, which upstream 0.32 needs; per-expert weights, raw conv1d, zero-centred norms),
which both implementations load and sanitize themselves: nothing is converted. Each run
prefills a prompt and then decodes greedily one token at a time (one forward and one
eval per token, no sampling code), alternating implementations over several rounds; the
best round counts, as the machine is shared. The greedy tokens of both are compared too.
Writes results/hybrid_decode_vs_upstream.md and .png.
"""

import argparse
import json
import math
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from gdn_prefill import RESULTS, resolve_blas_choices, run_worker  # noqa: E402

VENV = Path(__file__).parent / ".venv-upstream"
PROMPT_TOKENS = 64

# Realistic linear-attention dims (Qwen3-Next: 16 key heads, 32 value heads, head dim
# 128); the rest kept small so a decode step is not all projection matmuls.
CONFIG = dict(
    model_type="qwen3_next", architectures=["Qwen3NextForCausalLM"], hidden_size=1024,
    num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=2, head_dim=128,
    vocab_size=4096, intermediate_size=1024, linear_num_key_heads=16, linear_num_value_heads=32,
    linear_key_head_dim=128, linear_value_head_dim=128, linear_conv_kernel_dim=4,
    num_experts=16, num_experts_per_tok=4, moe_intermediate_size=256,
    shared_expert_intermediate_size=256, decoder_sparse_step=1, mlp_only_layers=[],
    norm_topk_prob=True, rms_norm_eps=1e-6, max_position_embeddings=4096, rope_theta=1e7,
    partial_rotary_factor=0.25, rope_scaling=None, full_attention_interval=4,
    tie_word_embeddings=False, attention_bias=False, hidden_act="silu",
)


def hf_shapes(c: dict) -> dict:
    """Tensor name -> shape of a qwen3_next checkpoint as transformers saves it."""
    H, V, E = c["hidden_size"], c["vocab_size"], c["num_experts"]
    key_dim = c["linear_num_key_heads"] * c["linear_key_head_dim"]
    value_dim = c["linear_num_value_heads"] * c["linear_value_head_dim"]
    Hv, hd = c["linear_num_value_heads"], c["head_dim"]
    shapes = {"model.embed_tokens.weight": (V, H), "model.norm.weight": (H,), "lm_head.weight": (V, H)}
    for i in range(c["num_hidden_layers"]):
        p = f"model.layers.{i}."
        shapes[p + "input_layernorm.weight"] = (H,)
        shapes[p + "post_attention_layernorm.weight"] = (H,)
        if (i + 1) % c["full_attention_interval"]:
            a = p + "linear_attn."
            shapes.update({
                a + "in_proj_qkvz.weight": (2 * key_dim + 2 * value_dim, H),
                a + "in_proj_ba.weight": (2 * Hv, H),
                a + "conv1d.weight": (2 * key_dim + value_dim, 1, c["linear_conv_kernel_dim"]),
                a + "A_log": (Hv,), a + "dt_bias": (Hv,),
                a + "norm.weight": (c["linear_value_head_dim"],),
                a + "out_proj.weight": (H, value_dim),
            })
        else:
            a = p + "self_attn."
            heads, kv = c["num_attention_heads"], c["num_key_value_heads"]
            shapes.update({
                a + "q_proj.weight": (2 * heads * hd, H), a + "k_proj.weight": (kv * hd, H),
                a + "v_proj.weight": (kv * hd, H), a + "o_proj.weight": (H, heads * hd),
                a + "q_norm.weight": (hd,), a + "k_norm.weight": (hd,),
            })
        m, inter, shared = p + "mlp.", c["moe_intermediate_size"], c["shared_expert_intermediate_size"]
        shapes[m + "gate.weight"] = (E, H)
        shapes[m + "shared_expert_gate.weight"] = (1, H)
        for name, shape in (("gate_proj", (shared, H)), ("up_proj", (shared, H)), ("down_proj", (H, shared))):
            shapes[f"{m}shared_expert.{name}.weight"] = shape
        for e in range(E):
            for name, shape in (("gate_proj", (inter, H)), ("up_proj", (inter, H)), ("down_proj", (H, inter))):
                shapes[f"{m}experts.{e}.{name}.weight"] = shape
    return shapes


def write_checkpoint(directory: Path) -> None:
    import numpy as np
    from safetensors.numpy import save_file

    rng = np.random.default_rng(0)
    weights = {}
    for name, shape in hf_shapes(CONFIG).items():
        if name.endswith("A_log"):
            value = np.log(rng.uniform(1, 16, shape))
        elif name.endswith("dt_bias"):
            value = np.ones(shape)
        elif len(shape) == 1:  # norms: zero-centred in the checkpoint, plain for linear_attn.norm
            value = rng.normal(0, 0.1, shape) + (1.0 if name.endswith("linear_attn.norm.weight") else 0.0)
        else:
            value = rng.normal(0, 1 / math.sqrt(shape[-1]), shape)
        weights[name] = value.astype(np.float32)
    directory.mkdir(parents=True, exist_ok=True)
    save_file(weights, str(directory / "model.safetensors"), metadata={"format": "pt"})
    (directory / "config.json").write_text(json.dumps(CONFIG, indent=2))


def ensure_upstream() -> Path:
    python = VENV / "bin" / "python"
    if not python.exists():
        print(f"creating {VENV} with upstream mlx-lm from PyPI ...", flush=True)
        subprocess.run([sys.executable, "-m", "venv", str(VENV)], check=True)
        subprocess.run([str(python), "-m", "pip", "install", "-q", "mlx[cpu]", "mlx-lm"], check=True)
    return python


def worker(checkpoint: str, tokens: int) -> dict:
    """Runs inside either interpreter: only the API both implementations share."""
    import mlx.core as mx
    from mlx_lm.models.cache import make_prompt_cache
    from mlx_lm.utils import load_model
    import mlx_lm

    model, _ = load_model(Path(checkpoint))
    prompt = mx.array([(7 * i) % CONFIG["vocab_size"] for i in range(PROMPT_TOKENS)])[None]
    cache = make_prompt_cache(model)
    y = mx.argmax(model(prompt, cache=cache)[:, -1], axis=-1)
    mx.eval(y)
    generated = []
    start = time.perf_counter()
    for _ in range(tokens):
        y = mx.argmax(model(y[:, None], cache=cache)[:, -1], axis=-1)
        mx.eval(y)
        generated.append(y.item())
    seconds = time.perf_counter() - start
    return {"version": mlx_lm.__version__, "tok_s": tokens / seconds, "tokens": generated}


def write_report(rows) -> None:
    lines = [
        "# Hybrid decode: this fork vs upstream mlx-lm (same checkpoint)",
        "",
        f"qwen3_next, {CONFIG['num_hidden_layers']} layers (3 Gated DeltaNet + 1 attention), hidden "
        f"{CONFIG['hidden_size']}, linear attention 16 key / 32 value heads of dim 128, "
        f"{CONFIG['num_experts']} experts top-{CONFIG['num_experts_per_tok']}; prompt {PROMPT_TOKENS} tokens, greedy.",
        "",
        "| BLAS | ours tok/s | upstream tok/s | ours / upstream | same greedy tokens |",
        "|---|---:|---:|---:|---|",
    ]
    for row in rows:
        lines.append(
            f"| {row['blas']} | {row['ours']:.1f} | {row['upstream']:.1f} ({row['upstream_version']}) | "
            f"{row['ours'] / row['upstream']:.3f} | {row['same_tokens']} |"
        )
    (RESULTS / "hybrid_decode_vs_upstream.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    xs = range(len(rows))
    fig, ax = plt.subplots(figsize=(2 + 3 * len(rows), 4))
    ax.bar([x - 0.2 for x in xs], [r["ours"] for r in rows], 0.4, label="this fork")
    ax.bar([x + 0.2 for x in xs], [r["upstream"] for r in rows], 0.4, label="upstream mlx-lm")
    ax.set_xticks(list(xs), [r["blas"].split(" ")[0] + " BLAS" for r in rows])
    ax.set_ylabel("decode tokens / s")
    ax.set_title("qwen3_next hybrid decode")
    ax.legend()
    fig.tight_layout()
    fig.savefig(RESULTS / "hybrid_decode_vs_upstream.png", dpi=120)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tokens", type=int, default=48)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--blas", choices=["auto", "openblas", "reference", "both"], default="both")
    parser.add_argument("--worker", nargs=2, metavar=("CHECKPOINT", "TOKENS"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        print(json.dumps(worker(args.worker[0], int(args.worker[1]))))
        return
    upstream_python = ensure_upstream()
    with tempfile.TemporaryDirectory() as checkpoint:
        write_checkpoint(Path(checkpoint))
        rows = [measure(blas, checkpoint, upstream_python, args) for blas in resolve_blas_choices(args.blas)]
    write_report(rows)


def measure(blas: str, checkpoint: str, upstream_python: Path, args) -> dict:
    best = {}
    for _ in range(args.rounds):
        for who, python in (("ours", sys.executable), ("upstream", str(upstream_python))):
            result = run_worker(__file__, blas, [checkpoint, str(args.tokens)], python=python)
            print(f"{blas} {who} {result['version']}: {result['tok_s']:.1f} tok/s", flush=True)
            if result["tok_s"] > best.get(who, {}).get("tok_s", 0):
                best[who] = result
    return {
        "blas": best["ours"]["blas"], "ours": best["ours"]["tok_s"], "upstream": best["upstream"]["tok_s"],
        "upstream_version": best["upstream"]["version"],
        "same_tokens": best["ours"]["tokens"] == best["upstream"]["tokens"],
    }


if __name__ == "__main__":
    main()
