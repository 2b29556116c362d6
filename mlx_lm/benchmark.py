"""`mlx_lm.benchmark`: prompt and generation speed of a model, over several trials.

The prompt is `--prompt-tokens` random token ids (from `--seed`), and every trial
generates exactly `--generation-tokens` tokens (EOS does not stop it). Each trial
reports prompt tokens-per-sec, generation tokens-per-sec and peak memory (GB, reset
before each run); the averages follow. With `--draft-model` every trial runs plainly
and speculatively on the same prompt, one row each, and the speculative rows add the
draft acceptance and the tokens per target forward; a last line gives the ratio of the
generation speeds. With `--batch-size` B > 1 a trial is one batch_generate of B random
prompts (speculating inside the batch with a drafter), and the rows report the batch's
speeds (upstream's). `--delay` sleeps that many seconds before each trial (to let a
machine cool, as upstream's).

Under mlx.launch (more than one rank) the model is sharded over all ranks (split by
layers with --pipeline; see `distributed`), every rank runs the same trials on the same
prompts (rank 0's seed) and only rank 0 prints.
"""

import argparse
import math
import sys
import time
from typing import Any, Dict, List, Optional

import mlx.core as mx
import mlx.nn as nn

from . import distributed
from .chat import add_speculation_arguments, check_speculation_arguments, load_with_speculation
from .batching import batch_generate
from .cli_args import DEFAULT_MODEL, HelpFormatter, add_dtype_argument, positive_int
from .feeding import DEFAULT_PREFILL_STEP_SIZE
from .generate import GenerationResponse, stream_generate
from .generate_utils import BatchStats
from .quant_schemes import quantize_activations
from .tokenizer_utils import TokenizerWrapper

DEFAULT_PROMPT_TOKENS = 512
DEFAULT_GENERATION_TOKENS = 1024
DEFAULT_NUM_TRIALS = 5
DEFAULT_SEED = 0
REPORTED = ("prompt_tps", "generation_tps", "peak_memory")


def random_prompt(model: nn.Module, num_tokens: int, seed: int) -> List[int]:
    """`num_tokens` token ids drawn uniformly from the model's vocabulary."""
    return random_prompts(model, 1, num_tokens, seed)[0]


def random_prompts(model: nn.Module, batch_size: int, num_tokens: int, seed: int) -> List[List[int]]:
    """`batch_size` prompts of `num_tokens` uniform token ids (the first is random_prompt's)."""
    mx.random.seed(seed)
    return mx.random.randint(0, model.args.vocab_size, (batch_size, num_tokens)).tolist()


def timed_run(
    model: nn.Module, tokenizer: TokenizerWrapper, prompt: List[int], num_tokens: int, kwargs: Dict[str, Any]
) -> GenerationResponse:
    """Generate `num_tokens` after `prompt`; the last response (speeds, peak memory)."""
    mx.reset_peak_memory()
    for response in stream_generate(model, tokenizer, prompt, max_tokens=num_tokens, **kwargs):
        pass
    if response.generation_tokens != num_tokens:
        raise RuntimeError(f"generated {response.generation_tokens} tokens, not {num_tokens}")
    return response


def timed_batch(
    model: nn.Module, tokenizer: TokenizerWrapper, prompts: List[List[int]], num_tokens: int, kwargs: Dict[str, Any]
) -> BatchStats:
    """Generate `num_tokens` after each prompt, together; the batch's stats."""
    mx.reset_peak_memory()
    stats = batch_generate(model, tokenizer, prompts, max_tokens=num_tokens, **kwargs).stats
    if stats.generation_tokens != num_tokens * len(prompts):
        raise RuntimeError(f"generated {stats.generation_tokens} tokens, not {num_tokens} x {len(prompts)}")
    return stats


def batch_measures(stats: BatchStats) -> Dict[str, float]:
    return {key: getattr(stats, key) for key in REPORTED}


def measures(response: GenerationResponse) -> Dict[str, float]:
    """What a row reports: the speeds and peak memory, plus speculation's counts."""
    values = {key: getattr(response, key) for key in REPORTED}
    spec = response.speculation
    if spec is not None:
        values["acceptance"] = spec.acceptance_rate
        values["tokens_per_forward"] = response.generation_tokens / max(spec.num_target_forwards, 1)
    return values


def seconds(value: str) -> float:
    """A --delay: a finite number of seconds, at least 0."""
    number = float(value)
    if not (math.isfinite(number) and number >= 0):
        raise argparse.ArgumentTypeError(f"expected a number of seconds >= 0, got {value!r}")
    return number


def format_row(values: Dict[str, float]) -> str:
    return ", ".join(f"{key}={value:.3f}" for key, value in values.items())


def average(rows: List[Dict[str, float]]) -> Dict[str, float]:
    return {key: sum(row[key] for row in rows) / len(rows) for key in rows[0]}


