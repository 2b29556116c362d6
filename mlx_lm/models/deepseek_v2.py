"""DeepSeek-V2 (`deepseek_v2`, DeepseekV2ForCausalLM: deepseek-ai/DeepSeek-V2, -V2-Lite,
-V2.5, DeepSeek-Coder-V2): llama's pre-norm block with multi-head latent attention
(mla.py) and a mixture of routed plus shared experts.

What differs from llama:
- Attention is MLA: queries from `q_proj` (V2-Lite: q_lora_rank null) or the q LoRA
  (`q_a_proj`, `q_a_layernorm`, `q_b_proj`); keys and values from one latent per token
  (`kv_a_proj_with_mqa`, `kv_a_layernorm`, `kv_b_proj`). Rope turns only the last
  qk_rope_head_dim features of each query head and the one rope key all heads share,
  in interleaved pairs (x[2i], x[2i+1]) (transformers' complex rotation), at
  rope_theta with yarn scaling when the config has it (the rotated features times
  get_mscale(f, mscale) / get_mscale(f, mscale_all_dim)); the softmax scale is
  (dn + dr)^-1/2 times get_mscale(f, mscale_all_dim)^2 (mla.softmax_scale).
- The cache holds the latent and the rotated rope key (a KVCache of one "head" of
  kv_lora_rank and qk_rope_head_dim features), not per-head keys and values.
- Layers from `first_k_dense_replace` on (and, with `moe_layer_freq` k, only every
  k-th: the original DeepSeek code's rule; transformers 5.24 does not read the key,
  and every released config has 1, where the two agree) are MoE: a softmax router
  (`gate`, weight (E, H), in fp32) picks `num_experts_per_tok` experts by probability,
  `topk_method` "greedy" over all of them or "group_limited_greedy" within the
  `topk_group` of `n_group` groups whose best probability is highest; the chosen
  probabilities (never renormalised: transformers ignores `norm_topk_prob`, so True is
  refused) times `routed_scaling_factor` weight the experts. Plus `shared_experts`,
  one SwiGLU of n_shared_experts * moe_intermediate_size. Other layers are a SwiGLU of
  intermediate_size; `mlp_bias` gives the dense and shared SwiGLUs biases (experts
  never have them).
Config dialects: the hub's top-level `rope_theta` and `rope_scaling` ({"type": "yarn",
...}) or transformers 5's `rope_parameters`. Weights: per expert as saved
(`mlp.experts.{e}.{gate,up,down}_proj.weight`), fused as transformers 5 holds them in
memory (`mlp.experts.gate_up_proj`), or ours (`mlp.switch_mlp.*`, upstream mlx-lm's
names too).
Reference: transformers `models/deepseek_v2/modeling_deepseek_v2.py`,
`configuration_deepseek_v2.py`.
"""

from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Tuple, Union

import mlx.core as mx
import mlx.nn as nn

from . import llama, pipeline, sharding
from .base import BaseModelArgs, run_hybrid_layers
from .cache import KVCache
from .llama import MLP
from .mixtral import check_top_k
from .mla import LatentAttention, softmax_scale
from .qwen3_next import split_fused_experts, stack_expert_weights
from .rope_utils import initialize_rope, resolve_rope
from .switch_layers import SwitchGLU

GREEDY, GROUP_LIMITED = "greedy", "group_limited_greedy"


