"""The shape of a head's dynamic token tree, chosen from measured per-depth acceptance (drafters/head_tree.py).

:func:`choose_tree` returns the ``(branch, depth, nodes)`` that ``propose_tree`` takes, maximising expected tokens
per step over the step's cost, from α_k (k = 1..K: the probability that the head's top-1 token at depth k is
accepted given the path before it was, measured at the running temperature) and a verify cost model.

Model (stated approximations):
  * siblings: the tree verifies the accepted path's depth-k node together with r_k - 1 siblings (distinct
    deterministic candidates; exact selection accepts the target's token when it is any of them), so depth k is
    passed with A_k(r) = P(target's token among the head's top-r). With only α_k known, the target's probability of
    the head's rank-i token is taken as α·q^(i-1) with q = α(1 - α): A_k(r) = α(1 - q^r) / (1 - q). The ratio q
    ties the tail to the head's confidence: a confident head (α near 1) leaves little mass, mostly on its next
    ranks; an unsure one (α small) leaves mass scattered beyond its top few (at T = 1 a low top-1 acceptance means a
    flat target law), so siblings add little there. A measured ``coverage[k][r - 1]`` = A_k(r) replaces it.
  * nodes: the N - 1 non-root nodes are spread as sibling sets along the likely path, r_k at depth k (Σ r_k = N - 1,
    r_k <= branch); the expected accepted drafts are τ = Σ_k Π_{j<=k} A_j(r_j) (the EAGLE-2 builder spends its
    budget on the best-scoring paths, which this path-width model approximates), a step emits 1 + τ tokens.
  * cost, in single-token target forwards: verify(N) = 1 + slope·(N - 1) (``DEFAULT_SLOPE``, or linear
    interpolation in a measured ``cost_table`` {nodes: cost}) plus ``head_cost`` per depth (one head forward per
    level, ~1/L of a target with L layers).
Deterministic: exhaustive over depth and branch, greedy allocation of nodes by marginal gain per unit cost
(ties to the smaller shape).
"""
from __future__ import annotations

import math
from typing import Mapping, Optional, Sequence

from ..payoff import DEFAULT_SLOPE
from tilespec.multidraft.token_tree import MAX_NODES

DEFAULT_TREE = (8, 6, 32)    # the shape used when no per-depth acceptance is known
HEAD_COST = 0.04             # one head forward (one target-shaped layer) over a target forward of ~28 layers
MAX_BRANCH = 8


def _check_alphas(alphas) -> list:
    if isinstance(alphas, (str, bytes)) or not isinstance(alphas, Sequence) or len(alphas) == 0:
        raise ValueError(f"alphas must be a non-empty list of per-depth acceptance rates in [0, 1], got {alphas!r}")
    out = []
    for a in alphas:
        try:
            a = float(a)
        except (TypeError, ValueError):
            raise ValueError(f"alphas must hold numbers in [0, 1], got {alphas!r}") from None
        if not 0.0 <= a <= 1.0:                       # also rejects NaN
            raise ValueError(f"alphas must lie in [0, 1], got {alphas!r}")
        out.append(a)
    return out


def verify_cost(nodes: int, cost_table: Optional[Mapping[int, float]] = None, slope: float = DEFAULT_SLOPE) -> float:
    """A verify forward over ``nodes`` positions in single-token forwards: the table linearly interpolated (and
    extended by its last segment's slope, or ``slope``) when given, else 1 + slope·(nodes - 1)."""
    if not cost_table:
        return 1.0 + slope * (nodes - 1)
    pts = sorted((int(n), float(c)) for n, c in cost_table.items())
    if any(n < 1 or not (math.isfinite(c) and c > 0) for n, c in pts):
        raise ValueError(f"cost_table maps node counts >= 1 to finite costs > 0, got {dict(cost_table)!r}")
    if len(pts) == 1:
        n0, c0 = pts[0]
        return c0 * (1.0 + slope * (nodes - 1)) / (1.0 + slope * (n0 - 1))
    for (n0, c0), (n1, c1) in zip(pts, pts[1:]):
        if nodes <= n1 or (n1, c1) == pts[-1]:
            return max(c0 + (c1 - c0) * (nodes - n0) / (n1 - n0), 1e-9)
    raise AssertionError("unreachable")


def _coverage(alpha: float, r: int, measured: Optional[Sequence[float]]) -> float:
    if measured is not None and r <= len(measured):
        return float(measured[r - 1])
    q = alpha * (1.0 - alpha)
    return alpha * (1.0 - q ** r) / (1.0 - q)


