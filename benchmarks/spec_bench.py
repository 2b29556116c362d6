"""Speculative decoding on the demo pair (examples/models/): speed, acceptance, the
theoretical bound, and upstream mlx-lm, side by side in one run.

    python benchmarks/spec_bench.py [--tokens 80] [--reps 3] [--blas default|reference]

Everything is greedy (argmax), so speculative output must equal plain output token for
token; every run is checked. A tok/s figure is the generated tokens over the wall time of
the whole call (prefill included, the prompts are short), summed over a fixed set of code
prompts. For every configuration each prompt is decoded plainly and then speculatively,
back to back, so load from other users of the machine hits both alike; a speedup is the
ratio of those paired times, and the median over repetitions counts.

1. Demo pair, num_draft_tokens k = 1..8: plain vs speculative tok/s, acceptance rate
   (accepted / drafted), tokens per target forward, and the per-token acceptance `a`
   (accepted / draft tokens compared: each round compares its accepted prefix plus the
   first rejected token, if any).
2. The bound: speedup <= E * t_plain / (k * t_draft + t_verify(k+1)), with
   E = (1 - a^(k+1)) / (1 - a) the expected tokens per round. t_plain is plain
   decoding's own time per token in the same repetition; k * t_draft is k chained
   draft steps, each evaluated asynchronously as it is built (as the loop drafts);
   t_verify(k+1) is one (k+1)-token target forward with rollback recording on (as in a
   speculative round); each step a forward plus log-softmax and argmax, timed
   `--calls` times right after every (plain, speculative) pair, median. Efficiency =
   measured speedup / bound, per repetition (the machine is shared and its speed
   drifts, so a bound is only comparable with runs timed next to it), median over
   repetitions: what rollbacks, catch-up feeds and bookkeeping leave of the ideal.
   t_verify(k+1) / t_plain is what a CPU makes expensive.
3. Acceptance sweep at k=4: a synthetic draft that costs what the demo draft costs (it
   runs the demo draft's forward) but proposes the target's own greedy token with
   probability p, else a wrong one; speedup vs measured acceptance next to the bound.
4. The peer: upstream mlx-lm from PyPI in its own venv (benchmarks/.venv-upstream, made
   on first use) and this fork, each in a child process under the same BLAS, alternating
   `--peer-rounds` times (median of `--peer-reps` repetitions inside each child; the
   ratio is the median of the per-round ratios): plain decoding on both demo checkpoints, speculative decoding
   on a dense pair (the demo draft as target, its first layer alone as draft), and what
   upstream does with the hybrid pair. Upstream 0.32 cannot load a dense qwen3_next
   checkpoint as transformers saves it (its sanitize returns early when it finds no
   experts, so the conv1d weights keep the transformers layout); the error is reported
   and both sides then run on one MLX-converted copy of the same weights
   (`mlx_lm.convert`, no quantization).
5. Defaults: the speculative call as a user makes it, `num_draft_tokens=3` (the CLI's
   default cap) and the adaptive draft length, next to the fixed lengths; the policy's
   process-wide memory (draft_length.DRAFT_LENGTHS) is kept, as in any long-lived
   process, so after the warm-up it starts warm. Its rounds draft varying lengths, so
   it has no single-k bound.
BLAS: by default what `import mlx_lm` gives (fast_blas.py: Intel MKL from the `cpu`
extra on Linux x86_64, one thread); the upstream child gets the same library by
LD_PRELOAD. `--blas reference` re-executes with MLX_LM_REFERENCE_BLAS=1 (the wheel's
netlib BLAS, for both sides). The BLAS line is printed and written. Writes
results/spec_bench.md and results/spec_bench.png.
"""

import argparse
import inspect
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(Path(__file__).parent))
from gdn_prefill import RESULTS  # noqa: E402
from hybrid_decode_vs_upstream import ensure_upstream  # noqa: E402

MODELS = ROOT / "examples" / "models"
TARGET = MODELS / "qwen3-next-stdlib"
DRAFT = MODELS / "qwen3-draft-stdlib"
PROMPTS = [
    "def fibonacci(n):",
    "class Stack:\n    def __init__(self):",
    "import os\n\n\ndef list_files(path):",
]
SWEEP_K = 4
SWEEP_P = [0.0, 0.5, 0.7, 0.8, 0.9, 1.0]
DEFAULT_CAP = 3  # the CLI's --num-draft-tokens


