"""Pipeline parallelism (models/pipeline.py, utils.sharded_load(pipeline_group=...)):
the layer split and its errors in one process; then, on 2 local ranks (ring backend,
one launch: each costs seconds of imports), every supported family's pipelined greedy
tokens (chunked prefill, bounded and 8-bit KV caches, a batch, speculation with a whole
draft), logits and rewound caches equal one process's, loading never holds another
rank's layers, mlx_lm.generate --pipeline prints what one process prints (on rank 0
only), mlx_lm.server --pipeline answers as one process, and a dying rank ends the other.
"""

import contextlib
import io
import json
import sys
from types import SimpleNamespace

import pytest

from checkpoints import TINY_CONFIGS, write_checkpoint
from mlx_lm.generate import generate
from mlx_lm.generate import main as generate_main
from mlx_lm.models import pipeline
from mlx_lm.utils import get_model_classes, load, sharded_load
from ranks import ROOT, run_ranks, start_ranks
from test_distributed import post, wait_for_url
from test_deepseek_v2 import FAMILY as DEEPSEEK_V2
from test_deepseek_v3 import FAMILY as DEEPSEEK_V3
from test_glm4_moe import FAMILY as GLM4_MOE
from test_ministral3 import FAMILY as MINISTRAL3
from test_qwen3_moe import TINY_MOE

WORKER = str(ROOT / "tests" / "pipeline_worker.py")
# Longer than two prefill chunks of PREFILL_STEP_SIZE.
PROMPT = [5, 9, 33, 7, 100, 3, 5, 9, 33, 7, 12, 40, 41, 5, 9, 33, 8, 2]
PREFILL_STEP_SIZE = 5
# Three GDN layers, then attention: rank 1 (layers 0, 1) holds no attention, and sends
# from a recurrent layer's cache.
HYBRID_TEXT = dict(TINY_CONFIGS["qwen3_next"], model_type="qwen3_5_text", num_experts=0, full_attention_interval=4)
# Model type -> tiny config of 3 or 4 layers: rank 0 holds two, rank 1 one or two (with
# first_k_dense_replace=1 and mlp_only_layers=[1], dense and MoE layers on both).
CONFIGS = {
    "qwen3_next": TINY_CONFIGS["qwen3_next"],
    # Heads of 32: 8-bit KV caches quantize them in groups of 32.
    "llama": dict(TINY_CONFIGS["llama"], num_hidden_layers=3, num_attention_heads=2, num_key_value_heads=1),
    "qwen2": dict(TINY_CONFIGS["llama"], model_type="qwen2", num_hidden_layers=3),
    "qwen3_moe": TINY_MOE,
    "deepseek_v3": dict(DEEPSEEK_V3.tiny, num_hidden_layers=3),
    "glm4_moe": dict(GLM4_MOE.tiny, num_hidden_layers=3, first_k_dense_replace=1),
    "qwen3_5": {"model_type": "qwen3_5", "text_config": HYBRID_TEXT, "vocab_size": HYBRID_TEXT["vocab_size"]},
    "ministral3": dict(MINISTRAL3.tiny, num_hidden_layers=3),
    "deepseek_v2": dict(DEEPSEEK_V2.tiny, num_hidden_layers=3),
}


def fake_group(size, rank):
    """Rank and size only: enough to plan a split, never to exchange."""
    return SimpleNamespace(size=lambda: size, rank=lambda: rank)


def test_default_split_gives_the_low_ranks_the_remainder():
    assert pipeline.layer_counts(7, 3) == [3, 2, 2]
    assert pipeline.layer_counts(4, 2, split=[1, 3]) == [1, 3]


def test_the_last_rank_holds_the_first_layers():
    stages = [pipeline.plan_stage(5, fake_group(2, rank)) for rank in (0, 1)]
    assert [(s.start, s.end) for s in stages] == [(2, 5), (0, 2)]
    assert [(s.receives, s.sends) for s in stages] == [(True, False), (False, True)]


def test_more_ranks_than_layers_is_a_clear_error():
    with pytest.raises(ValueError, match=r"cannot split 4 layers across 5 ranks.*at most 4 ranks"):
        pipeline.layer_counts(4, 5)


@pytest.mark.parametrize("split, message", [
    ([4], r"split \[4\] has 1 entries for 2 ranks"),
    ([3, 0], r"split \[3, 0\]: the counts must be positive and sum to the model's 4 layers"),
    ([2, 3], r"split \[2, 3\]: the counts must be positive and sum to the model's 4 layers"),
])
def test_a_split_that_does_not_fit_is_a_clear_error(split, message):
    with pytest.raises(ValueError, match=message):
        pipeline.layer_counts(4, 2, split)


def tiny_model(family):
    model_class, args_class = get_model_classes(CONFIGS[family])
    return model_class(args_class.from_dict(CONFIGS[family]))


