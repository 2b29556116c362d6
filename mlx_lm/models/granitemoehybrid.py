"""IBM Granite 4.0-H (and the dense Granite 4.0): a stack of Mamba-2 or attention mixers,
each layer followed by a shared SwiGLU MLP and optionally a softmax top-k mixture of
experts, with Granite's muP multipliers.

What differs from llama:
- The mixer of layer i is Mamba-2 or attention as `layer_types` says (transformers 5:
  "linear_attention" / "full_attention"; the hub's checkpoints: "mamba" / "attention";
  `layers_block_type` is transformers' other name for the field). Mamba-2 is
  Nemotron-H's mixer (`nemotron_h.Mamba2Mixer` over `ssm.py`: conv + silu, the SSD
  recurrence, rmsnorm(y * silu(z)) over `mamba_n_groups` groups, dt clamped to
  `time_step_limit` on every path where transformers clamps only on its multi-token
  path; the default (0, inf) clamps nothing). Its cache is an `ArraysCache(2)`,
  attention's a `KVCache`.
- Attention scores are scaled by `attention_multiplier`, not head_dim^-0.5; rope only
  when `position_embedding_type` is "rope" (Granite 4.0-H says "nope": no positions in
  attention, the Mamba layers carry order).
- Layer: h = x + residual_multiplier * mixer(n(x)); out = h + residual_multiplier *
  (moe(n'(h)) + shared_mlp(n'(h))), the MoE absent when num_local_experts is 0.
  Embeddings are scaled by embedding_multiplier, logits divided by logits_scaling.
- The shared MLP keeps its fused `input_linear` ([gate | up]) and `output_linear`. The
  router is a softmax over the top-k logits (equal to the renormalised top-k of the full
  softmax). Experts arrive as the hub stores them (`block_sparse_moe.input_linear`
  (E, 2I, D), `output_linear` (E, D, I), `router.layer`, also what transformers 5
  saves) or as transformers 5 holds them in memory (`experts.gate_up_proj`,
  `experts.down_proj`, `router.weight`); `sanitize` splits either into
  `block_sparse_moe.switch_mlp.{gate,up,down}_proj` (E, out, in).
- While speculating, each Mamba-2 layer records its recurrence inputs and a rollback
  replays the accepted prefix (DESIGN.md §2).
References: transformers `models/granitemoehybrid/modeling_granitemoehybrid.py`; IBM,
"Granite 4.0" model cards (ibm-granite/granite-4.0-h-*).
"""

import re
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Sequence, Union

import mlx.core as mx
import mlx.nn as nn

from . import llama, sharding
from .base import (
    BaseModelArgs,
    check_head_grouping,
    check_layer_types,
    create_attention_mask,
)
from .cache import ArraysCache, KVCache
from .falcon_h1 import read_float
from .nemotron_h import Mamba2Mixer, Mamba2Shape
from .qwen3_next import route
from .rope_utils import resolve_rope
from .switch_layers import SwitchGLU

MAMBA, ATTENTION = "linear_attention", "full_attention"
LEGACY_KINDS = {"mamba": MAMBA, "attention": ATTENTION}  # the hub's (transformers 4) names
POSITION_EMBEDDINGS = (None, "nope", "rope")


