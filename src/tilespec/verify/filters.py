"""Top-k / top-p keep thresholds without sorting the vocabulary (plain PyTorch), and the sort-based evaluation of
the same definitions that tests and benchmarks compare against.

Definitions, per row of z = temperature-scaled fp32 logits [B, R, V] (-inf = already excluded); both filters keep
every token with z >= a per-row threshold, so tied tokens are always kept or dropped together:

* top-k, k in [1, V): t_k = the k-th largest z counted with multiplicity; keep z >= t_k. k = 0 or k >= V: keep all.
* top-p, p in (0, 1): pi = softmax of the top-k-filtered row, S(v) = sum of pi_y over tokens with z_y > v
  (strictly greater); keep token x iff S(z_x) < p. S is non-increasing in v and S(max z) = 0, so the kept set is
  {z >= t_p} with t_p = the smallest vocabulary value v with S(v) < p, and at least one token survives. p >= 1:
  keep all. (A plain sort + cumsum gives the same set except on exact ties at the boundary, where it keeps only
  some of the tied tokens.)

Sort-free search: both thresholds are vocabulary values, found exactly by bisection over the order-preserving
int32 key of the fp32 value (:func:`order_key`; 2^32 keys, so 32 one-bit steps). Each step is one pass over the
row with no host sync and no data-dependent shape, so the search is usable inside CUDA-graph capture:

* t_k = float(largest key u with count(z >= float(u)) >= k). Exact (counts are integers).
* t_p = float(u + 1), u = the largest key with S(float(u)) >= p. S is computed as a masked sum in vocabulary order,
  the sort-based form as a cumsum in sorted order; the two roundings differ, so the kept sets can differ only for a
  token x whose S(z_x) is within float rounding of p (~1e-7 relative) - a near-tie of p itself.

The Triton kernels run the same search 2^BITS-way per pass: :mod:`tilespec.verify.kernels.radix` (each pass
split over many programs per row; the default) and :mod:`tilespec.verify.kernels.thresholds` (one program per row).
"""
from __future__ import annotations

from typing import Optional

import torch

from tilespec.env import triton_available

from .order_keys import KEY_BITS, KEY_NAN, KEY_NEG_INF, key_float, order_key  # noqa: F401  (re-exported)

NEG_INF = float("-inf")


def scaled_logits(logits: torch.Tensor, temperature: torch.Tensor) -> torch.Tensor:
    """z = fp32 logits [B, R, V] / T per request (greedy requests, T = 0, are scaled by 1)."""
    scale = torch.where(temperature > 0, temperature, torch.ones_like(temperature))
    return logits.float() / scale.view(-1, 1, 1).float()


def _top_k_on(top_k: torch.Tensor, vocab: int) -> torch.Tensor:
    return ((top_k > 0) & (top_k < vocab)).view(-1, 1)


# ---- sort-based evaluation (the definitions, literally; O(V log V) per row) ----

def top_k_threshold_sorted(z: torch.Tensor, top_k: torch.Tensor) -> torch.Tensor:
    """t_k [B, R] (float32, -inf where top-k is off) from a full descending sort of z [B, R, V]."""
    b, r, v = z.shape
    kk = torch.where(_top_k_on(top_k, v).view(-1), top_k, torch.ones_like(top_k)).clamp(max=v)
    kth = torch.sort(z, dim=-1, descending=True).values.gather(-1, (kk - 1).view(b, 1, 1).expand(b, r, 1))[..., 0]
    return torch.where(_top_k_on(top_k, v), kth, torch.full_like(kth, NEG_INF))


