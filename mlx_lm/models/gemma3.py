"""Gemma 3: `gemma3_text` (Gemma3ForCausalLM, e.g. gemma-3-1b) and `gemma3`
(Gemma3ForConditionalGeneration, e.g. gemma-3-4b/12b/27b, whose text model this runs).

What differs from llama:
- Sliding and global attention layers, 5:1 in the released models: `layer_types`, else
  every `sliding_window_pattern`-th layer global (transformers 4 configs). A sliding
  layer's query sees its `sliding_window` most recent positions, itself included; those
  layers cache in a `RotatingKVCache(sliding_window)`.
- Each layer type has its own rope: global layers `rope_theta` (default 1e6) with
  `rope_scaling` (linear x8 in the 4b-27b models), sliding layers `rope_local_base_freq`
  (default 1e4); transformers 5 writes both as `rope_parameters` keyed by layer type.
- Attention scores are scaled by `query_pre_attn_scalar`^-1/2, not head_dim^-1/2;
  queries and keys are RMS-normalised per head before rope.
- Every RMSNorm is zero-centred, x_hat * (1 + w) in float32. Checkpoints from
  transformers and from MLX converters (upstream mlx-lm's and ours) all store w, so the
  1 is added in the forward, exactly once, and `sanitize` never touches a norm.
- Four norms per block: the attention and MLP outputs are normalised before they join
  the residual stream (`post_attention_layernorm`, `post_feedforward_layernorm`).
- Embeddings are scaled by sqrt(hidden_size), the factor rounded to the compute dtype
  first, as transformers does; the MLP is GeGLU with the tanh-approximate gelu.
- `final_logit_softcapping` c: logits = c * tanh(logits / c) (Gemma3ForCausalLM only).
  transformers 5.24 never applies `attn_logit_softcapping` in Gemma 3, nor the final
  softcap in Gemma3ForConditionalGeneration; configs asking for them are refused.

Layouts: gemma3_text weights are `model.*` (+ `lm_head.*` unless tied). gemma3 nests
the config under `text_config` and the weights under `language_model.model.*` (as the
hub checkpoints, transformers 5 and MLX converters save them) or
`model.language_model.*` (transformers 4.5x); ours are `language_model.model.*`, and the
vision tower and projector are dropped.
Reference: transformers `models/gemma3/modeling_gemma3.py` and `configuration_gemma3.py`.
"""

from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Tuple, Union

import mlx.core as mx
import mlx.nn as nn

from . import gpt_oss, llama
from .base import BaseModelArgs, check_head_grouping, check_layer_types, scaled_dot_product_attention
from .cache import KVCache, RotatingKVCache
from .gpt_oss import FULL, SLIDING  # the same two layer kinds, by the same names
from .qwen3_5 import text_key
from .rope_utils import initialize_rope, resolve_rope

# Checkpoint prefixes of the vision tower and projector, which the text model drops.
VISION_PREFIXES = ("vision_tower.", "multi_modal_projector.", "model.vision_tower.", "model.multi_modal_projector.")
# transformers' defaults when a config names no rope theta (Gemma3TextConfig.default_theta).
DEFAULT_THETA = {FULL: 1_000_000.0, SLIDING: 10_000.0}


