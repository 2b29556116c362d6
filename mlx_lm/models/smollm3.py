"""SmolLM3 (`smollm3`, SmolLM3ForCausalLM: HuggingFaceTB/SmolLM3-3B): llama with NoPE
layers.

What differs from llama:
- Some layers carry no positional encoding (NoPE): `no_rope_layers[i]` is 1 where layer
  i ropes and 0 where it does not; without the list, every `no_rope_layer_interval`-th
  layer (default 4: layers 3, 7, ...) is NoPE, transformers' rule.
- Sliding window: `layer_types` when given; else, with `use_sliding_window` and a
  `sliding_window`, the NoPE layers slide (they see their `sliding_window` most recent
  positions, itself included, and cache them in a `RotatingKVCache`); the released
  model slides nowhere.
- transformers' defaults: rope theta 2e6, tied embeddings, 32768 positions.
Weights are `model.*` (+ `lm_head.*` unless tied), as transformers and MLX converters
save them.
Reference: transformers `models/smollm3/modeling_smollm3.py`, `configuration_smollm3.py`.
"""

from dataclasses import dataclass
from typing import List, Optional

from . import llama
from .granitemoehybrid import NoPositions
from .llama import FULL, SLIDING

DEFAULT_THETA = 2_000_000.0  # SmolLM3Config.default_theta


@dataclass
class ModelArgs(llama.ModelArgs):
    """SmolLM3Config's keys (llama's plus the NoPE and window switches), with its defaults."""

    max_position_embeddings: int = 32768
    tie_word_embeddings: bool = True
    no_rope_layers: Optional[List[int]] = None
    no_rope_layer_interval: int = 4
    use_sliding_window: bool = False

    def __post_init__(self):
        if self.rope_theta is None and "rope_theta" not in (self.rope_parameters or {}):
            self.rope_theta = DEFAULT_THETA  # llama's fallback would be 10000
        if self.no_rope_layers is None:
            interval = self.no_rope_layer_interval
            if isinstance(interval, bool) or not isinstance(interval, int) or interval < 1:
                raise ValueError(f"no_rope_layer_interval must be an int >= 1, got {interval!r}")
            self.no_rope_layers = [int((i + 1) % interval != 0) for i in range(self.num_hidden_layers)]
        self._check_no_rope_layers()
        if self.layer_types is None:
            slide = self.use_sliding_window and self.sliding_window is not None
            self.layer_types = [SLIDING if slide and not rope else FULL for rope in self.ropes]
        super().__post_init__()

    def _check_no_rope_layers(self):
        layers = self.no_rope_layers
        if not isinstance(layers, list) or len(layers) < self.num_hidden_layers or set(layers) - {0, 1}:
            raise ValueError(
                f"no_rope_layers must list 0 (NoPE) or 1 (rope) for each of the {self.num_hidden_layers} "
                f"layers, got {layers!r}"
            )

    @property
    def ropes(self) -> List[bool]:
        """Whether each layer turns queries and keys (the list may run past the layers)."""
        return [bool(rope) for rope in self.no_rope_layers[: self.num_hidden_layers]]


class SmolLM3Model(llama.LlamaModel):
    """llama's backbone with the NoPE layers' rope taken out."""

    def __init__(self, args: ModelArgs):
        super().__init__(args)
        for layer, rope in zip(self.layers, args.ropes):
            if not rope:
                layer.self_attn.rope = NoPositions()


class Model(llama.Model):
    # Both cache kinds roll back by themselves; the layers record nothing.
    supports_speculative_rollback = True
    backbone_class = SmolLM3Model
