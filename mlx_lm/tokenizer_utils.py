"""Loading a checkpoint's tokenizer, and upstream mlx-lm's tokenizer API in one place.

:func:`load` reads the tokenizer of a local checkpoint, picks its streaming
detokenizer (detokenizers.py) from ``tokenizer.json`` and its tool-call format
(tool_parsers/), and wraps it in a :class:`TokenizerWrapper` (tokenizer_wrapper.py).
Upstream keeps all of this in one module, and code written for it imports every name
from here: the detokenizers and the wrapper are re-exported.
"""

import json
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence, Set, TypeVar, Union

from transformers import AutoTokenizer, PreTrainedTokenizerBase, PreTrainedTokenizerFast

from . import tool_parsers
from .detokenizers import (
    REPLACEMENT_CHARACTER,
    SPM_SPACE,
    BPEStreamingDetokenizer,
    DetokenizerFactory,
    NaiveStreamingDetokenizer,
    SPMStreamingDetokenizer,
    StreamingDetokenizer,
    bytes_to_unicode,
    complete_utf8_prefix_length,
    detokenizer_class_for,
    read_decoder,
)
from .tokenizer_wrapper import (
    TokenizerWrapper,
    find_sequence,
    structural_markers,
    thinking_markers,
)

# Re-exported: code written for upstream imports these from here.
__all__ = [
    "AutoTokenizer", "PreTrainedTokenizerBase", "PreTrainedTokenizerFast",
    "REPLACEMENT_CHARACTER", "SPM_SPACE", "StreamingDetokenizer", "NaiveStreamingDetokenizer",
    "SPMStreamingDetokenizer", "BPEStreamingDetokenizer", "DetokenizerFactory", "bytes_to_unicode",
    "complete_utf8_prefix_length", "detokenizer_class_for", "read_decoder",
    "TokenizerWrapper", "find_sequence", "structural_markers", "thinking_markers",
    "DEFAULT_KEYS", "NewlineTokenizer", "load", "no_bos_or_eos", "with_chat_template",
]

# What a model family may set for checkpoints that leave it out (upstream's
# TOKENIZER_DEFAULTS, passed as load(defaults=...)).
DEFAULT_KEYS = ("eos_token_ids", "tool_parser_type", "chat_template_type")
NEWLINE_PIECE = "<n>"


class NewlineTokenizer(PreTrainedTokenizerFast):
    """A fast tokenizer whose vocabulary spells a newline as the piece ``<n>``, named
    by ``"tokenizer_class": "NewlineTokenizer"`` in tokenizer_config.json (upstream's
    class): text is encoded with each newline as ``<n>`` and decoded back."""

    @staticmethod
    def _newlines_as_pieces(text: Any) -> Any:
        # A text, a batch of texts, or pre-split words (lists of lists).
        if isinstance(text, str):
            return text.replace("\n", NEWLINE_PIECE)
        if isinstance(text, (list, tuple)):
            return type(text)(NewlineTokenizer._newlines_as_pieces(part) for part in text)
        return text

    # encode, __call__ and apply_chat_template(tokenize=True) all reach _encode_plus;
    # transformers 4 sends batches through _batch_encode_plus instead.
    def _encode_plus(self, text: Any, text_pair: Any = None, *args: Any, **kwargs: Any):
        return super()._encode_plus(self._newlines_as_pieces(text), self._newlines_as_pieces(text_pair),
                                    *args, **kwargs)

    def _batch_encode_plus(self, batch_text_or_text_pairs: Any, *args: Any, **kwargs: Any):
        return super()._batch_encode_plus(self._newlines_as_pieces(batch_text_or_text_pairs), *args, **kwargs)

    def tokenize(self, text: str, *args: Any, **kwargs: Any) -> List[str]:
        return super().tokenize(self._newlines_as_pieces(text), *args, **kwargs)

    def encode_batch(self, texts: Sequence[str], **kwargs: Any) -> List[List[int]]:
        """``encode`` of each text (upstream's name for it)."""
        return [self.encode(text, **kwargs) for text in texts]

    # decode and batch_decode both reach _decode.
    def _decode(self, *args: Any, **kwargs: Any) -> str:
        return super()._decode(*args, **kwargs).replace(NEWLINE_PIECE, "\n")


def _register_newline_tokenizer() -> None:
    # AutoTokenizer finds a tokenizer_class by name among registered classes. Done by
    # load, not at import, so that importing changes no library's state.
    AutoTokenizer.register(NewlineTokenizer, fast_tokenizer_class=NewlineTokenizer, exist_ok=True)


Ids = TypeVar("Ids", bound=Sequence[int])


def no_bos_or_eos(sequence: Ids, bos: Optional[int], eos: Optional[int]) -> Ids:
    """``sequence`` without a leading ``bos`` and a trailing ``eos`` (each only if
    there); an empty sequence stays empty."""
    if len(sequence) > 0 and sequence[0] == bos:
        sequence = sequence[1:]
    if len(sequence) > 0 and sequence[-1] == eos:
        sequence = sequence[:-1]
    return sequence


