"""EXAONE 3.0 / 3.5 (`exaone`: LGAI-EXAONE/EXAONE-3.0-7.8B-Instruct, EXAONE-3.5-2.4B/7.8B/
32B-Instruct, EXAONE-Deep): llama under other weight and config names.

transformers 5 runs these checkpoints as LlamaForCausalLM and renames on load; so do
we, and this file is only the renaming:
- Weights: the hub's `transformer.wte`, `transformer.h.{i}.attn.attention.{q,k,v}_proj` /
  `out_proj`, `ln_1`, `ln_2`, `mlp.c_fc_0` (gate), `mlp.c_fc_1` (up), `mlp.c_proj`
  (down), `transformer.ln_f` -> llama's `model.*` names (what transformers saves, and
  upstream mlx-lm's converted layout, are the hub's; what we save is llama's).
- Config: the hub's `num_layers`, `layer_norm_epsilon`, `activation_function` are
  `num_hidden_layers`, `rms_norm_eps`, `hidden_act` (transformers' attribute_map).
- transformers' defaults: rope theta 5e5, rms_norm_eps 1e-5, 8 KV heads, untied.
EXAONE 4 is `exaone4.py`.
Reference: transformers `models/exaone/configuration_exaone.py` (ExaoneConfig, a
LlamaConfig), `conversion_mapping.py` ("exaone"), `models/llama/modeling_llama.py`.
"""

from dataclasses import dataclass
from typing import Dict, Optional

import mlx.core as mx

from . import llama
from .base import resolve_aliases

DEFAULT_THETA = 500_000.0  # ExaoneConfig.default_theta
# (llama's key, the hub's, ExaoneConfig's default)
ALIASES = (("num_hidden_layers", "num_layers", 32), ("rms_norm_eps", "layer_norm_epsilon", 1e-5),
           ("hidden_act", "activation_function", "silu"))

# transformers' WeightRenaming for "exaone": (hub piece, llama piece), applied in order
# to keys under `transformer.`.
RENAMES = (
    ("transformer.wte.", "model.embed_tokens."),
    ("transformer.h.", "model.layers."),
    ("transformer.ln_f.", "model.norm."),
    (".attn.attention.", ".self_attn."),
    (".self_attn.out_proj.", ".self_attn.o_proj."),
    (".ln_1.", ".input_layernorm."),
    (".ln_2.", ".post_attention_layernorm."),
    (".mlp.c_fc_0.", ".mlp.gate_proj."),
    (".mlp.c_fc_1.", ".mlp.up_proj."),
    (".mlp.c_proj.", ".mlp.down_proj."),
)


@dataclass
class ModelArgs(llama.ModelArgs):
    """ExaoneConfig's keys (llama's, and the hub's aliases), with its defaults."""

    hidden_size: int = 4096
    num_hidden_layers: Optional[int] = None
    intermediate_size: int = 14336
    num_attention_heads: int = 32
    vocab_size: int = 102400
    rms_norm_eps: Optional[float] = None
    num_key_value_heads: Optional[int] = 8
    max_position_embeddings: int = 4096
    hidden_act: Optional[str] = None
    num_layers: Optional[int] = None
    layer_norm_epsilon: Optional[float] = None
    activation_function: Optional[str] = None

    def __post_init__(self):
        resolve_aliases(self, ALIASES)
        if self.hidden_act != "silu":
            raise ValueError(f"hidden_act {self.hidden_act!r} is not supported; EXAONE's MLP is llama's SwiGLU, 'silu'")
        if self.rope_theta is None and "rope_theta" not in (self.rope_parameters or {}):
            self.rope_theta = DEFAULT_THETA  # llama's fallback would be 10000
        super().__post_init__()


def rename_hub_weights(weights: Dict[str, mx.array]) -> Dict[str, mx.array]:
    """The hub's `transformer.*` names -> llama's; other keys as they are."""
    out = {}
    for key, value in weights.items():
        if key.startswith("transformer."):
            for old, new in RENAMES:
                key = key.replace(old, new)
        out[key] = value
    return out


class Model(llama.Model):
    """llama's network; sanitize renames the hub's weights first."""

    # KV caches roll back by themselves; the layers record nothing.
    supports_speculative_rollback = True

    def sanitize(self, weights: Dict[str, mx.array]) -> Dict[str, mx.array]:
        return super().sanitize(rename_hub_weights(weights))
