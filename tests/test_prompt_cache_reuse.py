"""Prefix reuse through the server's workers (issue 33): a prompt sharing a prefix with
a cached hybrid (Gated DeltaNet) prompt resumes at its nearest snapshot and answers as
a cold server does, greedy and seeded-sampled, with and without a draft model (dense
or itself hybrid), one request at a time and in the batch; a chat resumes at the end
of the messages it shares with a cached one."""

import numpy as np
import pytest
from checkpoints import TINY_CONFIGS, write_checkpoint
from server_harness import write_server_models

from mlx_lm.models.checkpoints import CheckpointedCache
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


def make_worker(model_dirs, kind, draft, step=STEP):
    provider = ModelProvider(str(model_dirs["hybrid"]), draft and str(model_dirs[draft]), False, 10, 1 << 40, None)
    if kind == "batch":
        return BatchWorker(provider, prefill_step_size=step, max_batch_size=2)
    return GenerationWorker(provider, prefill_step_size=step)


def answer(worker, prompt, **sampling):
    body = {"prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0, **sampling}
    return run_job(worker, worker.provider.make_job(parse_request(body, "text", ServerDefaults(max_tokens=MAX_TOKENS))))


def run_job(worker, job):
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


SYSTEM = "Answer from this document only. " + "The quick brown fox jumps over the lazy dog. " * 3


def chat_answer(worker, messages):
    body = {"messages": messages, "max_tokens": MAX_TOKENS, "temperature": 0}
    job = worker.provider.make_job(parse_request(body, "chat", ServerDefaults(max_tokens=MAX_TOKENS)))
    return job, run_job(worker, job)


@pytest.mark.parametrize("kind", ["one_at_a_time", "batch"])
def test_a_second_chat_resumes_at_the_message_boundary(model_dirs, kind):
    """Two chats sharing a system message: the second resumes where the template's
    rendering of it ends (off the step grid), and answers as a cold server does. The
    first kept a snapshot at the end of its user message too (a later turn's)."""
    warm = make_worker(model_dirs, kind, None, step=64)
    first_job, _ = chat_answer(warm, [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Who?"}])
    system_end, user_end = first_job.message_boundaries
    assert system_end % 64 and user_end < len(first_job.tokens)
    stored = [e.prompt_cache for e in warm.provider.default.prompt_cache._entries.values()]
    checkpointed = [c for c in stored if isinstance(c, CheckpointedCache)]
    assert checkpointed and all({system_end, user_end} <= set(c.positions()) for c in checkpointed)
    second = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Jumps where?"}]
    second_job, resumed = chat_answer(warm, second)
    assert second_job.message_boundaries[0] == system_end and resumed.cached_tokens == system_end
    _, cold = chat_answer(make_worker(model_dirs, kind, None, step=64), second)
    assert cold.cached_tokens == 0 and cold.text == resumed.text