def top_p_threshold_sorted(z: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """t_p [B, R] (float32, -inf where top_p >= 1) of rows z [B, R, V] (top-k already applied as -inf).

    pi is softmax(z) in vocabulary order, gathered into descending order; the mass of the tokens before the first
    of a group of ties is S of the group's value, so the kept prefix is extended over ties of its last value."""
    sorted_z, order = torch.sort(z, dim=-1, descending=True)
    probs = torch.softmax(z, dim=-1).gather(-1, order)
    mass_before = torch.cumsum(probs, dim=-1) - probs
    n_keep = (mass_before < top_p.view(-1, 1, 1)).sum(-1, keepdim=True).clamp(min=1)
    thr = sorted_z.gather(-1, n_keep - 1)[..., 0]
    return torch.where((top_p < 1.0).view(-1, 1), thr, torch.full_like(thr, NEG_INF))


# ---- sort-free search (bisection over order keys) ----

def top_k_threshold_search(z: torch.Tensor, top_k: torch.Tensor, k_max: Optional[int] = None) -> torch.Tensor:
    """t_k [B, R] of z [B, R, V] without a sort. ``k_max`` (a host-known bound on every enabled k, or None): one
    ``torch.topk(z, k_max)`` and a gather; otherwise 32 counting steps of the key bisection. Both exact."""
    b, r, v = z.shape
    on = _top_k_on(top_k, v)
    k = torch.where(on.view(-1), top_k, torch.ones_like(top_k)).view(-1, 1)
    if k_max is not None and 1 <= k_max < v:
        top = torch.topk(z, k_max, dim=-1, sorted=True).values
        kth = top.gather(-1, (k.clamp(max=k_max) - 1).view(b, 1, 1).expand(b, r, 1))[..., 0]
    else:
        base = torch.full((b, r), KEY_NEG_INF, dtype=torch.int64, device=z.device)   # count(z >= -inf) = V >= k
        for shift in range(KEY_BITS - 1, -1, -1):
            cand = base + (1 << shift)
            ok = (z >= key_float(cand)[..., None]).sum(-1) >= k
            base = torch.where(ok, cand, base)
        kth = key_float(base)
    return torch.where(on, kth, torch.full_like(kth, NEG_INF))


def top_p_threshold_search(z: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """t_p [B, R] of z [B, R, V] (top-k already applied as -inf) by 32 bisection steps, each one masked sum of pi."""
    b, r, _ = z.shape
    probs = torch.softmax(z, dim=-1)
    p = top_p.view(-1, 1)
    base = torch.full((b, r), KEY_NEG_INF - 1, dtype=torch.int64, device=z.device)  # sentinel: S(below all) = 1
    zero = probs.new_zeros(())
    for shift in range(KEY_BITS - 1, -1, -1):
        cand = base + (1 << shift)
        mass = torch.where(z > key_float(cand)[..., None], probs, zero).sum(-1)
        base = torch.where(mass >= p, cand, base)
    thr = key_float(base + 1)
    return torch.where(p < 1.0, thr, torch.full_like(thr, NEG_INF))


KERNEL_MIN_ROWS = 1   # rows (B x R) from which "auto" uses the chunked radix kernel on a GPU
ROW_KERNEL_TOP_P_ROWS = 128   # top-p alone from this many rows: the one-program-per-row kernel (measured faster)


def keep_threshold(logits: torch.Tensor, sampling, z: Optional[torch.Tensor] = None,
                   method: str = "auto") -> torch.Tensor:
    """Per-row threshold [B, R] (float32) of top-k followed by top-p: keep ``z >= thr`` (-inf: keep all).

    ``logits`` [B, R, V] raw (any float dtype); ``z`` its temperature-scaled fp32 copy when the caller has one.
    method: "auto" (on a GPU with at least KERNEL_MIN_ROWS rows "triton", or "search" without Triton; else
    "sort"), "triton" (the chunked radix select, :mod:`tilespec.verify.kernels.radix`: many programs per row),
    "triton_row" (the one-program-per-row kernel, :mod:`tilespec.verify.kernels.thresholds`), "search" (the torch
    bisection above), "sort" (the sort-based evaluation). Min-p is not included (see filtered_logits).
    """
    if method == "auto":
        rows = logits.shape[0] * logits.shape[1]
        # The rule: on a GPU the radix kernel beats the sort from KERNEL_MIN_ROWS rows; top-p alone keeps every
        # chunk of a row active, so from ROW_KERNEL_TOP_P_ROWS rows the one-program-per-row kernel is faster
        # (measured by bench/scripts/filter_thresholds.py).
        method = (("triton" if triton_available() else "search") if rows >= KERNEL_MIN_ROWS else "sort") \
            if logits.is_cuda else "sort"
        if method == "triton" and sampling.has_top_p and not sampling.has_top_k and rows >= ROW_KERNEL_TOP_P_ROWS:
            method = "triton_row"
    if method in ("triton", "triton_row"):
        if method == "triton":
            from .kernels.radix import radix_thresholds as find
        else:
            from .kernels.thresholds import filter_thresholds as find
        return find(logits, sampling.temperature, sampling.top_k, sampling.top_p, sampling.has_top_k,
                    sampling.has_top_p)
    if z is None:
        z = scaled_logits(logits, sampling.temperature)
    b, r, _ = z.shape
    thr = torch.full((b, r), NEG_INF, device=z.device)
    if sampling.has_top_k:
        if method == "sort":
            thr = top_k_threshold_sorted(z, sampling.top_k)
        else:
            bounds = sampling.top_k_range
            thr = top_k_threshold_search(z, sampling.top_k, None if bounds is None else bounds[1])
    if sampling.has_top_p:
        zk = z if not sampling.has_top_k else torch.where(z >= thr[..., None], z, torch.full_like(z, NEG_INF))
        find = top_p_threshold_sorted if method == "sort" else top_p_threshold_search
        thr = torch.maximum(thr, find(zk, sampling.top_p))
    return thr
