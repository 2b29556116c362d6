"""Continuous batching (mlx_lm/batching.py, mlx_lm/models/batch_cache.py): every greedy
answer equals its solo run, for dense, sliding-window and hybrid (GDN, short-conv,
Mamba-2) targets, with mixed
prompt lengths, sequences joining and leaving mid-flight, removal, prompt caches and stop
tokens; seeded sampling does not depend on the batch."""

import itertools

import mlx.core as mx
import pytest
from mlx.utils import tree_flatten, tree_unflatten

from checkpoints import TINY_CONFIGS
from mlx_lm import batch_drafters, batching
from mlx_lm.batching import BatchGenerator, batch_generate
from mlx_lm.draft_length import BatchDraftLengthPolicy, DraftLengthMemory
from mlx_lm.feeding import ids_within
from mlx_lm.generate import generate_step
from mlx_lm.models.batch_cache import (
    _AlignedKV, BatchArraysCache, BatchKVCache, BatchRotatingKVCache, extract_caches, make_room, merge_caches,
    trim_rows,
)
from mlx_lm.models.cache import (
    KVCache, QuantizedKVCache, RotatingKVCache, make_prompt_cache, maybe_quantize_kv_cache,
)
from mlx_lm.sample_utils import make_repetition_penalty, make_sampler
from mlx_lm.utils import get_model_classes

SLIDING_CONFIG = dict(
    model_type="mistral", hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, vocab_size=256, sliding_window=6, layer_types=["full_attention", "sliding_attention"],
    rms_norm_eps=1e-5, rope_theta=10000.0,
)
LFM2_CONFIG = dict(
    model_type="lfm2", vocab_size=256, hidden_size=64, num_hidden_layers=4, num_attention_heads=4,
    num_key_value_heads=2, intermediate_size=128, block_auto_adjust_ff_dim=False,
    layer_types=["conv", "full_attention", "conv", "full_attention"],
)
NEMOTRON_H_CONFIG = dict(
    model_type="nemotron_h", vocab_size=256, hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
    head_dim=16, mamba_num_heads=8, mamba_head_dim=8, ssm_state_size=16, n_groups=2, intermediate_size=128,
    hybrid_override_pattern="M*M-", num_hidden_layers=4,
)
CONFIGS = {
    "qwen3": TINY_CONFIGS["qwen3"],  # dense KV
    "mistral_sliding": SLIDING_CONFIG,  # a window of 6 next to a full layer
    "gpt_oss": TINY_CONFIGS["gpt_oss"],  # windows of 8, attention sinks, experts
    "qwen3_next": TINY_CONFIGS["qwen3_next"],  # GDN recurrent + conv state
    "lfm2": LFM2_CONFIG,  # short-conv state
    "nemotron_h": NEMOTRON_H_CONFIG,  # Mamba-2 SSM + conv state
}
# Heads of 32: KV quantizable in groups of 32.
MODEL_CONFIGS = dict(CONFIGS, quantizable=dict(TINY_CONFIGS["qwen3"], num_attention_heads=2, num_key_value_heads=1,
                                               head_dim=32))
_MODELS = {}


def tiny_model(name):
    """Random weights large enough that greedy choices are clear (as write_checkpoint)."""
    if name not in _MODELS:
        model_class, args_class = get_model_classes(MODEL_CONFIGS[name])
        mx.random.seed(3)
        model = model_class(args_class.from_dict(MODEL_CONFIGS[name]))
        weights = [(k, mx.random.normal(v.shape) * 0.5) for k, v in tree_flatten(model.parameters())]
        model.update(tree_unflatten(weights))
        mx.eval(model.parameters())
        _MODELS[name] = model
    return _MODELS[name]


def prompt(length, seed):
    return mx.random.randint(1, 200, (length,), key=mx.random.key(seed)).tolist()


def solo(model, tokens, max_tokens, **kwargs):
    steps = generate_step(mx.array(tokens), model, max_tokens=max_tokens, **kwargs)
    return [t for t, _ in steps]


def run(generator, until_done=True, steps=None):
    """Step the generator; uid -> generated tokens."""
    out = {}
    n = 0
    while len(generator) and (steps is None or n < steps):
        for r in generator.next_generated():
            out.setdefault(r.uid, []).append(r.token)
        n += 1
    return out


@pytest.mark.parametrize("name", list(CONFIGS))
@pytest.mark.parametrize("block", [256, 4])
def test_greedy_equals_solo_with_joins_and_leaves(name, block, monkeypatch):
    # Blocks of 4 columns: the batched buffers grow and drop old window columns often.
    monkeypatch.setattr(_AlignedKV, "step", block)
    model = tiny_model(name)
    lengths, budgets = [3, 13, 1, 9, 5], [9, 4, 7, 11, 6]
    prompts = [prompt(n, seed) for seed, n in enumerate(lengths)]
    # Two rows at most, prefilled 4 tokens a chunk: rows join as others finish, and the
    # 13-token prompt is prefilled in chunks while another row decodes.
    generator = BatchGenerator(model, completion_batch_size=2, prefill_step_size=4)
    uids = generator.insert(prompts[:3], max_tokens=budgets[:3])
    out = run(generator, steps=3)
    uids += generator.insert(prompts[3:], max_tokens=budgets[3:])  # join mid-flight
    for uid, tokens in run(generator).items():
        out.setdefault(uid, []).extend(tokens)
    for uid, p, budget in zip(uids, prompts, budgets):
        assert out[uid] == solo(model, p, budget, prefill_step_size=4), (name, uid)


