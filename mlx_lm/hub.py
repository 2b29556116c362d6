"""The Hugging Face hub: where a model named by repo id lives on disk, and uploading one."""

from pathlib import Path
from typing import Optional

# What a hub download fetches (upstream's name): configs, weights, code-free tokenizer files.
DEFAULT_ALLOW_PATTERNS = [
    "*.json",
    "model*.safetensors",
    "tokenizer.model",
    "*.tiktoken",
    "tiktoken.model",
    "*.txt",
    "*.jsonl",
    "*.jinja",
]


def get_model_path(path_or_hf_repo: str, revision: Optional[str] = None, *, with_code: bool = False) -> Path:
    """A local directory as is, else a hub snapshot (downloaded unless cached).
    `with_code` also fetches the repo's *.py files (a tokenizer's remote code)."""
    model_path = Path(path_or_hf_repo)
    if model_path.exists():
        if not model_path.is_dir():
            raise ValueError(f"Model path {model_path} is a file; expected a model directory")
        return model_path
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import HFValidationError, LocalEntryNotFoundError

    try:
        return Path(
            snapshot_download(
                path_or_hf_repo, revision=revision, allow_patterns=DEFAULT_ALLOW_PATTERNS + ["*.py"] * with_code
            )
        )
    except HFValidationError:
        raise FileNotFoundError(
            f"Model path {path_or_hf_repo!r} does not exist and is not a valid Hugging Face repo id"
        ) from None
    except LocalEntryNotFoundError:
        raise FileNotFoundError(
            f"Model {path_or_hf_repo!r} is not a local directory and could not be fetched from the "
            "Hugging Face hub (offline, or HF_HUB_OFFLINE=1, and not in the local cache)"
        ) from None
    except Exception as e:  # repo missing, gated, network errors: name the repo
        raise FileNotFoundError(f"Could not fetch model {path_or_hf_repo!r} from the Hugging Face hub: {e}") from e


def hf_repo_to_path(hf_repo: str) -> Path:
    """The local snapshot of hub repo `hf_repo` (what get_model_path downloaded), never
    fetching: huggingface_hub's LocalEntryNotFoundError if it is not in the cache."""
    from huggingface_hub import snapshot_download

    return Path(snapshot_download(hf_repo, local_files_only=True, allow_patterns=DEFAULT_ALLOW_PATTERNS))
