"""Phi-3.5-MoE (`phimoe`, PhimoeForCausalLM): Mixtral's layout with SparseMixer routing,
LayerNorms and biases.

What differs from mixtral:
- Routing is SparseMixer-v2's at inference (`sparsemixer`): the best expert, weighted by
  its softmax probability over the experts whose logit lies within a relative margin
  2 * `router_jitter_noise` of the best one (the others masked out), then the best of
  the rest, weighted likewise among those near it. Always two experts: the config's
  `num_experts_per_tok` must say 2. The weights do not sum to 1.
- Norms are LayerNorms with bias (eps `rms_norm_eps`), the final one too.
- q/k/v/o carry biases with `attention_bias`, lm_head with `lm_head_bias`.
- Rope is LongRoPE in the released checkpoint (short/long factors, with its own
  `short_mscale` / `long_mscale`), picked per call by the length it reaches.
- A `sliding_window` makes every layer slide, as in mixtral (the released config's
  window, 131072, is its whole context).
- transformers 5 holds the router as `mlp.router.weight` and the experts fused
  (`mlp.experts.gate_up_proj`, `mlp.experts.down_proj`); the hub and transformers'
  save have `block_sparse_moe.gate.weight` and `block_sparse_moe.experts.{e}.w1/w2/w3`.
Reference: transformers `models/phimoe/modeling_phimoe.py`; Liu et al., "GRIN: GRadient-
INformed MoE" (2024), arXiv:2409.12136.
"""

from dataclasses import dataclass
from typing import Tuple

import mlx.core as mx
import mlx.nn as nn

from . import mixtral
from .switch_layers import SwitchGLU


@dataclass
class ModelArgs(mixtral.ModelArgs):
    """PhimoeConfig's keys (mixtral's plus these), with its defaults."""

    num_local_experts: int = 16
    router_jitter_noise: float = 0.01
    lm_head_bias: bool = False

    def __post_init__(self):
        super().__post_init__()
        if self.num_experts_per_tok != 2:
            raise ValueError(f"num_experts_per_tok is {self.num_experts_per_tok}; phimoe's sparsemixer routes to 2")
        if self.tie_word_embeddings and self.lm_head_bias:
            raise ValueError("lm_head_bias=True with tie_word_embeddings=True is not supported (no checkpoint has it)")


def _best_within_margin(scores: mx.array, candidates: mx.array, margin: float) -> Tuple[mx.array, mx.array]:
    """The best of `candidates` (scores with the excluded experts at -inf), (..., 1), and
    its softmax weight among the candidates whose relative gap to it,
    (best - s) / max(|s|, best), is at most `margin`."""
    best = mx.argmax(candidates, axis=-1, keepdims=True)
    top = mx.take_along_axis(candidates, best, axis=-1)
    gap = (top - scores) / mx.maximum(mx.abs(scores), top)
    probs = mx.softmax(mx.where(gap > margin, -mx.inf, candidates), axis=-1, precise=True)
    return best, mx.take_along_axis(probs, best, axis=-1)


def sparsemixer(logits: mx.array, jitter_eps: float) -> Tuple[mx.array, mx.array]:
    """SparseMixer's inference routing: logits (..., E) -> expert ids (..., 2) and weights
    (..., 2), fp32. The first is the best expert; the second the best of the others,
    each weighted by its softmax among the experts within 2 * jitter_eps of it."""
    scores = logits.astype(mx.float32)
    first, w1 = _best_within_margin(scores, scores, 2 * jitter_eps)
    rest = mx.put_along_axis(scores, first, mx.array(-mx.inf, dtype=scores.dtype), axis=-1)
    second, w2 = _best_within_margin(scores, rest, 2 * jitter_eps)
    return mx.concatenate([first, second], axis=-1), mx.concatenate([w1, w2], axis=-1)


class SparseMoeBlock(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.jitter_eps = args.router_jitter_noise
        self.gate = nn.Linear(args.hidden_size, args.num_local_experts, bias=False)
        self.switch_mlp = SwitchGLU(args.hidden_size, args.intermediate_size, args.num_local_experts)

    def __call__(self, x: mx.array) -> mx.array:
        experts, weights = sparsemixer(self.gate(x), self.jitter_eps)  # (B, L, 2)
        return (self.switch_mlp(x, experts) * weights[..., None].astype(x.dtype)).sum(axis=-2)  # (B, L, hidden)


# mixtral's block, backbone and model with this family's parts swapped in (MLX
# initialises lazily, so the replaced parts are never computed).


class DecoderLayer(mixtral.DecoderLayer):
    def __init__(self, args: ModelArgs, layer_type: str):
        super().__init__(args, layer_type)
        self.block_sparse_moe = SparseMoeBlock(args)
        self.input_layernorm = nn.LayerNorm(args.hidden_size, eps=args.rms_norm_eps)
        self.post_attention_layernorm = nn.LayerNorm(args.hidden_size, eps=args.rms_norm_eps)


class PhimoeModel(mixtral.MixtralModel):
    block_class = DecoderLayer

    def __init__(self, args: ModelArgs):
        super().__init__(args)
        self.norm = nn.LayerNorm(args.hidden_size, eps=args.rms_norm_eps)


class Model(mixtral.Model):
    backbone_class = PhimoeModel

    def __init__(self, args: ModelArgs):
        super().__init__(args)
        if not args.tie_word_embeddings:
            self.lm_head = nn.Linear(args.hidden_size, args.vocab_size, bias=args.lm_head_bias)

    def sanitize(self, weights: mixtral.Weights) -> mixtral.Weights:
        """mixtral's, but transformers 5 names the in-memory router `mlp.router`."""
        weights = mixtral.from_memory_layout(weights, ("mlp", "router"), ("block_sparse_moe", "gate"))
        return super().sanitize(weights)
