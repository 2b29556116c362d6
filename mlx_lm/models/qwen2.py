"""Qwen2 / Qwen2.5: the llama decoder with biases on the q, k and v projections (none on
o_proj). Reference: transformers `models/qwen2/modeling_qwen2.py`.
"""

from dataclasses import dataclass

from . import llama
from .llama import Model  # noqa: F401  (the network is llama's; ModelArgs differs)


@dataclass
class ModelArgs(llama.ModelArgs):
    rms_norm_eps: float = 1e-6
    tie_word_embeddings: bool = False
    use_sliding_window: bool = False

    qkv_bias = True
    o_bias = False

    def __post_init__(self):
        super().__post_init__()
        if self.use_sliding_window:
            raise ValueError(
                "use_sliding_window=True is not supported for qwen2 (no released checkpoint uses it)"
            )
