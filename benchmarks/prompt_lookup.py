"""Prompt-lookup drafting (issue 15) on the demo target, greedy: speed against plain
decoding, and what a lookup costs as the context grows.

    python benchmarks/prompt_lookup.py [--tokens 200] [--reps 3] [--rounds 2000] [--blas auto|openblas|reference]

Every row is speculative_generate_step(prompt, model, prompt_lookup=True, ...) (or the
same with a `drafter=`) against generate_step on the same prompts. For every
configuration and prompt, plain decoding and the lookup run go back to back (which
one first alternates between repetitions), and the configurations run in an order
rotating between repetitions, so load from other users of the machine hits both
sides alike. A speedup is plain seconds / lookup seconds summed over a row's prompts
in one repetition; the median over repetitions counts. Greedy, so every lookup run's
tokens must equal the plain run's; every run is checked.

(a) The demo prompts (spec_bench.PROMPTS) x `--tokens`: the defaults (adaptive draft
    length, cap 3, n-grams 3..1) and fixed k = 1..4. Goal: defaults >= 1.3x plain.
    Hit rate: the fraction of generated positions where the lookup proposes anything
    (replayed position by position over prompt + plain output, independent of how the
    loop groups positions into rounds); first-guess agreement: where its first
    proposal is the token that came.
(b) An edit-style prompt: a 39-line function in standard-library style, then
    "# The same function, renamed:" and a renamed def line (the demo is a base code
    model without a chat template, so the instruction is code). Reported, no goal;
    also how much of the block the output copies.
(c) No match: PromptLookup(max_ngram_size=n, min_ngram_size=n) passed as `drafter=`,
    with n one more than the longest token run that occurs twice in that prompt plus
    its plain output (measured first), so no suffix the loop looks up was seen
    before: the lookup never proposes (checked: nothing drafted), and the row measures
    what the can_draft checks and plain stretches cost. Goal: defaults >= 0.95x plain.
    A control row times plain decoding against itself the same way: how far from
    1.00x the method's noise alone puts a ratio on the shared machine.
(d) Lookup cost per round, host only, at 1k, 10k and 100k tokens of context: the
    default PromptLookup (n-grams 3..1) indexes the context, then `--rounds` rounds
    each commit 2 more tokens: extend (indexing them), can_draft, and propose(k=3)
    timed apart; median microseconds. Two streams: standard-library source tokenized
    with the demo tokenizer (real code repetition), and a synthetic one (Zipf(1.1)
    over the 4096-id vocabulary, 30% of 8-64-token spans copied from anywhere
    earlier). Goals (ours): flat, a round at 100k within 2x of a round at 1k (a scan
    of the context would take 100x); and every round under 1% of a plain decoding step.

The mlx-cpu wheel links the netlib reference BLAS; with OpenBLAS installed (apt-get
install libopenblas0-pthread) the script re-executes itself with it preloaded, one
BLAS thread, and says which BLAS and dtype ran (load's auto dtype: float32 on the
CPU). Writes results/prompt_lookup.md and results/prompt_lookup.png.
"""

import argparse
import os
import platform
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Dict, List, Optional

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(Path(__file__).parent))
from gdn_prefill import RESULTS  # noqa: E402
from spec_bench import PROMPTS, TARGET, loaded_blas, reexec_with_blas  # noqa: E402

DEFAULT_CAP = 3  # mlx_lm.generate's DEFAULT_NUM_DRAFT_TOKENS
FIXED_KS = [1, 2, 3, 4]
CONTEXTS = [1_000, 10_000, 100_000]
TOKENS_PER_ROUND = 2  # (d): tokens committed between two lookups
STDLIB = Path(os.__file__).parent
GOAL_DEMO, GOAL_NO_MATCH, GOAL_FLAT, GOAL_SHARE = 1.3, 0.95, 2.0, 0.01

