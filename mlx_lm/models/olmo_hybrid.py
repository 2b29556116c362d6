"""OLMo Hybrid: Gated DeltaNet linear-attention layers interleaved with OLMo 3 attention
layers (3:1 in the released 7B).

What differs from llama:
- `layer_types` says which layers are "linear_attention" (Gated DeltaNet) and which
  "full_attention"; without it every 4th layer attends (and the last one if none would).
- Linear-attention layers are pre-norm (`input_layernorm`, `post_attention_layernorm`).
  Their mixer (`linear_attn`) projects q, k, v, the decay input a, the write input b
  and the output gate with separate matrices (`q_proj` .. `g_proj`), runs q, k, v
  through one depthwise causal conv (channels [all q | all k | all v]) and SiLU,
  L2-normalises q and k (q also scaled by Dk^-1/2) and applies the gated delta rule
  (`gated_delta.py`) with beta = 2 sigmoid(b) when `linear_allow_neg_eigval` (the
  default): beta in (0, 2), so a write may flip the state's sign along its key. The
  output goes through a gated RMSNorm (`o_norm`, eps 1e-5 whatever rms_norm_eps says:
  transformers follows FLA's fused norm there) and `o_proj`. Cache: `ArraysCache(2)`
  (conv state, recurrent state), rolled back by replaying the recorded inputs.
- Attention layers are OLMo 3's: post-norm (`post_attention_layernorm` on the
  attention output, `post_feedforward_layernorm` on the MLP output, each before its
  residual add), and q/k RMS-normalised over the whole projection (all heads at once),
  before rope. Rope is optional: a config whose rope theta is explicitly null (the
  released checkpoints) attends without positions (NoPE); one that says nothing about
  rope gets transformers' default theta 10000.
- Plain (not zero-centred) RMSNorms throughout.
Config dialects: OLMo-core's converter writes a top-level `rope_theta` (null for NoPE),
transformers 5 `rope_parameters`. Weights: transformers saves the linear layers' norms
as `attention_layer_norm` / `feedforward_layer_norm` and the conv as `q_conv1d`,
`k_conv1d`, `v_conv1d` (C_i, 1, K) (its load-time conversion renames and concatenates
them); sanitize does the same once, and transposes the conv to MLX's (C, K, 1).
Reference: transformers `models/olmo_hybrid/modeling_olmo_hybrid.py`,
`configuration_olmo_hybrid.py`, and its `conversion_mapping.py` entry.
"""

from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Tuple, Union

import mlx.core as mx
import mlx.nn as nn

from . import sharding
from .base import (
    BaseModelArgs,
    run_hybrid_layers,
    check_head_grouping,
    check_layer_types,
    scaled_dot_product_attention,
)
from .cache import ArraysCache, KVCache
from .gated_delta import CONV_STATE, compute_beta, compute_g
from .llama import MLP
from .gated_delta import gated_delta_cached
from .qwen3_next import GatedRMSNorm, causal_conv1d, l2_normalize
from .rope_utils import initialize_rope, resolve_rope

LINEAR_ATTENTION, FULL_ATTENTION = "linear_attention", "full_attention"
# Slots of a linear-attention layer's ArraysCache.
DEFAULT_ROPE_THETA = 10000.0  # what transformers uses when the config names no rope at all
# rope_theta's default: "the config has no rope_theta key", unlike an explicit null (NoPE).
ROPE_THETA_ABSENT = -1.0
O_NORM_EPS = 1e-5  # transformers hard-codes it (FLA's FusedRMSNormGated default)
# transformers' load-time renames of the linear layers' norms.
NORM_RENAMES = {".attention_layer_norm.": ".input_layernorm.", ".feedforward_layer_norm.": ".post_attention_layernorm."}
SPLIT_CONVS = ("q_conv1d", "k_conv1d", "v_conv1d")


