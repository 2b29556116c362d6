"""NVIDIA Nemotron-H: a hybrid stack of Mamba-2, attention, MLP and MoE blocks, one
mixer per block.

What differs from llama:
- Each block is norm -> one mixer -> residual, the mixer chosen per layer by
  `layers_block_type` (transformers 5: "linear_attention", "full_attention", "mlp",
  "moe"; the legacy "mamba"/"attention" names too) or `hybrid_override_pattern`
  (transformers 4: one character per layer, M / * / - / E).
- Mamba-2 mixers (`ssm.py`): in_proj gives [gate z | conv rows x, B, C | dt]; a
  depthwise causal conv1d with bias and silu; dt = max(softplus(dt + dt_bias),
  time_step_min); the SSD recurrence with A = -exp(A_log) and a D skip; a gated RMSNorm
  over `n_groups` groups; out_proj. Their cache is an `ArraysCache(2)`: conv state,
  SSM state (fp32). transformers clamps dt only on its multi-token path; we clamp on
  every path, so prefill, verify and decode compute one recurrence (they differ only
  where softplus(dt + dt_bias) < time_step_min).
- While the cache speculates, each Mamba-2 layer records its pre-forward states and
  its forward (`ssm.ssd_recorded`): a rollback to m tokens of a verify selects the
  state its m-th step computed, of a long forward replays m steps (DESIGN.md §2).
- Attention has no positional encoding (the Mamba layers carry order) and no biases.
- MLPs are not gated: down(relu(up(x))^2). MoE: a sigmoid router with a score
  correction bias and group-limited top-k, non-gated relu^2 experts (optionally in a
  latent space, fc1/fc2_latent_proj) plus a shared expert.
- Checkpoints name the backbone `backbone.*` (hub and transformers' save_pretrained);
  transformers 5 loads it as `model.*`, which we use. Norm weights are plain.
Only the blocks with state (Mamba-2 and attention) own a cache entry: `Model.layers`
lists those, one per entry of `make_cache()`.
References: transformers `models/nemotron_h/modeling_nemotron_h.py`; NVIDIA,
"Nemotron-H: A Family of Accurate and Efficient Hybrid Mamba-Transformer Models"
(arXiv 2504.03624).
"""

import math
import re
from dataclasses import dataclass
from functools import partial
from typing import Any, Dict, List, Optional, Tuple, Union

import mlx.core as mx
import mlx.nn as nn

from . import sharding
from .base import (
    BaseModelArgs,
    check_head_grouping,
    check_layer_types,
    create_attention_mask,
    scaled_dot_product_attention,
)
from .cache import ArraysCache, KVCache
from .ssm import causal_conv1d, conv_state_after, discretize_dt, entries_after, gated_rms_norm, ssd_recorded, ssd_update
from .switch_layers import SwitchLinear

MAMBA, ATTENTION, MLP_BLOCK, MOE = "linear_attention", "full_attention", "mlp", "moe"
PATTERN_KINDS = {"M": MAMBA, "*": ATTENTION, "-": MLP_BLOCK, "E": MOE}
LEGACY_KINDS = {"mamba": MAMBA, "attention": ATTENTION}  # older layers_block_type names
# Fields that configs also spell the older way (transformers accepts both): field ->
# (older name, default).
ALIASES = {
    "n_groups": ("mamba_n_groups", 8),
    "conv_kernel": ("mamba_d_conv", 4),
    "use_conv_bias": ("mamba_conv_bias", True),
    "time_step_min": ("mamba_dt_min", 0.001),
}
# Slots of a Mamba-2 layer's ArraysCache.
CONV_STATE, SSM_STATE = 0, 1


