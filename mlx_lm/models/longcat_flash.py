"""LongCat-Flash (`longcat_flash`, LongcatFlashForCausalLM: meituan-longcat/LongCat-Flash-Chat):
each decoder layer holds two MLA attention blocks and two dense SwiGLU MLPs, plus a
mixture of experts fed from the first block and added at the end ("shortcut-connected
MoE"), whose router may pick "zero experts" that return their input.

What differs from llama:
- A layer: h = x + attn0(n(x)); m = n(h); s = moe(m); h = h + mlp0(m);
  h = h + attn1(n(h)); out = h + mlp1(n(h)) + s, every n its own RMSNorm
  (`input_layernorm.{0,1}`, `post_attention_layernorm.{0,1}`). `num_layers` counts these
  layers; transformers' num_hidden_layers is twice it (one per attention block).
- Attention is MLA (mla.py) with a q LoRA always, interleaved rope (pairs (2i, 2i+1),
  DeepSeek's) on q_rot and the shared k_rot, and LoRA scales: the query times
  sqrt(hidden_size / q_lora_rank), the latent (keys' and values' source) times
  sqrt(hidden_size / kv_lora_rank) (`mla_scale_q_lora` / `mla_scale_kv_lora`, the hub's
  switches; transformers always scales). Scale (qk_nope + qk_rope)^-1/2 (times yarn's
  mscale^2 with mscale_all_dim). Each block caches its own latent: one CacheList of two
  KVCaches per layer, so a layer trims, batches and saves as its KV caches do.
- MoE: the router (`router.classifier`, no bias, in fp32) softmaxes over the
  n_routed_experts real experts and zero_expert_num zero experts together; the moe_topk
  largest p + `router.e_score_correction_bias` are chosen, weighted by p (no
  renormalisation) times routed_scaling_factor. A chosen zero expert adds weight * x
  (no compute: its slot runs expert 0 at weight 0); the real ones are SwiGLUs of
  expert_ffn_hidden_size (`switch_mlp`). No shared experts.
- Defaults: transformers' (rope theta 1e7, untied).
Weights: as the hub and transformers save them (per expert `mlp.experts.{e}.{gate,up,
down}_proj.weight`; transformers' save also writes unused gate/up rows for the zero
experts, dropped here), as transformers holds them (fused `mlp.experts.gate_up_proj`
(E + Z, 2I, H) and `down_proj` (E, H, I)), or ours; the multi-token-prediction weights
(`model.mtp.*`) are dropped, as transformers drops them. Checkpoints converted by
upstream mlx-lm (kv_b_proj split into embed_q / unembed_out, float or quantized) load too.
Reference: transformers `models/longcat_flash/modeling_longcat_flash.py`,
`configuration_longcat_flash.py`.
"""

import math
import re
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Tuple, Union

import mlx.core as mx
import mlx.nn as nn

from . import llama, mla, sharding
from .base import BaseModelArgs, run_hybrid_layers
from .cache import CacheList, KVCache
from .deepseek_v3 import join_absorbed_kv_b_proj
from .llama import MLP
from .minicpm3 import check_mla_args
from .mixtral import check_top_k
from .qwen3_next import split_fused_experts, stack_expert_weights
from .rope_utils import initialize_rope, resolve_rope
from .switch_layers import SwitchGLU


