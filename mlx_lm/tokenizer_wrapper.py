"""TokenizerWrapper: a Hugging Face tokenizer plus what generation needs around it.

The wrapper adds the EOS ids that end generation, a streaming detokenizer per stream
(detokenizers.py), the chat template call with upstream's defaults, and the markers a
model's format writes: reasoning (``<think>`` ... ``</think>`` and the multi-token
forms of Gemma 4, Kimi K3's XTML and gpt-oss's Harmony), tool calls (the format comes
from tool_parsers/), and the message framing removed from an answer. Every other
attribute is read from and written to the wrapped tokenizer, so the wrapper stands in
for it. Names and behaviour are upstream mlx-lm 0.32.2's; ``mlx_lm.tokenizer_utils``
re-exports it, as upstream has it there.
"""

import inspect
from typing import Any, Callable, Dict, Iterable, List, Optional, Sequence, Set, Tuple, Union

from transformers import PreTrainedTokenizerBase

from . import tool_parsers
from .detokenizers import DetokenizerFactory, NaiveStreamingDetokenizer, StreamingDetokenizer

# Kimi K3's XTML vocabulary: all four, as upstream tells it (and tool_parsers).
_XTML_TOKENS = tool_parsers._XTML_TOKENS
# Reasoning markers: single tokens a vocabulary holds, or (Gemma 4, Kimi K3's XTML)
# a text that starts with such a token.
_THINK_TOKENS = [("<think>", "</think>"), ("<longcat_think>", "</longcat_think>"), ("<|think:start|>", "<|think:end|>")]
_THINK_TEXTS = [(("<|channel>", "<channel|>"), ("<|channel>thought", "<channel|>")),
                (_XTML_TOKENS, ("<|open|>think<|sep|>", "<|close|>think<|sep|>")),
                (tool_parsers.HARMONY_TOKENS, ("<|channel|>analysis<|message|>", "<|end|>"))]
# Message framing some formats write between the parts of an answer: removed from it.
_STRUCTURAL_MARKERS = [
    (_XTML_TOKENS,
     ("<|open|>response<|sep|>", "<|close|>response<|sep|>", "<|close|>message<|sep|>")),
    (tool_parsers.HARMONY_TOKENS,
     # "<|channel|>commentary" alone: the channel header of a call (tool_parsers/harmony.py)
     ("<|start|>assistant", "<|channel|>final<|message|>", "<|channel|>commentary<|message|>",
      "<|channel|>commentary", "<|end|>")),
]
_RESPONSE_FORMAT_KEYS = ("initial_state", "transitions")

TokenIds = Tuple[int, ...]
Transitions = Dict[str, List[Tuple[str, str]]]


def thinking_markers(vocabulary: Dict[str, int]) -> Optional[Tuple[str, str]]:
    """The (start, end) markers of a model's reasoning, from its vocabulary; None for
    a model that does not reason in marked text."""
    for start, end in _THINK_TOKENS:
        if start in vocabulary and end in vocabulary:
            return start, end
    for tokens, markers in _THINK_TEXTS:
        if all(t in vocabulary for t in tokens):
            return markers
    return None


def structural_markers(vocabulary: Dict[str, int]) -> Tuple[str, ...]:
    """The message framing a vocabulary's format writes inside an answer (or ())."""
    for tokens, markers in _STRUCTURAL_MARKERS:
        if all(t in vocabulary for t in tokens):
            return markers
    return ()


def find_sequence(tokens: Sequence[int], sequence: Sequence[int], start: Optional[int] = None,
                  end: Optional[int] = None, reverse: bool = False) -> int:
    """Index of the first (``reverse``: last) occurrence of ``sequence`` that lies wholly
    in ``tokens[start:end]``; -1 if none. ``start`` and ``end`` are clamped into the
    sequence (a negative ``start`` is 0, as the server's look-back windows need, not a
    position from the end); None means the whole of it."""
    start = 0 if start is None else min(max(start, 0), len(tokens))
    end = len(tokens) if end is None else min(max(end, 0), len(tokens))
    width = len(sequence)
    if width == 0:
        raise ValueError("find_sequence: the sequence to find is empty")
    positions = range(start, end - width + 1)
    for i in reversed(positions) if reverse else positions:
        if all(tokens[i + j] == sequence[j] for j in range(width)):
            return i
    return -1


