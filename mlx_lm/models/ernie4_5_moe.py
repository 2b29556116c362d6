"""ERNIE 4.5 MoE (`ernie4_5_moe`, Ernie4_5_MoeForCausalLM: baidu/ERNIE-4.5-21B-A3B-PT,
-300B-A47B-PT): ERNIE 4.5's dense layers (interleaved rope, `use_bias`) with softmax
experts chosen through a correction bias, plus shared experts.

What differs from ernie4_5:
- Layer i is MoE when (i + 1) is a multiple of `moe_layer_interval` and
  `moe_layer_start_index` <= i <= `moe_layer_end_index` (-1: the last layer); else a
  SwiGLU of `intermediate_size`.
- The router (`gate`, weight (E, H), applied in fp32) gives softmax probabilities p;
  the `moe_k` experts with the largest p + `moe_statics.e_score_correction_bias` are
  chosen, weighted by p renormalised (the sum clamped below at `moe_norm_min`). Plus
  `shared_experts`, one SwiGLU of `moe_num_shared_experts * moe_intermediate_size`
  (with `use_bias`), when that count is positive. The routed experts have no biases;
  lm_head has one with `use_bias` (also when tied to the embeddings).
- Multi-token-prediction weights (`mtp*`) in the hub checkpoints are dropped, as
  transformers drops them.
- The hub stores the bias as `mlp.moe_statics.e_score_correction_bias` (1, E), and so
  does transformers' save; transformers 5 holds it as `mlp.gate.moe_statics.*` and the
  experts fused (`mlp.experts.gate_up_proj`, `mlp.experts.down_proj`). `sanitize` takes
  either, and per-expert `mlp.experts.{e}.{gate,up,down}_proj` -> `mlp.switch_mlp.*`.
Reference: transformers `models/ernie4_5_moe/modeling_ernie4_5_moe.py`.
"""

from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Tuple

import mlx.core as mx
import mlx.nn as nn

from . import ernie4_5, llama, sharding
from .granitemoehybrid import Router
from .llama import MLP
from .mixtral import check_top_k
from .qwen3_next import split_fused_experts, stack_expert_weights
from .switch_layers import SwitchGLU


@dataclass
class ModelArgs(ernie4_5.ModelArgs):
    """Ernie4_5_MoeConfig's keys (ernie4_5's plus the experts'), with its defaults."""

    moe_intermediate_size: int = 1536
    moe_k: int = 6
    moe_num_experts: int = 64
    moe_num_shared_experts: int = 2
    moe_layer_start_index: int = 1
    moe_layer_end_index: int = -1  # the last layer
    moe_layer_interval: int = 1
    moe_norm_min: float = 1e-12

    def __post_init__(self):
        super().__post_init__()
        if self.moe_layer_end_index == -1:
            self.moe_layer_end_index = self.num_hidden_layers - 1
        if self.moe_layer_interval < 1:
            raise ValueError(f"moe_layer_interval must be >= 1, got {self.moe_layer_interval}")
        if any(self.is_moe_layer(i) for i in range(self.num_hidden_layers)):
            check_top_k(self.moe_k, self.moe_num_experts, "moe_num_experts", "moe_k")

    def is_moe_layer(self, i: int) -> bool:
        return (i + 1) % self.moe_layer_interval == 0 and self.moe_layer_start_index <= i <= self.moe_layer_end_index


def route(logits: mx.array, correction_bias: mx.array, top_k: int, norm_min: float) -> Tuple[mx.array, mx.array]:
    """Softmax router with a choice bias: logits (..., E) -> expert ids (..., k) and
    weights (..., k), fp32: the k largest p + correction_bias (E,), weighted by their p
    over its sum (clamped below at norm_min)."""
    probs = mx.softmax(logits.astype(mx.float32), axis=-1, precise=True)
    choice = probs + correction_bias.astype(mx.float32)
    experts = mx.stop_gradient(mx.argpartition(-choice, kth=top_k - 1, axis=-1)[..., :top_k])
    weights = mx.take_along_axis(probs, experts, axis=-1)
    return experts, weights / mx.maximum(weights.sum(axis=-1, keepdims=True), norm_min)


class Statics(nn.Module):
    """The router's choice bias, (1, E) as stored (one expert group)."""

    def __init__(self, num_experts: int):
        super().__init__()
        self.e_score_correction_bias = mx.zeros((1, num_experts))


