"""The worker that runs the served model's requests together (BatchWorker: continuous
batching in one BatchGenerator). serving.py tells how the pieces fit."""

import copy
import logging
import queue
import time
from collections import deque
from typing import Any, Dict, List, Optional

from .batching import BatchGenerator, PromptProgress, Response
from .feeding import DEFAULT_PREFILL_STEP_SIZE
from .generation_worker import GenerationWorker
from .models.lru_prompt_cache import FetchResult
from .models.checkpoints import PrefillChunks
from .openai_api import GenerationResult, RequestError, StopStringFilter, TokenLogprob
from .served_model import Job, ModelProvider, ServedModel
from .speculation_stats import SpeculationStats

log = logging.getLogger("mlx_lm.server")


class _Stream:
    """A request in the batch: its prompt, what it has produced, how its text goes out."""

    def __init__(self, job: Job, served: ServedModel, tokens: List[int], num_cached: int):
        self.job, self.served, self.tokens, self.num_cached = job, served, tokens, num_cached
        self.detokenizer = served.tokenizer.detokenizer
        self.stops = StopStringFilter(job.request.stop)
        self.generated: List[int] = []  # the tokens the client gets
        self.emitted: List[int] = []  # every token the batch reported (beyond a stop string too)
        self.finish_reason: Optional[str] = None  # set once its answer is complete
        self.retired = False  # the batch retired its row (its caches came with the last response)
        self.final_cache: Optional[List[Any]] = None  # those caches
        self.text = ""
        self.logprobs: List[TokenLogprob] = []
        self.first_token_at: Optional[float] = None
        self.speculation: Optional[SpeculationStats] = None  # the batch's counts, when it speculates