# --- shared by both interpreters (the peer workers) ----------------------------------


def timed_generation(step_fn, prompts, tokens: int):
    """Run `step_fn(prompt)` over every prompt; (total seconds, tokens, from_draft flags)."""
    import mlx.core as mx

    outputs, flags, seconds = [], [], 0.0
    for prompt in prompts:
        start = time.perf_counter()
        out, fl = [], []
        for item in step_fn(mx.array(prompt)):
            out.append(item[0] if isinstance(item[0], int) else int(item[0]))
            fl.append(bool(item[2]) if len(item) > 2 else False)
            if len(out) == tokens:
                break
        seconds += time.perf_counter() - start
        outputs.append(out)
        flags.append(fl)
    return seconds, outputs, flags


def worker(spec: dict) -> dict:
    """One peer measurement, in whichever interpreter runs it (only shared API)."""
    import mlx.core as mx
    import mlx_lm
    from mlx_lm.generate import generate_step, speculative_generate_step
    from mlx_lm.utils import load_model

    result = {"version": mlx_lm.__version__}
    try:
        model, _ = load_model(Path(spec["model"]))
        draft = load_model(Path(spec["draft"]))[0] if spec.get("draft") else None
    except Exception as e:  # reported, not raised: the error is the measurement
        return {**result, "error": f"load: {type(e).__name__}: {e}"}
    tokens, k = spec["tokens"], spec.get("k", 4)
    if draft is None:
        step_fn = lambda p: generate_step(p, model, max_tokens=tokens)  # noqa: E731
    else:
        # This fork drafts an adaptive length by default; the peer comparison is per fixed k.
        fixed = ({"adaptive_draft_length": False}
                 if "adaptive_draft_length" in inspect.signature(speculative_generate_step).parameters else {})
        step_fn = lambda p: speculative_generate_step(p, model, draft, num_draft_tokens=k, max_tokens=tokens,  # noqa: E731
                                                      **fixed)
    try:
        timed_generation(step_fn, spec["prompts"][:1], 8)  # warm-up
        runs = [timed_generation(step_fn, spec["prompts"], tokens) for _ in range(spec.get("reps", 1))]
    except Exception as e:
        return {**result, "error": f"{type(e).__name__}: {e}"}
    mx.clear_cache()
    seconds = statistics.median(r[0] for r in runs)
    _, outputs, flags = runs[0]
    return {**result, "tok_s": sum(map(len, outputs)) / seconds, "tokens": outputs,
            "acceptance": round_stats(flags, k, tokens)["rate"] if draft is not None else None}


def round_stats(flags, k: int, tokens: int) -> dict:
    """Rounds rebuilt from the from_draft flags (accepted drafts, then the target's token).

    rate: accepted / drafted; per_token: accepted / compared (the geometric estimate of
    the per-token acceptance); tokens_per_round: tokens / target forwards."""
    accepted = drafted = compared = rounds = emitted = 0
    for run in flags:
        done = n = 0
        for from_draft in run:
            if from_draft:
                n += 1
                continue
            num_draft = min(k, tokens - done - 1)
            accepted, drafted, rounds = accepted + n, drafted + num_draft, rounds + 1
            compared += n + (n < num_draft)
            done += n + 1
            n = 0
        emitted += done
    return dict(rate=accepted / max(drafted, 1), per_token=accepted / max(compared, 1),
                tokens_per_round=emitted / max(rounds, 1), rounds=rounds)


# --- this fork: the demo pair --------------------------------------------------------


class SyntheticDraft:
    """The demo draft's cost with a chosen acceptance: runs the draft's forward, then
    returns logits whose argmax is the target's greedy token at that position with
    probability p (a fixed per-position coin), else a wrong token."""

    def __init__(self, draft, sequences, p: float, seed: int = 0):
        import numpy as np

        self.draft, self.layers, self.args = draft, draft.layers, draft.args
        self.sequences = sequences  # prompt + plain greedy output, one per prompt
        self.hits = np.random.default_rng(seed).random((len(sequences), 4096)) < p
        self.current = None

    def make_cache(self):
        return self.draft.make_cache()

    def __call__(self, inputs, cache=None):
        import mlx.core as mx

        position = cache[0].offset + inputs.shape[1]  # index of the token to predict
        logits = self.draft(inputs, cache=cache)
        sequence = self.sequences[self.current]
        right = sequence[position] if position < len(sequence) else 0
        token = right if self.hits[self.current, position] else (right + 1 + position) % self.args.vocab_size
        row = mx.where(mx.arange(self.args.vocab_size) == token, 10.0, -10.0)
        return logits * 0 + row  # depends on the draft's logits, so its forward runs


