"""AI21 Jamba: a hybrid of Mamba-1 and attention layers, each followed by an MLP or a
mixture of experts.

What differs from llama:
- Each layer is x + mixer(input_layernorm(x)), then x + ffn(pre_ff_layernorm(x)). The
  mixer is attention at layers i with i % attn_layer_period == attn_layer_offset, a
  Mamba-1 mixer (`mamba.MambaMixer`, named `mamba`) elsewhere; a `layer_types` list
  ("full_attention" / "linear_attention"), when a config has one, says the same.
- Attention has no positional encoding at all (the Mamba layers carry order) and no
  biases: nemotron_h's `Attention`.
- The Mamba mixers RMS-normalise dt, B and C with learned weights (`dt_layernorm`,
  `b_layernorm`, `c_layernorm`, eps rms_norm_eps) before the scan.
- The ffn is a mixture of experts at layers i with i % expert_layer_period ==
  expert_layer_offset (when num_experts > 1), a SwiGLU MLP elsewhere. The router
  (`router`) takes the top-k of the softmax over experts and does NOT renormalise the
  k weights (transformers' JambaTopKRouter; upstream mlx-lm renormalises).
- Caches: an `ArraysCache(2)` per Mamba layer (conv state, fp32 SSM state; rollback by
  replay, as mamba), a `KVCache` per attention layer.
- Experts arrive per expert (`feed_forward.experts.{e}.{gate,up,down}_proj.weight`, what
  the hub holds and transformers saves) or fused as transformers 5 holds them in memory
  (`experts.gate_up_proj`, `experts.down_proj`); `sanitize` stacks or splits either into
  `feed_forward.switch_mlp.*`.
Config dialects: transformers 4 and 5 write the same keys (`num_experts`; transformers
also reads `num_local_experts`); `mamba_dt_rank` "auto" is ceil(hidden_size / 16).
References: transformers `models/jamba/modeling_jamba.py`, `configuration_jamba.py`;
Lieber et al., "Jamba: A Hybrid Transformer-Mamba Language Model" (arXiv 2403.19887).
"""

from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Union

import mlx.core as mx
import mlx.nn as nn

from . import sharding
from .base import BaseModelArgs, check_head_grouping, check_layer_types, create_attention_mask
from .cache import ArraysCache, KVCache
from .llama import MLP
from .mamba import LEARNED_NORM, MambaMixer, MambaShape, check_mixer_config, resolve_dt_rank, shard_mixer
from .nemotron_h import Attention
from .qwen3_next import route, split_fused_experts, stack_expert_weights
from .switch_layers import SwitchGLU

FULL_ATTENTION, MAMBA = "full_attention", "linear_attention"
LEGACY_KINDS = {"attention": FULL_ATTENTION, "mamba": MAMBA}  # transformers' layers_block_type names
# transformers' defaults of the layer-pattern keys.
PATTERN_DEFAULTS = dict(attn_layer_period=8, attn_layer_offset=4, expert_layer_period=2, expert_layer_offset=1)


