"""utils.py: finding and loading checkpoints, with clear errors for bad ones."""

import json
import math
import shutil

import mlx.core as mx
import mlx.nn as nn
import pytest
from checkpoints import TINY_CONFIGS, write_checkpoint
from conftest import FIXTURES

from mlx.utils import tree_flatten

from mlx_lm.convert import convert
from mlx_lm.generate import stream_generate
from mlx_lm.tokenizer_utils import TokenizerWrapper
from mlx_lm.utils import (
    common_prefix_len, compute_bits_per_weight, compute_dtype, get_model_path, get_total_parameters, infer_quant_config,
    load, load_config, load_model, quantize_model, save_config,
)


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
        (dict(rope_scaling={"rope_type": "longrope"}), ValueError, "longrope rope scaling needs short_factor and long_factor"),
        (dict(rope_scaling={"rope_type": "unknown"}), ValueError, "Unsupported rope_type 'unknown'"),
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


# ---------------------------------------------------------------------------
# Compute dtype: half precision runs as float32 on the CPU backend (issue 21).


def half_checkpoint(directory, config_name="qwen3", dtype=mx.float16):
    """A tiny checkpoint whose weights are stored in `dtype`."""
    write_checkpoint(directory, TINY_CONFIGS[config_name])
    weights = mx.load(str(directory / "model.safetensors"))
    mx.save_safetensors(str(directory / "model.safetensors"), {k: v.astype(dtype) for k, v in weights.items()})
    return directory


def float_dtypes(model):
    return {p.dtype for _, p in tree_flatten(model.parameters()) if mx.issubdtype(p.dtype, mx.floating)}


def within_half_rounding(full, half):
    """float16 activations through a 2-layer model: within 1% of the logits' scale
    (measured 0.2-0.5%)."""
    error = mx.abs(full - half.astype(mx.float32)).max().item()
    return error <= 0.01 * mx.abs(full).max().item()


def test_compute_dtype_policy():
    cpu, gpu = mx.Device(mx.cpu), mx.Device(mx.gpu)
    assert compute_dtype(None, cpu)[0] == mx.float32
    assert compute_dtype("auto", cpu)[0] == mx.float32
    assert compute_dtype("auto", gpu)[0] is None  # Metal and CUDA keep the checkpoint's dtypes
    assert compute_dtype("bfloat16", cpu)[0] == mx.bfloat16
    with pytest.raises(ValueError, match="Unsupported dtype 'float8'; choose auto or one of"):
        compute_dtype("float8")


@pytest.mark.parametrize("stored", [mx.float16, mx.bfloat16])
def test_half_checkpoint_loads_as_float32_on_cpu_unless_asked(tmp_path, stored):
    directory = half_checkpoint(tmp_path / "half", dtype=stored)
    model, _ = load(str(directory))
    assert float_dtypes(model) == {mx.float32}
    kept, _ = load(str(directory), dtype="float16")
    assert float_dtypes(kept) == {mx.float16}
    # float16 -> float32 is exact, so the float32 model holds the stored numbers.
    tokens = mx.array([[5, 17, 42, 7]])
    full, half = model(tokens), kept(tokens)
    assert full.dtype == mx.float32 and half.dtype == mx.float16
    assert within_half_rounding(full, half)


def test_quantized_checkpoint_scales_become_float32(tmp_path):
    source = half_checkpoint(tmp_path / "half")
    quantized = tmp_path / "q4"
    convert(str(source), str(quantized), quantize=True, q_group_size=32, q_bits=4)
    model, _ = load(str(quantized))
    kept, _ = load(str(quantized), dtype="float16")
    scales = [(path, m) for path, m in model.named_modules() if "scales" in m]
    assert scales and all(m.scales.dtype == mx.float32 and m.biases.dtype == mx.float32 for _, m in scales)
    kept_modules = dict(kept.named_modules())
    for path, module in scales:  # the same quantized weights: the cast is exact
        half = kept_modules[path]
        assert half.scales.dtype == mx.float16
        assert mx.array_equal(module.weight, half.weight)
        assert mx.array_equal(module.scales, half.scales.astype(mx.float32))
    assert within_half_rounding(model(mx.array([[5, 17, 42, 7]])), kept(mx.array([[5, 17, 42, 7]])))