@dataclass
class TextModelArgs(BaseModelArgs):
    """Gemma3TextConfig's keys, with its defaults."""

    model_type: str = "gemma3_text"
    hidden_size: int = 2304
    intermediate_size: int = 9216
    num_hidden_layers: int = 26
    num_attention_heads: int = 8
    num_key_value_heads: int = 4
    head_dim: int = 256
    vocab_size: int = 262208
    rms_norm_eps: float = 1e-6
    hidden_activation: str = "gelu_pytorch_tanh"
    query_pre_attn_scalar: float = 256
    sliding_window: int = 4096
    sliding_window_pattern: int = 6  # transformers 4; layer_types wins when given
    layer_types: Optional[List[str]] = None
    rope_theta: Optional[float] = None  # transformers 4: global layers
    rope_scaling: Optional[Dict[str, Any]] = None  # transformers 4: global layers
    rope_local_base_freq: Optional[float] = None  # transformers 4: sliding layers
    rope_parameters: Optional[Dict[str, Dict[str, Any]]] = None  # transformers 5: per layer type
    max_position_embeddings: int = 131072
    attention_bias: bool = False
    final_logit_softcapping: Optional[float] = None
    attn_logit_softcapping: Optional[float] = None
    use_bidirectional_attention: bool = False
    tie_word_embeddings: bool = True

    def __post_init__(self):
        if self.layer_types is None:
            if self.sliding_window_pattern < 1:
                raise ValueError(f"sliding_window_pattern must be >= 1, got {self.sliding_window_pattern}")
            self.layer_types = [
                FULL if (i + 1) % self.sliding_window_pattern == 0 else SLIDING for i in range(self.num_hidden_layers)
            ]
        check_layer_types(self.layer_types, self.num_hidden_layers, (SLIDING, FULL))
        check_head_grouping(self.num_attention_heads, self.num_key_value_heads)
        self.rope = {kind: self._resolve_rope(kind) for kind in (SLIDING, FULL)}
        self._refuse_unsupported()

    def _resolve_rope(self, kind: str) -> Tuple[float, Optional[Dict[str, Any]]]:
        """(theta, scaling) of one layer type from either dialect; top-level keys win."""
        params = self.rope_parameters or {}
        unknown = sorted(set(params) - {SLIDING, FULL})
        if unknown:
            raise ValueError(
                f"gemma3 rope_parameters must be keyed by layer type ({SLIDING!r}, {FULL!r}); got keys {unknown}"
            )
        top_theta = self.rope_theta if kind == FULL else self.rope_local_base_freq
        top_scaling = self.rope_scaling if kind == FULL else None
        theta, scaling, partial = resolve_rope(top_theta, top_scaling, params.get(kind))
        if partial not in (None, 1.0):
            raise ValueError(f"gemma3 rotates whole heads; got partial_rotary_factor={partial} for {kind}")
        return (DEFAULT_THETA[kind] if theta is None else theta), scaling

    def _refuse_unsupported(self):
        if self.hidden_activation != "gelu_pytorch_tanh":
            raise ValueError(
                f"hidden_activation {self.hidden_activation!r} is not supported; gemma3 uses 'gelu_pytorch_tanh'"
            )
        if self.use_bidirectional_attention:
            raise ValueError(
                "use_bidirectional_attention=True (an embedding model) is not supported; gemma3 here is causal"
            )
        if self.attn_logit_softcapping is not None:
            raise ValueError(
                f"attn_logit_softcapping={self.attn_logit_softcapping} is not supported: transformers' Gemma 3 "
                "never applies it (no released checkpoint sets it); set it to null"
            )


@dataclass
class ModelArgs(BaseModelArgs):
    """gemma3: the text model's keys under `text_config`; gemma3_text: at the top level."""

    model_type: str
    text_config: Optional[Dict[str, Any]] = None
    tie_word_embeddings: Optional[bool] = None

    @classmethod
    def from_dict(cls, params: Dict[str, Any]) -> "ModelArgs":
        if params.get("model_type") == "gemma3_text":  # the whole config is the text config
            return cls(model_type="gemma3_text", text_config=dict(params))
        return super().from_dict(params)

    def __post_init__(self):
        if not isinstance(self.text_config, dict):
            raise ValueError(
                f"{self.model_type} config needs a text_config dict (got {self.text_config!r}); "
                "the text model's settings live there"
            )
        text = dict(self.text_config, model_type="gemma3_text")
        if self.tie_word_embeddings is not None:  # gemma3 ties by its top-level key
            text["tie_word_embeddings"] = self.tie_word_embeddings
        self.text_args = TextModelArgs.from_dict(text)
        if self.vision_language and self.text_args.final_logit_softcapping is not None:
            raise ValueError(
                f"text_config.final_logit_softcapping={self.text_args.final_logit_softcapping} is not supported: "
                "transformers' Gemma3ForConditionalGeneration never applies it; set it to null"
            )

    @property
    def vision_language(self) -> bool:
        """A Gemma3ForConditionalGeneration checkpoint (weights nested, vision tower)."""
        return self.model_type != "gemma3_text"

    @property
    def vocab_size(self) -> int:
        return self.text_args.vocab_size


def rms_norm(x: mx.array, weight: mx.array, eps: float) -> mx.array:
    """Gemma's zero-centred RMSNorm over the last axis, (..., D) -> (..., D): x_hat * (1 + w)
    computed in float32, then cast back to x's dtype (as transformers does)."""
    normed = mx.fast.rms_norm(x.astype(mx.float32), 1.0 + weight.astype(mx.float32), eps)
    return normed.astype(x.dtype)


def scale_embeddings(h: mx.array, hidden_size: int) -> mx.array:
    """h * sqrt(hidden_size), (..., D) -> (..., D), the factor first rounded to h's dtype
    as transformers does (sqrt(3840) = 61.97 scales by 62 in bfloat16)."""
    return h * mx.array(hidden_size**0.5, dtype=h.dtype)


