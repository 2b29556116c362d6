"""The peer's half of benchmarks/prefix_reuse.py: run by the python of a virtual
environment holding upstream mlx-lm (0.32.2), never by this project's.

    <venv>/bin/python benchmarks/prefix_reuse_peer.py JOB.json

JOB.json: {"model": a checkpoint directory, "first": [ids], "second": [ids],
"answer_tokens": n, "prefill_step_size": S, "warm_up_tokens": w, "expect_version":
"0.32.2", "document_end": d or null}. After an untimed request of the first w tokens
(first calls pay one-time setup), it does what the server of that version does with a
prompt cache, through the library calls the server makes: the first request prefilled
into a fresh cache and answered greedily, its cache stored under its prompt and answer
(`LRUPromptCache.insert_cache`); the second request looked up (`fetch_nearest_cache`: a
copy of the longest usable entry and the tokens it lacks), prefilled from there and
answered. With "document_end" (the benchmark's chat form: the document a system
message, the question a user message) the first d tokens of the first request are
prefilled as one segment and stored first, as that server stores a chat request's
system messages. Prints one JSON line: both times to the first token, both answers, how
many tokens the lookup supplied, and what ran (versions, BLAS libraries mapped into the
process, parameter dtypes).

Only names both packages share are used, so importing this project's mlx_lm instead
would go unnoticed; main() therefore refuses any mlx_lm but the one the job names.
"""

import json
import sys
import time
from pathlib import Path


def mapped_blas_libraries() -> list:
    """Files mapped into this process whose names say BLAS or MKL (Linux), i.e. which
    BLAS the mlx wheel's library was linked to and loaded."""
    maps = Path("/proc/self/maps")
    if not maps.exists():
        return []
    names = {line.split()[-1] for line in maps.read_text().splitlines() if "/" in line}
    return sorted(Path(n).name for n in names if "blas" in Path(n).name.lower() or "mkl" in Path(n).name.lower())


def time_to_first_token(model, prompt_cache, tokens, job):
    """(seconds to the first token, the greedy answer)."""
    import mlx.core as mx
    from mlx_lm.generate import generate_step

    start = time.perf_counter()
    steps = generate_step(mx.array(tokens), model, max_tokens=job["answer_tokens"], prompt_cache=prompt_cache,
                          prefill_step_size=job["prefill_step_size"])
    token, logprobs = next(steps)
    mx.eval(logprobs)
    seconds = time.perf_counter() - start
    return seconds, [int(token)] + [int(t) for t, _ in steps]


def prefill_system_segment(model, lru, tokens, job) -> list:
    """A cache fed `tokens` in prefill steps, a copy of it stored as the server stores
    the end of a chat request's system messages (cache_type "system")."""
    import copy

    import mlx.core as mx
    from mlx_lm.models.cache import make_prompt_cache

    cache = make_prompt_cache(model)
    step = job["prefill_step_size"]
    for start in range(0, len(tokens), step):
        model(mx.array(tokens[start : start + step])[None], cache=cache)
        mx.eval([c.state for c in cache])
    lru.insert_cache(job["model"], tokens, copy.deepcopy(cache), cache_type="system")
    return cache


def serve_both(job: dict) -> dict:
    """The first request stored (and, given "document_end", its document as a system
    segment first), then the second answered through the prompt cache."""
    from mlx.utils import tree_flatten
    from mlx_lm.models.cache import LRUPromptCache, make_prompt_cache
    from mlx_lm.utils import load_model

    model, _ = load_model(Path(job["model"]))
    lru = LRUPromptCache()
    time_to_first_token(model, make_prompt_cache(model), job["first"][: job["warm_up_tokens"]], job)  # untimed
    first, split = job["first"], job.get("document_end") or 0
    start = time.perf_counter()
    cache = prefill_system_segment(model, lru, first[:split], job) if split else make_prompt_cache(model)
    segment = time.perf_counter() - start
    first_seconds, first_answer = time_to_first_token(model, cache, first[split:], job)
    lru.insert_cache(job["model"], first + first_answer, cache)
    start = time.perf_counter()
    fetched, remaining = lru.fetch_nearest_cache(job["model"], job["second"])
    lookup = time.perf_counter() - start
    prompt_cache = fetched if fetched is not None else make_prompt_cache(model)
    shared_seconds, shared_answer = time_to_first_token(model, prompt_cache, remaining, job)
    dtypes = {str(p.dtype).split(".")[-1] for _, p in tree_flatten(model.parameters())}
    return dict(first=segment + first_seconds, first_answer=first_answer, shared=lookup + shared_seconds,
                shared_answer=shared_answer, resumed_at=len(job["second"]) - len(remaining),
                dtype="/".join(sorted(dtypes)))


def main() -> None:
    if len(sys.argv) != 2:
        raise SystemExit(f"usage: {sys.argv[0]} JOB.json (got {sys.argv[1:]})")
    job = json.loads(Path(sys.argv[1]).read_text())
    import mlx.core as mx
    import mlx_lm

    if mlx_lm.__version__ != job["expect_version"]:
        raise SystemExit(f"this python imports mlx_lm {mlx_lm.__version__} from {mlx_lm.__file__}, "
                         f"not the peer's {job['expect_version']}: run it with the peer venv's python")
    result = serve_both(job)
    result.update(version=mlx_lm.__version__, mlx=mx.__version__, blas=mapped_blas_libraries())
    print(json.dumps(result))


if __name__ == "__main__":
    main()
