"""Gemma 3n, text tower: `gemma3n_text` (Gemma3nForCausalLM) and `gemma3n`
(Gemma3nForConditionalGeneration, e.g. gemma-3n-E2B/E4B, whose text model this runs;
its vision and audio towers are dropped).

What differs from Gemma 3 (gemma3.py):
- RMSNorms scale by w itself (stored as ones), not by 1 + w; the value norm has no
  scale. Attention scores are not scaled (scale 1: the q/k norms set their size).
- KV sharing: the last `num_kv_shared_layers` layers compute no keys or values; each
  attends over those of the last earlier layer of its attention type (`kv_sources`),
  as that layer's cache returned them in the same forward. Those layers own no cache
  (a `SharedKVReader` entry): rolling back the source's cache rolls back its readers.
- AltUp: the residual stream is `altup_num_inputs` copies (the embedding and learned
  projections of it rescaled to its magnitude); each layer runs on the active copy,
  a router of it predicts every copy before the layer and corrects them after.
- Laurel: a low-rank residual branch beside attention, averaged in by 1/sqrt(2).
- Per-layer embeddings: a second embedding table gives each layer a small input of
  its own, mixed with a projection of the token embedding; each layer gates it with
  its active output and adds the result to the other copies.
- Activation sparsity: in the first layers (`activation_sparsity_pattern`) the MLP
  gate keeps only values above mean + z * std over its width, z the standard normal
  quantile of the sparsity level (a Gaussian top-k).
- MLP widths may differ per layer; the final logits are soft-capped (30 by default).

Tokens at or past the vision tower's vocabulary offset (image and audio soft tokens)
need the towers; here they embed through the text table as Gemma3nForCausalLM does.
Layouts: gemma3n_text weights are `model.*`; gemma3n nests the config under
`text_config` and the weights under `model.language_model.*` (transformers) or
`language_model.model.*` (MLX converters, and ours). Checkpoints keep k/v projections
for KV-shared layers that transformers ignores; sanitize drops them.
Reference: transformers `models/gemma3n/modeling_gemma3n.py`, `configuration_gemma3n.py`.
"""

import math
from dataclasses import dataclass
from statistics import NormalDist
from typing import Any, Dict, List, Optional, Sequence, Tuple, Union

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from . import gemma3, sharding
from .base import BaseModelArgs, check_head_grouping, check_layer_types, create_attention_mask
from .base import scaled_dot_product_attention
from .cache import KVCache, RotatingKVCache, SharedKVReader
from .gemma3 import scale_embeddings
from .gpt_oss import FULL, SLIDING
from .qwen3_5 import text_key
from .rope_utils import initialize_rope

# What the text model drops from a Gemma3nForConditionalGeneration checkpoint.
TOWER_PREFIXES = tuple(
    f"{root}{part}." for root in ("model.", "") for part in ("vision_tower", "audio_tower", "embed_vision", "embed_audio")
)
# Keys and values of a KV-shared layer: unused (transformers ignores them on load).
KV_WEIGHTS = ("k_proj", "v_proj", "k_norm", "v_norm")


def kv_sources(layer_types: Sequence[str], num_kv_shared_layers: int) -> List[Optional[int]]:
    """For each layer, the index of the layer whose keys and values it attends over
    (None: its own). The last num_kv_shared_layers layers read the last earlier layer
    of their own type, as transformers' `kv_sharing_modes` ("reuse" / "store")."""
    n = len(layer_types)
    if not 0 <= num_kv_shared_layers < n:
        raise ValueError(f"num_kv_shared_layers must be in [0, {n}) for {n} layers, got {num_kv_shared_layers}")
    first_shared = n - num_kv_shared_layers
    if num_kv_shared_layers and set(layer_types[:first_shared]) != set(layer_types):
        raise ValueError(
            f"num_kv_shared_layers={num_kv_shared_layers}: the shared layers' types {sorted(set(layer_types))} "
            f"must each appear among the first {first_shared} layers, which produce the keys and values"
        )
    last_of = {kind: i for i, kind in enumerate(layer_types[:first_shared])}
    return [None if i < first_shared else last_of[kind] for i, kind in enumerate(layer_types)]


