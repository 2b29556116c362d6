"""llama.py and the families built on it (qwen2.py, qwen3.py) against transformers.

Fixtures under tests/fixtures/<family>_<dialect>/ come from make_reference.py: tiny
random checkpoints saved by transformers, with config.json in the transformers-4
(`rope_theta`, `rope_scaling`) or transformers-5 (`rope_parameters`) dialect, and the
transformers fp32 logits for a fixed token sequence.
"""

import json
import shutil

import mlx.core as mx
import pytest
from conftest import FIXTURES

from mlx_lm.models.cache import make_prompt_cache
from mlx_lm.utils import load_model

DENSE_FIXTURES = ["llama_tf4", "llama_tf5", "qwen2_tf4", "qwen2_tf5", "qwen3_tf4", "qwen3_tf5"]
TOLERANCE = 1e-4  # fp32 on both sides; observed errors are ~1e-6


def relative_error(got: mx.array, want: mx.array) -> float:
    return (mx.abs(got - want).max() / mx.abs(want).max()).item()


def load_fixture(name):
    model, _ = load_model(FIXTURES / name)
    reference = mx.load(str(FIXTURES / name / "reference.safetensors"))
    return model, reference["input_ids"], reference["logits"]


@pytest.mark.parametrize("name", DENSE_FIXTURES)
def test_full_forward_matches_transformers(name):
    model, ids, want = load_fixture(name)
    assert relative_error(model(ids), want) < TOLERANCE


@pytest.mark.parametrize("name", DENSE_FIXTURES)
def test_cached_decode_matches_transformers(name):
    """Token by token, and in chunks of 5, through the model's own caches."""
    model, ids, want = load_fixture(name)
    for chunk in (1, 5):
        cache = make_prompt_cache(model)
        pieces = [model(ids[:, i : i + chunk], cache=cache) for i in range(0, ids.shape[1], chunk)]
        assert relative_error(mx.concatenate(pieces, axis=1), want) < TOLERANCE
        assert cache[0].offset == ids.shape[1]


@pytest.mark.parametrize("name", ["llama_tf5", "qwen2_tf5"])
def test_rope_parameters_are_read(name, tmp_path):
    """Dropping rope_parameters (upstream 0.32 ignores them) gives visibly wrong logits,
    so the tests above do check that the transformers-5 dialect is honoured."""
    directory = tmp_path / name
    shutil.copytree(FIXTURES / name, directory)
    config = json.loads((directory / "config.json").read_text())
    del config["rope_parameters"]
    (directory / "config.json").write_text(json.dumps(config))
    model, _ = load_model(directory)
    reference = mx.load(str(directory / "reference.safetensors"))
    assert relative_error(model(reference["input_ids"]), reference["logits"]) > 1e-2


def test_tied_embeddings_have_no_lm_head():
    model, _ = load_model(FIXTURES / "qwen2_tf4")
    assert model.args.tie_word_embeddings and "lm_head" not in model
    model, _ = load_model(FIXTURES / "qwen2_tf5")
    assert "lm_head" in model


@pytest.mark.parametrize("name", ["llama_tf5", "qwen3_tf4"])
def test_sanitize_is_idempotent(name):
    model, _ = load_model(FIXTURES / name)
    raw = mx.load(str(FIXTURES / name / "model.safetensors"))
    raw["model.layers.0.self_attn.rotary_emb.inv_freq"] = mx.ones((8,))
    once = model.sanitize(raw)
    twice = model.sanitize(dict(once))
    assert once.keys() == twice.keys()
    assert all(mx.array_equal(once[k], twice[k]) for k in once)
    assert not any("rotary_emb" in k for k in once)


def test_qwen_bias_layout():
    """qwen2: biases on q, k, v only; qwen3: per-head q/k norms, no biases."""
    qwen2, _ = load_model(FIXTURES / "qwen2_tf4")
    attn = qwen2.layers[0].self_attn
    assert "bias" in attn.q_proj and "bias" in attn.v_proj and "bias" not in attn.o_proj
    qwen3, _ = load_model(FIXTURES / "qwen3_tf4")
    attn = qwen3.layers[0].self_attn
    assert "bias" not in attn.q_proj and attn.q_norm.weight.shape == (24,)