@pytest.mark.parametrize("name", ["qwen3", "qwen3_next"])
def test_removed_row_leaves_the_others_and_its_cache_continues(name):
    model = tiny_model(name)
    prompts = [prompt(n, 10 + n) for n in (4, 7, 2)]
    generator = BatchGenerator(model, max_tokens=10)
    uids = generator.insert(prompts)
    out = run(generator, steps=5)
    removed = generator.remove([uids[1]], return_prompt_caches=True)
    cache, held = removed[uids[1]]
    for uid, tokens in run(generator).items():
        out[uid] += tokens
    for uid, p in zip(uids, prompts):
        want = solo(model, p, 10)
        if uid == uids[1]:
            got = out[uid]
            assert got == want[: len(got)] and held == p + got
            # The removed row's cache holds the prompt and its tokens: decoding on from it
            # gives the rest of the solo answer.
            cont = generate_step(mx.array(want[len(got) : len(got) + 1]), model, max_tokens=3, prompt_cache=cache)
            assert [t for t, _ in cont] == want[len(got) + 1 : len(got) + 4]
        else:
            assert out[uid] == want


def test_prompt_cache_reuse_and_returned_caches():
    model = tiny_model("qwen3_next")
    full = prompt(12, 42)
    cache = make_prompt_cache(model)
    model(mx.array(full[:7])[None], cache=cache)
    generator = BatchGenerator(model, return_prompt_caches=True)
    out, caches = generate_all(generator, [full[7:], prompt(5, 43)], 6, caches=[cache, None])
    solo_cache = make_prompt_cache(model)
    assert out[0] == solo(model, full, 6, prompt_cache=solo_cache)
    assert_same_caches(caches[0], solo_cache)  # the prompt and all 6 tokens, as the solo run's


def assert_same_caches(mine, theirs):
    for a_entry, b_entry in zip(mine, theirs):
        for a, b in zip(flat(a_entry), flat(b_entry)):
            assert a.shape == b.shape and mx.allclose(a, b, atol=1e-4)


def flat(entry):
    """What a cache entry holds, in temporal order (a ring buffer's layout aside)."""
    if isinstance(entry, RotatingKVCache):
        return [mx.array(entry.offset)] + [entry._temporal_order(b) for b in (entry.keys, entry.values)]
    return [x for _, x in tree_flatten(list(entry.state))]


def test_stop_tokens_and_processors():
    model = tiny_model("qwen3")
    p = prompt(6, 7)
    free = solo(model, p, 8)
    stop = free[3]
    penalty = [make_repetition_penalty(1.5, 8)]
    generator = BatchGenerator(model, stop_tokens={stop}, max_tokens=8)
    uid_stop, uid_pen = generator.insert([p, p], logits_processors=[None, penalty])
    responses = {}
    while len(generator):
        for r in generator.next_generated():
            responses.setdefault(r.uid, []).append(r)
    stopped = responses[uid_stop]
    assert [r.token for r in stopped] == free[: free.index(stop) + 1] and stopped[-1].finish_reason == "stop"
    penalised = [r.token for r in responses[uid_pen]]
    want = solo(model, p, 8, logits_processors=penalty)
    assert penalised[: len(want)] == want[: len(penalised)] and (stop in want or len(penalised) == 8)


def test_seeded_sampling_does_not_depend_on_the_batch():
    model = tiny_model("qwen3")
    sampler = make_sampler(temp=1.0)
    p = prompt(5, 3)

    def sample(with_others):
        generator = BatchGenerator(model, max_tokens=12, sampler=sampler)
        others = [prompt(4, 8), prompt(9, 9)] if with_others else []
        uid = generator.insert([p] + others, seeds=[17] + [None] * len(others))[0]
        return run(generator)[uid]

    alone = sample(False)
    assert alone == sample(True) and len(set(alone)) > 1


def test_a_seeded_row_draws_with_its_own_keys():
    """A seeded row's t-th token is drawn with a key of its seed and t: the same tokens
    alone, beside others, plain or speculating (any draft length), and a prefix of
    them with a smaller max_tokens; the global mx.random state is left alone (it used
    to be reseeded, which fixed every unseeded row drawn after it)."""
    model, draft = tiny_model("qwen3"), perturbed("qwen3")
    sampler = make_sampler(temp=1.0, top_p=0.95)
    p = prompt(5, 3)

    def sample(max_tokens, others=(), **kwargs):
        generator = BatchGenerator(model, sampler=sampler, **kwargs)
        uid = generator.insert([p, *others], max_tokens=[max_tokens] + [12] * len(others),
                               seeds=[17] + [None] * len(others))[0]
        return run(generator)[uid]

    alone = sample(12)
    assert len(set(alone)) > 1
    for kwargs in ({}, {"draft_model": draft}, {"draft_model": draft, "fixed_draft_length": True},
                   {"prompt_lookup": True}):
        assert sample(12, [prompt(4, 8), prompt(9, 9)], **kwargs) == alone, kwargs
        assert sample(3, **kwargs) == alone[:3], kwargs
    mx.random.seed(5)
    expected = mx.random.uniform().item()
    mx.random.seed(5)
    sample(12, draft_model=draft)
    assert mx.random.uniform().item() == expected
    with pytest.raises(ValueError, match="a seed needs a sampler from make_sampler"):
        BatchGenerator(model, sampler=lambda logprobs: mx.argmax(logprobs, axis=-1)).insert([p], seeds=[1])


