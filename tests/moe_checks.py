"""Checks the MoE test modules of issue 34 share beyond family_checks.py (test_qwen2_moe,
test_mixtral, test_phimoe, test_olmoe, test_granitemoe, test_glm4_moe, test_ernie4_5_moe,
test_dots1): a naive per-token, per-expert loop to hold a MoE block against, and sanitize on the three
layouts (transformers' saved per-expert one, transformers 5's fused in-memory one, the
MLX-converted one)."""

import re
from typing import Callable, Dict, List, Sequence, Tuple

import mlx.core as mx
import numpy as np
from family_checks import FIXTURES, fixture_model
from mlx.utils import tree_flatten

Weights = Dict[str, mx.array]


def np_swiglu(x: np.ndarray, gate: np.ndarray, up: np.ndarray, down: np.ndarray) -> np.ndarray:
    """One SwiGLU expert in float64: x (H,), gate/up (I, H), down (H, I) -> (H,)."""
    g, u = gate @ x, up @ x
    return down @ (g / (1 + np.exp(-g)) * u)


def naive_moe(x: mx.array, choose: Callable[[np.ndarray], List[Tuple[int, float]]],
              gate: mx.array, up: mx.array, down: mx.array) -> np.ndarray:
    """The routed sum token by token: x (B, L, H); `choose(token)` gives the
    (expert, weight) pairs of one token (H,); gate/up (E, I, H), down (E, H, I) ->
    (B, L, H) float64. A loop over tokens and chosen experts, as the papers write it."""
    xs = np.array(x, dtype=np.float64)
    g, u, d = (np.array(w, dtype=np.float64) for w in (gate, up, down))
    out = np.zeros_like(xs)
    for b in range(xs.shape[0]):
        for t in range(xs.shape[1]):
            for e, w in choose(xs[b, t]):
                out[b, t] += w * np_swiglu(xs[b, t], g[e], u[e], d[e])
    return out


def np_softmax(z: np.ndarray) -> np.ndarray:
    z = np.exp(z - z.max())
    return z / z.sum()


def softmax_top_k(router: mx.array, k: int, normalize: bool) -> Callable[[np.ndarray], List[Tuple[int, float]]]:
    """The textbook softmax router of weight (E, H), for naive_moe: the k most probable
    experts of a token and their probabilities, renormalised to sum to 1 if `normalize`."""
    weight = np.array(router, dtype=np.float64)

    def choose(x: np.ndarray) -> List[Tuple[int, float]]:
        p = np_softmax(weight @ x)
        best = np.argsort(-p)[:k]
        return list(zip(best, p[best] / (p[best].sum() if normalize else 1.0)))

    return choose


def sigmoid_group_top_k(router: mx.array, bias: mx.array, args) -> Callable[[np.ndarray], List[Tuple[int, float]]]:
    """DeepSeek-V3's router as transformers writes it (glm4_moe, dots1), for naive_moe:
    sigmoid scores; groups ranked by their two best biased scores, `topk_group` of
    `n_group` kept; the best biased experts there, weighted by their unbiased scores
    (renormalised with `norm_topk_prob`) times `routed_scaling_factor`."""
    weight, bias = np.array(router, dtype=np.float64), np.array(bias, dtype=np.float64)

    def choose(x: np.ndarray) -> List[Tuple[int, float]]:
        scores = 1 / (1 + np.exp(-(weight @ x)))
        biased = (scores + bias).reshape(args.n_group, -1)
        group_scores = np.sort(biased, axis=-1)[:, -2:].sum(-1) if biased.shape[1] > 1 else biased[:, 0]
        biased[np.argsort(-group_scores)[args.topk_group:]] = -np.inf  # the groups not kept
        best = np.argsort(-biased.reshape(-1))[: args.num_experts_per_tok]
        w = scores[best] / (scores[best].sum() + 1e-20 if args.norm_topk_prob else 1.0)
        return list(zip(best, w * args.routed_scaling_factor))

    return choose


