"""A least-recently-used store of prompt caches keyed by the tokens they hold.

The server keeps one of these per served model. An entry is a model's cache list (for
speculation: the target's entries followed by the draft's) together with the exact
token sequence it has consumed. `fetch(tokens)` finds the entry sharing the longest
prefix with a new prompt and returns a private copy of it plus the tokens still to feed:

- an entry whose key is a strict prefix of the prompt is used as is;
- an entry that is longer than the prompt or diverges from it is used if every one of
  its cache entries is trimmable (`can_trim_prompt_cache`): the copy is trimmed back to
  the common prefix;
- else, if it is a CheckpointedCache (models/checkpoints.py), from its nearest snapshot
  at or before the common prefix (one cut at the prompt's message boundaries, when the
  caller gives them): its recurrent states and wrapped sliding windows come
  from the snapshot, its KV entries are trimmed to it, and the prompt is fed from
  there, exactly as a cold run feeds it. Without one, recurrent states (ArraysCache)
  and wrapped sliding windows cannot give tokens back outside speculation, so for them
  only strict prefixes count (upstream mlx-lm issue #980); the server therefore also
  stores such a cache at the end of each prompt, before generation.
- At least one prompt token is always left to feed, because generation starts from the
  logits of the last prompt token: an exact hit on a trimmable entry is trimmed by one,
  and an exact hit on an untrimmable one is not used (or resumes at a snapshot).

`checkpointed(cache, prefill_step_size)` makes a fresh cache keep snapshots, within
`checkpoint_share` of the byte budget each; the prefill loops take them
(checkpoints.maybe_snapshot). Bytes count the snapshots once however many entries share
them (a copy keeps its source's); over budget, the least recently used entry first loses
its snapshots (it still serves strict-prefix and trimmable hits), then itself.

Copies share the stored arrays instead of duplicating them. That is safe because MLX
arrays are values: a cache writing `keys[..., a:b, :] = ...` replaces the array held by
its own attribute (a shared buffer is copied on that first write, not mutated), and a
copy never holds the same Python array objects as the stored entry (`state` returns
fresh slices). The stored entries themselves are never fed again.

Not thread-safe: the server touches it from its single generation thread only.
"""

from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Sequence, Tuple

from .cache import can_trim_prompt_cache, trim_prompt_cache
from .cache_base import LATE_NAMES
from .checkpoints import CheckpointedCache, Snapshot, always_trimmable, check_message_boundaries, copy_entry

# Upstream's cache types (LRUPromptCache.insert_cache), which stats_by_type reports.
CACHE_TYPES = ("assistant", "user", "system")


def copy_prompt_cache(prompt_cache: List[Any]) -> List[Any]:
    """A cache list holding the same tokens whose entries can be fed independently of
    the original's; rebuilt through each class's `from_state` (CacheList recurses). A
    CheckpointedCache's copy shares its snapshots."""
    if isinstance(prompt_cache, CheckpointedCache):
        return prompt_cache.copy_at(prompt_cache.held_tokens())
    return [copy_entry(c) for c in prompt_cache]


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
    nbytes: int  # of its cache entries (snapshots: LRUPromptCache._snapshot_users)
    trimmable: bool
    cache_type: str = "assistant"

    def snapshots(self) -> List[Snapshot]:
        cache = self.prompt_cache
        return list(cache.snapshots.values()) if isinstance(cache, CheckpointedCache) else []


@dataclass
class FetchResult:
    """`prompt_cache`: a private copy holding `tokens[:num_cached]`, or None (start
    fresh); `remaining`: the tokens still to feed (never empty)."""

    prompt_cache: Optional[List[Any]]
    remaining: List[int]
    num_cached: int


_NO_MODEL = object()


