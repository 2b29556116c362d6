"""Speculation inside the batch, in process: why (or whether) drafting pays at a given
batch size. The server's speculation mode (server_bench.py --mode speculation) over
HTTP says how much; this says why, without the server in the way.

    python benchmarks/batch_speculation.py [--clients 4] [--requests-per-client 4]
                                           [--max-tokens 64] [--repeats 5] [--blas auto]

Workload: the demo hybrid target (examples/models/qwen3-next-stdlib); N clients, each
sending its requests one after the other (greedy; request j of client c takes prompt
c + N j of `--prompts`: `demo`, the 3 demo prompts issue 31 measured with, or `code`,
the 8 code prompts of draft_policy_replay.py: 3 texts alone have runs of agreeing drafts
that can favour one K, at one client K = 3 by 13% where their mean acceptance says 3%),
imitated in one
BatchGenerator: a request is inserted when the client's previous one finishes. Runs:
plain; the demo draft loaded but never drafting (its cost of being there: prefill and
catch-up feeds); the demo draft with the adaptive draft length and with each fixed K;
the target's MTP head, adaptive and with K = 3. They run in turn (every other pass in
reverse order), `--repeats` times, medians reported; with one client, also the
single-sequence loop (speculative_generate_step) on the same requests. Then what each
part of a round costs at that batch size (synchronous timings, medians): a plain step
(also as the runs take it, pipelined), a verify of K + 1 columns, a draft model step,
an MTP head step, and the rollback of a verify whose rows keep different prefixes; and
what those parts allow each fixed K (its tokens per row-round at their price) against
what it reached.
Ratios to plain are medians of each pass's ratio (the machine's speed drifts).
Writes results/batch_speculation.md and .png (batch_speculation_N_clients.* for N != 4).
"""

import argparse
import statistics
import sys
import time
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from server_bench import DEMO_DRAFT, DEMO_TARGET, RESULTS, machine, pyplot  # noqa: E402
from draft_policy_replay import MORE_PROMPTS  # noqa: E402
from spec_bench import PROMPTS, BLAS_CHOICES, loaded_blas, reexec_with_blas  # noqa: E402


def serve(model, prompts, args, **generator_args):
    """Tokens/s of N clients' requests in turn, rounds per draft length (row-rounds) and
    the tokens emitted."""
    from mlx_lm.batching import BatchGenerator

    generator = BatchGenerator(model, max_tokens=args.max_tokens, completion_batch_size=args.clients,
                               **generator_args)
    sent, owner, lengths, num_tokens = Counter(), {}, Counter(), 0

    def send(client):
        (uid,) = generator.insert([prompts[(client + args.clients * sent[client]) % len(prompts)]])
        owner[uid] = client
        sent[client] += 1

    start = time.perf_counter()
    for client in range(args.clients):
        send(client)
    while len(generator):
        for r in generator.next_generated():
            num_tokens += 1
            if r.finish_reason is None:
                continue
            client = owner.pop(r.uid)
            for k, count in enumerate(r.speculation.draft_lengths if r.speculation else []):
                lengths[k] += count
            if sent[client] < args.requests_per_client:
                send(client)
    return num_tokens / (time.perf_counter() - start), lengths, num_tokens


def serve_alone(model, prompts, args, draft_model):
    """Tokens/s of the same requests one after the other in the single-sequence loop
    (speculative_generate_step with the adaptive draft length): what one client gets
    without the batch."""
    import mlx.core as mx

    from mlx_lm.speculative import speculative_generate_step

    num_tokens, start = 0, time.perf_counter()
    for i in range(args.clients * args.requests_per_client):
        steps = speculative_generate_step(mx.array(prompts[i % len(prompts)]), model, draft_model,
                                          max_tokens=args.max_tokens)
        num_tokens += sum(1 for _ in steps)
    return num_tokens / (time.perf_counter() - start), Counter(), num_tokens


def never_drafting():
    """The batch policy pinned to plain steps (the draft model stays loaded)."""
    from mlx_lm.draft_length import BatchDraftLengthPolicy

    class Plain(BatchDraftLengthPolicy):
        def choose(self, batch_size, rows):
            return 0

    return Plain