EDIT_BLOCK = '''def parse_header_line(line, strict=False):
    """Split a header line into its name and value.

    The name is everything before the first colon, stripped of
    whitespace and lowered; the value is the rest with surrounding
    whitespace removed.  Continuation lines (starting with a space
    or a tab) are returned with an empty name.  With *strict* set,
    a line without a colon raises ValueError instead of being
    returned as a value.
    """
    if not isinstance(line, str):
        raise TypeError("line must be a string, not %s" % type(line).__name__)
    line = line.rstrip("\\r\\n")
    if not line:
        return None, ""
    if line[0] in " \\t":
        return "", line.strip()
    name, sep, value = line.partition(":")
    if not sep:
        if strict:
            raise ValueError("no colon in header line: %r" % line)
        return "", line.strip()
    name = name.strip().lower()
    if not name:
        if strict:
            raise ValueError("empty header name: %r" % line)
        return "", value.strip()
    for char in name:
        if char.isspace():
            raise ValueError("whitespace in header name: %r" % name)
    value = value.strip()
    if value.startswith('"') and value.endswith('"') and len(value) > 1:
        value = value[1:-1]
    return name, value
'''
EDIT_DEF = "def split_header_line(line, strict=False):"
EDIT_PROMPT = EDIT_BLOCK + "\n\n# The same function, renamed:\n\n" + EDIT_DEF


# --- decoding rows (a)-(c) -----------------------------------------------------------


@dataclass
class Case:
    """One prompt of a row: its tokens, plain greedy output, and for (c) the n-gram size."""

    name: str
    prompt: List[int]
    reference: List[int] = field(default_factory=list)
    ngram: int = 0


@dataclass
class Config:
    """One configuration timed against plain decoding: `section` names its cases;
    `kwargs` go to speculative_generate_step. `drafter`: "lookup" (prompt_lookup=True),
    "no match" (a PromptLookup that cannot match), or "control" (plain decoding again)."""

    section: str
    label: str
    kwargs: dict
    drafter: str = "lookup"


@dataclass
class Row:
    plain_s: List[float] = field(default_factory=list)  # per repetition, summed over cases
    lookup_s: List[float] = field(default_factory=list)
    identical: bool = True
    drafted: int = 0
    accepted: int = 0
    forwards: int = 0
    tokens: int = 0
    lengths: Dict[int, int] = field(default_factory=dict)  # rounds per draft length
    gaps: Dict[str, List[float]] = field(default_factory=lambda: {"plain": [], "lookup": []})  # median gap per run


def configs() -> List[Config]:
    defaults = dict(num_draft_tokens=DEFAULT_CAP, adaptive_draft_length=True)
    rows = []
    for section in ("demo", "edit"):
        rows.append(Config(section, f"defaults (adaptive, cap {DEFAULT_CAP})", defaults))
        rows += [Config(section, f"fixed k={k}", dict(num_draft_tokens=k, adaptive_draft_length=False))
                 for k in FIXED_KS]
    rows.append(Config("no match", f"defaults (adaptive, cap {DEFAULT_CAP})", defaults, "no match"))
    rows.append(Config("no match", f"fixed k={DEFAULT_CAP}",
                       dict(num_draft_tokens=DEFAULT_CAP, adaptive_draft_length=False), "no match"))
    rows.append(Config("no match", "control: plain vs plain", {}, "control"))
    return rows


def lookup_fn(model, config: Config, case: Case, tokens: int, stats) -> Callable:
    from mlx_lm.drafters import PromptLookup
    from mlx_lm.generate import generate_step, speculative_generate_step

    def run(prompt):
        if config.drafter == "control":
            return generate_step(prompt, model, max_tokens=tokens)
        if config.drafter == "no match":
            drafter = dict(drafter=PromptLookup(max_ngram_size=case.ngram, min_ngram_size=case.ngram))
        else:
            drafter = dict(prompt_lookup=True, max_ngram_size=3)
        return speculative_generate_step(prompt, model, max_tokens=tokens, stats=stats, **drafter, **config.kwargs)

    return run


