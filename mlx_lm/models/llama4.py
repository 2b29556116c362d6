"""Llama 4 text: `llama4_text` (Llama4ForCausalLM) and the text model of `llama4`
(Llama4ForConditionalGeneration, Llama-4-Scout-17B-16E / Maverick-17B-128E).

What differs from llama:
- Two attention kinds per `layer_types`: "chunked_attention" layers cut the positions
  into chunks of `attention_chunk_size` from 0 and a query sees only the keys of its
  own chunk up to itself; "full_attention" layers are causal over everything. Chunked
  layers cache in a `ChunkedKVCache` (a ring of one chunk's rows, masked by chunk), so
  their memory never grows past a chunk; speculation rolls them back exactly, across
  chunk boundaries too, through the ring's rollback records.
- `no_rope_layers[i]` = 1: layer i uses rope (interleaved pairs, as transformers'
  complex rotation; llama3 scaling in Scout), else it is a NoPE layer. Without the
  list (or with the hub's empty one) every `no_rope_layer_interval`-th layer is NoPE;
  without `layer_types`, rope layers are the chunked ones when a chunk size is set.
- Rope layers L2-normalise q and k per head after rope (`use_qk_norm`; really an RMS
  norm without weight, eps `rms_norm_eps`).
- NoPE layers with `attn_temperature_tuning` (Scout's config writes it as the int 4)
  scale each query by 1 + attn_scale * log(1 + floor((p + 1) / floor_scale)) at
  position p (arXiv 2501.19399), so long contexts keep sharp attention.
- MoE layers (`moe_layers`, else every `interleave_moe_layer_step`-th layer; dense
  SwiGLU of `intermediate_size_mlp` otherwise): a `router` picks the top k experts by
  logit and their scores are sigmoid(logit); each chosen expert gets its input
  multiplied by its score (before the expert, as transformers does, not after), and a
  `shared_expert` SwiGLU of `intermediate_size` is added.

Layouts: llama4_text weights are `model.*` (+ `lm_head.*` unless tied); llama4 nests the
config under `text_config` and the weights under `language_model.*` beside the vision
tower and projector, which are dropped. transformers stores the experts fused as
`experts.gate_up_proj` (E, hidden, 2I, gate first) and `experts.down_proj` (E, I,
hidden), both (in, out); `sanitize` splits and transposes them into
`experts.{gate,up,down}_proj.weight` (E, out, in), the MLX converters' layout.
Reference: transformers `models/llama4/modeling_llama4.py` and `configuration_llama4.py`.
"""

from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Tuple, Union

import mlx.core as mx
import mlx.nn as nn

from . import sharding
from .base import (
    BaseModelArgs,
    check_head_grouping,
    check_layer_types,
    create_attention_mask,
    scaled_dot_product_attention,
)
from .cache import ChunkedKVCache, KVCache
from .llama import MLP
from .masks import create_chunked_mask
from .qwen3_5 import text_key
from .rope_utils import initialize_rope, resolve_rope
from .switch_layers import SwitchGLU

CHUNKED, FULL = "chunked_attention", "full_attention"
VISION_PREFIXES = ("vision_model.", "multi_modal_projector.", "model.vision_model.", "model.multi_modal_projector.")
DEFAULT_THETA = 500000.0  # Llama4TextConfig.default_theta


