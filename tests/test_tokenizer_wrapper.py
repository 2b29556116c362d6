"""TokenizerWrapper: EOS ids, forwarding, chat templates, the markers of a format and
finding them in a prompt, the response format; upstream 0.32.2's names throughout.

Every tokenizer here is trained locally by ``tests/tokenizer_fixture.py``.
"""

import shutil

import pytest
from transformers import PreTrainedTokenizerFast

from mlx_lm import tool_parsers
from mlx_lm.tokenizer_utils import load
from mlx_lm.tokenizer_wrapper import TokenizerWrapper, find_sequence, structural_markers, thinking_markers

# conftest.py makes the tokenizer fixtures bpe_dir, spm_dir, bpe and spm.
MESSAGES = [{"role": "user", "content": "hi"}]


@pytest.fixture(scope="module")
def thinking(bpe_dir, tmp_path_factory) -> TokenizerWrapper:
    """The BPE fixture with <think> and </think> added: ids 512 and 513."""
    directory = tmp_path_factory.mktemp("thinking")
    shutil.copytree(bpe_dir, directory, dirs_exist_ok=True)
    hf = load(directory).tokenizer
    hf.add_tokens(["<think>", "</think>"], special_tokens=True)
    return TokenizerWrapper(hf)


# ---------------------------------------------------------------------------
# EOS ids
# ---------------------------------------------------------------------------


def test_eos_token_ids_join_the_tokenizer_eos_as_upstream(bpe):
    assert bpe.eos_token_ids == {0}
    assert TokenizerWrapper(bpe.tokenizer, eos_token_ids=[1, 2]).eos_token_ids == {0, 1, 2}
    assert TokenizerWrapper(bpe.tokenizer, eos_token_ids=2).eos_token_ids == {0, 2}
    caller_ids = [1]
    TokenizerWrapper(bpe.tokenizer, eos_token_ids=caller_ids).add_eos_token(5)
    assert caller_ids == [1]


def test_eos_token_ids_empty_when_the_tokenizer_has_none(bpe_dir):
    wrapper = load(bpe_dir, tokenizer_config_extra={"eos_token": None})
    assert wrapper.eos_token_ids == set()


def test_eos_token_ids_setter_takes_any_collection(bpe_dir):
    wrapper = load(bpe_dir)
    wrapper.eos_token_ids = [3, 4]
    assert wrapper.eos_token_ids == {3, 4}
    wrapper.eos_token_ids = None
    assert wrapper.eos_token_ids == set()
    assert "eos_token_ids" not in vars(wrapper.tokenizer)
    for bad in ([-1], ["2"], [True]):
        with pytest.raises(ValueError, match="EOS token ids must be ints"):
            wrapper.eos_token_ids = bad


def test_add_eos_token(bpe_dir):
    wrapper = load(bpe_dir)
    wrapper.add_eos_token("<|im_end|>")
    wrapper.add_eos_token(7)
    wrapper.add_eos_token("9")  # digits are an id, as upstream reads --extra-eos-token
    assert wrapper.eos_token_ids == {0, 2, 7, 9}
    with pytest.raises(ValueError, match="<not-a-token>"):
        wrapper.add_eos_token("<not-a-token>")
    with pytest.raises(ValueError, match="-1"):
        wrapper.add_eos_token(-1)


# ---------------------------------------------------------------------------
# Forwarding
# ---------------------------------------------------------------------------


def test_attributes_are_forwarded(bpe_dir):
    wrapper = load(bpe_dir)
    hf_tokenizer = wrapper.tokenizer
    assert wrapper.eos_token == "<|endoftext|>"
    assert wrapper.vocab_size == hf_tokenizer.vocab_size == 512
    assert len(wrapper) == len(hf_tokenizer) == 512
    assert wrapper.encode("hello") == hf_tokenizer.encode("hello")
    wrapper.model_max_length = 123
    assert hf_tokenizer.model_max_length == 123
    with pytest.raises(AttributeError, match="no_such_attribute"):
        wrapper.no_such_attribute


def test_private_and_own_names_are_not_forwarded(bpe):
    assert hasattr(bpe.tokenizer, "_special_tokens_map")
    assert bpe._tokenizer is bpe.tokenizer  # the wrapper's own
    with pytest.raises(AttributeError, match="_special_tokens_map"):
        bpe._special_tokens_map


