"""convert.py and the quantization/saving helpers of utils.py."""

import importlib
import json
import os
import re
import shutil

import mlx.core as mx
import mlx.nn as nn
import pytest
from conftest import FIXTURES
from mlx.utils import tree_flatten
from tokenizer_fixture import write_tokenizer

from mlx_lm import cli, convert
from mlx_lm.convert import main as convert_main
from mlx_lm.utils import (
    dequantize_model,
    load,
    load_model,
    quantize_model,
    quantized_layers,
    save_model,
)

TOKENS = mx.array([[5, 17, 260, 33, 101, 7, 99, 300, 12, 45, 8, 200, 3, 77, 400, 1]])

# Relative logit error ||q - f|| / ||f|| of the quantized tiny models against their
# float originals, over 16 tokens. Measured (bits, group size):
#   llama (4, 32) 0.483  (4, 64) 0.572  (8, 32) 0.035  (8, 64) 0.043
#   qwen3 (4, 32) 0.365  (4, 64) 0.364  (8, 32) 0.017  (8, 64) 0.022
# An affine b-bit step is 1/(2^b - 1) of a group's range, so 8 bits should err ~17x
# less than 4 bits (measured 13-21x), and larger groups (wider ranges) somewhat more.
# The errors are large in absolute terms because random weights (std 0.5) give sharp
# attention and no residual damping, which amplify every weight error; the bounds are
# ~1.4x the measurements, so a wrong scale, group or bit width fails them.
TOLERANCES = {
    "llama": {(4, 32): 0.7, (4, 64): 0.8, (8, 32): 0.05, (8, 64): 0.06},
    "qwen3": {(4, 32): 0.5, (4, 64): 0.5, (8, 32): 0.025, (8, 64): 0.03},
}
FAMILY_DIRS = {"llama": "tiny_llama_dir", "qwen3": "tiny_model_dir"}


def relative_error(got, want):
    return (mx.linalg.norm(got - want) / mx.linalg.norm(want)).item()


@pytest.mark.parametrize("family", sorted(TOLERANCES))
@pytest.mark.parametrize("bits, group_size", [(4, 32), (4, 64), (8, 32), (8, 64)])
def test_quantized_conversion_loads_and_tracks_the_float_model(request, tmp_path, family, bits, group_size):
    float_dir = request.getfixturevalue(FAMILY_DIRS[family])
    out = tmp_path / "q"
    convert(str(float_dir), out, quantize=True, q_bits=bits, q_group_size=group_size)
    model, config = load_model(out)
    reference, reference_config = load_model(float_dir)
    float_logits = reference(TOKENS)

    # Loading rebuilds exactly the in-memory quantization, bit for bit.
    quantize_model(reference, reference_config, group_size, bits)
    assert mx.array_equal(model(TOKENS), reference(TOKENS))
    assert quantized_layers(model) == quantized_layers(reference)
    assert relative_error(model(TOKENS), float_logits) < TOLERANCES[family][(bits, group_size)]

    expected_block = {"group_size": group_size, "bits": bits, "mode": "affine"}
    assert config["quantization"] == config["quantization_config"] == expected_block
    layers = quantized_layers(model)
    assert "model.embed_tokens" in layers and "model.layers.1.mlp.down_proj" in layers
    assert all(p == {"group_size": group_size, "bits": bits, "mode": "affine"} for p in layers.values())
    index = json.loads((out / "model.safetensors.index.json").read_text())
    weights = mx.load(str(out / "model.safetensors"))
    assert set(index["weight_map"]) == set(weights) and set(index["weight_map"].values()) == {"model.safetensors"}
    assert index["metadata"]["total_size"] == sum(w.nbytes for w in weights.values())
    assert weights["model.layers.0.self_attn.q_proj.weight"].dtype == mx.uint32
    _, tokenizer = load(str(out))
    assert tokenizer.encode("def add(a, b):") == load(str(float_dir))[1].encode("def add(a, b):")