@dataclass
class ModelArgs(BaseModelArgs):
    """DeepseekV2Config's keys, with its defaults (plus the hub's moe_layer_freq and
    scoring_func)."""

    model_type: str
    vocab_size: int = 102400
    hidden_size: int = 4096
    intermediate_size: int = 11008
    moe_intermediate_size: int = 1407
    num_hidden_layers: int = 32
    num_attention_heads: int = 32
    num_key_value_heads: Optional[int] = None
    n_shared_experts: int = 2
    n_routed_experts: int = 64
    num_experts_per_tok: Optional[int] = None
    routed_scaling_factor: float = 1.0
    topk_method: Optional[str] = GREEDY
    n_group: Optional[int] = None
    topk_group: Optional[int] = None
    norm_topk_prob: bool = False
    scoring_func: str = "softmax"
    first_k_dense_replace: int = 0
    moe_layer_freq: int = 1
    kv_lora_rank: int = 512
    q_lora_rank: Optional[int] = 1536
    qk_nope_head_dim: int = 128
    qk_rope_head_dim: int = 64
    v_head_dim: int = 128
    hidden_act: str = "silu"
    max_position_embeddings: int = 2048
    rms_norm_eps: float = 1e-6
    rope_theta: Optional[float] = None
    rope_scaling: Optional[Dict[str, Any]] = None
    rope_parameters: Optional[Dict[str, Any]] = None
    attention_bias: bool = False
    mlp_bias: bool = False
    tie_word_embeddings: bool = False

    scoring = "softmax"  # the only scoring_func this family's router has

    def __post_init__(self):
        if self.num_key_value_heads is None:
            self.num_key_value_heads = self.num_attention_heads
        theta, self.rope_scaling, partial = resolve_rope(self.rope_theta, self.rope_scaling, self.rope_parameters)
        self.rope_theta = 10000.0 if theta is None else theta
        if partial not in (None, 1.0):
            raise ValueError(f"partial_rotary_factor {partial!r} is not supported: rope turns all "
                             f"qk_rope_head_dim ({self.qk_rope_head_dim}) features")
        self._validate_attention()
        self._validate_router()

    def _validate_attention(self):
        if self.num_key_value_heads != self.num_attention_heads:
            raise ValueError(f"num_key_value_heads ({self.num_key_value_heads}) must equal num_attention_heads "
                             f"({self.num_attention_heads}): kv_b_proj makes keys and values for every head")
        if self.qk_rope_head_dim % 2:
            raise ValueError(f"qk_rope_head_dim ({self.qk_rope_head_dim}) must be even: rope turns pairs")
        if self.hidden_act != "silu":
            raise ValueError(f"hidden_act {self.hidden_act!r} is not supported; this family uses 'silu'")
        if self.moe_layer_freq < 1:
            raise ValueError(f"moe_layer_freq ({self.moe_layer_freq}) must be >= 1")

    def _validate_top_k(self):
        if self.num_experts_per_tok is None:
            raise ValueError(f"{self.model_type} configs must give num_experts_per_tok (transformers has no default)")
        check_top_k(self.num_experts_per_tok, self.n_routed_experts, "n_routed_experts")
        if self.scoring_func != self.scoring:
            raise ValueError(f"scoring_func {self.scoring_func!r} is not supported; {self.model_type} scores "
                             f"experts by {self.scoring!r}")

    def _validate_router(self):
        self._validate_top_k()
        if self.topk_method not in (GREEDY, GROUP_LIMITED):
            raise ValueError(f"topk_method {self.topk_method!r} is not supported; use {GREEDY!r} or {GROUP_LIMITED!r}")
        if self.norm_topk_prob:
            raise ValueError("norm_topk_prob True is not supported: transformers' DeepseekV2 router never "
                             "renormalises (every released config has False)")
        if self.topk_method == GROUP_LIMITED:
            check_groups(self.n_routed_experts, self.n_group, self.topk_group)

    @property
    def rope_traditional(self) -> bool:
        """Interleaved pairs (2i, 2i + 1), as transformers' complex rotation."""
        return True

    def is_moe_layer(self, layer_idx: int) -> bool:
        return layer_idx >= self.first_k_dense_replace and layer_idx % self.moe_layer_freq == 0


