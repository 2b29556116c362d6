"""config.json: reading it (with generation_config.json's EOS) and writing it back."""

import json
import math
from pathlib import Path
from typing import Any, Dict, Union

# transformers 5 writes a non-finite float as {"__float__": "Infinity"} so that
# config.json stays valid JSON for every parser; read it back as the float it is.
_FLOAT_TAG = "__float__"
_TAGGED_FLOATS = {"Infinity": math.inf, "-Infinity": -math.inf, "NaN": math.nan}


def decode_tagged_floats(value: Any) -> Any:
    """`value` (parsed JSON) with every {"__float__": "Infinity" | "-Infinity" | "NaN"}
    replaced by its float; any other object, even one with a "__float__" key, kept."""
    if isinstance(value, dict):
        if set(value) == {_FLOAT_TAG} and value[_FLOAT_TAG] in _TAGGED_FLOATS:
            return _TAGGED_FLOATS[value[_FLOAT_TAG]]
        return {k: decode_tagged_floats(v) for k, v in value.items()}
    if isinstance(value, list):
        return [decode_tagged_floats(v) for v in value]
    return value


def encode_tagged_floats(value: Any) -> Any:
    """The inverse of decode_tagged_floats: non-finite floats as tagged objects."""
    if isinstance(value, float) and not math.isfinite(value):
        return {_FLOAT_TAG: "NaN" if math.isnan(value) else "Infinity" if value > 0 else "-Infinity"}
    if isinstance(value, dict):
        return {k: encode_tagged_floats(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [encode_tagged_floats(v) for v in value]
    return value


def load_config(model_path: Path) -> Dict[str, Any]:
    """config.json (tagged non-finite floats decoded), with eos_token_id from
    generation_config.json when that has one."""
    config_file = model_path / "config.json"
    if not config_file.exists():
        raise FileNotFoundError(f"No config.json in {model_path}")
    try:
        config = decode_tagged_floats(json.loads(config_file.read_text()))
    except json.JSONDecodeError as e:
        raise ValueError(f"Malformed {config_file}: {e}") from None
    if not isinstance(config, dict):
        raise ValueError(f"Malformed {config_file}: expected a JSON object")
    generation_file = model_path / "generation_config.json"
    if generation_file.exists():
        try:
            eos = json.loads(generation_file.read_text()).get("eos_token_id")
        except (json.JSONDecodeError, AttributeError):
            eos = None
        if eos is not None:
            config["eos_token_id"] = eos
    return config


def save_config(config: Dict[str, Any], config_path: Union[str, Path], *, keep_vision_config: bool = False) -> None:
    """Write config.json with sorted keys, minus transformers' local bookkeeping
    ("_name_or_path") and, unless `keep_vision_config`, the "vision_config" of a vision
    tower this package drops when loading; non-finite floats tagged as transformers
    writes them (valid JSON). An MLX "quantization" block is also written as
    "quantization_config", as upstream does (readers of the Hugging Face layout look
    there). `config` itself is left as it is."""
    dropped = {"_name_or_path"} | (set() if keep_vision_config else {"vision_config"})
    config = {k: v for k, v in config.items() if k not in dropped}
    if "quantization" in config:
        config["quantization_config"] = config["quantization"]
    Path(config_path).write_text(json.dumps(encode_tagged_floats(dict(sorted(config.items()))), indent=4))
