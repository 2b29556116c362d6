"""Gemma 4, text model: `gemma4_text` (Gemma4ForCausalLM) and `gemma4`
(Gemma4ForConditionalGeneration, whose text model this runs; MODEL_REMAPPING sends it
here, and its vision and audio towers are dropped).

What differs from Gemma 3n (gemma3n.py, whose attention, KV sharing, per-layer inputs
and caches this reuses):
- No AltUp, no Laurel, no activation sparsity: a Gemma 3 block (four norms) whose
  output is scaled by a stored per-layer `layer_scalar`.
- Global layers have their own head size (`global_head_dim`, default 512) and, with
  `attention_k_eq_v`, their own KV head count (`num_global_key_value_heads`) and no
  value projection: values are the key projection, value-normalised. transformers 5
  saves both as `per_layer_config` (layer index -> head_dim, num_key_value_heads).
- Global layers use "proportional" rope: only the first partial_rotary_factor of each
  head's frequency pairs turn, at base^(-2i / head_dim) (the exponent over the whole
  head), the others stay; sliding layers plain rope.
- KV sharing as Gemma 3n (`num_kv_shared_layers`, default 0); with
  `use_double_wide_mlp` the shared layers' MLPs are twice as wide.
- Per-layer inputs only when `hidden_size_per_layer_input` > 0; they are added to the
  residual stream after each block.
- `enable_moe_block`: beside each dense MLP a mixture of experts on the block's input
  (softmax router over a normalised, scaled input; top-k renormalised, times a
  per-expert scale; GeGLU experts), each branch normalised before the sum.
- The last layer must be global (transformers forces it; here a config saying
  otherwise is refused). `use_bidirectional_attention="all"` is refused (an encoder);
  "vision" only affects image tokens, which need the towers.

Layouts: gemma4_text weights are `model.*`; gemma4 nests the config under `text_config`
and the weights under `model.language_model.*` (transformers) or
`language_model.model.*` (ours). transformers stores each layer's experts fused,
`experts.gate_up_proj` (E, 2I, D) and `experts.down_proj` (E, D, I); ours are
`experts.{gate,up,down}_proj.weight`.
Reference: transformers `models/gemma4/modeling_gemma4.py`, `configuration_gemma4.py`.
"""

from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Tuple

import mlx.core as mx
import mlx.nn as nn

from . import gemma3, gemma3n, sharding
from .base import BaseModelArgs, check_head_grouping, check_layer_types
from .gemma3 import scale_embeddings
from .gemma3n import RMSNorm, kv_sources
from .gpt_oss import FULL, SLIDING
from .rope_utils import ProportionalRoPE
from .switch_layers import SwitchGLU

# transformers' rope when a config gives none (Gemma4TextConfig.__post_init__).
DEFAULT_ROPE = {
    SLIDING: {"rope_type": "default", "rope_theta": 10_000.0},
    FULL: {"rope_type": "proportional", "partial_rotary_factor": 0.25, "rope_theta": 1_000_000.0},
}
LAYER_OVERRIDES = ("head_dim", "num_key_value_heads")  # what per_layer_config may set


def layer_rope(head_dim: int, base: float, partial_rotary_factor: float, factor: float) -> ProportionalRoPE:
    """A layer type's rope (TextModelArgs.rope): proportional, plain rope being the one
    with every pair turning. transformers turns int(partial * head_dim // 2) pairs, which
    is int(head_dim * partial) // 2."""
    return ProportionalRoPE(head_dim, int(head_dim * partial_rotary_factor), base=base, factor=factor)


