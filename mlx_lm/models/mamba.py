"""Mamba (Mamba-1): a stack of selective state space blocks, no attention and no MLP.

What differs from llama:
- Each block is norm -> Mamba mixer -> residual (`backbone.layers.{i}.norm`, `.mixer`).
- The mixer (`MambaMixer`, shared with falcon_mamba and jamba): in_proj gives
  [x | gate z] (each `intermediate_size` = expand * hidden_size); x goes through a
  depthwise causal conv1d (bias by `use_conv_bias`) and silu; x_proj gives [dt (rank R)
  | B (N) | C (N)]; dt = softplus(dt_proj(dt)) per channel (no clamp: time_step_min/max
  only initialise dt_proj); the selective scan (`selective_scan.py`) with
  A = -exp(A_log) of shape (I, N) and a D skip; y * silu(z); out_proj.
  Falcon-Mamba RMS-normalises dt, B and C without a weight (`mixer_rms_eps`), Jamba with
  learned weights (`dt_layernorm`, `b_layernorm`, `c_layernorm`); `MambaShape.bcdt_norm`
  says which.
- The cache of every block is an `ArraysCache(2)`: conv state (K-1 rows of the conv
  input) and SSM state (I, N) in fp32. While speculating each mixer records its
  pre-forward states and per-token scan inputs; a rollback to m tokens replays m steps
  (`selective_scan.replay_prefix`, DESIGN.md §2).
- `residual_in_fp32` (the default) keeps the residual stream in fp32 whatever the
  weights' dtype, as transformers does.
- Embeddings are tied by default (`tie_word_embeddings`, true when the key is absent, as
  in the hub's transformers-4 checkpoints). Weights, their names and layouts (and the
  older `backbone.embedding.weight`) are mamba2's: `Model.sanitize` is its.
Config dialects: transformers 4 and 5 write the same keys; `intermediate_size` is
expand * hidden_size unless the config gives it (then it wins, as in transformers:
falcon-mamba-7b's expand 16 is stale), `time_step_rank` "auto" is ceil(hidden_size / 16).
References: transformers `models/mamba/modeling_mamba.py`, `configuration_mamba.py`;
Gu and Dao, "Mamba: Linear-Time Sequence Modeling with Selective State Spaces"
(arXiv 2312.00752).
"""

import math
from dataclasses import dataclass
from functools import partial
from typing import Any, List, Optional, Tuple, Union

import mlx.core as mx
import mlx.nn as nn

from . import mamba2, sharding
from .base import BaseModelArgs
from .cache import ArraysCache
from .selective_scan import discretize_dt, replay_prefix, selective_scan
from .ssm import causal_conv1d, conv_state_after

# Slots of a Mamba layer's ArraysCache.
CONV_STATE, SSM_STATE = 0, 1
# What normalises a mixer's dt, B and C before the scan (MambaShape.bcdt_norm).
NO_NORM, WEIGHTLESS_NORM, LEARNED_NORM = None, "weightless", "learned"


def resolve_dt_rank(rank: Union[int, str], hidden_size: int, field: str) -> int:
    """transformers' "auto": ceil(hidden_size / 16); else a positive int."""
    if rank == "auto":
        return math.ceil(hidden_size / 16)
    if not isinstance(rank, int) or rank < 1:
        raise ValueError(f"{field} must be a positive int or 'auto', got {rank!r}")
    return rank


@dataclass(frozen=True)
class MambaShape:
    """What a Mamba-1 mixer is made of, in neutral names (falcon_mamba and jamba build one)."""

    hidden_size: int
    intermediate_size: int
    state_size: int
    dt_rank: int
    conv_kernel: int
    conv_bias: bool
    proj_bias: bool
    bcdt_norm: Optional[str] = NO_NORM
    norm_eps: float = 1e-6


