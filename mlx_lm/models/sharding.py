"""Tensor-parallel sharding over `mx.distributed`: the pieces every family's `shard` uses.

Each rank of a group of N keeps 1/N of the heads of every attention, Gated DeltaNet and
Mamba-2 layer (1/N of the channels of a short conv) and 1/N of the hidden units of every
MLP and expert; embeddings, norms, routers and lm_head stay whole on every rank. A layer's input is the same on every rank; its
"all-to-sharded" projections (q/k/v, gate/up) compute the rank's slice of the heads or
hidden units, its "sharded-to-all" projection (o_proj, down_proj) multiplies that slice
by the matching input columns, and one `all_sum` per mixer and per MLP adds the N
partial outputs, so every rank again holds the whole hidden state. Caches follow by
themselves: a rank's KV cache and recurrent state hold only its own heads.

Linear layers (float and quantized) are sharded with MLX's own distributed layers
(`mlx.nn.layers.distributed.shard_linear`: AllToShardedLinear, ShardedToAllLinear and
their quantized forms). Expert stacks (`SwitchLinear`, (E, out, in)) and per-head
vectors are sliced here by `take_shard`. A module whose output is a sum of partial
terms not ending in one projection (a mixture of experts plus a shared expert) is made
to all-sum its own output by `sum_outputs`, keeping its parameter names.

The sum over ranks adds the same terms as one process in another order, so sharded
logits equal unsharded ones to float rounding, not bit for bit.
"""

import functools
from typing import List, Optional, Sequence, Tuple

import mlx.core as mx
import mlx.nn as nn
from mlx.nn.layers.distributed import shard_linear
from mlx.utils import tree_flatten

from .switch_layers import QuantizedSwitchLinear, SwitchGLU, SwitchLinear

ALL_TO_SHARDED, SHARDED_TO_ALL = "all-to-sharded", "sharded-to-all"


def world(group: Optional[mx.distributed.Group] = None) -> mx.distributed.Group:
    """`group`, or the global group (a group of one when not launched distributed)."""
    return group if group is not None else mx.distributed.init()


def per_rank(count: int, group: mx.distributed.Group, what: str) -> int:
    """count / N, or a ValueError naming `what` when N does not divide it."""
    size = group.size()
    if count % size:
        raise ValueError(
            f"{what} ({count}) is not divisible by the {size} ranks; run on a number of "
            f"ranks that divides it"
        )
    return count // size


def take_shard(
    x: mx.array, group: mx.distributed.Group, axis: int = 0, segments: Sequence[int] = ()
) -> mx.array:
    """This rank's part of `x` along `axis`: x is cut at `segments` (offsets of fused
    pieces, e.g. [all q | all k | all v]) and each piece into N equal blocks; the rank
    keeps block `rank` of every piece, concatenated in order."""
    pieces = mx.split(x, list(segments), axis=axis) if segments else [x]
    size, rank = group.size(), group.rank()
    for piece in pieces:
        if piece.shape[axis] % size:
            raise ValueError(f"a piece of size {piece.shape[axis]} on axis {axis} of {x.shape} "
                             f"does not split across {size} ranks")
    parts = [mx.split(piece, size, axis=axis)[rank] for piece in pieces]
    return mx.contiguous(parts[0] if len(parts) == 1 else mx.concatenate(parts, axis=axis))


def shard_projections(module: nn.Module, names: Sequence[str], sharding: str,
                      group: mx.distributed.Group, segments=1) -> None:
    """Replace each named linear layer of `module` by MLX's sharded layer of that kind."""
    for name in names:
        layer = getattr(module, name)
        setattr(module, name, shard_linear(layer, sharding, segments=segments, group=group))


def shard_attention(attn: nn.Module, num_heads: int, num_kv_heads: int, group: mx.distributed.Group, *,
                    qkv: Sequence[str] = ("q_proj", "k_proj", "v_proj"), out: str = "o_proj",
                    qkv_segments=1) -> Tuple[int, int]:
    """Split the `qkv` projections by heads (`qkv_segments`: the offsets of q, k and v
    in a fused one) and `out` by the matching input columns (it all-sums); returns the
    (query, kv) head counts per rank, which the caller stores."""
    heads = per_rank(num_heads, group, "num_attention_heads")
    kv_heads = per_rank(num_kv_heads, group, "num_key_value_heads")
    shard_projections(attn, qkv, ALL_TO_SHARDED, group, segments=qkv_segments)
    shard_projections(attn, (out,), SHARDED_TO_ALL, group)
    return heads, kv_heads


