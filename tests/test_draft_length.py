"""The draft-length policy, on simulated rounds (benchmarks/draft_policy_sim.py): seeded
per-token acceptance, round costs from the measured float16 demo pair and from assumed
float32-like and cheap-draft profiles. Pure Python, no models."""

import gc
import math
import random
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))

from draft_policy_sim import CAP, PROFILES, fixed_rates, simulate  # noqa: E402

from mlx_lm.draft_length import (  # noqa: E402
    BatchDraftLengthPolicy,
    DraftLengthMemory,
    DraftLengthPolicy,
    LearnedBatchDraftLength,
    LearnedDraftLength,
    acceptance_evidence,
    best_draft_length,
    expected_tokens,
    interpolated_costs,
)

FLOAT16 = PROFILES["float16 demo pair (measured)"]
NUM_ROUNDS = 1000


def policy_over_best(costs, a, seed=0, drift=0.0, stalls=0.0) -> float:
    """The policy's tokens per second over NUM_ROUNDS rounds / the best fixed k's (whose
    rounds, with a drift, take 1 + drift * (NUM_ROUNDS - 1) / (2 NUM_ROUNDS) times as
    long on average)."""
    run = simulate(DraftLengthPolicy(CAP), costs, lambda r: a, NUM_ROUNDS, seed=seed, drift=drift, stalls=stalls)
    mean_slowdown = (1 + drift * (NUM_ROUNDS - 1) / (2 * NUM_ROUNDS)) * (1 + 2 * stalls)  # a stall adds 2x its round
    return run["tokens"] / run["seconds"] / (max(fixed_rates(a, costs)) / mean_slowdown)


# --- pure functions --------------------------------------------------------------


@pytest.mark.parametrize("a", [0.0, 0.3, 0.9, 1.0])
@pytest.mark.parametrize("k", [0, 1, 4, 8])
def test_expected_tokens_is_the_truncated_geometric_mean(a, k):
    # P(at least i tokens accepted) = a^i, and the target's token always comes.
    assert expected_tokens(a, k) == pytest.approx(1 + sum(a**i for i in range(1, k + 1)))


def test_acceptance_evidence_counts_the_rejection_only_when_one_happened():
    assert acceptance_evidence(4, 2) == (2, 1)
    assert acceptance_evidence(4, 4) == (4, 0)
    assert acceptance_evidence(0, 0) == (0, 0)


def test_evidence_recovers_the_per_token_rate_where_accepted_over_drafted_does_not():
    rng, a, k = random.Random(3), 0.8, 4
    successes = failures = drafted = 0
    for _ in range(20000):
        n = 0
        while n < k and rng.random() < a:
            n += 1
        s, f = acceptance_evidence(k, n)
        successes, failures, drafted = successes + s, failures + f, drafted + k
    assert successes / (successes + failures) == pytest.approx(a, abs=0.01)
    assert successes / drafted < a - 0.1  # the naive rate counts drafts never compared


def test_interpolated_costs():
    prior = interpolated_costs([None, None, None], 0.5)
    assert prior == [1.0, 1.5, 2.0]
    between = interpolated_costs([1.0, None, None, 4.0], 0.3)
    assert between == pytest.approx([1.0, 2.0, 3.0, 4.0])
    beyond = interpolated_costs([None, 2.0, None], 0.5)  # along 1 + 0.5 k from k = 1
    assert beyond == pytest.approx([2.0 / 1.5, 2.0, 2.0 * 2.0 / 1.5])


def test_best_draft_length_takes_the_smaller_k_on_a_tie():
    def best(a, costs):
        return best_draft_length([expected_tokens(a, k) for k in range(len(costs))], costs)
    assert best(0.0, [1.0, 1.0, 1.0]) == 0
    assert best(1.0, [1.0, 2.0, 3.0]) == 0  # 1, 1, 1 tokens per cost
    assert best(0.9, [1.0, 1.1, 1.2]) == 2


# --- the policy in simulation ------------------------------------------------------


@pytest.mark.parametrize("profile", list(PROFILES))
def test_a_draft_that_never_agrees_costs_at_most_ten_percent(profile):
    costs = PROFILES[profile]
    run = simulate(DraftLengthPolicy(CAP), costs, lambda r: 0.0, NUM_ROUNDS, seed=1)
    assert run["tokens"] / run["seconds"] >= 0.9 / costs[0]
    # Plain rounds, bar the probes and near-ties (with the cheap draft a round of k = 1
    # costs 1.1x a plain one, within the 10% jitter).
    assert run["choices"][-100:].count(0) >= 80


