"""Keep thresholds for top-k / top-p / min-p: one fp32 value per logits row, applied by the kernels in-stream.

Used by :mod:`tilespec.verify.kernels.launch` (``fused`` / ``sigmoid`` with filters); PyTorch plus the threshold
kernels of :mod:`tilespec.verify.filters`.
"""
from __future__ import annotations

import warnings

import torch

from ..distributions import filtered_logits
from ..filters import keep_threshold
from ..types import VerifyInputs
from .topk16 import TOP_P_K_MAX, supports as _topk16_ok, top_k_thresholds16
from .topp16 import top_p_thresholds16

# top-k (and top-k then top-p) on bf16 / fp16 rows on a GPU: the kernels of topk16. Not on CPU: under the Triton
# interpreter every (row, chunk) program is a Python call, and the exactness suite's batches have ~10^6 rows, where
# torch.topk's vectorised CPU kernel gives the same thresholds (tests set TOPK16_ON_CPU to route CPU calls here).
TOPK16_ON_CPU = False

# 16-bit threshold kernels that failed to compile or launch on this machine (a Triton release that rejects a
# construct they use): those rows take the general exact path from then on, with one warning. Both paths are exact,
# so only speed changes. CPU (interpreter) failures are raised: they are bugs the tests must see.
_FAILED: set = set()


def _guarded(kind: str, fn, logits: torch.Tensor, *args, **kwargs):
    """``fn(logits, *args, **kwargs)``, or None when the ``kind`` kernels failed on this GPU (now or before)."""
    if kind in _FAILED:
        return None
    try:
        return fn(logits, *args, **kwargs)
    except Exception as err:                         # noqa: BLE001 (compile / launch errors have many types)
        if not logits.is_cuda or isinstance(err, torch.cuda.OutOfMemoryError):
            raise
        _FAILED.add(kind)
        warnings.warn(f"the {kind} threshold kernels failed on this GPU ({type(err).__name__}: "
                      f"{str(err).splitlines()[0] if str(err) else ''}); using the general exact path instead")
        return None


def _top_p16(logits: torch.Tensor, s) -> bool:
    """Whether these rows take :func:`.topp16.top_p_thresholds16`: top-p and / or min-p without top-k on bf16 /
    fp16 rows on a GPU."""
    return ((s.has_top_p or s.has_min_p) and not s.has_top_k and _topk16_ok(logits)
            and (logits.is_cuda or TOPK16_ON_CPU))


def _top_k16(logits: torch.Tensor, s) -> dict | None:
    """The arguments of :func:`.topk16.top_k_thresholds16` for these rows, or None when they do not take it."""
    bounds = s.top_k_range
    if not (s.has_top_k and _topk16_ok(logits) and (logits.is_cuda or TOPK16_ON_CPU)):
        return None
    if not (s.has_top_p or s.has_min_p):
        return dict(k_max=bounds[1] if bounds else 0)
    if bounds is not None and 1 <= bounds[0] and bounds[1] < logits.shape[-1] and bounds[1] <= TOP_P_K_MAX:
        return dict(top_p=s.top_p if s.has_top_p else None, min_p=s.min_p if s.has_min_p else None,
                    k_max=bounds[1])
    return None


def keep_thresholds_pair(target: torch.Tensor, draft, inputs: VerifyInputs) -> tuple:
    """(:func:`keep_thresholds` of the target rows, of the draft rows or None when ``draft`` is None): one launch
    set for both where the 16-bit kernels take both (same dtype and V), else two calls."""
    s = inputs.sampling
    if draft is not None and draft.dtype == target.dtype and draft.shape[::2] == target.shape[::2]:
        out = None
        if _top_p16(target, s) and _top_p16(draft, s):
            out = _guarded("topp16", top_p_thresholds16, target, s.top_p, s.temperature, draft,
                           min_p=s.min_p if s.has_min_p else None)
        elif (args := _top_k16(target, s)) is not None:   # sampling, dtype and V only: the draft's are the same
            out = _guarded("topk16", top_k_thresholds16, target, s.top_k, s.temperature, draft=draft, **args)
        if out is not None:
            return out
    return keep_thresholds(target, inputs), (keep_thresholds(draft, inputs) if draft is not None else None)