@dataclass
class ModelArgs(BaseModelArgs):
    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: Optional[int] = None  # None: one per query head
    head_dim: Optional[int] = None  # None: hidden_size / num_attention_heads
    rms_norm_eps: float = 1e-6
    num_experts: Optional[int] = None
    num_local_experts: Optional[int] = None  # transformers' other name for num_experts
    num_experts_per_tok: int = 2
    layer_types: Optional[List[str]] = None
    attn_layer_period: Optional[int] = None  # these four default as PATTERN_DEFAULTS says
    attn_layer_offset: Optional[int] = None
    expert_layer_period: Optional[int] = None
    expert_layer_offset: Optional[int] = None
    mamba_d_state: int = 16
    mamba_d_conv: int = 4
    mamba_expand: int = 2
    mamba_dt_rank: Union[int, str] = "auto"
    mamba_conv_bias: bool = True
    mamba_proj_bias: bool = False
    hidden_act: str = "silu"
    tie_word_embeddings: bool = False

    def __post_init__(self):
        given = {name for name in PATTERN_DEFAULTS if getattr(self, name) is not None}
        for name, default in PATTERN_DEFAULTS.items():
            if getattr(self, name) is None:
                setattr(self, name, default)
        self._resolve_counts()
        from_periods = [FULL_ATTENTION if i % self.attn_layer_period == self.attn_layer_offset else MAMBA
                        for i in range(self.num_hidden_layers)]
        if self.layer_types is None:
            self.layer_types = from_periods
        else:
            self.layer_types = [LEGACY_KINDS.get(kind, kind) for kind in self.layer_types]
            if {"attn_layer_period", "attn_layer_offset"} & given and self.layer_types != from_periods:
                raise ValueError(
                    f"layer_types {self.layer_types} disagrees with attn_layer_period ({self.attn_layer_period}) "
                    f"and attn_layer_offset ({self.attn_layer_offset}); give one of them"
                )
        self.mamba_dt_rank = resolve_dt_rank(self.mamba_dt_rank, self.hidden_size, "mamba_dt_rank")
        self._validate()

    def _resolve_counts(self):
        if self.num_experts is None:
            self.num_experts = 16 if self.num_local_experts is None else self.num_local_experts
        elif self.num_local_experts not in (None, self.num_experts):
            raise ValueError(
                f"num_experts ({self.num_experts}) and num_local_experts ({self.num_local_experts}) disagree; "
                "they name the same count, give one"
            )
        if self.num_key_value_heads is None:
            self.num_key_value_heads = self.num_attention_heads
        if self.head_dim is None:
            self.head_dim = self.hidden_size // self.num_attention_heads

    def _validate(self):
        for kind in ("attn", "expert"):
            period, offset = getattr(self, f"{kind}_layer_period"), getattr(self, f"{kind}_layer_offset")
            if not 0 <= offset < period:
                raise ValueError(f"{kind}_layer_offset ({offset}) must be in 0..{kind}_layer_period - 1 ({period - 1})")
        check_layer_types(self.layer_types, self.num_hidden_layers, (FULL_ATTENTION, MAMBA))
        check_head_grouping(self.num_attention_heads, self.num_key_value_heads)
        check_mixer_config(self.hidden_act, self.mamba_d_conv)
        if any(map(self.is_moe_layer, range(self.num_hidden_layers))) and not (
                0 < self.num_experts_per_tok <= self.num_experts):
            raise ValueError(
                f"num_experts_per_tok ({self.num_experts_per_tok}) must be in 1..num_experts ({self.num_experts})"
            )

    def is_moe_layer(self, i: int) -> bool:
        """transformers' rule: experts where i % expert_layer_period == expert_layer_offset,
        if there is more than one expert."""
        return self.num_experts > 1 and i % self.expert_layer_period == self.expert_layer_offset

    @property
    def mamba_shape(self) -> MambaShape:
        return MambaShape(
            self.hidden_size, self.mamba_expand * self.hidden_size, self.mamba_d_state, self.mamba_dt_rank,
            self.mamba_d_conv, conv_bias=self.mamba_conv_bias, proj_bias=self.mamba_proj_bias,
            bcdt_norm=LEARNED_NORM, norm_eps=self.rms_norm_eps,
        )


class SparseMoeBlock(nn.Module):
    """Softmax top-k router over SwiGLU experts; the k weights are not renormalised."""

    def __init__(self, args: ModelArgs):
        super().__init__()
        self.top_k = args.num_experts_per_tok
        self.router = nn.Linear(args.hidden_size, args.num_experts, bias=False)
        self.switch_mlp = SwitchGLU(args.hidden_size, args.intermediate_size, args.num_experts)

    def __call__(self, x: mx.array) -> mx.array:
        experts, weights = route(self.router(x), self.top_k, normalize=False)  # (B, L, k)
        return (self.switch_mlp(x, experts) * weights[..., None]).sum(axis=-2)  # (B, L, hidden)


class DecoderLayer(nn.Module):
    def __init__(self, args: ModelArgs, layer_idx: int):
        super().__init__()
        self.is_attention = args.layer_types[layer_idx] == FULL_ATTENTION
        if self.is_attention:
            self.self_attn = Attention(args)
        else:
            self.mamba = MambaMixer(args.mamba_shape)
        self.feed_forward = SparseMoeBlock(args) if args.is_moe_layer(layer_idx) else MLP(
            args.hidden_size, args.intermediate_size)
        self.input_layernorm = nn.RMSNorm(args.hidden_size, eps=args.rms_norm_eps)
        self.pre_ff_layernorm = nn.RMSNorm(args.hidden_size, eps=args.rms_norm_eps)

    def __call__(self, x: mx.array, mask: Optional[mx.array] = None, cache=None) -> mx.array:
        h = self.input_layernorm(x)
        h = self.self_attn(h, mask, cache) if self.is_attention else self.mamba(h, cache)
        x = x + h
        return x + self.feed_forward(self.pre_ff_layernorm(x))