@pytest.mark.parametrize("mode, group_size, bits", [("mxfp4", 32, 4), ("mxfp8", 32, 8), ("nvfp4", 16, 4)])
def test_other_quantization_modes_round_trip(tmp_path, tiny_llama_dir, mode, group_size, bits):
    convert(str(tiny_llama_dir), tmp_path / mode, quantize=True, q_mode=mode)
    model, config = load_model(tmp_path / mode)
    assert config["quantization"] == {"group_size": group_size, "bits": bits, "mode": mode}
    reference, reference_config = load_model(tiny_llama_dir)
    quantize_model(reference, reference_config, mode=mode)
    assert mx.array_equal(model(TOKENS), reference(TOKENS))


def test_eight_bits_err_far_less_than_four(tmp_path, tiny_llama_dir):
    reference, _ = load_model(tiny_llama_dir)
    float_logits = reference(TOKENS)
    errors = {}
    for bits in (4, 8):
        convert(str(tiny_llama_dir), tmp_path / str(bits), quantize=True, q_bits=bits)
        errors[bits] = relative_error(load_model(tmp_path / str(bits))[0](TOKENS), float_logits)
    assert errors[8] < errors[4] / 8


def test_dequantize_round_trip(tmp_path, tiny_model_dir):
    convert(str(tiny_model_dir), tmp_path / "q", quantize=True, q_bits=4, q_group_size=32)
    convert(str(tmp_path / "q"), tmp_path / "f", dequantize=True)
    quantized, _ = load_model(tmp_path / "q")
    restored, config = load_model(tmp_path / "f")
    assert "quantization" not in config and "quantization_config" not in config
    assert not quantized_layers(restored)
    q_proj = quantized.model.layers[0].self_attn.q_proj
    want = mx.dequantize(q_proj.weight, q_proj.scales, q_proj.biases, 32, 4)
    assert mx.array_equal(restored.model.layers[0].self_attn.q_proj.weight, want)
    # Same weights, float matmuls instead of quantized ones: float32 rounding only.
    assert mx.allclose(restored(TOKENS), quantized(TOKENS), atol=1e-4, rtol=1e-4)
    # In memory too, and the model quantizes again to the same layers.
    dequantize_model(quantized)
    assert mx.allclose(quantized(TOKENS), restored(TOKENS), atol=1e-5)


def test_dtype_cast(tmp_path, tiny_llama_dir):
    convert(str(tiny_llama_dir), tmp_path / "bf16", dtype="bfloat16")
    model, _ = load_model(tmp_path / "bf16")
    assert {p.dtype for _, p in tree_flatten(model.parameters())} == {mx.bfloat16}
    reference, _ = load_model(tiny_llama_dir)
    # bfloat16 keeps 8 significant bits: ~0.4 % per weight.
    assert relative_error(model(TOKENS).astype(mx.float32), reference(TOKENS)) < 0.05
    convert(str(tiny_llama_dir), tmp_path / "q16", quantize=True, dtype="float16")
    q_proj = load_model(tmp_path / "q16")[0].model.layers[0].self_attn.q_proj
    assert q_proj.scales.dtype == mx.float16 and q_proj.weight.dtype == mx.uint32


@pytest.mark.parametrize("named, want", [
    ({"torch_dtype": "bfloat16"}, mx.bfloat16),  # the hub's configs
    ({"dtype": "float16"}, mx.float16),  # transformers 5's
    ({"text_config": {"dtype": "bfloat16"}}, mx.bfloat16),
    ({"torch_dtype": "int8"}, mx.float32),  # not a float dtype: the weights' own
    ({}, mx.float32),
])
def test_default_dtype_is_the_one_the_config_names(tmp_path, tiny_llama_dir, named, want):
    """As upstream: without --dtype the weights are cast to the config's dtype."""
    source = tmp_path / "src"
    shutil.copytree(tiny_llama_dir, source)
    config = json.loads((source / "config.json").read_text())
    (source / "config.json").write_text(json.dumps({**config, **named}))
    convert(str(source), tmp_path / "out")
    model, _ = load_model(tmp_path / "out")
    assert {p.dtype for _, p in tree_flatten(model.parameters())} == {want}


