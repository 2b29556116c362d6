"""The server's counters (`Metrics`), added to by the generation worker as each request
finishes and read by GET /metrics in the Prometheus text exposition format, version
0.0.4 (https://prometheus.io/docs/instrumenting/exposition_formats/): per metric a
`# HELP` and a `# TYPE` line, then its samples `name{label="value"} number`.

Counters only grow (names end in `_total`); the gauges are read from the worker when
scraped. Nothing here touches MLX."""

import threading
from typing import Dict, Iterable, List, Tuple

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
ENDPOINTS = {"chat": "/v1/chat/completions", "text": "/v1/completions"}  # request kind -> its route
# completed: answered; cancelled: the client left (queued, prefilling or decoding);
# rejected: a 4xx refusal; failed: a 5xx (the generation failed).
OUTCOMES = ("completed", "cancelled", "rejected", "failed")

Sample = Tuple[Dict[str, str], float]


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


def _number(value: float) -> str:
    return str(int(value)) if float(value).is_integer() else repr(float(value))


def exposition_family(name: str, kind: str, help_text: str, samples: Iterable[Sample]) -> List[str]:
    """The lines of one metric: HELP, TYPE, then a line per (labels, value)."""
    if kind not in ("counter", "gauge") or (kind == "counter") != name.endswith("_total"):
        raise ValueError(f"metric {name!r} of type {kind!r}: counters, and only they, end in _total")
    lines = [f"# HELP {name} {help_text}", f"# TYPE {name} {kind}"]
    for labels, value in samples:
        label_text = ",".join(f'{key}="{_escape(v)}"' for key, v in labels.items())
        lines.append(f"{name}{{{label_text}}} {_number(value)}" if labels else f"{name} {_number(value)}")
    return lines


class Metrics:
    """Counters of the requests a server finished, safe to add to and read from any
    thread: requests by endpoint and outcome; prompt tokens (of which served from the
    prompt cache) and generated tokens of the requests that got past prefill; draft
    tokens proposed and accepted, and the rounds that drafted and that accepted at
    each depth (SpeculationStats.drafted_at_depth / accepted_at_depth, summed)."""

    def __init__(self):
        self._lock = threading.Lock()
        self._requests = {(endpoint, outcome): 0 for endpoint in ENDPOINTS.values() for outcome in OUTCOMES}
        self._tokens = {"prompt": 0, "cached": 0, "generated": 0, "drafted": 0, "accepted": 0}
        self._drafted_at_depth: List[int] = []
        self._accepted_at_depth: List[int] = []

    def count_request(self, kind: str, outcome: str) -> None:
        """A request of `kind` ("chat" or "text") ended with `outcome` (OUTCOMES)."""
        with self._lock:
            self._requests[self._key(kind, outcome)] += 1

    def count_error(self, kind: str, status: int) -> None:
        """A request of `kind` answered with the error `status`: rejected (4xx) or failed."""
        self.count_request(kind, "rejected" if status < 500 else "failed")

    def count_result(self, kind: str, result, cancelled: bool) -> None:
        """A request of `kind` that got past prefill ended (completed, or `cancelled`)
        with `result` (an openai_api.GenerationResult): it and its tokens, at once."""
        key, spec = self._key(kind, "cancelled" if cancelled else "completed"), result.speculation
        with self._lock:
            self._requests[key] += 1
            self._tokens["prompt"] += result.prompt_tokens
            self._tokens["cached"] += result.cached_tokens
            self._tokens["generated"] += result.completion_tokens
            if spec is None:
                return
            self._tokens["drafted"] += spec.num_drafted
            self._tokens["accepted"] += spec.num_accepted
            for totals, counts in ((self._drafted_at_depth, spec.drafted_at_depth),
                                   (self._accepted_at_depth, spec.accepted_at_depth)):
                totals += [0] * (len(counts) - len(totals))
                for d, n in enumerate(counts):
                    totals[d] += n

    @staticmethod
    def _key(kind: str, outcome: str) -> Tuple[str, str]:
        if kind not in ENDPOINTS or outcome not in OUTCOMES:
            raise ValueError(f"request kind {kind!r} / outcome {outcome!r}: kinds are {sorted(ENDPOINTS)}, "
                             f"outcomes {list(OUTCOMES)}")
        return ENDPOINTS[kind], outcome

    def exposition(self, batch_size: int, queue_length: int) -> str:
        """Every metric as GET /metrics answers it, with the worker's gauges."""
        with self._lock:
            requests, tokens = dict(self._requests), dict(self._tokens)
            drafted, accepted = self._drafted_at_depth[:], self._accepted_at_depth[:]

        def by_depth(counts: List[int]) -> List[Sample]:
            return [({"depth": str(d + 1)}, n) for d, n in enumerate(counts)]

        families = [
            ("mlx_lm_requests_total", "counter", "Generation requests finished, by endpoint and outcome.",
             [({"endpoint": e, "outcome": o}, n) for (e, o), n in requests.items()]),
            ("mlx_lm_prompt_tokens_total", "counter", "Prompt tokens of the requests that got past prefill.",
             [({}, tokens["prompt"])]),
            ("mlx_lm_cached_prompt_tokens_total", "counter", "Of those, prompt tokens found in the prompt cache.",
             [({}, tokens["cached"])]),
            ("mlx_lm_generated_tokens_total", "counter", "Tokens generated (completion tokens).",
             [({}, tokens["generated"])]),
            ("mlx_lm_draft_tokens_total", "counter", "Draft tokens proposed and verified.",
             [({}, tokens["drafted"])]),
            ("mlx_lm_draft_accepted_tokens_total", "counter", "Draft tokens the target accepted.",
             [({}, tokens["accepted"])]),
            ("mlx_lm_drafted_at_depth_total", "counter", "Speculative rounds that drafted at least depth tokens.",
             by_depth(drafted)),
            ("mlx_lm_accepted_at_depth_total", "counter",
             "Speculative rounds whose draft at depth was accepted (and all before it).", by_depth(accepted)),
            ("mlx_lm_batch_size", "gauge", "Requests the generation worker holds now (prefilling or decoding).",
             [({}, batch_size)]),
            ("mlx_lm_queue_length", "gauge", "Requests waiting for the generation worker.", [({}, queue_length)]),
        ]
        lines = [line for family in families for line in exposition_family(*family)]
        return "\n".join(lines) + "\n"
