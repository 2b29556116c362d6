"""Time to first token of a prompt sharing a prefix with a cached one, against the
same prompt cold: prefix reuse on hybrid and recurrent models (issue 33), this project
and upstream mlx-lm 0.32.2 side by side.

    python benchmarks/prefix_reuse.py [--lengths 2048 8192 32768] [--models demo demo_mtp mamba2]
                                      [--steps 2048] [--forms tokens chat]
                                      [--peer-lengths [2048 8192]]
                                      [--no-peer] [--peer-venv DIR]

For each model and prompt length L, as a server does it: a first request (a document
of L - 64 tokens, then a 64-token question) is prefilled into a fresh cache and stored
with its greedy answer; a second request, the same document with another question, is
then answered through the prompt cache (resuming where the cache allows) and cold (a
fresh cache). Time to first token counts the lookup and copy, the prefill and the first
token. Two forms of the same ids: `tokens`, a token prompt (as /v1/completions sends
it: no message boundaries), and `chat`, the document its own message (a system prompt,
an earlier turn) and the question the last one: the server then knows where the
document ends and passes it as a message boundary (prefill chunks end there, and a
snapshot is taken there), here to the first, the resumed and the cold request alike.
This project runs at its defaults: `load` (float32 on the CPU), the fast BLAS
`import mlx_lm` loads (fast_blas.py), the server's prompt-cache budget
(`served_model.default_prompt_cache_bytes`, half of it for snapshots), prefill step 2048;
`--steps` adds other steps. Its two answers (16 greedy tokens) must be identical and
the first token's logprobs equal bit for bit: the run fails otherwise (after writing
the table, which says DIFFER).

The peer is upstream mlx-lm 0.32.2 in its own virtual environment (`--peer-venv`,
created with `pip install mlx-lm==0.32.2 mlx[cpu]` on first use) and driven as a
subprocess, prefix_reuse_peer.py, making the calls its server makes (`LRUPromptCache`,
`fetch_nearest_cache`, `generate_step`) on the same token ids; in the chat form it
stores the document as its server stores a chat request's system messages (a "system"
segment), which it can reuse. It reads the weights this project computes with, written
out: float32 (upstream keeps a checkpoint's dtype, and the demo's float16 runs ~3x
slower on the CPU), in the MLX layout, without the demo's MTP head (upstream refuses
weights it does not know). Its BLAS is its mlx wheel's own; set MLX_LM_REFERENCE_BLAS=1
to run this project on the same one. Its first request is its cold time (the second is
as long). It runs only at `--peer-lengths` (by default not at 32k: its CPU prefill of a
Gated DeltaNet layer steps token by token, and a cold request takes it many minutes
there; for a token prompt it re-prefills a shared prefix at every length anyway).
Each process first answers an untimed request of 128 tokens (one-time setup).

Models: `demo`, the demo target examples/models/qwen3-next-stdlib (Qwen3-Next layout,
6 Gated DeltaNet + 2 attention layers, hidden 256), on Python standard-library source
(what it was trained on); `demo_mtp`, the same target drafting with its MTP head
(speculative_generate_step(mtp=True), 2 drafts a round: the cache holds the head's
entries too, and its snapshots the hidden state the head's next pair reads; no peer,
upstream 0.32.2 has no MTP drafting); `mamba2`, a random Mamba-2 model, 2 layers but of a real
width (hidden 1024, 32 heads of 64, state 128, 8 groups), on random ids, written to a
checkpoint both implementations load. Writes results/prefix_reuse.md and .png.
"""

import argparse
import functools
import itertools
import json
import os
import platform
import subprocess
import sys
import sysconfig
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

# mlx_lm before mlx.core: importing it loads the fast BLAS (the project's default).
from mlx_lm import fast_blas  # noqa: E402, I001
import mlx.core as mx  # noqa: E402
from mlx.utils import tree_flatten, tree_map  # noqa: E402

from mlx_lm.feeding import DEFAULT_PREFILL_STEP_SIZE  # noqa: E402
from mlx_lm.generate import generate_step, speculative_generate_step  # noqa: E402
from mlx_lm.models.lru_prompt_cache import LRUPromptCache  # noqa: E402
from mlx_lm.models.cache import make_prompt_cache  # noqa: E402
from mlx_lm.served_model import default_prompt_cache_bytes  # noqa: E402
from mlx_lm.utils import get_model_classes, load, load_model, parameter_dtypes  # noqa: E402

