"""Command R (`cohere`, CohereForCausalLM: c4ai-command-r-v01, command-r-plus, Aya 23 and
Aya Expanse): Command R7B's (cohere2's) parallel block with every layer global and roped.

What differs from llama (the block, norms and logit scale as cohere2):
- Parallel blocks: x + attn(norm(x)) + mlp(norm(x)), one norm per block.
- Norms are LayerNorms without a bias (mean removed, weight only), in float32.
- Rope is the interleaved (GPT-J) kind, pairs (2i, 2i + 1), in every layer; no window.
- `use_qk_norm` (Command R+): queries and keys pass a bias-free LayerNorm per head before
  rope, with weights of their own for each head, (H, D) and (H_kv, D).
- Logits are scaled by `logit_scale`; embeddings are tied by default; rope theta
  defaults to 5e5.
Weights are `model.*` (+ `lm_head.*` unless tied), as transformers and MLX converters
save them.
Reference: transformers `models/cohere/modeling_cohere.py`, `configuration_cohere.py`.
"""

from dataclasses import dataclass
from typing import Any, Dict, List, Optional

import mlx.core as mx
import mlx.nn as nn

from . import cohere2, glm4, sharding
from .base import BaseModelArgs, check_head_grouping
from .llama import FULL
from .rope_utils import resolve_whole_head_rope

DEFAULT_THETA = 500_000.0  # CohereConfig.default_theta


@dataclass
class ModelArgs(BaseModelArgs):
    """CohereConfig's keys, with its defaults."""

    model_type: str = "cohere"
    vocab_size: int = 256000
    hidden_size: int = 8192
    intermediate_size: int = 22528
    logit_scale: float = 0.0625
    num_hidden_layers: int = 40
    num_attention_heads: int = 64
    num_key_value_heads: Optional[int] = None
    head_dim: Optional[int] = None  # transformers reads it when present; else hidden / heads
    hidden_act: str = "silu"
    max_position_embeddings: int = 8192
    layer_norm_eps: float = 1e-5
    tie_word_embeddings: bool = True
    rope_theta: Optional[float] = None  # transformers 4
    rope_scaling: Optional[Dict[str, Any]] = None  # transformers 4
    rope_parameters: Optional[Dict[str, Any]] = None  # transformers 5
    attention_bias: bool = False
    use_qk_norm: bool = False

    sliding_window = None  # what llama's backbone and caches read: no layer slides
    qk_norm = False  # llama.Attention's RMSNorms; Cohere's per-head LayerNorms replace them

    def __post_init__(self):
        if self.num_key_value_heads is None:
            self.num_key_value_heads = self.num_attention_heads
        check_head_grouping(self.num_attention_heads, self.num_key_value_heads)
        if self.head_dim is None:
            self.head_dim = self.hidden_size // self.num_attention_heads
        self.rope_theta, self.rope_scaling = resolve_whole_head_rope(
            self.model_type, self.rope_theta, self.rope_scaling, self.rope_parameters, DEFAULT_THETA)
        if self.hidden_act != "silu":
            raise ValueError(f"hidden_act {self.hidden_act!r} is not supported; cohere uses 'silu'")
        if not isinstance(self.logit_scale, (int, float)) or isinstance(self.logit_scale, bool):
            raise ValueError(f"logit_scale must be a number (the logits are multiplied by it), got {self.logit_scale!r}")

    @property
    def layer_types(self) -> List[str]:
        return [FULL] * self.num_hidden_layers

    @property
    def rotary_dims(self) -> int:  # read by glm4.Attention: the whole head turns
        return self.head_dim

    @property
    def qkv_bias(self) -> bool:  # read by llama.Attention
        return self.attention_bias

    @property
    def o_bias(self) -> bool:
        return self.attention_bias


def head_layer_norm(x: mx.array, weight: mx.array, eps: float) -> mx.array:
    """A bias-free LayerNorm of each head with that head's weights: x (..., H, D) and
    weight (H, D) -> (..., H, D), computed in float32 and cast back to x's dtype."""
    normed = mx.fast.layer_norm(x.astype(mx.float32), None, None, eps)
    return (normed * weight.astype(mx.float32)).astype(x.dtype)


class HeadLayerNorm(nn.Module):
    def __init__(self, num_heads: int, head_dim: int, eps: float):
        super().__init__()
        self.weight = mx.ones((num_heads, head_dim))
        self.eps = eps

    def __call__(self, x: mx.array) -> mx.array:
        return head_layer_norm(x, self.weight, self.eps)


class Attention(glm4.Attention):
    """llama's attention with interleaved whole-head rope (glm4's), and with use_qk_norm
    each head's queries and keys normalised before it."""

    def __init__(self, args: ModelArgs):
        super().__init__(args)
        if args.use_qk_norm:
            self.q_norm = HeadLayerNorm(self.n_heads, args.head_dim, args.layer_norm_eps)
            self.k_norm = HeadLayerNorm(self.n_kv_heads, args.head_dim, args.layer_norm_eps)
            self.qk_norm = True  # llama's forward applies them to (B, L, H, D) before rope


class DecoderLayer(cohere2.DecoderLayer):
    """cohere2's parallel block around Command R's attention (MLX initialises lazily:
    the attention replaced here is never computed)."""

    def __init__(self, args: ModelArgs, layer_type: str = FULL):
        super().__init__(args, layer_type)
        self.self_attn = Attention(args)


class CohereModel(cohere2.Backbone):
    """cohere2's backbone (embeddings, bias-free final LayerNorm) over Command R's blocks
    (cohere2's, built by its __init__, are replaced before any is computed)."""

    def __init__(self, args: ModelArgs):
        super().__init__(args)
        self.layers = [DecoderLayer(args) for _ in range(args.num_hidden_layers)]


class Model(cohere2.Model):
    """cohere2's LM head (tied or `lm_head`, times logit_scale), sanitize and caches (KV
    caches: no layer slides) over Command R's backbone."""

    # KV caches roll back by themselves; the layers record nothing.
    supports_speculative_rollback = True
    backbone_class = CohereModel

    def shard(self, group: Optional[mx.distributed.Group] = None) -> None:
        """llama's tensor parallelism (heads and MLP units split, o_proj and down_proj
        all-sum); the per-head q/k norms keep the rows of the rank's heads."""
        group = sharding.world(group)
        super().shard(group)
        shard_head_norms(self.layers, group)


def shard_head_norms(layers: List[nn.Module], group: mx.distributed.Group) -> None:
    """Each layer's per-head q/k norms (when it has them) keep the rows of the heads
    this rank holds: contiguous blocks, as shard_attention splits the heads."""
    for layer in layers:
        attn = layer.self_attn
        if attn.qk_norm:
            attn.q_norm.weight = sharding.take_shard(attn.q_norm.weight, group)  # (H / N, D)
            attn.k_norm.weight = sharding.take_shard(attn.k_norm.weight, group)  # (H_kv / N, D)
