"""Mixtral (Mixtral-8x7B, -8x22B): llama's attention with a sparse mixture of SwiGLU
experts in place of the MLP.

What differs from llama:
- Each layer's MLP is `block_sparse_moe`: a softmax router `gate` over
  `num_local_experts` experts, the `num_experts_per_tok` best renormalised to sum to 1
  (always, unlike qwen3_moe's `norm_topk_prob`), and the weighted sum of their SwiGLUs
  (`switch_mlp`, each of `intermediate_size`). No shared expert, no dense layers.
- A `sliding_window` in the config makes every layer slide (transformers' MixtralModel
  picks its sliding mask whenever the key is not null), cached in a RotatingKVCache;
  null (Mixtral-8x7B-v0.1 and later) is full attention.
- `router_jitter_noise` only acts in training and is ignored.
- Experts arrive as the hub stores them (`block_sparse_moe.experts.{e}.w1/w2/w3.weight`:
  gate, down, up; also what transformers 5 saves) or as transformers 5 holds them in
  memory (`mlp.gate.weight`, `mlp.experts.gate_up_proj` (E, 2I, H), gate rows first,
  `mlp.experts.down_proj` (E, H, I)); `sanitize` stacks or splits either into
  `block_sparse_moe.switch_mlp.{gate,up,down}_proj.weight` (E, out, in).
Reference: transformers `models/mixtral/modeling_mixtral.py`.
"""

import re
from dataclasses import dataclass
from typing import Dict, Optional, Tuple, Union

import mlx.core as mx
import mlx.nn as nn

from . import llama, sharding
from .llama import SLIDING, Attention
from .qwen3_next import route
from .switch_layers import SwitchGLU

Weights = Dict[str, mx.array]
# The hub's per-expert names -> switch_mlp's.
HUB_EXPERT_NAMES = {"w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"}


def check_top_k(num_experts_per_tok: int, num_experts: int, name: str = "num_local_experts",
                top_k_name: str = "num_experts_per_tok") -> None:
    """Each token picks 1..E experts, else a ValueError naming both fields and values."""
    if not 0 < num_experts_per_tok <= num_experts:
        raise ValueError(f"{top_k_name} ({num_experts_per_tok}) must be in 1..{name} ({num_experts})")


@dataclass
class ModelArgs(llama.ModelArgs):
    """MixtralConfig's keys (llama's plus the experts'), with its defaults."""

    rms_norm_eps: float = 1e-5
    num_local_experts: int = 8
    num_experts_per_tok: int = 2

    def __post_init__(self):
        super().__post_init__()
        check_top_k(self.num_experts_per_tok, self.num_local_experts)

    def _set_layer_types(self):
        # Every layer slides when the config names a window (transformers' rule).
        if self.layer_types is None and self.sliding_window is not None:
            self.layer_types = [SLIDING] * self.num_hidden_layers
        super()._set_layer_types()


