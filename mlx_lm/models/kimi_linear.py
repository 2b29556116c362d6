"""Kimi Linear: Kimi Delta Attention (KDA) layers interleaved with multi-head latent
attention (MLA) layers (3:1 in the released 48B-A3B), each followed by a dense SwiGLU
MLP (the first `first_k_dense_replace` layers) or a DeepSeek-V3 style mixture of experts.

What differs from llama:
- `layer_types` says which layers are "linear_attention" (KDA) and which
  "full_attention" (MLA). Hub configs give them in `linear_attn_config` as 1-indexed
  `kda_layers` / `full_attn_layers`; with neither, every 4th layer after the first attends.
- KDA (`kda.py`) is the gated delta rule with a decay per key channel:
  g = exp(-exp(A_log) softplus(f_b(f_a(x)) + dt_bias)) (B, T, H, Dk) through a
  low-rank projection, beta = sigmoid(b_proj(x)) per head. q, k and v (as many heads,
  all of width Dk) each pass a depthwise causal conv (one conv over [q | k | v]) and
  SiLU; q and k are L2-normalised (eps 1e-6 inside the root, as FLA), q scaled by
  Dk^-1/2. The output is RMS-normalised per head and gated by sigmoid(g_b(g_a(x)))
  (`o_norm`), then `o_proj`. Cache: ArraysCache(2) (conv state, recurrent state),
  rolled back by replaying the recorded inputs.
- MLA without positions (NoPE): the "rope" part of the key, k_rot (qk_rope_head_dim),
  is shared by every head and never rotated. Queries come from `q_proj`, or from the q
  LoRA (`q_a_proj`, `q_a_layernorm`, `q_b_proj`) when q_lora_rank is set; keys and values
  from the latent c = norm(kv_a_proj_with_mqa(x)[:kv_lora_rank]) through `kv_b_proj`.
  Scale (qk_nope + qk_rope)^-1/2. The latent norms use eps 1e-6 (transformers' default
  for them), not rms_norm_eps.
- MLA cache (mla.py, shared with deepseek_v2/v3): the latent itself. A KVCache holds
  c (B, 1, S, kv_lora_rank) as its keys and k_rot (B, 1, S, qk_rope) as its values, as
  transformers caches them; attention is computed in the latent space (kv_b_proj
  absorbed: q_nope W_k^T c, and W_v applied to the attended latent), one key head for
  all query heads. At Kimi-Linear-48B sizes that
  is 576 numbers a token and layer instead of 32 * (192 + 128) = 10240 for expanded
  keys and values. kv_b_proj is read as a matrix, so it stays in float when quantizing.
- MoE: a sigmoid router in fp32 with a score-correction bias, group-limited top-k
  (nemotron_h.route), weights renormalised when `norm_topk_prob` (hub:
  `moe_renormalize`) and scaled by `routed_scaling_factor`; plus shared experts of
  n_shared_experts * moe_intermediate_size.
Config dialects: transformers 5 saves `layer_types`, `mlp_layer_types`, `linear_num_heads`
... beside the hub's names for the MoE keys (`num_experts`, `num_experts_per_token`,
`num_shared_experts`, `num_expert_group`, `moe_renormalize`); transformers' attribute
names (`num_local_experts`, ...) are read too. Weights: as saved (hub layout:
`block_sparse_moe.*` with per-expert w1/w2/w3, q/k/v_conv1d (C, 1, K), A_log (1, 1, H, 1),
forget-gate tensors on the attention), as transformers holds them in memory (`mlp.*`,
fused experts, one conv1d, `forget_gate.*`) or ours.
Reference: transformers `models/kimi_linear/modeling_kimi_linear.py`,
`configuration_kimi_linear.py`, and its `conversion_mapping.py` entry.
"""

import re
from dataclasses import dataclass
from functools import partial
from typing import Any, Dict, List, Optional, Tuple, Union

import mlx.core as mx
import mlx.nn as nn

from . import sharding
from .base import BaseModelArgs, check_layer_types, run_hybrid_layers
from .cache import ArraysCache, KVCache
from .gated_delta import compute_beta
from .kda import compute_kda_g, kda_recorded, kda_recurrence
from .llama import MLP
# latent_attention: minicpm3 reads it from here (written while this moved to mla.py)
from .mla import LatentAttention, latent_attention  # noqa: F401
from .nemotron_h import TopkRouter, route
from .qwen3_next import causal_conv1d, l2_normalize, split_fused_experts
from .ssm import conv_state_after, entries_after
from .switch_layers import SwitchGLU

