"""Loading fine-tuned adapters (tuner/) through `load(..., adapter_path=...)`.

Adapter directories are written here in the layout upstream's trainer saves
(adapter_config.json + adapters.safetensors with `<module>.lora_a`, `.lora_b`, DoRA
`.m`). The reference is the merged checkpoint computed with numpy from the formulas
(LoRA: W + scale (A B)^T; DoRA: that, each row rescaled to norm m), loaded as a plain
model: base + adapters must give its logits.
"""

import json
import shutil
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from mlx.utils import tree_flatten

from checkpoints import TINY_CONFIGS, write_checkpoint
from mlx_lm import tokenizer_utils
from mlx_lm.convert import convert
from mlx_lm.tuner import DoRALinear, LoRALinear
from mlx_lm.utils import dequantize_model, load, load_adapters, load_model, load_tokenizer

TOKENS = mx.array([[5, 17, 200, 33, 8, 401, 2]])
BLOCK_LINEARS = [f"self_attn.{p}_proj" for p in "qkvo"] + [f"mlp.{p}_proj" for p in ("gate", "up", "down")]


def base_weights(model_dir: Path) -> dict:
    return {k: np.array(v) for k, v in mx.load(str(model_dir / "model.safetensors")).items()}


def write_adapters(directory, weights, fine_tune_type="lora", num_layers=2, rank=4, scale=2.0, keys=None, seed=0,
                   num_blocks=2):
    """An adapter directory for a llama-style checkpoint whose float weights are
    `weights` (name -> (out, in) array); returns (directory, {tensor name: array})."""
    rng = np.random.default_rng(seed)
    directory = Path(directory)
    directory.mkdir(parents=True)
    blocks = range(num_blocks - num_layers, num_blocks) if num_layers > 0 else range(num_blocks)
    tensors = {}
    for i in blocks:
        for key in keys or BLOCK_LINEARS:
            path = f"model.layers.{i}.{key}"
            out_dims, in_dims = weights[f"{path}.weight"].shape
            tensors[f"{path}.lora_a"] = rng.standard_normal((in_dims, rank)).astype(np.float32) * 0.2
            tensors[f"{path}.lora_b"] = rng.standard_normal((rank, out_dims)).astype(np.float32) * 0.2
            if fine_tune_type == "dora":
                tensors[f"{path}.m"] = (1 + rng.random(out_dims)).astype(np.float32)
    config = {"fine_tune_type": fine_tune_type, "num_layers": num_layers, "model": "base", "iters": 10,
              "lora_parameters": {"rank": rank, "scale": scale, "dropout": 0.05}}
    if keys is not None:
        config["lora_parameters"]["keys"] = keys
    (directory / "adapter_config.json").write_text(json.dumps(config))
    mx.save_safetensors(str(directory / "adapters.safetensors"), {k: mx.array(v) for k, v in tensors.items()})
    return directory, tensors


def merged_weights(weights, tensors, scale, dora=False) -> dict:
    """The numpy reference: every adapted weight with its update folded in."""
    merged = dict(weights)
    for name in tensors:
        if not name.endswith(".lora_a"):
            continue
        path = name[: -len(".lora_a")]
        w = weights[f"{path}.weight"] + scale * (tensors[f"{path}.lora_a"] @ tensors[f"{path}.lora_b"]).T
        if dora:
            w = w * (tensors[f"{path}.m"] / np.linalg.norm(w, axis=1))[:, None]
        merged[f"{path}.weight"] = w.astype(np.float32)
    return merged


def reference_logits(model_dir: Path, weights: dict, directory: Path) -> mx.array:
    shutil.copytree(model_dir, directory)
    mx.save_safetensors(str(directory / "model.safetensors"), {k: mx.array(v) for k, v in weights.items()})
    return load_model(directory)[0](TOKENS)


def relative_error(got: mx.array, want: mx.array) -> float:
    return (mx.abs(got - want).max() / mx.abs(want).max()).item()


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory) -> Path:
    return write_checkpoint(tmp_path_factory.mktemp("base"), TINY_CONFIGS["llama"], seed=3)