def forward_seconds(model, prompt_cache, num_tokens: int, record: bool) -> float:
    """Time of one `num_tokens` forward + log-softmax + argmax, evaluated. With `record`,
    the caches record rollbacks (as in a speculative round) and the forward is trimmed
    away afterwards, untimed; else the cache keeps the tokens."""
    import mlx.core as mx
    from mlx_lm.models.cache import trim_prompt_cache

    if record:
        for c in prompt_cache:
            c.start_speculation(rollback_window=num_tokens)
    inputs = mx.array([[(17 * j) % 1000 + 10 for j in range(num_tokens)]])
    start = time.perf_counter()
    logits = model(inputs, cache=prompt_cache)[0]
    logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
    mx.eval(mx.argmax(logprobs, axis=-1), [c.state for c in prompt_cache])
    seconds = time.perf_counter() - start
    if record:
        trim_prompt_cache(prompt_cache, num_tokens)
        for c in prompt_cache:
            c.stop_speculation()
    return seconds


def draft_seconds(draft, prompt_cache, k: int) -> float:
    """Time of k chained single-token draft steps, each evaluated asynchronously as it
    is built, as the speculative loop drafts; trimmed away afterwards, untimed."""
    import mlx.core as mx
    from mlx_lm.models.cache import trim_prompt_cache

    y = mx.array([10])
    start = time.perf_counter()
    for _ in range(k):
        logits = draft(y[None], cache=prompt_cache)[:, -1, :]
        y = mx.argmax(logits - mx.logsumexp(logits, axis=-1, keepdims=True), axis=-1)
        mx.async_eval(y)
    mx.eval(y, [c.state for c in prompt_cache])
    seconds = time.perf_counter() - start
    trim_prompt_cache(prompt_cache, k)
    return seconds


def component_timers(target, draft, context) -> dict:
    """name -> function timing that component once, on caches prefilled with `context`:
    plain_forward, one target token; draft{k}, k chained draft steps; verify{k+1}, one
    (k+1)-token target forward with rollback recording on."""
    import mlx.core as mx
    from mlx_lm.models.cache import make_prompt_cache

    def prefilled(model):
        c = make_prompt_cache(model)
        model(mx.array(context)[None], cache=c)
        mx.eval([x.state for x in c])
        return c

    plain_cache, target_cache, draft_cache = prefilled(target), prefilled(target), prefilled(draft)

    def timer(name: str):
        if name == "plain_forward":
            return lambda: forward_seconds(target, plain_cache, 1, record=False)
        if name.startswith("draft"):
            return lambda: draft_seconds(draft, draft_cache, int(name[5:]))
        return lambda: forward_seconds(target, target_cache, int(name[6:]), record=True)

    return timer


def time_components(timer, names, calls: int, samples: dict) -> None:
    """`calls` round-robin timings of each named component, appended to samples[name]."""
    for _ in range(calls):
        for name in names:
            samples.setdefault(name, []).append(timer(name)())


def bound(a: float, k: int, t: dict) -> float:
    """E[tokens per round] * t_plain / (k draft steps + one (k+1)-token verify)."""
    from mlx_lm.draft_length import expected_tokens

    return expected_tokens(a, k) * t["plain"] / (t[f"draft{k}"] + t[f"verify{k + 1}"])