def sparsity_multiplier(sparsity: float) -> float:
    """The standard normal quantile of `sparsity` as transformers computes it
    (torch's Normal(0, 1).icdf in float32: erfinv(2p - 1), rounded to float32, times
    sqrt(2) in float32). Its float64 erfinv rounds to torch's float32 one, while MLX's
    float32 erfinv is a few ulps off."""
    p = np.float32(sparsity)
    x = np.float32(2) * p - np.float32(1)
    erfinv = np.float32(NormalDist().inv_cdf((float(x) + 1) / 2) / math.sqrt(2))
    return float(erfinv * np.float32(math.sqrt(2)))


def gaussian_topk(x: mx.array, multiplier: float, group: Optional[mx.distributed.Group] = None) -> mx.array:
    """relu(x - (mean + multiplier * std)) over the last axis, (..., F) -> (..., F); std
    is the population one (torch.std(unbiased=False)). With `group` (tensor parallel: x
    is this rank's share of the F units) mean and std are over every rank's units."""
    width, total = x.shape[-1], mx.sum(x, axis=-1, keepdims=True)
    if group is not None:
        width, total = width * group.size(), mx.distributed.all_sum(total, group=group)
    mean = total / width
    squares = mx.sum(mx.square(x - mean), axis=-1, keepdims=True)
    if group is not None:
        squares = mx.distributed.all_sum(squares, group=group)
    return nn.relu(x - (mean + mx.sqrt(squares / width) * mx.array(multiplier, dtype=x.dtype)))


def rms_norm(x: mx.array, weight: Optional[mx.array], eps: float) -> mx.array:
    """RMSNorm over the last axis scaled by `weight` (None: unscaled), (..., D), in
    float32 and cast back, as transformers' Gemma3nRMSNorm."""
    w = None if weight is None else weight.astype(mx.float32)
    return mx.fast.rms_norm(x.astype(mx.float32), w, eps).astype(x.dtype)


def match_magnitude(x: mx.array, target: mx.array) -> mx.array:
    """x rescaled to the root-mean-square `target` (..., 1) over its last axis; the
    mean square is clamped at 1e-5 as transformers does."""
    magnitude = mx.sqrt(mx.maximum(mx.mean(x * x, axis=-1, keepdims=True), 1e-5))
    return x * target / magnitude


def root_mean_square(x: mx.array) -> mx.array:
    return mx.sqrt(mx.mean(x * x, axis=-1, keepdims=True))


