"""GPT-2 (`gpt2`, GPT2LMHeadModel: openai-community/gpt2, gpt2-medium/-large/-xl,
distilgpt2): a pre-norm decoder with learned positions, LayerNorms, a fused q/k/v
projection and a GELU MLP.

What differs from llama:
- Positions are a learned table (`wpe`, n_positions rows) added to the token
  embeddings (`wte`); no rope. Positions past the table raise.
- LayerNorms with biases (`ln_1`, `ln_2`, `ln_f`); every projection has a bias.
- `c_attn` computes [q | k | v] in one projection (multi-head: as many key as query
  heads); `c_proj` mixes the heads back. The MLP is c_proj(act(c_fc(x))), act by
  `activation_function` (default "gelu_new", the tanh approximation), `n_inner` wide
  (default 4 * n_embd).
- Scores are scaled by head_dim^-0.5 with `scale_attn_weights` (else 1), and further by
  1 / (layer index + 1) with `scale_attn_by_inverse_layer_idx`.
- Embeddings are tied by default.
Weights: transformers' Conv1D stores (in, out), transposed from nn.Linear; the hub's
checkpoints name them `transformer.h.*` (transformers 5) or bare `h.*` (the original
upload, with `attn.bias` mask buffers). sanitize transposes and renames those once to
the MLX layout, `model.h.*` etc. (upstream mlx-lm's): the prefix tells the layouts
apart, since c_proj is square and a shape cannot.
This file is also the network gpt_bigcode reuses (its own attention over these blocks).
Reference: transformers `models/gpt2/modeling_gpt2.py`, `configuration_gpt2.py`.
"""

from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Union

import mlx.core as mx
import mlx.nn as nn

from . import sharding
from .activations import activation
from .base import BaseModelArgs, resolve_aliases, run_hybrid_layers, scaled_dot_product_attention
from .cache import KVCache
from .llama4 import query_positions

CONV1D_WEIGHTS = (".attn.c_attn.weight", ".attn.c_proj.weight", ".mlp.c_fc.weight", ".mlp.c_proj.weight")
HF_BUFFERS = (".attn.bias", ".attn.masked_bias")  # causal-mask buffers in old checkpoints


@dataclass
class ModelArgs(BaseModelArgs):
    """GPT2Config's keys with its defaults; hidden_size, max_position_embeddings,
    num_attention_heads and num_hidden_layers are accepted for n_embd, n_positions,
    n_head and n_layer (transformers' attribute_map)."""

    model_type: str
    vocab_size: int = 50257
    n_embd: Optional[int] = None
    n_positions: Optional[int] = None
    n_head: Optional[int] = None
    n_layer: Optional[int] = None
    n_inner: Optional[int] = None
    activation_function: str = "gelu_new"
    layer_norm_epsilon: float = 1e-5
    scale_attn_weights: bool = True
    scale_attn_by_inverse_layer_idx: bool = False
    add_cross_attention: bool = False
    tie_word_embeddings: bool = True
    hidden_size: Optional[int] = None
    max_position_embeddings: Optional[int] = None
    num_attention_heads: Optional[int] = None
    num_hidden_layers: Optional[int] = None

    def __post_init__(self):
        resolve_aliases(self, aliases(n_embd=768, n_positions=1024, n_head=12, n_layer=12))  # GPT2Config's defaults
        if self.n_embd % self.n_head:
            raise ValueError(f"n_embd ({self.n_embd}) must be a multiple of n_head ({self.n_head})")
        if self.add_cross_attention:
            raise ValueError("add_cross_attention=True is an encoder-decoder layout; a causal LM has none")
        activation(self.activation_function, "activation_function")
        if self.n_inner is None:
            self.n_inner = 4 * self.n_embd

    @property
    def head_dim(self) -> int:
        return self.n_embd // self.n_head