@dataclass
class ModelArgs(BaseModelArgs):
    model_type: str
    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    state_size: int = 16
    expand: int = 2
    intermediate_size: Optional[int] = None  # None: expand * hidden_size
    conv_kernel: int = 4
    use_bias: bool = False
    use_conv_bias: bool = True
    time_step_rank: Union[int, str] = "auto"
    layer_norm_epsilon: float = 1e-5
    residual_in_fp32: bool = True
    hidden_act: str = "silu"
    tie_word_embeddings: bool = True

    def __post_init__(self):
        # transformers: a written intermediate_size wins over expand (falcon-mamba-7b says
        # expand 16 with intermediate_size 8192 = 2 x hidden_size, and its weights are 8192 wide).
        if self.intermediate_size is None:
            self.intermediate_size = self.expand * self.hidden_size
        if self.intermediate_size < 1:
            raise ValueError(f"intermediate_size must be positive, got {self.intermediate_size}")
        self.time_step_rank = resolve_dt_rank(self.time_step_rank, self.hidden_size, "time_step_rank")
        check_mixer_config(self.hidden_act, self.conv_kernel)

    @property
    def mamba_shape(self) -> MambaShape:
        return MambaShape(self.hidden_size, self.intermediate_size, self.state_size, self.time_step_rank,
                          self.conv_kernel, conv_bias=self.use_conv_bias, proj_bias=self.use_bias)


def check_mixer_config(hidden_act: str, conv_kernel: int) -> None:
    if hidden_act != "silu":
        raise ValueError(f"hidden_act {hidden_act!r} is not supported; Mamba mixers use 'silu'")
    # K = 1 would leave no conv state and make the HF (C, 1, K) and MLX (C, K, 1) conv
    # layouts indistinguishable, which sanitize relies on.
    if conv_kernel < 2:
        raise ValueError(f"conv_kernel must be >= 2, got {conv_kernel}")


class MambaMixer(nn.Module):
    """in_proj -> [x | gate]; causal conv + silu on x; x_proj -> dt, B, C (normalised
    or not); the selective scan with a D skip; y * silu(gate) -> out_proj."""

    def __init__(self, shape: MambaShape):
        super().__init__()
        I, N, R = shape.intermediate_size, shape.state_size, shape.dt_rank
        self.intermediate_size, self.state_size, self.dt_rank = I, N, R
        self.conv_kernel_size = shape.conv_kernel
        self.bcdt_norm, self.norm_eps = shape.bcdt_norm, shape.norm_eps
        self.in_proj = nn.Linear(shape.hidden_size, 2 * I, bias=shape.proj_bias)
        self.conv1d = nn.Conv1d(I, I, shape.conv_kernel, groups=I, bias=shape.conv_bias)  # weight (I, K, 1)
        self.x_proj = nn.Linear(I, R + 2 * N, bias=False)
        self.dt_proj = nn.Linear(R, I, bias=True)
        self.A_log = mx.zeros((I, N))
        self.D = mx.ones((I,))
        self.out_proj = nn.Linear(I, shape.hidden_size, bias=shape.proj_bias)
        if shape.bcdt_norm == LEARNED_NORM:
            self.dt_layernorm = nn.RMSNorm(R, eps=shape.norm_eps)
            self.b_layernorm = nn.RMSNorm(N, eps=shape.norm_eps)
            self.c_layernorm = nn.RMSNorm(N, eps=shape.norm_eps)

    def conv_input(self, rows: mx.array, cache: Optional[ArraysCache]) -> mx.array:
        """[conv state ; new rows]: (b, K-1+T, I); zeros as the state of a new sequence."""
        state = None if cache is None else cache[CONV_STATE]
        if state is None:
            state = mx.zeros((rows.shape[0], self.conv_kernel_size - 1, rows.shape[-1]), rows.dtype)
        return mx.concatenate([state, rows], axis=1)

    def _normed(self, name: str, v: mx.array) -> mx.array:
        if self.bcdt_norm == LEARNED_NORM:
            return self[name](v)
        if self.bcdt_norm == WEIGHTLESS_NORM:  # in fp32, as transformers
            return mx.fast.rms_norm(v.astype(mx.float32), None, self.norm_eps).astype(v.dtype)
        return v

    def ssm_inputs(self, x: mx.array) -> Tuple[mx.array, mx.array, mx.array]:
        """Conv outputs x (b, T, I) -> dt (b, T, I) discretised, B, C (b, T, N)."""
        R, N = self.dt_rank, self.state_size
        dt, B, C = mx.split(self.x_proj(x), [R, R + N], axis=-1)
        dt, B, C = self._normed("dt_layernorm", dt), self._normed("b_layernorm", B), self._normed("c_layernorm", C)
        return discretize_dt(self.dt_proj(dt)), B, C

    def __call__(self, h: mx.array, cache: Optional[ArraysCache] = None) -> mx.array:
        T = h.shape[1]
        rows, gate = mx.split(self.in_proj(h), 2, axis=-1)  # (b, T, I) each
        conv_input = self.conv_input(rows, cache)  # (b, K-1+T, I)
        x = nn.silu(causal_conv1d(conv_input, self.conv1d.weight, self.conv1d.get("bias")))
        dt, B, C = self.ssm_inputs(x)
        A = -mx.exp(self.A_log.astype(mx.float32))  # (I, N)
        state = None if cache is None else cache[SSM_STATE]
        y, new_state = selective_scan(x, dt, A, B, C, state)  # (b, T, I)
        y = y + x * self.D.astype(x.dtype)
        if cache is not None:
            if cache.speculating:
                replay = partial(replay_prefix, conv_input, x, dt, A, B, state, self.conv_kernel_size)
                cache.record_rollback(T, replay, [cache[CONV_STATE], state])
            cache[CONV_STATE] = conv_state_after(conv_input, T, self.conv_kernel_size)
            cache[SSM_STATE] = new_state
        return self.out_proj(y * nn.silu(gate))


