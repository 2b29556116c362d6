"""GGUF export: a float llama, mistral or mixtral model as one llama.cpp file.

`convert_to_gguf(model_path, weights, config, output_file_path)` writes the weights (MLX
names, as `tree_flatten(model.parameters())` gives them) under llama.cpp's tensor names,
float16 (1-D tensors float32, as llama.cpp's own converter keeps them), with the
`general.*`, `llama.*` and `tokenizer.ggml.*` metadata llama.cpp's llama architecture
reads. All three types are llama.cpp's "llama" architecture (mixtral with
`llama.expert_count`).

What differs from upstream's exporter:
- A byte-level BPE tokenizer (GPT-2, Llama 3) is written as llama.cpp's "gpt2" model
  with its merges and pre-tokenizer; upstream labels every vocabulary "llama"
  (SentencePiece), which llama.cpp then tokenizes differently from the checkpoint.
- Experts are written stacked (`blk.N.ffn_{gate,up,down}_exps`), the layout MLX holds
  them in and llama.cpp reads; llama3 rope scaling becomes llama.cpp's `rope_freqs`.
- Anything llama.cpp could not run as the model runs here is refused by name: quantized
  weights, other rope scalings, tokenizers that are not BPE, pre-tokenizers not known.
  A `sliding_window` is not refused: llama.cpp's llama architecture has none, and its
  converter drops it too (full attention, the same within the window).

References: llama.cpp `convert_hf_to_gguf.py` and gguf-py `gguf/constants.py` (names,
keys), https://github.com/ggml-org/ggml/blob/master/docs/gguf.md (the format).
"""

import json
import re
from enum import IntEnum
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple, Union

import mlx.core as mx

from .models.rope_utils import Llama3RoPE, default_inv_freq
from .utils import get_model_classes

ACCEPTED_MODEL_TYPES = ("llama", "mistral", "mixtral")

# transformers' config defaults for max_position_embeddings, which the checkpoint's
# own model uses when config.json leaves it out; llama.cpp needs a context length.
DEFAULT_CONTEXT_LENGTH = {"llama": 2048, "mistral": 4096 * 32, "mixtral": 4096 * 32}

QUANTIZATION_VERSION = 2  # ggml's GGML_QNT_VERSION
ALIGNMENT = 32
# llama.cpp's converter gives a SentencePiece-style vocabulary read from tokenizer.json
# this score for every token it has none for.
UNSCORED = -1000.0


class GGMLFileType(IntEnum):
    """general.file_type: what most tensors are stored as (llama.cpp's LLAMA_FTYPE_MOSTLY_F16)."""

    GGML_TYPE_F16 = 1


class TokenType(IntEnum):
    """llama.cpp's token types (tokenizer.ggml.token_type)."""

    NORMAL = 1
    UNKNOWN = 2
    CONTROL = 3
    USER_DEFINED = 4
    UNUSED = 5
    BYTE = 6


# MLX module paths -> llama.cpp tensor names (gguf-py MODEL_TENSOR names).
MODEL_TENSOR_NAMES = {"model.embed_tokens": "token_embd", "model.norm": "output_norm", "lm_head": "output"}
LAYER_TENSOR_NAMES = {
    "input_layernorm": "attn_norm",
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "post_attention_layernorm": "ffn_norm",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
    "block_sparse_moe.gate": "ffn_gate_inp",
    "block_sparse_moe.switch_mlp.gate_proj": "ffn_gate_exps",
    "block_sparse_moe.switch_mlp.up_proj": "ffn_up_exps",
    "block_sparse_moe.switch_mlp.down_proj": "ffn_down_exps",
}

# The Llama 3 pre-tokenizer's split pattern (tokenizer.json), llama.cpp's "llama3".
LLAMA3_SPLIT_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
BYTE_TOKEN = re.compile(r"<0x[0-9A-Fa-f]{2}>")


# --- tensors -------------------------------------------------------------------------


