"""Hunyuan MoE (`hunyuan_v1_moe`, HunYuanMoEV1ForCausalLM: tencent/Hunyuan-A13B): the
Hunyuan dense attention (q/k norms after rope, NTK-alpha rope) with softmax experts plus
a shared MLP on every layer.

What differs from hunyuan_v1_dense:
- Every layer's MLP is a mixture: a router (`gate.wg`, applied in fp32 as the released
  weights are) gives softmax probabilities, the `moe_topk` best (an int, or one per
  layer) renormalised to sum to 1, over `num_experts` SwiGLU experts of
  `intermediate_size`; plus `shared_mlp`, a SwiGLU of the same size.
- Experts arrive per expert (`mlp.experts.{e}.{gate,up,down}_proj.weight`, the hub's and
  what transformers saves) or fused as transformers 5 holds them in memory; `sanitize`
  stacks or splits either into `mlp.switch_mlp.*` (E, out, in).
Reference: transformers `models/hunyuan_v1_moe/modeling_hunyuan_v1_moe.py`.
"""

from dataclasses import dataclass
from typing import Dict, List, Optional, Union

import mlx.core as mx
import mlx.nn as nn

from . import hunyuan_v1_dense, llama, sharding
from .llama import MLP
from .mixtral import check_top_k
from .qwen3_next import route, split_fused_experts, stack_expert_weights
from .switch_layers import SwitchGLU


@dataclass
class ModelArgs(hunyuan_v1_dense.ModelArgs):
    """HunYuanMoEV1Config's keys (the dense family's plus the experts'), with its defaults."""

    num_experts: int = 1
    moe_topk: Union[int, List[int]] = 1

    def __post_init__(self):
        super().__post_init__()
        if not isinstance(self.num_experts, int):
            raise ValueError(f"num_experts must be one count for every layer, got {self.num_experts!r}")
        if isinstance(self.moe_topk, list) and len(self.moe_topk) != self.num_hidden_layers:
            raise ValueError(f"moe_topk has {len(self.moe_topk)} entries but num_hidden_layers is "
                             f"{self.num_hidden_layers}; give one per layer")
        for i in range(self.num_hidden_layers):
            check_top_k(self.top_k(i), self.num_experts, "num_experts", "moe_topk")

    def top_k(self, layer_idx: int) -> int:
        return self.moe_topk if isinstance(self.moe_topk, int) else self.moe_topk[layer_idx]


class Gate(nn.Module):
    def __init__(self, dim: int, num_experts: int):
        super().__init__()
        self.wg = nn.Linear(dim, num_experts, bias=False)


class SparseMoeBlock(nn.Module):
    def __init__(self, args: ModelArgs, layer_idx: int):
        super().__init__()
        self.top_k = args.top_k(layer_idx)
        self.gate = Gate(args.hidden_size, args.num_experts)
        self.switch_mlp = SwitchGLU(args.hidden_size, args.intermediate_size, args.num_experts)
        self.shared_mlp = MLP(args.hidden_size, args.intermediate_size)

    def __call__(self, x: mx.array) -> mx.array:
        logits = self.gate.wg(x.astype(mx.float32))  # (B, L, E); fp32 as transformers with fp32 router weights
        experts, weights = route(logits, self.top_k, normalize=True)  # (B, L, k)
        routed = (self.switch_mlp(x, experts) * weights[..., None].astype(x.dtype)).sum(axis=-2)
        return routed + self.shared_mlp(x)  # (B, L, hidden)


# hunyuan_v1_dense's block and backbone with the MoE block swapped in (MLX initialises
# lazily, so the replaced dense MLPs are never computed).


class DecoderLayer(hunyuan_v1_dense.DecoderLayer):
    def __init__(self, args: ModelArgs, layer_idx: int):
        super().__init__(args, args.layer_types[layer_idx])
        self.mlp = SparseMoeBlock(args, layer_idx)


class HunYuanMoeModel(hunyuan_v1_dense.HunYuanModel):
    def __init__(self, args: ModelArgs):
        super().__init__(args)
        self.layers = [DecoderLayer(args, i) for i in range(args.num_hidden_layers)]


class Model(hunyuan_v1_dense.Model):
    backbone_class = HunYuanMoeModel

    def sanitize(self, weights: Dict[str, mx.array]) -> Dict[str, mx.array]:
        """llama's, then per-expert or fused experts -> stacked `switch_mlp`. Each rewrite
        consumes the keys it reads, so converted weights (and a second call) pass unchanged."""
        return split_fused_experts(stack_expert_weights(llama.Model.sanitize(self, weights)))

    def shard(self, group: Optional[mx.distributed.Group] = None) -> None:
        """Attention by heads (the per-head norms stay whole); every expert's and the
        shared MLP's hidden units split, the block all-summed once; the router whole."""
        group = sharding.world(group)
        for layer in self.layers:
            attn = layer.self_attn
            attn.n_heads, attn.n_kv_heads = sharding.shard_attention(attn, attn.n_heads, attn.n_kv_heads, group)
            sharding.shard_mlp(layer.mlp.shared_mlp, group, reduce=False)
            sharding.shard_moe(layer.mlp, layer.mlp.switch_mlp, group)

    def quant_predicate(self, path: str, module: nn.Module) -> Union[bool, Dict[str, int]]:
        # The router is small and its top-k choice sensitive: 8 bits (qwen3_moe's rule).
        return {"group_size": 64, "bits": 8} if path.endswith("mlp.gate.wg") else True
