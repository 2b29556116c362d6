"""Checks the sliding-window families' test modules share beyond family_checks.py
(test_gemma2, test_cohere2, test_exaone4, test_olmo3): sanitize on both layouts, and
that a fixture depends on a config feature."""

from typing import Any, Dict, Sequence

import mlx.core as mx
from family_checks import FIXTURES, fixture_model, reference, relative_error
from mlx.utils import tree_flatten

from mlx_lm.utils import load_model


def assert_sanitize_is_idempotent(fixtures: Sequence[str]) -> None:
    """transformers' layout passes once; an extra rope buffer and, when tied, an
    `lm_head` copy (upstream mlx-lm writes one) are dropped; a second pass (the MLX
    layout) changes nothing, and the result names exactly the model's parameters."""
    for name in fixtures:
        model = fixture_model(name)
        raw = mx.load(str(FIXTURES / name / "model.safetensors"))
        extra = dict(raw, **{"model.rotary_emb.inv_freq": mx.ones((8,)),
                             "lm_head.weight": raw["model.embed_tokens.weight"]})
        once = model.sanitize(extra)
        assert "model.rotary_emb.inv_freq" not in once, name
        assert ("lm_head.weight" in once) == (not model.args.tie_word_embeddings), name
        again = model.sanitize(dict(once))
        assert once.keys() == again.keys() and all(mx.array_equal(once[k], again[k]) for k in once), name
        assert sorted(once) == sorted(k for k, _ in tree_flatten(model.parameters())), name


def assert_override_matters(name: str, override: Dict[str, Any]) -> None:
    """The fixture loaded with `override` is far from transformers' logits: the
    feature the override removes is exercised (and read from the fixture's config)."""
    ids, want = reference(name)
    changed, _ = load_model(FIXTURES / name, model_config=override)
    assert relative_error(changed(ids), want) > 1e-2, override