def softcap(x: mx.array, cap: float) -> mx.array:
    """cap * tanh(x / cap): smoothly bounds values to (-cap, cap)."""
    return mx.tanh(x / cap) * cap


class RMSNorm(nn.Module):
    def __init__(self, dims: int, eps: float):
        super().__init__()
        self.weight = mx.zeros((dims,))  # zero-centred: the identity scale is w = 0
        self.eps = eps

    def __call__(self, x: mx.array) -> mx.array:
        return rms_norm(x, self.weight, self.eps)


class Attention(nn.Module):
    def __init__(self, args: TextModelArgs, layer_type: str):
        super().__init__()
        dim, head_dim, bias = args.hidden_size, args.head_dim, args.attention_bias
        self.n_heads, self.n_kv_heads = args.num_attention_heads, args.num_key_value_heads
        self.scale = args.query_pre_attn_scalar**-0.5
        self.q_proj = nn.Linear(dim, self.n_heads * head_dim, bias=bias)
        self.k_proj = nn.Linear(dim, self.n_kv_heads * head_dim, bias=bias)
        self.v_proj = nn.Linear(dim, self.n_kv_heads * head_dim, bias=bias)
        self.o_proj = nn.Linear(self.n_heads * head_dim, dim, bias=bias)
        self.q_norm = RMSNorm(head_dim, args.rms_norm_eps)
        self.k_norm = RMSNorm(head_dim, args.rms_norm_eps)
        theta, scaling = args.rope[layer_type]
        self.rope = initialize_rope(head_dim, theta, False, scaling, args.max_position_embeddings)

    def __call__(self, x: mx.array, mask: Optional[mx.array] = None, cache=None) -> mx.array:
        B, L, _ = x.shape
        q = self.q_norm(self.q_proj(x).reshape(B, L, self.n_heads, -1)).transpose(0, 2, 1, 3)  # (B, H, L, D)
        k = self.k_norm(self.k_proj(x).reshape(B, L, self.n_kv_heads, -1)).transpose(0, 2, 1, 3)
        v = self.v_proj(x).reshape(B, L, self.n_kv_heads, -1).transpose(0, 2, 1, 3)  # (B, H_kv, L, D)
        offset = cache.offset if cache is not None else 0
        q, k = self.rope(q, offset=offset), self.rope(k, offset=offset)
        if cache is not None:
            k, v = cache.update_and_fetch(k, v)  # (B, H_kv, S, D)
        out = scaled_dot_product_attention(q, k, v, cache=cache, scale=self.scale, mask=mask)
        return self.o_proj(out.transpose(0, 2, 1, 3).reshape(B, L, -1))


class MLP(nn.Module):
    def __init__(self, dim: int, hidden_dim: int):
        super().__init__()
        self.gate_proj = nn.Linear(dim, hidden_dim, bias=False)
        self.up_proj = nn.Linear(dim, hidden_dim, bias=False)
        self.down_proj = nn.Linear(hidden_dim, dim, bias=False)

    def __call__(self, x: mx.array) -> mx.array:
        # gelu_pytorch_tanh: 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3))), mx's gelu_approx.
        return self.down_proj(nn.gelu_approx(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    attention_class = Attention  # gemma2 swaps in its soft-capped attention

    def __init__(self, args: TextModelArgs, layer_type: str):
        super().__init__()
        self.layer_type = layer_type
        self.self_attn = self.attention_class(args, layer_type)
        self.mlp = MLP(args.hidden_size, args.intermediate_size)
        dim, eps = args.hidden_size, args.rms_norm_eps
        self.input_layernorm, self.post_attention_layernorm = RMSNorm(dim, eps), RMSNorm(dim, eps)
        self.pre_feedforward_layernorm, self.post_feedforward_layernorm = RMSNorm(dim, eps), RMSNorm(dim, eps)

    def __call__(self, x: mx.array, mask: Optional[mx.array] = None, cache=None) -> mx.array:
        h = x + self.post_attention_layernorm(self.self_attn(self.input_layernorm(x), mask, cache))
        return h + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(h)))