class LRUPromptCache:
    """At most `max_size` entries and `max_bytes` bytes of caches and their snapshots;
    the least recently inserted or fetched entry is evicted first, and an entry larger
    than `max_bytes` on its own is not stored (it would evict everything else and then
    itself). A cache's snapshots may take `checkpoint_share` of `max_bytes`. Entries
    are searched linearly: a server keeps a handful, and one pass over each key is
    cheap next to one forward."""

    def __init__(self, max_size: int = 10, max_bytes: int = 1 << 63, *, checkpoint_share: float = 0.5):
        if max_size < 0:
            raise ValueError(f"max_size must be >= 0, got {max_size}")
        if max_bytes < 0:
            raise ValueError(f"max_bytes must be >= 0, got {max_bytes}")
        if not 0 <= checkpoint_share <= 1:
            raise ValueError(f"checkpoint_share must be within [0, 1], got {checkpoint_share}")
        self.max_size = max_size
        self.max_bytes = max_bytes
        self.checkpoint_share = checkpoint_share
        self._entries: "OrderedDict[Tuple[int, ...], CacheEntry]" = OrderedDict()
        self._nbytes = 0  # the entries' nbytes plus each held snapshot's once
        self._snapshot_users: Dict[int, List[Any]] = {}  # id(snapshot) -> [snapshot, entries holding it]
        self._model = _NO_MODEL  # the model key upstream's method names were given

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, tokens: Sequence[int]) -> bool:
        return tuple(tokens) in self._entries

    @property
    def nbytes(self) -> int:
        return self._nbytes

    @property
    def checkpoint_bytes(self) -> int:
        """What the snapshots of one cache may take."""
        return int(self.max_bytes * self.checkpoint_share)

    def keys(self) -> List[Tuple[int, ...]]:
        """Stored token sequences, least recently used first."""
        return list(self._entries)

    def checkpointed(self, prompt_cache: List[Any], prefill_step_size: int, *,
                     message_boundaries: Sequence[int] = ()) -> List[Any]:
        """An empty cache list as a CheckpointedCache for prefills in steps of
        `prefill_step_size` (the prefill's own), within checkpoint_bytes, to be fed a
        prompt with these message boundaries; as it is where every entry trims anyway
        or nothing would be stored."""
        if self.max_size == 0 or self.checkpoint_bytes == 0 or all(always_trimmable(c) for c in prompt_cache):
            return prompt_cache
        if isinstance(prompt_cache, CheckpointedCache) or not all(
            c.empty() for c in prompt_cache if not always_trimmable(c)
        ):
            raise ValueError("checkpointed() takes a fresh cache list (make_prompt_cache): it counts from its first token")
        checkpointed = CheckpointedCache(prompt_cache, prefill_step_size, self.checkpoint_bytes)
        checkpointed.set_message_boundaries(message_boundaries)
        return checkpointed

    def _reusable_length(self, key: Tuple[int, ...], entry: CacheEntry, tokens: Sequence[int],
                         message_boundaries: Sequence[int]) -> int:
        """How many leading prompt tokens this entry can supply (0: none)."""
        common = common_prefix_length(key, tokens)
        if common == len(key) < len(tokens):
            return common  # a strict prefix: no trimming
        limit = min(common, len(tokens) - 1)
        if entry.trimmable:
            return limit
        if isinstance(entry.prompt_cache, CheckpointedCache):
            return entry.prompt_cache.nearest(limit, message_boundaries) or 0
        return 0

    def fetch(self, tokens: Sequence[int], *, message_boundaries: Sequence[int] = ()) -> FetchResult:
        """The best reusable entry for a prompt of `tokens` (see the module docstring)
        whose `message_boundaries` (token positions, models/checkpoints.py) the copy
        is then told of."""
        tokens = list(tokens)
        message_boundaries = check_message_boundaries(message_boundaries)
        best_key, best_length = None, 0
        for key, entry in self._entries.items():
            length = self._reusable_length(key, entry, tokens, message_boundaries)
            # On a tie prefer the entry needing no trim (the shorter key).
            if length > best_length or (length == best_length > 0 and len(key) < len(best_key)):
                best_key, best_length = key, length
        if best_key is None:
            return FetchResult(None, tokens, 0)
        self._entries.move_to_end(best_key)
        entry = self._entries[best_key]
        if best_length < len(best_key) and not entry.trimmable:
            prompt_cache = entry.prompt_cache.copy_at(best_length)  # from a snapshot
        else:
            prompt_cache = copy_prompt_cache(entry.prompt_cache)
            trim_prompt_cache(prompt_cache, len(best_key) - best_length)
        if isinstance(prompt_cache, CheckpointedCache):
            prompt_cache.set_message_boundaries(message_boundaries)
        return FetchResult(prompt_cache, tokens[best_length:], best_length)

    def insert(self, tokens: Sequence[int], prompt_cache: List[Any], *, cache_type: str = "assistant") -> bool:
        """Store `prompt_cache`, which holds exactly `tokens`, taking ownership of it:
        the caller must not feed it again. A trimmable entry makes the stored entries at
        strict prefixes of its key redundant, so they are dropped. Returns False, storing
        nothing and dropping nothing, when the entry alone exceeds `max_bytes` or
        `max_size` is 0."""
        key = tuple(tokens)
        if not key:
            raise ValueError("cannot store a prompt cache for an empty token sequence")
        if cache_type not in CACHE_TYPES:
            raise ValueError(f"cache_type must be one of {', '.join(CACHE_TYPES)}, got {cache_type!r}")
        if isinstance(prompt_cache, CheckpointedCache):
            prompt_cache.count_as(len(key))
        nbytes = sum(c.nbytes for c in prompt_cache)
        if nbytes > self.max_bytes or self.max_size == 0:
            return False
        trimmable = can_trim_prompt_cache(prompt_cache)
        if trimmable:
            for other in [k for k in self._entries if len(k) < len(key) and key[: len(k)] == k]:
                self._remove(other)
        if key in self._entries:
            self._remove(key)
        self._entries[key] = entry = CacheEntry(prompt_cache, nbytes, trimmable, cache_type)
        self._nbytes += nbytes
        self._hold(entry.snapshots())
        self.trim_to(n_sequences=self.max_size, n_bytes=self.max_bytes)
        return True

    def _hold(self, snapshots: List[Snapshot]) -> None:
        for snapshot in snapshots:
            users = self._snapshot_users.setdefault(id(snapshot), [snapshot, 0])
            self._nbytes += snapshot.nbytes if users[1] == 0 else 0
            users[1] += 1

    def _release(self, snapshots: List[Snapshot]) -> None:
        for snapshot in snapshots:
            users = self._snapshot_users[id(snapshot)]
            users[1] -= 1
            if users[1] == 0:
                del self._snapshot_users[id(snapshot)]
                self._nbytes -= snapshot.nbytes

    def _remove(self, key: Tuple[int, ...]) -> None:
        entry = self._entries.pop(key)
        self._nbytes -= entry.nbytes
        self._release(entry.snapshots())

    def _drop_snapshots(self, entry: CacheEntry) -> None:
        self._release(entry.snapshots())
        entry.prompt_cache.snapshots = {}

    def trim_to(self, *, n_sequences: Optional[int] = None, n_bytes: Optional[int] = None) -> None:
        """Evict least recently used entries until at most `n_sequences` entries and
        `n_bytes` bytes remain; over bytes, an entry first loses its snapshots."""
        while n_sequences is not None and len(self._entries) > max(n_sequences, 0):
            self._remove(next(iter(self._entries)))
        while self._entries and n_bytes is not None and self._nbytes > n_bytes:
            oldest = next(iter(self._entries.values()))
            if oldest.snapshots():
                self._drop_snapshots(oldest)
            else:
                self._remove(next(iter(self._entries)))

    # Upstream's method names (its LRUPromptCache keys entries by model too).

    def _check_model(self, model: Any) -> None:
        if self._model is _NO_MODEL:
            self._model = model
        elif model != self._model:
            raise ValueError(f"this LRUPromptCache holds caches of model {self._model!r}, not {model!r}: "
                             "keep one LRUPromptCache per model")

    def fetch_nearest_cache(self, model: Any, tokens: Sequence[int]) -> Tuple[Optional[List[Any]], List[int]]:
        """fetch() as upstream names it: (a private copy or None, the tokens still to
        feed). Unlike upstream's, an exact hit leaves its last token to feed, as every
        hit here does: generation starts from that token's logits."""
        self._check_model(model)
        got = self.fetch(tokens)
        return got.prompt_cache, got.remaining

    def insert_cache(self, model: Any, tokens: Sequence[int], prompt_cache: List[Any], *,
                     cache_type: str = "assistant") -> None:
        """insert() as upstream names it; `cache_type` is only counted (stats_by_type):
        eviction here is least recently used whatever the type."""
        self._check_model(model)
        self.insert(tokens, prompt_cache, cache_type=cache_type)

    def stats_by_type(self) -> Dict[str, Dict[str, int]]:
        """Per cache type: {"n_sequences", "n_bytes"} (an entry's bytes with its
        snapshots'; a snapshot two entries share counts in both)."""
        stats = {t: {"n_sequences": 0, "n_bytes": 0} for t in CACHE_TYPES}
        for entry in self._entries.values():
            stats[entry.cache_type]["n_sequences"] += 1
            stats[entry.cache_type]["n_bytes"] += entry.nbytes + sum(s.nbytes for s in entry.snapshots())
        return stats


LATE_NAMES["LRUPromptCache"] = LRUPromptCache  # upstream's `from mlx_lm.models.cache import LRUPromptCache`
