"""One rank of tests/test_distributed.py (started by tests/ranks.py, as mlx.launch would).

argv: a JSON spec. mode "match": {"out": dir, "prompt": [ids], "max_tokens": n,
"targets": {name: [target_dir, draft_dir]}, "configs": {name: [config, quantize]},
"cli": argv or None}; mode "die": {"prompt", "max_tokens", "config"}; mode "launched": {"out", "prompt", "config"}.

match, on every rank, written to out/rank<r>.json: for each target, the unsharded
model's greedy plain tokens (what one process gives), then the sharded model's
(sharded_load, and its peak memory) greedy plain, draft-model speculative and
prompt-lookup tokens, a seeded sampled speculative run, the speculation counts and
the parameter bytes, the sharded caches after plain vs speculative decoding; for each
config, a random model's sharded and unsharded logits
(full forward, and prefill + decode through the caches); rank 0's shared seed. Then,
given "cli", mlx_lm.generate's main(cli) with this rank's stdout in out/cli<r>.txt.
launched (under mlx.launch): a random llama of "config", sharded vs whole, written to
out/rank<r>.json.
die: a random qwen3_next of "config", sharded; rank 1 exits abruptly after the first
forward, rank 0 goes on decoding inside distributed.fail_together, as mlx_lm.generate
does.
"""

import contextlib
import json
import os
import sys
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_map

from mlx_lm import distributed
from mlx_lm.models.sharding import parameter_bytes


def plain(model, prompt, max_tokens):
    from mlx_lm.generate import generate_step

    return [t for t, _ in generate_step(prompt, model, max_tokens=max_tokens)]


def speculative(model, prompt, max_tokens, draft=None, sampler=None, **kwargs):
    from mlx_lm.generate import SpeculationStats, speculative_generate_step

    stats = SpeculationStats()
    tokens = [
        t for t, _, _ in speculative_generate_step(
            prompt, model, draft, num_draft_tokens=3, adaptive_draft_length=False, max_tokens=max_tokens,
            sampler=sampler, stats=stats, **kwargs,
        )
    ]
    return tokens, [stats.num_accepted, stats.num_drafted]


def cache_difference(model, prompt, max_tokens, draft):
    """Relative difference between the sharded target's next logits from its cache after
    a plain run and after a draft-model speculative run (which rolled every rank's
    shard back each round). Logits, not raw states: a sliding window may hold the same
    keys in another ring order."""
    from mlx_lm.generate import generate_step, speculative_generate_step
    from mlx_lm.models.cache import make_prompt_cache

    plain_cache, spec_cache = make_prompt_cache(model), make_prompt_cache(model) + make_prompt_cache(draft)
    tokens = [t for t, _ in generate_step(prompt, model, max_tokens=max_tokens, prompt_cache=plain_cache)]
    list(speculative_generate_step(prompt, model, draft, num_draft_tokens=3, adaptive_draft_length=False,
                                   max_tokens=max_tokens, prompt_cache=spec_cache))
    last = mx.array([[tokens[-1]]])
    a, b = model(last, plain_cache), model(last, spec_cache[: len(plain_cache)])
    return (mx.abs(a - b).max() / mx.abs(a).max()).item()


def match(spec, group):
    from mlx_lm.generate import main as generate_main
    from mlx_lm.sample_utils import make_sampler
    from mlx_lm.utils import load_model, sharded_load

    prompt, max_tokens = mx.array(spec["prompt"]), spec["max_tokens"]
    results = {}
    for name, (target_dir, draft_dir) in spec["targets"].items():
        full, _ = load_model(Path(target_dir))
        draft, _ = load_model(Path(draft_dir))
        before = mx.get_active_memory()
        mx.reset_peak_memory()
        model, _ = sharded_load(target_dir, tensor_group=group)
        load_peak = mx.get_peak_memory() - before  # what loading the shard needed at most
        spec_tokens, spec_counts = speculative(model, prompt, max_tokens, draft)
        mx.random.seed(7)
        sampled, _ = speculative(model, prompt, max_tokens, draft, sampler=make_sampler(1.0))
        results[name] = {
            "one_process": plain(full, prompt, max_tokens),
            "plain": plain(model, prompt, max_tokens),
            "speculative": spec_tokens,
            "speculative_counts": spec_counts,
            "lookup": speculative(model, prompt, max_tokens, prompt_lookup=True)[0],
            "sampled": sampled,
            "layer_bytes": [sum(parameter_bytes(layer) for layer in m.layers) for m in (full, model)],
            "bytes": [parameter_bytes(full), parameter_bytes(model)],
            "load_peak": load_peak,
            "cache_difference": cache_difference(model, prompt, max_tokens, draft),
            "largest_layer": max(parameter_bytes(layer) for layer in full.layers),
        }
    results["logits"] = logits(spec, group)
    results["shared_seed"] = distributed.shared_seed(None, group)  # rank 0's fresh seed, everywhere
    Path(spec["out"], f"rank{group.rank()}.json").write_text(json.dumps(results))
    if spec.get("cli"):  # the command line, in this process: it shards by itself
        with open(Path(spec["out"], f"cli{group.rank()}.txt"), "w") as f, contextlib.redirect_stdout(f):
            generate_main(spec["cli"])


