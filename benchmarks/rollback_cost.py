"""What an exact speculative rollback of recurrent layers costs, three ways, in one run:
Gated DeltaNet layers at Qwen3-Next sizes, KDA layers at Kimi-Linear-48B sizes, Mamba-2
layers at Nemotron-H sizes, RG-LRU blocks at RecurrentGemma-2B sizes and Mamba-1 layers at
mamba-130m sizes.

    python benchmarks/rollback_cost.py [--blas auto|openblas|reference] [--repeats 9]
                                       [--families gdn,kda,mamba2,rg_lru,mamba1]

Each family is a model of recurrent layers only, random weights, fp32:
- gdn: qwen3_next, 3 linear-attention layers (hidden 2048, 16 key heads, 32 value
  heads, head dims 128, conv kernel 4; a small dense MLP so the GDN layers dominate);
- kda: kimi_linear, 3 KDA layers (hidden 2304, 32 heads of dim 128 for q, k and v,
  conv kernel 4; a small dense MLP);
- mamba2: nemotron_h, 2 Mamba-2 blocks at Nemotron-H 8B sizes (hidden 4096, 128 heads
  of dim 64, state 128, 8 groups, conv kernel 4);
- rg_lru: recurrent_gemma, 2 recurrent blocks at RecurrentGemma-2B sizes (hidden and
  lru_width 2560, 10 gate heads, conv kernel 4; a small MLP);
- mamba1: mamba, 2 Mamba-1 blocks at state-spaces/mamba-130m sizes (hidden 768, 1536
  channels, state 16, dt rank 48, conv kernel 4).
It prefills 64 tokens, then runs one verify forward of k+1 tokens (k = 2, 4, 8 drafts)
and rolls back to m accepted tokens. Strategies:

- replay (ours): the layers recorded their recurrence inputs during the verify forward;
  `trim` replays the first m steps from the pre-forward state (DESIGN.md §2).
- snapshot + re-forward: keep the pre-forward state, restore it, and run the model again
  over the m accepted tokens (mlx-swift-lm #351, vllm-mlx).
- per-position state copies: the verify forward keeps the state after every position
  (vLLM's num_speculative_blocks, SGLang's intermediate_ssm_state_cache); a rollback
  picks one, so it costs memory instead of time (reported in bytes only).

Times are medians over repeats; m = k (one draft rejected, the longest replay) and the
mean over m = 1..k. Bytes are what each strategy keeps per speculative token per layer,
beyond the state every strategy holds. Each family runs in its own child process.
Writes results/rollback_cost.md, .json (the numbers) and .png (needs matplotlib;
`--replot` redraws both from the .json); a run of some `--families` keeps the saved
results of the others.
"""

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from gdn_prefill import RESULTS, resolve_blas_choices, run_worker  # noqa: E402

