"""Tokenizer wrapper and streaming detokenizers.

Generation produces one token id at a time, and the text shown to a user must
grow with it. Decoding each token on its own is wrong in general: a multi-byte
UTF-8 character may be split across tokens, and SentencePiece decoders treat
the first piece specially. The detokenizers here turn a token stream into text
incrementally and never emit a partial character:

* :class:`NaiveStreamingDetokenizer` works with any tokenizer by re-decoding
  the tokens since the last newline.
* :class:`SPMStreamingDetokenizer` and :class:`BPEStreamingDetokenizer` map
  every id to bytes once, then only append bytes, so each token costs O(1).

:func:`load` picks the right one from the ``decoder`` of ``tokenizer.json``.
"""

import copy
import json
import re
from functools import partial
from pathlib import Path
from typing import Any, Callable, Dict, Iterable, List, Optional, Set, Tuple, Union

from transformers import AutoTokenizer, PreTrainedTokenizerBase

from . import tool_parsers

REPLACEMENT_CHARACTER = "\ufffd"
SPM_SPACE = "\u2581"  # "▁", SentencePiece's marker for a space
_BYTE_PIECE = re.compile(r"<0x([0-9A-Fa-f]{2})>")


# ---------------------------------------------------------------------------
# UTF-8 and byte tables
# ---------------------------------------------------------------------------


def _utf8_sequence_length(lead_byte: int) -> int:
    """Bytes in the UTF-8 sequence starting with ``lead_byte``; 1 if invalid."""
    if lead_byte >= 0xF0:
        return 4 if lead_byte <= 0xF7 else 1
    if lead_byte >= 0xE0:
        return 3
    if lead_byte >= 0xC0:
        return 2
    return 1


def complete_utf8_prefix_length(data: bytes) -> int:
    """Length of the longest prefix of ``data`` that ends on a character boundary.

    Only a trailing, still-incomplete multi-byte sequence is excluded; invalid
    bytes elsewhere count as complete (they decode to U+FFFD and waiting for
    more bytes would not fix them).
    """
    # A UTF-8 sequence is at most 4 bytes, so its lead byte is among the last 4.
    for back in range(1, min(4, len(data)) + 1):
        byte = data[-back]
        if byte & 0xC0 != 0x80:  # not a continuation byte: a lead or ASCII
            if _utf8_sequence_length(byte) > back:
                return len(data) - back
            return len(data)
    return len(data)


def bytes_to_unicode() -> Dict[int, str]:
    """GPT-2's reversible byte -> printable character table.

    Printable Latin-1 bytes (``!``..``~``, ``¡``..``¬``, ``®``..``ÿ``) map to
    themselves; the remaining 68 bytes (controls, space, soft hyphen, ...) map
    in increasing order to ``chr(256 + n)``, so that byte-level BPE vocabularies
    never contain whitespace or control characters.
    """
    printable = (
        list(range(ord("!"), ord("~") + 1))
        + list(range(ord("¡"), ord("¬") + 1))
        + list(range(ord("®"), ord("ÿ") + 1))
    )
    table = {byte: chr(byte) for byte in printable}
    remapped = (byte for byte in range(256) if byte not in table)
    for n, byte in enumerate(remapped):
        table[byte] = chr(256 + n)
    return table


_UNICODE_TO_BYTE = {char: byte for byte, char in bytes_to_unicode().items()}


def _byte_level_piece_bytes(piece: str) -> bytes:
    """Bytes of a byte-level BPE vocabulary entry.

    Like the ``tokenizers`` ByteLevel decoder: a piece made only of table
    characters maps byte by byte, any other piece is taken as UTF-8 text.
    """
    try:
        return bytes(_UNICODE_TO_BYTE[char] for char in piece)
    except KeyError:
        return piece.encode("utf-8")


def _spm_piece_bytes(piece: str) -> bytes:
    """Bytes of a SentencePiece vocabulary entry (``<0xNN>`` is one raw byte)."""
    match = _BYTE_PIECE.fullmatch(piece)
    if match is not None:
        return bytes([int(match.group(1), 16)])
    return piece.replace(SPM_SPACE, " ").encode("utf-8")