def setup_arg_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="mlx_lm.benchmark", description="Measure prompt and generation speed", formatter_class=HelpFormatter
    )
    parser.add_argument("--model", default=DEFAULT_MODEL, help="Local model directory or Hugging Face repo id")
    parser.add_argument("--prompt-tokens", "-p", type=positive_int, default=DEFAULT_PROMPT_TOKENS,
                        help="Prompt length in tokens")
    parser.add_argument("--generation-tokens", "-g", type=positive_int, default=DEFAULT_GENERATION_TOKENS,
                        help="Tokens generated per trial")
    parser.add_argument("--num-trials", "-n", type=positive_int, default=DEFAULT_NUM_TRIALS,
                        help="Number of timed trials (after one warmup run)")
    parser.add_argument("--seed", type=int, default=DEFAULT_SEED, help="PRNG seed of the random prompt")
    parser.add_argument("--trust-remote-code", action="store_true",
                        help="Let the tokenizer run code from the checkpoint (upstream's flag)")
    parser.add_argument("--batch-size", "-b", type=positive_int, default=1,
                        help="Prompts generated together (batch_generate) per trial")
    parser.add_argument("--prefill-step-size", type=positive_int, default=DEFAULT_PREFILL_STEP_SIZE,
                        help="Prompt tokens per prefill forward")
    parser.add_argument("--delay", type=seconds, default=0.0,
                        help="Seconds to wait before each timed trial")
    parser.add_argument("--quantize-activations", "-qa", action="store_true",
                        help="Quantize each quantized layer's inputs as its weights are (nvfp4 and mxfp8 modes)")
    parser.add_argument("--pipeline", action="store_true", help="Under mlx.launch, split the model's layers "
                        "across the ranks (pipeline parallel) instead of sharding every layer")
    parser.set_defaults(adapter_path=None)  # what load_with_speculation reads; no adapters here
    add_speculation_arguments(parser)
    add_dtype_argument(parser)
    return parser


def run(args: argparse.Namespace, group: mx.distributed.Group) -> None:
    say = distributed.printer(group)
    model, tokenizer, speculation = load_with_speculation(args, group)
    if group.size() > 1:
        say(distributed.split_line(model, group, args.pipeline))
    if args.quantize_activations:
        quantize_activations(model)
    tokenizer.eos_token_ids = set()  # every trial generates all --generation-tokens
    prompts = random_prompts(model, args.batch_size, args.prompt_tokens, args.seed)
    # Label -> generation keyword arguments; an empty label: plain only, rows as upstream's.
    plain = {"prefill_step_size": args.prefill_step_size}
    configurations = {"plain": plain, "speculative": {**plain, **speculation}} if speculation else {"": plain}

    def measure(kwargs: Dict[str, Any]) -> Dict[str, float]:
        if args.batch_size == 1:
            return measures(timed_run(model, tokenizer, prompts[0], args.generation_tokens, kwargs))
        return batch_measures(timed_batch(model, tokenizer, prompts, args.generation_tokens, kwargs))

    def trial() -> Dict[str, Dict[str, float]]:
        return {label: measure(kwargs) for label, kwargs in configurations.items()}

    say("Running warmup..")
    trial()
    timing = f"Timing with prompt_tokens={args.prompt_tokens}, generation_tokens={args.generation_tokens}"
    if args.batch_size > 1:
        timing += f", batch_size={args.batch_size}"
    for key, value in speculation.items():
        timing += f", {key}={args.draft_model if key == 'draft_model' else value}"
    say(timing + ".")
    trials = []
    for i in range(args.num_trials):
        time.sleep(args.delay)
        trials.append(trial())
        for label, values in trials[-1].items():
            say(f"Trial {i + 1}:  {label + ': ' if label else ''}{format_row(values)}")
    averages = {label: average([t[label] for t in trials]) for label in configurations}
    for label, values in averages.items():
        say(f"Averages: {label + ': ' if label else ''}{format_row(values)}")
    if speculation:
        ratio = averages["speculative"]["generation_tps"] / averages["plain"]["generation_tps"]
        say(f"Speculative / plain generation_tps: {ratio:.3f}")


def main(argv: Optional[List[str]] = None) -> None:
    parser = setup_arg_parser()
    args = parser.parse_args(argv)
    check_speculation_arguments(parser, args)
    group = distributed.world()
    try:
        with distributed.fail_together(group):
            if group.size() > 1:  # the same prompts on every rank
                args.seed = distributed.shared_seed(args.seed, group)
            run(args, group)
            if group.size() > 1:
                distributed.wait_for_all(group)
    except (ValueError, FileNotFoundError) as e:
        sys.exit(f"Error: {e}")


if __name__ == "__main__":
    main()