def shard_mlp(mlp: nn.Module, group: mx.distributed.Group, *, reduce: bool = True,
              inputs: Sequence[str] = ("gate_proj", "up_proj"), output: str = "down_proj", segments=1) -> None:
    """The `inputs` projections (gate/up; `segments` pieces if fused) by hidden units,
    `output` (down_proj) by the matching columns. With `reduce=False` the output layer
    is only sliced, not all-summed: its caller sums a larger expression once (see
    `sum_outputs`)."""
    shard_projections(mlp, inputs, ALL_TO_SHARDED, group, segments=segments)
    if reduce:
        shard_projections(mlp, (output,), SHARDED_TO_ALL, group)
    else:
        slice_input_columns(getattr(mlp, output), group)


def slice_input_columns(linear: nn.Module, group: mx.distributed.Group) -> None:
    """Keep a linear layer's input columns of this rank, in place (float, or quantized:
    packed weight, scales and biases alike, so N must divide its groups), summing
    nothing; a bias stays on rank 0 only, so the caller's sum over ranks adds it once."""
    if not isinstance(linear, (nn.Linear, nn.QuantizedLinear)):
        raise ValueError(f"slice_input_columns takes a Linear or QuantizedLinear, got {type(linear).__name__}")
    for name in ("weight", "scales", "biases"):
        if name in linear:
            linear[name] = take_shard(linear[name], group, axis=-1)
    bias_on_rank0(linear, group)


def bias_on_rank0(module: nn.Module, group: mx.distributed.Group) -> None:
    """Zero `module`'s bias on every rank but 0: a layer applied to a partial sum (a
    rank's share) must add its bias once, not once per rank."""
    if "bias" in module and group.rank() != 0:
        module.bias = mx.zeros_like(module.bias)


def shard_switch_linear(layer: nn.Module, sharding: str, group: mx.distributed.Group) -> None:
    """An expert stack (E, out, in), float or quantized, in place: all-to-sharded keeps
    this rank's output rows of every expert, sharded-to-all its input columns (packed
    weights, scales and biases alike: N must divide the quantization groups). A bias
    (E, out) follows the rows, or stays on rank 0 only for columns. Nothing is summed
    here: the mixture of experts sums its weighted output once (`sum_outputs`)."""
    if not isinstance(layer, (SwitchLinear, QuantizedSwitchLinear)):
        raise ValueError(f"shard_switch_linear takes a SwitchLinear, got {type(layer).__name__}")
    if sharding not in (ALL_TO_SHARDED, SHARDED_TO_ALL):
        raise ValueError(f"sharding {sharding!r}: use {ALL_TO_SHARDED!r} or {SHARDED_TO_ALL!r}")
    axis = -2 if sharding == ALL_TO_SHARDED else -1
    for name in ("weight", "scales", "biases"):
        if name in layer:
            layer[name] = take_shard(layer[name], group, axis=axis)
    if "bias" in layer and sharding == ALL_TO_SHARDED:
        layer.bias = take_shard(layer.bias, group, axis=-1)
    elif sharding == SHARDED_TO_ALL:
        bias_on_rank0(layer, group)


def shard_switch_glu(glu: SwitchGLU, group: mx.distributed.Group) -> None:
    """Every expert's hidden units split across ranks (the caller all-sums)."""
    shard_switch_linear(glu.gate_proj, ALL_TO_SHARDED, group)
    shard_switch_linear(glu.up_proj, ALL_TO_SHARDED, group)
    shard_switch_linear(glu.down_proj, SHARDED_TO_ALL, group)


def shard_moe(moe: nn.Module, experts: SwitchGLU, group: mx.distributed.Group) -> None:
    """A mixture-of-experts block whose output is a weighted sum of `experts`' outputs
    (plus any dense term the caller slices with reduce=False): every expert's hidden
    units split across ranks, the block's output all-summed once."""
    shard_switch_glu(experts, group)
    sum_outputs(moe, group)


@functools.lru_cache(maxsize=None)
def _summed_class(cls: type) -> type:
    def __call__(self, *args, **kwargs):
        return mx.distributed.all_sum(cls.__call__(self, *args, **kwargs), group=self.sum_group)

    doc = f"{cls.__name__} whose output is all-summed over `sum_group` (see sharding.sum_outputs)."
    return type(f"Summed{cls.__name__}", (cls,), {"__call__": __call__, "__doc__": doc})


