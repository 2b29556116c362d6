"""Rotary position embeddings: default, linear, dynamic (NTK), llama3, yarn, longrope and
proportional (Gemma 4's global layers).

Configs come in two dialects. transformers 4 writes `rope_theta` and `rope_scaling` at
the top level; transformers 5 writes one `rope_parameters` dict holding `rope_theta`,
`rope_type` and the scaling keys. `resolve_rope` reads either into (theta, scaling), and
`initialize_rope` accepts that scaling dict or upstream's (a "type" or "rope_type" key).
Nothing here mutates a config dict it is given.

Every module but longrope is a pure function of (features, absolute position): the
rotation of a token never depends on how the sequence was split into forward calls,
which is what makes cached decoding, chunked prefill and speculative verification
agree. Longrope follows transformers, which picks one factor set per forward call by
the sequence length the call reaches: a call ending past
original_max_position_embeddings turns all its positions with the long factors, so a
full forward over a long sequence does too, while tokens fed one at a time before the
boundary keep the short ones. Hub checkpoints are run with that rule, so we match it
call for call; a prefill chunk or speculative verify round that straddles the switch
therefore differs from feeding its tokens one at a time, in transformers too.
(transformers' Phi-3 generate() also re-runs the whole sequence once it first grows
past the switch, so every cached key gets the long factors; our generation loop does
not.) Dynamic NTK also switches per call in transformers; here it is per position,
which equals transformers' token-by-token decoding.

References: "RoFormer" (arXiv 2104.09864); YaRN (arXiv 2309.00071); LongRoPE (arXiv
2402.13753); transformers `modeling_rope_utils.py`.
"""

import math
from typing import Any, Callable, Dict, Optional, Sequence, Tuple, Union

import mlx.core as mx
import mlx.nn as nn
import numpy as np

SUPPORTED_ROPE_TYPES = ("default", "mrope", "linear", "dynamic", "llama3", "yarn", "longrope", "proportional")


