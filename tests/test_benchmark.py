"""mlx_lm.benchmark: the rows it prints, plain and speculative, and its usage errors; on
2 local ranks (tensor parallel and --pipeline) rank 0 alone prints one table."""

import json
import math
import re
import shutil
import sys

import pytest

from checkpoints import TINY_CONFIGS, write_checkpoint
from mlx_lm import load, stream_generate
from mlx_lm import benchmark
from mlx_lm.benchmark import main, random_prompt, random_prompts
from ranks import run_ranks

ROW = re.compile(r"^(Trial \d+|Averages):  ?(?:(plain|speculative): )?(.*)$")


def parse_rows(text):
    """{(row name, label): {key: value}} of the Trial and Averages lines."""
    rows = {}
    for line in text.splitlines():
        match = ROW.match(line)
        if match:
            name, label, values = match.groups()
            rows[(name, label)] = {k: float(v) for k, v in (item.split("=") for item in values.split(", "))}
    return rows


def check_plausible(values):
    assert all(math.isfinite(v) and v > 0 for k, v in values.items() if k != "acceptance"), values
    assert values["peak_memory"] < 1.0  # GB; a tiny model


@pytest.fixture(scope="module")
def noisy_draft_dir(tmp_path_factory):
    return write_checkpoint(tmp_path_factory.mktemp("noisy_draft"), TINY_CONFIGS["qwen3"], noise=0.02)


def test_prints_each_trial_and_the_averages(tiny_model_dir, capsys):
    main(["--model", str(tiny_model_dir), "-p", "16", "-g", "8", "-n", "3"])
    out = capsys.readouterr().out
    assert out.startswith("Running warmup..\nTiming with prompt_tokens=16, generation_tokens=8.\n")
    rows = parse_rows(out)
    assert sorted(rows) == [("Averages", None), ("Trial 1", None), ("Trial 2", None), ("Trial 3", None)]
    for values in rows.values():
        assert list(values) == ["prompt_tps", "generation_tps", "peak_memory"]
        check_plausible(values)
    for key, mean in rows[("Averages", None)].items():
        assert mean == pytest.approx(sum(rows[(f"Trial {i}", None)][key] for i in (1, 2, 3)) / 3, abs=2e-3)


def test_with_a_draft_prints_plain_and_speculative_rows(tiny_model_dir, noisy_draft_dir, capsys):
    main(["--model", str(tiny_model_dir), "--draft-model", str(noisy_draft_dir), "--num-draft-tokens", "2",
          "--prompt-tokens", "16", "--generation-tokens", "12", "--num-trials", "2"])
    out = capsys.readouterr().out
    assert f"draft_model={noisy_draft_dir}, num_draft_tokens=2.\n" in out
    rows = parse_rows(out)
    assert len(rows) == 6
    for (name, label), values in rows.items():
        check_plausible(values)
        if label == "speculative":
            assert 0 <= values["acceptance"] <= 1 and 1 <= values["tokens_per_forward"] <= 3
        else:
            assert "acceptance" not in values
    plain, spec = rows[("Averages", "plain")], rows[("Averages", "speculative")]
    ratio = float(re.search(r"^Speculative / plain generation_tps: (\S+)$", out, re.MULTILINE).group(1))
    assert ratio == pytest.approx(spec["generation_tps"] / plain["generation_tps"], rel=1e-2)


def test_eos_does_not_cut_a_trial_short(tiny_model_dir, tmp_path, capsys):
    """A model whose first greedy token after the benchmark's prompt is its EOS still
    generates all -g tokens (the benchmark would raise otherwise)."""
    model, tokenizer = load(str(tiny_model_dir))
    first = next(stream_generate(model, tokenizer, random_prompt(model, 16, 0), max_tokens=1)).token
    model_dir = shutil.copytree(tiny_model_dir, tmp_path / "eos_first")
    config = json.loads((model_dir / "config.json").read_text())
    (model_dir / "config.json").write_text(json.dumps({**config, "eos_token_id": first}))
    main(["--model", str(model_dir), "-p", "16", "-g", "6", "-n", "1"])
    assert "Averages: prompt_tps=" in capsys.readouterr().out


def test_a_batch_trial_generates_every_prompt_together(tiny_model_dir, capsys):
    main(["--model", str(tiny_model_dir), "-p", "12", "-g", "5", "-n", "2", "--batch-size", "3",
          "--prefill-step-size", "4"])
    out = capsys.readouterr().out
    assert "Timing with prompt_tokens=12, generation_tokens=5, batch_size=3.\n" in out
    rows = parse_rows(out)
    assert sorted(rows) == [("Averages", None), ("Trial 1", None), ("Trial 2", None)]
    for values in rows.values():
        assert list(values) == ["prompt_tps", "generation_tps", "peak_memory"]
        check_plausible(values)


