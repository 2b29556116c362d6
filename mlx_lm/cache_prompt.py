"""`mlx_lm.cache_prompt`: run a prompt through a model once and save its KV cache, so
that `mlx_lm.generate --prompt-cache-file` starts after it.

The file has upstream's layout (`models/cache.save_prompt_cache`) and this metadata:
- "model" (the --model given) and "tokenizer_config" (JSON of the tokenizer options
  used), the two keys upstream writes;
- "model_type" and "model_fingerprint": which model made the cache. generate refuses a
  cache whose fingerprint is not that of the model it runs (files without one, e.g.
  from upstream, must name the same --model);
- "prompt" (the cached text) and "prompt_tokens" (JSON list of the cached token ids);
- for a model with recurrent or sliding-window layers, which cannot give tokens back,
  snapshots of those layers taken while the prompt was fed (models/checkpoints.py),
  within --snapshot-mb, in the way models/checkpoint_files.py keeps them: upstream's
  loader ignores them, and its metadata gets one more key.

The cached prompt is formatted like generate's but with the user message left open
(`continue_final_message`). generate then formats `cached text + new prompt` exactly
as it would without a cache and feeds only what follows the longest common prefix with
the cached tokens, trimming the cache back where the two differ (where the template
closes the message, or a token merges across the join): a cache with recurrent layers
goes back to its nearest snapshot at or before there. So generating from the cache
gives what generating from the whole prompt gives (bit for bit where the cache was
filled in the chunks generate's prefill cuts, which fill_cache does). A file without "prompt_tokens"
(upstream's) is continued with the new prompt's raw tokens, without a chat template.
"""

import argparse
import functools
import hashlib
import json
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Tuple

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx.utils import tree_flatten

from .cli_args import (
    DEFAULT_MODEL,
    DEFAULT_QUANTIZED_KV_START,  # noqa: F401  (upstream's cache_prompt.DEFAULT_QUANTIZED_KV_START)
    HelpFormatter,
    add_kv_quantization_arguments,
    format_bytes,
    json_object,
    positive_int,
    prompt_text,
)
from .feeding import DEFAULT_PREFILL_STEP_SIZE
from .models.cache import (
    can_trim_prompt_cache,
    check_kv_quantization,
    make_prompt_cache,
    maybe_quantize_kv_cache,
    trim_prompt_cache,
)
from .models.checkpoint_files import load_checkpointed, save_checkpointed
from .models.checkpoints import CheckpointedCache, PrefillChunks, always_trimmable, maybe_snapshot

# What the snapshots of a cached prompt may take by default (the newest is always kept).
DEFAULT_SNAPSHOT_MB = 1024
from .tokenizer_utils import TokenizerWrapper


def model_fingerprint(model: nn.Module) -> str:
    """Hash of every parameter's name, shape and dtype plus the values of the 8 smallest
    parameters (norm weights and biases, which differ between fine-tunes of one
    architecture). Cheap for any model size; the same weights give the same value."""
    params = sorted(tree_flatten(model.parameters()), key=lambda item: item[0])
    digest = hashlib.sha256()
    for name, p in params:
        digest.update(f"{name}:{tuple(p.shape)}:{p.dtype};".encode())
    for _, p in sorted(params, key=lambda item: (item[1].size, item[0]))[:8]:
        digest.update(np.array(p.astype(mx.float32)).tobytes())
    return digest.hexdigest()[:16]


def format_cached_prompt(
    tokenizer: TokenizerWrapper, prompt: str, system_prompt: Optional[str], use_chat_template: bool,
    template_args: Dict[str, Any],
) -> List[int]:
    """Token ids of the prompt to cache: the chat template with the user message open."""
    if not (use_chat_template and tokenizer.has_chat_template):
        return tokenizer.encode(prompt)
    messages = [{"role": "system", "content": system_prompt}] if system_prompt else []
    messages.append({"role": "user", "content": prompt})
    text = tokenizer.apply_chat_template(messages, tokenize=False, continue_final_message=True, **template_args)
    return tokenizer.encode(text, add_special_tokens=False)


def fill_cache(
    model: nn.Module, tokens: List[int], prompt_cache: List[Any], quantize_kv: Callable[[List[Any]], None],
    step_size: int = DEFAULT_PREFILL_STEP_SIZE,
) -> None:
    """Feed every token through the model into `prompt_cache`, in the chunks a prefill
    cuts (feeding.prefill), a CheckpointedCache taking its snapshots."""
    chunks, done = PrefillChunks(prompt_cache, step_size), 0
    maybe_snapshot(prompt_cache, 0)
    while done < len(tokens):
        n = chunks.size(done, len(tokens) - done)
        model(mx.array(tokens[done : done + n])[None], cache=prompt_cache)
        quantize_kv(prompt_cache)
        mx.eval([c.state for c in prompt_cache])
        done += n
        maybe_snapshot(prompt_cache, n)
        mx.clear_cache()