@dataclass(frozen=True)
class Mamba2Shape:
    """What a Mamba-2 mixer is made of, in neutral names (falcon_h1 builds one too).

    `norm_before_gate`: None for no norm (the output is y * silu(gate)); False for
    rmsnorm(y * silu(gate)) (Nemotron-H); True for rmsnorm(y) * silu(gate)."""

    hidden_size: int
    num_heads: int
    head_dim: int
    n_groups: int
    state_size: int
    conv_kernel: int
    conv_bias: bool
    in_proj_bias: bool
    out_proj_bias: bool
    norm_eps: float
    norm_before_gate: Optional[bool] = False
    time_step_min: float = 0.0
    time_step_max: float = math.inf

    @property
    def intermediate_size(self) -> int:
        return self.num_heads * self.head_dim


@dataclass
class ModelArgs(BaseModelArgs):
    model_type: str
    vocab_size: int
    hidden_size: int
    num_attention_heads: int
    num_key_value_heads: int
    mamba_num_heads: int
    mamba_head_dim: int
    ssm_state_size: int
    layers_block_type: Optional[List[str]] = None  # transformers 5
    hybrid_override_pattern: Optional[str] = None  # transformers 4
    num_hidden_layers: Optional[int] = None
    head_dim: int = 128  # transformers' default
    intermediate_size: Optional[int] = None  # MLP blocks
    n_groups: Optional[int] = None  # these four default as ALIASES says
    conv_kernel: Optional[int] = None
    use_conv_bias: Optional[bool] = None
    use_bias: bool = False  # in_proj / out_proj of the Mamba-2 mixers
    mlp_bias: bool = False
    mlp_hidden_act: str = "relu2"
    mamba_hidden_act: str = "silu"
    time_step_min: Optional[float] = None
    layer_norm_epsilon: float = 1e-5
    n_routed_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    moe_shared_expert_intermediate_size: int = 0
    moe_latent_size: Optional[int] = None
    routed_scaling_factor: float = 1.0
    n_group: int = 1
    topk_group: int = 1
    norm_topk_prob: bool = True
    mamba_n_groups: Optional[int] = None  # older spellings (ALIASES)
    mamba_d_conv: Optional[int] = None
    mamba_conv_bias: Optional[bool] = None
    mamba_dt_min: Optional[float] = None

    def __post_init__(self):
        self._resolve_aliases()
        if self.layers_block_type is not None:
            self.layers_block_type = [LEGACY_KINDS.get(kind, kind) for kind in self.layers_block_type]
        elif self.hybrid_override_pattern is not None:
            unknown = sorted(set(self.hybrid_override_pattern) - set(PATTERN_KINDS))
            if unknown:
                raise ValueError(
                    f"hybrid_override_pattern {self.hybrid_override_pattern!r} has unknown characters {unknown}; "
                    f"expected {''.join(PATTERN_KINDS)}"
                )
            self.layers_block_type = [PATTERN_KINDS[c] for c in self.hybrid_override_pattern]
        else:
            raise ValueError("the config needs layers_block_type or hybrid_override_pattern (the layer kinds)")
        if self.num_hidden_layers is None:
            self.num_hidden_layers = len(self.layers_block_type)
        self._validate()

    def _resolve_aliases(self):
        for name, (alias, default) in ALIASES.items():
            value, other = getattr(self, name), getattr(self, alias)
            if value is not None and other is not None and value != other:
                raise ValueError(f"{name} ({value!r}) and its older spelling {alias} ({other!r}) disagree")
            setattr(self, name, default if value is None and other is None else (other if value is None else value))

    def _validate(self):
        kinds = self.layers_block_type
        check_layer_types(kinds, self.num_hidden_layers, (MAMBA, ATTENTION, MLP_BLOCK, MOE))
        if self.mamba_hidden_act != "silu":
            raise ValueError(f"mamba_hidden_act {self.mamba_hidden_act!r} is not supported; Nemotron-H uses 'silu'")
        if self.mlp_hidden_act != "relu2":
            raise ValueError(f"mlp_hidden_act {self.mlp_hidden_act!r} is not supported; Nemotron-H uses 'relu2'")
        if self.mamba_num_heads % self.n_groups:
            raise ValueError(
                f"mamba_num_heads ({self.mamba_num_heads}) must be a multiple of n_groups ({self.n_groups})"
            )
        # K = 1 would leave no conv state and make the HF (C, 1, K) and MLX (C, K, 1)
        # conv layouts indistinguishable, which sanitize relies on.
        if self.conv_kernel < 2:
            raise ValueError(f"conv_kernel must be >= 2, got {self.conv_kernel}")
        check_head_grouping(self.num_attention_heads, self.num_key_value_heads)
        if MLP_BLOCK in kinds and not self.intermediate_size:
            raise ValueError(f"intermediate_size is {self.intermediate_size!r} but some blocks are MLPs")
        if MOE in kinds:
            self._validate_moe()

    @property
    def mamba_shape(self) -> Mamba2Shape:
        return Mamba2Shape(
            self.hidden_size, self.mamba_num_heads, self.mamba_head_dim, self.n_groups, self.ssm_state_size,
            self.conv_kernel, conv_bias=self.use_conv_bias, in_proj_bias=self.use_bias, out_proj_bias=self.use_bias,
            norm_eps=self.layer_norm_epsilon, norm_before_gate=False, time_step_min=self.time_step_min,
        )

    def _validate_moe(self):
        if not 0 < self.num_experts_per_tok <= self.n_routed_experts:
            raise ValueError(
                f"num_experts_per_tok ({self.num_experts_per_tok}) must be in "
                f"1..n_routed_experts ({self.n_routed_experts})"
            )
        if self.n_routed_experts % self.n_group or self.n_routed_experts // self.n_group < 2:
            raise ValueError(
                f"n_routed_experts ({self.n_routed_experts}) must split into n_group ({self.n_group}) groups "
                "of at least 2 (each group is scored by its best two)"
            )
        if not 0 < self.topk_group <= self.n_group:
            raise ValueError(f"topk_group ({self.topk_group}) must be in 1..n_group ({self.n_group})")


