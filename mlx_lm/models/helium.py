"""Helium (`helium`, HeliumForCausalLM: kyutai/helium-1-preview-2b, helium-1-2b): llama
with interleaved rope.

What differs from llama:
- Rope turns each head's features in interleaved pairs (x[2i], x[2i+1]) (transformers'
  Helium repeats each frequency twice and rotates neighbours), MLX's "traditional" rope:
  ERNIE 4.5's network (llama's blocks around glm4's attention), which this runs.
- q/k/v carry biases with `attention_bias`; o_proj never has one; the MLP's follow
  `mlp_bias`.
- transformers' defaults: head_dim 128, rms_norm_eps 1e-8, rope theta 1e5.
Weights are `model.*` (+ `lm_head.*` unless tied), as transformers and MLX converters
save them.
Reference: transformers `models/helium/modeling_helium.py`, `configuration_helium.py`.
"""

from dataclasses import dataclass

from . import ernie4_5, llama

DEFAULT_THETA = 100_000.0  # HeliumConfig.default_theta


@dataclass
class ModelArgs(llama.ModelArgs):
    """HeliumConfig's keys (llama's), with its defaults."""

    head_dim: int = 128
    rms_norm_eps: float = 1e-8
    max_position_embeddings: int = 4096

    o_bias = False  # read by llama.Attention: HeliumAttention's o_proj has no bias

    def __post_init__(self):
        if self.rope_theta is None and "rope_theta" not in (self.rope_parameters or {}):
            self.rope_theta = DEFAULT_THETA  # llama's fallback would be 10000
        super().__post_init__()

    @property
    def rotary_dims(self) -> int:  # read by glm4.Attention: the whole head turns
        return self.head_dim


class Model(ernie4_5.Model):
    """ERNIE 4.5's network: llama's LM head, sanitize, caches and tensor parallelism
    over llama blocks with interleaved whole-head rope."""
