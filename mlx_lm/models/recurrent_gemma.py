"""RecurrentGemma (Griffin): RG-LRU recurrent blocks and local sliding-window attention
in a repeating pattern, with Gemma's norms, embedding scale and GeGLU MLP.

What differs from llama:
- Each residual block is temporal_pre_norm -> temporal block -> residual, then
  channel_pre_norm -> MLP -> residual. The temporal block follows `block_types`
  (default recurrent, recurrent, attention), repeated over the layers (transformers 5
  names the kinds "linear_attention" / "sliding_attention" in its `layers_block_type`).
- Recurrent blocks: linear_y -> gelu; linear_x -> a depthwise causal conv1d of
  `conv1d_width` taps (with bias) -> the RG-LRU (`rg_lru.py`: per-head block-diagonal
  input and recurrence gates, a = exp(-8 gate_a softplus(Lambda)), input scaled by
  sqrt(1 - a^2) except at position 0, where the state resets); their product ->
  linear_out. Every linear has a bias. Their cache is an `ArraysCache(2)`: the last
  K-1 conv inputs and the RG-LRU state h (fp32). While it speculates, each block
  records its pre-forward states and per-token recurrence inputs (conv input, a, b); a
  rollback to m tokens replays the prefix (`rg_lru.state_after`), bit for bit what the
  verify forward had at m.
- Attention is local: every attention layer sees its `attention_window_size` most
  recent positions, itself included, and caches in a `RotatingKVCache` of that size.
  Rope turns only the first `partial_rotary_factor` (default 0.5) of each head; scores
  are scaled by head_dim^-1/2; o_proj always has a bias, q/k/v only with
  `attention_bias`. head_dim is hidden_size / num_attention_heads.
- RMSNorms are zero-centred, x_hat * (1 + w) in fp32 (gemma3.rms_norm); the MLP is
  GeGLU (tanh gelu, biases) of width intermediate_size / 2; embeddings are scaled by
  sqrt(hidden_size) rounded to bfloat16 (transformers keeps that factor as a bf16
  buffer: sqrt(2560) = 50.596 scales by 50.5 even in fp32); logits are soft-capped,
  c * tanh(logits / c), c = `logits_soft_cap`; lm_head is tied by default.
- transformers' cached multi-token forward restarts the conv from zeros; ours continues
  from the cached conv inputs, so a chunked decode equals the full forward (which is
  what the reference logits come from).
Config dialects: the hub checkpoints (transformers 4.40) write top-level `rope_theta`
and `partial_rotary_factor` and name the pattern `_block_types`; transformers 5 writes
`rope_parameters` holding both and `block_types` (and ignores `_block_types`: a hub
pattern other than the default would be lost there; we read it).
Reference: transformers `models/recurrent_gemma/modeling_recurrent_gemma.py` and
`configuration_recurrent_gemma.py`.
"""

import math
from dataclasses import dataclass
from functools import partial
from typing import Any, Dict, List, Optional, Sequence, Union

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
from .cache import ArraysCache, RotatingKVCache
from .gemma3 import RMSNorm, softcap
from .lfm2 import same_value
from .rg_lru import block_diagonal_linear, linear_scan, rg_lru_inputs, state_after
from .ssm import causal_conv1d, conv_state_after

RECURRENT, ATTENTION = "linear_attention", "sliding_attention"  # transformers 5's layer kinds
BLOCK_KINDS = {"recurrent": RECURRENT, "attention": ATTENTION}  # block_types' names for them
DEFAULT_BLOCK_TYPES = ("recurrent", "recurrent", "attention")
DEFAULT_ROPE_THETA, DEFAULT_PARTIAL_ROTARY_FACTOR = 10_000.0, 0.5  # transformers' defaults
CONV_STATE, LRU_STATE = 0, 1  # slots of a recurrent block's ArraysCache


