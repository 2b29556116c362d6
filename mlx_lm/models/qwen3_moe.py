"""Qwen3 MoE (Qwen3-30B-A3B, Qwen3-235B-A22B, Qwen3-Coder-30B-A3B): qwen3's attention
(per-head q/k RMSNorm before rope) with a sparse mixture-of-experts MLP.

What differs from qwen3:
- The MLP of layer i is a SparseMoeBlock (a softmax top-k router `gate` over
  `switch_mlp` SwiGLU experts, no shared expert) unless i is in `mlp_only_layers` or
  off the `decoder_sparse_step` grid, where a dense SwiGLU of `intermediate_size` sits.
- The router's top-k probabilities are renormalised to sum to 1 only with
  `norm_topk_prob` (True in the released checkpoints, False in transformers' default).
- transformers 5 writes the expert count as `num_local_experts`, transformers 4 (and
  the hub checkpoints) as `num_experts`; either is read.
- Experts arrive per expert (`mlp.experts.{e}.{gate,up,down}_proj.weight`, what both
  transformers 4 and 5 save) or fused as transformers 5 holds them in memory
  (`mlp.experts.gate_up_proj` (E, 2I, H), `mlp.experts.down_proj` (E, H, I));
  `sanitize` stacks or splits either into `mlp.switch_mlp.*` (E, out, in).
Reference: transformers `models/qwen3_moe/modeling_qwen3_moe.py`.
"""

from dataclasses import dataclass
from typing import Dict, List, Optional, Union

import mlx.core as mx
import mlx.nn as nn

from . import llama, qwen3, qwen3_next, sharding
from .llama import MLP, Attention
from .qwen3_next import quant_predicate, route, split_fused_experts, stack_expert_weights
from .switch_layers import SwitchGLU


@dataclass
class ModelArgs(qwen3.ModelArgs):
    num_experts: Optional[int] = None  # transformers 4
    num_local_experts: Optional[int] = None  # transformers 5
    num_experts_per_tok: int = 8
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = False
    decoder_sparse_step: int = 1
    mlp_only_layers: Optional[List[int]] = None

    def __post_init__(self):
        super().__post_init__()
        if self.num_experts is None:
            self.num_experts = 128 if self.num_local_experts is None else self.num_local_experts
        elif self.num_local_experts not in (None, self.num_experts):
            raise ValueError(
                f"num_experts ({self.num_experts}) and num_local_experts ({self.num_local_experts}) "
                "disagree; they name the same count, give one"
            )
        if self.mlp_only_layers is None:
            self.mlp_only_layers = []
        self._validate_moe()

    def _validate_moe(self):
        if self.decoder_sparse_step < 1:
            raise ValueError(f"decoder_sparse_step must be >= 1, got {self.decoder_sparse_step}")
        moe = [self.is_moe_layer(i) for i in range(self.num_hidden_layers)]
        if any(moe) and not 0 < self.num_experts_per_tok <= self.num_experts:
            raise ValueError(
                f"num_experts_per_tok ({self.num_experts_per_tok}) must be in 1..num_experts ({self.num_experts})"
            )
        if any(moe) and self.moe_intermediate_size <= 0:
            raise ValueError(f"moe_intermediate_size is {self.moe_intermediate_size} but some layers are MoE")
        if not all(moe) and self.intermediate_size <= 0:
            raise ValueError(f"intermediate_size is {self.intermediate_size} but some layers use a dense MLP")

    # MoE at layer i iff i is not in mlp_only_layers, there are experts and (i + 1) is a
    # multiple of decoder_sparse_step: transformers' rule, qwen3_next's too.
    is_moe_layer = qwen3_next.ModelArgs.is_moe_layer


class SparseMoeBlock(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.top_k, self.norm_topk_prob = args.num_experts_per_tok, args.norm_topk_prob
        self.gate = nn.Linear(args.hidden_size, args.num_experts, bias=False)
        self.switch_mlp = SwitchGLU(args.hidden_size, args.moe_intermediate_size, args.num_experts)

    def __call__(self, x: mx.array) -> mx.array:
        experts, weights = route(self.gate(x), self.top_k, self.norm_topk_prob)  # (B, L, k)
        return (self.switch_mlp(x, experts) * weights[..., None]).sum(axis=-2)  # (B, L, hidden)


# The blocks, backbone and model below run llama's forward passes; only what they are
# built from differs (an MLP kind per layer), so each builds its own parts in __init__
# (nn.Module.__init__, not llama's, which would build dense layers) and inherits the rest.


class DecoderLayer(llama.TransformerBlock):
    def __init__(self, args: ModelArgs, layer_idx: int):
        nn.Module.__init__(self)
        self.layer_type = args.layer_types[layer_idx]
        self.self_attn = Attention(args)
        if args.is_moe_layer(layer_idx):
            self.mlp = SparseMoeBlock(args)
        else:
            self.mlp = MLP(args.hidden_size, args.intermediate_size)
        self.input_layernorm = nn.RMSNorm(args.hidden_size, eps=args.rms_norm_eps)
        self.post_attention_layernorm = nn.RMSNorm(args.hidden_size, eps=args.rms_norm_eps)


class Qwen3MoeModel(llama.LlamaModel):
    def __init__(self, args: ModelArgs):
        nn.Module.__init__(self)
        self.embed_tokens = nn.Embedding(args.vocab_size, args.hidden_size)
        self.layers = [DecoderLayer(args, i) for i in range(args.num_hidden_layers)]
        self.norm = nn.RMSNorm(args.hidden_size, eps=args.rms_norm_eps)
        self.sliding_window = args.sliding_window


class Model(llama.Model):
    def __init__(self, args: ModelArgs):
        nn.Module.__init__(self)
        self.args = args
        self.model_type = args.model_type
        self.model = Qwen3MoeModel(args)
        if not args.tie_word_embeddings:
            self.lm_head = nn.Linear(args.hidden_size, args.vocab_size, bias=False)

    def sanitize(self, weights: Dict[str, mx.array]) -> Dict[str, mx.array]:
        """llama's, then per-expert or fused experts -> stacked `switch_mlp`. Each rewrite
        consumes the keys it reads, so converted weights (and a second call) pass unchanged."""
        return split_fused_experts(stack_expert_weights(super().sanitize(weights)))

    def shard(self, group: Optional[mx.distributed.Group] = None) -> None:
        """Tensor parallel as llama; MoE layers split every expert's hidden units and
        all-sum the block once (the router stays whole, so routing is identical)."""
        group = sharding.world(group)
        for layer in self.layers:
            attn = layer.self_attn
            attn.n_heads, attn.n_kv_heads = sharding.shard_attention(attn, attn.n_heads, attn.n_kv_heads, group)
            if isinstance(layer.mlp, SparseMoeBlock):
                sharding.shard_moe(layer.mlp, layer.mlp.switch_mlp, group)
            else:
                sharding.shard_mlp(layer.mlp, group)

    def quant_predicate(self, path: str, module: nn.Module) -> Union[bool, Dict[str, int]]:
        # Routers are small and their top-k choice is sensitive: 8 bits (qwen3_next's rule).
        return quant_predicate(path, module)
