"""mlx_lm.cache_prompt's loading flags: --adapter-path, --eos-token and
--trust-remote-code (the file format and resuming are in test_cache_files.py)."""

import json
import shutil

import pytest

from mlx_lm import tokenizer_utils
from mlx_lm.cache_prompt import main as cache_prompt_main
from mlx_lm.generate import main as generate_main
from mlx_lm.models.checkpoint_files import load_checkpointed
from test_adapters import base_weights, write_adapters

HEAD, TAIL = "The tokenizer splits text", " into pieces"


def test_a_cache_of_the_adapted_model_resumes_only_with_its_adapters(tmp_path, tiny_llama_dir, capsys):
    adapters, _ = write_adapters(tmp_path / "adapters", base_weights(tiny_llama_dir))
    cache_file = str(tmp_path / "adapted.safetensors")
    cache_prompt_main(["--model", str(tiny_llama_dir), "--adapter-path", str(adapters), "--prompt", HEAD,
                       "--prompt-cache-file", cache_file])
    capsys.readouterr()
    common = ["--model", str(tiny_llama_dir), "--max-tokens", "8", "--verbose", "false"]
    generate_main([*common, "--adapter-path", str(adapters), "--prompt-cache-file", cache_file, "--prompt", TAIL])
    resumed = capsys.readouterr().out
    generate_main([*common, "--adapter-path", str(adapters), "--prompt", HEAD + TAIL])
    assert resumed == capsys.readouterr().out
    with pytest.raises(SystemExit, match="was made for model"):
        generate_main([*common, "--prompt-cache-file", cache_file, "--prompt", TAIL])


def test_eos_token_is_the_one_the_chat_template_writes(tmp_path, tiny_model_dir):
    model_dir = shutil.copytree(tiny_model_dir, tmp_path / "model")
    config_file = model_dir / "tokenizer_config.json"
    config = json.loads(config_file.read_text())
    config["chat_template"] = "{% for m in messages %}{{ m['content'] }}{{ eos_token }}{% endfor %}"
    config_file.write_text(json.dumps(config))

    def cached_tokens(name, *flags):
        cache_file = str(tmp_path / f"{name}.safetensors")
        cache_prompt_main(["--model", str(model_dir), "--system-prompt", "Be brief", "--prompt", HEAD,
                           "--prompt-cache-file", cache_file, *flags])
        _, metadata = load_checkpointed(cache_file)
        return json.loads(metadata["prompt_tokens"]), json.loads(metadata["tokenizer_config"])

    from mlx_lm import load

    tokenizer = load(str(model_dir))[1]
    im_end, endoftext = tokenizer.convert_tokens_to_ids(["<|im_end|>", "<|endoftext|>"])
    tokens, options = cached_tokens("default")
    assert endoftext in tokens and im_end not in tokens and options == {}
    tokens, options = cached_tokens("im_end", "--eos-token", "<|im_end|>")
    assert im_end in tokens and endoftext not in tokens and options == {"eos_token": "<|im_end|>"}


def test_trust_remote_code_reaches_the_tokenizer_and_the_metadata(tmp_path, tiny_model_dir, monkeypatch):
    asked = []
    real_load = tokenizer_utils.load
    monkeypatch.setattr(tokenizer_utils, "load",
                        lambda path, extra=None, **kw: asked.append(dict(extra or {})) or real_load(path, extra, **kw))
    cache_file = str(tmp_path / "trusted.safetensors")
    cache_prompt_main(["--model", str(tiny_model_dir), "--prompt", HEAD, "--prompt-cache-file", cache_file,
                       "--trust-remote-code"])
    assert asked == [{"trust_remote_code": True}]
    assert json.loads(load_checkpointed(cache_file)[1]["tokenizer_config"]) == {"trust_remote_code": True}