@dataclass
class TextModelArgs(BaseModelArgs):
    """Gemma3nTextConfig's keys, with its defaults."""

    model_type: str = "gemma3n_text"
    vocab_size: int = 262400
    hidden_size: int = 2048
    intermediate_size: Union[int, List[int]] = 16384
    num_hidden_layers: int = 35
    num_attention_heads: int = 8
    num_key_value_heads: int = 2
    head_dim: int = 256
    hidden_activation: str = "gelu_pytorch_tanh"
    max_position_embeddings: int = 32768
    rms_norm_eps: float = 1e-6
    tie_word_embeddings: bool = True
    rope_parameters: Optional[Dict[str, Dict[str, Any]]] = None  # transformers 5: per layer type
    rope_theta: Optional[float] = None  # transformers 4: global layers
    rope_scaling: Optional[Dict[str, Any]] = None  # transformers 4: global layers
    rope_local_base_freq: Optional[float] = None  # transformers 4: sliding layers
    attention_bias: bool = False
    sliding_window: int = 512
    layer_types: Optional[List[str]] = None
    final_logit_softcapping: Optional[float] = 30.0
    vocab_size_per_layer_input: int = 262144
    hidden_size_per_layer_input: int = 256
    altup_active_idx: int = 0
    altup_correct_scale: bool = True
    altup_num_inputs: int = 4
    num_kv_shared_layers: int = 15
    laurel_rank: int = 64
    activation_sparsity_pattern: Optional[List[float]] = None

    def __post_init__(self):
        n = self.num_hidden_layers
        if self.layer_types is None:  # transformers' default: every fifth layer global
            self.layer_types = [FULL if (i + 1) % 5 == 0 else SLIDING for i in range(n)]
        check_layer_types(self.layer_types, n, (SLIDING, FULL))
        check_head_grouping(self.num_attention_heads, self.num_key_value_heads)
        self.intermediate_sizes = self._per_layer("intermediate_size", self.intermediate_size)
        if self.activation_sparsity_pattern is None:  # transformers' default: the first 10 of > 10
            sparse = 10 if n > 10 else 0
            self.activation_sparsity_pattern = [0.95] * sparse + [0.0] * (n - sparse)
        self._per_layer("activation_sparsity_pattern", self.activation_sparsity_pattern, scalar=False)
        if not 0 <= self.altup_active_idx < self.altup_num_inputs:
            raise ValueError(f"altup_active_idx must be in [0, {self.altup_num_inputs}), got {self.altup_active_idx}")
        self.kv_sources = kv_sources(self.layer_types, self.num_kv_shared_layers)
        self.rope = {kind: self._resolve_rope(kind) for kind in (SLIDING, FULL)}
        if self.hidden_activation != "gelu_pytorch_tanh":
            raise ValueError(
                f"hidden_activation {self.hidden_activation!r} is not supported; gemma3n uses 'gelu_pytorch_tanh'"
            )

    def _per_layer(self, name: str, value, scalar: bool = True) -> List:
        """One value per layer from a list of them (or, when `scalar`, one for all)."""
        if scalar and not isinstance(value, (list, tuple)):
            return [value] * self.num_hidden_layers
        if not isinstance(value, (list, tuple)) or len(value) != self.num_hidden_layers:
            raise ValueError(f"{name} must list one value per layer ({self.num_hidden_layers}), got {value!r}")
        return list(value)

    # Both rope dialects, keyed by layer type as in Gemma 3 (with its default thetas).
    _resolve_rope = gemma3.TextModelArgs._resolve_rope


@dataclass
class ModelArgs(BaseModelArgs):
    """gemma3n: the text model's keys under `text_config`; gemma3n_text: at the top level."""

    model_type: str
    text_config: Optional[Dict[str, Any]] = None
    tie_word_embeddings: Optional[bool] = None

    @classmethod
    def from_dict(cls, params: Dict[str, Any]) -> "ModelArgs":
        if params.get("model_type") == cls.text_model_type:  # the whole config is the text config
            return cls(model_type=cls.text_model_type, text_config=dict(params))
        return super().from_dict(params)

    text_model_type = "gemma3n_text"
    text_args_class = TextModelArgs

    def __post_init__(self):
        if not isinstance(self.text_config, dict):
            raise ValueError(
                f"{self.model_type} config needs a text_config dict (got {self.text_config!r}); "
                "the text model's settings live there"
            )
        text = dict(self.text_config, model_type=self.text_model_type)
        if self.tie_word_embeddings is not None:  # the multimodal model ties by its top-level key
            text["tie_word_embeddings"] = self.tie_word_embeddings
        self.text_args = self.text_args_class.from_dict(text)

    @property
    def vision_language(self) -> bool:
        """A multimodal checkpoint (weights nested, vision and audio towers)."""
        return self.model_type != self.text_model_type

    @property
    def vocab_size(self) -> int:
        return self.text_args.vocab_size


class RMSNorm(nn.Module):
    def __init__(self, dims: int, eps: float, with_scale: bool = True):
        super().__init__()
        if with_scale:
            self.weight = mx.ones((dims,))
        self.eps = eps

    def __call__(self, x: mx.array) -> mx.array:
        return rms_norm(x, self.get("weight"), self.eps)