class TextModel(nn.Module):
    layer_class = DecoderLayer  # gemma2 swaps in its own

    def __init__(self, args: TextModelArgs):
        super().__init__()
        self.hidden_size, self.sliding_window = args.hidden_size, args.sliding_window
        self.embed_tokens = nn.Embedding(args.vocab_size, args.hidden_size)
        self.layers = [self.layer_class(args, layer_type) for layer_type in args.layer_types]
        self.norm = RMSNorm(args.hidden_size, args.rms_norm_eps)

    def __call__(self, inputs: mx.array, cache: Optional[List[Any]] = None) -> mx.array:
        h = scale_embeddings(self.embed_tokens(inputs), self.hidden_size)  # (B, L, hidden)
        if cache is None:
            cache = [None] * len(self.layers)
        masks = self.masks(h, cache)
        for layer, layer_cache in zip(self.layers, cache):
            h = layer(h, masks[layer.layer_type], layer_cache)
        return self.norm(h)

    # One mask per layer type from the first cache of that type, windowed for sliding
    # layers even without a cache: gpt-oss's rule, for the same two layer kinds.
    masks = gpt_oss.Backbone.masks


class LanguageModel(nn.Module):
    """gemma3_text (Gemma3ForCausalLM): `model.*` and, unless tied, `lm_head`."""

    backbone_class = TextModel  # gemma2 swaps in its own

    def __init__(self, args: TextModelArgs):
        super().__init__()
        self.args = args
        self.model_type = args.model_type
        self.model = self.backbone_class(args)
        if not args.tie_word_embeddings:
            self.lm_head = nn.Linear(args.hidden_size, args.vocab_size, bias=False)

    def __call__(self, inputs: mx.array, cache: Optional[List[Any]] = None) -> mx.array:
        """Token ids (B, L) -> logits (B, L, vocab)."""
        h = self.model(inputs, cache)
        logits = self.model.embed_tokens.as_linear(h) if self.args.tie_word_embeddings else self.lm_head(h)
        if self.args.final_logit_softcapping is not None:
            logits = softcap(logits, self.args.final_logit_softcapping)
        return logits

    def sanitize(self, weights: Dict[str, mx.array]) -> Dict[str, mx.array]:
        """Drop rope buffers and, when tied, any `lm_head.*`: upstream mlx-lm writes the
        embedding matrix again as lm_head (quantized alongside when quantizing)."""
        weights = {k: v for k, v in weights.items() if "rotary_emb." not in k}
        if self.args.tie_word_embeddings:
            weights = {k: v for k, v in weights.items() if not k.startswith("lm_head.")}
        return weights

    @property
    def layers(self) -> List[DecoderLayer]:
        return self.model.layers

    # A window-sized ring buffer for sliding layers, a growing cache for global ones (as
    # gpt-oss). Both roll back exactly by themselves: a speculating RotatingKVCache records
    # its pre-forward window, a KVCache trims; the layers record nothing.
    make_cache = gpt_oss.Model.make_cache
    # Tensor parallel as llama: the same attention (q/k/v/o_proj, n_heads) and MLP names;
    # the per-head q/k norms are whole heads, so they stay whole.
    shard = llama.Model.shard


class ConditionalGeneration(nn.Module):
    """gemma3 (Gemma3ForConditionalGeneration): the text model under `language_model.`."""

    def __init__(self, args: ModelArgs):
        super().__init__()
        self.args = args
        self.model_type = args.model_type
        self.language_model = LanguageModel(args.text_args)

    def __call__(self, inputs: mx.array, cache: Optional[List[Any]] = None) -> mx.array:
        """Token ids (B, L) -> logits (B, L, vocab)."""
        return self.language_model(inputs, cache)

    def sanitize(self, weights: Dict[str, mx.array]) -> Dict[str, mx.array]:
        """Drop the vision tower and projector; any text prefix -> `language_model.`."""
        text = {text_key(k): v for k, v in weights.items() if not k.startswith(VISION_PREFIXES)}
        return {"language_model." + k: v for k, v in self.language_model.sanitize(text).items()}

    @property
    def layers(self) -> List[DecoderLayer]:
        return self.language_model.layers

    def make_cache(self) -> List[Union[KVCache, RotatingKVCache]]:
        return self.language_model.make_cache()

    def shard(self, group: Optional[mx.distributed.Group] = None) -> None:
        self.language_model.shard(group)


class Model:
    """What `get_model_classes` builds for both model types (MODEL_REMAPPING sends
    gemma3_text here): `Model(args)` is a LanguageModel for a gemma3_text config and a
    ConditionalGeneration for a gemma3 one, each with the weight names of its layout."""

    def __new__(cls, args: ModelArgs) -> Union[LanguageModel, ConditionalGeneration]:
        if args.vision_language:
            return ConditionalGeneration(args)
        return LanguageModel(args.text_args)