@pytest.mark.parametrize(
    "fine_tune_type, num_layers, keys",
    [("lora", -1, None), ("lora", 1, ["self_attn.q_proj", "mlp.down_proj"]), ("dora", 2, None)],
)
def test_adapters_give_the_merged_models_logits(llama_dir, tmp_path, fine_tune_type, num_layers, keys):
    weights = base_weights(llama_dir)
    adapters, tensors = write_adapters(tmp_path / "adapters", weights, fine_tune_type, num_layers, keys=keys)
    # upstream's positional order: path, tokenizer_config, model_config, adapter_path
    model, _ = load(str(llama_dir), None, None, str(adapters))
    want = reference_logits(llama_dir, merged_weights(weights, tensors, 2.0, fine_tune_type == "dora"), tmp_path / "m")
    got = model(TOKENS)
    assert relative_error(got, want) < 1e-5
    assert relative_error(load(str(llama_dir))[0](TOKENS), want) > 1e-2  # the adapters matter
    adapted = {p for p, m in model.named_modules() if isinstance(m, (LoRALinear, DoRALinear))}
    assert adapted == {n[: -len(".lora_a")] for n in tensors if n.endswith(".lora_a")}
    assert not model.training


def test_lora_on_a_quantized_base(llama_dir, tmp_path):
    convert(str(llama_dir), tmp_path / "q4", quantize=True)
    dequantized = dequantize_model(load_model(tmp_path / "q4")[0])
    weights = {k: np.array(v) for k, v in tree_flatten(dequantized.parameters())}
    adapters, tensors = write_adapters(tmp_path / "adapters", weights, keys=["self_attn.v_proj", "mlp.up_proj"])
    model, _ = load(str(tmp_path / "q4"), adapter_path=str(adapters))
    assert "scales" in model.layers[1].self_attn.v_proj.linear  # the base stays quantized
    merged = merged_weights(weights, tensors, 2.0)
    dequantized.load_weights([(k, mx.array(v)) for k, v in merged.items()])
    assert relative_error(model(TOKENS), dequantized(TOKENS)) < 1e-4


def test_full_fine_tune_replaces_tensors(llama_dir, tmp_path):
    directory = tmp_path / "full"
    directory.mkdir()
    (directory / "adapter_config.json").write_text(json.dumps({"fine_tune_type": "full"}))
    norm = mx.full((64,), 0.5)
    mx.save_safetensors(str(directory / "adapters.safetensors"), {"model.norm.weight": norm})
    model, _ = load(str(llama_dir), adapter_path=str(directory))
    assert mx.array_equal(model.model.norm.weight, norm)


def _adapter_dir(tmp_path, llama_dir, **kwargs):
    return write_adapters(tmp_path / "a", base_weights(llama_dir), **kwargs)[0]


def _rewrite_config(directory, **changes):
    config = json.loads((directory / "adapter_config.json").read_text())
    config.update(changes)
    (directory / "adapter_config.json").write_text(json.dumps(config))


def _drop_tensor(directory, name):
    tensors = mx.load(str(directory / "adapters.safetensors"))
    del tensors[name]
    mx.save_safetensors(str(directory / "adapters.safetensors"), tensors)


def _add_tensor(directory, name, value):
    tensors = mx.load(str(directory / "adapters.safetensors"))
    tensors[name] = value
    mx.save_safetensors(str(directory / "adapters.safetensors"), tensors)