@pytest.mark.parametrize("profile", list(PROFILES))
@pytest.mark.parametrize("seed", [0, 1])
def test_within_five_percent_of_the_best_fixed_length_when_the_draft_agrees(profile, seed):
    assert policy_over_best(PROFILES[profile], 0.9, seed=seed) >= 0.95


@pytest.mark.parametrize("a", [0.5, 0.7, 0.95])
def test_within_ten_percent_of_the_best_fixed_length_at_other_rates(a):
    for costs in PROFILES.values():
        assert policy_over_best(costs, a) >= 0.9


def test_costs_that_grow_together_do_not_mislead_it():
    # A context that makes every round 1.5x slower by the end of the run.
    assert policy_over_best(FLOAT16, 0.9, drift=0.5) >= 0.95


@pytest.mark.parametrize("a, bound", [(0.0, 0.9), (0.9, 0.93)])
def test_stalled_rounds_do_not_mislead_it(a, bound):
    # One round in twenty takes 3x as long, whatever its k (another process).
    for costs in PROFILES.values():
        assert policy_over_best(costs, a, stalls=0.05) >= bound


def test_follows_acceptance_down_to_plain_steps_and_back():
    third = 300
    schedule = lambda r: 0.0 if third <= r < 2 * third else 0.9  # noqa: E731
    choices = simulate(DraftLengthPolicy(CAP), FLOAT16, schedule, 3 * third, seed=2)["choices"]
    after_drop, after_return = choices[third : 2 * third], choices[2 * third :]
    # Down: the evidence of ~8 rounds at a high rate unwinds one rejection per round.
    assert after_drop.index(0) <= 30
    assert after_drop[40:].count(0) >= 0.9 * len(after_drop[40:])  # the rest are probes
    # Back: a probe within max_probe_interval rounds (failed probes doubled it from
    # 16), a follow-up probe after each good one, then the estimate climbs; and it
    # stays there.
    first_back = next(i for i, k in enumerate(after_return) if k >= 2)
    assert first_back <= 64 + 16
    assert sum(after_return[first_back + 20 :]) / len(after_return[first_back + 20 :]) >= 3


@pytest.mark.parametrize("cap", [0, 1, 3])
def test_never_drafts_beyond_the_cap(cap):
    policy = DraftLengthPolicy(cap)
    run = simulate(policy, FLOAT16[: cap + 1], lambda r: 0.95 if r % 50 < 25 else 0.0, 300, seed=4)
    assert max(run["choices"]) <= cap
    assert policy.counts == [run["choices"].count(k) for k in range(cap + 1)]


def test_deterministic_given_its_inputs():
    runs = [simulate(DraftLengthPolicy(CAP), FLOAT16, lambda r: 0.8, 300, seed=5)["choices"] for _ in range(2)]
    assert runs[0] == runs[1]


@pytest.mark.parametrize("k", [0, 2, 8])
def test_fixed_always_drafts_k_and_keeps_statistics(k):
    policy = DraftLengthPolicy.fixed(k)
    run = simulate(policy, PROFILES["float32-like (assumed)"], lambda r: 0.0, 100, seed=6)
    assert set(run["choices"]) == {k}
    assert policy.counts[k] == 100 and policy.mean_draft_length == k


def test_statistics_and_estimates():
    policy = DraftLengthPolicy(4)
    assert policy.mean_draft_length == 0.0 and policy.expected_round_seconds(2) is None
    # (The first round of each length is not learned from: it carries one-off work.)
    for num_draft, num_accepted in [(4, 4), (4, 1), (0, 0), (0, 0), (2, 2), (2, 2)]:
        policy.update(num_draft, num_accepted, 0.01 * (1 + num_draft))
    assert policy.counts == [2, 0, 2, 0, 2]
    assert policy.num_rounds == 6 and policy.num_accepted == 9
    assert policy.mean_draft_length == pytest.approx(12 / 6)
    assert 0.5 < policy.acceptance_estimate < 1.0
    assert policy.expected_round_seconds(0) == pytest.approx(0.01, rel=0.1)
    assert policy.expected_round_seconds(3) == pytest.approx(0.04, rel=0.1)  # between 2 and 4