RESULTS = Path(__file__).parent / "results"
PEER_SCRIPT = Path(__file__).parent / "prefix_reuse_peer.py"
PEER_VERSION = "0.32.2"
PEER_MAX_DEFAULT = 8192  # the longest prompt upstream runs at unless told (its CPU prefill is slow)
DEMO = ROOT / "examples" / "models" / "qwen3-next-stdlib"
QUESTION, ANSWER = 64, 16
WARM_UP = 128  # tokens of an untimed request first in each process: first calls pay one-time setup
# Every key upstream 0.32.2's Mamba-2 ModelArgs requires (this project's drops the ones it derives).
MTP_DRAFTS = 2  # the MTP row's draft tokens a round (fixed: a seeded or timed run should not depend on learning)
MAMBA2 = dict(model_type="mamba2", vocab_size=4096, hidden_size=1024, intermediate_size=2048, num_hidden_layers=2,
              num_heads=32, head_dim=64, state_size=128, expand=2, n_groups=8, conv_kernel=4,
              layer_norm_epsilon=1e-5, use_bias=False, use_conv_bias=True, tie_word_embeddings=False,
              time_step_limit=[0.0, float("inf")], time_step_rank="auto")


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


def write_mamba2(directory: Path) -> Path:
    """A random Mamba-2 checkpoint (MLX layout, float32) both implementations load."""
    model_class, args_class = get_model_classes(MAMBA2)
    model = model_class(args_class.from_dict(MAMBA2))
    mx.random.seed(0)
    model.update(tree_map(lambda w: mx.random.normal(w.shape) * 0.02, model.parameters()))
    directory.mkdir(parents=True)
    mx.save_safetensors(str(directory / "model.safetensors"), dict(tree_flatten(model.parameters())),
                        metadata={"format": "mlx"})
    (directory / "config.json").write_text(json.dumps(MAMBA2, indent=2))
    return directory


def write_demo_for_peer(model, directory: Path) -> Path:
    """The demo target as this project loaded it (float32, MLX layout, as mlx_lm.convert
    writes it: upstream 0.32.2's qwen3_next sanitize takes a checkpoint without experts
    for converted and leaves it alone), without its MTP head (upstream has none and
    refuses weights it does not know)."""
    kept = {k: v for k, v in tree_flatten(model.parameters()) if not k.startswith("mtp.")}
    directory.mkdir(parents=True)
    mx.save_safetensors(str(directory / "model.safetensors"), kept, metadata={"format": "mlx"})
    config = json.loads((DEMO / "config.json").read_text())
    config.update(dtype="float32", num_nextn_predict_layers=0)
    (directory / "config.json").write_text(json.dumps(config, indent=2))
    return directory


def fresh_cache(model, mtp: bool):
    """A model's empty cache list; with `mtp` its head's entries after the target's."""
    return make_prompt_cache(model) + (model.make_mtp_cache() if mtp else [])


def answer(model, prompt_cache, tokens, step: int, mtp: bool = False):
    """(seconds to the first token, the greedy answer, the first token's logprobs);
    `mtp`: drafted by the model's MTP head."""
    start = time.perf_counter()
    options = dict(max_tokens=ANSWER, prompt_cache=prompt_cache, prefill_step_size=step)
    if mtp:
        steps = ((t, lp) for t, lp, _ in speculative_generate_step(
            mx.array(tokens), model, mtp=True, num_draft_tokens=MTP_DRAFTS, adaptive_draft_length=False, **options))
    else:
        steps = generate_step(mx.array(tokens), model, **options)
    token, logprobs = next(steps)
    mx.eval(logprobs)
    seconds = time.perf_counter() - start
    return seconds, [token] + [t for t, _ in steps], logprobs


