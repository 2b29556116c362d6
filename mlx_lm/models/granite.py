"""IBM Granite 3.x dense (`granite`, GraniteForCausalLM: granite-3.0/3.1/3.2/3.3-2b and
-8b, base and instruct): llama with muP multipliers.

What differs from llama:
- Embeddings are scaled by `embedding_multiplier` (12 in the releases), each residual
  branch (attention and MLP) by `residual_multiplier`, attention scores by
  `attention_multiplier` (not head_dim^-0.5), and the logits divided by
  `logits_scaling` (granitemoe's args and backbone extend these; the attention is
  granitemoehybrid's).
- Quantization keeps o_proj, down_proj and lm_head at 8 bits (as upstream mlx-lm): the
  residual multiplier keeps what they write small, and 4-bit floating-point modes lose
  such blocks' scales.
Weights are `model.*` (+ `lm_head.*` unless tied), as transformers and MLX converters
save them.
Reference: transformers `models/granite/modeling_granite.py`, `configuration_granite.py`.
"""

from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Union

import mlx.core as mx
import mlx.nn as nn

from . import llama
from .granitemoehybrid import Attention

# Layers whose outputs the residual multiplier shrinks (see the module docstring).
EIGHT_BIT_SUFFIXES = ("self_attn.o_proj", "mlp.down_proj")


@dataclass
class ModelArgs(llama.ModelArgs):
    """GraniteConfig's keys (llama's plus the multipliers), with its defaults; granitemoe's
    add the experts."""

    embedding_multiplier: float = 1.0
    logits_scaling: float = 1.0
    residual_multiplier: float = 1.0
    attention_multiplier: float = 1.0

    position_embedding_type = "rope"  # what granitemoehybrid's Attention reads: always rope here

    def __post_init__(self):
        super().__post_init__()
        if self.logits_scaling == 0:
            raise ValueError("logits_scaling is 0; the logits are divided by it")


class DecoderLayer(llama.TransformerBlock):
    """llama's block with the attention scaled by attention_multiplier and both branches
    by residual_multiplier (MLX initialises lazily: llama's attention, replaced here, is
    never computed)."""

    def __init__(self, args: ModelArgs, layer_type: str):
        super().__init__(args, layer_type)
        self.self_attn = Attention(args)
        self.residual_multiplier = args.residual_multiplier

    def __call__(self, x: mx.array, mask: Optional[mx.array] = None, cache=None) -> mx.array:
        h = x + self.self_attn(self.input_layernorm(x), mask, cache) * self.residual_multiplier
        return h + self.mlp(self.post_attention_layernorm(h)) * self.residual_multiplier


class GraniteModel(llama.LlamaModel):
    """llama's backbone with the embeddings times embedding_multiplier (granitemoe's
    over its MoE blocks)."""

    block_class = DecoderLayer

    def __init__(self, args: ModelArgs):
        super().__init__(args)
        self.embedding_multiplier = args.embedding_multiplier

    def __call__(
        self, inputs: mx.array, cache: Optional[List[Any]] = None, input_embeddings: Optional[mx.array] = None
    ) -> mx.array:
        h = self.embed_tokens(inputs) if input_embeddings is None else input_embeddings  # (B, L, hidden)
        return super().__call__(inputs, cache, h * self.embedding_multiplier)  # given embeddings scale too


class Model(llama.Model):
    # KV caches roll back by themselves; the layers record nothing.
    supports_speculative_rollback = True
    backbone_class = GraniteModel

    def __call__(
        self, inputs: mx.array, cache: Optional[List[Any]] = None, input_embeddings: Optional[mx.array] = None
    ) -> mx.array:
        """Token ids (B, L) -> logits (B, L, vocab), divided by logits_scaling."""
        return super().__call__(inputs, cache, input_embeddings) / self.args.logits_scaling

    def quant_predicate(self, path: str, module: nn.Module) -> Union[bool, Dict[str, int]]:
        if path.endswith(EIGHT_BIT_SUFFIXES) or path == "lm_head":
            return {"group_size": 64, "bits": 8}
        return True