def run_workload(target, draft, prompts, args):
    from mlx_lm import batching

    configs = {
        "plain": {},
        "draft loaded, never drafting": dict(draft_model=draft, policy=never_drafting()),
        "draft, adaptive": dict(draft_model=draft),
        **{f"draft, fixed K={k}": dict(draft_model=draft, fixed_draft_length=True, num_draft_tokens=k)
           for k in (1, 2, 3)},
        "MTP head, adaptive": dict(mtp=True),
        "MTP head, fixed K=3": dict(mtp=True, fixed_draft_length=True, num_draft_tokens=3),
    }
    if args.clients == 1:  # the goal there: the batch against the single-sequence loop
        configs["single-sequence loop, draft, adaptive"] = dict(alone=True)
    default_policy = batching.BatchDraftLengthPolicy
    runs, lengths, tokens = {name: [] for name in configs}, {}, {}
    for repeat in range(args.repeats + 1):  # the first pass warms up
        # Every other pass in reverse order, so that a run's place in the pass (what ran
        # just before it) favours none.
        for name, config in (reversed(list(configs.items())) if repeat % 2 else configs.items()):
            config = dict(config)
            batching.BatchDraftLengthPolicy = config.pop("policy", default_policy)
            try:
                if config.pop("alone", False):
                    tps, lengths[name], tokens[name] = serve_alone(target, prompts, args, draft)
                else:
                    tps, lengths[name], tokens[name] = serve(target, prompts, args, **config)
            finally:
                batching.BatchDraftLengthPolicy = default_policy
            if repeat:
                runs[name].append(tps)
        print(f"pass {repeat}: " + ", ".join(f"{n} {r[-1]:.0f}" for n, r in runs.items() if r), flush=True)
    return runs, lengths, tokens