def test_sharded_save_writes_an_index_and_loads(tmp_path, tiny_llama_dir):
    model, config = load_model(tiny_llama_dir)
    shutil.copytree(tiny_llama_dir, tmp_path / "m")
    (tmp_path / "m" / "model.safetensors").unlink()
    progress = []
    save_model(tmp_path / "m", model, max_shard_bytes=200_000, progress=lambda d, t: progress.append((d, t)))
    index = json.loads((tmp_path / "m" / "model.safetensors.index.json").read_text())
    files = sorted(set(index["weight_map"].values()))
    assert len(files) > 2 and files[0] == f"model-00001-of-{len(files):05d}.safetensors"
    total = sum(p.nbytes for _, p in tree_flatten(model.parameters()))
    assert index["metadata"]["total_size"] == total and progress[-1] == (total, total)
    for name in files:
        shard = mx.load(str(tmp_path / "m" / name))
        assert sum(w.nbytes for w in shard.values()) <= 200_000 or len(shard) == 1
        assert all(index["weight_map"][k] == name for k in shard)
    loaded, _ = load_model(tmp_path / "m")
    assert mx.array_equal(loaded(TOKENS), model(TOKENS))


def test_predicates_choose_layers_and_the_config_records_them(tmp_path, tiny_llama_dir):
    def predicate(path, module):
        if path == "lm_head":
            return False
        if path.endswith("mlp.down_proj"):
            return {"group_size": 32, "bits": 8}
        return True

    convert(str(tiny_llama_dir), tmp_path / "mixed", quantize=True, quant_predicate=predicate)
    model, config = load_model(tmp_path / "mixed")
    block = config["quantization"]
    assert block["lm_head"] is False and type(model.lm_head) is nn.Linear
    assert block["model.layers.1.mlp.down_proj"] == {"group_size": 32, "bits": 8, "mode": "affine"}
    assert "model.layers.1.mlp.up_proj" not in block  # default parameters need no entry
    assert model.model.layers[1].mlp.down_proj.bits == 8 and model.model.layers[1].mlp.up_proj.bits == 4

    # A group size that divides only some layers (128: the 128-wide down_proj inputs)
    # keeps the others float, as upstream does.
    convert(str(tiny_llama_dir), tmp_path / "g128", quantize=True, q_group_size=128)
    assert set(quantized_layers(load_model(tmp_path / "g128")[0])) == {
        "model.layers.0.mlp.down_proj", "model.layers.1.mlp.down_proj"
    }


def test_moe_router_stays_at_eight_bits(tmp_path):
    source = shutil.copytree(FIXTURES / "gpt_oss_tf5", tmp_path / "hf")
    write_tokenizer(source, vocab_size=512)
    convert(str(source), tmp_path / "q", quantize=True, q_bits=4, q_group_size=32)
    model, config = load_model(tmp_path / "q")
    routers = {p: v for p, v in config["quantization"].items() if p.endswith("mlp.router")}
    assert len(routers) == 4 and all(v == {"group_size": 64, "bits": 8, "mode": "affine"} for v in routers.values())
    layers = quantized_layers(model)
    assert layers["model.layers.0.mlp.router"]["bits"] == 8
    assert layers["model.layers.0.mlp.experts.gate_proj"] == {"group_size": 32, "bits": 4, "mode": "affine"}
    # The model's own quant_predicate, applied in memory, gives the same layers exactly.
    reference, reference_config = load_model(source)
    quantize_model(reference, reference_config, 32, 4)
    assert quantized_layers(reference) == layers
    assert mx.array_equal(model(TOKENS % 256), reference(TOKENS % 256))


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(quantize=True, dequantize=True), "either --quantize or --dequantize"),
        (dict(q_bits=4), "only apply with -q"),
        (dict(quantize=True, q_bits=7), r"bits \[2, 3, 4, 5, 6, 8\], got 7"),
        (dict(quantize=True, q_group_size=100), "group sizes"),
        (dict(dtype="float64"), "Unsupported dtype 'float64'"),
        (dict(dequantize=True), "has no quantized layers"),
    ],
)
def test_bad_options_are_refused_and_leave_nothing(tmp_path, tiny_llama_dir, kwargs, message):
    with pytest.raises(ValueError, match=message):
        convert(str(tiny_llama_dir), tmp_path / "out", **kwargs)
    assert list(tmp_path.iterdir()) == []


