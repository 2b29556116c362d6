"""StarCoder2 (`starcoder2`, Starcoder2ForCausalLM: bigcode/starcoder2-3b, -7b, -15b):
Mistral's attention with biases, LayerNorms and a plain gelu MLP.

What differs from llama:
- Norms are LayerNorms with a bias (`norm_epsilon`), the final one too.
- The MLP is not gated: c_proj(gelu_tanh(c_fc(x))).
- `use_bias` (default True) puts biases on q/k/v/o and on c_fc/c_proj.
- `sliding_window`, when set, applies to every layer (Mistral's rule): a query sees its
  `sliding_window` most recent positions, itself included, and those layers cache in a
  `RotatingKVCache`. It may be null (no window: KV caches).
- Embeddings are tied by default.
Weights are `model.*` (+ `lm_head.*` unless tied), as transformers and MLX converters
save them.
Reference: transformers `models/starcoder2/modeling_starcoder2.py`, `configuration_starcoder2.py`.
"""

from dataclasses import dataclass
from typing import Any, Dict, List, Optional

import mlx.core as mx
import mlx.nn as nn

from . import llama, sharding
from .base import BaseModelArgs, check_head_grouping
from .llama import FULL, SLIDING
from .rope_utils import resolve_whole_head_rope


@dataclass
class ModelArgs(BaseModelArgs):
    """Starcoder2Config's keys, with its defaults."""

    model_type: str = "starcoder2"
    vocab_size: int = 49152
    hidden_size: int = 3072
    intermediate_size: int = 12288
    num_hidden_layers: int = 30
    num_attention_heads: int = 24
    num_key_value_heads: int = 2
    head_dim: Optional[int] = None  # transformers reads it when present; else hidden / heads
    hidden_act: str = "gelu_pytorch_tanh"
    max_position_embeddings: int = 4096
    norm_epsilon: float = 1e-5
    rope_theta: Optional[float] = None  # transformers 4
    rope_scaling: Optional[Dict[str, Any]] = None  # transformers 4
    rope_parameters: Optional[Dict[str, Any]] = None  # transformers 5
    sliding_window: Optional[int] = None
    use_bias: bool = True
    tie_word_embeddings: bool = True

    qk_norm = False  # what llama.Attention reads

    def __post_init__(self):
        check_head_grouping(self.num_attention_heads, self.num_key_value_heads)
        if self.head_dim is None:
            self.head_dim = self.hidden_size // self.num_attention_heads
        self.rope_theta, self.rope_scaling = resolve_whole_head_rope(
            self.model_type, self.rope_theta, self.rope_scaling, self.rope_parameters)
        if self.sliding_window is not None and not (isinstance(self.sliding_window, int) and self.sliding_window > 0):
            raise ValueError(f"sliding_window must be a positive int or null, got {self.sliding_window!r}")
        if self.hidden_act != "gelu_pytorch_tanh":
            raise ValueError(f"hidden_act {self.hidden_act!r} is not supported; starcoder2 uses 'gelu_pytorch_tanh'")

    @property
    def layer_types(self) -> List[str]:
        return [FULL if self.sliding_window is None else SLIDING] * self.num_hidden_layers

    @property
    def qkv_bias(self) -> bool:  # read by llama.Attention
        return self.use_bias

    @property
    def o_bias(self) -> bool:
        return self.use_bias


class MLP(nn.Module):
    def __init__(self, dim: int, hidden_dim: int, bias: bool):
        super().__init__()
        self.c_fc = nn.Linear(dim, hidden_dim, bias=bias)
        self.c_proj = nn.Linear(hidden_dim, dim, bias=bias)

    def __call__(self, x: mx.array) -> mx.array:
        # gelu_pytorch_tanh: 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3))), mx's gelu_approx.
        return self.c_proj(nn.gelu_approx(self.c_fc(x)))


class DecoderLayer(nn.Module):
    def __init__(self, args: ModelArgs, layer_type: str):
        super().__init__()
        self.layer_type = layer_type
        self.self_attn = llama.Attention(args)
        self.mlp = MLP(args.hidden_size, args.intermediate_size, args.use_bias)
        self.input_layernorm = nn.LayerNorm(args.hidden_size, eps=args.norm_epsilon)
        self.post_attention_layernorm = nn.LayerNorm(args.hidden_size, eps=args.norm_epsilon)

    def __call__(self, x: mx.array, mask: Optional[mx.array] = None, cache=None) -> mx.array:
        h = x + self.self_attn(self.input_layernorm(x), mask, cache)
        return h + self.mlp(self.post_attention_layernorm(h))


class Starcoder2Model(llama.LlamaModel):
    """llama's backbone (one mask per layer type, windowed for sliding layers) with a
    final LayerNorm."""

    def __init__(self, args: ModelArgs):
        nn.Module.__init__(self)  # not LlamaModel's: its norm is an RMSNorm
        self.sliding_window = args.sliding_window
        self.embed_tokens = nn.Embedding(args.vocab_size, args.hidden_size)
        self.layers = [DecoderLayer(args, layer_type) for layer_type in args.layer_types]
        self.norm = nn.LayerNorm(args.hidden_size, eps=args.norm_epsilon)


class Model(llama.Model):
    """llama's LM head (tied or `lm_head`), sanitize and caches (a RotatingKVCache per
    layer when there is a window) over StarCoder2's blocks."""

    # Both cache kinds roll back by themselves; the layers record nothing.
    supports_speculative_rollback = True
    backbone_class = Starcoder2Model

    def shard(self, group: Optional[mx.distributed.Group] = None) -> None:
        """llama's tensor parallelism: heads split, and the MLP's hidden units (c_fc's
        rows, c_proj's columns, which all-sums); the LayerNorms stay whole."""
        group = sharding.world(group)
        for layer in self.layers:
            attn = layer.self_attn
            attn.n_heads, attn.n_kv_heads = sharding.shard_attention(attn, attn.n_heads, attn.n_kv_heads, group)
            sharding.shard_mlp(layer.mlp, group, inputs=("c_fc",), output="c_proj")
