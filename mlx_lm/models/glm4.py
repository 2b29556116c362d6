"""GLM-4 (`glm4`, Glm4ForCausalLM: THUDM/GLM-4-9B-0414, GLM-4-32B-0414, GLM-Z1): llama's
grouped-query attention with partial interleaved rope, a fused SwiGLU and a sandwich
of norms.

What differs from llama:
- Rope turns only the first `partial_rotary_factor` (default 0.5) of each head's
  features, in interleaved pairs (x[2i], x[2i+1]): MLX's "traditional" rope. The other
  features pass unrotated. The factor is a top-level key in the hub's configs and sits
  in `rope_parameters` in transformers 5's.
- q/k/v carry biases (`attention_bias`, default True); o_proj has none.
- The MLP fuses gate and up in one projection, `gate_up_proj` -> [gate | up] (phi3's MLP).
- Each sublayer's output is normalised again before its residual add:
  h = x + post_self_attn_layernorm(attn(input_layernorm(x))),
  out = h + post_mlp_layernorm(mlp(post_attention_layernorm(h))).
Reference: transformers `models/glm4/modeling_glm4.py`, `configuration_glm4.py`.
"""

from dataclasses import dataclass
from typing import Optional

import mlx.core as mx
import mlx.nn as nn

from . import llama, sharding
from .phi3 import MLP  # the fused [gate | up] SwiGLU, with GLM-4's weight names
from .rope_utils import initialize_rope, resolve_rope

DEFAULT_PARTIAL_ROTARY_FACTOR = 0.5  # Glm4Config's default


def resolve_partial_rotary(top_level: Optional[float], rope_parameters: Optional[dict], default: float) -> float:
    """The rotated fraction of a head from either dialect (a top-level key wins), in (0, 1]."""
    _, _, in_rope = resolve_rope(None, None, rope_parameters)
    factor = top_level if top_level is not None else in_rope if in_rope is not None else default
    if not 0 < factor <= 1:
        raise ValueError(f"partial_rotary_factor must be in (0, 1], got {factor}")
    return factor


@dataclass
class ModelArgs(llama.ModelArgs):
    """Glm4Config's keys (llama's plus partial_rotary_factor), with its defaults."""

    rms_norm_eps: float = 1.5625e-07
    attention_bias: bool = True
    partial_rotary_factor: Optional[float] = None  # transformers 4; 5 puts it in rope_parameters

    o_bias = False
    default_partial_rotary_factor = DEFAULT_PARTIAL_ROTARY_FACTOR  # what a config naming none gets

    def __post_init__(self):
        super().__post_init__()
        self.partial_rotary_factor = resolve_partial_rotary(
            self.partial_rotary_factor, self.rope_parameters, self.default_partial_rotary_factor)

    @property
    def rotary_dims(self) -> int:
        return int(self.head_dim * self.partial_rotary_factor)


class Attention(llama.Attention):
    """llama's attention with rope on the first rotary_dims features, pairs interleaved
    (`traditional`; glm4_moe's pairs are the two halves instead)."""

    traditional = True

    def __init__(self, args: ModelArgs):
        super().__init__(args)
        self.rope = initialize_rope(args.rotary_dims, args.rope_theta, self.traditional, args.rope_scaling,
                                    args.max_position_embeddings)


class DecoderLayer(nn.Module):
    def __init__(self, args: ModelArgs, layer_type: str):
        super().__init__()
        self.layer_type = layer_type
        self.self_attn = Attention(args)
        self.mlp = MLP(args.hidden_size, args.intermediate_size)
        norm = lambda: nn.RMSNorm(args.hidden_size, eps=args.rms_norm_eps)  # noqa: E731
        self.input_layernorm, self.post_self_attn_layernorm = norm(), norm()
        self.post_attention_layernorm, self.post_mlp_layernorm = norm(), norm()

    def __call__(self, x: mx.array, mask: Optional[mx.array] = None, cache=None) -> mx.array:
        h = x + self.post_self_attn_layernorm(self.self_attn(self.input_layernorm(x), mask, cache))
        return h + self.post_mlp_layernorm(self.mlp(self.post_attention_layernorm(h)))


class Glm4Model(llama.LlamaModel):
    block_class = DecoderLayer


class Model(llama.Model):
    # KV caches roll back by themselves; the layers record nothing.
    supports_speculative_rollback = True
    backbone_class = Glm4Model

    def shard(self, group: Optional[mx.distributed.Group] = None) -> None:
        """llama's tensor parallelism; the fused gate_up_proj splits as two pieces, so each
        rank keeps matching gate and up rows."""
        group = sharding.world(group)
        for layer in self.layers:
            attn = layer.self_attn
            attn.n_heads, attn.n_kv_heads = sharding.shard_attention(attn, attn.n_heads, attn.n_kv_heads, group)
            sharding.shard_mlp(layer.mlp, group, inputs=("gate_up_proj",), segments=2)
