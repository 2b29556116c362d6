"""Tensor-parallel sharding over 2 local ranks (ring backend): each rank holds about half
of the decoder weights; greedy plain, speculative and prompt-lookup outputs equal one
process for a dense (llama), a sliding-window-with-sinks MoE (gpt_oss) and a hybrid
GDN (qwen3_next) target; mlx_lm.generate shards by itself and only rank 0 prints (all in one launch:
each costs seconds of imports); a
rank that dies ends the others with a clear error. Every run is bounded by a timeout.
"""

import contextlib
import http.client
import io
import json
import os
import re
import socket
import subprocess
import sys
import time

import mlx.core as mx
import numpy as np
import pytest

from checkpoints import TINY_CONFIGS, write_checkpoint
from family_checks import family_specs
from mlx_lm.generate import generate
from mlx_lm.generate import main as generate_main
from mlx_lm.models import sharding
from mlx_lm.utils import load
from ranks import ROOT, free_ports, run_ranks, start_ranks

WORKER = str(ROOT / "tests" / "distributed_worker.py")
# Repeats, so prompt lookup finds matches; longer than gpt_oss's window of 8.
PROMPT = [5, 9, 33, 7, 100, 3, 5, 9, 33, 7, 12, 40, 41, 5, 9, 33]
FAMILIES = ("llama", "gpt_oss", "qwen3_next")
# Every other family, and quantized layers, checked by logits: [config, quantize].
HYBRID_TEXT = dict(TINY_CONFIGS["qwen3_next"], model_type="qwen3_5_text")
LOGIT_CONFIGS = {
    "qwen3": [TINY_CONFIGS["qwen3"], False],
    "qwen3_moe": [dict(model_type="qwen3_moe", hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_experts=4,
                       num_experts_per_tok=2, moe_intermediate_size=64, mlp_only_layers=[1], vocab_size=256), True],
    "phi3": [dict(model_type="phi3", hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, vocab_size=256, max_position_embeddings=128, sliding_window=8), False],
    "gemma3_text": [dict(model_type="gemma3_text", hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=16, query_pre_attn_scalar=16,
                         sliding_window=8, sliding_window_pattern=2, vocab_size=256), False],
    "lfm2": [dict(model_type="lfm2", vocab_size=256, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, intermediate_size=128, block_auto_adjust_ff_dim=False, conv_bias=True,
                  layer_types=["conv", "full_attention"]), False],
    "qwen3_5": [{"model_type": "qwen3_5", "text_config": dict(HYBRID_TEXT, num_experts=0)}, False],
    "qwen3_5_moe": [{"model_type": "qwen3_5_moe", "text_config": HYBRID_TEXT}, False],
    "llama_quantized": [dict(TINY_CONFIGS["llama"], vocab_size=256), True],
    "nemotron_h_quantized": [dict(model_type="nemotron_h", vocab_size=256, hidden_size=64, num_attention_heads=4,
                                  num_key_value_heads=2, head_dim=16, mamba_num_heads=8, mamba_head_dim=8,
                                  ssm_state_size=16, n_groups=2, intermediate_size=128, hybrid_override_pattern="M*ME",
                                  n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=64,
                                  moe_shared_expert_intermediate_size=64), True],
    "falcon_h1": [dict(model_type="falcon_h1", vocab_size=256, hidden_size=64, intermediate_size=128,
                       num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, mamba_d_ssm=64,
                       mamba_n_heads=8, mamba_n_groups=2, mamba_d_state=16, mamba_rms_norm=True,
                       ssm_multipliers=[0.5, 1.2, 0.8, 1.1, 0.9]), False],
}

# The families with a shared-checks module (family_checks.py), by their tiny configs.
LOGIT_CONFIGS.update({name: [family.tiny, False] for name, family in family_specs().items()})


class FakeGroup:
    def __init__(self, size, rank):
        self._size, self._rank = size, rank

    def size(self):
        return self._size

    def rank(self):
        return self._rank


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("dist")
    return {
        name: [str(write_checkpoint(root / name, TINY_CONFIGS[name], seed=1)),
               str(write_checkpoint(root / f"{name}_draft", TINY_CONFIGS[name], seed=1, noise=0.02))]
        for name in FAMILIES
    }


def worker(mode, targets, tmp_path, max_tokens, cli=None, **kwargs):
    spec = dict(mode=mode, out=str(tmp_path), prompt=PROMPT, max_tokens=max_tokens, targets=targets, cli=cli,
                configs=LOGIT_CONFIGS)
    return run_ranks([sys.executable, WORKER, json.dumps(spec)], **kwargs)