# ---------------------------------------------------------------------------
# Chat templates
# ---------------------------------------------------------------------------


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
    assert text == bpe.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert text == (
        "<|im_start|>system\nBe brief.<|im_end|>\n"
        "<|im_start|>user\nHi there<|im_end|>\n"
        "<|im_start|>assistant\nHello!<|im_end|>\n"
        "<|im_start|>user\nBye<|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    assert bpe.apply_chat_template(conversation=messages, tokenize=False).endswith("Bye<|im_end|>\n")


def test_chat_template_override(spm):
    assert not spm.has_chat_template
    wrapper = TokenizerWrapper(spm.tokenizer, chat_template="{% for m in messages %}[{{ m['content'] }}]{% endfor %}")
    assert wrapper.has_chat_template
    rendered = wrapper.apply_chat_template(
        [{"role": "user", "content": "a"}, {"role": "user", "content": "b"}], tokenize=False
    )
    assert rendered == "[a][b]"


def test_a_python_chat_template_is_called_and_its_text_encoded(bpe):
    """Upstream's chat_templates/ modules: a function with apply_chat_template's call."""
    calls = []

    def render(messages, add_generation_prompt=False, **kwargs):
        calls.append(kwargs)
        return "".join(f"<|im_start|>{m['content']}" for m in messages) + ("!" if add_generation_prompt else "")

    wrapper = TokenizerWrapper(bpe.tokenizer, chat_template=render)
    assert wrapper.has_chat_template
    assert wrapper.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=False) == "<|im_start|>hi!"
    ids = wrapper.apply_chat_template(MESSAGES)
    assert ids == bpe.encode("<|im_start|>hi", add_special_tokens=False) and ids[0] == 1
    assert calls == [{"enable_thinking": False}, {"enable_thinking": False}]


def test_enable_thinking_defaults_to_has_thinking_as_upstream(bpe, thinking):
    template = "{{ 'on' if enable_thinking else 'off' }}"
    plain = TokenizerWrapper(bpe.tokenizer, chat_template=template)
    assert not plain.has_thinking
    assert plain.apply_chat_template(MESSAGES, tokenize=False) == "off"
    reasoning = TokenizerWrapper(thinking.tokenizer, chat_template=template)
    assert reasoning.apply_chat_template(MESSAGES, tokenize=False) == "on"
    assert reasoning.apply_chat_template(MESSAGES, tokenize=False, enable_thinking=False) == "off"


class ThinkingSwitchTokenizer(PreTrainedTokenizerFast):
    """A remote-code style tokenizer rendering chats itself, its switch named `thinking`."""

    def apply_chat_template(self, conversation, thinking=True, tokenize=True, **kwargs):
        return f"thinking={thinking} {kwargs}"


def test_a_custom_renderer_gets_its_own_thinking_keyword(bpe_dir):
    custom = TokenizerWrapper(ThinkingSwitchTokenizer(tokenizer_file=str(bpe_dir / "tokenizer.json")))
    assert custom.has_chat_template  # its renderer is the template
    assert custom.apply_chat_template(MESSAGES) == "thinking=False {'return_dict': False}"
    assert custom.apply_chat_template(MESSAGES, enable_thinking=True).startswith("thinking=True ")


# ---------------------------------------------------------------------------
# Markers and finding them
# ---------------------------------------------------------------------------


XTML = ["<|open|>", "<|close|>", "<|sep|>", "<|end_of_msg|>"]
HARMONY = ["<|start|>", "<|channel|>", "<|message|>", "<|end|>", "<|call|>"]


@pytest.mark.parametrize(
    "vocabulary, thinking, structure",
    [(["<think>", "</think>"], ("<think>", "</think>"), ()),
     (["<longcat_think>", "</longcat_think>"], ("<longcat_think>", "</longcat_think>"), ()),
     (["<|think:start|>", "<|think:end|>"], ("<|think:start|>", "<|think:end|>"), ()),
     (["<|channel>", "<channel|>"], ("<|channel>thought", "<channel|>"), ()),
     (XTML, ("<|open|>think<|sep|>", "<|close|>think<|sep|>"),
      ("<|open|>response<|sep|>", "<|close|>response<|sep|>", "<|close|>message<|sep|>")),
     (XTML[:3], None, ()),  # not XTML without <|end_of_msg|>, as upstream tells it
     (HARMONY, ("<|channel|>analysis<|message|>", "<|end|>"), ("<|start|>assistant", "<|channel|>final<|message|>",
      "<|channel|>commentary<|message|>", "<|channel|>commentary", "<|end|>")),
     (["<think>", "<|im_start|>"], None, ())],
)
def test_markers_of_each_vocabulary(vocabulary, thinking, structure):
    ids = {token: i for i, token in enumerate(vocabulary)}
    assert thinking_markers(ids) == thinking
    assert structural_markers(ids) == structure


def test_thinking_markers_and_their_ids(thinking, bpe):
    assert thinking.has_thinking
    assert (thinking.think_start, thinking.think_end) == ("<think>", "</think>")
    assert (thinking.think_start_tokens, thinking.think_end_tokens) == ((512,), (513,))
    assert (thinking.think_start_id, thinking.think_end_id) == (512, 513)
    assert not bpe.has_thinking
    assert [bpe.think_start, bpe.think_end, bpe.think_start_tokens, bpe.think_start_id, bpe.think_end_id] == [None] * 5