@dataclass
class ModelArgs(BaseModelArgs):
    """LongcatFlashConfig's keys (the hub's are the same), with its defaults."""

    model_type: str
    vocab_size: int = 131072
    hidden_size: int = 6144
    num_layers: Optional[int] = None
    num_hidden_layers: Optional[int] = None
    num_attention_heads: int = 64
    num_key_value_heads: Optional[int] = None
    hidden_act: str = "silu"
    max_position_embeddings: int = 131072
    rms_norm_eps: float = 1e-5
    tie_word_embeddings: bool = False
    rope_theta: Optional[float] = None
    rope_scaling: Optional[Dict[str, Any]] = None
    rope_parameters: Optional[Dict[str, Any]] = None
    attention_bias: bool = False
    ffn_hidden_size: int = 12288
    q_lora_rank: int = 1536
    kv_lora_rank: int = 512
    qk_nope_head_dim: int = 128
    qk_rope_head_dim: int = 64
    head_dim: Optional[int] = None
    qk_head_dim: Optional[int] = None
    v_head_dim: int = 128
    moe_topk: int = 12
    n_routed_experts: int = 512
    zero_expert_num: Optional[int] = 256
    zero_expert_type: str = "identity"
    expert_ffn_hidden_size: int = 2048
    routed_scaling_factor: float = 6.0
    attention_method: str = "MLA"
    router_bias: bool = False
    mla_scale_q_lora: bool = True
    mla_scale_kv_lora: bool = True

    def __post_init__(self):
        self._normalise_layer_count()
        if self.num_key_value_heads is None:
            self.num_key_value_heads = self.num_attention_heads
        if self.zero_expert_num is None:  # transformers: `zero_expert_num or 0`
            self.zero_expert_num = 0
        for name, want in (("head_dim", self.qk_rope_head_dim),
                           ("qk_head_dim", self.qk_nope_head_dim + self.qk_rope_head_dim)):
            if getattr(self, name) is None:
                setattr(self, name, want)
            elif getattr(self, name) != want:  # transformers would build mismatched shapes
                raise ValueError(f"{name} ({getattr(self, name)}) must be {want} (from qk_nope_head_dim "
                                 f"{self.qk_nope_head_dim} and qk_rope_head_dim {self.qk_rope_head_dim})")
        theta, self.rope_scaling, _ = resolve_rope(self.rope_theta, self.rope_scaling, self.rope_parameters)
        self.rope_theta = 1e7 if theta is None else theta  # LongcatFlashConfig.default_theta
        check_mla_args(self)
        self._validate_switches()
        if self.n_routed_experts < 1:
            raise ValueError(f"n_routed_experts must be >= 1, got {self.n_routed_experts}")
        check_top_k(self.moe_topk, self.n_routed_experts + self.zero_expert_num,
                    "n_routed_experts + zero_expert_num", "moe_topk")

    def _normalise_layer_count(self):
        """num_layers (the hub's and transformers' saved key) or num_hidden_layers (twice
        it, one per attention block; transformers reads num_layers from it when given)."""
        if self.num_layers is None:
            if self.num_hidden_layers is not None and self.num_hidden_layers % 2:
                raise ValueError(f"num_hidden_layers ({self.num_hidden_layers}) must be even: each layer "
                                 "holds two attention blocks")
            self.num_layers = 28 if self.num_hidden_layers is None else self.num_hidden_layers // 2
        elif self.num_hidden_layers is not None and self.num_hidden_layers != 2 * self.num_layers:
            raise ValueError(f"num_hidden_layers ({self.num_hidden_layers}) and num_layers ({self.num_layers}) "
                             f"disagree: num_hidden_layers counts attention blocks, 2 per layer; give one of them")
        self.num_hidden_layers = 2 * self.num_layers

    def _validate_switches(self):
        if self.attention_method != "MLA":
            raise ValueError(f"attention_method {self.attention_method!r} is not supported; LongCat-Flash uses 'MLA'")
        if self.zero_expert_type != "identity":
            raise ValueError(f"zero_expert_type {self.zero_expert_type!r} is not supported; give 'identity' "
                             "(zero experts return their input, as transformers has them)")
        if self.router_bias:  # transformers builds the bias but its router never adds it
            raise ValueError("router_bias True is not supported: transformers' LongCat router ignores the bias")
        if not (isinstance(self.q_lora_rank, int) and self.q_lora_rank > 0):
            raise ValueError(f"q_lora_rank must be a positive int (LongCat's queries always pass the q LoRA), "
                             f"got {self.q_lora_rank!r}")


class ScaledRMSNorm(nn.RMSNorm):
    """RMSNorm times a constant factor (LongCat's LoRA scale on the latent)."""

    def __init__(self, dims: int, eps: float, factor: float):
        super().__init__(dims, eps=eps)
        self.factor = factor

    def __call__(self, x: mx.array) -> mx.array:
        return super().__call__(x) * self.factor


