"""Streaming detokenizers, TokenizerWrapper and tokenizer loading.

Every tokenizer here is trained locally by ``tests/tokenizer_fixture.py``.
"""

import json
import shutil
from pathlib import Path

import pytest

# tests/ is on sys.path (pytest rootdir-relative import, and conftest.py).
from tokenizer_fixture import CORPUS, write_spm_style_tokenizer, write_tokenizer

from mlx_lm.tokenizer_utils import (
    BPEStreamingDetokenizer,
    NaiveStreamingDetokenizer,
    SPMStreamingDetokenizer,
    TokenizerWrapper,
    bytes_to_unicode,
    complete_utf8_prefix_length,
    load,
)

REPLACEMENT = "\ufffd"

TEXTS = [
    "Hello world, plain ASCII.",
    "naïve café crème brûlée",
    "日本語のテキスト 中文 한국어",  # Korean is not in the corpus: raw bytes
    "emoji 😀🎉🦀 and flags 🇫🇷 ok",
    "Ωμέγα and Привет\nnext line\n\n  indented code()\n",
    "<|im_start|>user\nhi 😀<|im_end|>\n",
    " leading space and trailing space ",
    CORPUS[13] + "\n" + CORPUS[14] + "\n" + CORPUS[15],
]


@pytest.fixture(scope="session")
def bpe_dir(tmp_path_factory) -> Path:
    directory = tmp_path_factory.mktemp("bpe")
    write_tokenizer(directory)
    return directory


@pytest.fixture(scope="session")
def spm_dir(tmp_path_factory) -> Path:
    directory = tmp_path_factory.mktemp("spm")
    write_spm_style_tokenizer(directory)
    return directory


@pytest.fixture(scope="session")
def bpe(bpe_dir) -> TokenizerWrapper:
    return load(bpe_dir)


@pytest.fixture(scope="session")
def spm(spm_dir) -> TokenizerWrapper:
    return load(spm_dir)


def stream(detokenizer, ids):
    """Feed ``ids`` one at a time; return (segments, texts after each token)."""
    detokenizer.reset()
    segments, texts = [], []
    for token_id in ids:
        detokenizer.add_token(token_id)
        texts.append(detokenizer.text)
        segments.append(detokenizer.last_segment)
    detokenizer.finalize()
    segments.append(detokenizer.last_segment)
    return segments, texts


def assert_streams_exactly(detokenizer, tokenizer, text):
    ids = tokenizer.encode(text, add_special_tokens=False)
    expected = tokenizer.decode(ids)
    segments, texts = stream(detokenizer, ids)
    assert detokenizer.text == expected
    assert "".join(segments) == expected
    assert detokenizer.tokens == ids
    for partial_text in texts:
        # Each intermediate text is a prefix of the final one, so it holds no
        # partial character and no U+FFFD standing in for one.
        assert expected.startswith(partial_text)
        assert REPLACEMENT not in partial_text
    for segment in segments:
        assert REPLACEMENT not in segment


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


def test_last_segment_advances_and_reset_clears(bpe):
    detokenizer = bpe.detokenizer
    for token_id in bpe.encode("one two", add_special_tokens=False):
        detokenizer.add_token(token_id)
    assert detokenizer.last_segment == "one two"
    assert detokenizer.last_segment == ""
    detokenizer.reset()
    assert detokenizer.text == "" and detokenizer.tokens == []
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
# load
# ---------------------------------------------------------------------------


def rewrite_decoder(source: Path, target: Path, decoder) -> None:
    shutil.copytree(source, target)
    path = target / "tokenizer.json"
    data = json.loads(path.read_text(encoding="utf-8"))
    data["decoder"] = decoder
    path.write_text(json.dumps(data, ensure_ascii=False), encoding="utf-8")


def test_load_picks_bpe_and_spm(bpe, spm):
    assert isinstance(bpe.detokenizer, BPEStreamingDetokenizer)
    assert isinstance(spm.detokenizer, SPMStreamingDetokenizer)
    assert spm.detokenizer.trim_space


def test_load_picks_bpe_for_byte_level_inside_a_sequence(bpe_dir, tmp_path):
    byte_level = json.loads((bpe_dir / "tokenizer.json").read_text())["decoder"]
    decoder = {"type": "Sequence", "decoders": [byte_level]}
    rewrite_decoder(bpe_dir, tmp_path / "tok", decoder)
    assert isinstance(load(tmp_path / "tok").detokenizer, BPEStreamingDetokenizer)


@pytest.mark.parametrize(
    "decoder",
    [None, {"type": "WordPiece", "prefix": "##", "cleanup": True}],
)
def test_load_falls_back_to_naive(bpe_dir, tmp_path, decoder):
    rewrite_decoder(bpe_dir, tmp_path / "tok", decoder)
    wrapper = load(tmp_path / "tok")
    assert type(wrapper.detokenizer) is NaiveStreamingDetokenizer


