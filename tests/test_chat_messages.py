"""chat_messages.py: upstream mlx-lm's convert_chat and process_message_content, as
`mlx_lm.server` exports them."""

import pytest

from mlx_lm.server import convert_chat, process_message_content


def test_convert_chat_with_the_default_mapping():
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
                {"role": "assistant", "content": "Hello"}, {"role": "user", "content": "Bye"}]
    assert convert_chat(messages) == ("ASSISTANT's RULE: Be brief.\nUSER: Hi\nASSISTANT: Hello\nUSER: Bye\n"
                                      "ASSISTANT:")  # the assistant prefix's last space is stripped


def test_convert_chat_with_a_mapping_of_ones_own():
    mapping = {"user": "<u>", "stop": "|"}  # no assistant prefix, unknown roles unprefixed
    assert convert_chat([{"role": "user", "content": "a"}, {"role": "tool", "content": "b"},
                         {"role": "user"}], mapping) == "<u>a|b|<u>|"
    assert convert_chat([{"role": "user", "content": "x "}], {}) == "USER: x \nASSISTANT:"  # {} is the default


def test_process_message_content_normalises_in_place():
    messages = [
        {"role": "user", "content": [{"type": "text", "text": "one "}, {"type": "text", "text": "two"}]},
        {"role": "assistant", "content": None,
         "tool_calls": [{"function": {"name": "add", "arguments": '{"a": 2, "b": [3]}'}},
                        {"function": {"name": "now", "arguments": ""}},
                        {"function": {"name": "sub", "arguments": {"a": 1}}}]},
        {"role": "tool", "content": "5"},
    ]
    assert process_message_content(messages) == []
    assert messages[0]["content"] == "one two" and messages[1]["content"] == "" and messages[2]["content"] == "5"
    assert [c["function"]["arguments"] for c in messages[1]["tool_calls"]] == [{"a": 2, "b": [3]}, "", {"a": 1}]


def test_process_message_content_keeps_images_only_when_asked():
    content = [{"type": "text", "text": "look"}, {"type": "image_url", "image_url": {"url": "data:image/png;base64,AA"}},
               {"type": "input_image", "image_url": "https://example.com/b.png"}]
    kept = [{"role": "user", "content": list(content)}]
    assert process_message_content(kept, keep_images=True) == ["data:image/png;base64,AA",
                                                               "https://example.com/b.png"]
    assert kept[0]["content"] == content
    with pytest.raises(ValueError, match="Only 'text' content type is supported.*image_url"):
        process_message_content([{"role": "user", "content": list(content)}])


@pytest.mark.parametrize("part", [{"type": "text"}, "plain string", {"text": "no type"}])
def test_process_message_content_refuses_parts_that_are_not_text(part):
    with pytest.raises(ValueError, match=r"messages\[0\]\.content"):
        process_message_content([{"role": "user", "content": [part]}])


def test_process_message_content_refuses_bad_tool_call_json():
    with pytest.raises(ValueError):
        process_message_content([{"role": "assistant", "tool_calls": [{"function": {"arguments": "{oops"}}]}])
