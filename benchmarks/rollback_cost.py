"""What an exact speculative rollback of Gated DeltaNet layers costs, three ways, in one run.

    python benchmarks/rollback_cost.py [--blas auto|openblas|reference] [--repeats 9]

A qwen3_next model of 3 linear-attention layers at Qwen3-Next sizes (hidden 2048, 16 key
heads, 32 value heads, head dims 128, conv kernel 4; random weights, fp32, a small dense
MLP so the GDN layers dominate) prefills 64 tokens, then runs one verify forward of k+1
tokens (k = 2, 4, 8 drafts) and rolls back to m accepted tokens. Strategies:

- replay (ours): the layers recorded their recurrence inputs during the verify forward;
  `trim` replays the first m steps from the pre-forward state (DESIGN.md §2).
- snapshot + re-forward: keep the pre-forward state, restore it, and run the model again
  over the m accepted tokens (mlx-swift-lm #351, vllm-mlx).
- per-position state copies: the verify forward keeps the state after every position
  (vLLM's num_speculative_blocks, SGLang's intermediate_ssm_state_cache); a rollback
  picks one, so it costs memory instead of time (reported in bytes only).

Times are medians over repeats; m = k (one draft rejected, the longest replay) and the
mean over m = 1..k. Bytes are what each strategy keeps per speculative token per layer,
beyond the state every strategy holds. Writes results/rollback_cost.md and .png.
"""

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from gdn_prefill import RESULTS, resolve_blas_choices, run_worker  # noqa: E402

CONFIG = dict(
    model_type="qwen3_next", hidden_size=2048, num_hidden_layers=3,
    layer_types=["linear_attention"] * 3, num_attention_heads=16, num_key_value_heads=2,
    head_dim=128, vocab_size=1024, intermediate_size=512, linear_num_key_heads=16,
    linear_num_value_heads=32, linear_key_head_dim=128, linear_value_head_dim=128,
    linear_conv_kernel_dim=4,
)
DRAFT_LENGTHS = (2, 4, 8)
PREFIX = 64


def median_time(fn, repeats):
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def worker(repeats: int) -> dict:
    import functools

    import mlx.core as mx

    from mlx_lm.models import qwen3_next
    from mlx_lm.models.cache import ArraysCache, make_prompt_cache, trim_prompt_cache

    mx.random.seed(0)
    model = qwen3_next.Model(qwen3_next.ModelArgs.from_dict(CONFIG))  # random init
    mx.eval(model.parameters())
    prefix_cache = make_prompt_cache(model)
    model(mx.random.randint(0, 1024, (1, PREFIX)), cache=prefix_cache)
    mx.eval([c.state for c in prefix_cache])
    state_bytes = prefix_cache[0][1].nbytes
    conv_state_bytes = prefix_cache[0][0].nbytes

    def fresh_cache(speculating):
        cache = [ArraysCache.from_state(list(c.state), c.meta_state) for c in prefix_cache]
        for c in cache:
            if speculating:
                c.start_speculation(rollback_window=16)
        return cache

    rows = []
    for k in DRAFT_LENGTHS:
        tokens = mx.random.randint(0, 1024, (1, k + 1))

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

        # Bytes our records keep per token per layer: the recurrence inputs + conv rows.
        _, rewind = verify()[0]._rollbacks.records[-1]
        replay_fn = next(  # partial(replay_prefix, conv_input, q, k, v, g, beta, pre_state)
            c.cell_contents for c in rewind.__closure__ if isinstance(c.cell_contents, functools.partial)
        )
        recorded = sum(a.nbytes for a in replay_fn.args if isinstance(a, mx.array))
        snapshot = state_bytes + conv_state_bytes  # fn.args ends with the pre-forward state
        ours_per_token = (recorded - state_bytes) / (k + 1)
        rows.append(dict(
            k=k, verify_ms=verify_s * 1e3 / len(model.layers),
            replay_ms=replay[k] * 1e3 / len(model.layers),
            replay_mean_ms=statistics.mean(replay.values()) * 1e3 / len(model.layers),
            reforward_ms=reforward[k] * 1e3 / len(model.layers),
            reforward_mean_ms=statistics.mean(reforward.values()) * 1e3 / len(model.layers),
            ours_bytes_per_token=ours_per_token,
            reforward_bytes_per_token=CONFIG["hidden_size"] * 4,
            per_position_bytes_per_token=state_bytes + conv_state_bytes,
            snapshot_bytes=snapshot,
        ))
        print(json.dumps(rows[-1]), file=sys.stderr, flush=True)
    return dict(rows=rows)


def write_report(result: dict) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = result["rows"]
    lines = [
        "# Exact GDN rollback: replay vs snapshot + re-forward vs per-position state copies",
        "",
        f"BLAS: {result['blas']}. Per layer, Qwen3-Next linear-attention sizes, fp32; "
        "m = k is one rejected draft (the longest replay), 'mean' averages m = 1..k.",
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
        "Per-position state copies roll back by picking a stored state (no compute): their "
        "cost is the memory above, written during every verify forward. Snapshot + re-forward also keeps the hidden input of each token "
        f"({rows[0]['reforward_bytes_per_token'] / 1024:.0f} KiB) to run it again. Every strategy "
        f"holds the pre-forward state ({rows[0]['snapshot_bytes'] / 2**20:.1f} MiB a layer): ours "
        "as the rollback snapshot, the others as the state they restore or start from.",
    ]
    (RESULTS / "rollback_cost.md").write_text("\n".join(lines) + "\n")

    fig, (ax_time, ax_mem) = plt.subplots(1, 2, figsize=(11, 4))
    ks = [r["k"] for r in rows]
    ax_time.plot(ks, [r["verify_ms"] for r in rows], "k--", label="verify forward (k+1 tokens)")
    ax_time.plot(ks, [r["replay_ms"] for r in rows], "o-", label="replay rollback (ours), m=k")
    ax_time.plot(ks, [r["reforward_ms"] for r in rows], "s-", label="snapshot + re-forward, m=k")
    ax_time.set(xlabel="draft tokens k", ylabel="ms per layer", yscale="log", title="time")
    ax_time.legend(fontsize=8)
    ax_mem.bar(["replay (ours)", "per-position copies"],
               [rows[-1]["ours_bytes_per_token"] / 1024, rows[-1]["per_position_bytes_per_token"] / 1024])
    ax_mem.set(ylabel="KiB per speculative token per layer", yscale="log", title="memory")
    fig.suptitle(f"GDN rollback cost ({result['blas'].split(' (')[0]})", fontsize=9)
    fig.tight_layout()
    fig.savefig(RESULTS / "rollback_cost.png", dpi=120)
    print("\n".join(lines))


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeats", type=int, default=9)
    parser.add_argument("--blas", choices=["auto", "openblas", "reference"], default="auto")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        print(json.dumps(worker(args.repeats)))
        return
    (blas,) = resolve_blas_choices(args.blas)
    write_report(run_worker(__file__, blas, ["--repeats", str(args.repeats)]))


if __name__ == "__main__":
    main()
