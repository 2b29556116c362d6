"""The worker that runs one request at a time (GenerationWorker): every MLX computation
of `mlx_lm.server` runs on its thread. serving.py tells how the pieces fit.

With `kv_bits` (the server's --kv-bits) its KV caches become QuantizedKVCaches once
they hold `quantized_kv_start` tokens, checked after each prefill chunk and each step,
as `stream_generate(..., kv_bits=...)` does, so an answer is that call's, token for
token; the prompt cache stores and resumes the quantized entries. Only this worker
honours them (upstream also serves --kv-bits one request at a time)."""

import contextlib
import logging
import queue
import threading
from typing import Any, Callable, Generator, List, Optional, Tuple

import mlx.core as mx

from .cli_args import DEFAULT_QUANTIZED_KV_START
from .drafters import PromptLookup
from .feeding import DEFAULT_PREFILL_STEP_SIZE, kv_quantizer
from .generate import GenerationResponse, stream_generate
from .models.lru_prompt_cache import FetchResult, copy_prompt_cache
from .metrics import Metrics
from .openai_api import GenerationRequest, GenerationResult, RequestError, StopStringFilter, TokenLogprob
from .sample_utils import make_logits_processors, make_sampler
from .served_model import Job, ModelProvider, ServedModel

log = logging.getLogger("mlx_lm.server")


class _Cancelled(Exception):
    """The client went away during prefill, after `num_fed` of `total` prompt tokens."""

    def __init__(self, num_fed: int, total: int):
        super().__init__(num_fed, total)
        self.num_fed, self.total = num_fed, total


@contextlib.contextmanager
def _seeded(seed: Optional[int]):
    """The global generator seeded with `seed` inside (nothing changes for None);
    afterwards it goes on from a draw made before, so later unseeded requests are not
    fixed by this seed (and ranks that agree on the state still agree)."""
    if seed is None:
        yield
        return
    resume = int(mx.random.randint(0, 2**31 - 1, ()).item())
    mx.random.seed(seed % (1 << 64))
    try:
        yield
    finally:
        mx.random.seed(resume)


