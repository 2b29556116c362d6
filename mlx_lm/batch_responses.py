"""What a continuous batch (batching.BatchGenerator) reports: a generated token
(`Response`), a prompt's prefill progress (`PromptProgress`) and batch_generate's
result (`BatchResponse`)."""

from dataclasses import dataclass
from typing import Any, List, Optional, Tuple

import mlx.core as mx

from .generate_utils import BatchStats
from .speculation_stats import SpeculationStats


@dataclass
class BatchResponse:
    """What `batch_generate` returns: one text per prompt (in order) and the stats;
    with the matching flags, each prompt's cache, generated token ids and logprobs."""

    texts: List[str]
    stats: BatchStats
    caches: Optional[List[List[Any]]] = None
    token_ids: Optional[List[List[int]]] = None
    logprobs: Optional[List[List[float]]] = None  # each generated token's


@dataclass
class PromptProgress:
    """A sequence's prefill advanced: `num_fed` of its `total` prompt tokens are in its
    cache. When all but the last are (`end_of_prompt`), `prompt_cache` is that cache,
    which the batch no longer touches (a server keeps it for prompts that extend this
    one); `end_of_segment`: the feed stopped at the end of one of the prompt's segments
    (insert_segments). Upstream's PromptProcessingBatch.Response: `progress`."""

    uid: int
    num_fed: int
    total: int
    prompt_cache: Optional[List[Any]] = None
    end_of_segment: bool = False
    end_of_prompt: bool = False

    @property
    def progress(self) -> Tuple[int, int]:
        """(done, total) as upstream counts it: at the end of the prompt all of it, its
        last token being the first the batch feeds."""
        return (self.total if self.end_of_prompt else self.num_fed), self.total


@dataclass
class Response:
    """One generated token of sequence `uid`; `logprobs` (V,) is the distribution it was
    sampled from. `finish_reason`: "stop" (a stop token, reported as the token), "length"
    (max_tokens reached) or None. `prompt_cache`: on the last response, when the generator
    returns caches, the sequence's caches (its prompt and every token it generated).
    `all_tokens`, on the last response: what the cache holds (the tokens the given
    cache held, the prompt, every generated token). `speculation`: a speculating
    sequence's counts so far."""

    uid: int
    token: int
    logprobs: mx.array
    finish_reason: Optional[str] = None
    prompt_cache: Optional[List[Any]] = None
    speculation: Optional[SpeculationStats] = None
    all_tokens: Optional[List[int]] = None
