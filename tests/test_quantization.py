"""quantization.py: the mixed-precision recipes (upstream's QUANT_RECIPES) and the
per-expert tensor scale of nvfp4 (quantize_model's global_scale)."""

import shutil

import mlx.core as mx
import mlx.nn as nn
import pytest
from checkpoints import TINY_CONFIGS
from conftest import FIXTURES
from tokenizer_fixture import write_tokenizer

from mlx_lm.convert import convert
from mlx_lm.quantization import (
    QUANT_RECIPES,
    dequantize_model,
    is_sensitive_layer,
    mixed_quant_predicate_builder,
    quantize_model,
    quantized_layers,
)
from mlx_lm.utils import get_model_classes, load_model

TOKENS = mx.array([[5, 17, 260, 33, 101, 7, 99, 300, 12, 45, 8, 200]])


def tiny_llama(num_layers: int) -> nn.Module:
    config = dict(TINY_CONFIGS["llama"], num_hidden_layers=num_layers)
    model_class, args_class = get_model_classes(config)
    return model_class(args_class.from_dict(config))


def test_sensitive_layers_are_the_outer_eighths_and_every_third_between():
    # 16 layers: an eighth is 2, so 0, 1, 14, 15 and (i - 2) % 3 == 2 for 4, 7, 10, 13.
    assert [i for i in range(16) if is_sensitive_layer(i, 16)] == [0, 1, 4, 7, 10, 13, 14, 15]
    # 2 layers: no first eighth (2 // 8 = 0), the last from 7 * 2 // 8 = 1.
    assert [i for i in range(2) if is_sensitive_layer(i, 2)] == [1]


@pytest.mark.parametrize("recipe, low, high", [("mixed_2_6", 2, 6), ("mixed_3_4", 3, 4), ("mixed_3_6", 3, 6),
                                               ("mixed_4_6", 4, 6)])
def test_recipe_bits_by_layer(recipe, low, high):
    model = tiny_llama(16)
    predicate = mixed_quant_predicate_builder(recipe, model, group_size=32)
    quantize_model(model, {}, group_size=32, quant_predicate=predicate)
    bits = {path: params["bits"] for path, params in quantized_layers(model).items()}
    sensitive = [0, 1, 4, 7, 10, 13, 14, 15]
    for i in range(16):
        want = high if i in sensitive else low
        assert bits[f"model.layers.{i}.self_attn.v_proj"] == want
        assert bits[f"model.layers.{i}.mlp.down_proj"] == want
        assert bits[f"model.layers.{i}.self_attn.q_proj"] == low
        assert bits[f"model.layers.{i}.mlp.up_proj"] == low
    assert bits["lm_head"] == high and bits["model.embed_tokens"] == low
    assert {p["group_size"] for p in quantized_layers(model).values()} == {32}


def test_recipe_group_size_none_is_64():
    predicate = mixed_quant_predicate_builder("mixed_4_6", tiny_llama(2), group_size=None)
    assert predicate("model.layers.0.mlp.up_proj", None) == {"group_size": 64, "bits": 4, "mode": "affine"}
    assert predicate("model.layers.1.mlp.down_proj", None) == {"group_size": 64, "bits": 6, "mode": "affine"}


def test_recipe_errors_name_the_problem():
    with pytest.raises(ValueError, match=r"Unknown quantization recipe 'mixed_1_8'; choose from mixed_2_6"):
        mixed_quant_predicate_builder("mixed_1_8", tiny_llama(2))

    class NoDownProjection(nn.Module):
        def __init__(self):
            super().__init__()
            self.layers = [nn.Linear(8, 8)]

    with pytest.raises(ValueError, match="NoDownProjection has no down_proj layers"):
        mixed_quant_predicate_builder("mixed_3_6", NoDownProjection())
    with pytest.raises(ValueError, match="group sizes"):
        mixed_quant_predicate_builder("mixed_3_6", tiny_llama(2), group_size=48)


