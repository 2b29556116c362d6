"""Fine-tuned adapters for inference: loading upstream's LoRA/DoRA/full adapter
directories (`utils.load_adapters`) and the adapter layers themselves (`lora`).
Training lives upstream (`mlx_lm.lora`); this package only runs and fuses adapters."""

from .lora import DoRALinear, LoRALinear, LoRASwitchLinear
from .utils import load_adapters

__all__ = ["DoRALinear", "LoRALinear", "LoRASwitchLinear", "load_adapters"]
