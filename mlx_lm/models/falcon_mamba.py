"""Falcon-Mamba (tiiuae/falcon-mamba-7b): Mamba-1 with dt, B and C RMS-normalised.

What differs from mamba (whose blocks, cache and rollback it uses as they are):
- Before the scan, the mixer RMS-normalises the dt rank vector, B and C over their last
  axis in fp32 without a learned weight (transformers' FalconMambaWeightlessRMSNorm;
  its `weight` buffers are all ones and never saved), eps `mixer_rms_eps` (1e-6, the
  default when older configs lack the key).
- Norms are llama's RMSNorm (the same arithmetic as mamba's).
Reference: transformers `models/falcon_mamba/modeling_falcon_mamba.py`.
"""

from dataclasses import dataclass
from typing import Dict

import mlx.core as mx

from . import mamba


@dataclass
class ModelArgs(mamba.ModelArgs):
    mixer_rms_eps: float = 1e-6

    def __post_init__(self):
        super().__post_init__()
        if not self.mixer_rms_eps > 0:
            raise ValueError(f"mixer_rms_eps must be > 0, got {self.mixer_rms_eps!r}")

    @property
    def mamba_shape(self) -> mamba.MambaShape:
        return mamba.MambaShape(
            self.hidden_size, self.intermediate_size, self.state_size, self.time_step_rank, self.conv_kernel,
            conv_bias=self.use_conv_bias, proj_bias=self.use_bias, bcdt_norm=mamba.WEIGHTLESS_NORM,
            norm_eps=self.mixer_rms_eps,
        )


class Model(mamba.Model):
    def sanitize(self, weights: Dict[str, mx.array]) -> Dict[str, mx.array]:
        """mamba's; transformers' dummy norm buffers (ones) are dropped if a converter
        kept them."""
        dummy = ("dt_layernorm.weight", "b_layernorm.weight", "c_layernorm.weight")
        return super().sanitize({k: v for k, v in weights.items() if not k.endswith(dummy)})