def test_a_multi_token_marker_has_tokens_but_no_single_id(bpe):
    hf = bpe.tokenizer
    vocabulary = {**hf.get_vocab(), "<|channel>": 9000, "<channel|>": 9001}

    class GemmaLike:  # Gemma 4's markers without growing the shared fixture's vocabulary
        def __getattr__(self, name):
            return getattr(hf, name)

        def get_vocab(self):
            return vocabulary

    wrapper = TokenizerWrapper(GemmaLike())
    assert wrapper.think_start == "<|channel>thought"
    assert wrapper.think_start_tokens == tuple(hf.encode("<|channel>thought", add_special_tokens=False))
    assert wrapper.think_end_tokens == (9001,)
    assert wrapper.think_end_id == 9001
    with pytest.raises(ValueError, match="'<|channel>thought' is .* tokens"):
        wrapper.think_start_id


def test_find_sequence_as_upstream_finds_tokens():
    hi, start, end = 200, 100, 101
    assert find_sequence([hi], [start], start=1 - 11) == -1
    assert find_sequence([hi], [start], start=1 - 11, reverse=True) == -1
    prompt = [hi, start, end, start]
    assert find_sequence(prompt, [start], start=0) == 1
    assert find_sequence(prompt, [start], start=0, reverse=True) == 3
    assert TokenizerWrapper._find(prompt, [start, end]) == 1


@pytest.mark.parametrize(
    "start, end, reverse, expected",
    [(None, None, False, 1), (None, None, True, 4), (2, None, False, 4), (None, 5, True, 1),
     (-50, 50, True, 4), (2, 5, False, -1), (5, 2, False, -1)],
)
def test_find_sequence_searches_only_inside_start_end(start, end, reverse, expected):
    tokens = [7, 3, 4, 9, 3, 4]
    assert find_sequence(tokens, [3, 4], start, end, reverse) == expected


def test_find_sequence_refuses_an_empty_sequence():
    with pytest.raises(ValueError, match="empty"):
        find_sequence([1, 2], [])


def test_find_and_rfind_think_markers_in_a_prompt(thinking):
    prompt = [5, 512, 6, 513, 7, 512, 8]
    assert thinking.find_think_start(prompt) == 1
    assert thinking.rfind_think_start(prompt) == 5
    assert thinking.find_think_end(prompt) == 3
    assert thinking.rfind_think_end(prompt) == 3
    assert thinking.rfind_think_start(prompt, end=5) == 1
    assert thinking.find_think_end(prompt, start=4) == -1
    assert thinking.rfind_think_start(prompt, start=len(prompt) - 11) == 5  # the server's window


def test_find_think_without_reasoning_markers_names_the_problem(bpe):
    for method in ("find_think_start", "rfind_think_start", "find_think_end", "rfind_think_end"):
        with pytest.raises(ValueError, match=f"{method}: .*has_thinking is False"):
            getattr(bpe, method)([1, 2, 3])


def test_tool_call_markers_and_their_tokens(bpe):
    module = tool_parsers.load_parser("json_tools")
    wrapper = TokenizerWrapper(bpe.tokenizer, tool_call_start="<|im_start|>", tool_call_end="</x>",
                               tool_parser=module.parse_tool_call)
    assert wrapper.has_tool_calling and wrapper.tool_parser is module.parse_tool_call
    assert (wrapper.tool_call_start, wrapper.tool_call_end) == ("<|im_start|>", "</x>")
    assert wrapper.tool_call_start_tokens == (1,)
    assert wrapper.tool_call_end_tokens == tuple(bpe.encode("</x>", add_special_tokens=False))
    assert not bpe.has_tool_calling and bpe.tool_call_start_tokens is None and bpe.tool_call_end is None
    no_end = TokenizerWrapper(bpe.tokenizer, tool_call_start="<|im_start|>")
    assert no_end.tool_call_end == "" and no_end.tool_call_end_tokens == ()


# ---------------------------------------------------------------------------
# Response format
# ---------------------------------------------------------------------------


def test_response_format_states(bpe):
    transitions = {"header": [("to=self<|message|>", "reasoning"), ["to=user<|message|>", "normal"]],
                   "reasoning": [("<|eom|>", "header")]}
    wrapper = TokenizerWrapper(bpe.tokenizer, response_format={"initial_state": "header", "transitions": transitions})
    assert wrapper.response_initial_state == "header"
    assert wrapper.response_transitions == {
        "header": [("to=self<|message|>", "reasoning"), ("to=user<|message|>", "normal")],
        "reasoning": [("<|eom|>", "header")],
    }
    assert bpe.response_transitions == {} and bpe.response_initial_state is None


@pytest.mark.parametrize(
    "response_format, match",
    [(["header"], "keys among"), ({"initial": "x"}, "keys among"), ({"initial_state": 3}, "state name, got 3"),
     ({"transitions": [("a", "b")]}, "dict of states"), ({"transitions": {"s": [("a",)]}}, r"\('a',\) of state 's'"),
     ({"transitions": {"s": [("", "normal")]}}, "non-empty strings")],
)
def test_a_malformed_response_format_is_refused(bpe, response_format, match):
    with pytest.raises(ValueError, match=match):
        TokenizerWrapper(bpe.tokenizer, response_format=response_format)