def assert_block_equals_naive(block, choose, dims: int, shared=None) -> None:
    """`block` (its experts in `block.switch_mlp`) on random (2, 5, dims) inputs equals
    naive_moe with `choose`, plus `shared(token)` (float64) when given, to 1e-5."""
    x = mx.random.normal((2, 5, dims), key=mx.random.key(0))
    s = block.switch_mlp
    want = naive_moe(x, choose, s.gate_proj.weight, s.up_proj.weight, s.down_proj.weight)
    if shared is not None:
        xs = np.array(x, dtype=np.float64)
        for b, t in np.ndindex(2, 5):
            want[b, t] += shared(xs[b, t])
    assert relative(block(x), want) < 1e-5


def assert_shared_moe_equals_naive(block, args) -> None:
    """The routed experts (sigmoid_group_top_k) plus the shared SwiGLU."""
    shared = block.shared_experts
    weights = [np.array(w, dtype=np.float64) for w in (shared.gate_proj.weight, shared.up_proj.weight,
                                                        shared.down_proj.weight)]
    choose = sigmoid_group_top_k(block.gate.weight, block.gate.e_score_correction_bias, args)
    assert_block_equals_naive(block, choose, 64, shared=lambda x: np_swiglu(x, *weights))


def relative(got: mx.array, want: np.ndarray) -> float:
    return float(np.abs(np.array(got, dtype=np.float64) - want).max() / np.abs(want).max())


def fuse_per_expert(weights: Weights, block: str, gate: str, up: str, down: str, into: str) -> Weights:
    """transformers' saved per-expert tensors `{block}.experts.{e}.{gate|up|down}.weight`
    -> transformers 5's in-memory ones `{into}.experts.gate_up_proj` (E, 2I, H) (gate
    rows first) and `{into}.experts.down_proj` (E, H, I): what its loader builds."""
    pattern = re.compile(rf"^(.*\.){re.escape(block)}\.experts\.(\d+)\.({gate}|{up}|{down})\.weight$")
    out, experts = {}, {}
    for key, value in weights.items():
        match = pattern.match(key)
        if match:
            prefix, e, proj = match.groups()
            experts.setdefault(prefix, {}).setdefault(proj, {})[int(e)] = value
        else:
            out[key] = value
    for prefix, projs in experts.items():
        stack = {p: mx.stack([v[e] for e in sorted(v)]) for p, v in projs.items()}
        out[f"{prefix}{into}.experts.gate_up_proj"] = mx.concatenate([stack[gate], stack[up]], axis=1)
        out[f"{prefix}{into}.experts.down_proj"] = stack[down]
    return out


def fused_mlp_experts(weights: Weights) -> Weights:
    """transformers 5's in-memory layout of the `mlp.experts.{e}.{gate,up,down}_proj`
    families (qwen2_moe, olmoe, glm4_moe): the same block name, experts fused."""
    return fuse_per_expert(weights, "mlp", "gate_proj", "up_proj", "down_proj", into="mlp")


def assert_same(a: Weights, b: Weights, what: str) -> None:
    assert sorted(a) == sorted(b), (what, sorted(set(a) ^ set(b)))
    assert all(a[k].dtype == b[k].dtype and mx.array_equal(a[k], b[k]) for k in a), what


def assert_sanitize_layouts(fixtures: Sequence[str], to_memory: Callable[[Weights], Weights]) -> None:
    """For each fixture: transformers' saved layout sanitizes to exactly the model's
    parameters; transformers 5's in-memory layout (`to_memory` of the saved one) to the
    same tensors; and a second pass (the MLX layout) changes nothing."""
    for name in fixtures:
        model = fixture_model(name)
        raw = mx.load(str(FIXTURES / name / "model.safetensors"))
        once = model.sanitize(dict(raw))
        assert sorted(once) == sorted(k for k, _ in tree_flatten(model.parameters())), name
        memory = to_memory(dict(raw))
        assert memory.keys() != raw.keys(), f"{name}: the in-memory layout renames something"
        assert_same(model.sanitize(memory), once, f"{name}: in-memory layout")
        assert_same(model.sanitize(dict(once)), once, f"{name}: second pass")