def shard_mixer(mixer: MambaMixer, group: mx.distributed.Group) -> None:
    """Keep this rank's channels of a Mamba-1 mixer, in place: in_proj splits [x | gate],
    the conv, dt_proj (rows and bias), A_log and D follow the channels. dt, B and C mix
    every channel, so x_proj all-sums its partial products (R + 2N values per token);
    out_proj all-sums. The conv and SSM states, and the rollback records, then hold only
    this rank's channels."""
    I = mixer.intermediate_size
    mixer.intermediate_size = sharding.per_rank(I, group, "intermediate_size")
    sharding.shard_projections(mixer, ("in_proj",), sharding.ALL_TO_SHARDED, group, segments=[I])
    for name in ("weight", "bias"):
        if name in mixer.conv1d:
            mixer.conv1d[name] = sharding.take_shard(mixer.conv1d[name], group, axis=0)
    sharding.shard_projections(mixer, ("x_proj", "out_proj"), sharding.SHARDED_TO_ALL, group)
    sharding.shard_projections(mixer, ("dt_proj",), sharding.ALL_TO_SHARDED, group)
    for name in ("A_log", "D"):
        mixer[name] = sharding.take_shard(mixer[name], group)


# The block, backbone and model run mamba2's forward passes, sanitize and cache layout
# (the same stack around another mixer); each builds its own parts in __init__
# (nn.Module.__init__, not mamba2's, which would build Mamba-2 mixers).


class Block(mamba2.Block):
    def __init__(self, args: ModelArgs, shape: MambaShape):
        nn.Module.__init__(self)
        self.residual_in_fp32 = args.residual_in_fp32
        self.norm = nn.RMSNorm(args.hidden_size, eps=args.layer_norm_epsilon)
        self.mixer = MambaMixer(shape)


class Backbone(mamba2.Backbone):
    def __init__(self, args: ModelArgs, shape: MambaShape):
        nn.Module.__init__(self)
        self.embeddings = nn.Embedding(args.vocab_size, args.hidden_size)
        self.layers = [Block(args, shape) for _ in range(args.num_hidden_layers)]
        self.norm_f = nn.RMSNorm(args.hidden_size, eps=args.layer_norm_epsilon)


class Model(mamba2.Model):
    # Mamba mixers record rollbacks into their ArraysCache while speculating.
    supports_speculative_rollback = True

    def __init__(self, args: ModelArgs):
        nn.Module.__init__(self)
        self.args = args
        self.model_type = args.model_type
        self.backbone = Backbone(args, args.mamba_shape)
        if not args.tie_word_embeddings:
            self.lm_head = nn.Linear(args.hidden_size, args.vocab_size, bias=False)

    def __call__(self, inputs: mx.array, cache: Optional[List[Any]] = None) -> mx.array:
        """Token ids (B, L) -> logits (B, L, vocab)."""
        # Back from the fp32 residual stream to the weights' dtype before the head, as
        # transformers does (else a bf16 head would be promoted to fp32 on every call).
        h = self.backbone(inputs, cache).astype(self.backbone.norm_f.weight.dtype)
        if self.args.tie_word_embeddings:
            return self.backbone.embeddings.as_linear(h)
        return self.lm_head(h)

    def shard(self, group: Optional[mx.distributed.Group] = None) -> None:
        """Tensor parallel over `group` (default: the global group), in place: every
        mixer by channels (`shard_mixer`); norms, embeddings and lm_head stay whole."""
        group = sharding.world(group)
        for block in self.layers:
            shard_mixer(block.mixer, group)