FAMILIES = {
    "gdn": dict(
        title="Gated DeltaNet, Qwen3-Next linear-attention sizes",
        config=dict(
            model_type="qwen3_next", hidden_size=2048, num_hidden_layers=3,
            layer_types=["linear_attention"] * 3, num_attention_heads=16, num_key_value_heads=2,
            head_dim=128, vocab_size=1024, intermediate_size=512, linear_num_key_heads=16,
            linear_num_value_heads=32, linear_key_head_dim=128, linear_value_head_dim=128,
            linear_conv_kernel_dim=4,
        ),
    ),
    "kda": dict(
        title="Kimi Delta Attention (per-channel decay), Kimi-Linear-48B-A3B sizes",
        config=dict(
            model_type="kimi_linear", hidden_size=2304, num_hidden_layers=3, layer_types=["linear_attention"] * 3,
            mlp_layer_types=["dense"] * 3, intermediate_size=512, num_attention_heads=32, vocab_size=1024,
            linear_num_heads=32, linear_head_dim=128, linear_conv_kernel_dim=4,
        ),
        note="KDA's decay is a vector per head and token (128 floats, where GDN's is one), so a record "
             "holds g as large as k; the replay chunk builds a (C, C, 128) decay per head. The state is "
             "GDN's (32 x 128 x 128 floats, 2 MiB a layer).",
    ),
    "mamba2": dict(
        title="Mamba-2, Nemotron-H 8B sizes",
        config=dict(
            model_type="nemotron_h", hidden_size=4096, layers_block_type=["linear_attention"] * 2,
            num_attention_heads=32, num_key_value_heads=8, vocab_size=1024, mamba_num_heads=128,
            mamba_head_dim=64, ssm_state_size=128, n_groups=8, conv_kernel=4,
        ),
    ),
    "rg_lru": dict(
        title="RG-LRU, RecurrentGemma-2B recurrent-block sizes",
        config=dict(
            model_type="recurrent_gemma", hidden_size=2560, lru_width=2560, num_hidden_layers=2,
            block_types=["recurrent"], num_attention_heads=10, num_key_value_heads=1, vocab_size=1024,
            intermediate_size=512, conv1d_width=4, attention_window_size=2048,
        ),
        note="The RG-LRU state is one vector per layer (lru_width floats), the size of one token's "
             "recorded inputs: replay keeps the conv input, a and b (about 3 x lru_width floats a token), "
             "per-position copies of state + conv state 4 x lru_width, and the forward's own per-position "
             "h (which the block outputs anyway) plus the conv input would be 2 x lru_width. Memory does not "
             "favour replay here; time still does (a replay is m elementwise steps, no projection).",
    ),
    "mamba1": dict(
        title="Mamba-1, mamba-130m sizes",
        config=dict(
            model_type="mamba", hidden_size=768, num_hidden_layers=2, state_size=16, expand=2,
            time_step_rank=48, conv_kernel=4, vocab_size=1024,
        ),
        note="A Mamba-1 record holds, per token, the conv input, the conv output x, dt (1536 floats "
             "each) and B (16), and once per forward A = -exp(A_log) (1536 x 16 floats, as large as the "
             "state): its bytes per token fall as k grows. A per-position copy is the (1536, 16) state "
             "plus the conv state.",
    ),
}
DRAFT_LENGTHS = (2, 4, 8)
PREFIX = 64


def median_time(fn, repeats):
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def recorded_bytes(cache) -> int:
    """Bytes of the arrays the newest record's replay holds (a functools.partial over
    the conv input, the per-token recurrence inputs and the pre-forward state)."""
    import functools

    import mlx.core as mx

    _, rewind = cache._rollbacks.records[-1]
    replay_fn = next(
        c.cell_contents for c in rewind.__closure__ if isinstance(c.cell_contents, functools.partial)
    )
    return sum(a.nbytes for a in replay_fn.args if isinstance(a, mx.array))


def worker(family: str, repeats: int) -> dict:
    import mlx.core as mx

    from mlx_lm.models.cache import ArraysCache, make_prompt_cache
    from mlx_lm.utils import get_model_classes

    config = FAMILIES[family]["config"]
    mx.random.seed(0)
    model_class, args_class = get_model_classes(config)
    model = model_class(args_class.from_dict(config))  # random init
    mx.eval(model.parameters())
    prefix_cache = make_prompt_cache(model)
    model(mx.random.randint(0, 1024, (1, PREFIX)), cache=prefix_cache)
    mx.eval([c.state for c in prefix_cache])
    conv_state_bytes, state_bytes = (a.nbytes for a in prefix_cache[0].state)

    def fresh_cache(speculating):
        cache = [ArraysCache.from_state(list(c.state), c.meta_state) for c in prefix_cache]
        for c in cache:
            if speculating:
                c.start_speculation(rollback_window=16)
        return cache

    rows = []
    for k in DRAFT_LENGTHS:
        tokens = mx.random.randint(0, 1024, (1, k + 1))
        row = measure(model, tokens, fresh_cache, repeats)
        ours_per_token = (recorded_bytes(row.pop("cache")[0]) - state_bytes) / (k + 1)
        row.update(
            k=k, ours_bytes_per_token=ours_per_token, reforward_bytes_per_token=config["hidden_size"] * 4,
            per_position_bytes_per_token=state_bytes + conv_state_bytes, snapshot_bytes=state_bytes + conv_state_bytes,
        )
        rows.append(row)
        print(json.dumps(row), file=sys.stderr, flush=True)
    return dict(family=family, rows=rows)


