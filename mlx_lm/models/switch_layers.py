"""Mixture-of-experts layers: each token runs through its k chosen experts.

Expert weights are stacked (E, out, in) and applied with gathered matmuls
(`mx.gather_mm` / `mx.gather_qmm`), so there is no Python loop over experts. For many
tokens (prefill) the (token, expert) pairs are sorted by expert first, so each expert's
weight is read once per contiguous run instead of once per token.

`stack_experts` and `split_fused_experts` turn the checkpoints' expert layouts (one
tensor per expert; transformers 5's fused gate_up_proj) into these stacks.
"""

import functools
import re
from typing import Callable, Dict, Optional, Tuple

import mlx.core as mx
import mlx.nn as nn

from .activations import swiglu

# Below this many (token, expert) pairs, sorting costs more than it saves.
SORT_THRESHOLD = 64


@functools.lru_cache(maxsize=None)
def gather_mm_runs_in(dtype: mx.Dtype, device: mx.Device) -> bool:
    """Whether the backend has a gather_mm kernel for `dtype` (MLX's CPU backend has one
    for float32 only). Asked once per dtype and device with a tiny product."""
    try:
        lhs, rhs = mx.zeros((1, 1, 2), dtype), mx.zeros((1, 2, 2), dtype)
        mx.eval(mx.gather_mm(lhs, rhs, rhs_indices=mx.array([0])))
        return True
    except RuntimeError:
        return False


def gather_mm(x: mx.array, w: mx.array, indices: mx.array, sorted_indices: bool) -> mx.array:
    """x @ w[indices], in float32 where the backend lacks a kernel for x's dtype (the
    result is cast back: the same product, computed more precisely)."""
    if gather_mm_runs_in(x.dtype, mx.default_device()):
        return mx.gather_mm(x, w, rhs_indices=indices, sorted_indices=sorted_indices)
    y = mx.gather_mm(x.astype(mx.float32), w.astype(mx.float32), rhs_indices=indices, sorted_indices=sorted_indices)
    return y.astype(x.dtype)


