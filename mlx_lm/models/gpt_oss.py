"""gpt-oss (OpenAI's open-weight mixture-of-experts models, 20b and 120b).

What differs from llama:
- Attention layers are either sliding-window (a query sees its `sliding_window` most
  recent positions, itself included) or full causal, per `layer_types` (alternating,
  sliding first, by default). Sliding layers cache in a `RotatingKVCache`.
- Every head has a learned sink logit (`sinks`, one per head) that joins the softmax over
  the keys without contributing a value, so a head can put its weight "nowhere".
- q/k/v/o projections carry biases; rope covers the whole head, with YaRN scaling.
- Every MLP is a mixture of experts: the `router` (a biased linear) picks the top k
  experts by logit, and their weights are a softmax over those k logits only. Experts are
  a clamped SwiGLU: gate <= limit, -limit <= up <= limit,
  out = gate * sigmoid(alpha * gate) * (up + 1), alpha 1.702, limit 7.

Checkpoints come in three layouts, all read by `Model.sanitize`:
- transformers' float layout: per layer `mlp.experts.gate_up_proj` (E, hidden, 2I), with
  gate and up interleaved along the last axis (gate, up, gate, ...), and
  `mlp.experts.down_proj` (E, I, hidden), both (in, out); `*_bias` alongside.
- the original MXFP4 layout (`quantization_config.quant_method == "mxfp4"`): the same
  tensors as `*_blocks` (E, out, in / 32, 16) uint8 holding two e2m1 values per byte
  (low nibble first) and `*_scales` (E, out, in / 32) uint8 e8m0 exponents (bias 127),
  i.e. the OCP Microscaling (MX) v1.0 MXFP4 format, which is bit for bit MLX's "mxfp4"
  quantization; the experts are then built as mxfp4-quantized layers and multiplied
  without dequantizing.
- MLX converters' layout: already split into `experts.{gate,up,down}_proj` (E, out, in),
  possibly quantized by the loader per `config["quantization"]`.

References: transformers `models/gpt_oss/modeling_gpt_oss.py` and
`integrations/mxfp4.py`; "gpt-oss-120b & gpt-oss-20b Model Card" (OpenAI, 2025);
OCP Microscaling Formats (MX) Specification v1.0.
"""

from dataclasses import dataclass
from functools import partial
from typing import Any, Dict, List, Optional, Tuple, Union

import mlx.core as mx
import mlx.nn as nn

from .base import (
    BaseModelArgs,
    check_head_grouping,
    check_layer_types,
    create_attention_mask,
    scaled_dot_product_attention,
)
from . import sharding
from .activations import swiglu_oai
from .cache import KVCache, RotatingKVCache
from .rope_utils import initialize_rope, resolve_rope
from .switch_layers import SwitchGLU, SwitchLinear

SLIDING, FULL = "sliding_attention", "full_attention"

# transformers' GptOssConfig falls back to this when a config names no rope at all.
DEFAULT_ROPE_PARAMETERS = {
    "rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0,
    "truncate": False, "original_max_position_embeddings": 4096,
}

# MXFP4 (OCP MX v1.0): 32 e2m1 values share one e8m0 scale.
MXFP4 = {"group_size": 32, "bits": 4, "mode": "mxfp4"}


