"""`mlx_lm.benchmark`: prompt and generation speed of a model, over several trials.

The prompt is `--prompt-tokens` random token ids (from `--seed`), and every trial
generates exactly `--generation-tokens` tokens (EOS does not stop it). Each trial
reports prompt tokens-per-sec, generation tokens-per-sec and peak memory (GB, reset
before each run); the averages follow. With `--draft-model` every trial runs plainly
and speculatively on the same prompt, one row each, and the speculative rows add the
draft acceptance and the tokens per target forward; a last line gives the ratio of the
generation speeds.
"""

import argparse
import sys
from typing import Any, Dict, List, Optional

import mlx.core as mx
import mlx.nn as nn

from .chat import add_speculation_arguments, check_speculation_arguments, load_with_speculation
from .cli_args import DEFAULT_MODEL, HelpFormatter, add_dtype_argument, positive_int
from .generate import GenerationResponse, stream_generate
from .tokenizer_utils import TokenizerWrapper

DEFAULT_PROMPT_TOKENS = 512
DEFAULT_GENERATION_TOKENS = 1024
DEFAULT_NUM_TRIALS = 5
DEFAULT_SEED = 0
REPORTED = ("prompt_tps", "generation_tps", "peak_memory")


def random_prompt(model: nn.Module, num_tokens: int, seed: int) -> List[int]:
    """`num_tokens` token ids drawn uniformly from the model's vocabulary."""
    mx.random.seed(seed)
    return mx.random.randint(0, model.args.vocab_size, (num_tokens,)).tolist()


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


def measures(response: GenerationResponse) -> Dict[str, float]:
    """What a row reports: the speeds and peak memory, plus speculation's counts."""
    values = {key: getattr(response, key) for key in REPORTED}
    spec = response.speculation
    if spec is not None:
        values["acceptance"] = spec.acceptance_rate
        values["tokens_per_forward"] = response.generation_tokens / max(spec.num_target_forwards, 1)
    return values


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
    parser.set_defaults(adapter_path=None)  # what load_with_speculation reads; no adapters here
    add_speculation_arguments(parser)
    add_dtype_argument(parser)
    return parser


def run(args: argparse.Namespace) -> None:
    model, tokenizer, speculation = load_with_speculation(args)
    tokenizer.eos_token_ids = set()  # every trial generates all --generation-tokens
    prompt = random_prompt(model, args.prompt_tokens, args.seed)
    # Label -> stream_generate keyword arguments; an empty label: plain only, rows as upstream's.
    configurations = {"plain": {}, "speculative": speculation} if speculation else {"": {}}

    def trial() -> Dict[str, Dict[str, float]]:
        return {
            label: measures(timed_run(model, tokenizer, prompt, args.generation_tokens, kwargs))
            for label, kwargs in configurations.items()
        }

    print("Running warmup..")
    trial()
    timing = f"Timing with prompt_tokens={args.prompt_tokens}, generation_tokens={args.generation_tokens}"
    for key, value in speculation.items():
        timing += f", {key}={args.draft_model if key == 'draft_model' else value}"
    print(timing + ".")
    trials = []
    for i in range(args.num_trials):
        trials.append(trial())
        for label, values in trials[-1].items():
            print(f"Trial {i + 1}:  {label + ': ' if label else ''}{format_row(values)}")
    averages = {label: average([t[label] for t in trials]) for label in configurations}
    for label, values in averages.items():
        print(f"Averages: {label + ': ' if label else ''}{format_row(values)}")
    if speculation:
        ratio = averages["speculative"]["generation_tps"] / averages["plain"]["generation_tps"]
        print(f"Speculative / plain generation_tps: {ratio:.3f}")


def main(argv: Optional[List[str]] = None) -> None:
    parser = setup_arg_parser()
    args = parser.parse_args(argv)
    check_speculation_arguments(parser, args)
    try:
        run(args)
    except (ValueError, FileNotFoundError) as e:
        sys.exit(f"Error: {e}")


if __name__ == "__main__":
    main()
