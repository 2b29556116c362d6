"""InternLM 3 (`internlm3`, transformers runs it as LlamaForCausalLM:
internlm/internlm3-8b-instruct): llama with one bias switch for the whole network.

What differs from llama:
- The hub's config names the biases `qkv_bias` (q/k/v) and `bias` (o_proj and the
  MLP); transformers 5 maps them onto llama's `attention_bias` (q/k/v/o) and `mlp_bias`
  and refuses the two apart, since llama biases q/k/v and o_proj alike. We read either
  spelling and refuse the same.
- transformers' defaults: head_dim 128, 2 KV heads, rms_norm_eps 1e-5, 32768 positions.
  The released checkpoint uses dynamic NTK rope (factor 6), llama's.
Weights are `model.*` (+ `lm_head.*` unless tied), as transformers and MLX converters
save them.
Reference: transformers `models/internlm3/configuration_internlm3.py` (the network is
`models/llama/modeling_llama.py`).
"""

from dataclasses import dataclass
from typing import Optional

from . import llama


def one_of(name: str, value: Optional[bool], alias: str, alias_value: Optional[bool]) -> bool:
    """A switch given under its transformers-5 name or its hub alias (default False)."""
    if value is not None and alias_value is not None and value != alias_value:
        raise ValueError(f"{name}={value} contradicts {alias}={alias_value}; give one of them")
    return bool(value if value is not None else alias_value)


@dataclass
class ModelArgs(llama.ModelArgs):
    """InternLM3Config's keys (llama's, plus the hub's bias names), with its defaults."""

    rms_norm_eps: float = 1e-5
    num_key_value_heads: Optional[int] = 2
    head_dim: Optional[int] = 128
    max_position_embeddings: int = 32768
    attention_bias: Optional[bool] = None  # transformers 5 (None: not given, see __post_init__)
    mlp_bias: Optional[bool] = None
    qkv_bias: Optional[bool] = None  # the hub's name of attention_bias
    bias: Optional[bool] = None  # the hub's name of mlp_bias

    def __post_init__(self):
        # llama.Attention reads qkv_bias (q/k/v) and o_bias (attention_bias) alike.
        self.attention_bias = self.qkv_bias = one_of("attention_bias", self.attention_bias, "qkv_bias", self.qkv_bias)
        self.mlp_bias = self.bias = one_of("mlp_bias", self.mlp_bias, "bias", self.bias)
        if self.attention_bias != self.mlp_bias:
            raise ValueError(
                f"internlm3 with qkv_bias={self.attention_bias} but bias={self.mlp_bias} is not supported: "
                "transformers' llama network biases q/k/v/o and the MLP alike; give them the same value"
            )
        super().__post_init__()


class Model(llama.Model):
    """llama's network."""

    # KV caches roll back by themselves; the layers record nothing.
    supports_speculative_rollback = True