def shortest_unrepeated(tokens: List[int]) -> int:
    """The smallest n such that no n tokens in a row occur twice in `tokens`."""
    n = 1
    while len({tuple(tokens[i : i + n]) for i in range(len(tokens) - n + 1)}) < len(tokens) - n + 1:
        n += 1
    return n


def make_cases(model, tokenizer, tokens: int) -> Dict[str, List[Case]]:
    """The prompts of every section with their plain greedy outputs."""
    from mlx_lm.generate import generate_step

    demo = [Case(f"demo {i + 1}", tokenizer.encode(p)) for i, p in enumerate(PROMPTS)]
    cases = {"demo": demo, "edit": [Case("edit", tokenizer.encode(EDIT_PROMPT))]}
    plain = lambda p: generate_step(p, model, max_tokens=tokens)  # noqa: E731
    for case in demo + cases["edit"]:
        case.reference = timed_run(plain, case.prompt, tokens)[1]
    cases["no match"] = [Case(c.name, c.prompt, c.reference, shortest_unrepeated(c.prompt + c.reference))
                         for c in demo]
    return cases


def replay(case: Case, max_ngram: int = 3, min_ngram: int = 1) -> Dict[str, float]:
    """Position by position over the plain output: hit rate (the lookup proposes
    anything) and first-guess agreement (its first proposal is the token that came)."""
    from mlx_lm.drafters import PromptLookup

    lookup = PromptLookup(max_ngram, min_ngram, context=case.prompt)
    hits = agree = 0
    for token in case.reference:
        proposal = lookup.lookup(1)
        hits += bool(proposal)
        agree += proposal == [token]
        lookup.extend([token])
    return dict(hit_rate=hits / len(case.reference), agreement=agree / len(case.reference))


def timed_run(decode: Callable, prompt: List[int], tokens: int):
    """(seconds, tokens, gaps): the wall time of `tokens` tokens of decode(prompt)
    (prefill included), the tokens, and the seconds between consecutive tokens."""
    import mlx.core as mx

    start = time.perf_counter()
    out, stamps = [], []
    for item in decode(mx.array(prompt)):
        stamps.append(time.perf_counter())
        out.append(int(item[0]))
        if len(out) == tokens:
            break
    return stamps[-1] - start, out, [b - a for a, b in zip(stamps, stamps[1:])]


def measure_pair(model, config: Config, case: Case, tokens: int, plain_first: bool, row: Row):
    """Plain and lookup decoding of one case back to back; (plain s, lookup s)."""
    from mlx_lm.generate import SpeculationStats, generate_step

    stats = SpeculationStats()
    plain = lambda p: generate_step(p, model, max_tokens=tokens)  # noqa: E731
    runs = {}
    for side in (["plain", "lookup"] if plain_first else ["lookup", "plain"]):
        fn = plain if side == "plain" else lookup_fn(model, config, case, tokens, stats)
        runs[side] = timed_run(fn, case.prompt, tokens)
        row.gaps[side].append(statistics.median(runs[side][2]))
    assert runs["plain"][1] == case.reference, "plain greedy decoding is not deterministic"
    row.identical &= runs["lookup"][1] == case.reference
    row.drafted, row.accepted = row.drafted + stats.num_drafted, row.accepted + stats.num_accepted
    row.forwards, row.tokens = row.forwards + stats.num_target_forwards, row.tokens + len(runs["lookup"][1])
    for k, n in enumerate(stats.draft_lengths):
        row.lengths[k] = row.lengths.get(k, 0) + n
    return runs["plain"][0], runs["lookup"][0]


def measure_rows(model, cases, rows: List[Config], args) -> Dict[tuple, Row]:
    results = {(c.section, c.label): Row() for c in rows}
    for config in rows:  # warm up every path
        case = cases[config.section][0]
        measure_pair(model, config, Case(case.name, case.prompt, case.reference[:8], case.ngram), 8, True, Row())
    for rep in range(args.reps):
        shift = rep * len(rows) // args.reps
        for config in rows[shift:] + rows[:shift]:
            row = results[(config.section, config.label)]
            pairs = [measure_pair(model, config, case, args.tokens, rep % 2 == 0, row)
                     for case in cases[config.section]]
            row.plain_s.append(sum(p for p, _ in pairs))
            row.lookup_s.append(sum(s for _, s in pairs))
        print(f"rep {rep + 1}/{args.reps} done", flush=True)
    return results