@dataclass
class ModelArgs(BaseModelArgs):
    """RecurrentGemmaConfig's keys, with its defaults (recurrentgemma-2b)."""

    model_type: str = "recurrent_gemma"
    vocab_size: int = 256000
    hidden_size: int = 2560
    intermediate_size: int = 3 * 2560
    num_hidden_layers: int = 26
    num_attention_heads: int = 10
    num_key_value_heads: Optional[int] = None  # default: num_attention_heads
    head_dim: Optional[int] = None  # always hidden_size / num_attention_heads
    lru_width: Optional[int] = None  # default: hidden_size
    attention_window_size: int = 2048
    sliding_window: Optional[int] = None  # transformers' alias of attention_window_size
    conv1d_width: int = 4
    logits_soft_cap: float = 30.0
    rms_norm_eps: float = 1e-6
    hidden_activation: str = "gelu_pytorch_tanh"
    rope_theta: Optional[float] = None  # transformers 4
    partial_rotary_factor: Optional[float] = None  # transformers 4
    rope_scaling: Optional[Dict[str, Any]] = None
    rope_parameters: Optional[Dict[str, Any]] = None  # transformers 5
    block_types: Optional[List[str]] = None  # default DEFAULT_BLOCK_TYPES
    _block_types: Optional[List[str]] = None  # the hub checkpoints' name for block_types
    layer_types: Optional[List[str]] = None  # one kind per layer; wins over block_types
    attention_bias: bool = False
    tie_word_embeddings: bool = True
    embeddings_scale_by_sqrt_dim: bool = True  # transformers 4.40 configs; 5 always scales

    def __post_init__(self):
        self.lru_width = self.hidden_size if self.lru_width is None else self.lru_width
        if self.num_key_value_heads is None:
            self.num_key_value_heads = self.num_attention_heads
        self.attention_window_size, self.sliding_window = same_value(
            "attention_window_size", self.attention_window_size, "sliding_window", self.sliding_window
        )
        self._resolve_head_dim()
        self._resolve_rope()
        self._normalise_layer_pattern()
        self._validate()

    def _resolve_head_dim(self):
        if self.hidden_size % self.num_attention_heads:
            raise ValueError(
                f"hidden_size {self.hidden_size} is not a multiple of num_attention_heads {self.num_attention_heads}"
            )
        head_dim = self.hidden_size // self.num_attention_heads
        if self.head_dim is not None and self.head_dim != head_dim:
            raise ValueError(
                f"head_dim {self.head_dim} != hidden_size / num_attention_heads = {head_dim}; recurrent_gemma "
                "always uses the latter (as transformers), remove head_dim"
            )
        self.head_dim = head_dim

    def _resolve_rope(self):
        """rope_theta and partial_rotary_factor from either dialect; only plain rope."""
        params = self.rope_parameters or {}
        if params.get("rope_type", "default") != "default" or self.rope_scaling is not None:
            raise ValueError(
                f"recurrent_gemma supports only default rope, got rope_parameters={self.rope_parameters!r}, "
                f"rope_scaling={self.rope_scaling!r}"
            )
        self.rope_theta, _ = same_value("rope_theta", self.rope_theta,
                                        "rope_parameters['rope_theta']", params.get("rope_theta"))
        if self.rope_theta is None:
            self.rope_theta = DEFAULT_ROPE_THETA
        self.partial_rotary_factor, _ = same_value(
            "partial_rotary_factor", self.partial_rotary_factor,
            "rope_parameters['partial_rotary_factor']", params.get("partial_rotary_factor"),
        )
        if self.partial_rotary_factor is None:
            self.partial_rotary_factor = DEFAULT_PARTIAL_ROTARY_FACTOR

    def _normalise_layer_pattern(self):
        """layer_types as given, else block_types (default: recurrent, recurrent,
        attention) repeated over the layers; both given must agree."""
        self.block_types, self._block_types = same_value(
            "block_types", self.block_types, "_block_types", self._block_types
        )
        if self.block_types is not None and (not self.block_types or set(self.block_types) - set(BLOCK_KINDS)):
            raise ValueError(f"block_types {self.block_types!r}: give a non-empty list of {list(BLOCK_KINDS)}")
        if self.layer_types is None:
            if self.block_types is None:
                self.block_types = self._block_types = list(DEFAULT_BLOCK_TYPES)
            self.layer_types = self._repeated(self.block_types)
        check_layer_types(self.layer_types, self.num_hidden_layers, (RECURRENT, ATTENTION))
        if self.block_types is not None and self.layer_types != self._repeated(self.block_types):
            raise ValueError(
                f"layer_types {self.layer_types} disagrees with block_types {self.block_types} repeated over "
                f"{self.num_hidden_layers} layers; remove one of them"
            )

    def _repeated(self, block_types: Sequence[str]) -> List[str]:
        return [BLOCK_KINDS[block_types[i % len(block_types)]] for i in range(self.num_hidden_layers)]

    def _validate(self):
        check_head_grouping(self.num_attention_heads, self.num_key_value_heads)
        if self.lru_width % self.num_attention_heads:
            raise ValueError(
                f"lru_width {self.lru_width} is not a multiple of num_attention_heads {self.num_attention_heads} "
                "(the RG-LRU gates are per-head blocks)"
            )
        # K = 1 would leave no conv state, and make the HF (C, 1, K) and MLX (C, K, 1)
        # conv layouts indistinguishable, which sanitize relies on.
        if self.conv1d_width < 2:
            raise ValueError(f"conv1d_width must be >= 2, got {self.conv1d_width}")
        if self.attention_window_size < 1:
            raise ValueError(f"attention_window_size must be >= 1, got {self.attention_window_size}")
        if self.rotary_dims % 2 or not 0 < self.partial_rotary_factor <= 1:
            raise ValueError(
                f"partial_rotary_factor {self.partial_rotary_factor} of head_dim {self.head_dim} must turn an even, "
                f"positive number of dims (got {self.rotary_dims})"
            )
        if not self.logits_soft_cap or self.logits_soft_cap <= 0:
            raise ValueError(f"logits_soft_cap must be a positive number, got {self.logits_soft_cap!r}")
        if self.hidden_activation != "gelu_pytorch_tanh":
            raise ValueError(
                f"hidden_activation {self.hidden_activation!r} is not supported; recurrent_gemma uses "
                "'gelu_pytorch_tanh'"
            )
        if not self.embeddings_scale_by_sqrt_dim:
            raise ValueError(
                "embeddings_scale_by_sqrt_dim=False is not supported: transformers always scales the "
                "embeddings by sqrt(hidden_size); remove the key"
            )

    @property
    def rotary_dims(self) -> int:
        return int(self.head_dim * self.partial_rotary_factor)