LINEAR_ATTENTION, FULL_ATTENTION = "linear_attention", "full_attention"
DENSE, SPARSE = "dense", "sparse"
# Slots of a KDA layer's ArraysCache.
CONV_STATE, RECURRENT_STATE = 0, 1
# Hub (and transformers-5 saved) names of the MoE keys -> transformers' attribute names.
MOE_ALIASES = {
    "num_experts": "num_local_experts",
    "num_experts_per_token": "num_experts_per_tok",
    "num_shared_experts": "n_shared_experts",
    "num_expert_group": "n_group",
    "moe_renormalize": "norm_topk_prob",
}
# What the hub's linear_attn_config names the KDA shape keys.
LINEAR_ATTN_KEYS = {"num_heads": "linear_num_heads", "head_dim": "linear_head_dim",
                    "short_conv_kernel_size": "linear_conv_kernel_dim"}
# transformers' defaults (KimiLinearConfig) of the keys that may come under either name.
DEFAULTS = {"num_local_experts": 256, "num_experts_per_tok": 8, "n_shared_experts": 1, "n_group": 1,
            "norm_topk_prob": True, "linear_num_heads": 32, "linear_head_dim": 128, "linear_conv_kernel_dim": 4}


@dataclass
class ModelArgs(BaseModelArgs):
    model_type: str
    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    intermediate_size: int = 9216
    moe_intermediate_size: int = 1024
    num_key_value_heads: Optional[int] = None
    kv_lora_rank: int = 512
    q_lora_rank: Optional[int] = None
    qk_nope_head_dim: int = 128
    qk_rope_head_dim: int = 64
    v_head_dim: int = 128
    mla_use_nope: bool = True
    hidden_act: str = "silu"
    rms_norm_eps: float = 1e-5
    attention_bias: bool = False
    routed_scaling_factor: float = 2.446
    topk_group: int = 1
    num_local_experts: Optional[int] = None
    num_experts: Optional[int] = None
    num_experts_per_tok: Optional[int] = None
    num_experts_per_token: Optional[int] = None
    n_shared_experts: Optional[int] = None
    num_shared_experts: Optional[int] = None
    n_group: Optional[int] = None
    num_expert_group: Optional[int] = None
    norm_topk_prob: Optional[bool] = None
    moe_renormalize: Optional[bool] = None
    layer_types: Optional[List[str]] = None
    mlp_layer_types: Optional[List[str]] = None
    first_k_dense_replace: int = 1
    linear_attn_config: Optional[Dict[str, Any]] = None
    linear_num_heads: Optional[int] = None
    linear_head_dim: Optional[int] = None
    linear_conv_kernel_dim: Optional[int] = None

    def __post_init__(self):
        if self.num_key_value_heads is None:
            self.num_key_value_heads = self.num_attention_heads
        self._normalise_aliases()
        self._normalise_linear_attn_config()
        self._normalise_layer_kinds()
        self._validate()

    def _merge(self, name: str, alias: str, value: Any) -> None:
        """Field `name` from itself or its other spelling; both set and different is an error."""
        own = getattr(self, name)
        if own is not None and value is not None and own != value:
            raise ValueError(f"{name} ({own!r}) and {alias} ({value!r}) disagree; give one of them")
        if own is None:
            setattr(self, name, value if value is not None else DEFAULTS[name])

    def _normalise_aliases(self):
        for alias, name in MOE_ALIASES.items():
            self._merge(name, alias, getattr(self, alias))
            setattr(self, alias, getattr(self, name))  # both spellings read the same afterwards

    def _normalise_linear_attn_config(self):
        """The hub's linear_attn_config overrides nothing set; its layer lists are 1-indexed."""
        config = self.linear_attn_config or {}
        for key, name in LINEAR_ATTN_KEYS.items():
            self._merge(name, f"linear_attn_config[{key!r}]", config.get(key))
        if self.layer_types is None and "kda_layers" in config and "full_attn_layers" in config:
            kinds: List[Optional[str]] = [None] * self.num_hidden_layers
            for kind, key in ((FULL_ATTENTION, "full_attn_layers"), (LINEAR_ATTENTION, "kda_layers")):
                for number in config[key]:
                    if not 1 <= number <= self.num_hidden_layers:
                        raise ValueError(f"linear_attn_config[{key!r}] names layer {number}; layers are "
                                         f"numbered 1..{self.num_hidden_layers}")
                    kinds[number - 1] = kind
            if None in kinds:
                raise ValueError(f"linear_attn_config leaves layer {kinds.index(None) + 1} without a kind")
            self.layer_types = kinds

    def _normalise_layer_kinds(self):
        """transformers' defaults: every 4th layer after the first attends; the first
        first_k_dense_replace layers are dense."""
        n = self.num_hidden_layers
        if self.layer_types is None:
            self.layer_types = [FULL_ATTENTION if i and i % 4 == 0 else LINEAR_ATTENTION for i in range(n)]
        if self.mlp_layer_types is None:
            self.mlp_layer_types = [DENSE if i < self.first_k_dense_replace else SPARSE for i in range(n)]

    def _validate(self):
        check_layer_types(self.layer_types, self.num_hidden_layers, (LINEAR_ATTENTION, FULL_ATTENTION))
        if len(self.mlp_layer_types) != self.num_hidden_layers or set(self.mlp_layer_types) - {DENSE, SPARSE}:
            raise ValueError(f"mlp_layer_types {self.mlp_layer_types!r}: give {DENSE!r} or {SPARSE!r} "
                             f"for each of the {self.num_hidden_layers} layers")
        if self.hidden_act != "silu":
            raise ValueError(f"hidden_act {self.hidden_act!r} is not supported; this family uses 'silu'")
        if not self.mla_use_nope:
            raise ValueError("mla_use_nope False (rope on the MLA layers) is not supported: Kimi Linear's "
                             "MLA layers use no positions, and transformers applies none")
        if self.num_key_value_heads != self.num_attention_heads:
            raise ValueError(f"num_key_value_heads ({self.num_key_value_heads}) must equal num_attention_heads "
                             f"({self.num_attention_heads}): kv_b_proj makes keys and values for every head")
        if self.linear_conv_kernel_dim < 2:  # no conv state, and ambiguous conv layouts in sanitize
            raise ValueError(f"linear_conv_kernel_dim must be >= 2, got {self.linear_conv_kernel_dim}")
        self._validate_router()

    def _validate_router(self):
        E, groups = self.num_local_experts, self.n_group
        if E % groups:
            raise ValueError(f"num_local_experts ({E}) is not divisible by n_group ({groups})")
        if not 1 <= self.topk_group <= groups:
            raise ValueError(f"topk_group ({self.topk_group}) must be in 1..n_group ({groups})")
        if self.topk_group < groups and E // groups < 2:  # groups are scored by their two best experts
            raise ValueError(f"n_group ({groups}) leaves {E // groups} expert per group; group-limited "
                             "routing needs at least 2")
        if not 1 <= self.num_experts_per_tok <= self.topk_group * E // groups:
            raise ValueError(f"num_experts_per_tok ({self.num_experts_per_tok}) must be in 1.."
                             f"{self.topk_group * E // groups} (the experts of topk_group groups)")