@pytest.mark.parametrize("cap, accepts, expected", [
    (8, True, [0, 0, 1, 2, 4, 8]),  # two plain rounds, then doubles up to the cap
    (6, True, [0, 0, 1, 2, 4, 6]),
    (8, False, [0, 0, 1]),  # the first rejection ends the slow start
    (0, True, [0, 0, 0]),
])
def test_slow_start_doubles_while_every_draft_is_accepted(cap, accepts, expected):
    policy = DraftLengthPolicy(cap)
    choices = []
    while policy.slow_start_rounds is None:
        choices.append(policy.choose())
        policy.update(choices[-1], choices[-1] if accepts else 0, 0.01)
    assert choices == expected


@pytest.mark.parametrize(
    "num_draft, num_accepted, seconds",
    [(5, 0, 0.01), (2, 3, 0.01), (-1, 0, 0.01), (2, 1, 0.0), (2, 1, math.nan)],
)
def test_update_rejects_impossible_rounds(num_draft, num_accepted, seconds):
    with pytest.raises(ValueError):
        DraftLengthPolicy(4).update(num_draft, num_accepted, seconds)


def test_constructor_rejects_bad_settings():
    for settings in [dict(max_draft_tokens=-1), dict(max_draft_tokens=2, probe_interval=1),
                     dict(max_draft_tokens=2, acceptance_memory=0.5), dict(max_draft_tokens=2, prior_accepted=0)]:
        with pytest.raises(ValueError):
            DraftLengthPolicy(**settings)


def test_choose_only_reads_what_update_learned():
    policy = DraftLengthPolicy(6)
    simulate(policy, FLOAT16[:7], lambda r: 0.7, 200, seed=7)
    assert len(set(policy.choose() for _ in range(3))) == 1


def test_choose_after_plain_is_what_choose_says_after_a_plain_round():
    """A pipelined plain stretch decides whether its next step is plain before this
    step is learned: choose_after_plain() must give what choose() gives once it is
    (its time aside), also on the probe rounds, or the probes from k = 0 are lost."""
    policy = DraftLengthPolicy(4, probe_interval=4, max_probe_interval=4)
    for _ in range(6):
        policy.update(2, 0, 0.02)  # nothing accepted: plain steps are best
    probes = 0
    for _ in range(40):
        ahead = policy.choose_after_plain()
        policy.update(0, 0, 0.01)
        assert policy.choose() == ahead
        if ahead > 0:
            probes += 1
            policy.update(ahead, 0, 0.03)
    assert probes >= 40 // 5 - 1


def test_failed_probes_from_plain_steps_double_the_interval_up_to_its_cap():
    """A draft that never agrees: after the plain rounds and two rounds of one draft
    step (the slow start's, and one more: the first round of a length is not timed),
    probes come 16, 32, 64, 64, ... rounds apart; an accepted probe brings the
    interval back to 16."""
    policy = DraftLengthPolicy(3)
    drafting_rounds = []
    for r in range(400):
        k = policy.choose()
        if k:
            drafting_rounds.append(r)
        policy.update(k, int(r >= 300 and k > 0), 0.01 + 0.01 * k)
        if r == 299:
            quiet = drafting_rounds[:]
    assert quiet[:3] == [2, 3, 3 + 16]  # k = 1 twice, then the first probe 16 rounds after the slow start
    assert [b - a for a, b in zip(quiet[2:], quiet[3:])] == [32, 64, 64, 64]
    assert drafting_rounds[len(quiet)] < 300 + 64  # noticed within an interval


def test_plain_rounds_first_measure_plain_steps_before_any_draft():
    """Acceptance 1/3 and a k = 1 round 1.75x a plain step (the demo pair at T=0.7 on
    this CPU): drafting loses. With plain steps measured first, two rounds of k = 1
    (the first is not timed) and the first probe (or two, after a lucky one) are all
    it drafts in 60 rounds; without them the prior line 1 + 0.3 k makes k = 1 look as cheap as plain
    until a plain step is measured."""
    def drafting_rounds(plain_rounds_first, seed):
        rng, policy, drafted = random.Random(seed), DraftLengthPolicy(3, plain_rounds_first=plain_rounds_first), 0
        for _ in range(60):
            k = policy.choose()
            drafted += k > 0
            accepted = 0
            while accepted < k and rng.random() < 1 / 3:
                accepted += 1
            policy.update(k, accepted, 0.005 * (1 + 0.75 * k))
        return drafted
    with_plain_first = [drafting_rounds(2, seed) for seed in range(4)]
    assert max(with_plain_first) <= 6
    assert sum(drafting_rounds(0, seed) for seed in range(4)) >= sum(with_plain_first) + 8


