"""Turning logits into the distributions speculative sampling compares (plain PyTorch, the reference semantics).

Every function works on rows: ``logits`` has shape [B, R, V] and the per-request parameters of a ResolvedSampling
(shape [B]) apply to all R rows of their request. Results are float32.
"""
from __future__ import annotations

import torch

from .types import ResolvedSampling

NEG_INF = float("-inf")


def _per_row(param: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """[B] -> [B, 1, 1] so a per-request parameter broadcasts over rows and vocabulary."""
    return param.view(-1, 1, 1).to(like.dtype) if param.dtype.is_floating_point else param.view(-1, 1, 1)


def filtered_logits(logits: torch.Tensor, sampling: ResolvedSampling) -> torch.Tensor:
    """Temperature-scaled logits [B, R, V] (fp32) with top-k / top-p / min-p exclusions set to -inf.

    Greedy requests (temperature 0) are scaled by 1 here; :func:`log_probs` turns them into one-hot rows.
    Ties: top-k keeps every token whose logit equals the k-th largest; top-p keeps a token when the mass of the
    tokens strictly before it in descending order is below top_p (so at least one token survives).
    """
    z = logits.float()
    temp = sampling.temperature
    scale = torch.where(temp > 0, temp, torch.ones_like(temp))
    z = z / _per_row(scale, z)
    if not sampling.has_filters:
        return z
    if sampling.has_top_k:
        k = sampling.top_k.clamp(min=0)
        vocab = z.shape[-1]
        kk = torch.where((k > 0) & (k < vocab), k, torch.full_like(k, vocab))
        sorted_desc = torch.sort(z, dim=-1, descending=True).values
        kth = sorted_desc.gather(-1, (kk - 1).view(-1, 1, 1).expand(z.shape[0], z.shape[1], 1))
        z = torch.where(z >= kth, z, torch.full_like(z, NEG_INF))
    if sampling.has_top_p:
        top_p = _per_row(sampling.top_p, z)
        sorted_z, order = torch.sort(z, dim=-1, descending=True)
        probs = torch.softmax(sorted_z, dim=-1)
        mass_before = torch.cumsum(probs, dim=-1) - probs
        keep_sorted = (mass_before < top_p) | (top_p >= 1.0)
        keep = torch.empty_like(keep_sorted).scatter_(-1, order, keep_sorted)
        z = torch.where(keep, z, torch.full_like(z, NEG_INF))
    if sampling.has_min_p:
        min_p = _per_row(sampling.min_p, z)
        logp = torch.log_softmax(z, dim=-1)
        max_logp = logp.max(dim=-1, keepdim=True).values
        drop = (min_p > 0) & (logp < max_logp + torch.log(min_p.clamp(min=1e-38)))
        z = torch.where(drop, torch.full_like(z, NEG_INF), z)
    return z


def log_probs(logits: torch.Tensor, sampling: ResolvedSampling) -> torch.Tensor:
    """log of the sampling distribution [B, R, V] (fp32): log_softmax of the filtered logits, or for greedy
    requests 0 at the first argmax and -inf elsewhere."""
    z = filtered_logits(logits, sampling)
    logp = torch.log_softmax(z, dim=-1)
    if sampling.any_greedy:
        first_max = z.argmax(dim=-1, keepdim=True)
        one_hot = torch.full_like(logp, NEG_INF).scatter_(-1, first_max, 0.0)
        greedy = _per_row(sampling.temperature, z) == 0
        logp = torch.where(greedy, one_hot, logp)
    return logp


def lenient_greedy_logprobs(logits: torch.Tensor, sampling: ResolvedSampling) -> torch.Tensor:
    """Temperature-1 log-probs used by the greedy lenience rule (accept x when p1(x) >= l * max p1)."""
    ones = ResolvedSampling(
        temperature=torch.ones_like(sampling.temperature), top_k=sampling.top_k, top_p=sampling.top_p,
        min_p=sampling.min_p, lenience=sampling.lenience, any_greedy=False, all_greedy=False,
        has_top_k=sampling.has_top_k, has_top_p=sampling.has_top_p, has_min_p=sampling.has_min_p,
        has_lenience=sampling.has_lenience)
    return torch.log_softmax(filtered_logits(logits, ones), dim=-1)


def draft_log_probs(draft_tokens: torch.Tensor, vocab: int, sampling: ResolvedSampling,
                    draft_logits: torch.Tensor | None, draft_probs: torch.Tensor | None) -> torch.Tensor:
    """log q [B, K, V] (fp32): processed draft logits, the given draft probabilities as they are, or one-hot rows
    at the drafted tokens when the draft is deterministic."""
    if draft_logits is not None:
        return log_probs(draft_logits, sampling)
    if draft_probs is not None:
        return torch.log(draft_probs.float())
    b, k = draft_tokens.shape
    one_hot = torch.full((b, k, vocab), NEG_INF, device=draft_tokens.device)
    return one_hot.scatter_(-1, draft_tokens.unsqueeze(-1), 0.0)