class Attention(mla.LatentAttention):
    """mla.LatentAttention with interleaved rope and LongCat's LoRA scales on the query
    (`queries`) and the latent (its norm)."""

    def __init__(self, args: ModelArgs):
        rope = initialize_rope(args.qk_rope_head_dim, args.rope_theta, True, args.rope_scaling,
                               args.max_position_embeddings)
        super().__init__(args, rope, mla.softmax_scale(args.qk_head_dim, args.rope_scaling))
        self.q_scale = math.sqrt(args.hidden_size / args.q_lora_rank) if args.mla_scale_q_lora else 1.0
        if args.mla_scale_kv_lora:
            self.kv_a_layernorm = ScaledRMSNorm(args.kv_lora_rank, mla.LATENT_NORM_EPS,
                                                math.sqrt(args.hidden_size / args.kv_lora_rank))

    def queries(self, x: mx.array) -> mx.array:
        q = super().queries(x)  # (B, H, L, dn + dr)
        return q if self.q_scale == 1.0 else q * self.q_scale


def route(logits: mx.array, correction_bias: mx.array, top_k: int, scaling: float) -> Tuple[mx.array, mx.array]:
    """LongCat's router: logits (..., E + Z) over real and zero experts -> expert ids
    (..., k) and weights (..., k), fp32: softmax p, the k largest p + correction_bias
    (E + Z,) chosen, weighted by p (not renormalised) times `scaling`."""
    probs = mx.softmax(logits.astype(mx.float32), axis=-1, precise=True)
    choice = probs + correction_bias.astype(mx.float32)
    experts = mx.stop_gradient(mx.argpartition(-choice, kth=top_k - 1, axis=-1)[..., :top_k])
    return experts, mx.take_along_axis(probs, experts, axis=-1) * scaling


def zero_expert_moe(x: mx.array, experts: mx.array, weights: mx.array, num_real: int, switch_mlp: SwitchGLU,
                    zero_share: float) -> mx.array:
    """x (..., H) through its chosen experts (..., k) with their weights (..., k): ids
    below `num_real` run `switch_mlp`, the others (zero experts) return x; -> the
    weighted sum (..., H). A zero expert's slot runs expert 0 at weight 0 (one gathered
    matmul for all slots); their summed weight times x is scaled by `zero_share` (1, or
    0 on the ranks but one of a sharded sum)."""
    real = experts < num_real
    outputs = switch_mlp(x, mx.where(real, experts, 0))  # (..., k, H)
    routed = (outputs * mx.where(real, weights, 0.0)[..., None].astype(x.dtype)).sum(axis=-2)
    zero_weight = mx.where(real, 0.0, weights).sum(axis=-1, keepdims=True) * zero_share  # (..., 1)
    return routed + x * zero_weight.astype(x.dtype)


class Router(nn.Module):
    """The router's parameters: classifier (E + Z, H), kept float (transformers keeps it
    in fp32), and the choice bias e_score_correction_bias (E + Z,)."""

    def __init__(self, dim: int, num_experts: int):
        super().__init__()
        self.classifier = nn.Linear(dim, num_experts, bias=False)
        self.e_score_correction_bias = mx.zeros((num_experts,))