def step_costs(model, case: Case, steps: int) -> Dict[str, float]:
    """What a plain step inside speculative_generate_step adds, measured where load
    cannot tell the sides apart: one-token target forwards (synced) on a plain cache
    and on one recording rollbacks (as the loop's caches do), interleaved step by
    step, median ms; and the loop's host calls per plain step (policy.choose_after_plain,
    policy.update, the no-match PromptLookup.can_draft), median us."""
    import mlx.core as mx
    from mlx_lm.draft_length import DraftLengthPolicy
    from mlx_lm.drafters import PromptLookup
    from mlx_lm.models.cache import make_prompt_cache

    caches = {"plain": make_prompt_cache(model), "recording": make_prompt_cache(model)}
    for c in caches["recording"]:
        c.start_speculation(rollback_window=2 * (DEFAULT_CAP + 1))  # as speculative_generate_step does
    times = {name: [] for name in [*caches, "choose_after_plain", "update", "can_draft"]}
    for cache in caches.values():
        model(mx.array(case.prompt)[None], cache=cache)
        mx.eval([c.state for c in cache])
    for i in range(steps):
        for name in list(caches)[:: 1 if i % 2 else -1]:
            start = time.perf_counter()
            logits = model(mx.array([[case.reference[i % len(case.reference)]]]), cache=caches[name])
            mx.eval(mx.argmax(logits[0, -1]), [c.state for c in caches[name]])
            times[name].append(time.perf_counter() - start)
    policy, lookup = DraftLengthPolicy(DEFAULT_CAP), PromptLookup(case.ngram, case.ngram, context=case.prompt)
    sequence = list(case.prompt)
    for token in case.reference:
        calls = [("choose_after_plain", policy.choose_after_plain), ("update", lambda: policy.update(0, 0, 5e-3)),
                 ("can_draft", lambda: lookup.can_draft(sequence))]
        for name, call in calls:
            start = time.perf_counter()
            call()
            times[name].append(time.perf_counter() - start)
        sequence.append(token)
    return {name: statistics.median(v) * (1e3 if name in caches else 1e6) for name, v in times.items()}


# --- (d) lookup cost per round -----------------------------------------------------


def stdlib_stream(tokenizer, length: int) -> List[int]:
    """Standard-library source files (sorted by name) tokenized, concatenated."""
    tokens = []
    for path in sorted(STDLIB.glob("*.py")):
        tokens += tokenizer.encode(path.read_text(errors="replace"))
        if len(tokens) >= length:
            return tokens[:length]
    raise SystemExit(f"only {len(tokens)} tokens of source under {STDLIB}, need {length}")


def synthetic_stream(length: int, vocab: int, seed: int = 0) -> List[int]:
    """Spans of 8-64 tokens: 30% copied from anywhere earlier, else Zipf(1.1) draws
    over `vocab` ids (ranks shuffled)."""
    import numpy as np

    rng = np.random.default_rng(seed)
    weights = 1.0 / (np.arange(vocab) + 2.7) ** 1.1
    ids = rng.permutation(vocab)
    tokens: List[int] = []
    while len(tokens) < length:
        span = int(rng.integers(8, 65))
        if tokens and rng.random() < 0.3:
            start = int(rng.integers(len(tokens)))
            tokens += tokens[start : start + span]
        else:
            tokens += ids[rng.choice(vocab, size=span, p=weights / weights.sum())].tolist()
    return tokens[:length]


