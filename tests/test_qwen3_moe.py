"""qwen3_moe.py against transformers, its config dialects and weight layouts, speculation
with it as target and as draft, and a quantized round trip.

Fixtures come from fixtures/make_families_reference.py: tiny random Qwen3-MoE
checkpoints saved by transformers 5, qwen3_moe_tf4 in the transformers-4 config dialect
(a dense layer in mlp_only_layers, no top-k renormalisation, per-expert weights) and
qwen3_moe_tf5 in the transformers-5 one (decoder_sparse_step 2, renormalised top-k,
experts fused as transformers 5 holds them), with the transformers fp32 logits.
"""

import mlx.core as mx
import mlx.nn as nn
import pytest
from checkpoints import TINY_CONFIGS, VOCAB_SIZE, write_checkpoint
from conftest import FIXTURES
from mlx.utils import tree_flatten
from test_gpt_oss import decode_in_chunks, load_fixture, relative_error
from test_speculative import accepted_per_round

from mlx_lm import convert, load
from mlx_lm.generate import SpeculationStats, generate_step, speculative_generate_step
from mlx_lm.models.qwen3_moe import Model, ModelArgs, SparseMoeBlock
from mlx_lm.models.switch_layers import SwitchLinear
from mlx_lm.utils import load_model, quantize_model, quantized_layers

FIXTURE_NAMES = ["qwen3_moe_tf4", "qwen3_moe_tf5"]
TOLERANCE = 1e-4  # fp32 on both sides; observed errors are ~3e-6

ARGS = dict(
    model_type="qwen3_moe", hidden_size=32, num_hidden_layers=4, intermediate_size=48,
    num_attention_heads=2, num_key_value_heads=1, head_dim=16, vocab_size=64,
    moe_intermediate_size=8, num_experts_per_tok=2,
)
# A tiny Qwen3-MoE sharing the tiny qwen3's vocabulary, so either can draft for the other.
TINY_MOE = dict(
    model_type="qwen3_moe", hidden_size=64, intermediate_size=128, num_hidden_layers=3,
    num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_experts=8, num_experts_per_tok=2,
    moe_intermediate_size=32, norm_topk_prob=True, mlp_only_layers=[1], rms_norm_eps=1e-6,
    vocab_size=VOCAB_SIZE, rope_theta=1e6, tie_word_embeddings=False, eos_token_id=0,
)
PROMPT = mx.array([(i * 37 + 11) % VOCAB_SIZE for i in range(20)])
NUM_TOKENS = 40


# --- against transformers -------------------------------------------------------------


@pytest.mark.parametrize("name", FIXTURE_NAMES)
@pytest.mark.parametrize("chunk", [None, 1, 5])
def test_logits_match_transformers(name, chunk):
    """One full forward, token by token through the cache, and chunks of 5."""
    model, ids, want = load_fixture(name)
    got = model(ids) if chunk is None else decode_in_chunks(model, ids, chunk)
    assert relative_error(got, want) < TOLERANCE


def test_fixtures_exercise_routing():
    """Without the renormalisation (tf5), or with it (tf4), the logits are far off, so
    norm_topk_prob is read and honoured."""
    for name in FIXTURE_NAMES:
        model, ids, want = load_fixture(name)
        flipped, _ = load_model(FIXTURES / name, model_config={"norm_topk_prob": not model.args.norm_topk_prob})
        assert relative_error(flipped(ids), want) > 1e-2, name


def test_moe_and_dense_layers_follow_the_config():
    tf4, _ = load_model(FIXTURES / "qwen3_moe_tf4")  # mlp_only_layers [1], sparse step 1
    assert [isinstance(layer.mlp, SparseMoeBlock) for layer in tf4.layers] == [True, False, True, True]
    tf5, _ = load_model(FIXTURES / "qwen3_moe_tf5")  # decoder_sparse_step 2
    assert [isinstance(layer.mlp, SparseMoeBlock) for layer in tf5.layers] == [False, True, False, True]
    assert tf5.layers[1].mlp.switch_mlp.gate_proj.num_experts == 4


