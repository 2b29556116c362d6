"""AFMoE (`afmoe`, AfmoeForCausalLM: Arcee's Trinity models, e.g. arcee-ai/Trinity-Mini).

What differs from llama:
- Sliding and global layers: `layer_types`, else every `global_attn_every_n_layers`-th
  layer (4) is global. A sliding layer's query sees its `sliding_window` most recent
  positions, itself included, cached in a `RotatingKVCache`. Only sliding layers rope;
  global layers have no positional encoding (NoPE).
- Attention: q and k are RMS-normalised per head (before rope), and the output is gated
  per feature by sigmoid(gate_proj(x)) before o_proj.
- Sandwich norms: h = x + post_attention_layernorm(attn(input_layernorm(x))), then
  h + post_mlp_layernorm(mlp(pre_mlp_layernorm(h))).
- muP input scaling (`mup_enabled`): the embeddings are multiplied by sqrt(hidden_size).
- The first `num_dense_layers` MLPs are dense SwiGLU; the rest are mixtures of experts:
  a sigmoid router whose choice adds `expert_bias` to the scores, weights the chosen
  unbiased scores renormalised (+1e-20) times `route_scale`, always, plus a shared
  SwiGLU expert of `num_shared_experts * moe_intermediate_size` units (none when 0).

Weights: checkpoints store one tensor per expert (`mlp.experts.{e}.{gate,up,down}_proj
.weight`), the router as `mlp.router.gate.weight` and the bias as `mlp.expert_bias`;
transformers' in-memory layout fuses the experts (`gate_up_proj`, `down_proj`).
Checkpoints converted by upstream mlx-lm use our names and load as they are.

Reference: transformers `models/afmoe/modeling_afmoe.py`, `configuration_afmoe.py`.
"""

from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Union

import mlx.core as mx
import mlx.nn as nn

from . import llama, sharding
from .base import BaseModelArgs, check_head_grouping, check_layer_types, check_sliding_window
from .base import scaled_dot_product_attention
from .llama import FULL, MLP, SLIDING
from .nemotron_h import route
from .rope_utils import initialize_rope, resolve_rope
from .switch_layers import SwitchGLU, split_fused_experts, stack_experts


@dataclass
class ModelArgs(BaseModelArgs):
    """AfmoeConfig's keys with its defaults, plus keys Trinity configs carry that
    transformers ignores (checked to mean what transformers does)."""

    model_type: str = "afmoe"
    vocab_size: int = 200192
    hidden_size: int = 2048
    intermediate_size: int = 6144
    moe_intermediate_size: int = 1408
    num_hidden_layers: int = 32
    num_dense_layers: int = 1
    num_attention_heads: int = 16
    num_key_value_heads: Optional[int] = None
    head_dim: int = 128
    hidden_act: str = "silu"
    max_position_embeddings: int = 16384
    rms_norm_eps: float = 1e-5
    tie_word_embeddings: bool = False
    rope_theta: Optional[float] = None  # transformers 4
    rope_scaling: Optional[Dict[str, Any]] = None  # transformers 4
    rope_parameters: Optional[Dict[str, Any]] = None  # transformers 5
    num_experts: int = 64
    num_experts_per_tok: int = 6
    num_shared_experts: int = 2
    route_scale: float = 1.0
    global_attn_every_n_layers: int = 4
    sliding_window: Optional[int] = 1024
    layer_types: Optional[List[str]] = None
    mup_enabled: bool = False
    attention_bias: bool = False
    score_func: str = "sigmoid"  # Trinity configs; transformers routes by sigmoid only
    route_norm: bool = True  # Trinity configs; transformers always renormalises
    n_group: int = 1  # Trinity configs; transformers has no group-limited routing
    topk_group: int = 1

    def __post_init__(self):
        if self.num_key_value_heads is None:
            self.num_key_value_heads = self.num_attention_heads
        check_head_grouping(self.num_attention_heads, self.num_key_value_heads)
        if self.layer_types is None:
            if not (isinstance(self.global_attn_every_n_layers, int) and self.global_attn_every_n_layers > 0):
                raise ValueError(f"global_attn_every_n_layers must be a positive int, got "
                                 f"{self.global_attn_every_n_layers!r}")
            every = self.global_attn_every_n_layers
            self.layer_types = [FULL if (i + 1) % every == 0 else SLIDING for i in range(self.num_hidden_layers)]
        check_layer_types(self.layer_types, self.num_hidden_layers, (SLIDING, FULL))
        check_sliding_window(self.layer_types, self.sliding_window)
        theta, self.rope_scaling, partial = resolve_rope(self.rope_theta, self.rope_scaling, self.rope_parameters)
        if partial not in (None, 1.0):
            raise ValueError(f"afmoe rotates whole heads; got partial_rotary_factor={partial}")
        self.rope_theta = 10000.0 if theta is None else theta
        self._validate_moe()

    def _validate_moe(self):
        if self.hidden_act != "silu":
            raise ValueError(f"hidden_act {self.hidden_act!r} is not supported; afmoe uses 'silu'")
        if self.score_func != "sigmoid":
            raise ValueError(f"score_func {self.score_func!r} is not supported; afmoe routes by 'sigmoid'")
        if not self.route_norm:
            raise ValueError("route_norm False is not supported: afmoe (as transformers) renormalises the "
                             "chosen experts' scores")
        if (self.n_group, self.topk_group) != (1, 1):
            raise ValueError(f"group-limited routing (n_group {self.n_group}, topk_group {self.topk_group}) is "
                             "not supported: afmoe (as transformers) chooses among all experts")
        if self.num_shared_experts < 0:
            raise ValueError(f"num_shared_experts must be >= 0, got {self.num_shared_experts}")
        if not 0 <= self.num_dense_layers <= self.num_hidden_layers:
            raise ValueError(f"num_dense_layers {self.num_dense_layers} is outside 0..{self.num_hidden_layers}")