MALFORMED = [
    (lambda d: (d / "adapter_config.json").unlink(), FileNotFoundError, "no adapter_config.json"),
    (lambda d: (d / "adapters.safetensors").unlink(), FileNotFoundError, "no adapters.safetensors"),
    (lambda d: (d / "adapter_config.json").write_text("{oops"), ValueError, "Malformed"),
    (lambda d: _rewrite_config(d, fine_tune_type="qlora"), ValueError, "fine_tune_type 'qlora'"),
    (lambda d: _rewrite_config(d, num_layers="all"), ValueError, "num_layers must be an int"),
    (lambda d: _rewrite_config(d, lora_parameters={"rank": 4}), ValueError, 'with "rank" and "scale"'),
    (lambda d: _rewrite_config(d, lora_parameters={"rank": 0, "scale": 1.0}), ValueError, "rank must be at least 1"),
    (lambda d: _rewrite_config(d, lora_parameters={"rank": 8, "scale": 1.0}), ValueError, r"file \(64, 4\) vs model \(64, 8\)"),
    (lambda d: _rewrite_config(d, lora_parameters={"rank": 4, "scale": 1.0, "keys": ["attn.qq"]}), ValueError,
     r"keys \['attn.qq'\] name no module"),
    (lambda d: _drop_tensor(d, "model.layers.1.mlp.up_proj.lora_b"), ValueError,
     "missing 1 tensors: model.layers.1.mlp.up_proj.lora_b"),
    (lambda d: _add_tensor(d, "model.layers.7.mlp.up_proj.lora_a", mx.zeros((64, 4))), ValueError,
     "1 tensors name nothing in the model: model.layers.7.mlp.up_proj.lora_a"),
    (lambda d: (d / "adapters.safetensors").write_bytes(b"not safetensors"), ValueError, "Could not read"),
]


@pytest.mark.parametrize("damage, error, message", MALFORMED)
def test_malformed_adapter_directories_name_the_problem(llama_dir, tmp_path, damage, error, message):
    directory = _adapter_dir(tmp_path, llama_dir)
    damage(directory)
    model, _ = load_model(llama_dir)
    with pytest.raises(error, match=message):
        load_adapters(model, directory)
    assert not any(isinstance(m, LoRALinear) for _, m in model.named_modules())  # left unchanged


def test_missing_adapter_directory(llama_dir, tmp_path):
    with pytest.raises(FileNotFoundError, match="is not a directory"):
        load(str(llama_dir), adapter_path=str(tmp_path / "nowhere"))


def test_load_signature_matches_upstream(llama_dir):
    model, tokenizer, config = load(str(llama_dir), None, {"rms_norm_eps": 1e-6}, None, True, True)
    assert config["rms_norm_eps"] == 1e-6 and model.args.rms_norm_eps == 1e-6
    with pytest.raises(TypeError):  # dtype is keyword-only, after upstream's options
        load(str(llama_dir), None, None, None, False, False, None, False, "float32")
    assert load(str(llama_dir), dtype="float32")[0].model.norm.weight.dtype == mx.float32


def test_trust_remote_code_reaches_the_tokenizer(llama_dir, monkeypatch):
    seen = []
    original = tokenizer_utils.AutoTokenizer.from_pretrained

    def recording(path, **kwargs):
        seen.append(kwargs)
        return original(path, **kwargs)

    monkeypatch.setattr(tokenizer_utils.AutoTokenizer, "from_pretrained", recording)
    load(str(llama_dir), trust_remote_code=True)
    load(str(llama_dir), tokenizer_config={"trust_remote_code": False})
    assert seen[0].get("trust_remote_code") is True and seen[1].get("trust_remote_code") is False
    load_tokenizer(llama_dir, {"model_max_length": 7}, eos_token_ids=[3, 4])
    assert seen[2] == {"model_max_length": 7}


def test_checkpoints_needing_their_own_model_code_are_refused(llama_dir, tmp_path):
    directory = shutil.copytree(llama_dir, tmp_path / "custom")
    config = json.loads((directory / "config.json").read_text())
    (directory / "config.json").write_text(json.dumps({**config, "model_file": "modeling.py"}))
    with pytest.raises(ValueError, match="model_file.*never runs"):
        load(str(directory), trust_remote_code=True)


