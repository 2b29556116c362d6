"""Speculative sampling at temperature > 0: the output has the target's law.

Three levels:
1. The pure functions of drafters.py against naive loops (STYLE rule 4).
2. One round of `speculative_sample` on fixed laws p and q, 200000 rounds in one batched
   call: each emitted token has the law of the target row it stands for, and a draft
   is accepted with probability sum min(p, q).
3. End to end, tiny target models with a 16-token vocabulary and a draft that is the
   target plus noise (accepts about half its proposals): one long run, and at every
   emitted token the exact law p_i the target gives it (a forward over the final text,
   the same processors and filters, the history up to that token). Under the right
   law the randomised probability integral transform u_i = F_i(t_i - 1) + U p_i(t_i)
   is independent and uniform on [0, 1) for every position, also for dependent tokens
   (Rosenblatt 1952), so a chi-square test on the histogram of u checks the law at
   every position of every round: accepted drafts, corrections after a rejection,
   bonus tokens, and positions after rollbacks of the GDN state. A second, targeted
   check: how often the emitted token is one the draft favours (q_i > p_i), against
   its expectation under p_i (a martingale z test); every broken rule leans that way.

Every statistical check is a chi-square or z test at significance 0.001 with fixed
seeds, so the outcome is deterministic; each one fails when the residual law or the
acceptance ratio is broken (see the report of issue 14).
"""

import math

import mlx.core as mx
import numpy as np
import pytest
from checkpoints import TINY_CONFIGS, perturb
from mlx.utils import tree_map

from mlx_lm.acceptance import accepted_count, correction_logprobs, speculative_sample
from mlx_lm.feeding import processed_logprobs
from mlx_lm.generate import SpeculationStats, generate_step, speculative_generate_step
from mlx_lm.sample_utils import make_logits_processors, make_sampler
from mlx_lm.utils import get_model_classes

Z_CRITICAL = 3.09  # one-sided normal quantile at 0.999
Z_TWO_SIDED = 3.29  # two-sided, significance 0.001


def chi_square_critical(df: int) -> float:
    """The chi-square quantile at 0.999 (Wilson-Hilferty; within 1% for df >= 3)."""
    a = 2 / (9 * df)
    return df * (1 - a + Z_CRITICAL * math.sqrt(a)) ** 3


def chi_square(observed: np.ndarray, expected: np.ndarray) -> float:
    """Pearson's statistic after pooling the cells expected fewer than 5 times into one."""
    small = expected < 5
    observed = np.append(observed[~small], observed[small].sum())
    expected = np.append(expected[~small], expected[small].sum())
    keep = expected > 0
    return float(((observed[keep] - expected[keep]) ** 2 / expected[keep]).sum()), int(keep.sum() - 1)


def assert_law(observed_counts: np.ndarray, probs: np.ndarray, what: str) -> None:
    statistic, df = chi_square(observed_counts, probs * observed_counts.sum())
    assert statistic < chi_square_critical(df), f"{what}: chi-square {statistic:.1f} on {df} df"


# ---------------------------------------------------------------------------
# 1. Pure functions against naive loops


def random_laws(rng, shape, sharpness=2.0):
    """Random log-probabilities of `shape` (..., V), some entries -inf (filtered)."""
    logits = rng.normal(size=shape) * sharpness
    logits[rng.random(shape) < 0.2] = -np.inf
    logits[..., 0] = np.maximum(logits[..., 0], 0)  # at least one token per row
    return logits - np.log(np.exp(logits).sum(-1, keepdims=True))


def test_accepted_count_matches_a_loop():
    rng = np.random.default_rng(0)
    batch, k, vocab = 64, 4, 7
    p, q = random_laws(rng, (batch, k + 1, vocab)), random_laws(rng, (batch, k, vocab))
    drafts = np.array([[rng.choice(vocab, p=np.exp(row)) for row in rows] for rows in q])
    uniforms = rng.random((batch, k))
    got = np.array(accepted_count(mx.array(p), mx.array(q), mx.array(drafts), mx.array(uniforms)))
    for b in range(batch):
        n = 0
        while n < k and uniforms[b, n] < min(1.0, np.exp(p[b, n, drafts[b, n]]) / np.exp(q[b, n, drafts[b, n]])):
            n += 1
        assert got[b] == n, b
    assert 0 < got.mean() < k  # both outcomes occur


