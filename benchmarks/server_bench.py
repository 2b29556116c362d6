"""`mlx_lm.server` benchmarks: the second turn of a chat with prompt-cache reuse vs none
(`--mode reuse`, the default), throughput with many concurrent clients (`--mode clients`),
speculation inside the batch on the demo hybrid (`--mode speculation`) and the batch
engine alone, in process (`--mode engine`).

    python benchmarks/server_bench.py [--model DIR] [--draft-model DIR] [--turn1-tokens 1500]
                                      [--max-tokens 32] [--conversations 3]
    python benchmarks/server_bench.py --mode clients [--clients 1,2,4,8,16,32] [--max-tokens 48]
                                      [--requests-per-client 2] [--model DIR] [--no-upstream]
    python benchmarks/server_bench.py --mode speculation [--clients 1,4,8] [--max-tokens 64]

Clients mode: N clients each send --requests-per-client greedy completions, one after
the other, all clients at once; aggregate tokens/s = completion tokens of all requests /
wall time. Servers: ours batched (`--max-batch-size 32`), ours sequential
(`--max-batch-size 1`, the one-at-a-time worker) and upstream mlx-lm's server (installed
from PyPI into benchmarks/.venv-upstream on first use, run outside this checkout), all on
the same checkpoint: by default a qwen3 of hidden 256 and 6 layers with random weights
and the test suite's 512-token tokenizer. Writes results/server_clients.md and .png.

Speculation mode: the demo hybrid target (examples/models/qwen3-next-stdlib) served
batched without a draft, batched with the demo draft, batched with a draft of the demo
draft's shape and random weights (it never agrees: the batch's adaptive draft length
must keep it near plain), batched drafting with the target's own MTP head (`--mtp`),
and one request at a time plain, with the demo draft and with the head; N clients each
send --requests-per-client greedy completions of the demo prompts. Writes
results/server_speculation.md and .png.

BLAS: the mlx-cpu wheel links the netlib reference BLAS, under which a forward of B rows
costs about B forwards of one, so batching cannot pay on this CPU; with OpenBLAS
installed (`--blas auto`, the default) the script re-executes itself with it preloaded,
one thread, and every server inherits it. The report says which ran.

Engine mode: the same N prompts through one BatchGenerator vs one generate_step after
the other (no HTTP), tokens/s of each and whether every greedy answer is the same;
with --prompt-lookup the batch speculates too. Writes results/batch_engine.md.

Reuse mode:

For each of N conversations, turn 1 sends a long user message (about --turn1-tokens
tokens); turn 2 sends turn 1, the assistant's answer and a short new question. Two
servers run the same conversations, one with the prompt cache (`--prompt-cache-size
10`) and one without (`0`). Measured on turn 2, over HTTP with streaming: time to first
token (request sent -> first token's chunk; `logprobs` makes every token send one),
decode tokens/s after it, and the prefill work `prompt_tokens - cached_tokens` next to
the turn's new tokens (`prompt_tokens(turn 2) - prompt_tokens(turn 1)`). The goal: with
reuse, prefill work <= new tokens.

Model: the demo hybrid (examples/models/qwen3-next-stdlib, made by
examples/train_demo.py) when it exists, else a stand-in of the same shape (qwen3_next, 8
layers [GDN x3, attention] x2, hidden 256, dense MLP) with random weights and the test
suite's 512-token tokenizer, written to a temporary directory. The demo pair's draft is
used with --draft-model. Writes results/server_bench.md and results/server_bench.png.
"""

import argparse
import http.client
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import List

