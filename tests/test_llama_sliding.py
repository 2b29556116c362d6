"""llama.py's sliding-window attention (Mistral's `sliding_window`, Ministral's mixed
`layer_types`) against transformers, past the window, through RotatingKVCache.

Fixtures from fixtures/make_phi3_reference.py: mistral_tf4 (MistralConfig, window 8 on
both layers, transformers-4 dialect) and ministral_tf5 (MinistralConfig, layer_types
[sliding, full], window 8, transformers-5 dialect), 24 tokens each, so every window
edge is crossed twice; the loader maps model_type "ministral" to llama.py.
"""

import copy

import mlx.core as mx
import pytest
from checkpoints import write_checkpoint
from conftest import FIXTURES
from test_gpt_oss import decode_in_chunks, relative_error

from mlx_lm.generate import SpeculationStats, generate_step, speculative_generate_step
from mlx_lm.models import qwen2
from mlx_lm.models.cache import KVCache, RotatingKVCache
from mlx_lm.models.llama import FULL, SLIDING, ModelArgs
from mlx_lm.utils import load_model

TOLERANCE = 1e-4
FIXTURE_NAMES = ["mistral_tf4", "ministral_tf5"]


def load_fixture(name, **override):
    model, _ = load_model(FIXTURES / name, model_config=override)
    return model, mx.load(str(FIXTURES / name / "reference.safetensors"))


@pytest.mark.parametrize("name", FIXTURE_NAMES)
def test_full_forward_matches_transformers(name):
    model, ref = load_fixture(name)
    assert ref["input_ids"].shape[1] >= 3 * model.args.sliding_window
    assert relative_error(model(ref["input_ids"]), ref["logits"]) < TOLERANCE


@pytest.mark.parametrize("name", FIXTURE_NAMES)
@pytest.mark.parametrize("chunk", [1, 5, 24])
def test_cached_decode_matches_transformers(name, chunk):
    model, ref = load_fixture(name)
    assert relative_error(decode_in_chunks(model, ref["input_ids"], chunk), ref["incremental_logits"]) < TOLERANCE


@pytest.mark.parametrize("name", FIXTURE_NAMES)
def test_the_window_matters(name):
    model, ref = load_fixture(name, sliding_window=1000)
    assert relative_error(model(ref["input_ids"]), ref["logits"]) > 1e-2


def test_layer_kinds_and_caches():
    mistral, _ = load_fixture("mistral_tf4")
    assert mistral.args.layer_types == [SLIDING, SLIDING]
    assert all(type(c) is RotatingKVCache and c.max_size == 8 for c in mistral.make_cache())
    ministral, _ = load_fixture("ministral_tf5")
    assert [type(c) for c in ministral.make_cache()] == [RotatingKVCache, KVCache]


BASE = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4, vocab_size=256)


def test_which_configs_slide():
    """A bare sliding_window slides every layer only for Mistral, as in transformers:
    Llama has no window, Qwen2/3 carry one that their layer_types switch on."""
    assert ModelArgs.from_dict(dict(BASE, model_type="mistral", sliding_window=4096)).layer_types == [SLIDING] * 2
    assert ModelArgs.from_dict(dict(BASE, model_type="mistral", sliding_window=None)).layer_types == [FULL] * 2
    assert ModelArgs.from_dict(dict(BASE, model_type="llama", sliding_window=4096)).layer_types == [FULL] * 2
    qwen = qwen2.ModelArgs.from_dict(dict(BASE, model_type="qwen2", sliding_window=32768, use_sliding_window=False))
    assert qwen.layer_types == [FULL] * 2
    mixed = dict(BASE, model_type="mistral", sliding_window=8, layer_types=[FULL, SLIDING])
    frozen = copy.deepcopy(mixed)
    assert ModelArgs.from_dict(mixed).layer_types == [FULL, SLIDING] and mixed == frozen


def test_config_errors_name_the_value():
    with pytest.raises(ValueError, match="sliding_window is None"):
        ModelArgs.from_dict(dict(BASE, model_type="llama", layer_types=[SLIDING, FULL]))
    with pytest.raises(ValueError, match="3 entries but num_hidden_layers is 2"):
        ModelArgs.from_dict(dict(BASE, model_type="llama", sliding_window=8, layer_types=[SLIDING] * 3))
    with pytest.raises(ValueError, match="chunked"):
        ModelArgs.from_dict(dict(BASE, model_type="llama", sliding_window=8, layer_types=[SLIDING, "chunked"]))


MISTRAL = dict(BASE, model_type="mistral", intermediate_size=128, num_key_value_heads=2, vocab_size=512,
               sliding_window=6, layer_types=[SLIDING, FULL])


@pytest.mark.parametrize("k", [2, 4])
def test_greedy_speculative_equals_plain_past_the_window(tmp_path, k):
    target = load_model(write_checkpoint(tmp_path / "t", MISTRAL))[0]
    draft = load_model(write_checkpoint(tmp_path / "d", MISTRAL, noise=0.02))[0]
    prompt = mx.array([(i * 53 + 7) % 512 for i in range(9)])
    want = [t for t, _ in generate_step(prompt, target, max_tokens=24)]
    stats = SpeculationStats()
    out = list(speculative_generate_step(prompt, target, draft, num_draft_tokens=k, max_tokens=24,
                                         adaptive_draft_length=False, stats=stats))
    assert [t for t, _, _ in out] == want
    assert 0 < stats.num_accepted < stats.num_drafted, stats