def test_greedy_generation_unchanged_by_the_float32_default(tmp_path):
    """Greedy tokens equal float16 decoding's, except where float16 rounding decides a
    near tie (then the float16 logits of the two choices are within its rounding)."""
    directory = half_checkpoint(tmp_path / "half")
    model, tokenizer = load(str(directory))
    kept, _ = load(str(directory), dtype="float16")
    prompt = tokenizer.encode("def fibonacci(n):")
    full = [r.token for r in stream_generate(model, tokenizer, prompt, max_tokens=24)]
    half = [r for r in stream_generate(kept, tokenizer, prompt, max_tokens=24)]
    for i, (a, b) in enumerate(zip(full, half)):
        if a != b.token:
            margin = (b.logprobs[b.token] - b.logprobs[a]).item()
            assert 0 <= margin < 0.05, (i, a, b.token, margin)
            break
    else:
        assert full == [r.token for r in half]


# --- what code written for upstream 0.32.2 calls ---------------------------------------


def test_tagged_non_finite_floats_are_read_and_written_back(tmp_path):
    """transformers 5 writes inf as {"__float__": "Infinity"} (e.g. Mamba-2's
    time_step_limit); any other object with that key is data and stays as it is."""
    config = {"model_type": "llama", "time_step_limit": [0.0, {"__float__": "Infinity"}],
              "nested": {"low": {"__float__": "-Infinity"}, "nan": {"__float__": "NaN"}},
              "not_a_tag": {"__float__": 3, "other": 4}, "also_not": {"__float__": "inf"}}
    (tmp_path / "config.json").write_text(json.dumps(config))
    got = load_config(tmp_path)
    assert got["time_step_limit"] == [0.0, float("inf")] and got["nested"]["low"] == float("-inf")
    assert math.isnan(got["nested"]["nan"])
    assert got["not_a_tag"] == {"__float__": 3, "other": 4} and got["also_not"] == {"__float__": "inf"}
    save_config(got, tmp_path / "config.json")
    written = json.loads((tmp_path / "config.json").read_text())  # strict JSON: no bare Infinity
    assert written["time_step_limit"] == [0.0, {"__float__": "Infinity"}]
    assert written["nested"] == {"low": {"__float__": "-Infinity"}, "nan": {"__float__": "NaN"}}
    assert load_config(tmp_path)["time_step_limit"] == [0.0, float("inf")]


@pytest.mark.parametrize("mode, group_size, bits", [
    ("affine", 64, 3), ("affine", 32, 4), ("affine", 128, 8), ("mxfp4", 32, 4), ("mxfp8", 32, 8), ("nvfp4", 16, 4),
])
def test_infer_quant_config_reads_the_packing(mode, group_size, bits):
    layer = nn.Linear(256, 128, bias=False)
    quantized = layer.to_quantized(group_size=group_size, bits=bits, mode=mode)
    weights = {"l.weight": quantized.weight, "l.scales": quantized.scales}
    assert infer_quant_config("l", layer, weights) == {"group_size": group_size, "bits": bits, "mode": mode}


def test_infer_quant_config_refuses_a_packing_no_mode_makes():
    layer = nn.Linear(256, 128, bias=False)
    weights = {"l.weight": mx.zeros((128, 48), mx.uint32), "l.scales": mx.zeros((128, 4), mx.uint8)}  # 6 bits, 64
    with pytest.raises(ValueError, match="l: packed weight width 48 and scales width 4"):
        infer_quant_config("l", layer, weights)


def test_load_model_takes_trust_remote_code_and_still_runs_no_model_code(tmp_path, tiny_llama_dir):
    assert load_model(tiny_llama_dir, trust_remote_code=False)[0] is not None
    shutil.copytree(tiny_llama_dir, tmp_path / "custom")
    config = json.loads((tmp_path / "custom" / "config.json").read_text())
    (tmp_path / "custom" / "config.json").write_text(json.dumps(dict(config, model_file="arch.py")))
    (tmp_path / "custom" / "arch.py").write_text("raise SystemExit('model code ran')\n")
    for trust in (False, True):
        with pytest.raises(ValueError, match="arch.py.*never runs.*trust_remote_code"):
            load_model(tmp_path / "custom", trust_remote_code=trust)


