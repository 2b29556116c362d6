"""ERNIE 4.5 dense (`ernie4_5`, Ernie4_5ForCausalLM: baidu/ERNIE-4.5-0.3B-PT): llama with
interleaved rope and one bias switch.

What differs from llama:
- Rope turns each head's features in interleaved pairs (x[2i], x[2i+1]), MLX's
  "traditional" rope over the whole head: glm4's attention with every feature rotated.
- `use_bias` puts biases on q/k/v/o and on the MLP's three projections (False in the
  released checkpoints).
- transformers' defaults differ: head_dim 128, tied embeddings, rms_norm_eps 1e-5.
Reference: transformers `models/ernie4_5/modeling_ernie4_5.py`, `configuration_ernie4_5.py`.
"""

from dataclasses import dataclass

from . import glm4, llama


@dataclass
class ModelArgs(llama.ModelArgs):
    """Ernie4_5Config's keys (llama's plus use_bias), with its defaults."""

    rms_norm_eps: float = 1e-5
    head_dim: int = 128
    tie_word_embeddings: bool = True
    use_bias: bool = False

    def __post_init__(self):
        super().__post_init__()
        self.mlp_bias = self.mlp_bias or self.use_bias  # llama's MLP reads mlp_bias; the config says use_bias

    @property
    def qkv_bias(self) -> bool:  # read by llama.Attention
        return self.use_bias

    @property
    def o_bias(self) -> bool:
        return self.use_bias

    @property
    def rotary_dims(self) -> int:  # read by glm4.Attention: the whole head turns
        return self.head_dim


class DecoderLayer(llama.TransformerBlock):
    """llama's block with interleaved rope (MLX initialises lazily, so llama's attention,
    replaced here, is never computed)."""

    def __init__(self, args: ModelArgs, layer_type: str):
        super().__init__(args, layer_type)
        self.self_attn = glm4.Attention(args)


class Ernie4_5Model(llama.LlamaModel):
    block_class = DecoderLayer


class Model(llama.Model):
    """llama's LM head, sanitize, caches and tensor parallelism over ERNIE's blocks."""

    # KV caches roll back by themselves; the layers record nothing.
    supports_speculative_rollback = True
    backbone_class = Ernie4_5Model