def measure_ours(target, draft, prompts, args) -> dict:
    """For every repetition, configuration and prompt: plain decoding, the speculative
    run, then `--calls` timings of the components the bound needs, back to back, so a
    burst of load on the shared machine hits the run and its bound alike. Each
    repetition gives a speedup, a bound and their ratio (the efficiency); the report
    shows medians over repetitions."""
    from mlx_lm.generate import SpeculationStats, generate_step, speculative_generate_step

    ks = list(range(1, args.max_k + 1))
    plain_fn = lambda p: generate_step(p, target, max_tokens=args.tokens)  # noqa: E731
    timed_generation(plain_fn, prompts[:1], 8)  # warm-up
    _, reference, _ = timed_generation(plain_fn, prompts, args.tokens)
    sequences = [p + r for p, r in zip(prompts, reference)]
    synthetic = {p: SyntheticDraft(draft, sequences, p, seed=1) for p in SWEEP_P}
    configs = [("k", k, draft) for k in ks] + [("p", p, synthetic[p]) for p in SWEEP_P]
    configs.append(("defaults", DEFAULT_CAP, draft))
    rows = {(kind, value): {"reps": [], "identical": True} for kind, value, _ in configs}
    timer = component_timers(target, draft, sequences[0][:64])
    all_samples = {}
    num_tokens = len(prompts) * args.tokens
    for name in ["plain_forward", *(f"draft{k}" for k in ks), *(f"verify{k + 1}" for k in ks)]:
        time_components(timer, [name], 2, {})  # warm-up
    for rep in range(args.reps):
        print(f"rep {rep + 1}/{args.reps}", flush=True)
        for kind, value, draft_model in configs:
            k, adaptive = SWEEP_K if kind == "p" else value, kind == "defaults"
            stats = SpeculationStats()
            names = ["plain_forward", f"draft{k}", f"verify{k + 1}"]
            plain_seconds = spec_seconds = 0.0
            outputs, flags, samples = [], [], {}
            for i, prompt in enumerate(prompts):
                seconds, out, _ = timed_generation(plain_fn, [prompt], args.tokens)
                assert out[0] == reference[i], "plain greedy decoding is not deterministic"
                plain_seconds += seconds
                if isinstance(draft_model, SyntheticDraft):
                    draft_model.current = i
                spec_fn = lambda p: speculative_generate_step(  # noqa: E731
                    p, target, draft_model, num_draft_tokens=k, adaptive_draft_length=adaptive, max_tokens=args.tokens,
                    stats=stats)
                seconds, out, fl = timed_generation(spec_fn, [prompt], args.tokens)
                spec_seconds += seconds
                outputs += out
                flags += fl
                time_components(timer, names, args.calls, samples)
            row = rows[(kind, value)]
            row["identical"] &= outputs == reference
            t = {name: statistics.median(v) for name, v in samples.items()}
            t["plain"] = plain_seconds / num_tokens
            if adaptive:  # rounds of varying length: counts from the stats, no single-k bound
                row.update(rate=stats.acceptance_rate, per_token=None, tokens_per_round=stats.tokens_per_forward,
                           rounds=stats.num_target_forwards, k=k)
                limit = None
            else:
                row.update(round_stats(flags, k, args.tokens), k=k)
                limit = bound(row["per_token"], k, t)
            speedup = plain_seconds / spec_seconds
            row["reps"].append(dict(plain=plain_seconds, spec=spec_seconds, speedup=speedup, bound=limit))
            for name, v in samples.items():
                all_samples.setdefault(name, []).extend(v)
            print(f"  {kind}={value}: plain {num_tokens / plain_seconds:.1f} tok/s, "
                  f"speculative {num_tokens / spec_seconds:.1f} tok/s (x{speedup:.2f}, bound x{fmt(limit)}), "
                  f"acceptance {row['rate']:.2f}, identical {outputs == reference}", flush=True)
    plain_per_token = []
    for row in rows.values():
        reps = row.pop("reps")
        row["speedup"] = statistics.median(r["speedup"] for r in reps)
        bounded = [r for r in reps if r["bound"] is not None]
        row["bound"] = statistics.median(r["bound"] for r in bounded) if bounded else None
        row["efficiency"] = statistics.median(r["speedup"] / r["bound"] for r in bounded) if bounded else None
        row["plain_tok_s"] = num_tokens / statistics.median(r["plain"] for r in reps)
        row["spec_tok_s"] = num_tokens / statistics.median(r["spec"] for r in reps)
        plain_per_token += [r["plain"] / num_tokens for r in reps]
    times = {name: statistics.median(v) for name, v in all_samples.items()}
    times["plain"] = statistics.median(plain_per_token)
    return {"rows": rows, "times": times, "sample": reference[0]}


