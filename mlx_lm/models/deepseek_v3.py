"""DeepSeek-V3 (`deepseek_v3`, DeepseekV3ForCausalLM: deepseek-ai/DeepSeek-V3, -R1, -V3.1,
moonshotai/Kimi-K2 (`kimi_k2`), Moonlight): deepseek_v2's network (MLA over a latent
cache, routed plus shared experts) with DeepSeek-V3's router.

What differs from deepseek_v2:
- The router (`gate`: weight (E, H) and `e_score_correction_bias` (E,), in fp32)
  scores experts by sigmoid; experts are chosen by score + bias within the
  `topk_group` of `n_group` groups whose two best biased scores sum highest
  (nemotron_h's `route`, transformers' DeepseekV3TopkRouter); the unbiased scores
  weight them, renormalised with `norm_topk_prob` (default True), times
  `routed_scaling_factor`.
- Rope pairs come from `rope_interleave` (default True: interleaved (2i, 2i + 1), as
  the checkpoints are trained; False: rotate-half (i, i + d/2)). transformers rotates
  the interleaved pairs into a de-interleaved layout, the same permutation on q_rot
  and k_rot, so the scores are those of MLX's interleaved rope.
- No MLP biases (transformers' DeepseekV3MLP has none: mlp_bias is refused).
- transformers' defaults are V3's: first_k_dense_replace 3, n_group 8, topk_group 4,
  top-8 of 256 experts, max_position_embeddings 4096.
- The hub checkpoints carry `num_nextn_predict_layers` multi-token-prediction layers
  past num_hidden_layers (`model.layers.61.*`): transformers ignores them, and so does
  `sanitize`. The FP8 releases (e4m3 weights with one `weight_scale_inv` per 128 x
  128 tile, `quantization_config.quant_method` "fp8") are dequantized by `sanitize`;
  checkpoints converted by upstream mlx-lm, whose kv_b_proj is split per head into
  `embed_q` (W_k transposed) and `unembed_out` (W_v), float or quantized, are joined
  back into kv_b_proj.
Reference: transformers `models/deepseek_v3/modeling_deepseek_v3.py`,
`configuration_deepseek_v3.py`.
"""

import re
from dataclasses import dataclass
from typing import Any, Dict, Optional, Tuple

import mlx.core as mx
import mlx.nn as nn

from . import deepseek_v2
from .deepseek_v2 import check_groups
from .mimo_v2_flash import dequantize_fp8_blocks
from .nemotron_h import TopkRouter, route

Weights = Dict[str, mx.array]
NOAUX_TC = "noaux_tc"


@dataclass
class ModelArgs(deepseek_v2.ModelArgs):
    """DeepseekV3Config's keys (deepseek_v2's, plus rope_interleave,
    num_nextn_predict_layers and the FP8 releases' quantization_config), with its
    defaults."""

    vocab_size: int = 129280
    hidden_size: int = 7168
    intermediate_size: int = 18432
    moe_intermediate_size: int = 2048
    num_hidden_layers: int = 61
    num_attention_heads: int = 128
    n_shared_experts: int = 1
    n_routed_experts: int = 256
    num_experts_per_tok: Optional[int] = 8
    routed_scaling_factor: float = 2.5
    topk_method: Optional[str] = NOAUX_TC
    n_group: Optional[int] = 8
    topk_group: Optional[int] = 4
    norm_topk_prob: bool = True
    scoring_func: str = "sigmoid"
    first_k_dense_replace: int = 3
    max_position_embeddings: int = 4096
    rope_interleave: bool = True
    num_nextn_predict_layers: int = 1
    quantization_config: Optional[Dict[str, Any]] = None

    scoring = "sigmoid"

    def __post_init__(self):
        super().__post_init__()
        if self.mlp_bias:
            raise ValueError("mlp_bias True is not supported: transformers' DeepseekV3MLP has no biases")
        config = self.quantization_config or {}
        if config.get("quant_method") not in (None, "fp8") or config.get("fmt", "e4m3") != "e4m3":
            raise ValueError(
                f"quantization_config {config!r} is not supported; only the releases' block-scaled e4m3 'fp8' "
                "(dequantized on load) or MLX-converted checkpoints load"
            )

    def _validate_router(self):
        self._validate_top_k()
        if self.topk_method not in (None, NOAUX_TC):
            raise ValueError(f"topk_method {self.topk_method!r} is not supported; deepseek_v3 routes by {NOAUX_TC!r}")
        E, groups = self.n_routed_experts, self.n_group
        check_groups(E, groups, self.topk_group)
        if self.topk_group < groups and E // groups < 2:
            raise ValueError(f"n_group ({groups}) leaves {E // groups} expert per group; groups are scored by "
                             "their two best experts")
        if self.num_experts_per_tok > self.topk_group * E // groups:
            raise ValueError(f"num_experts_per_tok ({self.num_experts_per_tok}) must be at most "
                             f"{self.topk_group * E // groups} (the experts of topk_group groups)")

    @property
    def rope_traditional(self) -> bool:
        return self.rope_interleave

    @property
    def fp8_block(self) -> Tuple[int, int]:
        """(rows, columns) of the FP8 weight tiles that share one scale."""
        rows, cols = (self.quantization_config or {}).get("weight_block_size", (128, 128))
        return rows, cols


