"""What `mlx_lm.server` serves: the loaded models (ServedModel, ModelProvider) and the
one worker thread that runs every MLX computation (BatchWorker or GenerationWorker). No HTTP here.

Serving. The model (and `--draft-model`) is loaded once. Request handler threads
parse, validate and tokenize (tokenizing needs no MLX); every MLX computation runs on
one worker thread that takes jobs from a queue. That worker is a BatchWorker:
concurrent requests decode together in one BatchGenerator (continuous batching,
`--max-batch-size` at once, speculating inside the batch with `--prompt-lookup` or a
`--draft-model` or `--mtp`), each greedy answer the one it gets alone. With
`--max-batch-size 1` or under mlx.launch it is a GenerationWorker, which serves one
request at a time.

Tool calls and reasoning. A chat prompt is rendered with the tools its tool_choice
leaves (chat_output.py); with the tokens goes the request's ChatPlan, by which the
handler thread splits the answer's text into content, reasoning and tool calls. The
worker only ever sees text, so speculation cannot change what the client gets.

Limits. A prompt longer than the model's context (`--max-prompt-tokens`) is refused
with a 400 on the handler thread, before any model work; a text too long to fit even
at the vocabulary's longest token per token is refused before tokenizing. Answers are
clipped to the context left after the prompt. Stop strings are bounded in number and
length (openai_api.py), and the prompt cache in entries and bytes (by default a
quarter of the memory free after loading).

Cancellation. A client that disconnects (noticed at a failed write, or while waiting by
polling the socket: end of input may be a half-close, so it is tested with a write the
client ignores) has its job cancelled. The worker checks after every prefill
step, of the target and the draft alike (the server prefills both itself, a step of
each at a time, because `stream_generate` cannot cancel a draft prefill), and after
every generated token; it then closes the generator, or stops prefilling, and stores
the cache under exactly the tokens it holds (a retry of a long prompt resumes there).

Prompt cache (`lru_prompt_cache.LRUPromptCache`). After `stream_generate` stops (EOS,
length, a stop string or a cancel) the cache holds the prompt plus every generated
token it returned (for speculation: target and draft alike, rollback included), so
the cache is stored under `prompt + generated tokens`. Caches that may become
untrimmable (recurrent ArraysCache layers, sliding-window RotatingKVCache layers) can
only be reused through keys that are strict prefixes of a later prompt, so for them
the worker also stores, after prefill, a copy under `prompt[:-1]`: it serves an
identical request and the next turn of a chat, whose prompt extends this one even
when the chat template renders the answer differently from the generated tokens (that
turn prefills its new tokens plus one). A copy under the whole prompt would save that
one token at the cost of a second copy of the cache and a one-token forward on every
request, so there is none. Reuse is exact: identical greedy requests give identical
outputs, with or without a draft model.
"""

import contextlib
import copy
import logging
import os
import queue
import threading
import time
from collections import deque
from pathlib import Path
from typing import Any, Callable, Dict, Generator, List, Optional, Tuple

import mlx.core as mx

from .batching import BatchGenerator, PromptProgress, Response
from .drafters import DraftModel, MTPHead, PromptLookup, check_mtp_head
from .feeding import DEFAULT_PREFILL_STEP_SIZE, CachedModel, prefill
from .generate import GenerationResponse, SpeculationStats, check_same_tokenizer, stream_generate
from .feeding import check_can_speculate
from .lru_prompt_cache import LRUPromptCache, copy_prompt_cache
from .chat_output import ChatPlan, forced_call_prefix, plan_chat, template_tools
from .metrics import Metrics
from .models.cache import CacheList, KVCache, QuantizedKVCache, make_prompt_cache
from .models.checkpoints import SnapshottingProgress
from .openai_api import (
    DEFAULT_MODEL_NAME,
    GenerationRequest,
    GenerationResult,
    RequestError,
    StopStringFilter,
    TokenLogprob,
)
from .sample_utils import make_logits_processors, make_sampler
from .tokenizer_utils import with_chat_template

log = logging.getLogger("mlx_lm.server")


def _always_trimmable(entry: Any) -> bool:
    if isinstance(entry, CacheList):
        return all(_always_trimmable(c) for c in entry.caches)
    return isinstance(entry, (KVCache, QuantizedKVCache))