@dataclass
class ModelArgs(BaseModelArgs):
    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int  # each expert's
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: Optional[int] = None
    head_dim: Optional[int] = None
    hidden_act: str = "silu"
    max_position_embeddings: int = 2048
    rms_norm_eps: float = 1e-6
    tie_word_embeddings: bool = False
    rope_theta: Optional[float] = None  # transformers 4
    rope_scaling: Optional[Dict[str, Any]] = None
    rope_parameters: Optional[Dict[str, Any]] = None  # transformers 5
    attention_bias: bool = False
    embedding_multiplier: float = 1.0
    logits_scaling: float = 1.0
    residual_multiplier: float = 1.0
    attention_multiplier: float = 1.0
    num_local_experts: int = 8
    num_experts_per_tok: int = 2
    shared_intermediate_size: int = 1024
    position_embedding_type: Optional[str] = None
    layer_types: Optional[List[str]] = None
    layers_block_type: Optional[List[str]] = None  # transformers' alias of layer_types
    mamba_n_heads: int = 128
    mamba_n_groups: int = 1
    mamba_d_state: int = 256
    mamba_d_head: Union[int, str] = "auto"
    mamba_d_conv: int = 4
    mamba_expand: int = 2
    mamba_conv_bias: bool = True
    mamba_proj_bias: bool = False
    time_step_limit: Optional[Sequence[Any]] = None

    qk_norm = False  # read by llama.Attention

    def __post_init__(self):
        self._resolve_layer_types()
        if self.num_key_value_heads is None:
            self.num_key_value_heads = self.num_attention_heads
        if self.head_dim is None:
            self.head_dim = self.hidden_size // self.num_attention_heads
        if self.mamba_d_head == "auto":
            self.mamba_d_head = self.mamba_expand * self.hidden_size // self.mamba_n_heads
        # transformers 5 writes infinity as {"__float__": "Infinity"}, json as Infinity.
        self.time_step_limit = tuple(read_float(v) for v in (self.time_step_limit or (0.0, float("inf"))))
        theta, self.rope_scaling, _ = resolve_rope(self.rope_theta, self.rope_scaling, self.rope_parameters)
        self.rope_theta = 10000.0 if theta is None else theta
        self._validate()

    def _resolve_layer_types(self):
        kinds = [None if k is None else [LEGACY_KINDS.get(t, t) for t in k]
                 for k in (self.layer_types, self.layers_block_type)]
        if kinds[0] is not None and kinds[1] is not None and kinds[0] != kinds[1]:
            raise ValueError(
                f"layer_types {self.layer_types!r} and layers_block_type {self.layers_block_type!r} disagree; "
                "they name the same field, give one"
            )
        # transformers' default: every layer Mamba-2.
        self.layer_types = kinds[0] or kinds[1] or [MAMBA] * self.num_hidden_layers

    def _validate(self):
        check_layer_types(self.layer_types, self.num_hidden_layers, (MAMBA, ATTENTION))
        check_head_grouping(self.num_attention_heads, self.num_key_value_heads)
        if self.hidden_act != "silu":
            raise ValueError(f"hidden_act {self.hidden_act!r} is not supported; Granite uses 'silu'")
        if self.position_embedding_type not in POSITION_EMBEDDINGS:
            raise ValueError(
                f"position_embedding_type {self.position_embedding_type!r} is not one of {list(POSITION_EMBEDDINGS)}"
            )
        if self.mamba_d_head * self.mamba_n_heads != self.mamba_expand * self.hidden_size:
            raise ValueError(
                f"mamba_d_head ({self.mamba_d_head}) x mamba_n_heads ({self.mamba_n_heads}) must equal "
                f"mamba_expand ({self.mamba_expand}) x hidden_size ({self.hidden_size})"
            )
        if self.mamba_n_heads % self.mamba_n_groups:
            raise ValueError(
                f"mamba_n_heads ({self.mamba_n_heads}) must be a multiple of mamba_n_groups ({self.mamba_n_groups})"
            )
        # K = 1 would make the HF (C, 1, K) and MLX (C, K, 1) conv layouts alike (sanitize).
        if self.mamba_d_conv < 2:
            raise ValueError(f"mamba_d_conv must be >= 2, got {self.mamba_d_conv}")
        if self.num_local_experts < 0 or (self.num_local_experts and
                                          not 0 < self.num_experts_per_tok <= self.num_local_experts):
            raise ValueError(
                f"num_experts_per_tok ({self.num_experts_per_tok}) must be in 1..num_local_experts "
                f"({self.num_local_experts}), or num_local_experts 0 for no experts"
            )
        if len(self.time_step_limit) != 2:
            raise ValueError(f"time_step_limit needs (min, max), got {self.time_step_limit!r}")

    @property
    def qkv_bias(self) -> bool:  # read by llama.Attention
        return self.attention_bias

    @property
    def o_bias(self) -> bool:
        return self.attention_bias

    @property
    def mamba_shape(self) -> Mamba2Shape:
        low, high = self.time_step_limit
        return Mamba2Shape(
            self.hidden_size, self.mamba_n_heads, self.mamba_d_head, self.mamba_n_groups, self.mamba_d_state,
            self.mamba_d_conv, conv_bias=self.mamba_conv_bias, in_proj_bias=self.mamba_proj_bias,
            out_proj_bias=self.mamba_proj_bias, norm_eps=self.rms_norm_eps, norm_before_gate=False,
            time_step_min=low, time_step_max=high,
        )