def check_groups(num_experts: int, n_group: Optional[int], topk_group: Optional[int]) -> None:
    """Group-limited routing: n_group divides the experts, 1 <= topk_group <= n_group."""
    if not (isinstance(n_group, int) and n_group >= 1 and num_experts % n_group == 0):
        raise ValueError(f"n_group ({n_group!r}) must divide n_routed_experts ({num_experts})")
    if not (isinstance(topk_group, int) and 1 <= topk_group <= n_group):
        raise ValueError(f"topk_group ({topk_group!r}) must be in 1..n_group ({n_group})")


def softmax_route(logits: mx.array, top_k: int, num_groups: Optional[int], top_groups: Optional[int],
                  scaling: float) -> Tuple[mx.array, mx.array]:
    """DeepSeek-V2's router: logits (..., E) -> expert ids (..., k) and weights (..., k), fp32.

    p = softmax(logits); with groups (num_groups, top_groups set: group_limited_greedy)
    only the experts of the `top_groups` groups whose largest p is highest stay, the
    others' p set to 0 (transformers' masked_fill); the k largest remaining p weight
    their experts, times `scaling`."""
    scores = mx.softmax(logits.astype(mx.float32), axis=-1, precise=True)
    if num_groups is not None and top_groups < num_groups:
        grouped = scores.reshape(*scores.shape[:-1], num_groups, -1)  # (..., groups, E / groups)
        best = mx.argpartition(-grouped.max(axis=-1), kth=top_groups - 1, axis=-1)[..., :top_groups]
        keep = mx.put_along_axis(mx.zeros(grouped.shape[:-1]), best, mx.array(1.0), axis=-1) > 0
        scores = mx.where(keep[..., None], grouped, 0.0).reshape(scores.shape)
    experts = mx.stop_gradient(mx.argpartition(-scores, kth=top_k - 1, axis=-1)[..., :top_k])
    return experts, mx.take_along_axis(scores, experts, axis=-1) * scaling


class Router(nn.Module):
    """The router's weight (E, H): not a Linear, so quantization leaves it float."""

    def __init__(self, dim: int, num_experts: int):
        super().__init__()
        self.weight = mx.zeros((num_experts, dim))


class MoE(nn.Module):
    """Routed experts (`switch_mlp`) weighted by the router, plus the shared experts."""

    def __init__(self, args: ModelArgs):
        super().__init__()
        self.args = args
        self.gate = self.make_router(args)
        self.switch_mlp = SwitchGLU(args.hidden_size, args.moe_intermediate_size, args.n_routed_experts)
        if args.n_shared_experts:
            self.shared_experts = MLP(args.hidden_size, args.moe_intermediate_size * args.n_shared_experts,
                                      bias=args.mlp_bias)

    @staticmethod
    def make_router(args: ModelArgs) -> nn.Module:
        return Router(args.hidden_size, args.n_routed_experts)

    def route(self, logits: mx.array) -> Tuple[mx.array, mx.array]:
        a = self.args
        groups = (a.n_group, a.topk_group) if a.topk_method == GROUP_LIMITED else (None, None)
        return softmax_route(logits, a.num_experts_per_tok, *groups, a.routed_scaling_factor)

    def __call__(self, x: mx.array) -> mx.array:
        logits = x.astype(mx.float32) @ self.gate.weight.astype(mx.float32).T  # (B, L, E), fp32 as transformers
        experts, weights = self.route(logits)  # (B, L, k)
        routed = (self.switch_mlp(x, experts) * weights[..., None].astype(x.dtype)).sum(axis=-2)  # (B, L, hidden)
        return routed + self.shared_experts(x) if "shared_experts" in self else routed

    def shard(self, group: mx.distributed.Group) -> None:
        """Every routed and shared expert's hidden units split; the block all-sums once."""
        if "shared_experts" in self:
            sharding.shard_mlp(self.shared_experts, group, reduce=False)
        sharding.shard_moe(self, self.switch_mlp, group)


