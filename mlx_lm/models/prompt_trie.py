"""Upstream's PromptTrie: values (prompt caches, in upstream's LRU) stored under token
sequences, one trie per model, and the search a prompt-cache store needs: the sequence
stored exactly, the longest stored prefix of a prompt, and the nearest stored sequence
that goes on past what it shares with the prompt.

Where upstream's differs: a stored one-token prefix counts as `shorter` (upstream skips
it), `longer` is always longer than the common prefix (upstream can return a stored
prefix of the prompt there), an exact match reports its length as `common_prefix`
(upstream 0), and popping prunes the emptied branches (upstream's pop_prefixes leaves
them, and a later search of such a branch fails).
"""

from collections import deque
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Sequence, Tuple

from .cache_base import int_list

_NO_VALUE = object()  # a node no sequence ends at (None is a value like any other)


class _Node:
    __slots__ = ("children", "value")

    def __init__(self):
        self.children: Dict[int, "_Node"] = {}
        self.value: Any = _NO_VALUE


@dataclass
class PromptTrieResult:
    """What `PromptTrie.search` found for a prompt (token lists, or None)."""

    model: Any
    exact: Optional[List[int]]  # the prompt itself, when a value is stored under it
    shorter: Optional[List[int]]  # the longest stored proper prefix of the prompt
    longer: Optional[List[int]]  # the shortest stored sequence past the common prefix
    common_prefix: int  # how many leading prompt tokens some stored path shares


class PromptTrie:
    def __init__(self):
        self._roots: Dict[Any, _Node] = {}

    def add(self, model: Any, tokens: Sequence[int], value: Any) -> Any:
        """Store `value` under `tokens`; returns the value it replaces (None if none)."""
        node = self._roots.setdefault(model, _Node())
        for token in int_list(tokens):
            node = node.children.setdefault(token, _Node())
        previous, node.value = node.value, value
        return None if previous is _NO_VALUE else previous

    def get(self, model: Any, tokens: Sequence[int]) -> Any:
        """The value stored under exactly `tokens` (KeyError if none)."""
        return self._stored_node(model, int_list(tokens))[-1].value

    def pop(self, model: Any, tokens: Sequence[int]) -> Any:
        """Remove and return the value stored under exactly `tokens` (KeyError if none)."""
        tokens = int_list(tokens)
        path = self._stored_node(model, tokens)
        value, path[-1].value = path[-1].value, _NO_VALUE
        self._prune(model, tokens, path)
        return value

    def pop_prefixes(self, model: Any, tokens: Sequence[int]) -> List[Tuple[int, Any]]:
        """Remove the values stored under proper prefixes of `tokens`; returns them as
        (prefix length, value), shortest first."""
        tokens = int_list(tokens)
        path = self._walk(model, tokens)
        popped = []
        for length, node in enumerate(path[: len(tokens)]):
            if node.value is not _NO_VALUE:
                popped.append((length, node.value))
                node.value = _NO_VALUE
        if path:
            self._prune(model, tokens, path)
        return popped

    def search(self, model: Any, tokens: Sequence[int]) -> PromptTrieResult:
        """The stored sequences nearest to `tokens` (see PromptTrieResult)."""
        tokens = int_list(tokens)
        path = self._walk(model, tokens)
        if not path:
            return PromptTrieResult(model, None, None, None, 0)
        shared = len(path) - 1
        if shared == len(tokens) and path[-1].value is not _NO_VALUE:
            return PromptTrieResult(model, tokens, None, None, shared)
        stored = [n for n in range(1, shared + 1) if path[n].value is not _NO_VALUE]
        shorter = tokens[: stored[-1]] if stored else None
        continuation = _nearest_value_below(path[-1]) if shared else None
        longer = None if continuation is None else tokens[:shared] + continuation
        return PromptTrieResult(model, None, shorter, longer, shared)

    def _walk(self, model: Any, tokens: List[int]) -> List[_Node]:
        """The nodes of tokens[:0], tokens[:1], ... as far as the trie holds them
        (empty when the model has no trie)."""
        node = self._roots.get(model)
        if node is None:
            return []
        path = [node]
        for token in tokens:
            node = node.children.get(token)
            if node is None:
                break
            path.append(node)
        return path

    def _stored_node(self, model: Any, tokens: List[int]) -> List[_Node]:
        """The path to the node of exactly `tokens`, which must hold a value."""
        path = self._walk(model, tokens)
        if len(path) != len(tokens) + 1 or path[-1].value is _NO_VALUE:
            raise KeyError(f"no value stored under these {len(tokens)} tokens for model {model!r}")
        return path

    def _prune(self, model: Any, tokens: List[int], path: List[_Node]) -> None:
        """Drop the nodes of `path` that no longer lead to any value, deepest first."""
        for depth in range(len(path) - 1, 0, -1):
            node = path[depth]
            if node.children or node.value is not _NO_VALUE:
                return
            del path[depth - 1].children[tokens[depth - 1]]
        if not path[0].children and path[0].value is _NO_VALUE:
            del self._roots[model]


def _nearest_value_below(node: _Node) -> Optional[List[int]]:
    """The shortest non-empty token path from `node` to a stored value (breadth first,
    so ties go to the branch added first); None when nothing is stored below."""
    queue = deque((child, [token]) for token, child in node.children.items())
    while queue:
        current, extra = queue.popleft()
        if current.value is not _NO_VALUE:
            return extra
        queue.extend((child, extra + [token]) for token, child in current.children.items())
    return None