class MoE(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.top_k, self.scaling, self.num_real = args.moe_topk, args.routed_scaling_factor, args.n_routed_experts
        self.router = Router(args.hidden_size, args.n_routed_experts + args.zero_expert_num)
        self.switch_mlp = SwitchGLU(args.hidden_size, args.expert_ffn_hidden_size, args.n_routed_experts)
        self.zero_share = 1.0  # see shard

    def __call__(self, x: mx.array) -> mx.array:
        logits = x.astype(mx.float32) @ self.router.classifier.weight.astype(mx.float32).T  # (B, L, E + Z)
        experts, weights = route(logits, self.router.e_score_correction_bias, self.top_k, self.scaling)  # (B, L, k)
        return zero_expert_moe(x, experts, weights, self.num_real, self.switch_mlp, self.zero_share)

    def shard(self, group: mx.distributed.Group) -> None:
        """Every expert's hidden units split, the block all-summed once; the zero
        experts' term (x times their weight, whole on every rank) kept on rank 0 only,
        so the sum adds it once."""
        sharding.shard_moe(self, self.switch_mlp, group)
        self.zero_share = 1.0 if group.rank() == 0 else 0.0


class DecoderLayer(nn.Module):
    """Two attention blocks and two MLPs, the MoE branching off after the first block."""

    def __init__(self, args: ModelArgs):
        super().__init__()
        dim, eps = args.hidden_size, args.rms_norm_eps
        self.mlp = MoE(args)
        self.self_attn = [Attention(args) for _ in range(2)]
        self.mlps = [MLP(dim, args.ffn_hidden_size) for _ in range(2)]
        self.input_layernorm = [nn.RMSNorm(dim, eps=eps) for _ in range(2)]
        self.post_attention_layernorm = [nn.RMSNorm(dim, eps=eps) for _ in range(2)]

    def __call__(self, x: mx.array, mask=None, cache: Optional[CacheList] = None) -> mx.array:
        first, second = (None, None) if cache is None else (cache[0], cache[1])
        h = x + self.self_attn[0](self.input_layernorm[0](x), mask, first)
        normed = self.post_attention_layernorm[0](h)
        shortcut, h = self.mlp(normed), h + self.mlps[0](normed)
        h = h + self.self_attn[1](self.input_layernorm[1](h), mask, second)
        return h + self.mlps[1](self.post_attention_layernorm[1](h)) + shortcut


class LongcatFlashModel(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.embed_tokens = nn.Embedding(args.vocab_size, args.hidden_size)
        self.layers = [DecoderLayer(args) for _ in range(args.num_layers)]
        self.norm = nn.RMSNorm(args.hidden_size, eps=args.rms_norm_eps)

    def __call__(self, inputs: mx.array, cache: Optional[List[CacheList]] = None,
                 input_embeddings: Optional[mx.array] = None) -> mx.array:
        h = self.embed_tokens(inputs) if input_embeddings is None else input_embeddings  # (B, L, hidden)
        # Both blocks of every layer attend over the same positions: one mask for all.
        return self.norm(run_hybrid_layers(h, self.layers, cache, 0))


_PER_EXPERT = re.compile(r"\.mlp\.experts\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")


def drop_zero_expert_weights(weights: Dict[str, mx.array], num_real: int) -> Dict[str, mx.array]:
    """Zero experts have no weights, but transformers allocates gate_up_proj rows for
    them and saves those (experts >= num_real, or rows past num_real fused): dropped."""
    out = {}
    for key, value in weights.items():
        match = _PER_EXPERT.search(key)
        if match and int(match.group(1)) >= num_real:
            continue
        if key.endswith(".mlp.experts.gate_up_proj") and value.shape[0] > num_real:
            value = value[:num_real]
        out[key] = value
    return out


class Model(llama.Model):
    """llama's head (tied or not) and sanitize base, with LongCat's layers."""

    # Latent KV caches roll back by themselves; the layers record nothing.
    supports_speculative_rollback = True
    backbone_class = LongcatFlashModel

    def sanitize(self, weights: Dict[str, mx.array]) -> Dict[str, mx.array]:
        """llama's (stored rope frequencies, a tied head's lm_head.weight dropped); the
        MTP weights and the zero experts' unused rows dropped; upstream mlx-lm's
        embed_q / unembed_out (float or quantized) joined back into kv_b_proj; per-expert
        or fused experts -> stacked `mlp.switch_mlp`. Each rewrite consumes or is guarded by the
        keys and shapes it changes, so ours (and a second call) pass unchanged."""
        weights = {k: v for k, v in super().sanitize(weights).items() if not k.startswith("model.mtp.")}
        weights = drop_zero_expert_weights(weights, self.args.n_routed_experts)
        weights = join_absorbed_kv_b_proj(weights, self.args.qk_nope_head_dim, self.args.kv_lora_rank)
        return split_fused_experts(stack_expert_weights(weights))

    def quant_predicate(self, path: str, module: nn.Module) -> Union[bool, Dict[str, int]]:
        """kv_b_proj is read as a matrix (absorbed into the latent attention) and the
        router classifier runs in fp32 (transformers keeps it so): both stay float."""
        return not path.endswith(("kv_b_proj", "router.classifier"))

    def make_cache(self) -> List[CacheList]:
        return [CacheList(KVCache(), KVCache()) for _ in self.layers]

    def shard(self, group: Optional[mx.distributed.Group] = None) -> None:
        """Tensor parallel over `group` (default: the global group), in place: both MLA
        blocks by heads (a rank's latent caches are whole), the dense MLPs by hidden
        units, the experts by hidden units with one sum for the MoE. Embeddings,
        lm_head, norms and the router stay whole."""
        group = sharding.world(group)
        for layer in self.layers:
            for attn, mlp in zip(layer.self_attn, layer.mlps):
                attn.shard(group)
                sharding.shard_mlp(mlp, group)
            layer.mlp.shard(group)