def _checked_defaults(defaults: Optional[Dict[str, Any]]) -> Dict[str, Any]:
    if defaults is None:
        return {}
    if not isinstance(defaults, dict) or set(defaults) - set(DEFAULT_KEYS):
        raise ValueError(f"tokenizer defaults must be a dict with keys among {DEFAULT_KEYS}, got {defaults!r}")
    return defaults


def _refuse_python_chat_template(tokenizer: PreTrainedTokenizerBase, defaults: Dict[str, Any]) -> None:
    """Upstream renders a few formats (DeepSeek-V3.2, Muse Spark) with Python chat
    templates chosen by `chat_template_type`; those families do not load here, and
    rendering such a chat with the Jinja template instead would be silently wrong."""
    name = tokenizer.init_kwargs.get("chat_template_type", defaults.get("chat_template_type"))
    if name is not None:
        raise ValueError(f"chat_template_type {name!r} names one of upstream mlx-lm's Python chat "
                         "templates (mlx_lm/chat_templates/), which this project does not have; "
                         "remove it from tokenizer_config.json to render with the Jinja chat_template")


def load(
    model_path: Union[str, Path],
    tokenizer_config_extra: Optional[Dict[str, Any]] = None,
    eos_token_ids: Union[List[int], int, None] = None,
    defaults: Optional[Dict[str, Any]] = None,
) -> TokenizerWrapper:
    """Load the tokenizer in ``model_path`` and wrap it.

    Args:
        model_path: local directory with the tokenizer files.
        tokenizer_config_extra: keyword arguments for ``AutoTokenizer.from_pretrained``.
        eos_token_ids: ids that end generation, besides the tokenizer's EOS.
        defaults: the model family's settings for checkpoints without them
            (``DEFAULT_KEYS``): ``eos_token_ids`` when none are given,
            ``tool_parser_type`` when tokenizer_config.json names none.

    Raises:
        FileNotFoundError: ``model_path`` is not a directory.
        ValueError: no tokenizer could be loaded from it, ``defaults`` has an unknown
            key, or it asks for a Python chat template (``chat_template_type``).
    """
    model_path = Path(model_path)
    defaults = _checked_defaults(defaults)
    if not model_path.is_dir():
        raise FileNotFoundError(f"tokenizer directory {model_path} does not exist")
    _register_newline_tokenizer()
    try:
        tokenizer = AutoTokenizer.from_pretrained(model_path, **(tokenizer_config_extra or {}))
    # `tokenizers` reports a malformed tokenizer.json as a bare Exception, so
    # nothing narrower catches every way a directory can fail to load.
    except Exception as error:
        raise ValueError(
            f"could not load a tokenizer from {model_path} (expected tokenizer.json "
            f"or tokenizer.model with tokenizer_config.json): {error}"
        ) from error
    _refuse_python_chat_template(tokenizer, defaults)
    detokenizer_class = detokenizer_class_for(read_decoder(model_path / "tokenizer.json"))
    if isinstance(tokenizer, NewlineTokenizer):
        # The byte tables would stream the piece "<n>" itself; only decode maps it.
        detokenizer_class = NaiveStreamingDetokenizer
    if eos_token_ids is None:
        eos_token_ids = defaults.get("eos_token_ids")
    return _wrap(tokenizer, detokenizer_class, eos_token_ids, _model_type(model_path),
                 defaults.get("tool_parser_type"))


def _wrap(
    tokenizer: PreTrainedTokenizerBase,
    detokenizer_class: DetokenizerFactory,
    eos_token_ids: Union[Set[int], List[int], int, None],
    model_type: Optional[str],
    default_tool_parser: Optional[str] = None,
    response_format: Optional[Dict[str, Any]] = None,
) -> TokenizerWrapper:
    tool_format = _tool_format(tokenizer, model_type, default_tool_parser)
    return TokenizerWrapper(
        tokenizer,
        detokenizer_class,
        eos_token_ids=eos_token_ids,
        tool_call_start=tool_format and tool_format.tool_call_start,
        tool_call_end=tool_format and tool_format.tool_call_end,
        tool_parser=tool_format and tool_format.parse_tool_call,
        response_format=response_format,
    )


def _model_type(model_path: Path) -> Optional[str]:
    try:
        with open(model_path / "config.json", encoding="utf-8") as f:
            model_type = json.load(f).get("model_type")
    except (OSError, ValueError, AttributeError):
        return None
    return model_type if isinstance(model_type, str) else None


def _tool_format(tokenizer: PreTrainedTokenizerBase, model_type: Optional[str],
                 default_name: Optional[str] = None):
    """The tool_parsers module of a tokenizer: as its tokenizer_config.json names it
    (`tool_parser_type`), else as the family's default, else as its chat template's
    markers or its vocabulary and family imply; None if nothing does."""
    name = tokenizer.init_kwargs.get("tool_parser_type", default_name)
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
    response_format = {"initial_state": wrapper.response_initial_state,
                       "transitions": wrapper.response_transitions}
    return _wrap(wrapper.tokenizer, wrapper._detokenizer_class, wrapper.eos_token_ids, model_type,
                 response_format=response_format)
