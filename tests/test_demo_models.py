"""The bundled demo pair (examples/models/, made by examples/train_demo.py): a trained
Gated-DeltaNet hybrid target and a distilled dense draft, float16, in the HF layout."""

from pathlib import Path

import pytest

from mlx_lm import load, stream_generate

MODELS = Path(__file__).resolve().parent.parent / "examples" / "models"
PROMPT = "def fibonacci(n):"


@pytest.fixture(scope="module")
def demo():
    target, tokenizer = load(str(MODELS / "qwen3-next-stdlib"))
    draft, _ = load(str(MODELS / "qwen3-draft-stdlib"))
    return target, draft, tokenizer


def test_speculative_output_equals_plain_and_the_draft_mostly_agrees(demo):
    target, draft, tokenizer = demo
    prompt = tokenizer.encode(PROMPT)
    plain = [r.token for r in stream_generate(target, tokenizer, prompt, max_tokens=48)]
    responses = list(stream_generate(target, tokenizer, prompt, max_tokens=48, draft_model=draft,
                                     num_draft_tokens=4, adaptive_draft_length=False))  # counts below need k=4
    assert [r.token for r in responses] == plain
    stats = responses[-1].speculation
    assert stats.acceptance_rate > 0.25, stats  # a trained, distilled draft: far above chance (1/4096)
    assert stats.num_target_forwards <= len(plain) / 2
    text = "".join(r.text for r in responses)
    assert any(word in text for word in ("return", "if ", "self", "def ")), text  # Python-ish