def float32_plain(path: Path, prompts, tokens: int) -> dict:
    """Plain decoding tok/s of the checkpoint kept in float16 and cast to float32 (what
    `load`'s auto dtype does on the CPU backend, which computes float16 by conversion),
    back to back."""
    from mlx_lm.generate import generate_step
    from mlx_lm.utils import load

    result = {}
    for name, dtype in (("float16", "float16"), ("float32", "float32")):
        model = load(str(path), dtype=dtype)[0]
        fn = lambda p: generate_step(p, model, max_tokens=tokens)  # noqa: E731
        timed_generation(fn, prompts[:1], 8)
        seconds, _, _ = timed_generation(fn, prompts, tokens)
        result[name] = len(prompts) * tokens / seconds
    return result


# --- the peer ------------------------------------------------------------------------


def run_worker(python: str, spec: dict) -> dict:
    out = subprocess.run([python, __file__, "--worker", json.dumps(spec)], capture_output=True,
                         text=True, cwd=tempfile.gettempdir(), env=peer_env())  # cwd: never import ./mlx_lm
    if out.returncode:
        return {"error": f"worker exited {out.returncode}: {out.stderr.strip().splitlines()[-1:]}"}
    return json.loads(out.stdout.strip().splitlines()[-1])


def write_first_layer_copy(source: Path, directory: Path) -> None:
    """The dense draft cut to its first layer: a cheaper draft that often disagrees."""
    import mlx.core as mx

    weights = mx.load(str(source / "model.safetensors"))
    keep = {k: v for k, v in weights.items() if not k.startswith("model.layers.") or k.split(".")[2] == "0"}
    directory.mkdir(parents=True)
    mx.save_safetensors(str(directory / "model.safetensors"), keep, metadata={"format": "pt"})
    config = json.loads((source / "config.json").read_text())
    config["num_hidden_layers"] = 1
    if "layer_types" in config:
        config["layer_types"] = config["layer_types"][:1]
    (directory / "config.json").write_text(json.dumps(config))


def summarize_runs(runs: list) -> dict:
    """One side's rounds: the first error if any round failed, else the median tok/s."""
    failed = [r for r in runs if "error" in r]
    if failed:
        return failed[0]
    return dict(runs[0], tok_s=statistics.median(r["tok_s"] for r in runs))


def measure_peer(prompts, args, scratch: Path) -> list:
    from mlx_lm.convert import convert

    upstream = str(ensure_upstream())
    converted, one_layer = scratch / "target-mlx", scratch / "draft-1-layer"
    convert(str(args.target), mlx_path=converted)
    write_first_layer_copy(args.draft, one_layer)
    base = dict(prompts=prompts, tokens=args.tokens, k=SWEEP_K)
    load_error = run_worker(upstream, dict(base, model=str(args.target))).get("error")
    cases = [
        ("plain, hybrid target (MLX-converted copy)", dict(base, model=str(converted))),
        ("plain, dense draft checkpoint", dict(base, model=str(args.draft))),
        (f"speculative k={SWEEP_K}, dense pair (draft as target, its layer 0 as draft)",
         dict(base, model=str(args.draft), draft=str(one_layer))),
        (f"speculative k={SWEEP_K}, hybrid demo pair", dict(base, model=str(converted), draft=str(args.draft))),
    ]
    rows = []
    for name, spec in cases:
        results = {"ours": [], "upstream": []}
        for i in range(args.peer_rounds):  # alternating, each side first in turn
            sides = (("ours", sys.executable), ("upstream", upstream))
            for who, python in sides if i % 2 == 0 else sides[::-1]:
                results[who].append(run_worker(python, dict(spec, reps=args.peer_reps)))
        mine, theirs = (summarize_runs(results[who]) for who in ("ours", "upstream"))
        if "tok_s" in mine and "tok_s" in theirs:
            mine["ratio"] = statistics.median(a["tok_s"] / b["tok_s"] for a, b in zip(results["ours"], results["upstream"]))
        print(f"peer {name}: ours {mine.get('tok_s', mine.get('error'))}, "
              f"upstream {theirs.get('tok_s', theirs.get('error'))}, ratio {mine.get('ratio')}", flush=True)
        rows.append((name, mine, theirs))
    return [("upstream loading the committed hybrid checkpoint", load_error), rows]


# --- report --------------------------------------------------------------------------


BLAS_CHOICES = ["default", "reference"]


def loaded_blas() -> str:
    """The BLAS MLX computes with here (fast_blas.blas_in_use), mlx_lm imported first."""
    import mlx_lm  # noqa: F401  (loads the fast BLAS unless mlx.core came first)
    from mlx_lm.fast_blas import blas_in_use

    return blas_in_use()


