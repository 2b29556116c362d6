"""Qwen3-Next: a hybrid of Gated DeltaNet linear attention and gated full attention, with
a sparse mixture of experts plus a shared expert.

What differs from llama:
- Most layers (`layer_types`, else every layer but each `full_attention_interval`-th)
  mix tokens with a Gated DeltaNet (`linear_attn`): grouped input projections, a
  depthwise causal conv1d (its last K-1 input rows are the conv state), L2-normalised
  queries and keys, the gated delta rule (`gated_delta.py`, fp32 state) and a gated
  RMSNorm before `out_proj`. Their cache is an `ArraysCache(2)`: conv state, recurrent
  state.
- Full attention layers gate their output: `q_proj` yields per head [query | gate] and
  the output is o_proj(attn * sigmoid(gate)); q/k are RMS-normalised per head; rope
  turns only the first `partial_rotary_factor` of each head.
- The checkpoint's RMSNorms are zero-centred (transformers computes x_hat * (1 + w));
  `sanitize` adds the 1 once, so plain `nn.RMSNorm` applies. `linear_attn.norm` is a
  plain (not zero-centred) gated norm.
- MLP: a softmax top-k router over `switch_mlp` experts plus a `shared_expert` scaled by
  sigmoid(`shared_expert_gate`(x)), except in `mlp_only_layers` and off the
  `decoder_sparse_step` grid, where a dense SwiGLU sits.
- The checkpoint may carry a multi-token-prediction head (`mtp.*`, declared by
  `num_nextn_predict_layers`): see MultiTokenPredictor. It is loaded but runs only when
  a speculative run drafts with it (drafters.MTPHead); plain decoding never calls it.
References: transformers `models/qwen3_next/modeling_qwen3_next.py` (which ignores
`mtp.*`); vLLM `model_executor/models/qwen3_next_mtp.py` for the head; Yang et al.,
"Gated Delta Networks" (arXiv 2412.06464).
"""

import re
from dataclasses import dataclass
from functools import partial
from typing import Any, Dict, List, Optional, Tuple, Union

import mlx.core as mx
import mlx.nn as nn

from .base import (
    BaseModelArgs,
    run_hybrid_layers,
    check_head_grouping,
    check_layer_types,
    create_attention_mask,
    scaled_dot_product_attention,
)
from . import pipeline, sharding
from .cache import ArraysCache, KVCache
from .gated_delta import CONV_STATE, compute_g, gated_delta_cached
from .llama import MLP
from .rope_utils import initialize_rope, resolve_rope
from .switch_layers import SwitchGLU

LINEAR_ATTENTION, FULL_ATTENTION = "linear_attention", "full_attention"
# Slots of a linear-attention layer's ArraysCache.
# Zero-centred RMSNorm weights in the checkpoint (the gated `linear_attn.norm` is not).
ZERO_CENTRED_NORMS = ("input_layernorm.weight", "post_attention_layernorm.weight", "q_norm.weight", "k_norm.weight")
# The MTP head's own zero-centred norms (its decoder layer's end in ZERO_CENTRED_NORMS).
MTP_NORMS = ("mtp.pre_fc_norm_embedding.weight", "mtp.pre_fc_norm_hidden.weight", "mtp.norm.weight")
# transformers' l2norm adds this to the sum of squares of each query and key head.
L2_NORM_EPS = 1e-6