def test_refuses_existing_output_and_requantizing(tmp_path, tiny_llama_dir):
    (tmp_path / "taken").mkdir()
    with pytest.raises(ValueError, match="already exists"):
        convert(str(tiny_llama_dir), tmp_path / "taken")
    convert(str(tiny_llama_dir), tmp_path / "q", quantize=True)
    with pytest.raises(ValueError, match="already quantized"):
        convert(str(tmp_path / "q"), tmp_path / "qq", quantize=True)


def test_failed_write_leaves_no_output(tmp_path, tiny_llama_dir, monkeypatch):
    def fail(config, path):
        raise OSError("disk full")

    monkeypatch.setattr(importlib.import_module("mlx_lm.saving"), "save_config", fail)
    with pytest.raises(OSError, match="disk full"):
        convert(str(tiny_llama_dir), tmp_path / "out")
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("umask", [0o022, 0o077], ids=["022", "077"])
def test_output_folder_gets_the_mode_mkdir_gives(tmp_path, tiny_llama_dir, umask):
    """The folder is written under a temporary name first; it still ends up as any folder
    the user makes (0755 under umask 022), not private to them as a temporary one is."""
    previous = os.umask(umask)
    try:
        (tmp_path / "made").mkdir()
        convert(str(tiny_llama_dir), tmp_path / "out")
    finally:
        os.umask(previous)
    assert (tmp_path / "out").stat().st_mode == (tmp_path / "made").stat().st_mode


def test_cli_reports_progress_and_errors(tmp_path, tiny_llama_dir, capsys):
    assert cli.COMMANDS["convert"] == "mlx_lm.convert"
    convert_main(["--hf-path", str(tiny_llama_dir), "--mlx-path", str(tmp_path / "q"), "-q", "--q-bits", "8"])
    err = capsys.readouterr().err
    assert "Quantizing" in err and "Saved the MLX model" in err
    assert "\r" not in err and len(re.findall(r"\[INFO\] Saved \d+\.\d\d [KM]B of weights\n", err)) == 1
    assert load_model(tmp_path / "q")[1]["quantization"]["bits"] == 8
    with pytest.raises(SystemExit, match="Error: Cannot save to .*already exists"):
        convert_main(["--hf-path", str(tiny_llama_dir), "--mlx-path", str(tmp_path / "q")])
    with pytest.raises(SystemExit, match="Error: .*got 7"):
        convert_main(["--hf-path", str(tiny_llama_dir), "--mlx-path", str(tmp_path / "x"), "-q", "--q-bits", "7"])


