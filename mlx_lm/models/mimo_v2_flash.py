"""MiMo-V2-Flash (`mimo_v2_flash`, MiMoV2FlashForCausalLM: XiaomiMiMo/MiMo-V2-Flash).

What differs from llama:
- Sliding and global attention layers (`layer_types`; the hub's `hybrid_layer_pattern`,
  1 = sliding; by default global at layer 0 and every sixth). A sliding layer's query
  sees its `sliding_window` most recent positions, itself included, cached in a
  `RotatingKVCache`. The hub's `sliding_window_size` counts the previous tokens only, so
  the window is `sliding_window_size + 1` (129 on the hub), as transformers reads it.
- The two kinds have their own shapes: sliding layers have twice the KV heads (the hub's
  `swa_*` keys say so explicitly) and learned attention sinks (one logit per head that
  joins the softmax without a value, as gpt-oss); global layers have none unless
  `add_full_attention_sink_bias`.
- Query/key heads are wider than value heads (`head_dim` 192, `v_head_dim` 128); values
  are multiplied by `attention_value_scale` (0.707) before they are cached.
- Partial rope: the first int(head_dim * partial_rotary_factor) features of each q/k
  head (0.334: 64 of 192) rotate, with a theta per layer kind (5e6 global, 1e4 sliding).
- MLPs per `mlp_layer_types` (the hub's `moe_layer_freq`, 1 = sparse): a dense SwiGLU
  first layer, then mixtures of experts with DeepSeek-V3's sigmoid router (a score
  correction bias for the choice, group-limited top-k, renormalised unbiased scores
  times `routed_scaling_factor`) and no shared expert.

Weights: hub checkpoints (and transformers' save) store one tensor per expert
(`mlp.experts.{e}.{gate,up,down}_proj.weight`) and the sinks as
`self_attn.attention_sink_bias`; transformers' in-memory layout fuses the experts
(`gate_up_proj` (E, 2I, D), `down_proj` (E, D, I)) and names the sinks `sinks`. The
hub's multi-token-prediction layers (`model.mtp.*`) are dropped: their blocks are
MiMo's own (not the Qwen3-Next layout mlx_lm/mtp.py runs), and transformers ignores
them too. The hub's FP8 release (e4m3 weights, one `weight_scale_inv` per 128 x 128
tile) is dequantized to bfloat16 on load; checkpoints converted by upstream mlx-lm
(experts under `mlp.switch_mlp`, float or quantized) load too.

Reference: transformers `models/mimo_v2_flash/modeling_mimo_v2_flash.py`,
`configuration_mimo_v2_flash.py`.
"""

from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Tuple

import mlx.core as mx
import mlx.nn as nn

from . import llama, sharding
from .base import BaseModelArgs, check_head_grouping, check_layer_types, check_sliding_window
from .base import scaled_dot_product_attention
from .llama import FULL, MLP, SLIDING
from .nemotron_h import TopkRouter, route
from .rope_utils import initialize_rope, resolve_rope
from .switch_layers import SwitchGLU, split_fused_experts, stack_experts

DENSE, SPARSE = "dense", "sparse"
# transformers' per-kind defaults (MiMoV2FlashConfig), the released checkpoint's values.
DEFAULT_THETA = {FULL: 5_000_000.0, SLIDING: 10_000.0}
DEFAULT_PARTIAL_ROTARY_FACTOR = 0.334


@dataclass
class AttentionKind:
    """The shape of one kind of attention layer (global or sliding)."""

    num_heads: int
    num_kv_heads: int
    head_dim: int
    v_head_dim: int
    sinks: bool
    rope_theta: float
    rope_scaling: Optional[Dict[str, Any]]
    rotary_dims: int


