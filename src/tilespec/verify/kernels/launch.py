"""Python launch wrappers: ``fused_verify`` (2 launches), ``sigmoid_verify`` (1), ``tiled_verify`` (2 + softmaxes).

No wrapper synchronises with the host: buffers are allocated with ``torch.empty`` (no kernel), the per-device
counter buffer used by the last-program-done reduction is zero-initialised once and reset by the kernel itself,
and every size passed to a kernel is a Python int known from tensor shapes. Hence the fused path can be captured
in a CUDA graph (allocate the counters outside the capture by calling once before capturing, as any warm-up does).
Sizes B and K are not specialised on (``do_not_specialize``): changing them never recompiles a kernel; V, the
dtypes and the feature switches (draft kind, filters) select among a few compiled variants.

Block sizes are module globals so tests can shrink them to exercise multi-chunk code on tiny vocabularies:
CHUNK1 (pass-1 chunk; fixed per V so results are batch invariant), BLOCK2 (pass-2 tile), TILE (tiled's n).
"""
from __future__ import annotations

import contextlib
import os
from typing import Optional

import numpy as np
import torch
import triton

from ..distributions import draft_log_probs, filtered_logits, log_probs
from ..types import VerifyInputs, VerifyResult
from . import common
from .sample import accept_sample_kernel
from .stats import row_stats_kernel
from .tiled import tiled_partials_kernel

DRAFT_NONE, DRAFT_LOGITS, DRAFT_PROBS = (c.value for c in (common.DRAFT_NONE, common.DRAFT_LOGITS,
                                                          common.DRAFT_PROBS))
MODE_LOGITS, MODE_SIGMOID, MODE_PROBS = (c.value for c in (common.MODE_LOGITS, common.MODE_SIGMOID,
                                                           common.MODE_PROBS))
CHUNK1 = 8192
BLOCK2 = 1024
TILE = 1024
RB = 8
NUM_WARPS1 = 8
NUM_WARPS2 = 4
PROGRAMS_PER_SM = 4

_COUNTERS: dict = {}
_SM_COUNT: dict = {}


def _quiet():
    """Silence NumPy's log(0) warnings when the kernels run in Triton's interpreter (log(0) = -inf is intended)."""
    if os.environ.get("TRITON_INTERPRET") == "1":
        return np.errstate(all="ignore")
    return contextlib.nullcontext()


def _counters(device: torch.device, batch: int) -> torch.Tensor:
    """int32 [>= B] zeros that the kernels leave at zero; grown (never shrunk) per device."""
    key = (device.type, device.index)
    buf = _COUNTERS.get(key)
    if buf is None or buf.numel() < batch:
        buf = torch.zeros(max(batch, 64), dtype=torch.int32, device=device)
        _COUNTERS[key] = buf
    return buf


def _sm_count(device: torch.device) -> int:
    if device.type != "cuda":
        return 4
    key = device.index if device.index is not None else torch.cuda.current_device()
    if key not in _SM_COUNT:
        _SM_COUNT[key] = torch.cuda.get_device_properties(key).multi_processor_count
    return _SM_COUNT[key]


def _rows(t: torch.Tensor) -> torch.Tensor:
    """[B, R, V] with unit stride along V (a copy only if the caller passed a non-contiguous last dimension)."""
    return t if t.stride(-1) == 1 else t.contiguous()


def keep_thresholds(logits: torch.Tensor, inputs: VerifyInputs) -> torch.Tensor:
    """Exact selection pass for top-k / top-p / min-p: per row, the smallest scaled logit that the filters keep.

    Uses :func:`tilespec.verify.distributions.filtered_logits` (the reference semantics: sorts / cumsums a full
    fp32 copy of every row), so the kernels' mask ``z / T >= thr`` keeps exactly the same set (for top-p, tokens
    tied with the last kept one are also kept). Returns float32 [B, R].
    """
    z = filtered_logits(logits, inputs.sampling)
    return z.masked_fill(torch.isneginf(z), float("inf")).amin(dim=-1).contiguous()