def peer_env() -> dict:
    """The environment of the peer children: the BLAS this process computes with, by
    LD_PRELOAD (upstream does not load one itself), MKL kept to one thread as here."""
    from mlx_lm.fast_blas import cblas_library

    env = dict(os.environ)
    library = cblas_library()
    if library and "mkl" in Path(library).name:
        env["LD_PRELOAD"], env["MKL_THREADING_LAYER"] = library, "SEQUENTIAL"
    return env


def model_line(path: Path, model) -> str:
    from mlx.utils import tree_flatten

    params = sum(v.size for _, v in tree_flatten(model.parameters()))
    size = sum(f.stat().st_size for f in path.iterdir()) / 1e6
    from mlx_lm.utils import parameter_dtypes

    kind = json.loads((path / "config.json").read_text())["model_type"]
    return (f"`{path.resolve().relative_to(ROOT) if path.resolve().is_relative_to(ROOT) else path}`: {kind}, "
            f"{params / 1e6:.2f}M parameters, {size:.1f} MB on disk, computing in {parameter_dtypes(model)}")


def fmt(x, spec=".2f"):
    return "-" if x is None else format(x, spec)


def goal_lines(ours, peer) -> list:
    rows = ours["rows"]
    demo = {v: r for (kind, v), r in rows.items() if kind == "k"}
    best_k = max(demo, key=lambda k: demo[k]["speedup"])
    efficiencies = [r["efficiency"] for r in rows.values() if r["efficiency"] is not None]
    at = demo.get(SWEEP_K, demo[best_k])
    lines = [
        "## Goals (issue 7)",
        "",
        f"- acceptance at k={at['k']} >= 60%: **{at['rate']:.1%}**",
        f"- speculative >= 1.5x plain: **{at['speedup']:.2f}x** at k={at['k']}, "
        f"best **{demo[best_k]['speedup']:.2f}x** at k={best_k}",
        f"- defaults (adaptive, cap {DEFAULT_CAP}): **{rows[('defaults', DEFAULT_CAP)]['speedup']:.2f}x** plain, "
        f"{rows[('defaults', DEFAULT_CAP)]['speedup'] / demo[best_k]['speedup']:.2f} of the best fixed k",
        f"- token-identical to plain decoding: **{all(r['identical'] for r in rows.values())}** (every run)",
        f"- efficiency >= 90% of the bound: median **{statistics.median(efficiencies):.0%}**, "
        f"range {min(efficiencies):.0%} to {max(efficiencies):.0%} over the k and p rows",
    ]
    if peer:
        ratios = [f"{name.split(',')[1].strip()} **{mine['ratio']:.2f}**"
                  for name, mine, theirs in peer[1] if name.startswith("plain") and "ratio" in mine]
        lines.append("- plain decoding >= 0.95x upstream: " + ", ".join(ratios))
    f32 = ours.get("float32")
    if f32:
        lines.append(f"- context: plain decoding of the target kept in float16 runs at {f32['float16']:.1f} tok/s; "
                     f"cast to float32 (`load`'s auto dtype on the CPU) at {f32['float32']:.1f} tok/s on this CPU")
    return lines