class NoPositions(nn.Module):
    """What attention runs where a rope would: nothing ("nope": the Mamba layers carry order)."""

    def __call__(self, x: mx.array, offset: int = 0) -> mx.array:
        return x


class Attention(llama.Attention):
    """llama's grouped-query attention, its scores scaled by attention_multiplier, with
    rope only when position_embedding_type is "rope"."""

    def __init__(self, args: ModelArgs):
        super().__init__(args)
        self.scale = args.attention_multiplier
        if args.position_embedding_type != "rope":
            self.rope = NoPositions()


class SharedMLP(nn.Module):
    """SwiGLU with gate and up fused in one projection: input_linear -> [gate | up]."""

    def __init__(self, dim: int, hidden_dim: int):
        super().__init__()
        self.input_linear = nn.Linear(dim, 2 * hidden_dim, bias=False)
        self.output_linear = nn.Linear(hidden_dim, dim, bias=False)

    def __call__(self, x: mx.array) -> mx.array:
        gate, up = mx.split(self.input_linear(x), 2, axis=-1)
        return self.output_linear(nn.silu(gate) * up)


class Router(nn.Module):
    """The router's weight (E, D); not a Linear, so quantization leaves it whole (its
    top-k choice is sensitive)."""

    def __init__(self, dim: int, num_experts: int):
        super().__init__()
        self.weight = mx.zeros((num_experts, dim))


