"""How closely the demo draft and the demo target's MTP head follow the target.

    python examples/measure_agreement.py [--models examples/models] [--json out.json]

For fixed code prompts the target continues each one: greedily, and by sampling at
T = 0.7 and T = 1.0 (seeded). Along each continuation, at every position that predicts
a continuation token, it compares the target's next-token law p with the drafter's q:

- sum_x min(p_T(x), q_T(x)), both scaled by the temperature T the text was sampled at
  (also with top_p 0.95 applied to both, at T = 0.7). This is the probability that
  speculative sampling accepts one draft token at that position.
- greedy agreement: argmax q == argmax p, on the greedy continuations.

The draft model's q is its next-token law given the same text. The MTP head's q at
position t is its law of x_{t+2} given the target's final hidden state h_t and the true
x_{t+1} (the first draft of a round, as drafters.MTPHead uses it); its p is the target's
own law after x_{t+1}. Uses mlx_lm only (no torch).
"""

import argparse
import json
from pathlib import Path
from typing import Dict, List, Optional

import mlx.core as mx

from mlx_lm import load

PROMPTS = [
    "def fibonacci(n):",
    "import os",
    "class Stack:",
    "def main():",
    "for i in range(10):",
    "import sys\n\ndef parse_args(argv):",
    "class Node:\n    def __init__(self, value):",
    "def read_file(path):",
    "try:\n",
    "if __name__ == '__main__':",
    "def __repr__(self):",
    "    def close(self):",
]
TEMPERATURES = (0.7, 1.0)
NUM_NEW = 64
SAMPLES_PER_PROMPT = 2


def continue_text(target, prompt: List[int], temp: float, seed: int) -> List[int]:
    """The target's continuation of `prompt`, NUM_NEW tokens, drawn with keys from
    `seed`; temp 0 is greedy."""
    from mlx_lm.models.cache import make_prompt_cache

    cache = make_prompt_cache(target)
    logits = target(mx.array(prompt)[None], cache=cache)[0, -1]
    tokens = []
    for step in range(NUM_NEW):
        if temp == 0:
            token = mx.argmax(logits)
        else:
            token = mx.random.categorical(logits / temp, key=mx.random.key(seed * NUM_NEW + step))
        tokens.append(int(token))
        logits = target(token.reshape(1, 1), cache=cache)[0, -1]
    return tokens


def top_p_probs(probs: mx.array, top_p: float) -> mx.array:
    """(N, V) laws -> the same laws cut to their smallest top set of mass >= top_p, renormalised."""
    order = mx.argsort(-probs, axis=-1)
    sorted_probs = mx.take_along_axis(probs, order, axis=-1)
    before = mx.cumsum(sorted_probs, axis=-1) - sorted_probs  # mass strictly above each token
    kept_sorted = mx.where(before < top_p, sorted_probs, 0.0)
    kept = mx.put_along_axis(mx.zeros_like(probs), order, kept_sorted, axis=-1)
    return kept / kept.sum(axis=-1, keepdims=True)


def overlap(p_logits: mx.array, q_logits: mx.array, temp: float, top_p: Optional[float] = None) -> mx.array:
    """(N, V) logits -> (N,) sum_x min(p_T(x), q_T(x))."""
    p = mx.softmax(p_logits.astype(mx.float32) / temp, axis=-1)
    q = mx.softmax(q_logits.astype(mx.float32) / temp, axis=-1)
    if top_p is not None:
        p, q = top_p_probs(p, top_p), top_p_probs(q, top_p)
    return mx.minimum(p, q).sum(axis=-1)


def laws_along(target, draft, tokens: List[int], num_prompt: int):
    """Target, draft and head logits at the continuation positions of `tokens`:
    (target (N, V), draft (N, V)) for x_{t+1}, t = num_prompt-1 .. L-2, and
    (target (M, V), head (M, V)) for x_{t+2}, t = num_prompt-1 .. L-3."""
    ids = mx.array(tokens)[None]
    hidden, target_logits = target.hidden_and_logits(ids)
    draft_logits = draft(ids)
    start, length = num_prompt - 1, len(tokens)
    # Pair t = (x_{t+1}, h_t) for t = 0..L-2, in one pass with a fresh cache, as MTPHead
    # holds the committed pairs; its output at t is the law of x_{t+2}.
    head_cache = target.make_mtp_cache()
    _, head_logits = target.mtp_forward(ids[:, 1:], hidden[:, :-1], head_cache)
    return (
        (target_logits[0, start : length - 1], draft_logits[0, start : length - 1]),
        (target_logits[0, start + 1 : length - 1], head_logits[0, start : length - 2]),
    )


def measure(models: Path, seed: int = 0) -> Dict[str, Dict[str, float]]:
    target, tokenizer = load(str(models / "qwen3-next-stdlib"))
    draft, _ = load(str(models / "qwen3-draft-stdlib"))
    if target.mtp_head is None:
        raise ValueError(f"{models / 'qwen3-next-stdlib'} has no MTP head (num_nextn_predict_layers)")
    sums = {name: {} for name in ("draft", "mtp")}
    counts = {name: {} for name in ("draft", "mtp")}

    def add(name: str, metric: str, values: mx.array) -> None:
        sums[name][metric] = sums[name].get(metric, 0.0) + float(values.sum())
        counts[name][metric] = counts[name].get(metric, 0) + values.size

    for i, text in enumerate(PROMPTS):
        prompt = tokenizer.encode(text)
        greedy = prompt + continue_text(target, prompt, 0.0, 0)
        for name, (p, q) in zip(("draft", "mtp"), laws_along(target, draft, greedy, len(prompt))):
            add(name, "greedy_agreement", (mx.argmax(p, -1) == mx.argmax(q, -1)).astype(mx.float32))
        for temp in TEMPERATURES:
            for sample in range(SAMPLES_PER_PROMPT):
                sample_seed = 10_000 * seed + 100 * i + 10 * sample + int(10 * temp)
                sampled = prompt + continue_text(target, prompt, temp, sample_seed)
                pairs = laws_along(target, draft, sampled, len(prompt))
                for name, (p, q) in zip(("draft", "mtp"), pairs):
                    add(name, f"min_pq_T{temp}", overlap(p, q, temp))
                    if temp == 0.7:
                        add(name, f"min_pq_T{temp}_top_p0.95", overlap(p, q, temp, 0.95))
    result = {name: {m: sums[name][m] / counts[name][m] for m in sums[name]} for name in sums}
    for name in result:
        result[name]["positions"] = counts[name]
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--models", type=Path, default=Path(__file__).parent / "models")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", type=Path, default=None, help="also write the numbers here")
    args = parser.parse_args()
    mx.set_default_device(mx.cpu)
    result = measure(args.models, args.seed)
    for name, metrics in result.items():
        print(f"{name}:")
        for metric, value in metrics.items():
            if metric != "positions":
                print(f"  {metric:28s} {value:.3f}")
        print(f"  positions                    {metrics['positions']}")
    if args.json:
        args.json.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