class Attention(nn.Module):
    """Attention over its own keys and values, or, for a KV-shared layer (`reads_kv`),
    over those its source layer passes it: then it has no k/v projections."""

    def __init__(self, args: TextModelArgs, layer_type: str, reads_kv: bool, head_dim: int, n_kv_heads: int,
                 rope: nn.Module, values_from_keys: bool = False):
        super().__init__()
        dim, bias, eps = args.hidden_size, args.attention_bias, args.rms_norm_eps
        self.n_heads, self.n_kv_heads, self.reads_kv = args.num_attention_heads, n_kv_heads, reads_kv
        self.values_from_keys = values_from_keys
        self.q_proj = nn.Linear(dim, self.n_heads * head_dim, bias=bias)
        self.q_norm = RMSNorm(head_dim, eps)
        if not reads_kv:
            self.k_proj = nn.Linear(dim, n_kv_heads * head_dim, bias=bias)
            if not values_from_keys:  # Gemma 4's attention_k_eq_v layers reuse the key projection
                self.v_proj = nn.Linear(dim, n_kv_heads * head_dim, bias=bias)
            self.k_norm = RMSNorm(head_dim, eps)
            self.v_norm = RMSNorm(head_dim, eps, with_scale=False)
        self.o_proj = nn.Linear(self.n_heads * head_dim, dim, bias=bias)
        self.rope = rope

    def __call__(self, x: mx.array, mask, cache=None, shared: Optional[Tuple] = None):
        """(B, L, dim) -> ((B, L, dim), (keys, values, cache, offset) for its readers)."""
        B, L, _ = x.shape
        kv = self.keys_and_values(x, cache) if shared is None else shared
        keys, values, kv_cache, offset = kv
        q = self.q_norm(self.q_proj(x).reshape(B, L, self.n_heads, -1)).transpose(0, 2, 1, 3)  # (B, H, L, D)
        q = self.rope(q, offset=offset)
        out = scaled_dot_product_attention(q, keys, values, cache=kv_cache, scale=1.0, mask=mask)
        return self.o_proj(out.transpose(0, 2, 1, 3).reshape(B, L, -1)), kv

    def keys_and_values(self, x: mx.array, cache) -> Tuple:
        """Normalised, rotated keys and normalised values appended to `cache`: (keys,
        values as the cache returns them (B, H_kv, S, D), the cache, the offset before)."""
        B, L, _ = x.shape
        offset = cache.offset if cache is not None else 0
        k = self.k_proj(x).reshape(B, L, self.n_kv_heads, -1)
        v = k if self.values_from_keys else self.v_proj(x).reshape(B, L, self.n_kv_heads, -1)
        k = self.rope(self.k_norm(k).transpose(0, 2, 1, 3), offset=offset)  # (B, H_kv, L, D)
        v = self.v_norm(v).transpose(0, 2, 1, 3)
        if cache is not None:
            k, v = cache.update_and_fetch(k, v)
        return k, v, cache, offset


class MLP(nn.Module):
    def __init__(self, dim: int, hidden_dim: int, sparsity: float):
        super().__init__()
        self.gate_proj = nn.Linear(dim, hidden_dim, bias=False)
        self.up_proj = nn.Linear(dim, hidden_dim, bias=False)
        self.down_proj = nn.Linear(hidden_dim, dim, bias=False)
        self.multiplier = sparsity_multiplier(sparsity) if sparsity > 0 else None
        self.units_group: Optional[mx.distributed.Group] = None  # set when sharded: the top-k spans ranks

    def __call__(self, x: mx.array) -> mx.array:
        gate = self.gate_proj(x)
        if self.multiplier is not None:
            gate = gaussian_topk(gate, self.multiplier, self.units_group)
        return self.down_proj(nn.gelu_approx(gate) * self.up_proj(x))