def lookup_costs(stream: List[int], context: int, rounds: int) -> Dict[str, float]:
    """Host microseconds at `context` tokens: indexing per token in bulk, then per
    round (TOKENS_PER_ROUND new tokens): extend, can_draft, propose(k=3); medians."""
    from mlx_lm.drafters import PromptLookup

    index_us = float("inf")
    for _ in range(3):  # the fastest of three builds: interference only adds time
        lookup = PromptLookup()
        start = time.perf_counter()
        lookup.extend(stream[:context])
        index_us = min(index_us, (time.perf_counter() - start) * 1e6 / context)
    sequence = stream[:context]
    times = {"extend": [], "can_draft": [], "propose": []}
    hits = 0
    for r in range(rounds):
        sequence += stream[context + r * TOKENS_PER_ROUND : context + (r + 1) * TOKENS_PER_ROUND]
        t0 = time.perf_counter()
        lookup.extend(sequence[len(lookup.tokens) :])
        t1 = time.perf_counter()
        hit = lookup.can_draft(sequence)
        t2 = time.perf_counter()
        if hit:
            lookup.propose(sequence, DEFAULT_CAP, None, [])
            times["propose"].append((time.perf_counter() - t2) * 1e6)
        times["extend"].append((t1 - t0) * 1e6 / TOKENS_PER_ROUND)
        times["can_draft"].append((t2 - t1) * 1e6)
        hits += hit
    result = {name: statistics.median(v) if v else 0.0 for name, v in times.items()}
    round_us = TOKENS_PER_ROUND * result["extend"] + result["can_draft"] + hits / rounds * result["propose"]
    return dict(result, index=index_us, round=round_us, hit_rate=hits / rounds)


def measure_costs(tokenizer, vocab: int, rounds: int) -> Dict[str, Dict[int, dict]]:
    length = max(CONTEXTS) + rounds * TOKENS_PER_ROUND
    streams = {"stdlib code": stdlib_stream(tokenizer, length), "synthetic": synthetic_stream(length, vocab)}
    lookup_costs(streams["synthetic"], min(CONTEXTS), rounds)  # warm-up
    costs = {name: {n: lookup_costs(s, n, rounds) for n in CONTEXTS} for name, s in streams.items()}
    print("lookup costs measured", flush=True)
    return costs


# --- the report ----------------------------------------------------------------------


def speedup(row: Row) -> float:
    return statistics.median(p / s for p, s in zip(row.plain_s, row.lookup_s))


def gap_ms(row: Row) -> Dict[str, float]:
    return {side: statistics.median(gaps) * 1e3 for side, gaps in row.gaps.items()}


def gap_ratio(row: Row) -> float:
    """Median over the back-to-back pairs of plain's median gap / lookup's."""
    return statistics.median(p / q for p, q in zip(row.gaps["plain"], row.gaps["lookup"]))


def row_line(label: str, row: Row, tokens: int) -> str:
    rounds = sum(row.lengths.values())
    mean_k = sum(k * n for k, n in row.lengths.items()) / max(rounds, 1)
    drafting = rounds - row.lengths.get(0, 0)
    tok_s = lambda seconds: tokens / statistics.median(seconds)  # noqa: E731
    ratios = " ".join(f"{p / s:.2f}" for p, s in zip(row.plain_s, row.lookup_s))
    counts = (f"{row.accepted / max(row.drafted, 1):.2f} | {row.tokens / row.forwards:.2f} | {mean_k:.2f} | "
              f"{row.drafted / max(drafting, 1):.2f}") if row.forwards else "- | - | - | -"
    return (f"| {label} | {tok_s(row.plain_s):.1f} | {tok_s(row.lookup_s):.1f} | **{speedup(row):.2f}x** | "
            f"{ratios} | {min(row.plain_s) / min(row.lookup_s):.2f}x | {counts} | "
            f"{'yes' if row.identical else '**NO**'} |")


TABLE_HEAD = [
    "| configuration | plain tok/s | lookup tok/s | vs plain (median) | per repetition | fastest vs fastest | "
    "acceptance | tokens / target forward | mean k (all rounds) | mean k (drafting rounds) | tokens = plain |",
    "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|",
]


