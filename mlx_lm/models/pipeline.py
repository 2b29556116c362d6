"""Pipeline parallelism over `mx.distributed`: each rank of a group holds a contiguous
slice of the decoder layers (upstream's layout: rank N-1 the first layers, rank 0 the
last), and one forward passes the hidden state down the ranks.

Rank N-1 embeds the tokens and runs its layers; every other rank receives the hidden
state from rank r+1, runs its layers and, unless it is rank 0, sends the result to
rank r-1. An all_gather then hands rank 0's output (the last layer's) to every rank,
so each applies the final norm and lm_head and samples the same token: the generation
loops run unchanged on every rank, as under tensor parallelism (models/sharding.py).
Embeddings, the final norm and lm_head stay on every rank.

A rank keeps only its layers (`PipelineMixin.pipeline`): `layers` becomes the held
slice, numbered from 0, so `make_cache` gives one entry per held layer and everything
that zips caches with layers (trim_prompt_cache, speculative rollback, prompt-cache
files) sees this rank's part. Call it after the weights are attached (utils.sharded_load
loads lazily, pipelines, then materialises only the held layers): the parameter names
of the held layers change with their numbering.

Why the send is tied to a cache: prefill evaluates only the caches' states, not the
logits. Rank r-1's caches depend on what it receives, so rank r's caches must depend
on what it sends, or rank r would never send and rank r-1 would wait for ever.

Logits equal one process's bit for bit: every layer runs once, on one rank, on the
same inputs; only where it runs changes.
"""

from dataclasses import dataclass
from typing import Any, List, Optional, Sequence

import mlx.core as mx
import mlx.nn as nn

from .arrays_cache import ArraysCache
from .batch_kv_cache import _AlignedKV
from .cache import KVCache
from .quantized_cache import QuantizedKVCache
from .rotating_cache import RotatingKVCache

# Model types whose backbone (`model.model`, as upstream) takes `pipeline`, each checked
# on two ranks by tests/test_pipeline.py. Others built on the same backbones (mistral on
# llama's) are refused until a test says they work: a backbone subclass may override
# the forward that does the exchange.
FAMILIES = ("qwen3_next", "llama", "qwen2", "qwen3_moe", "deepseek_v3", "glm4_moe", "qwen3_5", "ministral3",
            "deepseek_v2")


@dataclass(frozen=True)
class Stage:
    """This rank's place in the pipeline: it holds layers [start, end) of the model."""

    rank: int
    size: int
    start: int
    end: int
    group: Optional[mx.distributed.Group] = None

    @property
    def receives(self) -> bool:
        """Whether a rank before this one (r + 1) computes the layers in front of it."""
        return self.rank < self.size - 1

    @property
    def sends(self) -> bool:
        """Whether a rank after this one (r - 1) runs the layers behind it."""
        return self.rank > 0


def layer_counts(num_layers: int, size: int, split: Optional[Sequence[int]] = None) -> List[int]:
    """Layers per rank (index: rank). Default: as even as possible, the low ranks (the
    last layers) taking the remainder, as upstream; `split` gives them explicitly."""
    if size > num_layers:
        raise ValueError(
            f"cannot split {num_layers} layers across {size} ranks: each rank needs at least one layer; "
            f"run on at most {num_layers} ranks"
        )
    if split is None:
        base, extra = divmod(num_layers, size)
        return [base + (rank < extra) for rank in range(size)]
    split = list(split)
    if len(split) != size:
        raise ValueError(f"split {split} has {len(split)} entries for {size} ranks; give one layer count per rank")
    if any(count <= 0 for count in split) or sum(split) != num_layers:
        raise ValueError(f"split {split}: the counts must be positive and sum to the model's {num_layers} layers")
    return split


def plan_stage(num_layers: int, group: mx.distributed.Group, split: Optional[Sequence[int]] = None) -> Stage:
    """The layers `group`'s rank holds: rank r follows the layers of ranks r+1 .. N-1."""
    counts = layer_counts(num_layers, group.size(), split)
    rank = group.rank()
    start = sum(counts[rank + 1 :])
    return Stage(rank, group.size(), start, start + counts[rank], group)


