"""mlx_lm.fuse: adapters folded into the weights give the model base + adapters is."""

import json

import mlx.core as mx
import numpy as np
import pytest
from mlx.utils import tree_flatten

from checkpoints import TINY_CONFIGS, write_checkpoint
from mlx_lm import cli, generate
from mlx_lm.convert import convert
from mlx_lm.fuse import fuse, setup_arg_parser
from mlx_lm.tuner import LoRALinear
from mlx_lm.utils import load, quantized_layers
from test_adapters import TOKENS, base_weights, random_lora, relative_error, write_adapters


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory):
    return write_checkpoint(tmp_path_factory.mktemp("base"), TINY_CONFIGS["llama"], seed=5)


@pytest.mark.parametrize("fine_tune_type", ["lora", "dora"])
def test_fused_model_equals_base_with_adapters(llama_dir, tmp_path, fine_tune_type):
    adapters, _ = write_adapters(tmp_path / "adapters", base_weights(llama_dir), fine_tune_type, num_layers=1)
    fuse(str(llama_dir), adapters, tmp_path / "fused")
    adapted, tokenizer = load(str(llama_dir), adapter_path=str(adapters))
    fused, _ = load(str(tmp_path / "fused"))
    assert not any(isinstance(m, LoRALinear) for _, m in fused.named_modules())
    assert relative_error(fused(TOKENS), adapted(TOKENS)) < 1e-5
    assert relative_error(load(str(llama_dir))[0](TOKENS), adapted(TOKENS)) > 1e-2
    prompt = "The quick brown fox"
    assert generate(fused, tokenizer, prompt, max_tokens=12) == generate(adapted, tokenizer, prompt, max_tokens=12)
    for name in ("tokenizer.json", "config.json", "model.safetensors.index.json"):
        assert (tmp_path / "fused" / name).exists()


def test_fusing_onto_a_quantized_base_keeps_the_adapted_layers_float(llama_dir, tmp_path):
    convert(str(llama_dir), tmp_path / "q4", quantize=True)
    float_weights = {k: np.array(v) for k, v in tree_flatten(load(str(llama_dir))[0].parameters())}
    keys = ["self_attn.q_proj", "mlp.down_proj"]
    adapters, _ = write_adapters(tmp_path / "adapters", float_weights, keys=keys)
    adapted, _ = load(str(tmp_path / "q4"), adapter_path=str(adapters))

    fuse(str(tmp_path / "q4"), adapters, tmp_path / "fused")
    fused, _, config = load(str(tmp_path / "fused"), return_config=True)
    float_paths = {f"model.layers.{i}.{k}" for i in range(2) for k in keys}
    base_quantized = {p.removesuffix(".linear") for p in quantized_layers(adapted)}
    assert set(quantized_layers(fused)) == base_quantized - float_paths and float_paths <= base_quantized
    assert all(config["quantization"][p] is False for p in float_paths)
    assert relative_error(fused(TOKENS), adapted(TOKENS)) < 1e-5

    cli.main(["fuse", "--model", str(tmp_path / "q4"), "--adapter-path", str(adapters),
              "--save-path", str(tmp_path / "dq"), "--de-quantize"])
    dequantized, _, config = load(str(tmp_path / "dq"), return_config=True)
    assert not quantized_layers(dequantized) and "quantization" not in config
    assert "quantization" not in json.loads((tmp_path / "dq" / "config.json").read_text())
    assert relative_error(dequantized(TOKENS), adapted(TOKENS)) < 1e-5


def test_fuse_cli_flags_and_errors(llama_dir, tmp_path):
    args = setup_arg_parser().parse_args([])
    assert (args.model, args.adapter_path, args.save_path, args.dequantize) == ("mlx_model", "adapters", "fused_model", False)
    assert setup_arg_parser().parse_args(["--dequantize"]).dequantize
    adapters, _ = write_adapters(tmp_path / "adapters", base_weights(llama_dir))
    (tmp_path / "taken").mkdir()
    with pytest.raises(SystemExit, match="already exists"):
        cli.main(["fuse", "--model", str(llama_dir), "--adapter-path", str(adapters), "--save-path", str(tmp_path / "taken")])
    with pytest.raises(SystemExit, match="no adapter_config.json"):
        cli.main(["fuse", "--model", str(llama_dir), "--adapter-path", str(tmp_path), "--save-path", str(tmp_path / "x")])
    assert not (tmp_path / "x").exists()