def _piece_table(
    tokenizer: PreTrainedTokenizerBase, piece_bytes: Callable[[str], bytes]
) -> Tuple[bytes, ...]:
    """id -> bytes for the whole vocabulary; added tokens decode to their content."""
    vocab = tokenizer.get_vocab()
    added = tokenizer.get_added_vocab()
    table = [b""] * (max(vocab.values(), default=-1) + 1)
    for piece, token_id in vocab.items():
        if piece in added:
            table[token_id] = piece.encode("utf-8")
        else:
            table[token_id] = piece_bytes(piece)
    return tuple(table)


# ---------------------------------------------------------------------------
# Detokenizers
# ---------------------------------------------------------------------------


class StreamingDetokenizer:
    """Incremental token ids -> text.

    Protocol: ``reset()``, ``add_token(token_id)``, ``finalize()`` and the
    properties ``text`` (all text so far), ``tokens`` (ids so far) and
    ``last_segment`` (text since the previous read of ``last_segment``).
    ``text`` never ends in a partial UTF-8 character before ``finalize()``.
    """

    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        """Forget all tokens and text."""
        self._tokens: List[int] = []
        self._read_offset = 0

    def add_token(self, token_id: int) -> None:
        raise NotImplementedError(f"{type(self).__name__} must define add_token")

    def finalize(self) -> None:
        """Flush held-back bytes; incomplete characters become U+FFFD."""
        raise NotImplementedError(f"{type(self).__name__} must define finalize")

    @property
    def text(self) -> str:
        raise NotImplementedError(f"{type(self).__name__} must define text")

    @property
    def tokens(self) -> List[int]:
        return self._tokens

    @property
    def last_segment(self) -> str:
        """Text produced since the previous read; reading advances the read point."""
        text = self.text
        segment = text[self._read_offset :]
        self._read_offset = len(text)
        return segment

    def new_stream(self) -> "StreamingDetokenizer":
        """A fresh, reset detokenizer sharing this one's read-only tables."""
        fresh = copy.copy(self)
        fresh.reset()
        return fresh


class NaiveStreamingDetokenizer(StreamingDetokenizer):
    """Works with any tokenizer by re-decoding the tokens of the current line.

    Tokens are committed whenever their decoded text ends in a newline, so the
    cost per token is O(line length). The current line is decoded after the
    last committed token and that token's own text is cut off again: decoders
    that strip a leading space (SentencePiece) would otherwise eat the first
    space of every line.
    """

    def __init__(self, tokenizer: PreTrainedTokenizerBase) -> None:
        self._tokenizer = tokenizer
        super().__init__()

    def reset(self) -> None:
        super().reset()
        self._committed_text = ""
        self._anchor_tokens: List[int] = []
        self._anchor_text = ""
        self._line_tokens: List[int] = []
        self._line_text = ""
        self._visible_line_text = ""

    def _decode_line(self) -> str:
        decoded = self._tokenizer.decode(self._anchor_tokens + self._line_tokens)
        if decoded.startswith(self._anchor_text):
            return decoded[len(self._anchor_text) :]
        return self._tokenizer.decode(self._line_tokens)

    def add_token(self, token_id: int) -> None:
        self._tokens.append(token_id)
        self._line_tokens.append(token_id)
        line_text = self._decode_line()
        if line_text.endswith("\n"):
            # A newline byte cannot sit inside a multi-byte character, so
            # everything before it is final.
            self._committed_text += line_text
            self._anchor_tokens = [token_id]
            self._anchor_text = self._tokenizer.decode(self._anchor_tokens)
            self._line_tokens = []
            self._line_text = ""
            self._visible_line_text = ""
        else:
            self._line_text = line_text
            self._update_visible_line_text()

    def _update_visible_line_text(self) -> None:
        # Decoders render an incomplete trailing character as U+FFFD, and a
        # ByteFallback decoder turns a whole run of byte tokens into U+FFFDs
        # while its last character is incomplete, hiding already shown
        # characters. So show the line only up to its trailing U+FFFDs, and
        # never less than before: the next tokens or finalize() settle it.
        candidate = self._line_text.rstrip(REPLACEMENT_CHARACTER)
        if candidate.startswith(self._visible_line_text):
            self._visible_line_text = candidate

    def finalize(self) -> None:
        self._committed_text += self._line_text
        self._line_tokens = []
        self._line_text = ""
        self._visible_line_text = ""

    @property
    def text(self) -> str:
        return self._committed_text + self._visible_line_text