class SparseMoeBlock(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.top_k = args.num_experts_per_tok
        self.gate = nn.Linear(args.hidden_size, args.num_local_experts, bias=False)
        self.switch_mlp = SwitchGLU(args.hidden_size, args.intermediate_size, args.num_local_experts)

    def __call__(self, x: mx.array) -> mx.array:
        experts, weights = route(self.gate(x), self.top_k, normalize=True)  # (B, L, k)
        return (self.switch_mlp(x, experts) * weights[..., None]).sum(axis=-2)  # (B, L, hidden)


class DecoderLayer(nn.Module):
    def __init__(self, args: ModelArgs, layer_type: str):
        super().__init__()
        self.layer_type = layer_type
        self.self_attn = Attention(args)
        self.block_sparse_moe = SparseMoeBlock(args)
        self.input_layernorm = nn.RMSNorm(args.hidden_size, eps=args.rms_norm_eps)
        self.post_attention_layernorm = nn.RMSNorm(args.hidden_size, eps=args.rms_norm_eps)

    def __call__(self, x: mx.array, mask: Optional[mx.array] = None, cache=None) -> mx.array:
        h = x + self.self_attn(self.input_layernorm(x), mask, cache)
        return h + self.block_sparse_moe(self.post_attention_layernorm(h))


class MixtralModel(llama.LlamaModel):
    block_class = DecoderLayer


_PER_EXPERT = re.compile(r"^(.*)\.experts\.(\d+)\.(\w+)\.weight$")


def stack_experts(weights: Weights, names: Dict[str, str]) -> Weights:
    """`{block}.experts.{e}.{name}.weight` (out, in), for each `name` in `names` ->
    `{block}.switch_mlp.{names[name]}.weight` (E, out, in); other keys pass."""
    out, groups = {}, {}
    for key, value in weights.items():
        match = _PER_EXPERT.match(key)
        if match and match.group(3) in names:
            block, expert, name = match.groups()
            groups.setdefault((block, names[name]), {})[int(expert)] = value
        else:
            out[key] = value
    for (block, proj), experts in groups.items():
        if sorted(experts) != list(range(len(experts))):
            raise ValueError(
                f"{block}.experts has {proj} for experts {sorted(experts)}; expected 0..{len(experts) - 1}"
            )
        out[f"{block}.switch_mlp.{proj}.weight"] = mx.stack([experts[e] for e in range(len(experts))])
    return out


def from_memory_layout(weights: Weights, memory: Tuple[str, str], hub: Tuple[str, str]) -> Weights:
    """transformers 5's in-memory MoE tensors -> ours: its block `memory[0]` with router
    `memory[1]` is the hub's block `hub[0]` with router `hub[1]`; `experts.gate_up_proj`
    (E, 2I, H), gate rows first, and `experts.down_proj` (E, H, I) become switch_mlp's.
    Only keys under `.{memory[0]}.experts.` or naming its router change."""
    (block, router), (hub_block, hub_router) = memory, hub
    out = {}
    for key, value in weights.items():
        head, sep, tail = key.partition(f".{block}.")
        stem = f"{head}.{hub_block}."
        if sep and tail == "experts.gate_up_proj":
            gate, up = mx.split(value, 2, axis=1)
            out[stem + "switch_mlp.gate_proj.weight"], out[stem + "switch_mlp.up_proj.weight"] = gate, up
        elif sep and tail == "experts.down_proj":
            out[stem + "switch_mlp.down_proj.weight"] = value
        elif sep and tail == f"{router}.weight":
            out[stem + f"{hub_router}.weight"] = value
        else:
            out[key] = value
    return out


class Model(llama.Model):
    # KV and rotating caches roll back by themselves; the layers record nothing.
    supports_speculative_rollback = True
    backbone_class = MixtralModel

    def sanitize(self, weights: Weights) -> Weights:
        """llama's (rope buffers, a tied lm_head), then either expert layout -> stacked
        `switch_mlp`; each rewrite consumes the keys it reads, so a second pass (the MLX
        layout) changes nothing."""
        weights = from_memory_layout(super().sanitize(weights), ("mlp", "gate"), ("block_sparse_moe", "gate"))
        return stack_experts(weights, HUB_EXPERT_NAMES)

    def shard(self, group: Optional[mx.distributed.Group] = None) -> None:
        """Attention by heads; every expert's hidden units split across ranks and the
        block all-summed once. The router stays whole, so routing is identical."""
        group = sharding.world(group)
        for layer in self.layers:
            attn = layer.self_attn
            attn.n_heads, attn.n_kv_heads = sharding.shard_attention(attn, attn.n_heads, attn.n_kv_heads, group)
            sharding.shard_moe(layer.block_sparse_moe, layer.block_sparse_moe.switch_mlp, group)

    def quant_predicate(self, path: str, module: nn.Module) -> Union[bool, Dict[str, int]]:
        # The router is small and its top-k choice sensitive: 8 bits (qwen3_moe's rule).
        if path.endswith("block_sparse_moe.gate"):
            return {"group_size": 64, "bits": 8}
        return True