def sort_by_expert(x: mx.array, indices: mx.array) -> Tuple[mx.array, mx.array, mx.array]:
    """x (..., 1, 1, D) and indices (..., k) -> rows (N*k, 1, D) ordered by expert,
    their expert ids (N*k,), and the order that restores the original layout."""
    k = indices.shape[-1]
    flat_indices = indices.flatten()
    order = mx.argsort(flat_indices)
    rows = x.reshape(-1, 1, x.shape[-1])[order // k]
    return rows, flat_indices[order], mx.argsort(order)


def unsort(y: mx.array, restore: mx.array, indices_shape) -> mx.array:
    """Inverse of sort_by_expert for outputs (N*k, 1, out) -> (..., k, 1, out)."""
    return y[restore].reshape(*indices_shape, 1, y.shape[-1])


class _ExpertStack(nn.Module):
    """What a stack of expert matrices `weight` (E, out, ...) tells of its shape."""

    @property
    def output_dims(self) -> int:
        return self.weight.shape[1]

    @property
    def num_experts(self) -> int:
        return self.weight.shape[0]


class SwitchLinear(_ExpertStack):
    """E stacked linear layers; `indices` picks one per (token, slot)."""

    def __init__(self, input_dims: int, output_dims: int, num_experts: int, bias: bool = False):
        super().__init__()
        scale = input_dims**-0.5
        self.weight = mx.random.uniform(-scale, scale, (num_experts, output_dims, input_dims))
        if bias:
            self.bias = mx.zeros((num_experts, output_dims))

    @property
    def input_dims(self) -> int:
        return self.weight.shape[2]

    def __call__(self, x: mx.array, indices: mx.array, sorted_indices: bool = False) -> mx.array:
        y = gather_mm(x, self.weight.swapaxes(-1, -2), indices, sorted_indices)
        if "bias" in self:
            y = y + mx.expand_dims(self.bias[indices], -2)
        return y

    def to_quantized(self, group_size: Optional[int] = None, bits: Optional[int] = None, mode: str = "affine",
                     global_scale: bool = False):
        return QuantizedSwitchLinear.from_float(self, group_size, bits, mode, global_scale)


# NVFP4's tensor-level scale: mx.quantize(global_scale=g) takes a tensor's largest |w| and
# decodes with g / (448 * 6), E4M3's largest scale times E2M1's largest element.
NVFP4_GLOBAL_SCALE_DIVISOR = 448 * 6


def quantize_experts(weight: mx.array, group_size: int, bits: int, mode: str) -> Tuple[mx.array, mx.array, mx.array]:
    """(E, out, in) -> (packed, scales, global_scale (E,) float32): nvfp4 with one tensor
    scale per expert, its largest |w| (upstream's choice); an all-zero expert gets 1."""
    if mode != "nvfp4":
        raise ValueError(f"A per-expert global scale is nvfp4's; mode {mode!r} has none")
    largest = mx.max(mx.abs(weight), axis=(-2, -1)).astype(mx.float32)
    global_scale = mx.where(largest > 0, largest, 1.0)
    quantized = [mx.quantize(weight[e], group_size, bits, mode=mode, global_scale=global_scale[e])
                 for e in range(weight.shape[0])]
    return mx.stack([q for q, _ in quantized]), mx.stack([s for _, s in quantized]), global_scale


def quantized_group_size_and_bits(packed: mx.array, scales: mx.array, input_dims: int) -> Tuple[int, int]:
    """The group size and bits mx.quantize used for `input_dims` columns, read off its
    outputs (given None, it picks the mode's defaults): one scale per group, 32 // bits
    values per packed uint32."""
    return input_dims // scales.shape[-1], 32 * packed.shape[-1] // input_dims


class QuantizedSwitchLinear(_ExpertStack):
    """SwitchLinear quantized; with `global_scale` (nvfp4 only) each expert also holds a
    float32 tensor scale, applied to its outputs (mx.gather_qmm takes one on the GPU
    only, and an output scale is the same product everywhere)."""

    def __init__(self, input_dims: int, output_dims: int, num_experts: int, bias: bool = False,
                 group_size: Optional[int] = None, bits: Optional[int] = None, mode: str = "affine",
                 global_scale: bool = False):
        super().__init__()
        if global_scale and mode != "nvfp4":
            raise ValueError(f"A per-expert global scale is nvfp4's; mode {mode!r} has none")
        self.group_size, self.bits, self.mode = group_size, bits, mode
        weight = mx.zeros((num_experts, output_dims, input_dims))
        self.weight, self.scales, *biases = mx.quantize(weight, group_size, bits, mode=mode)
        self.group_size, self.bits = quantized_group_size_and_bits(self.weight, self.scales, input_dims)
        if biases and biases[0] is not None:
            self.biases = biases[0]
        if global_scale:
            self.global_scale = mx.ones((num_experts,), mx.float32)
        if bias:
            self.bias = mx.zeros((num_experts, output_dims))
        self.freeze()

    @classmethod
    def from_float(cls, layer: SwitchLinear, group_size: int, bits: int, mode: str, global_scale: bool = False):
        num_experts, output_dims, input_dims = layer.weight.shape
        q = cls(input_dims, output_dims, num_experts, "bias" in layer, group_size, bits, mode, global_scale)
        if global_scale:
            q.weight, q.scales, q.global_scale = quantize_experts(layer.weight, q.group_size, q.bits, mode)
        else:
            q.weight, q.scales, *biases = mx.quantize(layer.weight, group_size, bits, mode=mode)
            if biases and biases[0] is not None:
                q.biases = biases[0]
        if "bias" in layer:
            q.bias = layer.bias
        return q

    @property
    def input_dims(self) -> int:
        return self.scales.shape[-1] * self.group_size

    def __call__(self, x: mx.array, indices: mx.array, sorted_indices: bool = False) -> mx.array:
        y = mx.gather_qmm(
            x, self.weight, self.scales, self.get("biases"), rhs_indices=indices, transpose=True,
            group_size=self.group_size, bits=self.bits, mode=self.mode, sorted_indices=sorted_indices,
        )
        if "global_scale" in self:
            decode = (self.global_scale / NVFP4_GLOBAL_SCALE_DIVISOR)[indices]
            y = (y.astype(mx.float32) * mx.expand_dims(decode, (-2, -1))).astype(y.dtype)
        if "bias" in self:
            y = y + mx.expand_dims(self.bias[indices], -2)
        return y


ExpertsFn = Callable[[mx.array, mx.array, bool], mx.array]  # (rows, expert ids, sorted) -> outputs


def through_experts(x: mx.array, indices: mx.array, experts: ExpertsFn) -> mx.array:
    """x (..., D), indices (..., k) expert ids -> (..., k, D_out): `experts` applied to
    each (token, expert) pair, sorted by expert first when there are many."""
    x = mx.expand_dims(x, (-2, -3))  # (..., 1, 1, D)
    do_sort = indices.size >= SORT_THRESHOLD
    idx = indices
    if do_sort:
        x, idx, restore = sort_by_expert(x, indices)
    y = experts(x, idx, do_sort)
    if do_sort:
        y = unsort(y, restore, indices.shape)
    return y.squeeze(-2)


class SwiGLU(nn.Module):
    """SwitchGLU's default activation, called (up, gate): silu(gate) * up."""

    def __call__(self, x: mx.array, gate: mx.array) -> mx.array:
        return swiglu(gate, x)


class SwitchGLU(nn.Module):
    """Gated expert MLP: down(activation(up(x), gate(x))) per chosen expert.

    `activation(up, gate)` defaults to SwiGLU; gpt-oss passes its clamped variant."""

    def __init__(self, input_dims: int, hidden_dims: int, num_experts: int,
                 activation: Optional[Callable[[mx.array, mx.array], mx.array]] = None, bias: bool = False):
        super().__init__()
        self.gate_proj = SwitchLinear(input_dims, hidden_dims, num_experts, bias=bias)
        self.up_proj = SwitchLinear(input_dims, hidden_dims, num_experts, bias=bias)
        self.down_proj = SwitchLinear(hidden_dims, input_dims, num_experts, bias=bias)
        self.activation = SwiGLU() if activation is None else activation

    def __call__(self, x: mx.array, indices: mx.array) -> mx.array:
        """x (..., D), indices (..., k) expert ids -> (..., k, D) per-expert outputs."""
        return through_experts(x, indices, self._experts)

    def _experts(self, x: mx.array, idx: mx.array, sorted_indices: bool) -> mx.array:
        h = self.activation(self.up_proj(x, idx, sorted_indices), self.gate_proj(x, idx, sorted_indices))
        return self.down_proj(h, idx, sorted_indices)


class SwitchMLP(nn.Module):
    """Ungated expert MLP (upstream's): fc2(activation(fc1(x))) per chosen expert,
    precise GELU by default."""

    def __init__(self, input_dims: int, hidden_dims: int, num_experts: int,
                 activation: Optional[Callable[[mx.array], mx.array]] = None, bias: bool = False):
        super().__init__()
        self.fc1 = SwitchLinear(input_dims, hidden_dims, num_experts, bias=bias)
        self.fc2 = SwitchLinear(hidden_dims, input_dims, num_experts, bias=bias)
        self.activation = nn.GELU(approx="precise") if activation is None else activation

    def __call__(self, x: mx.array, indices: mx.array) -> mx.array:
        """x (..., D), indices (..., k) expert ids -> (..., k, D) per-expert outputs."""
        return through_experts(x, indices, self._experts)

    def _experts(self, x: mx.array, idx: mx.array, sorted_indices: bool) -> mx.array:
        return self.fc2(self.activation(self.fc1(x, idx, sorted_indices)), idx, sorted_indices)


# --- checkpoint layouts of expert stacks ---------------------------------------------

EXPERT_KEY = re.compile(r"^(.*\.mlp\.experts)\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")


def stack_experts(weights: Dict[str, mx.array]) -> Dict[str, mx.array]:
    """Per-expert tensors `...mlp.experts.{e}.{proj}.weight` (out, in) -> one stacked
    `...mlp.experts.{proj}.weight` (E, out, in) per layer and projection, in place."""
    groups: Dict[str, Dict[int, str]] = {}
    for key in list(weights):
        match = EXPERT_KEY.match(key)
        if match:
            stem, expert, proj = match.groups()
            groups.setdefault(f"{stem}.{proj}.weight", {})[int(expert)] = key
    for stacked, by_expert in groups.items():
        if sorted(by_expert) != list(range(len(by_expert))):
            raise ValueError(f"{stacked}: experts {sorted(by_expert)} are not 0..{len(by_expert) - 1}")
        weights[stacked] = mx.stack([weights.pop(by_expert[e]) for e in range(len(by_expert))])
    return weights


def split_fused_experts(weights: Dict[str, mx.array]) -> Dict[str, mx.array]:
    """transformers' in-memory experts, `gate_up_proj` (E, 2I, D) (gate rows first) and
    `down_proj` (E, D, I), -> our gate/up/down `.weight` (E, out, in), in place."""
    for key in [k for k in weights if k.endswith(".mlp.experts.gate_up_proj")]:
        gate, up = mx.split(weights.pop(key), 2, axis=1)
        weights[key[: -len("gate_up_proj")] + "gate_proj.weight"] = gate
        weights[key[: -len("gate_up_proj")] + "up_proj.weight"] = up
    for key in [k for k in weights if k.endswith(".mlp.experts.down_proj")]:
        weights[key + ".weight"] = weights.pop(key)
    return weights