def relu2(x: mx.array) -> mx.array:
    return mx.square(nn.relu(x))


def route(logits: mx.array, correction_bias: mx.array, top_k: int, num_groups: int, top_groups: int,
          normalize: bool, scaling: float) -> Tuple[mx.array, mx.array]:
    """Sigmoid router with group-limited choice: router logits (..., E) -> expert ids
    (..., k) and their weights (..., k), fp32.

    Experts are chosen by score + correction_bias (E,), only within the `top_groups` of
    `num_groups` groups whose two best biased scores sum highest; the weights are the
    unbiased sigmoid scores, renormalised if `normalize`, times `scaling`."""
    scores = mx.sigmoid(logits.astype(mx.float32))
    choice = scores + correction_bias.astype(mx.float32)
    if top_groups < num_groups:
        grouped = choice.reshape(*choice.shape[:-1], num_groups, -1)  # (..., groups, E / groups)
        group_scores = mx.topk(grouped, 2, axis=-1).sum(axis=-1)  # (..., groups)
        best = mx.argpartition(-group_scores, kth=top_groups - 1, axis=-1)[..., :top_groups]
        keep = mx.put_along_axis(mx.zeros_like(group_scores), best, mx.array(1.0), axis=-1) > 0
        choice = mx.where(keep[..., None], grouped, -mx.inf).reshape(choice.shape)
    experts = mx.argpartition(-choice, kth=top_k - 1, axis=-1)[..., :top_k]
    weights = mx.take_along_axis(scores, experts, axis=-1)
    if normalize:
        weights = weights / (weights.sum(axis=-1, keepdims=True) + 1e-20)
    return experts, weights * scaling


class GatedRMSNorm(nn.Module):
    """gated_rms_norm with its weight, over groups of `group_size` channels."""

    def __init__(self, dims: int, group_size: int, eps: float, norm_before_gate: bool):
        super().__init__()
        self.weight = mx.ones((dims,))
        self.group_size, self.eps, self.norm_before_gate = group_size, eps, norm_before_gate

    def __call__(self, y: mx.array, gate: mx.array) -> mx.array:
        return gated_rms_norm(y, gate, self.weight, self.group_size, self.eps, norm_before_gate=self.norm_before_gate)


