"""utils.py: finding and loading checkpoints, with clear errors for bad ones."""

import json
import shutil

import mlx.core as mx
import pytest
from checkpoints import TINY_CONFIGS, write_checkpoint
from conftest import FIXTURES

from mlx_lm.tokenizer_utils import TokenizerWrapper
from mlx_lm.utils import get_model_path, load, load_model


def copy_fixture(tmp_path, name="llama_tf4"):
    return shutil.copytree(FIXTURES / name, tmp_path / name)


def edit_config(directory, **changes):
    config = json.loads((directory / "config.json").read_text())
    for key, value in changes.items():
        if value is None:
            config.pop(key, None)
        else:
            config[key] = value
    (directory / "config.json").write_text(json.dumps(config))


def test_load_returns_model_tokenizer_and_config(tiny_model_dir):
    model, tokenizer, config = load(str(tiny_model_dir), return_config=True)
    assert isinstance(tokenizer, TokenizerWrapper) and config["model_type"] == "qwen3"
    assert tokenizer.eos_token_ids == {0}
    assert model(mx.array([[1, 2, 3]])).shape == (1, 3, config["vocab_size"])


def test_generation_config_eos_and_model_config_override(tmp_path):
    directory = write_checkpoint(tmp_path / "m", TINY_CONFIGS["llama"])
    (directory / "generation_config.json").write_text(json.dumps({"eos_token_id": [0, 2]}))
    _, tokenizer = load(str(directory))
    assert tokenizer.eos_token_ids == {0, 2}
    model, _ = load(str(directory), model_config={"rms_norm_eps": 1e-3})
    assert model.args.rms_norm_eps == 1e-3


def test_lazy_load_and_mistral_remapping(tmp_path):
    directory = copy_fixture(tmp_path)
    edit_config(directory, model_type="mistral")
    model, config = load_model(directory, lazy=True)
    assert type(model).__module__ == "mlx_lm.models.llama" and config["model_type"] == "mistral"


def test_sharded_weights_are_all_read(tmp_path):
    directory = copy_fixture(tmp_path)
    weights = mx.load(str(directory / "model.safetensors"))
    names = sorted(weights)
    (directory / "model.safetensors").unlink()
    mx.save_safetensors(str(directory / "model-00001-of-00002.safetensors"), {k: weights[k] for k in names[:5]})
    mx.save_safetensors(str(directory / "model-00002-of-00002.safetensors"), {k: weights[k] for k in names[5:]})
    model, _ = load_model(directory)
    reference = mx.load(str(directory / "reference.safetensors"))
    assert mx.allclose(model(reference["input_ids"]), reference["logits"], atol=1e-4)


def test_missing_path_and_offline_repo_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="does-not-exist"):
        get_model_path(str(tmp_path / "does-not-exist"))
    with pytest.raises(FileNotFoundError, match="org/not-cached-model"):
        get_model_path("org/not-cached-model")
    a_file = tmp_path / "weights.bin"
    a_file.write_bytes(b"")
    with pytest.raises(ValueError, match="is a file"):
        get_model_path(str(a_file))


@pytest.mark.parametrize(
    "changes, error, message",
    [
        (dict(model_type=None), ValueError, "no model_type"),
        (dict(model_type="transformer-xxl"), ValueError, "'transformer-xxl' not supported"),
        (dict(hidden_size=32), ValueError, "shape mismatches: model.embed_tokens.weight"),
        (dict(num_hidden_layers=3), ValueError, "missing 9 weights: model.layers.2"),
        (dict(num_attention_heads=3, num_key_value_heads=2), ValueError, "multiple of num_key_value_heads"),
        (dict(rope_scaling={"rope_type": "longrope"}), ValueError, "Unsupported rope_type 'longrope'"),
    ],
)
def test_bad_configs_get_clear_errors(tmp_path, changes, error, message):
    directory = copy_fixture(tmp_path)
    edit_config(directory, **changes)
    with pytest.raises(error, match=message):
        load_model(directory)


def test_bad_files_get_clear_errors(tmp_path):
    directory = copy_fixture(tmp_path)
    weights = mx.load(str(directory / "model.safetensors"))
    weights["model.extra.weight"] = mx.zeros((2,))
    mx.save_safetensors(str(directory / "model.safetensors"), weights)
    with pytest.raises(ValueError, match="unexpected 1 weights: model.extra.weight"):
        load_model(directory)

    (directory / "model.safetensors").write_bytes(b"\x10\x00\x00\x00not a safetensors file")
    with pytest.raises(ValueError, match="Could not read weights file"):
        load_model(directory)
    (directory / "model.safetensors").unlink()
    with pytest.raises(FileNotFoundError, match="No model.*safetensors"):
        load_model(directory)
    (directory / "config.json").write_text("{not json")
    with pytest.raises(ValueError, match="Malformed"):
        load_model(directory)
    (directory / "config.json").unlink()
    with pytest.raises(FileNotFoundError, match="No config.json"):
        load_model(directory)