def _as_id_set(token_ids: Union[int, Iterable[int], None]) -> Set[int]:
    """A new set (the caller's collection is never mutated), each id checked."""
    if token_ids is None:
        return set()
    ids = {token_ids} if isinstance(token_ids, int) else set(token_ids)
    for token_id in ids:
        if isinstance(token_id, bool) or not isinstance(token_id, int) or token_id < 0:
            raise ValueError(f"EOS token ids must be ints >= 0, got {token_id!r} in {token_ids!r}")
    return ids


def _checked_response_format(response_format: Optional[Dict[str, Any]]) -> Dict[str, Any]:
    """A chat format's states (upstream's RESPONSE_FORMAT): `initial_state` and
    `transitions` {state: [(marker, next state), ...]}, each checked."""
    if response_format is None:
        return {}
    if not isinstance(response_format, dict) or set(response_format) - set(_RESPONSE_FORMAT_KEYS):
        raise ValueError(f"response_format must be a dict with keys among {_RESPONSE_FORMAT_KEYS}, "
                         f"got {response_format!r}")
    initial = response_format.get("initial_state")
    if initial is not None and not isinstance(initial, str):
        raise ValueError(f"response_format initial_state must be a state name, got {initial!r}")
    transitions = response_format.get("transitions", {})
    if not isinstance(transitions, dict):
        raise ValueError(f"response_format transitions must be a dict of states, got {transitions!r}")
    checked: Transitions = {}
    for state, edges in transitions.items():
        checked[state] = [tuple(edge) for edge in edges]
        for edge in checked[state]:
            if len(edge) != 2 or not all(isinstance(part, str) and part for part in edge):
                raise ValueError(f"response_format transition {edge!r} of state {state!r} "
                                 "must be a (marker, next state) pair of non-empty strings")
    return {"initial_state": initial, "transitions": checked}


def _thinking_keyword(tokenizer: PreTrainedTokenizerBase) -> Tuple[str, bool]:
    """The keyword that switches reasoning in the tokenizer's template call, and whether
    the tokenizer renders chats with its own code: remote-code tokenizers override
    apply_chat_template, and some of them name the switch `thinking`."""
    renderer = getattr(type(tokenizer), "apply_chat_template", None)
    custom = renderer is not PreTrainedTokenizerBase.apply_chat_template
    if custom:
        try:
            parameters = inspect.signature(renderer).parameters
        except (TypeError, ValueError):  # a builtin or C-implemented renderer
            return "enable_thinking", custom
        if "thinking" in parameters and "enable_thinking" not in parameters:
            return "thinking", custom
    return "enable_thinking", custom