# --- config -----------------------------------------------------------------------------


def test_dialects_normalise_alike():
    tf4 = ModelArgs.from_dict(dict(ARGS, num_experts=4, rope_theta=1e6))
    rope = {"rope_type": "default", "rope_theta": 1e6}
    tf5 = ModelArgs.from_dict(dict(ARGS, num_local_experts=4, rope_parameters=rope))
    for field in ("num_experts", "rope_theta", "rope_scaling", "mlp_only_layers"):
        assert getattr(tf4, field) == getattr(tf5, field), field
    assert tf4.num_experts == 4
    assert ModelArgs.from_dict(ARGS).num_experts == 128  # transformers' default


def test_config_errors_name_the_value():
    with pytest.raises(ValueError, match=r"num_experts \(4\) and num_local_experts \(8\)"):
        ModelArgs.from_dict(dict(ARGS, num_experts=4, num_local_experts=8))
    with pytest.raises(ValueError, match=r"num_experts_per_tok \(5\)"):
        ModelArgs.from_dict(dict(ARGS, num_experts=4, num_experts_per_tok=5))
    with pytest.raises(ValueError, match="decoder_sparse_step must be >= 1, got 0"):
        ModelArgs.from_dict(dict(ARGS, num_experts=4, decoder_sparse_step=0))
    with pytest.raises(ValueError, match="moe_intermediate_size is 0"):
        ModelArgs.from_dict(dict(ARGS, num_experts=4, moe_intermediate_size=0))
    with pytest.raises(ValueError, match="use_sliding_window=True"):
        ModelArgs.from_dict(dict(ARGS, num_experts=4, use_sliding_window=True))


# --- weights ------------------------------------------------------------------------------


def assert_same_weights(a, b):
    assert a.keys() == b.keys()
    assert all(a[k].dtype == b[k].dtype and mx.array_equal(a[k], b[k]) for k in a)


def test_sanitize_stacks_and_splits_experts():
    tf4, _ = load_model(FIXTURES / "qwen3_moe_tf4")
    raw = mx.load(str(FIXTURES / "qwen3_moe_tf4" / "model.safetensors"))
    weights = tf4.sanitize(raw)
    stem = "model.layers.2.mlp."
    assert mx.array_equal(weights[stem + "switch_mlp.up_proj.weight"][3], raw[stem + "experts.3.up_proj.weight"])
    assert mx.array_equal(weights[stem + "switch_mlp.down_proj.weight"][1], raw[stem + "experts.1.down_proj.weight"])
    assert not any(".experts." in k for k in weights)
    tf5, _ = load_model(FIXTURES / "qwen3_moe_tf5")
    fused = mx.load(str(FIXTURES / "qwen3_moe_tf5" / "model.safetensors"))
    weights = tf5.sanitize(fused)
    stem = "model.layers.3.mlp."
    I = tf5.args.moe_intermediate_size
    assert mx.array_equal(weights[stem + "switch_mlp.gate_proj.weight"], fused[stem + "experts.gate_up_proj"][:, :I])
    assert mx.array_equal(weights[stem + "switch_mlp.up_proj.weight"], fused[stem + "experts.gate_up_proj"][:, I:])


@pytest.mark.parametrize("name", FIXTURE_NAMES)
def test_sanitize_is_idempotent(name):
    """On raw transformers weights (per expert and fused), converted float weights and
    converted quantized ones."""
    model, config = load_model(FIXTURES / name)
    once = model.sanitize(mx.load(str(FIXTURES / name / "model.safetensors")))
    assert_same_weights(model.sanitize(once), once)
    converted = dict(tree_flatten(model.parameters()))
    assert_same_weights(model.sanitize(converted), converted)
    quantize_model(model, config, group_size=32, bits=4)
    quantized = dict(tree_flatten(model.parameters()))
    assert "model.layers.3.mlp.switch_mlp.gate_proj.scales" in quantized
    assert_same_weights(model.sanitize(quantized), quantized)


