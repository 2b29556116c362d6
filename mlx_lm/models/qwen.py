"""Qwen (`qwen`, QWenLMHeadModel: Qwen/Qwen-1_8B, Qwen-7B, Qwen-14B, Qwen-72B and their
-Chat models; the 2023 first generation, run by the checkpoints' own remote code, not
in transformers): llama's block under GPT-2-style names.

What differs from llama:
- `c_attn` computes [q | k | v] in one projection with a bias (multi-head: as many key
  as query heads, each `kv_channels` wide); `c_proj` mixes the heads back, biased
  unless `no_bias` (default True).
- The MLP is c_proj(w1(x) * silu(w2(x))): w2 is the gate, w1 the up projection (the
  hub checkpoints' order), each `intermediate_size // 2` wide, biased unless no_bias.
- RMSNorms `ln_1`, `ln_2`, `ln_f` (eps `layer_norm_epsilon`).
- Rope turns the first `rotary_pct` of each head in rotate-half pairs, base
  `rotary_emb_base`.
- `use_logn_attn`: queries at positions p >= `seq_length` are scaled by
  log(p + 1) / log(seq_length), so attention stays as sharp past the training length.
- `use_dynamic_ntk`: the remote code picks one NTK rope base from the length of the
  *first* forward of a generation (decode steps reuse it), so a first call of at most
  `seq_length` tokens leaves plain rope for good; chunked prefill (chunks of at most
  seq_length) is therefore exact. A first call longer than seq_length would need the
  rescaled base, which is not implemented: it raises.
Reference: the checkpoints' `modeling_qwen.py` / `configuration_qwen.py` (Qwen/Qwen-7B on
the hub); tests/fixtures/make_qwen_reference.py holds an independent torch reference.
"""

import math
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Union

import mlx.core as mx
import mlx.nn as nn

from . import gpt2, sharding
from .base import BaseModelArgs, scaled_dot_product_attention
from .cache import KVCache
from .llama4 import query_positions


@dataclass
class ModelArgs(BaseModelArgs):
    """QWenConfig's keys (the hub's configuration_qwen.py), with its defaults."""

    model_type: str
    vocab_size: int = 151936
    hidden_size: int = 4096
    num_hidden_layers: int = 32
    num_attention_heads: int = 32
    kv_channels: int = 128
    intermediate_size: int = 22016
    layer_norm_epsilon: float = 1e-6
    rotary_pct: float = 1.0
    rotary_emb_base: float = 10000.0
    seq_length: int = 8192
    scale_attn_weights: bool = True
    use_dynamic_ntk: bool = True
    use_logn_attn: bool = True
    no_bias: bool = True
    tie_word_embeddings: bool = False

    def __post_init__(self):
        if self.num_attention_heads * self.kv_channels != self.hidden_size:
            raise ValueError(f"num_attention_heads * kv_channels ({self.num_attention_heads} * {self.kv_channels}) "
                             f"must equal hidden_size ({self.hidden_size}): c_attn's output splits by hidden_size")
        if not 0 < self.rotary_pct <= 1:
            raise ValueError(f"rotary_pct must be in (0, 1], got {self.rotary_pct}")
        if self.intermediate_size % 2:
            raise ValueError(f"intermediate_size ({self.intermediate_size}) must be even: w1 and w2 are each half")

    @property
    def rotary_dims(self) -> int:
        return int(self.kv_channels * self.rotary_pct)


def logn_scale(positions: mx.array, seq_length: int) -> mx.array:
    """Qwen's query scale at integer `positions` (any shape), float32:
    log(p + 1) / log(seq_length) where p + 1 > seq_length, else 1."""
    ones = positions.astype(mx.float32) + 1.0
    return mx.where(ones > seq_length, mx.log(ones) / math.log(seq_length), 1.0)