@dataclass
class TextModelArgs(BaseModelArgs):
    """Gemma4TextConfig's keys, with its defaults (`global_head_dim` and
    `num_global_key_value_heads` are the hub configs' keys that transformers 5 turns into
    `per_layer_config`)."""

    model_type: str = "gemma4_text"
    vocab_size: int = 262144
    hidden_size: int = 2304
    intermediate_size: int = 9216
    num_hidden_layers: int = 30
    num_attention_heads: int = 8
    num_key_value_heads: int = 4
    head_dim: int = 256
    global_head_dim: int = 512
    num_global_key_value_heads: Optional[int] = None
    per_layer_config: Optional[Dict[str, Dict[str, Any]]] = None
    hidden_activation: str = "gelu_pytorch_tanh"
    max_position_embeddings: int = 131072
    rms_norm_eps: float = 1e-6
    tie_word_embeddings: bool = True
    rope_parameters: Optional[Dict[str, Dict[str, Any]]] = None
    attention_bias: bool = False
    sliding_window: int = 512
    layer_types: Optional[List[str]] = None
    final_logit_softcapping: Optional[float] = None
    use_bidirectional_attention: Optional[str] = None
    vocab_size_per_layer_input: int = 262144
    hidden_size_per_layer_input: int = 256
    attention_k_eq_v: bool = False
    num_kv_shared_layers: int = 0
    enable_moe_block: bool = False
    use_double_wide_mlp: bool = False
    num_experts: Optional[int] = None
    top_k_experts: Optional[int] = None
    moe_intermediate_size: Optional[int] = None

    def __post_init__(self):
        n = self.num_hidden_layers
        if self.layer_types is None:  # transformers' default: every sixth layer global
            self.layer_types = [FULL if (i + 1) % 6 == 0 else SLIDING for i in range(n)]
        check_layer_types(self.layer_types, n, (SLIDING, FULL))
        if self.layer_types[-1] != FULL:
            raise ValueError(f"layer_types[-1] must be {FULL!r} (transformers forces it), got {self.layer_types[-1]!r}")
        self.head_dims, self.kv_heads = self._layer_shapes()
        for kv in set(self.kv_heads):
            check_head_grouping(self.num_attention_heads, kv)
        self.kv_sources = kv_sources(self.layer_types, self.num_kv_shared_layers)
        self.rope = {kind: self._rope(kind) for kind in (SLIDING, FULL)}
        self._refuse_unsupported()

    def _layer_shapes(self) -> Tuple[List[int], List[int]]:
        """Each layer's (head_dim, num_key_value_heads): per_layer_config when given,
        else the hub keys, as transformers resolves them."""
        if self.per_layer_config is None:
            kv_global = self.num_global_key_value_heads if self.attention_k_eq_v else None
            override = {"head_dim": self.global_head_dim}
            if kv_global is not None:
                override["num_key_value_heads"] = kv_global
            overrides = {i: override for i, kind in enumerate(self.layer_types) if kind == FULL}
        else:
            overrides = {int(i): dict(o) for i, o in self.per_layer_config.items()}
            unknown = sorted({k for o in overrides.values() for k in o} - set(LAYER_OVERRIDES))
            if unknown or not all(0 <= i < self.num_hidden_layers for i in overrides):
                raise ValueError(f"per_layer_config may set {list(LAYER_OVERRIDES)} of layers 0.."
                                 f"{self.num_hidden_layers - 1}; got {self.per_layer_config!r}")
        base = dict(head_dim=self.head_dim, num_key_value_heads=self.num_key_value_heads)
        shapes = [{**base, **overrides.get(i, {})} for i in range(self.num_hidden_layers)]
        return [s["head_dim"] for s in shapes], [s["num_key_value_heads"] for s in shapes]

    def _rope(self, kind: str) -> Dict[str, Any]:
        """The rope of one layer type, on the head size of that type's first layer."""
        params = dict((self.rope_parameters or DEFAULT_ROPE).get(kind) or {})
        rope_type = params.get("rope_type", "default")
        if rope_type not in ("default", "proportional") or "rope_theta" not in params:
            raise ValueError(f"gemma4 rope_parameters[{kind!r}] must be a 'default' or 'proportional' rope with a "
                             f"rope_theta; got {params!r}")
        head_dim = self.head_dims[self.layer_types.index(kind)] if kind in self.layer_types else self.head_dim
        partial = params.get("partial_rotary_factor", 1.0) if rope_type == "proportional" else 1.0
        return dict(head_dim=head_dim, base=params["rope_theta"], partial_rotary_factor=partial,
                    factor=params.get("factor", 1.0) if rope_type == "proportional" else 1.0)

    def _refuse_unsupported(self):
        if self.hidden_activation != "gelu_pytorch_tanh":
            raise ValueError(
                f"hidden_activation {self.hidden_activation!r} is not supported; gemma4 uses 'gelu_pytorch_tanh'"
            )
        if self.use_bidirectional_attention not in (None, "vision"):
            raise ValueError(f"use_bidirectional_attention={self.use_bidirectional_attention!r} (an encoder) is not "
                             "supported; gemma4 here is causal")
        if self.enable_moe_block and None in (self.num_experts, self.top_k_experts, self.moe_intermediate_size):
            raise ValueError(
                "enable_moe_block=True needs num_experts, top_k_experts and moe_intermediate_size; got "
                f"{self.num_experts}, {self.top_k_experts}, {self.moe_intermediate_size}"
            )


@dataclass
class ModelArgs(gemma3n.ModelArgs):
    """gemma4: the text model's keys under `text_config`; gemma4_text: at the top level."""

    text_model_type = "gemma4_text"
    text_args_class = TextModelArgs