@dataclass
class ModelArgs(BaseModelArgs):
    model_type: str
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    vocab_size: int
    linear_num_key_heads: int
    linear_num_value_heads: int
    linear_key_head_dim: int
    linear_value_head_dim: int
    linear_conv_kernel_dim: int = 4
    intermediate_size: Optional[int] = None  # dense MLP layers
    head_dim: Optional[int] = 256  # transformers' default for these families
    rms_norm_eps: float = 1e-6
    hidden_act: str = "silu"
    attention_bias: bool = False
    tie_word_embeddings: bool = False
    max_position_embeddings: Optional[int] = None
    rope_theta: Optional[float] = None
    rope_scaling: Optional[Dict[str, Any]] = None
    rope_parameters: Optional[Dict[str, Any]] = None
    partial_rotary_factor: Optional[float] = None
    layer_types: Optional[List[str]] = None
    full_attention_interval: int = 4
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    shared_expert_intermediate_size: int = 0
    norm_topk_prob: bool = True
    decoder_sparse_step: int = 1
    mlp_only_layers: Optional[List[int]] = None
    num_nextn_predict_layers: int = 0  # MTP head layers (qwen3_5 names it mtp_num_hidden_layers)

    def __post_init__(self):
        if self.head_dim is None:
            self.head_dim = self.hidden_size // self.num_attention_heads
        if self.mlp_only_layers is None:
            self.mlp_only_layers = []
        theta, self.rope_scaling, factor = resolve_rope(self.rope_theta, self.rope_scaling, self.rope_parameters)
        self.rope_theta = 10000.0 if theta is None else theta
        if self.partial_rotary_factor is None:  # transformers' default for these families
            self.partial_rotary_factor = 0.25 if factor is None else factor
        if self.layer_types is None:
            if self.full_attention_interval < 1:
                raise ValueError(f"full_attention_interval must be >= 1, got {self.full_attention_interval}")
            self.layer_types = [
                FULL_ATTENTION if (i + 1) % self.full_attention_interval == 0 else LINEAR_ATTENTION
                for i in range(self.num_hidden_layers)
            ]
        self._validate()

    def _validate(self):
        check_layer_types(self.layer_types, self.num_hidden_layers, (LINEAR_ATTENTION, FULL_ATTENTION))
        if self.hidden_act != "silu":
            raise ValueError(f"hidden_act {self.hidden_act!r} is not supported; this family uses 'silu'")
        if self.linear_num_value_heads % self.linear_num_key_heads:
            raise ValueError(
                f"linear_num_value_heads ({self.linear_num_value_heads}) must be a multiple of "
                f"linear_num_key_heads ({self.linear_num_key_heads})"
            )
        check_head_grouping(self.num_attention_heads, self.num_key_value_heads)
        # K = 1 (a per-channel scale, no conv state) is allowed: both conv layouts are then
        # (C, 1, 1), so sanitize has nothing to convert.
        if self.linear_conv_kernel_dim < 1:
            raise ValueError(f"linear_conv_kernel_dim must be >= 1, got {self.linear_conv_kernel_dim}")
        if self.rotary_dims % 2 or not 0 < self.rotary_dims <= self.head_dim:
            raise ValueError(
                f"partial_rotary_factor {self.partial_rotary_factor} of head_dim {self.head_dim} gives "
                f"{self.rotary_dims} rotary dims; need an even number in (0, head_dim]"
            )
        kinds = [self.is_moe_layer(i) for i in range(self.num_hidden_layers)]
        if any(kinds) and not 0 < self.num_experts_per_tok <= self.num_experts:
            raise ValueError(
                f"num_experts_per_tok ({self.num_experts_per_tok}) must be in 1..num_experts ({self.num_experts})"
            )
        if not all(kinds) and not self.intermediate_size:
            raise ValueError(f"intermediate_size is {self.intermediate_size!r} but some layers use a dense MLP")
        if self.num_mtp_layers < 0:
            raise ValueError(f"the MTP head's layer count must be >= 0, got {self.num_mtp_layers}")

    @property
    def num_mtp_layers(self) -> int:
        """Decoder layers of the multi-token-prediction head (0: none)."""
        return self.num_nextn_predict_layers

    @property
    def rotary_dims(self) -> int:
        return int(self.head_dim * self.partial_rotary_factor)

    def is_moe_layer(self, layer_idx: int) -> bool:
        return (
            layer_idx not in self.mlp_only_layers
            and self.num_experts > 0
            and (layer_idx + 1) % self.decoder_sparse_step == 0
        )


def l2_normalize(x: mx.array, scale: float = 1.0) -> mx.array:
    """scale * x / sqrt(sum(x^2) + L2_NORM_EPS) over the last axis, in fp32; (..., D) -> (..., D).

    rms_norm with eps / D is the same expression up to a factor sqrt(D), in one kernel.
    """
    D = x.shape[-1]
    return mx.fast.rms_norm(x.astype(mx.float32), None, L2_NORM_EPS / D) * (scale * D**-0.5)


