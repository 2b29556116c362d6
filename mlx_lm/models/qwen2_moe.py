"""Qwen2 MoE (Qwen1.5-MoE-A2.7B, Qwen2-57B-A14B): qwen2's attention (biases on q, k and
v, none on o_proj) with a sparse mixture of experts plus a gated shared expert.

What differs from qwen3_moe:
- No q/k norms; q/k/v carry biases unless `qkv_bias` is false (transformers 5's key;
  the hub configs omit it, and every released checkpoint has them).
- The MoE block (`qwen3_next.SparseMoeBlock`, the same block): a softmax top-k router
  `gate` over `switch_mlp` SwiGLU experts, renormalised only with `norm_topk_prob`
  (False in the released checkpoints), plus `shared_expert` (a SwiGLU of
  `shared_expert_intermediate_size`) scaled by sigmoid(`shared_expert_gate`(x)), one
  scalar per token.
- Dense layers (in `mlp_only_layers` or off the `decoder_sparse_step` grid) are a
  SwiGLU of `intermediate_size`, as in qwen3_moe.
- The hub configs and transformers 5 both write `num_experts` (default 60).
- Experts arrive per expert (`mlp.experts.{e}.{gate,up,down}_proj.weight`, what
  transformers saves) or fused as transformers 5 holds them in memory
  (`mlp.experts.gate_up_proj` (E, 2I, H), `mlp.experts.down_proj` (E, H, I));
  `sanitize` stacks or splits either into `mlp.switch_mlp.*` (E, out, in).
Reference: transformers `models/qwen2_moe/modeling_qwen2_moe.py`.
"""

from dataclasses import dataclass
from typing import Dict, Optional, Union

import mlx.core as mx
import mlx.nn as nn

from . import llama, qwen3_moe, sharding
from .qwen3_next import SparseMoeBlock, quant_predicate, split_fused_experts, stack_expert_weights


@dataclass
class ModelArgs(qwen3_moe.ModelArgs):
    """Qwen2MoeConfig's keys and defaults (the MoE ones are qwen3_moe's fields)."""

    num_experts: Optional[int] = 60
    num_experts_per_tok: int = 4
    moe_intermediate_size: int = 1408
    shared_expert_intermediate_size: int = 5632
    qkv_bias: bool = True  # a field here (llama and qwen3 derive it)

    qk_norm = False
    o_bias = False

    def __post_init__(self):
        if self.use_sliding_window:
            raise ValueError("use_sliding_window=True is not supported for qwen2_moe (no released checkpoint uses it)")
        if self.num_experts is None and self.num_local_experts is None:
            self.num_experts = 60  # not qwen3_moe's 128
        super().__post_init__()
        if self.shared_expert_intermediate_size <= 0:
            raise ValueError(f"shared_expert_intermediate_size must be > 0, got {self.shared_expert_intermediate_size}")


# qwen3_moe's block and backbone, with this family's MoE block on the MoE layers. The
# parent builds its own first; MLX initialises lazily, so the replaced parts are never
# computed.


class DecoderLayer(qwen3_moe.DecoderLayer):
    def __init__(self, args: ModelArgs, layer_idx: int):
        super().__init__(args, layer_idx)
        if args.is_moe_layer(layer_idx):
            self.mlp = SparseMoeBlock(args)


class Qwen2MoeModel(qwen3_moe.Qwen3MoeModel):
    def __init__(self, args: ModelArgs):
        super().__init__(args)
        self.layers = [DecoderLayer(args, i) for i in range(args.num_hidden_layers)]


class Model(llama.Model):
    # KV caches roll back by themselves; the layers record nothing.
    supports_speculative_rollback = True
    backbone_class = Qwen2MoeModel

    def sanitize(self, weights: Dict[str, mx.array]) -> Dict[str, mx.array]:
        """llama's, then per-expert or fused experts -> stacked `switch_mlp`. Each rewrite
        consumes the keys it reads, so converted weights (and a second call) pass unchanged."""
        return split_fused_experts(stack_expert_weights(super().sanitize(weights)))

    def shard(self, group: Optional[mx.distributed.Group] = None) -> None:
        """Tensor parallel as llama; MoE layers split every expert's and the shared
        expert's hidden units and all-sum the block once (routed + gated shared). The
        router and the shared-expert gate stay whole, so routing is identical."""
        group = sharding.world(group)
        for layer in self.layers:
            attn = layer.self_attn
            attn.n_heads, attn.n_kv_heads = sharding.shard_attention(attn, attn.n_heads, attn.n_kv_heads, group)
            if isinstance(layer.mlp, SparseMoeBlock):
                sharding.shard_mlp(layer.mlp.shared_expert, group, reduce=False)
                sharding.shard_moe(layer.mlp, layer.mlp.switch_mlp, group)
            else:
                sharding.shard_mlp(layer.mlp, group)

    def quant_predicate(self, path: str, module: nn.Module) -> Union[bool, Dict[str, int]]:
        # The router and the shared-expert gate are small and sensitive: 8 bits.
        return quant_predicate(path, module)