class MoE(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.top_k = args.num_experts_per_tok
        self.router = Router(args.hidden_size, args.num_local_experts)
        self.switch_mlp = SwitchGLU(args.hidden_size, args.intermediate_size, args.num_local_experts)

    def __call__(self, x: mx.array) -> mx.array:
        logits = (x @ self.router.weight.T).astype(mx.float32)  # (B, L, E), fp32 as transformers
        experts, weights = route(logits, self.top_k, normalize=True)  # (B, L, k)
        return (self.switch_mlp(x, experts) * weights[..., None].astype(x.dtype)).sum(axis=-2)


class DecoderLayer(nn.Module):
    def __init__(self, args: ModelArgs, layer_idx: int):
        super().__init__()
        self.layer_type = args.layer_types[layer_idx]
        self.residual_multiplier = args.residual_multiplier
        self.input_layernorm = nn.RMSNorm(args.hidden_size, eps=args.rms_norm_eps)
        self.post_attention_layernorm = nn.RMSNorm(args.hidden_size, eps=args.rms_norm_eps)
        if self.layer_type == MAMBA:
            self.mamba = Mamba2Mixer(args.mamba_shape)
        else:
            self.self_attn = Attention(args)
        if args.num_local_experts:
            self.block_sparse_moe = MoE(args)
        self.shared_mlp = SharedMLP(args.hidden_size, args.shared_intermediate_size)

    def feed_forward(self, h: mx.array) -> mx.array:
        out = self.shared_mlp(h)
        return out + self.block_sparse_moe(h) if "block_sparse_moe" in self else out

    def __call__(self, x: mx.array, mask: Optional[mx.array] = None, cache=None) -> mx.array:
        h = self.input_layernorm(x)
        h = self.mamba(h, cache) if self.layer_type == MAMBA else self.self_attn(h, mask, cache)
        h = x + h * self.residual_multiplier
        return h + self.feed_forward(self.post_attention_layernorm(h)) * self.residual_multiplier


class GraniteModel(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.embedding_multiplier = args.embedding_multiplier
        self.embed_tokens = nn.Embedding(args.vocab_size, args.hidden_size)
        self.layers = [DecoderLayer(args, i) for i in range(args.num_hidden_layers)]
        self.norm = nn.RMSNorm(args.hidden_size, eps=args.rms_norm_eps)
        # Attention layers share one mask, made from the first one's cache entry.
        kinds = args.layer_types
        self.first_attention = kinds.index(ATTENTION) if ATTENTION in kinds else None

    def __call__(self, inputs: mx.array, cache: Optional[List[Any]] = None) -> mx.array:
        h = self.embed_tokens(inputs) * self.embedding_multiplier  # (B, L, hidden)
        cache = [None] * len(self.layers) if cache is None else cache
        if len(cache) != len(self.layers):
            raise ValueError(f"cache has {len(cache)} entries; this model needs {len(self.layers)} (see make_cache)")
        mask = None if self.first_attention is None else create_attention_mask(h, cache[self.first_attention])
        for layer, entry in zip(self.layers, cache):
            h = layer(h, mask, entry)
        return self.norm(h)


# Expert tensors as the hub (and transformers 5's save) and transformers 5's memory name
# them -> ours; fused [gate | up] (E, 2I, D) tensors are split.
_GATE_UP = ("block_sparse_moe.input_linear.weight", "block_sparse_moe.experts.gate_up_proj")
_DOWN = ("block_sparse_moe.output_linear.weight", "block_sparse_moe.experts.down_proj")
_ROUTER = "block_sparse_moe.router.layer.weight"


def rename_experts(key: str, value: mx.array) -> Dict[str, mx.array]:
    """One checkpoint tensor -> our tensors (itself if it needs no renaming)."""
    prefix = key[: key.find("block_sparse_moe.")]
    if key.endswith(_GATE_UP):
        gate, up = mx.split(value, 2, axis=1)  # transformers chunks gate first
        return {prefix + "block_sparse_moe.switch_mlp.gate_proj.weight": gate,
                prefix + "block_sparse_moe.switch_mlp.up_proj.weight": up}
    if key.endswith(_DOWN):
        return {prefix + "block_sparse_moe.switch_mlp.down_proj.weight": value}
    if key.endswith(_ROUTER):
        return {prefix + "block_sparse_moe.router.weight": value}
    return {key: value}


_UPSTREAM_MLP = re.compile(r"^(.*\.)mlp\.(gate_proj|up_proj|down_proj)\.(weight|scales|biases)$")
_ROUTER_LAYER = re.compile(r"^(.*\.block_sparse_moe\.router)\.layer\.(weight|scales|biases)$")


def from_upstream_layout(weights: Dict[str, mx.array], hidden_size: int) -> Dict[str, mx.array]:
    """Checkpoints converted by upstream mlx-lm -> ours: its dense layers' `mlp.gate_proj`
    / `up_proj` / `down_proj` are our `shared_mlp.input_linear` ([gate | up] rows; packed
    rows, scales and biases concatenate alike) / `output_linear`; its router, which it
    quantizes (8 bits) as a Linear, is dequantized (a float one passes as it is, for
    rename_experts). Other keys pass."""
    out, dense, router = {}, {}, {}
    for key, value in weights.items():
        if _UPSTREAM_MLP.match(key):
            prefix, proj, part = _UPSTREAM_MLP.match(key).groups()
            dense.setdefault(prefix, {})[proj, part] = value
        elif _ROUTER_LAYER.match(key):
            prefix, part = _ROUTER_LAYER.match(key).groups()
            router.setdefault(prefix, {})[part] = value
        else:
            out[key] = value
    for prefix, parts in dense.items():
        for part in {part for _, part in parts}:
            out[f"{prefix}shared_mlp.input_linear.{part}"] = mx.concatenate(
                [parts["gate_proj", part], parts["up_proj", part]], axis=0)
            out[f"{prefix}shared_mlp.output_linear.{part}"] = parts["down_proj", part]
    for prefix, parts in router.items():
        out[prefix + ".layer.weight"] = dequantized(parts, hidden_size)
    return out


def dequantized(parts: Dict[str, mx.array], in_dims: int) -> mx.array:
    """A float weight (out, in_dims) from an affine-quantized one's weight, scales and
    biases; bits and group size read off their widths."""
    if "scales" not in parts:
        return parts["weight"]
    bits = parts["weight"].shape[-1] * 32 // in_dims
    group_size = in_dims // parts["scales"].shape[-1]
    return mx.dequantize(parts["weight"], parts["scales"], parts.get("biases"), group_size=group_size, bits=bits)


class Model(nn.Module):
    # Mamba-2 layers record rollbacks into their ArraysCache while speculating.
    supports_speculative_rollback = True

    def __init__(self, args: ModelArgs):
        super().__init__()
        self.args = args
        self.model_type = args.model_type
        self.model = GraniteModel(args)
        if not args.tie_word_embeddings:
            self.lm_head = nn.Linear(args.hidden_size, args.vocab_size, bias=False)

    def __call__(self, inputs: mx.array, cache: Optional[List[Any]] = None) -> mx.array:
        """Token ids (B, L) -> logits (B, L, vocab)."""
        h = self.model(inputs, cache)
        if self.args.tie_word_embeddings:
            return self.model.embed_tokens.as_linear(h) / self.args.logits_scaling
        return self.lm_head(h) / self.args.logits_scaling

    def sanitize(self, weights: Dict[str, mx.array]) -> Dict[str, mx.array]:
        """Hub / transformers weights or converted ones -> ours; each rewrite is guarded
        by the name or shape it changes, so a second pass changes nothing."""
        out = {}
        for key, value in from_upstream_layout(weights, self.args.hidden_size).items():
            if key == "lm_head.weight" and self.args.tie_word_embeddings:
                continue
            if key.endswith("mamba.conv1d.weight") and value.shape[1] == 1 and value.shape[2] > 1:
                value = value.swapaxes(1, 2)  # (ch, 1, K) -> (ch, K, 1)
            out.update(rename_experts(key, value))
        return out

    @property
    def layers(self) -> List[DecoderLayer]:
        return self.model.layers

    def make_cache(self) -> List[Union[ArraysCache, KVCache]]:
        return [ArraysCache(2) if layer.layer_type == MAMBA else KVCache() for layer in self.layers]

    def shard(self, group: Optional[mx.distributed.Group] = None) -> None:
        """Tensor parallel over `group` (default: the global group), in place: Mamba-2
        mixers by heads (with their B/C groups), attention by heads, the shared MLP and
        every expert by hidden units. The experts' sum and the shared MLP each all-sum
        (two sums where one would do: they are separate modules, whose names are the
        checkpoint's). The router, embeddings and lm_head stay whole."""
        group = sharding.world(group)
        for layer in self.layers:
            if layer.layer_type == MAMBA:
                sharding.shard_mamba2(layer.mamba, group)
            else:
                attn = layer.self_attn
                attn.n_heads, attn.n_kv_heads = sharding.shard_attention(attn, attn.n_heads, attn.n_kv_heads, group)
            sharding.shard_mlp(layer.shared_mlp, group, inputs=("input_linear",), output="output_linear", segments=2)
            if "block_sparse_moe" in layer:
                sharding.shard_moe(layer.block_sparse_moe, layer.block_sparse_moe.switch_mlp, group)