def test_fusing_expert_adapters(tmp_path):
    base_dir = write_checkpoint(tmp_path / "base", TINY_CONFIGS["qwen3_next"], seed=4)
    model, _ = load(str(base_dir))
    params = {k: np.array(v) for k, v in tree_flatten(model.parameters())}
    paths = [p for p, m in model.named_modules() if p.startswith("model.layers.3.") and type(m).__name__ in ("Linear", "SwitchLinear")]
    directory = tmp_path / "adapters"
    directory.mkdir()
    (directory / "adapter_config.json").write_text(json.dumps({"num_layers": 1, "lora_parameters": {"rank": 3, "scale": 1.5}}))
    tensors = random_lora(params, paths, 3, np.random.default_rng(2))
    mx.save_safetensors(str(directory / "adapters.safetensors"), {k: mx.array(v) for k, v in tensors.items()})
    fuse(str(base_dir), directory, tmp_path / "fused")
    adapted, _ = load(str(base_dir), adapter_path=str(directory))
    fused, _ = load(str(tmp_path / "fused"))
    assert relative_error(fused(TOKENS), adapted(TOKENS)) < 1e-5
    assert relative_error(model(TOKENS), adapted(TOKENS)) > 1e-3


def test_upload_repo_uploads_the_fused_folder_and_fails_clearly_offline(llama_dir, tmp_path, monkeypatch):
    from huggingface_hub import HfApi
    from huggingface_hub.errors import OfflineModeIsEnabled

    calls = []
    monkeypatch.setattr(HfApi, "create_repo", lambda self, repo_id, exist_ok: calls.append(("create", repo_id)))
    monkeypatch.setattr(HfApi, "upload_folder",
                        lambda self, folder_path, repo_id, repo_type: calls.append(("upload", folder_path, repo_id)))
    adapters, _ = write_adapters(tmp_path / "adapters", base_weights(llama_dir))
    flags = ["fuse", "--model", str(llama_dir), "--adapter-path", str(adapters)]
    cli.main(flags + ["--save-path", str(tmp_path / "up"), "--upload-repo", "me/fused"])
    assert calls == [("create", "me/fused"), ("upload", str(tmp_path / "up"), "me/fused")]
    assert 'load("me/fused")' in (tmp_path / "up" / "README.md").read_text()

    with pytest.raises(SystemExit, match="Hub repo id 'no-namespace' must be of the form"):
        cli.main(flags + ["--save-path", str(tmp_path / "bad"), "--upload-repo", "no-namespace"])
    assert not (tmp_path / "bad").exists()

    def offline(self, repo_id, exist_ok):
        raise OfflineModeIsEnabled("offline mode is enabled")

    monkeypatch.setattr(HfApi, "create_repo", offline)
    with pytest.raises(SystemExit, match="Could not upload .* 'me/fused': OfflineModeIsEnabled"):
        cli.main(flags + ["--save-path", str(tmp_path / "off"), "--upload-repo", "me/fused"])
    assert (tmp_path / "off" / "config.json").exists()


def test_trust_remote_code_reaches_the_tokenizer(llama_dir, tmp_path, monkeypatch):
    from mlx_lm import tokenizer_utils

    asked = []
    real_load = tokenizer_utils.load
    monkeypatch.setattr(tokenizer_utils, "load",
                        lambda path, extra=None, **kw: asked.append(extra) or real_load(path, extra, **kw))
    adapters, _ = write_adapters(tmp_path / "adapters", base_weights(llama_dir))
    flags = ["fuse", "--model", str(llama_dir), "--adapter-path", str(adapters)]
    cli.main(flags + ["--save-path", str(tmp_path / "plain")])
    cli.main(flags + ["--save-path", str(tmp_path / "trusted"), "--trust-remote-code"])
    assert asked == [None, {"trust_remote_code": True}]