sys.path.insert(0, str(Path(__file__).resolve().parent))
from spec_bench import PROMPTS, loaded_blas, reexec_with_blas  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
RESULTS = Path(__file__).parent / "results"
VENV = Path(__file__).parent / ".venv-upstream"
DENSE = dict(
    model_type="qwen3", vocab_size=512, hidden_size=256, intermediate_size=768, num_hidden_layers=6,
    num_attention_heads=4, num_key_value_heads=2, head_dim=64, rms_norm_eps=1e-6, rope_theta=1e6,
    tie_word_embeddings=True, max_position_embeddings=4096,
)
DEMO_TARGET = ROOT / "examples" / "models" / "qwen3-next-stdlib"
DEMO_DRAFT = ROOT / "examples" / "models" / "qwen3-draft-stdlib"
STAND_IN = dict(
    model_type="qwen3_next", vocab_size=512, hidden_size=256, intermediate_size=768, num_hidden_layers=8,
    full_attention_interval=4, num_attention_heads=4, num_key_value_heads=2, head_dim=64,
    linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=64, linear_value_head_dim=64,
    linear_conv_kernel_dim=4, num_experts=0, tie_word_embeddings=True, partial_rotary_factor=0.25,
    rope_theta=10000.0, rms_norm_eps=1e-6, eos_token_id=0,
)
SENTENCES = [
    "The cache keeps the state of every layer after the prompt.",
    "A recurrent layer folds all earlier tokens into one fixed-size state.",
    "Reusing a prefix saves the work of feeding it through the model again.",
    "The server answers one request at a time, in the order they arrive.",
    "def mean(values):\n    return sum(values) / len(values)\n",
]


def write_stand_in(directory: Path, config: dict = STAND_IN) -> Path:
    sys.path.insert(0, str(ROOT / "tests"))
    from checkpoints import write_checkpoint

    return write_checkpoint(directory, config, scale=0.1)


def long_message(conversation: int, num_tokens: int) -> str:
    # About 3 tokens per word with a 512-token vocabulary (fewer with the demo's 4096).
    words, lines, i = 0, [], 0
    while words * 3 < num_tokens:
        line = f"Note {conversation}.{i}: {SENTENCES[(i + conversation) % len(SENTENCES)]}"
        lines.append(line)
        words += len(line.split())
        i += 1
    return "\n".join(lines)


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


class Server:
    """`python -m mlx_lm.server FLAGS` on a free port, ours (this checkout, by PYTHONPATH)
    or upstream's (`python` of its venv, run outside the checkout); ready once /health answers."""

    def __init__(self, flags, log_path: Path, python: str = sys.executable, ours: bool = True):
        port = free_port()
        env = dict(os.environ)
        env.pop("PYTHONPATH", None)
        if ours:
            env["PYTHONPATH"] = str(ROOT)
        command = [python, "-m", "mlx_lm.server", *map(str, flags), "--port", str(port)]
        self.log_path, self.address, self.resets = log_path, ("127.0.0.1", port), 0
        with open(log_path, "w") as log:
            self.process = subprocess.Popen(command, stderr=log, stdout=subprocess.DEVNULL, env=env,
                                            cwd=tempfile.gettempdir())
        deadline = time.time() + 300
        while not self._healthy():
            if self.process.poll() is not None or time.time() > deadline:
                raise SystemExit(f"server did not start:\n{log_path.read_text()}")
            time.sleep(0.2)

    def _healthy(self) -> bool:
        try:
            connection = http.client.HTTPConnection(*self.address, timeout=2)
            connection.request("GET", "/health")
            return connection.getresponse().status == 200
        except OSError:
            return False

    def stop(self):
        self.process.terminate()
        self.process.wait(timeout=30)

    def complete(self, prompt: str, max_tokens: int) -> int:
        """One greedy text completion; returns its completion tokens. A connection the
        server resets (a full listen backlog) is counted in `resets` and tried again."""
        body = json.dumps({"prompt": prompt, "max_tokens": max_tokens, "temperature": 0})
        for attempt in range(5):
            connection = http.client.HTTPConnection(*self.address, timeout=600)
            try:
                connection.request("POST", "/v1/completions", body, {"Content-Type": "application/json"})
                reply = json.loads(connection.getresponse().read())
                break
            except (ConnectionResetError, ConnectionRefusedError):
                self.resets += 1
            finally:
                connection.close()
        else:
            raise SystemExit(f"server at {self.address} reset 5 connections in a row")
        if "usage" not in reply:
            raise SystemExit(f"server error: {reply}")
        return reply["usage"]["completion_tokens"]

    def chat(self, messages, max_tokens):
        """Stream one greedy chat completion: (text, usage, ttft_s, decode_tok_s)."""
        body = json.dumps({"messages": messages, "max_tokens": max_tokens, "temperature": 0, "stream": True,
                           "logprobs": True, "stream_options": {"include_usage": True}})
        connection = http.client.HTTPConnection(*self.address, timeout=600)
        start = time.perf_counter()
        connection.request("POST", "/v1/chat/completions", body, {"Content-Type": "application/json"})
        response = connection.getresponse()
        token_times, text, usage = [], "", None
        for raw in response:
            line = raw.decode().strip()
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[len("data: "):])
            if "error" in chunk:
                raise SystemExit(f"server error: {chunk['error']}")
            if chunk.get("usage"):
                usage = chunk["usage"]
            for choice in chunk["choices"]:
                text += choice["delta"].get("content") or ""
                if choice.get("logprobs"):
                    token_times += [time.perf_counter()] * len(choice["logprobs"]["content"])
        connection.close()
        ttft = token_times[0] - start
        decode = (len(token_times) - 1) / (token_times[-1] - token_times[0]) if len(token_times) > 1 else 0.0
        return text, usage, ttft, decode


