"""Streaming detokenizers: byte tables, exact streaming, the protocol, the choice.

Every tokenizer here is trained locally by ``tests/tokenizer_fixture.py``.
"""

import json
from typing import List

import pytest

# tests/ is on sys.path; conftest.py makes the fixtures bpe_dir, spm_dir, bpe, spm.
from tokenizer_fixture import (
    REPLACEMENT,
    TEXTS,
    assert_streams_exactly,
    write_spm_style_tokenizer,
)

from mlx_lm.detokenizers import (
    BPEStreamingDetokenizer,
    NaiveStreamingDetokenizer,
    SPMStreamingDetokenizer,
    StreamingDetokenizer,
    bytes_to_unicode,
    complete_utf8_prefix_length,
    detokenizer_class_for,
)
from mlx_lm.tokenizer_utils import load

# ---------------------------------------------------------------------------
# Helpers
# ---------------------------------------------------------------------------


def test_bytes_to_unicode_is_a_bijection_onto_printable_characters():
    table = bytes_to_unicode()
    assert sorted(table) == list(range(256))
    assert len(set(table.values())) == 256
    assert table[ord("A")] == "A" and table[0xE9] == "é"
    # Space is the 33rd non-printable byte (after 0x00..0x1F): 256 + 32.
    assert table[ord(" ")] == "Ġ" == chr(256 + 32)
    assert table[ord("\n")] == "Ċ"
    assert all(not c.isspace() and c.isprintable() for c in table.values())


@pytest.mark.parametrize(
    "data, expected",
    [
        (b"abc", 3),
        ("é".encode(), 2),
        ("é".encode()[:1], 0),
        (b"a" + "日".encode()[:2], 1),
        (b"a" + "😀".encode()[:3], 1),
        ("😀".encode(), 4),
        (b"\x80\x80", 2),  # stray continuation bytes: invalid, not pending
        (b"a\xff", 2),
    ],
)
def test_complete_utf8_prefix_length(data, expected):
    assert complete_utf8_prefix_length(data) == expected


# ---------------------------------------------------------------------------
# Streaming
# ---------------------------------------------------------------------------


def test_fixture_splits_characters_across_tokens(bpe, spm):
    # Guard: the streaming tests are only meaningful if some token ends in
    # the middle of a character.
    for wrapper in (bpe, spm):
        ids = wrapper.encode(TEXTS[3], add_special_tokens=False)
        decoded_alone = [wrapper.decode([i]) for i in ids]
        assert any(REPLACEMENT in piece for piece in decoded_alone)


@pytest.mark.parametrize("text", TEXTS)
def test_bpe_detokenizer_streams_exactly(bpe, text):
    detokenizer = bpe.detokenizer
    assert isinstance(detokenizer, BPEStreamingDetokenizer)
    assert_streams_exactly(detokenizer, bpe, text)


@pytest.mark.parametrize("text", TEXTS)
def test_spm_detokenizer_streams_exactly(spm, text):
    detokenizer = spm.detokenizer
    assert isinstance(detokenizer, SPMStreamingDetokenizer)
    assert_streams_exactly(detokenizer, spm, text)


@pytest.mark.parametrize("kind", ["bpe", "spm"])
@pytest.mark.parametrize("text", TEXTS)
def test_naive_detokenizer_streams_exactly(request, kind, text):
    wrapper = request.getfixturevalue(kind)
    assert_streams_exactly(NaiveStreamingDetokenizer(wrapper.tokenizer), wrapper, text)


def test_spm_without_trim_keeps_the_leading_space(tmp_path):
    write_spm_style_tokenizer(tmp_path, strip_leading_space=False)
    wrapper = load(tmp_path)
    detokenizer = wrapper.detokenizer
    assert isinstance(detokenizer, SPMStreamingDetokenizer)
    assert not detokenizer.trim_space
    ids = wrapper.encode("Hello there", add_special_tokens=False)
    assert wrapper.decode(ids).startswith(" ")
    assert_streams_exactly(detokenizer, wrapper, "Hello there 日本")


