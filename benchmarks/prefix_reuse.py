"""Time to first token of a prompt sharing a prefix with a cached one, against the
same prompt cold: prefix reuse on hybrid and recurrent models (issue 33).

    python benchmarks/prefix_reuse.py [--lengths 2048 8192] [--steps 2048 256] [--models demo mamba2]

For each model, prompt length L and prefill step S, as the server does it: a first
request (a document of L - 64 tokens, then a 64-token question) is prefilled into a
fresh cache from `LRUPromptCache.checkpointed` (snapshots of the recurrent states every
S tokens, within half of the byte budget) and stored with its answer. A second request,
the same document with another question, is then answered twice: through the prompt
cache (it resumes at the snapshot nearest the document's end, at or before it, with the
KV layers trimmed there, and prefills the rest) and cold (a fresh cache). Time to first
token counts the lookup and copy, the prefill and the first token. Both answers (16
greedy tokens) must be identical, and the first token's logprobs bit for bit.

Snapshots sit on the prefill grid (multiples of S: the only positions where a cold run
has the same state, see models/checkpoints.py), so S is the granularity of reuse: with
the default 2048 a 2k prompt sharing all but its question has no snapshot to resume
from. The rows with S = 256 show the finer grid and what it costs cold.

Models: `demo`, the demo target examples/models/qwen3-next-stdlib (Qwen3-Next layout,
6 Gated DeltaNet + 2 attention layers, hidden 256), on Python standard-library source
(what it was trained on); `mamba2`, a random Mamba-2 model, 2 layers but of a real
width (hidden 1024, 32 heads of 64, state 128, 8 groups), on random ids. The upstream
peer is not run: upstream mlx-lm 0.32.2 cannot trim recurrent states and re-prefills a
shared prefix (its issue #980; issue 33 measured 25.2 s shared against 20.4 s cold at
2,572 tokens on this machine), and installing it here would cost more than it tells.
Writes results/prefix_reuse.md and results/prefix_reuse.png.
"""

import argparse
import sys
import sysconfig
import time
from pathlib import Path

import mlx.core as mx
from mlx.utils import tree_map

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from mlx_lm.generate import generate_step  # noqa: E402
from mlx_lm.lru_prompt_cache import LRUPromptCache  # noqa: E402
from mlx_lm.models.cache import make_prompt_cache  # noqa: E402
from mlx_lm.utils import get_model_classes, load  # noqa: E402

RESULTS = Path(__file__).parent / "results"
DEMO = ROOT / "examples" / "models" / "qwen3-next-stdlib"
QUESTION, ANSWER = 64, 16
MAMBA2 = dict(model_type="mamba2", vocab_size=4096, hidden_size=1024, num_hidden_layers=2, num_heads=32,
              head_dim=64, state_size=128, expand=2, n_groups=8, conv_kernel=4)


def stdlib_text(num_chars: int) -> str:
    """Standard-library source, file after file, until num_chars."""
    text = ""
    for path in sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py")):
        text += path.read_text(errors="ignore")
        if len(text) >= num_chars:
            break
    return text


def demo_prompts(tokenizer, length: int):
    """(first, second): one document, two questions (other stretches of source)."""
    ids = tokenizer.encode(stdlib_text(12 * length), add_special_tokens=False)
    if len(ids) < length + 2 * QUESTION:
        raise SystemExit(f"the standard library gave only {len(ids)} tokens for prompts of {length}")
    document = ids[: length - QUESTION]
    return document + ids[length : length + QUESTION], document + ids[length + QUESTION : length + 2 * QUESTION]


def random_prompts(vocab_size: int, length: int):
    mx.random.seed(length)
    ids = mx.random.randint(1, vocab_size, (length + QUESTION,)).tolist()
    document = ids[: length - QUESTION]
    return document + ids[length - QUESTION : length], document + ids[length:]


def random_mamba2():
    model_class, args_class = get_model_classes(MAMBA2)
    model = model_class(args_class.from_dict(MAMBA2))
    mx.random.seed(0)
    model.update(tree_map(lambda w: mx.random.normal(w.shape) * 0.02, model.parameters()))
    mx.eval(model.parameters())
    return model


def answer(model, prompt_cache, tokens, step: int):
    """(seconds to the first token, the greedy answer, the first token's logprobs)."""
    start = time.perf_counter()
    steps = generate_step(mx.array(tokens), model, max_tokens=ANSWER, prompt_cache=prompt_cache,
                          prefill_step_size=step)
    token, logprobs = next(steps)
    mx.eval(logprobs)
    seconds = time.perf_counter() - start
    return seconds, [token] + [t for t, _ in steps], logprobs