def test_correction_logprobs_match_a_loop():
    rng = np.random.default_rng(1)
    k, vocab = 3, 6
    p, q = random_laws(rng, (5, k + 1, vocab)), random_laws(rng, (5, k, vocab))
    q[0, 1] = p[0, 1]  # p == q: no residual mass, the row falls back to p
    got = np.array(correction_logprobs(mx.array(p), mx.array(q)))
    for b in range(5):
        for i in range(k + 1):
            if i == k:
                want = np.exp(p[b, i])
            else:
                residual = [max(0.0, math.exp(p[b, i, v]) - math.exp(q[b, i, v])) for v in range(vocab)]
                total = sum(residual)
                want = np.exp(p[b, i]) if total == 0 else np.array(residual) / total
            np.testing.assert_allclose(np.exp(got[b, i]), want, atol=1e-6, err_msg=f"row {b}, {i}")


# ---------------------------------------------------------------------------
# 2. One round on fixed laws, many times


def test_one_round_emits_the_target_law_and_accepts_sum_min():
    """K = 2, V = 6: the first emitted token ~ p_0; the second, when the first draft was
    accepted, ~ p_1; the bonus (both accepted) ~ p_2; P(first accepted) = sum min(p_0, q_0)."""
    rng = np.random.default_rng(2)
    num_rounds, k, vocab = 200_000, 2, 6
    p, q = random_laws(rng, (k + 1, vocab), 1.0), random_laws(rng, (k, vocab), 1.0)
    key = mx.random.key(3)
    draft_key, round_key = mx.random.split(key)
    drafts = mx.random.categorical(mx.broadcast_to(mx.array(q), (num_rounds, k, vocab)), key=draft_key)
    num_accepted, token = speculative_sample(
        mx.broadcast_to(mx.array(p), (num_rounds, k + 1, vocab)),
        mx.broadcast_to(mx.array(q), (num_rounds, k, vocab)),
        drafts,
        key=round_key,
    )
    drafts, n, token = np.array(drafts), np.array(num_accepted), np.array(token)
    emitted = np.concatenate([drafts, np.zeros((num_rounds, 1), np.int64)], axis=1)
    emitted[np.arange(num_rounds), n] = token  # drafts[:n], then the token

    probs = np.exp(p)
    assert_law(np.bincount(emitted[:, 0], minlength=vocab), probs[0], "first token")
    assert_law(np.bincount(emitted[n >= 1, 1], minlength=vocab), probs[1], "second token")
    assert_law(np.bincount(emitted[n == 2, 2], minlength=vocab), probs[2], "bonus token")
    # A rejected first draft is followed by a token of norm(max(0, p0 - q0)).
    residual = np.maximum(probs[0] - np.exp(q[0]), 0)
    assert_law(np.bincount(emitted[n == 0, 0], minlength=vocab), residual / residual.sum(), "correction")
    accept_rate = np.minimum(probs[0], np.exp(q[0])).sum()
    spread = math.sqrt(accept_rate * (1 - accept_rate) / num_rounds)
    assert abs((n >= 1).mean() - accept_rate) < Z_CRITICAL * spread


def test_one_round_is_reproducible_with_a_key():
    p = mx.log(mx.array([[0.5, 0.3, 0.2], [0.1, 0.1, 0.8]]))
    q = mx.log(mx.array([[0.2, 0.2, 0.6]]))
    drafts = mx.array([2])
    a = speculative_sample(p, q, drafts, key=mx.random.key(7))
    b = speculative_sample(p, q, drafts, key=mx.random.key(7))
    assert all(mx.array_equal(x, y) for x, y in zip(a, b))


# ---------------------------------------------------------------------------
# 3. End to end

VOCAB = 16
PROMPT = mx.array([3, 1, 4, 1, 5, 9, 2, 6])


