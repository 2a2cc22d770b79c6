"""The optimal multi-draft acceptance alpha* = max P(Y in {X_1..X_K}) over valid selection rules.

* General K (identical or not):  alpha* = 1 + min_{S subset Omega} [ p(S) - prod_k q_k(S) ]   (max-flow/min-cut).
* Theorem 3 (K = 2, identical):   alpha* = min_S [ p(S) + q(S^c)^2 + 2 q(S) q(S^c) ]  (= the K = 2 case above).
* Identical drafts, any K, O(V log V): sort tokens by p/q ascending (q = 0 last), prefix sums P_j, Q_j;
  alpha* = 1 + min_{0 <= j <= V} (P_j - Q_j^K).  Batched over rows in PyTorch.
* ``lp_optimum``: the optimal-transport LP over (x_1..x_K, y) (V^(K+1) variables; a test oracle for tiny V).
* ``acceptance_gap``: per row alpha* - (a scheme's test-pass probability).
"""
from __future__ import annotations

import itertools

import numpy as np
import torch

from .common import DTYPE, check_law

MAX_BRUTE_FORCE_V = 20


def optimal_acceptance(p: torch.Tensor, q: torch.Tensor, k: int) -> torch.Tensor:
    """alpha*_K for K i.i.d. drafts ~ q: p, q [N, V] -> [N] (sorted-threshold scan, exact)."""
    if k < 1:
        raise ValueError(f"number of drafts K must be >= 1, got {k}")
    if p.shape != q.shape or p.dim() != 2:
        raise ValueError(f"p and q must both be [N, V], got {tuple(p.shape)} and {tuple(q.shape)}")
    p, q = p.to(DTYPE), q.to(DTYPE)
    ratio = torch.where(q > 0, p / q.clamp(min=1e-300), torch.full_like(p, float("inf")))
    order = torch.argsort(ratio, dim=-1, stable=True)
    pc = torch.cumsum(p.gather(-1, order), -1)
    qc = torch.cumsum(q.gather(-1, order), -1).clamp(max=1.0)
    vals = pc - qc ** k
    best = torch.minimum(vals.min(dim=-1).values, torch.zeros_like(vals[:, 0]))    # j = 0: the empty set
    return (1 + best).clamp(0.0, 1.0)


def optimal_acceptance_brute(p: np.ndarray, qs: np.ndarray) -> float:
    """alpha* = 1 + min_S [p(S) - prod_k q_k(S)] by enumerating subsets of the support (V <= 20).

    p [V], qs [K, V] (non-identical drafts allowed). Tokens outside supp(p) u supp(q_k) never matter.
    """
    p = np.asarray(p, dtype=np.float64)
    qs = np.atleast_2d(np.asarray(qs, dtype=np.float64))
    support = np.nonzero((p > 0) | (qs > 0).any(0))[0]
    if support.size > MAX_BRUTE_FORCE_V:
        raise ValueError(f"brute-force optimum needs a support of at most {MAX_BRUTE_FORCE_V} tokens, "
                         f"got {support.size}")
    ps, qss = p[support], qs[:, support]
    n = support.size
    masks = ((np.arange(1 << n)[:, None] >> np.arange(n)[None, :]) & 1).astype(np.float64)   # [2^n, n]
    vals = masks @ ps - np.prod(masks @ qss.T, axis=1)
    return float(np.clip(1 + vals.min(), 0.0, 1.0))


def theorem3_acceptance(p: np.ndarray, q: np.ndarray) -> float:
    """Theorem 3 literally (K = 2, identical): min_S [p(S) + q(S^c)^2 + 2 q(S) q(S^c)] by enumeration."""
    p, q = np.asarray(p, np.float64), np.asarray(q, np.float64)
    n = p.size
    if n > MAX_BRUTE_FORCE_V:
        raise ValueError(f"theorem3_acceptance enumerates subsets; V must be <= {MAX_BRUTE_FORCE_V}")
    best = np.inf
    for bits in itertools.product((0, 1), repeat=n):
        sel = np.array(bits, dtype=bool)
        qs_, qc = q[sel].sum(), q[~sel].sum()
        best = min(best, p[sel].sum() + qc ** 2 + 2 * qs_ * qc)
    return float(best)


def lp_optimum(p: np.ndarray, qs: np.ndarray) -> float:
    """Optimal-transport LP: max sum pi(x, y) 1[y in x] over couplings of Q = prod q_k and p (V^(K+1) vars)."""
    p = np.asarray(p, np.float64)
    qs = np.atleast_2d(np.asarray(qs, np.float64))
    kk, v = qs.shape
    if v ** (kk + 1) > 200_000:
        raise ValueError(f"lp_optimum is exponential: V^(K+1) = {v ** (kk + 1)} variables is too many")
    tuples = list(itertools.product(range(v), repeat=kk))
    qx = np.array([np.prod([qs[i, x[i]] for i in range(kk)]) for x in tuples])
    nt = len(tuples)
    cost = np.zeros(nt * v)
    for t, x in enumerate(tuples):
        for y in set(x):
            cost[t * v + y] = -1.0
    a_eq = np.zeros((nt, nt * v))
    for t in range(nt):
        a_eq[t, t * v:(t + 1) * v] = 1.0
    a_ub = np.zeros((v, nt * v))                      # column sums <= p(y) (equivalent, numerically safer)
    for y in range(v):
        a_ub[y, y::v] = 1.0
    from scipy.optimize import linprog   # here: scipy.optimize costs ~0.35 s to import
    res = linprog(cost, A_ub=a_ub, b_ub=p, A_eq=a_eq, b_eq=qx, bounds=(0, None), method="highs")
    if res.status != 0:
        raise RuntimeError(f"OT LP failed: {res.message}")
    return float(-res.fun)


def acceptance_gap(scheme: str, p: torch.Tensor, q: torch.Tensor, k: int) -> dict:
    """Per-row gap between the optimum and a scheme (identical drafts): p, q [N, V] -> dict of [N] tensors
    ``optimal``, ``scheme`` (test-pass probability) and ``gap`` = optimal - scheme (>= 0 up to rounding)."""
    from .schemes import accept_probability

    check_law(p.to(DTYPE), "p")
    check_law(q.to(DTYPE), "q")
    opt = optimal_acceptance(p, q, k)
    got = accept_probability(scheme, p, q[:, None, :].expand(-1, k, -1))
    return {"optimal": opt, "scheme": got, "gap": opt - got}
