"""Gemma (`gemma`, GemmaForCausalLM: google/gemma-2b, gemma-7b, gemma-1.1, CodeGemma):
llama with Gemma's norms, embeddings and GeGLU.

What differs from llama (the pieces are Gemma 3's, which kept them):
- Every RMSNorm is zero-centred, x_hat * (1 + w) in float32. transformers' and MLX
  converters' checkpoints all store w, so the 1 is added in the forward, once, and
  `sanitize` never touches a norm.
- Embeddings are scaled by sqrt(hidden_size), the factor rounded to the compute dtype
  first, as transformers does (embeddings given in place of token ids are not scaled).
- The MLP is GeGLU with the tanh-approximate gelu. The hub configs say
  `hidden_act: "gelu"`, which transformers reads as the tanh gelu, and so do we.
- head_dim is its own key (256 in the releases, so 16 heads * 256 != 3072 in gemma-7b);
  embeddings are tied by default.
Weights are `model.*` (+ `lm_head.*` unless tied).
Reference: transformers `models/gemma/modeling_gemma.py`, `configuration_gemma.py`.
"""

from dataclasses import dataclass
from typing import Any, List, Optional

import mlx.core as mx

from . import gemma3, llama

# transformers maps the hub's legacy "gelu" onto the tanh approximation for Gemma.
TANH_GELU_NAMES = ("gelu_pytorch_tanh", "gelu")


@dataclass
class ModelArgs(llama.ModelArgs):
    """GemmaConfig's keys (llama's plus these), with its defaults."""

    head_dim: Optional[int] = 256
    max_position_embeddings: int = 8192
    tie_word_embeddings: bool = True
    hidden_act: str = "gelu_pytorch_tanh"
    use_bidirectional_attention: Optional[bool] = None

    def __post_init__(self):
        super().__post_init__()
        if self.hidden_act not in TANH_GELU_NAMES:
            raise ValueError(f"hidden_act {self.hidden_act!r} is not supported; gemma uses 'gelu_pytorch_tanh'")
        if self.use_bidirectional_attention:
            raise ValueError("use_bidirectional_attention=True (an embedding model) is not supported; gemma is causal")


class DecoderLayer(llama.TransformerBlock):
    """llama's pre-norm block with zero-centred norms and GeGLU (MLX initialises
    lazily: the modules replaced here are never computed)."""

    def __init__(self, args: ModelArgs, layer_type: str):
        super().__init__(args, layer_type)
        self.mlp = gemma3.MLP(args.hidden_size, args.intermediate_size)
        self.input_layernorm = gemma3.RMSNorm(args.hidden_size, args.rms_norm_eps)
        self.post_attention_layernorm = gemma3.RMSNorm(args.hidden_size, args.rms_norm_eps)


class GemmaModel(llama.LlamaModel):
    block_class = DecoderLayer

    def __init__(self, args: ModelArgs):
        super().__init__(args)
        self.norm = gemma3.RMSNorm(args.hidden_size, args.rms_norm_eps)
        self.hidden_size = args.hidden_size

    def __call__(
        self, inputs: mx.array, cache: Optional[List[Any]] = None, input_embeddings: Optional[mx.array] = None
    ) -> mx.array:
        if input_embeddings is None:  # transformers scales looked-up embeddings only
            input_embeddings = gemma3.scale_embeddings(self.embed_tokens(inputs), self.hidden_size)  # (B, L, hidden)
        return super().__call__(inputs, cache, input_embeddings)


class Model(llama.Model):
    """llama's LM head (tied or `lm_head`), sanitize, KV caches and tensor parallelism
    over Gemma's blocks."""

    # KV caches roll back by themselves; the layers record nothing.
    supports_speculative_rollback = True
    backbone_class = GemmaModel