class Attention(nn.Module):
    def __init__(self, args: ModelArgs, layer_type: str):
        super().__init__()
        dim, head_dim, bias = args.hidden_size, args.head_dim, args.attention_bias
        self.n_heads, self.n_kv_heads = args.num_attention_heads, args.num_key_value_heads
        self.scale = head_dim**-0.5
        self.q_proj = nn.Linear(dim, self.n_heads * head_dim, bias=bias)
        self.k_proj = nn.Linear(dim, self.n_kv_heads * head_dim, bias=bias)
        self.v_proj = nn.Linear(dim, self.n_kv_heads * head_dim, bias=bias)
        self.o_proj = nn.Linear(self.n_heads * head_dim, dim, bias=bias)
        self.gate_proj = nn.Linear(dim, self.n_heads * head_dim, bias=False)
        self.q_norm = nn.RMSNorm(head_dim, eps=args.rms_norm_eps)
        self.k_norm = nn.RMSNorm(head_dim, eps=args.rms_norm_eps)
        self.uses_rope = layer_type == SLIDING  # global layers are NoPE
        if self.uses_rope:
            self.rope = initialize_rope(head_dim, args.rope_theta, False, args.rope_scaling,
                                        args.max_position_embeddings)

    def __call__(self, x: mx.array, mask: Optional[mx.array] = None, cache=None) -> mx.array:
        B, L, _ = x.shape
        q = self.q_norm(self.q_proj(x).reshape(B, L, self.n_heads, -1)).transpose(0, 2, 1, 3)  # (B, H, L, D)
        k = self.k_norm(self.k_proj(x).reshape(B, L, self.n_kv_heads, -1)).transpose(0, 2, 1, 3)
        v = self.v_proj(x).reshape(B, L, self.n_kv_heads, -1).transpose(0, 2, 1, 3)  # (B, H_kv, L, D)
        if self.uses_rope:
            offset = cache.offset if cache is not None else 0
            q, k = self.rope(q, offset=offset), self.rope(k, offset=offset)
        if cache is not None:
            k, v = cache.update_and_fetch(k, v)  # (B, H_kv, S, D)
        out = scaled_dot_product_attention(q, k, v, cache=cache, scale=self.scale, mask=mask)
        out = out.transpose(0, 2, 1, 3).reshape(B, L, -1)  # (B, L, H * D)
        return self.o_proj(out * mx.sigmoid(self.gate_proj(x)))


class Router(nn.Module):
    """Holds the router's linear layer under the checkpoint's name (`router.gate`)."""

    def __init__(self, dim: int, num_experts: int):
        super().__init__()
        self.gate = nn.Linear(dim, num_experts, bias=False)