class GenerationWorker:
    """Runs jobs one at a time (call `run_forever` on its own thread)."""

    def __init__(self, provider: ModelProvider, prefill_step_size: int = DEFAULT_PREFILL_STEP_SIZE,
                 default_num_draft_tokens: int = 3,
                 fixed_draft_length: bool = False, prompt_lookup: bool = False, max_ngram_size: int = 3, *,
                 kv_bits: Optional[int] = None, kv_group_size: int = 64,
                 quantized_kv_start: int = DEFAULT_QUANTIZED_KV_START):
        # The served model's caches are checked now (a sliding window cannot be
        # quantized): a bad setting fails at startup, not on every request.
        self.kv_options = dict(kv_bits=kv_bits, kv_group_size=kv_group_size, quantized_kv_start=quantized_kv_start)
        kv_quantizer(provider.default.make_cache(), **self.kv_options)
        self.provider = provider
        self.prefill_step_size = prefill_step_size
        self.default_num_draft_tokens = default_num_draft_tokens
        self.fixed_draft_length = fixed_draft_length
        self.prompt_lookup, self.max_ngram_size = prompt_lookup, max_ngram_size
        self.jobs: "queue.Queue[Optional[Job]]" = queue.Queue()  # None: stop()
        self._thread: Optional[threading.Thread] = None
        self.metrics = Metrics()  # what GET /metrics reports
        self._running: Optional[Job] = None  # the job `run` is on

    def submit(self, job: Job) -> None:
        self.jobs.put(job)

    def start(self) -> None:
        """Run `run_forever` on its own (daemon) thread."""
        self._thread = threading.Thread(target=self._run_logged, name="generation", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """End the thread once the jobs submitted before are done (`join` waits)."""
        self.jobs.put(None)

    def join(self) -> None:
        if self._thread is not None:
            self._thread.join()

    def _run_logged(self) -> None:
        try:
            self.run_forever()
        except BaseException:  # nothing should get here: each job and step is guarded
            log.exception("The generation worker stopped: no more requests will be answered")

    @property
    def alive(self) -> bool:
        """Whether the thread `start` began still runs (a worker that died answers
        nothing: /health says so)."""
        return self._thread is not None and self._thread.is_alive()

    @property
    def batch_size(self) -> int:
        """Requests being generated now (read from any thread)."""
        return int(self._running is not None)

    @property
    def queue_length(self) -> int:
        """Requests waiting for the worker (read from any thread)."""
        return self.jobs.qsize()

    def run_forever(self) -> None:
        while (job := self.jobs.get()) is not None:  # None: stop()
            self.run(job)

    def run(self, job: Job) -> None:
        kind = job.request.kind
        if job.cancelled.is_set():
            log.info("Client disconnected while queued; request dropped")
            self.metrics.count_request(kind, "cancelled")
            return
        self._running = job
        try:
            with _seeded(job.request.seed):
                result = self.generate(job)
            # Counted before the answer goes out: a client that has it sees it counted.
            self.metrics.count_result(kind, result, cancelled=job.cancelled.is_set())
            job.events.put(("done", result))
        except RequestError as e:
            self.metrics.count_error(kind, e.status)
            job.events.put(("error", e.status, e.message))
        except _Cancelled as e:
            self.metrics.count_request(kind, "cancelled")
            log.info("Client disconnected during prefill (%d of %d prompt tokens fed); request dropped",
                     e.num_fed, e.total)
        except Exception as e:  # the server stays up; the client learns why
            log.exception("Generation failed")
            self.metrics.count_error(kind, 500)
            job.events.put(("error", 500, f"generation failed: {type(e).__name__}: {e}"))
        finally:
            self._running = None

    def _sampling(self, served: ServedModel, request: GenerationRequest):
        bad = [t for t in request.logit_bias if t >= served.vocab_size]
        if bad:
            raise RequestError(400, f"logit_bias token ids {bad[:5]} are outside the vocabulary (size {served.vocab_size})")
        try:
            sampler = make_sampler(**request.sampling, xtc_special_tokens=sorted(served.tokenizer.eos_token_ids))
            processors = make_logits_processors(request.logit_bias, **request.penalties)
        except ValueError as e:
            raise RequestError(400, str(e)) from None
        return sampler, processors

    def _progress(self, job: Job, num_fed: int, total: int) -> Callable[[int, int], None]:
        """Prefill callback: keepalives for streams, and the cancel check."""
        def progress(done: int, _: int) -> None:
            if job.cancelled.is_set():
                raise _Cancelled(num_fed + done, total)
            if job.request.stream:
                job.events.put(("keepalive", num_fed + done, total))

        return progress

    def _kv_quantizer(self, served: ServedModel, prompt_cache: List[Any]) -> Callable[[List[Any]], None]:
        """feeding.kv_quantizer of the worker's settings; a model that cannot take them
        (another one a request named, with sliding windows) is the request's 400."""
        try:
            return kv_quantizer(prompt_cache, **self.kv_options)
        except ValueError as e:
            raise RequestError(400, f"{served.name} cannot be served with this server's KV quantization "
                                    f"(--kv-bits {self.kv_options['kv_bits']}): {e}") from None

    def _fetch_cache(self, served: ServedModel, job: Job) -> Tuple[List[Any], FetchResult]:
        """The request's cache: from the prompt cache, or fresh, keeping snapshots of its
        recurrent states so that later prompts resume inside it (issue 33)."""
        fetched = served.prompt_cache.fetch(job.tokens, message_boundaries=job.message_boundaries)
        if fetched.prompt_cache is not None:
            return fetched.prompt_cache, fetched
        fresh = served.make_cache()
        return served.prompt_cache.checkpointed(fresh, self.prefill_step_size,
                                                message_boundaries=job.message_boundaries), fetched

    def generate(self, job: Job) -> GenerationResult:
        request = job.request
        served = self.provider.get(job.model_key)
        speculating = served.draft_model is not None or self.prompt_lookup or served.mtp
        if request.num_draft_tokens is not None and not speculating:
            raise RequestError(400, "num_draft_tokens needs a server started with --draft-model, --prompt-lookup "
                                    "or --mtp")
        if job.tokens is None:  # another model's: rendered now that it is loaded
            job.tokens, job.chat_plan = served.encode_with_plan(request)
            job.message_boundaries = served.message_boundaries(request, job.tokens)
        tokens = job.tokens
        max_tokens = served.max_new_tokens(len(tokens), request.max_tokens)
        sampler, processors = self._sampling(served, request)
        prompt_cache, fetched = self._fetch_cache(served, job)
        quantize_kv = self._kv_quantizer(served, prompt_cache)
        # Prefilled here, not by stream_generate, whose draft prefill cannot be cancelled.
        progress = self._progress(job, fetched.num_cached, len(tokens))
        lru = served.prompt_cache
        try:
            remaining = served.prefill(fetched.remaining, prompt_cache, self.prefill_step_size, progress, quantize_kv)
        except _Cancelled as e:
            # Both halves hold exactly the tokens fed so far: keep them, so a client that
            # retries the prompt (after its own timeout, say) resumes rather than restarts.
            if e.num_fed > fetched.num_cached:
                lru.insert(tokens[: e.num_fed], prompt_cache)
            raise
        if served.snapshot_prompts and len(tokens) > 1 and tokens[:-1] not in lru:
            lru.insert(tokens[:-1], copy_prompt_cache(prompt_cache))  # see the module docstring
        num_fed = len(tokens) - 1
        if processors and num_fed:
            # The generator sees only the tokens it is fed; penalties must also see the
            # part of the prompt already in the cache.
            seen = mx.array(tokens[:num_fed])
            processors = [lambda history, logits, p=p: p(mx.concatenate([seen, history]), logits) for p in processors]
        kwargs = {}
        if speculating:
            # Which sample a seed gives depends on the draft lengths: a seeded sampled request pins them.
            fixed = self.fixed_draft_length or (request.seed is not None and request.sampling["temp"] > 0)
            kwargs = dict(draft_model=served.draft_model, adaptive_draft_length=not fixed,
                          num_draft_tokens=request.num_draft_tokens or self.default_num_draft_tokens)
        if served.mtp:
            kwargs["mtp"] = True
        if self.prompt_lookup:
            # The lookup sees the whole prompt, the part already in the cache included.
            kwargs["drafter"] = PromptLookup(self.max_ngram_size, context=tokens[:num_fed])
        responses = stream_generate(
            served.model, served.tokenizer, mx.array(remaining), max_tokens,
            sampler=sampler, logits_processors=processors, prompt_cache=prompt_cache,
            prefill_step_size=self.prefill_step_size, **self.kv_options,
            prompt_progress_callback=self._progress(job, num_fed, len(tokens)), **kwargs,
        )
        return self._consume(job, served, responses, tokens, prompt_cache, fetched.num_cached)

    def _consume(self, job: Job, served: ServedModel, responses: Generator[GenerationResponse, None, None],
                 tokens: List[int], prompt_cache: List[Any], num_cached: int) -> GenerationResult:
        """Stream the responses out; afterwards store the cache under what it holds."""
        request, stops = job.request, StopStringFilter(job.request.stop)
        generated, text, logprobs = [], "", []
        finish_reason, speculation = None, None
        try:
            for response in responses:
                generated.append(response.token)
                speculation = response.speculation
                entries = []
                if response.finish_reason != "stop" and request.logprobs:
                    entries = [self._logprob(served, response, request.top_logprobs)]
                delta, stopped = stops.add(response.text)
                finish_reason = "stop" if stopped else response.finish_reason
                if finish_reason is not None:
                    delta += stops.flush()
                text += delta
                logprobs += entries
                if request.stream and (delta or entries):
                    job.events.put(("delta", delta, entries))
                if finish_reason is not None or job.cancelled.is_set():
                    break
        finally:
            responses.close()  # settles the caches at exactly prompt + generated
        served.prompt_cache.insert(tokens + generated, prompt_cache)
        if job.cancelled.is_set():
            log.info("Client disconnected; stopped after %d generated tokens", len(generated))
        result = GenerationResult(text, finish_reason or "stop", len(tokens), num_cached, len(generated),
                                  speculation, logprobs)
        log.info("%s: %d prompt tokens (%d cached), %d generated at %.1f tokens/s%s", served.name,
                 result.prompt_tokens, num_cached, len(generated), response.generation_tps,
                 "" if speculation is None else
                 f", {speculation.num_accepted}/{speculation.num_drafted} draft tokens accepted")
        return result

    @staticmethod
    def _logprob(served: ServedModel, response, top_n: int) -> TokenLogprob:
        row = response.logprobs
        decode = served.tokenizer.decode
        top = []
        if top_n:
            ids = mx.argpartition(-row, kth=top_n - 1)[:top_n]
            values = row[ids].tolist()
            top = sorted(((decode([i]), v) for i, v in zip(ids.tolist(), values)), key=lambda tv: -tv[1])
        return TokenLogprob(decode([response.token]), row[response.token].item(), top)