def sum_outputs(module: nn.Module, group: mx.distributed.Group) -> None:
    """Make `module` return the all-sum over ranks of what it computes, in place.

    The instance becomes a subclass of its own class whose `__call__` sums the parent's
    output, so its parameter names, isinstance checks and forward code stay as they
    are (wrapping it would rename every parameter under it)."""
    module.__class__ = _summed_class(type(module))
    module.sum_group = group


def parameter_bytes(module: nn.Module) -> int:
    """Bytes of the parameters `module` holds on this rank."""
    return sum(v.nbytes for _, v in tree_flatten(module.parameters()))


def shard_gated_delta(gdn: nn.Module, group: mx.distributed.Group, *,
                      per_head: Sequence[str] = (), qkv_ordered: Sequence[str] = (), out: str = "out_proj") -> None:
    """Keep this rank's key heads of a Gated DeltaNet layer, each with its r value heads,
    in place (qwen3_next's GatedDeltaNet attributes). `per_head` projections have rows
    ordered by key head (so contiguous blocks are whole heads), `qkv_ordered` ones rows
    [all q | all k | all v], like the conv channels. A_log and dt_bias are per value
    head; `out` (out_proj) all-sums over the value heads' columns. The conv and recurrent
    states then hold only this rank's channels and heads, and so does every rollback
    record made from them."""
    key_dim = gdn.key_dim
    gdn.num_key_heads = per_rank(gdn.num_key_heads, group, "linear_num_key_heads")
    gdn.num_value_heads = per_rank(gdn.num_value_heads, group, "linear_num_value_heads")
    shard_projections(gdn, per_head, ALL_TO_SHARDED, group)
    shard_projections(gdn, qkv_ordered, ALL_TO_SHARDED, group, segments=[key_dim, 2 * key_dim])
    gdn.conv1d.weight = take_shard(gdn.conv1d.weight, group, axis=0, segments=[key_dim, 2 * key_dim])  # (C/N, K, 1)
    gdn.A_log = take_shard(gdn.A_log, group)
    gdn.dt_bias = take_shard(gdn.dt_bias, group)
    shard_projections(gdn, (out,), SHARDED_TO_ALL, group)
    gdn.key_dim = gdn.num_key_heads * gdn.key_head_dim
    gdn.value_dim = gdn.num_value_heads * gdn.value_head_dim
    gdn.conv_dim = 2 * gdn.key_dim + gdn.value_dim


def mamba2_in_proj_pieces(mixer: nn.Module) -> List[int]:
    """Offsets of [gate I | x I | B G*N | C G*N | dt H] in a Mamba-2 in_proj's rows."""
    I, GN = mixer.intermediate_size, mixer.n_groups * mixer.state_size
    return [I, 2 * I, 2 * I + GN, 2 * I + 2 * GN]


def shard_mamba2(mixer: nn.Module, group: mx.distributed.Group) -> None:
    """Keep this rank's heads of a Mamba-2 mixer (nemotron_h.Mamba2Mixer's attributes),
    with the B/C groups they read: heads and groups are both contiguous, so with G
    divisible by N a rank's heads read exactly its groups. in_proj splits each of its
    five pieces, the conv each of [x | B | C], dt_bias / A_log / D per head and the
    gated norm's weight per channel (its groups stay whole); out_proj all-sums. The
    conv and SSM states, and the rollback records, then cover this rank's share."""
    I, GN = mixer.intermediate_size, mixer.n_groups * mixer.state_size
    in_pieces, conv_pieces = mamba2_in_proj_pieces(mixer), [I, I + GN]
    mixer.num_heads = per_rank(mixer.num_heads, group, "mamba_num_heads")
    mixer.n_groups = per_rank(mixer.n_groups, group, "n_groups")
    shard_projections(mixer, ("in_proj",), ALL_TO_SHARDED, group, segments=in_pieces)
    for name in ("weight", "bias"):
        if name in mixer.conv1d:
            mixer.conv1d[name] = take_shard(mixer.conv1d[name], group, axis=0, segments=conv_pieces)
    for name in ("dt_bias", "A_log", "D"):
        mixer[name] = take_shard(mixer[name], group)
    if "norm" in mixer:
        mixer.norm.weight = take_shard(mixer.norm.weight, group)
    shard_projections(mixer, ("out_proj",), SHARDED_TO_ALL, group)
    mixer.intermediate_size = mixer.num_heads * mixer.head_dim
    mixer.conv_dim = mixer.intermediate_size + 2 * mixer.n_groups * mixer.state_size
