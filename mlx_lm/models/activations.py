"""Activation functions by their transformers names (`hidden_act`, `activation_function`),
the gated forms upstream names (`swiglu`, `precise_swiglu`, gpt-oss's `swiglu_oai`),
and xIELU (Apertus), whose parameters are learned.

Each is a pure elementwise function of arrays. The GELU variants follow transformers'
`activations.py`: "gelu" and "gelu_python" are the exact erf form; "gelu_new",
"gelu_pytorch_tanh" and "gelu_fast" are the same tanh approximation written three ways
(equal up to float rounding); "quick_gelu" is x * sigmoid(1.702 x).

Reference: transformers `activations.py`; xIELU: "Deriving Activation Functions Using
Integration" (arXiv 2411.13010).
"""

from typing import Callable, Dict

import mlx.core as mx
import mlx.nn as nn


def swiglu(gate: mx.array, x: mx.array) -> mx.array:
    """silu(gate) * x, elementwise (upstream's argument order: the gate first)."""
    return nn.silu(gate) * x


def precise_swiglu(h: mx.array, gate: mx.array, x: mx.array) -> mx.array:
    """swiglu computed in float32 and cast to h's dtype (half-precision silu loses the
    small products a long sum of them adds up)."""
    return swiglu(gate.astype(mx.float32), x.astype(mx.float32)).astype(h.dtype)


def swiglu_oai(gate: mx.array, x: mx.array, alpha: float = 1.702, limit: float = 7.0) -> mx.array:
    """gpt-oss's gated activation: min(gate, limit) * sigmoid(alpha * min(gate, limit))
    * (clip(x, -limit, limit) + 1); the gate is clipped from above only."""
    gate = mx.minimum(gate, limit)
    return gate * mx.sigmoid(alpha * gate) * (mx.clip(x, -limit, limit) + 1)


class SwigluOAI(nn.Module):
    """swiglu_oai with fixed alpha and limit, called as upstream's: (x, gate)."""

    def __init__(self, alpha: float = 1.702, limit: float = 7.0):
        super().__init__()
        self.alpha, self.limit = alpha, limit

    def __call__(self, x: mx.array, gate: mx.array) -> mx.array:
        return swiglu_oai(gate, x, self.alpha, self.limit)


def relu_squared(x: mx.array) -> mx.array:
    """relu(x)^2 (transformers' "relu2", Nemotron's MLP)."""
    return mx.square(nn.relu(x))


ACTIVATIONS: Dict[str, Callable[[mx.array], mx.array]] = {
    "gelu": nn.gelu,
    "gelu_python": nn.gelu,
    "gelu_new": nn.gelu_approx,
    "gelu_pytorch_tanh": nn.gelu_approx,
    "gelu_fast": nn.gelu_approx,
    "quick_gelu": nn.gelu_fast_approx,
    "relu": nn.relu,
    "relu2": relu_squared,
    "silu": nn.silu,
    "swish": nn.silu,
}


def activation(name: str, field: str = "hidden_act") -> Callable[[mx.array], mx.array]:
    """The function transformers calls `name`; a ValueError naming `field` and the
    value when it is not one of ACTIVATIONS."""
    if name not in ACTIVATIONS:
        raise ValueError(f"{field} {name!r} is not supported; use one of {sorted(ACTIVATIONS)}")
    return ACTIVATIONS[name]


def xielu(x: mx.array, alpha_p: mx.array, alpha_n: mx.array, beta: mx.array, eps: mx.array) -> mx.array:
    """xIELU of x (any shape), with scalar parameters:
    a_p = softplus(alpha_p), a_n = beta + softplus(alpha_n);
    x > 0: a_p x^2 + beta x;  x <= 0: a_n (expm1(min(x, eps)) - x) + beta x.
    (eps < 0 keeps expm1's argument off 0, where the negative branch's gradient vanishes.)"""
    a_p = nn.softplus(alpha_p)
    a_n = beta + nn.softplus(alpha_n)
    positive = a_p * x * x + beta * x
    negative = (mx.expm1(mx.minimum(x, eps)) - x) * a_n + beta * x
    return mx.where(x > 0, positive, negative)


class XIELU(nn.Module):
    """xIELU with its learned scalars, initialised as transformers' XIELUActivation (the
    checkpoints hold them: `alpha_p`, `alpha_n`, `beta`, `eps`). alpha_p and alpha_n
    are stored as softplus^-1 of their initial values (alpha_n of its offset from beta)."""

    def __init__(self, alpha_p_init: float = 0.8, alpha_n_init: float = 0.8, beta: float = 0.5, eps: float = -1e-6):
        super().__init__()
        inverse_softplus = lambda y: mx.log(mx.expm1(mx.array(y, dtype=mx.float32)))  # noqa: E731
        self.alpha_p = inverse_softplus(alpha_p_init)  # () as MLX converters save it
        self.alpha_n = inverse_softplus(alpha_n_init - beta)
        self.beta = mx.array(beta, dtype=mx.float32)
        self.eps = mx.array(eps, dtype=mx.float32)

    def __call__(self, x: mx.array) -> mx.array:
        return xielu(x, self.alpha_p, self.alpha_n, self.beta, self.eps).astype(x.dtype)


XieLU = XIELU  # upstream's spelling of the same class
