"""The Hugging Face hub: where a model named by repo id lives on disk, and uploading one."""

from pathlib import Path
from typing import Optional, Union

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


def check_repo_id(repo_id: str) -> None:
    """ValueError naming `repo_id` unless it is a valid hub repo id ("namespace/name")."""
    from huggingface_hub.errors import HFValidationError
    from huggingface_hub.utils import validate_repo_id

    if not isinstance(repo_id, str) or repo_id.count("/") != 1:
        raise ValueError(f"Hub repo id {repo_id!r} must be of the form namespace/name, e.g. mlx-community/my-model")
    try:
        validate_repo_id(repo_id)
    except HFValidationError as e:
        raise ValueError(f"Hub repo id {repo_id!r} is not valid: {e}") from None


def create_model_card(path: Union[str, Path], hf_path: Union[str, Path, None]) -> None:
    """Write `path`/README.md: a model card saying the model is for MLX text generation,
    based on hub repo `hf_path` (None: a local checkpoint, no base model named).
    Upstream starts from the source repo's own card, which needs the network; this one
    starts from huggingface_hub's template, so converting works offline."""
    from huggingface_hub import ModelCard, ModelCardData

    data = ModelCardData(language="en", library_name="mlx", pipeline_tag="text-generation", tags=["mlx"])
    if hf_path is not None:
        data.base_model = str(hf_path)
    card = ModelCard.from_template(data)
    card.text = ""
    card.save(str(Path(path) / "README.md"))


def _usage_text(upload_repo: str, base_model: Optional[str]) -> str:
    from . import __version__

    provenance = ""
    if base_model is not None:
        provenance = (
            f"This model [{upload_repo}](https://huggingface.co/{upload_repo}) was converted to MLX from "
            f"[{base_model}](https://huggingface.co/{base_model}) with mlx_lm {__version__}.\n"
        )
    return (
        f"# {upload_repo}\n\n{provenance}\n## Use with mlx\n\n```python\nfrom mlx_lm import generate, load\n\n"
        f'model, tokenizer = load("{upload_repo}")\nprint(generate(model, tokenizer, prompt="hello"))\n```\n'
    )


def upload_to_hub(path: Union[str, Path], upload_repo: str) -> str:
    """Upload the model directory `path` to hub repo `upload_repo` (created if missing),
    after writing the usage into its model card (README.md, made by create_model_card if
    absent); returns the repo's URL. The local directory is left as it is whatever happens:
    a failed upload (offline, no token, no access) raises RuntimeError naming the repo and
    the cause, and can be retried."""
    from huggingface_hub import HfApi, ModelCard

    path = Path(path)
    check_repo_id(upload_repo)
    if not (path / "config.json").is_file():
        raise FileNotFoundError(f"Cannot upload {path}: it is not a model directory (no config.json)")
    if not (path / "README.md").exists():
        create_model_card(path, None)
    card = ModelCard.load(path / "README.md")
    card.text = _usage_text(upload_repo, card.data.base_model)
    card.save(str(path / "README.md"))
    try:  # upload_folder, not upstream's upload_large_folder, which huggingface_hub 2.4 lacks
        api = HfApi()
        api.create_repo(repo_id=upload_repo, exist_ok=True)
        api.upload_folder(folder_path=str(path), repo_id=upload_repo, repo_type="model")
    except Exception as e:  # offline, unauthenticated, network: all mean "not uploaded"
        raise RuntimeError(
            f"Could not upload {path} to the hub repo {upload_repo!r}: {type(e).__name__}: {str(e).rstrip('.')}. "
            f"The model is kept in {path}; retry with mlx_lm.utils.upload_to_hub({str(path)!r}, {upload_repo!r})"
        ) from e
    return f"https://huggingface.co/{upload_repo}"