@dataclass
class ModelArgs(BaseModelArgs):
    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: Optional[int] = None
    head_dim: Optional[int] = None
    hidden_act: str = "silu"
    rms_norm_eps: float = 1e-6
    attention_bias: bool = False
    tie_word_embeddings: bool = False
    max_position_embeddings: Optional[int] = 65536
    rope_theta: Optional[float] = ROPE_THETA_ABSENT  # None: no rope (NoPE)
    rope_scaling: Optional[Dict[str, Any]] = None
    rope_parameters: Optional[Dict[str, Any]] = None
    layer_types: Optional[List[str]] = None
    linear_num_key_heads: Optional[int] = None
    linear_num_value_heads: Optional[int] = None
    linear_key_head_dim: Optional[int] = None
    linear_value_head_dim: Optional[int] = None
    linear_conv_kernel_dim: int = 4
    linear_allow_neg_eigval: bool = True

    def __post_init__(self):
        if self.num_key_value_heads is None:
            self.num_key_value_heads = self.num_attention_heads
        if self.head_dim is None:
            self.head_dim = self.hidden_size // self.num_attention_heads
        self._normalise_rope()
        if self.layer_types is None:
            self.layer_types = default_layer_types(self.num_hidden_layers)
        self._normalise_linear_heads()
        self._validate()

    def _normalise_rope(self):
        """rope_theta after this: a float, or None for no rope. NoPE is an explicit null
        theta, top-level or in rope_parameters; no theta at all is the default."""
        params = self.rope_parameters if isinstance(self.rope_parameters, dict) else {}
        nope = self.rope_theta is None or ("rope_theta" in params and params["rope_theta"] is None)
        top = None if self.rope_theta in (None, ROPE_THETA_ABSENT) else self.rope_theta
        theta, self.rope_scaling, _ = resolve_rope(top, self.rope_scaling, self.rope_parameters)
        self.rope_theta = None if nope else DEFAULT_ROPE_THETA if theta is None else theta

    def _normalise_linear_heads(self):
        """transformers' defaults: as many linear heads as attention heads, key heads of
        0.75 hidden / heads, value heads twice as wide."""
        if self.linear_num_key_heads is None:
            self.linear_num_key_heads = self.num_attention_heads
        if self.linear_num_value_heads is None:
            self.linear_num_value_heads = self.num_attention_heads
        if self.linear_key_head_dim is None:
            self.linear_key_head_dim = int(0.75 * self.hidden_size / self.linear_num_key_heads)
        if self.linear_value_head_dim is None:
            self.linear_value_head_dim = 2 * self.linear_key_head_dim

    def _validate(self):
        check_layer_types(self.layer_types, self.num_hidden_layers, (LINEAR_ATTENTION, FULL_ATTENTION))
        if self.hidden_act != "silu":
            raise ValueError(f"hidden_act {self.hidden_act!r} is not supported; this family uses 'silu'")
        check_head_grouping(self.num_attention_heads, self.num_key_value_heads)
        if self.linear_num_value_heads % self.linear_num_key_heads:
            raise ValueError(
                f"linear_num_value_heads ({self.linear_num_value_heads}) must be a multiple of "
                f"linear_num_key_heads ({self.linear_num_key_heads})"
            )
        if self.linear_conv_kernel_dim < 2:  # no conv state, and ambiguous conv layouts in sanitize
            raise ValueError(f"linear_conv_kernel_dim must be >= 2, got {self.linear_conv_kernel_dim}")
        if self.rope_theta is not None and self.rope_theta <= 0:
            raise ValueError(f"rope_theta must be positive (or null for no rope), got {self.rope_theta}")


def default_layer_types(num_layers: int) -> List[str]:
    """transformers' default pattern: every 4th layer attends, the last one if none would."""
    kinds = [FULL_ATTENTION if i % 4 == 3 else LINEAR_ATTENTION for i in range(num_layers)]
    if FULL_ATTENTION not in kinds:
        kinds[-1] = FULL_ATTENTION
    return kinds


class ProjectionRMSNorm(nn.Module):
    """RMSNorm over a whole q or k projection (every head at once, OLMo's qk-norm).
    Sharded by heads, a rank holds a slice of the vector: its mean square is then summed
    over `group` so the norm stays that of the whole projection."""

    def __init__(self, dims: int, eps: float):
        super().__init__()
        self.weight = mx.ones((dims,))
        self.eps, self.dims = eps, dims
        self.group: Optional[mx.distributed.Group] = None

    def __call__(self, x: mx.array) -> mx.array:
        if self.group is None:
            return mx.fast.rms_norm(x, self.weight, self.eps)
        squares = mx.distributed.all_sum(mx.square(x.astype(mx.float32)).sum(-1, keepdims=True), group=self.group)
        return self.weight * (x.astype(mx.float32) * mx.rsqrt(squares / self.dims + self.eps)).astype(x.dtype)

    def shard(self, group: mx.distributed.Group) -> None:
        self.weight = sharding.take_shard(self.weight, group)
        self.group = group


