"""mlx_lm.gguf: a tiny llama exported to GGUF and read back with mx.load holds every
tensor under llama.cpp's name, q/k rows in llama.cpp's rope order, and the metadata
llama.cpp's llama architecture reads; what llama.cpp could not run is refused by name."""

import json
import shutil

import mlx.core as mx
import numpy as np
import pytest
from mlx.utils import tree_flatten

from checkpoints import TINY_CONFIGS, write_checkpoint
from mlx_lm import cli
from mlx_lm.convert import convert
from mlx_lm.fuse import setup_arg_parser
from mlx_lm.gguf import (
    LLAMA3_SPLIT_PATTERN, GGMLFileType, TokenType, convert_to_gguf, permute_weights, pre_tokenizer_name, token_table, translate_weight_names,
)
from mlx_lm.utils import load, load_model
from test_adapters import base_weights, write_adapters
from tokenizer_fixture import write_spm_style_tokenizer

LLAMA = TINY_CONFIGS["llama"]
HEAD_DIM = LLAMA["hidden_size"] // LLAMA["num_attention_heads"]
LAYER_NAMES = {
    "attn_norm": "input_layernorm", "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj", "attn_output": "self_attn.o_proj", "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj",
}


def float_weights(model_dir):
    model, config = load_model(model_dir)
    return dict(tree_flatten(model.parameters())), config


def export(model_dir, path, config=None, weights=None):
    """convert_to_gguf of the checkpoint in `model_dir` (its own config and weights unless
    given), read back: (tensors, metadata)."""
    own_weights, own_config = float_weights(model_dir)
    convert_to_gguf(model_dir, weights or own_weights, config or own_config, str(path))
    return mx.load(str(path), return_metadata=True)


@pytest.fixture(scope="module")
def exported(tiny_llama_dir, tmp_path_factory):
    tensors, metadata = export(tiny_llama_dir, tmp_path_factory.mktemp("gguf") / "llama.gguf")
    return float_weights(tiny_llama_dir)[0], tensors, metadata