def measure(model, first, second, step: int, form: str, mtp: bool = False) -> dict:
    """This project's row: the first request stored, the second answered through the
    prompt cache and cold. Form "chat": the server's message boundary at the document's
    end is given to every cache (a cold run of a chat prompt is cut there too). `mtp`:
    every request drafted by the model's MTP head."""
    lru = LRUPromptCache(max_bytes=default_prompt_cache_bytes())
    bounds = dict(message_boundaries=[len(second) - QUESTION]) if form == "chat" else {}
    entry = lru.checkpointed(fresh_cache(model, mtp), step, **bounds)
    cold_first, answered, _ = answer(model, entry, first, step, mtp)
    lru.insert(first + answered, entry)
    start = time.perf_counter()
    fetched = lru.fetch(second, **bounds)
    cache = fetched.prompt_cache or lru.checkpointed(fresh_cache(model, mtp), step, **bounds)
    lookup = time.perf_counter() - start
    shared, shared_answer, shared_logprobs = answer(model, cache, fetched.remaining, step, mtp)
    cold, cold_answer, cold_logprobs = answer(model, lru.checkpointed(fresh_cache(model, mtp), step, **bounds),
                                              second, step, mtp)
    snapshots = entry.snapshots.values()
    return dict(
        form=form, tokens=len(second), step=step, cold=cold, cold_first=cold_first, shared=lookup + shared,
        resumed_at=fetched.num_cached, shared_prefix=len(second) - QUESTION, num_snapshots=len(snapshots),
        snapshot_bytes=sum(s.nbytes for s in snapshots), one_snapshot=max((s.nbytes for s in snapshots), default=0),
        answer=cold_answer,
        identical=shared_answer == cold_answer and mx.array_equal(shared_logprobs, cold_logprobs).item(),
    )


def ensure_peer(venv: Path) -> Path:
    """The python of the peer's virtual environment, created on first use."""
    python = venv / "bin" / "python"
    if not python.exists():
        print(f"creating {venv} with mlx-lm {PEER_VERSION} from the package index ...", flush=True)
        subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
        subprocess.run([str(python), "-m", "pip", "install", "-q", f"mlx-lm=={PEER_VERSION}", "mlx[cpu]"], check=True)
    return python