# The prompt limit of a model whose config.json names no context length.
FALLBACK_CONTEXT_LENGTH = 32768
# The share of free memory the prompt cache may fill by default: the rest is left for
# the running request's own cache and activations.
PROMPT_CACHE_MEMORY_FRACTION = 0.25
FALLBACK_PROMPT_CACHE_BYTES = 2 << 30


def context_length(config: dict) -> Optional[int]:
    """The context a checkpoint was trained for: `max_position_embeddings`, at the top
    level (llama, qwen2, qwen3, qwen3_next, gpt_oss) or in `text_config` (qwen3_5,
    qwen3_5_moe); None if the config names none."""
    for section in (config, config.get("text_config") or {}):
        value = section.get("max_position_embeddings")
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            return value
    return None


def available_memory() -> Optional[int]:
    """Bytes free for caches now: on a GPU its free memory (CUDA), or what Metal
    recommends the GPU use of unified memory less what MLX holds (the weights);
    otherwise the operating system's available memory. None if unknown."""
    try:
        info = mx.device_info()
    except AttributeError:  # older mlx: only mx.metal.device_info, absent off macOS
        info = {}
    if "free_memory" in info:
        return int(info["free_memory"])
    if "max_recommended_working_set_size" in info:
        return max(0, int(info["max_recommended_working_set_size"]) - mx.get_active_memory())
    try:
        with open("/proc/meminfo") as meminfo:
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return None


def default_prompt_cache_bytes() -> int:
    free = available_memory()
    return FALLBACK_PROMPT_CACHE_BYTES if free is None else int(free * PROMPT_CACHE_MEMORY_FRACTION)


