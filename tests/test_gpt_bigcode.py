"""gpt_bigcode.py (GPT-BigCode, StarCoder): the shared family checks (family_checks.py) on
the transformers fixtures, plus what only GPT-BigCode has: the multi-query split of
c_attn (one KV head shared by every query head) against a naive one, the per-head
layout without multi_query, sanitize (Linear weights renamed, not transposed) and the
config. Two-rank sharding of FAMILY.tiny (query heads split, the KV head kept whole on
each rank) is in test_distributed.py.

Fixtures come from fixtures/make_gpt_bigcode_reference.py: gpt_bigcode_tf5 (multi-query,
tied) and gpt_bigcode_mha (multi_query false, untied, exact gelu).
"""

import mlx.core as mx
from checkpoints import VOCAB_SIZE
from family_checks import Family, FamilyChecks, fixture_model
from layout_checks import assert_sanitize_converts_once, raw_weights

from mlx_lm.models.cache import make_prompt_cache
from mlx_lm.models.gpt_bigcode import ModelArgs

FAMILY = Family(
    fixtures=["gpt_bigcode_mha", "gpt_bigcode_tf5"],
    tiny=dict(model_type="gpt_bigcode", n_embd=64, n_head=4, n_layer=2, n_positions=128, vocab_size=VOCAB_SIZE,
              eos_token_id=0),
    small=dict(model_type="gpt_bigcode", n_embd=32, n_head=2, n_layer=1, n_positions=128, vocab_size=256),
)


class TestGptBigcode(FamilyChecks):
    family = FAMILY


def test_multi_query_shares_one_kv_head():
    attn = fixture_model("gpt_bigcode_tf5").layers[0].attn
    x = mx.random.normal((1, 5, 64), key=mx.random.key(0))
    qkv = attn.c_attn(x)  # (1, 5, 64 + 16 + 16)
    q, k, v = attn.split_heads(qkv)
    assert q.shape == (1, 4, 5, 16) and k.shape == v.shape == (1, 1, 5, 16)
    for h in range(4):
        assert mx.array_equal(q[0, h], qkv[0, :, 16 * h:16 * (h + 1)])
    assert mx.array_equal(k[0, 0], qkv[0, :, 64:80]) and mx.array_equal(v[0, 0], qkv[0, :, 80:96])
    cache = make_prompt_cache(fixture_model("gpt_bigcode_tf5"))
    fixture_model("gpt_bigcode_tf5")(mx.array([[1, 2, 3]]), cache=cache)
    assert cache[0].state[0].shape[1] == 1  # one KV head cached


def test_without_multi_query_each_head_has_its_rows():
    attn = fixture_model("gpt_bigcode_mha").layers[0].attn
    qkv = mx.arange(2 * 3 * 4 * 3 * 16, dtype=mx.float32).reshape(2, 3, 4 * 3 * 16)
    q, k, v = attn.split_heads(qkv)
    assert q.shape == k.shape == v.shape == (2, 4, 3, 16)
    for h in range(4):
        rows = qkv[:, :, 48 * h:48 * (h + 1)]  # head h: [q_h | k_h | v_h]
        assert mx.array_equal(q[:, h], rows[..., :16]) and mx.array_equal(k[:, h], rows[..., 16:32])
        assert mx.array_equal(v[:, h], rows[..., 32:])


def test_sanitize_renames_without_transposing():
    raw = raw_weights("gpt_bigcode_tf5")
    once = assert_sanitize_converts_once("gpt_bigcode_tf5", {"lm_head.weight": raw["transformer.wte.weight"]},
                                         dropped=["lm_head.weight"])
    assert mx.array_equal(once["model.h.0.attn.c_attn.weight"], raw["transformer.h.0.attn.c_attn.weight"])
    assert_sanitize_converts_once("gpt_bigcode_mha")


def test_config_defaults():
    args = ModelArgs(model_type="gpt_bigcode")
    assert (args.multi_query, args.num_key_value_heads, args.activation_function, args.tie_word_embeddings) == (
        True, 1, "gelu_pytorch_tanh", True)
    assert ModelArgs(model_type="gpt_bigcode", multi_query=False, n_head=8).num_key_value_heads == 8
