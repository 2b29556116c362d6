"""Qwen3.5 MoE: qwen3_5 with the qwen3_next sparse MLP (softmax top-k router, SwitchGLU
experts, sigmoid-gated shared expert) in every layer.

What differs from qwen3_5:
- Every layer's MLP is a SparseMoeBlock; transformers' config has no `mlp_only_layers`
  or `decoder_sparse_step`, and always renormalises the top-k router weights.
- The hub checkpoints store experts fused: `mlp.experts.gate_up_proj` (E, 2I, H; first
  half gate, second half up) and `mlp.experts.down_proj` (E, H, I); transformers saves
  them per expert. `sanitize` (qwen3_next's) turns either into `mlp.switch_mlp.*`.
Reference: transformers `models/qwen3_5_moe/modeling_qwen3_5_moe.py`.
"""

from dataclasses import dataclass

from . import qwen3_5
from .qwen3_5 import Model  # noqa: F401  (the network is qwen3_5's; ModelArgs differs)


@dataclass
class TextModelArgs(qwen3_5.TextModelArgs):
    def __post_init__(self):
        if not self.norm_topk_prob:
            raise ValueError(
                "norm_topk_prob=False is not supported for qwen3_5_moe: transformers always "
                "renormalises the top-k router weights of this family"
            )
        super().__post_init__()

    def is_moe_layer(self, layer_idx: int) -> bool:
        return True


@dataclass
class ModelArgs(qwen3_5.ModelArgs):
    text_args_class = TextModelArgs