def tiny(kind, scale=0.3, noise=0.0):
    """A random model of TINY_CONFIGS[kind] with a 16-token vocabulary; `noise` > 0
    adds noise to every weight (perturb): a draft that often disagrees."""
    config = dict(TINY_CONFIGS[kind], vocab_size=VOCAB)
    model_class, args_class = get_model_classes(config)
    model = model_class(args_class.from_dict(config))
    mx.random.seed(0)
    model.update(tree_map(lambda w: mx.random.normal(w.shape) * scale, model.parameters()))
    mx.eval(model.parameters())
    return perturb(model, noise, seed=1) if noise else model


def laws_along(model, tokens, start, sampler, processors):
    """(len(tokens) - start, V) probabilities the sampler draws tokens[start:] from,
    from one forward over `tokens` (the history of each is the tokens before it)."""
    logits = model(mx.array(tokens)[None])[0, start - 1 : -1]
    logprobs = processed_logprobs(logits, mx.array(tokens[:start]), mx.array(tokens[start:-1]), processors)
    return np.array(mx.exp(sampler.distribution(logprobs)))


def pit_histogram(tokens, laws, seed, bins=10):
    """Counts of the randomised PIT values u_i = F_i(t_i - 1) + U_i p_i(t_i) in `bins`."""
    rng = np.random.default_rng(seed)
    rows = np.arange(len(tokens))
    below = np.cumsum(laws, axis=1)[rows, tokens] - laws[rows, tokens]
    u = below + rng.random(len(tokens)) * laws[rows, tokens]
    return np.bincount(np.minimum((u * bins).astype(int), bins - 1), minlength=bins)


CASES = {
    # target kind, draft noise, draft length, tokens, sampler and processors
    "dense": ("llama", 0.6, 3, 1200, dict(temp=1.0, top_k=10, top_p=0.9, min_p=0.05), dict(repetition_penalty=1.5)),
    "hybrid": ("qwen3_next", 0.6, 2, 700, dict(temp=1.0, top_k=10, top_p=0.9, min_p=0.05), dict(repetition_penalty=1.5)),
    "xtc": ("llama", 0.6, 2, 800, dict(temp=0.7, top_p=0.95, xtc_probability=0.5, xtc_threshold=0.1), {}),
}


@pytest.mark.parametrize("case", CASES)
def test_speculative_sampling_has_the_target_law(case):
    kind, noise, k, num_tokens, sampler_args, processor_args = CASES[case]
    target, draft = tiny(kind), tiny(kind, noise=noise)
    sampler, processors = make_sampler(**sampler_args), make_logits_processors(**processor_args)
    mx.random.seed(11)
    stats = SpeculationStats()
    tokens = [t for t, _, _ in speculative_generate_step(PROMPT, target, draft, num_draft_tokens=k, adaptive_draft_length=False,
                                                         stats=stats,
                                                         max_tokens=num_tokens, sampler=sampler,
                                                         logits_processors=processors)]
    assert 0.2 < stats.acceptance_rate < 0.8  # rejections and acceptances, and rollbacks
    assert_target_law(target, draft, tokens, sampler, processors, case)


def assert_target_law(target, draft, tokens, sampler, processors, what):
    """`tokens` (generated after PROMPT) have the target's law: the PIT histogram is
    uniform, and the tokens are ones the draft favours (q > p) no more often than the
    target's law says (a broken rule leans towards the draft; a martingale z test)."""
    sequence = PROMPT.tolist() + tokens
    laws = laws_along(target, sequence, PROMPT.size, sampler, processors)
    filtered = (laws == 0).sum(axis=1)
    assert filtered.mean() > 1, "the filters should remove tokens"
    counts = pit_histogram(np.array(tokens), laws, seed=12)
    assert_law(counts, np.full(len(counts), 1 / len(counts)), f"{what}: PIT histogram")
    favoured = laws_along(draft, sequence, PROMPT.size, sampler, processors) > laws
    rows = np.arange(len(tokens))
    m = (laws * favoured).sum(axis=1)
    z = (favoured[rows, tokens].sum() - m.sum()) / math.sqrt((m * (1 - m)).sum())
    assert abs(z) < Z_TWO_SIDED, f"{what}: {z:.2f} standard deviations towards the draft"


