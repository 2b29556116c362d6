"""IBM Granite 3.0/3.1 MoE (`granitemoe`, GraniteMoeForCausalLM: granite-3.0-1b-a400m,
-3b-a800m): Mixtral's layout with Granite's muP multipliers and fused expert tensors.

What differs from mixtral:
- Embeddings are scaled by `embedding_multiplier`, every residual branch (attention
  and experts) by `residual_multiplier`, attention scores by `attention_multiplier`
  (not head_dim^-0.5), and the logits divided by `logits_scaling`.
- The router takes the top-k logits and softmaxes over those k (the same as
  renormalising the top-k of the full softmax): granitemoehybrid's MoE block, which
  keeps the router out of quantization (it is not a Linear).
- Experts are stored fused as the hub has them (`block_sparse_moe.input_linear.weight`
  (E, 2I, H), gate rows first; `output_linear.weight` (E, H, I); `router.layer.weight`;
  also what transformers 5 saves), or as transformers 5 holds them in memory
  (`experts.gate_up_proj`, `experts.down_proj`, `router.weight`); `sanitize` splits
  either into `block_sparse_moe.switch_mlp.{gate,up,down}_proj` (E, out, in).
Reference: transformers `models/granitemoe/modeling_granitemoe.py`.
"""

from dataclasses import dataclass
from typing import Any, Dict, List, Optional

import mlx.core as mx
import mlx.nn as nn

from . import granite, llama, mixtral
from .granitemoehybrid import MoE, Attention, rename_experts


@dataclass
class ModelArgs(granite.ModelArgs):
    """GraniteMoeConfig's keys (dense Granite's, with its multipliers, plus the experts),
    with its defaults."""

    num_local_experts: int = 8
    num_experts_per_tok: int = 2

    def __post_init__(self):
        super().__post_init__()
        mixtral.check_top_k(self.num_experts_per_tok, self.num_local_experts)


class DecoderLayer(nn.Module):
    def __init__(self, args: ModelArgs, layer_type: str):
        super().__init__()
        self.layer_type = layer_type
        self.residual_multiplier = args.residual_multiplier
        self.self_attn = Attention(args)
        self.block_sparse_moe = MoE(args)
        self.input_layernorm = nn.RMSNorm(args.hidden_size, eps=args.rms_norm_eps)
        self.post_attention_layernorm = nn.RMSNorm(args.hidden_size, eps=args.rms_norm_eps)

    def __call__(self, x: mx.array, mask: Optional[mx.array] = None, cache=None) -> mx.array:
        h = x + self.self_attn(self.input_layernorm(x), mask, cache) * self.residual_multiplier
        return h + self.block_sparse_moe(self.post_attention_layernorm(h)) * self.residual_multiplier


class GraniteMoeModel(granite.GraniteModel):
    """Dense Granite's backbone (embeddings times embedding_multiplier) over MoE blocks."""

    block_class = DecoderLayer


class Model(llama.Model):
    # KV caches roll back by themselves; the layers record nothing.
    supports_speculative_rollback = True
    backbone_class = GraniteMoeModel

    def __call__(
        self, inputs: mx.array, cache: Optional[List[Any]] = None, input_embeddings: Optional[mx.array] = None
    ) -> mx.array:
        return super().__call__(inputs, cache, input_embeddings) / self.args.logits_scaling

    def sanitize(self, weights: Dict[str, mx.array]) -> Dict[str, mx.array]:
        """llama's, then the fused experts and router (hub or in-memory names) -> ours;
        each rewrite is guarded by the name it changes, so a second pass changes nothing."""
        out = {}
        for key, value in super().sanitize(weights).items():
            out.update(rename_experts(key, value))
        return out

    # Attention by heads, every expert's hidden units split and the block summed once.
    shard = mixtral.Model.shard
