"""StableLM (`stablelm`, StableLmForCausalLM: stablelm-3b-4e1t, stablelm-2-1_6b,
stablelm-2-12b, stable-code-3b, and their chat releases).

What differs from llama:
- Norms are LayerNorms with a bias (`layer_norm_eps`), the final one too.
- Rope turns only the first `partial_rotary_factor` (default 0.25) of each head's
  features, in rotate-half pairs; the rest pass. The factor is a top-level key in the
  hub's configs and sits in `rope_parameters` in transformers 5's.
- q/k/v carry biases with `use_qkv_bias`; o_proj never has one.
- `qk_layernorm` (stablelm-2-12b): queries and keys pass a bias-free LayerNorm per head
  before rope, each head with its own weights. transformers stores one LayerNorm per
  head (`self_attn.q_layernorm.norms.{h}.weight`, (D,)); we hold them stacked as
  `self_attn.q_norm.weight` (H, D), Command R's layout (whose attention this runs),
  and `sanitize` stacks them.
- `use_parallel_residual` (stablelm-2-12b): x + attn(norm(x)) + mlp(norm(x)), one
  norm per block; else llama's sequential block with two.
- head_dim is always hidden_size / num_attention_heads.
Weights are `model.*` (+ `lm_head.*` unless tied).
Reference: transformers `models/stablelm/modeling_stablelm.py`, `configuration_stablelm.py`.
"""

import re
from dataclasses import dataclass
from typing import Any, Dict, Optional

import mlx.core as mx
import mlx.nn as nn

from . import cohere, glm4, llama, sharding
from .base import BaseModelArgs, check_head_grouping
from .llama import FULL
from .rope_utils import resolve_rope

DEFAULT_PARTIAL_ROTARY_FACTOR = 0.25  # StableLmConfig's default
# transformers' per-head q/k LayerNorms: layers.{i}.self_attn.{q,k}_layernorm.norms.{h}.weight
_PER_HEAD_NORM = re.compile(r"^(.*\.self_attn\.)([qk])_layernorm\.norms\.(\d+)\.weight$")


@dataclass
class ModelArgs(BaseModelArgs):
    """StableLmConfig's keys, with its defaults."""

    model_type: str = "stablelm"
    vocab_size: int = 50304
    intermediate_size: int = 6912
    hidden_size: int = 2560
    num_hidden_layers: int = 32
    num_attention_heads: int = 32
    num_key_value_heads: int = 32
    hidden_act: str = "silu"
    max_position_embeddings: int = 4096
    layer_norm_eps: float = 1e-5
    tie_word_embeddings: bool = False
    rope_theta: Optional[float] = None  # transformers 4
    rope_scaling: Optional[Dict[str, Any]] = None  # transformers 4
    rope_parameters: Optional[Dict[str, Any]] = None  # transformers 5
    partial_rotary_factor: Optional[float] = None  # transformers 4; 5 puts it in rope_parameters
    use_qkv_bias: bool = False
    qk_layernorm: bool = False
    use_parallel_residual: bool = False

    sliding_window = None  # what llama's caches read: no layer slides
    qk_norm = False  # llama.Attention's RMSNorms; the per-head LayerNorms replace them
    o_bias = False  # read by llama.Attention

    def __post_init__(self):
        check_head_grouping(self.num_attention_heads, self.num_key_value_heads)
        if self.hidden_size % self.num_attention_heads:
            raise ValueError(
                f"hidden_size ({self.hidden_size}) must be a multiple of num_attention_heads "
                f"({self.num_attention_heads}): stablelm's head_dim is their quotient"
            )
        theta, self.rope_scaling, _ = resolve_rope(self.rope_theta, self.rope_scaling, self.rope_parameters)
        self.rope_theta = 10000.0 if theta is None else theta
        self.partial_rotary_factor = glm4.resolve_partial_rotary(
            self.partial_rotary_factor, self.rope_parameters, DEFAULT_PARTIAL_ROTARY_FACTOR)
        if self.hidden_act != "silu":
            raise ValueError(f"hidden_act {self.hidden_act!r} is not supported; stablelm uses 'silu'")

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads

    @property
    def rotary_dims(self) -> int:  # read by glm4.Attention
        return int(self.head_dim * self.partial_rotary_factor)

    @property
    def qkv_bias(self) -> bool:  # read by llama.Attention
        return self.use_qkv_bias

    @property
    def use_qk_norm(self) -> bool:  # read by cohere.Attention
        return self.qk_layernorm


