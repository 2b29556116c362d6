"""GPT-BigCode (`gpt_bigcode`, GPTBigCodeForCausalLM: bigcode/starcoder, starcoderbase,
santacoder, tiny_starcoder, WizardCoder-15B, Octocoder): GPT-2's network with
multi-query attention and nn.Linear projections.

What differs from gpt2:
- `multi_query` (default True): one key/value head shared by all query heads; `c_attn`
  computes [q (n_embd) | k (head_dim) | v (head_dim)]. Without it, every head has its
  own, and c_attn's output is per head [q_h | k_h | v_h] (viewed (heads, 3 head_dim)).
- Projections are nn.Linear (out, in): nothing to transpose.
- Default activation "gelu_pytorch_tanh" (the tanh approximation). The softmax-in-fp32
  switches only change float16 rounding, and MLX's attention keeps its softmax in
  float32 anyway; they are not read.
Weights: transformers' `transformer.*` -> `model.*` (gpt2's layout).
Tensor parallel: with one KV head, every rank keeps it whole and splits the query
heads; per-head layouts split by heads.
Reference: transformers `models/gpt_bigcode/modeling_gpt_bigcode.py`,
`configuration_gpt_bigcode.py`.
"""

from dataclasses import dataclass
from typing import Optional

import mlx.core as mx
import mlx.nn as nn

from . import gpt2, sharding


@dataclass
class ModelArgs(gpt2.ModelArgs):
    """GPTBigCodeConfig's keys (gpt2's plus multi_query), with its defaults."""

    activation_function: str = "gelu_pytorch_tanh"
    multi_query: bool = True

    @property
    def num_key_value_heads(self) -> int:
        return 1 if self.multi_query else self.n_head


class Attention(gpt2.Attention):
    """gpt2's attention with one shared KV head (multi_query) or per-head fused rows."""

    def __init__(self, args: ModelArgs, layer_idx: int):
        super().__init__(args, layer_idx)
        self.n_kv_heads = args.num_key_value_heads
        self.multi_query, self.head_dim = args.multi_query, args.head_dim
        self.c_attn = nn.Linear(args.n_embd, args.n_embd + 2 * self.n_kv_heads * args.head_dim, bias=True)

    def split_heads(self, qkv: mx.array):
        """(B, L, (H + 2 H_kv) D) -> q (B, H, L, D), k and v (B, H_kv, L, D)."""
        if self.multi_query:  # [q | k | v] with one KV head
            B, L, _ = qkv.shape
            q_width = self.n_heads * self.head_dim
            q, k, v = mx.split(qkv, [q_width, q_width + self.head_dim], axis=-1)
            q = q.reshape(B, L, self.n_heads, self.head_dim).transpose(0, 2, 1, 3)
            return q, k[:, None], v[:, None]  # (B, 1, L, D)
        B, L, _ = qkv.shape
        per_head = qkv.reshape(B, L, self.n_heads, -1).transpose(0, 2, 1, 3)  # (B, H, L, 3 D)
        return tuple(mx.split(per_head, 3, axis=-1))


class Block(gpt2.Block):
    attention_class = Attention


class GPTBigCodeModel(gpt2.GPT2Model):
    block_class = Block


def shard_shared_kv(attn: Attention, group: mx.distributed.Group) -> None:
    """Multi-query c_attn in place: this rank's query heads, the one KV head whole (its
    rows repeated on every rank; the input is whole everywhere, so no sum is needed)."""
    q_rows = attn.n_heads * attn.head_dim
    attn.n_heads = sharding.per_rank(attn.n_heads, group, "n_head")
    for name in ("weight", "scales", "biases", "bias"):
        if name in attn.c_attn:
            full = attn.c_attn[name]
            attn.c_attn[name] = mx.concatenate([sharding.take_shard(full[:q_rows], group), full[q_rows:]], axis=0)
    sharding.shard_projections(attn, ("c_proj",), sharding.SHARDED_TO_ALL, group)


class Model(gpt2.Model):
    """gpt2's LM head, caches and layout over BigCode blocks (Linear weights)."""

    backbone_class = GPTBigCodeModel
    conv1d = False

    def shard(self, group: Optional[mx.distributed.Group] = None) -> None:
        """Query heads (and their c_attn rows) split across ranks, the shared KV head
        kept whole on each (per-head layouts: heads split as gpt2's); c_fc by hidden
        units; c_proj of each all-sums."""
        group = sharding.world(group)
        for layer in self.layers:
            attn = layer.attn
            if attn.multi_query:
                shard_shared_kv(attn, group)
            else:
                attn.n_heads, attn.n_kv_heads = sharding.shard_attention(
                    attn, attn.n_heads, attn.n_kv_heads, group, qkv=("c_attn",), out="c_proj")
            sharding.shard_mlp(layer.mlp, group, inputs=("c_fc",), output="c_proj")