@dataclass
class TextModelArgs(BaseModelArgs):
    """Llama4TextConfig's keys, with its defaults."""

    model_type: str = "llama4_text"
    vocab_size: int = 202048
    hidden_size: int = 5120
    intermediate_size: int = 8192
    intermediate_size_mlp: int = 16384
    num_hidden_layers: int = 48
    num_attention_heads: int = 40
    num_key_value_heads: Optional[int] = 8
    head_dim: Optional[int] = 128
    hidden_act: str = "silu"
    max_position_embeddings: int = 131072
    rms_norm_eps: float = 1e-5
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    num_experts_per_tok: int = 1
    num_local_experts: int = 16
    moe_layers: Optional[List[int]] = None
    interleave_moe_layer_step: int = 1
    use_qk_norm: bool = True
    rope_theta: Optional[float] = None  # transformers 4
    rope_scaling: Optional[Dict[str, Any]] = None  # transformers 4
    rope_parameters: Optional[Dict[str, Any]] = None  # transformers 5
    no_rope_layers: Optional[List[int]] = None
    no_rope_layer_interval: int = 4
    attention_chunk_size: Optional[int] = 8192
    layer_types: Optional[List[str]] = None
    attn_temperature_tuning: Union[bool, int] = True
    floor_scale: int = 8192
    attn_scale: float = 0.1

    def __post_init__(self):
        if self.num_key_value_heads is None:
            self.num_key_value_heads = self.num_attention_heads
        if self.head_dim is None:
            self.head_dim = self.hidden_size // self.num_attention_heads
        check_head_grouping(self.num_attention_heads, self.num_key_value_heads)
        if self.hidden_act != "silu":
            raise ValueError(f"hidden_act {self.hidden_act!r} is not supported; llama4 uses 'silu'")
        theta, self.rope_scaling, partial = resolve_rope(self.rope_theta, self.rope_scaling, self.rope_parameters)
        if partial not in (None, 1.0):
            raise ValueError(f"llama4 rotates whole heads; got partial_rotary_factor={partial}")
        self.rope_theta = DEFAULT_THETA if theta is None else theta
        self._set_rope_layers()
        self._set_layer_types()
        self._set_moe_layers()

    def _set_rope_layers(self):
        # transformers treats an empty list (what the hub configs write) like a missing one.
        if not self.no_rope_layers:
            if self.no_rope_layer_interval < 1:
                raise ValueError(f"no_rope_layer_interval must be >= 1, got {self.no_rope_layer_interval}")
            interval = self.no_rope_layer_interval
            self.no_rope_layers = [int((i + 1) % interval != 0) for i in range(self.num_hidden_layers)]
        if len(self.no_rope_layers) < self.num_hidden_layers or set(self.no_rope_layers) - {0, 1}:
            raise ValueError(
                f"no_rope_layers must give 1 (rope) or 0 (NoPE) for each of the {self.num_hidden_layers} layers, "
                f"got {self.no_rope_layers}"
            )

    def _set_layer_types(self):
        chunk = self.attention_chunk_size
        if self.layer_types is None:
            self.layer_types = [
                CHUNKED if rope and chunk is not None else FULL for rope in self.no_rope_layers[: self.num_hidden_layers]
            ]
        check_layer_types(self.layer_types, self.num_hidden_layers, (CHUNKED, FULL))
        if CHUNKED in self.layer_types and not (isinstance(chunk, int) and chunk > 0):
            raise ValueError(
                f"layer_types has chunked_attention layers but attention_chunk_size is {chunk!r}; "
                "give a positive chunk size"
            )

    def _set_moe_layers(self):
        if self.moe_layers is None:
            step = self.interleave_moe_layer_step
            if step < 1:
                raise ValueError(f"interleave_moe_layer_step must be >= 1, got {step}")
            self.moe_layers = list(range(step - 1, self.num_hidden_layers, step))
        outside = [i for i in self.moe_layers if not 0 <= i < self.num_hidden_layers]
        if outside:
            raise ValueError(f"moe_layers {outside} are not layers of a {self.num_hidden_layers}-layer model")
        if self.moe_layers and not 0 < self.num_experts_per_tok <= self.num_local_experts:
            raise ValueError(
                f"num_experts_per_tok ({self.num_experts_per_tok}) must be in 1..num_local_experts "
                f"({self.num_local_experts})"
            )


@dataclass
class ModelArgs(BaseModelArgs):
    """llama4: the text model's keys under `text_config`; llama4_text: at the top level."""

    model_type: str
    text_config: Optional[Dict[str, Any]] = None
    tie_word_embeddings: Optional[bool] = None

    @classmethod
    def from_dict(cls, params: Dict[str, Any]) -> "ModelArgs":
        if params.get("model_type") == "llama4_text":  # the whole config is the text config
            return cls(model_type="llama4_text", text_config=dict(params))
        return super().from_dict(params)

    def __post_init__(self):
        if not isinstance(self.text_config, dict):
            raise ValueError(
                f"{self.model_type} config needs a text_config dict (got {self.text_config!r}); "
                "the text model's settings live there"
            )
        self.text_args = TextModelArgs.from_dict(dict(self.text_config, model_type="llama4_text"))
        tied = self.text_args.tie_word_embeddings
        if self.vision_language and self.tie_word_embeddings not in (None, tied):
            raise ValueError(
                f"tie_word_embeddings is {self.tie_word_embeddings} but text_config.tie_word_embeddings is {tied}; "
                "they must agree"
            )

    @property
    def vision_language(self) -> bool:
        """A Llama4ForConditionalGeneration checkpoint (weights nested, vision tower)."""
        return self.model_type != "llama4_text"

    @property
    def vocab_size(self) -> int:
        return self.text_args.vocab_size


