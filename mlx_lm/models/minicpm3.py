"""MiniCPM3 (`minicpm3`, MiniCPM3ForCausalLM: openbmb/MiniCPM3-4B): DeepSeek-V2's
multi-head latent attention (MLA) in llama's pre-norm block, with MiniCPM's muP
multipliers.

What differs from llama:
- Attention is MLA. Queries come from a q LoRA (`q_a_proj`, `q_a_layernorm`,
  `q_b_proj`), or from `q_proj` when q_lora_rank is null; keys and values from the
  latent c = norm(kv_a_proj_with_mqa(x)[:kv_lora_rank]) through `kv_b_proj`. Each head's
  key is [k_nope | k_rot], where k_rot (qk_rope_head_dim, the rest of kv_a_proj_with_mqa's
  output) is shared by all heads. Rope turns only q_rot and k_rot, in rotate-half pairs
  (DeepSeek's are interleaved). Scale (qk_nope + qk_rope)^-1/2, times yarn's mscale^2
  when a scaled rope gives mscale_all_dim (`mla.softmax_scale`). v_head_dim defaults to
  hidden_size / num_attention_heads; the latent norms use eps 1e-6, not rms_norm_eps.
- The cache holds the latent, not per-head keys and values: mla.py's latent
  attention (a KVCache of c (B, 1, S, kv_lora_rank) and the rotated k_rot (B, 1, S,
  qk_rope_head_dim), attended with kv_b_proj absorbed), so it trims, batches and saves
  as any KV cache. kv_b_proj is read as a matrix and stays float when quantizing.
- Embeddings are scaled by `scale_emb`, every residual branch by scale_depth /
  sqrt(num_hidden_layers), and the final hidden state divided by hidden_size /
  dim_model_base before lm_head, tied or not (scale_depth / dim_model_base null: no-op).
- The hub's rope scaling is longrope over the rotated features (rope_utils.SuScaledRoPE:
  per-frequency short / long factors, switched per forward call as transformers does).
- transformers' defaults: tied embeddings, rope theta 10000.
Config: the hub's `rope_theta` / `rope_scaling` ({"type": "longrope", ...}) or
transformers 5's `rope_parameters`. Weights: the hub's names are transformers' and ours;
checkpoints converted by upstream mlx-lm load too (a quantized kv_b_proj is dequantized).
Reference: transformers `models/minicpm3/modeling_minicpm3.py`, `configuration_minicpm3.py`.
"""

import math
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Union

import mlx.core as mx
import mlx.nn as nn

from . import llama, mla, sharding
from .base import BaseModelArgs, run_hybrid_layers
from .cache import KVCache
from .deepseek_v3 import dequantized
from .llama import MLP
from .rope_utils import initialize_rope, resolve_rope


@dataclass
class ModelArgs(BaseModelArgs):
    """MiniCPM3Config's keys, with its defaults (openbmb/MiniCPM3-4B's)."""

    model_type: str
    vocab_size: int = 73448
    hidden_size: int = 2560
    intermediate_size: int = 6400
    num_hidden_layers: int = 62
    num_attention_heads: int = 40
    num_key_value_heads: Optional[int] = None
    hidden_act: str = "silu"
    max_position_embeddings: int = 32768
    rms_norm_eps: float = 1e-5
    tie_word_embeddings: bool = True
    rope_theta: Optional[float] = None
    rope_scaling: Optional[Dict[str, Any]] = None
    rope_parameters: Optional[Dict[str, Any]] = None
    attention_bias: bool = False
    mlp_bias: bool = False
    kv_lora_rank: int = 256
    q_lora_rank: Optional[int] = 768
    qk_nope_head_dim: int = 64
    qk_rope_head_dim: int = 32
    v_head_dim: Optional[int] = None
    scale_emb: float = 12.0
    scale_depth: Optional[float] = 1.4
    dim_model_base: Optional[float] = 256

    def __post_init__(self):
        if self.num_key_value_heads is None:
            self.num_key_value_heads = self.num_attention_heads
        if self.hidden_size % self.num_attention_heads:
            raise ValueError(f"hidden_size ({self.hidden_size}) is not a multiple of num_attention_heads "
                             f"({self.num_attention_heads})")
        if self.v_head_dim is None:
            self.v_head_dim = self.hidden_size // self.num_attention_heads
        if self.scale_depth is None:  # transformers: a residual scale of 1
            self.scale_depth = math.sqrt(self.num_hidden_layers)
        if self.dim_model_base is None:  # transformers: no logit scaling
            self.dim_model_base = self.hidden_size
        theta, self.rope_scaling, _ = resolve_rope(self.rope_theta, self.rope_scaling, self.rope_parameters)
        self.rope_theta = 10000.0 if theta is None else theta
        check_mla_args(self)
        if not self.dim_model_base > 0:
            raise ValueError(f"dim_model_base must be positive, got {self.dim_model_base!r}")

    @property
    def logits_scaling(self) -> float:
        """What the final hidden state is divided by before lm_head."""
        return self.hidden_size / self.dim_model_base