class SigmoidGatedRMSNorm(nn.Module):
    """weight * rmsnorm(y) * sigmoid(gate) per head, in fp32 (transformers' o_norm)."""

    def __init__(self, dims: int, eps: float):
        super().__init__()
        self.weight = mx.ones((dims,))
        self.eps = eps

    def __call__(self, y: mx.array, gate: mx.array) -> mx.array:
        normed = mx.fast.rms_norm(y.astype(mx.float32), self.weight.astype(mx.float32), self.eps)
        return (normed * mx.sigmoid(gate.astype(mx.float32))).astype(y.dtype)


class DeltaAttention(nn.Module):
    """Kimi Delta Attention: short convs on q, k, v, then the per-channel-decay delta rule."""

    def __init__(self, args: ModelArgs):
        super().__init__()
        dim = args.hidden_size
        self.num_heads, self.head_dim = args.linear_num_heads, args.linear_head_dim
        self.qkv_dim = self.num_heads * self.head_dim
        self.conv_kernel_size = args.linear_conv_kernel_dim
        self.q_proj = nn.Linear(dim, self.qkv_dim, bias=False)
        self.k_proj = nn.Linear(dim, self.qkv_dim, bias=False)
        self.v_proj = nn.Linear(dim, self.qkv_dim, bias=False)
        self.conv1d = nn.Conv1d(3 * self.qkv_dim, 3 * self.qkv_dim, self.conv_kernel_size, groups=3 * self.qkv_dim,
                                bias=False)  # weight (C, K, 1), channels [all q | all k | all v]
        self.f_a_proj = nn.Linear(dim, self.head_dim, bias=False)
        self.f_b_proj = nn.Linear(self.head_dim, self.qkv_dim, bias=False)
        self.A_log = mx.zeros((self.num_heads,))
        self.dt_bias = mx.zeros((self.qkv_dim,))
        self.b_proj = nn.Linear(dim, self.num_heads, bias=False)
        self.g_a_proj = nn.Linear(dim, self.head_dim, bias=False)
        self.g_b_proj = nn.Linear(self.head_dim, self.qkv_dim, bias=False)
        self.o_norm = SigmoidGatedRMSNorm(self.head_dim, args.rms_norm_eps)
        self.o_proj = nn.Linear(self.qkv_dim, dim, bias=False)

    def conv_input(self, qkv: mx.array, cache: Optional[ArraysCache]) -> mx.array:
        """[conv state ; new rows] (B, K-1+T, 3 qkv_dim); zeros before the first token."""
        state = None if cache is None else cache[CONV_STATE]
        if state is None:
            state = mx.zeros((qkv.shape[0], self.conv_kernel_size - 1, qkv.shape[-1]), qkv.dtype)
        return mx.concatenate([state, qkv], axis=1)

    def inputs(self, x: mx.array, mixed: mx.array) -> Tuple[mx.array, ...]:
        """The recurrence inputs from the layer input x and the conv outputs (B, T, 3
        qkv_dim): q, k (B, T, H, Dk) normalised (q scaled), v (B, T, H, Dk), the decay g
        (B, T, H, Dk) and beta (B, T, H), in fp32."""
        B, T, _ = x.shape
        q, k, v = (t.reshape(B, T, self.num_heads, self.head_dim) for t in mx.split(mixed, 3, axis=-1))
        q, k = l2_normalize(q, self.head_dim**-0.5), l2_normalize(k)
        a = self.f_b_proj(self.f_a_proj(x)).reshape(B, T, self.num_heads, self.head_dim)
        g = compute_kda_g(self.A_log, a, self.dt_bias)  # (B, T, H, Dk)
        return q, k, v, g, compute_beta(self.b_proj(x))

    def __call__(self, x: mx.array, cache: Optional[ArraysCache] = None) -> mx.array:
        B, T, _ = x.shape
        qkv = mx.concatenate([self.q_proj(x), self.k_proj(x), self.v_proj(x)], axis=-1)  # (B, T, 3 qkv_dim)
        conv_input = self.conv_input(qkv, cache)  # (B, K-1+T, 3 qkv_dim)
        q, k, v, g, beta = self.inputs(x, nn.silu(causal_conv1d(conv_input, self.conv1d.weight)))
        state = None if cache is None else cache[RECURRENT_STATE]
        if cache is not None and cache.speculating:
            y, new_state, state_after = kda_recorded(q, k, v, g, beta, state)  # (B, T, H, Dv)
            cache.record_rollback(T, partial(entries_after, conv_input, T, state_after), [cache[CONV_STATE], state])
        else:
            y, new_state = kda_recurrence(q, k, v, g, beta, state)
        if cache is not None:
            cache[CONV_STATE] = conv_state_after(conv_input, T, self.conv_kernel_size)
            cache[RECURRENT_STATE] = new_state
        gate = self.g_b_proj(self.g_a_proj(x)).reshape(B, T, self.num_heads, -1)  # (B, T, H, Dv)
        return self.o_proj(self.o_norm(y, gate).reshape(B, T, -1))

    def shard(self, group: mx.distributed.Group) -> None:
        """By heads: q/k/v, f_b, g_b and b_proj rows are head-major, the conv's channels
        [all q | all k | all v], dt_bias per head and channel, A_log per head; f_a and
        g_a (to one head's width) and the per-head o_norm weight stay whole."""
        qkv_dim = self.qkv_dim
        self.num_heads = sharding.per_rank(self.num_heads, group, "linear_num_heads")
        sharding.shard_projections(self, ("q_proj", "k_proj", "v_proj", "f_b_proj", "g_b_proj", "b_proj"),
                                   sharding.ALL_TO_SHARDED, group)
        self.conv1d.weight = sharding.take_shard(self.conv1d.weight, group, segments=[qkv_dim, 2 * qkv_dim])
        self.A_log = sharding.take_shard(self.A_log, group)
        self.dt_bias = sharding.take_shard(self.dt_bias, group)
        sharding.shard_projections(self, ("o_proj",), sharding.SHARDED_TO_ALL, group)
        self.qkv_dim = self.num_heads * self.head_dim


