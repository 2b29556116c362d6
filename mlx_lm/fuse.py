"""`mlx_lm.fuse`: fold fine-tuned adapters into the base weights and save the model.

    mlx_lm.fuse --model <base> --adapter-path adapters --save-path fused_model [--dequantize]
                [--upload-repo namespace/name] [--trust-remote-code]

The saved model computes what the base with its adapters computes: every adapted layer
becomes one float linear layer holding W + scale * (lora_a @ lora_b)^T (DoRA: rescaled
per row). Unlike upstream, an adapted layer of a quantized base stays float instead of
being requantized at the base's precision, which rounds most of a small update away
(upstream issue #1172); the config's quantization block records it as float. With
--dequantize the whole model is saved in float. --export-gguf also writes the fused model,
dequantized, as a llama.cpp GGUF file (`gguf.convert_to_gguf`; llama, mistral, mixtral)
at --gguf-path inside the saved folder.
"""

import argparse
import sys
from pathlib import Path
from typing import Any, Dict, List, Optional, Union

import mlx.nn as nn
from mlx.utils import tree_flatten, tree_unflatten

from .cli_args import HelpFormatter
from .gguf import check_exportable, convert_to_gguf
from .hub import check_repo_id, upload_to_hub
from .tuner.lora import LoRALinear, LoRASwitchLinear
from .utils import dequantize_model, get_model_path, load_adapters, load_model, load_tokenizer, save

QUANTIZATION_KEYS = ("quantization", "quantization_config")


def fuse_adapters(model: nn.Module) -> List[str]:
    """Replace every adapter layer of `model` by its fused linear layer, in place;
    returns the paths of the layers fused."""
    fused = [(path, m.fuse()) for path, m in model.named_modules() if isinstance(m, (LoRALinear, LoRASwitchLinear))]
    if fused:
        model.update_modules(tree_unflatten(fused))
    return [path for path, _ in fused]


def _record_float_layers(config: Dict[str, Any], paths: List[str]) -> Dict[str, Any]:
    """The config with `paths` kept float (`false`) in its MLX quantization block(s)."""
    config = dict(config)
    for key in QUANTIZATION_KEYS:
        block = config.get(key)
        if isinstance(block, dict) and "quant_method" not in block:
            config[key] = {**block, **{path: False for path in paths}}
    return config


def fuse(
    model: str,
    adapter_path: Union[str, Path] = "adapters",
    save_path: Union[str, Path] = "fused_model",
    dequantize: bool = False,
    revision: Optional[str] = None,
    *,
    upload_repo: Optional[str] = None,
    trust_remote_code: bool = False,
    export_gguf: bool = False,
    gguf_path: Union[str, Path] = "ggml-model-f16.gguf",
) -> None:
    """Load `model` (a local directory or hub repo) with the adapters of
    `adapter_path`, fuse them and save the result to `save_path` (which must not
    exist). The checkpoint's dtypes are kept. `upload_repo`: then upload the saved
    folder to that hub repo (`hub.upload_to_hub`; a failed upload is a RuntimeError and
    the folder stays). `trust_remote_code`: let the tokenizer run the repo's own code.
    `export_gguf`: also write the fused model, dequantized, to `save_path / gguf_path`
    as GGUF (a model type or rope scaling it cannot take is refused before the fuse)."""
    if Path(save_path).exists():
        raise ValueError(f"Cannot save to {save_path}: it already exists; choose another --save-path or remove it")
    if upload_repo is not None:  # a bad id fails before the fuse, not after
        check_repo_id(upload_repo)
    model_path = get_model_path(model, revision=revision, with_code=trust_remote_code)
    base, config = load_model(model_path, lazy=True, trust_remote_code=trust_remote_code)
    if export_gguf:  # a model type or rope llama.cpp's llama cannot take fails before the fuse
        check_exportable(config)
    tokenizer = load_tokenizer(model_path, {"trust_remote_code": True} if trust_remote_code else None)
    load_adapters(base, adapter_path)
    fused = fuse_adapters(base)
    if dequantize:
        dequantize_model(base)
        config = {k: v for k, v in config.items() if k not in QUANTIZATION_KEYS}
    else:
        config = _record_float_layers(config, fused)
    save(save_path, model_path, base, tokenizer, config, donate_model=not export_gguf)
    if export_gguf:  # the saved folder keeps its quantization; the GGUF file is float
        float_config = {k: v for k, v in config.items() if k not in QUANTIZATION_KEYS}
        weights = dict(tree_flatten(dequantize_model(base).parameters()))
        convert_to_gguf(save_path, weights, float_config, str(Path(save_path) / gguf_path))
    if upload_repo is not None:
        upload_to_hub(save_path, upload_repo)


def setup_arg_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="mlx_lm.fuse", description="Fuse fine-tuned adapters into the base model", formatter_class=HelpFormatter
    )
    parser.add_argument("--model", default="mlx_model", help="Base model: local directory or Hugging Face repo id")
    parser.add_argument("--adapter-path", default="adapters", help="Adapter directory (adapter_config.json, adapters.safetensors)")
    parser.add_argument("--save-path", default="fused_model", help="Output directory (must not exist)")
    # Upstream spelled it --de-quantize before renaming it --dequantize; both work.
    parser.add_argument("--dequantize", "--de-quantize", action="store_true", help="Save the whole model in float")
    parser.add_argument("--upload-repo", default=None, help="Then upload the fused model to this Hugging Face repo")
    parser.add_argument("--trust-remote-code", action="store_true",
                        help="Let the tokenizer run its repo's own code (transformers' option)")
    parser.add_argument("--export-gguf", action="store_true", help="Also write the fused model as a GGUF file (llama.cpp)")
    parser.add_argument("--gguf-path", default="ggml-model-f16.gguf", help="The GGUF file's path inside --save-path")
    return parser


def parse_arguments(argv: Optional[List[str]] = None) -> argparse.Namespace:
    """Upstream's name: the command line (`argv`, else sys.argv's), parsed."""
    return setup_arg_parser().parse_args(argv)


def main(argv: Optional[List[str]] = None) -> None:
    args = parse_arguments(argv)
    try:
        fuse(args.model, args.adapter_path, args.save_path, dequantize=args.dequantize,
             upload_repo=args.upload_repo, trust_remote_code=args.trust_remote_code,
             export_gguf=args.export_gguf, gguf_path=args.gguf_path)
    except (ValueError, FileNotFoundError, RuntimeError) as e:
        sys.exit(f"Error: {e}")
    print(f"[INFO] Saved the fused model to {args.save_path}", file=sys.stderr)
    if args.export_gguf:
        print(f"[INFO] Wrote GGUF to {Path(args.save_path) / args.gguf_path}", file=sys.stderr)
    if args.upload_repo is not None:
        print(f"[INFO] Uploaded it to https://huggingface.co/{args.upload_repo}", file=sys.stderr)


if __name__ == "__main__":
    main()
