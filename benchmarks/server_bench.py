"""Second turn of a multi-turn chat through `mlx_lm.server`: prompt-cache reuse vs none.

    python benchmarks/server_bench.py [--model DIR] [--draft-model DIR] [--turn1-tokens 1500]
                                      [--max-tokens 32] [--conversations 3]

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
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RESULTS = Path(__file__).parent / "results"
DEMO_TARGET = ROOT / "examples" / "models" / "qwen3-next-stdlib"
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


def write_stand_in(directory: Path) -> Path:
    sys.path.insert(0, str(ROOT / "tests"))
    from checkpoints import write_checkpoint

    return write_checkpoint(directory, STAND_IN, scale=0.1)


def long_message(conversation: int, num_tokens: int) -> str:
    # About 3 tokens per word with a 512-token vocabulary (fewer with the demo's 4096).
    words, lines, i = 0, [], 0
    while words * 3 < num_tokens:
        line = f"Note {conversation}.{i}: {SENTENCES[(i + conversation) % len(SENTENCES)]}"
        lines.append(line)
        words += len(line.split())
        i += 1
    return "\n".join(lines)


class Server:
    def __init__(self, model: Path, draft: Path, cache_size: int, log_path: Path):
        command = [sys.executable, "-m", "mlx_lm.server", "--model", str(model), "--port", "0",
                   "--prompt-cache-size", str(cache_size)]
        if draft is not None:
            command += ["--draft-model", str(draft)]
        self.log_path = log_path
        with open(log_path, "w") as log:
            self.process = subprocess.Popen(command, stderr=log, stdout=subprocess.DEVNULL)
        deadline = time.time() + 300
        while True:
            match = re.search(r"on http://([\d.]+):(\d+)", log_path.read_text())
            if match:
                self.address = (match.group(1), int(match.group(2)))
                break
            if self.process.poll() is not None or time.time() > deadline:
                raise SystemExit(f"server did not start:\n{log_path.read_text()}")
            time.sleep(0.2)

    def stop(self):
        self.process.terminate()
        self.process.wait(timeout=30)

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
    server = Server(model, draft, cache_size, log_dir / f"server_cache{cache_size}.log")
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
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib not installed: no PNG")
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


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", type=Path, default=None, help="Target model (default: the demo hybrid)")
    parser.add_argument("--draft-model", type=Path, default=None, help="Draft model for speculative decoding")
    parser.add_argument("--turn1-tokens", type=int, default=1500)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--conversations", type=int, default=3)
    args = parser.parse_args()
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