class MoE(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.top_k, self.route_scale = args.num_experts_per_tok, args.route_scale
        self.router = Router(args.hidden_size, args.num_experts)
        self.expert_bias = mx.zeros((args.num_experts,))
        self.experts = SwitchGLU(args.hidden_size, args.moe_intermediate_size, args.num_experts)
        self.has_shared = args.num_shared_experts > 0  # transformers' zero-unit MLP adds zeros
        if self.has_shared:
            self.shared_experts = MLP(args.hidden_size, args.moe_intermediate_size * args.num_shared_experts)

    def __call__(self, x: mx.array) -> mx.array:
        logits = self.router.gate(x).astype(mx.float32)  # (..., E)
        experts, weights = route(logits, self.expert_bias, self.top_k, 1, 1, True, self.route_scale)  # (..., k)
        y = self.experts(x, experts)  # (..., k, D)
        routed = (y * weights[..., None].astype(y.dtype)).sum(axis=-2)
        return self.shared_experts(x) + routed if self.has_shared else routed


class DecoderLayer(nn.Module):
    def __init__(self, args: ModelArgs, layer_type: str, sparse: bool):
        super().__init__()
        dim, eps = args.hidden_size, args.rms_norm_eps
        self.layer_type = layer_type
        self.self_attn = Attention(args, layer_type)
        self.mlp = MoE(args) if sparse else MLP(dim, args.intermediate_size)
        self.input_layernorm = nn.RMSNorm(dim, eps=eps)
        self.post_attention_layernorm = nn.RMSNorm(dim, eps=eps)
        self.pre_mlp_layernorm = nn.RMSNorm(dim, eps=eps)
        self.post_mlp_layernorm = nn.RMSNorm(dim, eps=eps)

    def __call__(self, x: mx.array, mask: Optional[mx.array] = None, cache=None) -> mx.array:
        h = x + self.post_attention_layernorm(self.self_attn(self.input_layernorm(x), mask, cache))
        return h + self.post_mlp_layernorm(self.mlp(self.pre_mlp_layernorm(h)))


class Backbone(llama.LlamaModel):
    """llama's forward (one mask per layer kind, final RMSNorm) over AFMoE's layers, with
    muP's input scaling."""

    def __init__(self, args: ModelArgs):
        nn.Module.__init__(self)  # llama's __init__ builds one block kind; ours are two
        self.sliding_window = args.sliding_window
        self.embed_tokens = nn.Embedding(args.vocab_size, args.hidden_size)
        self.layers = [DecoderLayer(args, kind, i >= args.num_dense_layers) for i, kind in enumerate(args.layer_types)]
        self.norm = nn.RMSNorm(args.hidden_size, eps=args.rms_norm_eps)
        self.embed_scale = args.hidden_size**0.5 if args.mup_enabled else 1.0

    def __call__(self, inputs: mx.array, cache: Optional[List[Any]] = None,
                 input_embeddings: Optional[mx.array] = None) -> mx.array:
        h = self.embed_tokens(inputs) if input_embeddings is None else input_embeddings  # (B, L, hidden)
        return super().__call__(inputs, cache, h * self.embed_scale)  # transformers scales given embeddings too


class Model(llama.Model):
    """llama's LM head (tied or `lm_head`) and caches (RotatingKVCache for sliding
    layers, KVCache for global ones) over AFMoE's backbone."""

    # Both cache kinds roll back by themselves; the layers record nothing.
    supports_speculative_rollback = True
    backbone_class = Backbone

    def sanitize(self, weights: Dict[str, mx.array]) -> Dict[str, mx.array]:
        """Per-expert or fused experts -> our stacks (llama's drops rope buffers and a
        tied `lm_head`); each rewrite consumes the keys it reads, so our own layout (a
        second call, MLX-converted checkpoints) passes unchanged."""
        return split_fused_experts(stack_experts(super().sanitize(weights)))

    def quant_predicate(self, path: str, module: nn.Module) -> Union[bool, Dict[str, int]]:
        # The router is small and its top-k choice flips on small logit errors: 8 bits.
        if path.endswith("mlp.router.gate"):
            return {"group_size": 64, "bits": 8}
        return True

    def shard(self, group: Optional[mx.distributed.Group] = None) -> None:
        """Tensor parallel over `group` (default: the global group), in place: each rank
        keeps its share of the heads (q/k/v, the output gate's features, o_proj's
        columns), of the dense and shared MLPs' units and of every expert's units; the
        per-head q/k norms, routers, embeddings and lm_head stay whole, so routing is the
        same on every rank."""
        group = sharding.world(group)
        for layer in self.layers:
            attn = layer.self_attn
            attn.n_heads, attn.n_kv_heads = sharding.shard_attention(
                attn, attn.n_heads, attn.n_kv_heads, group, qkv=("q_proj", "k_proj", "v_proj", "gate_proj"))
            if isinstance(layer.mlp, MoE):
                if layer.mlp.has_shared:
                    sharding.shard_mlp(layer.mlp.shared_experts, group, reduce=False)
                sharding.shard_moe(layer.mlp, layer.mlp.experts, group)
            else:
                sharding.shard_mlp(layer.mlp, group)
