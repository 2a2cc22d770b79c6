"""Turning logits into the distributions speculative sampling compares (plain PyTorch, the reference semantics).

Every function works on rows: ``logits`` has shape [B, R, V] and the per-request parameters of a ResolvedSampling
(shape [B]) apply to all R rows of their request. Results are float32.
"""
from __future__ import annotations

import torch

from .filters import keep_threshold, scaled_logits
from .types import ResolvedSampling

NEG_INF = float("-inf")


def _per_row(param: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """[B] -> [B, 1, 1] so a per-request parameter broadcasts over rows and vocabulary."""
    return param.view(-1, 1, 1).to(like.dtype) if param.dtype.is_floating_point else param.view(-1, 1, 1)


def filtered_logits(logits: torch.Tensor, sampling: ResolvedSampling, method: str = "auto") -> torch.Tensor:
    """Temperature-scaled logits [B, R, V] (fp32) with top-k / top-p / min-p exclusions set to -inf.

    Greedy requests (temperature 0) are scaled by 1 here; :func:`log_probs` turns them into one-hot rows.
    With z the scaled row (order: temperature, top-k, top-p, min-p):
    top-k keeps every token with z >= the k-th largest z (ties at the k-th value are all kept);
    top-p keeps token x iff the probability mass (softmax of the top-k-filtered row) of the tokens with z strictly
    greater than z_x is < top_p, so tied tokens are kept together and at least one token survives;
    min-p drops tokens whose log-prob (of the row filtered so far) is below max log-prob + log(min_p).
    No sort: both thresholds come from an exact bisection over fp32 order keys (:mod:`tilespec.verify.filters`;
    a Triton kernel for CUDA tensors), with no host sync, so this is safe inside CUDA-graph capture.
    ``method``: "auto", "triton" (chunked radix kernel), "triton_row" (one program per row), "search" or "sort"
    (the sort-based evaluation of the same definition, kept for tests and benchmarks); all give the same kept set
    except where a top-p mass is within float rounding of top_p.
    """
    z = scaled_logits(logits, sampling.temperature)
    if not sampling.has_filters:
        return z
    if sampling.has_top_k or sampling.has_top_p:
        thr = keep_threshold(logits, sampling, z=z, method=method)
        z = torch.where(z >= thr[..., None], z, torch.full_like(z, NEG_INF))
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
