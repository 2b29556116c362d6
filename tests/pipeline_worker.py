"""One rank of tests/test_pipeline.py (started by tests/ranks.py, as mlx.launch would).

argv: a JSON spec {"out": dir, "prompt": [ids], "max_tokens": n, "prefill_step_size": n,
"families": {name: [target_dir, draft_dir]}, "quantized_kv": {name: kv group size},
"cli": argv or None}. For each family, on every rank: the whole model (load_model) and
the pipelined one (sharded_load with pipeline_group) give greedy tokens (prefilled in
chunks of prefill_step_size; also with max_kv_size, batched, and with 8-bit KV caches
for the families of "quantized_kv"), logits (a full forward, then prefill + decode
through the caches), logits after a rewind (trim_prompt_cache while speculating) and
speculative tokens with the whole draft on every rank; plus the held layer count and
parameter bytes. Written to out/rank<r>.json; then, given "cli", mlx_lm.generate's
main(cli) with this rank's stdout in out/cli<r>.txt.
With "victim" (a rank) and "config" (a qwen3_next config) instead: see `die`.
"""

import contextlib
import json
import os
import sys
from pathlib import Path

from mlx_lm import distributed
from mlx_lm.batching import batch_generate
from mlx_lm.generate import generate_step, speculative_generate_step
from mlx_lm.generate import main as generate_main
from mlx_lm.models.cache import trim_prompt_cache
from mlx_lm.models.sharding import parameter_bytes
from mlx_lm.utils import load_model, sharded_load

import mlx.core as mx


def greedy(model, prompt, spec, draft=None, **options):
    if draft is None:
        steps = generate_step(prompt, model, max_tokens=spec["max_tokens"], prefill_step_size=spec["prefill_step_size"],
                              **options)
        return [t for t, _ in steps]
    steps = speculative_generate_step(prompt, model, draft, num_draft_tokens=3, adaptive_draft_length=False,
                                      max_tokens=spec["max_tokens"], prefill_step_size=spec["prefill_step_size"])
    return [t for t, _, _ in steps]


def decode_logits(model, prompt, num_decoded=2):
    """A full forward (no cache), then a prefill and num_decoded single-token steps
    through the model's caches: logits (1, L, vocab) each."""
    cache = model.make_cache()
    steps = [model(prompt[None, :-num_decoded], cache)]
    steps += [model(prompt[None, i : i + 1], cache) for i in range(prompt.size - num_decoded, prompt.size)]
    return [model(prompt[None]), mx.concatenate(steps, axis=1)]


def rewound_logits(model, prompt, num_rewound=3):
    """Logits of the last num_rewound tokens fed again after trim_prompt_cache took
    them back (while speculating: a recurrent state rewinds only then)."""
    cache = model.make_cache()
    mx.eval(model(prompt[None, :-4], cache))
    for entry in cache:
        entry.start_speculation()
    mx.eval(model(prompt[None, -4:], cache))
    trim_prompt_cache(cache, num_rewound)
    for entry in cache:
        entry.stop_speculation()
    return model(prompt[None, -num_rewound:], cache)


def largest_difference(a, b):
    return mx.abs(a - b).max().item()


def batched(model, tokenizer, prompt):
    """Greedy tokens of two prompts of different lengths decoded as one batch."""
    prompts = [prompt.tolist(), prompt.tolist()[3:]]
    return batch_generate(model, tokenizer, prompts, max_tokens=6, return_token_ids=True).token_ids


def smallest_other_layer(whole, piped):
    """Parameter bytes of the smallest layer another rank holds."""
    stage = piped.model.stage
    return min(parameter_bytes(layer) for i, layer in enumerate(whole.layers) if not stage.start <= i < stage.end)


def family_results(target_dir, draft_dir, spec, group):
    """What each of the whole and the pipelined model gives, in pairs [whole, pipelined]."""
    prompt = mx.array(spec["prompt"])
    whole, _ = load_model(Path(target_dir))
    draft, _ = load_model(Path(draft_dir))
    before = mx.get_active_memory()
    mx.reset_peak_memory()
    piped, tokenizer = sharded_load(target_dir, pipeline_group=group)
    load_peak = mx.get_peak_memory() - before  # what loading this rank's layers needed at most
    logits = [largest_difference(a, b) for a, b in zip(decode_logits(whole, prompt), decode_logits(piped, prompt))]
    results = {
        "plain": [greedy(m, prompt, spec) for m in (whole, piped)],
        "speculative": [greedy(whole, prompt, spec), greedy(piped, prompt, spec, draft)],
        "bounded": [greedy(m, prompt, spec, max_kv_size=8) for m in (whole, piped)],  # rotating caches
        "batched": [batched(m, tokenizer, prompt) for m in (whole, piped)],
        "logit_differences": logits,
        "rewound_difference": largest_difference(rewound_logits(whole, prompt), rewound_logits(piped, prompt)),
        "held_layers": [len(piped.layers), len(piped.make_cache()), len(whole.layers)],
        "bytes": [parameter_bytes(whole), parameter_bytes(piped), load_peak, smallest_other_layer(whole, piped)],
    }
    if spec["quantized_kv"].get(Path(target_dir).name):
        options = dict(kv_bits=8, kv_group_size=spec["quantized_kv"][Path(target_dir).name], quantized_kv_start=0)
        results["quantized_kv"] = [greedy(m, prompt, spec, **options) for m in (whole, piped)]
    return results


def die(spec, group):
    """Rank spec["victim"] exits after the first pipelined forward; the other keeps
    decoding inside distributed.fail_together, as mlx_lm.generate does."""
    from mlx_lm.models import qwen3_next

    model = qwen3_next.Model(qwen3_next.ModelArgs.from_dict(spec["config"]))
    model.model.pipeline(group)
    cache, tokens = model.make_cache(), mx.array(spec["prompt"])[None]
    mx.eval(model(tokens, cache))
    if group.rank() == spec["victim"]:
        os._exit(3)
    with distributed.fail_together(group):
        for _ in range(100000):
            mx.eval(model(tokens[:, :1], cache))


def main(spec, group):
    if spec.get("victim") is not None:
        return die(spec, group)
    results = {name: family_results(*dirs, spec, group) for name, dirs in spec["families"].items()}
    Path(spec["out"], f"rank{group.rank()}.json").write_text(json.dumps(results))
    if spec.get("cli"):
        with open(Path(spec["out"], f"cli{group.rank()}.txt"), "w") as f, contextlib.redirect_stdout(f):
            generate_main(spec["cli"])


if __name__ == "__main__":
    main(json.loads(sys.argv[1]), distributed.world())
