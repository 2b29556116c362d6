"""What a newcomer sees from the command lines: help with defaults, no import noise,
user-level errors, and progress fit for a terminal or a pipe."""

import importlib
import io
import subprocess
import sys

import pytest

from mlx_lm import __version__, cache_prompt, generate, load
from mlx_lm.cli import COMMANDS
from mlx_lm.cli_args import format_bytes
from mlx_lm.convert import print_progress
from mlx_lm.convert import setup_arg_parser as convert_parser
from mlx_lm.generate import main as generate_main
from mlx_lm.generate import setup_arg_parser as generate_parser

NOISE = ("PyTorch was not found", "RuntimeWarning", "Traceback")


@pytest.mark.parametrize(
    "parser, defaults",
    [
        (generate_parser, ["(default: 100)", "(default: 3)", "(default: mlx-community/", "(default: True)"]),
        (convert_parser, ["(default: mlx_model)", "(default: affine)", "affine 64", "affine 4"]),
        (cache_prompt.setup_arg_parser, ["(default: mlx-community/", "(default: 5000)", "(default: 64)"]),
    ],
)
def test_help_shows_defaults(parser, defaults):
    text = " ".join(parser().format_help().split())  # undo the line wrapping
    assert all(d in text for d in defaults), text
    assert "default: None" not in text and "default: ()" not in text


def test_module_help_prints_no_import_noise():
    result = subprocess.run([sys.executable, "-m", "mlx_lm.generate", "--help"], capture_output=True, text=True,
                            timeout=120)
    assert result.returncode == 0 and result.stdout.startswith("usage: mlx_lm.generate")
    assert not any(n in result.stderr for n in NOISE), result.stderr


@pytest.mark.parametrize("command", ["", *COMMANDS])
def test_each_console_script_runs_its_command(command, monkeypatch, capsys):
    """The function setup.py names for `mlx_lm.<command>` (for "": `mlx_lm`)."""
    console = importlib.import_module("_mlx_lm_console")
    name = f"mlx_lm.{command}" if command else "mlx_lm"
    monkeypatch.setattr(sys, "argv", [name, "--help"])
    with pytest.raises(SystemExit) as exited:
        getattr(console, command or "main")()
    assert exited.value.code == 0 and capsys.readouterr().out.startswith(f"usage: {name}")
    if not command:
        monkeypatch.setattr(sys, "argv", [name, "--version"])
        console.main()
        assert capsys.readouterr().out == f"{__version__}\n"


def test_cli_errors_come_before_any_output(tiny_model_dir, capsys):
    common = ["--model", str(tiny_model_dir), "--ignore-chat-template"]
    with pytest.raises(SystemExit, match=r"^Error: The prompt is empty \(--prompt '' gives no tokens\).*--prompt -"):
        generate_main([*common, "--prompt", ""])
    with pytest.raises(SystemExit):
        generate_main([*common, "--prompt", "hi", "--max-tokens", "0"])
    out, err = capsys.readouterr()
    assert out == "" and "--max-tokens must be positive, or -1 for no limit; got 0" in err
    # An error raised while generating (here: by the library) comes before "==========".
    model, tokenizer = load(str(tiny_model_dir))
    with pytest.raises(ValueError, match="num_draft_tokens needs a draft_model"):
        generate(model, tokenizer, "hi", verbose=True, num_draft_tokens=2)
    assert capsys.readouterr().out == ""


def test_max_kv_size_with_a_cache_file_is_a_usage_error(capsys):
    with pytest.raises(SystemExit) as exited:
        generate_main(["--model", "m", "--prompt-cache-file", "c.safetensors", "--max-kv-size", "64"])
    assert exited.value.code == 2 and "size was fixed when it was made" in capsys.readouterr().err


class Terminal(io.StringIO):
    def isatty(self):
        return True