def aliases(**defaults: int):
    """GPT-2's short config names, their long aliases and `defaults` (resolve_aliases' table)."""
    long_names = dict(n_embd="hidden_size", n_positions="max_position_embeddings", n_head="num_attention_heads",
                      n_layer="num_hidden_layers")
    return [(name, long_names[name], default) for name, default in defaults.items()]


def check_positions(offset: Union[int, mx.array], num_tokens: int, table_size: int) -> None:
    """A learned position table has `table_size` rows: positions past it raise (a
    batch's per-row offsets are not checked, to keep the forward lazy)."""
    if isinstance(offset, int) and offset + num_tokens > table_size:
        raise ValueError(f"positions up to {offset + num_tokens - 1} exceed the model's {table_size} learned "
                         "positions (n_positions); keep prompt + output within them")


class Attention(nn.Module):
    """Multi-head attention from one fused projection: c_attn -> [q | k | v]."""

    def __init__(self, args: ModelArgs, layer_idx: int):
        super().__init__()
        dim = args.n_embd
        self.n_heads = self.n_kv_heads = args.n_head
        self.scale = args.head_dim**-0.5 if args.scale_attn_weights else 1.0
        if args.scale_attn_by_inverse_layer_idx:
            self.scale /= layer_idx + 1
        self.c_attn = nn.Linear(dim, 3 * dim, bias=True)
        self.c_proj = nn.Linear(dim, dim, bias=True)

    def split_heads(self, qkv: mx.array):
        """(B, L, (H + 2 H_kv) D) -> q (B, H, L, D), k and v (B, H_kv, L, D)."""
        B, L, _ = qkv.shape
        q, k, v = mx.split(qkv, 3, axis=-1)
        q = q.reshape(B, L, self.n_heads, -1).transpose(0, 2, 1, 3)
        k, v = (t.reshape(B, L, self.n_kv_heads, -1).transpose(0, 2, 1, 3) for t in (k, v))
        return q, k, v

    def __call__(self, x: mx.array, mask: Optional[mx.array] = None, cache=None) -> mx.array:
        B, L, _ = x.shape
        q, k, v = self.split_heads(self.c_attn(x))
        if cache is not None:
            k, v = cache.update_and_fetch(k, v)
        out = scaled_dot_product_attention(q, k, v, cache=cache, scale=self.scale, mask=mask)
        return self.c_proj(out.transpose(0, 2, 1, 3).reshape(B, L, -1))