def test_a_batch_speculates_with_a_draft(tiny_model_dir, noisy_draft_dir, capsys):
    main(["--model", str(tiny_model_dir), "--draft-model", str(noisy_draft_dir), "-b", "2",
          "-p", "8", "-g", "6", "-n", "1"])
    rows = parse_rows(capsys.readouterr().out)
    assert sorted(rows) == [("Averages", "plain"), ("Averages", "speculative"),
                            ("Trial 1", "plain"), ("Trial 1", "speculative")]


def test_batch_prompts_are_distinct_and_seeded(tiny_model_dir):
    model, _ = load(str(tiny_model_dir))
    prompts = random_prompts(model, 3, 10, seed=4)
    assert len(prompts) == 3 and all(len(p) == 10 for p in prompts) and prompts[0] != prompts[1]
    assert random_prompts(model, 3, 10, seed=4) == prompts
    assert random_prompt(model, 10, seed=4) == random_prompts(model, 1, 10, seed=4)[0]


def test_delay_sleeps_before_each_trial(tiny_model_dir, monkeypatch, capsys):
    sleeps = []
    monkeypatch.setattr(benchmark.time, "sleep", sleeps.append)
    main(["--model", str(tiny_model_dir), "-p", "4", "-g", "2", "-n", "3", "--delay", "1.5"])
    assert sleeps == [1.5, 1.5, 1.5]


def test_quantize_activations_applies_to_the_loaded_model(tiny_model_dir, monkeypatch, capsys):
    quantized = []
    monkeypatch.setattr(benchmark, "quantize_activations", quantized.append)
    main(["--model", str(tiny_model_dir), "-p", "4", "-g", "2", "-n", "1", "-qa"])
    assert len(quantized) == 1 and hasattr(quantized[0], "layers")


@pytest.mark.parametrize("argv, message", [
    (["--delay", "-1"], "argument --delay: expected a number of seconds >= 0, got '-1'"),
    (["-b", "0"], "argument --batch-size/-b: expected a positive integer, got 0"),
    (["-p", "0"], "argument --prompt-tokens/-p: expected a positive integer, got 0"),
    (["-g", "-3"], "argument --generation-tokens/-g: expected a positive integer, got -3"),
    (["-n", "many"], "argument --num-trials/-n: invalid positive_int value: 'many'"),
    (["--num-draft-tokens", "4"], "--num-draft-tokens 4 needs --draft-model"),
])
def test_bad_flag_values_are_usage_errors(argv, message, capsys):
    with pytest.raises(SystemExit) as exited:
        main(argv)
    assert exited.value.code == 2 and message in capsys.readouterr().err


def test_mlx_lm_benchmark_dispatches_here(monkeypatch, capsys):
    from mlx_lm import cli

    monkeypatch.setattr(sys, "argv", list(sys.argv))  # the dispatcher rewrites it
    with pytest.raises(SystemExit):
        cli.main(["benchmark", "--num-draft-tokens", "4"])
    assert "mlx_lm.benchmark: error: --num-draft-tokens 4 needs --draft-model" in capsys.readouterr().err


def test_a_missing_model_is_an_error_naming_it(tmp_path):
    with pytest.raises(SystemExit, match=f"^Error: Model path '{tmp_path / 'none'}' does not exist"):
        main(["--model", str(tmp_path / "none"), "-p", "4", "-g", "2", "-n", "1"])


@pytest.mark.parametrize("split", ["tensor", "pipeline"])
def test_two_ranks_print_one_table_from_rank_0(split, tiny_llama_dir, tmp_path):
    """With a draft under --pipeline (pinned draft length on every rank), plain with tensor parallel."""
    extra = ["--pipeline", "--draft-model", str(write_checkpoint(tmp_path / "draft", TINY_CONFIGS["llama"], seed=1,
                                                                  noise=0.02))] if split == "pipeline" else []
    ranks = run_ranks([sys.executable, "-m", "mlx_lm.benchmark", "--model", str(tiny_llama_dir), "-p", "8", "-g", "4",
                       "-n", "2", *extra], timeout=180)
    assert [r.returncode for r in ranks] == [0, 0], [r.stderr[-2000:] for r in ranks]
    assert ranks[1].stdout == ""
    out = ranks[0].stdout
    assert out.startswith(f"{split.capitalize()} parallel over 2 ranks: ") and "Running warmup..\n" in out
    labels = ["plain", "speculative"] if extra else [None]
    rows = parse_rows(out)
    assert sorted(rows) == sorted((name, label) for name in ("Averages", "Trial 1", "Trial 2") for label in labels)
    for values in rows.values():
        check_plausible(values)
    if extra:
        assert "adaptive_draft_length=False." in out and "Speculative / plain generation_tps: " in out
