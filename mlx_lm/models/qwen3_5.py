"""Qwen3.5 (dense): the qwen3_next hybrid as the text model of a vision-language
checkpoint.

What differs from qwen3_next:
- The config nests the text model under `text_config`; the top-level
  `tie_word_embeddings` is the one transformers ties by.
- The Gated DeltaNet projects with separate `in_proj_qkv` ([all q | all k | all v]),
  `in_proj_z`, `in_proj_b` and `in_proj_a` instead of grouped per key head.
- Every MLP is dense (transformers' Qwen3.5 text config drops the MoE keys).
- Rope is multimodal (mrope) in transformers, but for text every position axis carries
  the same index, so it is plain partial rope; the mrope keys are dropped.
- Weights live under `model.language_model.*` and `lm_head.*` in the checkpoint (ours:
  `language_model.model.*`, `language_model.lm_head.*`); the vision tower
  (`model.visual.*`, or `vision_tower.*` after MLX conversion) is dropped. The MTP head
  (`mtp.*` at the top level, declared by `mtp_num_hidden_layers` in `text_config`) is
  qwen3_next's, ours at `language_model.mtp.*`.
Reference: transformers `models/qwen3_5/modeling_qwen3_5.py`.
"""

from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Tuple, Union

import mlx.core as mx
import mlx.nn as nn

from . import qwen3_next, sharding
from .base import BaseModelArgs
from .cache import ArraysCache, KVCache

VISION_PREFIXES = ("model.visual.", "vision_tower.")
# Rope-scaling keys that only place image/video tokens; text positions make them moot.
MROPE_KEYS = ("mrope_section", "mrope_interleaved")


@dataclass
class TextModelArgs(qwen3_next.ModelArgs):
    mtp_num_hidden_layers: int = 0

    @property
    def num_mtp_layers(self) -> int:
        return self.mtp_num_hidden_layers

    def __post_init__(self):
        for name in ("rope_scaling", "rope_parameters"):
            params = getattr(self, name)
            if params is not None:
                setattr(self, name, _without_mrope(params))
        super().__post_init__()

    def is_moe_layer(self, layer_idx: int) -> bool:
        # transformers' Qwen3_5TextConfig deletes the MoE keys: any left in a config are
        # ignored, as transformers ignores them.
        return False


def _without_mrope(params: Dict[str, Any]) -> Dict[str, Any]:
    """Rope parameters with the mrope keys removed and type "mrope" read as "default"."""
    params = {k: v for k, v in params.items() if k not in MROPE_KEYS}
    for key in ("type", "rope_type"):
        if params.get(key) == "mrope":
            params[key] = "default"
    return params


@dataclass
class ModelArgs(BaseModelArgs):
    model_type: str
    text_config: Optional[Dict[str, Any]] = None
    tie_word_embeddings: Optional[bool] = None

    text_args_class = TextModelArgs

    def __post_init__(self):
        if not isinstance(self.text_config, dict):
            raise ValueError(
                f"{self.model_type} config needs a text_config dict (got {self.text_config!r}); "
                "the text model's settings live there"
            )
        text = dict(self.text_config)
        if self.tie_word_embeddings is None:
            self.tie_word_embeddings = text.get("tie_word_embeddings", False)
        text["tie_word_embeddings"] = self.tie_word_embeddings
        text.setdefault("model_type", self.model_type)
        self.text_args = self.text_args_class.from_dict(text)

    @property
    def vocab_size(self) -> int:
        """The text model's (generation compares target and draft vocabularies by it)."""
        return self.text_args.vocab_size


class GatedDeltaNet(qwen3_next.GatedDeltaNet):
    def make_projections(self, hidden_size: int):
        self.in_proj_qkv = nn.Linear(hidden_size, self.conv_dim, bias=False)
        self.in_proj_z = nn.Linear(hidden_size, self.value_dim, bias=False)
        self.in_proj_b = nn.Linear(hidden_size, self.num_value_heads, bias=False)
        self.in_proj_a = nn.Linear(hidden_size, self.num_value_heads, bias=False)

    def project(self, x: mx.array) -> Tuple[mx.array, mx.array, mx.array, mx.array]:
        """x (B, T, hidden) -> conv rows qkv (B, T, conv_dim), z (B, T, Hv, Dv), b, a (B, T, Hv)."""
        B, T, _ = x.shape
        z = self.in_proj_z(x).reshape(B, T, self.num_value_heads, self.value_head_dim)
        return self.in_proj_qkv(x), z, self.in_proj_b(x), self.in_proj_a(x)

    def shard(self, group: mx.distributed.Group) -> None:
        """Keep this rank's key heads: in_proj_qkv's rows are [all q | all k | all v],
        in_proj_z/b/a's are per value head (those of a key head are adjacent)."""
        sharding.shard_gated_delta(
            self, group, per_head=("in_proj_z", "in_proj_b", "in_proj_a"), qkv_ordered=("in_proj_qkv",)
        )


class LanguageModel(qwen3_next.Model):
    linear_attention_class = GatedDeltaNet


def text_key(key: str) -> str:
    """Checkpoint key -> key inside the language model (`model.*`, `lm_head.*`)."""
    if key.startswith("model.language_model."):
        return "model." + key[len("model.language_model.") :]
    if key.startswith("language_model."):  # already converted
        return key[len("language_model.") :]
    return key


class Model(nn.Module):
    supports_speculative_rollback = LanguageModel.supports_speculative_rollback
    supports_mtp = LanguageModel.supports_mtp

    def __init__(self, args: ModelArgs):
        super().__init__()
        self.args = args
        self.model_type = args.model_type
        self.language_model = LanguageModel(args.text_args)

    def __call__(self, inputs: mx.array, cache: Optional[List[Any]] = None) -> mx.array:
        """Token ids (B, L) -> logits (B, L, vocab)."""
        return self.language_model(inputs, cache)

    def hidden_and_logits(self, inputs: mx.array, cache: Optional[List[Any]] = None) -> Tuple[mx.array, mx.array]:
        return self.language_model.hidden_and_logits(inputs, cache)

    @property
    def mtp_head(self) -> Optional[qwen3_next.MultiTokenPredictor]:
        return self.language_model.mtp_head

    def mtp_forward(self, tokens: mx.array, hidden: mx.array, cache: List[Any]) -> Tuple[mx.array, mx.array]:
        return self.language_model.mtp_forward(tokens, hidden, cache)

    def make_mtp_cache(self) -> List[KVCache]:
        return self.language_model.make_mtp_cache()

    def sanitize(self, weights: Dict[str, mx.array]) -> Dict[str, mx.array]:
        weights = {k: v for k, v in weights.items() if not k.startswith(VISION_PREFIXES)}
        text = self.language_model.sanitize({text_key(k): v for k, v in weights.items()})
        return {"language_model." + k: v for k, v in text.items()}

    @property
    def model(self) -> qwen3_next.TextModel:
        """The text backbone (upstream's name: `model.model.pipeline(group)`)."""
        return self.language_model.model

    @property
    def layers(self) -> List[qwen3_next.DecoderLayer]:
        return self.language_model.layers

    def make_cache(self) -> List[Union[ArraysCache, KVCache]]:
        return self.language_model.make_cache()

    def shard(self, group: Optional[mx.distributed.Group] = None) -> None:
        """Tensor parallel, as qwen3_next (`LanguageModel.shard`)."""
        self.language_model.shard(group)

    def quant_predicate(self, path: str, module: nn.Module) -> Union[bool, Dict[str, int]]:
        return qwen3_next.quant_predicate(path, module)
