"""TII Falcon-H1: every layer runs a Mamba-2 mixer and attention side by side on the same
normed input, then a SwiGLU MLP, with muP multipliers throughout.

What differs from llama:
- Layer: h = x + ssm_out_multiplier * mamba(n(x)) + attention_out_multiplier *
  attn(attention_in_multiplier * n(x)); then h + mlp(n'(h)). Its cache is a
  CacheList(ArraysCache(2) (conv state, SSM state), KVCache).
- The Mamba-2 mixer is Nemotron-H's (nemotron_h.Mamba2Mixer over ssm.py) with
  `mamba_d_ssm` channels, its input scaled by ssm_in_multiplier and its in_proj output
  by the muP vector (ssm_multipliers over [gate | x | B | C | dt]); dt clamped to
  `time_step_limit`; the output gated by silu(gate), through a group-wise RMSNorm only
  if `mamba_rms_norm` (before or after the gate: `mamba_norm_before_gate`).
- Attention keys are scaled by key_multiplier (folded into the softmax scale: the keys
  only meet the queries); embeddings by embedding_multiplier, logits by
  lm_head_multiplier; the MLP's gate by mlp_multipliers[0] before silu and its output by
  mlp_multipliers[1].
References: transformers `models/falcon_h1/modeling_falcon_h1.py`; TII, "Falcon-H1: A
Family of Hybrid-Head Language Models" (arXiv 2507.22448).
"""

import math
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Sequence, Union

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from . import llama, sharding
from .base import BaseModelArgs, check_head_grouping, create_attention_mask
from .cache import ArraysCache, CacheList, KVCache
from .nemotron_h import Mamba2Mixer, Mamba2Shape
from .rope_utils import resolve_rope


@dataclass
class ModelArgs(BaseModelArgs):
    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: Optional[int] = None
    head_dim: Optional[int] = None
    hidden_act: str = "silu"
    rms_norm_eps: float = 1e-5
    max_position_embeddings: Optional[int] = None
    rope_theta: Optional[float] = None
    rope_scaling: Optional[Dict[str, Any]] = None
    rope_parameters: Optional[Dict[str, Any]] = None
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    mlp_bias: bool = False
    projectors_bias: bool = False  # the Mamba out_proj
    mamba_d_ssm: Optional[int] = 1024
    mamba_n_heads: int = 128
    mamba_d_head: Union[int, str] = "auto"
    mamba_n_groups: int = 1
    mamba_d_state: int = 256
    mamba_d_conv: int = 4
    mamba_expand: int = 2
    mamba_conv_bias: bool = True
    mamba_proj_bias: bool = False  # the Mamba in_proj
    mamba_norm_before_gate: bool = True
    mamba_rms_norm: bool = False
    time_step_limit: Optional[Sequence[Any]] = None
    embedding_multiplier: float = 1.0
    lm_head_multiplier: float = 1.0
    mlp_multipliers: Optional[List[float]] = None
    key_multiplier: float = 1.0
    attention_in_multiplier: float = 1.0
    attention_out_multiplier: float = 1.0
    ssm_multipliers: Optional[List[float]] = None
    ssm_in_multiplier: float = 1.0
    ssm_out_multiplier: float = 1.0

    qk_norm = False  # read by llama.Attention

    def __post_init__(self):
        if self.num_key_value_heads is None:
            self.num_key_value_heads = self.num_attention_heads
        if self.head_dim is None:
            self.head_dim = self.hidden_size // self.num_attention_heads
        if self.mamba_d_ssm is None:
            self.mamba_d_ssm = self.mamba_expand * self.hidden_size
        if self.mamba_d_head == "auto":
            self.mamba_d_head = self.mamba_d_ssm // self.mamba_n_heads
        self.time_step_limit = tuple(read_float(v) for v in (self.time_step_limit or (0.0, math.inf)))
        if self.mlp_multipliers is None:
            self.mlp_multipliers = [1.0, 1.0]
        if self.ssm_multipliers is None:
            self.ssm_multipliers = [1.0] * 5
        theta, self.rope_scaling, _ = resolve_rope(self.rope_theta, self.rope_scaling, self.rope_parameters)
        self.rope_theta = 10000.0 if theta is None else theta
        self._validate()

    def _validate(self):
        check_head_grouping(self.num_attention_heads, self.num_key_value_heads)
        if self.hidden_act != "silu":
            raise ValueError(f"hidden_act {self.hidden_act!r} is not supported; Falcon-H1 uses 'silu'")
        if self.mamba_d_head * self.mamba_n_heads != self.mamba_d_ssm:
            raise ValueError(
                f"mamba_d_head ({self.mamba_d_head}) x mamba_n_heads ({self.mamba_n_heads}) must equal "
                f"mamba_d_ssm ({self.mamba_d_ssm})"
            )
        if self.mamba_n_heads % self.mamba_n_groups:
            raise ValueError(
                f"mamba_n_heads ({self.mamba_n_heads}) must be a multiple of mamba_n_groups ({self.mamba_n_groups})"
            )
        # K = 1 would make the HF (C, 1, K) and MLX (C, K, 1) conv layouts alike (sanitize).
        if self.mamba_d_conv < 2:
            raise ValueError(f"mamba_d_conv must be >= 2, got {self.mamba_d_conv}")
        for name, want in (("time_step_limit", 2), ("mlp_multipliers", 2), ("ssm_multipliers", 5)):
            if len(getattr(self, name)) != want:
                raise ValueError(f"{name} needs {want} values, got {getattr(self, name)!r}")

    @property
    def qkv_bias(self) -> bool:  # read by llama.Attention
        return self.attention_bias

    @property
    def o_bias(self) -> bool:
        return self.attention_bias

    @property
    def mamba_shape(self) -> Mamba2Shape:
        return Mamba2Shape(
            self.hidden_size, self.mamba_n_heads, self.mamba_d_head, self.mamba_n_groups, self.mamba_d_state,
            self.mamba_d_conv, conv_bias=self.mamba_conv_bias, in_proj_bias=self.mamba_proj_bias,
            out_proj_bias=self.projectors_bias, norm_eps=self.rms_norm_eps,
            norm_before_gate=self.mamba_norm_before_gate if self.mamba_rms_norm else None,
            time_step_min=self.time_step_limit[0], time_step_max=self.time_step_limit[1],
        )