class ServedModel:
    """A loaded model (plus optional draft), its tokenizer and its prompt cache.

    Prompt limit: `max_prompt_tokens`, by default the target's context (see
    `context_length`). A draft with a shorter context does not lower it: every emitted
    token is the target's, so past its context a draft only guesses worse. Requests ask
    for at most `max_tokens`, clipped so that prompt and answer fit in the larger of the
    context and `max_prompt_tokens` (the answer then ends with finish_reason "length").
    `cache_bytes` None: PROMPT_CACHE_MEMORY_FRACTION of the memory free after loading."""

    def __init__(self, path: str, draft_path: Optional[str], cache_size: int, cache_bytes: Optional[int],
                 chat_template: Optional[str] = None, max_prompt_tokens: Optional[int] = None,
                 dtype: Optional[str] = None, mtp: bool = False, group: Optional[mx.distributed.Group] = None):
        from .utils import load, sharded_load

        self.name = path
        if group is not None and group.size() > 1:  # tensor parallel (distributed_serving.py)
            self.model, self.tokenizer, config = sharded_load(path, tensor_group=group, return_config=True, dtype=dtype)
        else:
            self.model, self.tokenizer, config = load(path, return_config=True, dtype=dtype)
        self.mtp = mtp
        if mtp:
            check_mtp_head(self.model)
        if chat_template:
            self.tokenizer = with_chat_template(self.tokenizer, chat_template, config.get("model_type"))
        self.draft_model = None
        self.draft_name = draft_path
        self.draft_context_length = None
        if draft_path is not None:
            self.draft_model, draft_tokenizer, draft_config = load(draft_path, return_config=True, dtype=dtype)
            check_same_tokenizer(self.tokenizer, draft_tokenizer, path, draft_path)
            self.draft_context_length = context_length(draft_config)
        self.context_length = context_length(config)
        if max_prompt_tokens is not None:
            self.max_prompt_tokens, self.prompt_limit_source = max_prompt_tokens, "the server's --max-prompt-tokens"
        elif self.context_length is not None:
            self.max_prompt_tokens = self.context_length
            self.prompt_limit_source = "the model's context, max_position_embeddings in its config.json"
        else:
            self.max_prompt_tokens = FALLBACK_CONTEXT_LENGTH
            self.prompt_limit_source = "a default: the model's config.json names no context length"
        self.max_total_tokens = max(self.max_prompt_tokens, self.context_length or 0)
        # A text longer than this many characters per allowed token cannot fit: refused
        # before tokenizing. Vocabulary spellings are at least as long as the text a
        # token covers (byte-level BPE spells each byte as one character).
        self.longest_token_chars = max(len(t) for t in self.tokenizer.get_vocab())
        if cache_bytes is None:
            cache_bytes = default_prompt_cache_bytes()
        self.prompt_cache = LRUPromptCache(cache_size, cache_bytes)
        fresh = self.make_cache()
        if mtp:
            check_can_speculate(self.model, fresh[: len(self.model.layers)], "target model")
        if self.draft_model is not None:
            # Validate before serving: otherwise every request would fail (upstream #1446).
            num_target = len(self.model.layers)
            check_can_speculate(self.model, fresh[:num_target], "target model")
            check_can_speculate(self.draft_model, fresh[num_target:], "draft model")
        # Only strict-prefix keys can reuse a cache that may not trim (module docstring).
        self.snapshot_prompts = cache_size > 0 and not all(_always_trimmable(c) for c in fresh)

    @property
    def vocab_size(self) -> int:
        return self.model.args.vocab_size

    def make_cache(self) -> List[Any]:
        """The target's cache entries, then the draft's or the MTP head's."""
        prompt_cache = make_prompt_cache(self.model)
        if self.draft_model is not None:
            prompt_cache += make_prompt_cache(self.draft_model)
        if self.mtp:
            prompt_cache += self.model.make_mtp_cache()
        return prompt_cache

    def _too_long(self, size: str) -> RequestError:
        return RequestError(400, f"the prompt has {size}; this server accepts prompts of at most "
                                 f"{self.max_prompt_tokens} tokens ({self.prompt_limit_source}): shorten it")

    def encode(self, request: GenerationRequest) -> List[int]:
        """The request's prompt tokens, refused (400) past the prompt limit or when they
        leave no room for an answer. Needs no MLX, so the server calls it on the
        request's own thread: a huge prompt never occupies the generation worker."""
        return self.encode_with_plan(request)[0]

    def encode_with_plan(self, request: GenerationRequest) -> Tuple[List[int], Optional[ChatPlan]]:
        """`encode`, and for a chat how its answer is read (chat_output.ChatPlan)."""
        if request.kind == "chat":
            text = self._render(request)
            tokens = self._tokenize_text(text, {"add_special_tokens": False})
            plan = plan_chat(self.tokenizer, text, request.tool_choice, request.tools, request.parallel_tool_calls)
        else:
            tokens, plan = self._tokenize(request), None
        if not tokens:
            raise RequestError(400, "the prompt is empty after tokenization")
        if len(tokens) > self.max_prompt_tokens:
            raise self._too_long(f"{len(tokens)} tokens")
        self.max_new_tokens(len(tokens), 1)
        return tokens, plan

    def _tokenize(self, request: GenerationRequest) -> List[int]:
        if isinstance(request.prompt, list):
            if len(request.prompt) > self.max_prompt_tokens:  # before looking at each id
                raise self._too_long(f"{len(request.prompt)} tokens")
            bad = [t for t in request.prompt if t >= self.vocab_size]
            if bad:
                raise RequestError(400, f"prompt token ids {bad[:5]} are outside the vocabulary (size {self.vocab_size})")
            return list(request.prompt)
        return self._tokenize_text(request.prompt, {})

    def _tokenize_text(self, text: str, kwargs: Dict[str, Any]) -> List[int]:
        if len(text) > self.max_prompt_tokens * self.longest_token_chars:
            raise self._too_long(f"{len(text)} characters, more than {self.max_prompt_tokens} tokens of at most "
                                 f"{self.longest_token_chars} characters each can hold")
        return self.tokenizer.encode(text, **kwargs)

    def _render(self, request: GenerationRequest) -> str:
        """The chat prompt: the template renders the messages (tool results included)
        and the tools tool_choice leaves; a required call ends it with the start marker."""
        if not self.tokenizer.has_chat_template:
            raise RequestError(400, f"{self.name} has no chat template: use /v1/completions, or start the server with --chat-template")
        try:
            prefix = forced_call_prefix(self.tokenizer, request.tool_choice)
        except ValueError as e:
            raise RequestError(400, str(e)) from None
        if request.tools and not self.tokenizer.has_tool_calling:
            log.warning("The request has tools, but %s names no tool-call format: its calls come back as content",
                        self.name)
        kwargs = dict(request.chat_template_kwargs)
        tools = template_tools(request.tools, request.tool_choice, request.named_tool)
        if tools:
            kwargs["tools"] = tools
        try:
            return self.tokenizer.apply_chat_template(
                request.messages, tokenize=False, add_generation_prompt=True, **kwargs
            ) + prefix
        except Exception as e:  # jinja raises its own types, templates call raise_exception
            raise RequestError(400, f"the chat template could not render these messages: {e}") from None

    def max_new_tokens(self, num_prompt: int, requested: int) -> int:
        """`requested`, clipped to the room the context leaves after the prompt."""
        room = self.max_total_tokens - num_prompt
        if room < 1:
            raise RequestError(400, f"the prompt's {num_prompt} tokens fill this server's context of "
                                    f"{self.max_total_tokens} tokens and leave no room for an answer: shorten it")
        return min(requested, room)

    def prefill(self, tokens: List[int], prompt_cache: List[Any], step: int,
                progress: Callable[[int, int], None]) -> List[int]:
        """Feed all of `tokens` but the last to the target and the draft, `step` tokens
        at a time and each step to both, calling `progress(done, total)` after each
        (it may raise to cancel); returns the last token. Same chunks as
        `generate.prefill`, so the caches are the ones `stream_generate` would build."""
        num_target = len(self.model.layers)
        prompt = mx.array(tokens)
        if not self.mtp:  # a CheckpointedCache's snapshots (issue 33); the head's pairs would not resume
            progress = SnapshottingProgress(prompt_cache, progress)
        if self.mtp:
            # The head takes the target's hidden states chunk by chunk, and the pair of
            # the last token too: the run that continues this cache begins after it.
            head = MTPHead(self.model, prompt_cache[:num_target], prompt_cache[num_target:], self.vocab_size)
            head.prefill_with_target(prompt, step, progress, lambda c: None, feed_last_pair=True)
        elif self.draft_model is None:
            prefill(self.model, prompt, prompt_cache, step, progress)
        else:  # fed as speculation feeds it
            target = CachedModel(self.model, prompt_cache[:num_target], self.vocab_size, self.vocab_size)
            draft = DraftModel(self.draft_model, prompt_cache[num_target:], self.vocab_size)
            draft.prefill(target, prompt, step, progress, lambda c: None)
        return tokens[-1:]


