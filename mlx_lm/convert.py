"""`mlx_lm.convert`: a Hugging Face checkpoint -> an MLX one, optionally quantized.

The checkpoint is read with our own `load_model`, so each family's `sanitize` runs and
the output is in the MLX layout (what `load` reads without rewriting). Output: weights
in shards of at most 5 GB plus `model.safetensors.index.json`, `config.json` (with the
"quantization" block when quantized) and the tokenizer files.
"""

import argparse
import sys
from pathlib import Path
from typing import Callable, List, Optional, Union

from . import tokenizer_utils
from .cli_args import HelpFormatter, format_bytes
from .hub import check_repo_id, upload_to_hub
from .quantization import (  # noqa: F401  (QUANT_RECIPES, mixed_quant_predicate_builder: upstream's names here)
    QUANT_MODES,
    QUANT_RECIPES,
    QuantPredicate,
    dequantize_model,
    mixed_quant_predicate_builder,
    quant_params,
    quantize_model,
    quantized_layers,
    read_quantization,
)
from .saving import save
from .utils import DTYPES, cast_floats, get_model_path, load_model

# The dtypes --dtype accepts (upstream's name).
MODEL_CONVERSION_DTYPES = list(DTYPES)


def _check_options(
    mlx_path: Path, quantize: bool, dequantize: bool, q_group_size: Optional[int], q_bits: Optional[int],
    q_mode: str, dtype: Optional[str], quant_predicate: Union[QuantPredicate, str, None], upload_repo: Optional[str],
) -> None:
    if mlx_path.exists():
        raise ValueError(f"Cannot save to {mlx_path}: it already exists; choose another --mlx-path or remove it")
    if quantize and dequantize:
        raise ValueError("Choose either --quantize or --dequantize, not both")
    if quantize:
        quant_params(q_group_size, q_bits, q_mode, where="--quantize")
    elif (q_group_size, q_bits, q_mode, quant_predicate) != (None, None, "affine", None):
        raise ValueError("--q-group-size, --q-bits, --q-mode and --quant-predicate only apply with -q/--quantize")
    if isinstance(quant_predicate, str):
        _check_recipe(quant_predicate, q_bits, q_mode)
    if dtype is not None and dtype not in DTYPES:
        raise ValueError(f"Unsupported dtype {dtype!r}; choose from {', '.join(DTYPES)}")
    if upload_repo is not None:
        check_repo_id(upload_repo)


def _check_recipe(recipe: str, q_bits: Optional[int], q_mode: str) -> None:
    if recipe not in QUANT_RECIPES:
        raise ValueError(f"Unknown quantization recipe {recipe!r}; choose from {', '.join(QUANT_RECIPES)}")
    if q_mode != "affine":
        raise ValueError(f"The mixed-precision recipes quantize affine; --q-mode {q_mode} does not apply to {recipe}")
    if q_bits is not None:
        raise ValueError(f"--q-bits {q_bits}: recipe {recipe} sets the bits of every layer; leave --q-bits out")


def config_dtype(config: dict) -> Optional[str]:
    """The float dtype a config names for its weights, if one convert can cast to."""
    text_config = config.get("text_config") if isinstance(config.get("text_config"), dict) else {}
    for named in (config.get("torch_dtype"), config.get("dtype"), text_config.get("torch_dtype"),
                  text_config.get("dtype")):
        if named is not None:
            return named if named in DTYPES else None
    return None


def convert(
    hf_path: str,
    mlx_path: Union[str, Path] = "mlx_model",
    quantize: bool = False,
    q_group_size: Optional[int] = None,
    q_bits: Optional[int] = None,
    q_mode: str = "affine",
    dtype: Optional[str] = None,
    upload_repo: Optional[str] = None,
    revision: Optional[str] = None,
    dequantize: bool = False,
    quant_predicate: Union[QuantPredicate, str, None] = None,
    trust_remote_code: bool = False,
    *,
    progress: Optional[Callable[[str, int, int], None]] = None,
) -> None:
    """Convert `hf_path` (a local directory or hub repo) into `mlx_path`.

    dtype: cast floating point weights (norms and biases included) to float16,
    bfloat16 or float32 before quantizing; None takes the dtype the config names
    (`torch_dtype`, transformers 5's `dtype`, or its `text_config`'s), as upstream
    does, and keeps the checkpoint's dtypes when it names none of those.
    quantize: quantize with `q_group_size`/`q_bits`/`q_mode` (defaults of the mode,
    affine 64/4) choosing layers by `quant_predicate` (a callable, or the name of a
    mixed-precision recipe of QUANT_RECIPES), else the model's own.
    dequantize: turn a quantized checkpoint back into float.
    upload_repo: then upload the result to this hub repo (`hub.upload_to_hub`); if the
    upload fails (offline, say) the RuntimeError says so and the output stays.
    trust_remote_code: let the tokenizer run the repo's own code (never model code).
    progress(stage, done, total): called while loading, converting and writing.

    The output directory must not exist; it is written under a temporary name and
    renamed when complete, so a failed conversion leaves nothing behind."""
    mlx_path = Path(mlx_path)
    _check_options(mlx_path, quantize, dequantize, q_group_size, q_bits, q_mode, dtype, quant_predicate, upload_repo)
    report = progress or (lambda stage, done, total: None)
    model_path = get_model_path(hf_path, revision=revision, with_code=trust_remote_code)
    report("Loading", 0, 1)
    model, config = load_model(model_path, lazy=True, trust_remote_code=trust_remote_code)
    tokenizer = tokenizer_utils.load(model_path, {"trust_remote_code": True} if trust_remote_code else None)
    if quantize and read_quantization(config) is not None:
        raise ValueError(f"{hf_path} is already quantized; convert it with --dequantize first to requantize it")
    if dequantize and not quantized_layers(model):
        raise ValueError(f"--dequantize: {hf_path} has no quantized layers")
    if isinstance(quant_predicate, str):
        quant_predicate = mixed_quant_predicate_builder(quant_predicate, model, q_group_size)

    config = _cast_to_dtype(model, config, dtype or config_dtype(config))
    if quantize:
        report("Quantizing", 0, 1)
        model, config = quantize_model(model, config, q_group_size, q_bits, q_mode, quant_predicate=quant_predicate)
    if dequantize:
        model = dequantize_model(model)
        config = {k: v for k, v in config.items() if k not in ("quantization", "quantization_config")}

    # A hub repo names the card's base model; with a revision its snapshot is not the one
    # save would look up, so the downloaded directory is passed instead.
    source = hf_path if revision is None and not Path(hf_path).exists() else model_path
    save(mlx_path, source, model, tokenizer, config, progress=lambda done, total: report("Saving", done, total))
    if upload_repo is not None:
        report("Uploading", 0, 1)
        upload_to_hub(mlx_path, upload_repo)