def read_float(value: Any) -> float:
    """A config number; transformers 5 writes infinity as {"__float__": "Infinity"}."""
    if isinstance(value, dict) and "__float__" in value:
        return float(value["__float__"])
    return float(value)


def mup_vector(shape: Mamba2Shape, multipliers: Sequence[float]) -> mx.array:
    """The per-channel scale of the in_proj output: multipliers[i] over the i-th of its
    segments [gate I | x I | B G*N | C G*N | dt H] -> (2I + 2GN + H,)."""
    I, GN = shape.intermediate_size, shape.n_groups * shape.state_size
    sizes = (I, I, GN, GN, shape.num_heads)
    # Built from host memory, not as a lazy graph: a lazy constant made on the loading
    # thread cannot be evaluated on another (a server's worker thread: "There is no
    # Stream(cpu, 0) in current thread").
    return mx.array(np.repeat(np.asarray(multipliers, np.float32), sizes))


class Mixer(Mamba2Mixer):
    def __init__(self, args: ModelArgs):
        super().__init__(args.mamba_shape)
        self.ssm_in_multiplier = args.ssm_in_multiplier
        # Underscored: a constant, not a parameter (transformers rebuilds it from the config too).
        self._mup_vector = mup_vector(args.mamba_shape, args.ssm_multipliers)

    def project(self, h: mx.array) -> mx.array:
        return self.in_proj(h * self.ssm_in_multiplier) * self._mup_vector.astype(h.dtype)


class Attention(llama.Attention):
    def __init__(self, args: ModelArgs):
        super().__init__(args)
        self.scale = self.scale * args.key_multiplier  # q . (m k) = m (q . k)


class MLP(llama.MLP):
    def __init__(self, args: ModelArgs):
        super().__init__(args.hidden_size, args.intermediate_size, bias=args.mlp_bias)
        self.gate_multiplier, self.down_multiplier = args.mlp_multipliers

    def __call__(self, x: mx.array) -> mx.array:
        h = nn.silu(self.gate_proj(x) * self.gate_multiplier) * self.up_proj(x)
        return self.down_proj(h) * self.down_multiplier