# --- pure helpers ---------------------------------------------------------------------


def query_positions(offset: Union[int, mx.array], num_queries: int) -> mx.array:
    """Positions (B or 1, L) of num_queries new tokens after `offset` (an int, or (B,)
    per row in a batch)."""
    return mx.array(offset).reshape(-1, 1) + mx.arange(num_queries)


def attention_temperature(positions: mx.array, floor_scale: int, attn_scale: float) -> mx.array:
    """Llama 4's query scale for NoPE layers at integer `positions` (any shape), float32:
    1 + attn_scale * log(1 + floor((p + 1) / floor_scale))."""
    steps = mx.floor((positions.astype(mx.float32) + 1.0) / floor_scale)
    return mx.log1p(steps) * attn_scale + 1.0


def sigmoid_top_k(logits: mx.array, k: int) -> Tuple[mx.array, mx.array]:
    """Router logits (..., E) -> the k experts with the largest logits (..., k) and their
    scores sigmoid(logit) (..., k), computed in float32, returned in the logits' dtype."""
    experts = mx.stop_gradient(mx.argpartition(-logits, kth=k - 1, axis=-1)[..., :k])
    chosen = mx.take_along_axis(logits, experts, axis=-1)
    return experts, mx.sigmoid(chosen.astype(mx.float32)).astype(logits.dtype)


# --- layers ---------------------------------------------------------------------------


class Attention(nn.Module):
    def __init__(self, args: TextModelArgs, layer_idx: int):
        super().__init__()
        dim, head_dim, bias = args.hidden_size, args.head_dim, args.attention_bias
        self.n_heads, self.n_kv_heads = args.num_attention_heads, args.num_key_value_heads
        self.scale = head_dim**-0.5
        self.q_proj = nn.Linear(dim, self.n_heads * head_dim, bias=bias)
        self.k_proj = nn.Linear(dim, self.n_kv_heads * head_dim, bias=bias)
        self.v_proj = nn.Linear(dim, self.n_kv_heads * head_dim, bias=bias)
        self.o_proj = nn.Linear(self.n_heads * head_dim, dim, bias=bias)
        self.use_rope = bool(args.no_rope_layers[layer_idx])
        self.use_qk_norm = args.use_qk_norm and self.use_rope
        self.temperature_tuning = bool(args.attn_temperature_tuning) and not self.use_rope
        self.eps, self.floor_scale, self.attn_scale = args.rms_norm_eps, args.floor_scale, args.attn_scale
        if self.use_rope:  # transformers rotates adjacent pairs (complex numbers): "traditional"
            self.rope = initialize_rope(head_dim, args.rope_theta, True, args.rope_scaling,
                                        args.max_position_embeddings)

    def __call__(self, x: mx.array, mask=None, cache=None) -> mx.array:
        B, L, _ = x.shape
        q = self.q_proj(x).reshape(B, L, self.n_heads, -1).transpose(0, 2, 1, 3)  # (B, H, L, D)
        k = self.k_proj(x).reshape(B, L, self.n_kv_heads, -1).transpose(0, 2, 1, 3)  # (B, H_kv, L, D)
        v = self.v_proj(x).reshape(B, L, self.n_kv_heads, -1).transpose(0, 2, 1, 3)
        offset = cache.offset if cache is not None else 0
        if self.use_rope:
            q, k = self.rope(q, offset=offset), self.rope(k, offset=offset)
        if self.use_qk_norm:  # after rope, as transformers does
            q, k = mx.fast.rms_norm(q, None, self.eps), mx.fast.rms_norm(k, None, self.eps)
        if self.temperature_tuning:
            scales = attention_temperature(query_positions(offset, L), self.floor_scale, self.attn_scale)
            q = (q * scales[:, None, :, None]).astype(q.dtype)  # (B or 1, 1, L, 1)
        if cache is not None:
            k, v = cache.update_and_fetch(k, v)  # (B, H_kv, S, D)
        out = scaled_dot_product_attention(q, k, v, cache=cache, scale=self.scale, mask=mask)
        return self.o_proj(out.transpose(0, 2, 1, 3).reshape(B, L, -1))


