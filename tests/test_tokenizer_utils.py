"""tokenizer_utils: loading a checkpoint's tokenizer (detokenizer, EOS ids, tool-call
format, a family's defaults), NewlineTokenizer, no_bos_or_eos, and upstream 0.32.2's
names all importable from here.

Every tokenizer here is trained locally by ``tests/tokenizer_fixture.py``.
"""

import json
import shutil
from pathlib import Path

import pytest

# tests/ is on sys.path; conftest.py makes the fixtures bpe_dir, spm_dir, bpe, spm.
from tokenizer_fixture import (
    assert_streams_exactly,
    rewrite_decoder,
)

from mlx_lm import tokenizer_utils
from mlx_lm.tokenizer_utils import (
    BPEStreamingDetokenizer,
    NaiveStreamingDetokenizer,
    NewlineTokenizer,
    SPMStreamingDetokenizer,
    load,
    no_bos_or_eos,
    with_chat_template,
)

# Upstream 0.32.2's public module-level names in tokenizer_utils (its classes and
# functions, and the transformers classes it imports there).
UPSTREAM_NAMES = ["StreamingDetokenizer", "NaiveStreamingDetokenizer", "SPMStreamingDetokenizer",
                  "BPEStreamingDetokenizer", "TokenizerWrapper", "NewlineTokenizer", "load", "no_bos_or_eos",
                  "AutoTokenizer", "PreTrainedTokenizerFast", "PreTrainedTokenizerBase"]


def test_upstream_names_are_importable_from_tokenizer_utils():
    missing = [name for name in UPSTREAM_NAMES if not hasattr(tokenizer_utils, name)]
    assert missing == []
    assert tokenizer_utils.TokenizerWrapper.__module__ == "mlx_lm.tokenizer_wrapper"
    assert tokenizer_utils.BPEStreamingDetokenizer.__module__ == "mlx_lm.detokenizers"


def test_the_tokenizer_modules_stay_under_600_lines():
    package = Path(tokenizer_utils.__file__).parent
    for name in ("tokenizer_utils.py", "tokenizer_wrapper.py", "detokenizers.py"):
        assert len((package / name).read_text(encoding="utf-8").splitlines()) < 600, name


# ---------------------------------------------------------------------------
# load
# ---------------------------------------------------------------------------


def test_load_picks_bpe_and_spm(bpe, spm):
    assert isinstance(bpe.detokenizer, BPEStreamingDetokenizer)
    assert isinstance(spm.detokenizer, SPMStreamingDetokenizer)
    assert spm.detokenizer.trim_space


def test_load_picks_bpe_for_byte_level_inside_a_sequence(bpe_dir, tmp_path):
    byte_level = json.loads((bpe_dir / "tokenizer.json").read_text())["decoder"]
    rewrite_decoder(bpe_dir, tmp_path / "tok", {"type": "Sequence", "decoders": [byte_level]})
    assert isinstance(load(tmp_path / "tok").detokenizer, BPEStreamingDetokenizer)


@pytest.mark.parametrize("decoder", [None, {"type": "WordPiece", "prefix": "##", "cleanup": True}])
def test_load_falls_back_to_naive(bpe_dir, tmp_path, decoder):
    rewrite_decoder(bpe_dir, tmp_path / "tok", decoder)
    assert type(load(tmp_path / "tok").detokenizer) is NaiveStreamingDetokenizer