class Attention(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.n_heads, self.head_dim = args.num_attention_heads, args.kv_channels
        width = self.n_heads * self.head_dim
        self.scale = self.head_dim**-0.5 if args.scale_attn_weights else 1.0
        self.seq_length = args.seq_length
        self.use_logn_attn, self.use_dynamic_ntk = args.use_logn_attn, args.use_dynamic_ntk
        self.c_attn = nn.Linear(args.hidden_size, 3 * width, bias=True)
        self.c_proj = nn.Linear(width, args.hidden_size, bias=not args.no_bias)
        self.rope = nn.RoPE(args.rotary_dims, traditional=False, base=args.rotary_emb_base)

    def check_ntk(self, offset: Union[int, mx.array], num_tokens: int) -> None:
        if self.use_dynamic_ntk and isinstance(offset, int) and offset == 0 and num_tokens > self.seq_length:
            raise ValueError(
                f"a first forward of {num_tokens} tokens is longer than seq_length ({self.seq_length}): Qwen's "
                "dynamic NTK would rescale rope for the whole generation, which is not implemented; feed the "
                "prompt in chunks of at most seq_length (generation does), or set use_dynamic_ntk false")

    def __call__(self, x: mx.array, mask: Optional[mx.array] = None, cache=None) -> mx.array:
        B, L, _ = x.shape
        offset = cache.offset if cache is not None else 0
        self.check_ntk(offset, L)
        q, k, v = (t.reshape(B, L, self.n_heads, -1).transpose(0, 2, 1, 3)  # (B, H, L, D)
                   for t in mx.split(self.c_attn(x), 3, axis=-1))
        q, k = self.rope(q, offset=offset), self.rope(k, offset=offset)
        if self.use_logn_attn:
            scales = logn_scale(query_positions(offset, L), self.seq_length)
            q = (q * scales[:, None, :, None]).astype(q.dtype)  # (B or 1, 1, L, 1)
        if cache is not None:
            k, v = cache.update_and_fetch(k, v)
        out = scaled_dot_product_attention(q, k, v, cache=cache, scale=self.scale, mask=mask)
        return self.c_proj(out.transpose(0, 2, 1, 3).reshape(B, L, -1))


class MLP(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        width = args.intermediate_size // 2
        self.w1 = nn.Linear(args.hidden_size, width, bias=not args.no_bias)
        self.w2 = nn.Linear(args.hidden_size, width, bias=not args.no_bias)
        self.c_proj = nn.Linear(width, args.hidden_size, bias=not args.no_bias)

    def __call__(self, x: mx.array) -> mx.array:
        return self.c_proj(self.w1(x) * nn.silu(self.w2(x)))


class Block(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.ln_1 = nn.RMSNorm(args.hidden_size, eps=args.layer_norm_epsilon)
        self.attn = Attention(args)
        self.ln_2 = nn.RMSNorm(args.hidden_size, eps=args.layer_norm_epsilon)
        self.mlp = MLP(args)

    def __call__(self, x: mx.array, mask: Optional[mx.array] = None, cache=None) -> mx.array:
        h = x + self.attn(self.ln_1(x), mask, cache)
        return h + self.mlp(self.ln_2(h))


class Model(nn.Module):
    # KV caches roll back by themselves; the layers record nothing.
    supports_speculative_rollback = True

    def __init__(self, args: ModelArgs):
        super().__init__()
        self.args = args
        self.model_type = args.model_type
        blocks = [Block(args) for _ in range(args.num_hidden_layers)]
        self.transformer = gpt2.Decoder(args.vocab_size, args.hidden_size, blocks,
                                        nn.RMSNorm(args.hidden_size, eps=args.layer_norm_epsilon))
        if not args.tie_word_embeddings:
            self.lm_head = nn.Linear(args.hidden_size, args.vocab_size, bias=False)

    def __call__(self, inputs: mx.array, cache: Optional[List[Any]] = None) -> mx.array:
        """Token ids (B, L) -> logits (B, L, vocab)."""
        h = self.transformer(inputs, cache)
        return self.transformer.wte.as_linear(h) if self.args.tie_word_embeddings else self.lm_head(h)

    def sanitize(self, weights: Dict[str, mx.array]) -> Dict[str, mx.array]:
        """The remote code's rope buffer is computed here; when tied, no lm_head."""
        weights = {k: v for k, v in weights.items() if not k.endswith("rotary_emb.inv_freq")}
        if self.args.tie_word_embeddings:
            weights.pop("lm_head.weight", None)
        return weights

    @property
    def layers(self) -> List[Block]:
        return self.transformer.h

    def make_cache(self) -> List[KVCache]:
        return [KVCache() for _ in self.layers]

    def shard(self, group: Optional[mx.distributed.Group] = None) -> None:
        """Tensor parallel over `group`: c_attn's q, k and v pieces by heads, c_proj
        all-sums; w1 and w2 by hidden units, the MLP's c_proj all-sums."""
        group = sharding.world(group)
        for layer in self.layers:
            attn = layer.attn
            attn.n_heads, _ = sharding.shard_attention(attn, attn.n_heads, attn.n_heads, group, qkv=("c_attn",),
                                                       out="c_proj", qkv_segments=3)
            sharding.shard_mlp(layer.mlp, group, inputs=("w1", "w2"), output="c_proj")
