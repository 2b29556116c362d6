"""OLMoE (`olmoe`, OlmoeForCausalLM: allenai/OLMoE-1B-7B-0924 and -0125, Instruct):
llama's pre-norm block with OLMo's QK-norm over the whole projection and a sparse
mixture of experts in place of the MLP.

What differs from llama:
- q_proj's and k_proj's outputs are RMS-normalised over the whole projection (all heads
  together: `q_norm` of hidden_size features, `k_norm` of H_kv * D), before the heads
  are split and roped: olmo3's attention (`olmo3.Attention`, whose sharded norms sum
  their squares over the ranks).
- Every layer's MLP is a softmax top-k router `gate` over `num_experts` SwiGLU experts
  of `intermediate_size` (`qwen3_moe.SparseMoeBlock`), renormalised only with
  `norm_topk_prob` (False in the released checkpoints). No shared expert.
- `clip_qkv` (clamping q, k, v) is refused unless null: no released checkpoint sets it.
- Experts arrive per expert (`mlp.experts.{e}.{gate,up,down}_proj.weight`, the hub's
  and what transformers saves) or fused as transformers 5 holds them in memory
  (`mlp.experts.gate_up_proj`, `mlp.experts.down_proj`); `sanitize` stacks or splits
  either into `mlp.switch_mlp.*` (E, out, in).
Reference: transformers `models/olmoe/modeling_olmoe.py`; Muennighoff et al., "OLMoE:
Open Mixture-of-Experts Language Models" (2024), arXiv:2409.02060.
"""

from dataclasses import dataclass
from typing import Dict, Optional, Union

import mlx.core as mx
import mlx.nn as nn

from . import llama, olmo3, sharding
from .llama import FULL
from .mixtral import check_top_k
from .qwen3_moe import SparseMoeBlock
from .qwen3_next import quant_predicate, split_fused_experts, stack_expert_weights


@dataclass
class ModelArgs(llama.ModelArgs):
    """OlmoeConfig's keys (llama's plus these), with its defaults."""

    rms_norm_eps: float = 1e-5
    num_experts: int = 64
    num_experts_per_tok: int = 8
    norm_topk_prob: bool = False
    clip_qkv: Optional[float] = None

    def __post_init__(self):
        super().__post_init__()
        if self.clip_qkv is not None:
            raise ValueError(f"clip_qkv={self.clip_qkv} is not supported (no released OLMoE checkpoint clips)")
        if self.head_dim * self.num_attention_heads != self.hidden_size:
            # transformers sizes q_norm by hidden_size, so the heads must tile it.
            raise ValueError(f"head_dim ({self.head_dim}) x num_attention_heads ({self.num_attention_heads}) "
                             f"must equal hidden_size ({self.hidden_size}) for olmoe")
        check_top_k(self.num_experts_per_tok, self.num_experts, "num_experts")
        self.rope = {FULL: (self.rope_theta, self.rope_scaling)}  # what olmo3.Attention reads

    @property
    def moe_intermediate_size(self) -> int:  # what qwen3_moe.SparseMoeBlock reads
        return self.intermediate_size


class DecoderLayer(llama.TransformerBlock):
    """llama's block with olmo3's attention and the MoE block (MLX initialises lazily,
    so llama's replaced parts are never computed)."""

    def __init__(self, args: ModelArgs, layer_type: str):
        super().__init__(args, layer_type)
        self.self_attn = olmo3.Attention(args, FULL)
        self.mlp = SparseMoeBlock(args)


class OlmoeModel(llama.LlamaModel):
    block_class = DecoderLayer


def shard_projection_norms(attn: nn.Module, group: mx.distributed.Group) -> None:
    """An attention's whole-projection q/k norms after its heads are sharded: each rank
    keeps the weights of its own features and sums the squares with the others."""
    for norm in (attn.q_norm, attn.k_norm):
        norm.weight = sharding.take_shard(norm.weight, group)
        norm.group = group


class Model(llama.Model):
    # KV caches roll back by themselves; the layers record nothing.
    supports_speculative_rollback = True
    backbone_class = OlmoeModel

    def sanitize(self, weights: Dict[str, mx.array]) -> Dict[str, mx.array]:
        """llama's, then per-expert or fused experts -> stacked `switch_mlp`. Each rewrite
        consumes the keys it reads, so converted weights (and a second call) pass unchanged."""
        return split_fused_experts(stack_expert_weights(super().sanitize(weights)))

    def shard(self, group: Optional[mx.distributed.Group] = None) -> None:
        """Attention by heads, with the q/k norms' weights split alike (each rank sums its
        squares with the others, see olmo3.projection_rms_norm); every expert's hidden
        units split and the block all-summed once. The router stays whole."""
        group = sharding.world(group)
        for layer in self.layers:
            attn = layer.self_attn
            attn.n_heads, attn.n_kv_heads = sharding.shard_attention(attn, attn.n_heads, attn.n_kv_heads, group)
            shard_projection_norms(attn, group)
            sharding.shard_moe(layer.mlp, layer.mlp.switch_mlp, group)

    def quant_predicate(self, path: str, module: nn.Module) -> Union[bool, Dict[str, int]]:
        # The router is small and its top-k choice sensitive: 8 bits (qwen3_moe's rule).
        return quant_predicate(path, module)