class Attention(nn.Module):
    """OLMo 3 attention: q/k normalised over the whole projection, then optional rope."""

    def __init__(self, args: ModelArgs):
        super().__init__()
        dim, head_dim = args.hidden_size, args.head_dim
        self.num_heads, self.num_kv_heads = args.num_attention_heads, args.num_key_value_heads
        self.scale = head_dim**-0.5
        bias = args.attention_bias
        self.q_proj = nn.Linear(dim, self.num_heads * head_dim, bias=bias)
        self.k_proj = nn.Linear(dim, self.num_kv_heads * head_dim, bias=bias)
        self.v_proj = nn.Linear(dim, self.num_kv_heads * head_dim, bias=bias)
        self.o_proj = nn.Linear(self.num_heads * head_dim, dim, bias=bias)
        self.q_norm = ProjectionRMSNorm(self.num_heads * head_dim, args.rms_norm_eps)
        self.k_norm = ProjectionRMSNorm(self.num_kv_heads * head_dim, args.rms_norm_eps)
        self.rope = None
        if args.rope_theta is not None:
            self.rope = initialize_rope(head_dim, args.rope_theta, False, args.rope_scaling,
                                        args.max_position_embeddings)

    def __call__(self, x: mx.array, mask: Optional[mx.array] = None, cache: Optional[KVCache] = None) -> mx.array:
        B, L, _ = x.shape
        q = self.q_norm(self.q_proj(x)).reshape(B, L, self.num_heads, -1)  # (B, L, H, D)
        k = self.k_norm(self.k_proj(x)).reshape(B, L, self.num_kv_heads, -1)
        v = self.v_proj(x).reshape(B, L, self.num_kv_heads, -1)
        q, k, v = (t.transpose(0, 2, 1, 3) for t in (q, k, v))  # (B, H, L, D)
        if self.rope is not None:
            offset = cache.offset if cache is not None else 0
            q, k = self.rope(q, offset=offset), self.rope(k, offset=offset)
        if cache is not None:
            k, v = cache.update_and_fetch(k, v)
        out = scaled_dot_product_attention(q, k, v, cache=cache, scale=self.scale, mask=mask)
        return self.o_proj(out.transpose(0, 2, 1, 3).reshape(B, L, -1))

    def shard(self, group: mx.distributed.Group) -> None:
        """By heads; the q/k norms keep their slices and sum their mean squares."""
        self.num_heads, self.num_kv_heads = sharding.shard_attention(self, self.num_heads, self.num_kv_heads, group)
        self.q_norm.shard(group)
        self.k_norm.shard(group)


