"""Importance-weighted (IS) selection + single-draft SD (Khisti et al., Theorem 1), with the truncated LP
(Algorithm 1, parameter s), the truncated alphabet (size m) and K > 2 drafts by pairwise stages (Remark 4).

Pair stage, inputs X1 ~ a, X2 ~ b independent (a = b for identical drafts), target p, all [V]:

* rank the proposable tokens (a + b > 0) by d_i = p_i - a_i b_i, decreasing (stable); unproposable tokens last
  (they can never be emitted by the IS step, so they would only waste LP slots). Omega_1 = top s ranks.
* weights: W_ij = P(Y_I = i | X1 = i, X2 = j) for i != j both in Omega_1 (LP variables, s(s-1) of them);
  otherwise the higher-ranked token wins; X1 == X2 outputs it.
* law of Y_I (eq. 13 and its Omega_1 part):
  p_I(i) = a_i b_i + a_i T^b_i + T^a_i b_i on Omega_2, T^a_i = a(lower ranks than i)  (one reversed cumsum);
  p_I(i) = a_i b_i + a_i b(Omega_2) + a(Omega_2) b_i + sum_{j in Omega_1, j != i} [a_i b_j W_ij + a_j b_i (1 - W_ji)].
* LP (scipy HiGHS): max sum_{i in Omega_1} t_i  s.t.  t_i <= p_i, t_i <= p_I(i),  0 <= W <= 1.
  s = None means s = all proposable tokens, i.e. the exact optimum of the pair (small alphabets only).

Chain (Remark 4): Y^(1) = pair(X1, X2 | q1, q2); Y^(k) = pair(Y^(k-1), X_{k+1} | p_I^(k-1), q_{k+1}); each stage
maximises sum min(p, p_I^(k)). Final step: accept Y with prob min(1, p(Y)/p_I(Y)), else draw from
norm((p - p_I)^+).  For ANY weights the output law is exactly p; test-pass = sum_y min(p(y), p_I(y)).

Truncated alphabet: Omega_0 = top-m tokens of p, p_hat = p 1[Omega_0] / p(Omega_0); run the scheme with target
p_hat, then keep its output with prob p(Omega_0), else draw from p restricted to the complement. Law p;
test-pass = p(Omega_0) sum min(p_hat, p_I).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from .common import DTYPE, EPS_MASS, Selection, Stream, check_inputs, finish, gather


@dataclass
class PairPlan:
    """Pair-stage plan for N rows: rank_of [N, V] int64 (0 = best), W [N, S, S] float64 indexed by ranks,
    s_eff [N] int64 (size of Omega_1), p_I [N, V] float64 law of the selected token."""

    rank_of: torch.Tensor
    W: torch.Tensor
    s_eff: torch.Tensor
    p_I: torch.Tensor


def _pair_row(p: np.ndarray, a: np.ndarray, b: np.ndarray, s: int | None):
    """One row of the truncated pair LP. Returns (rank_of [V], W [s_eff, s_eff], p_I [V])."""
    v = p.shape[0]
    proposable = (a > 0) | (b > 0)
    key = np.where(proposable, p - a * b, -np.inf)
    order = np.argsort(-key, kind="stable")
    rank_of = np.empty(v, dtype=np.int64)
    rank_of[order] = np.arange(v)
    n_prop = int(proposable.sum())
    s_eff = n_prop if s is None else min(int(s), n_prop)
    a_s, b_s, p_s = a[order], b[order], p[order]
    ta = np.cumsum(a_s[::-1])[::-1] - a_s
    tb = np.cumsum(b_s[::-1])[::-1] - b_s
    pi_s = a_s * b_s + a_s * tb + ta * b_s
    w = np.zeros((s_eff, s_eff))
    if s_eff >= 2:
        aa, bb = a_s[:s_eff], b_s[:s_eff]
        const = aa * bb + aa * b_s[s_eff:].sum() + a_s[s_eff:].sum() * bb
        pairs = [(i, j) for i in range(s_eff) for j in range(s_eff) if i != j]
        npair = len(pairs)
        coef = np.zeros((s_eff, npair))          # p_I(Omega_1) = const + coef @ W
        for col, (i, j) in enumerate(pairs):
            m = aa[i] * bb[j]                     # P(X1 = i, X2 = j)
            coef[i, col] += m
            coef[j, col] -= m
            const[j] += m
        a_ub = np.hstack([-coef, np.eye(s_eff)])  # t_i - coef_i W <= const_i
        cost = np.concatenate([np.zeros(npair), -np.ones(s_eff)])
        bounds = [(0.0, 1.0)] * npair + [(0.0, float(max(pi, 0.0))) for pi in p_s[:s_eff]]
        from scipy.optimize import linprog   # here: scipy.optimize costs ~0.35 s to import
        res = linprog(cost, A_ub=a_ub, b_ub=const, bounds=bounds, method="highs")
        wv = np.clip(res.x[:npair], 0.0, 1.0) if res.status == 0 else np.ones(npair)   # fallback: priority
        for col, (i, j) in enumerate(pairs):
            w[i, j] = wv[col] if res.status == 0 else float(i < j)
        pi_s[:s_eff] = const + coef @ (np.array([w[i, j] for i, j in pairs]))
    p_i = np.empty(v)
    p_i[order] = np.clip(pi_s, 0.0, None)
    return rank_of, w, p_i


def plan_pair(p: torch.Tensor, a: torch.Tensor, b: torch.Tensor, s: int | None) -> PairPlan:
    """Solve the pair stage for every row: p, a, b [N, V] -> PairPlan (one small LP per row, on the host)."""
    if s is not None and s < 0:
        raise ValueError(f"truncation size s must be >= 0 or None, got {s}")
    stacked = torch.cat([p, a, b], dim=-1).detach().to("cpu", DTYPE)
    uniq, inverse = torch.unique(stacked, dim=0, return_inverse=True)   # rows sharing a node share one LP
    v = p.shape[-1]
    un = uniq.numpy()
    rows = [_pair_row(un[i, :v], un[i, v:2 * v], un[i, 2 * v:], s) for i in range(un.shape[0])]
    smax = max([r[1].shape[0] for r in rows] + [1])
    w = np.zeros((len(rows), smax, smax))
    for i, r in enumerate(rows):
        w[i, :r[1].shape[0], :r[1].shape[0]] = r[1]
    dev = p.device
    inv = inverse.to(dev)
    plan = PairPlan(rank_of=torch.as_tensor(np.stack([r[0] for r in rows]) if rows else np.zeros((0, p.shape[1]), np.int64), device=dev),
                    W=torch.as_tensor(w, device=dev),
                    s_eff=torch.as_tensor([r[1].shape[0] for r in rows], dtype=torch.int64, device=dev),
                    p_I=torch.as_tensor(np.stack([r[2] for r in rows]) if rows else np.zeros((0, p.shape[1])), device=dev))
    return PairPlan(plan.rank_of[inv], plan.W[inv], plan.s_eff[inv], plan.p_I[inv])


def pair_select(plan: PairPlan, x1: torch.Tensor, x2: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Apply a pair plan: x1, x2 [N] tokens, u [N] uniforms -> [N] selected token (law plan.p_I)."""
    r1, r2 = gather(plan.rank_of, x1), gather(plan.rank_of, x2)
    smax = plan.W.shape[1]
    both = (r1 < plan.s_eff) & (r2 < plan.s_eff) & (x1 != x2)
    n = torch.arange(x1.shape[0], device=x1.device)
    w = plan.W[n, r1.clamp(max=smax - 1), r2.clamp(max=smax - 1)]
    pick1 = torch.where(both, u < w, r1 <= r2)
    return torch.where(pick1, x1, x2)


