"""Qwen3 (dense): the llama decoder with a per-head RMSNorm on queries and keys before
rope, and an explicit head_dim. Reference: transformers `models/qwen3/modeling_qwen3.py`.
"""

from dataclasses import dataclass

from . import llama
from .llama import Model  # noqa: F401  (the network is llama's; ModelArgs differs)


@dataclass
class ModelArgs(llama.ModelArgs):
    use_sliding_window: bool = False

    qk_norm = True

    def __post_init__(self):
        super().__post_init__()
        if self.use_sliding_window:
            raise ValueError(
                "use_sliding_window=True is not supported for qwen3 (no released checkpoint uses it)"
            )