class GatedDeltaNet(nn.Module):
    """Linear attention by the gated delta rule, with separate projections and beta
    possibly in (0, 2)."""

    def __init__(self, args: ModelArgs):
        super().__init__()
        dim = args.hidden_size
        self.num_key_heads, self.num_value_heads = args.linear_num_key_heads, args.linear_num_value_heads
        self.key_head_dim, self.value_head_dim = args.linear_key_head_dim, args.linear_value_head_dim
        self.key_dim = self.num_key_heads * self.key_head_dim
        self.value_dim = self.num_value_heads * self.value_head_dim
        self.conv_dim = 2 * self.key_dim + self.value_dim  # channels [all q | all k | all v]
        self.conv_kernel_size = args.linear_conv_kernel_dim
        self.allow_neg_eigval = args.linear_allow_neg_eigval
        self.q_proj = nn.Linear(dim, self.key_dim, bias=False)
        self.k_proj = nn.Linear(dim, self.key_dim, bias=False)
        self.v_proj = nn.Linear(dim, self.value_dim, bias=False)
        self.a_proj = nn.Linear(dim, self.num_value_heads, bias=False)
        self.b_proj = nn.Linear(dim, self.num_value_heads, bias=False)
        self.g_proj = nn.Linear(dim, self.value_dim, bias=False)
        self.conv1d = nn.Conv1d(self.conv_dim, self.conv_dim, self.conv_kernel_size, groups=self.conv_dim,
                                bias=False)  # weight (C, K, 1)
        self.A_log = mx.zeros((self.num_value_heads,))
        self.dt_bias = mx.ones((self.num_value_heads,))
        self.o_norm = GatedRMSNorm(self.value_head_dim, O_NORM_EPS)
        self.o_proj = nn.Linear(self.value_dim, dim, bias=False)

    def conv_input(self, qkv: mx.array, cache: Optional[ArraysCache]) -> mx.array:
        """[conv state ; new rows] (B, K-1+T, conv_dim); zeros before the first token."""
        state = None if cache is None else cache[CONV_STATE]
        if state is None:
            state = mx.zeros((qkv.shape[0], self.conv_kernel_size - 1, self.conv_dim), qkv.dtype)
        return mx.concatenate([state, qkv], axis=1)

    def heads(self, mixed: mx.array) -> Tuple[mx.array, mx.array, mx.array]:
        """Conv outputs (B, T, conv_dim) -> q, k (B, T, Hk, Dk) L2-normalised in fp32 (q
        scaled by Dk^-1/2) and v (B, T, Hv, Dv)."""
        B, T, _ = mixed.shape
        q, k, v = mx.split(mixed, [self.key_dim, 2 * self.key_dim], axis=-1)
        q = l2_normalize(q.reshape(B, T, self.num_key_heads, -1), self.key_head_dim**-0.5)
        k = l2_normalize(k.reshape(B, T, self.num_key_heads, -1))
        return q, k, v.reshape(B, T, self.num_value_heads, -1)

    def __call__(self, x: mx.array, cache: Optional[ArraysCache] = None) -> mx.array:
        B, T, _ = x.shape
        qkv = mx.concatenate([self.q_proj(x), self.k_proj(x), self.v_proj(x)], axis=-1)  # (B, T, conv_dim)
        conv_input = self.conv_input(qkv, cache)  # (B, K-1+T, conv_dim)
        q, k, v = self.heads(nn.silu(causal_conv1d(conv_input, self.conv1d.weight)))
        g = compute_g(self.A_log, self.a_proj(x), self.dt_bias)  # (B, T, Hv)
        beta = compute_beta(self.b_proj(x), self.allow_neg_eigval)  # (B, T, Hv), in (0, 2) if allowed
        y = gated_delta_cached(conv_input, q, k, v, g, beta, cache)  # (B, T, Hv, Dv)
        gate = self.g_proj(x).reshape(B, T, self.num_value_heads, -1)  # (B, T, Hv, Dv)
        return self.o_proj(self.o_norm(y, gate).reshape(B, T, -1))

    def shard(self, group: mx.distributed.Group) -> None:
        """Keep this rank's key heads with their value heads: q/k/v/g/a/b_proj rows are
        head-major, the conv's channels [all q | all k | all v]."""
        sharding.shard_gated_delta(self, group, per_head=("q_proj", "k_proj", "v_proj", "a_proj", "b_proj", "g_proj"),
                                   out="o_proj")


class LinearAttentionLayer(nn.Module):
    """Pre-norm: x + mixer(norm(x)), then + mlp(norm(.))."""

    def __init__(self, args: ModelArgs):
        super().__init__()
        self.linear_attn = GatedDeltaNet(args)
        self.mlp = MLP(args.hidden_size, args.intermediate_size)
        self.input_layernorm = nn.RMSNorm(args.hidden_size, eps=args.rms_norm_eps)
        self.post_attention_layernorm = nn.RMSNorm(args.hidden_size, eps=args.rms_norm_eps)

    def __call__(self, x: mx.array, mask: Optional[mx.array] = None, cache=None) -> mx.array:
        h = x + self.linear_attn(self.input_layernorm(x), cache)
        return h + self.mlp(self.post_attention_layernorm(h))


class AttentionLayer(nn.Module):
    """Post-norm (OLMo 2/3): x + norm(attn(x)), then + norm(mlp(.))."""

    def __init__(self, args: ModelArgs):
        super().__init__()
        self.self_attn = Attention(args)
        self.mlp = MLP(args.hidden_size, args.intermediate_size)
        self.post_attention_layernorm = nn.RMSNorm(args.hidden_size, eps=args.rms_norm_eps)
        self.post_feedforward_layernorm = nn.RMSNorm(args.hidden_size, eps=args.rms_norm_eps)

    def __call__(self, x: mx.array, mask: Optional[mx.array] = None, cache=None) -> mx.array:
        h = x + self.post_attention_layernorm(self.self_attn(x, mask, cache))
        return h + self.post_feedforward_layernorm(self.mlp(h))