def test_acceptance_on_the_generated_text_is_sum_min():
    """k = 1: each round's draft is accepted with probability alpha = sum min(p, q) at
    that position (p, q: the filtered laws given the committed text). The count of
    accepted drafts minus the sum of the alphas is a martingale: within 3.09 standard
    deviations of 0. Token matching would accept sum p * q, far less. With k = 1 about
    a third of the tokens are bonus tokens, so the law check here covers those well."""
    target, draft = tiny("llama"), tiny("llama", noise=0.6)
    sampler, processors = make_sampler(temp=1.0, top_p=0.95), make_logits_processors(repetition_penalty=1.2)
    mx.random.seed(21)
    out = []
    for item in speculative_generate_step(PROMPT, target, draft, num_draft_tokens=1, adaptive_draft_length=False,
                                          max_tokens=-1,
                                          sampler=sampler, logits_processors=processors):
        out.append(item)
        if len(out) == 1200:
            break
    # Round starts: each round emits its accepted draft (if any), then the target's token.
    starts, accepted, i = [], [], 0
    while i < len(out) - 1:
        starts.append(i)
        accepted.append(out[i][2])
        i += 2 if out[i][2] else 1
    sequence = PROMPT.tolist() + [t for t, _, _ in out]
    p = laws_along(target, sequence, PROMPT.size, sampler, processors)[starts]
    q = laws_along(draft, sequence, PROMPT.size, sampler, processors)[starts]
    alpha = np.minimum(p, q).sum(axis=1)
    spread = math.sqrt((alpha * (1 - alpha)).sum())
    assert abs(sum(accepted) - alpha.sum()) < Z_CRITICAL * spread, (sum(accepted), alpha.sum(), spread)
    matching = (p * q).sum(axis=1).sum()
    assert sum(accepted) > matching + 2 * Z_CRITICAL * spread, (sum(accepted), matching)
    assert_target_law(target, draft, sequence[PROMPT.size :], sampler, processors, "k = 1")


# ---------------------------------------------------------------------------


def test_same_seed_same_output_and_greedy_unchanged():
    target, draft = tiny("qwen3_next"), tiny("qwen3_next", noise=0.6)
    sampler = make_sampler(temp=0.8, top_k=8)
    runs, stats = [], SpeculationStats()
    for _ in range(2):
        mx.random.seed(5)
        runs.append([t for t, _, _ in speculative_generate_step(PROMPT, target, draft, num_draft_tokens=3, adaptive_draft_length=False,
                                                                max_tokens=40, sampler=sampler, stats=stats)])
    assert runs[0] == runs[1] and stats.acceptance_rule == "speculative sampling"
    # One token left: the round drafts one (upstream's min(k, remaining)) and yields one.
    mx.random.seed(5)
    (only,) = speculative_generate_step(PROMPT, target, draft, num_draft_tokens=3, adaptive_draft_length=False,
                                        max_tokens=1, sampler=sampler)
    assert 0 <= only[0] < VOCAB
    plain = [t for t, _ in generate_step(PROMPT, target, max_tokens=40)]
    greedy = [t for t, _, _ in speculative_generate_step(PROMPT, target, draft, num_draft_tokens=3, adaptive_draft_length=False,
                                                         max_tokens=40,
                                                         stats=stats)]
    assert greedy == plain and stats.acceptance_rule == "token matching"


def test_a_sampler_function_falls_back_to_token_matching():
    """A plain function gives no law: the loop matches its tokens, as for greedy. With an
    argmax function the output equals plain greedy decoding token for token."""
    target, draft = tiny("llama"), tiny("llama", noise=0.2)
    plain = [t for t, _ in generate_step(PROMPT, target, max_tokens=30)]
    argmax = lambda logprobs: mx.argmax(logprobs, axis=-1)  # noqa: E731
    stats = SpeculationStats()
    out = [t for t, _, _ in speculative_generate_step(PROMPT, target, draft, num_draft_tokens=2, adaptive_draft_length=False,
                                                      max_tokens=30,
                                                      sampler=argmax, stats=stats)]
    assert out == plain and 0 < stats.num_accepted < stats.num_drafted
    assert stats.acceptance_rule == "token matching"