def _cast_to_dtype(model, config: dict, dtype: Optional[str]) -> dict:
    """Cast the model's floats to `dtype` (None: leave them) and say so in the config."""
    if dtype is None:
        return config
    cast_floats(model, DTYPES[dtype])
    return {k: dtype if k in ("torch_dtype", "dtype") else v for k, v in config.items()}


def print_progress(stage: str, done: int, total: int) -> None:
    """Progress on stderr: each stage once; while saving, a line updated in place on a
    terminal, else (a pipe, a log file) one line when the weights are written."""
    if stage != "Saving":
        print(f"[INFO] {stage}", file=sys.stderr, flush=True)
    elif sys.stderr.isatty():
        end = "\n" if done == total else ""
        print(f"\r[INFO] Saving {format_bytes(done)} of {format_bytes(total)} ({100 * done // max(total, 1)}%)",
              end=end, file=sys.stderr, flush=True)
    elif done == total:
        print(f"[INFO] Saved {format_bytes(total)} of weights", file=sys.stderr, flush=True)


def configure_parser() -> argparse.ArgumentParser:
    """The command line of mlx_lm.convert (upstream's name for it)."""
    parser = argparse.ArgumentParser(
        prog="mlx_lm.convert", description="Convert a Hugging Face model to MLX, optionally quantized",
        formatter_class=HelpFormatter,
    )
    parser.add_argument("--hf-path", "--model", required=True, help="Local model directory or Hugging Face repo id")
    parser.add_argument("--mlx-path", default="mlx_model", help="Output directory (must not exist)")
    parser.add_argument("-q", "--quantize", action="store_true", help="Quantize the weights")
    group_sizes = ", ".join(f"{mode} {sizes[0]}" for mode, (sizes, _) in QUANT_MODES.items())
    bit_widths = ", ".join(f"{mode} {bits[0]}" for mode, (_, bits) in QUANT_MODES.items())
    parser.add_argument("--q-group-size", type=int, default=None,
                        help=f"Quantization group size (default by --q-mode: {group_sizes})")
    parser.add_argument("--q-bits", type=int, default=None, help=f"Bits per weight (default by --q-mode: {bit_widths})")
    parser.add_argument("--q-mode", choices=list(QUANT_MODES), default="affine", help="Quantization mode")
    parser.add_argument("--quant-predicate", choices=QUANT_RECIPES, default=None,
                        help="Mixed-precision recipe (affine): most layers at the first bit width, the sensitive "
                             "ones at the second")
    parser.add_argument("--dtype", choices=MODEL_CONVERSION_DTYPES, default=None,
                        help="Cast float weights to this type (default: the one config.json names, else keep "
                             "the checkpoint's)")
    parser.add_argument("-d", "--dequantize", action="store_true", help="Dequantize a quantized model")
    parser.add_argument("--upload-repo", default=None, help="Then upload the result to this Hugging Face repo")
    parser.add_argument("--revision", default=None, help="Hub revision (branch, tag or commit)")
    parser.add_argument("--trust-remote-code", action="store_true",
                        help="Let the tokenizer run the repo's own code (model code is never run)")
    return parser


setup_arg_parser = configure_parser  # the name every other mlx_lm CLI module uses


def main(argv: Optional[List[str]] = None) -> None:
    args = configure_parser().parse_args(argv)
    try:
        convert(
            args.hf_path, args.mlx_path, quantize=args.quantize, q_group_size=args.q_group_size,
            q_bits=args.q_bits, q_mode=args.q_mode, dtype=args.dtype, upload_repo=args.upload_repo,
            revision=args.revision, dequantize=args.dequantize, quant_predicate=args.quant_predicate,
            trust_remote_code=args.trust_remote_code, progress=print_progress,
        )
    except (ValueError, FileNotFoundError, RuntimeError) as e:
        sys.exit(f"Error: {e}")
    print(f"[INFO] Saved the MLX model to {args.mlx_path}", file=sys.stderr)
    if args.upload_repo is not None:
        print(f"[INFO] Uploaded it to https://huggingface.co/{args.upload_repo}", file=sys.stderr)


if __name__ == "__main__":
    main()