def resolve_rope(
    rope_theta: Optional[float],
    rope_scaling: Optional[Dict[str, Any]],
    rope_parameters: Optional[Dict[str, Any]],
) -> Tuple[Optional[float], Optional[Dict[str, Any]], Optional[float]]:
    """Normalise both config dialects to (theta, scaling, partial_rotary_factor).

    Values set at the top level win over `rope_parameters`. `scaling` is None for plain
    rope, else a new dict with a "rope_type" key. Missing values come back as None.
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


def resolve_whole_head_rope(
    model_type: str,
    rope_theta: Optional[float],
    rope_scaling: Optional[Dict[str, Any]],
    rope_parameters: Optional[Dict[str, Any]],
    default_theta: float = 10000.0,
) -> Tuple[float, Optional[Dict[str, Any]]]:
    """`resolve_rope` for a family whose rope turns every feature of a head: (theta,
    scaling), theta `default_theta` when neither dialect names one; a ValueError naming
    the family when a partial_rotary_factor other than 1 is given."""
    theta, scaling, partial = resolve_rope(rope_theta, rope_scaling, rope_parameters)
    if partial not in (None, 1.0):
        raise ValueError(f"{model_type} rotates whole heads; got partial_rotary_factor={partial}")
    return (default_theta if theta is None else theta), scaling


# --- inverse frequencies (numpy, float64): (dims // 2,) each ---------------------------


def default_inv_freq(dims: int, base: float) -> np.ndarray:
    """theta_i = base^(-2i / dims), i = 0 .. dims/2 - 1."""
    return 1.0 / (base ** (np.arange(0, dims, 2, dtype=np.float64) / dims))


def llama3_inv_freq(
    dims: int, base: float, factor: float, low_freq_factor: float, high_freq_factor: float,
    original_max_position_embeddings: int,
) -> np.ndarray:
    """Llama 3.1: wavelengths longer than original / low_freq_factor slowed by `factor`,
    shorter than original / high_freq_factor kept, a linear blend in between."""
    inv_freq = default_inv_freq(dims, base)
    wavelen = 2 * math.pi / inv_freq
    old_context = original_max_position_embeddings
    # Llama 4 Scout has high_freq_factor == low_freq_factor: no blend band, and the
    # blend (selected nowhere then) divides by zero.
    with np.errstate(divide="ignore", invalid="ignore"):
        smooth = (old_context / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
        blended = (1 - smooth) * inv_freq / factor + smooth * inv_freq
    return np.where(
        wavelen > old_context / low_freq_factor,
        inv_freq / factor,
        np.where(wavelen < old_context / high_freq_factor, inv_freq, blended),
    )


def yarn_inv_freq(
    dims: int, base: float, factor: float, original_max_position_embeddings: int,
    beta_fast: float = 32.0, beta_slow: float = 1.0, truncate: bool = True,
) -> np.ndarray:
    """YaRN: dimensions that turn more than beta_fast times over the original context
    keep their frequency, fewer than beta_slow times are interpolated by `factor`, a
    linear ramp between."""

    def correction_dim(num_rotations):
        return dims * math.log(original_max_position_embeddings / (num_rotations * 2 * math.pi)) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dims - 1)
    if low == high:
        high += 0.001  # avoid a zero-width ramp
    ramp = np.clip((np.arange(dims // 2, dtype=np.float64) - low) / (high - low), 0, 1)
    inv_freq = default_inv_freq(dims, base)
    return inv_freq / factor * ramp + inv_freq * (1 - ramp)


def yarn_get_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def apply_yarn_mscale(scale: float, scaling_config: Optional[Dict[str, Any]]) -> float:
    """Upstream's: an attention scale times yarn_get_mscale(factor, mscale_all_dim)^2,
    the part of yarn's mscale that sharpens the softmax (YarnRoPE puts the ratio
    get_mscale(f, mscale) / get_mscale(f, mscale_all_dim) on the rotated features).
    Unchanged for plain rope, without mscale_all_dim, or with factor <= 1.
    `scaling_config`: resolve_rope's dict or upstream's ("type" or "rope_type")."""
    config = scaling_config or {}
    rope_type = config.get("rope_type") or config.get("type") or "default"
    if rope_type == "default" or not config.get("mscale_all_dim"):
        return scale
    mscale = yarn_get_mscale(config.get("factor", 1), config["mscale_all_dim"])
    return scale * mscale * mscale


def longrope_inv_freq(dims: int, base: float, factors: Union[float, Sequence[float]]) -> np.ndarray:
    """LongRoPE: theta_i / factors_i, one rescale factor per frequency (or one for all)."""
    factors = np.broadcast_to(np.asarray(factors, dtype=np.float64), (dims // 2,))
    return default_inv_freq(dims, base) / factors


def longrope_attention_factor(factor: float, original_max_position_embeddings: int) -> float:
    """sqrt(1 + ln(factor) / ln(original)), 1 when the context is not extended."""
    if factor <= 1.0:
        return 1.0
    return math.sqrt(1 + math.log(factor) / math.log(original_max_position_embeddings))


def proportional_inv_freq(dims: int, rotated_dims: int, base: float, factor: float = 1.0) -> np.ndarray:
    """Proportional rope (Gemma 4): the first rotated_dims // 2 pairs turn at
    base^(-2i / dims), the exponent over the whole head rather than the rotated part,
    divided by `factor`; the other pairs have frequency 0 and never turn."""
    inv_freq = np.zeros(dims // 2)
    inv_freq[: rotated_dims // 2] = default_inv_freq(dims, base)[: rotated_dims // 2] / factor
    return inv_freq


def dynamic_ntk_base(base: float, dims: int, factor: float, max_position_embeddings: int, seq_len):
    """Dynamic NTK: the base for a sequence of seq_len tokens (an int or an array of them);
    unchanged up to max_position_embeddings, then
    base * (factor * seq_len / max - (factor - 1))^(dims / (dims - 2))."""
    seq_len = np.maximum(seq_len, max_position_embeddings)
    return base * ((factor * seq_len / max_position_embeddings) - (factor - 1)) ** (dims / (dims - 2))


# --- applying a rotation (mlx) ---------------------------------------------------------


def scale_rotated(x: mx.array, dims: int, mscale: float) -> mx.array:
    """x (..., D) with its first `dims` features times mscale (yarn's and longrope's
    attention factor scales cos and sin alike, so the rotated part only)."""
    if mscale == 1.0:
        return x
    if dims == x.shape[-1]:
        return x * mscale
    return mx.concatenate([x[..., :dims] * mscale, x[..., dims:]], axis=-1)


def periods(inv_freq: np.ndarray) -> mx.array:
    """What mx.fast.rope's `freqs` takes: 1 / inverse frequency, (dims // 2,) float32."""
    return mx.array((1.0 / inv_freq).astype(np.float32))