def copied_span(output: List[int], source: List[int]) -> int:
    """Length of the longest run of `output` tokens that occurs in `source`."""
    best = 0
    for i in range(len(output)):
        n = best + 1
        while i + n <= len(output) and any(source[j : j + n] == output[i : i + n] for j in range(len(source) - n + 1)):
            best, n = n, n + 1
    return best


def edit_lines(case: Case, tokenizer) -> List[str]:
    text = tokenizer.decode(case.reference)
    body = EDIT_BLOCK.split("\n", 1)[1]
    same = next((i for i, (a, b) in enumerate(zip(text, body)) if a != b), min(len(text), len(body)))
    block = tokenizer.encode(EDIT_BLOCK)
    first = "\n".join(text.splitlines()[:6])
    return [
        f"- prompt: {len(case.prompt)} tokens (the 39-line block, then `# The same function, renamed:` and "
        f"`{EDIT_DEF}`); {len(case.reference)} tokens generated",
        f"- the output reproduces {same} of the body's {len(body)} characters verbatim; its longest run "
        f"copied from the block is {copied_span(case.reference, block)} tokens. Its first lines:",
        "", "```python", EDIT_DEF + first, "```",
    ]


def goal_line(name: str, value: float, goal: float, above: bool = True) -> str:
    """A goal's value, its bound and whether it was met, as one report line."""
    met = value >= goal if above else value <= goal
    return f"- {name}: **{value:.3f}x** (goal {'>=' if above else '<='} {goal}x) -> {'met' if met else '**MISSED**'}"


def decoding_lines(cases, results, tokenizer) -> List[str]:
    lines = ["## (a) Demo prompts", "", "| prompt | prompt tokens | hit rate | first-guess agreement |",
             "|---|---:|---:|---:|"]
    for case in cases["demo"]:
        r = replay(case)
        lines.append(f"| `{PROMPTS[int(case.name[-1]) - 1]!r}` | {len(case.prompt)} | {r['hit_rate']:.2f} | "
                     f"{r['agreement']:.2f} |")
    sections = [("demo", None), ("edit", "## (b) Edit-style prompt"), ("no match", "## (c) A lookup that never matches")]
    for section, title in sections:
        if title:
            lines += ["", title, ""]
        if section == "edit":
            r = replay(cases["edit"][0])
            lines += edit_lines(cases["edit"][0], tokenizer)
            lines += ["", f"- hit rate {r['hit_rate']:.2f}, first-guess agreement {r['agreement']:.2f}"]
        if section == "no match":
            lines.append("- drafter: `PromptLookup(max_ngram_size=n, min_ngram_size=n)` with n = "
                         + ", ".join(str(c.ngram) for c in cases["no match"])
                         + " for the three demo prompts (one more than the longest run that occurs twice in "
                         "prompt + plain output); hit rate "
                         + ", ".join(f"{replay(c, c.ngram, c.ngram)['hit_rate']:.2f}" for c in cases["no match"])
                         + ". Both lookup configurations decode in plain stretches throughout (nothing to draft). "
                         "The control row is plain vs plain timed the same way: the method's noise.")
        lines += [""] + TABLE_HEAD
        tokens = sum(len(c.reference) for c in cases[section])
        lines += [row_line(label, row, tokens) for (s, label), row in results.items() if s == section]
        if section == "no match":
            lines += ["", "Median gap between consecutive tokens (robust to bursts of load, which hit only some "
                      "tokens; every token here comes from its own target step): per run, then plain / lookup per "
                      "back-to-back pair, median over the pairs:", ""]
            lines += [f"- {label}: plain {gap_ms(row)['plain']:.2f} ms, lookup {gap_ms(row)['lookup']:.2f} ms -> "
                      f"**{gap_ratio(row):.3f}x** plain's speed" for (s, label), row in results.items() if s == section]
    return lines


