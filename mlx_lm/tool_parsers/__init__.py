"""Tool-call formats, one module per format as upstream names them (and nemotron_json, harmony). Each module has
`tool_call_start` and `tool_call_end` (the markers around a call in the model's
text; an empty end marker: the call runs to the end of the answer) and
`parse_tool_call(text, tools=None)`, which takes the text between the markers and
returns {"name": str, "arguments": dict[, "id": str]} or a list of them, and raises
ValueError on text it cannot read (the server then returns that text as content).

Which format a model writes: `tool_parser_type` in its tokenizer_config.json, else
the markers its chat template writes (`parser_for_template`), else its tokenizer's
vocabulary or its config's model_type (`parser_for_model`)."""

import importlib
from types import ModuleType
from typing import Iterable, Optional

PARSER_NAMES = ("function_gemma", "gemma4", "glm47", "harmony", "json_tools", "kimi_k2", "kimi_k3", "laguna",
                "longcat", "minicpm5", "minimax_m2", "mistral", "muse_spark", "nemotron_json", "pythonic",
                "qwen3_coder")

# Checked in this order: some templates contain another format's markers too
# (qwen3_coder and GLM templates hold "<tool_call>" as well).
_TEMPLATE_MARKERS = (
    ("minimax_m2", ("<minimax:tool_call>",)),
    ("gemma4", ("<|tool_call>", "<tool_call|>")),
    ("function_gemma", ("<start_function_call>",)),
    ("longcat", ("<longcat_tool_call>",)),
    ("glm47", ("<arg_key>",)),
    ("pythonic", ("<|tool_call_start|>",)),
    ("pythonic", ("<|tool_list_start|>",)),
    ("qwen3_coder", ("<tool_call>\n<function=",)),
    ("qwen3_coder", ("<tool_call>\\n<function=",)),  # the newline escaped in a Jinja string
    ("kimi_k2", ("<|tool_calls_section_begin|>",)),
    ("minicpm5", ('<function name="', '<param name="')),
    ("mistral", ("[TOOL_CALLS]",)),
    ("muse_spark", ("<atem:function_calls>",)),
    ("nemotron_json", ("<TOOLCALL>",)),
    ("json_tools", ("<tool_call>",)),  # Qwen2.5, Qwen3, Hermes: JSON between the markers
)

# Families whose format is known when neither the template nor the vocabulary says.
_MODEL_TYPES = {"gemma4": "gemma4", "gemma4_text": "gemma4", "glm4_moe": "glm47", "glm4_moe_lite": "glm47",
                "gpt_oss": "harmony",
                "kimi_k2": "kimi_k2", "laguna": "laguna", "lfm2": "pythonic", "lfm2_moe": "pythonic",
                "longcat_flash": "longcat", "minimax": "minimax_m2", "minimax_m2": "minimax_m2",
                "muse_spark": "muse_spark"}

_XTML_TOKENS = ("<|open|>", "<|close|>", "<|sep|>", "<|end_of_msg|>")
HARMONY_TOKENS = ("<|start|>", "<|channel|>", "<|message|>", "<|end|>", "<|call|>")


def load_parser(name: str) -> ModuleType:
    """The module of format `name`; ValueError naming the formats there are."""
    if name not in PARSER_NAMES:
        raise ValueError(f"unknown tool parser {name!r} (tool_parser_type): expected one of {', '.join(PARSER_NAMES)}")
    return importlib.import_module(f"{__name__}.{name}")


def parser_for_template(chat_template: Optional[str]) -> Optional[str]:
    """The format whose markers a chat template writes, or None."""
    if not isinstance(chat_template, str):
        return None
    for name, markers in _TEMPLATE_MARKERS:
        if all(m in chat_template for m in markers):
            return name
    return None


def parser_for_model(vocabulary: Iterable[str], model_type: Optional[str]) -> Optional[str]:
    """The format a tokenizer's special tokens or a family imply, or None. LFM2
    conversions, for one, have the tool-call tokens but no template that names them."""
    vocabulary = set(vocabulary)
    if all(t in vocabulary for t in _XTML_TOKENS):
        return "kimi_k3"
    if all(t in vocabulary for t in HARMONY_TOKENS):
        return "harmony"
    if "<|tool_call_start|>" in vocabulary and "<|tool_call_end|>" in vocabulary:
        return "pythonic"
    return _MODEL_TYPES.get(model_type)