class MoE(nn.Module):
    """Routed experts (sigmoid router, group-limited top-k) plus shared experts."""

    def __init__(self, args: ModelArgs):
        super().__init__()
        self.args = args
        self.gate = TopkRouter(args.hidden_size, args.num_local_experts)
        self.switch_mlp = SwitchGLU(args.hidden_size, args.moe_intermediate_size, args.num_local_experts)
        self.shared_experts = MLP(args.hidden_size, args.moe_intermediate_size * args.n_shared_experts)

    def __call__(self, x: mx.array) -> mx.array:
        a = self.args
        logits = x.astype(mx.float32) @ self.gate.weight.astype(mx.float32).T  # (..., E), fp32 as transformers
        experts, weights = route(logits, self.gate.e_score_correction_bias, a.num_experts_per_tok, a.n_group,
                                 a.topk_group, a.norm_topk_prob, a.routed_scaling_factor)
        routed = (self.switch_mlp(x, experts) * weights[..., None].astype(x.dtype)).sum(axis=-2)
        return routed + self.shared_experts(x)

    def shard(self, group: mx.distributed.Group) -> None:
        """Every expert's and the shared experts' hidden units split; summed once."""
        sharding.shard_mlp(self.shared_experts, group, reduce=False)
        sharding.shard_moe(self, self.switch_mlp, group)