def scale_embeddings(h: mx.array, hidden_size: int) -> mx.array:
    """h * sqrt(hidden_size), (..., D) -> (..., D), the factor rounded to bfloat16 first
    (transformers' `normalizer` buffer is bf16), then to h's dtype."""
    return h * mx.array(math.sqrt(hidden_size), dtype=mx.bfloat16).astype(h.dtype)


def replay_prefix(conv_input: mx.array, a: mx.array, b: mx.array, state: Optional[mx.array], kernel_size: int,
                  m: Union[int, Sequence[int]]) -> List[mx.array]:
    """A recurrent block's cache entries after only the first m tokens of a recorded
    forward (m a list: row i after its own m[i], in one replay): the conv state is rows
    [m, m+K-1) of the conv input (B, K-1+T, W), the RG-LRU state the scan of the first
    m of the recorded a, b (B, T, W) from the pre-forward `state`. [conv, lru] states."""
    return [conv_state_after(conv_input, m, kernel_size), state_after(a, b, state, m)]


class RGLRU(nn.Module):
    """The RG-LRU's parameters and its per-token inputs (a, b) from the conv output."""

    def __init__(self, width: int, num_heads: int):
        super().__init__()
        block = width // num_heads
        self.recurrent_param = mx.zeros((width,))
        self.input_gate_weight = mx.zeros((num_heads, block, block))
        self.input_gate_bias = mx.zeros((num_heads, block))
        self.recurrent_gate_weight = mx.zeros((num_heads, block, block))
        self.recurrent_gate_bias = mx.zeros((num_heads, block))

    def inputs(self, x: mx.array, starts_sequence: bool):
        """x (B, T, W) -> the recurrence's a, b (B, T, W)."""
        gate_x = block_diagonal_linear(x, self.input_gate_weight, self.input_gate_bias)
        gate_a = block_diagonal_linear(x, self.recurrent_gate_weight, self.recurrent_gate_bias)
        return rg_lru_inputs(x, gate_x, gate_a, self.recurrent_param, starts_sequence)