class Job:
    """One request on its way through the worker. `events` carries, in order:
    ("keepalive", done, total)* and ("delta", text, [TokenLogprob])* (streams only),
    then ("done", GenerationResult) or ("error", status, message). `tokens`: the
    prompt, if already tokenized (and checked against the prompt limit).
    `chat_plan`: how a chat answer is read (chat_output.py), set with the tokens."""

    def __init__(self, request: GenerationRequest, model_key: Optional[str], tokens: Optional[List[int]] = None,
                 chat_plan: Optional[ChatPlan] = None):
        self.request = request
        self.model_key = model_key
        self.tokens = tokens
        self.chat_plan = chat_plan
        self.events: "queue.Queue[tuple]" = queue.Queue()
        self.cancelled = threading.Event()


def model_id(path: str) -> str:
    """The public name of a model: a local directory's name (never its path, which
    tells clients about the server's disk), or the repo id as given."""
    local = Path(path).expanduser()
    return local.resolve().name if local.exists() else path


class ModelProvider:
    """Maps request model names to the served model. With `allow_other_models`,
    requests may also name another local model directory, loaded on demand in place of
    the previous such model (never downloaded; no draft model)."""

    def __init__(self, model_path: str, draft_path: Optional[str], allow_other_models: bool,
                 cache_size: int, cache_bytes: Optional[int], chat_template: Optional[str],
                 max_prompt_tokens: Optional[int] = None, dtype: Optional[str] = None, *, mtp: bool = False,
                 group: Optional[mx.distributed.Group] = None):
        self.default = ServedModel(model_path, draft_path, cache_size, cache_bytes, chat_template, max_prompt_tokens,
                                   dtype, mtp=mtp, group=group)
        self.model_id = model_id(model_path)
        self.names = {model_path, self.model_id, Path(model_path).name, str(Path(model_path).expanduser().resolve()),
                      DEFAULT_MODEL_NAME}
        self.draft_names = {None, DEFAULT_MODEL_NAME}
        if draft_path is not None:
            self.draft_names |= {draft_path, Path(draft_path).name, str(Path(draft_path).expanduser().resolve())}
        self.allow_other_models = allow_other_models
        self.cache_size, self.cache_bytes, self.chat_template = cache_size, cache_bytes, chat_template
        self.max_prompt_tokens, self.dtype = max_prompt_tokens, dtype
        self.other: Optional[ServedModel] = None  # touched by the worker only

    def resolve(self, request: GenerationRequest) -> Optional[str]:
        """None for the served model, else the path of another local model; raises 404."""
        if request.draft_model not in self.draft_names:
            served = "no draft model" if self.default.draft_name is None else model_id(self.default.draft_name)
            raise RequestError(404, f"draft model {request.draft_model!r} is not served here (this server uses {served})")
        if request.model is None or request.model in self.names:
            return None
        hint = f"this server serves {self.model_id!r}; name it or {DEFAULT_MODEL_NAME!r}"
        if not self.allow_other_models:
            raise RequestError(404, f"model {request.model!r} is not served here: {hint} "
                                    "(the operator can allow other local models with --allow-other-models)")
        path = Path(request.model).expanduser()
        if not (path / "config.json").is_file():
            raise RequestError(404, f"model {request.model!r} is not a local model directory with a config.json "
                                    f"(the server never downloads models): {hint}")
        if request.draft_model not in (None, DEFAULT_MODEL_NAME) or request.num_draft_tokens is not None:
            raise RequestError(400, f"speculative decoding is only available with {self.model_id!r}")
        return str(path.resolve())

    def get(self, key: Optional[str]) -> ServedModel:
        if key is None:
            return self.default
        if self.other is None or self.other.name != key:
            self.other = None  # free the previous one before loading
            log.info("Loading %s", key)
            try:
                self.other = ServedModel(key, None, self.cache_size, self.cache_bytes, self.chat_template,
                                         self.max_prompt_tokens, self.dtype)
            except (ValueError, FileNotFoundError) as e:
                raise RequestError(400, f"could not load model {key!r}: {e}") from None
        return self.other

    def make_job(self, request: GenerationRequest) -> Job:
        """Resolve the model and, for the served one, tokenize on the calling (request)
        thread; another model's prompt is tokenized by the worker once it is loaded."""
        key = self.resolve(request)
        if key is not None:
            return Job(request, key)
        return Job(request, None, *self.default.encode_with_plan(request))


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
                 fixed_draft_length: bool = False, prompt_lookup: bool = False, max_ngram_size: int = 3):
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

    def generate(self, job: Job) -> GenerationResult:
        request = job.request
        served = self.provider.get(job.model_key)
        speculating = served.draft_model is not None or self.prompt_lookup or served.mtp
        if request.num_draft_tokens is not None and not speculating:
            raise RequestError(400, "num_draft_tokens needs a server started with --draft-model, --prompt-lookup "
                                    "or --mtp")
        if job.tokens is None:  # another model's: rendered now that it is loaded
            job.tokens, job.chat_plan = served.encode_with_plan(request)
        tokens = job.tokens
        max_tokens = served.max_new_tokens(len(tokens), request.max_tokens)
        sampler, processors = self._sampling(served, request)
        fetched = served.prompt_cache.fetch(tokens)
        # A fresh cache keeps snapshots of its recurrent states: later prompts resume inside it (issue 33).
        prompt_cache = fetched.prompt_cache or served.prompt_cache.checkpointed(served.make_cache(), self.prefill_step_size)
        # Prefilled here, not by stream_generate, whose draft prefill cannot be cancelled.
        progress = self._progress(job, fetched.num_cached, len(tokens))
        lru = served.prompt_cache
        try:
            remaining = served.prefill(fetched.remaining, prompt_cache, self.prefill_step_size, progress)
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
            prefill_step_size=self.prefill_step_size,
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
                 fixed_draft_length: bool = False):
        super().__init__(provider, prefill_step_size, default_num_draft_tokens, fixed_draft_length, prompt_lookup,
                         max_ngram_size)
        self.max_batch_size = max_batch_size
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
            prefill_step_size=self.prefill_step_size, return_prompt_caches=True, prompt_lookup=self.prompt_lookup,
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
        fetched = served.prompt_cache.fetch(tokens)
        seeded = request.seed is not None and request.sampling["temp"] > 0
        cache = fetched.prompt_cache or served.prompt_cache.checkpointed(served.make_cache(), self.prefill_step_size)
        # Penalties and lookups also see the part of the prompt already in the cache.
        uid = self.generator.insert(
            [fetched.remaining], [max_tokens], caches=[cache],
            all_tokens=[tokens[: fetched.num_cached]], samplers=[sampler], logits_processors=[processors],
            seeds=[request.seed % (1 << 64) if seeded else None], num_draft_tokens=[request.num_draft_tokens],
        )[0]
        self.streams[uid] = _Stream(job, served, tokens, fetched.num_cached)

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