def test_batch_kv_cache_layout_and_mask():
    rows = []
    for n in (3, 5):
        c = KVCache()
        c.update_and_fetch(mx.random.normal((1, 2, n, 4)), mx.random.normal((1, 2, n, 4)))
        rows.append(c)
    batch = merge_caches([[c] for c in rows])[0]
    assert isinstance(batch, BatchKVCache) and batch.num_invalid == [2, 0] and batch.offset.tolist() == [3, 5]
    mask = batch.make_mask(2)
    # Row 0: padding columns 0, 1 hidden; query 0 (column 5) sees 2..5, query 1 sees 2..6.
    assert mask.shape == (2, 1, 2, 7)
    F, T = False, True
    assert mask[0, 0].tolist() == [[F, F, T, T, T, T, F], [F, F, T, T, T, T, T]]
    assert mask[1, 0, 0].tolist() == [True] * 6 + [False]
    back = extract_caches([batch], 0)[0]
    assert mx.array_equal(back.state[0], rows[0].state[0]) and back.offset == 3
    assert batch.positions[:, :5].tolist() == [[-1, -1, 0, 1, 2], [0, 1, 2, 3, 4]]
    kept = batch.filter([1])  # in place, as upstream's
    assert kept is batch and kept.num_invalid == [0] and kept.width == 5
    assert kept.positions[:, :5].tolist() == [[0, 1, 2, 3, 4]]


def test_batch_kv_cache_trims_each_row_and_squeezes_holes(monkeypatch):
    monkeypatch.setattr(_AlignedKV, "step", 8)
    rows = []
    for n in (2, 4):
        c = KVCache()
        c.update_and_fetch(*[mx.arange(n, dtype=mx.float32).reshape(1, 1, n, 1)] * 2)
        rows.append(c)
    batch = merge_caches([[c] for c in rows])[0]
    new = mx.full((2, 1, 3, 1), 9.0)
    batch.update_and_fetch(new, new)
    batch.trim_rows([3, 1])  # row 0 keeps none of the three, row 1 two
    assert batch.lengths == [2, 6] and batch.offset.tolist() == [2, 6] and batch.width == 6
    assert batch.positions[:, :6].tolist() == [[-1, -1, 0, 1, -1, -1], [0, 1, 2, 3, 4, 5]]
    mask = batch.make_mask(1)[:, 0, 0]  # the next token of each row sees its own tokens only
    assert mask.tolist() == [[False, False, True, True, False, False, True], [True] * 7]
    compact = []
    monkeypatch.setattr(_AlignedKV, "_compact", lambda self, real=_AlignedKV._compact: compact.append(1) or real(self))
    for _ in range(3):  # past the 8 columns: the holes are squeezed out, then it grows
        make_room([batch], 1)  # as the generator does before each forward
        batch.update_and_fetch(new[:, :, :1], new[:, :, :1])
    assert compact and batch.num_invalid == [4, 0]
    assert extract_caches([batch], 0)[0].state[0][0, 0, :, 0].tolist() == [0, 1, 9, 9, 9]
    assert extract_caches([batch], 1)[0].offset == 9


def test_batch_rotating_cache_keeps_each_window():
    c = RotatingKVCache(4)
    for _ in range(6):  # wrapped
        c.update_and_fetch(mx.random.normal((1, 1, 1, 2)), mx.random.normal((1, 1, 1, 2)))
    batch = BatchRotatingKVCache.merge([c])
    back = batch.extract(0)
    assert back.offset == 6 and mx.array_equal(back._temporal_order(back.keys), c._temporal_order(c.keys))
    with pytest.raises(ValueError, match="sink tokens"):
        BatchRotatingKVCache.merge([RotatingKVCache(8, keep=4)])


@pytest.mark.parametrize("draft", [False, True])
def test_every_step_evaluates_the_positions_it_updates(draft, monkeypatch):
    """A plain step of a gapless batch never reads `positions`; left lazy, its updates
    piled up (one per layer and step) until a row left, which then waited for all of
    them. Each step evaluates them with its tokens, speculative rounds too."""
    model = tiny_model("qwen3")
    evaluated = []
    for name in ("eval", "async_eval"):
        real = getattr(mx, name)
        def recording(*arrays, real=real):
            evaluated.extend(id(a) for _, a in tree_flatten(list(arrays)))
            return real(*arrays)
        monkeypatch.setattr(mx, name, recording)
    extra = dict(draft_model=tiny_model("qwen3"), fixed_draft_length=True, num_draft_tokens=2) if draft else {}
    generator = BatchGenerator(model, max_tokens=6, **extra)
    generator.insert([prompt(5, 1), prompt(9, 2)])
    checked = 0
    while len(generator) > 1:  # (a leaving row's read would evaluate them anyway)
        generator.next()
        if generator._table.caches is not None:
            entries = [e for e in generator._table.caches if isinstance(e, _AlignedKV)]
            assert entries and all(id(e.positions) in evaluated for e in entries)
            checked += 1
        evaluated.clear()
    assert checked >= 2