def write_report(ours, peer, header, tokenizer, args) -> str:
    rows, t = ours["rows"], ours["times"]
    ks = [v for kind, v in rows if kind == "k"]
    lines = [
        "# Speculative decoding on the demo pair",
        "",
        *header,
        f"- greedy; {len(PROMPTS)} code prompts x {args.tokens} tokens; median of {args.reps} repetitions; "
        f"components timed {args.calls}x after every (plain, speculative) pair; speedup, bound and "
        "efficiency are per-repetition values, then the median",
        "",
        *goal_lines(ours, peer),
        "",
        "## Plain vs speculative, k = 1..8",
        "",
        "| k | acceptance | per-token a | tokens / forward | plain tok/s | spec tok/s | speedup | bound | efficiency | t_verify(k+1) / t_plain | identical |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    for k in ks:
        r = rows[("k", k)]
        lines.append(
            f"| {k} | {r['rate']:.1%} | {r['per_token']:.3f} | {r['tokens_per_round']:.2f} | {r['plain_tok_s']:.1f} | "
            f"{r['spec_tok_s']:.1f} | **{r['speedup']:.2f}x** | {r['bound']:.2f}x | {r['efficiency']:.0%} | "
            f"{t[f'verify{k + 1}'] / t['plain']:.2f} | {r['identical']} |"
        )
    r = rows[("defaults", DEFAULT_CAP)]
    lines.append(
        f"| defaults (adaptive, cap {DEFAULT_CAP}) | {r['rate']:.1%} | - | {r['tokens_per_round']:.2f} | "
        f"{r['plain_tok_s']:.1f} | {r['spec_tok_s']:.1f} | **{r['speedup']:.2f}x** | - | - | - | {r['identical']} |"
    )
    lines += [
        "",
        f"Component times (ms): plain decoding {t['plain'] * 1e3:.2f} per token (t_plain of the bound); "
        f"one target forward {t['plain_forward'] * 1e3:.2f} (timed alone, graph building then evaluation, "
        "as a speculative round runs its verify; plain decoding's pipelined loop takes less per token); "
        "one draft step "
        f"{t[f'draft{SWEEP_K}'] / SWEEP_K * 1e3:.2f} (draft / target forward = "
        f"{t[f'draft{SWEEP_K}'] / SWEEP_K / t['plain_forward']:.3f}).",
        "",
        "| k | k draft steps (ms) | t_verify(k+1) (ms) | t_verify(k+1) / target forward |",
        "|---:|---:|---:|---:|",
        *(f"| {k} | {t[f'draft{k}'] * 1e3:.2f} | {t[f'verify{k + 1}'] * 1e3:.2f} | "
          f"{t[f'verify{k + 1}'] / t['plain_forward']:.2f} |" for k in ks),
        "",
        f"## Acceptance sweep, k = {SWEEP_K}, synthetic draft at the demo draft's cost",
        "",
        "| p | acceptance | per-token a | tokens / forward | speedup | bound | efficiency | identical |",
        "|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    for p in SWEEP_P:
        r = rows[("p", p)]
        lines.append(
            f"| {p:.2f} | {r['rate']:.1%} | {r['per_token']:.3f} | {r['tokens_per_round']:.2f} | "
            f"**{r['speedup']:.2f}x** | {r['bound']:.2f}x | {r['efficiency']:.0%} | {r['identical']} |"
        )
    (load_name, load_error), peer_rows = peer if peer else ((None, None), [])
    if peer:
        lines += [
            "",
            "## This fork vs upstream mlx-lm (child processes, same BLAS)",
            "",
            f"{args.peer_rounds} alternating rounds of one child process per side, each timing "
            f"{args.peer_reps} repetitions (median); tok/s: median over rounds; ours / upstream: "
            "median of the per-round ratios. Both sides load the checkpoints with `load_model`, "
            "so they compute in the checkpoints' own float16 (`load`'s CPU dtype policy is ours alone).",
            "",
            f"- {load_name}: `{load_error or 'loads'}`",
            "",
            "| case | ours tok/s | upstream tok/s | ours / upstream | acceptance (ours, upstream) | same tokens |",
            "|---|---:|---:|---:|---|---|",
        ]
        for name, mine, theirs in peer_rows:
            if "error" in theirs or "error" in mine:
                lines.append(f"| {name} | {fmt(mine.get('tok_s'), '.1f')} | error: `{theirs.get('error', '')}` "
                             f"{'(ours: ' + mine['error'] + ')' if 'error' in mine else ''} | - | - | - |")
                continue
            acc = (f"{mine['acceptance']:.1%}, {theirs['acceptance']:.1%}" if mine.get("acceptance") is not None else "-")
            lines.append(f"| {name} | {mine['tok_s']:.1f} | {theirs['tok_s']:.1f} ({theirs['version']}) | "
                         f"**{mine['ratio']:.2f}** | {acc} | {mine['tokens'] == theirs['tokens']} |")
    sample = tokenizer.decode(ours["sample"])
    lines += ["", f"Sample (plain greedy, prompt `{PROMPTS[0]}`):", "", "```python", PROMPTS[0] + sample, "```"]
    text = "\n".join(lines) + "\n"
    (RESULTS / "spec_bench.md").write_text(text)
    return text


def write_plot(ours) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows, t = ours["rows"], ours["times"]
    ks = [v for kind, v in rows if kind == "k"]
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.2))
    left.plot(ks, [rows[("k", k)]["speedup"] for k in ks], "o-", label="measured")
    left.plot(ks, [rows[("k", k)]["bound"] for k in ks], "s--", label="bound (measured a and costs)")
    left.axhline(1, color="grey", lw=0.8)
    left.set_xlabel("num_draft_tokens k")
    left.set_ylabel("speedup over plain decoding")
    left.set_title("demo pair (qwen3_next hybrid + qwen3 draft)")
    left.legend()
    grid = [i / 100 for i in range(0, 101)]
    right.plot(grid, [bound(a, SWEEP_K, t) for a in grid], "-", color="C1", label=f"bound, k={SWEEP_K}")
    sweep = [rows[("p", p)] for p in SWEEP_P]
    right.plot([r["per_token"] for r in sweep], [r["speedup"] for r in sweep], "o", color="C0",
               label="synthetic draft (measured)")
    demo = rows.get(("k", SWEEP_K))
    if demo is not None:
        right.plot([demo["per_token"]], [demo["speedup"]], "*", ms=14, color="C3", label="demo draft")
    right.axhline(1, color="grey", lw=0.8)
    right.set_xlabel("per-token acceptance a")
    right.set_ylabel("speedup")
    right.set_title(f"speedup vs acceptance, k={SWEEP_K}")
    right.legend()
    fig.tight_layout()
    fig.savefig(RESULTS / "spec_bench.png", dpi=120)