def test_take_shard_keeps_each_pieces_block():
    x = mx.arange(24).reshape(12, 2)
    pieces = [4, 8]  # [a (4) | b (4) | c (4)] along axis 0
    got = [np.array(sharding.take_shard(x, FakeGroup(2, r), axis=0, segments=pieces)) for r in (0, 1)]
    ref = np.arange(24).reshape(12, 2)
    np.testing.assert_array_equal(got[0], ref[[0, 1, 4, 5, 8, 9]])
    np.testing.assert_array_equal(got[1], ref[[2, 3, 6, 7, 10, 11]])
    np.testing.assert_array_equal(np.array(sharding.take_shard(x, FakeGroup(3, 2), axis=0)), ref[8:])


def test_per_rank_refuses_uneven_split():
    assert sharding.per_rank(8, FakeGroup(2, 0), "num_attention_heads") == 4
    with pytest.raises(ValueError, match=r"num_key_value_heads \(3\) is not divisible by the 2 ranks"):
        sharding.per_rank(3, FakeGroup(2, 0), "num_key_value_heads")


def cli_args(checkpoints):
    target, draft = checkpoints["qwen3_next"]
    return ["--model", target, "--draft-model", draft, "-p", "hello hello", "-m", "12", "--verbose", "false",
            "--ignore-chat-template"]


def test_two_ranks_match_one_process(checkpoints, tmp_path):
    """One launch for everything (each costs seconds of imports): the library calls,
    then mlx_lm.generate's main on the hybrid target with a hybrid draft. Its limit
    only catches a hang: every family's sharded logits run in it, on a shared host."""
    ranks = worker("match", checkpoints, tmp_path, max_tokens=12, timeout=480, cli=cli_args(checkpoints))
    assert [r.returncode for r in ranks] == [0, 0], [r.stderr[-2000:] for r in ranks]
    per_rank = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]
    for name in FAMILIES:
        r0, r1 = per_rank[0][name], per_rank[1][name]
        for got in (r0, r1):
            assert got["plain"] == got["one_process"], name
            assert got["speculative"] == got["one_process"], name
            assert got["lookup"] == got["one_process"], name
            full_layers, rank_layers = got["layer_bytes"]
            assert 0.48 < rank_layers / full_layers < 0.53, (name, rank_layers / full_layers)
            full_bytes, rank_bytes = got["bytes"]
            # sharded_load never held the whole checkpoint: at most its shard plus one full layer.
            assert got["load_peak"] <= rank_bytes + got["largest_layer"], (name, got["load_peak"])
            assert got["load_peak"] < full_bytes, (name, got["load_peak"], full_bytes)
            assert got["cache_difference"] < 1e-4, (name, got["cache_difference"])  # every shard rolled back
        accepted, drafted = r0["speculative_counts"]
        assert 0 < accepted < drafted, (name, accepted, drafted)  # rejections: rollbacks ran
        assert r0["sampled"] == r1["sampled"], name  # identical decisions under sampling
        assert r0["speculative_counts"] == r1["speculative_counts"], name
    assert per_rank[0]["shared_seed"] == per_rank[1]["shared_seed"]
    for name in LOGIT_CONFIGS:
        for got in (per_rank[0]["logits"][name], per_rank[1]["logits"][name]):
            assert max(got["errors"]) < 1e-4, (name, got["errors"])  # float32: the sum's order differs
            full_layers, rank_layers = got["layer_bytes"]
            assert 0.45 < rank_layers / full_layers < 0.55, (name, rank_layers / full_layers)
    # The command line sharded by itself, printed on rank 0 only, and printed what one process prints.
    single = io.StringIO()
    with contextlib.redirect_stdout(single):
        generate_main(cli_args(checkpoints))
    assert (tmp_path / "cli0.txt").read_text() == single.getvalue() and single.getvalue().strip()
    assert (tmp_path / "cli1.txt").read_text() == ""


def test_through_mlx_launch(tmp_path):
    """The real launcher once (ring backend, 2 local ranks), with light imports: it is
    slow on few cores (tests/ranks.py says why), so the other tests start ranks alike
    without it."""
    port = free_ports(1)[0]
    spec = dict(mode="launched", out=str(tmp_path), prompt=PROMPT, config=TINY_CONFIGS["llama"])
    command = ["mlx.launch", "--backend", "ring", "-n", "2", "--starting-port", str(port),
               "--python", sys.executable, "--", WORKER, json.dumps(spec)]
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=90,
                          env=dict(os.environ, PYTHONPATH=str(ROOT)))
    assert done.returncode == 0, done.stderr[-2000:]
    for got in [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]:
        assert got["size"] == 2 and got["error"] < 1e-4, got
        full_layers, rank_layers = got["layer_bytes"]
        assert 0.48 < rank_layers / full_layers < 0.53