def test_load_without_tokenizer_files_raises(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(ValueError, match=str(tmp_path)):
        load(tmp_path)


def test_load_corrupt_tokenizer_json_raises(bpe_dir, tmp_path):
    rewrite_decoder(bpe_dir, tmp_path / "tok", {"type": "NoSuchDecoder"})
    with pytest.raises(ValueError, match="tok"):
        load(tmp_path / "tok")


def test_load_missing_directory_raises(tmp_path):
    with pytest.raises(FileNotFoundError, match="nope"):
        load(tmp_path / "nope")


def test_load_passes_config_extra_and_eos_ids(bpe_dir):
    wrapper = load(str(bpe_dir), tokenizer_config_extra={"model_max_length": 77})
    assert wrapper.model_max_length == 77
    # Added to the tokenizer's own EOS (id 0), as upstream's.
    assert load(bpe_dir, eos_token_ids=2).eos_token_ids == {0, 2}
    assert load(bpe_dir, eos_token_ids=[1, 2]).eos_token_ids == {0, 1, 2}


def write_config(directory: Path, **entries) -> Path:
    path = directory / "tokenizer_config.json"
    config = json.loads(path.read_text(encoding="utf-8"))
    path.write_text(json.dumps({**config, **entries}), encoding="utf-8")
    return directory


# ---------------------------------------------------------------------------
# load(defaults=...): a family's settings for checkpoints without them
# ---------------------------------------------------------------------------


def test_defaults_give_eos_ids_only_when_none_are_given(bpe_dir):
    assert load(bpe_dir, defaults={"eos_token_ids": [1, 2]}).eos_token_ids == {0, 1, 2}
    assert load(bpe_dir, eos_token_ids=[3], defaults={"eos_token_ids": [1, 2]}).eos_token_ids == {0, 3}
    assert load(bpe_dir, defaults={}).eos_token_ids == {0}


def test_defaults_give_the_tool_parser_unless_the_checkpoint_names_one(bpe_dir, tmp_path):
    mistral = tokenizer_utils.tool_parsers.load_parser("mistral")
    wrapper = load(bpe_dir, defaults={"tool_parser_type": "mistral"})
    assert wrapper.tool_parser is mistral.parse_tool_call and wrapper.tool_call_start == mistral.tool_call_start
    named = write_config(shutil.copytree(bpe_dir, tmp_path / "named"), tool_parser_type="json_tools")
    assert load(named, defaults={"tool_parser_type": "mistral"}).tool_call_start == "<tool_call>"
    with pytest.raises(ValueError, match="unknown tool parser 'nope'"):
        load(bpe_dir, defaults={"tool_parser_type": "nope"})


@pytest.mark.parametrize("defaults", [{"eos_token_id": [1]}, ["tool_parser_type"]])
def test_defaults_with_unknown_keys_are_refused(bpe_dir, defaults):
    with pytest.raises(ValueError, match="tokenizer defaults must be a dict with keys among"):
        load(bpe_dir, defaults=defaults)


def test_a_python_chat_template_type_is_refused_by_name(bpe_dir, tmp_path):
    with pytest.raises(ValueError, match="chat_template_type 'muse_spark'.*Python chat templates"):
        load(bpe_dir, defaults={"chat_template_type": "muse_spark"})
    named = write_config(shutil.copytree(bpe_dir, tmp_path / "named"), chat_template_type="deepseek_v32")
    with pytest.raises(ValueError, match="'deepseek_v32'.*remove it from tokenizer_config.json"):
        load(named)


def test_with_chat_template_keeps_the_response_format(bpe_dir):
    wrapper = load(bpe_dir)
    wrapper._response_format = {"initial_state": "header", "transitions": {"header": [("<a>", "normal")]}}
    served = with_chat_template(wrapper, "{{ '[TOOL_CALLS]' }}")
    assert served.response_initial_state == "header"
    assert served.response_transitions == {"header": [("<a>", "normal")]}
    assert served.tool_call_start == "[TOOL_CALLS]"


# ---------------------------------------------------------------------------
# NewlineTokenizer
# ---------------------------------------------------------------------------


@pytest.fixture(scope="module")
def newline_dir(bpe_dir, tmp_path_factory) -> Path:
    """The BPE fixture spelling newlines as its added piece "<n>" (id 512)."""
    directory = tmp_path_factory.mktemp("newline")
    hf = load(bpe_dir).tokenizer
    hf.add_tokens(["<n>"], special_tokens=True)
    hf.save_pretrained(directory)
    return write_config(directory, tokenizer_class="NewlineTokenizer")


def test_newline_tokenizer_spells_newlines_as_its_piece(newline_dir):
    wrapper = load(newline_dir)
    hf = wrapper.tokenizer
    assert isinstance(hf, NewlineTokenizer)
    newline_id = hf.convert_tokens_to_ids("<n>")
    ids = hf.encode("one\ntwo", add_special_tokens=False)
    assert newline_id == 512 and ids.count(newline_id) == 1
    assert ids == hf.encode("one<n>two", add_special_tokens=False) == hf("one\ntwo")["input_ids"]
    assert hf.encode_batch(["a\nb", "c"], add_special_tokens=False) == [hf.encode("a<n>b", add_special_tokens=False),
                                                                       hf.encode("c", add_special_tokens=False)]
    assert "<n>" in hf.tokenize("a\nb")
    assert hf.decode(ids) == "one\ntwo"
    assert hf.batch_decode([ids, ids[:1]]) == ["one\ntwo", hf.decode(ids[:1])]


def test_newline_tokenizer_streams_and_renders_chats_with_newlines(newline_dir):
    wrapper = load(newline_dir)
    assert type(wrapper.detokenizer) is NaiveStreamingDetokenizer
    assert_streams_exactly(wrapper.detokenizer, wrapper, "first line\nsecond 😀\n\nend")
    ids = wrapper.apply_chat_template([{"role": "user", "content": "hi"}], add_generation_prompt=True)
    assert 512 in ids and wrapper.decode(ids) == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"


# ---------------------------------------------------------------------------
# no_bos_or_eos
# ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    "sequence, expected",
    [([1, 5, 6, 2], [5, 6]), ([5, 6, 2], [5, 6]), ([1, 5, 6], [5, 6]), ([5, 6], [5, 6]),
     ([1, 2], []), ([1], []), ([2], []), ([], []), ((1, 7, 2), (7,)), ([2, 5, 1], [2, 5, 1])],
)
def test_no_bos_or_eos(sequence, expected):
    assert no_bos_or_eos(sequence, bos=1, eos=2) == expected


def test_no_bos_or_eos_without_bos_or_eos_ids():
    assert no_bos_or_eos([1, 2, 3], bos=None, eos=None) == [1, 2, 3]