@dataclass
class ModelArgs(BaseModelArgs):
    """MiMoV2FlashConfig's keys with its defaults, plus the hub config's own keys."""

    model_type: str = "mimo_v2_flash"
    vocab_size: int = 152576
    hidden_size: int = 4096
    intermediate_size: int = 16384
    moe_intermediate_size: int = 2048
    num_hidden_layers: int = 48
    num_attention_heads: int = 64
    num_key_value_heads: int = 4
    head_dim: int = 192
    v_head_dim: int = 128
    hidden_act: str = "silu"
    max_position_embeddings: int = 131072
    rms_norm_eps: Optional[float] = None  # hub: layernorm_epsilon; else 1e-5
    layernorm_epsilon: Optional[float] = None
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    attention_value_scale: Optional[float] = 0.707
    n_routed_experts: int = 256
    num_experts_per_tok: int = 8
    routed_scaling_factor: Optional[float] = 1.0  # the hub stores null: 1.0
    n_group: int = 1
    topk_group: int = 1
    norm_topk_prob: bool = True
    scoring_func: str = "sigmoid"
    sliding_window: Optional[int] = 129
    sliding_window_size: Optional[int] = None  # hub: previous tokens seen, the query aside
    layer_types: Optional[List[str]] = None
    hybrid_layer_pattern: Optional[List[int]] = None  # hub: 1 = sliding, 0 = global
    mlp_layer_types: Optional[List[str]] = None
    moe_layer_freq: Optional[List[int]] = None  # hub: 1 = sparse, 0 = dense
    rope_parameters: Optional[Dict[str, Dict[str, Any]]] = None  # transformers 5: by layer kind
    rope_theta: Optional[float] = None  # hub: global layers
    swa_rope_theta: Optional[float] = None  # hub: sliding layers
    partial_rotary_factor: Optional[float] = None  # hub: both kinds
    swa_num_attention_heads: Optional[int] = None  # hub; transformers: num_attention_heads
    swa_num_key_value_heads: Optional[int] = None  # hub; transformers: 2 * num_key_value_heads
    swa_head_dim: Optional[int] = None
    swa_v_head_dim: Optional[int] = None
    add_swa_attention_sink_bias: bool = True
    add_full_attention_sink_bias: bool = False
    n_shared_experts: Optional[int] = None  # hub: null (transformers has no shared expert)
    topk_method: Optional[str] = None  # hub: "noaux_tc", the routing route() implements
    quantization_config: Optional[Dict[str, Any]] = None  # hub: the FP8 release's blocks

    def __post_init__(self):
        if self.rms_norm_eps is None:
            self.rms_norm_eps = 1e-5 if self.layernorm_epsilon is None else self.layernorm_epsilon
        if self.routed_scaling_factor is None:
            self.routed_scaling_factor = 1.0
        if self.sliding_window_size is not None:  # transformers: it wins over sliding_window
            self.sliding_window = self.sliding_window_size + 1
        self.layer_types = self._pattern("layer_types", self.layer_types, "hybrid_layer_pattern",
                                         self.hybrid_layer_pattern, (FULL, SLIDING), self._default_layer_types())
        self.mlp_layer_types = self._pattern("mlp_layer_types", self.mlp_layer_types, "moe_layer_freq",
                                             self.moe_layer_freq, (DENSE, SPARSE),
                                             [DENSE] + [SPARSE] * (self.num_hidden_layers - 1))
        check_layer_types(self.layer_types, self.num_hidden_layers, (SLIDING, FULL))
        check_layer_types(self.mlp_layer_types, self.num_hidden_layers, (DENSE, SPARSE))
        check_sliding_window(self.layer_types, self.sliding_window)
        self.attention = {kind: self._attention_kind(kind) for kind in (FULL, SLIDING)}
        self._validate()

    def _default_layer_types(self) -> List[str]:
        return [FULL if i == 0 or (i + 1) % 6 == 0 else SLIDING for i in range(self.num_hidden_layers)]

    def _pattern(self, name: str, kinds, hub_name: str, hub_flags, names, default) -> List[str]:
        """A per-layer list from transformers' names, else from the hub's 0/1 flags, else
        the default; both given must agree."""
        from_hub = None
        if hub_flags is not None:
            if not isinstance(hub_flags, list) or set(hub_flags) - {0, 1}:
                raise ValueError(f"{hub_name} must be a list of 0/1 flags, one per layer; got {hub_flags!r}")
            from_hub = [names[flag] for flag in hub_flags]
        if kinds is not None and from_hub is not None and list(kinds) != from_hub:
            raise ValueError(f"{name} {kinds} disagrees with {hub_name} {hub_flags}")
        return list(kinds if kinds is not None else from_hub if from_hub is not None else default)

    def _attention_kind(self, kind: str) -> AttentionKind:
        params = self.rope_parameters or {}
        if set(params) - {SLIDING, FULL}:
            raise ValueError(
                f"mimo_v2_flash rope_parameters must be keyed by layer type ({SLIDING!r}, {FULL!r}); "
                f"got keys {sorted(params)}"
            )
        top_theta = self.rope_theta if kind == FULL else self.swa_rope_theta
        theta, scaling, partial = resolve_rope(top_theta, None, params.get(kind))
        partial = self.partial_rotary_factor or partial or DEFAULT_PARTIAL_ROTARY_FACTOR
        sliding = kind == SLIDING
        head_dim = (self.swa_head_dim if sliding else None) or self.head_dim
        rotary_dims = int(head_dim * partial)
        if rotary_dims % 2 or not 0 < rotary_dims <= head_dim:
            raise ValueError(
                f"partial_rotary_factor {partial} rotates {rotary_dims} of {head_dim} features of the {kind} "
                "layers; it must be an even number, at least 2"
            )
        return AttentionKind(
            num_heads=(self.swa_num_attention_heads if sliding else None) or self.num_attention_heads,
            num_kv_heads=(self.swa_num_key_value_heads or 2 * self.num_key_value_heads) if sliding
            else self.num_key_value_heads,
            head_dim=head_dim,
            v_head_dim=(self.swa_v_head_dim if sliding else None) or self.v_head_dim,
            sinks=self.add_swa_attention_sink_bias if sliding else self.add_full_attention_sink_bias,
            rope_theta=DEFAULT_THETA[kind] if theta is None else theta,
            rope_scaling=scaling,
            rotary_dims=rotary_dims,
        )

    def _validate(self):
        for kind, shape in self.attention.items():
            check_head_grouping(shape.num_heads, shape.num_kv_heads)
        if self.hidden_act != "silu":
            raise ValueError(f"hidden_act {self.hidden_act!r} is not supported; mimo_v2_flash uses 'silu'")
        if self.scoring_func != "sigmoid":
            raise ValueError(f"scoring_func {self.scoring_func!r} is not supported; mimo_v2_flash routes by 'sigmoid'")
        if self.n_routed_experts % self.n_group or not 0 < self.topk_group <= self.n_group:
            raise ValueError(
                f"n_routed_experts ({self.n_routed_experts}) must split into n_group ({self.n_group}) equal groups, "
                f"of which topk_group ({self.topk_group}) are kept"
            )
        if self.n_shared_experts:
            raise ValueError(f"n_shared_experts {self.n_shared_experts} is not supported: mimo_v2_flash's experts "
                             "are all routed (transformers' MiMoV2FlashMoE has no shared expert)")
        if self.topk_method not in (None, "noaux_tc"):
            raise ValueError(f"topk_method {self.topk_method!r} is not supported; mimo_v2_flash routes by 'noaux_tc'")
        method = (self.quantization_config or {}).get("quant_method")
        if method not in (None, "fp8"):
            raise ValueError(
                f"quantization_config.quant_method {method!r} is not supported for mimo_v2_flash; only the "
                "release's block-scaled 'fp8' (dequantized on load) or MLX-converted checkpoints load"
            )

    @property
    def fp8_block(self) -> Tuple[int, int]:
        """(rows, columns) of the FP8 weight tiles that share one scale."""
        rows, cols = (self.quantization_config or {}).get("weight_block_size", (128, 128))
        return rows, cols