def measure(model, tokens, fresh_cache, repeats) -> dict:
    """Per-layer ms of a verify forward of `tokens`, of rolling it back to m (m = k, and
    the mean over 1..k) by replay, and of a re-forward of m tokens from the snapshot."""
    import mlx.core as mx

    from mlx_lm.models.cache import trim_prompt_cache

    k = tokens.shape[1] - 1
    num_layers = len(model.layers)

    def verify():
        cache = fresh_cache(True)
        mx.eval(model(tokens, cache=cache), [c.state for c in cache])
        return cache

    def rollback_time(m):
        cache = verify()
        start = time.perf_counter()
        trim_prompt_cache(cache, k + 1 - m)
        mx.eval([c.state for c in cache])
        return time.perf_counter() - start

    def reforward_time(m):
        cache = fresh_cache(False)  # the restored snapshot: references, no copy
        start = time.perf_counter()
        mx.eval(model(tokens[:, :m], cache=cache), [c.state for c in cache])
        return time.perf_counter() - start

    verify_s = median_time(verify, repeats)
    replay = {m: statistics.median(rollback_time(m) for _ in range(repeats)) for m in range(1, k + 1)}
    reforward = {m: statistics.median(reforward_time(m) for _ in range(repeats)) for m in range(1, k + 1)}
    ms = 1e3 / num_layers
    return dict(
        verify_ms=verify_s * ms, replay_ms=replay[k] * ms, replay_mean_ms=statistics.mean(replay.values()) * ms,
        reforward_ms=reforward[k] * ms, reforward_mean_ms=statistics.mean(reforward.values()) * ms,
        cache=verify(),
    )


def size_label(nbytes: float) -> str:
    return f"{nbytes / 2**20:.1f} MiB" if nbytes >= 2**20 else f"{nbytes / 1024:.0f} KiB"


def table(result: dict) -> list:
    rows = result["rows"]
    lines = [
        f"## {FAMILIES[result['family']]['title']}",
        "",
        "| k | verify forward (ms) | replay m=k (ms) | replay / verify | replay mean (ms) "
        "| re-forward m=k (ms) | re-forward / replay "
        "| ours bytes/token | per-position bytes/token | per-position / ours |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        lines.append(
            f"| {r['k']} | {r['verify_ms']:.2f} | {r['replay_ms']:.3f} | {r['replay_ms'] / r['verify_ms']:.1%} "
            f"| {r['replay_mean_ms']:.3f} | {r['reforward_ms']:.2f} | {r['reforward_ms'] / r['replay_ms']:.1f}x "
            f"| {r['ours_bytes_per_token'] / 1024:.1f} KiB "
            f"| {r['per_position_bytes_per_token'] / 1024:.0f} KiB "
            f"| {r['per_position_bytes_per_token'] / r['ours_bytes_per_token']:.0f}x |"
        )
    lines += [
        "",
        f"Snapshot + re-forward also keeps the hidden input of each token "
        f"({rows[0]['reforward_bytes_per_token'] / 1024:.0f} KiB) to run it again. Every strategy holds "
        f"the pre-forward state ({size_label(rows[0]['snapshot_bytes'])} a layer): ours as the "
        "rollback snapshot, the others as the state they restore or start from.",
        "",
    ]
    note = FAMILIES[result["family"]].get("note")
    return lines + ([note, ""] if note else [])


