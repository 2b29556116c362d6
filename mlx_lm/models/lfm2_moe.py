"""Liquid LFM2-MoE: LFM2's hybrid of gated short convolutions and grouped-query attention
with a sparse mixture of experts after the first `num_dense_layers` layers.

What differs from LFM2 (`lfm2.py`, whose conv, attention and SwiGLU blocks it reuses):
- Layer i < num_dense_layers has a dense SwiGLU of exactly `intermediate_size` units
  (no `block_auto_adjust_ff_dim` shrinking: transformers' Lfm2MoeMLP takes the width as
  given); every later layer a mixture of `num_experts` SwiGLU experts of
  `moe_intermediate_size` units (`feed_forward.switch_mlp`).
- The router is sigmoid-scored: experts are *chosen* by sigmoid(logits) + expert_bias
  (a per-expert load-balancing bias, `use_expert_bias`) but *weighted* by the unbiased
  sigmoid scores, renormalised to sum to 1 (+1e-6) if `norm_topk_prob`, then scaled by
  `routed_scaling_factor`. No shared expert.
- Cache per layer as LFM2: `ArraysCache(1)` (conv state, rolled back by slicing the
  recorded conv input) or `KVCache`.
Config dialects: Liquid's hub checkpoints write top-level `rope_theta` and
`tie_embedding`; transformers 5 writes `rope_parameters` and `tie_word_embeddings`. The
layer pattern is `layer_types` (LFM2's `full_attn_idxs` is read too). Weights: one tensor
per expert (`feed_forward.experts.{e}.w1/w3/w2.weight`, the hub layout and what
transformers 5 saves) or fused (`experts.gate_up_proj` (E, 2I, H) = [w1 ; w3],
`experts.down_proj` (E, H, I), transformers' in-memory layout).
Reference: transformers `models/lfm2_moe/modeling_lfm2_moe.py`, `configuration_lfm2_moe.py`.
"""

import re
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Tuple, Union

import mlx.core as mx
import mlx.nn as nn

from . import lfm2, sharding
from .base import BaseModelArgs, check_head_grouping
from .lfm2 import FeedForward, layer_pattern, normalise_shared_keys, sanitize_weights
from .switch_layers import SwitchGLU

# transformers adds this to the sum of the chosen weights before renormalising.
NORM_EPS = 1e-6
# Per expert e: hub name -> ours (w1 gate, w3 up, w2 down).
EXPERT_PROJECTIONS = {"w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"}


@dataclass
class ModelArgs(BaseModelArgs):
    model_type: str
    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    # Defaults below are transformers' (Lfm2MoeConfig, LFM2-8B-A1B's shape).
    intermediate_size: int = 7168
    moe_intermediate_size: int = 1792
    num_experts: int = 32
    num_experts_per_tok: int = 4
    num_dense_layers: int = 2
    use_expert_bias: bool = True
    norm_topk_prob: bool = True
    routed_scaling_factor: float = 1.0
    head_dim: Optional[int] = None
    norm_eps: float = 1e-5
    conv_bias: bool = False
    conv_L_cache: int = 3
    max_position_embeddings: Optional[int] = 128000
    rope_theta: Optional[float] = None
    rope_scaling: Optional[Dict[str, Any]] = None
    rope_parameters: Optional[Dict[str, Any]] = None
    layer_types: Optional[List[str]] = None
    full_attn_idxs: Optional[List[int]] = None
    tie_word_embeddings: Optional[bool] = None
    tie_embedding: Optional[bool] = None  # Liquid's name for it

    def __post_init__(self):
        normalise_shared_keys(self)
        if self.layer_types is None and self.full_attn_idxs is None:
            raise ValueError("config has neither layer_types nor full_attn_idxs; give the layer pattern")
        self.layer_types, self.full_attn_idxs = layer_pattern(
            self.layer_types, self.full_attn_idxs, self.num_hidden_layers
        )
        self._validate()

    def _validate(self):
        check_head_grouping(self.num_attention_heads, self.num_key_value_heads)
        if self.conv_L_cache < 2:  # see lfm2.ModelArgs: no state, and ambiguous conv layouts
            raise ValueError(f"conv_L_cache must be >= 2, got {self.conv_L_cache}")
        if not 0 <= self.num_dense_layers <= self.num_hidden_layers:
            raise ValueError(
                f"num_dense_layers must be in 0..num_hidden_layers ({self.num_hidden_layers}), "
                f"got {self.num_dense_layers}"
            )
        if self.num_dense_layers < self.num_hidden_layers and not 0 < self.num_experts_per_tok <= self.num_experts:
            raise ValueError(
                f"num_experts_per_tok ({self.num_experts_per_tok}) must be in 1..num_experts ({self.num_experts})"
            )

    def is_moe_layer(self, layer_idx: int) -> bool:
        return layer_idx >= self.num_dense_layers