class RecurrentBlock(nn.Module):
    """linear_out(gelu(linear_y(h)) * rg_lru(conv_1d(linear_x(h))))."""

    def __init__(self, args: ModelArgs):
        super().__init__()
        width, self.kernel_size = args.lru_width, args.conv1d_width
        self.linear_y = nn.Linear(args.hidden_size, width)
        self.linear_x = nn.Linear(args.hidden_size, width)
        self.linear_out = nn.Linear(width, args.hidden_size)
        self.conv_1d = nn.Conv1d(width, width, self.kernel_size, groups=width, bias=True)  # weight (W, K, 1)
        self.rg_lru = RGLRU(width, args.num_attention_heads)

    def conv_input(self, rows: mx.array, cache: Optional[ArraysCache]) -> mx.array:
        """[conv state ; new rows]: (B, K-1+T, W); zeros before a sequence's first token,
        as transformers' left padding of the conv."""
        state = None if cache is None else cache[CONV_STATE]
        if state is None:
            state = mx.zeros((rows.shape[0], self.kernel_size - 1, rows.shape[2]), rows.dtype)
        return mx.concatenate([state, rows], axis=1)

    def __call__(self, h: mx.array, cache: Optional[ArraysCache] = None) -> mx.array:
        T = h.shape[1]
        y = nn.gelu_approx(self.linear_y(h))  # (B, T, W)
        conv_input = self.conv_input(self.linear_x(h), cache)  # (B, K-1+T, W)
        x = causal_conv1d(conv_input, self.conv_1d.weight, self.conv_1d.bias)  # (B, T, W)
        state = None if cache is None else cache[LRU_STATE]
        a, b = self.rg_lru.inputs(x, starts_sequence=state is None)
        hs, new_state = linear_scan(a, b, state)  # (B, T, W), (B, W) fp32
        if cache is not None:
            if cache.speculating:
                replay = partial(replay_prefix, conv_input, a, b, state, self.kernel_size)
                cache.record_rollback(T, replay, [cache[CONV_STATE], state])
            cache[CONV_STATE] = conv_state_after(conv_input, T, self.kernel_size)
            cache[LRU_STATE] = new_state
        return self.linear_out(hs.astype(h.dtype) * y)


class Attention(nn.Module):
    """Local multi-query / grouped attention; rope on the first rotary_dims of a head."""

    def __init__(self, args: ModelArgs):
        super().__init__()
        dim, head_dim, bias = args.hidden_size, args.head_dim, args.attention_bias
        self.num_heads, self.num_kv_heads = args.num_attention_heads, args.num_key_value_heads
        self.scale = head_dim**-0.5
        self.q_proj = nn.Linear(dim, self.num_heads * head_dim, bias=bias)
        self.k_proj = nn.Linear(dim, self.num_kv_heads * head_dim, bias=bias)
        self.v_proj = nn.Linear(dim, self.num_kv_heads * head_dim, bias=bias)
        self.o_proj = nn.Linear(self.num_heads * head_dim, dim, bias=True)
        self.rope = nn.RoPE(args.rotary_dims, traditional=False, base=args.rope_theta)

    def __call__(self, x: mx.array, mask=None, cache: Optional[RotatingKVCache] = None) -> mx.array:
        B, L, _ = x.shape
        q = self.q_proj(x).reshape(B, L, self.num_heads, -1).transpose(0, 2, 1, 3)  # (B, H, L, D)
        k = self.k_proj(x).reshape(B, L, self.num_kv_heads, -1).transpose(0, 2, 1, 3)  # (B, H_kv, L, D)
        v = self.v_proj(x).reshape(B, L, self.num_kv_heads, -1).transpose(0, 2, 1, 3)
        offset = cache.offset if cache is not None else 0
        q, k = self.rope(q, offset=offset), self.rope(k, offset=offset)
        if cache is not None:
            k, v = cache.update_and_fetch(k, v)  # (B, H_kv, S, D)
        out = scaled_dot_product_attention(q, k, v, cache=cache, scale=self.scale, mask=mask)
        return self.o_proj(out.transpose(0, 2, 1, 3).reshape(B, L, -1))


