"""models/checkpoint_files.py: a CheckpointedCache's snapshots go into its prompt-cache
file in a way upstream's loader (and load_prompt_cache) ignores, and come back from
it: a prompt diverging inside the cached one resumes at a snapshot and continues as a
cold run, bit for bit."""

import json

import mlx.core as mx
import pytest
from family_checks import fixture_model
from mlx.utils import tree_unflatten
from test_checkpoints import FAMILIES, PROMPT, STEP, assert_same_caches, tokens

from mlx_lm.cache_prompt import fill_cache, tokens_after_cache
from mlx_lm.generate import generate_step
from mlx_lm.models.cache import load_prompt_cache, make_prompt_cache
from mlx_lm.models.checkpoint_files import SNAPSHOTS_KEY, load_checkpointed, save_checkpointed
from mlx_lm.models.checkpoints import CheckpointedCache


def filled_file(tmp_path, family):
    """A file of PROMPT fed in prefill chunks of STEP, with snapshots at 8..40."""
    model = fixture_model(FAMILIES[family])
    prompt_cache = CheckpointedCache(make_prompt_cache(model), STEP, 1 << 40)
    fill_cache(model, PROMPT, prompt_cache, lambda c: None, step_size=STEP)
    path = str(tmp_path / "prompt.safetensors")
    save_checkpointed(path, prompt_cache, {"model": "fixture"})
    return model, prompt_cache, path


@pytest.mark.parametrize("family", ["gated_deltanet", "sliding_window"])
def test_a_loaded_cache_resumes_at_a_snapshot_as_a_cold_run(tmp_path, family):
    model, saved, path = filled_file(tmp_path, family)
    loaded, metadata = load_checkpointed(path)
    assert metadata == {"model": "fixture"}
    assert isinstance(loaded, CheckpointedCache) and loaded.positions() == saved.positions() == [8, 16, 24, 32, 40]
    assert loaded.held_tokens() == len(PROMPT)
    assert_same_caches(loaded, saved)
    prompt = PROMPT[:21] + tokens(1, 10)  # diverges at 21: back to the snapshot at 16
    remaining = tokens_after_cache(loaded, PROMPT, prompt)
    assert remaining == prompt[16:]
    resumed = list(generate_step(mx.array(remaining), model, max_tokens=4, prompt_cache=loaded, prefill_step_size=STEP))
    cold_cache = make_prompt_cache(model)
    cold = list(generate_step(mx.array(prompt), model, max_tokens=4, prompt_cache=cold_cache, prefill_step_size=STEP))
    assert [t for t, _ in resumed] == [t for t, _ in cold]
    assert all(mx.array_equal(a, b).item() for (_, a), (_, b) in zip(resumed, cold))
    assert_same_caches(loaded, cold_cache)


def test_upstreams_loader_and_load_prompt_cache_ignore_the_snapshots(tmp_path):
    _, saved, path = filled_file(tmp_path, "gated_deltanet")
    plain = load_prompt_cache(path)
    assert type(plain) is list and len(plain) == len(saved)
    assert_same_caches(plain, saved)
    # Upstream 0.32.2's reading: three metadata sections, states zipped with the class names.
    tensors, strings = mx.load(path, return_metadata=True)
    metadata, classes, _ = tree_unflatten(list(strings.items()))
    states = tree_unflatten(list(tensors.items()))
    assert len(classes) == len(saved) < len(states)  # the snapshots sit past the entries
    assert [c for c, _ in zip(classes, states)] == [type(e).__name__ for e in saved]
    assert SNAPSHOTS_KEY in metadata and metadata["model"] == "fixture"


def test_reserved_key_and_malformed_records_are_refused(tmp_path):
    _, saved, path = filled_file(tmp_path, "gated_deltanet")
    with pytest.raises(ValueError, match=f"metadata key '{SNAPSHOTS_KEY}' is reserved"):
        save_checkpointed(path, saved, {SNAPSHOTS_KEY: "x"})
    tensors, strings = mx.load(path, return_metadata=True)
    record = json.loads(strings[f"0.{SNAPSHOTS_KEY}"])
    record["snapshots"][0]["entries"] = record["snapshots"][0]["entries"][:1]
    strings[f"0.{SNAPSHOTS_KEY}"] = json.dumps(record)
    mx.save_safetensors(path, tensors, strings)
    with pytest.raises(ValueError, match=r"malformed mlx_lm_snapshots record: a snapshot describes 1 entries"):
        load_checkpointed(path)


def test_a_plain_list_is_saved_as_save_prompt_cache_saves_it(tmp_path):
    model = fixture_model(FAMILIES["gated_deltanet"])
    prompt_cache = make_prompt_cache(model)
    fill_cache(model, PROMPT, prompt_cache, lambda c: None, step_size=STEP)
    save_checkpointed(str(tmp_path / "plain"), prompt_cache)
    loaded, metadata = load_checkpointed(str(tmp_path / "plain.safetensors"))
    assert type(loaded) is list and metadata == {}
    assert_same_caches(loaded, prompt_cache)