def sigmoid_route(logits: mx.array, expert_bias: Optional[mx.array], top_k: int, normalize: bool,
                  scaling: float) -> Tuple[mx.array, mx.array]:
    """LFM2-MoE's router: logits (..., E) -> expert ids (..., k) and weights (..., k) fp32.

    Experts are chosen by sigmoid(logits) + expert_bias (E,) (or the scores alone when
    there is no bias); their weights are the unbiased scores, divided by their sum
    + NORM_EPS if `normalize`, times `scaling`."""
    scores = mx.sigmoid(logits.astype(mx.float32))
    choice = scores if expert_bias is None else scores + expert_bias.astype(mx.float32)
    # Indices carry no gradient (training adapters differentiates through the weights).
    experts = mx.stop_gradient(mx.argpartition(-choice, kth=top_k - 1, axis=-1)[..., :top_k])
    weights = mx.take_along_axis(scores, experts, axis=-1)
    if normalize:
        weights = weights / (weights.sum(axis=-1, keepdims=True) + NORM_EPS)
    return experts, weights * scaling


class SparseMoeBlock(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.top_k, self.normalize, self.scaling = (
            args.num_experts_per_tok, args.norm_topk_prob, args.routed_scaling_factor
        )
        self.gate = nn.Linear(args.hidden_size, args.num_experts, bias=False)
        self.switch_mlp = SwitchGLU(args.hidden_size, args.moe_intermediate_size, args.num_experts)
        if args.use_expert_bias:
            self.expert_bias = mx.zeros((args.num_experts,))

    def __call__(self, x: mx.array) -> mx.array:
        experts, weights = sigmoid_route(self.gate(x), self.get("expert_bias"), self.top_k, self.normalize,
                                         self.scaling)  # (B, L, k)
        return (self.switch_mlp(x, experts) * weights[..., None].astype(x.dtype)).sum(axis=-2)  # (B, L, hidden)


def decoder_layer(args: ModelArgs, layer_idx: int) -> lfm2.DecoderLayer:
    """LFM2's layer with a dense SwiGLU (the first num_dense_layers) or the mixture."""
    if args.is_moe_layer(layer_idx):
        feed_forward = SparseMoeBlock(args)
    else:
        feed_forward = FeedForward(args.hidden_size, args.intermediate_size)
    return lfm2.DecoderLayer(args, layer_idx, feed_forward)


_PER_EXPERT = re.compile(r"^(.*\.feed_forward)\.experts\.(\d+)\.(w1|w2|w3)\.weight$")


def stack_experts(weights: Dict[str, mx.array]) -> Dict[str, mx.array]:
    """Per-expert `feed_forward.experts.{e}.{w1,w3,w2}.weight` (out, in) and fused
    `experts.gate_up_proj` / `experts.down_proj` -> `feed_forward.switch_mlp.*.weight`
    (E, out, in). Keys already stacked pass through, so a second pass changes nothing."""
    out, per_expert = {}, {}
    for key, value in weights.items():
        match = _PER_EXPERT.match(key)
        if match:
            prefix, expert, name = match.groups()
            per_expert.setdefault((prefix, EXPERT_PROJECTIONS[name]), {})[int(expert)] = value
        elif key.endswith(".feed_forward.experts.gate_up_proj"):
            prefix = key[: -len("experts.gate_up_proj")]
            gate, up = mx.split(value, 2, axis=1)  # (E, I, H) each: w1 rows first
            out[prefix + "switch_mlp.gate_proj.weight"], out[prefix + "switch_mlp.up_proj.weight"] = gate, up
        elif key.endswith(".feed_forward.experts.down_proj"):
            out[key[: -len("experts.down_proj")] + "switch_mlp.down_proj.weight"] = value
        else:
            out[key] = value
    for (prefix, name), experts in per_expert.items():
        if sorted(experts) != list(range(len(experts))):
            raise ValueError(f"{prefix}.experts has {name} weights for experts {sorted(experts)}; "
                             f"expected 0..{len(experts) - 1}")
        out[f"{prefix}.switch_mlp.{name}.weight"] = mx.stack([experts[e] for e in range(len(experts))])
    return out


class Model(lfm2.Model):
    """LFM2's model (forward, caches, rollback recording) with mixture-of-experts layers."""

    decoder_layer_class = staticmethod(decoder_layer)

    def sanitize(self, weights: Dict[str, mx.array]) -> Dict[str, mx.array]:
        """LFM2's rewrites (conv layout, tied lm_head), then the experts stacked."""
        return stack_experts(sanitize_weights(weights, self.args.tie_word_embeddings))

    def quant_predicate(self, path: str, module: nn.Module) -> Union[bool, Dict[str, int]]:
        """The routers are small and decide which experts run: keep them at 8 bits."""
        if path.endswith("feed_forward.gate"):
            return {"group_size": 64, "bits": 8}
        return True

    def shard(self, group: Optional[mx.distributed.Group] = None) -> None:
        """Tensor parallel over `group` (default: the global group), in place: token
        mixers as LFM2's (attention by heads, short convs by channels), dense MLPs and
        every expert by hidden units, the mixture's weighted sum all-summed once. The
        routers (and expert_bias), embeddings and lm_head stay whole."""
        group = sharding.world(group)
        for layer in self.layers:
            (layer.self_attn if layer.is_attention else layer.conv).shard(group)
            if isinstance(layer.feed_forward, SparseMoeBlock):
                sharding.shard_moe(layer.feed_forward, layer.feed_forward.switch_mlp, group)
            else:
                sharding.shard_mlp(layer.feed_forward, group, inputs=("w1", "w3"), output="w2")
