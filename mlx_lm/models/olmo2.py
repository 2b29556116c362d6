"""OLMo 2 (`olmo2`, Olmo2ForCausalLM: allenai/OLMo-2-1124-7B/13B, OLMo-2-0325-32B,
OLMo-2-0425-1B, and their Instruct releases): OLMo 3's network with every layer global.

What differs from llama (all of it OLMo 3's, whose attention, block and backbone this
runs):
- Post-norms only: x + norm(attn(x)), then h + norm(mlp(h)); the sublayers' inputs are
  not normalised.
- QK-norm over the whole projection: q_proj's output (all heads, H * D features) and
  k_proj's (H_kv * D) are RMS-normalised before the heads are split, one RMS over every
  head; tensor parallel sums the squares over the ranks (olmo3.projection_rms_norm).
- No sliding window: every layer is global, one rope (default theta 10000) for all.
Weights are `model.*` (+ `lm_head.*` unless tied), as transformers and MLX converters
save them.
Reference: transformers `models/olmo2/modeling_olmo2.py`, `configuration_olmo2.py`.
"""

from dataclasses import dataclass
from typing import Any, Dict, List, Optional

from . import olmo3
from .base import BaseModelArgs, check_head_grouping
from .llama import FULL
from .rope_utils import resolve_whole_head_rope


@dataclass
class ModelArgs(BaseModelArgs):
    """Olmo2Config's keys, with its defaults."""

    model_type: str = "olmo2"
    vocab_size: int = 50304
    hidden_size: int = 4096
    intermediate_size: int = 11008
    num_hidden_layers: int = 32
    num_attention_heads: int = 32
    num_key_value_heads: Optional[int] = None
    head_dim: Optional[int] = None  # transformers reads it when present; else hidden / heads
    hidden_act: str = "silu"
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = False
    rope_theta: Optional[float] = None  # transformers 4
    rope_scaling: Optional[Dict[str, Any]] = None  # transformers 4
    rope_parameters: Optional[Dict[str, Any]] = None  # transformers 5
    attention_bias: bool = False
    rms_norm_eps: float = 1e-5

    sliding_window = None  # what llama's backbone and caches read: no layer slides

    def __post_init__(self):
        if self.num_key_value_heads is None:
            self.num_key_value_heads = self.num_attention_heads
        check_head_grouping(self.num_attention_heads, self.num_key_value_heads)
        if self.head_dim is None:
            self.head_dim = self.hidden_size // self.num_attention_heads
        self.rope_theta, self.rope_scaling = resolve_whole_head_rope(
            self.model_type, self.rope_theta, self.rope_scaling, self.rope_parameters)
        if self.hidden_act != "silu":
            raise ValueError(f"hidden_act {self.hidden_act!r} is not supported; olmo2 uses 'silu'")

    @property
    def layer_types(self) -> List[str]:
        return [FULL] * self.num_hidden_layers

    @property
    def rope(self) -> Dict[str, Any]:
        """(theta, scaling) by layer type, what olmo3.Attention reads."""
        return {FULL: (self.rope_theta, self.rope_scaling)}


class Model(olmo3.Model):
    """OLMo 3's network (LM head, sanitize, KV caches, tensor parallelism with the
    projection norms' squares summed over the ranks), every layer global."""