def dequantize_fp8_blocks(weight: mx.array, scale_inv: mx.array, block: Tuple[int, int],
                          dtype: mx.Dtype = mx.bfloat16) -> mx.array:
    """A block-scaled FP8 weight -> `dtype`: `weight` (out, in) holds e4m3 bytes (uint8),
    `scale_inv` (ceil(out / rows), ceil(in / cols)) one multiplier per (rows, cols)
    tile (the last tiles may be partial); the value is fp8(weight) * its tile's scale."""
    rows, cols = block
    out_dims, in_dims = weight.shape
    scales = mx.repeat(mx.repeat(scale_inv.astype(mx.float32), rows, axis=0), cols, axis=1)  # (>= out, >= in)
    return (mx.from_fp8(weight, dtype=mx.float32) * scales[:out_dims, :in_dims]).astype(dtype)


class Attention(nn.Module):
    def __init__(self, args: ModelArgs, layer_type: str):
        super().__init__()
        shape, dim, bias = args.attention[layer_type], args.hidden_size, args.attention_bias
        self.n_heads, self.n_kv_heads = shape.num_heads, shape.num_kv_heads
        self.scale = shape.head_dim**-0.5
        self.q_proj = nn.Linear(dim, self.n_heads * shape.head_dim, bias=bias)
        self.k_proj = nn.Linear(dim, self.n_kv_heads * shape.head_dim, bias=bias)
        self.v_proj = nn.Linear(dim, self.n_kv_heads * shape.v_head_dim, bias=bias)
        self.o_proj = nn.Linear(self.n_heads * shape.v_head_dim, dim, bias=False)
        self.has_sinks = shape.sinks
        if shape.sinks:
            self.sinks = mx.zeros((self.n_heads,))
        self.v_scale = 1.0 if args.attention_value_scale is None else args.attention_value_scale
        self.rope = initialize_rope(
            shape.rotary_dims, shape.rope_theta, False, shape.rope_scaling, args.max_position_embeddings
        )

    def __call__(self, x: mx.array, mask: Optional[mx.array] = None, cache=None) -> mx.array:
        B, L, _ = x.shape
        q = self.q_proj(x).reshape(B, L, self.n_heads, -1).transpose(0, 2, 1, 3)  # (B, H, L, D)
        k = self.k_proj(x).reshape(B, L, self.n_kv_heads, -1).transpose(0, 2, 1, 3)  # (B, H_kv, L, D)
        v = self.v_proj(x).reshape(B, L, self.n_kv_heads, -1).transpose(0, 2, 1, 3)  # (B, H_kv, L, Dv)
        v = v * self.v_scale  # scaled before caching, as transformers does
        offset = cache.offset if cache is not None else 0
        q, k = self.rope(q, offset=offset), self.rope(k, offset=offset)  # the first rotary_dims rotate
        if cache is not None:
            k, v = cache.update_and_fetch(k, v)  # (B, H_kv, S, D), (B, H_kv, S, Dv)
        sinks = self.sinks if self.has_sinks else None
        out = scaled_dot_product_attention(q, k, v, cache=cache, scale=self.scale, mask=mask, sinks=sinks)
        return self.o_proj(out.transpose(0, 2, 1, 3).reshape(B, L, -1))  # (B, H, L, Dv) -> (B, L, H * Dv)