def test_unbatchable_cache_is_refused_by_name():
    with pytest.raises(ValueError, match="KVCache, QuantizedKVCache"):
        merge_caches([[KVCache()], [QuantizedKVCache()]])
    with pytest.raises(ValueError, match="max_tokens"):
        BatchGenerator(tiny_model("qwen3")).insert([[1, 2]], max_tokens=0)


def test_batch_generate_texts_equal_solo(tiny_model_dir):
    from mlx_lm import load
    from mlx_lm.generate import generate

    model, tokenizer = load(str(tiny_model_dir))
    prompts = ["hello there", "a much longer prompt than the first one", "x"]
    result = batch_generate(model, tokenizer, prompts, max_tokens=8, return_token_ids=True)
    for text, p in zip(result.texts, prompts):
        assert text == generate(model, tokenizer, p, max_tokens=8)
    assert result.stats.generation_tokens == sum(len(t) for t in result.token_ids) + sum(
        len(t) < 8 for t in result.token_ids
    )


def repetitive_prompt(length, seed):
    """A short random phrase repeated: prompt lookup finds drafts, right or wrong."""
    phrase = prompt(3 + seed % 3, seed)
    return (phrase * length)[:length]


class OracleLookup:
    """Drafts from the solo answer, the k-th draft of every few rounds wrong, so rows
    accept different numbers of drafts (every per-row rollback length is exercised)."""

    def __init__(self, answer, always_right=False):
        self.answer, self.committed, self.rounds = answer or [], -1, 0  # the first extend is the prompt's token
        self.always_right = always_right

    def extend(self, tokens):
        self.committed += len(tokens)

    def lookup(self, k):
        self.rounds += 1
        drafts = list(self.answer[max(self.committed, 0) : max(self.committed, 0) + k])
        wrong = self.rounds % (k + 1)
        if wrong < len(drafts) and not self.always_right:
            drafts[wrong] = (drafts[wrong] + 1) % 200
        return drafts


def generate_all(generator, prompts, budgets, **kwargs):
    uids = generator.insert(prompts, max_tokens=budgets, **kwargs)
    out, caches = {}, {}
    while len(generator):
        for r in generator.next_generated():
            out.setdefault(r.uid, []).append(r.token)
            if r.finish_reason:
                caches[r.uid] = r.prompt_cache
    return [out[u] for u in uids], [caches.get(u) for u in uids]


@pytest.mark.parametrize("name", list(CONFIGS))
def test_speculation_in_the_batch_equals_solo(name, monkeypatch):
    monkeypatch.setattr(_AlignedKV, "step", 8)  # holes squeezed out and buffers grown often
    model = tiny_model(name)
    lengths, budgets = [14, 5, 22, 9], [12, 16, 7, 14]
    prompts = [repetitive_prompt(n, seed) for seed, n in enumerate(lengths)]
    solo_caches = [make_prompt_cache(model) for _ in prompts]
    answers = [solo(model, p, b, prefill_step_size=6, prompt_cache=c) for p, b, c in zip(prompts, budgets, solo_caches)]
    oracles = {tuple(p): a for p, a in zip(prompts, answers)}
    monkeypatch.setattr(batch_drafters, "PromptLookup", lambda n, context=(): OracleLookup(oracles.get(tuple(context))))
    generator = BatchGenerator(model, completion_batch_size=3, prefill_step_size=6, prompt_lookup=True,
                               num_draft_tokens=3, return_prompt_caches=True)
    out, caches = generate_all(generator, prompts, budgets)
    stats = generator.stats()
    assert 0 < stats.accepted_tokens < stats.draft_tokens  # drafts accepted and rejected
    for i in range(len(prompts)):
        assert out[i] == answers[i], (name, i)
        assert_same_caches(caches[i], solo_caches[i])  # rolled back per row: the prompt and the answer


def test_prompt_lookup_in_the_batch_equals_solo():
    model = tiny_model("qwen3")
    lengths, budgets = [14, 5, 22, 9], [12, 16, 7, 14]
    prompts = [repetitive_prompt(n, seed) for seed, n in enumerate(lengths)]
    sampled, penalty = make_sampler(temp=1.0), [make_repetition_penalty(1.3, 6)]
    generator = BatchGenerator(model, completion_batch_size=4, prefill_step_size=6, prompt_lookup=True)
    # Greedy rows, a seeded sampled row (speculative sampling) and a row with a penalty (which sees, at
    # each verified position, the history plain decoding would show it).
    out, _ = generate_all(generator, prompts + [prompts[0], prompts[1]], budgets + [12, 8],
                          samplers=[None] * 5 + [sampled], seeds=[None] * 5 + [5],
                          logits_processors=[None] * 4 + [penalty, None])
    assert generator.stats().accepted_tokens > 0
    for i, (p, budget) in enumerate(zip(prompts, budgets)):
        assert out[i] == solo(model, p, budget), i
    assert out[4] == solo(model, prompts[0], 12, logits_processors=penalty)
    alone = BatchGenerator(model, max_tokens=8, prompt_lookup=True)
    assert out[5] == generate_all(alone, [prompts[1]], 8, samplers=[sampled], seeds=[5])[0][0]


