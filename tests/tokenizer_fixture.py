"""Tiny tokenizers trained locally, so that no test needs the Hugging Face hub.

``write_tokenizer`` writes a GPT-2 style byte-level BPE tokenizer (the kind the
tiny test models use); ``write_spm_style_tokenizer`` writes a Llama style one
(SentencePiece pieces with ``▁`` for spaces and ``<0xNN>`` byte fallback).
Both train on the fixed corpus below and are deterministic. The pytest fixtures at
the end (``bpe_dir``, ``spm_dir``, ``bpe``, ``spm``) and the streaming helpers serve
the tokenizer tests; a test module imports the fixtures it uses.
"""

import json
import shutil
from pathlib import Path
from typing import Dict, List, Tuple

import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
EOS_TOKEN = "<|endoftext|>"

# Rendered by transformers' sandboxed jinja environment, which provides
# `raise_exception`.
CHATML_TEMPLATE = (
    "{%- for message in messages -%}"
    "{%- if message['role'] not in ['system', 'user', 'assistant'] -%}"
    "{{- raise_exception('Unknown role: ' + message['role']) -}}"
    "{%- endif -%}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content']"
    " + '<|im_end|>\\n' -}}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}"
    "{{- '<|im_start|>assistant\\n' -}}"
    "{%- endif -%}"
)

CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "A language model predicts the next token from the tokens before it.",
    "Speculative decoding drafts a few tokens with a small model and verifies",
    "them with the large model in a single forward pass.",
    "When the draft disagrees, the target's token is kept and the cache is",
    "rolled back to the last accepted position.",
    "Once upon a time there was a little robot who loved to read books.",
    "Every morning it walked to the library, said hello to the librarian and",
    "sat by the window until the sun went down.",
    "Numbers: 0 1 2 3 4 5 6 7 8 9 10 42 100 2048 65536 3.14159 -1e-5",
    "Punctuation: (parentheses) [brackets] {braces} <angle> 'quotes' \"double\"",
    "Questions? Answers! Lists; items: one, two, three... and so on.",
    "user@example.com https://example.org/path?query=value&x=1#anchor",
    "def fibonacci(n: int) -> int:",
    '    """Return the n-th Fibonacci number."""',
    "    if n < 2:",
    "        return n",
    "    return fibonacci(n - 1) + fibonacci(n - 2)",
    "",
    "class Stack:",
    "    def __init__(self):",
    "        self.items = []",
    "",
    "    def push(self, item):",
    "        self.items.append(item)",
    "",
    "    def pop(self):",
    "        return self.items.pop()",
    "",
    "for i in range(10):",
    "    print(f'{i}: {fibonacci(i)}')",
    "import numpy as np",
    "x = np.zeros((4, 8), dtype=np.float32)",
    "result = {key: value for key, value in zip(keys, values) if value}",
    "The naïve café served crème brûlée to a señor from São Paulo.",
    "Ein Bär läuft über die Straße. Größe und Übermaß.",
    "日本語のテキストも少し含めます。東京は大きな都市です。",
    "中文文本：你好，世界！今天天气很好。",
    "Ωμέγα, αλφα, βήτα και γάμμα είναι ελληνικά γράμματα.",
    "Привет, мир! Это русский текст.",
    "Emoji: 😀 😂 🎉 👍 🚀 ❤️ and symbols: € £ ¥ © ® ™ ° ± × ÷",
    "Math: ∑ ∫ √ ∞ ≈ ≠ ≤ ≥ → ← ∀ ∃",
    "She sells sea shells by the sea shore, and the shells she sells are sure.",
    "It was the best of times, it was the worst of times, it was the age of",
    "wisdom, it was the age of foolishness, it was the epoch of belief.",
    "To be, or not to be, that is the question: whether 'tis nobler in the",
    "mind to suffer the slings and arrows of outrageous fortune.",
    "In the beginning the universe was created. This has made a lot of people",
    "very angry and been widely regarded as a bad move.",
    "The tokenizer splits text into pieces; the detokenizer joins them again.",
    "Streaming output must never show half of a multi-byte character.",
]