class Attention(cohere.Attention):
    """Command R's attention (per-head q/k LayerNorms with qk_layernorm) with partial
    rotate-half rope instead of its interleaved whole-head one."""

    traditional = False


class DecoderLayer(nn.Module):
    def __init__(self, args: ModelArgs, layer_type: str):
        super().__init__()
        self.layer_type = layer_type
        self.self_attn = Attention(args)
        self.mlp = llama.MLP(args.hidden_size, args.intermediate_size)  # SwiGLU, no biases
        self.input_layernorm = nn.LayerNorm(args.hidden_size, eps=args.layer_norm_eps)
        self.parallel = args.use_parallel_residual
        if not self.parallel:
            self.post_attention_layernorm = nn.LayerNorm(args.hidden_size, eps=args.layer_norm_eps)

    def __call__(self, x: mx.array, mask: Optional[mx.array] = None, cache=None) -> mx.array:
        h = self.input_layernorm(x)
        if self.parallel:  # GPT-NeoX's parallel residual: one norm feeds both
            return x + self.self_attn(h, mask, cache) + self.mlp(h)
        h = x + self.self_attn(h, mask, cache)
        return h + self.mlp(self.post_attention_layernorm(h))


class StableLmModel(llama.LlamaModel):
    """llama's backbone with a final LayerNorm (with a bias)."""

    def __init__(self, args: ModelArgs):
        nn.Module.__init__(self)  # not LlamaModel's: its norm is an RMSNorm
        self.sliding_window = args.sliding_window
        self.embed_tokens = nn.Embedding(args.vocab_size, args.hidden_size)
        self.layers = [DecoderLayer(args, FULL) for _ in range(args.num_hidden_layers)]
        self.norm = nn.LayerNorm(args.hidden_size, eps=args.layer_norm_eps)


def stack_head_norms(weights: Dict[str, mx.array]) -> Dict[str, mx.array]:
    """transformers' per-head q/k LayerNorms, `self_attn.q_layernorm.norms.{h}.weight`
    (D,) each, -> one `self_attn.q_norm.weight` (H, D) per layer (k likewise); other
    tensors, and already stacked ones, pass unchanged."""
    out, heads = {}, {}
    for key, value in weights.items():
        match = _PER_HEAD_NORM.match(key)
        if match is None:
            out[key] = value
        else:
            heads.setdefault(f"{match[1]}{match[2]}_norm.weight", {})[int(match[3])] = value
    for key, rows in heads.items():
        out[key] = mx.stack([rows[h] for h in sorted(rows)])  # (H, D)
    return out


class Model(llama.Model):
    """llama's LM head (tied or `lm_head`) and KV caches over StableLM's blocks."""

    # KV caches roll back by themselves; the layers record nothing.
    supports_speculative_rollback = True
    backbone_class = StableLmModel

    def sanitize(self, weights: Dict[str, mx.array]) -> Dict[str, mx.array]:
        """llama's (drops rope buffers and a tied lm_head), then the per-head q/k norms
        stacked; a second pass finds nothing to stack."""
        return stack_head_norms(super().sanitize(weights))

    def shard(self, group: Optional[mx.distributed.Group] = None) -> None:
        """llama's tensor parallelism (heads and MLP units split, o_proj and down_proj
        all-sum); the per-head q/k norms keep the rows of the rank's heads."""
        group = sharding.world(group)
        super().shard(group)
        cohere.shard_head_norms(self.layers, group)