def truncate_alphabet(p: torch.Tensor, m: int | None) -> tuple[torch.Tensor, torch.Tensor]:
    """(p_hat [N, V], p(Omega_0) [N]) with Omega_0 the top-m tokens of p (m None: no truncation)."""
    if m is None:
        return p, torch.ones(p.shape[0], dtype=p.dtype, device=p.device)
    if m < 1:
        raise ValueError(f"alphabet size m must be >= 1, got {m}")
    m = min(int(m), p.shape[-1])
    top = torch.topk(p, m, dim=-1).indices
    keep = torch.zeros_like(p, dtype=torch.bool).scatter_(-1, top, True)
    p_in = torch.where(keep, p, torch.zeros_like(p))
    mass = p_in.sum(-1)
    return p_in / mass[:, None], mass


def chain_law(p: torch.Tensor, qs: torch.Tensor, mask: torch.Tensor, s: int | None,
              tokens: torch.Tensor | None = None, stream: Stream | None = None):
    """Run the pairwise chain over the active candidates. Returns (p_I [N, V], Y_I [N] or None).

    With tokens and stream the IS step is also sampled (stage k uses the coin stream.extra(k)).
    """
    n = p.shape[0]
    law = torch.zeros_like(p)
    has = torch.zeros(n, dtype=torch.bool, device=p.device)
    y = torch.full((n,), -1, dtype=torch.int64, device=p.device) if tokens is not None else None
    for k in range(qs.shape[1]):
        act = mask[:, k]
        start = act & ~has
        law = torch.where(start[:, None], qs[:, k], law)
        if y is not None:
            y = torch.where(start, tokens[:, k], y)
        pair = (act & has).nonzero().squeeze(1)
        if pair.numel():
            plan = plan_pair(p[pair], law[pair], qs[pair, k], s)
            if y is not None:
                u = stream.subset(pair).extra(k)
                y[pair] = pair_select(plan, y[pair], tokens[pair, k], u)
            law[pair] = plan.p_I
        has = has | act
    return law, y