def _byte_level_alphabet_size() -> int:
    return len(pre_tokenizers.ByteLevel.alphabet())


def _train_byte_level(vocab_size: int) -> Tokenizer:
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        # All 256 byte symbols, so any text encodes without an unknown token.
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(CORPUS, trainer=trainer)
    return tokenizer


def _pad_vocab(tokenizer: Tokenizer, vocab_size: int) -> None:
    """Add reserved tokens until the vocabulary has exactly ``vocab_size`` ids."""
    missing = vocab_size - tokenizer.get_vocab_size()
    if missing > 0:
        start = tokenizer.get_vocab_size()
        tokenizer.add_special_tokens(
            [f"<|reserved_{start + i}|>" for i in range(missing)]
        )


def _write_config(directory: Path, config: dict) -> None:
    with open(directory / "tokenizer_config.json", "w", encoding="utf-8") as f:
        json.dump(config, f, indent=2, ensure_ascii=False)


def _added_tokens_decoder(tokenizer: Tokenizer) -> Dict[str, dict]:
    return {
        str(token_id): {
            "content": added.content,
            "lstrip": False,
            "normalized": False,
            "rstrip": False,
            "single_word": False,
            "special": True,
        }
        for token_id, added in tokenizer.get_added_tokens_decoder().items()
    }


def write_tokenizer(directory: Path, vocab_size: int = 512) -> None:
    """Write a byte-level BPE tokenizer with exactly ``vocab_size`` ids.

    Ids 0, 1, 2 are ``<|endoftext|>`` (EOS and pad), ``<|im_start|>`` and
    ``<|im_end|>``; the chat template is ChatML. When the corpus runs out of
    merges before ``vocab_size``, reserved special tokens fill the rest.

    Raises:
        ValueError: ``vocab_size`` is too small for the specials plus 256 bytes.
    """
    minimum = len(SPECIAL_TOKENS) + _byte_level_alphabet_size()
    if vocab_size < minimum:
        raise ValueError(
            f"vocab_size {vocab_size} < {minimum} (3 special tokens + 256 bytes)"
        )
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    tokenizer = _train_byte_level(vocab_size)
    _pad_vocab(tokenizer, vocab_size)
    if tokenizer.get_vocab_size() != vocab_size:
        raise AssertionError(
            f"fixture vocab {tokenizer.get_vocab_size()} != requested {vocab_size}"
        )
    tokenizer.save(str(directory / "tokenizer.json"))
    _write_config(
        directory,
        {
            "tokenizer_class": "PreTrainedTokenizerFast",
            "bos_token": None,
            "eos_token": EOS_TOKEN,
            "pad_token": EOS_TOKEN,
            "unk_token": None,
            "add_bos_token": False,
            "add_eos_token": False,
            "clean_up_tokenization_spaces": False,
            "model_max_length": 4096,
            "added_tokens_decoder": _added_tokens_decoder(tokenizer),
            "chat_template": CHATML_TEMPLATE,
        },
    )


# ---------------------------------------------------------------------------
# SentencePiece style (Llama): ▁ for spaces, <0xNN> byte fallback
# ---------------------------------------------------------------------------

SPM_SPECIAL_TOKENS = ["<unk>", "<s>", "</s>"]


def _spm_corpus() -> List[str]:
    # Only Latin text is trained on, so CJK, Greek, Cyrillic and emoji have no
    # pieces and must be spelled with <0xNN> byte tokens.
    return [line for line in CORPUS if all(ord(c) < 0x250 for c in line)]