def receive(h: mx.array, stage: Stage) -> mx.array:
    """The hidden state (B, L, D) entering this rank's layers: `h` (the embedded tokens)
    on the first stage, else what rank r+1 sends (shaped like h)."""
    if not stage.receives:
        return h
    return mx.distributed.recv_like(h, stage.rank + 1, group=stage.group)


def send_and_share(h: mx.array, stage: Stage, cache: Optional[List[Any]]) -> mx.array:
    """After this rank's layers: send h (B, L, D) on to rank r-1 (the send tied to the
    last held cache entry, see the module docstring), then return the last layer's
    output, rank 0's h, on every rank."""
    if stage.sends:
        h = mx.distributed.send(h, stage.rank - 1, group=stage.group)
        if cache is not None and cache[-1] is not None:
            tie_to_cache(cache[-1], h)
    if stage.size == 1:
        return h
    return mx.distributed.all_gather(h, group=stage.group)[: h.shape[0]]  # rank 0's rows come first


def tie_to_cache(entry: Any, dependency: mx.array) -> None:
    """Make one array that `entry.state` reads depend on `dependency`, in place, so
    evaluating the cache computes it; each cache layout keeps its arrays differently."""
    if isinstance(entry, ArraysCache):
        slot = next((i for i, a in enumerate(entry.cache) if a is not None), None)
        if slot is None:
            raise ValueError("pipeline: the last held layer's ArraysCache holds no state after a forward")
        entry[slot] = mx.depends(entry[slot], dependency)
    elif isinstance(entry, _AlignedKV):
        entry.buffers = [mx.depends(entry.buffers[0], dependency), *entry.buffers[1:]]
    elif isinstance(entry, QuantizedKVCache):
        entry.keys = (mx.depends(entry.keys[0], dependency), *entry.keys[1:])
    elif isinstance(entry, (KVCache, RotatingKVCache)):
        entry.keys = mx.depends(entry.keys, dependency)
    else:
        raise ValueError(
            f"pipeline parallelism cannot tie its send to a {type(entry).__name__} cache entry; "
            "use the model's own make_cache caches"
        )


class PipelineMixin:
    """For a backbone (the inner model with `layers`): `pipeline(group)` keeps this
    rank's layers; its __call__ wraps them in `receive` and `send_and_share`. Facts
    about the layer list (which layer's cache makes the mask) are read from `layers`
    at each call, never stored when it is built: pipelining changes the list."""

    stage = Stage(rank=0, size=1, start=0, end=0)  # not pipelined: no exchange (start, end unread)

    def pipeline(self, group: mx.distributed.Group, split: Optional[Sequence[int]] = None) -> None:
        """Keep only the layers `group`'s rank runs (upstream's split: rank N-1 the first
        layers; `split`: layers per rank, index = rank), in place, once."""
        if self.stage.size > 1:
            raise ValueError(f"this model is already pipelined over {self.stage.size} ranks")
        stage = plan_stage(len(self.layers), group, split)
        self.layers = self.layers[stage.start : stage.end]
        self.stage = stage

    @property
    def pipeline_layers(self) -> List[nn.Module]:
        """Upstream's name for the layers this rank runs (here: all of `layers`)."""
        return self.layers


def pipelined_backbone(model: nn.Module, model_type: str) -> PipelineMixin:
    """The backbone of `model` (of `model_type`) that takes `pipeline`; a ValueError
    naming the model type and the supported ones for any other family."""
    if model_type not in FAMILIES:
        raise ValueError(
            f"model type {model_type!r} does not support pipeline parallelism; supported: {', '.join(FAMILIES)} "
            "(or load it tensor-parallel with tensor_group)"
        )
    backbone = model.model
    assert isinstance(backbone, PipelineMixin), f"{model_type}'s backbone {type(backbone).__name__} has no pipeline"
    return backbone