def importance(p: torch.Tensor, qs: torch.Tensor, tokens: torch.Tensor, stream: Stream,
               mask: torch.Tensor | None = None, s: int | None = 5, m: int | None = None,
               validate: bool = True) -> Selection:
    """IS + SD selection (truncated LP s, truncated alphabet m; s=None, m=None is the exact pairwise optimum)."""
    p, qs, tokens, mask = check_inputs(p, qs, tokens, mask, validate)
    p_hat, in_mass = truncate_alphabet(p, m)
    law, y = chain_law(p_hat, qs, mask, s, tokens, stream)
    resid = (p_hat - law).clamp(min=0)
    sure = resid.sum(-1) <= EPS_MASS
    passed = (stream.accept(0) * gather(law, y) < gather(p_hat, y)) | sure
    weights = resid
    if m is not None:
        outside = stream.extra(0) >= in_mass
        p_out = torch.where(p_hat > 0, torch.zeros_like(p), p)
        weights = torch.where(outside[:, None], p_out, resid)
        passed = passed & ~outside
    return finish(weights, y, passed, tokens, mask, stream)


def importance_test_pass(p: torch.Tensor, qs: torch.Tensor, s: int | None = 5, m: int | None = None,
                         mask: torch.Tensor | None = None) -> torch.Tensor:
    """[N] exact test-pass probability p(Omega_0) * sum_y min(p_hat(y), p_I(y)) of :func:`importance`."""
    if mask is None:
        mask = torch.ones(qs.shape[:2], dtype=torch.bool, device=qs.device)
    p, qs = p.to(DTYPE), qs.to(DTYPE)
    p_hat, in_mass = truncate_alphabet(p, m)
    law, _ = chain_law(p_hat, qs, mask.bool(), s)
    return in_mass * torch.minimum(p_hat, law).sum(-1)
