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
    python_requires=">=3.9",
    install_requires=requirements,
    extras_require={
        "cpu": [f"mlx[cpu]>={MIN_MLX_VERSION}"],
        "cuda12": [f"mlx[cuda12]>={MIN_MLX_VERSION}"],
        "cuda13": [f"mlx[cuda13]>={MIN_MLX_VERSION}"],
        "test": ["pytest", "tokenizers", "safetensors", "openai"],
    },
    entry_points={
        "console_scripts": [
            "mlx_lm = mlx_lm.cli:main",
            "mlx_lm.generate = mlx_lm.generate:main",
            "mlx_lm.convert = mlx_lm.convert:main",
            "mlx_lm.cache_prompt = mlx_lm.cache_prompt:main",
            "mlx_lm.server = mlx_lm.server:main",
            "mlx_lm.fuse = mlx_lm.fuse:main",
            "mlx_lm.chat = mlx_lm.chat:main",
            "mlx_lm.benchmark = mlx_lm.benchmark:main",
        ]
    },
)