class MLP(nn.Module):
    def __init__(self, dim: int, hidden_dim: int):
        super().__init__()
        self.gate_proj = nn.Linear(dim, hidden_dim)
        self.up_proj = nn.Linear(dim, hidden_dim)
        self.down_proj = nn.Linear(hidden_dim, dim)

    def __call__(self, x: mx.array) -> mx.array:
        # gelu_pytorch_tanh: mx's gelu_approx.
        return self.down_proj(nn.gelu_approx(self.gate_proj(x)) * self.up_proj(x))


class ResidualBlock(nn.Module):
    def __init__(self, args: ModelArgs, layer_type: str):
        super().__init__()
        self.layer_type = layer_type
        self.temporal_pre_norm = RMSNorm(args.hidden_size, args.rms_norm_eps)
        self.temporal_block = Attention(args) if layer_type == ATTENTION else RecurrentBlock(args)
        self.channel_pre_norm = RMSNorm(args.hidden_size, args.rms_norm_eps)
        self.mlp_block = MLP(args.hidden_size, args.intermediate_size // 2)

    def __call__(self, x: mx.array, mask=None, cache=None) -> mx.array:
        h = self.temporal_pre_norm(x)
        if self.layer_type == ATTENTION:
            h = x + self.temporal_block(h, mask, cache)
        else:
            h = x + self.temporal_block(h, cache)
        return h + self.mlp_block(self.channel_pre_norm(h))


class Backbone(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.hidden_size, self.window = args.hidden_size, args.attention_window_size
        self.embed_tokens = nn.Embedding(args.vocab_size, args.hidden_size)
        self.layers = [ResidualBlock(args, kind) for kind in args.layer_types]
        self.final_norm = RMSNorm(args.hidden_size, args.rms_norm_eps)
        # Attention layers share one mask, made from the first one's cache.
        self.first_attention = args.layer_types.index(ATTENTION) if ATTENTION in args.layer_types else None

    def __call__(self, inputs: mx.array, cache: Optional[List[Any]] = None) -> mx.array:
        h = scale_embeddings(self.embed_tokens(inputs), self.hidden_size)  # (B, L, hidden)
        if cache is None:
            cache = [None] * len(self.layers)
        mask = None
        if self.first_attention is not None:
            mask = create_attention_mask(h, cache[self.first_attention], window_size=self.window)
        for layer, layer_cache in zip(self.layers, cache):
            h = layer(h, mask, layer_cache)
        return self.final_norm(h)


class Model(nn.Module):
    # Recurrent blocks record rollbacks into their ArraysCache while speculating; the
    # attention layers' RotatingKVCaches record the rows they overwrite.
    supports_speculative_rollback = True

    def __init__(self, args: ModelArgs):
        super().__init__()
        self.args = args
        self.model_type = args.model_type
        self.model = Backbone(args)
        if not args.tie_word_embeddings:
            self.lm_head = nn.Linear(args.hidden_size, args.vocab_size, bias=False)

    def __call__(self, inputs: mx.array, cache: Optional[List[Any]] = None) -> mx.array:
        """Token ids (B, L) -> soft-capped logits (B, L, vocab)."""
        h = self.model(inputs, cache)
        logits = self.model.embed_tokens.as_linear(h) if self.args.tie_word_embeddings else self.lm_head(h)
        return softcap(logits, self.args.logits_soft_cap)

    def sanitize(self, weights: Dict[str, mx.array]) -> Dict[str, mx.array]:
        """Raw transformers or converted weights -> ours. Each rewrite is guarded by what
        it changes, so a second pass changes nothing: rope buffers and a tied lm_head are
        dropped; the conv weight is transposed only while it has the HF (W, 1, K) shape
        (ours is (W, K, 1), K >= 2)."""
        weights = {k: v for k, v in weights.items() if "rotary_emb." not in k}
        if self.args.tie_word_embeddings:
            weights.pop("lm_head.weight", None)
        for key, value in weights.items():
            if key.endswith("conv_1d.weight") and value.shape[1] == 1 and value.shape[2] > 1:
                weights[key] = value.swapaxes(1, 2)  # (W, 1, K) -> (W, K, 1)
        return weights

    @property
    def layers(self) -> List[ResidualBlock]:
        return self.model.layers

    def make_cache(self) -> List[Union[ArraysCache, RotatingKVCache]]:
        window = self.args.attention_window_size
        return [RotatingKVCache(window) if layer.layer_type == ATTENTION else ArraysCache(2) for layer in self.layers]

    def shard(self, group: Optional[mx.distributed.Group] = None) -> None:
        """Tensor parallel over `group` (default: the global group), in place: attention
        by query heads (one KV head, as recurrentgemma-2b's, stays whole on every rank;
        more are split), each recurrent block by RG-LRU heads (linear_x / linear_y rows,
        the conv's channels and the gates' blocks alike, so a rank's conv and recurrent
        states hold its channels) and the MLP by hidden units; o_proj, linear_out and
        down_proj all-sum (their biases added once)."""
        group = sharding.world(group)
        for layer in self.layers:
            block = layer.temporal_block
            if layer.layer_type == ATTENTION:
                shard_local_attention(block, group)
            else:
                shard_recurrent_block(block, group)
            sharding.shard_mlp(layer.mlp_block, group)


def shard_local_attention(attn: Attention, group: mx.distributed.Group) -> None:
    """Query heads split; KV heads split too, unless there is one (multi-query), which
    every rank then keeps whole."""
    if attn.num_kv_heads == 1:
        attn.num_heads = sharding.per_rank(attn.num_heads, group, "num_attention_heads")
        sharding.shard_projections(attn, ("q_proj",), sharding.ALL_TO_SHARDED, group)
        sharding.shard_projections(attn, ("o_proj",), sharding.SHARDED_TO_ALL, group)
        return
    attn.num_heads, attn.num_kv_heads = sharding.shard_attention(attn, attn.num_heads, attn.num_kv_heads, group)


def shard_recurrent_block(block: RecurrentBlock, group: mx.distributed.Group) -> None:
    """This rank's RG-LRU heads (contiguous channel blocks) in every per-channel piece."""
    lru = block.rg_lru
    sharding.per_rank(lru.input_gate_weight.shape[0], group, "num_attention_heads (RG-LRU heads)")
    sharding.shard_projections(block, ("linear_x", "linear_y"), sharding.ALL_TO_SHARDED, group)
    block.conv_1d.weight = sharding.take_shard(block.conv_1d.weight, group)  # (W/N, K, 1)
    block.conv_1d.bias = sharding.take_shard(block.conv_1d.bias, group)
    for name in ("recurrent_param", "input_gate_weight", "input_gate_bias", "recurrent_gate_weight",
                 "recurrent_gate_bias"):
        lru[name] = sharding.take_shard(lru[name], group)
    sharding.shard_projections(block, ("linear_out",), sharding.SHARDED_TO_ALL, group)