def run_mode(model, draft, cache_size, args, log_dir):
    flags = ["--model", model, "--prompt-cache-size", cache_size] + (["--draft-model", draft] if draft else [])
    server = Server(flags, log_dir / f"server_cache{cache_size}.log")
    rows = []
    try:
        server.chat([{"role": "user", "content": "warm up"}], 4)
        for conversation in range(args.conversations):
            turn1 = [{"role": "user", "content": long_message(conversation, args.turn1_tokens)}]
            answer, usage1, _, _ = server.chat(turn1, args.max_tokens)
            turn2 = turn1 + [{"role": "assistant", "content": answer},
                             {"role": "user", "content": "Summarise that in one line."}]
            _, usage2, ttft, decode = server.chat(turn2, args.max_tokens)
            cached = usage2["prompt_tokens_details"]["cached_tokens"]
            rows.append(dict(prompt=usage2["prompt_tokens"], cached=cached, prefill=usage2["prompt_tokens"] - cached,
                             new=usage2["prompt_tokens"] - usage1["prompt_tokens"], ttft=ttft, decode=decode))
    finally:
        server.stop()
    return rows


def mean(rows, key):
    return sum(r[key] for r in rows) / len(rows)


def report(model_label, args, results):
    reuse, none = results["reuse"], results["no reuse"]
    lines = [
        "# Server: second chat turn with prompt-cache reuse vs without",
        "",
        f"{model_label}; turn 1 about {args.turn1_tokens} tokens, answers of {args.max_tokens} tokens, "
        f"greedy, {args.conversations} conversations, streaming over HTTP on the CPU backend.",
        "",
        "| prompt cache | turn-2 prompt tokens | cached | prefilled | new tokens | TTFT (s) | decode tok/s |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for name, rows in results.items():
        lines.append(f"| {name} | {mean(rows, 'prompt'):.0f} | {mean(rows, 'cached'):.0f} | "
                     f"{mean(rows, 'prefill'):.0f} | {mean(rows, 'new'):.0f} | {mean(rows, 'ttft'):.3f} | "
                     f"{mean(rows, 'decode'):.1f} |")
    goal = all(r["prefill"] <= r["new"] for r in reuse)
    lines += [
        "",
        f"TTFT with reuse / without: {mean(reuse, 'ttft') / mean(none, 'ttft'):.3f}. "
        f"Goal (turn-2 prefill <= its new tokens, in every conversation): {'met' if goal else 'NOT met'}.",
        "",
    ]
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "server_bench.md").write_text("\n".join(lines))
    print("\n".join(lines))
    plt = pyplot()
    if plt is None:
        return
    fig, axes = plt.subplots(1, 2, figsize=(8, 3.2))
    names = list(results)
    axes[0].bar(names, [mean(results[n], "ttft") for n in names], color=["tab:green", "tab:gray"])
    axes[0].set_ylabel("turn-2 time to first token (s)")
    axes[1].bar(names, [mean(results[n], "prefill") for n in names], color=["tab:green", "tab:gray"])
    axes[1].axhline(mean(reuse, "new"), color="k", linestyle="--", label="new tokens")
    axes[1].set_ylabel("turn-2 tokens prefilled")
    axes[1].legend()
    fig.suptitle(model_label, fontsize=9)
    fig.tight_layout()
    fig.savefig(RESULTS / "server_bench.png", dpi=120)