class FixedLookup:
    def __init__(self, token):
        self.token = token

    def extend(self, tokens):
        pass

    def lookup(self, k):
        return [self.token][:k]


@pytest.mark.parametrize("drafted", ["likely", "unlikely"])
def test_speculative_sampling_in_the_batch_keeps_the_law(drafted, monkeypatch):
    """Sampling at temperature 1 with one drafted token after the prompt: over many
    seeds, the first token follows the target's law whether the draft is likely
    (mostly accepted) or not (mostly corrected)."""
    model = tiny_model("qwen3")
    p = prompt(6, 21)
    law = mx.softmax(model(mx.array(p)[None])[0, -1], axis=-1)
    ranked = mx.argsort(-law).tolist()
    draft = ranked[0] if drafted == "likely" else ranked[-1]
    monkeypatch.setattr(batch_drafters, "PromptLookup", lambda n, context=(): FixedLookup(draft))
    generator = BatchGenerator(model, max_tokens=1, sampler=make_sampler(temp=1.0), prompt_lookup=True,
                               fixed_draft_length=True)
    num_samples = 400
    firsts = [t[0] for t in generate_all(generator, [p] * num_samples, 1, seeds=list(range(num_samples)))[0]]
    assert generator.stats().draft_tokens == num_samples
    for token in ranked[:2]:
        q = law[token].item()
        frequency = firsts.count(token) / num_samples
        assert abs(frequency - q) < 4 * (q * (1 - q) / num_samples) ** 0.5 + 1e-3, (token, frequency, q)


def test_insert_checks_each_draft_cap():
    generator = BatchGenerator(tiny_model("qwen3"), prompt_lookup=True, num_draft_tokens=3)
    for bad in (0, -2):  # 0 used to become the default cap
        with pytest.raises(ValueError, match=f"num_draft_tokens must be at least 1, got {bad}"):
            generator.insert([prompt(4, 1)], num_draft_tokens=[bad])
    assert len(generator) == 0
    generator.insert([prompt(4, 1)], num_draft_tokens=[None])  # None: the generator's cap
    assert generator._queued[0].num_draft_tokens == 3


def test_prompt_lookup_needs_layers_that_record():
    class Plain(type(tiny_model("qwen3_next"))):
        supports_speculative_rollback = False

    model = tiny_model("qwen3_next")
    model.__class__ = Plain
    try:
        with pytest.raises(ValueError, match="ArraysCache"):
            BatchGenerator(model, prompt_lookup=True)
    finally:
        model.__class__ = Plain.__bases__[0]


def perturbed(name, noise=0.03):
    """The target with noise on its weights: a draft that agrees with it part of the time."""
    model_class, args_class = get_model_classes(CONFIGS[name])
    draft = model_class(args_class.from_dict(CONFIGS[name]))
    mx.random.seed(11)
    draft.update(tree_unflatten([(k, v + noise * mx.random.normal(v.shape))
                                 for k, v in tree_flatten(tiny_model(name).parameters())]))
    mx.eval(draft.parameters())
    return draft


@pytest.mark.parametrize("name, draft_of", [("qwen3", "qwen3"), ("mistral_sliding", "mistral_sliding"),
                                            ("gpt_oss", "gpt_oss"), ("qwen3_next", "qwen3"), ("lfm2", "qwen3"),
                                            ("qwen3", "qwen3_next"), ("qwen3_next", "qwen3_next"), ("qwen3", "lfm2"),
                                            ("nemotron_h", "nemotron_h")])
def test_draft_model_in_the_batch_equals_solo(name, draft_of, monkeypatch):
    monkeypatch.setattr(_AlignedKV, "step", 8)
    model, draft = tiny_model(name), perturbed(draft_of)
    lengths, budgets = [14, 5, 22, 9], [12, 16, 7, 14]
    prompts = [repetitive_prompt(n, seed) for seed, n in enumerate(lengths)]
    solo_caches = [make_prompt_cache(model) for _ in prompts]
    answers = [solo(model, p, b, prefill_step_size=6, prompt_cache=c) for p, b, c in zip(prompts, budgets, solo_caches)]
    generator = BatchGenerator(model, completion_batch_size=3, prefill_step_size=6, draft_model=draft,
                               num_draft_tokens=3, return_prompt_caches=True)
    out, caches = generate_all(generator, prompts, budgets)
    stats = generator.stats()
    assert stats.draft_tokens > 0 and (stats.accepted_tokens > 0 or draft_of != name)
    num_target = len(solo_caches[0])
    for i, (p, a) in enumerate(zip(prompts, answers)):
        assert out[i] == a, (name, i)
        assert_same_caches(caches[i][:num_target], solo_caches[i])
        # The draft's half holds the same tokens (ids past its table as 0): it continues
        # like a fresh feed of them.
        fresh = make_prompt_cache(draft)
        draft(ids_within(mx.array(p + a), draft.args.vocab_size)[None], cache=fresh)
        assert_same_caches(caches[i][num_target:], fresh)