def choose_tree(alphas: Sequence[float], *, cost_table: Optional[Mapping[int, float]] = None,
                head_cost: float = HEAD_COST, slope: float = DEFAULT_SLOPE, max_nodes: int = MAX_NODES,
                max_branch: int = MAX_BRANCH, coverage: Optional[Sequence[Sequence[float]]] = None) -> tuple:
    """(branch, depth, nodes) maximising (1 + τ) / (verify(nodes) + depth·head_cost) (module docstring).

    alphas: α_k per depth (len K >= 1, each in [0, 1]; depth <= K); coverage: optional measured A_k(r) per depth
    (lists of increasing values in [0, 1]); nodes counts the root, 2 <= nodes <= max_nodes."""
    alphas = _check_alphas(alphas)
    if not (isinstance(max_nodes, int) and 2 <= max_nodes <= MAX_NODES and isinstance(max_branch, int)
            and max_branch >= 1):
        raise ValueError(f"max_nodes must be in [2, {MAX_NODES}] and max_branch >= 1, got {max_nodes}, {max_branch}")
    if not (math.isfinite(head_cost) and head_cost >= 0.0 and math.isfinite(slope) and slope >= 0.0):
        raise ValueError(f"head_cost and slope must be finite and >= 0, got {head_cost}, {slope}")
    if coverage is not None:
        coverage = [_check_alphas(c) for c in coverage]
    best, best_value = (1, 1, 2), -1.0
    for depth in range(1, min(len(alphas), max_nodes - 1) + 1):
        cov = [coverage[k] if coverage is not None and k < len(coverage) else None for k in range(depth)]
        for branch in range(1, max_branch + 1):
            widths = [1] * depth                       # a chain first: every depth needs one node
            for _ in range(max_nodes):
                nodes = 1 + sum(widths)
                if nodes > max_nodes:
                    break
                tau, reach = 0.0, 1.0
                for k, r in enumerate(widths):
                    reach *= _coverage(alphas[k], r, cov[k])
                    tau += reach
                value = (1.0 + tau) / (verify_cost(nodes, cost_table, slope) + depth * head_cost)
                shape = (max(widths), depth, nodes)
                if value > best_value * (1.0 + 1e-9):
                    best, best_value = shape, value
                grow = [k for k in range(depth) if widths[k] < branch]
                if not grow:
                    break
                k = max(grow, key=lambda k: (_gain(alphas, widths, k, cov), -k))   # most τ per extra node
                widths[k] += 1
    return best


def _gain(alphas: list, widths: list, k: int, cov: list) -> float:
    """τ gained by one more sibling at depth k."""
    def tau(ws):
        total, reach = 0.0, 1.0
        for j, r in enumerate(ws):
            reach *= _coverage(alphas[j], r, cov[j])
            total += reach
        return total
    more = list(widths)
    more[k] += 1
    return tau(more) - tau(widths)


def alphas_for_temperature(table: Mapping, temperature: float) -> Optional[list]:
    """Per-depth α at ``temperature`` from ``{"0": [...], "0.7": [...], "1": [...]}`` (a head's
    ``alpha_by_temperature``): linear interpolation between the two nearest stored temperatures (per depth, over
    the depths both have), the nearest one outside their range; None for an empty or missing table."""
    if not table:
        return None
    points = sorted((float(t), _check_alphas(a)) for t, a in table.items())
    t = float(temperature)
    if t <= points[0][0]:
        return points[0][1]
    if t >= points[-1][0]:
        return points[-1][1]
    for (t0, a0), (t1, a1) in zip(points, points[1:]):
        if t0 <= t <= t1:
            w = (t - t0) / (t1 - t0)
            return [(1 - w) * x + w * y for x, y in zip(a0, a1)]
    return None


def head_tree_shape(manifest: Optional[Mapping], temperature: float, **options) -> tuple:
    """The tree for a head whose saved info is ``manifest`` at ``temperature``: :func:`choose_tree` over its
    ``alpha_by_temperature`` (optional ``tree_cost_table`` {nodes: cost}), else :data:`DEFAULT_TREE`."""
    table = (manifest or {}).get("alpha_by_temperature")
    alphas = alphas_for_temperature(table, temperature) if table else None
    if not alphas:
        return DEFAULT_TREE
    costs = (manifest or {}).get("tree_cost_table")
    if costs and "cost_table" not in options:
        options["cost_table"] = {int(n): float(c) for n, c in costs.items()}
    return choose_tree(alphas, **options)