def round_costs(target, draft, prompts, args):
    """Milliseconds of each part of a round at batch size N, synchronous, medians of 30."""
    import mlx.core as mx

    from mlx_lm.models.batch_cache import make_room, merge_caches, trim_rows
    from mlx_lm.models.cache import make_prompt_cache

    B = args.clients

    def batched(model, make):
        rows = []
        for i in range(B):
            cache = make()
            model(mx.array(prompts[i % len(prompts)])[None], cache=cache)
            rows.append(cache)
        mx.eval([c.state for cache in rows for c in cache])
        caches = merge_caches(rows)
        for c in caches:
            c.start_speculation()
        return caches

    def median_ms(*steps, n=30):
        """Median ms of each step; several are taken in turn (so that they see the same
        machine) and returned as a list."""
        for _ in range(3):
            for step in steps:
                step()
        times = [[] for _ in steps]
        for _ in range(n):
            for step, taken in zip(steps, times):
                mx.synchronize()
                start = time.perf_counter()
                step()
                mx.synchronize()
                taken.append((time.perf_counter() - start) * 1000)
        medians = [statistics.median(taken) for taken in times]
        return medians if len(steps) > 1 else medians[0]

    target_cache = batched(target, lambda: make_prompt_cache(target))
    token = mx.full((B, 1), 5, dtype=mx.uint32)

    def forward(cache, model, width, keeps=None):
        """A forward of `width` columns, then each row keeps keeps[i] of them (default
        none: the caches stay as they were)."""
        def step():
            make_room(cache, width)
            mx.eval(model(mx.repeat(token, width, axis=1), cache=cache), [c.state for c in cache])
            trim_rows(cache, [width - k for k in (keeps or [0] * B)])
            mx.eval([c.state for c in cache])
        return step

    def plain_steps(n=30):
        """ms per plain step in a run of n, each queued before the last one's tokens are
        read, as the generator's plain steps are (the caches keep the n tokens)."""
        tokens, last, start = token, None, time.perf_counter()
        for _ in range(n):
            make_room(target_cache, 1)
            tokens = mx.argmax(target(tokens, cache=target_cache)[:, -1], axis=-1).astype(mx.uint32)[:, None]
            mx.async_eval(tokens, [c.state for c in target_cache])
            if last is not None:
                last.tolist()
            last = tokens
        last.tolist()
        return (time.perf_counter() - start) * 1000 / n

    plain_steps()  # warm up
    costs = {"plain step, pipelined (as in the runs)": statistics.median(plain_steps() for _ in range(3)),
             "plain step (1 column)": median_ms(forward(target_cache, target, 1))}
    for k in (1, 2, 3):
        costs[f"verify, K={k} ({k + 1} columns)"] = median_ms(forward(target_cache, target, k + 1))
    mixed = [4 - i % 4 for i in range(B)]  # rows keeping 4, 3, 2, 1 of the columns
    costs[f"verify, K=3, then rows keep {mixed[:4]}..."] = median_ms(forward(target_cache, target, 4, mixed))
    draft_cache = batched(draft, lambda: make_prompt_cache(draft))
    costs["draft model step"] = median_ms(forward(draft_cache, draft, 1))

    def drafting_round(queue_each_step):
        """3 draft steps and the verify of their 4 columns, read once: queued when all
        are built, or each step as it is built and the drafts before the verify's graph
        (as the generator does), so that graph building overlaps the computing."""
        def step():
            make_room(draft_cache, 3)
            drafted = [token[:, 0]]
            for _ in range(3):
                drafted.append(mx.argmax(draft(drafted[-1][:, None], cache=draft_cache)[:, -1], axis=-1))
                if queue_each_step:
                    mx.async_eval(drafted[-1])
            columns = mx.stack(drafted, axis=1).astype(mx.uint32)
            if queue_each_step:
                mx.async_eval(columns)
            make_room(target_cache, 4)
            mx.eval(mx.argmax(target(columns, cache=target_cache), axis=-1))
            trim_rows(draft_cache, [3] * B)
            trim_rows(target_cache, [4] * B)
            mx.eval([c.state for c in draft_cache + target_cache])
        return step

    (costs["drafting round, K=3, queued at once"],
     costs["drafting round, K=3, queued step by step (as in the runs)"]) = median_ms(drafting_round(False),
                                                                                   drafting_round(True))
    head_cache = merge_caches([target.make_mtp_cache() for _ in range(B)])
    hidden = mx.random.normal((B, 1, target.mtp_head.pre_fc_norm_hidden.weight.shape[0]))

    def head_step():
        make_room(head_cache, 1)
        mx.eval(target.mtp_forward(token, hidden, head_cache)[1], [c.state for c in head_cache])
        trim_rows(head_cache, [1] * B)

    costs["MTP head step"] = median_ms(head_step)
    return costs


def to_plain(runs, name) -> float:
    """The median over passes of a run's tokens/s over plain's in the same pass: the
    machine's speed drifts between passes more than between runs of one pass."""
    return statistics.median(t / p for t, p in zip(runs[name], runs["plain"]))


def allowed_by_parts(runs, lengths, tokens, costs):
    """Table lines: for each fixed-K run, the ratio to plain that the round's parts
    allow, tokens per row-round x a pipelined plain step / (a verify of K + 1 columns +
    K draft steps), beside the ratio reached. A drafting round cannot be queued before
    the last one is read (its drafts start from that round's decided tokens), so its
    parts add up, less what building its later graphs while the first compute hides
    (the two drafting-round rows); what a run loses against them is the rest:
    deciding, rolling back, handing tokens out, prefilling the requests that join,
    rounds with fewer rows at the end. The parts are timed once, after the runs: on a
    machine whose speed drifts they compare loosely."""
    lines = ["| run | tokens per row-round | allowed by the parts | reached | reached / allowed |",
             "|---|---:|---:|---:|---:|"]
    for name in runs:
        if "fixed K=" not in name:
            continue
        k = int(name.rsplit("=", 1)[1])
        step = costs["MTP head step" if name.startswith("MTP") else "draft model step"]
        per_row_round = tokens[name] / sum(lengths[name].values())
        round_ms = costs[f"verify, K={k} ({k + 1} columns)"] + k * step
        allowed = per_row_round * costs["plain step, pipelined (as in the runs)"] / round_ms
        reached = to_plain(runs, name)
        lines.append(f"| {name} | {per_row_round:.2f} | {allowed:.2f}x | {reached:.2f}x | {reached / allowed:.2f} |")
    return lines