def rope_with_periods(
    x: mx.array, dims: int, offset: int, freqs: mx.array, traditional: bool, mscale: float = 1.0
) -> mx.array:
    """x (B, *, L, D) rotated at positions offset .. offset + L - 1, pair i turning by
    position / freqs[i] (see `periods`); features past `dims` pass through."""
    x = scale_rotated(x, dims, mscale)
    return mx.fast.rope(x, dims, traditional=traditional, base=None, scale=1.0, offset=offset, freqs=freqs)


def rope_with_angles(x: mx.array, dims: int, angles: mx.array, traditional: bool) -> mx.array:
    """x (B, *, L, D) rotated by explicit angles (L, dims // 2): pairs (i, i + dims/2),
    or (2i, 2i + 1) if traditional, turn by angles[:, i]."""
    cos, sin = mx.cos(angles).astype(x.dtype), mx.sin(angles).astype(x.dtype)
    rotated = x[..., :dims]
    if traditional:
        x1, x2 = rotated[..., 0::2], rotated[..., 1::2]
        out = mx.stack([x1 * cos - x2 * sin, x1 * sin + x2 * cos], axis=-1).reshape(rotated.shape)
    else:
        x1, x2 = rotated[..., : dims // 2], rotated[..., dims // 2 :]
        out = mx.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
    return mx.concatenate([out, x[..., dims:]], axis=-1) if dims < x.shape[-1] else out


RangeRope = Callable[[mx.array, int], mx.array]  # (rows (B, *, n, D), their first position) -> rotated


def rope_either_side(x: mx.array, offset: int, boundary: int, before: RangeRope, after: RangeRope) -> mx.array:
    """x (B, *, L, D) at positions offset .. offset + L - 1: the rows before `boundary`
    rotated by `before`, the rest by `after` (a call on one side is not split)."""
    if not isinstance(offset, int):
        raise ValueError(f"this rope switches frequencies at a position and needs an int offset, got {offset!r}")
    num_before = min(max(boundary - offset, 0), x.shape[-2])
    if num_before == x.shape[-2]:
        return before(x, offset)
    if num_before == 0:
        return after(x, offset)
    head, tail = x[..., :num_before, :], x[..., num_before:, :]
    return mx.concatenate([before(head, offset), after(tail, offset + num_before)], axis=-2)


# --- modules ---------------------------------------------------------------------------


class ScaledRoPE(nn.Module):
    """Rope from explicit inverse frequencies (dims // 2,), with an optional scale on the
    rotated features."""

    def __init__(self, dims: int, inv_freq: np.ndarray, traditional: bool = False, mscale: float = 1.0):
        super().__init__()
        if inv_freq.shape != (dims // 2,):
            raise ValueError(f"rope over {dims} features needs {dims // 2} frequencies, got shape {inv_freq.shape}")
        self.dims = dims
        self.traditional = traditional
        self.mscale = float(mscale)
        self._freqs = periods(inv_freq)  # underscore: not a parameter

    def __call__(self, x: mx.array, offset: int = 0) -> mx.array:
        return rope_with_periods(x, self.dims, offset, self._freqs, self.traditional, self.mscale)


class ProportionalRoPE(ScaledRoPE):
    """Upstream's ProportionalRoPE(dims, rotated_dims, traditional, base, factor): rope
    over all `dims` features with proportional_inv_freq, so the pairs past rotated_dims
    pass through unchanged (a period of inf turns by 0)."""

    def __init__(self, dims: int, rotated_dims: int, traditional: bool = False, base: float = 10000.0,
                 factor: float = 1.0):
        if isinstance(rotated_dims, bool) or not isinstance(rotated_dims, int) or not 0 <= rotated_dims <= dims:
            raise ValueError(f"proportional rope rotates 0 to {dims} of its {dims} features, got "
                             f"rotated_dims={rotated_dims!r}")
        if not factor > 0:
            raise ValueError(f"proportional rope needs a positive factor, got {factor!r}")
        with np.errstate(divide="ignore"):  # frequency 0 -> period inf, what fast.rope takes as no turn
            super().__init__(dims, proportional_inv_freq(dims, rotated_dims, base, factor), traditional)


class Llama3RoPE(ScaledRoPE):
    """Llama 3.1 frequency smoothing; `scaling_config` holds factor, low_freq_factor,
    high_freq_factor and original_max_position_embeddings (missing: max_position_embeddings,
    as transformers; both None: 8192, Llama 3.1's)."""

    def __init__(
        self, dims: int, max_position_embeddings: Optional[int] = 2048, traditional: bool = False,
        base: float = 10000, scaling_config: Optional[Dict[str, Any]] = None,
    ):
        config = scaling_config or {}
        if "factor" not in config:
            raise ValueError(f"llama3 rope needs a 'factor' in its scaling config, got {scaling_config!r}")
        original = config.get("original_max_position_embeddings") or max_position_embeddings or 8192
        inv_freq = llama3_inv_freq(
            dims, base, config["factor"], config.get("low_freq_factor", 1.0), config.get("high_freq_factor", 4.0),
            original,
        )
        super().__init__(dims, inv_freq, traditional)
        self.max_position_embeddings = max_position_embeddings

    def extra_repr(self) -> str:
        return f"{self.dims}, traditional={self.traditional}, max_position_embeddings={self.max_position_embeddings}"


class YarnRoPE(ScaledRoPE):
    """YaRN: ramped interpolation of the frequencies, rotated features times the
    attention factor get_mscale(f, mscale) / get_mscale(f, mscale_all_dim) unless
    `attention_factor` is given. scaling_factor None: max / original positions."""

    def __init__(
        self, dims: int, traditional: bool = False, max_position_embeddings: int = 2048, base: float = 10000,
        scaling_factor: Optional[float] = 1.0, original_max_position_embeddings: int = 4096,
        beta_fast: float = 32, beta_slow: float = 1, mscale: float = 1, mscale_all_dim: float = 0,
        *, attention_factor: Optional[float] = None, truncate: bool = True,
    ):
        if scaling_factor is None:
            scaling_factor = max_position_embeddings / original_max_position_embeddings
        if attention_factor is None:
            attention_factor = yarn_get_mscale(scaling_factor, mscale) / yarn_get_mscale(scaling_factor, mscale_all_dim)
        inv_freq = yarn_inv_freq(
            dims, base, scaling_factor, original_max_position_embeddings, beta_fast, beta_slow, truncate
        )
        super().__init__(dims, inv_freq, traditional, attention_factor)


class SuScaledRoPE(nn.Module):
    """LongRoPE ("su" scaling, Phi-3.5 / Phi-4-mini): a call over positions
    offset .. offset + L - 1 turns with base frequencies / short_factor, scaled by
    short_mscale, while offset + L <= original_max_position_embeddings, else every one
    of its positions with / long_factor and long_mscale (transformers' per-call rule,
    see the module docstring). Either mscale defaults to
    longrope_attention_factor(max / original, original)."""

    def __init__(
        self, dims: int, base: float = 10000.0, max_position_embeddings: int = 131072,
        original_max_position_embeddings: int = 4096,
        short_factor: Union[float, Sequence[float]] = 1.0, long_factor: Union[float, Sequence[float]] = 1.0,
        short_mscale: Optional[float] = None, long_mscale: Optional[float] = None, *, traditional: bool = False,
    ):
        super().__init__()
        for name, factors in (("short_factor", short_factor), ("long_factor", long_factor)):
            if np.ndim(factors) and np.shape(factors) != (dims // 2,):
                raise ValueError(
                    f"longrope {name} needs {dims // 2} values for {dims} rotated features, got {np.shape(factors)}"
                )
        default_mscale = longrope_attention_factor(
            max_position_embeddings / original_max_position_embeddings, original_max_position_embeddings
        )
        self.dims = dims
        self.traditional = traditional
        self.original_max_position_embeddings = original_max_position_embeddings
        self.short_mscale = default_mscale if short_mscale is None else float(short_mscale)
        self.long_mscale = default_mscale if long_mscale is None else float(long_mscale)
        self._short_freqs = periods(longrope_inv_freq(dims, base, short_factor))
        self._long_freqs = periods(longrope_inv_freq(dims, base, long_factor))

    def __call__(self, x: mx.array, offset: Union[int, mx.array] = 0) -> mx.array:
        """x (B, *, L, D) at positions offset.. ; `offset` an int, or a (B,) array of
        each row's first position (a batch): each row then takes the factors its own
        call of L tokens would, so a batch row turns as the sequence does alone."""
        if isinstance(offset, mx.array):
            reaches_past = offset + x.shape[-2] > self.original_max_position_embeddings  # (B,)
            rows = reaches_past.reshape(-1, *([1] * (x.ndim - 1)))  # (B, 1, .., 1)
            return mx.where(rows, self._long(x, offset), self._short(x, offset))
        if not isinstance(offset, int):
            raise ValueError(f"longrope picks its factors by the length a call reaches and needs an int offset "
                             f"or a (B,) array of them, got {offset!r}")
        if offset + x.shape[-2] > self.original_max_position_embeddings:
            return self._long(x, offset)
        return self._short(x, offset)

    def _long(self, x: mx.array, offset: Union[int, mx.array]) -> mx.array:
        return rope_with_periods(x, self.dims, offset, self._long_freqs, self.traditional, self.long_mscale)

    def _short(self, x: mx.array, offset: Union[int, mx.array]) -> mx.array:
        return rope_with_periods(x, self.dims, offset, self._short_freqs, self.traditional, self.short_mscale)


class DynamicNTKRoPE(nn.Module):
    """Dynamic NTK scaling: plain rope up to max_position_embeddings; the token at
    position p beyond it turns with the base dynamic_ntk_base(..., seq_len=p + 1), the
    base transformers uses when that token is decoded."""

    def __init__(self, dims: int, base: float, traditional: bool, factor: float, max_position_embeddings: int):
        super().__init__()
        if max_position_embeddings is None:
            raise ValueError("dynamic rope needs max_position_embeddings, got None")
        self.dims, self.base, self.traditional = dims, base, traditional
        self.factor, self.max_position_embeddings = factor, max_position_embeddings
        self._freqs = periods(default_inv_freq(dims, base))

    def angles(self, offset: int, num_positions: int) -> mx.array:
        """(num_positions, dims // 2) float32 angles for positions offset.. (all past max)."""
        positions = np.arange(offset, offset + num_positions, dtype=np.float64)[:, None]
        bases = dynamic_ntk_base(self.base, self.dims, self.factor, self.max_position_embeddings, positions + 1)
        exponents = np.arange(0, self.dims, 2, dtype=np.float64)[None] / self.dims
        return mx.array((positions / bases**exponents).astype(np.float32))  # (num_positions, dims // 2)

    def __call__(self, x: mx.array, offset: int = 0) -> mx.array:
        return rope_either_side(x, offset, self.max_position_embeddings, self._within, self._beyond)

    def _within(self, x: mx.array, offset: int) -> mx.array:
        return rope_with_periods(x, self.dims, offset, self._freqs, self.traditional)

    def _beyond(self, x: mx.array, offset: int) -> mx.array:
        return rope_with_angles(x, self.dims, self.angles(offset, x.shape[-2]), self.traditional)

    def extra_repr(self) -> str:
        return (f"{self.dims}, traditional={self.traditional}, "
                f"max_position_embeddings={self.max_position_embeddings}, factor={self.factor}")


class DynamicNTKScalingRoPE(DynamicNTKRoPE):
    """Upstream's name and argument order for DynamicNTKRoPE. Upstream turns every
    position of a call with the base of the position the call reaches; here each
    position takes its own (see the module docstring). The two agree on calls that
    stay within max_position_embeddings and on single-token decoding."""

    def __init__(self, dims: int, max_position_embeddings: int, traditional: bool, base: float, factor: float):
        super().__init__(dims, base, traditional, factor, max_position_embeddings)


def initialize_rope(
    dims: int,
    base: float,
    traditional: bool,
    scaling_config: Optional[Dict[str, Any]] = None,
    max_position_embeddings: Optional[int] = None,
) -> nn.Module:
    """The rope module for `dims` rotated features. `scaling_config`: None, the dict
    resolve_rope returns, or upstream's (the rope type under "type" or "rope_type")."""
    config = dict(scaling_config or {})
    rope_type = config.get("rope_type") or config.get("type") or "default"
    if rope_type in ("default", "mrope"):  # mrope: text-only positions are plain rope
        return nn.RoPE(dims, traditional=traditional, base=base)
    if rope_type == "linear":
        return nn.RoPE(dims, traditional=traditional, base=base, scale=1 / config["factor"])
    if rope_type == "dynamic":
        return DynamicNTKRoPE(dims, base, traditional, config["factor"], max_position_embeddings)
    if rope_type == "proportional":  # upstream's: int(dims * partial_rotary_factor) features turn
        partial = config.get("partial_rotary_factor", 1.0)
        if isinstance(partial, bool) or not isinstance(partial, (int, float)) or not 0 <= partial <= 1:
            raise ValueError(f"proportional rope needs a partial_rotary_factor in [0, 1], got {partial!r}")
        return ProportionalRoPE(dims, int(dims * partial), traditional, base, config.get("factor", 1.0))
    if max_position_embeddings is not None:  # transformers' fallback for the original context
        config.setdefault("original_max_position_embeddings", max_position_embeddings)
    if rope_type == "llama3":
        return Llama3RoPE(dims, max_position_embeddings, traditional, base, config)
    if rope_type == "yarn":
        return _yarn_from_config(dims, base, traditional, config, max_position_embeddings)
    if rope_type == "longrope":
        return _longrope_from_config(dims, base, traditional, config, max_position_embeddings)
    raise ValueError(f"Unsupported rope_type {rope_type!r}; supported: {', '.join(SUPPORTED_ROPE_TYPES)}")


def _original_context(config: Dict[str, Any], rope_type: str) -> int:
    if config.get("original_max_position_embeddings") is None:
        raise ValueError(f"{rope_type} rope needs original_max_position_embeddings (or max_position_embeddings)")
    return config["original_max_position_embeddings"]


def _yarn_from_config(dims, base, traditional, config, max_position_embeddings) -> YarnRoPE:
    mscale, mscale_all_dim = config.get("mscale"), config.get("mscale_all_dim")
    if not (mscale and mscale_all_dim):  # transformers: the ratio only when both are set
        mscale, mscale_all_dim = 1.0, 0.0
    return YarnRoPE(
        dims, traditional, max_position_embeddings, base, config.get("factor"),
        _original_context(config, "yarn"), config.get("beta_fast") or 32, config.get("beta_slow") or 1,
        mscale, mscale_all_dim, attention_factor=config.get("attention_factor"), truncate=config.get("truncate", True),
    )


def _longrope_from_config(dims, base, traditional, config, max_position_embeddings) -> SuScaledRoPE:
    original = _original_context(config, "longrope")
    missing = [key for key in ("short_factor", "long_factor") if config.get(key) is None]
    if missing:
        raise ValueError(f"longrope rope scaling needs {' and '.join(missing)} (per-frequency factor lists)")
    mscale = config.get("attention_factor")
    if mscale is None and config.get("factor") is not None:
        mscale = longrope_attention_factor(config["factor"], original)
    return SuScaledRoPE(
        dims, base, max_position_embeddings or original, original, config["short_factor"], config["long_factor"],
        config.get("short_mscale", mscale), config.get("long_mscale", mscale), traditional=traditional,
    )