def test_load_model_builds_the_classes_get_model_classes_gives(tiny_llama_dir):
    """Upstream's hook for a custom architecture: a subclass of the family, say."""
    from mlx_lm.models import llama

    class Custom(llama.Model):
        marker = "custom"

    seen = []

    def custom_classes(config):
        seen.append(config["model_type"])
        return Custom, llama.ModelArgs

    model, _ = load_model(tiny_llama_dir, get_model_classes=custom_classes)
    assert type(model) is Custom and seen == ["llama"]
    plain, _ = load_model(tiny_llama_dir)
    tokens = mx.array([[1, 2, 3]])
    assert mx.array_equal(model(tokens), plain(tokens))


def test_parameter_count_and_bits_per_weight_float_and_quantized(tiny_llama_dir):
    """A 4-bit layer in groups of 64 with float32 scales and biases costs 4 + 64 / 64
    bits a weight; the norms stay float32 (32 bits); the count is the float model's."""
    model, config = load_model(tiny_llama_dir)
    sizes = {k: v.size for k, v in tree_flatten(model.parameters())}
    assert model.parameters()["model"]["norm"]["weight"].dtype == mx.float32
    matrices = sum(n for k, n in sizes.items() if not k.endswith("norm.weight"))
    norms = sum(sizes.values()) - matrices
    assert get_total_parameters(model) == sum(sizes.values()) and compute_bits_per_weight(model) == 32
    quantize_model(model, config, group_size=64, bits=4)
    assert get_total_parameters(model) == sum(sizes.values())
    assert compute_bits_per_weight(model) == pytest.approx((5 * matrices + 32 * norms) / (matrices + norms))
    assert [common_prefix_len(a, b) for a, b in [([1, 2, 3], [1, 2, 4]), ([1, 2], [1, 2, 3]), ([], [1]), ([5], [6])]] \
        == [2, 2, 0, 0]


def test_cast_floats_keeps_router_biases_in_float32():
    from mlx_lm.utils import cast_floats

    class Gate(nn.Module):
        def __init__(self):
            super().__init__()
            self.weight = mx.ones((4, 8))
            self.e_score_correction_bias = mx.array([0.1, 1e-4, 3.0, -2.0])
            self.expert_bias = mx.zeros((4,))

    gate = cast_floats(Gate(), mx.bfloat16)
    assert gate.weight.dtype == mx.bfloat16
    assert gate.e_score_correction_bias.dtype == mx.float32 and gate.expert_bias.dtype == mx.float32
    assert gate.e_score_correction_bias[1].item() == mx.array(1e-4).item()


def test_hf_repo_to_path_finds_the_cached_snapshot_and_never_fetches(tmp_path, monkeypatch):
    from huggingface_hub import constants
    from huggingface_hub.errors import LocalEntryNotFoundError

    from mlx_lm.utils import hf_repo_to_path

    snapshot = tmp_path / "models--org--tiny" / "snapshots" / "0123abcd"
    snapshot.mkdir(parents=True)
    (snapshot / "config.json").write_text("{}")
    (tmp_path / "models--org--tiny" / "refs").mkdir()
    (tmp_path / "models--org--tiny" / "refs" / "main").write_text("0123abcd")
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path))
    assert hf_repo_to_path("org/tiny") == snapshot
    with pytest.raises(LocalEntryNotFoundError):
        hf_repo_to_path("org/absent")


def test_does_model_support_input_embeddings():
    from mlx_lm.utils import does_model_support_input_embeddings, get_model_classes

    model_class, args_class = get_model_classes(TINY_CONFIGS["llama"])
    assert does_model_support_input_embeddings(model_class(args_class.from_dict(TINY_CONFIGS["llama"])))

    class NoRows(nn.Module):
        def __call__(self, inputs, cache=None):
            return inputs

    assert not does_model_support_input_embeddings(NoRows())