class Laurel(nn.Module):
    """Learned augmented residual: x + norm(right(left(x))), a rank-`laurel_rank` branch."""

    def __init__(self, args: TextModelArgs):
        super().__init__()
        self.linear_left = nn.Linear(args.hidden_size, args.laurel_rank, bias=False)
        self.linear_right = nn.Linear(args.laurel_rank, args.hidden_size, bias=False)
        self.post_laurel_norm = RMSNorm(args.hidden_size, args.rms_norm_eps)

    def __call__(self, x: mx.array) -> mx.array:
        return x + self.post_laurel_norm(self.linear_right(self.linear_left(x)))


class AltUp(nn.Module):
    """Alternating updates over the (n, B, L, D) stack of residual copies
    (https://arxiv.org/abs/2301.13310): predict every copy from a router of the active
    one before a layer, correct them by the layer's innovation after it."""

    def __init__(self, args: TextModelArgs):
        super().__init__()
        n, dim = args.altup_num_inputs, args.hidden_size
        self.n, self.active = n, args.altup_active_idx
        self.correct_output_scale = mx.zeros((dim,))
        self.correction_coefs = nn.Linear(n, n, bias=False)
        self.prediction_coefs = nn.Linear(n, n * n, bias=False)
        self.modality_router = nn.Linear(dim, n, bias=False)
        self.router_norm = RMSNorm(dim, args.rms_norm_eps)
        self.router_scale = 1.0 / dim

    def modalities(self, x: mx.array) -> mx.array:
        """(B, L, D) -> (B, L, n) router weights in (-1, 1), tanh taken in float32."""
        routed = self.modality_router(self.router_norm(x) * mx.array(self.router_scale, dtype=x.dtype))
        return mx.tanh(routed.astype(mx.float32)).astype(x.dtype)

    def predict(self, stack: mx.array) -> mx.array:
        """(n, B, L, D) -> (n, B, L, D): copy j plus sum_i c[j, i] copy i, c from the router."""
        modalities = self.modalities(stack[self.active])
        B, L, _ = modalities.shape
        coefs = self.prediction_coefs(modalities).reshape(B, L, self.n, self.n).swapaxes(-1, -2)  # (B, L, i, j)
        mixed = stack.transpose(1, 2, 3, 0) @ coefs  # (B, L, D, n)
        return mixed.transpose(3, 0, 1, 2) + stack

    def correct(self, predictions: mx.array, activated: mx.array) -> mx.array:
        """Each copy i plus (1 + c_i) times the innovation activated - predictions[active]."""
        coefs = self.correction_coefs(self.modalities(activated)) + 1.0  # (B, L, n)
        innovation = activated - predictions[self.active]  # (B, L, D)
        return innovation[None] * coefs.transpose(2, 0, 1)[..., None] + predictions