def checkpointed_cache(prompt_cache: List[Any], snapshot_mb: int) -> List[Any]:
    """A fresh cache that keeps snapshots of its untrimmable entries within
    `snapshot_mb` MiB; as it is where all trim, or with no budget."""
    if snapshot_mb < 0:
        raise ValueError(f"--snapshot-mb must be >= 0, got {snapshot_mb}")
    if snapshot_mb == 0 or all(always_trimmable(c) for c in prompt_cache):
        return prompt_cache
    return CheckpointedCache(prompt_cache, DEFAULT_PREFILL_STEP_SIZE, snapshot_mb << 20)


def tokens_after_cache(prompt_cache: List[Any], cached_tokens: List[int], full_tokens: List[int]) -> List[int]:
    """What to feed after a cache holding `cached_tokens` to have fed `full_tokens`:
    the cache is trimmed back to their longest common prefix (leaving at least one
    token to feed, whose logits start generation)."""
    common, limit = 0, min(len(cached_tokens), len(full_tokens) - 1)
    while common < limit and cached_tokens[common] == full_tokens[common]:
        common += 1
    if common < len(cached_tokens) and not can_trim_prompt_cache(prompt_cache):
        common = _snapshot_at_or_before(prompt_cache, common, len(cached_tokens))
    trim_prompt_cache(prompt_cache, len(cached_tokens) - common)
    return full_tokens[common:]


def _snapshot_at_or_before(prompt_cache: List[Any], common: int, num_cached: int) -> int:
    """Where a cache that cannot trim goes back to for a prompt sharing `common` of its
    `num_cached` tokens: its nearest snapshot (a CheckpointedCache), else ValueError."""
    position = prompt_cache.nearest(common) if isinstance(prompt_cache, CheckpointedCache) else None
    if position is None:
        kinds = sorted({type(c).__name__ for c in prompt_cache if not c.is_trimmable()})
        raise ValueError(
            f"The prompt differs from the cached one from token {common} of {num_cached} on, and the cache "
            f"cannot be trimmed back ({', '.join(kinds)}) nor has a snapshot at or before there; start the "
            "prompt with the cached text, or remake the cache with mlx_lm.cache_prompt (which keeps snapshots)"
        )
    return position


@dataclass
class CachedPrompt:
    """A loaded prompt cache, the file it came from and the tokens it holds (`tokens`
    None: the file does not say)."""

    path: str
    cache: List[Any]
    text: str
    tokens: Optional[List[int]]

    def resume(
        self, tokenizer: TokenizerWrapper, prompt: str, format_prompt: Callable[[str], List[int]]
    ) -> Tuple[List[Any], List[int]]:
        """(cache, tokens to feed) for generating as from `format_prompt(text + prompt)`.
        The cache may be trimmed back; `tokens` follows it."""
        if self.tokens is None:
            return self.cache, tokenizer.encode(prompt, add_special_tokens=False)
        full_tokens = format_prompt(self.text + prompt)
        to_feed = tokens_after_cache(self.cache, self.tokens, full_tokens)
        self.tokens = full_tokens[: len(full_tokens) - len(to_feed)]
        return self.cache, to_feed

    def cache_for(self, model: nn.Module, quantize_kv: Callable[[List[Any]], None]) -> List[Any]:
        """A new cache of `model` (a draft model) holding the tokens this one holds."""
        if self.tokens is None:
            raise ValueError(
                f"Prompt cache {self.path} does not record its tokens (a file from upstream mlx-lm), so a "
                "draft model cannot be brought to it; remake it with mlx_lm.cache_prompt, or leave out --draft-model"
            )
        prompt_cache = make_prompt_cache(model)
        fill_cache(model, self.tokens, prompt_cache, quantize_kv)
        return prompt_cache


def load_cached_prompt(path: str, model: nn.Module, model_name: str) -> CachedPrompt:
    """Load a cache file for `model` (loaded from `model_name`); a cache made by another
    model is refused with a ValueError naming both."""
    prompt_cache, metadata = load_checkpointed(path)
    made_for = metadata.get("model", "an unnamed model")
    fingerprint = metadata.get("model_fingerprint")
    same = fingerprint == model_fingerprint(model) if fingerprint is not None else made_for == model_name
    if not same or len(prompt_cache) != len(make_prompt_cache(model)):
        raise ValueError(
            f"Prompt cache {path} was made for model {made_for!r} ({metadata.get('model_type', 'type unknown')}), "
            f"not for {model_name!r}; make one for this model with mlx_lm.cache_prompt --model {model_name}"
        )
    tokens = None
    if "prompt_tokens" in metadata:
        try:
            tokens = json.loads(metadata["prompt_tokens"])
        except json.JSONDecodeError:
            tokens = None
        if not (isinstance(tokens, list) and all(type(t) is int for t in tokens)):
            raise ValueError(f"Prompt cache {path} has malformed prompt_tokens metadata; expected a JSON list of ids")
    return CachedPrompt(path, prompt_cache, metadata.get("prompt", ""), tokens)