def test_architecture_remapping_wins_over_the_model_type(monkeypatch):
    from mlx_lm import utils
    from mlx_lm.models import llama, qwen3

    monkeypatch.setitem(utils.MODEL_ARCHITECTURE_REMAPPING, ("llama", "Qwen3LikeForCausalLM"), "qwen3")
    assert utils.get_model_classes({"model_type": "llama", "architectures": ["Qwen3LikeForCausalLM"]}) == (
        qwen3.Model, qwen3.ModelArgs)
    assert utils.get_model_classes({"model_type": "llama", "architectures": "Qwen3LikeForCausalLM"})[0] is qwen3.Model
    assert utils.get_model_classes({"model_type": "llama", "architectures": ["LlamaForCausalLM"]})[0] is llama.Model
    assert utils.get_model_classes({"model_type": "mistral", "architectures": None})[0] is llama.Model


def test_common_prefix_len_takes_upstreams_argument_names():
    assert common_prefix_len(list1=[1, 2, 3], list2=[1, 2, 9]) == 2


def test_wired_limit_is_set_only_where_the_device_recommends_one(monkeypatch):
    from mlx_lm.utils import can_run_metal, maybe_set_recommended_wired_limit

    limits = []
    monkeypatch.setattr(mx, "set_wired_limit", lambda limit: limits.append(limit) or 7)
    monkeypatch.setattr(mx, "device_info", lambda: {"max_recommended_working_set_size": 1 << 30})
    assert maybe_set_recommended_wired_limit() == 7 and limits == [1 << 30]
    monkeypatch.setattr(mx, "device_info", lambda: {"architecture": "x86_64"})
    assert maybe_set_recommended_wired_limit() is None and limits == [1 << 30]
    previous = mx.default_device()
    mx.set_default_device(mx.cpu)
    try:
        assert can_run_metal() is False
    finally:
        mx.set_default_device(previous)


def test_sharded_load_takes_repo_and_trust_remote_code(tiny_llama_dir, monkeypatch):
    from mlx_lm import tokenizer_utils
    from mlx_lm.utils import sharded_load

    asked = []
    real_load = tokenizer_utils.load
    monkeypatch.setattr(tokenizer_utils, "load", lambda path, extra=None, **kw: asked.append(extra) or real_load(path))
    model, _, config = sharded_load(repo=str(tiny_llama_dir), trust_remote_code=True, return_config=True)
    assert asked == [{"trust_remote_code": True}] and config["model_type"] == "llama"
    reference, _ = load(str(tiny_llama_dir))
    tokens = mx.array([[5, 17, 260, 33]])
    assert mx.allclose(model(tokens), reference(tokens), atol=1e-5)


def test_every_public_name_of_upstreams_utils_is_here():
    """Upstream 0.32.2's mlx_lm.utils names, as its users import them."""
    from mlx_lm import utils

    upstream = """MODEL_REMAPPING MODEL_ARCHITECTURE_REMAPPING MAX_FILE_SIZE_GB DEFAULT_ALLOW_PATTERNS can_run_metal
        maybe_set_recommended_wired_limit get_total_parameters compute_bits_per_weight hf_repo_to_path load_config
        infer_quant_config load_model load_adapters load_tokenizer load sharded_load make_shards create_model_card
        upload_to_hub save_model quantize_model dequantize_model save_config save common_prefix_len
        does_model_support_input_embeddings pipeline_load""".split()
    assert [name for name in upstream if not hasattr(utils, name)] == []


def test_load_tokenizer_takes_a_path_string_and_names_a_missing_one(tiny_llama_dir, tmp_path):
    from mlx_lm.utils import load_tokenizer

    tokenizer = load_tokenizer(str(tiny_llama_dir), eos_token_ids=[2])
    assert isinstance(tokenizer, TokenizerWrapper) and 2 in tokenizer.eos_token_ids
    with pytest.raises(FileNotFoundError, match="is not a local directory and could not be fetched"):
        load_tokenizer("org/not-cached-anywhere")
