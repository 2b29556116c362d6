"""LLM inference on MLX, with exact speculative decoding on every kind of cache.

The public names load, generate, stream_generate, batch_generate and convert are
imported on first use, so `import mlx_lm` stays cheap and `python -m mlx_lm.generate`
runs its module once (it is not imported first by the package).
"""

import logging
import sys
import types
from importlib import import_module

from . import fast_blas
from ._version import __version__

# Public name -> the module (of this package) that defines it.
_PUBLIC = {"load": "utils", "generate": "generate", "stream_generate": "generate", "convert": "convert",
           "batch_generate": "batching"}

__all__ = ["__version__", "batch_generate", "convert", "generate", "load", "stream_generate"]

_MISSING_MLX = (
    "mlx_lm needs MLX, which is not installed ({error}). On macOS: pip install mlx. On Linux "
    "MLX comes with the extra for your backend; from a checkout of mlx_lm: "
    'pip install -e ".[cpu]" (CPU), ".[cuda12]" or ".[cuda13]" (NVIDIA GPUs, CUDA 12 or 13).'
)


def _check_mlx() -> None:
    try:
        import mlx.core  # noqa: F401
    except ImportError as e:
        if not (e.name or "").startswith("mlx"):  # MLX is there but something it needs is not
            raise
        raise ModuleNotFoundError(_MISSING_MLX.format(error=e), name=e.name) from None


class _DropTorchNotice(logging.Filter):
    """transformers announces at import that PyTorch is missing; mlx_lm uses only its
    tokenizers, so that notice is noise. Every other record passes."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not record.getMessage().startswith("PyTorch was not found")


class _Package(types.ModuleType):
    """Keeps `mlx_lm.generate` and `mlx_lm.convert` the functions (as upstream has them)
    after their modules are imported: the import system binds a submodule on its package
    under the same name."""

    def __setattr__(self, name: str, value) -> None:
        if isinstance(value, types.ModuleType) and _PUBLIC.get(name) == name:
            value = getattr(value, name)
        super().__setattr__(name, value)


def __getattr__(name: str):
    if name not in _PUBLIC:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(import_module(f".{_PUBLIC[name]}", __name__), name)
    setattr(sys.modules[__name__], name, value)
    return value


fast_blas.load_fast_blas()  # before mlx.core binds its BLAS (fast_blas.py)
_check_mlx()
logging.getLogger("transformers").addFilter(_DropTorchNotice())
sys.modules[__name__].__class__ = _Package