def random_lora(params, paths, rank, rng):
    """Adapter tensors for the (switch) linear layers `paths`: lora_a, lora_b of
    upstream's shapes, (in, r) and (r, out), experts (E, r, in) and (E, out, r)."""
    tensors = {}
    for path in paths:
        w = params[f"{path}.weight"]
        shapes = [(w.shape[1], rank), (rank, w.shape[0])] if w.ndim == 2 else [(w.shape[0], rank, w.shape[2]), (w.shape[0], w.shape[1], rank)]
        for name, shape in zip(("lora_a", "lora_b"), shapes):
            tensors[f"{path}.{name}"] = (rng.standard_normal(shape) * 0.1).astype(np.float32)
    return tensors


def merge_lora(params, tensors, scale):
    """numpy reference: W + scale (a b)^T, experts W[e] + scale b[e] a[e]."""
    merged = dict(params)
    for name in (n for n in tensors if n.endswith(".lora_a")):
        path = name[: -len(".lora_a")]
        a, b = tensors[name], tensors[f"{path}.lora_b"]
        update = (a @ b).T if a.ndim == 2 else b @ a
        merged[f"{path}.weight"] = (params[f"{path}.weight"] + scale * update).astype(np.float32)
    return merged


def test_lora_on_a_hybrid_moe_model_including_its_experts(tmp_path):
    """qwen3_next (GatedDeltaNet + attention, MoE): the default keys adapt every linear
    and expert layer of the last two blocks; the reference merges them in numpy."""
    base_dir = write_checkpoint(tmp_path / "base", TINY_CONFIGS["qwen3_next"], seed=2)
    model, _ = load_model(base_dir)
    params = {k: np.array(v) for k, v in tree_flatten(model.parameters())}
    paths = [p for p, m in model.named_modules() if p.startswith(("model.layers.2.", "model.layers.3."))
             and type(m).__name__ in ("Linear", "SwitchLinear")]
    assert any(p.endswith("switch_mlp.up_proj") for p in paths) and any("linear_attn" in p for p in paths)
    tensors = random_lora(params, paths, 2, np.random.default_rng(1))
    directory = tmp_path / "adapters"
    directory.mkdir()
    config = {"num_layers": 2, "lora_parameters": {"rank": 2, "scale": 0.5, "dropout": 0.0}}
    (directory / "adapter_config.json").write_text(json.dumps(config))
    mx.save_safetensors(str(directory / "adapters.safetensors"), {k: mx.array(v) for k, v in tensors.items()})

    adapted, _ = load(str(base_dir), adapter_path=str(directory))
    reference, _ = load_model(base_dir)
    reference.load_weights([(k, mx.array(v)) for k, v in merge_lora(params, tensors, 0.5).items()])
    assert relative_error(adapted(TOKENS), reference(TOKENS)) < 1e-5
    assert relative_error(model(TOKENS), reference(TOKENS)) > 1e-3
    _rewrite_config(directory, fine_tune_type="dora")
    with pytest.raises(ValueError, match=r"dora on model\.layers\.\d\.mlp\.switch_mlp\.\w+ \(SwitchLinear\)"):
        load_adapters(load_model(base_dir)[0], directory)


def test_generate_cli_takes_adapter_path(llama_dir, tmp_path, capsys):
    """mlx_lm.generate --adapter-path prints what the adapted model generates."""
    from mlx_lm import generate
    from mlx_lm.generate import main as generate_main

    adapters, _ = write_adapters(tmp_path / "adapters", base_weights(llama_dir))
    model, tokenizer = load(str(llama_dir), adapter_path=str(adapters))
    want = generate(model, tokenizer, "hello there", max_tokens=12)
    common = ["--model", str(llama_dir), "--prompt", "hello there", "--max-tokens", "12", "--ignore-chat-template",
              "--verbose", "false"]
    generate_main([*common, "--adapter-path", str(adapters)])
    assert capsys.readouterr().out == want + "\n"
    generate_main(common)
    assert capsys.readouterr().out != want + "\n"  # the adapters change the output
