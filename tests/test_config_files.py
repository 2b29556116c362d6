"""config_files.py: save_config's keys (upstream's vision_config and quantization_config
rules) and its round trip through load_config."""

import json
import math

from mlx_lm.config_files import load_config, save_config


def test_save_config_drops_bookkeeping_and_vision_config_unless_kept(tmp_path):
    config = {"model_type": "gemma3", "_name_or_path": "/home/me/x", "vision_config": {"hidden_size": 8},
              "text_config": {"hidden_size": 16}}
    save_config(config, tmp_path / "config.json")
    assert json.loads((tmp_path / "config.json").read_text()) == {"model_type": "gemma3",
                                                                   "text_config": {"hidden_size": 16}}
    save_config(config, tmp_path / "kept.json", keep_vision_config=True)
    assert json.loads((tmp_path / "kept.json").read_text())["vision_config"] == {"hidden_size": 8}
    assert "_name_or_path" in config and "vision_config" in config  # the caller's dict is left as it is


def test_save_config_mirrors_quantization_and_sorts(tmp_path):
    block = {"group_size": 32, "bits": 4, "mode": "affine", "lm_head": False}
    save_config({"quantization": block, "a": math.inf, "model_type": "llama"}, tmp_path / "config.json")
    text = (tmp_path / "config.json").read_text()
    written = json.loads(text)
    assert written["quantization_config"] == block == written["quantization"]
    assert list(written) == ["a", "model_type", "quantization", "quantization_config"]
    assert written["a"] == {"__float__": "Infinity"}
    assert load_config(tmp_path)["a"] == math.inf
