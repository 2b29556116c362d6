"""A fast BLAS for MLX's CPU backend on Linux.

The `mlx[cpu]` wheel links netlib's reference BLAS, whose multi-row matrix products run
4-16x slower than a tuned BLAS: a verify of k + 1 tokens then costs nearly k + 1 plain
steps and speculation cannot pay. The `cpu` extra of mlx_lm pulls Intel's MKL (the
`mkl` wheel: self-contained, exporting the standard cblas symbols; the pip OpenBLAS
builds either rename their symbols or need a system libgfortran). `import mlx_lm`
loads its `libmkl_rt` with RTLD_GLOBAL before anything imports `mlx.core`, so the
cblas calls of MLX's library bind to it instead of the wheel's BLAS.

- Sequential, one thread, unless MKL_THREADING_LAYER or MKL_NUM_THREADS say otherwise:
  on a 2-core CPU the matrix products are small and MLX's own work shares the cores.
- MLX_LM_REFERENCE_BLAS=1 opts out; nothing is loaded off Linux, without the `mkl`
  wheel, or once `mlx.core` is imported (it has bound its BLAS by then).
- `blas_in_use()` says which BLAS MLX's products go to, and how to get the fast one.
"""

import ctypes
import os
import re
import sys
from importlib import metadata
from pathlib import Path
from typing import Optional

OPT_OUT = "MLX_LM_REFERENCE_BLAS"
_loaded: Optional[ctypes.CDLL] = None  # libmkl_rt, once loaded
_skipped = ""  # why it was not loaded
_sequential = False  # whether it was set to run sequentially (MKL's threading layers: 1)


def _mkl_library() -> Optional[Path]:
    """libmkl_rt of the installed `mkl` distribution, if any."""
    try:
        files = metadata.files("mkl") or []
    except metadata.PackageNotFoundError:
        return None
    for file in files:
        if file.name.startswith("libmkl_rt.so"):
            path = Path(file.locate()).resolve()
            if path.is_file():
                return path
    return None


def load_fast_blas() -> None:
    """Load MKL for MLX's CPU matrix products, if it can still take effect (see the
    module docstring); safe to call more than once."""
    global _loaded, _skipped, _sequential
    if _loaded is not None or _skipped:
        return
    if not sys.platform.startswith("linux"):
        _skipped = "not on Linux (macOS uses Accelerate)"
    elif os.environ.get(OPT_OUT, "") not in ("", "0"):
        _skipped = f"{OPT_OUT} is set"
    elif "mlx.core" in sys.modules:
        _skipped = "mlx.core was imported before mlx_lm"
    else:
        library = _mkl_library()
        if library is None:
            _skipped = "the mkl wheel is not installed"
            return
        try:
            _loaded = ctypes.CDLL(str(library), mode=ctypes.RTLD_GLOBAL)
        except OSError as e:
            _skipped = f"{library.name} did not load ({e})"
            return
        # Set through its API, not the environment, which child processes would inherit.
        if "MKL_THREADING_LAYER" not in os.environ and os.environ.get("MKL_NUM_THREADS", "1") == "1":
            _loaded.MKL_Set_Threading_Layer(1)  # MKL_THREADING_SEQUENTIAL
            _sequential = True


class _SymbolInfo(ctypes.Structure):  # dladdr's Dl_info
    _fields_ = [("dli_fname", ctypes.c_char_p), ("dli_fbase", ctypes.c_void_p),
                ("dli_sname", ctypes.c_char_p), ("dli_saddr", ctypes.c_void_p)]


def cblas_library() -> Optional[str]:
    """The file of the library a global lookup of `cblas_sgemm` finds (what MLX's
    library binds to when it loads after it), or None: then MLX uses the BLAS it
    links (the wheel's, loaded locally with it)."""
    process = ctypes.CDLL(None)
    try:
        address = ctypes.cast(process.cblas_sgemm, ctypes.c_void_p)
    except AttributeError:
        return None
    info = _SymbolInfo()
    if not process.dladdr(address, ctypes.byref(info)) or not info.dli_fname:
        return None
    return info.dli_fname.decode()


def blas_in_use() -> str:
    """One line: the BLAS MLX's CPU matrix products use, its threads, and, when it is
    the slow one, how to get the fast one."""
    if not sys.platform.startswith("linux"):
        return "the platform's (Accelerate on macOS)"
    library = cblas_library()
    if library is not None and "mkl_rt" in library:
        mkl = ctypes.CDLL(library)
        buffer = ctypes.create_string_buffer(256)
        mkl.mkl_get_version_string(buffer, len(buffer))
        layer = "sequential" if _sequential else os.environ.get("MKL_THREADING_LAYER", "INTEL").lower()
        threads = 1 if layer == "sequential" else mkl.mkl_get_max_threads()
        version = re.search(r"Version ([\d.]+)", buffer.value.decode(errors="replace"))
        name = f"Intel MKL {version.group(1)}" if version else "Intel MKL"
        return f"{name} ({layer}, {threads} thread{'s' * (threads != 1)})"
    if library is not None:
        return f"{Path(library).name} (loaded before mlx.core)"
    how = ("import mlx_lm before mlx.core" if "imported before" in _skipped else
           f"unset {OPT_OUT}" if OPT_OUT in _skipped else 'pip install -e ".[cpu]" brings MKL (x86_64)')
    return (f"the mlx wheel's own, netlib's reference BLAS (multi-row products 4-16x slower; "
            f"{_skipped or 'no fast BLAS loaded'}): {how}")


def blas_line() -> Optional[str]:
    """"BLAS: ..." where MLX computes on the CPU (the CLIs print it), else None."""
    import mlx.core as mx  # (by now mlx_lm has loaded, or not, its BLAS)

    return f"BLAS: {blas_in_use()}" if mx.default_device().type == mx.DeviceType.cpu else None