@pytest.mark.parametrize("fixture", ["qwen3_next_tf4", "qwen3_5_moe_tf5"])
def test_hybrid_convert_then_load_round_trip(tmp_path, fixture):
    """Raw transformers hybrid -> MLX layout (float, then 8-bit) -> load: logits unchanged
    in float, the zero-centred norms shifted once, the routers and shared-expert gates at
    8 bits by the model's predicate."""
    source = shutil.copytree(FIXTURES / fixture, tmp_path / "hf")
    write_tokenizer(source, vocab_size=512)
    reference, _ = load_model(source)
    tokens = TOKENS % 256
    convert(str(source), tmp_path / "float")
    converted, _ = load_model(tmp_path / "float")
    assert mx.array_equal(converted(tokens), reference(tokens))

    convert(str(source), tmp_path / "q8", quantize=True, q_bits=8, q_group_size=32)
    quantized, config = load_model(tmp_path / "q8")
    # Loading rebuilds exactly what quantizing in memory gives. Against the float model
    # the tiny random MoE fixtures move a lot (8% and 21% observed): 8-bit noise flips
    # top-k routing choices, a discontinuous change, so only a loose bound applies.
    in_memory, in_memory_config = load_model(source)
    quantize_model(in_memory, in_memory_config, 32, 8)
    assert mx.array_equal(quantized(tokens), in_memory(tokens))
    assert relative_error(quantized(tokens), reference(tokens)) < 0.4
    gates = [p for p in config["quantization"] if isinstance(config["quantization"][p], dict)]
    assert gates and all(p.endswith(("mlp.gate", "shared_expert_gate")) for p in gates)
    assert all(config["quantization"][p]["bits"] == 8 and config["quantization"][p]["group_size"] == 64 for p in gates)


def test_upload_repo_is_checked_first_and_a_failed_upload_keeps_the_output(tmp_path, tiny_llama_dir, monkeypatch):
    from huggingface_hub import HfApi
    from huggingface_hub.errors import OfflineModeIsEnabled

    with pytest.raises(ValueError, match="Hub repo id 'no namespace' must be of the form namespace/name"):
        convert(str(tiny_llama_dir), tmp_path / "out", upload_repo="no namespace")
    assert list(tmp_path.iterdir()) == []

    def offline(self, repo_id, exist_ok):
        raise OfflineModeIsEnabled("offline mode is enabled")

    monkeypatch.setattr(HfApi, "create_repo", offline)
    with pytest.raises(SystemExit, match=r"Error: Could not upload .*'me/tiny-8bit'.*The model is kept in"):
        convert_main(["--hf-path", str(tiny_llama_dir), "--mlx-path", str(tmp_path / "out"), "-q", "--q-bits", "8",
                      "--upload-repo", "me/tiny-8bit"])
    model, config = load_model(tmp_path / "out")
    assert config["quantization"]["bits"] == 8 and "me/tiny-8bit" in (tmp_path / "out" / "README.md").read_text()


def test_upstreams_positional_order_recipes_and_trust_remote_code(tmp_path, tiny_llama_dir, monkeypatch):
    from mlx_lm import tokenizer_utils
    from mlx_lm.convert import MODEL_CONVERSION_DTYPES, QUANT_RECIPES, configure_parser

    asked = []
    real_load = tokenizer_utils.load
    monkeypatch.setattr(tokenizer_utils, "load", lambda path, extra=None, **kw: asked.append(extra) or real_load(path))
    # hf_path, mlx_path, quantize, q_group_size, q_bits, q_mode, dtype, upload_repo, revision,
    # dequantize, quant_predicate, trust_remote_code: upstream 0.32.2's order.
    convert(str(tiny_llama_dir), tmp_path / "out", True, 32, None, "affine", "float16", None, None, False,
            "mixed_3_6", True)
    assert asked == [{"trust_remote_code": True}]
    model, _ = load_model(tmp_path / "out")
    assert quantized_layers(model)["lm_head"]["bits"] == 6 and model.model.norm.weight.dtype == mx.float16
    assert MODEL_CONVERSION_DTYPES == ["float16", "bfloat16", "float32"] and "mixed_2_6" in QUANT_RECIPES
    args = configure_parser().parse_args(["--model", "m", "-q", "--quant-predicate", "mixed_4_6", "--upload-repo",
                                          "me/x", "--trust-remote-code"])
    assert (args.quant_predicate, args.upload_repo, args.trust_remote_code) == ("mixed_4_6", "me/x", True)
