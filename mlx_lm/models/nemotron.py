"""Nemotron (`nemotron`, NemotronForCausalLM: nvidia/Nemotron-4-Minitron-4B, Minitron-8B,
Mistral-NeMo-Minitron-8B, Nemotron-Mini-4B): llama's grouped-query attention with
partial rope, a non-gated squared-ReLU MLP and "1p" LayerNorms.

What differs from llama:
- Norms are LayerNorms with a bias whose scale is stored zero-centred: the weight
  applied is 1 + `weight` (NemotronLayerNorm1P), so a checkpoint's weight stays as
  saved and the +1 happens in the forward (sanitize never shifts it).
- The MLP is down_proj(relu(up_proj(x))^2) (`hidden_act` "relu2"), no gate; biases with
  `mlp_bias`.
- Rope turns the first `partial_rotary_factor` (default 0.5) of each head's features in
  rotate-half pairs; the rest pass. The factor is top-level in the hub's configs and in
  `rope_parameters` in transformers 5's.
- q/k/v/o carry biases with `attention_bias`. `norm_eps` is the norms' epsilon.
Reference: transformers `models/nemotron/modeling_nemotron.py`, `configuration_nemotron.py`.
"""

from dataclasses import dataclass
from typing import Optional

import mlx.core as mx
import mlx.nn as nn

from . import glm4, glm4_moe, llama, sharding
from .activations import activation

DEFAULT_PARTIAL_ROTARY_FACTOR = 0.5  # NemotronConfig's


@dataclass
class ModelArgs(llama.ModelArgs):
    """NemotronConfig's keys (llama's plus norm_eps, hidden_act, partial_rotary_factor),
    with its defaults."""

    norm_eps: float = 1e-5
    hidden_act: str = "relu2"
    max_position_embeddings: int = 4096
    partial_rotary_factor: Optional[float] = None  # transformers 4; 5 puts it in rope_parameters

    def __post_init__(self):
        super().__post_init__()
        activation(self.hidden_act)  # a known name, else a ValueError naming it
        # transformers: the factor in rope_parameters wins over the top-level one.
        top_level = self.partial_rotary_factor
        self.partial_rotary_factor = glm4.resolve_partial_rotary(
            None, self.rope_parameters, DEFAULT_PARTIAL_ROTARY_FACTOR if top_level is None else top_level)

    @property
    def rotary_dims(self) -> int:  # read by glm4.Attention
        return int(self.head_dim * self.partial_rotary_factor)


class LayerNorm1P(nn.LayerNorm):
    """LayerNorm applying 1 + weight (the stored weight is zero-centred) and its bias."""

    def __call__(self, x: mx.array) -> mx.array:
        return mx.fast.layer_norm(x, 1.0 + self.weight, self.bias, self.eps)


class MLP(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.up_proj = nn.Linear(args.hidden_size, args.intermediate_size, bias=args.mlp_bias)
        self.down_proj = nn.Linear(args.intermediate_size, args.hidden_size, bias=args.mlp_bias)
        self.act = activation(args.hidden_act)

    def __call__(self, x: mx.array) -> mx.array:
        return self.down_proj(self.act(self.up_proj(x)))


class DecoderLayer(nn.Module):
    def __init__(self, args: ModelArgs, layer_type: str = llama.FULL):
        super().__init__()
        self.layer_type = layer_type
        self.self_attn = glm4_moe.Attention(args)  # partial rope, rotate-half pairs
        self.mlp = MLP(args)
        self.input_layernorm = LayerNorm1P(args.hidden_size, eps=args.norm_eps)
        self.post_attention_layernorm = LayerNorm1P(args.hidden_size, eps=args.norm_eps)

    def __call__(self, x: mx.array, mask: Optional[mx.array] = None, cache=None) -> mx.array:
        h = x + self.self_attn(self.input_layernorm(x), mask, cache)
        return h + self.mlp(self.post_attention_layernorm(h))


class NemotronModel(llama.LlamaModel):
    block_class = DecoderLayer

    def __init__(self, args: ModelArgs):
        super().__init__(args)
        self.norm = LayerNorm1P(args.hidden_size, eps=args.norm_eps)  # replaces llama's RMSNorm


class Model(llama.Model):
    """llama's LM head, sanitize and caches over Nemotron blocks."""

    # KV caches roll back by themselves; the layers record nothing.
    supports_speculative_rollback = True
    backbone_class = NemotronModel

    def shard(self, group: Optional[mx.distributed.Group] = None) -> None:
        """llama's tensor parallelism with a gateless MLP (up_proj by hidden units)."""
        group = sharding.world(group)
        for layer in self.layers:
            attn = layer.self_attn
            attn.n_heads, attn.n_kv_heads = sharding.shard_attention(attn, attn.n_heads, attn.n_kv_heads, group)
            sharding.shard_mlp(layer.mlp, group, inputs=("up_proj",))