class MoE(nn.Module):
    """Routed experts only (no shared expert); `gate` is the router, as in the checkpoint."""

    def __init__(self, args: ModelArgs):
        super().__init__()
        self.args = args
        self.gate = TopkRouter(args.hidden_size, args.n_routed_experts)
        self.experts = SwitchGLU(args.hidden_size, args.moe_intermediate_size, args.n_routed_experts)

    def __call__(self, x: mx.array) -> mx.array:
        a = self.args
        logits = x.astype(mx.float32) @ self.gate.weight.astype(mx.float32).T  # (..., E), fp32 as transformers
        experts, weights = route(logits, self.gate.e_score_correction_bias, a.num_experts_per_tok, a.n_group,
                                 a.topk_group, a.norm_topk_prob, a.routed_scaling_factor)  # (..., k) each
        y = self.experts(x, experts)  # (..., k, D)
        return (y * weights[..., None].astype(y.dtype)).sum(axis=-2)


class DecoderLayer(nn.Module):
    def __init__(self, args: ModelArgs, layer_type: str, mlp_type: str):
        super().__init__()
        self.layer_type = layer_type
        self.self_attn = Attention(args, layer_type)
        self.mlp = MoE(args) if mlp_type == SPARSE else MLP(args.hidden_size, args.intermediate_size)
        self.input_layernorm = nn.RMSNorm(args.hidden_size, eps=args.rms_norm_eps)
        self.post_attention_layernorm = nn.RMSNorm(args.hidden_size, eps=args.rms_norm_eps)

    def __call__(self, x: mx.array, mask: Optional[mx.array] = None, cache=None) -> mx.array:
        h = x + self.self_attn(self.input_layernorm(x), mask, cache)
        return h + self.mlp(self.post_attention_layernorm(h))