def test_quantized_round_trip_loads_and_generates(tmp_path):
    """mlx_lm.convert -q: the router stays at 8 bits, experts are 4-bit, and the saved
    model loads as exactly the in-memory quantization of the float one, and generates.
    (4-bit random tiny models err much, see test_convert.py: 0.59 of the max logit here.)"""
    source = write_checkpoint(tmp_path / "float", TINY_MOE, seed=3)
    convert(str(source), tmp_path / "q", quantize=True, q_bits=4, q_group_size=32)
    model, tokenizer = load(str(tmp_path / "q"))
    layers = quantized_layers(model)
    assert layers["model.layers.0.mlp.gate"] == {"group_size": 64, "bits": 8, "mode": "affine"}
    assert layers["model.layers.2.mlp.switch_mlp.down_proj"] == {"group_size": 32, "bits": 4, "mode": "affine"}
    reference, config = load_model(source)
    float_logits = reference(PROMPT[None])
    quantize_model(reference, config, group_size=32, bits=4)
    assert mx.array_equal(model(PROMPT[None]), reference(PROMPT[None]))
    assert relative_error(model(PROMPT[None]), float_logits) < 0.8  # measured 0.59
    tokens = [t for t, _ in generate_step(PROMPT, model, max_tokens=8)]
    assert len(tokens) == 8 and all(0 <= t < VOCAB_SIZE for t in tokens)


def test_quant_predicate_keeps_only_the_router_at_8_bits():
    model = Model(ModelArgs.from_dict(dict(TINY_MOE)))
    quantizable = (nn.Linear, nn.Embedding, SwitchLinear)
    nn.quantize(model, 32, 4, class_predicate=lambda p, m: isinstance(m, quantizable) and model.quant_predicate(p, m))
    assert model.layers[0].mlp.gate.bits == 8
    assert model.layers[1].mlp.gate_proj.bits == 4  # the dense MLP's gate_proj is no router
    assert model.layers[0].mlp.switch_mlp.up_proj.bits == 4


# --- speculation ----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def spec_models(tmp_path_factory):
    root = tmp_path_factory.mktemp("qwen3_moe_spec")
    moe = load_model(write_checkpoint(root / "moe", TINY_MOE, seed=1))[0]
    noisy = load_model(write_checkpoint(root / "noisy", TINY_MOE, seed=1, noise=0.02))[0]
    dense = load_model(write_checkpoint(root / "qwen3", TINY_CONFIGS["qwen3"], seed=2))[0]
    return {"moe": moe, "noisy": noisy, "qwen3": dense}


@pytest.mark.parametrize("target, draft", [("moe", "noisy"), ("moe", "qwen3"), ("noisy", "moe"), ("qwen3", "moe")])
@pytest.mark.parametrize("k", [1, 3])
def test_greedy_speculation_equals_plain(spec_models, target, draft, k):
    """Qwen3-MoE as target (noisy-self and dense qwen3 drafts) and as draft (of its noisy
    copy and of a dense qwen3): greedy output is the target's own."""
    target_model, draft_model = spec_models[target], spec_models[draft]
    want = [t for t, _ in generate_step(PROMPT, target_model, max_tokens=NUM_TOKENS)]
    stats = SpeculationStats()
    out = list(speculative_generate_step(PROMPT, target_model, draft_model, num_draft_tokens=k, max_tokens=NUM_TOKENS,
                                         adaptive_draft_length=False, stats=stats))
    assert [t for t, _, _ in out] == want
    rounds = accepted_per_round(out)
    assert stats.num_accepted < stats.num_drafted  # some drafts were rolled back
    if "noisy" in (target, draft) and k == 3:
        # Rounds end fully, partly (a multi-token rollback) and not at all accepted.
        assert {0, 3} <= set(rounds) and any(0 < n < k for n in rounds), rounds