def test_a_draft_that_sits_out_plain_steps_catches_up(monkeypatch):
    """A draft that rarely agrees (a round drafting K costing 1 + K/2 plain steps, a
    deterministic clock): the batch decodes plainly most rounds, the draft fed only the
    tokens it missed when it next drafts or a row joins or leaves, in one forward.
    Answers equal solo runs; every row's draft cache holds its prompt and answer."""
    monkeypatch.setattr(_AlignedKV, "step", 8)
    learn = BatchDraftLengthPolicy.learn_cost
    monkeypatch.setattr(BatchDraftLengthPolicy, "learn_cost", lambda self, rows, k, seconds: learn(self, rows, k, 1 + k / 2))
    # A cold start: the model is shared with earlier tests, whose real round times (and
    # lookups) the process-wide memory would otherwise start this batch from.
    monkeypatch.setattr(batching, "DRAFT_LENGTHS", DraftLengthMemory())
    model, draft = tiny_model("qwen3"), perturbed("qwen3", noise=0.5)
    lengths, budgets = [14, 5, 22, 9], [40, 25, 7, 30]
    prompts = [repetitive_prompt(n, seed) for seed, n in enumerate(lengths)]
    answers = [solo(model, p, b) for p, b in zip(prompts, budgets)]
    generator = BatchGenerator(model, completion_batch_size=3, draft_model=draft, return_prompt_caches=True)
    out, caches = generate_all(generator, prompts, budgets)
    assert out == answers
    assert 0 < generator.stats().draft_tokens < 20  # mostly plain steps
    num_target = len(make_prompt_cache(model))
    for p, a, cache in zip(prompts, answers, caches):
        fresh = make_prompt_cache(draft)
        draft(mx.array(p + a)[None], cache=fresh)
        assert_same_caches(cache[num_target:], fresh)


def test_a_round_after_plain_steps_starts_with_the_draft_caught_up(monkeypatch):
    """What plain steps gave the target alone is fed to the draft before a drafting
    round's clock starts (the plain steps' debt, not the round's cost): the round's
    first draft step feeds each row's token alone, where a round queued after another
    feeds the last one's kept token with it. Answers equal solo runs."""
    choices = itertools.count()
    monkeypatch.setattr(BatchDraftLengthPolicy, "choose",
                        lambda self, batch_size, rows: 3 if next(choices) % 6 >= 4 else 0)
    lags = []
    draft_step = batch_drafters.BatchDraftModel.draft
    monkeypatch.setattr(batch_drafters.BatchDraftModel, "draft",
                        lambda self, *a, **k: lags.append(len(self.lag)) or draft_step(self, *a, **k))
    model, draft = tiny_model("qwen3"), perturbed("qwen3")
    lengths, budgets = [14, 5, 22], [30, 25, 20]
    prompts = [repetitive_prompt(n, seed) for seed, n in enumerate(lengths)]
    answers = [solo(model, p, b) for p, b in zip(prompts, budgets)]
    out, _ = generate_all(BatchGenerator(model, completion_batch_size=3, draft_model=draft), prompts, budgets)
    assert out == answers
    assert 0 in lags and 1 in lags and max(lags) == 1, lags


@pytest.mark.parametrize("draft_name", ["qwen3", "qwen3_next"])
def test_a_draft_no_row_uses_lags_by_a_bounded_chunk(draft_name, monkeypatch):
    """While the policy keeps every row plain, the draft is still fed their tokens,
    MAX_LAG plain steps at a time (not all at once at the end: an unbounded (B, L)
    forward), so a returned cache's draft half holds the row's tokens."""
    model, draft = tiny_model("qwen3"), perturbed(draft_name)
    monkeypatch.setattr(batching.BatchDraftLengthPolicy, "choose", lambda self, batch_size, rows: 0)
    penalty = [make_repetition_penalty(1.3)]
    prompts = [repetitive_prompt(9, 0), repetitive_prompt(5, 1)]
    answers = [solo(model, p, 50, logits_processors=penalty) for p in prompts]
    generator = BatchGenerator(model, max_tokens=50, draft_model=draft, return_prompt_caches=True)
    uids = generator.insert(prompts, logits_processors=[penalty, penalty])
    out, caches, lags = {u: [] for u in uids}, {}, []
    while len(generator):
        for r in generator.next_generated():
            out[r.uid].append(r.token)
            if r.finish_reason:
                caches[r.uid] = r.prompt_cache
        lags.append(len(generator._drafter.lag))
    assert [out[u] for u in uids] == answers
    assert max(lags) == batch_drafters.MAX_LAG - 1 and generator.stats().draft_tokens == 0
    num_target = len(make_prompt_cache(model))
    for u, p in zip(uids, prompts):
        fresh = make_prompt_cache(draft)
        draft(mx.array(p + out[u])[None], cache=fresh)
        assert_same_caches(caches[u][num_target:], fresh)


