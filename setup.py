import sys
from pathlib import Path

from setuptools import setup

package_dir = Path(__file__).parent / "mlx_lm"
version = {}
exec((package_dir / "_version.py").read_text(), version)

MIN_MLX_VERSION = "0.29.0"
requirements = [
    "numpy",
    "transformers>=4.46",
    "huggingface-hub",
    "sentencepiece",
    "jinja2",
    "protobuf",
]
# On Linux the MLX backend is chosen through an extra (cpu, cuda12, cuda13).
if sys.platform == "darwin":
    requirements.append(f"mlx>={MIN_MLX_VERSION}")

setup(
    name="mlx-lm",
    version=version["__version__"],
    description="LLMs with MLX, with exact speculative decoding on every kind of cache",
    long_description=(Path(__file__).parent / "README.md").read_text(encoding="utf-8"),
    long_description_content_type="text/markdown",
    license="MIT",
    packages=["mlx_lm", "mlx_lm.models", "mlx_lm.tuner"],
    # Outside the package, so that a missing MLX reads as one line (see its docstring).
    py_modules=["_mlx_lm_console"],
    python_requires=">=3.9",
    install_requires=requirements,
    extras_require={
        # MKL: a fast BLAS for MLX's CPU backend, loaded by `import mlx_lm` (fast_blas.py).
        "cpu": [f"mlx[cpu]>={MIN_MLX_VERSION}", 'mkl>=2024; platform_system == "Linux" and platform_machine == "x86_64"'],
        "cuda12": [f"mlx[cuda12]>={MIN_MLX_VERSION}"],
        "cuda13": [f"mlx[cuda13]>={MIN_MLX_VERSION}"],
        "test": ["pytest", "pytest-xdist", "tokenizers", "safetensors", "openai"],
    },
    entry_points={
        "console_scripts": [
            "mlx_lm = _mlx_lm_console:main",
            "mlx_lm.generate = _mlx_lm_console:generate",
            "mlx_lm.convert = _mlx_lm_console:convert",
            "mlx_lm.cache_prompt = _mlx_lm_console:cache_prompt",
            "mlx_lm.server = _mlx_lm_console:server",
            "mlx_lm.fuse = _mlx_lm_console:fuse",
            "mlx_lm.chat = _mlx_lm_console:chat",
            "mlx_lm.benchmark = _mlx_lm_console:benchmark",
        ]
    },
)
