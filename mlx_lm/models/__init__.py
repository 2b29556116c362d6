# The batched caches register themselves in cache.py's registry (upstream's
# `KVCache.merge`, `from mlx_lm.models.cache import BatchKVCache`), so they are imported
# before any module of this package is used.
from . import batch_cache  # noqa: F401