class TokenizerWrapper:
    """A Hugging Face tokenizer plus EOS ids, a chat template, a detokenizer and the
    markers of the model's format (module docstring).

    ``chat_template`` overrides the tokenizer's: a Jinja string, or (as upstream's
    Python chat templates) a function called like ``apply_chat_template`` that returns
    the text. ``eos_token_ids`` are added to the tokenizer's own EOS, as upstream does.
    """

    def __init__(
        self,
        tokenizer: PreTrainedTokenizerBase,
        detokenizer_class: DetokenizerFactory = NaiveStreamingDetokenizer,
        eos_token_ids: Union[int, Iterable[int], None] = None,
        chat_template: Union[str, Callable[..., str], None] = None,
        tool_call_start: Optional[str] = None,
        tool_call_end: Optional[str] = None,
        tool_parser: Optional[Callable[[str, Any], Any]] = None,
        response_format: Optional[Dict[str, Any]] = None,
    ) -> None:
        self._tokenizer = tokenizer
        self._detokenizer_class = detokenizer_class
        # Built on first use: the SPM/BPE tables cost O(vocab) to make.
        self._detokenizer_prototype: Optional[StreamingDetokenizer] = None
        self._chat_template = chat_template
        self._thinking_keyword, self._custom_renderer = _thinking_keyword(tokenizer)
        self._response_format = _checked_response_format(response_format)
        vocabulary = tokenizer.get_vocab()  # a fresh dict of the whole vocabulary: read once
        self._think = thinking_markers(vocabulary)
        self._think_tokens = self._think and tuple(self._marker_ids(m, vocabulary) for m in self._think)
        self._structural_markers = structural_markers(vocabulary)
        self._tool_call = None if tool_call_start is None else (tool_call_start, tool_call_end or "")
        # Tool-call markers are the ids their text encodes to, as upstream's (no vocabulary rule).
        self._tool_call_tokens = self._tool_call and tuple(
            tuple(tokenizer.encode(m, add_special_tokens=False)) for m in self._tool_call)
        self._tool_parser = tool_parser
        ids = _as_id_set(eos_token_ids)
        if tokenizer.eos_token_id is not None:
            ids.add(tokenizer.eos_token_id)
        self.eos_token_ids = ids

    def _marker_ids(self, marker: str, vocabulary: Dict[str, int]) -> TokenIds:
        # A reasoning marker that is one vocabulary entry is that id even where the
        # tokenizer would split its text (an entry that is not an added token), as upstream's.
        if marker in vocabulary:
            return (vocabulary[marker],)
        return tuple(self._tokenizer.encode(marker, add_special_tokens=False))

    @property
    def eos_token_ids(self) -> Set[int]:
        return self._eos_token_ids

    @eos_token_ids.setter
    def eos_token_ids(self, token_ids: Union[int, Iterable[int], None]) -> None:
        self._eos_token_ids = _as_id_set(token_ids)

    def add_eos_token(self, token: Union[int, str]) -> None:
        """Also stop at ``token``: an id, a string of digits (an id, as upstream reads
        it), or a token string in the vocabulary."""
        if isinstance(token, str) and token.isdigit():
            token = int(token)
        if isinstance(token, str):
            token_id = self._tokenizer.convert_tokens_to_ids(token)
            unknown = token_id is None or (
                token_id == self._tokenizer.unk_token_id and token != self._tokenizer.unk_token
            )
            if unknown:
                raise ValueError(f"EOS token {token!r} is not in the vocabulary")
        elif isinstance(token, int) and not isinstance(token, bool) and token >= 0:
            token_id = token
        else:
            raise ValueError(f"EOS token must be a token string or an id >= 0, got {token!r}")
        self._eos_token_ids.add(token_id)

    @property
    def detokenizer(self) -> StreamingDetokenizer:
        """A new, empty detokenizer (one per generation stream)."""
        if self._detokenizer_prototype is None:
            self._detokenizer_prototype = self._detokenizer_class(self._tokenizer)
        return self._detokenizer_prototype.new_stream()

    @property
    def has_chat_template(self) -> bool:
        return (self._chat_template is not None or self._tokenizer.chat_template is not None
                or self._custom_renderer)

    def apply_chat_template(self, *args: Any, tokenize: bool = True, **kwargs: Any):
        """Render a conversation with the override, or the tokenizer's template.

        Arguments are ``PreTrainedTokenizerBase.apply_chat_template``'s. Defaults to a
        list of ids (``tokenize=True, return_dict=False``) and, as upstream, to
        ``enable_thinking=has_thinking``: templates that can turn reasoning off (Qwen3's)
        get it on for models with reasoning markers, off otherwise. The switch is passed
        as ``thinking`` to a tokenizer whose own renderer names it so.
        """
        if self._thinking_keyword != "enable_thinking" and "enable_thinking" in kwargs:
            kwargs[self._thinking_keyword] = kwargs.pop("enable_thinking")
        kwargs.setdefault(self._thinking_keyword, self.has_thinking)
        if callable(self._chat_template):
            text = self._chat_template(*args, **kwargs)
            return self._tokenizer.encode(text, add_special_tokens=False) if tokenize else text
        kwargs.setdefault("return_dict", False)
        if self._chat_template is not None:
            kwargs.setdefault("chat_template", self._chat_template)
        return self._tokenizer.apply_chat_template(*args, tokenize=tokenize, **kwargs)

    @property
    def tokenizer(self) -> PreTrainedTokenizerBase:
        """The wrapped Hugging Face tokenizer."""
        return self._tokenizer

    # Reasoning and tool-call markers, as upstream names them (module docstring of
    # text_state_machine.py for how the server uses them).

    _find = staticmethod(find_sequence)

    def _think_marker_tokens(self, which: int, caller: str) -> TokenIds:
        if self._think_tokens is None:
            raise ValueError(f"{caller}: this tokenizer has no reasoning markers (has_thinking is False)")
        return self._think_tokens[which]

    def find_think_start(self, tokens: Sequence[int], start: Optional[int] = None,
                         end: Optional[int] = None) -> int:
        """First position of ``think_start_tokens`` in ``tokens[start:end]``, or -1."""
        return find_sequence(tokens, self._think_marker_tokens(0, "find_think_start"), start, end)

    def rfind_think_start(self, tokens: Sequence[int], start: Optional[int] = None,
                          end: Optional[int] = None) -> int:
        """Last position of ``think_start_tokens`` in ``tokens[start:end]``, or -1."""
        return find_sequence(tokens, self._think_marker_tokens(0, "rfind_think_start"), start, end, reverse=True)

    def find_think_end(self, tokens: Sequence[int], start: Optional[int] = None,
                       end: Optional[int] = None) -> int:
        """First position of ``think_end_tokens`` in ``tokens[start:end]``, or -1."""
        return find_sequence(tokens, self._think_marker_tokens(1, "find_think_end"), start, end)

    def rfind_think_end(self, tokens: Sequence[int], start: Optional[int] = None,
                        end: Optional[int] = None) -> int:
        """Last position of ``think_end_tokens`` in ``tokens[start:end]``, or -1."""
        return find_sequence(tokens, self._think_marker_tokens(1, "rfind_think_end"), start, end, reverse=True)

    @staticmethod
    def _single_id(tokens: Optional[TokenIds], marker: Optional[str]) -> Optional[int]:
        if tokens is not None and len(tokens) != 1:
            raise ValueError(f"the marker {marker!r} is {len(tokens)} tokens {tokens}, not one")
        return None if tokens is None else tokens[0]

    @property
    def has_thinking(self) -> bool:
        return self._think is not None

    @property
    def think_start(self) -> Optional[str]:
        return self._think and self._think[0]

    @property
    def think_end(self) -> Optional[str]:
        return self._think and self._think[1]

    @property
    def think_start_tokens(self) -> Optional[TokenIds]:
        return self._think_tokens and self._think_tokens[0]

    @property
    def think_end_tokens(self) -> Optional[TokenIds]:
        return self._think_tokens and self._think_tokens[1]

    @property
    def think_start_id(self) -> Optional[int]:
        return self._single_id(self.think_start_tokens, self.think_start)

    @property
    def think_end_id(self) -> Optional[int]:
        return self._single_id(self.think_end_tokens, self.think_end)

    @property
    def structural_markers(self) -> Tuple[str, ...]:
        return self._structural_markers

    @property
    def has_tool_calling(self) -> bool:
        return self._tool_call is not None

    @property
    def tool_call_start(self) -> Optional[str]:
        return self._tool_call and self._tool_call[0]

    @property
    def tool_call_end(self) -> Optional[str]:
        return self._tool_call and self._tool_call[1]

    @property
    def tool_call_start_tokens(self) -> Optional[TokenIds]:
        return self._tool_call_tokens and self._tool_call_tokens[0]

    @property
    def tool_call_end_tokens(self) -> Optional[TokenIds]:
        return self._tool_call_tokens and self._tool_call_tokens[1]

    @property
    def tool_parser(self) -> Optional[Callable[[str, Any], Any]]:
        """`parse_tool_call(text, tools)` of the model's format (tool_parsers/)."""
        return self._tool_parser

    @property
    def response_transitions(self) -> Transitions:
        """The chat format's own states {state: [(marker, next state)]}; {} for none."""
        return self._response_format.get("transitions", {})

    @property
    def response_initial_state(self) -> Optional[str]:
        """The state a response starts in under the chat format; None for the default."""
        return self._response_format.get("initial_state")

    def __len__(self) -> int:
        # Special methods bypass __getattr__, so len() is forwarded explicitly.
        return len(self._tokenizer)

    def __getattr__(self, name: str) -> Any:
        # Only called when normal lookup fails. Private names and the wrapper's own are
        # never forwarded: a property that fails reports its own name, and copying
        # (before __init__ has set _tokenizer) cannot recurse.
        if name.startswith("_") or name in _WRAPPER_NAMES:
            raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")
        return getattr(self._tokenizer, name)

    def __setattr__(self, name: str, value: Any) -> None:
        if name.startswith("_") or name in _WRAPPER_NAMES:
            object.__setattr__(self, name, value)
        else:
            setattr(self._tokenizer, name, value)


# Properties and methods of the wrapper itself are never forwarded.
_WRAPPER_NAMES = frozenset(vars(TokenizerWrapper))