@dataclass
class ModelArgs(BaseModelArgs):
    model_type: str = "gpt_oss"
    num_hidden_layers: int = 36
    num_local_experts: int = 128
    num_experts_per_tok: int = 4
    vocab_size: int = 201088
    rms_norm_eps: float = 1e-5
    hidden_size: int = 2880
    intermediate_size: int = 2880
    head_dim: int = 64
    num_attention_heads: int = 64
    num_key_value_heads: int = 8
    sliding_window: int = 128
    max_position_embeddings: int = 131072
    attention_bias: bool = True
    swiglu_alpha: float = 1.702
    swiglu_limit: float = 7.0
    tie_word_embeddings: bool = False
    rope_theta: Optional[float] = None
    rope_scaling: Optional[Dict[str, Any]] = None
    rope_parameters: Optional[Dict[str, Any]] = None
    layer_types: Optional[List[str]] = None
    quantization_config: Optional[Dict[str, Any]] = None  # HF: how the checkpoint is stored
    quantization: Optional[Dict[str, Any]] = None  # MLX converters: what the loader quantizes

    def __post_init__(self):
        if self.layer_types is None:
            self.layer_types = [SLIDING if i % 2 == 0 else FULL for i in range(self.num_hidden_layers)]
        check_layer_types(self.layer_types, self.num_hidden_layers, (SLIDING, FULL))
        check_head_grouping(self.num_attention_heads, self.num_key_value_heads)
        if self.rope_scaling is None and self.rope_parameters is None:
            self.rope_parameters = dict(DEFAULT_ROPE_PARAMETERS)
        theta, self.rope_scaling, partial_rotary_factor = resolve_rope(
            self.rope_theta, self.rope_scaling, self.rope_parameters
        )
        if partial_rotary_factor not in (None, 1.0):
            raise ValueError(f"gpt-oss rotates whole heads; got partial_rotary_factor={partial_rotary_factor}")
        self.rope_theta = 150000.0 if theta is None else theta
        quant_method = (self.quantization_config or {}).get("quant_method")
        if self.quantization is None and quant_method not in (None, "mxfp4"):
            raise ValueError(
                f"quantization_config.quant_method {quant_method!r} is not supported for gpt_oss; "
                "only 'mxfp4' checkpoints (or MLX-converted ones) load"
            )

    @property
    def mxfp4_experts(self) -> bool:
        """Experts arrive as the original MXFP4 blocks (an MLX-converted checkpoint says
        how it is quantized in `quantization` instead, and the loader applies that)."""
        method = (self.quantization_config or {}).get("quant_method")
        return self.quantization is None and method == "mxfp4"


def clamped_swiglu(up: mx.array, gate: mx.array, alpha: float = 1.702, limit: float = 7.0) -> mx.array:
    """gpt-oss expert activation on (..., I) projections -> (..., I):
    min(gate, limit) * sigmoid(alpha * min(gate, limit)) * (clip(up, -limit, limit) + 1)
    (activations.swiglu_oai, called as SwitchGLU calls its activation: up first)."""
    return swiglu_oai(gate, up, alpha, limit)


def route(router_logits: mx.array, k: int) -> Tuple[mx.array, mx.array]:
    """(..., E) router logits -> the k chosen experts (..., k) and their weights (..., k):
    a softmax over the k chosen logits only."""
    indices = mx.argpartition(-router_logits, kth=k - 1, axis=-1)[..., :k]
    chosen = mx.take_along_axis(router_logits, indices, axis=-1)
    return indices, mx.softmax(chosen, axis=-1, precise=True)


def deinterleave(x: mx.array, axis: int) -> Tuple[mx.array, mx.array]:
    """Even and odd entries of `x` along `axis`: transformers fuses gate and up as
    (gate_0, up_0, gate_1, up_1, ...)."""
    even = [slice(None)] * x.ndim
    odd = list(even)
    even[axis], odd[axis] = slice(0, None, 2), slice(1, None, 2)
    return x[tuple(even)], x[tuple(odd)]


def mxfp4_blocks_as_weight(blocks: mx.array) -> mx.array:
    """(..., G, 16) uint8 MXFP4 blocks -> (..., G * 4) uint32: the same bytes as MLX's
    mxfp4 weight (element 2j in the low nibble of byte j, little-endian words)."""
    words = mx.view(blocks, mx.uint32)  # (..., G, 4)
    return words.reshape(*words.shape[:-2], -1)


