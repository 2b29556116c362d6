"""The served model when upstream-style code hands the server a model provider of its
own making (any object with upstream 0.32.2's provider attributes: `model`,
`tokenizer`, `draft_model`, `model_key`, `is_batchable`, `cli_args`, and the methods
`load(model, adapter, draft)`, `load_default()`, `reset()`), as upstream's own tests
do with their DummyModelProvider.

ProvidedModel is a serving.ServedModel over the provider's already loaded objects
(serving.py's loads from a path); ProvidedModels is the serving.ModelProvider the
worker and the handler read, serving that one model. Request model names: upstream's
"default_model" and the path in model_key, plus any other name the provider's own
`load` answers with this same model (upstream asks it per request; here once per
name, on the handler thread, under a lock). Other names get a 404: one model is
served, never swapped.

A TODO of issue 32: a ServedModel constructor from loaded objects in serving.py would
replace ProvidedModel's copy of the limits below once serving.py's refactor settles.
"""

import dataclasses
import threading
from typing import Any, Optional, Set, Tuple

from .models.lru_prompt_cache import LRUPromptCache
from .openai_api import DEFAULT_MODEL_NAME, GenerationRequest
from .serving import FALLBACK_CONTEXT_LENGTH, ModelProvider, ServedModel, context_length, model_id
from .serving import _always_trimmable  # ServedModel's own rule for which caches need prefix copies
from .feeding import check_can_speculate
from .tokenizer_utils import TokenizerWrapper


class ProvidedModel(ServedModel):
    """ServedModel's attributes and limits over a provider's loaded model, tokenizer
    and draft (ServedModel.__init__ would load them from a path)."""

    @staticmethod
    def name_of(model_key: Any) -> str:
        """The model's name: the path in upstream's (model, adapter, draft) key."""
        if isinstance(model_key, tuple) and model_key and isinstance(model_key[0], str):
            return model_key[0]
        return DEFAULT_MODEL_NAME

    def __init__(self, provider: Any, draft_name: Optional[str], prompt_cache: LRUPromptCache,
                 max_prompt_tokens: Optional[int] = None):
        model, tokenizer = provider.model, provider.tokenizer
        if model is None or not isinstance(tokenizer, TokenizerWrapper):
            raise TypeError(f"the model provider's load_default() left model={type(model).__name__} and tokenizer="
                            f"{type(tokenizer).__name__}; expected a model and the TokenizerWrapper that "
                            "mlx_lm.utils.load returns")
        self.name = self.name_of(provider.model_key)
        self.model, self.tokenizer, self.mtp = model, tokenizer, False
        self.draft_model = provider.draft_model
        self.draft_name = draft_name if self.draft_model is not None else None
        self.draft_context_length = None
        self.context_length = context_length(dataclasses.asdict(model.args))
        self.max_prompt_tokens = max_prompt_tokens or self.context_length or FALLBACK_CONTEXT_LENGTH
        self.prompt_limit_source = ("the max_prompt_tokens option" if max_prompt_tokens else
                                    "the model's context, max_position_embeddings" if self.context_length else
                                    "a default: the model's arguments name no context length")
        self.max_total_tokens = max(self.max_prompt_tokens, self.context_length or 0)
        self.longest_token_chars = max(len(t) for t in tokenizer.get_vocab())
        self.prompt_cache = prompt_cache
        fresh = self.make_cache()
        if self.draft_model is not None:  # before serving, as ServedModel
            num_target = len(model.layers)
            check_can_speculate(model, fresh[:num_target], "target model")
            check_can_speculate(self.draft_model, fresh[num_target:], "draft model")
        self.snapshot_prompts = prompt_cache.max_size > 0 and not all(_always_trimmable(c) for c in fresh)


class ProvidedModels(ModelProvider):
    """serving.ModelProvider's interface over one ProvidedModel (module docstring)."""

    def __init__(self, provider: Any, served: ProvidedModel):
        self.provider = provider
        self.default = served
        self.model_id = model_id(served.name)
        self.names: Set[str] = {DEFAULT_MODEL_NAME, served.name, self.model_id}
        self.refused: Set[str] = set()
        self.draft_names = {None, DEFAULT_MODEL_NAME}
        if served.draft_name is not None:
            self.draft_names.add(served.draft_name)
        self.allow_other_models = False
        self.other = None
        self._asking = threading.Lock()

    def resolve(self, request: GenerationRequest) -> Optional[str]:
        name = request.model
        if name is not None and name not in self.names and name not in self.refused:
            with self._asking:
                served = self._provider_serves(name)
            (self.names if served else self.refused).add(name)
        return super().resolve(request)

    def _provider_serves(self, name: str) -> bool:
        """Whether the provider's own load(name) gives the served model."""
        try:
            loaded: Tuple[Any, Any] = self.provider.load(name, None, None)
        except Exception:  # its way of refusing the name (upstream's dummy asserts)
            return False
        return isinstance(loaded, tuple) and len(loaded) == 2 and loaded[0] is self.default.model