def test_convert_with_a_recipe_round_trips(tmp_path, tiny_llama_dir):
    convert(str(tiny_llama_dir), tmp_path / "mixed", quantize=True, q_group_size=32, quant_predicate="mixed_2_6")
    model, config = load_model(tmp_path / "mixed")
    layers = quantized_layers(model)
    assert layers["model.layers.0.mlp.down_proj"]["bits"] == 2 and layers["model.layers.1.mlp.down_proj"]["bits"] == 6
    assert layers["lm_head"]["bits"] == 6 and layers["model.layers.0.self_attn.k_proj"]["bits"] == 2
    assert config["quantization"]["lm_head"] == {"group_size": 32, "bits": 6, "mode": "affine"}
    # The same recipe applied in memory gives the same model exactly.
    reference, reference_config = load_model(tiny_llama_dir)
    predicate = mixed_quant_predicate_builder("mixed_2_6", reference, 32)
    quantize_model(reference, reference_config, 32, quant_predicate=predicate)
    assert quantized_layers(reference) == layers
    assert mx.array_equal(model(TOKENS), reference(TOKENS))


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(quant_predicate="mixed_9_9"), "Unknown quantization recipe 'mixed_9_9'"),
        (dict(quant_predicate="mixed_3_6", q_mode="mxfp4"), "quantize affine; --q-mode mxfp4"),
        (dict(quant_predicate="mixed_3_6", q_bits=4), "--q-bits 4: recipe mixed_3_6 sets the bits"),
    ],
)
def test_convert_refuses_a_bad_recipe_before_any_work(tmp_path, tiny_llama_dir, kwargs, message):
    with pytest.raises(ValueError, match=message):
        convert(str(tiny_llama_dir), tmp_path / "out", quantize=True, **kwargs)
    assert list(tmp_path.iterdir()) == []


def test_recipe_keeps_the_models_own_choices(tmp_path):
    """gpt-oss keeps its routers at 8 bits; the recipe decides the rest."""
    source = shutil.copytree(FIXTURES / "gpt_oss_tf5", tmp_path / "hf")
    write_tokenizer(source, vocab_size=512)
    convert(str(source), tmp_path / "q", quantize=True, q_group_size=32, quant_predicate="mixed_3_6")
    layers = quantized_layers(load_model(tmp_path / "q")[0])
    routers = [params for path, params in layers.items() if path.endswith("mlp.router")]
    assert routers and all(params["bits"] == 8 for params in routers)
    assert layers["model.layers.0.self_attn.q_proj"] == {"group_size": 32, "bits": 3, "mode": "affine"}
    assert sorted(QUANT_RECIPES) == ["mixed_2_6", "mixed_3_4", "mixed_3_6", "mixed_4_6"]


def moe_checkpoint(tmp_path):
    source = shutil.copytree(FIXTURES / "qwen3_moe_tf4", tmp_path / "hf")
    write_tokenizer(source, vocab_size=512)  # the smallest it writes; the model reads ids < 256 only
    return source


def test_global_scale_gives_each_expert_its_tensor_scale(tmp_path):
    from mlx_lm.models.switch_layers import NVFP4_GLOBAL_SCALE_DIVISOR

    model, config = load_model(moe_checkpoint(tmp_path))
    float_weight = mx.array(model.model.layers[0].mlp.switch_mlp.down_proj.weight)
    _, config = quantize_model(model, config, mode="nvfp4", global_scale=True)
    experts = model.model.layers[0].mlp.switch_mlp.down_proj
    assert experts.global_scale.dtype == mx.float32
    assert mx.array_equal(experts.global_scale, mx.max(mx.abs(float_weight), axis=(1, 2)))
    path = "model.layers.0.mlp.switch_mlp.down_proj"
    assert config["quantization"][path] == {"group_size": 16, "bits": 4, "mode": "nvfp4", "global_scale": True}
    assert "global_scale" not in quantized_layers(model)["model.layers.0.self_attn.q_proj"]
    # Each expert decodes as mx.dequantize with its scale (g / (448 * 6) times the scales).
    for e in range(float_weight.shape[0]):
        want = mx.dequantize(experts.weight[e], experts.scales[e], None, 16, 4, mode="nvfp4",
                             global_scale=experts.global_scale[e])
        got = mx.dequantize(experts.weight[e], experts.scales[e], None, 16, 4, mode="nvfp4")
        assert mx.allclose(got * experts.global_scale[e] / NVFP4_GLOBAL_SCALE_DIVISOR, want, rtol=1e-6, atol=0)