class Attention(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        dim, head_dim, bias = args.hidden_size, args.head_dim, args.attention_bias
        self.n_heads = args.num_attention_heads
        self.n_kv_heads = args.num_key_value_heads
        self.scale = head_dim**-0.5
        self.q_proj = nn.Linear(dim, self.n_heads * head_dim, bias=bias)
        self.k_proj = nn.Linear(dim, self.n_kv_heads * head_dim, bias=bias)
        self.v_proj = nn.Linear(dim, self.n_kv_heads * head_dim, bias=bias)
        self.o_proj = nn.Linear(self.n_heads * head_dim, dim, bias=bias)
        self.sinks = mx.zeros((self.n_heads,))
        self.rope = initialize_rope(
            head_dim, args.rope_theta, False, args.rope_scaling, args.max_position_embeddings
        )

    def __call__(self, x: mx.array, mask: Optional[mx.array] = None, cache=None) -> mx.array:
        B, L, _ = x.shape
        q = self.q_proj(x).reshape(B, L, self.n_heads, -1).transpose(0, 2, 1, 3)  # (B, H, L, D)
        k = self.k_proj(x).reshape(B, L, self.n_kv_heads, -1).transpose(0, 2, 1, 3)  # (B, H_kv, L, D)
        v = self.v_proj(x).reshape(B, L, self.n_kv_heads, -1).transpose(0, 2, 1, 3)
        offset = cache.offset if cache is not None else 0
        q, k = self.rope(q, offset=offset), self.rope(k, offset=offset)
        if cache is not None:
            k, v = cache.update_and_fetch(k, v)  # (B, H_kv, S, D)
        out = scaled_dot_product_attention(
            q, k, v, cache=cache, scale=self.scale, mask=mask, sinks=self.sinks
        )  # (B, H, L, D)
        return self.o_proj(out.transpose(0, 2, 1, 3).reshape(B, L, -1))


class MLP(nn.Module):
    """Top-k routed experts; `router` and `experts` are the checkpoint's names."""

    def __init__(self, args: ModelArgs):
        super().__init__()
        self.num_experts_per_tok = args.num_experts_per_tok
        self.router = nn.Linear(args.hidden_size, args.num_local_experts, bias=True)
        activation = partial(clamped_swiglu, alpha=args.swiglu_alpha, limit=args.swiglu_limit)
        self.experts = SwitchGLU(
            args.hidden_size, args.intermediate_size, args.num_local_experts, activation=activation, bias=True
        )

    def __call__(self, x: mx.array) -> mx.array:
        indices, weights = route(self.router(x), self.num_experts_per_tok)  # (B, L, k) each
        y = self.experts(x, indices)  # (B, L, k, hidden)
        return (y * weights[..., None]).sum(axis=-2)


class TransformerBlock(nn.Module):
    def __init__(self, args: ModelArgs, layer_type: str):
        super().__init__()
        self.layer_type = layer_type
        self.self_attn = Attention(args)
        self.mlp = MLP(args)
        self.input_layernorm = nn.RMSNorm(args.hidden_size, eps=args.rms_norm_eps)
        self.post_attention_layernorm = nn.RMSNorm(args.hidden_size, eps=args.rms_norm_eps)

    def __call__(self, x: mx.array, mask: Optional[mx.array] = None, cache=None) -> mx.array:
        h = x + self.self_attn(self.input_layernorm(x), mask, cache)
        return h + self.mlp(self.post_attention_layernorm(h))


class Backbone(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.sliding_window = args.sliding_window
        self.embed_tokens = nn.Embedding(args.vocab_size, args.hidden_size)
        self.layers = [TransformerBlock(args, layer_type) for layer_type in args.layer_types]
        self.norm = nn.RMSNorm(args.hidden_size, eps=args.rms_norm_eps)

    def __call__(self, inputs: mx.array, cache: Optional[List[Any]] = None) -> mx.array:
        h = self.embed_tokens(inputs)  # (B, L, hidden)
        if cache is None:
            cache = [None] * len(self.layers)
        masks = self.masks(h, cache)
        for layer, layer_cache in zip(self.layers, cache):
            h = layer(h, masks[layer.layer_type], layer_cache)
        return self.norm(h)

    def masks(self, h: mx.array, cache: List[Any]) -> Dict[str, Optional[mx.array]]:
        """One mask per attention kind, from the first cache of that kind: all caches of
        a kind hold the same positions. Sliding masks are windowed even without a cache."""
        masks = {}
        for layer, layer_cache in zip(self.layers, cache):
            if layer.layer_type not in masks:
                window = self.sliding_window if layer.layer_type == SLIDING else None
                masks[layer.layer_type] = create_attention_mask(h, layer_cache, window_size=window)
        return masks


class Model(nn.Module):
    # Speculation rolls back exactly: the sliding layers' RotatingKVCaches record their
    # own pre-forward windows, the full layers' KVCaches trim.
    supports_speculative_rollback = True

    def __init__(self, args: ModelArgs):
        super().__init__()
        self.args = args
        self.model_type = args.model_type
        self.model = Backbone(args)
        if not args.tie_word_embeddings:
            self.lm_head = nn.Linear(args.hidden_size, args.vocab_size, bias=False)
        if args.mxfp4_experts:
            # MLX multiplies the checkpoint's MXFP4 blocks as they are; only the expert
            # projections are stored that way (biases, router and attention stay float).
            nn.quantize(self, **MXFP4, class_predicate=lambda _, module: isinstance(module, SwitchLinear))

    def __call__(self, inputs: mx.array, cache: Optional[List[Any]] = None) -> mx.array:
        """Token ids (B, L) -> logits (B, L, vocab)."""
        h = self.model(inputs, cache)
        if self.args.tie_word_embeddings:
            return self.model.embed_tokens.as_linear(h)
        return self.lm_head(h)

    def sanitize(self, weights: Dict[str, mx.array]) -> Dict[str, mx.array]:
        """Split transformers' fused expert tensors (float or MXFP4) into our stacked
        (E, out, in) gate/up/down. Each rewrite consumes the key it reads, so tensors
        already in our layout (a second call, MLX-converted checkpoints) pass unchanged."""
        weights = dict(weights)
        stems = {k[: k.index(".mlp.experts.")] + ".mlp.experts." for k in weights if ".mlp.experts." in k}
        for stem in sorted(stems):
            for name, tensor in self._unfuse(weights, stem + "gate_up_proj").items():
                gate, up = deinterleave(tensor, axis=1)  # rows: (gate_0, up_0, gate_1, ...)
                weights[f"{stem}gate_proj.{name}"], weights[f"{stem}up_proj.{name}"] = gate, up
            for name, tensor in self._unfuse(weights, stem + "down_proj").items():
                weights[f"{stem}down_proj.{name}"] = tensor
        if self.args.tie_word_embeddings:
            weights.pop("lm_head.weight", None)
        return weights

    def _unfuse(self, weights: Dict[str, mx.array], fused: str) -> Dict[str, mx.array]:
        """Pop the tensors of one fused expert projection, in either HF layout, as
        {parameter name: (E, out, ...)} with output features on axis 1."""
        tensors = {}
        if fused in weights:  # float (E, in, out)
            tensors["weight"] = weights.pop(fused).swapaxes(1, 2)
        if fused + "_blocks" in weights:  # MXFP4 (E, out, G, 16) and (E, out, G)
            blocks, scales = weights.pop(fused + "_blocks"), weights.pop(fused + "_scales")
            tensors.update(self._mxfp4_tensors(blocks, scales))
        if fused + "_bias" in weights:  # (E, out)
            tensors["bias"] = weights.pop(fused + "_bias")
        return tensors

    def _mxfp4_tensors(self, blocks: mx.array, scales: mx.array) -> Dict[str, mx.array]:
        """Quantized parameters for mxfp4 experts, else the dequantized float weight
        (bfloat16 holds every e2m1 value times a power of two exactly)."""
        weight = mxfp4_blocks_as_weight(blocks)  # (E, out, in / 8)
        if self.args.mxfp4_experts:
            return {"weight": weight, "scales": scales}
        return {"weight": mx.dequantize(weight, scales, **MXFP4, dtype=mx.bfloat16)}

    @property
    def layers(self) -> List[TransformerBlock]:
        return self.model.layers

    def make_cache(self) -> List[Union[KVCache, RotatingKVCache]]:
        """A window-sized ring buffer for sliding layers, a growing cache for full ones."""
        return [
            RotatingKVCache(self.args.sliding_window) if layer.layer_type == SLIDING else KVCache()
            for layer in self.layers
        ]

    def shard(self, group: Optional[mx.distributed.Group] = None) -> None:
        """Tensor parallel over `group` (default: the global group), in place: each rank
        keeps its share of the heads (with their sinks) and of every expert's hidden
        units; the router, embeddings and lm_head stay whole, so routing is identical on
        every rank. Sliding and full layers shard alike: a rank's RotatingKVCache holds
        the window of its own heads."""
        group = sharding.world(group)
        for layer in self.layers:
            attn = layer.self_attn
            attn.sinks = sharding.take_shard(attn.sinks, group)
            attn.n_heads, attn.n_kv_heads = sharding.shard_attention(attn, attn.n_heads, attn.n_kv_heads, group)
            sharding.shard_moe(layer.mlp, layer.mlp.experts, group)

    def quant_predicate(self, path: str, module: nn.Module) -> Union[bool, Dict[str, int]]:
        # Routing decisions are sensitive to small logit errors: keep the router at 8 bits.
        if path.endswith("mlp.router"):
            return {"group_size": 64, "bits": 8}
        return True
