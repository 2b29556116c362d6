import os
import sys
from pathlib import Path

import pytest

# Tests never touch the network; helper modules live beside the tests.
os.environ["HF_HUB_OFFLINE"] = "1"
sys.path.insert(0, str(Path(__file__).parent))

from checkpoints import TINY_CONFIGS, write_checkpoint  # noqa: E402
from tokenizer_fixture import bpe, bpe_dir, spm, spm_dir  # noqa: E402, F401  (tokenizer tests' fixtures)

FIXTURES = Path(__file__).parent / "fixtures"


@pytest.fixture(autouse=True)
def cold_draft_lengths():
    """Every test starts with no learned draft lengths (draft_length.DRAFT_LENGTHS is
    process-wide): what it asserts must not depend on the tests that ran before."""
    from mlx_lm.draft_length import DRAFT_LENGTHS

    DRAFT_LENGTHS.forget()
    yield


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> Path:
    """A tiny random qwen3 checkpoint with a trained byte-level BPE tokenizer."""
    return write_checkpoint(tmp_path_factory.mktemp("tiny_qwen3"), TINY_CONFIGS["qwen3"])


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory) -> Path:
    return write_checkpoint(tmp_path_factory.mktemp("tiny_llama"), TINY_CONFIGS["llama"], seed=1)