def write_report(results: list, repeats: int) -> None:
    by_blas = {}
    for r in results:
        by_blas.setdefault(r["blas"], []).append(r["family"])
    blas = results[0]["blas"] if len(by_blas) == 1 else "; ".join(
        f"{label} ({', '.join(families)})" for label, families in by_blas.items())
    lines = [
        "# Exact recurrent-layer rollback: replay vs snapshot + re-forward vs per-position state copies",
        "",
        f"BLAS: {blas}. dtype: float32. Medians of {repeats} repeats, per layer; m = k is one rejected "
        "draft (the longest replay), 'mean' averages m = 1..k. Per-position state copies roll back by "
        "picking a stored state (no compute): their cost is the memory below, written during every "
        "verify forward.",
        "",
    ]
    for result in results:
        lines += table(result)
    (RESULTS / "rollback_cost.md").write_text("\n".join(lines).rstrip() + "\n")
    (RESULTS / "rollback_cost.json").write_text(json.dumps(dict(repeats=repeats, results=results), indent=1) + "\n")
    print("\n".join(lines))
    try:
        write_plot(results)
    except ImportError:
        print("matplotlib is not installed: results/rollback_cost.png not rewritten; install it and run "
              "with --replot to draw it from results/rollback_cost.json", file=sys.stderr)


def write_plot(results: list) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(len(results), 2, figsize=(11, 4 * len(results)), squeeze=False)
    for result, (ax_time, ax_mem) in zip(results, axes):
        rows, title = result["rows"], FAMILIES[result["family"]]["title"]
        ks = [r["k"] for r in rows]
        ax_time.plot(ks, [r["verify_ms"] for r in rows], "k--", label="verify forward (k+1 tokens)")
        ax_time.plot(ks, [r["replay_ms"] for r in rows], "o-", label="replay rollback (ours), m=k")
        ax_time.plot(ks, [r["reforward_ms"] for r in rows], "s-", label="snapshot + re-forward, m=k")
        ax_time.set(xlabel="draft tokens k", ylabel="ms per layer", yscale="log", title=f"{title}: time")
        ax_time.legend(fontsize=8)
        ax_mem.bar(["replay (ours)", "per-position copies"],
                   [rows[-1]["ours_bytes_per_token"] / 1024, rows[-1]["per_position_bytes_per_token"] / 1024])
        ax_mem.set(ylabel="KiB per speculative token per layer", yscale="log", title=f"{title}: memory")
    fig.suptitle(f"Recurrent rollback cost ({results[0]['blas'].split(' (')[0]}, float32)", fontsize=9)
    fig.tight_layout()
    fig.savefig(RESULTS / "rollback_cost.png", dpi=120)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeats", type=int, default=9)
    parser.add_argument("--blas", choices=["auto", "openblas", "reference"], default="auto")
    parser.add_argument("--families", default=",".join(FAMILIES), help="comma-separated, from: " + ", ".join(FAMILIES))
    parser.add_argument("--family", choices=list(FAMILIES), help=argparse.SUPPRESS)  # the worker's
    parser.add_argument("--replot", action="store_true",
                        help="measure nothing: rewrite the table and plot from results/rollback_cost.json")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        print(json.dumps(worker(args.family, args.repeats)))
        return
    if args.replot:
        saved = json.loads((RESULTS / "rollback_cost.json").read_text())
        write_report(saved["results"], saved["repeats"])
        return
    families = args.families.split(",")
    unknown = sorted(set(families) - set(FAMILIES))
    if unknown:
        parser.error(f"--families: unknown {unknown}; choose from {list(FAMILIES)}")
    (blas,) = resolve_blas_choices(args.blas)
    results = [run_worker(__file__, blas, ["--family", f, "--repeats", str(args.repeats)]) for f in families]
    write_report(with_saved_results(results), args.repeats)


def with_saved_results(results: list) -> list:
    """`results` plus the saved ones of the families not run now, in FAMILIES order."""
    saved = RESULTS / "rollback_cost.json"
    by_family = {r["family"]: r for r in json.loads(saved.read_text())["results"]} if saved.exists() else {}
    by_family.update({r["family"]: r for r in results})
    return [by_family[f] for f in FAMILIES if f in by_family]


if __name__ == "__main__":
    main()
