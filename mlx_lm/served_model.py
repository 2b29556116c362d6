"""The models `mlx_lm.server` serves (ServedModel: a loaded model, its draft or MTP head,
tokenizer, limits and prompt cache; ModelProvider: request names to models) and the
jobs the handler threads hand the worker (Job). serving.py tells how the pieces fit."""

import logging
import os
import queue
import threading
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Tuple

import mlx.core as mx

from .chat_output import ChatPlan, forced_call_prefix, plan_chat, template_tools
from .drafters import DraftModel, MTPHead, check_mtp_head
from .feeding import check_can_speculate, prefill, put_back_first
from .models.lru_prompt_cache import LRUPromptCache
from .models.cache import make_prompt_cache
from .models.checkpoints import CheckpointedCache, PrefillChunks, SnapshottingProgress, always_trimmable
from .openai_api import DEFAULT_MODEL_NAME, GenerationRequest, RequestError
from .speculative import check_same_tokenizer
from .tokenizer_utils import with_chat_template

log = logging.getLogger("mlx_lm.server")


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
                 dtype: Optional[str] = None, mtp: bool = False, group: Optional[mx.distributed.Group] = None,
                 load_options: Optional[Dict[str, Any]] = None, pipeline: bool = False):
        from .distributed import split_groups
        from .utils import load, sharded_load

        options = load_options or {}  # utils.load's adapter_path, trust_remote_code (the server's flags)

        self.name = path
        if group is not None and group.size() > 1:  # tensor or pipeline parallel (distributed_serving.py)
            self.model, self.tokenizer, config = sharded_load(path, **split_groups(group, pipeline), return_config=True,
                                                              dtype=dtype,
                                                              trust_remote_code=options.get("trust_remote_code", False))
        else:
            self.model, self.tokenizer, config = load(path, return_config=True, dtype=dtype, **options)
        self.mtp = mtp
        if mtp:
            check_mtp_head(self.model)
        if chat_template:
            self.tokenizer = with_chat_template(self.tokenizer, chat_template, config.get("model_type"))
        self.draft_model = None
        self.draft_name = draft_path
        self.draft_context_length = None
        if draft_path is not None:
            self.draft_model, draft_tokenizer, draft_config = load(
                draft_path, return_config=True, dtype=dtype, trust_remote_code=options.get("trust_remote_code", False))
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
        self.snapshot_prompts = cache_size > 0 and not all(always_trimmable(c) for c in fresh)

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

    def message_boundaries(self, request: GenerationRequest, tokens: List[int]) -> Tuple[int, ...]:
        """Where, inside a chat prompt's `tokens`, the chat template's rendering of its
        first i messages ends (all of them: before the generation prompt), where those
        tokens begin the prompt: prefills
        end a chunk there and a checkpointed cache snapshots there (models/checkpoints.py),
        so a later prompt that shares those messages (a system prompt, a document, the
        turns before) resumes there exactly. A function of the messages up to each one
        only, so a cold run of a prompt extending them is cut alike. () for completions."""
        if request.kind != "chat" or not self.prompt_cache.checkpoint_bytes:
            return ()
        kwargs = dict(request.chat_template_kwargs)
        tools = template_tools(request.tools, request.tool_choice, request.named_tool)
        if tools:
            kwargs["tools"] = tools
        found = []
        for i in range(1, len(request.messages) + 1):
            try:
                text = self.tokenizer.apply_chat_template(request.messages[:i], tokenize=False,
                                                          add_generation_prompt=False, **kwargs)
            except Exception:  # a template may refuse a partial chat (e.g. one ending on a system message)
                continue
            ids = self.tokenizer.encode(text, add_special_tokens=False)
            if 0 < len(ids) < len(tokens) and tokens[: len(ids)] == ids and (not found or len(ids) > found[-1]):
                found.append(len(ids))
        return tuple(found)

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
                progress: Callable[[int, int], None],
                quantize_kv: Callable[[List[Any]], None] = lambda cache: None) -> List[int]:
        """Feed all of `tokens` but the last to the target and the draft, `step` tokens
        at a time and each step to both, calling `progress(done, total)` after each
        (it may raise to cancel) and `quantize_kv` on each model's entries (feeding.
        kv_quantizer's); returns the last token. Same chunks as `generate.prefill`, so
        the caches are the ones `stream_generate` would build."""
        num_target = len(self.model.layers)
        prompt = mx.array(tokens)
        # A CheckpointedCache's snapshots and chunk ends (issue 33): the whole list's,
        # though the target and the draft are fed their parts.
        progress = SnapshottingProgress(prompt_cache, progress)
        chunks = PrefillChunks(prompt_cache, step)
        if self.mtp:
            # The head takes the target's hidden states chunk by chunk. The run that
            # continues this cache begins after its last token and so lacks that token's
            # pair: a CheckpointedCache keeps the hidden state it needs (the run then
            # feeds it as a cold run does), a plain list gets the pair now.
            checkpoints = prompt_cache if isinstance(prompt_cache, CheckpointedCache) else None
            head = MTPHead(self.model, prompt_cache[:num_target], prompt_cache[num_target:], self.vocab_size,
                           checkpoints=checkpoints)
            progress = put_back_first(prompt_cache, (head.target.cache, head.cache), progress)
            head.prefill_with_target(prompt, step, progress, quantize_kv, feed_last_pair=checkpoints is None)
        elif self.draft_model is None:
            prefill(self.model, prompt, prompt_cache, step, progress, quantize_kv)
        else:  # fed as speculation feeds it (DraftModel.prefill, with the whole list's chunks)
            draft = DraftModel(self.draft_model, prompt_cache[num_target:], self.vocab_size)
            target_cache = prompt_cache[:num_target]
            progress = put_back_first(prompt_cache, (target_cache, draft.cache), progress)
            prefill(self.model, prompt, target_cache, step, progress, quantize_kv,
                    also=draft.prefill_feeds(prompt), chunks=chunks)
        return tokens[-1:]


class Job:
    """One request on its way through the worker. `events` carries, in order:
    ("keepalive", done, total)* and ("delta", text, [TokenLogprob])* (streams only),
    then ("done", GenerationResult) or ("error", status, message). `tokens`: the
    prompt, if already tokenized (and checked against the prompt limit).
    `chat_plan`: how a chat answer is read (chat_output.py), set with the tokens;
    `message_boundaries`: ServedModel.message_boundaries of the tokens."""

    def __init__(self, request: GenerationRequest, model_key: Optional[str], tokens: Optional[List[int]] = None,
                 chat_plan: Optional[ChatPlan] = None, message_boundaries: Tuple[int, ...] = ()):
        self.request = request
        self.model_key = model_key
        self.tokens = tokens
        self.chat_plan = chat_plan
        self.message_boundaries = message_boundaries
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
                 group: Optional[mx.distributed.Group] = None, load_options: Optional[Dict[str, Any]] = None,
                 pipeline: bool = False):
        self.default = ServedModel(model_path, draft_path, cache_size, cache_bytes, chat_template, max_prompt_tokens,
                                   dtype, mtp=mtp, group=group, load_options=load_options, pipeline=pipeline)
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
        tokens, plan = self.default.encode_with_plan(request)
        return Job(request, None, tokens, plan, self.default.message_boundaries(request, tokens))