def test_a_dying_rank_ends_the_others_with_a_clear_error():
    spec = dict(mode="die", prompt=PROMPT, max_tokens=100000, config=TINY_CONFIGS["qwen3_next"])
    ranks = run_ranks([sys.executable, WORKER, json.dumps(spec)], timeout=60, stop_others_on_failure=False)
    assert ranks[1].returncode == 3
    assert ranks[0].returncode == 1, ranks[0].stderr[-2000:]  # ended by itself, not by the timeout
    assert "Error: rank 0 of 2 stopped" in ranks[0].stderr
    assert "Another rank probably failed" in ranks[0].stderr


def post(url, path, body):
    host, port = url[len("http://"):].split(":")
    connection = http.client.HTTPConnection(host, int(port), timeout=20)
    connection.request("POST", path, body=json.dumps(body), headers={"Content-Type": "application/json"})
    response = connection.getresponse()
    status, data = response.status, response.read()
    connection.close()
    return status, data.decode()


def disconnect_mid_stream(url, body):
    """Read the start of a stream, then hang up."""
    host, port = url[len("http://"):].split(":")
    data = json.dumps(body).encode()
    with socket.create_connection((host, int(port)), timeout=20) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Content-Length: %d\r\n\r\n%s" % (len(data), data))
        received = b""
        while received.count(b"data: {") < 3:
            received += sock.recv(4096)


def wait_for_url(ranks, timeout=60.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        match = re.search(r"on (http://[\d.]+:\d+)", ranks.stderr(0))
        if match:
            return match.group(1)
        assert all(p.poll() is None for p in ranks.processes), [ranks.stderr(r)[-2000:] for r in (0, 1)]
        time.sleep(0.1)
    pytest.fail(f"server did not start: {ranks.stderr(0)[-2000:]}")


def test_server_on_two_ranks_answers_as_one_process_and_ends_when_a_rank_dies(checkpoints):
    target, draft = checkpoints["qwen3_next"]
    ranks = start_ranks([sys.executable, "-m", "mlx_lm.server", "--model", target, "--draft-model", draft,
                         "--port", "0"])
    try:
        url = wait_for_url(ranks)
        model, tokenizer = load(target)
        expected = generate(model, tokenizer, "hello hello", max_tokens=10)
        body = {"prompt": "hello hello", "max_tokens": 10, "temperature": 0}
        for _ in range(2):  # the second from the prompt cache
            status, text = post(url, "/v1/completions", body)
            assert status == 200, text
            assert json.loads(text)["choices"][0]["text"] == expected
        status, text = post(url, "/v1/completions", dict(body, stream=True))
        deltas = [json.loads(line[6:]) for line in text.splitlines() if line.startswith("data: {")]
        assert "".join(d["choices"][0]["text"] for d in deltas if d["choices"]) == expected
        disconnect_mid_stream(url, dict(body, max_tokens=5000, stream=True))
        status, text = post(url, "/v1/completions", body)  # the ranks stopped that job at the same token
        assert status == 200 and json.loads(text)["choices"][0]["text"] == expected, text
        assert "Client disconnected; stopped after" in ranks.stderr(0)
        assert "Serving" not in ranks.stderr(1)  # only rank 0 serves and logs requests
        ranks.processes[1].kill()
        with contextlib.suppress(OSError, http.client.HTTPException):
            post(url, "/v1/completions", body)
        results = ranks.wait(timeout=30, stop_others_on_failure=False)
    finally:
        for p in ranks.processes:
            p.kill()
    assert results[0].returncode == 1, results[0].stderr[-2000:]  # ended by itself, not by the timeout
    assert "Error: rank 0 of 2 stopped serving" in results[0].stderr


def test_a_deadline_ends_a_rank_that_waits_for_a_lost_peer():
    """distributed.deadline: a block that outlives it exits the rank (1), naming what
    it waited for; one that finishes in time cancels it."""
    code = ("import time, types\n"
            "from mlx_lm import distributed\n"
            "group = types.SimpleNamespace(rank=lambda: 0, size=lambda: 2)\n"
            "with distributed.deadline(5, 'a quick one', group):\n"
            "    pass\n"
            "with distributed.deadline(0.2, 'sending the line', group):\n"
            "    time.sleep(30)\n")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert result.returncode == 1
    assert "Error: rank 0 of 2 stopped: sending the line took over 0.2 s" in result.stderr
    assert "a quick one" not in result.stderr