def setup_arg_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="mlx_lm.cache_prompt", description="Cache a prompt's KV state for later generation",
        formatter_class=HelpFormatter,
    )
    parser.add_argument("--model", default=DEFAULT_MODEL, help="Local model directory or Hugging Face repo id")
    parser.add_argument("--adapter-path", default=None,
                        help="LoRA/DoRA adapters for --model; generate then needs the same --adapter-path")
    parser.add_argument("--trust-remote-code", action="store_true",
                        help="Let the tokenizer run its repo's own code (transformers' option)")
    parser.add_argument("--eos-token", default=None,
                        help="The tokenizer's end-of-sequence token (what a chat template writes as eos_token)")
    parser.add_argument("--prompt", required=True, help="Prompt text to cache, or '-' for stdin")
    parser.add_argument("--prompt-cache-file", required=True, help="Output file (.safetensors)")
    parser.add_argument("--system-prompt", default=None, help="System prompt for the chat template")
    parser.add_argument("--ignore-chat-template", action="store_true",
                        help="Cache the prompt as is, without the chat template")
    parser.add_argument("--chat-template-config", type=json_object, default=None,
                        help="JSON object of extra chat template arguments")
    parser.add_argument("--max-kv-size", type=positive_int, default=None,
                        help="Bound every KV cache to this many tokens, keeping the first 4 (default: unbounded)")
    add_kv_quantization_arguments(parser)
    parser.add_argument("--snapshot-mb", type=int, default=DEFAULT_SNAPSHOT_MB,
                        help="MiB the snapshots of recurrent and sliding-window layers may take in the file, so "
                             "that a prompt differing near the end of the cached one resumes from them (0: none)")
    return parser


def tokenizer_options(args: argparse.Namespace) -> Dict[str, Any]:
    """The tokenizer options the command line asks for (upstream's tokenizer_config,
    also saved in the file's metadata)."""
    options: Dict[str, Any] = {"trust_remote_code": True} if args.trust_remote_code else {}
    if args.eos_token is not None:
        options["eos_token"] = args.eos_token
    return options


def main(argv: Optional[List[str]] = None) -> None:
    args = setup_arg_parser().parse_args(argv)
    try:
        from .utils import load

        tokenizer_config = tokenizer_options(args)
        model, tokenizer, config = load(args.model, tokenizer_config=tokenizer_config, adapter_path=args.adapter_path,
                                        return_config=True, trust_remote_code=args.trust_remote_code)
        prompt = prompt_text(args.prompt)
        tokens = format_cached_prompt(
            tokenizer, prompt, args.system_prompt, not args.ignore_chat_template, args.chat_template_config or {}
        )
        prompt_cache = checkpointed_cache(make_prompt_cache(model, max_kv_size=args.max_kv_size), args.snapshot_mb)
        if args.kv_bits is not None:
            check_kv_quantization(prompt_cache, args.kv_group_size, args.kv_bits, args.quantized_kv_start)
        quantize_kv = functools.partial(
            maybe_quantize_kv_cache, quantized_kv_start=args.quantized_kv_start,
            kv_group_size=args.kv_group_size, kv_bits=args.kv_bits,
        )
        fill_cache(model, tokens, prompt_cache, quantize_kv)
        metadata = {
            "model": args.model,
            "tokenizer_config": json.dumps(tokenizer_config),
            "model_type": str(config.get("model_type")),
            "model_fingerprint": model_fingerprint(model),
            "prompt": prompt,
            "prompt_tokens": json.dumps(tokens),
        }
        save_checkpointed(args.prompt_cache_file, prompt_cache, metadata)
        saved_file = Path(args.prompt_cache_file)
        if saved_file.suffix != ".safetensors":  # MLX appends the suffix
            saved_file = saved_file.with_name(saved_file.name + ".safetensors")
    except (ValueError, FileNotFoundError) as e:
        sys.exit(f"Error: {e}")
    print(f"Cached {len(tokens)} prompt tokens in {saved_file} ({format_bytes(saved_file.stat().st_size)})")


if __name__ == "__main__":
    main()