@partial(mx.compile, shapeless=True)
def _weighted_sum(rows: List[mx.array], taps: List[mx.array]) -> mx.array:
    """sum_j rows[j] * taps[j], fused into one pass (elementwise only, so shapeless)."""
    out = rows[0] * taps[0]
    for row, tap in zip(rows[1:], taps[1:]):
        out = out + row * tap
    return out


def causal_conv1d(conv_input: mx.array, weight: mx.array) -> mx.array:
    """Depthwise causal convolution, no padding: the input already starts with K-1 rows of
    history (the conv state, zeros at the start of a sequence).

    conv_input (B, K-1+T, C), weight (C, K, 1) -> (B, T, C). As K shifted multiply-adds:
    on the CPU backend that is several times faster than a grouped mx.conv1d.
    """
    K = weight.shape[1]
    T = conv_input.shape[1] - K + 1
    taps = weight[:, :, 0].T  # (K, C)
    if T == 1:  # decode: one dot product per channel
        return (conv_input * taps).sum(axis=1, keepdims=True)
    return _weighted_sum([conv_input[:, j : j + T] for j in range(K)], [taps[j] for j in range(K)])


def route(logits: mx.array, top_k: int, normalize: bool) -> Tuple[mx.array, mx.array]:
    """Softmax router: logits (..., E) -> expert ids (..., k) and their weights (..., k),
    the softmax probabilities (fp32) of the k best experts, renormalised to sum to 1 if
    `normalize`. Weights come back in the logits' dtype."""
    probs = mx.softmax(logits.astype(mx.float32), axis=-1, precise=True)
    # Indices carry no gradient (training the MoE head or adapters differentiates through here).
    experts = mx.stop_gradient(mx.argpartition(-probs, kth=top_k - 1, axis=-1)[..., :top_k])
    weights = mx.take_along_axis(probs, experts, axis=-1)
    if normalize:
        weights = weights / weights.sum(axis=-1, keepdims=True)
    return experts, weights.astype(logits.dtype)


class GatedRMSNorm(nn.Module):
    """rmsnorm(y) * weight * silu(z) per value head; the gate is applied in fp32."""

    def __init__(self, dims: int, eps: float):
        super().__init__()
        self.weight = mx.ones((dims,))
        self.eps = eps

    def __call__(self, y: mx.array, z: mx.array) -> mx.array:
        normed = mx.fast.rms_norm(y, self.weight, self.eps)
        return (normed.astype(mx.float32) * nn.silu(z.astype(mx.float32))).astype(y.dtype)


