"""Streaming detokenizers: token ids in, text out, one token at a time.

Generation produces one token id at a time, and the text shown to a user must
grow with it. Decoding each token on its own is wrong in general: a multi-byte
UTF-8 character may be split across tokens, and SentencePiece decoders treat
the first piece specially. The detokenizers here turn a token stream into text
incrementally and never emit a partial character:

* :class:`NaiveStreamingDetokenizer` works with any tokenizer by re-decoding
  the tokens since the last newline.
* :class:`SPMStreamingDetokenizer` and :class:`BPEStreamingDetokenizer` map
  every id to bytes once, then only append bytes, so each token costs O(1).

:func:`detokenizer_class_for` picks one from the ``decoder`` of ``tokenizer.json``.
Every name here is also importable from ``mlx_lm.tokenizer_utils``, as upstream has them.
"""

import abc
import copy
import json
import re
from functools import partial
from pathlib import Path
from typing import Callable, Dict, List, Optional, Tuple

from transformers import PreTrainedTokenizerBase

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


class StreamingDetokenizer(abc.ABC):
    """Incremental token ids -> text, with upstream's protocol.

    ``reset()``, ``add_token(token)``, ``finalize()`` and three attributes: ``text``
    (all text so far; a property in some subclasses), ``tokens`` (the ids so far) and
    ``offset`` (how much of ``text`` ``last_segment`` has handed out). ``text`` never
    ends in a partial UTF-8 character before ``finalize()``. There is no ``__init__``
    here: a subclass builds its tables, then calls its own ``reset``, as upstream's do.
    """

    text: str
    tokens: List[int]
    offset: int

    @abc.abstractmethod
    def reset(self) -> None:
        """Forget all tokens and text, keeping the tables built from the tokenizer."""

    @abc.abstractmethod
    def add_token(self, token: int) -> None:
        """Consume one token id."""

    @abc.abstractmethod
    def finalize(self) -> None:
        """Flush held-back bytes; incomplete characters become U+FFFD."""

    def _reset_stream(self) -> None:
        self.tokens = []
        self.offset = 0

    @property
    def last_segment(self) -> str:
        """Text produced since the previous read; reading advances ``offset``."""
        text = self.text
        segment = text[self.offset :]
        self.offset = len(text)
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
        self.reset()

    def reset(self) -> None:
        self._reset_stream()
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

    def add_token(self, token: int) -> None:
        self.tokens.append(token)
        self._line_tokens.append(token)
        line_text = self._decode_line()
        if line_text.endswith("\n"):
            # A newline byte cannot sit inside a multi-byte character, so
            # everything before it is final.
            self._committed_text += line_text
            self._anchor_tokens = [token]
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
        self.reset()

    def reset(self) -> None:
        self._reset_stream()
        self.text = ""
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
        self.text += pending[:complete].decode("utf-8", errors="replace")
        self._pending = pending[complete:]

    def add_token(self, token: int) -> None:
        self.tokens.append(token)
        self._append_bytes(self._piece(token))

    def finalize(self) -> None:
        self.text += self._pending.decode("utf-8", errors="replace")
        self._pending = b""


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

    def add_token(self, token: int) -> None:
        self.tokens.append(token)
        piece = self._piece(token)
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
# Choosing one from tokenizer.json
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


def read_decoder(tokenizer_file: Path) -> Optional[dict]:
    if not tokenizer_file.is_file():
        return None
    with open(tokenizer_file, encoding="utf-8") as f:
        return json.load(f).get("decoder")
