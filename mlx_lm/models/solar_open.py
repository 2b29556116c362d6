"""Solar Open (`solar_open`, SolarOpenForCausalLM: upstage/Solar-Open-100B): glm4_moe's
network with every layer a mixture of experts and whole-head rope.

What differs from glm4_moe:
- Every layer is MoE (no `first_k_dense_replace`, no dense `intermediate_size`: the
  config has neither).
- Rope turns whole heads (rotate-half pairs) with transformers' default theta 1e6; no
  q/k norms; q/k/v biases with `attention_bias`, none on o_proj.
- Defaults: head_dim 128, moe_intermediate_size 1280, rms_norm_eps 1e-5.
The router (sigmoid scores, e_score_correction_bias, group-limited top-k, scaling), the
shared experts and the weight layouts are glm4_moe's.
Reference: transformers `models/solar_open/modeling_solar_open.py`.
"""

from dataclasses import dataclass
from typing import Optional

from . import glm4_moe

DEFAULT_THETA = 1_000_000.0  # SolarOpenConfig.default_theta


@dataclass
class ModelArgs(glm4_moe.ModelArgs):
    """SolarOpenConfig's keys, with its defaults."""

    intermediate_size: Optional[int] = None  # no dense layers (see __post_init__)
    num_attention_heads: int = 64  # (defaults from here on: the field above has one)
    vocab_size: int = 196608
    head_dim: int = 128
    moe_intermediate_size: int = 1280
    first_k_dense_replace: int = 0

    default_partial_rotary_factor = 1.0

    def __post_init__(self):
        if self.rope_theta is None and "rope_theta" not in (self.rope_parameters or {}):
            self.rope_theta = DEFAULT_THETA  # llama's fallback would be 10000
        if self.intermediate_size is None:
            # llama's block builds a dense MLP that glm4_moe's replaces before it is ever
            # computed; any positive size does.
            self.intermediate_size = self.moe_intermediate_size
        if self.first_k_dense_replace:
            raise ValueError(f"first_k_dense_replace={self.first_k_dense_replace}: every solar_open layer is MoE")
        super().__post_init__()


class Model(glm4_moe.Model):
    """glm4_moe's network, every layer MoE."""