class BatchWorker(GenerationWorker):
    """Runs the served model's requests together in one BatchGenerator (continuous
    batching, at most `max_batch_size` decoding at once, admitted first come first
    served); a request for another model (--allow-other-models) runs alone, in its
    turn, once the requests before it have finished. With --prompt-lookup, a
    --draft-model (recurrent ones too) or --mtp, requests without penalties
    speculate inside the batch (each row drafts, at most its num_draft_tokens a round:
    as many as the batch's draft-length policy finds fastest, or all of them with
    --fixed-draft-length; one forward verifies all rows, each keeps its own
    accepted prefix).

    Per request, as the one-at-a-time worker does: its own sampler, penalties and seed
    (a seeded sample depends on nothing else: not the batch, what ran before, the
    drafts, or max_tokens, which only cuts it), stop strings,
    streaming, logprobs, and the prompt cache: fetched before it joins, stored after
    prefill (under prompt[:-1], for caches that may not trim) and when it ends, under
    exactly the tokens its cache holds. A cancelled request leaves the batch at the
    next step; the others go on undisturbed."""

    def __init__(self, provider: ModelProvider, prefill_step_size: int = DEFAULT_PREFILL_STEP_SIZE,
                 max_batch_size: int = 8,
                 default_num_draft_tokens: int = 3, prompt_lookup: bool = False, max_ngram_size: int = 3,
                 fixed_draft_length: bool = False, prefill_batch_size: int = 8):
        super().__init__(provider, prefill_step_size, default_num_draft_tokens, fixed_draft_length, prompt_lookup,
                         max_ngram_size)
        self.max_batch_size = max_batch_size
        self.prefill_batch_size = prefill_batch_size  # prompts prefilling at once (upstream's --prompt-concurrency)
        self.backlog: "deque[Optional[Job]]" = deque()
        self.streams: Dict[int, _Stream] = {}
        self.generator = self._make_generator()  # a model that cannot speculate fails here, at startup

    @property
    def batch_size(self) -> int:
        return len(self.streams) + super().batch_size  # (another model's request runs alone)

    @property
    def queue_length(self) -> int:
        return super().queue_length + len(self.backlog)

    def _make_generator(self) -> BatchGenerator:
        served = self.provider.default
        return BatchGenerator(
            served.model, stop_tokens=served.tokenizer.eos_token_ids, completion_batch_size=self.max_batch_size,
            prefill_batch_size=self.prefill_batch_size, prefill_step_size=self.prefill_step_size,
            return_prompt_caches=True, prompt_lookup=self.prompt_lookup,
            num_draft_tokens=self.default_num_draft_tokens, max_ngram_size=self.max_ngram_size,
            draft_model=served.draft_model, mtp=served.mtp, fixed_draft_length=self.fixed_draft_length,
        )

    def run_forever(self) -> None:
        while True:
            self._take_jobs(wait=not self.streams and not self.backlog)
            self._admit()
            if self.streams:
                self.step()
            elif self.backlog and self.backlog[0] is None:  # stop(), everything before it done
                return
            elif self.backlog:  # another model's request, and the batch is empty
                self.run(self.backlog.popleft())

    def _take_jobs(self, wait: bool) -> None:
        if wait:
            self.backlog.append(self.jobs.get())
        while True:
            try:
                self.backlog.append(self.jobs.get_nowait())
            except queue.Empty:
                return

    def _admit(self) -> None:
        while self.backlog and self.backlog[0] is not None and self.backlog[0].model_key is None:
            job = self.backlog.popleft()
            if job.cancelled.is_set():
                log.info("Client disconnected while queued; request dropped")
                self.metrics.count_request(job.request.kind, "cancelled")
                continue
            try:
                self._start(job)
            except RequestError as e:
                self.metrics.count_error(job.request.kind, e.status)
                job.events.put(("error", e.status, e.message))
            except Exception as e:  # the server stays up; the client learns why
                log.exception("Could not start the request")
                self.metrics.count_error(job.request.kind, 500)
                job.events.put(("error", 500, f"generation failed: {type(e).__name__}: {e}"))

    def _start(self, job: Job) -> None:
        request, served = job.request, self.provider.default
        if request.num_draft_tokens is not None and not self.generator.speculating:
            raise RequestError(400, "num_draft_tokens needs a server started with --draft-model or --prompt-lookup")
        tokens = job.tokens
        max_tokens = served.max_new_tokens(len(tokens), request.max_tokens)
        sampler, processors = self._sampling(served, request)
        cache, fetched = self._fetch_cache(served, job)
        seeded = request.seed is not None and request.sampling["temp"] > 0
        # Penalties and lookups also see the part of the prompt already in the cache.
        uid = self.generator.insert_segments(
            [self._segments(cache, fetched)], [max_tokens], caches=[cache],
            all_tokens=[tokens[: fetched.num_cached]], samplers=[sampler], logits_processors=[processors],
            seeds=[request.seed % (1 << 64) if seeded else None], num_draft_tokens=[request.num_draft_tokens],
        )[0]
        self.streams[uid] = _Stream(job, served, tokens, fetched.num_cached)

    def _segments(self, cache: List[Any], fetched: FetchResult) -> List[List[int]]:
        """The rest of the prompt in pieces that end where a solo prefill's chunks
        would: the batch never cuts a chunk across a piece's end, so it chunks the
        prompt as the one-at-a-time worker does (models/checkpoints.py)."""
        return PrefillChunks(cache, self.prefill_step_size).segments(fetched.remaining)

    def step(self) -> None:
        """One batch step; its tokens go out to their requests; cancelled ones leave.
        Whatever fails in it fails the requests in the batch (500) and starts a fresh
        batch: the worker goes on."""
        try:
            progress, responses = self.generator.next()
            for event in progress:
                self._prefilled(event)
            for response in responses:  # a speculating row may report several tokens a step
                self._deliver(response)
            for uid in [uid for uid, s in self.streams.items() if s.finish_reason or s.job.cancelled.is_set()]:
                self._finish(uid, self.streams[uid])
                del self.streams[uid]  # (after: a failure above fails it too)
        except Exception as e:  # the server stays up; every client in the batch learns why
            log.exception("Batched generation failed")
            for stream in self.streams.values():
                self.metrics.count_error(stream.job.request.kind, 500)
                stream.job.events.put(("error", 500, f"generation failed: {type(e).__name__}: {e}"))
            self.streams.clear()
            self.generator = self._make_generator()

    def _prefilled(self, event: PromptProgress) -> None:
        stream = self.streams[event.uid]
        lru, tokens = stream.served.prompt_cache, stream.tokens
        if event.prompt_cache is not None and stream.served.snapshot_prompts and tokens[:-1] not in lru:
            lru.insert(tokens[:-1], event.prompt_cache)  # see the module docstring; the batch has its own copy
        if stream.job.request.stream:
            stream.job.events.put(("keepalive", stream.num_cached + event.num_fed, len(tokens)))

    def _deliver(self, response: Response) -> None:
        stream = self.streams[response.uid]
        stream.emitted.append(response.token)
        if response.finish_reason is not None:  # the batch retired the row, even past a stop string
            stream.retired, stream.final_cache = True, response.prompt_cache
        if stream.finish_reason is not None:  # past its stop string: in its cache, not in its answer
            return
        request = stream.job.request
        stream.generated.append(response.token)
        stream.first_token_at = stream.first_token_at or time.perf_counter()
        stream.speculation = response.speculation
        if response.finish_reason != "stop":
            stream.detokenizer.add_token(response.token)
        if response.finish_reason is not None:
            stream.detokenizer.finalize()
        entries = []
        if response.finish_reason != "stop" and request.logprobs:
            entries = [self._logprob(stream.served, response, request.top_logprobs)]
        delta, stopped = stream.stops.add(stream.detokenizer.last_segment)
        finish_reason = "stop" if stopped else response.finish_reason
        if finish_reason is not None:
            delta += stream.stops.flush()
        stream.text += delta
        stream.logprobs += entries
        if request.stream and (delta or entries):
            stream.job.events.put(("delta", delta, entries))
        if finish_reason is not None:
            stream.finish_reason = finish_reason

    def _finish(self, uid: int, stream: _Stream) -> None:
        """Retire request `uid` (from the batch too, unless the batch retired it) and
        store its cache under exactly the tokens it holds."""
        sequence = stream.tokens + stream.emitted
        num_held, prompt_cache = len(sequence), stream.final_cache
        if not stream.retired:
            prompt_cache, held = self.generator.remove([uid], return_prompt_caches=True)[uid]
            num_held = len(held)
        if num_held > stream.num_cached:
            stream.served.prompt_cache.insert(sequence[:num_held], prompt_cache)
        kind = stream.job.request.kind
        if num_held < len(stream.tokens):  # cancelled before its prompt was in
            log.info("Client disconnected during prefill (%d of %d prompt tokens fed); request dropped",
                     num_held, len(stream.tokens))
            self.metrics.count_request(kind, "cancelled")
            return
        if stream.job.cancelled.is_set():
            log.info("Client disconnected; stopped after %d generated tokens", len(stream.generated))
        result = GenerationResult(stream.text, stream.finish_reason or "stop", len(stream.tokens), stream.num_cached,
                                  len(stream.generated), self._speculation_stats(stream), stream.logprobs)
        seconds = time.perf_counter() - (stream.first_token_at or time.perf_counter())
        log.info("%s: %d prompt tokens (%d cached), %d generated at %.1f tokens/s (batch of %d)",
                 stream.served.name, result.prompt_tokens, stream.num_cached, len(stream.generated),
                 len(stream.generated) / seconds if seconds > 0 else 0.0, len(self.streams))
        # Counted before the answer goes out: a client that has it sees it counted.
        self.metrics.count_result(kind, result, cancelled=stream.job.cancelled.is_set())
        stream.job.events.put(("done", result))

    @staticmethod
    def _speculation_stats(stream: _Stream) -> Optional[SpeculationStats]:
        return None if stream.speculation is None else copy.deepcopy(stream.speculation)