def step_lines(steps: Dict[str, float]) -> List[str]:
    host = steps["choose_after_plain"] + steps["update"] + steps["can_draft"]
    return ["", "What a plain step inside the loop adds (demo prompt 2, no-match drafter), measured apart:", "",
            f"- one-token target forward, synced, interleaved step by step: plain cache {steps['plain']:.2f} ms, "
            f"cache recording rollbacks {steps['recording']:.2f} ms -> recording costs "
            f"**{steps['recording'] / steps['plain'] - 1:+.1%}** per step",
            f"- host calls per plain step: policy.choose_after_plain {steps['choose_after_plain']:.1f} us, "
            f"policy.update {steps['update']:.1f} us, PromptLookup.can_draft {steps['can_draft']:.1f} us: "
            f"{host:.1f} us = **{host / 1e3 / steps['plain']:.2%}** of a plain step"]


def cost_lines(costs, plain_step_us: float) -> List[str]:
    lines = ["", "## (d) Lookup cost per round (host only, default PromptLookup, n-grams 3..1)", "",
             f"Microseconds, medians over the rounds; a round commits {TOKENS_PER_ROUND} tokens (extend), "
             f"then can_draft, then propose(k={DEFAULT_CAP}) where it hit. A plain decoding step of the demo "
             f"target took {plain_step_us:.0f} us in (a).", "",
             "| stream | context | index (per token, bulk, fastest of 3) | extend (per token) | can_draft | propose | "
             "round | round / plain step | hit rate |", "|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for name, by_context in costs.items():
        for n, c in by_context.items():
            lines.append(f"| {name} | {n:,} | {c['index']:.2f} | {c['extend']:.2f} | {c['can_draft']:.2f} | "
                         f"{c['propose']:.2f} | {c['round']:.2f} | {c['round'] / plain_step_us:.2%} | "
                         f"{c['hit_rate']:.2f} |")
    return lines


def write_report(cases, results, steps, costs, header, tokenizer) -> str:
    demo = speedup(results[("demo", f"defaults (adaptive, cap {DEFAULT_CAP})")])
    defaults_c = results[("no match", f"defaults (adaptive, cap {DEFAULT_CAP})")]
    no_match = speedup(defaults_c)
    demo_plain = results[("demo", f"defaults (adaptive, cap {DEFAULT_CAP})")]
    plain_step_us = statistics.median(demo_plain.plain_s) / (demo_plain.tokens / len(demo_plain.plain_s)) * 1e6
    identical = all(row.identical for row in results.values())
    lines = ["# Prompt-lookup drafting (greedy, demo target)", "", *header, "", "## Goals", "",
             goal_line("(a) demo prompts, defaults vs plain", demo, GOAL_DEMO),
             goal_line("(c) never-matching lookup, defaults vs plain", no_match, GOAL_NO_MATCH)]
    control = results[("no match", "control: plain vs plain")]
    lines.append(f"  - the same by median gap between tokens: {gap_ratio(defaults_c):.3f}x; the control (plain vs "
                 f"plain, timed the same way) gave {speedup(control):.3f}x, per repetition "
                 + ", ".join(f"{p / q:.2f}" for p, q in zip(control.plain_s, control.lookup_s))
                 + f", by median gap {gap_ratio(control):.3f}x")
    for name, by_context in costs.items():
        ratio = by_context[max(CONTEXTS)]["round"] / by_context[min(CONTEXTS)]["round"]
        lines.append(goal_line(f"(d) {name}: round cost at {max(CONTEXTS) // 1000}k / at {min(CONTEXTS) // 1000}k",
                               ratio, GOAL_FLAT, above=False))
    share = max(c["round"] for by_context in costs.values() for c in by_context.values()) / plain_step_us
    lines.append(f"- (d) the costliest round, as a share of a plain decoding step: **{share:.3%}** "
                 f"(goal < {GOAL_SHARE:.0%}) -> {'met' if share < GOAL_SHARE else '**MISSED**'}")
    nothing = all(results[k].drafted == 0 for k in results if k[0] == "no match")
    lines += [f"- every lookup run's tokens equal plain decoding's: {'yes' if identical else '**NO**'}; "
              f"(c) drafted nothing: {'yes' if nothing else '**NO**'}", ""]
    lines += decoding_lines(cases, results, tokenizer) + step_lines(steps) + cost_lines(costs, plain_step_us)
    report = "\n".join(lines) + "\n"
    (RESULTS / "prompt_lookup.md").write_text(report)
    return report


def write_plot(results, costs, blas: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.8), gridspec_kw=dict(width_ratios=[1.3, 1]))
    labels = [f"{s}: {label}" for s, label in results][::-1]
    values = [speedup(row) for row in results.values()][::-1]
    colors = {"demo": "tab:blue", "edit": "tab:green", "no match": "tab:gray"}
    left.barh(labels, values, color=[colors[s] for s, _ in results][::-1])
    for y, v in enumerate(values):
        left.text(v, y, f" {v:.2f}x", va="center", fontsize=7)
    left.axvline(1.0, color="k", lw=0.8)
    left.axvline(GOAL_DEMO, color="tab:blue", ls="--", lw=0.8, label=f"goal (a): {GOAL_DEMO}x")
    left.axvline(GOAL_NO_MATCH, color="tab:red", ls=":", lw=0.8, label=f"goal (c): {GOAL_NO_MATCH}x")
    left.tick_params(axis="y", labelsize=7)
    left.set_xlabel("speedup over plain greedy decoding (median of per-repetition ratios)")
    left.legend(fontsize=7, loc="lower right")
    for i, (name, by_context) in enumerate(costs.items()):
        for part, style in (("round", "o-"), ("extend", "s--"), ("can_draft", "^:"), ("propose", "d-.")):
            right.plot(CONTEXTS, [by_context[n][part] for n in CONTEXTS], style, color=f"C{i}",
                       label=f"{name}: {part}{' (per token)' if part == 'extend' else ''}")
    right.set_title("lookup cost per round (host)", fontsize=9)
    right.set_xscale("log")
    right.set_ylim(bottom=0)
    right.set_xlabel("context (tokens seen)")
    right.set_ylabel("host microseconds (median)")
    right.legend(fontsize=6, ncol=2)
    fig.suptitle(f"Prompt lookup on the demo target, float32; {blas.split(' preloaded')[0]}", fontsize=9)
    fig.tight_layout()
    fig.savefig(RESULTS / "prompt_lookup.png", dpi=120)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tokens", type=int, default=200, help="tokens generated per prompt")
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=2000, help="(d): timed rounds per context")
    parser.add_argument("--steps", type=int, default=400, help="(c): interleaved forwards per cache kind")
    parser.add_argument("--blas", choices=["auto", "openblas", "reference"], default="auto")
    args = parser.parse_args()
    reexec_with_blas(args.blas)
    sys.path.insert(0, str(ROOT))
    import mlx.core as mx
    from mlx_lm import load
    from mlx_lm.utils import parameter_dtypes

    model, tokenizer = load(str(TARGET))
    blas, dtype = loaded_blas(), parameter_dtypes(model)
    print(f"BLAS: {blas}\ndtype: {dtype}", flush=True)
    started = time.time()
    cases = make_cases(model, tokenizer, args.tokens)
    results = measure_rows(model, cases, configs(), args)
    steps = step_costs(model, cases["no match"][1], args.steps)
    costs = measure_costs(tokenizer, model.args.vocab_size, args.rounds)
    header = [
        f"- BLAS: {blas}",
        f"- machine: {platform.processor() or platform.machine()}, {os.cpu_count()} cores (shared), mlx {mx.__version__}",
        f"- target: `examples/models/qwen3-next-stdlib` (float16 on disk), computing in {dtype} (load's auto dtype)",
        f"- greedy, {args.tokens} tokens per prompt, {args.reps} repetitions; benchmark wall time "
        f"{(time.time() - started) / 60:.1f} min",
        "- command: `python benchmarks/prompt_lookup.py" + "".join(f" {a}" for a in sys.argv[1:]) + "`",
    ]
    RESULTS.mkdir(exist_ok=True)
    print(write_report(cases, results, steps, costs, header, tokenizer))
    write_plot(results, costs, blas)


if __name__ == "__main__":
    main()