class JambaModel(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.embed_tokens = nn.Embedding(args.vocab_size, args.hidden_size)
        self.layers = [DecoderLayer(args, i) for i in range(args.num_hidden_layers)]
        self.final_layernorm = nn.RMSNorm(args.hidden_size, eps=args.rms_norm_eps)
        # Attention layers share one mask, made from the first one's cache entry.
        kinds = [layer.is_attention for layer in self.layers]
        self.first_attention = kinds.index(True) if True in kinds else None

    def __call__(self, inputs: mx.array, cache: Optional[List[Any]] = None) -> mx.array:
        h = self.embed_tokens(inputs)  # (B, L, hidden)
        cache = [None] * len(self.layers) if cache is None else cache
        if len(cache) != len(self.layers):
            raise ValueError(f"cache has {len(cache)} entries; this model needs {len(self.layers)} (see make_cache)")
        mask = None if self.first_attention is None else create_attention_mask(h, cache[self.first_attention])
        for layer, c in zip(self.layers, cache):
            h = layer(h, mask, c)
        return self.final_layernorm(h)


class Model(nn.Module):
    # Mamba mixers record rollbacks into their ArraysCache while speculating.
    supports_speculative_rollback = True

    def __init__(self, args: ModelArgs):
        super().__init__()
        self.args = args
        self.model_type = args.model_type
        self.model = JambaModel(args)
        if not args.tie_word_embeddings:
            self.lm_head = nn.Linear(args.hidden_size, args.vocab_size, bias=False)

    def __call__(self, inputs: mx.array, cache: Optional[List[Any]] = None) -> mx.array:
        """Token ids (B, L) -> logits (B, L, vocab)."""
        h = self.model(inputs, cache)
        if self.args.tie_word_embeddings:
            return self.model.embed_tokens.as_linear(h)
        return self.lm_head(h)

    def sanitize(self, weights: Dict[str, mx.array]) -> Dict[str, mx.array]:
        """Hub / transformers weights or converted ones -> ours; each rewrite is guarded
        by the name or shape it changes, so a second pass changes nothing."""
        # qwen3_next's expert stacking reads `.mlp.experts.*`: Jamba's pass through it
        # under that name and come back as `.feed_forward.switch_mlp.*`.
        renamed = {key.replace(".feed_forward.experts.", ".mlp.experts."): value for key, value in weights.items()}
        out = {}
        for key, value in split_fused_experts(stack_expert_weights(renamed)).items():
            key = key.replace(".mlp.switch_mlp.", ".feed_forward.switch_mlp.")
            if self.args.tie_word_embeddings and key == "lm_head.weight":
                continue
            if key.endswith("mamba.conv1d.weight") and value.shape[1] == 1 and value.shape[2] > 1:
                value = value.swapaxes(1, 2)  # (ch, 1, K) -> (ch, K, 1)
            out[key] = value
        return out

    @property
    def layers(self) -> List[DecoderLayer]:
        return self.model.layers

    def make_cache(self) -> List[Union[ArraysCache, KVCache]]:
        return [KVCache() if layer.is_attention else ArraysCache(2) for layer in self.layers]

    def quant_predicate(self, path: str, module: nn.Module) -> Union[bool, Dict[str, int]]:
        # The router is small and its top-k choice sensitive: 8 bits (qwen3_next's rule).
        if path.endswith("feed_forward.router"):
            return {"group_size": 64, "bits": 8}
        return True

    def shard(self, group: Optional[mx.distributed.Group] = None) -> None:
        """Tensor parallel over `group` (default: the global group), in place: attention
        by heads, Mamba mixers by channels (mamba.shard_mixer), MLPs and every expert by
        hidden units (the MoE block all-sums once). Routers, norms, embeddings and
        lm_head stay whole."""
        group = sharding.world(group)
        for layer in self.layers:
            if layer.is_attention:
                attn = layer.self_attn
                attn.num_heads, attn.num_kv_heads = sharding.shard_attention(
                    attn, attn.num_heads, attn.num_kv_heads, group)
            else:
                shard_mixer(layer.mamba, group)
            if isinstance(layer.feed_forward, SparseMoeBlock):
                sharding.shard_moe(layer.feed_forward, layer.feed_forward.switch_mlp, group)
            else:
                sharding.shard_mlp(layer.feed_forward, group)