class MoE(nn.Module):
    def __init__(self, args: TextModelArgs):
        super().__init__()
        self.top_k = args.num_experts_per_tok
        self.router = nn.Linear(args.hidden_size, args.num_local_experts, bias=False)
        self.experts = SwitchGLU(args.hidden_size, args.intermediate_size, args.num_local_experts)
        self.shared_expert = MLP(args.hidden_size, args.intermediate_size)

    def __call__(self, x: mx.array) -> mx.array:
        experts, scores = sigmoid_top_k(self.router(x), self.top_k)  # (B, L, k)
        routed_in = x[..., None, :] * scores[..., None]  # (B, L, k, hidden): each expert's own scaled input
        routed = self.experts(routed_in, experts[..., None]).squeeze(-2)  # (B, L, k, hidden)
        return self.shared_expert(x) + routed.sum(axis=-2)


class DecoderLayer(nn.Module):
    def __init__(self, args: TextModelArgs, layer_idx: int):
        super().__init__()
        self.layer_type = args.layer_types[layer_idx]
        self.self_attn = Attention(args, layer_idx)
        if layer_idx in args.moe_layers:
            self.feed_forward = MoE(args)
        else:
            self.feed_forward = MLP(args.hidden_size, args.intermediate_size_mlp)
        self.input_layernorm = nn.RMSNorm(args.hidden_size, eps=args.rms_norm_eps)
        self.post_attention_layernorm = nn.RMSNorm(args.hidden_size, eps=args.rms_norm_eps)

    def __call__(self, x: mx.array, mask=None, cache=None) -> mx.array:
        h = x + self.self_attn(self.input_layernorm(x), mask, cache)
        return h + self.feed_forward(self.post_attention_layernorm(h))


class TextModel(nn.Module):
    def __init__(self, args: TextModelArgs):
        super().__init__()
        self.chunk_size = args.attention_chunk_size
        self.embed_tokens = nn.Embedding(args.vocab_size, args.hidden_size)
        self.layers = [DecoderLayer(args, i) for i in range(args.num_hidden_layers)]
        self.norm = nn.RMSNorm(args.hidden_size, eps=args.rms_norm_eps)

    def __call__(self, inputs: mx.array, cache: Optional[List[Any]] = None) -> mx.array:
        h = self.embed_tokens(inputs)  # (B, L, hidden)
        if cache is None:
            cache = [None] * len(self.layers)
        masks = self.masks(h, cache)
        for layer, layer_cache in zip(self.layers, cache):
            h = layer(h, masks[layer.layer_type], layer_cache)
        return self.norm(h)

    def masks(self, h: mx.array, cache: List[Any]) -> Dict[str, Any]:
        """One mask per attention kind, from the first cache of that kind (a chunked
        layer's cache masks by chunk); chunked masks are built even without a cache."""
        masks = {}
        for layer, layer_cache in zip(self.layers, cache):
            kind, L = layer.layer_type, h.shape[1]
            if kind in masks:
                continue
            if kind == CHUNKED and layer_cache is None and L > self.chunk_size:
                masks[kind] = create_chunked_mask(L, 0, self.chunk_size)
            else:  # within one chunk, chunked attention is causal
                masks[kind] = create_attention_mask(h, layer_cache)
        return masks


