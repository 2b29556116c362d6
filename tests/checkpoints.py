"""Tiny random checkpoints in the Hugging Face layout, written by the tests themselves."""

import json
from pathlib import Path
from typing import Any, Dict

import mlx.core as mx
from mlx.utils import tree_flatten, tree_unflatten

from mlx_lm.utils import get_model_classes, load_model, save_config, save_model

from tokenizer_fixture import write_tokenizer

VOCAB_SIZE = 512

TINY_CONFIGS: Dict[str, Dict[str, Any]] = {
    "llama": dict(
        model_type="llama", hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, rms_norm_eps=1e-5,
        vocab_size=VOCAB_SIZE, rope_theta=10000.0, tie_word_embeddings=False,
    ),
    "qwen3": dict(
        model_type="qwen3", hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, rms_norm_eps=1e-6,
        vocab_size=VOCAB_SIZE, rope_parameters={"rope_type": "default", "rope_theta": 1e6},
        tie_word_embeddings=True, eos_token_id=0,
    ),
    "qwen3_next": dict(
        model_type="qwen3_next", hidden_size=64, num_hidden_layers=4, full_attention_interval=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, linear_num_key_heads=2,
        linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=16, linear_conv_kernel_dim=4,
        num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=32,
        intermediate_size=128, decoder_sparse_step=1, mlp_only_layers=[], partial_rotary_factor=0.25,
        vocab_size=512, rms_norm_eps=1e-6, rope_theta=10000.0, eos_token_id=0,
    ),
    "gpt_oss": dict(
        model_type="gpt_oss", hidden_size=64, intermediate_size=32, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, sliding_window=8, num_local_experts=4, num_experts_per_tok=2,
        vocab_size=512, eos_token_id=0,
    ),
}


def write_checkpoint(
    directory: Path, config: Dict[str, Any], seed: int = 0, scale: float = 0.5, noise: float = 0.0
) -> Path:
    """Random weights (from our own model, HF names) + config.json + tokenizer files.

    `noise` > 0 writes the weights of `seed` plus that much noise (see with_noise): a
    draft that agrees with the noise-free target part of the time."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    model_class, args_class = get_model_classes(config)
    mx.random.seed(seed)
    model = model_class(args_class.from_dict(config))
    weights = {k: mx.random.normal(v.shape) * scale for k, v in tree_flatten(model.parameters())}
    if noise:
        weights = with_noise(weights, noise, seed)
    mx.save_safetensors(str(directory / "model.safetensors"), weights)
    (directory / "config.json").write_text(json.dumps(config, indent=2))
    write_tokenizer(directory, vocab_size=config["vocab_size"])
    return directory


def with_noise(weights: Dict[str, mx.array], noise: float, seed: int = 0) -> Dict[str, mx.array]:
    """Each floating-point tensor plus Gaussian noise of `noise` times its own standard
    deviation (quantized tensors unchanged). At noise 0.02 a tiny random model's greedy
    choices flip often enough that drafting rounds end fully, partly and not at all
    accepted."""
    key = mx.random.key(seed)
    noisy = {}
    for name, value in sorted(weights.items()):
        key, subkey = mx.random.split(key)
        if mx.issubdtype(value.dtype, mx.floating):
            spread = mx.sqrt(mx.mean(mx.square(value - mx.mean(value))))
            value = value + noise * spread * mx.random.normal(value.shape, value.dtype, key=subkey)
        noisy[name] = value
    return noisy


def perturb(model, noise: float, seed: int = 0):
    """`model` with with_noise applied to its parameters in place; returns it."""
    model.update(tree_unflatten(list(with_noise(dict(tree_flatten(model.parameters())), noise, seed).items())))
    mx.eval(model.parameters())
    return model


def assert_saves_and_reloads(model, config: Dict[str, Any], directory: Path, tokens: mx.array) -> None:
    """Saved in the MLX layout (save_model, save_config) and loaded back, `model` has
    the same parameters, bit for bit, and the same logits on `tokens`."""
    save_model(directory, model)
    save_config(config, Path(directory) / "config.json")
    reloaded, _ = load_model(Path(directory))
    assert mx.array_equal(reloaded(tokens), model(tokens))
    saved, loaded = tree_flatten(model.parameters()), tree_flatten(reloaded.parameters())
    assert [k for k, _ in saved] == [k for k, _ in loaded]
    assert all(mx.array_equal(a, b) for (_, a), (_, b) in zip(saved, loaded))
