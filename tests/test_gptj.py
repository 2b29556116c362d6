"""gptj.py (GPT-J): the shared family checks (family_checks.py) on the transformers
fixtures, plus what only GPT-J has: the partial interleaved ("rotate every two") rope
against transformers' formula, the parallel block, lm_head's bias (also when the weight
is tied), sanitize (upstream mlx-lm's names, mask buffers) and the config errors.
Two-rank sharding of FAMILY.tiny is in test_distributed.py.

Fixtures come from fixtures/make_gptj_reference.py: gptj_tf5 (rotary_dim 8 of 16,
untied) and gptj_tied (the whole head rotated, tied lm_head weight with its own bias).
"""

import mlx.core as mx
import numpy as np
import pytest
from checkpoints import VOCAB_SIZE
from family_checks import FIXTURES, Family, FamilyChecks, fixture_model, reference, relative_error
from layout_checks import assert_sanitize_converts_once, raw_weights
from sliding_checks import assert_override_matters

from mlx_lm.models.gptj import ModelArgs
from mlx_lm.utils import load_model

FAMILY = Family(
    fixtures=["gptj_tied", "gptj_tf5"],
    tiny=dict(model_type="gptj", n_embd=64, n_head=4, n_layer=2, rotary_dim=8, n_inner=128, vocab_size=VOCAB_SIZE,
              eos_token_id=0),
    small=dict(model_type="gptj", n_embd=32, n_head=2, n_layer=1, rotary_dim=8, vocab_size=256),
)
ARGS = dict(model_type="gptj", n_embd=64, n_head=4, n_layer=2, rotary_dim=8, vocab_size=256)


class TestGptj(FamilyChecks):
    family = FAMILY


def np_gptj_rope(x: np.ndarray, offset: int, rotary_dim: int) -> np.ndarray:
    """transformers' GPT-J: sin/cos of position * 10000^(-2i / rotary_dim), each repeated
    twice, times x and rotate_every_two(x) = (-x[2i+1], x[2i]) on the first rotary_dim
    features; the rest pass. x (B, H, L, D)."""
    L = x.shape[-2]
    inv_freq = 1.0 / 10000 ** (np.arange(0, rotary_dim, 2) / rotary_dim)
    angles = np.arange(offset, offset + L)[:, None] * inv_freq[None]  # (L, rotary_dim / 2)
    sin, cos = np.repeat(np.sin(angles), 2, -1), np.repeat(np.cos(angles), 2, -1)
    turned = x[..., :rotary_dim]
    every_two = np.stack([-turned[..., 1::2], turned[..., 0::2]], -1).reshape(turned.shape)
    return np.concatenate([turned * cos + every_two * sin, x[..., rotary_dim:]], -1)


def test_rope_turns_interleaved_pairs_of_the_first_rotary_dim():
    rope = fixture_model("gptj_tf5").layers[0].attn.rope
    x = np.random.default_rng(0).normal(size=(1, 2, 5, 16)).astype(np.float32)
    for offset in (0, 33):
        got = np.array(rope(mx.array(x), offset=offset))
        np.testing.assert_allclose(got, np_gptj_rope(x, offset, 8), rtol=1e-5, atol=1e-5)
        assert np.array_equal(got[..., 8:], x[..., 8:])


def test_block_is_parallel_and_rope_matters():
    assert_override_matters("gptj_tf5", {"rotary_dim": 16})
    block = fixture_model("gptj_tf5").layers[0]
    x = mx.random.normal((1, 4, 64), key=mx.random.key(1))
    h = block.ln_1(x)
    assert mx.allclose(block(x, "causal"), x + block.attn(h, "causal") + block.mlp(h), atol=1e-6)


def test_lm_head_bias_counts_and_tied_weight_is_wtes():
    ids, want = reference("gptj_tied")
    model, _ = load_model(FIXTURES / "gptj_tied")
    assert mx.array_equal(model.lm_head.weight, model.transformer.wte.weight)
    model.lm_head.bias = mx.zeros_like(model.lm_head.bias)
    assert relative_error(model(ids), want) > 1e-2


def test_sanitize_renames_upstream_and_drops_buffers():
    raw = raw_weights("gptj_tf5")
    buffers = {"transformer.h.0.attn.bias": mx.ones((1, 1, 4, 4)), "transformer.h.0.attn.masked_bias": mx.array(-1e4)}
    assert_sanitize_converts_once("gptj_tf5", buffers, dropped=list(buffers))
    upstream = {("model." + k.removeprefix("transformer.") if k.startswith("transformer.") else k): v
                for k, v in raw.items()}
    assert_sanitize_converts_once("gptj_tf5", upstream, dropped=[k for k in upstream if k.startswith("model.")])
    tied = assert_sanitize_converts_once("gptj_tied")
    assert mx.array_equal(tied["lm_head.weight"], tied["transformer.wte.weight"]) and "lm_head.bias" in tied


@pytest.mark.parametrize("override, match", [
    ({"rotary_dim": None}, "rotary_dim must be an even number in 2..16"), ({"rotary_dim": 32}, "got 32"),
    ({"n_head": 5}, r"n_head \(5\)"), ({"activation_function": "mish"}, "'mish'"),
])
def test_config_errors_name_the_value(override, match):
    with pytest.raises(ValueError, match=match):
        ModelArgs.from_dict(dict(ARGS, **override))
    assert ModelArgs.from_dict(dict(ARGS, n_embd=None, hidden_size=64)).n_embd == 64