def test_draft_model_must_batch_its_caches():
    Plain = type("Plain", (type(tiny_model("qwen3_next")),), {"supports_speculative_rollback": False})
    draft = tiny_model("qwen3_next")
    draft.__class__ = Plain
    try:
        with pytest.raises(ValueError, match="a draft model in a batch needs every cache .* ArraysCache"):
            BatchGenerator(tiny_model("qwen3"), draft_model=draft)
    finally:
        draft.__class__ = Plain.__bases__[0]
    with pytest.raises(ValueError, match="at most one of"):
        BatchGenerator(tiny_model("qwen3"), draft_model=tiny_model("qwen3"), prompt_lookup=True)


@pytest.mark.parametrize("name", ["qwen3", "qwen3_next", "mistral_sliding", "gpt_oss"])
def test_a_queued_round_is_undone_when_rows_are_removed_or_copied(name, monkeypatch):
    """With a draft model each step queues the next round before returning its
    tokens. A copy of a row's caches (extract_cache) or a removal between steps first
    undoes that round in every row: the copy and the removed row's caches hold
    exactly the tokens reported (a sliding window past its wrap a whole window), and
    the other rows go on as alone."""
    monkeypatch.setattr(_AlignedKV, "step", 8)
    model, draft = tiny_model(name), perturbed("qwen3")
    prompts = [repetitive_prompt(n, seed) for seed, n in enumerate([9, 14, 6])]
    answers = [solo(model, p, 16) for p in prompts]
    generator = BatchGenerator(model, max_tokens=16, draft_model=draft, fixed_draft_length=True)
    uids = generator.insert(prompts)
    out = {}
    while not generator._rounds.queued or min(len(out.get(u, [])) for u in uids) < 3:
        for r in generator.next_generated():
            out.setdefault(r.uid, []).append(r.token)
    num_target = len(make_prompt_cache(model))

    def assert_holds(cache, tokens):
        for half, m in ((cache[:num_target], model), (cache[num_target:], draft)):
            fresh = make_prompt_cache(m)
            m(mx.array(tokens)[None], cache=fresh)
            assert_same_caches(half, fresh)
            # It goes on as the fresh feed does (a window left short wrote past its buffer).
            assert mx.allclose(m(mx.array([[7]]), cache=half), m(mx.array([[7]]), cache=fresh), atol=1e-4)

    copy, held = generator.extract_cache([uids[0]])[uids[0]]
    assert held == prompts[0] + out[uids[0]]
    assert_holds(copy, prompts[0] + out[uids[0]])
    while not generator._rounds.queued:
        for r in generator.next_generated():
            out.setdefault(r.uid, []).append(r.token)
    cache, held = generator.remove([uids[1]], return_prompt_caches=True)[uids[1]]
    assert held == prompts[1] + out[uids[1]]
    assert_holds(cache, prompts[1] + out[uids[1]])
    for r_uid, tokens in run(generator).items():
        out[r_uid] += tokens
    assert out[uids[0]] == answers[0] and out[uids[2]] == answers[2]
    assert out[uids[1]] == answers[1][: len(out[uids[1]])]


def test_speculating_rows_stop_and_leave_with_exact_caches(monkeypatch):
    """A stop token inside accepted drafts ends the row there; a row removed mid-flight
    gives back a cache holding exactly the tokens it reports."""
    model = tiny_model("qwen3_next")
    prompts = [repetitive_prompt(n, seed) for seed, n in enumerate([9, 14, 6])]
    answers = [solo(model, p, 16) for p in prompts]
    oracles = {tuple(p): a for p, a in zip(prompts, answers)}
    monkeypatch.setattr(batch_drafters, "PromptLookup",
                        lambda n, context=(): OracleLookup(oracles.get(tuple(context)), always_right=True))
    stop = answers[0][1]  # the second draft of the first round: accepted, then the row stops
    assert answers[0][0] != stop
    generator = BatchGenerator(model, max_tokens=16, stop_tokens={stop}, prompt_lookup=True, return_prompt_caches=True)
    uids = generator.insert(prompts)
    out, caches, steps = {u: [] for u in uids}, {}, 0
    while len(generator):
        for r in generator.next_generated():
            out[r.uid].append(r.token)
            caches[r.uid] = r.prompt_cache
        steps += 1
        if steps == 3 and uids[1] in generator.extract_cache([uids[1]]):
            (removed, held), = generator.remove([uids[1]], return_prompt_caches=True).values()
    for i, uid in enumerate(uids):
        want = answers[i][: answers[i].index(stop) + 1] if stop in answers[i] else answers[i]
        got = out[uid]
        assert got == want[: len(got)] and (i == 1 or got == want), i
        cache = removed if i == 1 else caches[uid]
        if i == 1:
            assert held == prompts[1] + got
        fresh = make_prompt_cache(model)
        model(mx.array(prompts[i] + got)[None], cache=fresh)  # the same tokens fed at once
        assert_same_caches(cache, fresh)


