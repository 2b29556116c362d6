"""hub.py: repo ids, the model card, and uploading (the hub itself replaced: tests never
use the network)."""

import pytest

from mlx_lm.hub import check_repo_id, create_model_card, upload_to_hub


@pytest.mark.parametrize("repo_id, message", [("no-namespace", "must be of the form namespace/name"),
                                              ("a/b/c", "must be of the form"), ("org/bad name", "is not valid")])
def test_bad_repo_ids_are_named(repo_id, message):
    with pytest.raises(ValueError, match=message):
        check_repo_id(repo_id)
    check_repo_id("mlx-community/tiny-4bit")


def test_model_card_says_mlx_and_the_base_model(tmp_path):
    create_model_card(tmp_path, "org/base")
    card = (tmp_path / "README.md").read_text()
    assert "library_name: mlx" in card and "pipeline_tag: text-generation" in card and "base_model: org/base" in card


def model_dir(tmp_path):
    (tmp_path / "m").mkdir()
    (tmp_path / "m" / "config.json").write_text("{}")
    create_model_card(tmp_path / "m", "org/base")
    return tmp_path / "m"


def test_upload_creates_the_repo_and_uploads_the_folder(tmp_path, monkeypatch):
    from huggingface_hub import HfApi

    calls = []
    monkeypatch.setattr(HfApi, "create_repo", lambda self, repo_id, exist_ok: calls.append(("create", repo_id)))
    monkeypatch.setattr(HfApi, "upload_folder",
                        lambda self, folder_path, repo_id, repo_type: calls.append(("upload", folder_path, repo_id)))
    path = model_dir(tmp_path)
    assert upload_to_hub(path, "me/tiny") == "https://huggingface.co/me/tiny"
    assert calls == [("create", "me/tiny"), ("upload", str(path), "me/tiny")]
    card = (path / "README.md").read_text()
    assert "# me/tiny" in card and "converted to MLX from [org/base]" in card and 'load("me/tiny")' in card


def test_offline_upload_fails_clearly_and_keeps_the_model(tmp_path, monkeypatch):
    from huggingface_hub import HfApi
    from huggingface_hub.errors import OfflineModeIsEnabled

    def offline(self, repo_id, exist_ok):
        raise OfflineModeIsEnabled("Cannot reach https://huggingface.co: offline mode is enabled")

    monkeypatch.setattr(HfApi, "create_repo", offline)
    path = model_dir(tmp_path)
    with pytest.raises(RuntimeError, match=r"Could not upload .* to the hub repo 'me/tiny': OfflineModeIsEnabled"):
        upload_to_hub(path, "me/tiny")
    assert (path / "config.json").read_text() == "{}"
    with pytest.raises(FileNotFoundError, match="not a model directory"):
        upload_to_hub(tmp_path, "me/tiny")
