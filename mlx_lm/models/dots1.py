"""dots.llm1 (`dots1`, Dots1ForCausalLM: rednote-hilab/dots.llm1.base, .inst): qwen3's
attention in llama's pre-norm block with glm4_moe's experts.

What differs from glm4_moe:
- Rope turns whole heads (no partial rotary factor unless the config names one); each
  q and k head is always RMS-normalised before rope (qwen3's per-head norms).
- q/k/v *and* o_proj carry biases with `attention_bias` (default False).
- Layers from `max_window_layers` on slide when `sliding_window` is set (transformers'
  rule when `layer_types` is absent; the released config has max_window_layers =
  num_hidden_layers, so none slides), cached in a RotatingKVCache.
- transformers' defaults: first_k_dense_replace 0, norm_topk_prob False, rms_norm_eps
  1e-6; n_routed_experts, n_shared_experts and num_experts_per_tok have none and must
  be given.
The router (sigmoid scores, e_score_correction_bias, group-limited top-k, scaling),
the shared experts, the dense first layers and the weight layouts are glm4_moe's.
Reference: transformers `models/dots1/modeling_dots1.py`, `configuration_dots1.py`.
"""

from dataclasses import dataclass
from typing import Optional

from . import glm4_moe
from .llama import FULL, SLIDING


@dataclass
class ModelArgs(glm4_moe.ModelArgs):
    """Dots1Config's keys (glm4_moe's plus max_window_layers), with its defaults."""

    rms_norm_eps: float = 1e-6
    first_k_dense_replace: int = 0
    norm_topk_prob: bool = False
    n_routed_experts: Optional[int] = None
    n_shared_experts: Optional[int] = None
    num_experts_per_tok: Optional[int] = None
    sliding_window: Optional[int] = 4096
    max_window_layers: int = 62

    default_partial_rotary_factor = 1.0

    def __post_init__(self):
        required = ("n_routed_experts", "n_shared_experts", "num_experts_per_tok")
        missing = [k for k in required if getattr(self, k) is None]
        if missing:
            raise ValueError(f"dots1 configs must give {', '.join(missing)} (transformers has no default)")
        super().__post_init__()

    def _set_layer_types(self):
        if self.layer_types is None:
            window = self.sliding_window is not None
            self.layer_types = [SLIDING if window and i >= self.max_window_layers else FULL
                                for i in range(self.num_hidden_layers)]
        super()._set_layer_types()

    @property
    def qk_norm(self) -> bool:  # read by llama.Attention: always
        return True

    @property
    def o_bias(self) -> bool:
        return self.attention_bias


class Model(glm4_moe.Model):
    """glm4_moe's network (its sanitize drops nothing real here: dots1 has no MTP layers)."""
