"""Rotary position embeddings: default, linear, llama3 and yarn scaling.

Configs come in two dialects. transformers 4 writes `rope_theta` and `rope_scaling` at
the top level; transformers 5 writes one `rope_parameters` dict holding `rope_theta`,
`rope_type` and the scaling keys. `resolve_rope` reads either into (theta, scaling).
"""

import math
from typing import Any, Dict, Optional, Tuple

import mlx.core as mx
import mlx.nn as nn
import numpy as np

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "yarn")


def resolve_rope(
    rope_theta: Optional[float],
    rope_scaling: Optional[Dict[str, Any]],
    rope_parameters: Optional[Dict[str, Any]],
) -> Tuple[Optional[float], Optional[Dict[str, Any]], Optional[float]]:
    """Normalise both config dialects to (theta, scaling, partial_rotary_factor).

    Values set at the top level win over `rope_parameters`. `scaling` is None for plain
    rope, else a dict with a "rope_type" key. Missing values come back as None.
    """
    params = dict(rope_parameters or {})
    if rope_parameters is not None and not isinstance(rope_parameters, dict):
        raise ValueError(f"rope_parameters must be a dict, got {rope_parameters!r}")
    if rope_theta is None:
        rope_theta = params.pop("rope_theta", None)
    partial_rotary_factor = params.pop("partial_rotary_factor", None)
    params.pop("rope_theta", None)
    scaling = dict(rope_scaling) if rope_scaling is not None else params
    if "type" in scaling and "rope_type" not in scaling:
        scaling["rope_type"] = scaling.pop("type")
    if scaling.get("rope_type", "default") == "default":
        scaling = None
    return rope_theta, scaling, partial_rotary_factor


def llama3_inv_freq(dims: int, base: float, scaling: Dict[str, Any]) -> np.ndarray:
    """Llama 3.1 frequencies: long wavelengths slowed by `factor`, a smooth blend between."""
    inv_freq = 1.0 / (base ** (np.arange(0, dims, 2, dtype=np.float64) / dims))
    factor = scaling["factor"]
    low_freq_factor = scaling.get("low_freq_factor", 1.0)
    high_freq_factor = scaling.get("high_freq_factor", 4.0)
    old_context = scaling.get("original_max_position_embeddings", 8192)
    wavelen = 2 * math.pi / inv_freq
    low_freq_wavelen = old_context / low_freq_factor
    high_freq_wavelen = old_context / high_freq_factor
    smooth = (old_context / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    blended = (1 - smooth) * inv_freq / factor + smooth * inv_freq
    return np.where(
        wavelen > low_freq_wavelen,
        inv_freq / factor,
        np.where(wavelen < high_freq_wavelen, inv_freq, blended),
    )


def yarn_inv_freq(
    dims: int, base: float, scaling: Dict[str, Any], max_position_embeddings: Optional[int]
) -> Tuple[np.ndarray, float]:
    """YaRN (arXiv 2309.00071): interpolate low frequencies, keep high ones; returns
    (inv_freq, attention_factor), the factor scaling the rotated features."""
    factor = scaling.get("factor")
    original = scaling["original_max_position_embeddings"]
    if factor is None:
        factor = max_position_embeddings / original
    attention_factor = scaling.get("attention_factor")
    if attention_factor is None:

        def get_mscale(scale, mscale=1.0):
            return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0

        mscale, mscale_all_dim = scaling.get("mscale"), scaling.get("mscale_all_dim")
        if mscale and mscale_all_dim:
            attention_factor = get_mscale(factor, mscale) / get_mscale(factor, mscale_all_dim)
        else:
            attention_factor = get_mscale(factor)
    beta_fast = scaling.get("beta_fast") or 32
    beta_slow = scaling.get("beta_slow") or 1

    def correction_dim(num_rotations):
        return dims * math.log(original / (num_rotations * 2 * math.pi)) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dims - 1)
    if low == high:
        high += 0.001  # avoid a zero-width ramp
    ramp = np.clip((np.arange(dims // 2, dtype=np.float64) - low) / (high - low), 0, 1)
    extrapolation_weight = 1 - ramp
    pos_freqs = base ** (np.arange(0, dims, 2, dtype=np.float64) / dims)
    inv_freq = (1 / (factor * pos_freqs)) * ramp + (1 / pos_freqs) * extrapolation_weight
    return inv_freq, float(attention_factor)


class ScaledRoPE(nn.Module):
    """Rope from explicit inverse frequencies, with an optional scale on the rotated
    features (yarn's attention factor scales cos and sin alike)."""

    def __init__(self, dims: int, inv_freq: np.ndarray, traditional: bool, mscale: float):
        super().__init__()
        self.dims = dims
        self.traditional = traditional
        self.mscale = mscale
        # mx.fast.rope takes periods (1 / inverse frequency); kept out of parameters.
        self._freqs = mx.array((1.0 / inv_freq).astype(np.float32))

    def __call__(self, x: mx.array, offset: int = 0) -> mx.array:
        if self.mscale != 1.0:
            rotated = x[..., : self.dims] * self.mscale
            x = mx.concatenate([rotated, x[..., self.dims :]], axis=-1) if self.dims < x.shape[-1] else rotated
        return mx.fast.rope(
            x, self.dims, traditional=self.traditional, base=None, scale=1.0,
            offset=offset, freqs=self._freqs,
        )


def initialize_rope(
    dims: int,
    base: float,
    traditional: bool,
    scaling_config: Optional[Dict[str, Any]] = None,
    max_position_embeddings: Optional[int] = None,
) -> nn.Module:
    """The rope module for `dims` rotated features; `scaling_config` as from resolve_rope."""
    rope_type = (scaling_config or {}).get("rope_type", "default")
    if rope_type == "default":
        return nn.RoPE(dims, traditional=traditional, base=base)
    if rope_type == "linear":
        return nn.RoPE(dims, traditional=traditional, base=base, scale=1 / scaling_config["factor"])
    if rope_type == "llama3":
        return ScaledRoPE(dims, llama3_inv_freq(dims, base, scaling_config), traditional, 1.0)
    if rope_type == "yarn":
        inv_freq, mscale = yarn_inv_freq(dims, base, scaling_config, max_position_embeddings)
        return ScaledRoPE(dims, inv_freq, traditional, mscale)
    raise ValueError(
        f"Unsupported rope_type {rope_type!r}; supported: {', '.join(SUPPORTED_ROPE_TYPES)}"
    )
