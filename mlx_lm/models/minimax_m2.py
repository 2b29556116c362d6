"""MiniMax-M2 (`minimax_m2`, MiniMaxM2ForCausalLM: MiniMaxAI/MiniMax-M2, -M2.1): Mixtral's
layout with OLMo's whole-projection QK-norm, partial rope and sigmoid routing.

What differs from mixtral:
- q_proj's and k_proj's outputs are RMS-normalised over the whole projection (all heads
  together) before the heads are split: olmo3's attention (`ProjectionNorm`; sharded,
  the squares are summed over the ranks). No biases.
- Rope turns the first `rotary_dim` features of each head in rotate-half pairs: the
  hub's configs give `rotary_dim`, transformers 5's a `partial_rotary_factor` in
  `rope_parameters` (either is read; rotary_dim wins). Default theta 5e6.
- The router scores experts by sigmoid (fp32); the k best by score +
  `e_score_correction_bias` (a tensor of the MoE block) are weighted by their scores
  renormalised to sum to 1 (nemotron_h's `route` with one group).
- Experts as mixtral's (`block_sparse_moe.experts.{e}.w1/w2/w3`, `gate`, and
  `e_score_correction_bias`); transformers 5 names the block `mlp` in memory.
Reference: transformers `models/minimax_m2/modeling_minimax_m2.py`, `configuration_minimax_m2.py`.
"""

from dataclasses import dataclass
from typing import Optional

import mlx.core as mx

from . import mixtral, olmo3, sharding
from .olmoe import shard_projection_norms
from .glm4 import resolve_partial_rotary
from .llama import FULL
from .nemotron_h import route
from .rope_utils import initialize_rope

DEFAULT_THETA = 5_000_000.0  # MiniMaxM2Config.default_theta


@dataclass
class ModelArgs(mixtral.ModelArgs):
    """MiniMaxM2Config's keys (mixtral's plus the rope split), with its defaults."""

    head_dim: int = 128
    rms_norm_eps: float = 1e-6
    num_local_experts: int = 256
    num_experts_per_tok: int = 8
    rotary_dim: Optional[int] = None  # the hub's configs
    partial_rotary_factor: Optional[float] = None

    def __post_init__(self):
        if self.rope_theta is None and "rope_theta" not in (self.rope_parameters or {}):
            self.rope_theta = DEFAULT_THETA  # llama's fallback would be 10000
        super().__post_init__()
        top_level = self.rotary_dim / self.head_dim if self.rotary_dim is not None else self.partial_rotary_factor
        self.partial_rotary_factor = resolve_partial_rotary(top_level, self.rope_parameters, 1.0)
        self.rope = {FULL: (self.rope_theta, self.rope_scaling)}  # what olmo3.Attention reads

    @property
    def rotary_dims(self) -> int:
        return int(self.head_dim * self.partial_rotary_factor)


class Attention(olmo3.Attention):
    """olmo3's attention (whole-projection q/k norms) with rope on the first rotary_dims
    features only."""

    def __init__(self, args: ModelArgs):
        super().__init__(args, FULL)
        self.rope = initialize_rope(args.rotary_dims, args.rope_theta, False, args.rope_scaling,
                                    args.max_position_embeddings)


class SparseMoeBlock(mixtral.SparseMoeBlock):
    """mixtral's router and experts, with a choice bias and sigmoid scores."""

    def __init__(self, args: ModelArgs):
        super().__init__(args)
        self.e_score_correction_bias = mx.zeros((args.num_local_experts,))

    def __call__(self, x: mx.array) -> mx.array:
        experts, weights = route(self.gate(x), self.e_score_correction_bias, self.top_k, 1, 1, True, 1.0)  # (B, L, k)
        return (self.switch_mlp(x, experts) * weights[..., None].astype(x.dtype)).sum(axis=-2)  # (B, L, hidden)


# mixtral's block, backbone and model with this family's parts swapped in (MLX
# initialises lazily, so the replaced parts are never computed).


class DecoderLayer(mixtral.DecoderLayer):
    def __init__(self, args: ModelArgs, layer_type: str):
        super().__init__(args, layer_type)
        self.self_attn = Attention(args)
        self.block_sparse_moe = SparseMoeBlock(args)


class MiniMaxM2Model(mixtral.MixtralModel):
    block_class = DecoderLayer


class Model(mixtral.Model):
    backbone_class = MiniMaxM2Model

    def sanitize(self, weights: mixtral.Weights) -> mixtral.Weights:
        """mixtral's, with transformers 5's in-memory correction bias name too."""
        moved = ".mlp.e_score_correction_bias", ".block_sparse_moe.e_score_correction_bias"
        return super().sanitize({k.replace(*moved): v for k, v in weights.items()})

    def shard(self, group: Optional[mx.distributed.Group] = None) -> None:
        """mixtral's, plus the q/k norms: each rank keeps the weights of its features and
        sums the squares with the others (olmo3.projection_rms_norm)."""
        group = sharding.world(group)
        super().shard(group)
        for layer in self.layers:
            shard_projection_norms(layer.self_attn, group)
