"""Mamba-2 (state-spaces, Mistral's Mamba-Codestral): a pure state-space stack, every
layer norm -> Mamba-2 mixer -> residual, no attention and no MLP.

What differs from llama:
- No attention, positions or MLP: each block is x + mixer(rmsnorm(x)), the mixer
  Nemotron-H's (`nemotron_h.Mamba2Mixer` over `ssm.py`): in_proj -> [gate z | conv rows
  x, B, C | dt]; a depthwise causal conv1d + silu; the SSD recurrence with A =
  -exp(A_log), dt = clamp(softplus(dt + dt_bias), time_step_limit) and a D skip;
  rmsnorm(y * silu(z)) over `n_groups` groups of intermediate / n_groups channels
  (transformers' MambaRMSNormGated: heads of one B/C group are normalised together);
  out_proj. Its cache is an `ArraysCache(2)`: conv state, SSM state (fp32).
- `time_step_limit` is the only clamp (time_step_min / max / floor only initialise
  dt_bias). transformers clamps on its multi-token path only; we clamp on every path,
  so prefill, verify and decode compute one recurrence (the default (0, inf) clamps
  nothing).
- `residual_in_fp32` keeps the residual stream in fp32, each norm reading it in the
  weights' dtype, as transformers does.
- Configs may carry `norm_before_gate` and `rms_norm` (Mamba-Codestral): transformers
  ignores both (it always gates before the norm) and so do we.
- While the cache speculates each mixer records its pre-forward states and per-token
  recurrence inputs; a rollback to m tokens replays m steps (DESIGN.md §2).
- Checkpoints name the backbone `backbone.*`; transformers 4 also read the older
  `backbone.embedding.weight`.
References: transformers `models/mamba2/modeling_mamba2.py`; Dao and Gu, "Transformers
are SSMs" (arXiv 2405.21060).
"""

from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Sequence

import mlx.core as mx
import mlx.nn as nn

from . import sharding
from .base import BaseModelArgs
from .cache import ArraysCache
from .falcon_h1 import read_float
from .nemotron_h import Mamba2Mixer, Mamba2Shape


@dataclass
class ModelArgs(BaseModelArgs):
    model_type: str
    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    num_heads: int = 128
    head_dim: int = 64
    state_size: int = 128
    expand: int = 2
    n_groups: int = 8
    conv_kernel: int = 4
    use_bias: bool = False  # in_proj and out_proj
    use_conv_bias: bool = True
    hidden_act: str = "silu"
    layer_norm_epsilon: float = 1e-5
    residual_in_fp32: bool = True
    time_step_limit: Optional[Sequence[Any]] = None
    tie_word_embeddings: bool = False

    def __post_init__(self):
        # transformers 5 writes infinity as {"__float__": "Infinity"}, json as Infinity.
        self.time_step_limit = tuple(read_float(v) for v in (self.time_step_limit or (0.0, float("inf"))))
        self._validate()

    def _validate(self):
        if self.hidden_act != "silu":
            raise ValueError(f"hidden_act {self.hidden_act!r} is not supported; Mamba-2 uses 'silu'")
        if self.hidden_size * self.expand != self.num_heads * self.head_dim:
            raise ValueError(
                f"hidden_size ({self.hidden_size}) x expand ({self.expand}) must equal num_heads "
                f"({self.num_heads}) x head_dim ({self.head_dim})"
            )
        if self.num_heads % self.n_groups:
            raise ValueError(f"num_heads ({self.num_heads}) must be a multiple of n_groups ({self.n_groups})")
        # K = 1 would make the HF (C, 1, K) and MLX (C, K, 1) conv layouts alike (sanitize).
        if self.conv_kernel < 2:
            raise ValueError(f"conv_kernel must be >= 2, got {self.conv_kernel}")
        if len(self.time_step_limit) != 2:
            raise ValueError(f"time_step_limit needs (min, max), got {self.time_step_limit!r}")

    @property
    def mamba_shape(self) -> Mamba2Shape:
        low, high = self.time_step_limit
        return Mamba2Shape(
            self.hidden_size, self.num_heads, self.head_dim, self.n_groups, self.state_size, self.conv_kernel,
            conv_bias=self.use_conv_bias, in_proj_bias=self.use_bias, out_proj_bias=self.use_bias,
            norm_eps=self.layer_norm_epsilon, norm_before_gate=False, time_step_min=low, time_step_max=high,
        )


