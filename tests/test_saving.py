"""saving.py: save_model (donating the model, the index), save (a complete directory,
from a local checkpoint or a cached hub snapshot)."""

import json
import shutil

import mlx.core as mx
import pytest
from mlx.utils import tree_flatten

from mlx_lm.saving import save, save_model
from mlx_lm.tokenizer_utils import load as load_tokenizer
from mlx_lm.utils import get_total_parameters, load_model

TOKENS = mx.array([[5, 17, 260, 33, 101, 7]])


def test_donated_model_is_emptied_and_its_weights_saved(tmp_path, tiny_llama_dir):
    model, _ = load_model(tiny_llama_dir)
    want = {k: mx.array(v) for k, v in tree_flatten(model.parameters())}
    num_parameters = get_total_parameters(model)
    save_model(tmp_path / "m", model, donate_model=True, max_shard_bytes=100_000)
    assert all(v.size == 0 for _, v in tree_flatten(model.parameters()))
    index = json.loads((tmp_path / "m" / "model.safetensors.index.json").read_text())
    assert index["metadata"] == {"total_parameters": num_parameters, "total_size": sum(v.nbytes for v in want.values())}
    assert len(set(index["weight_map"].values())) > 1  # sharded
    got = {}
    for name in set(index["weight_map"].values()):
        got.update(mx.load(str(tmp_path / "m" / name)))
    assert got.keys() == want.keys() and all(mx.array_equal(got[k], want[k]) for k in want)


def test_kept_model_still_runs_and_weights_dicts_cannot_be_donated(tmp_path, tiny_llama_dir):
    model, _ = load_model(tiny_llama_dir)
    before = model(TOKENS)
    save_model(tmp_path / "kept", model)
    assert mx.array_equal(model(TOKENS), before)
    with pytest.raises(ValueError, match="donate_model=True needs the model"):
        save_model(tmp_path / "dict", dict(tree_flatten(model.parameters())), donate_model=True)


def test_save_writes_a_loadable_directory_with_card_and_extra_files(tmp_path, tiny_llama_dir):
    source = shutil.copytree(tiny_llama_dir, tmp_path / "src")
    (source / "tokenization_custom.py").write_text("# a tokenizer's remote code\n")
    model, config = load_model(source)
    reference = model(TOKENS)
    save(tmp_path / "out", source, model, load_tokenizer(source), config)  # donates, as upstream
    assert all(v.size == 0 for _, v in tree_flatten(model.parameters()))
    out = tmp_path / "out"
    assert (out / "tokenization_custom.py").read_text() == "# a tokenizer's remote code\n"
    card = (out / "README.md").read_text()
    assert "library_name: mlx" in card and "- mlx" in card and "base_model" not in card
    assert mx.array_equal(load_model(out)[0](TOKENS), reference)


def test_save_from_a_cached_hub_repo_names_it_as_base_model(tmp_path, tiny_llama_dir, monkeypatch):
    from huggingface_hub import constants

    snapshot = tmp_path / "hub" / "models--org--tiny" / "snapshots" / "0123abcd"
    shutil.copytree(tiny_llama_dir, snapshot)
    (snapshot / "generation_config.json").write_text('{"eos_token_id": 2}')
    (tmp_path / "hub" / "models--org--tiny" / "refs").mkdir()
    (tmp_path / "hub" / "models--org--tiny" / "refs" / "main").write_text("0123abcd")
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    model, config = load_model(snapshot)
    save(tmp_path / "out", "org/tiny", model, load_tokenizer(snapshot), config, donate_model=False)
    assert "base_model: org/tiny" in (tmp_path / "out" / "README.md").read_text()
    assert json.loads((tmp_path / "out" / "generation_config.json").read_text()) == {"eos_token_id": 2}
    assert model(TOKENS).shape == (1, 6, 512)  # not donated


@pytest.mark.parametrize("source", ["/no/such/dir", "org/not-cached"])
def test_save_names_a_source_it_cannot_find_before_writing(tmp_path, tiny_llama_dir, source):
    model, config = load_model(tiny_llama_dir)
    with pytest.raises(FileNotFoundError, match=f"the source '{source}' is neither a directory nor a hub repo"):
        save(tmp_path / "out", source, model, load_tokenizer(tiny_llama_dir), config)
    assert list(tmp_path.iterdir()) == [] and model(TOKENS).shape == (1, 6, 512)