class SparseMoeBlock(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.top_k, self.norm_min = args.moe_k, args.moe_norm_min
        self.gate = Router(args.hidden_size, args.moe_num_experts)
        self.moe_statics = Statics(args.moe_num_experts)
        self.switch_mlp = SwitchGLU(args.hidden_size, args.moe_intermediate_size, args.moe_num_experts)
        if args.moe_num_shared_experts > 0:
            hidden = args.moe_intermediate_size * args.moe_num_shared_experts
            self.shared_experts = MLP(args.hidden_size, hidden, bias=args.use_bias)

    def __call__(self, x: mx.array) -> mx.array:
        logits = x.astype(mx.float32) @ self.gate.weight.astype(mx.float32).T  # (B, L, E), fp32 as transformers
        experts, weights = route(logits, self.moe_statics.e_score_correction_bias[0], self.top_k, self.norm_min)
        routed = (self.switch_mlp(x, experts) * weights[..., None].astype(x.dtype)).sum(axis=-2)  # (B, L, hidden)
        return routed + self.shared_experts(x) if "shared_experts" in self else routed


# ernie4_5's block and backbone with the MoE block swapped in on MoE layers (MLX
# initialises lazily, so the replaced dense MLPs are never computed).


class DecoderLayer(ernie4_5.DecoderLayer):
    def __init__(self, args: ModelArgs, layer_idx: int):
        super().__init__(args, llama.FULL)
        if args.is_moe_layer(layer_idx):
            self.mlp = SparseMoeBlock(args)


class Ernie4_5MoeModel(ernie4_5.Ernie4_5Model):
    def __init__(self, args: ModelArgs):
        super().__init__(args)
        self.layers = [DecoderLayer(args, i) for i in range(args.num_hidden_layers)]


_MEMORY_BIAS = ".mlp.gate.moe_statics.e_score_correction_bias"


class OutputBias(nn.Module):
    """lm_head's bias alone, for tied embeddings (the weight is embed_tokens')."""

    def __init__(self, vocab_size: int):
        super().__init__()
        self.bias = mx.zeros((vocab_size,))


class Model(ernie4_5.Model):
    backbone_class = Ernie4_5MoeModel

    def __init__(self, args: ModelArgs):
        super().__init__(args)
        if args.use_bias:  # unlike the dense family, lm_head has a bias too
            tied = args.tie_word_embeddings
            self.lm_head = OutputBias(args.vocab_size) if tied else nn.Linear(args.hidden_size, args.vocab_size)

    def __call__(
        self, inputs: mx.array, cache: Optional[List[Any]] = None, input_embeddings: Optional[mx.array] = None
    ) -> mx.array:
        logits = super().__call__(inputs, cache, input_embeddings)
        return logits + self.lm_head.bias if isinstance(self.get("lm_head"), OutputBias) else logits

    def sanitize(self, weights: Dict[str, mx.array]) -> Dict[str, mx.array]:
        """llama's; MTP weights dropped; transformers 5's in-memory bias name -> the
        hub's; per-expert or fused experts -> stacked `switch_mlp`. Each rewrite consumes
        the keys it reads, so converted weights (and a second call) pass unchanged."""
        weights = {k.replace(_MEMORY_BIAS, ".mlp.moe_statics.e_score_correction_bias"): v
                   for k, v in super().sanitize(weights).items() if "mtp" not in k}
        return split_fused_experts(stack_expert_weights(weights))

    def shard(self, group: Optional[mx.distributed.Group] = None) -> None:
        """Attention by heads; MoE layers split every routed and shared expert's hidden
        units and all-sum the block once; dense layers as llama. The router stays whole."""
        group = sharding.world(group)
        for layer in self.layers:
            attn = layer.self_attn
            attn.n_heads, attn.n_kv_heads = sharding.shard_attention(attn, attn.n_heads, attn.n_kv_heads, group)
            if isinstance(layer.mlp, SparseMoeBlock):
                if "shared_experts" in layer.mlp:
                    sharding.shard_mlp(layer.mlp.shared_experts, group, reduce=False)
                sharding.shard_moe(layer.mlp, layer.mlp.switch_mlp, group)
            else:
                sharding.shard_mlp(layer.mlp, group)
