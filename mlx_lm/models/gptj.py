"""GPT-J (`gptj`, GPTJForCausalLM: EleutherAI/gpt-j-6b, and its fine-tunes): one
LayerNorm per block feeding attention and MLP in parallel, partial interleaved rope.

What differs from llama:
- Block: h = ln_1(x); out = x + attn(h) + mlp(h) (no second norm).
- Rope turns only the first `rotary_dim` features of each head (default 64), in
  interleaved pairs (x[2i], x[2i+1]) ("rotate every two"): MLX's traditional rope,
  base 10000; the other features pass.
- q/k/v/out_proj have no biases; the MLP (fc_in, act, fc_out) and lm_head do.
  act by `activation_function` (default "gelu_new").
- Untied embeddings by default; a tied config shares lm_head's weight with wte but
  keeps lm_head's own bias, as transformers does (sanitize copies the weight in).
Weights: transformers' `transformer.*` and `lm_head.*` names (MLX layout too);
upstream mlx-lm's `model.*` are renamed.
Reference: transformers `models/gptj/modeling_gptj.py`, `configuration_gptj.py`.
"""

from dataclasses import dataclass
from typing import Any, Dict, List, Optional

import mlx.core as mx
import mlx.nn as nn

from . import gpt2, sharding
from .activations import activation
from .base import BaseModelArgs, resolve_aliases, scaled_dot_product_attention
from .cache import KVCache

HF_BUFFERS = (".attn.bias", ".attn.masked_bias")  # causal-mask buffers in old checkpoints


@dataclass
class ModelArgs(BaseModelArgs):
    """GPTJConfig's keys with its defaults (and gpt2's long aliases of the short names)."""

    model_type: str
    vocab_size: int = 50400
    n_embd: Optional[int] = None
    n_positions: Optional[int] = None
    n_head: Optional[int] = None
    n_layer: Optional[int] = None
    rotary_dim: Optional[int] = 64
    n_inner: Optional[int] = None
    activation_function: str = "gelu_new"
    layer_norm_epsilon: float = 1e-5
    tie_word_embeddings: bool = False
    hidden_size: Optional[int] = None
    max_position_embeddings: Optional[int] = None
    num_attention_heads: Optional[int] = None
    num_hidden_layers: Optional[int] = None

    def __post_init__(self):
        resolve_aliases(self, gpt2.aliases(n_embd=4096, n_positions=2048, n_head=16, n_layer=28))  # GPTJConfig's
        if self.n_embd % self.n_head:
            raise ValueError(f"n_embd ({self.n_embd}) must be a multiple of n_head ({self.n_head})")
        head_dim = self.n_embd // self.n_head
        # transformers sizes its rope table by n_embd when rotary_dim is None, which only
        # fits a single head: refuse rather than guess.
        if not (isinstance(self.rotary_dim, int) and 0 < self.rotary_dim <= head_dim and self.rotary_dim % 2 == 0):
            raise ValueError(f"rotary_dim must be an even number in 2..{head_dim} (the head size), "
                             f"got {self.rotary_dim!r}")
        activation(self.activation_function, "activation_function")
        if self.n_inner is None:
            self.n_inner = 4 * self.n_embd


class Attention(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        dim = args.n_embd
        self.n_heads = args.n_head
        self.scale = (dim // args.n_head) ** -0.5
        self.q_proj = nn.Linear(dim, dim, bias=False)
        self.k_proj = nn.Linear(dim, dim, bias=False)
        self.v_proj = nn.Linear(dim, dim, bias=False)
        self.out_proj = nn.Linear(dim, dim, bias=False)
        self.rope = nn.RoPE(args.rotary_dim, traditional=True, base=10000.0)

    def __call__(self, x: mx.array, mask: Optional[mx.array] = None, cache=None) -> mx.array:
        B, L, _ = x.shape
        q, k, v = (p(x).reshape(B, L, self.n_heads, -1).transpose(0, 2, 1, 3)  # (B, H, L, D)
                   for p in (self.q_proj, self.k_proj, self.v_proj))
        offset = cache.offset if cache is not None else 0
        q, k = self.rope(q, offset=offset), self.rope(k, offset=offset)
        if cache is not None:
            k, v = cache.update_and_fetch(k, v)
        out = scaled_dot_product_attention(q, k, v, cache=cache, scale=self.scale, mask=mask)
        return self.out_proj(out.transpose(0, 2, 1, 3).reshape(B, L, -1))


class MLP(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.fc_in = nn.Linear(args.n_embd, args.n_inner, bias=True)
        self.fc_out = nn.Linear(args.n_inner, args.n_embd, bias=True)
        self.act = activation(args.activation_function, "activation_function")

    def __call__(self, x: mx.array) -> mx.array:
        return self.fc_out(self.act(self.fc_in(x)))


class Block(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.ln_1 = nn.LayerNorm(args.n_embd, eps=args.layer_norm_epsilon)
        self.attn = Attention(args)
        self.mlp = MLP(args)

    def __call__(self, x: mx.array, mask: Optional[mx.array] = None, cache=None) -> mx.array:
        h = self.ln_1(x)
        return x + self.attn(h, mask, cache) + self.mlp(h)


class Model(nn.Module):
    # KV caches roll back by themselves; the layers record nothing.
    supports_speculative_rollback = True

    def __init__(self, args: ModelArgs):
        super().__init__()
        self.args = args
        self.model_type = args.model_type
        blocks = [Block(args) for _ in range(args.n_layer)]
        self.transformer = gpt2.Decoder(args.vocab_size, args.n_embd, blocks,
                                        nn.LayerNorm(args.n_embd, eps=args.layer_norm_epsilon))
        self.lm_head = nn.Linear(args.n_embd, args.vocab_size, bias=True)

    def __call__(self, inputs: mx.array, cache: Optional[List[Any]] = None) -> mx.array:
        """Token ids (B, L) -> logits (B, L, vocab)."""
        return self.lm_head(self.transformer(inputs, cache))

    def sanitize(self, weights: Dict[str, mx.array]) -> Dict[str, mx.array]:
        """Drop mask buffers; upstream mlx-lm's `model.*` -> `transformer.*` (by prefix);
        when tied, lm_head's weight is wte's (lm_head keeps its bias)."""
        out = {}
        for key, value in weights.items():
            if key.endswith(HF_BUFFERS):
                continue
            out["transformer." + key.removeprefix("model.") if key.startswith("model.") else key] = value
        if self.args.tie_word_embeddings:  # quantized: the packed weight with its scales and biases
            out.update({f"lm_head.{name}": out[f"transformer.wte.{name}"] for name in ("weight", "scales", "biases")
                        if f"transformer.wte.{name}" in out})
        return out

    @property
    def layers(self) -> List[Block]:
        return self.transformer.h

    def make_cache(self) -> List[KVCache]:
        return [KVCache() for _ in self.layers]

    def shard(self, group: Optional[mx.distributed.Group] = None) -> None:
        """Tensor parallel over `group`: q/k/v by heads, out_proj all-sums; fc_in by
        hidden units, fc_out all-sums. The block adds both sums to its whole input."""
        group = sharding.world(group)
        for layer in self.layers:
            attn = layer.attn
            attn.n_heads, _ = sharding.shard_attention(attn, attn.n_heads, attn.n_heads, group, out="out_proj")
            sharding.shard_mlp(layer.mlp, group, inputs=("fc_in",), output="fc_out")