def unpermute(rows: np.ndarray, heads: int) -> np.ndarray:
    """Naive inverse of llama.cpp's order: within each head, row 2i came from row i and
    row 2i + 1 from row i + head_dim / 2."""
    head_dim = rows.shape[0] // heads
    original = np.empty_like(rows)
    for h in range(heads):
        for i in range(head_dim // 2):
            original[h * head_dim + i] = rows[h * head_dim + 2 * i]
            original[h * head_dim + head_dim // 2 + i] = rows[h * head_dim + 2 * i + 1]
    return original


def test_every_tensor_has_llama_cpp_name_shape_and_dtype(exported):
    weights, tensors, _ = exported
    expected = {"token_embd.weight": "model.embed_tokens.weight", "output_norm.weight": "model.norm.weight",
                "output.weight": "lm_head.weight"}
    for layer in range(LLAMA["num_hidden_layers"]):
        for gguf_name, mlx_name in LAYER_NAMES.items():
            expected[f"blk.{layer}.{gguf_name}.weight"] = f"model.layers.{layer}.{mlx_name}.weight"
    assert set(tensors) == set(expected) and len(weights) == len(expected)
    for gguf_name, mlx_name in expected.items():
        tensor, original = tensors[gguf_name], weights[mlx_name]
        assert tensor.shape == original.shape, gguf_name
        # llama.cpp's converter keeps 1-D tensors (norms) float32, matrices float16.
        assert tensor.dtype == (mx.float32 if original.ndim == 1 else mx.float16), gguf_name
        if "attn_q" not in gguf_name and "attn_k" not in gguf_name:
            assert mx.array_equal(tensor, original.astype(tensor.dtype)), gguf_name


def test_q_and_k_rows_unpermuted_equal_the_originals(exported):
    weights, tensors, _ = exported
    for layer in range(LLAMA["num_hidden_layers"]):
        for name, heads in (("q", LLAMA["num_attention_heads"]), ("k", LLAMA["num_key_value_heads"])):
            original = np.array(weights[f"model.layers.{layer}.self_attn.{name}_proj.weight"].astype(mx.float16))
            written = np.array(tensors[f"blk.{layer}.attn_{name}.weight"])
            assert not np.array_equal(written, original)
            np.testing.assert_array_equal(unpermute(written, heads), original)


def test_permuted_rows_with_interleaved_rope_give_the_same_attention_scores():
    """What llama.cpp computes (adjacent pairs rotated, traditional rope) on permuted q/k
    equals what the model computes (halves rotated) on the original ones."""
    mx.random.seed(3)
    heads, length = 2, 5
    x = mx.random.normal((1, length, 12))
    wq, wk = mx.random.normal((heads * HEAD_DIM, 12)), mx.random.normal((heads * HEAD_DIM, 12))

    def scores(q_weight, k_weight, traditional):
        def project(w):  # (1, H, L, D)
            return mx.fast.rope((x @ w.T).reshape(1, length, heads, HEAD_DIM).transpose(0, 2, 1, 3),
                                HEAD_DIM, traditional=traditional, base=10000.0, scale=1.0, offset=0)
        return project(q_weight) @ project(k_weight).swapaxes(-1, -2)

    model = scores(wq, wk, traditional=False)
    llama_cpp = scores(permute_weights(wq, heads), permute_weights(wk, heads), traditional=True)
    assert mx.allclose(llama_cpp, model, atol=1e-4)
    assert not mx.allclose(scores(wq, wk, traditional=True), model, atol=1e-2)


def test_model_metadata(exported):
    _, _, metadata = exported
    expected = {
        "llama.block_count": 2, "llama.context_length": 2048, "llama.embedding_length": 64,
        "llama.feed_forward_length": 128, "llama.attention.head_count": 4, "llama.attention.head_count_kv": 2,
        "llama.rope.dimension_count": HEAD_DIM, "llama.attention.key_length": HEAD_DIM, "llama.vocab_size": 512,
        "general.file_type": 1, "general.alignment": 32,
    }
    assert metadata["general.architecture"] == "llama"
    for key, value in expected.items():
        assert metadata[key].dtype == mx.uint32 and metadata[key].item() == value, key
    assert metadata["llama.rope.freq_base"].item() == 10000.0
    assert metadata["llama.attention.layer_norm_rms_epsilon"].item() == pytest.approx(1e-5)
    assert not any(key.startswith(("llama.expert", "llama.rope.scaling")) for key in metadata)


def test_tokenizer_metadata(exported, tiny_llama_dir):
    _, _, metadata = exported
    tokenizer = json.loads((tiny_llama_dir / "tokenizer.json").read_text())
    vocab = dict(tokenizer["model"]["vocab"], **{t["content"]: t["id"] for t in tokenizer["added_tokens"]})
    assert metadata["tokenizer.ggml.model"] == "gpt2" and metadata["tokenizer.ggml.pre"] == "gpt-2"
    assert metadata["tokenizer.ggml.tokens"] == sorted(vocab, key=vocab.get)
    assert metadata["tokenizer.ggml.merges"] == [" ".join(m) if isinstance(m, list) else m for m in tokenizer["model"]["merges"]]
    assert len(metadata["tokenizer.ggml.merges"]) > 100
    types = metadata["tokenizer.ggml.token_type"].tolist()
    assert types[:3] == [TokenType.CONTROL] * 3 and types[3:300] == [TokenType.NORMAL] * 297
    assert metadata["tokenizer.ggml.eos_token_id"].item() == vocab["<|endoftext|>"] == 0
    assert metadata["tokenizer.ggml.padding_token_id"].item() == 0
    assert "tokenizer.ggml.bos_token_id" not in metadata  # the fixture's bos_token is null
    assert metadata["tokenizer.ggml.add_bos_token"].item() is False
    assert metadata["tokenizer.chat_template"].startswith("{%- for message in messages")


def test_sentencepiece_style_tokenizer_is_llama_cpp_llama_model(tiny_llama_dir, tmp_path):
    model_dir = tmp_path / "spm_llama"
    shutil.copytree(tiny_llama_dir, model_dir)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (model_dir / name).unlink()
    write_spm_style_tokenizer(model_dir, vocab_size=400)
    _, metadata = export(model_dir, tmp_path / "spm.gguf")
    tokens, types = metadata["tokenizer.ggml.tokens"], metadata["tokenizer.ggml.token_type"].tolist()
    assert metadata["tokenizer.ggml.model"] == "llama" and "tokenizer.ggml.merges" not in metadata
    assert tokens[:4] == ["<unk>", "<s>", "</s>", "<0x00>"] and tokens[400:] == [f"[PAD{i}]" for i in range(400, 512)]
    assert types[:3] == [TokenType.CONTROL] * 3 and types[3:259] == [TokenType.BYTE] * 256
    assert types[259] == TokenType.NORMAL and types[400:] == [TokenType.UNUSED] * 112
    assert metadata["tokenizer.ggml.scores"].shape == (512,)
    ids = {key: metadata[f"tokenizer.ggml.{key}_token_id"].item() for key in ("unknown", "bos", "eos")}
    assert ids == {"unknown": 0, "bos": 1, "eos": 2}


def test_rope_scaling_linear_and_llama3(tiny_llama_dir, tmp_path):
    weights, config = float_weights(tiny_llama_dir)
    linear = dict(config, rope_scaling={"type": "linear", "factor": 2.0}, max_position_embeddings=4096)
    _, metadata = export(tiny_llama_dir, tmp_path / "linear.gguf", linear)
    assert metadata["llama.rope.scaling.type"] == "linear" and metadata["llama.rope.scaling.factor"].item() == 2.0
    assert metadata["llama.context_length"].item() == 4096

    scaling = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 64}
    tensors, _ = export(tiny_llama_dir, tmp_path / "llama3.gguf", dict(config, rope_scaling=scaling))
    factors = np.array(tensors["rope_freqs.weight"])
    wavelengths = 2 * np.pi * 10000.0 ** (np.arange(0, HEAD_DIM, 2) / HEAD_DIM)
    expected = np.where(wavelengths < 64 / 4, 1.0, np.where(wavelengths > 64, 8.0, np.nan))
    blend = np.isnan(expected)
    smooth = (64 / wavelengths[blend] - 1.0) / (4.0 - 1.0)
    expected[blend] = 1 / ((1 - smooth) / 8.0 + smooth)
    assert tensors["rope_freqs.weight"].dtype == mx.float32 and blend.any() and not blend.all()
    np.testing.assert_allclose(factors, expected, rtol=1e-6)


def test_mistral_is_llama_cpp_llama(tmp_path):
    model_dir = write_checkpoint(tmp_path / "mistral", dict(LLAMA, model_type="mistral"), seed=4)
    tensors, metadata = export(model_dir, tmp_path / "mistral.gguf")
    assert metadata["general.architecture"] == "llama" and "blk.1.attn_q.weight" in tensors
    assert metadata["llama.context_length"].item() == 4096 * 32  # MistralConfig's default


def test_mixtral_experts_are_stacked_under_exps_names(tmp_path):
    config = dict(LLAMA, model_type="mixtral", num_local_experts=4, num_experts_per_tok=2)
    model_dir = write_checkpoint(tmp_path / "mixtral", config, seed=2)
    weights, _ = float_weights(model_dir)
    tensors, metadata = export(model_dir, tmp_path / "mixtral.gguf")
    assert metadata["llama.expert_count"].item() == 4 and metadata["llama.expert_used_count"].item() == 2
    for name, mlx_name in (("ffn_gate_exps", "gate_proj"), ("ffn_up_exps", "up_proj"), ("ffn_down_exps", "down_proj")):
        original = weights[f"model.layers.1.block_sparse_moe.switch_mlp.{mlx_name}.weight"]
        assert original.shape[0] == 4 and mx.array_equal(tensors[f"blk.1.{name}.weight"], original.astype(mx.float16))
    assert tensors["blk.0.ffn_gate_inp.weight"].shape == (4, 64)
    assert not any(".ffn_gate." in name for name in tensors)


def test_refusals_name_the_problem(tiny_llama_dir, tiny_model_dir, tmp_path):
    weights, config = float_weights(tiny_llama_dir)
    qwen_weights, qwen_config = float_weights(tiny_model_dir)
    with pytest.raises(ValueError, match="model type 'qwen3'; accepted: llama, mistral, mixtral"):
        convert_to_gguf(tiny_model_dir, qwen_weights, qwen_config, str(tmp_path / "q.gguf"))
    yarn = dict(config, rope_scaling={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64})
    with pytest.raises(ValueError, match="not 'yarn'"):
        convert_to_gguf(tiny_llama_dir, weights, yarn, str(tmp_path / "y.gguf"))
    with pytest.raises(ValueError, match="'model.layers.0.extra.weight' has no llama.cpp name"):
        convert_to_gguf(tiny_llama_dir, dict(weights, **{"model.layers.0.extra.weight": mx.zeros((2, 2))}), config,
                        str(tmp_path / "x.gguf"))
    quantized = dict(weights, **{"model.layers.0.mlp.up_proj.scales": mx.zeros((2, 2))})
    with pytest.raises(ValueError, match="'model.layers.0.mlp.up_proj.scales' is quantized; dequantize"):
        convert_to_gguf(tiny_llama_dir, quantized, config, str(tmp_path / "s.gguf"))
    with pytest.raises(ValueError, match="needs tokenizer.json"):
        convert_to_gguf(tmp_path, weights, config, str(tmp_path / "t.gguf"))
    assert not list(tmp_path.glob("*.gguf"))


def test_upstreams_names():
    assert translate_weight_names("model.layers.7.self_attn.q_proj.weight") == "blk.7.attn_q.weight"
    assert translate_weight_names("model.layers.0.block_sparse_moe.gate.weight") == "blk.0.ffn_gate_inp.weight"
    assert translate_weight_names("lm_head.weight") == "output.weight"
    assert (GGMLFileType.GGML_TYPE_F16, TokenType.NORMAL, TokenType.BYTE) == (1, 1, 6)
    rows = mx.arange(8).reshape(8, 1)  # 2 heads of 4: within each, 0 1 2 3 -> 0 2 1 3
    assert permute_weights(rows, 2).reshape(-1).tolist() == [0, 2, 1, 3, 4, 6, 5, 7]
    assert permute_weights(rows, 4, 2).tolist() == permute_weights(rows, 2).tolist()


def test_tokenizer_refusals_and_padding():
    with pytest.raises(ValueError, match="not this one"):
        pre_tokenizer_name({"type": "Whitespace"})
    assert pre_tokenizer_name({"type": "Sequence", "pretokenizers": [{"type": "ByteLevel"}]}) == "gpt-2"
    llama3_split = {"type": "Split", "pattern": {"Regex": LLAMA3_SPLIT_PATTERN}, "behavior": "Isolated"}
    llama3 = {"type": "Sequence", "pretokenizers": [llama3_split, {"type": "ByteLevel", "use_regex": False}]}
    assert pre_tokenizer_name(llama3) == "llama3"
    with pytest.raises(ValueError, match="not this one"):  # Llama 3's split but ByteLevel's regex too
        pre_tokenizer_name({"type": "Sequence", "pretokenizers": [llama3_split, {"type": "ByteLevel"}]})
    tokenizer = {"model": {"type": "BPE", "vocab": {"a": 0, "b": 2}}, "added_tokens": [
        {"id": 3, "content": "<s>", "special": True}, {"id": 4, "content": "<tool>", "special": False}]}
    texts, types = token_table(tokenizer, 6, byte_tokens=False)
    assert texts == ["a", "[PAD1]", "b", "<s>", "<tool>", "[PAD5]"]
    assert types == [TokenType.NORMAL, TokenType.UNUSED, TokenType.NORMAL, TokenType.CONTROL,
                     TokenType.USER_DEFINED, TokenType.UNUSED]
    with pytest.raises(ValueError, match="token id 4, beyond the model's vocab_size 4"):
        token_table(tokenizer, 4, byte_tokens=False)


def test_fuse_export_gguf_writes_a_float_file(tiny_llama_dir, tiny_model_dir, tmp_path):
    args = setup_arg_parser().parse_args([])
    assert (args.export_gguf, args.gguf_path) == (False, "ggml-model-f16.gguf")
    convert(str(tiny_llama_dir), tmp_path / "q4", quantize=True)
    adapters, _ = write_adapters(tmp_path / "adapters", base_weights(tiny_llama_dir), num_layers=1)
    cli.main(["fuse", "--model", str(tmp_path / "q4"), "--adapter-path", str(adapters),
              "--save-path", str(tmp_path / "fused"), "--export-gguf"])
    fused, _, config = load(str(tmp_path / "fused"), return_config=True)
    assert "quantization" in config  # the folder keeps its quantized layers
    tensors, metadata = mx.load(str(tmp_path / "fused" / "ggml-model-f16.gguf"), return_metadata=True)
    assert metadata["general.architecture"] == "llama" and len(tensors) == 3 + 9 * LLAMA["num_hidden_layers"]
    assert all(t.dtype in (mx.float16, mx.float32) for t in tensors.values())
    # The adapted (float) down projection of the last layer is written as fused.
    down = fused.model.layers[1].mlp.down_proj.weight
    assert mx.array_equal(tensors["blk.1.ffn_down.weight"], down.astype(mx.float16))

    yarn_dir = tmp_path / "yarn"
    shutil.copytree(tiny_llama_dir, yarn_dir)
    yarn = dict(LLAMA, rope_scaling={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64})
    (yarn_dir / "config.json").write_text(json.dumps(yarn))
    with pytest.raises(SystemExit, match="not 'yarn'"):
        cli.main(["fuse", "--model", str(yarn_dir), "--adapter-path", str(adapters),
                  "--save-path", str(tmp_path / "yarn_fused"), "--export-gguf"])
    assert not (tmp_path / "yarn_fused").exists()
    with pytest.raises(SystemExit, match="model type 'qwen3'"):
        cli.main(["fuse", "--model", str(tiny_model_dir), "--adapter-path", str(adapters),
                  "--save-path", str(tmp_path / "qwen_fused"), "--export-gguf", "--gguf-path", "q.gguf"])
    assert not (tmp_path / "qwen_fused").exists()