def geglu(up: mx.array, gate: mx.array) -> mx.array:
    """gelu_pytorch_tanh(gate) * up, the experts' activation (SwitchGLU's argument order)."""
    return nn.gelu_approx(gate) * up


class Router(nn.Module):
    """Top-k experts and their weights: softmax over experts (float32) of the
    unscaled-normalised input times `scale` / sqrt(D); the top-k renormalised, times
    `per_expert_scale` of each chosen expert."""

    def __init__(self, args: TextModelArgs):
        super().__init__()
        self.norm = RMSNorm(args.hidden_size, args.rms_norm_eps, with_scale=False)
        self.proj = nn.Linear(args.hidden_size, args.num_experts, bias=False)
        self.scale = mx.ones((args.hidden_size,))
        self.per_expert_scale = mx.ones((args.num_experts,))
        self.top_k, self.root_size = args.top_k_experts, args.hidden_size**-0.5

    def __call__(self, x: mx.array) -> Tuple[mx.array, mx.array]:
        """(..., D) -> expert ids (..., k) and weights (..., k)."""
        scores = self.proj(self.norm(x) * self.scale * self.root_size)
        probs = mx.softmax(scores.astype(mx.float32), axis=-1)
        ids = mx.argpartition(-probs, self.top_k - 1, axis=-1)[..., : self.top_k]
        weights = mx.take_along_axis(probs, ids, axis=-1)
        weights = weights / mx.sum(weights, axis=-1, keepdims=True)
        return ids, (weights * self.per_expert_scale[ids]).astype(x.dtype)


class DecoderLayer(nn.Module):
    def __init__(self, args: TextModelArgs, index: int):
        super().__init__()
        self.layer_type, self.kv_source = args.layer_types[index], args.kv_sources[index]
        head_dim, kv_heads, rope = args.head_dims[index], args.kv_heads[index], args.rope[self.layer_type]
        self.self_attn = gemma3n.Attention(
            args, self.layer_type, self.kv_source is not None, head_dim, kv_heads, layer_rope(**rope),
            values_from_keys=args.attention_k_eq_v and self.layer_type == FULL)
        wide = args.use_double_wide_mlp and self.kv_source is not None
        self.mlp = gemma3.MLP(args.hidden_size, args.intermediate_size * (2 if wide else 1))  # GeGLU
        dim, eps = args.hidden_size, args.rms_norm_eps
        self.input_layernorm, self.post_attention_layernorm = RMSNorm(dim, eps), RMSNorm(dim, eps)
        self.pre_feedforward_layernorm, self.post_feedforward_layernorm = RMSNorm(dim, eps), RMSNorm(dim, eps)
        self.layer_scalar = mx.ones((1,))
        self.has_experts, self.has_per_layer_input = args.enable_moe_block, args.hidden_size_per_layer_input > 0
        if self.has_experts:
            self.router = Router(args)
            self.experts = SwitchGLU(dim, args.moe_intermediate_size, args.num_experts, activation=geglu)
            self.post_feedforward_layernorm_1, self.post_feedforward_layernorm_2 = RMSNorm(dim, eps), RMSNorm(dim, eps)
            self.pre_feedforward_layernorm_2 = RMSNorm(dim, eps)
        if self.has_per_layer_input:
            self.per_layer_input_gate = nn.Linear(dim, args.hidden_size_per_layer_input, bias=False)
            self.per_layer_projection = nn.Linear(args.hidden_size_per_layer_input, dim, bias=False)
            self.post_per_layer_input_norm = RMSNorm(dim, eps)

    def __call__(self, h: mx.array, per_layer_input: Optional[mx.array], mask, cache=None, shared=None):
        """(B, L, D) and this layer's (B, L, P) input (or None) -> ((B, L, D), its kv)."""
        attn, kv = self.self_attn(self.input_layernorm(h), mask, cache, shared)
        h = h + self.post_attention_layernorm(attn)
        h = h + self.post_feedforward_layernorm(self.feed_forward(h))
        if self.has_per_layer_input:
            h = h + self.add_per_layer_input(h, per_layer_input)
        return h * self.layer_scalar, kv

    def feed_forward(self, h: mx.array) -> mx.array:
        """The dense MLP, plus (normalised apart) the experts on the same input."""
        dense = self.mlp(self.pre_feedforward_layernorm(h))
        if not self.has_experts:
            return dense
        ids, weights = self.router(h)
        experts = self.experts(self.pre_feedforward_layernorm_2(h), ids)  # (B, L, k, D)
        mixed = mx.sum(experts * weights[..., None], axis=-2)
        return self.post_feedforward_layernorm_1(dense) + self.post_feedforward_layernorm_2(mixed)

    def add_per_layer_input(self, h: mx.array, per_layer_input: mx.array) -> mx.array:
        gated = nn.gelu_approx(self.per_layer_input_gate(h)) * per_layer_input  # (B, L, P)
        return self.post_per_layer_input_norm(self.per_layer_projection(gated))