class Mamba2Mixer(nn.Module):
    """in_proj -> [gate | conv rows | dt]; causal conv + silu -> x, B, C; the SSD
    recurrence with a D skip; the gated output (norm or not) -> out_proj."""

    def __init__(self, shape: Mamba2Shape):
        super().__init__()
        self.num_heads, self.head_dim = shape.num_heads, shape.head_dim
        self.n_groups, self.state_size = shape.n_groups, shape.state_size
        self.intermediate_size = shape.intermediate_size
        self.conv_dim = self.intermediate_size + 2 * self.n_groups * self.state_size  # [x | B | C]
        self.conv_kernel_size = shape.conv_kernel
        self.time_step_limit = (shape.time_step_min, shape.time_step_max)
        self.in_proj = nn.Linear(shape.hidden_size, self.intermediate_size + self.conv_dim + self.num_heads,
                                 bias=shape.in_proj_bias)
        self.conv1d = nn.Conv1d(self.conv_dim, self.conv_dim, self.conv_kernel_size, groups=self.conv_dim,
                                bias=shape.conv_bias)  # weight (ch, K, 1)
        self.dt_bias = mx.ones((self.num_heads,))
        self.A_log = mx.zeros((self.num_heads,))
        self.D = mx.ones((self.num_heads,))
        if shape.norm_before_gate is not None:
            self.norm = GatedRMSNorm(self.intermediate_size, self.intermediate_size // self.n_groups,
                                     shape.norm_eps, shape.norm_before_gate)
        self.out_proj = nn.Linear(self.intermediate_size, shape.hidden_size, bias=shape.out_proj_bias)

    def project(self, h: mx.array) -> mx.array:
        """h (b, T, hidden) -> [gate | conv rows | dt] (b, T, I + conv_dim + H)."""
        return self.in_proj(h)

    def gated_output(self, y: mx.array, gate: mx.array) -> mx.array:
        """y, gate (b, T, I) -> what out_proj reads."""
        if "norm" in self:
            return self.norm(y, gate)
        return (y.astype(mx.float32) * nn.silu(gate.astype(mx.float32))).astype(y.dtype)

    def conv_input(self, rows: mx.array, cache: Optional[ArraysCache]) -> mx.array:
        """[conv state ; new rows]: (b, K-1+T, conv_dim); zeros as the state of a new sequence."""
        state = None if cache is None else cache[CONV_STATE]
        if state is None:
            state = mx.zeros((rows.shape[0], self.conv_kernel_size - 1, self.conv_dim), rows.dtype)
        return mx.concatenate([state, rows], axis=1)

    def ssm_inputs(self, conv_out: mx.array, dt: mx.array) -> Tuple[mx.array, mx.array, mx.array, mx.array]:
        """Conv outputs (b, T, conv_dim) and raw dt (b, T, H) -> x (b, T, H, P), dt
        discretised, B, C (b, T, G, N)."""
        b, T, _ = conv_out.shape
        x, B, C = mx.split(conv_out, [self.intermediate_size, self.intermediate_size + self.n_groups * self.state_size],
                           axis=-1)
        x = x.reshape(b, T, self.num_heads, self.head_dim)
        B, C = (t.reshape(b, T, self.n_groups, self.state_size) for t in (B, C))
        return x, discretize_dt(dt, self.dt_bias, *self.time_step_limit), B, C

    def __call__(self, h: mx.array, cache: Optional[ArraysCache] = None) -> mx.array:
        b, T, _ = h.shape
        gate, rows, dt = mx.split(self.project(h), [self.intermediate_size, self.intermediate_size + self.conv_dim],
                                  axis=-1)
        conv_input = self.conv_input(rows, cache)  # (b, K-1+T, conv_dim)
        conv_out = nn.silu(causal_conv1d(conv_input, self.conv1d.weight, self.conv1d.get("bias")))
        x, dt, B, C = self.ssm_inputs(conv_out, dt)
        A = -mx.exp(self.A_log.astype(mx.float32))
        state = None if cache is None else cache[SSM_STATE]
        if cache is not None and cache.speculating:
            y, new_state, state_after = ssd_recorded(x, dt, A, B, C, state)  # (b, T, H, P)
            cache.record_rollback(T, partial(entries_after, conv_input, T, state_after), [cache[CONV_STATE], state])
        else:
            y, new_state = ssd_update(x, dt, A, B, C, state)
        y = y + x * self.D[:, None].astype(x.dtype)
        if cache is not None:
            cache[CONV_STATE] = conv_state_after(conv_input, T, self.conv_kernel_size)
            cache[SSM_STATE] = new_state
        return self.out_proj(self.gated_output(y.reshape(b, T, -1), gate))


