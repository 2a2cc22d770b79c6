"""Expected tokens per target forward of a γ-token draft chain walked along given text: the held-out estimate of
live decoding.

Exact speculative sampling emits the target's law p whatever the draft does, so live text is distributed as a
response the target sampled at the same setting. Given the token x a step emits at a position, the draft token
there was accepted with probability P(accepted, x) / P(x) = min(p(x), q(x)) / p(x) = min(1, q(x) / p(x)) (at
temperature 0: whether the draft's argmax is x), and a draft at depth k >= 2 is reached only when every earlier draft
of the step was accepted, i.e. equalled the emitted tokens: the head then saw the text's own tokens and its own
earlier outputs, which is exactly what the training-time test (heads.model.DraftHead.ttt_forward) feeds depth k.
So walking the chain along such a response -- a step starting at token j tries depth m at token j + m - 1 with that
acceptance probability, stops at the first rejection (that token is the residual draw) or emits a bonus token after
γ acceptances -- reproduces live decoding's law of steps and tokens. What the per-position average acceptance
(sum_v min(p, q) at every position) misses: steps start right after a rejection, so hard stretches of text are
tried more often than their share of positions; and at T > 0 the contexts are the sampled ones.

:func:`chain_walk` computes the walk's expectation exactly (a forward pass over the visit probabilities of step
starts), not by simulation.
"""
from __future__ import annotations

import torch


def chain_walk(accept: torch.Tensor, start: torch.Tensor, end: torch.Tensor, gamma: int) -> tuple:
    """Expected target forwards and emitted tokens per row of a γ-chain walked along each row.

    accept [S, K, T] float in [0, 1]: accept[s, k - 1, j] = probability that a draft at depth k for token j of row s
    is accepted (K >= gamma); start [S] int64: the first token the first step drafts (the engine's prefill leaves the
    prompt's last token pending, so its first step drafts the first response token); end [S] int64: tokens j < end
    exist. A step starting at j tests depths m = 1..γ at tokens j + m - 1 (none past ``end``: the step then ends at
    the row's end, which leaves out the surplus a last step may emit beyond the requested tokens), and the next step
    starts after the first rejected token or after the bonus token j + γ. -> (steps [S] float64: expected forwards
    to emit tokens [start, end), tokens [S] float64: end - start, clamped at 0). Tokens per forward of rows R:
    tokens[R].sum() / steps[R].sum().
    """
    if accept.ndim != 3 or start.shape != (accept.shape[0],) or end.shape != start.shape:
        raise ValueError(f"chain_walk needs accept [S, K, T] and start / end [S], got {tuple(accept.shape)}, "
                         f"{tuple(start.shape)}, {tuple(end.shape)}")
    s, k, t = accept.shape
    if not 1 <= gamma <= k:
        raise ValueError(f"gamma must be in [1, {k}] (the depths accept holds), got {gamma}")
    acc = torch.zeros((s, gamma, t + gamma + 1), dtype=torch.float64, device=accept.device)
    acc[:, :, :t] = accept[:, :gamma].double()
    cols = torch.arange(t + gamma + 1, device=accept.device)
    acc = acc * (cols[None, None] < end[:, None, None])            # no draft past the row's end
    visit = torch.zeros((s, t + gamma + 2), dtype=torch.float64, device=accept.device)
    live = start < end
    visit[live, start[live]] = 1.0
    steps = torch.zeros(s, dtype=torch.float64, device=accept.device)
    for j in range(t):
        w = visit[:, j] * (j < end)
        steps += w
        run = w
        for m in range(1, gamma + 1):
            a = acc[:, m - 1, j + m - 1]
            visit[:, j + m] += run * (1.0 - a)                   # rejected at depth m: the next step at j + m
            run = run * a
        visit[:, j + gamma + 1] += run                            # all accepted, plus the bonus token j + γ
    return steps, (end - start).clamp(min=0).double()


def taus_of_walks(accept: torch.Tensor, start: torch.Tensor, end: torch.Tensor, gammas) -> dict:
    """{γ: tokens per forward} of :func:`chain_walk` pooled over the rows (0.0 where the rows hold no tokens)."""
    out = {}
    for g in gammas:
        steps, tokens = chain_walk(accept, start, end, g)
        out[g] = float(tokens.sum() / steps.sum()) if float(steps.sum()) > 0 else 0.0
    return out


def alphas_of_taus(taus: dict) -> list:
    """Per-depth acceptance whose chain formula (acceptance.tau_by_gamma) gives ``taus`` {1: τ1, .., K: τK}:
    a_1 = τ1 - 1, a_k = (τk - τ(k-1)) / (τ(k-1) - τ(k-2)) (τ0 = 1, τ(-1) = 0), clipped to [0, 1] (a walk's τ can
    grow by more than the previous increment where acceptance is correlated along the text)."""
    prev2, prev, out = 0.0, 1.0, []
    for g in sorted(taus):
        inc, last = taus[g] - prev, prev - prev2
        out.append(min(1.0, max(0.0, inc / last)) if last > 0 else 0.0)
        prev2, prev = prev, taus[g]
    return out