def test_global_scale_round_trips_through_save_load_and_dequantize(tmp_path):
    from mlx_lm.saving import save
    from mlx_lm.tokenizer_utils import load as load_tokenizer

    source = moe_checkpoint(tmp_path)
    float_model, _ = load_model(source)
    model, config = load_model(source)
    quantize_model(model, config, mode="nvfp4", global_scale=True)
    tokens = TOKENS % 256
    logits = model(tokens)
    float_logits = float_model(tokens)
    # nvfp4 on random weights: the error a tensor scale leaves is no larger than without one.
    plain, _ = load_model(source)
    quantize_model(plain, config, mode="nvfp4")
    error = mx.linalg.norm(logits - float_logits) / mx.linalg.norm(float_logits)
    assert error.item() < 1.05 * (mx.linalg.norm(plain(tokens) - float_logits) / mx.linalg.norm(float_logits)).item()
    _, config = quantize_model(*load_model(source), mode="nvfp4", global_scale=True)
    save(tmp_path / "q", source, model, load_tokenizer(source), config, donate_model=False)
    reloaded, _ = load_model(tmp_path / "q")
    assert mx.array_equal(reloaded(tokens), logits)
    experts = reloaded.model.layers[0].mlp.switch_mlp.gate_proj
    want = mx.stack([mx.dequantize(experts.weight[e], experts.scales[e], None, 16, 4, mode="nvfp4",
                                   global_scale=experts.global_scale[e]) for e in range(experts.weight.shape[0])])
    dequantize_model(reloaded)
    assert mx.array_equal(reloaded.model.layers[0].mlp.switch_mlp.gate_proj.weight, want)


def test_global_scale_is_read_from_the_tensors_when_the_config_omits_it(tmp_path):
    import json

    from mlx_lm.saving import save
    from mlx_lm.tokenizer_utils import load as load_tokenizer

    source = moe_checkpoint(tmp_path)
    model, config = load_model(source)
    _, config = quantize_model(model, config, mode="nvfp4", global_scale=True)
    tokens = TOKENS % 256
    logits = model(tokens)
    save(tmp_path / "q", source, model, load_tokenizer(source), config)
    written = json.loads((tmp_path / "q" / "config.json").read_text())
    for key in ("quantization", "quantization_config"):  # the expert entries said global_scale; now they do not
        written[key] = {p: v for p, v in written[key].items() if not (isinstance(v, dict) and "global_scale" in v)}
    assert "model.layers.0.mlp.switch_mlp.up_proj" not in written["quantization"]
    (tmp_path / "q" / "config.json").write_text(json.dumps(written))
    reloaded, _ = load_model(tmp_path / "q")
    assert "global_scale" in quantized_layers(reloaded)["model.layers.0.mlp.switch_mlp.up_proj"]
    assert mx.array_equal(reloaded(tokens), logits)


def test_global_scale_errors_name_the_problem(tmp_path):
    with pytest.raises(ValueError, match="global_scale is nvfp4's per-expert tensor scale; mode 'affine' has none"):
        quantize_model(tiny_llama(2), {}, global_scale=True)
    with pytest.raises(ValueError, match="applies to expert layers .SwitchLinear. and Model has none"):
        quantize_model(tiny_llama(2), {}, mode="nvfp4", global_scale=True)
    model = tiny_llama(2)
    with pytest.raises(ValueError, match=r"quant_predicate\('model.embed_tokens'\): a per-expert global_scale is for "
                                         "expert layers; model.embed_tokens is a Embedding"):
        quantize_model(model, {}, mode="nvfp4", quant_predicate=lambda p, m: {"mode": "nvfp4", "global_scale": True})
    assert not quantized_layers(model)  # refused before any layer changed
    with pytest.raises(ValueError, match="global_scale must be true or false, got 'yes'"):
        load_model_with_block(tmp_path, {"lm_head": {"mode": "nvfp4", "global_scale": "yes"}})


def load_model_with_block(tmp_path, overrides):
    from mlx_lm.quantization import read_quantization

    return read_quantization({"quantization": dict({"group_size": 16, "bits": 4, "mode": "nvfp4"}, **overrides)})