class Attention(nn.Module):
    """Grouped-query attention without positional encoding or biases."""

    def __init__(self, args: ModelArgs):
        super().__init__()
        dim, self.head_dim = args.hidden_size, args.head_dim
        self.num_heads, self.num_kv_heads = args.num_attention_heads, args.num_key_value_heads
        self.scale = self.head_dim**-0.5
        self.q_proj = nn.Linear(dim, self.num_heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(dim, self.num_kv_heads * self.head_dim, bias=False)
        self.v_proj = nn.Linear(dim, self.num_kv_heads * self.head_dim, bias=False)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, dim, bias=False)

    def __call__(self, x: mx.array, mask: Optional[mx.array] = None, cache=None) -> mx.array:
        B, L, _ = x.shape
        q = self.q_proj(x).reshape(B, L, self.num_heads, -1).transpose(0, 2, 1, 3)  # (B, H, L, D)
        k = self.k_proj(x).reshape(B, L, self.num_kv_heads, -1).transpose(0, 2, 1, 3)
        v = self.v_proj(x).reshape(B, L, self.num_kv_heads, -1).transpose(0, 2, 1, 3)
        if cache is not None:
            k, v = cache.update_and_fetch(k, v)
        out = scaled_dot_product_attention(q, k, v, cache=cache, scale=self.scale, mask=mask)
        return self.o_proj(out.transpose(0, 2, 1, 3).reshape(B, L, -1))


class MLP(nn.Module):
    def __init__(self, dim: int, hidden_dim: int, bias: bool):
        super().__init__()
        self.up_proj = nn.Linear(dim, hidden_dim, bias=bias)
        self.down_proj = nn.Linear(hidden_dim, dim, bias=bias)

    def __call__(self, x: mx.array) -> mx.array:
        return self.down_proj(relu2(self.up_proj(x)))


class Experts(nn.Module):
    """E non-gated relu^2 MLPs, stacked: up_proj (E, I, D), down_proj (E, D, I)."""

    def __init__(self, dim: int, hidden_dim: int, num_experts: int):
        super().__init__()
        self.up_proj = SwitchLinear(dim, hidden_dim, num_experts)
        self.down_proj = SwitchLinear(hidden_dim, dim, num_experts)

    def __call__(self, x: mx.array, experts: mx.array, weights: mx.array) -> mx.array:
        """x (..., D), experts and weights (..., k) -> the weighted sum (..., D)."""
        x = mx.expand_dims(x, (-2, -3))  # (..., 1, 1, D)
        y = self.down_proj(relu2(self.up_proj(x, experts)), experts)  # (..., k, 1, D)
        return (y.squeeze(-2) * weights[..., None].astype(y.dtype)).sum(axis=-2)


class TopkRouter(nn.Module):
    """The router's parameters (kept out of quantization: it is not a Linear)."""

    def __init__(self, dim: int, num_experts: int):
        super().__init__()
        self.weight = mx.zeros((num_experts, dim))
        self.e_score_correction_bias = mx.zeros((num_experts,))