def make_attention(args: ModelArgs) -> LatentAttention:
    """MLA with rope on the qk_rope_head_dim features and the yarn-aware softmax scale."""
    rope = initialize_rope(args.qk_rope_head_dim, args.rope_theta, args.rope_traditional, args.rope_scaling,
                           args.max_position_embeddings)
    return LatentAttention(args, rope, softmax_scale(args.qk_nope_head_dim + args.qk_rope_head_dim, args.rope_scaling))


class DecoderLayer(nn.Module):
    """Pre-norm: x + mla(norm(x)), then + mlp(norm(.)) (`mlp` a SwiGLU or a MoE)."""

    def __init__(self, args: ModelArgs, mlp: nn.Module):
        super().__init__()
        self.self_attn = make_attention(args)
        self.mlp = mlp
        self.input_layernorm = nn.RMSNorm(args.hidden_size, eps=args.rms_norm_eps)
        self.post_attention_layernorm = nn.RMSNorm(args.hidden_size, eps=args.rms_norm_eps)

    def __call__(self, x: mx.array, mask=None, cache: Optional[KVCache] = None) -> mx.array:
        h = x + self.self_attn(self.input_layernorm(x), mask, cache)
        return h + self.mlp(self.post_attention_layernorm(h))


class DeepseekV2Model(pipeline.PipelineMixin, nn.Module):
    moe_class = MoE  # deepseek_v3 swaps in its sigmoid router

    def __init__(self, args: ModelArgs):
        super().__init__()
        self.embed_tokens = nn.Embedding(args.vocab_size, args.hidden_size)
        self.layers = [DecoderLayer(args, self.make_mlp(args, i)) for i in range(args.num_hidden_layers)]
        self.norm = nn.RMSNorm(args.hidden_size, eps=args.rms_norm_eps)

    def make_mlp(self, args: ModelArgs, layer_idx: int) -> nn.Module:
        if args.is_moe_layer(layer_idx):
            return self.moe_class(args)
        return MLP(args.hidden_size, args.intermediate_size, bias=args.mlp_bias)

    def __call__(self, inputs: mx.array, cache: Optional[List[Any]] = None,
                 input_embeddings: Optional[mx.array] = None) -> mx.array:
        h = self.embed_tokens(inputs) if input_embeddings is None else input_embeddings  # (B, L, hidden)
        h = run_hybrid_layers(pipeline.receive(h, self.stage), self.layers, cache, 0)  # every layer attends: one mask
        return self.norm(pipeline.send_and_share(h, self.stage, cache))


class Model(llama.Model):
    """llama's LM head (tied or `lm_head`) over the MLA backbone."""

    # The latent caches are KVCaches, which trim by themselves; the layers record nothing.
    supports_speculative_rollback = True
    backbone_class = DeepseekV2Model

    def sanitize(self, weights: Dict[str, mx.array]) -> Dict[str, mx.array]:
        """llama's (rope buffers and a tied lm_head dropped); per-expert or fused
        experts -> `switch_mlp` (E, out, in). Each rewrite consumes the keys it reads,
        so our layout (a second call, MLX-converted checkpoints) passes unchanged."""
        return split_fused_experts(stack_expert_weights(super().sanitize(weights)))

    def quant_predicate(self, path: str, module: nn.Module) -> Union[bool, Dict[str, int]]:
        """kv_b_proj is read as a matrix (absorbed into the latent attention): float. The
        router is not a Linear, so it stays float by itself."""
        return not path.endswith("kv_b_proj")

    def make_cache(self) -> List[KVCache]:
        return [KVCache() for _ in self.layers]

    def shard(self, group: Optional[mx.distributed.Group] = None) -> None:
        """Tensor parallel over `group` (default: the global group), in place: MLA by
        heads (each rank's latent cache is whole), MLPs and experts by hidden units.
        Embeddings, lm_head, norms, the latent projections and routers stay whole."""
        group = sharding.world(group)
        for layer in self.layers:
            layer.self_attn.shard(group)
            if isinstance(layer.mlp, MoE):
                layer.mlp.shard(group)
            else:
                sharding.shard_mlp(layer.mlp, group)