def test_batch_policy_weighs_the_whole_batch():
    """A batch's K maximizes the rows' expected tokens per second of a round at that
    batch size: a good draft pays with one row (a wide verify is nearly free) and not
    with eight on a compute-bound machine (a verify of K + 1 columns costs K + 1 steps)."""
    policy = BatchDraftLengthPolicy()
    for _ in range(3):
        for k in range(4):
            for batch_size, seconds in ((1, 1.0 + 0.1 * k), (8, 1.0 + k)):
                policy.update(k, 0, False)
                policy.learn_cost(batch_size, k, seconds)
    good = (0.8, 3)  # (acceptance, room)
    assert policy.choose(1, [good]) == 3
    assert policy.choose(8, [good] * 8) == 0
    assert policy.choose(2, [good] * 2) == 3  # borrows the nearest batch size's costs
    assert policy.choose(1, [(0.0, 3)]) == 0
    assert policy.choose(1, [good, (0.8, 1)]) == 3  # each row's room caps its own drafts
    assert policy.choose(1, []) == 0  # no row follows the policy (and no round counted)
    policy.update(1, 8, True)  # a probe all accepted by likely rows: cost keeps it plain
    assert policy.choose(8, [good] * 8) == 0
    fixed = BatchDraftLengthPolicy(adaptive=False)
    assert fixed.choose(8, [good, (0.0, 2)]) == 3
    with pytest.raises(ValueError, match="probe_interval"):
        BatchDraftLengthPolicy(probe_interval=1)


def test_batch_policy_probes_less_often_while_probes_fail():
    """From K = 0 a probe (the largest room) comes after 16 rounds; each probe with nothing
    accepted doubles the wait (to at most 256), one with an acceptance resets it, and
    one with every draft accepted is followed by another at once."""
    policy = BatchDraftLengthPolicy()
    bad = [(0.0, 3)] * 4

    def rounds_to_next_probe(accepted_at_probe):
        for n in range(1, 1000):
            k = policy.choose(4, bad)
            policy.update(k, accepted_at_probe if k else 0, accepted_at_probe == 4 and k > 0)
            policy.learn_cost(4, k, 1.0 + k)
            if k:
                return n

    waits = [rounds_to_next_probe(0) for _ in range(7)]
    assert waits == [16, 32, 64, 128, 256, 256, 256]
    rounds_to_next_probe(1)  # something accepted: back to every 16 rounds
    assert rounds_to_next_probe(0) == 16
    assert rounds_to_next_probe(4) == 32 and rounds_to_next_probe(0) == 1  # all accepted: at once


def test_a_probe_from_plain_steps_drafts_the_largest_room():
    """A plain batch probes with every draft its rows have room for: rows whose drafts
    agree again show it by several acceptances each, not one."""
    policy = BatchDraftLengthPolicy()
    rows = [(0.0, 3), (0.0, 2)]
    choices = []
    for _ in range(16):
        k = policy.choose(2, rows)
        policy.update(k, 0, False)
        policy.learn_cost(2, k, 1.0 + k)
        choices.append(k)
    assert choices == [0] * 15 + [3]


def test_batch_policy_probes_the_least_recent_draft_length():
    """While drafting K = 3 is best, probes visit the other lengths, least recently
    chosen first: K = 0 among them, so a batch learns what its plain steps cost."""
    policy = BatchDraftLengthPolicy()
    for k in range(4):
        policy.update(k, 0, False)
        policy.learn_cost(1, k, 1.0 + 0.1 * k)
    choices = []
    for _ in range(64):
        k = policy.choose(1, [(0.8, 3)])
        policy.update(k, k, True)
        policy.learn_cost(1, k, 1.0 + 0.1 * k)
        choices.append(k)
    assert [(n, k) for n, k in enumerate(choices) if k != 3] == [(15, 0), (31, 1), (47, 2), (63, 0)]


def test_a_joining_row_starts_at_the_batch_acceptance():
    """A new row's acceptance starts at what the batch's rows showed lately, with the
    weight of row_prior_weight comparisons (its own rounds soon outweigh it), and two
    misses in a row do not sink a row that accepts most drafts."""
    policy = BatchDraftLengthPolicy()
    assert policy.new_row().value == 0.5
    for _ in range(64):
        policy.learn_row(policy.new_row(), 3, 3)  # every draft accepted
    row = policy.new_row()
    assert row.value > 0.9 and row.successes + row.failures == pytest.approx(8.0)
    for _ in range(6):
        policy.learn_row(row, 3, 3)
    policy.learn_row(row, 3, 0)
    policy.learn_row(row, 3, 0)
    assert row.value > 0.85
    for _ in range(24):  # a row whose drafts stopped agreeing is noticed within a few dozen rounds
        policy.learn_row(row, 1, 0)
    assert row.value < 0.4


