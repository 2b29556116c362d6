"""What the command lines share: argparse value types, defaults and the help layout.

A leaf module (the standard library only), so the CLIs (generate, cache_prompt, server)
can share it without importing one another.
"""

import argparse
import json
import math
import sys
from typing import Optional

DEFAULT_MODEL = "mlx-community/Llama-3.2-3B-Instruct-4bit"
DEFAULT_QUANTIZED_KV_START = 5000


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """`--help` lists every option's default, except where there is none to tell."""

    def _get_help_string(self, action: argparse.Action) -> str:
        if action.default in (None, "", (), []) or isinstance(action, argparse._StoreTrueAction):
            return action.help or ""
        return super()._get_help_string(action)


def add_dtype_argument(parser: argparse.ArgumentParser) -> None:
    """--dtype: the compute dtype of the weights (utils.compute_dtype)."""
    parser.add_argument("--dtype", choices=["auto", "float32", "float16", "bfloat16"], default="auto",
                        help="Compute dtype of the weights; auto runs half precision (scales included) as "
                        "float32 on the CPU backend, where it is several times faster, and keeps the "
                        "checkpoint's dtypes on Metal and CUDA")


def str2bool(value: str) -> bool:
    lowered = value.lower()
    if lowered in ("true", "t", "yes", "y", "1"):
        return True
    if lowered in ("false", "f", "no", "n", "0"):
        return False
    raise argparse.ArgumentTypeError(f"expected true or false, got {value!r}")


def json_object(value: str) -> dict:
    try:
        parsed = json.loads(value)
    except json.JSONDecodeError as e:
        raise argparse.ArgumentTypeError(f"not valid JSON ({e}): {value!r}") from None
    if not isinstance(parsed, dict):
        raise argparse.ArgumentTypeError(f"expected a JSON object, got {value!r}")
    return parsed


def positive_int(value: str) -> int:
    number = int(value)
    if number < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {value}")
    return number


def positive_float(value: str) -> float:
    number = float(value)
    if not (math.isfinite(number) and number > 0):
        raise argparse.ArgumentTypeError(f"expected a positive number, got {value!r}")
    return number


def prompt_text(value: str) -> str:
    """A --prompt value: '-' reads stdin; the escapes \\n and \\t typed in a shell become
    a newline and a tab."""
    if value == "-":
        return sys.stdin.read()
    return value.replace("\\n", "\n").replace("\\t", "\t")


def format_bytes(num_bytes: int) -> str:
    """A size in the largest unit that keeps it at least 1 (KB, MB, GB; binary)."""
    for unit, scale in (("GB", 2**30), ("MB", 2**20)):
        if num_bytes >= scale:
            return f"{num_bytes / scale:.2f} {unit}"
    return f"{num_bytes / 2**10:.2f} KB"


def add_kv_quantization_arguments(parser: argparse.ArgumentParser, bits_note: str = "") -> None:
    """--kv-bits, --kv-group-size and --quantized-kv-start, with upstream's defaults
    (generate, cache_prompt, server; `bits_note` ends --kv-bits' help)."""
    parser.add_argument("--kv-bits", type=int, default=None,
                        help=f"Quantize the KV cache to this many bits (default: not quantized){bits_note}")
    parser.add_argument("--kv-group-size", type=int, default=64, help="Group size of KV cache quantization")
    parser.add_argument("--quantized-kv-start", type=int, default=DEFAULT_QUANTIZED_KV_START,
                        help="Quantize the KV cache once it holds this many tokens (with --kv-bits)")


def add_drafter_arguments(parser: argparse.ArgumentParser) -> None:
    """--prompt-lookup, --max-ngram-size and --mtp: the drafters that need no draft model
    (mlx_lm.generate and mlx_lm.server; check_one_drafter refuses two at once)."""
    parser.add_argument("--prompt-lookup", action="store_true",
                        help="Speculative decoding without a draft model: draft the tokens that followed the "
                        "latest earlier occurrence of the last few tokens in the prompt and the output")
    parser.add_argument("--max-ngram-size", type=positive_int, default=3,
                        help="With --prompt-lookup: the longest suffix looked up, in tokens")
    parser.add_argument("--mtp", action="store_true",
                        help="Speculative decoding with the model's own multi-token-prediction head "
                        "(Qwen3-Next, Qwen3.5 checkpoints with mtp.* weights); --num-draft-tokens applications a round")


def check_one_drafter(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """At most one of --prompt-lookup, --mtp and --draft-model."""
    drafters = [name for name, given in [("--prompt-lookup", args.prompt_lookup), ("--mtp", args.mtp),
                                         ("--draft-model", args.draft_model is not None)] if given]
    if len(drafters) > 1:
        parser.error(f"{' and '.join(drafters)} are {len(drafters)} drafters; give one")


# transformers' own default chat template (ChatML) until 4.43 dropped it; upstream's
# --use-default-chat-template still reads it (tokenizer.default_chat_template), which
# today's transformers lacks, so the template is kept here.
DEFAULT_CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
NO_VISION_MODELS = "this project loads no vision models, so a prompt takes no images; give text only"


class RefusedOption(argparse.Action):
    """An upstream flag this project cannot honour: giving it is a usage error saying
    why (`why`), before any work."""

    def __init__(self, option_strings, dest, why: str, **kwargs):
        super().__init__(option_strings, dest, **kwargs)
        self.why = why

    def __call__(self, parser, namespace, values, option_string=None):
        parser.error(f"{option_string}: {self.why}")


def add_default_chat_template_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--use-default-chat-template", action="store_true",
                        help="A tokenizer without a chat template renders with ChatML (transformers' former "
                        "default) instead of taking the text as is")


def use_default_chat_template(tokenizer) -> None:
    """--use-default-chat-template: a TokenizerWrapper without a chat template gets
    DEFAULT_CHAT_TEMPLATE; one with its own keeps it."""
    if not tokenizer.has_chat_template:
        tokenizer.tokenizer.chat_template = DEFAULT_CHAT_TEMPLATE


def add_upstream_generate_arguments(parser: argparse.ArgumentParser) -> None:
    """mlx_lm.generate's --image (refused), --quantize-activations and
    --use-default-chat-template, as upstream 0.32.2 has them."""
    parser.add_argument("--image", nargs="+", action=RefusedOption, why=NO_VISION_MODELS,
                        help="Upstream's image files for a vision model: refused (no vision models here)")
    parser.add_argument("--quantize-activations", "-qa", action="store_true",
                        help="Round each nvfp4 or mxfp8 layer's input to the layer's format too "
                        "(the model's quantize_activations option)")
    add_default_chat_template_argument(parser)


def activation_model_config(args: argparse.Namespace) -> Optional[dict]:
    """The model_config of `load` that --quantize-activations asks for (None: the
    checkpoint's own config)."""
    return {"quantize_activations": True} if args.quantize_activations else None