class TextModel(nn.Module):
    def __init__(self, args: TextModelArgs):
        super().__init__()
        self.hidden_size, self.sliding_window = args.hidden_size, args.sliding_window
        self.embed_tokens = nn.Embedding(args.vocab_size, args.hidden_size)
        self.layers = [DecoderLayer(args, i) for i in range(args.num_hidden_layers)]
        self.norm = RMSNorm(args.hidden_size, args.rms_norm_eps)
        self.per_layer_shape = (args.num_hidden_layers, args.hidden_size_per_layer_input)
        if args.hidden_size_per_layer_input:
            size = args.num_hidden_layers * args.hidden_size_per_layer_input
            self.embed_tokens_per_layer = nn.Embedding(args.vocab_size_per_layer_input, size)
            self.per_layer_model_projection = nn.Linear(args.hidden_size, size, bias=False)
            self.per_layer_projection_norm = RMSNorm(args.hidden_size_per_layer_input, args.rms_norm_eps)

    def __call__(self, inputs: mx.array, cache: Optional[List[Any]] = None) -> mx.array:
        h = scale_embeddings(self.embed_tokens(inputs), self.hidden_size)  # (B, L, D)
        per_layer_inputs = self.per_layer_inputs(inputs, h) if self.per_layer_shape[1] else None
        cache = [None] * len(self.layers) if cache is None else cache
        masks = gemma3n.layer_masks(h, self.layers, cache, self.sliding_window)
        return self.norm(gemma3n.run_layers(self.layers, h, per_layer_inputs, masks, cache))

    # Gemma 3n's per-layer inputs (the same weights and steps). transformers' Gemma 4
    # fails on ids past the per-layer table; they read row 0 here, as in Gemma 3n.
    per_layer_inputs = gemma3n.TextModel.per_layer_inputs
    sanitize = gemma3n.TextModel.sanitize


def unfuse_experts(weights: Dict[str, mx.array]) -> Dict[str, mx.array]:
    """transformers' fused experts -> SwitchGLU weights: `experts.gate_up_proj` (E, 2I, D)
    -> gate_proj / up_proj (E, I, D), `experts.down_proj` (E, D, I) -> down_proj.weight.
    Guarded by the fused keys, which the output no longer has."""
    weights = dict(weights)
    for key in [k for k in weights if k.endswith(".experts.gate_up_proj")]:
        gate, up = mx.split(weights.pop(key), 2, axis=1)
        weights[key[: -len("gate_up_proj")] + "gate_proj.weight"] = gate
        weights[key[: -len("gate_up_proj")] + "up_proj.weight"] = up
    for key in [k for k in weights if k.endswith(".experts.down_proj")]:
        weights[key + ".weight"] = weights.pop(key)
    return weights


class LanguageModel(gemma3n.LanguageModel):
    """gemma4_text (Gemma4ForCausalLM): `model.*` and, unless tied, `lm_head`."""

    backbone_class = TextModel

    def sanitize(self, weights: Dict[str, mx.array]) -> Dict[str, mx.array]:
        """Gemma 3n's (rope buffers, KV-shared layers' k/v, tied lm_head), and the
        experts unfused."""
        return super().sanitize(unfuse_experts(weights))

    def shard(self, group: Optional[mx.distributed.Group] = None) -> None:
        """Gemma 3n's heads and MLP units per rank; every expert's hidden units split
        too, the experts' outputs all-summed before their norm (router whole)."""
        group = sharding.world(group)
        gemma3n.shard_layers(self.layers, group)
        for layer in self.layers:
            if layer.has_experts:
                sharding.shard_switch_glu(layer.experts, group)
                sharding.sum_outputs(layer.experts, group)


class ConditionalGeneration(gemma3n.ConditionalGeneration):
    """gemma4 (Gemma4ForConditionalGeneration): the text model under `language_model.`."""

    language_model_class = LanguageModel


class Model:
    """What `get_model_classes` builds for both model types (MODEL_REMAPPING sends
    gemma4 here): a LanguageModel for a gemma4_text config, a ConditionalGeneration for
    a gemma4 one."""

    supports_speculative_rollback = True

    def __new__(cls, args: ModelArgs):
        if args.vision_language:
            return ConditionalGeneration(args)
        return LanguageModel(args.text_args)
