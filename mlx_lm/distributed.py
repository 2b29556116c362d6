"""Running the command-line tools on several ranks (`mlx.launch`).

Under `mlx.launch` every rank runs the same command. The target model is sharded
tensor-parallel (`utils.sharded_load`), or with `--pipeline` split by layers
(models/pipeline.py), so every forward all-sums across ranks or passes down them, and
the ranks must take identical decisions, token by token and round by round:
- sampling draws from one seed on every rank (`shared_seed`: rank 0's, broadcast);
- speculation drafts a pinned number of tokens per round (the adaptive policy reads
  wall-clock times, which differ across ranks and would desynchronise them); the draft
  model (or prompt lookup) runs whole on every rank, fed identical tokens, so it
  proposes identical drafts; the verify forward is sharded, and its all-summed logits
  are identical on every rank, so every rank accepts the same prefix and rolls back
  its own shard of each cache by the same count;
- only rank 0 prints.
Collectives outside the model (`shared_seed`, `broadcast_object`, a server's agreed
cancel flag) run on the generation stream, like every forward: on two streams the
ranks could pair one rank's flag with another's still-running forward.
A rank that fails closes its connections; the others then fail in their next all-sum,
and `fail_together` turns that into one clear error and a non-zero exit, so no rank
waits forever (mlx.launch also stops the remaining ranks once one exits non-zero).
"""

import contextlib
import os
import pickle
import sys
import threading
from typing import Any, Callable, Dict, Iterator, Optional

import mlx.core as mx
import numpy as np

from .feeding import on_generation_stream


def world() -> mx.distributed.Group:
    """The global group: every rank under mlx.launch, a group of one otherwise."""
    return mx.distributed.init()


def split_groups(group: mx.distributed.Group, pipeline: bool) -> Dict[str, Optional[mx.distributed.Group]]:
    """`utils.sharded_load`'s group arguments for a command's `--pipeline`: every rank
    a pipeline stage (a slice of the layers), else a tensor shard (a slice of each)."""
    return {"pipeline_group": group if pipeline else None, "tensor_group": None if pipeline else group}


def printer(group: mx.distributed.Group) -> Callable[..., None]:
    """`print` on rank 0; on the other ranks a function that prints nothing."""
    return print if group.rank() == 0 else _print_nothing


def _print_nothing(*args: Any, **kwargs: Any) -> None:
    pass


@on_generation_stream
def shared_seed(seed: Optional[int], group: mx.distributed.Group) -> int:
    """`seed` as rank 0 has it (a fresh random one if rank 0 has none), on every rank:
    rank 0 contributes it to an all-sum, the others contribute 0."""
    if seed is None:
        seed = int(mx.random.randint(0, 2**31 - 1, ()).item()) if group.rank() == 0 else 0
    mine = mx.array(seed if group.rank() == 0 else 0, dtype=mx.int32)
    return int(mx.distributed.all_sum(mine, group=group).item())


@contextlib.contextmanager
def deadline(seconds: float, what: str, group: mx.distributed.Group) -> Iterator[None]:
    """Exit this rank (1, naming `what`) if the block has not finished in `seconds`:
    for an exchange the other ranks are already waiting on, which then takes no time.
    MLX's ring backend may notice a lost peer while no operation is pending; the next
    one then waits for ever instead of raising (chat's rank 0, whose peer died while
    it waited for input, hung in 1 of 6 runs on a loaded machine)."""
    def expire() -> None:
        print(f"Error: rank {group.rank()} of {group.size()} stopped: {what} took over {seconds:g} s; another "
              "rank probably failed or was stopped (see its output)", file=sys.stderr, flush=True)
        os._exit(1)

    timer = threading.Timer(seconds, expire)
    timer.daemon = True
    timer.start()
    try:
        yield
    finally:
        timer.cancel()


@on_generation_stream
def broadcast_object(obj: Any, group: mx.distributed.Group, *, sender_deadline: Optional[float] = None,
                     what: str = "a broadcast") -> Any:
    """Rank 0's `obj` on every rank (the others pass anything, e.g. None): its pickle,
    all-summed with zeros from the other ranks. Only for ranks of one job, which trust
    each other as one program does. `sender_deadline` (seconds): for an object the
    others already wait for, rank 0 exits if sending it takes longer (see deadline)."""
    timed = sender_deadline is not None and group.rank() == 0
    with deadline(sender_deadline, what, group) if timed else contextlib.nullcontext():
        data = pickle.dumps(obj) if group.rank() == 0 else b""
        size = int(mx.distributed.all_sum(mx.array(len(data), dtype=mx.int32), group=group).item())
        mine = np.frombuffer(data, dtype=np.uint8) if group.rank() == 0 else np.zeros(size, dtype=np.uint8)
        total = mx.distributed.all_sum(mx.array(mine), group=group)
        return pickle.loads(bytes(np.array(total)))


@on_generation_stream
def wait_for_all(group: mx.distributed.Group) -> None:
    """Return once every rank got here. A generation loop ends with its next forward
    queued; a rank that exited then would cut a peer still computing it (a pipeline
    stage runs a step ahead of the one after it) off mid-exchange."""
    mx.eval(mx.distributed.all_sum(mx.array(0, dtype=mx.int32), group=group))


@contextlib.contextmanager
def fail_together(group: mx.distributed.Group) -> Iterator[None]:
    """On more than one rank, turn a RuntimeError (a lost peer, a failed all-sum) into
    SystemExit with a message naming this rank, so the rank exits at once and non-zero."""
    try:
        yield
    except RuntimeError as e:
        if group.size() == 1:
            raise
        sys.exit(
            f"Error: rank {group.rank()} of {group.size()} stopped: {e}. Another rank probably "
            "failed or was stopped (see its output); every rank must run the same command"
        )


def split_line(model: Any, group: mx.distributed.Group, pipeline: bool) -> str:
    """What a command prints (on rank 0) about how the model is split across the ranks."""
    from .models.sharding import parameter_bytes

    return (f"{'Pipeline' if pipeline else 'Tensor'} parallel over {group.size()} ranks: "
            f"{parameter_bytes(model) / 1e9:.3f} GB of weights on rank 0")