def report(args, runs, lengths, tokens, costs):
    lines = [
        f"# Speculation inside the batch, in process: {args.clients} clients",
        "",
        f"`{DEMO_TARGET.relative_to(DEMO_TARGET.parents[2])}` (Gated DeltaNet + attention), float32; "
        f"{args.clients} clients x {args.requests_per_client} requests of {args.max_tokens} greedy tokens (the "
        f"{args.prompts} prompts), each client's next request inserted when its last finishes (one BatchGenerator, "
        f"as the server's batch worker runs it); medians of {args.repeats} runs taken in turn "
        f"(every other pass in reverse order). Draft: "
        f"`{DEMO_DRAFT.name}`; MTP: the target's own head. `python benchmarks/batch_speculation.py "
        f"--clients {args.clients} --prompts {args.prompts}`.",
        "",
        "| run | tok/s | / plain (median of the passes' ratios) | runs | row-rounds per K (0: plain) |",
        "|---|---:|---:|---|---|",
    ]
    for name, tps in runs.items():
        median = statistics.median(tps)
        by_k = ", ".join(f"{k}: {n}" for k, n in sorted(lengths[name].items()) if n) or "-"
        lines.append(f"| {name} | {median:.0f} | {to_plain(runs, name):.2f}x | {', '.join(f'{t:.0f}' for t in tps)} | "
                     f"{by_k} |")
    lines += ["", f"What a round's parts cost at batch size {args.clients} (ms, medians of 30; each part finished "
              "before the next begins):", "",
              "| part | ms |", "|---|---:|"]
    lines += [f"| {name} | {ms:.2f} |" for name, ms in costs.items()]
    lines += ["", "What those parts allow a round of each fixed K, against what it reached (the last pass's "
              "tokens and rounds):", ""]
    lines += allowed_by_parts(runs, lengths, tokens, costs)
    lines += ["", machine(), ""]
    RESULTS.mkdir(exist_ok=True)
    stem = "batch_speculation" if args.clients == 4 else f"batch_speculation_{args.clients}_clients"
    stem += "" if args.prompts == "demo" else f"_{args.prompts}_prompts"
    (RESULTS / f"{stem}.md").write_text("\n".join(lines))
    print("\n".join(lines))
    plt = pyplot()
    if plt is None:
        return
    names = list(runs)
    fig, ax = plt.subplots(figsize=(7, 3.6))
    ax.barh(names[::-1], [to_plain(runs, n) for n in names[::-1]], color="tab:blue")
    ax.axvline(1.0, color="grey", linestyle="--", linewidth=1)
    ax.set_xlabel("tokens/s / plain batched decoding")
    ax.set_title(f"{args.clients} clients, demo hybrid target, float32; {loaded_blas().split(' (')[0]}",
                 fontsize=7)
    ax.tick_params(axis="y", labelsize=7)
    fig.tight_layout()
    fig.savefig(RESULTS / f"{stem}.png", dpi=120)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--clients", type=int, default=4)
    parser.add_argument("--requests-per-client", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--prompts", choices=["demo", "code"], default="demo",
                        help="demo: the 3 demo prompts (issue 31's workload); code: 8 code prompts")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--blas", choices=BLAS_CHOICES, default="default")
    args = parser.parse_args()
    reexec_with_blas(args.blas)
    print(f"BLAS: {loaded_blas()}", flush=True)
    from mlx_lm import load

    target, tokenizer = load(str(DEMO_TARGET))
    draft, _ = load(str(DEMO_DRAFT))
    prompts = [tokenizer.encode(p) for p in (PROMPTS if args.prompts == "demo" else PROMPTS + MORE_PROMPTS)]
    runs, lengths, tokens = run_workload(target, draft, prompts, args)
    report(args, runs, lengths, tokens, round_costs(target, draft, prompts, args))


if __name__ == "__main__":
    main()