def random_model(config, quantize):
    """The same random model on every rank (seeded), quantized (8 bits, groups of 32) if asked."""
    from mlx_lm.utils import get_model_classes

    model_class, args_class = get_model_classes(config)
    mx.random.seed(1)
    model = model_class(args_class.from_dict(config))
    model.update(tree_map(lambda v: mx.random.normal(v.shape) * 0.5, model.parameters()))
    if quantize:
        nn.quantize(model, group_size=32, bits=8)
    mx.eval(model.parameters())
    return model


def decode_logits(model, prompt, num_decoded=2):
    """Logits of a full forward (no cache), then of a prefill and num_decoded single-token
    steps through the model's caches: (1, L, vocab) each."""
    full = model(prompt[None])
    cache = model.make_cache()
    steps = [model(prompt[None, :-num_decoded], cache)]
    steps += [model(prompt[None, i : i + 1], cache) for i in range(prompt.size - num_decoded, prompt.size)]
    return full, mx.concatenate(steps, axis=1)


def logits(spec, group):
    """Sharded vs unsharded logits (relative max error) and layer bytes, per family: one
    model, decoded whole, then sharded in place and decoded again (the cost grows with
    every family: one build, and a sharded forward waits on the other rank at each sum)."""
    prompt, results = mx.array(spec["prompt"]), {}
    for name, (config, quantize) in spec["configs"].items():
        model = random_model(config, quantize)
        whole = decode_logits(model, prompt)
        mx.eval(whole)
        whole_bytes = sum(parameter_bytes(layer) for layer in model.layers)
        model.shard(group)
        errors = [(mx.abs(a - b).max() / mx.abs(a).max()).item() for a, b in zip(whole, decode_logits(model, prompt))]
        results[name] = {"errors": errors, "layer_bytes": [whole_bytes, sum(parameter_bytes(l) for l in model.layers)]}
    return results


def die(spec, group):
    """Rank 1 exits after the first sharded forward; rank 0 keeps decoding. Only light
    imports here (no tokenizer, no transformers), so the ranks start fast."""
    from mlx_lm.models import qwen3_next

    model = qwen3_next.Model(qwen3_next.ModelArgs.from_dict(spec["config"]))
    model.shard(group)
    cache, token = model.make_cache(), mx.array(spec["prompt"])[None]
    mx.eval(model(token, cache))
    if group.rank() == 1:
        os._exit(3)
    with distributed.fail_together(group):
        for _ in range(spec["max_tokens"]):
            mx.eval(model(token[:, :1], cache))


def launched(spec, group):
    """Under mlx.launch itself: a random llama (light imports, no tokenizer), sharded vs
    whole, logits through the caches; the relative error and the layer bytes."""
    from mlx_lm.models import llama

    def build():
        mx.random.seed(1)
        model = llama.Model(llama.ModelArgs.from_dict(spec["config"]))
        model.update(tree_map(lambda v: mx.random.normal(v.shape) * 0.5, model.parameters()))
        return model

    full, sharded = build(), build()
    sharded.shard(group)
    prompt = mx.array(spec["prompt"])
    a, b = decode_logits(full, prompt)[1], decode_logits(sharded, prompt)[1]
    result = {"size": group.size(), "error": (mx.abs(a - b).max() / mx.abs(a).max()).item(),
              "layer_bytes": [sum(parameter_bytes(layer) for layer in m.layers) for m in (full, sharded)]}
    Path(spec["out"], f"rank{group.rank()}.json").write_text(json.dumps(result))


if __name__ == "__main__":
    spec = json.loads(sys.argv[1])
    {"match": match, "die": die, "launched": launched}[spec["mode"]](spec, distributed.world())