def run_peer(python: Path, checkpoint: Path, first, second, step: int, form: str, workdir: Path) -> dict:
    """Upstream's row, from prefix_reuse_peer.py run by the peer's python (in `workdir`,
    without PYTHONPATH, so nothing of this checkout is importable there)."""
    job = workdir / "job.json"
    job.write_text(json.dumps(dict(model=str(checkpoint), first=first, second=second, answer_tokens=ANSWER,
                                   prefill_step_size=step, warm_up_tokens=WARM_UP,
                                   document_end=len(second) - QUESTION if form == "chat" else None,
                                   expect_version=PEER_VERSION)))
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    out = subprocess.run([str(python), str(PEER_SCRIPT), str(job)], capture_output=True, text=True, env=env,
                         cwd=workdir)
    if out.returncode:
        raise SystemExit(f"the peer ({python}) failed with status {out.returncode}:\n{out.stderr[-4000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def load_models(names, workdir: Path):
    """name -> (our model, prompts(length), the checkpoint the peer reads or None (no
    peer), whether its MTP head drafts)."""
    for name in names:
        if name in ("demo", "demo_mtp"):
            model, tokenizer = load(str(DEMO))
            prompts = functools.partial(demo_prompts, tokenizer)
            if name == "demo_mtp":
                yield name, model, prompts, None, True
            else:
                yield name, model, prompts, write_demo_for_peer(model, workdir / "demo"), False
        else:
            checkpoint = write_mamba2(workdir / "mamba2")
            model, _ = load_model(checkpoint)
            yield name, model, lambda n: random_prompts(MAMBA2["vocab_size"], n), checkpoint, False


def run(args, command: str):
    rows = []
    peer_python = None if args.no_peer else ensure_peer(args.peer_venv)
    with tempfile.TemporaryDirectory() as tmp:
        for name, model, prompts, checkpoint, mtp in load_models(args.models, Path(tmp)):
            for length in args.lengths:
                first, second = prompts(length)
                answer(model, make_prompt_cache(model), first[:WARM_UP], args.steps[0])  # untimed
                for step, form in itertools.product(args.steps, args.forms):
                    row = dict(model=name, dtype=parameter_dtypes(model),
                               **measure(model, first, second, step, form, mtp))
                    if peer_python is not None and checkpoint is not None and length in args.peer_lengths:
                        row["peer"] = run_peer(peer_python, checkpoint, first, second, step, form, Path(tmp))
                    print({k: v for k, v in row.items() if k != "answer"}, flush=True)
                    rows.append(row)
                    write_table(rows, command)  # so far, should a long run be stopped
                    write_plot(rows)
    return rows


def ours_ratio(row: dict) -> float:
    """Shared over the faster of the two cold prefills (the load on the machine varies by minutes)."""
    return row["shared"] / min(row["cold"], row["cold_first"])


def row_line(r: dict) -> str:
    ours = (f"| {r['model']} | {r['form']} | {r['tokens']} | {r['step']} | {r['shared_prefix']} | {r['resumed_at']} "
            f"| {min(r['cold'], r['cold_first']):.2f} | {r['shared']:.2f} | **{ours_ratio(r):.3f}x** "
            f"| {r['num_snapshots']} | {r['snapshot_bytes'] / 2**20:.1f} ({r['one_snapshot'] / 2**20:.2f}) "
            f"| {'identical' if r['identical'] else 'DIFFER'} ")
    if "peer" not in r:
        return ours + "| not run | | | | |"
    p = r["peer"]
    return ours + (f"| {p['resumed_at']} | {p['first']:.2f} | {p['shared']:.2f} | {p['shared'] / p['first']:.3f}x "
                   f"| {'yes' if p['shared_answer'] == r['answer'] else 'no'} |")


def header(rows, command: str) -> list:
    peer = next((r["peer"] for r in rows if "peer" in r), None)
    peer_line = (f"- upstream: mlx-lm {peer['version']} (mlx {peer['mlx']}), BLAS libraries mapped: "
                 f"{', '.join(peer['blas']) or 'none named blas/mkl'}; dtype {peer['dtype']} (a float32 copy)"
                 if peer else "- upstream: not run (--no-peer)")
    dtypes = ", ".join(sorted({f"{r['model']} {r['dtype']}" for r in rows}))
    return [
        "# Prefix reuse: time to first token, shared prefix vs cold, this project and upstream",
        "",
        f"- command: `{command}`",
        f"- machine: {platform.machine()}, {os.cpu_count()} cores shared with other work; load average "
        f"{' / '.join(f'{v:.2f}' for v in os.getloadavg())} (1/5/15 min) when this table was written",
        f"- this project: mlx {mx.__version__}, BLAS {fast_blas.blas_in_use()}; dtype {dtypes}; prompt cache "
        f"{default_prompt_cache_bytes() / 2**30:.1f} GiB (the server's default), half for snapshots",
        peer_line,
        "",
        "A first request (document + question) is stored with its answer; the second (the same document, another "
        f"{QUESTION}-token question) is answered through the prompt cache, then cold. Times to the first token in "
        "seconds. Ours: `cold` is the faster of the first request and the second run cold (as long); `answers` "
        f"compares the second request's {ANSWER} greedy tokens and first logprobs, resumed vs cold (asserted). "
        "Upstream: `cold` is its first request; `= ours` says whether its answer equals ours token for token.",
        "",
        "| model | form | prompt tokens | prefill step | shared prefix | ours resumed at | ours cold | ours shared "
        "| ours shared / cold | snapshots | snapshot MB (each) | ours answers | upstream resumed at | upstream cold "
        "| upstream shared | upstream shared / cold | upstream = ours |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|---:|---:|---:|---:|---|",
    ]


def write_table(rows, command: str) -> None:
    lines = header(rows, command) + [row_line(r) for r in rows]
    lines += [
        "",
        "Resumed at: the tokens the prompt cache supplied (the snapshot at or before the shared prefix, with the KV "
        "layers trimmed there); 0 is a cold prefill. Snapshot MB: all the stored entry keeps, and one snapshot. "
        "Form `tokens`: a token prompt (/v1/completions), no message boundaries; `chat`: the document its own "
        "message, its end a message boundary (this project cuts prefill chunks and takes a snapshot there; "
        "upstream's server stores a segment there, but only after system messages: a document sent as an earlier "
        "user turn it would not reuse). Upstream 0.32.2 cannot trim a recurrent "
        "state: for a token prompt it finds no usable entry and prefills everything again. Issue 33's goal: "
        "shared <= 0.1x cold at 2k tokens, <= 0.05x at 32k, answers identical.",
    ]
    (RESULTS / "prefix_reuse.md").write_text("\n".join(lines) + "\n")


def write_plot(rows) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (times, ratios) = plt.subplots(1, 2, figsize=(min(16, max(9, 0.8 * len(rows) + 5)), 5.5))
    labels = [f"{r['model']} {r['form']}\n{r['tokens']} tok, S={r['step']}" for r in rows]
    bars = [("ours cold", lambda r: min(r["cold"], r["cold_first"])), ("ours shared", lambda r: r["shared"]),
            ("upstream cold", lambda r: r.get("peer", {}).get("first", 0)),
            ("upstream shared", lambda r: r.get("peer", {}).get("shared", 0))]
    for i, (label, value) in enumerate(bars):
        times.bar([x + 0.2 * (i - 1.5) for x in range(len(rows))], [value(r) for r in rows], 0.2, label=label)
    times.set_xticks(list(range(len(rows))), labels, fontsize=6, rotation=60)
    times.set_yscale("log")
    times.set_ylabel("time to first token (s)")
    times.legend(fontsize=7)
    for model, form in sorted({(r["model"], r["form"]) for r in rows}):
        mine = [r for r in rows if (r["model"], r["form"], r["step"]) == (model, form, rows[0]["step"])]
        ratios.plot([r["tokens"] for r in mine], [ours_ratio(r) for r in mine], "o-", label=f"ours, {model} {form}")
        peer = [r for r in mine if "peer" in r]
        ratios.plot([r["tokens"] for r in peer], [r["peer"]["shared"] / r["peer"]["first"] for r in peer], "s--",
                    label=f"upstream, {model} {form}")
    ratios.plot([2048, 32768], [0.1, 0.05], "kv", linestyle="none", label="issue 33 goal (at most)")
    ratios.set_xscale("log", base=2)
    ratios.set_yscale("log")
    ratios.set_xlabel("prompt tokens")
    ratios.set_ylabel("shared / cold")
    ratios.legend(fontsize=7)
    fig.suptitle("Prefix reuse on recurrent models (issue 33), CPU")
    fig.tight_layout()
    fig.savefig(RESULTS / "prefix_reuse.png", dpi=120)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lengths", type=int, nargs="+", default=[2048, 8192, 32768])
    parser.add_argument("--steps", type=int, nargs="+", default=[DEFAULT_PREFILL_STEP_SIZE])
    parser.add_argument("--models", nargs="+", choices=["demo", "demo_mtp", "mamba2"],
                        default=["demo", "demo_mtp", "mamba2"])
    parser.add_argument("--peer-lengths", type=int, nargs="*", default=None,
                        help="the lengths upstream runs at (default: those of --lengths up to 8192; its CPU prefill "
                        "steps the recurrence token by token)")
    parser.add_argument("--forms", nargs="+", choices=["tokens", "chat"], default=["tokens", "chat"],
                        help="tokens: a token prompt (/v1/completions); chat: the document its own message")
    parser.add_argument("--no-peer", action="store_true", help="leave out upstream mlx-lm")
    parser.add_argument("--peer-venv", type=Path, default=Path(__file__).parent / f".venv-upstream-{PEER_VERSION}")
    args = parser.parse_args()
    if min(args.lengths) <= QUESTION:
        raise SystemExit(f"--lengths must all exceed the {QUESTION}-token question, got {args.lengths}")
    if args.peer_lengths is None:
        args.peer_lengths = [n for n in args.lengths if n <= PEER_MAX_DEFAULT]
    if not set(args.peer_lengths) <= set(args.lengths):
        raise SystemExit(f"--peer-lengths {args.peer_lengths} must be among --lengths {args.lengths}")
    if min(args.steps) < 1:
        raise SystemExit(f"--steps must all be >= 1, got {args.steps}")
    command = ("python benchmarks/prefix_reuse.py " + " ".join(sys.argv[1:])).strip()
    rows = run(args, command)
    differ = [f"{r['model']} {r['form']} {r['tokens']} S={r['step']}" for r in rows if not r["identical"]]
    if differ:
        raise SystemExit(f"resumed and cold answers differ: {', '.join(differ)} (see results/prefix_reuse.md)")


if __name__ == "__main__":
    main()
