"""Apertus (`apertus`, ApertusForCausalLM: swiss-ai/Apertus-8B-2509, Apertus-70B-2509):
llama with q/k norms and a non-gated xIELU MLP.

What differs from llama:
- The MLP is down_proj(xielu(up_proj(x))): no gate, and the activation has learned
  scalars per layer (`mlp.act_fn.alpha_p`, `alpha_n`, `beta`, `eps`; activations.XIELU).
  transformers saves alpha_p and alpha_n as (1,), MLX converters as (); sanitize
  takes both.
- Each query and key head is RMS-normalised before rope (`q_norm`, `k_norm`), always:
  the hub's `qk_norm` is true in every checkpoint and transformers has no switch.
- The norms are `attention_layernorm` and `feedforward_layernorm` (pre-norm, as llama).
- q/k/v/o carry biases with `attention_bias`; the MLP never has one.
- Rope: transformers' default is llama3 scaling (theta 1.2e7, factor 8, original
  context 8192). transformers 5 uses that default whenever a config gives no
  `rope_scaling` / `rope_parameters`, even if it gives a `rope_theta` (that theta is then
  ignored); so do we.
Reference: transformers `models/apertus/modeling_apertus.py`, `configuration_apertus.py`,
`activations.py` (XIELUActivation).
"""

from dataclasses import dataclass
from typing import Dict, Optional

import mlx.core as mx
import mlx.nn as nn

from . import llama, sharding
from .activations import XIELU, activation

# ApertusConfig's rope when a config names none.
DEFAULT_ROPE = {"rope_type": "llama3", "rope_theta": 12_000_000.0, "factor": 8.0,
                "original_max_position_embeddings": 8192, "low_freq_factor": 1.0, "high_freq_factor": 4.0}


@dataclass
class ModelArgs(llama.ModelArgs):
    """ApertusConfig's keys (llama's plus hidden_act, and the hub's qk_norm, post_norm,
    mlp_bias, which only one value each is valid for), with its defaults."""

    rms_norm_eps: float = 1e-5
    max_position_embeddings: int = 65536
    hidden_act: str = "xielu"
    qk_norm: Optional[bool] = None
    post_norm: bool = False

    def __post_init__(self):
        for name, allowed in (("qk_norm", (None, True)), ("post_norm", (False,)), ("mlp_bias", (False,))):
            if getattr(self, name) not in allowed:
                raise ValueError(f"{name}={getattr(self, name)!r} is not an Apertus layout (transformers' "
                                 f"Apertus has q/k norms, no post-norms and no MLP biases)")
        self.qk_norm = True  # read by llama.Attention
        if self.hidden_act != "xielu":
            activation(self.hidden_act)  # a known name, else a ValueError naming it
        if self.rope_scaling is None and self.rope_parameters is None:
            self.rope_parameters, self.rope_theta = dict(DEFAULT_ROPE), None  # transformers 5's default
        super().__post_init__()


class MLP(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.up_proj = nn.Linear(args.hidden_size, args.intermediate_size, bias=False)
        self.down_proj = nn.Linear(args.intermediate_size, args.hidden_size, bias=False)
        self.act_fn = XIELU() if args.hidden_act == "xielu" else activation(args.hidden_act)

    def __call__(self, x: mx.array) -> mx.array:
        return self.down_proj(self.act_fn(self.up_proj(x)))


class DecoderLayer(nn.Module):
    def __init__(self, args: ModelArgs, layer_type: str = llama.FULL):
        super().__init__()
        self.layer_type = layer_type
        self.self_attn = llama.Attention(args)
        self.mlp = MLP(args)
        self.attention_layernorm = nn.RMSNorm(args.hidden_size, eps=args.rms_norm_eps)
        self.feedforward_layernorm = nn.RMSNorm(args.hidden_size, eps=args.rms_norm_eps)

    def __call__(self, x: mx.array, mask: Optional[mx.array] = None, cache=None) -> mx.array:
        h = x + self.self_attn(self.attention_layernorm(x), mask, cache)
        return h + self.mlp(self.feedforward_layernorm(h))


class ApertusModel(llama.LlamaModel):
    block_class = DecoderLayer


class Model(llama.Model):
    """llama's LM head and caches over Apertus blocks."""

    # KV caches roll back by themselves; the layers record nothing.
    supports_speculative_rollback = True
    backbone_class = ApertusModel

    def sanitize(self, weights: Dict[str, mx.array]) -> Dict[str, mx.array]:
        """llama's, and transformers' (1,) xIELU alpha_p / alpha_n -> the () MLX keeps
        (by shape, so a second pass changes nothing)."""
        weights = super().sanitize(weights)
        return {k: v.reshape(()) if k.endswith((".act_fn.alpha_p", ".act_fn.alpha_n")) and v.ndim else v
                for k, v in weights.items()}

    def shard(self, group: Optional[mx.distributed.Group] = None) -> None:
        """llama's tensor parallelism with a gateless MLP: up_proj by hidden units,
        down_proj by the matching columns; the xIELU scalars stay whole."""
        group = sharding.world(group)
        for layer in self.layers:
            attn = layer.self_attn
            attn.n_heads, attn.n_kv_heads = sharding.shard_attention(attn, attn.n_heads, attn.n_kv_heads, group)
            sharding.shard_mlp(layer.mlp, group, inputs=("up_proj",))