class GatedDeltaNet(nn.Module):
    """Linear attention by the gated delta rule. qwen3_next projects q, k, v, z with one
    matrix and b, a with another, both grouped per key head; qwen3_5 overrides
    `make_projections` / `project` with separate ones."""

    def __init__(self, args: ModelArgs):
        super().__init__()
        self.num_key_heads, self.num_value_heads = args.linear_num_key_heads, args.linear_num_value_heads
        self.key_head_dim, self.value_head_dim = args.linear_key_head_dim, args.linear_value_head_dim
        self.key_dim = self.num_key_heads * self.key_head_dim
        self.value_dim = self.num_value_heads * self.value_head_dim
        self.conv_dim = 2 * self.key_dim + self.value_dim  # channels [all q | all k | all v]
        self.conv_kernel_size = args.linear_conv_kernel_dim
        self.make_projections(args.hidden_size)
        self.conv1d = nn.Conv1d(
            self.conv_dim, self.conv_dim, self.conv_kernel_size, groups=self.conv_dim, bias=False
        )  # weight (C, K, 1)
        self.A_log = mx.zeros((self.num_value_heads,))
        self.dt_bias = mx.ones((self.num_value_heads,))
        self.norm = GatedRMSNorm(self.value_head_dim, args.rms_norm_eps)
        self.out_proj = nn.Linear(self.value_dim, args.hidden_size, bias=False)

    def make_projections(self, hidden_size: int):
        self.in_proj_qkvz = nn.Linear(hidden_size, 2 * self.key_dim + 2 * self.value_dim, bias=False)
        self.in_proj_ba = nn.Linear(hidden_size, 2 * self.num_value_heads, bias=False)

    def project(self, x: mx.array) -> Tuple[mx.array, mx.array, mx.array, mx.array]:
        """x (B, T, hidden) -> conv rows qkv (B, T, conv_dim), z (B, T, Hv, Dv), b, a (B, T, Hv).

        Each key head's slice of in_proj_qkvz is [q Dk | k Dk | v r*Dv | z r*Dv] and of
        in_proj_ba [b r | a r], r = Hv / Hk value heads per key head."""
        B, T, _ = x.shape
        Dk, r = self.key_head_dim, self.num_value_heads // self.num_key_heads
        qkvz = self.in_proj_qkvz(x).reshape(B, T, self.num_key_heads, -1)  # (B, T, Hk, 2Dk + 2rDv)
        q, k, v, z = mx.split(qkvz, [Dk, 2 * Dk, 2 * Dk + r * self.value_head_dim], axis=-1)
        b, a = mx.split(self.in_proj_ba(x).reshape(B, T, self.num_key_heads, 2 * r), [r], axis=-1)
        qkv = mx.concatenate([q.reshape(B, T, -1), k.reshape(B, T, -1), v.reshape(B, T, -1)], axis=-1)
        z = z.reshape(B, T, self.num_value_heads, self.value_head_dim)
        return qkv, z, b.reshape(B, T, -1), a.reshape(B, T, -1)

    def conv_input(self, qkv: mx.array, cache: Optional[ArraysCache]) -> mx.array:
        """[conv state ; new rows]: (B, K-1+T, conv_dim). The next conv state is its last
        K-1 rows, and after only m of the T tokens it is rows [m, m+K-1)."""
        state = None if cache is None else cache[CONV_STATE]
        if state is None:
            state = mx.zeros((qkv.shape[0], self.conv_kernel_size - 1, self.conv_dim), qkv.dtype)
        return mx.concatenate([state, qkv], axis=1)

    def heads(self, mixed: mx.array) -> Tuple[mx.array, mx.array, mx.array]:
        """Conv outputs (B, T, conv_dim) -> q, k (B, T, Hk, Dk) L2-normalised in fp32, q
        also scaled by Dk^-1/2, and v (B, T, Hv, Dv)."""
        B, T, _ = mixed.shape
        q, k, v = mx.split(mixed, [self.key_dim, 2 * self.key_dim], axis=-1)
        q = l2_normalize(q.reshape(B, T, self.num_key_heads, -1), self.key_head_dim**-0.5)
        k = l2_normalize(k.reshape(B, T, self.num_key_heads, -1))
        return q, k, v.reshape(B, T, self.num_value_heads, -1)

    def __call__(self, x: mx.array, cache: Optional[ArraysCache] = None) -> mx.array:
        B, T, _ = x.shape
        qkv, z, b, a = self.project(x)
        conv_input = self.conv_input(qkv, cache)  # (B, K-1+T, conv_dim)
        q, k, v = self.heads(nn.silu(causal_conv1d(conv_input, self.conv1d.weight)))
        g, beta = compute_g(self.A_log, a, self.dt_bias), mx.sigmoid(b.astype(mx.float32))  # (B, T, Hv)
        y = gated_delta_cached(conv_input, q, k, v, g, beta, cache)  # (B, T, Hv, Dv)
        return self.out_proj(self.norm(y, z).reshape(B, T, -1))

    def shard(self, group: mx.distributed.Group) -> None:
        """Keep this rank's key heads, each with its value heads: in_proj_qkvz and
        in_proj_ba are grouped per key head, so contiguous rows are whole heads."""
        sharding.shard_gated_delta(self, group, per_head=("in_proj_qkvz", "in_proj_ba"))


