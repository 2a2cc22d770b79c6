"""Exactness suite of the multi-draft schemes (called by ``tilespec check exactness --method multidraft``).

Token level: for a small alphabet (V = 5..6) the exact output law of every valid scheme is the target p (the
law of Y = TLSR(X_1..X_K), X_k ~ q_k independent, summed over all candidate tuples). Each case draws
``samples`` candidate tuples, runs the scheme batched, and tests with ``fit_test`` (G-test and chi-square,
pooled bins):  ``output`` = counts of Y vs p;  ``test_pass`` = [passed, failed] vs the scheme's exact
test-pass probability (:func:`~.schemes.accept_probability`).

Chain level (``verify_multidraft``): an order-1 Markov target P0, P[y_prev] and drafts Q_k at their own
temperatures; K draft sequences of length L = 2 per round, rounds repeated until two tokens are out; the pair
(y1, y2) must have law P0(y1) P(y1, y2).

Power check: ``multidraft:planted-is-no-sd`` emits the IS token without the SD correction (law p_I != p); it is
marked exact_method=False and must FAIL.
"""
from __future__ import annotations

import time

import numpy as np
import torch

from ..exactness.stats import CaseResult, fit_test, summarize
from .chain import verify_multidraft
from .common import DTYPE, Stream
from .importance import chain_law
from .schemes import select, accept_probability


def _law(x) -> torch.Tensor:
    t = torch.as_tensor(x, dtype=DTYPE)
    return t / t.sum(-1, keepdim=True)


def _tempered(p: torch.Tensor, temp: float) -> torch.Tensor:
    """p^(1/T) renormalised (zeros stay zero)."""
    return _law(torch.where(p > 0, p.clamp(min=1e-300) ** (1.0 / temp), torch.zeros_like(p)))


def token_cases() -> list[tuple[str, str, torch.Tensor, torch.Tensor]]:
    """(case, scheme, p [V], qs [K, V]) for the token-level suite."""
    p5 = _law([0.40, 0.25, 0.15, 0.12, 0.08])
    q5 = _law([0.10, 0.15, 0.30, 0.25, 0.20])
    p6z = _law([0.35, 0.0, 0.30, 0.20, 0.15, 0.0])        # target zeros (top-p) and draft zeros
    q6z = _law([0.10, 0.25, 0.0, 0.30, 0.20, 0.15])
    hot = _tempered(p5, 2.0)
    iid2, iid3 = q5.expand(2, 5), q6z.expand(3, 6)
    noniid2 = torch.stack([_tempered(p5, 1.2), hot])
    noniid4 = torch.stack([_tempered(p5, 1.2), hot, q5, _tempered(p5, 0.7)])
    cases = [("V5-K1", "sd", p5, q5[None])]
    for scheme in ("specinfer", "spectr", "is", "is-lp", "is-s2", "is-m3"):
        cases.append(("V5-K2-iid", scheme, p5, iid2))
    for scheme in ("specinfer", "spectr", "is", "is-m3"):
        cases.append(("V6-K3-iid-zeros", scheme, p6z, iid3))
    for scheme in ("specinfer", "is", "is-lp"):
        cases.append(("V5-K2-noniid", scheme, p5, noniid2))
    for scheme in ("specinfer", "is", "is-m2"):
        cases.append(("V5-K4-noniid", scheme, p5, noniid4))
    return cases


def _draw(qs: torch.Tensor, samples: int, gen: torch.Generator) -> torch.Tensor:
    return torch.stack([torch.multinomial(qs[k].float(), samples, replacement=True, generator=gen)
                        for k in range(qs.shape[0])], dim=1)


def _token_case(case, scheme, p, qs, samples, alpha, seed, gen) -> CaseResult:
    start = time.perf_counter()
    k, v = qs.shape
    tokens = _draw(qs, samples, gen)
    pp, qq = p.expand(samples, v), qs.expand(samples, k, v)
    sel = select(scheme, pp, qq, tokens, Stream.for_rows(samples, seed=seed))
    counts = torch.bincount(sel.token, minlength=v).numpy()
    acc = float(accept_probability(scheme, p[None], qs[None])[0])
    passed = int(sel.test_pass.sum())
    fits = {"output": fit_test(counts, p.numpy()),
            "test_pass": fit_test(np.array([passed, samples - passed]), np.array([acc, 1 - acc]))}
    return summarize(case, f"multidraft:{scheme}", samples, alpha, fits, time.perf_counter() - start,
                     note=f"K={k} V={v}; test-pass exact {acc:.4f}, observed {passed / samples:.4f}")