def test_quantized_kv_rows_batch_and_equal_solo():
    """Rows whose prompt caches are 8-bit quantized (groups of 32) decode together as
    they do alone with kv_bits (new tokens quantized as they arrive)."""
    model = tiny_model("quantizable")
    prompts = [prompt(n, 50 + n) for n in (7, 12, 4)]

    def quantized_cache(p):
        cache = make_prompt_cache(model)
        model(mx.array(p[:-1])[None], cache=cache)
        maybe_quantize_kv_cache(cache, 0, 32, 8)
        assert all(isinstance(c, QuantizedKVCache) for c in cache)
        return cache

    answers = [solo(model, p[-1:], 9, prompt_cache=quantized_cache(p), kv_bits=8, kv_group_size=32) for p in prompts]
    generator = BatchGenerator(model, completion_batch_size=2, return_prompt_caches=True)
    out, caches = generate_all(generator, [p[-1:] for p in prompts], 9, caches=[quantized_cache(p) for p in prompts])
    assert out == answers
    for p, a, cache in zip(prompts, answers, caches):
        assert isinstance(cache[0], QuantizedKVCache) and cache[0].offset == len(p) + len(a)


def test_a_batch_stops_drafting_what_is_never_accepted(monkeypatch):
    """Lookups that never agree: each row's acceptance estimate falls and, with a
    verify of K + 1 columns costing more than a plain step (the policy's clock made
    deterministic: a round drafting K takes 1 + K/2), the batch drafts in a few
    rounds, then only in its probes; the tokens are the solo runs'."""
    model = tiny_model("qwen3")
    prompts = [prompt(5, 31), prompt(9, 32)]
    wants = [solo(model, p, 40) for p in prompts]
    never = next(t for t in range(1, 200) if all(t not in w for w in wants))
    monkeypatch.setattr(batch_drafters, "PromptLookup", lambda n, context=(): FixedLookup(never))
    learn = BatchDraftLengthPolicy.learn_cost
    monkeypatch.setattr(BatchDraftLengthPolicy, "learn_cost", lambda self, rows, k, seconds: learn(self, rows, k, 1 + k / 2))
    # A cold start: the model is shared with earlier tests, whose real round times (and
    # lookups) the process-wide memory would otherwise start this batch from.
    monkeypatch.setattr(batching, "DRAFT_LENGTHS", DraftLengthMemory())
    generator = BatchGenerator(model, max_tokens=40, prompt_lookup=True, num_draft_tokens=3)
    assert generate_all(generator, prompts, 40)[0] == wants
    stats = generator.stats()
    # Two rounds of one draft a row (the prior, then one miss), then one probe 16 rounds on
    # (the next would come 32 later).
    assert stats.accepted_tokens == 0 and stats.draft_tokens == 2 * 3
    # Fixed: every row drafts every round (a FixedLookup has one draft).
    generator = BatchGenerator(model, max_tokens=40, prompt_lookup=True, num_draft_tokens=3, fixed_draft_length=True)
    assert generate_all(generator, prompts, 40)[0] == wants
    assert generator.stats().draft_tokens == 2 * 40

@pytest.mark.parametrize("name", ["qwen3_next", "lfm2", "nemotron_h"])
def test_recurrent_rows_roll_back_by_their_own_counts_in_one_replay(name, monkeypatch):
    """After a verify of 4 tokens, rows keeping 4, 3, 1 and 0 of them: each layer replays
    once, every row's own prefix, and each row's caches equal a solo feed of what it keeps."""
    calls = []
    record = BatchArraysCache.record_rollback

    def counting(self, num_tokens, fn, snapshot):
        def replay(m):
            calls.append(m)
            return fn(m)
        record(self, num_tokens, replay, snapshot)

    monkeypatch.setattr(BatchArraysCache, "record_rollback", counting)
    model = tiny_model(name)
    prompts = [prompt(n, seed) for seed, n in enumerate([7, 5, 9, 6])]
    fed = [prompt(4, 10 + seed) for seed in range(4)]
    rows = []
    for p in prompts:
        cache = make_prompt_cache(model)
        model(mx.array(p)[None], cache=cache)
        rows.append(cache)
    batch = merge_caches(rows)
    for entry in batch:
        entry.start_speculation()
    make_room(batch, 4)
    model(mx.array(fed), cache=batch)
    keeps = [4, 3, 1, 0]
    trim_rows(batch, [4 - k for k in keeps])
    num_recurrent = sum(isinstance(c, BatchArraysCache) for c in batch)
    assert calls == [keeps] * num_recurrent
    for i, (p, f, k) in enumerate(zip(prompts, fed, keeps)):
        solo_cache = make_prompt_cache(model)
        model(mx.array(p + f[:k])[None], cache=solo_cache)
        assert_same_caches(extract_caches(batch, i), solo_cache)


def test_sampling_rows_draft_from_their_own_law():
    """An unseeded sampling row's device drafter draws its drafts from the row's law q
    and the round decides them by speculative sampling: with the target as its own
    draft, p = q (up to the rounding of a verify against a single step) and every draft
    passes; a seeded row drafts point masses and matches its own draws, so fewer do."""
    model = tiny_model("qwen3")

    def acceptance(seed):
        generator = BatchGenerator(model, sampler=make_sampler(temp=1.0), draft_model=model,
                                   fixed_draft_length=True, num_draft_tokens=3)
        generator.insert([prompt(5, 3), prompt(6, 4)], max_tokens=24, seeds=[seed, seed])
        run(generator)
        stats = generator.stats()
        return stats.accepted_tokens / stats.draft_tokens

    real_q, point_masses = acceptance(None), acceptance(7)
    assert real_q > 0.95 and point_masses < real_q - 0.1