class DecoderLayer(nn.Module):
    def __init__(self, args: TextModelArgs, index: int):
        super().__init__()
        self.layer_type = args.layer_types[index]
        self.kv_source = args.kv_sources[index]
        theta, scaling = args.rope[self.layer_type]
        rope = initialize_rope(args.head_dim, theta, False, scaling, args.max_position_embeddings)
        self.self_attn = Attention(args, self.layer_type, self.kv_source is not None, args.head_dim,
                                   args.num_key_value_heads, rope)
        self.mlp = MLP(args.hidden_size, args.intermediate_sizes[index], args.activation_sparsity_pattern[index])
        dim, eps, per_layer = args.hidden_size, args.rms_norm_eps, args.hidden_size_per_layer_input
        self.input_layernorm, self.post_attention_layernorm = RMSNorm(dim, eps), RMSNorm(dim, eps)
        self.pre_feedforward_layernorm, self.post_feedforward_layernorm = RMSNorm(dim, eps), RMSNorm(dim, eps)
        self.altup, self.laurel = AltUp(args), Laurel(args)
        self.per_layer_input_gate = nn.Linear(dim, per_layer, bias=False)
        self.per_layer_projection = nn.Linear(per_layer, dim, bias=False)
        self.post_per_layer_input_norm = RMSNorm(dim, eps)
        self.correct_scale = args.altup_correct_scale

    def __call__(self, stack: mx.array, per_layer_input: mx.array, mask, cache=None, shared=None):
        """(n, B, L, D) copies and this layer's (B, L, P) input -> (new copies, its kv)."""
        predictions = self.altup.predict(stack)
        h, kv = self.mix(predictions[self.altup.active], mask, cache, shared)
        corrected = self.altup.correct(predictions, h)
        gated = self.gate_per_layer_input(corrected[self.altup.active], per_layer_input)
        return mx.concatenate([corrected[:1], corrected[1:] + gated]), kv  # copies 1.. get it, as transformers

    def mix(self, x: mx.array, mask, cache, shared) -> Tuple[mx.array, Tuple]:
        """The transformer block on the active copy, with the Laurel branch beside attention."""
        normed = self.input_layernorm(x)
        attn, kv = self.self_attn(normed, mask, cache, shared)
        h = (x + self.post_attention_layernorm(attn) + self.laurel(normed)) / math.sqrt(2)
        return h + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(h))), kv

    def gate_per_layer_input(self, active: mx.array, per_layer_input: mx.array) -> mx.array:
        if self.correct_scale:
            active = active * self.altup.correct_output_scale
        gated = nn.gelu_approx(self.per_layer_input_gate(active)) * per_layer_input  # (B, L, P)
        return self.post_per_layer_input_norm(self.per_layer_projection(gated))


def layer_masks(h: mx.array, layers: Sequence[nn.Module], cache: Sequence[Any], window: int) -> Dict[str, Any]:
    """One mask per layer type, from the first cache of that type a layer owns (a
    KV-shared layer's entry holds nothing; its source is of the same type). Sliding
    masks are windowed even without a cache."""
    masks = {}
    for layer, layer_cache in zip(layers, cache):
        if layer.layer_type not in masks and layer.kv_source is None:
            size = window if layer.layer_type == SLIDING else None
            masks[layer.layer_type] = create_attention_mask(h, layer_cache, window_size=size)
    return masks


def run_layers(layers, stack: mx.array, per_layer_inputs: mx.array, masks, cache) -> mx.array:
    """The decoder layers in order; a KV source's (keys, values, cache, offset) are
    kept for the layers that read them. per_layer_inputs: (B, L, num_layers, P), or
    None for a model without them (Gemma 4's larger models)."""
    sources = {layer.kv_source for layer in layers}
    kept = {}
    for i, (layer, layer_cache) in enumerate(zip(layers, cache)):
        shared = kept.get(layer.kv_source)
        per_layer_input = None if per_layer_inputs is None else per_layer_inputs[:, :, i, :]
        stack, kv = layer(stack, per_layer_input, masks[layer.layer_type], layer_cache, shared)
        if i in sources:
            kept[i] = kv
    return stack