# --- warm start: what earlier calls of a pair learned (DRAFT_LENGTHS) ----------------

MTP_COSTS = [4.5e-3, 6.2e-3, 7.3e-3, 8.4e-3]  # the demo's MTP head on OpenBLAS: plain 4.5 ms, head 0.9 ms


def learned_from_a_call(costs, a, num_rounds=40, seed=0) -> LearnedDraftLength:
    """The state a cold policy leaves after one simulated call."""
    policy = DraftLengthPolicy(len(costs) - 1)
    simulate(policy, costs, lambda r: a, num_rounds, seed=seed)
    return policy.learned


def test_a_policy_that_starts_from_what_a_call_learned_drafts_from_its_first_round():
    learned = learned_from_a_call(MTP_COSTS, 0.9)
    assert learned.warm
    assert DraftLengthPolicy(3).choose() == 0  # cold: plain rounds first
    warm = DraftLengthPolicy(3, learned=learned)
    assert warm.choose() == 3
    assert warm.costs is learned.costs and warm.acceptance is learned.acceptance  # it learns into them
    before = learned.num_drafting_rounds
    warm.update(3, 3, MTP_COSTS[3])
    assert learned.num_drafting_rounds == before + 1


def test_a_warm_start_from_a_draft_that_never_agrees_stays_plain_with_its_probe_interval():
    learned = learned_from_a_call(MTP_COSTS, 0.0, num_rounds=200)
    assert learned.probe_interval == 64  # failed probes doubled it
    run = simulate(DraftLengthPolicy(3, learned=learned), MTP_COSTS, lambda r: 0.0, 48, seed=1)
    assert run["choices"].count(0) >= 47


def test_the_mtp_head_drafts_its_cap_from_the_second_call():
    """With the MTP head's costs (a draft step a fifth of a plain one) and its acceptance,
    short calls draft at the cap: tokens per target forward within 5% of fixed k = 3
    from the second call on, and the first call already within 10%."""
    fixed = simulate(DraftLengthPolicy.fixed(3), MTP_COSTS, lambda r: 0.9, 40, seed=0)["tokens"]
    learned = None
    for call in range(4):
        policy = DraftLengthPolicy(3, learned=learned)
        run = simulate(policy, MTP_COSTS, lambda r: 0.9, 40, seed=call)
        learned = policy.learned
        assert run["tokens"] >= (0.95 if call else 0.9) * fixed, (call, run["choices"])
        if call:
            assert run["choices"].count(0) <= 1, run["choices"]


def test_memory_keys_by_models_and_setting_and_forgets_collected_models():
    class Model:
        pass

    memory = DraftLengthMemory()
    target, draft, other = Model(), Model(), Model()
    entry = memory.get([target, draft], ("sequence", 1), object)
    assert memory.get([target, draft], ("sequence", 1), object) is entry
    assert memory.get([target, other], ("sequence", 1), object) is not entry  # another pair: fresh
    assert memory.get([target, draft], ("batch", 1), object) is not entry  # another setting: fresh
    assert len(memory) == 3
    del other
    gc.collect()
    assert len(memory) == 2  # the memory holds no model alive and drops its entries
    memory.forget()
    assert len(memory) == 0


def test_the_first_timed_round_of_each_shape_is_not_learned():
    """A round's first call at new shapes carries one-off work: its time is dropped,
    per (batch size, K), and the shapes seen are shared like the costs."""
    learned = LearnedBatchDraftLength()
    policy = BatchDraftLengthPolicy(learned=learned)
    policy.learn_round_time(4, 3, 1.0)  # first K = 3 round at batch 4: dropped
    assert policy.costs == {}
    policy.learn_round_time(4, 3, 0.02)
    assert policy.costs[4].costs(3)[3] == pytest.approx(0.02)
    policy.learn_round_time(2, 3, 1.0)  # another batch size: its own first round
    assert 2 not in policy.costs
    later = BatchDraftLengthPolicy(learned=learned)
    later.learn_round_time(4, 3, 0.03)
    assert later.costs[4].costs(3)[3] > 0.02