def _planted_case(samples, alpha, seed, gen) -> CaseResult:
    start = time.perf_counter()
    p = _law([0.40, 0.25, 0.15, 0.12, 0.08])
    qs = _law([0.10, 0.15, 0.30, 0.25, 0.20]).expand(2, 5)
    tokens = _draw(qs, samples, gen)
    mask = torch.ones(samples, 2, dtype=torch.bool)
    _, y = chain_law(p.expand(samples, 5), qs.expand(samples, 2, 5), mask, 5, tokens, Stream.for_rows(samples, seed))
    counts = torch.bincount(y, minlength=5).numpy()
    fits = {"output": fit_test(counts, p.numpy())}
    return summarize("V5-K2-iid", "multidraft:planted-is-no-sd", samples, alpha, fits,
                     time.perf_counter() - start, exact_method=False,
                     note="power check: IS step without the SD correction (law p_I != p); must FAIL")


def chain_case(scheme: str, temps: tuple[float, ...], samples: int, alpha: float, seed: int,
               v: int = 5, L: int = 2, sampler: str = "gumbel") -> CaseResult:
    """Sequence-level check of ``verify_multidraft``: law of the first two emitted tokens."""
    start = time.perf_counter()
    gen = torch.Generator().manual_seed(1234)
    table = torch.randn(v + 1, v, generator=gen, dtype=DTYPE) * 2.5
    target = torch.softmax(table, -1)                                 # row 0: start, row 1 + y: after y
    noise = 0.8 * torch.randn(v + 1, v, generator=gen, dtype=DTYPE)
    drafts = [torch.softmax(table / t + noise, -1) for t in temps]     # equal temperatures: identical drafts
    k = len(temps)
    sgen = torch.Generator().manual_seed(seed)
    ctx = torch.zeros(samples, dtype=torch.int64)                     # table row of the context
    out = torch.full((samples, 2), -1, dtype=torch.int64)
    have = torch.zeros(samples, dtype=torch.int64)
    rnd = 0
    while bool((have < 2).any()):
        rows = (have < 2).nonzero().squeeze(1)
        n = rows.numel()
        d_tok = torch.empty(n, k, L, dtype=torch.int64)
        d_prob = torch.empty(n, k, L, v, dtype=DTYPE)
        t_prob = torch.empty(n, k, L + 1, v, dtype=DTYPE)
        for i in range(k):
            state = ctx[rows]
            for t in range(L + 1):
                t_prob[:, i, t] = target[state]
                if t == L:
                    break
                d_prob[:, i, t] = drafts[i][state]
                d_tok[:, i, t] = torch.multinomial(d_prob[:, i, t], 1, generator=sgen).squeeze(1)
                state = 1 + d_tok[:, i, t]
        res = verify_multidraft(None, d_tok, target_probs=t_prob, draft_probs=d_prob, scheme=scheme,
                                seed=seed * 7919 + rnd * 1_000_003, offsets=0, sampler=sampler)
        for j in range(L + 1):
            em = res.output_tokens[:, j]
            put = (em >= 0) & (have[rows] < 2)
            r = rows[put]
            out[r, have[r]] = em[put]
            have[r] += 1
        last = out[rows, (have[rows] - 1).clamp(min=0)]
        ctx[rows] = 1 + last
        rnd += 1
    counts = torch.bincount(out[:, 0] * v + out[:, 1], minlength=v * v).numpy()
    exact = (target[0][:, None] * target[1:]).reshape(-1).numpy()
    fits = {"pair": fit_test(counts, exact)}
    name = "chain-L2-K%d-%s%s" % (k, "iid" if len(set(temps)) == 1 else "noniid", "-cdf" if sampler == "cdf" else "")
    return summarize(name, f"multidraft:{scheme}", samples, alpha, fits, time.perf_counter() - start,
                     note=f"draft temperatures {temps}; law of (y1, y2) over {rnd} rounds")


def run_multidraft_exactness(samples: int, alpha: float = 1e-6, seed: int = 0) -> list[CaseResult]:
    """Every scheme on every token-level case, the chain-level cases, and the planted-bias power check."""
    if samples < 100:
        raise ValueError(f"samples must be >= 100, got {samples}")
    gen = torch.Generator().manual_seed(seed)
    results = [_token_case(c, s, p, qs, samples, alpha, seed, gen) for c, s, p, qs in token_cases()]
    chain_samples = max(100, samples // 4)
    for scheme, temps in (("sd", (1.5,)), ("specinfer", (1.5, 1.5)), ("spectr", (1.5, 1.5, 1.5)),
                          ("is", (1.5, 1.5)), ("specinfer", (1.2, 2.0)), ("is", (1.2, 2.0, 0.8))):
        results.append(chain_case(scheme, temps, chain_samples, alpha, seed))
    results.append(chain_case("is", (1.2, 2.0), chain_samples, alpha, seed, sampler="cdf"))
    results.append(_planted_case(samples, alpha, seed, gen))
    return results