@pytest.mark.parametrize("family", CONFIGS)
def test_a_rank_keeps_only_its_layers_and_their_caches(family):
    model = tiny_model(family)
    first = model.layers[: len(model.layers) // 2]  # rank 1's: the first layers, the smaller half
    model.model.pipeline(fake_group(2, 1))
    assert [id(l) for l in model.layers] == [id(l) for l in first] and len(model.make_cache()) == len(first)
    with pytest.raises(ValueError, match="already pipelined over 2 ranks"):
        model.model.pipeline(fake_group(2, 1))


def test_every_listed_family_takes_a_pipeline_and_runs_on_two_ranks_below():
    assert set(CONFIGS) == set(pipeline.FAMILIES)
    for family in CONFIGS:
        assert isinstance(pipeline.pipelined_backbone(tiny_model(family), family), pipeline.PipelineMixin), family


def test_an_unsupported_family_is_a_clear_error(tmp_path):
    directory = write_checkpoint(tmp_path / "gpt_oss", TINY_CONFIGS["gpt_oss"])
    with pytest.raises(ValueError, match=r"model type 'gpt_oss' does not support pipeline parallelism; "
                                         r"supported: qwen3_next, llama, qwen2, "):
        sharded_load(str(directory), pipeline_group=fake_group(2, 0))


def test_both_groups_at_once_is_a_clear_error(tmp_path):
    with pytest.raises(ValueError, match="pipeline_group or tensor_group, not both"):
        sharded_load(str(tmp_path), pipeline_group=fake_group(2, 0), tensor_group=fake_group(2, 0))


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("pipeline")
    return {
        family: [str(write_checkpoint(root / family, config, seed=1)),
                 str(write_checkpoint(root / f"{family}_draft", config, seed=1, noise=0.02))]
        for family, config in CONFIGS.items()
    }


def cli_args(checkpoints):
    target, draft = checkpoints["qwen3_next"]
    return ["--model", target, "--draft-model", draft, "-p", "hello hello", "-m", "12", "--verbose", "false",
            "--ignore-chat-template", "--prefill-step-size", "2"]


def test_two_ranks_match_one_process(checkpoints, tmp_path):
    spec = dict(out=str(tmp_path), prompt=PROMPT, max_tokens=10, prefill_step_size=PREFILL_STEP_SIZE,
                families=checkpoints, quantized_kv={"llama": 32}, cli=cli_args(checkpoints) + ["--pipeline"])
    ranks = run_ranks([sys.executable, WORKER, json.dumps(spec)], timeout=300)
    assert [r.returncode for r in ranks] == [0, 0], [r.stderr[-2000:] for r in ranks]
    per_rank = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]
    for family in CONFIGS:
        for got in (per_rank[0][family], per_rank[1][family]):
            for run in ("plain", "speculative", "bounded", "batched") + ("quantized_kv",) * (family == "llama"):
                whole, pipelined = got[run]
                assert pipelined == whole, (family, run)
            assert got["logit_differences"] == [0.0, 0.0], family  # each layer runs once, on the same inputs
            assert got["rewound_difference"] == 0.0, family
            whole_bytes, rank_bytes, load_peak, other_layer = got["bytes"]
            # Loading never held another rank's layer: this rank's weights and less than one more.
            assert rank_bytes < whole_bytes and load_peak < rank_bytes + other_layer, (family, got["bytes"])
        held = [per_rank[r][family]["held_layers"] for r in (0, 1)]  # [held, cache entries, whole model's]
        layers = held[0][2]
        assert layers in (3, 4) and [h[0] for h in held] == [layers - layers // 2, layers // 2], family
        assert all(h[1] == h[0] for h in held), family
    single = io.StringIO()
    with contextlib.redirect_stdout(single):
        generate_main(cli_args(checkpoints))
    assert (tmp_path / "cli0.txt").read_text() == single.getvalue() and single.getvalue().strip()
    assert (tmp_path / "cli1.txt").read_text() == ""


def test_server_on_two_ranks_answers_as_one_process(checkpoints):
    target, draft = checkpoints["qwen3_next"]
    ranks = start_ranks([sys.executable, "-m", "mlx_lm.server", "--model", target, "--draft-model", draft,
                         "--port", "0", "--pipeline", "--prefill-step-size", "2"])
    body = {"prompt": "hello hello", "max_tokens": 10, "temperature": 0}
    try:
        url = wait_for_url(ranks)
        replies = [post(url, "/v1/completions", body) for _ in range(2)]  # the second from the prompt cache
    finally:
        for p in ranks.processes:
            p.kill()
    assert [status for status, _ in replies] == [200, 200], replies
    expected = generate(*load(target), "hello hello", max_tokens=10)
    assert [json.loads(text)["choices"][0]["text"] for _, text in replies] == [expected, expected]
    assert "Pipeline parallel over 2 ranks: 2 decoder layers on rank 0" in ranks.stderr(0)
    assert "Serving" not in ranks.stderr(1)  # only rank 0 serves


@pytest.mark.parametrize("victim", [0, 1])
def test_a_dying_rank_ends_the_other_with_a_clear_error(victim):
    """Rank 1 waits on rank 0 only in the gather, rank 0 on rank 1 in every receive."""
    spec = dict(victim=victim, prompt=PROMPT, config=TINY_CONFIGS["qwen3_next"])
    ranks = run_ranks([sys.executable, WORKER, json.dumps(spec)], timeout=60, stop_others_on_failure=False)
    survivor = 1 - victim
    assert ranks[victim].returncode == 3
    assert ranks[survivor].returncode == 1, ranks[survivor].stderr[-2000:]  # by itself, not the timeout
    assert f"Error: rank {survivor} of 2 stopped" in ranks[survivor].stderr