class OlmoHybridModel(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.embed_tokens = nn.Embedding(args.vocab_size, args.hidden_size)
        self.layers = [AttentionLayer(args) if kind == FULL_ATTENTION else LinearAttentionLayer(args)
                       for kind in args.layer_types]
        self.norm = nn.RMSNorm(args.hidden_size, eps=args.rms_norm_eps)
        # Attention layers share one mask, made from the first one's cache; GDN layers need none.
        kinds = args.layer_types
        self.first_attention_layer = kinds.index(FULL_ATTENTION) if FULL_ATTENTION in kinds else None

    def __call__(self, inputs: mx.array, cache: Optional[List[Any]] = None) -> mx.array:
        h = self.embed_tokens(inputs)  # (B, L, hidden)
        return self.norm(run_hybrid_layers(h, self.layers, cache, self.first_attention_layer))


def sanitize_weights(weights: Dict[str, mx.array], tie_word_embeddings: bool) -> Dict[str, mx.array]:
    """Saved transformers weights, transformers' in-memory ones or ours -> ours, as
    transformers' loader converts them. Each rewrite is guarded by the key or shape it
    changes: the norm renames and the conv concatenation [q ; k ; v] (transformers saves
    it split, in pieces that need not be the q/k/v widths) apply to keys only the raw
    layout has; the conv is transposed only while it is (C, 1, K); a tied lm_head is
    dropped."""
    out = {}
    for key, value in weights.items():
        for old, new in NORM_RENAMES.items():
            key = key.replace(old, new)
        out[key] = value
    if tie_word_embeddings:
        out.pop("lm_head.weight", None)
    for key in [k for k in out if k.endswith("linear_attn.q_conv1d.weight")]:
        prefix = key[: -len("q_conv1d.weight")]
        pieces = [out.pop(f"{prefix}{name}.weight") for name in SPLIT_CONVS]
        out[prefix + "conv1d.weight"] = mx.concatenate(pieces, axis=0)  # (C, 1, K)
    for key, value in out.items():
        if key.endswith("linear_attn.conv1d.weight") and value.shape[1] == 1 and value.shape[2] > 1:
            out[key] = value.swapaxes(1, 2)  # (C, 1, K) -> (C, K, 1)
    return out


class Model(nn.Module):
    # Linear-attention layers record rollbacks into their ArraysCache while speculating.
    supports_speculative_rollback = True

    def __init__(self, args: ModelArgs):
        super().__init__()
        self.args = args
        self.model_type = args.model_type
        self.model = OlmoHybridModel(args)
        if not args.tie_word_embeddings:
            self.lm_head = nn.Linear(args.hidden_size, args.vocab_size, bias=False)

    def __call__(self, inputs: mx.array, cache: Optional[List[Any]] = None) -> mx.array:
        """Token ids (B, L) -> logits (B, L, vocab)."""
        h = self.model(inputs, cache)
        if self.args.tie_word_embeddings:
            return self.model.embed_tokens.as_linear(h)
        return self.lm_head(h)

    def sanitize(self, weights: Dict[str, mx.array]) -> Dict[str, mx.array]:
        return sanitize_weights(weights, self.args.tie_word_embeddings)

    @property
    def layers(self) -> List[Union[LinearAttentionLayer, AttentionLayer]]:
        return self.model.layers

    def make_cache(self) -> List[Union[ArraysCache, KVCache]]:
        return [KVCache() if isinstance(layer, AttentionLayer) else ArraysCache(2) for layer in self.layers]

    def shard(self, group: Optional[mx.distributed.Group] = None) -> None:
        """Tensor parallel over `group` (default: the global group), in place: attention
        by heads (its whole-projection q/k norms sum their mean squares over ranks),
        Gated DeltaNet by key heads with their value heads (so each rank's conv and
        recurrent state, and its rollback records, cover only its heads), MLPs by hidden
        units. Embeddings, lm_head and the layer norms stay whole."""
        group = sharding.world(group)
        for layer in self.layers:
            (layer.self_attn if isinstance(layer, AttentionLayer) else layer.linear_attn).shard(group)
            sharding.shard_mlp(layer.mlp, group)
