"""`mlx_lm.server` under mlx.launch: rank 0 serves HTTP, every rank generates.

The model is sharded over all ranks (`ModelProvider(..., group=...)`), so every forward
all-sums and every rank must run the same jobs, with the same inputs, stopping at the
same token. Rank 0's worker broadcasts each job it takes (the request, its model key
and its prompt tokens) and the other ranks' workers, which never see a client, run
the same job on receipt (`RankWorker`). What only rank 0 knows, whether the client
went away, is agreed on where the worker asks: the job's cancel flag is an
`AgreedEvent`, whose `is_set()` all-sums rank 0's answer, so every rank stops at the
same prefill chunk or token. Everything else the worker decides (stop strings, EOS,
prompt-cache hits, sampling from the shared seed, pinned draft lengths) is a function
of those inputs, identical on every rank.

A generation that raises on one rank cannot be trusted to leave the ranks in step
(and a lost peer raises in the next all-sum), so under more than one rank a failed
generation ends the process with a clear error; the others then fail in their next
all-sum and end too.
"""

import argparse
import logging
import os
import sys
import threading
from typing import NoReturn

import mlx.core as mx

from . import distributed
from .feeding import on_generation_stream
from .serving import GenerationResult, GenerationWorker, Job, ModelProvider

log = logging.getLogger(__name__)


# Rank 0 sends each job to followers that wait for it (they answer every job in step
# with it): longer means one is gone.
SEND_DEADLINE_SECONDS = 30.0


class AgreedEvent:
    """A cancel flag read alike on every rank. `set()` is local (rank 0's HTTP thread
    calls it); `is_set()` all-sums rank 0's state, so it is a collective: only the
    generation worker calls it, at the same points on every rank."""

    def __init__(self, group: mx.distributed.Group):
        self.group = group
        self._event = threading.Event()

    def set(self) -> None:
        self._event.set()

    @on_generation_stream  # behind the forwards still running there (distributed.py)
    def is_set(self) -> bool:
        mine = int(self.group.rank() == 0 and self._event.is_set())
        return mx.distributed.all_sum(mx.array(mine, dtype=mx.int32), group=self.group).item() > 0


class RankWorker(GenerationWorker):
    """The generation worker of one rank: rank 0 broadcasts each job before running
    it, the others receive and run it (`run_forever` on a follower never returns
    until rank 0 goes away)."""

    def __init__(self, group: mx.distributed.Group, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.group = group

    def submit(self, job: Job) -> None:
        job.cancelled = AgreedEvent(self.group)
        super().submit(job)

    def run_forever(self) -> None:
        if self.group.rank() == 0:
            return super().run_forever()
        while True:
            request, model_key, tokens = distributed.broadcast_object(None, self.group)
            job = Job(request, model_key, tokens)
            job.cancelled = AgreedEvent(self.group)
            self.run(job)

    def run(self, job: Job) -> None:
        try:
            if self.group.rank() == 0:  # to followers already waiting for it (distributed.deadline says why)
                distributed.broadcast_object((job.request, job.model_key, job.tokens), self.group,
                                             sender_deadline=SEND_DEADLINE_SECONDS,
                                             what="sending a request to the other ranks")
            super().run(job)
        except RuntimeError as e:
            self._stop(e)

    def generate(self, job: Job) -> GenerationResult:
        try:
            return super().generate(job)
        except RuntimeError as e:  # before GenerationWorker.run would answer 500 and go on
            self._stop(e)

    def _stop(self, error: RuntimeError) -> NoReturn:
        print(f"Error: rank {self.group.rank()} of {self.group.size()} stopped serving: {error}. Another rank "
              "probably failed or was stopped (see its output)", file=sys.stderr, flush=True)
        os._exit(1)  # also from the worker thread: the ranks can no longer agree


def agree_on_settings(parser: argparse.ArgumentParser, args: argparse.Namespace, group: mx.distributed.Group) -> None:
    """Before loading, on every rank: refuse what cannot run sharded, seed every rank
    with rank 0's seed, pin the draft length (the adaptive policy times rounds on each
    rank's clock) and let only rank 0 log requests."""
    if args.allow_other_models:
        parser.error("--allow-other-models cannot be used under mlx.launch: every rank must load the same model")
    if args.mtp:
        parser.error("--mtp cannot be used under mlx.launch: the MTP head is not sharded")
    mx.random.seed(distributed.shared_seed(None, group))
    args.fixed_draft_length = True
    if group.rank() != 0:
        logging.getLogger("mlx_lm").setLevel(max(logging.WARNING, logging.getLevelName(args.log_level)))


def agree_on_cache_bytes(provider: ModelProvider, group: mx.distributed.Group) -> None:
    """Every rank bounds its prompt cache by rank 0's bound (by default a share of the
    memory free after loading, which differs across hosts), so hits and evictions, and
    with them the forwards, are the same on every rank."""
    cache = provider.default.prompt_cache
    cache.max_bytes = distributed.broadcast_object(cache.max_bytes, group)


def make_worker(group: mx.distributed.Group, provider: ModelProvider, args: argparse.Namespace) -> GenerationWorker:
    """The server's one-request-at-a-time worker (with its --kv-bits): a RankWorker
    under more than one rank."""
    options = (args.prefill_step_size, args.num_draft_tokens, args.fixed_draft_length, args.prompt_lookup,
               args.max_ngram_size)
    kv_options = dict(kv_bits=args.kv_bits, kv_group_size=args.kv_group_size,
                      quantized_kv_start=args.quantized_kv_start)
    if group.size() == 1:
        return GenerationWorker(provider, *options, **kv_options)
    return RankWorker(group, provider, *options, **kv_options)


def follow(args: argparse.Namespace, group: mx.distributed.Group, provider: ModelProvider) -> None:
    """A rank other than 0: run every job rank 0 broadcasts, until rank 0 goes away."""
    agree_on_cache_bytes(provider, group)
    with distributed.fail_together(group):
        make_worker(group, provider, args).run_forever()