def reexec_with_blas(choice: str) -> None:
    """--blas reference: run again with the library's fast BLAS turned off."""
    if choice == "reference" and os.environ.get("MLX_LM_REFERENCE_BLAS") != "1":
        os.execve(sys.executable, [sys.executable, *sys.argv], dict(os.environ, MLX_LM_REFERENCE_BLAS="1"))


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tokens", type=int, default=80, help="tokens generated per prompt")
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--calls", type=int, default=2,
                        help="timings of each component after every (plain, speculative) pair")
    parser.add_argument("--max-k", type=int, default=8)
    parser.add_argument("--peer-rounds", type=int, default=4, help="alternating child-process rounds per side")
    parser.add_argument("--peer-reps", type=int, default=3, help="timed repetitions in each child (median)")
    parser.add_argument("--no-peer", action="store_true", help="skip upstream mlx-lm")
    parser.add_argument("--blas", choices=BLAS_CHOICES, default="default",
                        help="default: what import mlx_lm loads (MKL on Linux x86_64); reference: the wheel's BLAS")
    parser.add_argument("--target", type=Path, default=TARGET, help="target checkpoint (default: the demo's)")
    parser.add_argument("--draft", type=Path, default=DRAFT, help="draft checkpoint (default: the demo's)")
    parser.add_argument("--dtype", default="auto", choices=["auto", "float32", "float16", "bfloat16"],
                        help="compute dtype of both models (load's dtype; auto: float32 on the CPU backend)")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        print(json.dumps(worker(json.loads(args.worker))))
        return
    reexec_with_blas(args.blas)
    sys.path.insert(0, str(ROOT))
    from mlx_lm import load  # first: it loads the fast BLAS before mlx.core

    import mlx.core as mx
    target, tokenizer = load(str(args.target), dtype=args.dtype)
    draft, _ = load(str(args.draft), dtype=args.dtype)
    prompts = [tokenizer.encode(p) for p in PROMPTS]
    blas = loaded_blas()
    print(f"BLAS: {blas}", flush=True)
    header = [
        f"- BLAS: {blas}",
        f"- machine: {platform.processor() or platform.machine()}, {os.cpu_count()} cores (shared), mlx {mx.__version__}",
        f"- target {model_line(args.target, target)}",
        f"- draft {model_line(args.draft, draft)}",
    ]
    started = time.time()
    ours = measure_ours(target, draft, prompts, args)
    ours["float32"] = float32_plain(args.target, prompts, args.tokens)
    peer = None
    if not args.no_peer:
        with tempfile.TemporaryDirectory() as scratch:
            peer = measure_peer(prompts, args, Path(scratch))
    header.append(f"- benchmark wall time {(time.time() - started) / 60:.1f} min")
    RESULTS.mkdir(exist_ok=True)
    print(write_report(ours, peer, header, tokenizer, args))
    write_plot(ours)


if __name__ == "__main__":
    main()