class MLP(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.c_fc = nn.Linear(args.n_embd, args.n_inner, bias=True)
        self.c_proj = nn.Linear(args.n_inner, args.n_embd, bias=True)
        self.act = activation(args.activation_function, "activation_function")

    def __call__(self, x: mx.array) -> mx.array:
        return self.c_proj(self.act(self.c_fc(x)))


class Block(nn.Module):
    attention_class = Attention  # gpt_bigcode swaps it

    def __init__(self, args: ModelArgs, layer_idx: int):
        super().__init__()
        self.ln_1 = nn.LayerNorm(args.n_embd, eps=args.layer_norm_epsilon)
        self.attn = self.attention_class(args, layer_idx)
        self.ln_2 = nn.LayerNorm(args.n_embd, eps=args.layer_norm_epsilon)
        self.mlp = MLP(args)

    def __call__(self, x: mx.array, mask: Optional[mx.array] = None, cache=None) -> mx.array:
        h = x + self.attn(self.ln_1(x), mask, cache)
        return h + self.mlp(self.ln_2(h))


class Decoder(nn.Module):
    """The GPT-style backbone under GPT-2's names: token embeddings `wte`, blocks `h`,
    final norm `ln_f` (gptj and qwen build it from their own blocks and norm)."""

    def __init__(self, vocab_size: int, dim: int, blocks: List[nn.Module], final_norm: nn.Module):
        super().__init__()
        self.wte = nn.Embedding(vocab_size, dim)
        self.h = blocks
        self.ln_f = final_norm

    def embed(self, inputs: mx.array, cache: Optional[List[Any]]) -> mx.array:
        return self.wte(inputs)

    def __call__(self, inputs: mx.array, cache: Optional[List[Any]] = None) -> mx.array:
        h = self.embed(inputs, cache)  # (B, L, D)
        h = run_hybrid_layers(h, self.h, cache, mask_layer=0)  # every layer attends: one causal mask
        return self.ln_f(h)


class GPT2Model(Decoder):
    """Decoder plus the learned position table `wpe`."""

    block_class = Block

    def __init__(self, args: ModelArgs):
        blocks = [self.block_class(args, i) for i in range(args.n_layer)]
        super().__init__(args.vocab_size, args.n_embd, blocks, nn.LayerNorm(args.n_embd, eps=args.layer_norm_epsilon))
        self.wpe = nn.Embedding(args.n_positions, args.n_embd)

    def embed(self, inputs: mx.array, cache: Optional[List[Any]]) -> mx.array:
        L = inputs.shape[1]
        offset = cache[0].offset if cache is not None else 0
        check_positions(offset, L, self.wpe.weight.shape[0])
        return self.wte(inputs) + self.wpe(query_positions(offset, L))  # (B, L, D)


def hf_to_mlx(weights: Dict[str, mx.array], transpose: bool) -> Dict[str, mx.array]:
    """transformers' keys (`transformer.*`, or bare as the original GPT-2 upload) ->
    `model.*`, dropping mask buffers and (with `transpose`) turning Conv1D weights (in,
    out) into nn.Linear's (out, in). `model.*` and `lm_head.*` keys pass unchanged."""
    out = {}
    for key, value in weights.items():
        if not key.startswith(("model.", "lm_head.")):
            if key.endswith(HF_BUFFERS):
                continue
            key = "model." + key.removeprefix("transformer.")
            if transpose and key.endswith(CONV1D_WEIGHTS):
                value = mx.contiguous(value.T)  # row-major as a reload: matmuls round alike
        out[key] = value
    return out


class Model(nn.Module):
    # KV caches roll back by themselves; the layers record nothing.
    supports_speculative_rollback = True
    backbone_class = GPT2Model
    conv1d = True  # transformers' GPT-2 projections are Conv1D (in, out)

    def __init__(self, args: ModelArgs):
        super().__init__()
        self.args = args
        self.model_type = args.model_type
        self.model = self.backbone_class(args)
        if not args.tie_word_embeddings:
            self.lm_head = nn.Linear(args.n_embd, args.vocab_size, bias=False)

    def __call__(self, inputs: mx.array, cache: Optional[List[Any]] = None) -> mx.array:
        """Token ids (B, L) -> logits (B, L, vocab)."""
        h = self.model(inputs, cache)
        return self.model.wte.as_linear(h) if self.args.tie_word_embeddings else self.lm_head(h)

    def sanitize(self, weights: Dict[str, mx.array]) -> Dict[str, mx.array]:
        """transformers' layout -> the MLX one once (by key prefix); when tied, no lm_head."""
        weights = hf_to_mlx(weights, transpose=self.conv1d)
        if self.args.tie_word_embeddings:
            weights.pop("lm_head.weight", None)
        return weights

    @property
    def layers(self) -> List[Block]:
        return self.model.h

    def make_cache(self) -> List[KVCache]:
        return [KVCache() for _ in self.layers]

    def shard(self, group: Optional[mx.distributed.Group] = None) -> None:
        """Tensor parallel over `group`: each rank keeps its heads of c_attn's q, k and
        v pieces (and their biases) and c_fc's hidden units; c_proj of each all-sums.
        The embeddings and position table stay whole."""
        group = sharding.world(group)
        for layer in self.layers:
            attn = layer.attn
            attn.n_heads, attn.n_kv_heads = sharding.shard_attention(
                attn, attn.n_heads, attn.n_kv_heads, group, qkv=("c_attn",), out="c_proj", qkv_segments=3)
            sharding.shard_mlp(layer.mlp, group, inputs=("c_fc",), output="c_proj")
