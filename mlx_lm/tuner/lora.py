"""Low-rank adapter layers for inference: LoRA and DoRA around a linear layer.

LoRA (Hu et al., arXiv 2106.09685) adds a trained low-rank product to a frozen layer:

    y = linear(x) + scale * (x @ lora_a) @ lora_b       lora_a (in, r), lora_b (r, out)

DoRA (Liu et al., arXiv 2402.09353) also rescales each output row of the adapted weight
W' = W + scale * (lora_a @ lora_b)^T to a learned magnitude m (out,):

    y = (m / ||W'||_row) * (x @ W'^T) + bias

The attribute names are the tensor names upstream's trainer writes to
`adapters.safetensors` (`<layer>.lora_a`, `<layer>.lora_b`, DoRA `<layer>.m`; the base
layer's own tensors move under `<layer>.linear.`). Training is not supported here, and
an inference forward never drops out, so the trainer's dropout plays no part.
"""

from typing import Tuple, Union

import mlx.core as mx
import mlx.nn as nn

from ..models.switch_layers import QuantizedSwitchLinear, SwitchLinear, gather_mm

BaseLinear = Union[nn.Linear, nn.QuantizedLinear]
BaseSwitchLinear = Union[SwitchLinear, QuantizedSwitchLinear]


def linear_dims(linear: Union[BaseLinear, BaseSwitchLinear]) -> Tuple[int, int]:
    """(input_dims, output_dims) of a float or quantized (switch) linear layer."""
    output_dims, packed = linear.weight.shape[-2:]
    if isinstance(linear, (nn.QuantizedLinear, QuantizedSwitchLinear)):
        return packed * 32 // linear.bits, output_dims
    return packed, output_dims


def dense_weight(linear: Union[BaseLinear, BaseSwitchLinear]) -> mx.array:
    """The ([E,] out, in) weight of a (switch) linear layer, dequantized if quantized."""
    if isinstance(linear, (nn.QuantizedLinear, QuantizedSwitchLinear)):
        return mx.dequantize(
            linear.weight, linear.scales, linear.get("biases"), linear.group_size, linear.bits, mode=linear.mode
        )
    return linear.weight


def lora_delta(lora_a: mx.array, lora_b: mx.array, scale: float) -> mx.array:
    """The weight update scale * (lora_a @ lora_b)^T: lora_a (in, r), lora_b (r, out) -> (out, in)."""
    return scale * (lora_b.T @ lora_a.T)


def rescale_rows(adapted: mx.array, magnitude: mx.array) -> mx.array:
    """DoRA's effective weight: each row of the adapted weight (out, in) rescaled to
    the norm magnitude (out,) -> (out, in)."""
    norms = mx.linalg.norm(adapted.astype(mx.float32), axis=1)
    return (magnitude / norms)[:, None].astype(adapted.dtype) * adapted


def _float_linear(weight: mx.array, base: BaseLinear) -> nn.Linear:
    """A float nn.Linear holding `weight` and the base layer's bias."""
    output_dims, input_dims = weight.shape
    layer = nn.Linear(input_dims, output_dims, bias="bias" in base)
    layer.weight = weight
    if "bias" in base:
        layer.bias = base.bias
    return layer


class LoRALinear(nn.Module):
    """A linear layer plus scale * (x @ lora_a) @ lora_b."""

    def __init__(self, linear: BaseLinear, r: int, scale: float):
        super().__init__()
        input_dims, output_dims = linear_dims(linear)
        self.linear = linear
        self.scale = scale
        self.lora_a = mx.zeros((input_dims, r))
        self.lora_b = mx.zeros((r, output_dims))

    def __call__(self, x: mx.array) -> mx.array:
        z = (x @ self.lora_a.astype(x.dtype)) @ self.lora_b.astype(x.dtype)
        return self.linear(x) + self.scale * z

    def adapted_weight(self) -> mx.array:
        """The (out, in) weight this layer acts with: W + scale * (lora_a @ lora_b)^T."""
        weight = dense_weight(self.linear)
        return weight + lora_delta(self.lora_a, self.lora_b, self.scale).astype(weight.dtype)

    def fuse(self) -> nn.Linear:
        """One float linear layer computing the same function. A quantized base is
        dequantized and the result stays float: requantizing W + delta at the base's
        precision rounds most of a small delta away (upstream issue #1172)."""
        return _float_linear(self.adapted_weight(), self.linear)


class DoRALinear(LoRALinear):
    """LoRA with each output row of the adapted weight rescaled to the learned norm `m`."""

    def __init__(self, linear: BaseLinear, r: int, scale: float):
        super().__init__(linear, r, scale)
        self.m = mx.linalg.norm(dense_weight(linear).astype(mx.float32), axis=1)

    def adapted_weight(self) -> mx.array:
        return rescale_rows(super().adapted_weight(), self.m)

    def __call__(self, x: mx.array) -> mx.array:
        y = x @ self.adapted_weight().astype(x.dtype).T
        if "bias" in self.linear:
            y = y + self.linear.bias
        return y


class LoRASwitchLinear(nn.Module):
    """E stacked (expert) linear layers, each with its own low-rank update: for the
    expert e a token is routed to, + scale * (x @ lora_a[e]^T) @ lora_b[e]^T.
    lora_a (E, r, in), lora_b (E, out, r), upstream's layout."""

    def __init__(self, linear: BaseSwitchLinear, r: int, scale: float):
        super().__init__()
        num_experts = linear.weight.shape[0]
        input_dims, output_dims = linear_dims(linear)
        self.linear = linear
        self.scale = scale
        self.lora_a = mx.zeros((num_experts, r, input_dims))
        self.lora_b = mx.zeros((num_experts, output_dims, r))

    def __call__(self, x: mx.array, indices: mx.array, sorted_indices: bool = False) -> mx.array:
        z = gather_mm(x, self.lora_a.swapaxes(-1, -2).astype(x.dtype), indices, sorted_indices)  # (..., r)
        z = gather_mm(z, self.lora_b.swapaxes(-1, -2).astype(x.dtype), indices, sorted_indices)
        return self.linear(x, indices, sorted_indices) + self.scale * z

    def adapted_weight(self) -> mx.array:
        """(E, out, in): each expert's W + scale * lora_b @ lora_a."""
        weight = dense_weight(self.linear)
        return weight + (self.scale * (self.lora_b @ self.lora_a)).astype(weight.dtype)

    def fuse(self) -> SwitchLinear:
        """One float SwitchLinear computing the same function (see LoRALinear.fuse)."""
        num_experts, output_dims, input_dims = self.lora_b.shape[0], self.lora_b.shape[1], self.lora_a.shape[2]
        layer = SwitchLinear(input_dims, output_dims, num_experts, bias="bias" in self.linear)
        layer.weight = self.adapted_weight()
        if "bias" in self.linear:
            layer.bias = self.linear.bias
        return layer


def adapter_for(layer: nn.Module, fine_tune_type: str, r: int, scale: float, path: str) -> nn.Module:
    """The adapter layer wrapping `layer` (at `path`) for "lora" or "dora"."""
    if isinstance(layer, (nn.Linear, nn.QuantizedLinear)):
        return (DoRALinear if fine_tune_type == "dora" else LoRALinear)(layer, r, scale)
    if isinstance(layer, (SwitchLinear, QuantizedSwitchLinear)) and fine_tune_type == "lora":
        return LoRASwitchLinear(layer, r, scale)
    raise ValueError(
        f"{fine_tune_type} on {path} ({type(layer).__name__}) is not supported: adapters load on linear "
        "layers (LoRA and DoRA) and expert layers (LoRA only)"
    )