class _ByteStreamingDetokenizer(StreamingDetokenizer):
    """Shared machinery: id -> bytes table, byte buffer, complete-UTF-8 output."""

    def __init__(self, piece_table: Tuple[bytes, ...]) -> None:
        self._piece_table = piece_table
        super().__init__()

    def reset(self) -> None:
        super().reset()
        self._text = ""
        self._pending = b""

    def _piece(self, token_id: int) -> bytes:
        # Models often pad the embedding past the tokenizer's vocabulary;
        # tokenizer.decode renders such ids as nothing, and so do we.
        if 0 <= token_id < len(self._piece_table):
            return self._piece_table[token_id]
        return b""

    def _append_bytes(self, data: bytes) -> None:
        pending = self._pending + data
        complete = complete_utf8_prefix_length(pending)
        self._text += pending[:complete].decode("utf-8", errors="replace")
        self._pending = pending[complete:]

    def add_token(self, token_id: int) -> None:
        self._tokens.append(token_id)
        self._append_bytes(self._piece(token_id))

    def finalize(self) -> None:
        self._text += self._pending.decode("utf-8", errors="replace")
        self._pending = b""

    @property
    def text(self) -> str:
        return self._text


class SPMStreamingDetokenizer(_ByteStreamingDetokenizer):
    """For SentencePiece vocabularies: ``▁`` is a space, ``<0xNN>`` a raw byte.

    With ``trim_space`` the first space of the text is dropped, as the
    ``Strip`` step of a Llama style decoder does.
    """

    def __init__(
        self, tokenizer: PreTrainedTokenizerBase, trim_space: bool = True
    ) -> None:
        self.trim_space = trim_space
        super().__init__(_piece_table(tokenizer, _spm_piece_bytes))

    def reset(self) -> None:
        super().reset()
        self._at_start = True

    def add_token(self, token_id: int) -> None:
        self._tokens.append(token_id)
        piece = self._piece(token_id)
        if self._at_start and piece:
            self._at_start = False
            if self.trim_space and piece.startswith(b" "):
                piece = piece[1:]
        self._append_bytes(piece)