def measure(model, first, second, step: int) -> dict:
    """One row: the first request stored, the second answered through the cache and cold."""
    lru = LRUPromptCache(max_bytes=8 << 30)
    entry = lru.checkpointed(make_prompt_cache(model), step)
    cold_first, answered, _ = answer(model, entry, first, step)
    lru.insert(first + answered, entry)
    start = time.perf_counter()
    fetched = lru.fetch(second)
    cache = fetched.prompt_cache or lru.checkpointed(make_prompt_cache(model), step)
    lookup = time.perf_counter() - start
    shared, shared_answer, shared_logprobs = answer(model, cache, fetched.remaining, step)
    cold, cold_answer, cold_logprobs = answer(model, make_prompt_cache(model), second, step)
    snapshots = entry.snapshots.values()
    return dict(
        tokens=len(second), step=step, cold=cold, cold_first=cold_first, shared=lookup + shared,
        resumed_at=fetched.num_cached, shared_prefix=len(second) - QUESTION, num_snapshots=len(snapshots),
        snapshot_bytes=sum(s.nbytes for s in snapshots), one_snapshot=max((s.nbytes for s in snapshots), default=0),
        identical=shared_answer == cold_answer and mx.array_equal(shared_logprobs, cold_logprobs).item(),
    )


def run(models, lengths, steps, command: str):
    rows = []
    for name in models:
        if name == "demo":
            model, tokenizer = load(str(DEMO))
            prompts = lambda length: demo_prompts(tokenizer, length)  # noqa: E731
        else:
            model = random_mamba2()
            prompts = lambda length: random_prompts(MAMBA2["vocab_size"], length)  # noqa: E731
        for length in lengths:
            first, second = prompts(length)
            for step in steps:
                row = dict(model=name, **measure(model, first, second, step))
                print(row, flush=True)
                rows.append(row)
                write_table(rows, command)  # so far, should a long run be stopped
    return rows


def write_table(rows, command: str) -> None:
    lines = [
        "# Prefix reuse: time to first token, shared prefix vs cold",
        "",
        f"`{command}` (reference BLAS, CPU, a 2-core machine shared with other work: the ratios matter).",
        "A first request (document + question) is stored; the second (same document, another question, "
        f"{QUESTION} tokens) resumes at the snapshot at or before the shared prefix, or is prefilled cold. "
        "`first cold` is the first request's own time, a cold prefill of as many tokens: the ratio takes "
        "the faster of the two (the load on the machine varies by minutes). Answers: 16 greedy tokens and the first logprobs, "
        "resumed vs cold.",
        "",
        "| model | prompt tokens | prefill step | shared prefix | resumed at | first cold s | cold s | shared s "
        "| shared / faster cold | snapshots | snapshot MB (each) | answers |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['model']} | {r['tokens']} | {r['step']} | {r['shared_prefix']} | {r['resumed_at']} "
            f"| {r['cold_first']:.2f} | {r['cold']:.2f} | {r['shared']:.2f} "
            f"| {r['shared'] / min(r['cold'], r['cold_first']):.3f}x "
            f"| {r['num_snapshots']} | {r['snapshot_bytes'] / 2**20:.1f} ({r['one_snapshot'] / 2**20:.2f}) "
            f"| {'identical' if r['identical'] else 'DIFFER'} |"
        )
    lines += ["", "Resumed at 0: no snapshot at or before the shared prefix (the prefill step is coarser than "
              "the prompt), so both runs are cold prefills and their difference is the machine's noise. "
              "Snapshot MB: what the stored entry keeps in all, and one snapshot."]
    lines += ["", "Upstream mlx-lm 0.32.2 is not run (see the script's docstring): it re-prefills the whole "
              "shared prefix of a recurrent model (issue 33: 25.2 s shared vs 20.4 s cold at 2,572 tokens)."]
    (RESULTS / "prefix_reuse.md").write_text("\n".join(lines) + "\n")


def write_plot(rows) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = [f"{r['model']}\n{r['tokens']} tok, S={r['step']}" for r in rows]
    x = range(len(rows))
    fig, ax = plt.subplots(figsize=(max(6, 1.4 * len(rows)), 4))
    ax.bar([i - 0.2 for i in x], [min(r["cold"], r["cold_first"]) for r in rows], 0.4, label="cold (the faster)")
    ax.bar([i + 0.2 for i in x], [r["shared"] for r in rows], 0.4, label="shared prefix (resumed)")
    ax.set_xticks(list(x), labels, fontsize=7)
    ax.set_yscale("log")
    ax.set_ylabel("time to first token (s)")
    ax.set_title("Prefix reuse on recurrent models (issue 33)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(RESULTS / "prefix_reuse.png", dpi=120)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lengths", type=int, nargs="+", default=[2048, 8192])
    parser.add_argument("--steps", type=int, nargs="+", default=[2048, 256])
    parser.add_argument("--models", nargs="+", choices=["demo", "mamba2"], default=["demo", "mamba2"])
    args = parser.parse_args()
    command = ("python benchmarks/prefix_reuse.py " + " ".join(sys.argv[1:])).strip()
    rows = run(args.models, args.lengths, args.steps, command)
    write_plot(rows)


if __name__ == "__main__":
    main()