def _pass2(inputs: VerifyInputs, mode: int, tgt: torch.Tensor, drf: Optional[torch.Tensor], draft_kind: int, *,
           thr_t=None, thr_q=None, stats=None, tau=None, bpart=None, n_tiles: int = 1, alpha: float = 0.0,
           beta: float = 1.0, method: str, exact: bool) -> VerifyResult:
    batch, k_max, vocab = inputs.batch_size, inputs.max_draft, inputs.vocab_size
    device = tgt.device
    dummy = inputs.sampling.temperature
    tiles_total = triton.cdiv(vocab, BLOCK2)
    per_request = max(1, triton.cdiv(PROGRAMS_PER_SM * _sm_count(device), batch))
    tiles = triton.cdiv(tiles_total, min(per_request, tiles_total))
    nc2 = triton.cdiv(tiles_total, tiles)
    out = torch.empty(batch, k_max + 1, dtype=torch.int64, device=device)
    nacc = torch.empty(batch, dtype=torch.int64, device=device)
    nemit = torch.empty(batch, dtype=torch.int64, device=device)
    accepted = torch.empty(batch, k_max, dtype=torch.bool, device=device)
    pval = torch.empty(batch, nc2, 2, dtype=torch.float32, device=device)
    pidx = torch.empty(batch, nc2, 2, dtype=torch.int32, device=device)
    m, s, a, nc1 = stats if stats is not None else (dummy, dummy, dummy, 1)
    tokens = inputs.draft_tokens if k_max > 0 else inputs.num_draft_tokens
    drf_t = drf if drf is not None else tgt
    with _quiet():
        _launch_pass2(inputs, mode, tgt, drf_t, draft_kind, thr_t, thr_q, m, s, a, nc1, tau, bpart, n_tiles, pval,
                      pidx, out, nacc, nemit, accepted, tokens, nc2, tiles, alpha, beta)
    return VerifyResult(output_tokens=out, num_accepted=nacc, num_emitted=nemit, accepted=accepted,
                        method=method, exact=exact)


def _launch_pass2(inputs, mode, tgt, drf_t, draft_kind, thr_t, thr_q, m, s, a, nc1, tau, bpart, n_tiles, pval, pidx,
                  out, nacc, nemit, accepted, tokens, nc2, tiles, alpha, beta):
    batch, k_max, vocab = inputs.batch_size, inputs.max_draft, inputs.vocab_size
    dummy = inputs.sampling.temperature
    nc1_block = triton.next_power_of_2(max(nc1, n_tiles))
    accept_sample_kernel[(nc2, batch)](
        tgt, drf_t, tokens, inputs.num_draft_tokens, inputs.seeds, inputs.offsets, inputs.sampling.temperature,
        inputs.sampling.lenience, thr_t if thr_t is not None else dummy, thr_q if thr_q is not None else dummy,
        m, s, a, tau if tau is not None else dummy, bpart if bpart is not None else dummy, pval, pidx,
        _counters(tgt.device, batch), out, nacc, nemit, accepted,
        k_max, vocab, nc1, nc2, tiles, n_tiles, tgt.stride(0), tgt.stride(1), drf_t.stride(0), drf_t.stride(1),
        float(alpha), float(beta),
        MODE=mode, DRAFT_KIND=draft_kind, HAS_THR=thr_t is not None, BLOCK=BLOCK2, NC1_BLOCK=nc1_block,
        NC2_BLOCK=triton.next_power_of_2(nc2), RB=RB, num_warps=NUM_WARPS2)


def _draft(inputs: VerifyInputs) -> tuple[Optional[torch.Tensor], int]:
    if inputs.draft_logits is not None:
        return _rows(inputs.draft_logits), DRAFT_LOGITS
    if inputs.draft_probs is not None:
        return _rows(inputs.draft_probs), DRAFT_PROBS
    return None, DRAFT_NONE