# ---------------------------------------------------------------------------
# Clients mode: aggregate throughput of N concurrent clients.


def machine() -> str:
    """Where the numbers come from. Under the reference BLAS a forward of B rows costs
    about B times one (batching cannot pay); under OpenBLAS a small model's forward is
    mostly fixed cost, as on a GPU."""
    import platform

    import mlx.core as mx

    load = os.getloadavg()[0]
    return (f"Machine: {platform.machine()} {platform.system()}, {os.cpu_count()} CPUs (load average {load:.1f} "
            f"at the end), MLX {mx.__version__} on {mx.default_device()}; BLAS: {loaded_blas()}.")


def ensure_upstream(packages: str) -> Path:
    python = VENV / "bin" / "python"
    if not python.exists():
        print(f"creating {VENV} with {packages} from PyPI ...", flush=True)
        subprocess.run([sys.executable, "-m", "venv", str(VENV)], check=True)
        subprocess.run([str(python), "-m", "pip", "install", "-q", *packages.split()], check=True)
    return python


def client_prompt(client: int, request: int) -> str:
    # Mixed lengths: one to four sentences, different for every request.
    count = 1 + (client + request) % 4
    return " ".join(SENTENCES[(client * 3 + request + i) % len(SENTENCES)] for i in range(count))


def aggregate_tps(server: Server, num_clients: int, args, prompt=client_prompt) -> float:
    """Completion tokens per second of all clients together, each sending its requests
    in turn (`prompt(client, request)`)."""
    def client(i: int) -> int:
        return sum(server.complete(prompt(i, r), args.max_tokens) for r in range(args.requests_per_client))

    start = time.perf_counter()
    with ThreadPoolExecutor(num_clients) as pool:
        tokens = sum(pool.map(client, range(num_clients)))
    return tokens / (time.perf_counter() - start)