class TextModel(nn.Module):
    def __init__(self, args: TextModelArgs):
        super().__init__()
        dim, n = args.hidden_size, args.altup_num_inputs
        self.hidden_size, self.sliding_window = dim, args.sliding_window
        self.embed_tokens = nn.Embedding(args.vocab_size, dim)
        self.per_layer_shape = (args.num_hidden_layers, args.hidden_size_per_layer_input)
        self.embed_tokens_per_layer = nn.Embedding(args.vocab_size_per_layer_input, math.prod(self.per_layer_shape))
        self.per_layer_model_projection = nn.Linear(dim, math.prod(self.per_layer_shape), bias=False)
        self.per_layer_projection_norm = RMSNorm(args.hidden_size_per_layer_input, args.rms_norm_eps)
        self.layers = [DecoderLayer(args, i) for i in range(args.num_hidden_layers)]
        self.norm = RMSNorm(dim, args.rms_norm_eps)
        self.altup_projections = [nn.Linear(dim, dim, bias=False) for _ in range(1, n)]
        self.altup_unembed_projections = [nn.Linear(dim, dim, bias=False) for _ in range(1, n)]

    def __call__(self, inputs: mx.array, cache: Optional[List[Any]] = None) -> mx.array:
        h = scale_embeddings(self.embed_tokens(inputs), self.hidden_size)  # (B, L, D)
        per_layer_inputs = self.per_layer_inputs(inputs, h)
        cache = [None] * len(self.layers) if cache is None else cache
        masks = layer_masks(h, self.layers, cache, self.sliding_window)
        stack = run_layers(self.layers, self.altup_stack(h), per_layer_inputs, masks, cache)
        return self.norm(self.altup_unstack(stack))

    def per_layer_inputs(self, inputs: mx.array, embeddings: mx.array) -> mx.array:
        """(B, L) ids and their (B, L, D) scaled embeddings -> (B, L, num_layers, P):
        each layer's slice of the second table plus the normalised projection of the
        embedding, times 1/sqrt(2). Scales are rounded to the compute dtype first."""
        table_size, shape = self.embed_tokens_per_layer.weight.shape[0], (*inputs.shape, *self.per_layer_shape)
        ids = mx.where((inputs >= 0) & (inputs < table_size), inputs, 0)  # transformers: ids past the table -> 0
        own = scale_embeddings(self.embed_tokens_per_layer(ids), self.per_layer_shape[1]).reshape(shape)
        scale = mx.array(self.hidden_size**-0.5, dtype=embeddings.dtype)
        projected = self.per_layer_projection_norm((self.per_layer_model_projection(embeddings) * scale).reshape(shape))
        return (projected + own) * mx.array(2**-0.5, dtype=embeddings.dtype)

    def altup_stack(self, h: mx.array) -> mx.array:
        """(B, L, D) -> (n, B, L, D): h and its projections, each at h's magnitude."""
        target = root_mean_square(h)
        return mx.stack([h] + [match_magnitude(proj(h), target) for proj in self.altup_projections])

    def altup_unstack(self, stack: mx.array) -> mx.array:
        """(n, B, L, D) -> (B, L, D): the mean of copy 0 and the other copies projected
        back, each at copy 0's magnitude."""
        target = root_mean_square(stack[0])
        copies = [match_magnitude(proj(x), target) for proj, x in zip(self.altup_unembed_projections, stack[1:])]
        return mx.mean(mx.stack([stack[0]] + copies), axis=0)

    def sanitize(self, weights: Dict[str, mx.array], prefix: str) -> Dict[str, mx.array]:
        """Drop the unused k/v weights of KV-shared layers (keys under `prefix`)."""
        unused = tuple(f"{prefix}layers.{i}.self_attn.{name}." for i, layer in enumerate(self.layers)
                       if layer.kv_source is not None for name in KV_WEIGHTS)
        return {k: v for k, v in weights.items() if not k.startswith(unused)}


def make_layer_caches(layers, sliding_window: int) -> List[Union[KVCache, RotatingKVCache, SharedKVReader]]:
    """A window-sized ring buffer for each sliding layer, a growing cache for each
    global one, nothing for a KV-shared layer (it reads its source's)."""
    caches = []
    for layer in layers:
        if layer.kv_source is not None:
            caches.append(SharedKVReader())
        else:
            caches.append(RotatingKVCache(sliding_window) if layer.layer_type == SLIDING else KVCache())
    return caches


def shard_layers(layers, group: Optional[mx.distributed.Group] = None) -> None:
    """Tensor parallel: each rank keeps its share of every layer's heads and MLP units;
    a KV-shared layer's query heads match the kv heads its source keeps on the rank;
    a sparse MLP's top-k takes its statistics over every rank's units. AltUp, Laurel,
    the per-layer inputs and the embeddings stay whole."""
    group = sharding.world(group)
    for layer in layers:
        attn = layer.self_attn
        qkv = ("q_proj",) if attn.reads_kv else ("q_proj", "k_proj") + (() if attn.values_from_keys else ("v_proj",))
        attn.n_heads, attn.n_kv_heads = sharding.shard_attention(attn, attn.n_heads, attn.n_kv_heads, group, qkv=qkv)
        sharding.shard_mlp(layer.mlp, group)
        if isinstance(layer.mlp, MLP):
            layer.mlp.units_group = group


