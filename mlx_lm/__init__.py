"""LLM inference on MLX, with exact speculative decoding on every kind of cache."""

from ._version import __version__
from .convert import convert
from .generate import generate, stream_generate
from .utils import load

__all__ = ["__version__", "convert", "generate", "load", "stream_generate"]
