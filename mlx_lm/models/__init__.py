# The batched caches and the LRU prompt cache register themselves in cache.py's
# registries (upstream's `KVCache.merge`, `from mlx_lm.models.cache import BatchKVCache,
# LRUPromptCache`), so they are imported before any module of this package is used.
from . import batch_cache, lru_prompt_cache  # noqa: F401