def pyplot():
    """matplotlib's pyplot on the Agg backend, or None (and a note) without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib not installed: no PNG")
        return None
    return plt


def write_report(stem: str, lines: List[str], results: dict, clients: List[int], title: str) -> None:
    """results/<stem>.md, and results/<stem>.png: aggregate tokens/s by clients, one line a server."""
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / f"{stem}.md").write_text("\n".join(lines))
    print("\n".join(lines))
    plt = pyplot()
    if plt is None:
        return
    fig, ax = plt.subplots(figsize=(6, 3.8))
    for name, by_clients in results.items():
        ax.plot(clients, [by_clients[n] for n in clients], marker="o", label=name)
    ax.set_xscale("log", base=2)
    ax.set_xticks(clients, [str(n) for n in clients])
    ax.set_xlabel("concurrent clients")
    ax.set_ylabel("aggregate tokens/s")
    ax.set_title(title, fontsize=8)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(RESULTS / f"{stem}.png", dpi=120)


def measure_in_turn(servers: dict, args, prompt) -> dict:
    """name -> clients -> the best aggregate tokens/s of --repeats runs, the servers
    taking turns (a load spike from elsewhere hits one run, not one server)."""
    results = {name: {n: 0.0 for n in args.clients} for name in servers}
    for n in args.clients:
        for _ in range(args.repeats):
            for name, server in servers.items():
                results[name][n] = max(results[name][n], aggregate_tps(server, n, args, prompt))
        print(n, {name: round(r[n], 1) for name, r in results.items()}, flush=True)
    return results


def run_clients(model: Path, args, log_dir: Path) -> dict:
    """All servers up at once, measured in turn at each client count (so a change in
    the machine's load hits them alike)."""
    configs = {"ours batched": (["--max-batch-size", max(args.clients)], sys.executable, True),
               "ours sequential": (["--max-batch-size", 1], sys.executable, True)}
    if not args.no_upstream:
        configs["upstream"] = ([], str(ensure_upstream(args.upstream_packages)), False)
    servers = {}
    try:
        for name, (flags, python, ours) in configs.items():
            flags = ["--model", model, "--max-tokens", args.max_tokens, "--prompt-cache-size", 0, *flags]
            servers[name] = Server(flags, log_dir / f"{name.replace(' ', '_')}.log", python, ours)
            aggregate_tps(servers[name], 2, args)  # warm up: every prompt length once
        results = measure_in_turn(servers, args, client_prompt)
        args.resets = {name: server.resets for name, server in servers.items()}
    finally:
        for server in servers.values():
            server.stop()
    return results


def report_clients(label: str, args, results: dict) -> None:
    names = list(results)
    sequential_1 = results["ours sequential"][args.clients[0]]
    lines = [
        "# Server: aggregate throughput with concurrent clients",
        "",
        f"{label}; greedy, {args.max_tokens} tokens a request, {args.requests_per_client} requests per client, "
        f"over HTTP (non-streaming), no prompt cache; best of {args.repeats} runs, the servers taking turns.",
        "",
        "| clients | " + " | ".join(f"{n} tok/s" for n in names) + " | batched / sequential"
        + (" | batched / upstream |" if "upstream" in results else " |"),
        "|---:|" + "---:|" * (len(names) + 1 + ("upstream" in results)),
    ]
    for n in args.clients:
        batched = results["ours batched"][n]
        row = f"| {n} | " + " | ".join(f"{results[k][n]:.1f}" for k in names)
        row += f" | {batched / results['ours sequential'][n]:.2f}x"
        if "upstream" in results:
            row += f" | {batched / results['upstream'][n]:.2f}x"
        lines.append(row + " |")
    lines += ["", f"Ours batched at each client count / ours sequential with {args.clients[0]} client(s): "
              + ", ".join(f"{n}: {results['ours batched'][n] / sequential_1:.2f}x" for n in args.clients),
              "", "Connections reset by the server (each request tried again, its time counted): "
              + ", ".join(f"{name} {count}" for name, count in args.resets.items()) + ".",
              "", machine(), ""]
    write_report("server_clients", lines, results, args.clients, label)


# ---------------------------------------------------------------------------
# Speculation mode: draft models inside the batch, on the demo hybrid.


def demo_prompt(client: int, request: int) -> str:
    return PROMPTS[(client + request) % len(PROMPTS)]


def write_random_draft(directory: Path) -> Path:
    """The demo draft's files with random weights of the same shapes (never agrees)."""
    import shutil

    import mlx.core as mx

    shutil.copytree(DEMO_DRAFT, directory)
    weights = mx.load(str(directory / "model.safetensors"))
    mx.random.seed(0)
    mx.save_safetensors(str(directory / "model.safetensors"),
                        {k: (mx.random.normal(v.shape) * 0.05).astype(v.dtype) for k, v in weights.items()})
    return directory


def run_speculation(args, log_dir: Path) -> dict:
    random_draft = write_random_draft(log_dir / "random_draft")
    batch = ["--max-batch-size", max(args.clients)]
    configs = {
        "batched plain": batch,
        "batched, demo draft": batch + ["--draft-model", DEMO_DRAFT],
        "batched, random draft": batch + ["--draft-model", random_draft],
        "batched, MTP head": batch + ["--mtp"],
        "one at a time, plain": ["--max-batch-size", 1],
        "one at a time, demo draft": ["--max-batch-size", 1, "--draft-model", DEMO_DRAFT],
        "one at a time, MTP head": ["--max-batch-size", 1, "--mtp"],
    }
    servers = {}
    try:
        for name, flags in configs.items():
            flags = ["--model", DEMO_TARGET, "--max-tokens", args.max_tokens, "--prompt-cache-size", 0, *flags]
            servers[name] = Server(flags, log_dir / f"{name.replace(' ', '_').replace(',', '')}.log")
            aggregate_tps(servers[name], len(PROMPTS), args, demo_prompt)  # warm up: every prompt once
        results = measure_in_turn(servers, args, demo_prompt)
    finally:
        for server in servers.values():
            server.stop()
    return results


def report_speculation(args, results: dict) -> None:
    names = list(results)
    plain = results["batched plain"]
    lines = [
        "# Server: speculation inside the batch (demo hybrid target)",
        "",
        f"`{DEMO_TARGET.relative_to(ROOT)}` (Gated DeltaNet + attention) served by `mlx_lm.server` in float32 "
        f"(the CPU's auto dtype); greedy, {args.max_tokens} tokens a request, {args.requests_per_client} requests "
        "per client (the demo prompts), over HTTP (non-streaming), no prompt cache; default draft length "
        f"(at most 3; the batch's adaptive draft length); best of {args.repeats} runs, the servers taking turns. "
        "Aggregate completion tokens/s; in brackets, / batched plain at the same client count.",
        "",
        "| clients | " + " | ".join(names) + " |",
        "|---:|" + "---:|" * len(names),
    ]
    for n in args.clients:
        lines.append(f"| {n} | " + " | ".join(f"{results[k][n]:.1f} ({results[k][n] / plain[n]:.2f}x)"
                                              for k in names) + " |")
    lines += ["", machine(), ""]
    write_report("server_speculation", lines, results, args.clients,
                 f"demo hybrid target, float32; {loaded_blas().split(' preloaded')[0]}")


# ---------------------------------------------------------------------------
# Engine mode: BatchGenerator vs generate_step in process.


def run_engine(model_dir: Path, args) -> List[dict]:
    import mlx.core as mx

    from mlx_lm.batching import BatchGenerator
    from mlx_lm.generate import generate_step
    from mlx_lm.utils import load

    model, tokenizer = load(str(model_dir))

    def sequential(prompts):
        return [[t for t, _ in generate_step(mx.array(p), model, max_tokens=args.max_tokens)] for p in prompts]

    def batched(prompts):
        generator = BatchGenerator(model, max_tokens=args.max_tokens, completion_batch_size=len(prompts),
                                   prompt_lookup=args.prompt_lookup)
        uids = generator.insert(prompts)
        out = {uid: [] for uid in uids}
        while len(generator):
            for r in generator.next_generated():
                out[r.uid].append(r.token)
        return [out[uid] for uid in uids]

    def timed(run, prompts):
        start = time.perf_counter()
        tokens = run(prompts)
        return sum(len(t) for t in tokens) / (time.perf_counter() - start), tokens

    rows = []
    for n in args.clients:
        prompts = [tokenizer.encode(client_prompt(i, 0)) for i in range(n)]
        best = {"solo": (0.0, None), "batched": (0.0, None)}
        for _ in range(2):  # in turn, best of two: a load spike from elsewhere hits one run
            for name, run in (("batched", batched), ("solo", sequential)):
                best[name] = max(best[name], timed(run, prompts), key=lambda r: r[0])
        rows.append(dict(n=n, solo=best["solo"][0], batched=best["batched"][0],
                         same=best["solo"][1] == best["batched"][1]))
        print(rows[-1], flush=True)
    return rows


def report_engine(label: str, args, rows: List[dict]) -> None:
    lines = [
        "# Batch engine in process: BatchGenerator vs one generate_step after the other",
        "",
        f"{label}; greedy, {args.max_tokens} tokens a prompt (prefill included), prompt lookup "
        f"{'on' if args.prompt_lookup else 'off'}; best of two runs each, taken in turn.",
        "",
        "| prompts | sequential tok/s | batched tok/s | batched / sequential | same greedy tokens |",
        "|---:|---:|---:|---:|---|",
    ]
    for r in rows:
        ratio = r["batched"] / r["solo"]
        lines.append(f"| {r['n']} | {r['solo']:.1f} | {r['batched']:.1f} | {ratio:.2f}x | {r['same']} |")
    lines += ["", machine()]
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "batch_engine.md").write_text("\n".join(lines + [""]))
    print("\n".join(lines))


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--mode", choices=["reuse", "clients", "speculation", "engine"], default="reuse")
    parser.add_argument("--model", type=Path, default=None,
                        help="Target model (default: reuse, the demo hybrid; clients, a random qwen3)")
    parser.add_argument("--draft-model", type=Path, default=None, help="Reuse mode: draft model for speculation")
    parser.add_argument("--turn1-tokens", type=int, default=1500)
    parser.add_argument("--max-tokens", type=int, default=None, help="Tokens per answer (reuse 32, clients 48)")
    parser.add_argument("--conversations", type=int, default=3)
    parser.add_argument("--clients", type=lambda v: [int(x) for x in v.split(",")], default=None,
                        help="Client counts (clients and engine: 1,2,4,8,16,32; speculation: 1,4,8)")
    parser.add_argument("--requests-per-client", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=2, help="Clients and speculation: runs per cell, best kept")
    parser.add_argument("--no-upstream", action="store_true", help="Clients mode: skip upstream mlx-lm")
    parser.add_argument("--upstream-packages", default="mlx[cpu] mlx-lm",
                        help="Clients mode: what the upstream venv installs (e.g. 'mlx[cuda12] mlx-lm' on a GPU)")
    parser.add_argument("--prompt-lookup", action="store_true", help="Engine mode: speculate inside the batch")
    parser.add_argument("--blas", choices=["auto", "openblas", "reference"], default="auto")
    args = parser.parse_args()
    reexec_with_blas(args.blas)
    print(f"BLAS: {loaded_blas()}", flush=True)
    args.clients = args.clients or ([1, 4, 8] if args.mode == "speculation" else [1, 2, 4, 8, 16, 32])
    if args.mode == "speculation":
        args.max_tokens = args.max_tokens or 64
        with tempfile.TemporaryDirectory() as tmp:
            report_speculation(args, run_speculation(args, Path(tmp)))
        return
    if args.mode == "engine":
        args.max_tokens = args.max_tokens or 48
        sys.path.insert(0, str(ROOT))
        with tempfile.TemporaryDirectory() as tmp:
            model = args.model or write_stand_in(Path(tmp) / "dense", DENSE)
            label = str(args.model) if args.model else "qwen3 (hidden 256, 6 layers, random weights)"
            report_engine(label, args, run_engine(model, args))
        return
    if args.mode == "clients":
        args.max_tokens = args.max_tokens or 48
        with tempfile.TemporaryDirectory() as tmp:
            model = args.model or write_stand_in(Path(tmp) / "dense", DENSE)
            label = str(args.model) if args.model else "qwen3 (hidden 256, 6 layers, random weights)"
            report_clients(label, args, run_clients(model, args, Path(tmp)))
        return
    args.max_tokens = args.max_tokens or 32
    with tempfile.TemporaryDirectory() as tmp:
        model = args.model
        if model is None and DEMO_TARGET.is_dir():
            model = DEMO_TARGET
            label = f"demo hybrid {DEMO_TARGET.name}"
        elif model is None:
            model = write_stand_in(Path(tmp) / "stand_in")
            label = "stand-in hybrid (qwen3_next, demo shape, random weights, 512-token vocabulary)"
        else:
            label = str(model)
        if args.draft_model is not None:
            label += f" + draft {args.draft_model.name}"
        results = {mode: run_mode(model, args.draft_model, size, args, Path(tmp))
                   for mode, size in (("reuse", 10), ("no reuse", 0))}
    report(label, args, results)


if __name__ == "__main__":
    main()