class BPEStreamingDetokenizer(_ByteStreamingDetokenizer):
    """For byte-level BPE vocabularies (GPT-2 style, see :func:`bytes_to_unicode`)."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase) -> None:
        super().__init__(_piece_table(tokenizer, _byte_level_piece_bytes))


DetokenizerFactory = Callable[[PreTrainedTokenizerBase], StreamingDetokenizer]


# ---------------------------------------------------------------------------
# Wrapper
# ---------------------------------------------------------------------------


def _as_id_set(token_ids: Union[int, Iterable[int], None]) -> Optional[Set[int]]:
    # A copy, so add_eos_token never mutates the caller's collection.
    if token_ids is None:
        return None
    if isinstance(token_ids, int):
        return {token_ids}
    return set(token_ids)


class TokenizerWrapper:
    """A Hugging Face tokenizer plus EOS ids, a chat template and a detokenizer.

    Attributes that the wrapper does not define are read from and written to
    the wrapped tokenizer, so it can stand in for it.
    """

    def __init__(
        self,
        tokenizer: PreTrainedTokenizerBase,
        detokenizer_class: DetokenizerFactory = NaiveStreamingDetokenizer,
        eos_token_ids: Union[int, Iterable[int], None] = None,
        chat_template: Optional[str] = None,
        tool_call_start: Optional[str] = None,
        tool_call_end: Optional[str] = None,
        tool_parser: Optional[Callable[[str, Any], Any]] = None,
    ) -> None:
        self._tokenizer = tokenizer
        self._detokenizer_class = detokenizer_class
        # Built on first use: the SPM/BPE tables cost O(vocab) to make.
        self._detokenizer_prototype: Optional[StreamingDetokenizer] = None
        self._chat_template = chat_template
        vocabulary = tokenizer.get_vocab()  # a fresh dict of the whole vocabulary: read once
        self._think = thinking_markers(vocabulary)
        self._structural_markers = structural_markers(vocabulary)
        self._tool_call = None if tool_call_start is None else (tool_call_start, tool_call_end or "")
        self._tool_parser = tool_parser
        ids = _as_id_set(eos_token_ids)
        if ids is None:
            default = tokenizer.eos_token_id
            ids = set() if default is None else {default}
        self.eos_token_ids = ids

    def add_eos_token(self, token: Union[int, str]) -> None:
        """Also stop at ``token`` (an id, or a token string in the vocabulary)."""
        if isinstance(token, str):
            token_id = self._tokenizer.convert_tokens_to_ids(token)
            unknown = token_id is None or (
                token_id == self._tokenizer.unk_token_id
                and token != self._tokenizer.unk_token
            )
            if unknown:
                raise ValueError(f"EOS token {token!r} is not in the vocabulary")
        elif isinstance(token, int) and not isinstance(token, bool) and token >= 0:
            token_id = token
        else:
            raise ValueError(
                f"EOS token must be a token string or an id >= 0, got {token!r}"
            )
        self.eos_token_ids.add(token_id)

    @property
    def detokenizer(self) -> StreamingDetokenizer:
        """A new, empty detokenizer (one per generation stream)."""
        if self._detokenizer_prototype is None:
            self._detokenizer_prototype = self._detokenizer_class(self._tokenizer)
        return self._detokenizer_prototype.new_stream()

    @property
    def has_chat_template(self) -> bool:
        return (
            self._chat_template is not None
            or self._tokenizer.chat_template is not None
        )

    def apply_chat_template(self, messages: List[Dict[str, Any]], **kwargs: Any):
        """Render ``messages`` with the tokenizer's (or the override) template.

        Defaults to ``tokenize=True, return_dict=False``, i.e. a list of ids, and, as
        upstream, ``enable_thinking=has_thinking``: templates that can turn reasoning
        off (Qwen3's) get it on for models with reasoning markers, off otherwise.
        """
        kwargs.setdefault("tokenize", True)
        kwargs.setdefault("return_dict", False)
        kwargs.setdefault("enable_thinking", self.has_thinking)
        if self._chat_template is not None:
            kwargs.setdefault("chat_template", self._chat_template)
        return self._tokenizer.apply_chat_template(messages, **kwargs)

    @property
    def tokenizer(self) -> PreTrainedTokenizerBase:
        """The wrapped Hugging Face tokenizer."""
        return self._tokenizer

    # Reasoning and tool-call markers, as upstream names them (module docstring of
    # text_state_machine.py for how the server uses them).

    def _ids(self, text: Optional[str]) -> Optional[Tuple[int, ...]]:
        return None if text is None else tuple(self._tokenizer.encode(text, add_special_tokens=False))

    def _single_id(self, text: Optional[str]) -> Optional[int]:
        ids = self._ids(text)
        if ids is not None and len(ids) != 1:
            raise ValueError(f"the marker {text!r} is {len(ids)} tokens, not one")
        return None if ids is None else ids[0]

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
    def think_start_tokens(self) -> Optional[Tuple[int, ...]]:
        return self._ids(self.think_start)

    @property
    def think_end_tokens(self) -> Optional[Tuple[int, ...]]:
        return self._ids(self.think_end)

    @property
    def think_start_id(self) -> Optional[int]:
        return self._single_id(self.think_start)

    @property
    def think_end_id(self) -> Optional[int]:
        return self._single_id(self.think_end)

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
    def tool_call_start_tokens(self) -> Optional[Tuple[int, ...]]:
        return self._ids(self.tool_call_start)

    @property
    def tool_call_end_tokens(self) -> Optional[Tuple[int, ...]]:
        return self._ids(self.tool_call_end)

    @property
    def tool_parser(self) -> Optional[Callable[[str, Any], Any]]:
        """`parse_tool_call(text, tools)` of the model's format (tool_parsers/)."""
        return self._tool_parser

    def __getattr__(self, name: str) -> Any:
        # Only called when normal lookup fails. Reading through __dict__ avoids
        # infinite recursion before __init__ has set _tokenizer (e.g. copying).
        tokenizer = self.__dict__.get("_tokenizer")
        if tokenizer is None:
            raise AttributeError(name)
        return getattr(tokenizer, name)

    def __setattr__(self, name: str, value: Any) -> None:
        if name.startswith("_") or name == "eos_token_ids" or name in _WRAPPER_NAMES:
            object.__setattr__(self, name, value)
        else:
            setattr(self._tokenizer, name, value)


# Properties and methods of the wrapper itself are never forwarded on assignment.
_WRAPPER_NAMES = frozenset(vars(TokenizerWrapper))


# ---------------------------------------------------------------------------
# Loading
# ---------------------------------------------------------------------------


def _is_spm_decoder(steps: List[dict], with_strip: bool) -> bool:
    """Whether ``steps`` is Replace(▁ -> ' '), ByteFallback, Fuse[, Strip(' ', 1, 0)]."""
    expected = ["Replace", "ByteFallback", "Fuse"] + (["Strip"] if with_strip else [])
    if [step.get("type") for step in steps] != expected:
        return False
    replace = steps[0]
    if replace.get("pattern") != {"String": SPM_SPACE} or replace.get("content") != " ":
        return False
    if with_strip:
        strip = steps[3]
        return (strip.get("content"), strip.get("start"), strip.get("stop")) == (
            " ",
            1,
            0,
        )
    return True


def detokenizer_class_for(decoder: Optional[dict]) -> DetokenizerFactory:
    """Pick the streaming detokenizer for a ``tokenizer.json`` ``decoder`` entry."""
    if decoder is None:
        return NaiveStreamingDetokenizer
    if decoder.get("type") == "ByteLevel":
        return BPEStreamingDetokenizer
    if decoder.get("type") == "Sequence":
        steps = decoder.get("decoders") or []
        if any(step.get("type") == "ByteLevel" for step in steps):
            return BPEStreamingDetokenizer
        if _is_spm_decoder(steps, with_strip=True):
            return partial(SPMStreamingDetokenizer, trim_space=True)
        if _is_spm_decoder(steps, with_strip=False):
            return partial(SPMStreamingDetokenizer, trim_space=False)
    return NaiveStreamingDetokenizer


def _read_decoder(tokenizer_file: Path) -> Optional[dict]:
    if not tokenizer_file.is_file():
        return None
    with open(tokenizer_file, encoding="utf-8") as f:
        return json.load(f).get("decoder")


def load(
    model_path: Path,
    tokenizer_config_extra: Optional[Dict[str, Any]] = None,
    eos_token_ids: Union[List[int], int, None] = None,
) -> TokenizerWrapper:
    """Load the tokenizer in ``model_path`` and wrap it.

    Args:
        model_path: local directory with the tokenizer files.
        tokenizer_config_extra: keyword arguments for
            ``AutoTokenizer.from_pretrained``.
        eos_token_ids: ids that end generation; default: the tokenizer's EOS.

    Raises:
        FileNotFoundError: ``model_path`` is not a directory.
        ValueError: no tokenizer could be loaded from it.
    """
    model_path = Path(model_path)
    if not model_path.is_dir():
        raise FileNotFoundError(f"tokenizer directory {model_path} does not exist")
    try:
        tokenizer = AutoTokenizer.from_pretrained(
            model_path, **(tokenizer_config_extra or {})
        )
    # `tokenizers` reports a malformed tokenizer.json as a bare Exception, so
    # nothing narrower catches every way a directory can fail to load.
    except Exception as error:
        raise ValueError(
            f"could not load a tokenizer from {model_path} (expected tokenizer.json "
            f"or tokenizer.model with tokenizer_config.json): {error}"
        ) from error
    detokenizer_class = detokenizer_class_for(
        _read_decoder(model_path / "tokenizer.json")
    )
    return _wrap(tokenizer, detokenizer_class, _as_id_set(eos_token_ids), _model_type(model_path))


def _wrap(
    tokenizer: PreTrainedTokenizerBase,
    detokenizer_class: DetokenizerFactory,
    eos_token_ids: Optional[Set[int]],
    model_type: Optional[str],
) -> TokenizerWrapper:
    tool_format = _tool_format(tokenizer, model_type)
    return TokenizerWrapper(
        tokenizer,
        detokenizer_class,
        eos_token_ids=eos_token_ids,
        tool_call_start=tool_format and tool_format.tool_call_start,
        tool_call_end=tool_format and tool_format.tool_call_end,
        tool_parser=tool_format and tool_format.parse_tool_call,
    )


# Reasoning markers: single tokens a vocabulary holds, or (Gemma 4, Kimi K3's XTML)
# a text that starts with such a token.
_THINK_TOKENS = [("<think>", "</think>"), ("<longcat_think>", "</longcat_think>"), ("<|think:start|>", "<|think:end|>")]
_THINK_TEXTS = [(("<|channel>", "<channel|>"), ("<|channel>thought", "<channel|>")),
                (("<|open|>", "<|close|>", "<|sep|>"), ("<|open|>think<|sep|>", "<|close|>think<|sep|>")),
                (tool_parsers.HARMONY_TOKENS, ("<|channel|>analysis<|message|>", "<|end|>"))]
# Message framing some formats write between the parts of an answer: removed from it.
_STRUCTURAL_MARKERS = [
    (("<|open|>", "<|close|>", "<|sep|>"),
     ("<|open|>response<|sep|>", "<|close|>response<|sep|>", "<|close|>message<|sep|>")),
    (tool_parsers.HARMONY_TOKENS,
     # "<|channel|>commentary" alone: the channel header of a call (tool_parsers/harmony.py)
     ("<|start|>assistant", "<|channel|>final<|message|>", "<|channel|>commentary<|message|>",
      "<|channel|>commentary", "<|end|>")),
]


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


def _model_type(model_path: Path) -> Optional[str]:
    try:
        with open(model_path / "config.json", encoding="utf-8") as f:
            model_type = json.load(f).get("model_type")
    except (OSError, ValueError, AttributeError):
        return None
    return model_type if isinstance(model_type, str) else None


def _tool_format(tokenizer: PreTrainedTokenizerBase, model_type: Optional[str]):
    """The tool_parsers module of a tokenizer: as its tokenizer_config.json names it
    (`tool_parser_type`), else as its chat template's markers or its vocabulary and
    family imply; None if nothing does."""
    name = tokenizer.init_kwargs.get("tool_parser_type")
    if name is None:
        name = tool_parsers.parser_for_template(tokenizer.chat_template)
    if name is None:
        name = tool_parsers.parser_for_model(tokenizer.get_vocab(), model_type)
    return None if name is None else tool_parsers.load_parser(name)


def with_chat_template(wrapper: TokenizerWrapper, chat_template: str,
                       model_type: Optional[str] = None) -> TokenizerWrapper:
    """`wrapper`'s tokenizer rendering with `chat_template` (the server's
    --chat-template), and the tool-call format read again from it: a template may
    write another format than the checkpoint's own (tool_parser_type still wins)."""
    wrapper.tokenizer.chat_template = chat_template
    return _wrap(wrapper.tokenizer, wrapper._detokenizer_class, wrapper.eos_token_ids, model_type)