def check_mla_args(args) -> None:
    """What every MLA family's ModelArgs refuses: key/value heads other than the query
    heads (kv_b_proj makes keys and values for each head) and activations but SiLU."""
    if args.num_key_value_heads != args.num_attention_heads:
        raise ValueError(f"num_key_value_heads ({args.num_key_value_heads}) must equal num_attention_heads "
                         f"({args.num_attention_heads}): latent attention makes keys and values for every head")
    if args.hidden_act != "silu":
        raise ValueError(f"hidden_act {args.hidden_act!r} is not supported; this family uses 'silu'")


class DecoderLayer(nn.Module):
    """Pre-norm, each branch scaled: x + s attn(norm(x)), then + s mlp(norm(.))."""

    def __init__(self, args: ModelArgs):
        super().__init__()
        rope = initialize_rope(args.qk_rope_head_dim, args.rope_theta, False, args.rope_scaling,
                               args.max_position_embeddings)  # rotate-half pairs, unlike DeepSeek's
        scale = mla.softmax_scale(args.qk_nope_head_dim + args.qk_rope_head_dim, args.rope_scaling)
        self.self_attn = mla.LatentAttention(args, rope, scale)
        self.mlp = MLP(args.hidden_size, args.intermediate_size, bias=args.mlp_bias)
        self.input_layernorm = nn.RMSNorm(args.hidden_size, eps=args.rms_norm_eps)
        self.post_attention_layernorm = nn.RMSNorm(args.hidden_size, eps=args.rms_norm_eps)
        self.residual_scale = args.scale_depth / math.sqrt(args.num_hidden_layers)

    def __call__(self, x: mx.array, mask=None, cache: Optional[KVCache] = None) -> mx.array:
        h = x + self.self_attn(self.input_layernorm(x), mask, cache) * self.residual_scale
        return h + self.mlp(self.post_attention_layernorm(h)) * self.residual_scale


class MiniCPM3Model(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.scale_emb = args.scale_emb
        self.embed_tokens = nn.Embedding(args.vocab_size, args.hidden_size)
        self.layers = [DecoderLayer(args) for _ in range(args.num_hidden_layers)]
        self.norm = nn.RMSNorm(args.hidden_size, eps=args.rms_norm_eps)

    def __call__(self, inputs: mx.array, cache: Optional[List[KVCache]] = None,
                 input_embeddings: Optional[mx.array] = None) -> mx.array:
        h = self.embed_tokens(inputs) if input_embeddings is None else input_embeddings  # (B, L, hidden)
        return self.norm(run_hybrid_layers(h * self.scale_emb, self.layers, cache, 0))  # given embeddings scale too


class Model(llama.Model):
    """llama's head (tied or not), sanitize (stored rope frequencies and a tied head's
    lm_head.weight dropped: the hub's, transformers' and our names agree) and layers."""

    # Latent KV caches roll back by themselves; the layers record nothing.
    supports_speculative_rollback = True
    backbone_class = MiniCPM3Model

    def __call__(self, inputs: mx.array, cache: Optional[List[KVCache]] = None,
                 input_embeddings: Optional[mx.array] = None) -> mx.array:
        """Token ids (B, L) -> logits (B, L, vocab): the head's output over the final hidden
        state / logits_scaling (the same product; lm_head has no bias)."""
        return super().__call__(inputs, cache, input_embeddings) / self.args.logits_scaling

    def sanitize(self, weights: Dict[str, mx.array]) -> Dict[str, mx.array]:
        """llama's; a kv_b_proj quantized by upstream mlx-lm (which attends over expanded
        keys and values) dequantized, as the latent attention reads it as a float matrix
        (guarded by its `.scales`, which it consumes)."""
        weights = super().sanitize(weights)
        for key in [k for k in weights if k.endswith(".kv_b_proj.scales")]:
            name = key[: -len(".scales")]
            weights[name + ".weight"] = dequantized(weights, name, self.args.kv_lora_rank)
        return weights

    def quant_predicate(self, path: str, module: nn.Module) -> Union[bool, Dict[str, int]]:
        """kv_b_proj is read as a matrix (absorbed into the latent attention): float."""
        return not path.endswith("kv_b_proj")

    def make_cache(self) -> List[KVCache]:
        return [KVCache() for _ in self.layers]

    def shard(self, group: Optional[mx.distributed.Group] = None) -> None:
        """Tensor parallel over `group` (default: the global group), in place: MLA by
        heads (a rank's latent cache is whole: every head reads it), MLPs by hidden
        units. Embeddings, lm_head and norms stay whole."""
        group = sharding.world(group)
        for layer in self.layers:
            layer.self_attn.shard(group)
            sharding.shard_mlp(layer.mlp, group)
