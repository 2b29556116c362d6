"""A least-recently-used store of prompt caches keyed by the tokens they hold.

The server keeps one of these per served model. An entry is a model's cache list (for
speculation: the target's entries followed by the draft's) together with the exact
token sequence it has consumed. `fetch(tokens)` finds the entry sharing the longest
prefix with a new prompt and returns a private copy of it plus the tokens still to feed:

- an entry whose key is a strict prefix of the prompt is used as is;
- an entry that is longer than the prompt or diverges from it is used only if every one
  of its cache entries is trimmable (`can_trim_prompt_cache`): the copy is trimmed back
  to the common prefix. Recurrent states (ArraysCache) and sliding windows that have
  wrapped cannot give tokens back outside speculation, so for them only strict
  prefixes count (upstream mlx-lm issue #980); the server therefore also stores such a
  cache at the end of each prompt, before generation.
- At least one prompt token is always left to feed, because generation starts from the
  logits of the last prompt token: an exact hit on a trimmable entry is trimmed by one,
  and an exact hit on an untrimmable one is not used.

Copies share the stored arrays instead of duplicating them. That is safe because MLX
arrays are values: a cache writing `keys[..., a:b, :] = ...` replaces the array held by
its own attribute (a shared buffer is copied on that first write, not mutated), and a
copy never holds the same Python array objects as the stored entry (`state` returns
fresh slices). The stored entries themselves are never fed again.

Not thread-safe: the server touches it from its single generation thread only.
"""

from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, List, Optional, Sequence, Tuple

from .models.cache import CacheList, can_trim_prompt_cache, trim_prompt_cache


def copy_prompt_cache(prompt_cache: List[Any]) -> List[Any]:
    """A cache list holding the same tokens whose entries can be fed independently of
    the original's; rebuilt through each class's `from_state` (CacheList recurses)."""
    return [_copy_entry(c) for c in prompt_cache]


def _copy_entry(entry: Any) -> Any:
    if isinstance(entry, CacheList):
        return CacheList(*(_copy_entry(c) for c in entry.caches))
    return type(entry).from_state(entry.state, entry.meta_state)


def common_prefix_length(a: Sequence[int], b: Sequence[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


@dataclass
class CacheEntry:
    prompt_cache: List[Any]
    nbytes: int
    trimmable: bool


@dataclass
class FetchResult:
    """`prompt_cache`: a private copy holding `tokens[:num_cached]`, or None (start
    fresh); `remaining`: the tokens still to feed (never empty)."""

    prompt_cache: Optional[List[Any]]
    remaining: List[int]
    num_cached: int


class LRUPromptCache:
    """At most `max_size` entries and `max_bytes` bytes of caches; the least recently
    inserted or fetched entry is evicted first, and an entry larger than `max_bytes` on
    its own is not stored (it would evict everything else and then itself). Entries
    are searched linearly: a server keeps a handful, and one pass over each key is
    cheap next to one forward."""

    def __init__(self, max_size: int = 10, max_bytes: int = 1 << 63):
        if max_size < 0:
            raise ValueError(f"max_size must be >= 0, got {max_size}")
        if max_bytes < 0:
            raise ValueError(f"max_bytes must be >= 0, got {max_bytes}")
        self.max_size = max_size
        self.max_bytes = max_bytes
        self._entries: "OrderedDict[Tuple[int, ...], CacheEntry]" = OrderedDict()
        self._nbytes = 0  # sum of the entries' nbytes

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, tokens: Sequence[int]) -> bool:
        return tuple(tokens) in self._entries

    @property
    def nbytes(self) -> int:
        return self._nbytes

    def keys(self) -> List[Tuple[int, ...]]:
        """Stored token sequences, least recently used first."""
        return list(self._entries)

    def _reusable_length(self, key: Tuple[int, ...], entry: CacheEntry, tokens: Sequence[int]) -> int:
        """How many leading prompt tokens this entry can supply (0: none)."""
        common = common_prefix_length(key, tokens)
        if common == len(key) < len(tokens):
            return common  # a strict prefix: no trimming
        if not entry.trimmable:
            return 0
        return min(common, len(tokens) - 1)

    def fetch(self, tokens: Sequence[int]) -> FetchResult:
        """The best reusable entry for a prompt of `tokens` (see the module docstring)."""
        tokens = list(tokens)
        best_key, best_length = None, 0
        for key, entry in self._entries.items():
            length = self._reusable_length(key, entry, tokens)
            # On a tie prefer the entry needing no trim (the shorter key).
            if length > best_length or (length == best_length > 0 and len(key) < len(best_key)):
                best_key, best_length = key, length
        if best_key is None:
            return FetchResult(None, tokens, 0)
        self._entries.move_to_end(best_key)
        prompt_cache = copy_prompt_cache(self._entries[best_key].prompt_cache)
        trim_prompt_cache(prompt_cache, len(best_key) - best_length)
        return FetchResult(prompt_cache, tokens[best_length:], best_length)

    def insert(self, tokens: Sequence[int], prompt_cache: List[Any]) -> bool:
        """Store `prompt_cache`, which holds exactly `tokens`, taking ownership of it:
        the caller must not feed it again. A trimmable entry makes the stored entries at
        strict prefixes of its key redundant, so they are dropped. Returns False, storing
        nothing and dropping nothing, when the entry alone exceeds `max_bytes` or
        `max_size` is 0."""
        key = tuple(tokens)
        if not key:
            raise ValueError("cannot store a prompt cache for an empty token sequence")
        nbytes = sum(c.nbytes for c in prompt_cache)
        if nbytes > self.max_bytes or self.max_size == 0:
            return False
        trimmable = can_trim_prompt_cache(prompt_cache)
        if trimmable:
            for other in [k for k in self._entries if len(k) < len(key) and key[: len(k)] == k]:
                self._remove(other)
        if key in self._entries:
            self._remove(key)
        self._entries[key] = CacheEntry(prompt_cache, nbytes, trimmable)
        self._nbytes += nbytes
        self.trim_to(n_sequences=self.max_size, n_bytes=self.max_bytes)
        return True

    def _remove(self, key: Tuple[int, ...]) -> None:
        self._nbytes -= self._entries.pop(key).nbytes

    def trim_to(self, *, n_sequences: Optional[int] = None, n_bytes: Optional[int] = None) -> None:
        """Evict least recently used entries until at most `n_sequences` entries and
        `n_bytes` bytes remain."""
        while self._entries and (
            (n_sequences is not None and len(self._entries) > n_sequences)
            or (n_bytes is not None and self._nbytes > n_bytes)
        ):
            self._remove(next(iter(self._entries)))
