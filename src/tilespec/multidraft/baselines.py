"""Rejection-style baselines, fully batched in PyTorch: single draft (SD), SpecInfer, SpecTr.

Shapes as in :mod:`.common`: p [N, V], qs [N, K, V], tokens [N, K], mask [N, K]; all return a Selection.

* SD (Leviathan/Chen): accept X with prob min(1, p(X)/q(X)), else draw from norm((p - q)^+).  Output law p,
  acceptance sum_x min(p, q) = 1 - TV(p, q).  SD is SpecInfer with one candidate.
* SpecInfer (recursive rejection sampling): r_0 = p; for active k in order accept X_k with prob
  min(1, r_{k-1}(X_k)/q_k(X_k)), else r_k = norm((r_{k-1} - q_k)^+); if all reject draw from r_K.
  Works for identical and non-identical drafts.  Test-pass 1 - prod_k (1 - b_k), b_k = sum min(r_{k-1}, q_k).
* SpecTr K-SEQ (identical drafts): beta(rho) = sum_x min(q, p/rho), P_acc = 1 - (1 - beta)^K';
  rho* in [1, K'] is the root of P_acc(rho) = rho beta(rho) (bisection, the valid upper side kept);
  accept X_k with prob min(1, p(X_k)/(rho q(X_k))) in order; if all reject draw from
  p_res = (p - min(q, p/rho) P_acc/beta) / (1 - P_acc)  (>= 0 because P_acc <= rho beta).
  K' = number of active candidates per row.
"""
from __future__ import annotations

import torch

from .common import EPS_MASS, Selection, Stream, check_inputs, finish, gather

BISECTION_STEPS = 50


def specinfer(p: torch.Tensor, qs: torch.Tensor, tokens: torch.Tensor, stream: Stream,
              mask: torch.Tensor | None = None, validate: bool = True, static: bool = False) -> Selection:
    """SpecInfer multi-round rejection sampling (SD when K = 1). See the module docstring. ``static``: no host
    sync (every candidate round runs; a row without active candidates draws from p)."""
    p, qs, tokens, mask = check_inputs(p, qs, tokens, mask, validate)
    n = p.shape[0]
    r = p.clone()
    done = torch.zeros(n, dtype=torch.bool, device=p.device)
    chosen = torch.full((n,), -1, dtype=torch.int64, device=p.device)
    for k in range(qs.shape[1]):
        act = mask[:, k] & ~done
        if not static and not bool(act.any()):
            continue
        x = tokens[:, k]
        q = qs[:, k]
        resid = (r - q).clamp(min=0)
        mass = resid.sum(-1)
        acc = act & ((stream.accept(k) * gather(q, x) < gather(r, x)) | (mass <= EPS_MASS))
        chosen = torch.where(acc, x, chosen)
        done = done | acc
        upd = (act & ~acc)[:, None]
        r = torch.where(upd, resid / mass.clamp(min=EPS_MASS)[:, None], r)
    return finish(r, chosen, done, tokens, mask, stream, static)


def single_draft(p: torch.Tensor, q: torch.Tensor, token: torch.Tensor, stream: Stream) -> Selection:
    """Single-draft speculative sampling: p [N, V], q [N, V], token [N]."""
    if q.dim() != 2 or token.dim() != 1:
        raise ValueError("single_draft takes q [N, V] and token [N]")
    return specinfer(p, q[:, None, :], token[:, None], stream)


def spectr_rho(p: torch.Tensor, q: torch.Tensor, k_active: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(rho* [N], beta(rho*) [N]) for p, q [N, V] and K' [N] (float64), by bisection on [1, K'].

    g(rho) = 1 - (1 - beta(rho))^K' - rho beta(rho) is >= 0 at rho = 1 and <= 0 at rho = K'; the returned rho is
    the upper end of the final bracket, where g <= 0 (so p_res >= 0).
    """
    kf = k_active.to(p.dtype)
    lo = torch.ones_like(kf)
    hi = kf.clone()

    def g(rho):
        beta = torch.minimum(q, p / rho[:, None]).sum(-1)
        return 1 - (1 - beta) ** kf - rho * beta

    for _ in range(BISECTION_STEPS):
        mid = 0.5 * (lo + hi)
        pos = g(mid) > 0
        lo = torch.where(pos, mid, lo)
        hi = torch.where(pos, hi, mid)
    beta = torch.minimum(q, p / hi[:, None]).sum(-1)
    return hi, beta


def spectr(p: torch.Tensor, qs: torch.Tensor, tokens: torch.Tensor, stream: Stream,
           mask: torch.Tensor | None = None, validate: bool = True, static: bool = False) -> Selection:
    """SpecTr K-sequential selection for identical drafts. See the module docstring. ``static``: no host sync
    (the caller promises identical drafts; a row without active candidates draws from p)."""
    p, qs, tokens, mask = check_inputs(p, qs, tokens, mask, validate)
    n = p.shape[0]
    first = mask.long().argmax(dim=1)
    q = qs[torch.arange(n, device=p.device), first]                                   # [N, V]
    if not static and bool((((qs - q[:, None]).abs().amax(-1) > 1e-6) & mask).any()):
        raise ValueError("spectr needs identical drafts (equal qs over the active candidates); use specinfer or is")
    k_active = mask.sum(dim=1)
    rho, beta = spectr_rho(p, q, k_active)
    p_acc = 1 - (1 - beta) ** k_active.to(p.dtype)
    res = (p - torch.minimum(q, p / rho[:, None]) * (p_acc / beta.clamp(min=1e-300))[:, None]).clamp(min=0)
    sure = res.sum(-1) <= EPS_MASS                                                    # q == p: every test passes
    done = torch.zeros(n, dtype=torch.bool, device=p.device)
    chosen = torch.full((n,), -1, dtype=torch.int64, device=p.device)
    for k in range(qs.shape[1]):
        act = mask[:, k] & ~done
        if not static and not bool(act.any()):
            continue
        x = tokens[:, k]
        acc = act & ((stream.accept(k) * rho * gather(q, x) < gather(p, x)) | sure)
        chosen = torch.where(acc, x, chosen)
        done = done | acc
    res = torch.where((k_active > 0)[:, None], res, p)      # no active candidate (static rows only): p itself
    return finish(res, chosen, done, tokens, mask, stream, static)