class MoE(deepseek_v2.MoE):
    """deepseek_v2's block with the sigmoid, bias-corrected, group-limited router."""

    @staticmethod
    def make_router(args: ModelArgs) -> nn.Module:
        return TopkRouter(args.hidden_size, args.n_routed_experts)

    def route(self, logits: mx.array) -> Tuple[mx.array, mx.array]:
        a = self.args
        return route(logits, self.gate.e_score_correction_bias, a.num_experts_per_tok, a.n_group, a.topk_group,
                     a.norm_topk_prob, a.routed_scaling_factor)


class DeepseekV3Model(deepseek_v2.DeepseekV2Model):
    moe_class = MoE


_LAYER = re.compile(r"^model\.layers\.(\d+)\.")


def drop_layers(weights: Weights, first: int, stop: int) -> Weights:
    """Weights of layers first..stop-1 (`model.layers.{i}.*`) removed."""
    def kept(key: str) -> bool:
        match = _LAYER.match(key)
        return not (match and first <= int(match.group(1)) < stop)

    return {k: v for k, v in weights.items() if kept(k)}


def dequantized(weights: Weights, name: str, in_dims: int) -> mx.array:
    """`name`.weight, popped, dequantized if it comes with affine `.scales` / `.biases`
    (bits and group size follow from its `in_dims` true input features)."""
    weight = weights.pop(f"{name}.weight")
    if f"{name}.scales" not in weights:
        return weight
    scales, biases = weights.pop(f"{name}.scales"), weights.pop(f"{name}.biases", None)
    if biases is None:
        raise ValueError(f"{name} is quantized without biases (not affine); re-convert the checkpoint from the hub")
    bits, group_size = weight.shape[-1] * 32 // in_dims, in_dims // scales.shape[-1]
    return mx.dequantize(weight, scales, biases, group_size=group_size, bits=bits)


def join_absorbed_kv_b_proj(weights: Weights, nope_dim: int, kv_lora_rank: int) -> Weights:
    """Upstream mlx-lm's converted attention -> kv_b_proj, in place: `embed_q` (H, r, dn)
    holds each head's W_k transposed and `unembed_out` (H, dv, r) its W_v (float or
    quantized); kv_b_proj.weight is (H (dn + dv), r), head-major [W_k ; W_v], float.
    Any attention's prefix (LongCat's `self_attn.{0,1}.` too)."""
    for key in [k for k in weights if k.endswith(".embed_q.weight")]:
        prefix = key[: -len("embed_q.weight")]
        w_k = dequantized(weights, prefix + "embed_q", nope_dim).swapaxes(-1, -2)  # (H, dn, r)
        w_v = dequantized(weights, prefix + "unembed_out", kv_lora_rank)  # (H, dv, r)
        weights[prefix + "kv_b_proj.weight"] = mx.concatenate([w_k, w_v], axis=1).reshape(-1, kv_lora_rank)
    return weights


class Model(deepseek_v2.Model):
    backbone_class = DeepseekV3Model

    def sanitize(self, weights: Weights) -> Weights:
        """deepseek_v2's, after: the MTP layers past num_hidden_layers dropped, FP8
        weights dequantized (each consumes its `weight_scale_inv`), upstream mlx-lm's
        embed_q / unembed_out joined into kv_b_proj (consumed too). Each rewrite is
        guarded by the keys it consumes, so a second call changes nothing."""
        a = self.args
        n = a.num_hidden_layers
        weights = drop_layers(weights, n, n + a.num_nextn_predict_layers)
        for key in [k for k in weights if k.endswith(".weight_scale_inv")]:
            weight = key[: -len("_scale_inv")]
            weights[weight] = dequantize_fp8_blocks(weights[weight], weights.pop(key), a.fp8_block)
        weights = join_absorbed_kv_b_proj(weights, a.qk_nope_head_dim, a.kv_lora_rank)
        return super().sanitize(weights)