class DecoderLayer(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.mamba = Mixer(args)
        self.self_attn = Attention(args)
        self.feed_forward = MLP(args)
        self.input_layernorm = nn.RMSNorm(args.hidden_size, eps=args.rms_norm_eps)
        self.pre_ff_layernorm = nn.RMSNorm(args.hidden_size, eps=args.rms_norm_eps)
        self.ssm_out_multiplier = args.ssm_out_multiplier
        self.attention_in_multiplier = args.attention_in_multiplier
        self.attention_out_multiplier = args.attention_out_multiplier

    def __call__(self, x: mx.array, mask: Optional[mx.array] = None, cache: Optional[CacheList] = None) -> mx.array:
        ssm_cache, kv_cache = (None, None) if cache is None else (cache[0], cache[1])
        h = self.input_layernorm(x)
        ssm = self.mamba(h, ssm_cache) * self.ssm_out_multiplier
        attn = self.self_attn(h * self.attention_in_multiplier, mask, kv_cache) * self.attention_out_multiplier
        h = x + (ssm + attn)
        return h + self.feed_forward(self.pre_ff_layernorm(h))


class Backbone(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.embed_tokens = nn.Embedding(args.vocab_size, args.hidden_size)
        self.layers = [DecoderLayer(args) for _ in range(args.num_hidden_layers)]
        self.final_layernorm = nn.RMSNorm(args.hidden_size, eps=args.rms_norm_eps)
        self.embedding_multiplier = args.embedding_multiplier

    def __call__(self, inputs: mx.array, cache: Optional[List[Any]] = None) -> mx.array:
        h = self.embed_tokens(inputs) * self.embedding_multiplier  # (B, L, hidden)
        if cache is None:
            cache = [None] * len(self.layers)
        mask = create_attention_mask(h, cache[0])  # the CacheList asks its KVCache
        for layer, layer_cache in zip(self.layers, cache):
            h = layer(h, mask, layer_cache)
        return self.final_layernorm(h)


class Model(nn.Module):
    # The Mamba-2 mixers record rollbacks into their ArraysCache while speculating.
    supports_speculative_rollback = True

    def __init__(self, args: ModelArgs):
        super().__init__()
        self.args = args
        self.model_type = args.model_type
        self.model = Backbone(args)
        if not args.tie_word_embeddings:
            self.lm_head = nn.Linear(args.hidden_size, args.vocab_size, bias=False)

    def __call__(self, inputs: mx.array, cache: Optional[List[Any]] = None) -> mx.array:
        """Token ids (B, L) -> logits (B, L, vocab)."""
        h = self.model(inputs, cache)
        if self.args.tie_word_embeddings:
            return self.model.embed_tokens.as_linear(h) * self.args.lm_head_multiplier
        return self.lm_head(h) * self.args.lm_head_multiplier

    def sanitize(self, weights: Dict[str, mx.array]) -> Dict[str, mx.array]:
        """transformers or converted weights -> ours; every rewrite is guarded by the key
        or shape it changes, so a second pass changes nothing."""
        out = {}
        for key, value in weights.items():
            if key.endswith("mamba.mup_vector"):  # a constant of the config (mup_vector)
                continue
            if key == "lm_head.weight" and self.args.tie_word_embeddings:
                continue
            if key.endswith("mamba.conv1d.weight") and value.shape[1] == 1 and value.shape[2] > 1:
                value = value.swapaxes(1, 2)  # (ch, 1, K) -> (ch, K, 1)
            out[key] = value
        return out

    @property
    def layers(self) -> List[DecoderLayer]:
        return self.model.layers

    def shard(self, group: Optional[mx.distributed.Group] = None) -> None:
        """Tensor parallel over `group` (default: the global group), in place: each
        layer's Mamba-2 mixer by heads (its muP vector follows in_proj's rows), its
        attention by heads and its MLP by hidden units; embeddings and lm_head stay
        whole."""
        group = sharding.world(group)
        for layer in self.layers:
            mamba, attn = layer.mamba, layer.self_attn
            pieces = sharding.mamba2_in_proj_pieces(mamba)
            sharding.shard_mamba2(mamba, group)
            mamba._mup_vector = sharding.take_shard(mamba._mup_vector, group, segments=pieces)
            mx.eval(mamba._mup_vector)  # not a parameter: evaluated here, on the loading thread (see mup_vector)
            attn.n_heads, attn.n_kv_heads = sharding.shard_attention(attn, attn.n_heads, attn.n_kv_heads, group)
            sharding.shard_mlp(layer.feed_forward, group)

    def make_cache(self) -> List[CacheList]:
        return [CacheList(ArraysCache(2), KVCache()) for _ in self.layers]
