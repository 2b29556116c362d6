"""Upstream mlx-lm's chat message helpers, as `mlx_lm.server` exports them:
`process_message_content` (messages made ready for a chat template) and `convert_chat`
(a plain-text prompt for a model without a chat template, from a role mapping).
"""

import json
from typing import Any, Dict, List, Optional

# Upstream's mapping. "system_prompt" is part of it but no role reads it, there or here.
DEFAULT_ROLE_MAPPING: Dict[str, str] = {
    "system_prompt": ("A chat between a curious user and an artificial intelligence assistant. "
                      "The assistant follows the given rules no matter what."),
    "system": "ASSISTANT's RULE: ",
    "user": "USER: ",
    "assistant": "ASSISTANT: ",
    "stop": "\n",
}
IMAGE_PART_TYPES = ("image_url", "input_image", "image")


def convert_chat(messages: List[Dict[str, Any]], role_mapping: Optional[Dict[str, str]] = None) -> str:
    """Each message as `<role prefix><content><stop>`, then the assistant's prefix, with
    trailing whitespace removed. Roles the mapping lacks get no prefix; an empty or
    missing mapping means DEFAULT_ROLE_MAPPING."""
    mapping = role_mapping or DEFAULT_ROLE_MAPPING
    stop = mapping.get("stop", "")
    lines = [f"{mapping.get(message['role'], '')}{message.get('content', '')}{stop}" for message in messages]
    return ("".join(lines) + mapping.get("assistant", "")).rstrip()


def image_url(part: Any) -> Optional[str]:
    """The URL of an image content part (its `image_url` or `image`, a string or
    {"url": ...}), or None for a part of another type."""
    if not isinstance(part, dict) or part.get("type") not in IMAGE_PART_TYPES:
        return None
    url = part.get("image_url", part.get("image"))
    return url.get("url") if isinstance(url, dict) else url


def _joined_text(index: int, content: List[Any]) -> str:
    texts = []
    for part in content:
        if not (isinstance(part, dict) and part.get("type") == "text" and "text" in part):
            raise ValueError(f"Only 'text' content type is supported: messages[{index}].content has {part!r}")
        texts.append(part["text"])
    return "".join(texts)


def _decode_tool_arguments(message: Dict[str, Any]) -> None:
    """Arguments sent as JSON text become objects: chat templates index them."""
    for call in message.get("tool_calls") or []:
        function = call.get("function") if isinstance(call, dict) else None
        arguments = function.get("arguments") if isinstance(function, dict) else None
        if isinstance(arguments, str) and arguments:
            function["arguments"] = json.loads(arguments)


def process_message_content(messages: List[Dict[str, Any]], *, keep_images: bool = False) -> List[str]:
    """Make `messages` ready for `apply_chat_template`, in place: a list of text parts
    becomes their joined text, a missing (None) content "", and tool-call arguments
    given as JSON text are decoded. With `keep_images`, a message whose content has
    image parts keeps its list as it is. Returns the kept images' URLs, in order.
    ValueError for a content part that is not text (nor a kept image), or tool-call
    arguments that are not valid JSON."""
    urls: List[str] = []
    for index, message in enumerate(messages):
        content = message.get("content")
        images = [url for part in content if (url := image_url(part)) is not None] \
            if keep_images and isinstance(content, list) else []
        if images:
            urls.extend(images)
        elif isinstance(content, list):
            message["content"] = _joined_text(index, content)
        elif content is None:
            message["content"] = ""
        _decode_tool_arguments(message)
    return urls