def _train_metaspace_merges(num_merges_target: int) -> Tuple[List[str], List]:
    """Train a Metaspace BPE; return (learned pieces, merges) without specials."""
    trainer_model = Tokenizer(models.BPE())
    trainer_model.pre_tokenizer = pre_tokenizers.Metaspace(
        replacement="▁", prepend_scheme="first"
    )
    trainer = trainers.BpeTrainer(vocab_size=num_merges_target, show_progress=False)
    trainer_model.train_from_iterator(_spm_corpus(), trainer=trainer)
    model = json.loads(trainer_model.to_str())["model"]
    pieces = sorted(model["vocab"], key=model["vocab"].get)
    merges = [tuple(m.split(" ")) if isinstance(m, str) else tuple(m) for m in model["merges"]]
    return pieces, merges


def write_spm_style_tokenizer(
    directory: Path, vocab_size: int = 400, strip_leading_space: bool = True
) -> None:
    """Write a Llama style tokenizer.json (+ config) into ``directory``.

    Vocabulary: ``<unk>``, ``<s>``, ``</s>``, the 256 ``<0xNN>`` byte tokens,
    then pieces learned on the Latin part of the corpus. The decoder is
    Replace(▁ -> space), ByteFallback, Fuse and, when ``strip_leading_space``,
    Strip(one leading space), as in Llama 2 checkpoints.
    """
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    byte_tokens = [f"<0x{b:02X}>" for b in range(256)]
    fixed = SPM_SPECIAL_TOKENS + byte_tokens
    pieces, merges = _train_metaspace_merges(vocab_size - len(fixed))
    vocab = {token: i for i, token in enumerate(fixed + pieces)}
    tokenizer = Tokenizer(
        models.BPE(vocab=vocab, merges=merges, unk_token="<unk>", byte_fallback=True)
    )
    tokenizer.pre_tokenizer = pre_tokenizers.Metaspace(
        replacement="▁", prepend_scheme="first"
    )
    steps = [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()]
    if strip_leading_space:
        steps.append(decoders.Strip(content=" ", left=1, right=0))
    tokenizer.decoder = decoders.Sequence(steps)
    tokenizer.add_special_tokens(SPM_SPECIAL_TOKENS)
    tokenizer.save(str(directory / "tokenizer.json"))
    _write_config(
        directory,
        {
            "tokenizer_class": "PreTrainedTokenizerFast",
            "bos_token": "<s>",
            "eos_token": "</s>",
            "unk_token": "<unk>",
            "pad_token": None,
            "clean_up_tokenization_spaces": False,
            "model_max_length": 4096,
            "added_tokens_decoder": _added_tokens_decoder(tokenizer),
        },
    )


# ---------------------------------------------------------------------------
# Fixtures and helpers of the tokenizer tests
# ---------------------------------------------------------------------------

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
def bpe(bpe_dir):
    from mlx_lm.tokenizer_utils import load

    return load(bpe_dir)


@pytest.fixture(scope="session")
def spm(spm_dir):
    from mlx_lm.tokenizer_utils import load

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
    """Streaming ``text``'s ids gives ``tokenizer.decode`` of them, and never shows a
    partial character (or a U+FFFD standing in for one) on the way."""
    ids = tokenizer.encode(text, add_special_tokens=False)
    expected = tokenizer.decode(ids)
    segments, texts = stream(detokenizer, ids)
    assert detokenizer.text == expected
    assert "".join(segments) == expected
    assert detokenizer.tokens == ids
    for partial_text in texts:
        assert expected.startswith(partial_text)
        assert REPLACEMENT not in partial_text
    for segment in segments:
        assert REPLACEMENT not in segment


def rewrite_decoder(source: Path, target: Path, decoder) -> None:
    """A copy of the tokenizer in ``source`` with another tokenizer.json decoder."""
    shutil.copytree(source, target)
    path = target / "tokenizer.json"
    data = json.loads(path.read_text(encoding="utf-8"))
    data["decoder"] = decoder
    path.write_text(json.dumps(data, ensure_ascii=False), encoding="utf-8")