class Block(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.residual_in_fp32 = args.residual_in_fp32
        self.norm = nn.RMSNorm(args.hidden_size, eps=args.layer_norm_epsilon)
        self.mixer = Mamba2Mixer(args.mamba_shape)

    def __call__(self, x: mx.array, cache: Optional[ArraysCache] = None) -> mx.array:
        residual = x.astype(mx.float32) if self.residual_in_fp32 else x
        return residual + self.mixer(self.norm(x.astype(self.norm.weight.dtype)), cache)


class Backbone(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.embeddings = nn.Embedding(args.vocab_size, args.hidden_size)
        self.layers = [Block(args) for _ in range(args.num_hidden_layers)]
        self.norm_f = nn.RMSNorm(args.hidden_size, eps=args.layer_norm_epsilon)

    def __call__(self, inputs: mx.array, cache: Optional[List[ArraysCache]] = None) -> mx.array:
        h = self.embeddings(inputs)  # (B, L, hidden)
        cache = [None] * len(self.layers) if cache is None else cache
        if len(cache) != len(self.layers):
            raise ValueError(f"cache has {len(cache)} entries; this model needs {len(self.layers)} (see make_cache)")
        for block, entry in zip(self.layers, cache):
            h = block(h, entry)
        return self.norm_f(h)


class Model(nn.Module):
    # The Mamba-2 mixers record rollbacks into their ArraysCache while speculating.
    supports_speculative_rollback = True

    def __init__(self, args: ModelArgs):
        super().__init__()
        self.args = args
        self.model_type = args.model_type
        self.backbone = Backbone(args)
        if not args.tie_word_embeddings:
            self.lm_head = nn.Linear(args.hidden_size, args.vocab_size, bias=False)

    def __call__(self, inputs: mx.array, cache: Optional[List[ArraysCache]] = None) -> mx.array:
        """Token ids (B, L) -> logits (B, L, vocab)."""
        h = self.backbone(inputs, cache)
        if self.args.tie_word_embeddings:
            return self.backbone.embeddings.as_linear(h)
        return self.lm_head(h)

    def sanitize(self, weights: Dict[str, mx.array]) -> Dict[str, mx.array]:
        """transformers (4 or 5) or converted weights -> ours; each rewrite is guarded by
        the key or shape it changes, so a second pass changes nothing."""
        out = {}
        for key, value in weights.items():
            if key == "lm_head.weight" and self.args.tie_word_embeddings:
                continue
            if key == "backbone.embedding.weight":  # the older name transformers 4 renamed on load
                key = "backbone.embeddings.weight"
            if key.endswith("mixer.conv1d.weight") and value.shape[1] == 1 and value.shape[2] > 1:
                value = value.swapaxes(1, 2)  # (ch, 1, K) -> (ch, K, 1)
            out[key] = value
        return out

    @property
    def layers(self) -> List[Block]:
        return self.backbone.layers

    def make_cache(self) -> List[ArraysCache]:
        return [ArraysCache(2) for _ in self.layers]

    def shard(self, group: Optional[mx.distributed.Group] = None) -> None:
        """Tensor parallel over `group` (default: the global group), in place: every
        mixer by heads with their B/C groups (n_groups must split across the ranks);
        embeddings, norms and lm_head stay whole."""
        group = sharding.world(group)
        for block in self.layers:
            sharding.shard_mamba2(block.mixer, group)