class LanguageModel(nn.Module):
    """llama4_text (Llama4ForCausalLM): `model.*` and, unless tied, `lm_head`."""

    # The chunked layers' ring buffers record their own writes while speculating and the
    # full layers' KVCaches trim: rollback is exact with no layer records.
    supports_speculative_rollback = True

    def __init__(self, args: TextModelArgs):
        super().__init__()
        self.args = args
        self.model_type = args.model_type
        self.model = TextModel(args)
        if not args.tie_word_embeddings:
            self.lm_head = nn.Linear(args.hidden_size, args.vocab_size, bias=False)

    def __call__(self, inputs: mx.array, cache: Optional[List[Any]] = None) -> mx.array:
        """Token ids (B, L) -> logits (B, L, vocab)."""
        h = self.model(inputs, cache)
        return self.model.embed_tokens.as_linear(h) if self.args.tie_word_embeddings else self.lm_head(h)

    def sanitize(self, weights: Dict[str, mx.array]) -> Dict[str, mx.array]:
        """Drop rope buffers and, when tied, `lm_head.weight`; fused experts -> split
        (E, out, in). Each rewrite consumes the keys it reads, so a second call (or
        converted weights) changes nothing."""
        weights = {k: v for k, v in weights.items() if "rotary_emb." not in k}
        if self.args.tie_word_embeddings:
            weights.pop("lm_head.weight", None)
        return split_fused_experts(weights)

    @property
    def layers(self) -> List[DecoderLayer]:
        return self.model.layers

    def make_cache(self) -> List[Union[ChunkedKVCache, KVCache]]:
        """A one-chunk ring for chunked layers, a growing cache for full ones."""
        chunk = self.args.attention_chunk_size
        return [ChunkedKVCache(chunk) if layer.layer_type == CHUNKED else KVCache() for layer in self.layers]

    def shard(self, group: Optional[mx.distributed.Group] = None) -> None:
        """Tensor parallel over `group` (default: the global group), in place: heads
        split across ranks, dense MLPs, every expert and the shared expert by hidden
        units (the MoE block all-sums once, shared expert included); the router,
        embeddings and lm_head stay whole, so routing is identical on every rank."""
        group = sharding.world(group)
        for layer in self.layers:
            attn = layer.self_attn
            attn.n_heads, attn.n_kv_heads = sharding.shard_attention(attn, attn.n_heads, attn.n_kv_heads, group)
            if isinstance(layer.feed_forward, MoE):
                sharding.shard_mlp(layer.feed_forward.shared_expert, group, reduce=False)
                sharding.shard_moe(layer.feed_forward, layer.feed_forward.experts, group)
            else:
                sharding.shard_mlp(layer.feed_forward, group)

    def quant_predicate(self, path: str, module: nn.Module) -> Union[bool, Dict[str, int]]:
        # Top-k routing flips on small logit errors: keep the router at 8 bits.
        if path.endswith("feed_forward.router"):
            return {"group_size": 64, "bits": 8}
        return True


def split_fused_experts(weights: Dict[str, mx.array]) -> Dict[str, mx.array]:
    """transformers' fused experts -> SwitchGLU's: `experts.gate_up_proj` (E, hidden, 2I),
    gate in the first half of the last axis, and `experts.down_proj` (E, I, hidden), both
    (in, out), -> `experts.{gate,up,down}_proj.weight` (E, out, in)."""
    out = {}
    for key, value in weights.items():
        if key.endswith(".feed_forward.experts.gate_up_proj"):
            gate, up = mx.split(value, 2, axis=-1)  # (E, hidden, I) each
            out[key[: -len("gate_up_proj")] + "gate_proj.weight"] = gate.swapaxes(1, 2)
            out[key[: -len("gate_up_proj")] + "up_proj.weight"] = up.swapaxes(1, 2)
        elif key.endswith(".feed_forward.experts.down_proj"):
            out[key + ".weight"] = value.swapaxes(1, 2)  # (E, hidden, I)
        else:
            out[key] = value
    return out


class ConditionalGeneration(nn.Module):
    """llama4 (Llama4ForConditionalGeneration): the text model under `language_model.`."""

    supports_speculative_rollback = LanguageModel.supports_speculative_rollback

    def __init__(self, args: ModelArgs):
        super().__init__()
        self.args = args
        self.model_type = args.model_type
        self.language_model = LanguageModel(args.text_args)

    def __call__(self, inputs: mx.array, cache: Optional[List[Any]] = None) -> mx.array:
        """Token ids (B, L) -> logits (B, L, vocab)."""
        return self.language_model(inputs, cache)

    def sanitize(self, weights: Dict[str, mx.array]) -> Dict[str, mx.array]:
        """Drop the vision tower and projector; the text weights -> `language_model.`."""
        text = {text_key(k): v for k, v in weights.items() if not k.startswith(VISION_PREFIXES)}
        return {"language_model." + k: v for k, v in self.language_model.sanitize(text).items()}

    @property
    def layers(self) -> List[DecoderLayer]:
        return self.language_model.layers

    def make_cache(self) -> List[Union[ChunkedKVCache, KVCache]]:
        return self.language_model.make_cache()

    def shard(self, group: Optional[mx.distributed.Group] = None) -> None:
        self.language_model.shard(group)

    def quant_predicate(self, path: str, module: nn.Module) -> Union[bool, Dict[str, int]]:
        return self.language_model.quant_predicate(path, module)


class Model:
    """What `get_model_classes` builds for both model types (MODEL_REMAPPING sends
    llama4_text here): a LanguageModel for a llama4_text config, a ConditionalGeneration
    for a llama4 one, each with the weight names of its layout."""

    def __new__(cls, args: ModelArgs) -> Union[LanguageModel, ConditionalGeneration]:
        if args.vision_language:
            return ConditionalGeneration(args)
        return LanguageModel(args.text_args)
