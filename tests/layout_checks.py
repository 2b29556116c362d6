"""What the test modules of the dense families with their own weight layouts share
(test_gpt2, test_gpt_neox, test_gptj, test_gpt_bigcode, test_qwen, test_exaone,
test_apertus): sanitize takes a fixture's checkpoint as saved once, and its own output
unchanged."""

from typing import Dict, Optional, Sequence

import mlx.core as mx
from family_checks import FIXTURES, fixture_model
from mlx.utils import tree_flatten


def raw_weights(name: str) -> Dict[str, mx.array]:
    """A fixture's weights as its checkpoint holds them (before sanitize)."""
    return mx.load(str(FIXTURES / name / "model.safetensors"))


def assert_sanitize_converts_once(name: str, extra: Optional[Dict[str, mx.array]] = None,
                                  dropped: Sequence[str] = ()) -> Dict[str, mx.array]:
    """sanitize(checkpoint + extra) names exactly the model's parameters, without the
    `dropped` keys; a second pass (the MLX layout) changes nothing. Returns the first
    pass."""
    model = fixture_model(name)
    once = model.sanitize(dict(raw_weights(name), **(extra or {})))
    assert not set(dropped) & set(once), (name, sorted(set(dropped) & set(once)))
    assert sorted(once) == sorted(k for k, _ in tree_flatten(model.parameters())), name
    again = model.sanitize(dict(once))
    assert once.keys() == again.keys() and all(mx.array_equal(once[k], again[k]) for k in once), name
    return once