class LanguageModel(nn.Module):
    """gemma3n_text (Gemma3nForCausalLM): `model.*` and, unless tied, `lm_head`."""

    # Speculation rolls back exactly: ring buffers record their pre-forward windows,
    # KV caches trim, and KV-shared layers hold nothing of their own.
    supports_speculative_rollback = True
    backbone_class = TextModel  # gemma4_text swaps in its own

    def __init__(self, args: TextModelArgs):
        super().__init__()
        self.args = args
        self.model_type = args.model_type
        self.model = self.backbone_class(args)
        if not args.tie_word_embeddings:
            self.lm_head = nn.Linear(args.hidden_size, args.vocab_size, bias=False)

    # Token ids (B, L) -> logits (B, L, vocab): Gemma 3's head and final soft-cap.
    __call__ = gemma3.LanguageModel.__call__

    def sanitize(self, weights: Dict[str, mx.array]) -> Dict[str, mx.array]:
        """Drop rope buffers, the KV-shared layers' unused k/v weights and, when tied,
        any `lm_head.*` (upstream mlx-lm writes the embedding again as lm_head)."""
        weights = {k: v for k, v in weights.items() if "rotary_emb." not in k}
        if self.args.tie_word_embeddings:
            weights = {k: v for k, v in weights.items() if not k.startswith("lm_head.")}
        return self.model.sanitize(weights, "model.")

    @property
    def layers(self) -> List[DecoderLayer]:
        return self.model.layers

    def make_cache(self) -> List[Union[KVCache, RotatingKVCache, SharedKVReader]]:
        return make_layer_caches(self.layers, self.args.sliding_window)

    def shard(self, group: Optional[mx.distributed.Group] = None) -> None:
        shard_layers(self.layers, group)


class ConditionalGeneration(nn.Module):
    """gemma3n (Gemma3nForConditionalGeneration): the text model under `language_model.`."""

    supports_speculative_rollback = True
    language_model_class = LanguageModel

    def __init__(self, args: ModelArgs):
        super().__init__()
        self.args = args
        self.model_type = args.model_type
        self.language_model = self.language_model_class(args.text_args)

    def __call__(self, inputs: mx.array, cache: Optional[List[Any]] = None) -> mx.array:
        """Token ids (B, L) -> logits (B, L, vocab)."""
        return self.language_model(inputs, cache)

    def sanitize(self, weights: Dict[str, mx.array]) -> Dict[str, mx.array]:
        """Drop the vision and audio towers and their embedders; any text prefix ->
        `language_model.`."""
        text = {text_key(k): v for k, v in weights.items() if not k.startswith(TOWER_PREFIXES)}
        return {"language_model." + k: v for k, v in self.language_model.sanitize(text).items()}

    @property
    def layers(self) -> List[DecoderLayer]:
        return self.language_model.layers

    def make_cache(self) -> List[Union[KVCache, RotatingKVCache, SharedKVReader]]:
        return self.language_model.make_cache()

    def shard(self, group: Optional[mx.distributed.Group] = None) -> None:
        self.language_model.shard(group)


class Model:
    """What `get_model_classes` builds for both model types (MODEL_REMAPPING sends
    gemma3n_text here): a LanguageModel for a gemma3n_text config, a
    ConditionalGeneration for a gemma3n one, each with the weight names of its layout."""

    supports_speculative_rollback = True

    def __new__(cls, args: ModelArgs) -> Union[LanguageModel, ConditionalGeneration]:
        if args.vision_language:
            return ConditionalGeneration(args)
        return LanguageModel(args.text_args)