class MoE(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.args = args
        inner = args.moe_latent_size or args.hidden_size
        self.gate = TopkRouter(args.hidden_size, args.n_routed_experts)
        self.experts = Experts(inner, args.moe_intermediate_size, args.n_routed_experts)
        self.shared_experts = MLP(args.hidden_size, args.moe_shared_expert_intermediate_size, args.mlp_bias)
        if args.moe_latent_size is not None:
            self.fc1_latent_proj = nn.Linear(args.hidden_size, args.moe_latent_size, bias=args.mlp_bias)
            self.fc2_latent_proj = nn.Linear(args.moe_latent_size, args.hidden_size, bias=args.mlp_bias)

    def __call__(self, x: mx.array) -> mx.array:
        a = self.args
        logits = x.astype(mx.float32) @ self.gate.weight.astype(mx.float32).T  # (..., E), fp32 as transformers
        experts, weights = route(logits, self.gate.e_score_correction_bias, a.num_experts_per_tok, a.n_group,
                                 a.topk_group, a.norm_topk_prob, a.routed_scaling_factor)
        latent = x if a.moe_latent_size is None else self.fc1_latent_proj(x)
        routed = self.experts(latent, experts, weights)
        if a.moe_latent_size is not None:
            routed = self.fc2_latent_proj(routed)
        return routed + self.shared_experts(x)


class Block(nn.Module):
    def __init__(self, args: ModelArgs, layer_idx: int):
        super().__init__()
        self.block_type = args.layers_block_type[layer_idx]
        self.norm = nn.RMSNorm(args.hidden_size, eps=args.layer_norm_epsilon)
        if self.block_type == MAMBA:
            self.mixer = Mamba2Mixer(args.mamba_shape)
        elif self.block_type == ATTENTION:
            self.mixer = Attention(args)
        elif self.block_type == MOE:
            self.mixer = MoE(args)
        else:
            self.mixer = MLP(args.hidden_size, args.intermediate_size, args.mlp_bias)

    @property
    def has_cache(self) -> bool:
        return self.block_type in (MAMBA, ATTENTION)

    def __call__(self, x: mx.array, mask: Optional[mx.array] = None, cache=None) -> mx.array:
        h = self.norm(x)
        if self.block_type == MAMBA:
            return x + self.mixer(h, cache)
        if self.block_type == ATTENTION:
            return x + self.mixer(h, mask, cache)
        return x + self.mixer(h)


class Backbone(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.embeddings = nn.Embedding(args.vocab_size, args.hidden_size)
        self.layers = [Block(args, i) for i in range(args.num_hidden_layers)]
        self.norm_f = nn.RMSNorm(args.hidden_size, eps=args.layer_norm_epsilon)
        cached = [block for block in self.layers if block.has_cache]
        # Attention blocks share one mask, made from the first one's cache entry.
        kinds = [block.block_type for block in cached]
        self.first_attention = kinds.index(ATTENTION) if ATTENTION in kinds else None

    def __call__(self, inputs: mx.array, cache: Optional[List[Any]] = None) -> mx.array:
        h = self.embeddings(inputs)  # (B, L, hidden)
        num_cached = sum(block.has_cache for block in self.layers)
        cache = [None] * num_cached if cache is None else cache
        if len(cache) != num_cached:
            raise ValueError(f"cache has {len(cache)} entries; this model needs {num_cached} (see make_cache)")
        mask = None if self.first_attention is None else create_attention_mask(h, cache[self.first_attention])
        entries = iter(cache)
        for block in self.layers:
            h = block(h, mask, next(entries) if block.has_cache else None)
        return self.norm_f(h)


_PER_EXPERT = re.compile(r"^(.*\.mixer\.experts)\.(\d+)\.(up_proj|down_proj)\.weight$")
_FUSED_EXPERTS = re.compile(r"^.*\.mixer\.experts\.(up_proj|down_proj)$")


def stack_experts(weights: Dict[str, mx.array]) -> Dict[str, mx.array]:
    """mixer.experts.{e}.{up,down}_proj.weight -> mixer.experts.{up,down}_proj.weight
    (E, out, in); transformers 5's fused mixer.experts.{up,down}_proj get the `.weight`."""
    groups: Dict[Tuple[str, str], Dict[int, mx.array]] = {}
    out = {}
    for key, value in weights.items():
        match = _PER_EXPERT.match(key)
        if match:
            prefix, expert, proj = match.groups()
            groups.setdefault((prefix, proj), {})[int(expert)] = value
        else:
            out[key + ".weight" if _FUSED_EXPERTS.match(key) else key] = value
    for (prefix, proj), experts in groups.items():
        if sorted(experts) != list(range(len(experts))):
            raise ValueError(f"{prefix} has {proj} for experts {sorted(experts)}; expected 0..{len(experts) - 1}")
        out[f"{prefix}.{proj}.weight"] = mx.stack([experts[e] for e in range(len(experts))])
    return out


class Model(nn.Module):
    # Mamba-2 layers record rollbacks into their ArraysCache while speculating.
    supports_speculative_rollback = True

    def __init__(self, args: ModelArgs):
        super().__init__()
        self.args = args
        self.model_type = args.model_type
        self.model = Backbone(args)
        # transformers never ties this head for nemotron_h (no tied weight keys).
        self.lm_head = nn.Linear(args.hidden_size, args.vocab_size, bias=False)

    def __call__(self, inputs: mx.array, cache: Optional[List[Any]] = None) -> mx.array:
        """Token ids (B, L) -> logits (B, L, vocab)."""
        return self.lm_head(self.model(inputs, cache))

    def sanitize(self, weights: Dict[str, mx.array]) -> Dict[str, mx.array]:
        """Hub / transformers weights or converted ones -> ours; each rewrite is guarded
        by the name or shape it changes, so a second pass changes nothing."""
        out = {}
        for key, value in weights.items():
            if key.startswith("mtp."):  # the multi-token-prediction head, unused (transformers drops it too)
                continue
            if key.startswith("backbone."):
                key = "model." + key[len("backbone.") :]
            if key.endswith("mixer.conv1d.weight") and value.shape[1] == 1 and value.shape[2] > 1:
                value = value.swapaxes(1, 2)  # (ch, 1, K) -> (ch, K, 1)
            out[key] = value
        return stack_experts(out)

    @property
    def layers(self) -> List[Block]:
        """The blocks that own a cache entry (Mamba-2 and attention), in order."""
        return [block for block in self.model.layers if block.has_cache]

    def make_cache(self) -> List[Union[ArraysCache, KVCache]]:
        return [ArraysCache(2) if block.block_type == MAMBA else KVCache() for block in self.layers]

    def shard(self, group: Optional[mx.distributed.Group] = None) -> None:
        """Tensor parallel over `group` (default: the global group), in place: Mamba-2
        mixers by heads (with their B/C groups), attention by heads, MLPs and experts
        by hidden units; each mixer all-sums once. The router, embeddings and lm_head
        stay whole."""
        group = sharding.world(group)
        for block in self.model.layers:
            mixer = block.mixer
            if block.block_type == MAMBA:
                sharding.shard_mamba2(mixer, group)
            elif block.block_type == ATTENTION:
                mixer.num_heads, mixer.num_kv_heads = sharding.shard_attention(
                    mixer, mixer.num_heads, mixer.num_kv_heads, group
                )
            elif block.block_type == MOE:
                sharding.shard_switch_linear(mixer.experts.up_proj, sharding.ALL_TO_SHARDED, group)
                sharding.shard_switch_linear(mixer.experts.down_proj, sharding.SHARDED_TO_ALL, group)
                sharding.shard_mlp(mixer.shared_experts, group, reduce=False, inputs=("up_proj",))
                if self.args.moe_latent_size is not None:  # applied to the partial routed sum
                    sharding.bias_on_rank0(mixer.fc2_latent_proj, group)
                sharding.sum_outputs(mixer, group)
            else:
                sharding.shard_mlp(mixer, group, inputs=("up_proj",))
