"""Prefix reuse through the server's workers (issue 33): a prompt sharing a prefix with
a cached hybrid (Gated DeltaNet) prompt resumes at its nearest snapshot and answers as
a cold server does, greedy and seeded-sampled, with and without a draft model (dense
or itself hybrid), one request at a time and in the batch."""

import numpy as np
import pytest
from checkpoints import TINY_CONFIGS, write_checkpoint
from server_harness import write_server_models

from mlx_lm.openai_api import ServerDefaults, parse_request
from mlx_lm.serving import BatchWorker, GenerationWorker, ModelProvider

STEP = 8
MAX_TOKENS = 8


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("reuse_models")
    dirs = write_server_models(root)  # "hybrid" (Gated DeltaNet), "draft" (dense)
    dirs["hybrid_draft"] = write_checkpoint(root / "hybrid_draft", TINY_CONFIGS["qwen3_next"], noise=0.5)
    return dirs


def ids(seed, n):
    return np.random.default_rng(seed).integers(1, 512, n).tolist()


DOCUMENT = ids(0, 37)
FIRST, SECOND = DOCUMENT + ids(1, 6), DOCUMENT + ids(2, 9)  # share 37 tokens: resume at 32


def make_worker(model_dirs, kind, draft):
    provider = ModelProvider(str(model_dirs["hybrid"]), draft and str(model_dirs[draft]), False, 10, 1 << 40, None)
    if kind == "batch":
        return BatchWorker(provider, prefill_step_size=STEP, max_batch_size=2)
    return GenerationWorker(provider, prefill_step_size=STEP)


def answer(worker, prompt, **sampling):
    body = {"prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0, **sampling}
    job = worker.provider.make_job(parse_request(body, "text", ServerDefaults(max_tokens=MAX_TOKENS)))
    if isinstance(worker, BatchWorker):
        worker.submit(job)
        worker._take_jobs(wait=False)
        while worker.streams or worker.backlog:
            worker._admit()
            worker.step()
    else:
        worker.run(job)
    events = []
    while not job.events.empty():
        events.append(job.events.get())
    assert events[-1][0] == "done", events[-1]
    return events[-1][1]


@pytest.mark.parametrize("kind", ["one_at_a_time", "batch"])
@pytest.mark.parametrize("draft", [None, "draft", "hybrid_draft"])
def test_a_shared_prefix_resumes_at_a_snapshot_and_answers_as_cold(model_dirs, kind, draft):
    warm = make_worker(model_dirs, kind, draft)
    answer(warm, FIRST)
    greedy = answer(warm, SECOND)
    assert greedy.cached_tokens == 32  # the snapshot at or before the 37 shared tokens
    edited = SECOND[:42] + [5, 6, 7]
    sampled = answer(warm, edited, temperature=1.0, seed=3)
    assert sampled.cached_tokens == 40  # SECOND's prefill, resumed on the grid, took one there
    cold = make_worker(model_dirs, kind, draft)
    assert answer(cold, SECOND).text == greedy.text
    cold.provider.default.prompt_cache.trim_to(n_sequences=0)
    cold_sampled = answer(cold, edited, temperature=1.0, seed=3)
    assert cold_sampled.cached_tokens == 0 and cold_sampled.text == sampled.text
    lru = warm.provider.default.prompt_cache
    assert lru.nbytes <= lru.max_bytes