def test_convert_progress_updates_a_terminal_line_and_logs_once_to_a_pipe(monkeypatch):
    total = 3 * 2**20 + 2**19
    steps = [(2**20 * i, total) for i in range(1, 4)] + [(total, total)]
    for stream, is_terminal in ((Terminal(), True), (io.StringIO(), False)):
        monkeypatch.setattr(sys, "stderr", stream)
        print_progress("Loading", 0, 1)
        for done, size in steps:
            print_progress("Saving", done, size)
        text = stream.getvalue()
        assert text.startswith("[INFO] Loading\n")
        if is_terminal:
            assert text.count("\r") == 4 and text.endswith("\r[INFO] Saving 3.50 MB of 3.50 MB (100%)\n")
            assert "Saving 1.00 MB of 3.50 MB (28%)" in text
        else:
            assert text == "[INFO] Loading\n[INFO] Saved 3.50 MB of weights\n"


def test_format_bytes_picks_a_readable_unit():
    assert [format_bytes(n) for n in (512, 3 * 2**20 // 2, 5 * 2**30)] == ["0.50 KB", "1.50 MB", "5.00 GB"]


def test_upstream_flags_this_project_cannot_honour_are_usage_errors(capsys):
    from mlx_lm import cli

    for argv, message in ((["generate", "--prompt", "hi", "--image", "a.png", "b.png"],
                           "mlx_lm.generate: error: --image: this project loads no vision models"),):
        with pytest.raises(SystemExit) as exited:
            cli.main(argv)
        assert exited.value.code == 2 and message in capsys.readouterr().err


def test_quantize_activations_reaches_the_model_config(tmp_path, tiny_llama_dir, capsys):
    from mlx_lm.convert import convert

    convert(str(tiny_llama_dir), tmp_path / "q4", quantize=True)
    common = ["--model", str(tmp_path / "q4"), "--prompt", "hi", "--max-tokens", "2", "--verbose", "false"]
    generate_main(common)
    assert capsys.readouterr().out.strip()
    # Affine layers cannot quantize their inputs: the option reached load_model.
    with pytest.raises(SystemExit, match="quantize_activations: lm_head has mode 'affine'"):
        generate_main([*common, "--quantize-activations"])


def test_use_default_chat_template_renders_chatml_only_without_a_template(tmp_path, tiny_model_dir, capsys,
                                                                          monkeypatch):
    import json
    import shutil

    generate_module = importlib.import_module("mlx_lm.generate")  # `mlx_lm.generate` is also the function
    prompts = []
    monkeypatch.setattr(generate_module, "generate",
                        lambda model, tokenizer, prompt, **kw: prompts.append(tokenizer.decode(prompt)) or "")
    directories = []
    for name, template in (("bare", None), ("own", "{% for m in messages %}[{{ m['content'] }}]{% endfor %}")):
        directory = shutil.copytree(tiny_model_dir, tmp_path / name)
        config = json.loads((directory / "tokenizer_config.json").read_text())
        config["chat_template"] = template
        (directory / "tokenizer_config.json").write_text(json.dumps(config))
        directories.append(directory)
    for model_dir in directories:
        for flags in ([], ["--use-default-chat-template"]):
            generate_main(["--model", str(model_dir), "--prompt", "hi", "--verbose", "false", *flags])
    assert prompts == ["hi", "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n", "[hi]", "[hi]"]


def test_generate_refuses_a_draft_whose_tokenizer_differs(tmp_path, tiny_model_dir):
    """The draft's tokenizer is checked against the target's whatever the other flags
    (the check once sat under --use-default-chat-template and ran only with it)."""
    import json
    import shutil

    swapped = shutil.copytree(tiny_model_dir, tmp_path / "swapped")
    tokenizer = json.loads((swapped / "tokenizer.json").read_text())
    vocab = tokenizer["model"]["vocab"]
    first, second = [token for token, i in vocab.items() if i in (300, 301)]
    vocab[first], vocab[second] = vocab[second], vocab[first]
    (swapped / "tokenizer.json").write_text(json.dumps(tokenizer))
    for flags in ([], ["--use-default-chat-template"]):
        with pytest.raises(SystemExit, match="differs from the target's"):
            generate_main(["--model", str(tiny_model_dir), "--draft-model", str(swapped), "--prompt", "hi",
                           "--max-tokens", "2", "--verbose", "false", *flags])