def test_batch_policies_share_costs_per_batch_size():
    learned = LearnedBatchDraftLength()
    first = BatchDraftLengthPolicy(learned=learned)
    first.learn_cost(4, 2, 0.02)
    first.learn_row(first.new_row(), 4, 4)
    second = BatchDraftLengthPolicy(learned=learned)
    assert sorted(second.costs) == [4]  # batch size 4 learned; 1 is not
    assert second.costs[4].costs(2)[2] == pytest.approx(0.02)
    assert second.new_row().value > 0.5  # the pooled acceptance carried over
    assert BatchDraftLengthPolicy().costs == {}


# --- warm start in the loops (tiny fixtures; the learned state injected, no timing) ---


def tiny(name="llama_tf4"):
    from conftest import FIXTURES

    from mlx_lm.utils import load_model

    return load_model(FIXTURES / name)[0]


def teach_drafting_pays(learned: LearnedDraftLength, cap: int) -> None:
    """Rounds of every k that cost little more than a plain step (as measured so far,
    if at all) and were all accepted."""
    plain = learned.costs.costs(cap)[0] if learned.costs.measured else 1.0
    policy = DraftLengthPolicy(cap, learned=learned)
    for _ in range(3):
        for k in range(cap + 1):
            policy.update(k, k, plain * (1.0 + 0.05 * k))


def test_a_second_call_with_the_same_pair_starts_from_what_the_first_learned():
    import mlx.core as mx

    from mlx_lm.generate import SpeculationStats, speculative_generate_step
    from mlx_lm.sample_utils import make_sampler
    from mlx_lm.speculative import learned_draft_length

    target, draft = tiny(), tiny()  # the draft is the target's twin: every draft agrees
    prompt = mx.array([3, 17, 5, 9, 21, 4])

    def run(draft_model):
        stats = SpeculationStats()
        tokens = [t for t, _, _ in speculative_generate_step(prompt, target, draft_model, num_draft_tokens=4,
                                                             max_tokens=5, stats=stats)]
        return tokens, stats

    first, _ = run(draft)
    learned = learned_draft_length(target, draft, "DraftModel", make_sampler(), (None, 64, 0), 4)
    assert learned.num_drafting_rounds > 0 or learned.lengths_seen == {0}  # the first call learned into it
    teach_drafting_pays(learned, 4)
    second, stats = run(draft)
    assert second == first
    assert stats.num_target_forwards == 1 and stats.draft_lengths[4] == 1  # round one drafted the cap
    other = tiny()  # another draft model: another pair, cold (plain rounds first)
    assert learned_draft_length(target, other, "DraftModel", make_sampler(), (None, 64, 0), 4) is not learned
    third, stats = run(other)
    assert third == first and stats.num_target_forwards >= 3 and stats.draft_lengths[0] >= 2


def test_a_seeded_sampled_run_with_a_pinned_length_ignores_the_warm_state():
    import mlx.core as mx

    from mlx_lm.generate import speculative_generate_step
    from mlx_lm.sample_utils import make_sampler
    from mlx_lm.speculative import learned_draft_length

    target, draft = tiny(), tiny()
    prompt = mx.array([3, 17, 5, 9, 21, 4])
    sampler = make_sampler(0.7)

    def seeded():
        mx.random.seed(7)
        return [t for t, _, _ in speculative_generate_step(prompt, target, draft, num_draft_tokens=3, max_tokens=12,
                                                           sampler=sampler, adaptive_draft_length=False)]

    before = seeded()
    teach_drafting_pays(learned_draft_length(target, draft, "DraftModel", sampler, (None, 64, 0), 3), 3)
    list(speculative_generate_step(prompt, target, draft, num_draft_tokens=3, max_tokens=12, sampler=sampler))
    assert seeded() == before


def test_batch_generators_of_the_same_pair_share_their_costs():
    from mlx_lm.batching import BatchGenerator

    target, draft = tiny(), tiny()
    first, second = BatchGenerator(target, draft_model=draft), BatchGenerator(target, draft_model=draft)
    assert first._policy.costs is second._policy.costs and first._policy.pooled is second._policy.pooled
    first._policy.learn_cost(3, 1, 0.01)
    assert sorted(second._policy.costs) == [3]  # batch sizes keyed separately
    assert BatchGenerator(target, draft_model=tiny())._policy.costs == {}  # another pair
    assert BatchGenerator(target, draft_model=draft, fixed_draft_length=True)._policy.costs == {}
