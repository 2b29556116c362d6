"""GLM-4.5 / GLM-4.6 / GLM-4.7 (`glm4_moe`, Glm4MoeForCausalLM: zai-org/GLM-4.5, -4.5-Air,
-4.6): GLM-4's partial rope in llama's pre-norm block, with DeepSeek-V3-style sigmoid
routed experts plus shared experts.

What differs from glm4:
- Rope turns the first `partial_rotary_factor` (default 0.5) of each head's features
  in rotate-half pairs (x[i], x[i + d/2]), not interleaved ones; the rest pass.
- No post-norms: llama's block. q/k/v biases only with `attention_bias` (default False;
  True in the released configs); with `use_qk_norm` each q and k head is RMS-normalised
  before rope.
- Layers from `first_k_dense_replace` on are MoE: a router (`gate`: weight (E, H) and
  `e_score_correction_bias` (E,), applied in fp32) scores experts by sigmoid; experts
  are chosen by score + bias within the `topk_group` of `n_group` groups whose two
  best biased scores sum highest (nemotron_h's `route`); the unbiased scores weight
  them, renormalised with `norm_topk_prob`, times `routed_scaling_factor`. Plus
  `shared_experts`, one SwiGLU of `n_shared_experts * moe_intermediate_size`. Earlier
  layers are a SwiGLU of `intermediate_size`.
- The hub checkpoints carry multi-token-prediction layers past `num_hidden_layers`
  (`model.layers.46.*` in GLM-4.5): transformers ignores them, and so does `sanitize`.
- Experts arrive per expert (`mlp.experts.{e}.{gate,up,down}_proj.weight`, the hub's
  and what transformers saves) or fused as transformers 5 holds them in memory;
  `sanitize` stacks or splits either into `mlp.switch_mlp.*` (E, out, in).
Reference: transformers `models/glm4_moe/modeling_glm4_moe.py`, `configuration_glm4_moe.py`.
"""

import re
from dataclasses import dataclass
from typing import Dict, Optional

import mlx.core as mx
import mlx.nn as nn

from . import glm4, llama, sharding
from .llama import MLP
from .mixtral import check_top_k
from .nemotron_h import TopkRouter, route
from .qwen3_next import split_fused_experts, stack_expert_weights
from .switch_layers import SwitchGLU


@dataclass
class ModelArgs(glm4.ModelArgs):
    """Glm4MoeConfig's keys (glm4's plus the experts'), with its defaults."""

    rms_norm_eps: float = 1e-5
    attention_bias: bool = False
    moe_intermediate_size: int = 1408
    num_experts_per_tok: int = 8
    n_shared_experts: int = 1
    n_routed_experts: int = 128
    routed_scaling_factor: float = 1.0
    n_group: int = 1
    topk_group: int = 1
    first_k_dense_replace: int = 1
    norm_topk_prob: bool = True
    use_qk_norm: bool = False

    def __post_init__(self):
        super().__post_init__()
        check_top_k(self.num_experts_per_tok, self.n_routed_experts, "n_routed_experts")
        if self.n_group < 1 or self.n_routed_experts % self.n_group:
            raise ValueError(f"n_group ({self.n_group}) must divide n_routed_experts ({self.n_routed_experts})")
        if not 0 < self.topk_group <= self.n_group:
            raise ValueError(f"topk_group ({self.topk_group}) must be in 1..n_group ({self.n_group})")
        if self.topk_group < self.n_group and self.n_routed_experts // self.n_group < 2:
            raise ValueError("groups score by their two best experts; give at least 2 experts per group")
        if self.n_shared_experts < 1:
            raise ValueError(f"n_shared_experts is {self.n_shared_experts}; glm4_moe's block has shared experts")

    @property
    def qk_norm(self) -> bool:  # what llama.Attention reads
        return self.use_qk_norm


class Attention(glm4.Attention):
    """glm4's attention with rotate-half pairs (and llama's optional per-head q/k norms)."""

    traditional = False


class MoE(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.args = args
        self.gate = TopkRouter(args.hidden_size, args.n_routed_experts)
        self.switch_mlp = SwitchGLU(args.hidden_size, args.moe_intermediate_size, args.n_routed_experts)
        self.shared_experts = MLP(args.hidden_size, args.moe_intermediate_size * args.n_shared_experts)

    def __call__(self, x: mx.array) -> mx.array:
        a = self.args
        logits = x.astype(mx.float32) @ self.gate.weight.astype(mx.float32).T  # (B, L, E), fp32 as transformers
        experts, weights = route(logits, self.gate.e_score_correction_bias, a.num_experts_per_tok, a.n_group,
                                 a.topk_group, a.norm_topk_prob, a.routed_scaling_factor)  # (B, L, k)
        routed = (self.switch_mlp(x, experts) * weights[..., None].astype(x.dtype)).sum(axis=-2)
        return routed + self.shared_experts(x)  # (B, L, hidden)


# llama's block and backbone with this family's parts swapped in (MLX initialises
# lazily, so the replaced parts are never computed).


class DecoderLayer(llama.TransformerBlock):
    def __init__(self, args: ModelArgs, layer_idx: int):
        super().__init__(args, args.layer_types[layer_idx])
        self.self_attn = Attention(args)
        if layer_idx >= args.first_k_dense_replace:
            self.mlp = MoE(args)


class Glm4MoeModel(llama.LlamaModel):
    def __init__(self, args: ModelArgs):
        super().__init__(args)
        self.layers = [DecoderLayer(args, i) for i in range(args.num_hidden_layers)]


_LAYER = re.compile(r"^model\.layers\.(\d+)\.")


class Model(llama.Model):
    # KV caches roll back by themselves; the layers record nothing.
    supports_speculative_rollback = True
    backbone_class = Glm4MoeModel

    def sanitize(self, weights: Dict[str, mx.array]) -> Dict[str, mx.array]:
        """llama's; the multi-token-prediction layers (past num_hidden_layers) dropped;
        per-expert or fused experts -> stacked `switch_mlp`. Each rewrite consumes the
        keys it reads, so converted weights (and a second call) pass unchanged."""
        n = self.args.num_hidden_layers
        weights = {k: v for k, v in super().sanitize(weights).items()
                   if not (_LAYER.match(k) and int(_LAYER.match(k).group(1)) >= n)}
        return split_fused_experts(stack_expert_weights(weights))

    def shard(self, group: Optional[mx.distributed.Group] = None) -> None:
        """Attention by heads (the per-head q/k norms are shared by all heads, so they stay
        whole); MoE layers split every routed and shared expert's hidden units and
        all-sum the block once; dense layers as llama. The router stays whole."""
        group = sharding.world(group)
        for layer in self.layers:
            attn = layer.self_attn
            attn.n_heads, attn.n_kv_heads = sharding.shard_attention(attn, attn.n_heads, attn.n_kv_heads, group)
            if isinstance(layer.mlp, MoE):
                sharding.shard_mlp(layer.mlp.shared_experts, group, reduce=False)
                sharding.shard_moe(layer.mlp, layer.mlp.switch_mlp, group)
            else:
                sharding.shard_mlp(layer.mlp, group)