class Backbone(llama.LlamaModel):
    """llama's forward (embeddings, one mask per layer kind, final RMSNorm) over MiMo's
    layers, whose MLP kind is per layer too."""

    def __init__(self, args: ModelArgs):
        nn.Module.__init__(self)  # llama's __init__ builds one block kind; ours are two
        self.sliding_window = args.sliding_window
        self.embed_tokens = nn.Embedding(args.vocab_size, args.hidden_size)
        self.layers = [DecoderLayer(args, kind, mlp) for kind, mlp in zip(args.layer_types, args.mlp_layer_types)]
        self.norm = nn.RMSNorm(args.hidden_size, eps=args.rms_norm_eps)


class Model(llama.Model):
    """llama's LM head (tied or `lm_head`) and caches (RotatingKVCache for sliding
    layers, KVCache for global ones) over MiMo's backbone."""

    # Both cache kinds roll back by themselves (the sliding layers' RotatingKVCaches
    # record the rows they overwrite); the layers record nothing.
    supports_speculative_rollback = True
    backbone_class = Backbone

    def sanitize(self, weights: Dict[str, mx.array]) -> Dict[str, mx.array]:
        """Hub/transformers layouts -> ours (llama's drops rope buffers and a tied
        `lm_head`); each rewrite consumes the keys it reads, so our own layout (a second
        call, MLX-converted checkpoints) passes unchanged."""
        weights = {k: v for k, v in super().sanitize(weights).items() if not k.startswith("model.mtp.")}
        for key in [k for k in weights if k.endswith(".weight_scale_inv")]:  # the FP8 release
            weight = key[: -len("_scale_inv")]
            weights[weight] = dequantize_fp8_blocks(weights[weight], weights.pop(key), self.args.fp8_block)
        for key in [k for k in weights if k.endswith(".self_attn.attention_sink_bias")]:
            weights[key[: -len("attention_sink_bias")] + "sinks"] = weights.pop(key)
        for key in [k for k in weights if ".mlp.switch_mlp." in k]:  # converted by upstream mlx-lm
            weights[key.replace(".mlp.switch_mlp.", ".mlp.experts.")] = weights.pop(key)
        return split_fused_experts(stack_experts(weights))

    def shard(self, group: Optional[mx.distributed.Group] = None) -> None:
        """Tensor parallel over `group` (default: the global group), in place: each rank
        keeps its share of every layer's heads (with their sinks), of the dense MLP's
        units and of every expert's units; routers, embeddings and lm_head stay whole,
        so routing is the same on every rank."""
        group = sharding.world(group)
        for layer in self.layers:
            attn = layer.self_attn
            if attn.has_sinks:
                attn.sinks = sharding.take_shard(attn.sinks, group)
            attn.n_heads, attn.n_kv_heads = sharding.shard_attention(attn, attn.n_heads, attn.n_kv_heads, group)
            if isinstance(layer.mlp, MoE):
                sharding.shard_moe(layer.mlp, layer.mlp.experts, group)
            else:
                sharding.shard_mlp(layer.mlp, group)