class Attention(nn.Module):
    """Grouped-query attention with per-head q/k RMSNorm, partial rope and an output gate."""

    def __init__(self, args: ModelArgs):
        super().__init__()
        dim, self.head_dim = args.hidden_size, args.head_dim
        self.num_heads, self.num_kv_heads = args.num_attention_heads, args.num_key_value_heads
        self.scale = self.head_dim**-0.5
        bias = args.attention_bias
        self.q_proj = nn.Linear(dim, 2 * self.num_heads * self.head_dim, bias=bias)  # per head [query | gate]
        self.k_proj = nn.Linear(dim, self.num_kv_heads * self.head_dim, bias=bias)
        self.v_proj = nn.Linear(dim, self.num_kv_heads * self.head_dim, bias=bias)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, dim, bias=bias)
        self.q_norm = nn.RMSNorm(self.head_dim, eps=args.rms_norm_eps)
        self.k_norm = nn.RMSNorm(self.head_dim, eps=args.rms_norm_eps)
        self.rope = initialize_rope(
            args.rotary_dims, args.rope_theta, False, args.rope_scaling, args.max_position_embeddings
        )

    def __call__(self, x: mx.array, mask: Optional[mx.array] = None, cache=None) -> mx.array:
        B, L, _ = x.shape
        q, gate = mx.split(self.q_proj(x).reshape(B, L, self.num_heads, 2 * self.head_dim), 2, axis=-1)
        k = self.k_proj(x).reshape(B, L, self.num_kv_heads, -1)  # (B, L, H_kv, D)
        v = self.v_proj(x).reshape(B, L, self.num_kv_heads, -1)
        q, k, v = (t.transpose(0, 2, 1, 3) for t in (self.q_norm(q), self.k_norm(k), v))  # (B, H, L, D)
        offset = cache.offset if cache is not None else 0
        q, k = self.rope(q, offset=offset), self.rope(k, offset=offset)
        if cache is not None:
            k, v = cache.update_and_fetch(k, v)
        out = scaled_dot_product_attention(q, k, v, cache=cache, scale=self.scale, mask=mask)
        out = out.transpose(0, 2, 1, 3).reshape(B, L, -1)  # (B, L, H * D)
        return self.o_proj(out * mx.sigmoid(gate.reshape(B, L, -1)))