def test_load_without_tokenizer_files_raises(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(ValueError, match=str(tmp_path)):
        load(tmp_path)


def test_load_corrupt_tokenizer_json_raises(bpe_dir, tmp_path):
    rewrite_decoder(bpe_dir, tmp_path / "tok", {"type": "NoSuchDecoder"})
    with pytest.raises(ValueError, match="tok"):
        load(tmp_path / "tok")


def test_load_missing_directory_raises(tmp_path):
    missing = tmp_path / "nope"
    with pytest.raises(FileNotFoundError, match="nope"):
        load(missing)


def test_load_passes_config_extra_and_eos_ids(bpe_dir):
    wrapper = load(bpe_dir, tokenizer_config_extra={"model_max_length": 77})
    assert wrapper.model_max_length == 77
    assert load(bpe_dir, eos_token_ids=2).eos_token_ids == {2}
    assert load(bpe_dir, eos_token_ids=[0, 2]).eos_token_ids == {0, 2}


# ---------------------------------------------------------------------------
# TokenizerWrapper
# ---------------------------------------------------------------------------


def test_eos_token_ids_default_to_the_tokenizer_eos(bpe):
    assert bpe.eos_token_ids == {0}
    wrapper = TokenizerWrapper(bpe.tokenizer, eos_token_ids=[1, 2])
    assert wrapper.eos_token_ids == {1, 2}


def test_eos_token_ids_empty_when_the_tokenizer_has_none(bpe_dir):
    wrapper = load(bpe_dir, tokenizer_config_extra={"eos_token": None})
    assert wrapper.eos_token_ids == set()


def test_add_eos_token(bpe_dir):
    wrapper = load(bpe_dir)
    wrapper.add_eos_token("<|im_end|>")
    wrapper.add_eos_token(7)
    assert wrapper.eos_token_ids == {0, 2, 7}
    with pytest.raises(ValueError, match="<not-a-token>"):
        wrapper.add_eos_token("<not-a-token>")
    with pytest.raises(ValueError, match="-1"):
        wrapper.add_eos_token(-1)


def test_attributes_are_forwarded(bpe_dir):
    wrapper = load(bpe_dir)
    hf_tokenizer = wrapper.tokenizer
    assert wrapper.eos_token == "<|endoftext|>"
    assert wrapper.vocab_size == hf_tokenizer.vocab_size == 512
    assert wrapper.encode("hello") == hf_tokenizer.encode("hello")
    wrapper.model_max_length = 123
    assert hf_tokenizer.model_max_length == 123
    wrapper.eos_token_ids = {5}
    assert wrapper.eos_token_ids == {5}
    assert "eos_token_ids" not in vars(hf_tokenizer)
    with pytest.raises(AttributeError):
        wrapper.no_such_attribute


def test_chat_template_renders_roles_and_generation_prompt(bpe):
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hi there"},
        {"role": "assistant", "content": "Hello!"},
        {"role": "user", "content": "Bye"},
    ]
    assert bpe.has_chat_template
    ids = bpe.apply_chat_template(messages, add_generation_prompt=True)
    assert isinstance(ids, list) and all(isinstance(i, int) for i in ids)
    text = bpe.decode(ids)
    assert text == bpe.apply_chat_template(
        messages, add_generation_prompt=True, tokenize=False
    )
    assert text == (
        "<|im_start|>system\nBe brief.<|im_end|>\n"
        "<|im_start|>user\nHi there<|im_end|>\n"
        "<|im_start|>assistant\nHello!<|im_end|>\n"
        "<|im_start|>user\nBye<|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    without_prompt = bpe.apply_chat_template(messages, tokenize=False)
    assert without_prompt.endswith("Bye<|im_end|>\n")


def test_chat_template_override(spm):
    assert not spm.has_chat_template
    wrapper = TokenizerWrapper(
        spm.tokenizer, chat_template="{% for m in messages %}[{{ m['content'] }}]{% endfor %}"
    )
    assert wrapper.has_chat_template
    rendered = wrapper.apply_chat_template(
        [{"role": "user", "content": "a"}, {"role": "user", "content": "b"}],
        tokenize=False,
    )
    assert rendered == "[a][b]"


def test_enable_thinking_defaults_to_has_thinking_as_upstream(bpe_dir, tmp_path):
    """Upstream passes enable_thinking=has_thinking unless the caller sets it."""
    template = "{{ 'on' if enable_thinking else 'off' }}"
    messages = [{"role": "user", "content": "hi"}]
    plain = TokenizerWrapper(load(bpe_dir).tokenizer, chat_template=template)
    assert not plain.has_thinking
    assert plain.apply_chat_template(messages, tokenize=False) == "off"
    shutil.copytree(bpe_dir, tmp_path / "thinking")
    hf = load(tmp_path / "thinking").tokenizer
    hf.add_tokens(["<think>", "</think>"], special_tokens=True)
    thinking = TokenizerWrapper(hf, chat_template=template)
    assert thinking.has_thinking
    assert thinking.apply_chat_template(messages, tokenize=False) == "on"
    assert thinking.apply_chat_template(messages, tokenize=False, enable_thinking=False) == "off"