def test_finalize_flushes_an_incomplete_character(bpe):
    detokenizer = bpe.detokenizer
    first_byte = "日".encode()[:1]
    # The vocabulary entry that is exactly the byte 0xE6.
    byte_piece = bytes_to_unicode()[first_byte[0]]
    detokenizer.add_token(bpe.convert_tokens_to_ids("a"))
    detokenizer.add_token(bpe.convert_tokens_to_ids(byte_piece))
    assert detokenizer.text == "a"
    assert detokenizer.last_segment == "a"
    detokenizer.finalize()
    assert detokenizer.text == "a" + REPLACEMENT
    assert detokenizer.last_segment == REPLACEMENT


def test_last_segment_advances_offset_and_reset_clears(bpe):
    detokenizer = bpe.detokenizer
    for token_id in bpe.encode("one two", add_special_tokens=False):
        detokenizer.add_token(token_id)
    assert detokenizer.offset == 0
    assert detokenizer.last_segment == "one two"
    assert detokenizer.offset == len("one two")
    assert detokenizer.last_segment == ""
    detokenizer.reset()
    assert detokenizer.text == "" and detokenizer.tokens == [] and detokenizer.offset == 0
    detokenizer.add_token(bpe.encode("x", add_special_tokens=False)[0])
    assert detokenizer.last_segment == "x"


def test_out_of_vocabulary_id_decodes_to_nothing(bpe):
    # Models pad their embedding past the tokenizer vocabulary.
    detokenizer = bpe.detokenizer
    detokenizer.add_token(10_000)
    detokenizer.finalize()
    assert detokenizer.text == bpe.decode([10_000]) == ""


def test_detokenizer_property_gives_independent_instances(bpe):
    first, second = bpe.detokenizer, bpe.detokenizer
    assert first is not second
    first.add_token(bpe.encode("a", add_special_tokens=False)[0])
    assert second.text == "" and second.tokens == []


# ---------------------------------------------------------------------------
# The protocol, as upstream's subclasses use it
# ---------------------------------------------------------------------------


class UpperCaseDetokenizer(StreamingDetokenizer):
    """Written as upstream's docstring asks of a subclass: plain ``text``, ``tokens``
    and ``offset`` attributes set by ``reset``, which ``__init__`` calls itself."""

    def __init__(self, pieces: List[str]) -> None:
        super().__init__()
        self.pieces = pieces
        self.reset()

    def reset(self) -> None:
        self.offset = 0
        self.tokens = []
        self.text = ""

    def add_token(self, token: int) -> None:
        self.tokens.append(token)
        self.text += self.pieces[token].upper()

    def finalize(self) -> None:
        pass


def test_upstream_style_subclass_streams_through_last_segment():
    detokenizer = UpperCaseDetokenizer(["ab", "c "])
    detokenizer.add_token(0)
    assert detokenizer.last_segment == "AB"
    detokenizer.add_token(1)
    detokenizer.add_token(0)
    assert detokenizer.last_segment == "C AB"
    assert detokenizer.tokens == [0, 1, 0]
    fresh = detokenizer.new_stream()
    assert fresh.text == "" and fresh.offset == 0 and detokenizer.text == "ABC AB"


def test_the_protocol_cannot_be_instantiated_half_done():
    class NoFinalize(StreamingDetokenizer):
        def reset(self):
            pass

        def add_token(self, token):
            pass

    with pytest.raises(TypeError, match="finalize"):
        NoFinalize()
    with pytest.raises(TypeError, match="abstract"):
        StreamingDetokenizer()


# ---------------------------------------------------------------------------
# Choosing one from tokenizer.json
# ---------------------------------------------------------------------------


def test_detokenizer_class_for_each_decoder(bpe_dir, spm_dir):
    byte_level = json.loads((bpe_dir / "tokenizer.json").read_text())["decoder"]
    spm_decoder = json.loads((spm_dir / "tokenizer.json").read_text())["decoder"]
    assert detokenizer_class_for(byte_level) is BPEStreamingDetokenizer
    assert detokenizer_class_for({"type": "Sequence", "decoders": [byte_level]}) is BPEStreamingDetokenizer
    with_strip = detokenizer_class_for(spm_decoder)
    assert with_strip.func is SPMStreamingDetokenizer and with_strip.keywords == {"trim_space": True}
    without_strip = {"type": "Sequence", "decoders": spm_decoder["decoders"][:3]}
    assert detokenizer_class_for(without_strip).keywords == {"trim_space": False}
    for other in (None, {"type": "WordPiece", "prefix": "##"}, {"type": "Sequence", "decoders": []}):
        assert detokenizer_class_for(other) is NaiveStreamingDetokenizer