class SparseMoeBlock(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.top_k, self.norm_topk_prob = args.num_experts_per_tok, args.norm_topk_prob
        self.gate = nn.Linear(args.hidden_size, args.num_experts, bias=False)
        self.switch_mlp = SwitchGLU(args.hidden_size, args.moe_intermediate_size, args.num_experts)
        self.shared_expert = MLP(args.hidden_size, args.shared_expert_intermediate_size)
        self.shared_expert_gate = nn.Linear(args.hidden_size, 1, bias=False)

    def __call__(self, x: mx.array) -> mx.array:
        experts, weights = route(self.gate(x), self.top_k, self.norm_topk_prob)  # (B, L, k)
        routed = (self.switch_mlp(x, experts) * weights[..., None]).sum(axis=-2)  # (B, L, hidden)
        return routed + self.shared_expert(x) * mx.sigmoid(self.shared_expert_gate(x))


class DecoderLayer(nn.Module):
    def __init__(self, args: ModelArgs, layer_idx: int, linear_attention_class=GatedDeltaNet,
                 layer_type: Optional[str] = None):
        super().__init__()
        self.is_linear = (layer_type or args.layer_types[layer_idx]) == LINEAR_ATTENTION
        if self.is_linear:
            self.linear_attn = linear_attention_class(args)
        else:
            self.self_attn = Attention(args)
        if args.is_moe_layer(layer_idx):
            self.mlp = SparseMoeBlock(args)
        else:
            self.mlp = MLP(args.hidden_size, args.intermediate_size)
        self.input_layernorm = nn.RMSNorm(args.hidden_size, eps=args.rms_norm_eps)
        self.post_attention_layernorm = nn.RMSNorm(args.hidden_size, eps=args.rms_norm_eps)

    def __call__(self, x: mx.array, mask: Optional[mx.array] = None, cache=None) -> mx.array:
        h = self.input_layernorm(x)
        h = x + (self.linear_attn(h, cache) if self.is_linear else self.self_attn(h, mask, cache))
        return h + self.mlp(self.post_attention_layernorm(h))


class TextModel(pipeline.PipelineMixin, nn.Module):
    def __init__(self, args: ModelArgs, linear_attention_class=GatedDeltaNet):
        super().__init__()
        self.embed_tokens = nn.Embedding(args.vocab_size, args.hidden_size)
        self.layers = [DecoderLayer(args, i, linear_attention_class) for i in range(args.num_hidden_layers)]
        self.norm = nn.RMSNorm(args.hidden_size, eps=args.rms_norm_eps)

    @property
    def first_attention_layer(self) -> Optional[int]:
        """Attention layers share one mask, made from the first one's cache (None: this
        model, or this pipeline rank, has none); GDN layers need none."""
        return next((i for i, layer in enumerate(self.layers) if not layer.is_linear), None)

    def __call__(self, inputs: mx.array, cache: Optional[List[Any]] = None) -> mx.array:
        h = pipeline.receive(self.embed_tokens(inputs), self.stage)  # (B, L, hidden)
        h = run_hybrid_layers(h, self.layers, cache, self.first_attention_layer)
        return self.norm(pipeline.send_and_share(h, self.stage, cache))


class MultiTokenPredictor(nn.Module):
    """The multi-token-prediction head (`mtp.*`): from the backbone's final hidden state
    h_t (after its final norm, what the lm_head scores) and the embedding of token t+1,
    a prediction of token t+2:

        x = fc(concat[pre_fc_norm_embedding(embed(x_{t+1})), pre_fc_norm_hidden(h_t)])
        g_t = norm(layer(x))       logits = lm_head(g_t)

    (embedding first: engines that swapped the halves lost most of the acceptance). The
    layer is a full-attention decoder layer like the backbone's (gated q_proj, q/k norms,
    the backbone's MLP kind for layer index 0) with its own KV cache: entry t holds the
    pair (x_{t+1}, h_t), roped at position t as vLLM places it (rope is relative, so any
    fixed shift of the positions gives the same scores). To draft further, the head is
    applied to its own g_t with the token it drafted. All norms are zero-centred in the
    checkpoint (sanitize adds the 1)."""

    def __init__(self, args: ModelArgs, linear_attention_class=GatedDeltaNet):
        super().__init__()
        hidden, eps = args.hidden_size, args.rms_norm_eps
        self.fc = nn.Linear(2 * hidden, hidden, bias=False)
        self.pre_fc_norm_embedding = nn.RMSNorm(hidden, eps=eps)
        self.pre_fc_norm_hidden = nn.RMSNorm(hidden, eps=eps)
        self.layers = [
            DecoderLayer(args, 0, linear_attention_class, layer_type=FULL_ATTENTION)
            for _ in range(args.num_mtp_layers)
        ]
        self.norm = nn.RMSNorm(hidden, eps=eps)

    def __call__(self, embedded: mx.array, hidden: mx.array, cache: Optional[List[Any]] = None) -> mx.array:
        """embedded (B, T, H) = embed(x_{t+1}), hidden (B, T, H) = h_t -> g_t (B, T, H)."""
        x = self.fc(mx.concatenate([self.pre_fc_norm_embedding(embedded), self.pre_fc_norm_hidden(hidden)], axis=-1))
        if cache is None:
            cache = [None] * len(self.layers)
        mask = create_attention_mask(x, cache[0])
        for layer, layer_cache in zip(self.layers, cache):
            x = layer(x, mask, layer_cache)
        return self.norm(x)


def has_hf_conv_layout(weights: Dict[str, mx.array]) -> bool:
    """True for raw transformers weights: their conv1d is (C, 1, K), ours (C, K, 1)."""
    convs = [v for k, v in weights.items() if k.endswith("linear_attn.conv1d.weight")]
    if not convs:
        raise ValueError(
            "no linear_attn.conv1d.weight in the checkpoint: cannot tell raw transformers weights "
            "(zero-centred norms) from converted ones"
        )
    return any(w.shape[1] == 1 and w.shape[2] > 1 for w in convs)


_PER_EXPERT = re.compile(r"^(.*\.mlp)\.experts\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")


def stack_expert_weights(weights: Dict[str, mx.array]) -> Dict[str, mx.array]:
    """mlp.experts.{e}.{gate,up,down}_proj.weight (out, in) -> mlp.switch_mlp.*.weight (E, out, in)."""
    groups: Dict[Tuple[str, str], Dict[int, mx.array]] = {}
    out = {}
    for key, value in weights.items():
        match = _PER_EXPERT.match(key)
        if match:
            prefix, expert, proj = match.groups()
            groups.setdefault((prefix, proj), {})[int(expert)] = value
        else:
            out[key] = value
    for (prefix, proj), experts in groups.items():
        if sorted(experts) != list(range(len(experts))):
            raise ValueError(f"{prefix}.experts has {proj} for experts {sorted(experts)}; expected 0..{len(experts) - 1}")
        out[f"{prefix}.switch_mlp.{proj}.weight"] = mx.stack([experts[e] for e in range(len(experts))])
    return out


def split_fused_experts(weights: Dict[str, mx.array]) -> Dict[str, mx.array]:
    """transformers-5 fused experts -> switch_mlp: experts.gate_up_proj (E, 2I, H), first
    half gate and second half up; experts.down_proj (E, H, I)."""
    out = {}
    for key, value in weights.items():
        if key.endswith(".mlp.experts.gate_up_proj"):
            prefix = key[: -len("experts.gate_up_proj")]
            gate, up = mx.split(value, 2, axis=1)
            out[prefix + "switch_mlp.gate_proj.weight"] = gate
            out[prefix + "switch_mlp.up_proj.weight"] = up
        elif key.endswith(".mlp.experts.down_proj"):
            out[key[: -len("experts.down_proj")] + "switch_mlp.down_proj.weight"] = value
        else:
            out[key] = value
    return out


def sanitize_text_weights(weights: Dict[str, mx.array], tie_word_embeddings: bool) -> Dict[str, mx.array]:
    """Raw transformers or converted weights (keys `model.*`, `lm_head.*`) -> ours.

    Each rewrite is guarded by what it changes, so running it again changes nothing:
    per-expert and fused experts are stacked/split when present; the conv weight is
    transposed when it has the HF (C, 1, K) shape; the zero-centred norms get +1 only
    when the conv weights were still in that raw shape.
    """
    raw = has_hf_conv_layout(weights)
    weights = dict(weights)
    if tie_word_embeddings:
        weights.pop("lm_head.weight", None)
    weights = split_fused_experts(stack_expert_weights(weights))
    for key, value in weights.items():
        if key.endswith("linear_attn.conv1d.weight") and value.shape[1] == 1 and value.shape[2] > 1:
            weights[key] = value.swapaxes(1, 2)  # (C, 1, K) -> (C, K, 1)
        elif raw and (key.endswith(ZERO_CENTRED_NORMS) or key == "model.norm.weight" or key in MTP_NORMS):
            weights[key] = value + 1.0
    return weights


def keep_mtp_weights(model: nn.Module, weights: Dict[str, mx.array]) -> Dict[str, mx.array]:
    """The checkpoint's `mtp.*` tensors stay when `model` has a head for them. A config
    that declares a head the checkpoint lacks (converted by a tool that drops it, as
    upstream mlx-lm does) leaves the model without one; a head the config does not
    declare is dropped (transformers ignores it too)."""
    has_weights = any(k.startswith("mtp.") for k in weights)
    if "mtp" in model and not has_weights:
        model.pop("mtp")
    if "mtp" not in model:
        weights = {k: v for k, v in weights.items() if not k.startswith("mtp.")}
    return weights


def quant_predicate(path: str, module: nn.Module) -> Union[bool, Dict[str, int]]:
    """Routers and the shared-expert gate are small and sensitive: keep them at 8 bits."""
    if path.endswith("mlp.gate") or path.endswith("shared_expert_gate"):
        return {"group_size": 64, "bits": 8}
    return True


class Model(nn.Module):
    # The token mixer of linear-attention layers; qwen3_5 swaps in its split projections.
    linear_attention_class = GatedDeltaNet
    # Linear-attention layers record rollbacks into their ArraysCache while speculating.
    supports_speculative_rollback = True
    # mtp_head, hidden_and_logits, mtp_forward and make_mtp_cache (drafters.MTPHead).
    supports_mtp = True

    def __init__(self, args: ModelArgs):
        super().__init__()
        self.args = args
        self.model_type = args.model_type
        self.model = TextModel(args, self.linear_attention_class)
        if not args.tie_word_embeddings:
            self.lm_head = nn.Linear(args.hidden_size, args.vocab_size, bias=False)
        if args.num_mtp_layers:
            self.mtp = MultiTokenPredictor(args, self.linear_attention_class)

    def __call__(self, inputs: mx.array, cache: Optional[List[Any]] = None) -> mx.array:
        """Token ids (B, L) -> logits (B, L, vocab)."""
        return self.logits(self.model(inputs, cache))

    def logits(self, hidden: mx.array) -> mx.array:
        """Final hidden states (B, L, H), after the final norm -> logits (B, L, vocab)."""
        if self.args.tie_word_embeddings:
            return self.model.embed_tokens.as_linear(hidden)
        return self.lm_head(hidden)

    def hidden_and_logits(self, inputs: mx.array, cache: Optional[List[Any]] = None) -> Tuple[mx.array, mx.array]:
        """Token ids (B, L) -> (final hidden states (B, L, H) after the final norm, logits)."""
        hidden = self.model(inputs, cache)
        return hidden, self.logits(hidden)

    @property
    def mtp_head(self) -> Optional[MultiTokenPredictor]:
        """The multi-token-prediction head, or None (none declared, or none in the checkpoint)."""
        return self.get("mtp")

    def mtp_forward(self, tokens: mx.array, hidden: mx.array, cache: List[Any]) -> Tuple[mx.array, mx.array]:
        """The head on pairs (x_{t+1} = tokens (B, T), h_t = hidden (B, T, H)) -> (g_t (B, T, H), logits of x_{t+2})."""
        g = self.mtp(self.model.embed_tokens(tokens), hidden, cache)
        return g, self.logits(g)

    def make_mtp_cache(self) -> List[KVCache]:
        return [KVCache() for _ in self.mtp.layers]

    def sanitize(self, weights: Dict[str, mx.array]) -> Dict[str, mx.array]:
        return sanitize_text_weights(keep_mtp_weights(self, weights), self.args.tie_word_embeddings)

    @property
    def layers(self) -> List[DecoderLayer]:
        return self.model.layers

    def make_cache(self) -> List[Union[ArraysCache, KVCache]]:
        return [ArraysCache(2) if layer.is_linear else KVCache() for layer in self.layers]

    def quant_predicate(self, path: str, module: nn.Module) -> Union[bool, Dict[str, int]]:
        return quant_predicate(path, module)

    def shard(self, group: Optional[mx.distributed.Group] = None) -> None:
        """Tensor parallel over `group` (default: the global group), in place: attention
        by heads, Gated DeltaNet by key heads (with their value heads, so each rank's
        conv and recurrent state, and what it records for rollback, cover only its own
        heads), MLPs and experts by hidden units. Routers, the shared-expert gate,
        embeddings and lm_head stay whole."""
        group = sharding.world(group)
        for layer in self.layers:
            if layer.is_linear:
                layer.linear_attn.shard(group)
            else:
                attn = layer.self_attn
                attn.num_heads, attn.num_kv_heads = sharding.shard_attention(
                    attn, attn.num_heads, attn.num_kv_heads, group
                )
            if isinstance(layer.mlp, SparseMoeBlock):
                sharding.shard_mlp(layer.mlp.shared_expert, group, reduce=False)
                sharding.shard_moe(layer.mlp, layer.mlp.switch_mlp, group)  # routed + gated shared, summed once
            else:
                sharding.shard_mlp(layer.mlp, group)

