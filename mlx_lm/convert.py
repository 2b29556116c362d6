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
from .utils import (
    DTYPES,
    QUANT_MODES,
    QuantPredicate,
    cast_floats,
    dequantize_model,
    get_model_path,
    load_model,
    quant_params,
    quantize_model,
    quantized_layers,
    read_quantization,
    save,
)


def _check_options(
    mlx_path: Path, quantize: bool, dequantize: bool, q_group_size: Optional[int], q_bits: Optional[int],
    q_mode: str, dtype: Optional[str],
) -> None:
    if mlx_path.exists():
        raise ValueError(f"Cannot save to {mlx_path}: it already exists; choose another --mlx-path or remove it")
    if quantize and dequantize:
        raise ValueError("Choose either --quantize or --dequantize, not both")
    if quantize:
        quant_params(q_group_size, q_bits, q_mode, where="--quantize")
    elif (q_group_size, q_bits, q_mode) != (None, None, "affine"):
        raise ValueError("--q-group-size, --q-bits and --q-mode only apply with -q/--quantize")
    if dtype is not None and dtype not in DTYPES:
        raise ValueError(f"Unsupported dtype {dtype!r}; choose from {', '.join(DTYPES)}")


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
    revision: Optional[str] = None,
    dequantize: bool = False,
    quant_predicate: Optional[QuantPredicate] = None,
    progress: Optional[Callable[[str, int, int], None]] = None,
) -> None:
    """Convert `hf_path` (a local directory or hub repo) into `mlx_path`.

    dtype: cast floating point weights (norms and biases included) to float16,
    bfloat16 or float32 before quantizing; None takes the dtype the config names
    (`torch_dtype`, transformers 5's `dtype`, or its `text_config`'s), as upstream
    does, and keeps the checkpoint's dtypes when it names none of those.
    quantize: quantize with `q_group_size`/`q_bits`/`q_mode` (defaults of the mode,
    affine 64/4) choosing layers by `quant_predicate`, else the model's own.
    dequantize: turn a quantized checkpoint back into float.
    progress(stage, done, total): called while loading, converting and writing.

    The output directory must not exist; it is written under a temporary name and
    renamed when complete, so a failed conversion leaves nothing behind."""
    mlx_path = Path(mlx_path)
    _check_options(mlx_path, quantize, dequantize, q_group_size, q_bits, q_mode, dtype)
    report = progress or (lambda stage, done, total: None)
    model_path = get_model_path(hf_path, revision=revision)
    report("Loading", 0, 1)
    model, config = load_model(model_path, lazy=True)
    tokenizer = tokenizer_utils.load(model_path)
    if quantize and read_quantization(config) is not None:
        raise ValueError(f"{hf_path} is already quantized; convert it with --dequantize first to requantize it")
    if dequantize and not quantized_layers(model):
        raise ValueError(f"--dequantize: {hf_path} has no quantized layers")

    dtype = dtype or config_dtype(config)
    if dtype is not None:
        cast_floats(model, DTYPES[dtype])
        for key in ("torch_dtype", "dtype"):
            if key in config:
                config[key] = dtype
    if quantize:
        report("Quantizing", 0, 1)
        model, config = quantize_model(model, config, q_group_size, q_bits, q_mode, quant_predicate)
    if dequantize:
        model = dequantize_model(model)
        config = {k: v for k, v in config.items() if k not in ("quantization", "quantization_config")}

    save(mlx_path, model_path, model, tokenizer, config, progress=lambda done, total: report("Saving", done, total))


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


def setup_arg_parser() -> argparse.ArgumentParser:
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
    parser.add_argument("--dtype", choices=list(DTYPES), default=None,
                        help="Cast float weights to this type (default: keep the checkpoint's)")
    parser.add_argument("-d", "--dequantize", action="store_true", help="Dequantize a quantized model")
    parser.add_argument("--revision", default=None, help="Hub revision (branch, tag or commit)")
    return parser


def main(argv: Optional[List[str]] = None) -> None:
    args = setup_arg_parser().parse_args(argv)
    try:
        convert(
            args.hf_path, args.mlx_path, quantize=args.quantize, q_group_size=args.q_group_size,
            q_bits=args.q_bits, q_mode=args.q_mode, dtype=args.dtype, revision=args.revision,
            dequantize=args.dequantize, progress=print_progress,
        )
    except (ValueError, FileNotFoundError) as e:
        sys.exit(f"Error: {e}")
    print(f"[INFO] Saved the MLX model to {args.mlx_path}", file=sys.stderr)


if __name__ == "__main__":
    main()