def fused_verify(inputs: VerifyInputs) -> VerifyResult:
    """Exact verification from logits: pass 1 (row statistics) + pass 2 (accept, lazy residual, sample)."""
    batch, k_max, vocab = inputs.batch_size, inputs.max_draft, inputs.vocab_size
    tgt = _rows(inputs.target_logits)
    drf, kind = _draft(inputs)
    thr_t = thr_q = None
    if inputs.sampling.has_filters:
        thr_t = keep_thresholds(tgt, inputs)
        if kind == DRAFT_LOGITS and k_max > 0:
            thr_q = keep_thresholds(drf, inputs)
    nc1 = triton.cdiv(vocab, CHUNK1)
    m = torch.empty(batch, 2 * k_max + 1, nc1, dtype=torch.float32, device=tgt.device)
    s = torch.empty_like(m)
    a = torch.empty(m.shape, dtype=torch.int32, device=tgt.device)
    n_rows = k_max + 1 + (k_max if kind == DRAFT_LOGITS else 0)
    drf_t = drf if kind == DRAFT_LOGITS else tgt
    dummy = inputs.sampling.temperature
    with _quiet():
        row_stats_kernel[(nc1, n_rows, batch)](
            tgt, drf_t, inputs.num_draft_tokens, inputs.sampling.temperature,
            thr_t if thr_t is not None else dummy, thr_q if thr_q is not None else dummy, m, s, a,
            k_max, vocab, nc1, tgt.stride(0), tgt.stride(1), drf_t.stride(0), drf_t.stride(1),
            HAS_DRAFT_LOGITS=kind == DRAFT_LOGITS, HAS_THR=thr_t is not None, CHUNK=CHUNK1, num_warps=NUM_WARPS1)
    return _pass2(inputs, MODE_LOGITS, tgt, drf, kind, thr_t=thr_t, thr_q=thr_q, stats=(m, s, a, nc1),
                  method="fused", exact=True)


def sigmoid_verify(inputs: VerifyInputs, alpha: float, beta: float) -> VerifyResult:
    """The paper's NON-EXACT sigmoid approximation, one launch (plus the threshold pass if filters are set)."""
    if not alpha < 0 < beta:
        raise ValueError(f"sigmoid needs alpha < 0 < beta, got alpha={alpha}, beta={beta}")
    if inputs.sampling.any_greedy:
        raise NotImplementedError("method 'sigmoid' does not support greedy requests (temperature 0); greedy "
                                  "verification needs no approximation: use 'fused'")
    tgt = _rows(inputs.target_logits)
    drf, kind = _draft(inputs)
    thr_t = thr_q = None
    if inputs.sampling.has_filters:
        thr_t = keep_thresholds(tgt, inputs)
        if kind == DRAFT_LOGITS and inputs.max_draft > 0:
            thr_q = keep_thresholds(drf, inputs)
    return _pass2(inputs, MODE_SIGMOID, tgt, drf, kind, thr_t=thr_t, thr_q=thr_q, alpha=alpha, beta=beta,
                  method="sigmoid", exact=False)


def tiled_verify(inputs: VerifyInputs) -> VerifyResult:
    """The paper's exact tiled method on probabilities (softmaxes in PyTorch, then 2 launches)."""
    batch, k_max, vocab = inputs.batch_size, inputs.max_draft, inputs.vocab_size
    sampling = inputs.sampling
    p = log_probs(inputs.target_logits, sampling).exp_().contiguous()
    if k_max == 0:
        return _pass2(inputs, MODE_PROBS, p, None, DRAFT_PROBS, method="tiled", exact=True)
    if inputs.draft_probs is not None:
        q = _rows(inputs.draft_probs.float())
    else:
        q = draft_log_probs(inputs.draft_tokens, vocab, sampling, inputs.draft_logits, None).exp_().contiguous()
    n_tiles = triton.cdiv(vocab, TILE)
    tau = torch.empty(batch, k_max, dtype=torch.float32, device=p.device)
    bpart = torch.empty(batch, k_max, n_tiles, dtype=torch.float32, device=p.device)
    with _quiet():
        tiled_partials_kernel[(n_tiles, k_max, batch)](
            p, q, inputs.draft_tokens, inputs.num_draft_tokens, sampling.lenience, tau, bpart, k_max, vocab,
            n_tiles, p.stride(0), p.stride(1), q.stride(0), q.stride(1), TILE=TILE, num_warps=NUM_WARPS2)
    return _pass2(inputs, MODE_PROBS, p, q, DRAFT_PROBS, tau=tau, bpart=bpart, n_tiles=n_tiles,
                  method="tiled", exact=True)