class DecoderLayer(nn.Module):
    """Pre-norm: x + mixer(norm(x)), then + mlp(norm(.))."""

    def __init__(self, args: ModelArgs, layer_idx: int):
        super().__init__()
        self.is_linear = args.layer_types[layer_idx] == LINEAR_ATTENTION
        self.self_attn = DeltaAttention(args) if self.is_linear else LatentAttention(args)
        sparse = args.mlp_layer_types[layer_idx] == SPARSE
        self.mlp = MoE(args) if sparse else MLP(args.hidden_size, args.intermediate_size)
        self.input_layernorm = nn.RMSNorm(args.hidden_size, eps=args.rms_norm_eps)
        self.post_attention_layernorm = nn.RMSNorm(args.hidden_size, eps=args.rms_norm_eps)

    def __call__(self, x: mx.array, mask=None, cache=None) -> mx.array:
        normed = self.input_layernorm(x)
        h = x + (self.self_attn(normed, cache) if self.is_linear else self.self_attn(normed, mask, cache))
        return h + self.mlp(self.post_attention_layernorm(h))


class KimiLinearModel(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.embed_tokens = nn.Embedding(args.vocab_size, args.hidden_size)
        self.layers = [DecoderLayer(args, i) for i in range(args.num_hidden_layers)]
        self.norm = nn.RMSNorm(args.hidden_size, eps=args.rms_norm_eps)
        # MLA layers share one mask, made from the first one's cache; KDA layers need none.
        kinds = args.layer_types
        self.first_attention_layer = kinds.index(FULL_ATTENTION) if FULL_ATTENTION in kinds else None

    def __call__(self, inputs: mx.array, cache: Optional[List[Any]] = None) -> mx.array:
        h = self.embed_tokens(inputs)  # (B, L, hidden)
        return self.norm(run_hybrid_layers(h, self.layers, cache, self.first_attention_layer))


_PER_EXPERT = re.compile(r"^(.*\.mlp)\.experts\.(\d+)\.(w1|w2|w3)\.weight$")
_EXPERT_PROJ = {"w1": "gate_proj", "w2": "down_proj", "w3": "up_proj"}
_SPLIT_CONVS = ("q_conv1d", "k_conv1d", "v_conv1d")


def stack_experts(weights: Dict[str, mx.array]) -> Dict[str, mx.array]:
    """mlp.experts.{e}.w1/w3/w2.weight (the hub's gate/up/down, (out, in)) ->
    mlp.switch_mlp.{gate,up,down}_proj.weight (E, out, in)."""
    groups: Dict[Tuple[str, str], Dict[int, mx.array]] = {}
    out = {}
    for key, value in weights.items():
        match = _PER_EXPERT.match(key)
        if match:
            prefix, expert, proj = match.groups()
            groups.setdefault((prefix, _EXPERT_PROJ[proj]), {})[int(expert)] = value
        else:
            out[key] = value
    for (prefix, proj), experts in groups.items():
        if sorted(experts) != list(range(len(experts))):
            raise ValueError(f"{prefix}.experts has {proj} for experts {sorted(experts)}; expected 0..{len(experts) - 1}")
        out[f"{prefix}.switch_mlp.{proj}.weight"] = mx.stack([experts[e] for e in range(len(experts))])
    return out


def sanitize_weights(weights: Dict[str, mx.array]) -> Dict[str, mx.array]:
    """Saved (hub) weights, transformers' in-memory ones or ours -> ours. Each rewrite is
    guarded by the key or shape it changes: `block_sparse_moe.` -> `mlp.` and
    `forget_gate.` dropped (key renames), per-expert and fused experts stacked or split,
    q/k/v_conv1d concatenated into conv1d (keys only the saved layout has), the conv
    transposed while it is (C, 1, K), A_log flattened while it is (1, 1, H, 1)."""
    out = {}
    for key, value in weights.items():
        out[key.replace(".block_sparse_moe.", ".mlp.").replace(".self_attn.forget_gate.", ".self_attn.")] = value
    out = split_fused_experts(stack_experts(out))
    for key in [k for k in out if k.endswith("self_attn.q_conv1d.weight")]:
        prefix = key[: -len("q_conv1d.weight")]
        out[prefix + "conv1d.weight"] = mx.concatenate([out.pop(f"{prefix}{name}.weight") for name in _SPLIT_CONVS])
    for key, value in out.items():
        if key.endswith("self_attn.conv1d.weight") and value.shape[1] == 1 and value.shape[2] > 1:
            out[key] = value.swapaxes(1, 2)  # (C, 1, K) -> (C, K, 1)
        elif key.endswith("self_attn.A_log") and value.ndim > 1:
            out[key] = value.reshape(-1)  # (1, 1, H, 1) -> (H,)
    return out


class Model(nn.Module):
    # KDA layers record rollbacks into their ArraysCache while speculating.
    supports_speculative_rollback = True

    def __init__(self, args: ModelArgs):
        super().__init__()
        self.args = args
        self.model_type = args.model_type
        self.model = KimiLinearModel(args)
        # Always its own head: transformers never ties it (KimiLinearForCausalLM has no tied
        # keys), whatever tie_word_embeddings says, and saves lm_head.weight either way.
        self.lm_head = nn.Linear(args.hidden_size, args.vocab_size, bias=False)

    def __call__(self, inputs: mx.array, cache: Optional[List[Any]] = None) -> mx.array:
        """Token ids (B, L) -> logits (B, L, vocab)."""
        return self.lm_head(self.model(inputs, cache))

    def sanitize(self, weights: Dict[str, mx.array]) -> Dict[str, mx.array]:
        return sanitize_weights(weights)

    def quant_predicate(self, path: str, module: nn.Module) -> Union[bool, Dict[str, int]]:
        """kv_b_proj is read as a matrix (absorbed into the latent attention): float. The
        router is not a Linear, so it stays float by itself."""
        return not path.endswith("kv_b_proj")

    @property
    def layers(self) -> List[DecoderLayer]:
        return self.model.layers

    def make_cache(self) -> List[Union[ArraysCache, KVCache]]:
        return [ArraysCache(2) if layer.is_linear else KVCache() for layer in self.layers]

    def shard(self, group: Optional[mx.distributed.Group] = None) -> None:
        """Tensor parallel over `group` (default: the global group), in place: MLA and
        KDA by heads (a rank's latent cache is whole, its KDA states hold its heads),
        MLPs and experts by hidden units. Embeddings, lm_head, norms and routers stay
        whole."""
        group = sharding.world(group)
        for layer in self.layers:
            layer.self_attn.shard(group)
            if isinstance(layer.mlp, MoE):
                layer.mlp.shard(group)
            else:
                sharding.shard_mlp(layer.mlp, group)