def keep_thresholds(logits: torch.Tensor, inputs: VerifyInputs) -> torch.Tensor:
    """Exact selection pass for top-k / top-p / min-p: per row, the smallest scaled logit that the filters keep.

    On bf16 / fp16 rows on a GPU: top-p and / or min-p without top-k, :func:`.topp16.top_p_thresholds16` (a count
    histogram of the keys below the row's largest; min-p's threshold from the row max alone); top-k alone, or top-k
    then top-p / min-p when every k is known on the host and in [1, min(V, 1025)),
    :func:`.topk16.top_k_thresholds16` (a segment-max pivot and one compacting pass, an exact digit-counting
    fallback). Top-k alone otherwise, with every k known on the host and in [1, V): :func:`_top_k_thresholds`, the
    same thresholds from one ``torch.topk``. Top-k / top-p without min-p otherwise:
    :func:`tilespec.verify.filters.keep_threshold` itself (on a GPU the radix / row kernels, which scale the raw
    logits on the fly: no fp32 copy of the rows); its ``z >= thr`` is by definition the set ``filtered_logits``
    keeps. With min-p otherwise: the smallest z that ``filtered_logits`` keeps (the reference semantics on a full
    fp32 copy of every row). The kernels' mask ``z / T >= thr`` keeps the reference's set (for top-p, tokens tied
    with the last kept one are also kept; the 16-bit top-p / min-p sums differ from the reference's in rounding
    only, see :mod:`.topp16`). Returns float32 [B, R]; a row with no filter on gets -inf (keep all) or, on the
    reference path with min-p, its smallest finite z: the same set but for -inf tokens, which have no mass either
    way.
    """
    s = inputs.sampling
    bounds = s.top_k_range
    out = None
    if _top_p16(logits, s):
        out = _guarded("topp16", top_p_thresholds16, logits, s.top_p, s.temperature,
                       min_p=s.min_p if s.has_min_p else None)
    elif (args := _top_k16(logits, s)) is not None:
        out = _guarded("topk16", top_k_thresholds16, logits, s.top_k, s.temperature, **args)
    if out is not None:
        return out
    if (s.has_top_k and not s.has_top_p and not s.has_min_p and bounds is not None
            and 1 <= bounds[0] and bounds[1] < logits.shape[-1]):
        return _top_k_thresholds(logits, s.top_k, s.temperature, bounds[1])
    if not s.has_min_p:
        return keep_threshold(logits, s).contiguous()
    z = filtered_logits(logits, s)
    return z.masked_fill(torch.isneginf(z), float("inf")).amin(dim=-1).contiguous()


def _top_k_thresholds(logits: torch.Tensor, top_k: torch.Tensor, temperature: torch.Tensor, k_max: int):
    """The k-th largest scaled logit per row [B, R] (float32), every k in [1, V): what the reference's full sort
    gives, at the cost of a top-``k_max`` selection instead of a sort and an fp32 copy of the rows. Exact: x ->
    float(x) / T is non-decreasing, so the k-th largest scaled logit is the k-th largest logit, scaled the same way
    (greedy rows, T = 0, are scaled by 1 as in ``filtered_logits``)."""
    batch, rows, _ = logits.shape
    top = torch.topk(logits, k_max, dim=-1, sorted=True).values                   # [B, R, k_max], descending
    kth = top.gather(-1, (top_k - 1).view(batch, 1, 1).expand(batch, rows, 1))[..., 0].float()
    scale = torch.where(temperature > 0, temperature, torch.ones_like(temperature))
    return (kth / scale[:, None]).contiguous()