def translate_weight_names(name: str) -> str:
    """llama.cpp's name for the MLX parameter `name` (model.layers.3.self_attn.q_proj.weight
    -> blk.3.attn_q.weight); a ValueError for a parameter llama.cpp has no place for."""
    module, _, kind = name.rpartition(".")
    if module in MODEL_TENSOR_NAMES:
        return f"{MODEL_TENSOR_NAMES[module]}.{kind}"
    layer = re.fullmatch(r"model\.layers\.(\d+)\.(.+)", module)
    if layer and layer.group(2) in LAYER_TENSOR_NAMES:
        return f"blk.{layer.group(1)}.{LAYER_TENSOR_NAMES[layer.group(2)]}.{kind}"
    raise ValueError(f"GGUF export: tensor {name!r} has no llama.cpp name (known: {sorted(LAYER_TENSOR_NAMES)})")


def permute_weights(weights: mx.array, n_head: int, n_head_kv: Optional[int] = None) -> mx.array:
    """q or k projection rows (n_head * head_dim, ...) reordered for llama.cpp's rope.

    MLX (and transformers) rotate feature i of a head with feature i + head_dim / 2;
    llama.cpp's llama rope rotates features 2i and 2i + 1. Within each head, row
    i goes to 2i and row i + head_dim / 2 to 2i + 1, so both compute the same
    attention. `n_head_kv` (upstream's argument), when given, is the number of heads
    the rows hold (a k projection's)."""
    heads = n_head if n_head_kv is None else n_head_kv
    rows = weights.shape[0]
    if rows % (2 * heads):
        raise ValueError(f"GGUF export: {rows} projection rows do not split into {heads} heads of even size")
    halves = weights.reshape(heads, 2, rows // heads // 2, *weights.shape[1:])  # (H, 2, D/2, ...)
    return halves.swapaxes(1, 2).reshape(weights.shape)  # (H * D, ...), halves interleaved


def check_float(weights: Dict[str, mx.array]) -> None:
    """A ValueError naming the first quantized tensor, if any: llama.cpp cannot read
    MLX's quantized layout."""
    quantized = [k for k, v in weights.items() if k.endswith((".scales", ".biases")) or not mx.issubdtype(v.dtype, mx.floating)]
    if quantized:
        raise ValueError(
            f"GGUF export needs float weights, but {quantized[0]!r} is quantized; dequantize the model first "
            "(mlx_lm.fuse --export-gguf does)"
        )


def gguf_tensors(weights: Dict[str, mx.array], n_heads: int, n_kv_heads: int) -> Dict[str, mx.array]:
    """The weights under llama.cpp's names, q/k permuted for its rope, matrices float16
    and 1-D tensors (norms, biases) float32, as llama.cpp's converter stores them."""
    check_float(weights)
    tensors = {}
    for name, value in weights.items():
        if ".self_attn.q_proj." in name:
            value = permute_weights(value, n_heads)
        elif ".self_attn.k_proj." in name:
            value = permute_weights(value, n_heads, n_kv_heads)
        tensors[translate_weight_names(name)] = value.astype(mx.float32 if value.ndim == 1 else mx.float16)
    return tensors


def llama3_rope_factors(head_dim: int, theta: float, scaling: Dict[str, Any], max_positions: Optional[int]) -> mx.array:
    """llama.cpp's rope_freqs tensor (head_dim / 2,): what each default rope frequency
    is divided by under Llama 3.1's scaling (1 for short wavelengths, `factor` for long),
    read off the rope the model itself builds (its periods, `_freqs`, over the default ones)."""
    rope = Llama3RoPE(head_dim, max_positions, False, theta, scaling)
    return (rope._freqs * mx.array(default_inv_freq(head_dim, theta))).astype(mx.float32)


# --- model metadata --------------------------------------------------------------------


def uint32(value: int) -> mx.array:
    return mx.array(value, dtype=mx.uint32)


def float32(value: float) -> mx.array:
    return mx.array(value, dtype=mx.float32)


def check_model_type(config: Dict[str, Any]) -> None:
    """A ValueError naming the config's model type unless GGUF export accepts it."""
    model_type = config.get("model_type")
    if model_type not in ACCEPTED_MODEL_TYPES:
        raise ValueError(
            f"GGUF export does not support model type {model_type!r}; accepted: {', '.join(ACCEPTED_MODEL_TYPES)}"
        )


def check_exportable(config: Dict[str, Any]) -> None:
    """What convert_to_gguf refuses about a config, checked before any work: the model
    type and the rope scaling (a quantization block is not refused: fuse dequantizes)."""
    check_model_type(config)
    rope_metadata(model_args(config))


def check_float_config(config: Dict[str, Any]) -> None:
    if config.get("quantization") or config.get("quantization_config"):
        raise ValueError("GGUF export needs a float model, but its config has a quantization block; dequantize first")


def model_args(config: Dict[str, Any]):
    """The model's normalised ModelArgs (head_dim, kv heads, rope theta and scaling
    resolved as the model itself resolves them)."""
    return get_model_classes(config)[1].from_dict(config)


def rope_metadata(args) -> Tuple[Dict[str, Any], Dict[str, mx.array]]:
    """(metadata, extra tensors) for the model's rope scaling: none, linear (a factor) or
    llama3 (a rope_freqs tensor); any other is a ValueError naming it."""
    scaling = args.rope_scaling
    if scaling is None:
        return {}, {}
    rope_type = scaling.get("rope_type")
    if rope_type == "linear":
        return {"llama.rope.scaling.type": "linear", "llama.rope.scaling.factor": float32(scaling["factor"])}, {}
    if rope_type == "llama3":
        factors = llama3_rope_factors(args.head_dim, args.rope_theta, scaling, args.max_position_embeddings)
        return {}, {"rope_freqs.weight": factors}
    raise ValueError(f"GGUF export supports no rope scaling, linear or llama3, not {rope_type!r} ({scaling!r})")


def model_metadata(args, name: str) -> Dict[str, Any]:
    """general.* and llama.* keys of the model `args` (its ModelArgs) describe, called `name`."""
    context = args.max_position_embeddings or DEFAULT_CONTEXT_LENGTH[args.model_type]
    metadata = {
        "general.architecture": "llama",
        "general.name": name,
        "general.file_type": uint32(GGMLFileType.GGML_TYPE_F16),
        "general.quantization_version": uint32(QUANTIZATION_VERSION),
        "general.alignment": uint32(ALIGNMENT),
        "llama.vocab_size": uint32(args.vocab_size),
        "llama.context_length": uint32(context),
        "llama.embedding_length": uint32(args.hidden_size),
        "llama.block_count": uint32(args.num_hidden_layers),
        "llama.feed_forward_length": uint32(args.intermediate_size),
        "llama.attention.head_count": uint32(args.num_attention_heads),
        "llama.attention.head_count_kv": uint32(args.num_key_value_heads),
        "llama.attention.key_length": uint32(args.head_dim),
        "llama.attention.value_length": uint32(args.head_dim),
        "llama.attention.layer_norm_rms_epsilon": float32(args.rms_norm_eps),
        "llama.rope.dimension_count": uint32(args.head_dim),
        "llama.rope.freq_base": float32(args.rope_theta),
    }
    if args.model_type == "mixtral":
        metadata["llama.expert_count"] = uint32(args.num_local_experts)
        metadata["llama.expert_used_count"] = uint32(args.num_experts_per_tok)
    return metadata


# --- tokenizer metadata ----------------------------------------------------------------


def token_text(token: Union[str, Dict[str, Any], None]) -> Optional[str]:
    """A tokenizer_config.json token entry's text (a string or an AddedToken dict)."""
    return token.get("content") if isinstance(token, dict) else token


def pre_tokenizer_name(pre_tokenizer: Optional[Dict[str, Any]]) -> str:
    """llama.cpp's name (tokenizer.ggml.pre) for a byte-level BPE's pre-tokenizer: GPT-2's
    ByteLevel regex or Llama 3's split; any other is a ValueError, since llama.cpp would
    split text differently from the checkpoint's tokenizer."""
    steps = (pre_tokenizer or {}).get("pretokenizers", [pre_tokenizer] if pre_tokenizer else [])
    kinds = [step.get("type") for step in steps]
    if kinds == ["ByteLevel"] and steps[0].get("use_regex", True):
        return "gpt-2"
    if (kinds == ["Split", "ByteLevel"] and steps[0].get("pattern", {}).get("Regex") == LLAMA3_SPLIT_PATTERN
            and not steps[1].get("use_regex", True)):
        return "llama3"
    raise ValueError(
        f"GGUF export knows GPT-2's and Llama 3's byte-level pre-tokenizers, not this one: {pre_tokenizer!r}"
    )


def token_table(tokenizer: Dict[str, Any], vocab_size: int, byte_tokens: bool) -> Tuple[List[str], List[int]]:
    """(texts, token types) of ids 0 .. vocab_size - 1. Special added tokens are CONTROL,
    other added ones USER_DEFINED, <0xNN> pieces BYTE when `byte_tokens`; embedding rows
    the tokenizer has no token for are "[PAD<id>]" and UNUSED, as llama.cpp's converter
    fills padded vocabularies."""
    texts = {token_id: text for text, token_id in tokenizer["model"]["vocab"].items()}
    added = {entry["id"]: entry.get("special", False) for entry in tokenizer.get("added_tokens", [])}
    texts.update({entry["id"]: entry["content"] for entry in tokenizer.get("added_tokens", [])})
    if max(texts) >= vocab_size:
        raise ValueError(f"GGUF export: the tokenizer has token id {max(texts)}, beyond the model's vocab_size {vocab_size}")
    table = []
    for token_id in range(vocab_size):
        text = texts.get(token_id)
        if text is None:
            kind = TokenType.UNUSED
        elif token_id in added:
            kind = TokenType.CONTROL if added[token_id] else TokenType.USER_DEFINED
        else:
            kind = TokenType.BYTE if byte_tokens and BYTE_TOKEN.fullmatch(text) else TokenType.NORMAL
        table.append((f"[PAD{token_id}]" if text is None else text, int(kind)))
    return [text for text, _ in table], [kind for _, kind in table]


def merge_strings(merges: List[Any]) -> List[str]:
    """BPE merges as llama.cpp stores them, "left right" (tokenizer.json has that form or
    [left, right] pairs)."""
    return [merge if isinstance(merge, str) else " ".join(merge) for merge in merges]


def vocabulary_metadata(tokenizer: Dict[str, Any], vocab_size: int) -> Dict[str, Any]:
    """tokenizer.ggml.model, tokens and token types, plus merges and the pre-tokenizer
    (byte-level BPE, llama.cpp's "gpt2") or scores (byte-fallback BPE, SentencePiece
    style, llama.cpp's "llama")."""
    model = tokenizer.get("model", {})
    if model.get("type") != "BPE":
        raise ValueError(f"GGUF export supports BPE tokenizers, not {model.get('type')!r} (tokenizer.json's model.type)")
    sentencepiece_style = bool(model.get("byte_fallback"))
    tokens, types = token_table(tokenizer, vocab_size, byte_tokens=sentencepiece_style)
    metadata = {"tokenizer.ggml.tokens": tokens, "tokenizer.ggml.token_type": mx.array(types, dtype=mx.int32)}
    if sentencepiece_style:
        metadata["tokenizer.ggml.model"] = "llama"
        metadata["tokenizer.ggml.scores"] = mx.full((vocab_size,), UNSCORED, dtype=mx.float32)
    else:
        metadata["tokenizer.ggml.model"] = "gpt2"
        metadata["tokenizer.ggml.pre"] = pre_tokenizer_name(tokenizer.get("pre_tokenizer"))
        metadata["tokenizer.ggml.merges"] = merge_strings(model.get("merges", []))
    return metadata


def token_id(text: str, tokens: List[str], role: str) -> int:
    if text not in tokens:
        raise ValueError(f"GGUF export: the {role} token {text!r} of tokenizer_config.json is not in the vocabulary")
    return tokens.index(text)


def special_token_metadata(tokens: List[str], tokenizer_config: Dict[str, Any], config: Dict[str, Any]) -> Dict[str, Any]:
    """bos/eos/unknown/padding ids (tokenizer_config.json's tokens, else config.json's
    ids), whether to add bos/eos, and the chat template."""
    metadata = {}
    for role, key in (("bos", "bos"), ("eos", "eos"), ("unk", "unknown"), ("pad", "padding")):
        text = token_text(tokenizer_config.get(f"{role}_token"))
        fallback = config.get(f"{role}_token_id")
        if isinstance(fallback, list):  # several eos ids (Llama 3.1): llama.cpp keeps one
            fallback = fallback[0] if fallback else None
        chosen = token_id(text, tokens, role) if text is not None else fallback
        if chosen is not None:
            metadata[f"tokenizer.ggml.{key}_token_id"] = uint32(chosen)
    for role in ("bos", "eos"):
        if f"add_{role}_token" in tokenizer_config:
            metadata[f"tokenizer.ggml.add_{role}_token"] = mx.array(bool(tokenizer_config[f"add_{role}_token"]))
    metadata.update(chat_template_metadata(tokenizer_config.get("chat_template")))
    return metadata


def chat_template_metadata(template: Union[str, List[Dict[str, str]], None]) -> Dict[str, str]:
    """tokenizer.chat_template, and tokenizer.chat_template.<name> for each named
    template of a list (its "default" one is the plain key)."""
    if template is None:
        return {}
    if isinstance(template, str):
        return {"tokenizer.chat_template": template}
    return {
        "tokenizer.chat_template" + ("" if entry["name"] == "default" else f".{entry['name']}"): entry["template"]
        for entry in template
    }


def read_json(path: Path, required: bool) -> Dict[str, Any]:
    if not path.exists():
        if required:
            raise ValueError(f"GGUF export needs {path.name}, which {path.parent} lacks")
        return {}
    return json.loads(path.read_text(encoding="utf-8"))


def tokenizer_metadata(model_path: Path, config: Dict[str, Any], vocab_size: int) -> Dict[str, Any]:
    """tokenizer.ggml.* (and tokenizer.chat_template) from the tokenizer files in `model_path`."""
    tokenizer = read_json(model_path / "tokenizer.json", required=True)
    tokenizer_config = read_json(model_path / "tokenizer_config.json", required=False)
    if tokenizer_config.get("chat_template") is None and (model_path / "chat_template.jinja").exists():
        tokenizer_config["chat_template"] = (model_path / "chat_template.jinja").read_text(encoding="utf-8")
    metadata = vocabulary_metadata(tokenizer, vocab_size)
    metadata.update(special_token_metadata(metadata["tokenizer.ggml.tokens"], tokenizer_config, config))
    return metadata


# --- the file ----------------------------------------------------------------------------


def convert_to_gguf(
    model_path: Union[str, Path],
    weights: Dict[str, mx.array],
    config: Dict[str, Any],
    output_file_path: str,
) -> None:
    """Write `weights` (a float model's, MLX names) with `config`'s metadata and the
    tokenizer of `model_path` to the GGUF file `output_file_path`.

    Raises:
        ValueError: a model type other than llama, mistral or mixtral, quantized
            weights, a tensor, rope scaling or tokenizer llama.cpp has no form for, or
            no tokenizer.json in `model_path`.
    """
    model_path = Path(model_path)
    check_model_type(config)
    check_float_config(config)
    check_float(weights)
    args = model_args(config)
    name = str(config.get("_name_or_path") or model_path.name).split("/")[-1]
    metadata = model_metadata(args, name)
    rope_entries, rope_tensors = rope_metadata(args)
    metadata.update(rope_entries)
    metadata.update(tokenizer_metadata(model_path, config, args.vocab_size))
    tensors = gguf_tensors(weights, args.num_attention_heads, args.num_key_value_heads)
    mx.save_gguf(str(output_file_path), {**tensors, **rope_tensors}, metadata)
