"""mla.py: latent attention with rope (deepseek_v2 / deepseek_v3) against transformers'
expanded form in float64 (per-head keys [W_k c, rope(k_rot)], values W_v c, causal
softmax), whole and through the latent cache in pieces; the yarn softmax scale against
transformers' formula. The rope-free form (Kimi Linear) and the absorbed product by
hand are in test_kimi_linear.py.
"""

import math

import mlx.core as mx
import numpy as np
import pytest
from family_checks import fixture_model, relative_error
from mlx.utils import tree_map

from mlx_lm.models.cache import KVCache
from mlx_lm.models.mla import LatentAttention, softmax_scale
from mlx_lm.utils import get_model_classes


def np_rope(x: np.ndarray, offset: int, theta: float, traditional: bool) -> np.ndarray:
    """x (..., T, d) turned at positions offset..: pairs (2i, 2i+1) if traditional, else
    (i, i + d/2), pair i by position * theta^(-2i/d) (plain rope)."""
    d = x.shape[-1]
    angles = np.arange(offset, offset + x.shape[-2])[:, None] * theta ** (-np.arange(0, d, 2) / d)  # (T, d/2)
    cos, sin = np.cos(angles), np.sin(angles)
    if traditional:
        a, b = x[..., 0::2], x[..., 1::2]
        return np.stack([a * cos - b * sin, a * sin + b * cos], axis=-1).reshape(x.shape)
    a, b = x[..., : d // 2], x[..., d // 2 :]
    return np.concatenate([a * cos - b * sin, b * cos + a * sin], axis=-1)


def expanded_attention(attn: LatentAttention, x: np.ndarray, theta: float, traditional: bool) -> np.ndarray:
    """transformers' DeepseekV2/V3 attention in float64, keys and values expanded per head."""
    H, dn, dv, r = attn.num_heads, attn.nope_dim, attn.v_dim, attn.kv_lora_rank
    B, T, _ = x.shape
    f64 = lambda a: np.array(a, dtype=np.float64)  # noqa: E731
    q = f64(attn.queries(mx.array(x.astype(np.float32))))  # (B, H, T, dn + dr)
    q = np.concatenate([q[..., :dn], np_rope(q[..., dn:], 0, theta, traditional)], axis=-1)
    kv = x @ f64(attn.kv_a_proj_with_mqa.weight).T
    if "bias" in attn.kv_a_proj_with_mqa:
        kv = kv + f64(attn.kv_a_proj_with_mqa.bias)
    c, k_rot = kv[..., :r], np_rope(kv[..., r:], 0, theta, traditional)  # (B, T, r), (B, T, dr)
    c = c / np.sqrt((c**2).mean(-1, keepdims=True) + 1e-6) * f64(attn.kv_a_layernorm.weight)
    kv_b = (c @ f64(attn.kv_b_proj.weight).T).reshape(B, T, H, dn + dv).transpose(0, 2, 1, 3)
    keys = np.concatenate([kv_b[..., :dn], np.broadcast_to(k_rot[:, None], (B, H, T, k_rot.shape[-1]))], axis=-1)
    scores = attn.scale * q @ keys.swapaxes(-1, -2) + np.triu(np.full((T, T), -np.inf), 1)
    p = np.exp(scores - scores.max(-1, keepdims=True))
    out = ((p / p.sum(-1, keepdims=True)) @ kv_b[..., dn:]).transpose(0, 2, 1, 3).reshape(B, T, -1)
    out = out @ f64(attn.o_proj.weight).T
    return out + f64(attn.o_proj.bias) if "bias" in attn.o_proj else out


def rotate_half_model():
    """deepseek_v3 with rotate-half pairs, plain rope at theta 50 and a q LoRA."""
    config = dict(model_type="deepseek_v3", vocab_size=64, hidden_size=64, intermediate_size=32, num_hidden_layers=1,
                  num_attention_heads=4, q_lora_rank=16, kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=8,
                  v_head_dim=16, n_routed_experts=4, n_group=1, topk_group=1, num_experts_per_tok=2,
                  first_k_dense_replace=1, rope_theta=50.0, rope_interleave=False)
    model_class, args_class = get_model_classes(config)
    model = model_class(args_class.from_dict(config))
    mx.random.seed(3)
    model.update(tree_map(lambda w: mx.random.normal(w.shape) * 0.3, model.parameters()))
    return model


@pytest.mark.parametrize("which", ["deepseek_v2_tf5", "rotate_half"])
def test_latent_attention_with_rope_equals_expanded_keys_and_values(which):
    """deepseek_v2_tf5: interleaved pairs at theta 300, q LoRA, biases; rotate_half:
    deepseek_v3's rope_interleave False."""
    model = fixture_model(which) if which != "rotate_half" else rotate_half_model()
    attn, args = model.layers[0].self_attn, model.args
    x = np.random.default_rng(5).standard_normal((2, 11, 64))
    want = mx.array(expanded_attention(attn, x, args.rope_theta, args.rope_traditional).astype(np.float32))
    assert relative_error(attn(mx.array(x.astype(np.float32)), "causal"), want) < 1e-5
    cache, pieces = KVCache(), []
    for start, stop in ((0, 4), (4, 5), (5, 11)):  # the rope offsets come from the latent cache
        pieces.append(attn(mx.array(x[:, start:stop].astype(np.float32)), cache.make_mask(stop - start), cache))
    assert relative_error(mx.concatenate(pieces, axis=1), want) < 1e-5


def get_mscale(scale: float, mscale: float) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


@pytest.mark.parametrize("scaling, want", [
    (None, 24**-0.5),
    ({"rope_type": "yarn", "factor": 40.0, "mscale": 0.707, "mscale_all_dim": 0.707},
     24**-0.5 * get_mscale(40.0, 0.707) ** 2),  # DeepSeek-V2-Lite
    ({"rope_type": "yarn", "factor": 40.0, "mscale": 1.0}, 24**-0.5),  # no mscale_all_dim: unscaled
    ({"rope_type": "yarn", "factor": 1.0, "mscale_all_dim": 1.0}, 24**-0.5),  # factor 1: get_mscale is 1
])
def test_softmax_scale_is_transformers_yarn_apply_mscale(scaling, want):
    assert softmax_scale(24, scaling) == pytest.approx(want, rel=1e-12)
