"""What `mlx_lm.server` serves: the loaded models (ServedModel, ModelProvider) and the
one worker thread that runs every MLX computation (BatchWorker or GenerationWorker). No HTTP here.
The names live in served_model.py (models, jobs), generation_worker.py (one request at a
time) and batch_worker.py (continuous batching); this module gathers them.

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

Prompt cache (`models/lru_prompt_cache.LRUPromptCache`). After `stream_generate` stops (EOS,
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

Snapshots (issue 33). A fresh cache of a model with such layers is a CheckpointedCache
(models/checkpoints.py; with --mtp its head's too): its prefill keeps exact snapshots of them at
chunk ends, so a prompt sharing only a prefix with a stored one (another question on
the same document, an edited turn) resumes at the nearest snapshot, KV layers trimmed
there, and answers as a cold run does. Chunks end at multiples of the prefill step and
of checkpoints.SNAPSHOT_GRID and, for chats, where the template's rendering of the
first i messages ends (ServedModel.message_boundaries): a shared system prompt or
earlier turn resumes at its end. Both workers cut a prompt alike (the batch through
its segments), so a resumed answer equals the one either gives cold.
"""

from .batch_worker import BatchWorker
from .generation_worker import GenerationWorker
from .models.checkpoints import always_trimmable as _always_trimmable  # provided_models' name for it
from .openai_api import GenerationResult
from .served_model import (
    FALLBACK_CONTEXT_LENGTH,
    FALLBACK_PROMPT_CACHE_BYTES,
    PROMPT_CACHE_MEMORY_FRACTION,
    Job,
    ModelProvider,
    ServedModel,
    available_memory,
    context_length,
    default_prompt_cache_bytes,
    model_id,
)

__all__ = [
    "BatchWorker", "GenerationWorker", "GenerationResult", "FALLBACK_CONTEXT_LENGTH", "FALLBACK_PROMPT_CACHE_BYTES",
    "PROMPT_CACHE_MEMORY_FRACTION", "Job", "ModelProvider", "ServedModel", "available_memory", "context_length",
    "default_prompt_cache_bytes", "model_id", "_always_trimmable",
]
