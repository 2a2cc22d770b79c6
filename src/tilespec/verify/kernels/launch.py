"""Python launch wrappers: ``fused_verify`` (2 launches), ``sigmoid_verify`` (1), ``tiled_verify`` (2 + softmaxes).

``fused`` on large vocabularies (per-request layout): ``stream.row_stats_stream_kernel`` (statistics + acceptance
test in its last program per request) then ``residual.sample_wide_kernel`` (WIDE_TILES tiles of row n per program,
launched as a programmatic dependent of pass 1 where PDL holds), ending with the draw in the last program per
request; direct launches: ``direct``.

No wrapper synchronises with the host, and the hot path issues as few PyTorch ops as possible (every op costs
~5-10 us of host time eagerly): per call, only the four output tensors are allocated (``torch.empty``, no kernel).
Everything that depends only on the shapes - grids, constexprs, kernel choice, the scratch buffers of pass 1 /
pass 2 and the counters of the last-program-done reduction - lives in a :class:`_Plan` cached per (device, B, K, V,
variant). The counters are zero-initialised when the plan is made and reset by the kernel itself, so the fused path
can be captured in a CUDA graph (make the plan outside the capture by calling once before capturing, as any warm-up
does; a plan first made during a capture is used for that call only and not cached). Because the scratch and
counters of a plan are reused by later calls of the same shape, calls of the same shape must not run concurrently
on different CUDA streams (calls on one stream, eager or graph-replayed, are ordered and safe).
Sizes B and K are not specialised on (``do_not_specialize``): changing them never recompiles a kernel; V, the
dtypes and the feature switches (draft kind, filters) select among a few compiled variants.

Layout: when a row fits in one pass-1 chunk / pass-2 tile and ``ROW_ELEMS // block > 1`` (small vocabularies), the
``batched`` kernels process BLOCK_B = ROW_ELEMS // block requests per program; otherwise the per-request kernels run,
one request per program (large vocabularies). The choice depends on V alone (batch invariance); on a GPU the batched
layout is off (ROW_ELEMS = 1); in Triton's CPU interpreter it makes the exactness suite ~500x faster.

Block sizes and the other launch constants are module globals, not settings (tests shrink them to exercise
multi-chunk code on tiny vocabularies): CHUNK1 (pass-1 chunk; fixed per V: batch invariance), BLOCK2 (pass-2 tile),
TILE (tiled's n), ROW_ELEMS (see below). CHUNKS_PER_PROGRAM (0 = by batch size): pass-1 chunks per program in the
per-request layout, grid (ceil(NC / CPP), R, B); the statistics, hence the tokens, are the same bits for every
value, so choosing it by batch size keeps results batch invariant.
"""
from __future__ import annotations

import functools
from typing import Optional

import numpy as np
import torch
import triton

from tilespec.env import triton_interpreted

from ..distributions import draft_log_probs, log_probs
from ..types import VerifyInputs, VerifyResult
from . import common
from .batch_split import per_slices
from .keep import _top_k_thresholds, keep_thresholds, keep_thresholds_pair  # noqa: F401  (tests import them)
from .direct import _capturing, _direct_key, _launcher  # noqa: F401  (tests use launch._launcher)
from .residual import sample_wide_kernel
from .sample import accept_sample_kernel, accept_sample_rows_kernel
from .stats import row_stats_rows_kernel
from .stream import row_stats_stream_kernel
from .tiled import tiled_partials_kernel, tiled_partials_rows_kernel

DRAFT_NONE, DRAFT_LOGITS, DRAFT_PROBS = (c.value for c in (common.DRAFT_NONE, common.DRAFT_LOGITS,
                                                          common.DRAFT_PROBS))
MODE_LOGITS, MODE_SIGMOID, MODE_PROBS = (c.value for c in (common.MODE_LOGITS, common.MODE_SIGMOID,
                                                           common.MODE_PROBS))
CHUNK1 = 8192
BLOCK2 = 1024             # pass-2 tile = the inverse-CDF tile of rng.SAMPLE_TILE (other values: same law)
TILE = 1024
RB = 8
NUM_WARPS1 = 8
NUM_WARPS2 = 4
PROGRAMS_PER_SM = 4
# fused pass 1 (per-request layout): contiguous CHUNK1 chunks per program (grid (ceil(NC / CPP), R, B)), sharing one
# program's scalar loads and tail atomic; 1 = one chunk per program. The statistics are the same bits for every
# value (same per-chunk arithmetic), so tokens do not depend on it. 0 = auto: CPP_AUTO from CPP_AUTO_MIN_BATCH
# requests up, else 1.
CHUNKS_PER_PROGRAM = 0
CPP_AUTO, CPP_AUTO_MIN_BATCH = 2, 16
# fused pass 1 of the per-request layout, stream.row_stats_stream_kernel: lanes of GROUP1 contiguous ids over slices
# of SUB1_STREAM ids (NUM_WARPS1_STREAM warps; the lane layout never depends on B: batch invariance), PREFETCH1
# slices loaded ahead (no bits change), at most MAXNREG1 registers per thread (register allocation only: no bits
# change).
SUB1_STREAM = 2048
NUM_WARPS1_STREAM = 8
GROUP1 = 8
PREFETCH1 = 2
MAXNREG1 = 40
# fused pass 2 of the per-request layout, residual.sample_wide_kernel: WIDE_TILES BLOCK2 tiles of row n per program in
# one block, linear weights. FAST_EXP: ex2.approx.ftz in both passes; PDL: pass 2 launched as a programmatic
# dependent of pass 1 (compute capability >= 9 and a Triton with launch_pdl). GPU only; neither moves a token beyond
# fp32 rounding. Rows that allow 16-byte loads (see _aligned) take the ALIGNED variants of both passes.
WIDE_TILES = 4
NUM_WARPS2_WIDE = 8
_INTERPRET = triton_interpreted()
FAST_EXP = not _INTERPRET
PDL = not _INTERPRET
# Requests batched per program = ROW_ELEMS // block (at most MAX_BLOCK_B): large blocks in the interpreter (few,
# large NumPy ops); 1 = per-request kernels (GPUs).
ROW_ELEMS = 1 << 20 if _INTERPRET else 1
MAX_BLOCK_B = 65536 if _INTERPRET else 1024
PLAN_LIMIT = 512          # plans cached per process; later shapes are planned per call (still correct)
_PLANS: dict = {}
_SM_COUNT: dict = {}


def _quiet(fn):
    """Decorator: silence NumPy's log(0) warnings in Triton's interpreter (-inf is intended); a no-op on GPUs."""
    if not _INTERPRET:
        return fn

    @functools.wraps(fn)
    def quiet(*args, **kwargs):
        with np.errstate(all="ignore"):
            return fn(*args, **kwargs)
    return quiet


def _sm_count(device: torch.device) -> int:
    if device.type != "cuda":
        return 4
    key = device.index if device.index is not None else torch.cuda.current_device()
    if key not in _SM_COUNT:
        _SM_COUNT[key] = torch.cuda.get_device_properties(key).multi_processor_count
    return _SM_COUNT[key]


def _pdl(device: torch.device) -> bool:
    """Whether pass 2 is launched as a programmatic dependent of pass 1 on ``device`` (see PDL)."""
    return PDL and device.type == "cuda" and common.pdl_capable(device)


def _rows(t: torch.Tensor) -> torch.Tensor:
    """[B, R, V] with unit stride along V (a copy only if the caller passed a non-contiguous last dimension)."""
    return t if t.stride(-1) == 1 else t.contiguous()


def _block(limit: int, vocab: int, batch: int) -> tuple[int, int, int]:
    """(block width, number of blocks per row, requests per program) for a row of ``vocab`` ids in blocks of at most
    ``limit``: requests are batched only when the whole row fits in one block. On a GPU this depends on V (and the
    globals) only, because the compiled layout - hence the order of a row's float reductions - depends on the block
    shape, and a request's result must not depend on its batch. The interpreter reduces every row of a block with
    the same NumPy loop whatever the block's height, so there it is also capped by the batch (no empty lanes)."""
    width = min(limit, triton.next_power_of_2(vocab))
    blocks = triton.cdiv(vocab, width)
    rows = 1 if blocks > 1 else max(1, min(MAX_BLOCK_B, ROW_ELEMS // width))
    if _INTERPRET:
        rows = min(rows, triton.next_power_of_2(batch))
    return width, blocks, rows


class _Plan:
    """Shape-dependent launch state of one (device, B, K, V, variant): kernel choice, grids, constexprs, scratch,
    counters, and the compiled kernels found for it (``direct``, see :class:`_Launcher`)."""

    __slots__ = ("kernel1", "const1a", "const2a",   # pass-1 kernel name; ALIGNED variants of const1 / const2
                 "rows1", "grid1", "const1", "nc1", "m", "s", "a", "rows2", "grid2", "const2", "nc2", "tiles", "tsum",
                 "counters", "rows_t", "grid_t", "const_t", "n_tiles", "tau", "bpart", "direct", "split", "nrow",
                 "lse", "cnt1")


def _plan(device: torch.device, batch: int, k_max: int, vocab: int, mode: int, kind: int, has_thr: bool,
          stats: bool) -> _Plan:
    key = (device, batch, k_max, vocab, mode, kind, has_thr, stats, CHUNK1, BLOCK2, TILE, RB, ROW_ELEMS,
           MAX_BLOCK_B, NUM_WARPS1, NUM_WARPS2, PROGRAMS_PER_SM, CHUNKS_PER_PROGRAM, CPP_AUTO, CPP_AUTO_MIN_BATCH,
           SUB1_STREAM, NUM_WARPS1_STREAM, PREFETCH1, MAXNREG1, GROUP1, WIDE_TILES, NUM_WARPS2_WIDE, FAST_EXP, PDL)
    if key in _PLANS:
        return _PLANS[key]
    plan = _make_plan(device, batch, k_max, vocab, mode, kind, has_thr, stats)
    if len(_PLANS) < PLAN_LIMIT and not _capturing(device):
        plan.direct = {}
        _PLANS[key] = plan  # never evicted: a captured CUDA graph may hold its buffers' addresses
    return plan


def _make_plan(device, batch, k_max, vocab, mode, kind, has_thr, stats) -> _Plan:
    """Grids are 3-tuples (a compiled kernel's launcher, unlike the JIT dispatcher, does not pad them)."""
    p = _Plan()
    p.direct = None          # no direct launches for plans that are not cached
    f32 = dict(dtype=torch.float32, device=device)
    p.nc1, p.n_tiles, p.m, p.s, p.a, p.tau, p.bpart = 1, 1, None, None, None, None, None
    p.split, p.nrow, p.lse, p.cnt1 = False, None, None, None
    p.kernel1, p.const1a, p.const2a = None, None, None
    if stats:  # fused pass 1
        chunk, p.nc1, bb1 = _block(CHUNK1, vocab, batch)
        p.rows1 = bb1 > 1
        n_rows = k_max + 1 + (k_max if kind == DRAFT_LOGITS else 0)
        p.grid1 = (p.nc1, n_rows, triton.cdiv(batch, bb1))
        p.const1 = dict(DRAFT_KIND=kind, HAS_THR=has_thr, CHUNK=chunk, num_warps=NUM_WARPS1)
        if p.rows1:
            p.const1["BLOCK_B"] = bb1
            p.kernel1 = "rows"
        else:   # per-request layout: pass 1's tail runs the acceptance test, pass 2 is sample_wide_kernel
            p.split = True
            cpp = _per_program(CHUNKS_PER_PROGRAM, CPP_AUTO, CPP_AUTO_MIN_BATCH, p.nc1, batch)
            p.grid1 = (triton.cdiv(p.nc1, cpp), *p.grid1[1:])
            p.const1.update(NC_BLOCK=triton.next_power_of_2(p.nc1), RB=RB, CPP=cpp)
            p.kernel1 = "stream"
            sub = min(SUB1_STREAM, chunk)   # rows of V < 8 ids: lane groups no wider than the slice
            p.const1.update(SUB=sub, PREFETCH=PREFETCH1, ALIGNED=False, num_warps=NUM_WARPS1_STREAM,
                            GROUP=min(GROUP1, sub), FAST=FAST_EXP, PDL=_pdl(device))
            if MAXNREG1 > 0 and not _INTERPRET:   # 0: no cap
                p.const1["maxnreg"] = MAXNREG1
            p.const1a = dict(p.const1, ALIGNED=True)   # for calls whose rows allow 16-byte loads
            p.nrow = torch.empty(batch, dtype=torch.int32, device=device)
            p.lse = torch.empty(batch, 2, **f32)
            p.cnt1 = torch.zeros(batch, dtype=torch.int32, device=device)
        shape = (batch, 2 * k_max + 1, p.nc1)
        p.m, p.s = torch.empty(shape, **f32), torch.empty(shape, **f32)
        p.a = torch.empty(shape, dtype=torch.int32, device=device)
    if mode == MODE_PROBS:  # tiled pass 1 (pass 2 reads tau / b_k; with K = 0 it never does: 1-element buffers)
        tile, n_tiles, bbt = _block(TILE, vocab, batch)
        p.rows_t = bbt > 1
        p.grid_t = (n_tiles, k_max, triton.cdiv(batch, bbt))
        p.const_t = dict(TILE=tile, num_warps=NUM_WARPS2)
        if p.rows_t:
            p.const_t["BLOCK_B"] = bbt
        p.n_tiles = n_tiles       # also for K = 0 (never read then): pass 2's constexprs must not depend on K
        p.tau = torch.empty(max(1, batch * k_max), **f32)
        p.bpart = torch.empty(max(1, batch * k_max * p.n_tiles), **f32)
    block, tiles_total, bb2 = _block(BLOCK2, vocab, batch)
    p.rows2 = bb2 > 1
    if p.rows2:   # one program per request row: no per-tile masses, no cross-program reduction
        p.tiles, p.nc2 = 1, 1
    elif p.split:   # fused: WIDE_TILES tiles of row n per program
        p.tiles = min(WIDE_TILES, triton.next_power_of_2(tiles_total))
    else:
        per_request = max(1, triton.cdiv(PROGRAMS_PER_SM * _sm_count(device), batch))
        p.tiles = triton.cdiv(tiles_total, min(per_request, tiles_total))
    p.nc2 = triton.cdiv(tiles_total, p.tiles) if not p.rows2 else 1
    p.grid2 = (p.nc2, triton.cdiv(batch, bb2), 1)
    p.tsum = p.counters = None
    if not p.rows2:
        p.counters = torch.zeros(batch, dtype=torch.int32, device=device)
        p.tsum = torch.empty(batch, p.nc2 * p.tiles if not p.split else tiles_total, 2, **f32)   # (residual, p)
    if p.split:
        p.const2 = dict(DRAFT_KIND=kind, HAS_THR=has_thr, BLOCK=block, TILES=p.tiles,
                        NT_BLOCK=triton.next_power_of_2(tiles_total), ALIGNED=False, FAST=FAST_EXP,
                        PDL=_pdl(device), num_warps=NUM_WARPS2_WIDE)
        if p.const2["PDL"]:
            p.const2["launch_pdl"] = True
        p.const2a = dict(p.const2, ALIGNED=True)
        return p
    p.const2 = dict(MODE=mode, DRAFT_KIND=kind, HAS_THR=has_thr, BLOCK=block,
                    NC1_BLOCK=triton.next_power_of_2(max(p.nc1, p.n_tiles)),
                    NT2_BLOCK=triton.next_power_of_2(p.nc2 * p.tiles), RB=RB, num_warps=NUM_WARPS2)
    if p.rows2:
        p.const2.update(BLOCK_B=bb2, WB=8)
    return p


def _per_program(value: int, auto: int, auto_min_batch: int, total: int, batch: int) -> int:
    """Pass-1 chunks per program (CHUNKS_PER_PROGRAM): ``value``, or with 0 ``auto`` from ``auto_min_batch``
    requests up (else 1), at most the row's ``total`` (no program of skipped work). It moves no bits (same per-chunk
    arithmetic), so a batch-dependent choice keeps tokens batch invariant."""
    return max(1, min(value or (auto if batch >= auto_min_batch else 1), total))


def _outputs(batch: int, k_max: int, device: torch.device) -> tuple:
    """The four output tensors (``torch.empty``: the only ATen ops of a hot-loop call)."""
    return (torch.empty(batch, k_max + 1, dtype=torch.int64, device=device),
            torch.empty(batch, dtype=torch.int64, device=device), torch.empty(batch, dtype=torch.int64, device=device),
            torch.empty(batch, k_max, dtype=torch.bool, device=device))


def _result(outs: tuple, method: str, exact: bool) -> VerifyResult:
    out, nacc, nemit, accepted = outs
    return VerifyResult(output_tokens=out, num_accepted=nacc, num_emitted=nemit, accepted=accepted, method=method,
                        exact=exact)


def _pass2(inputs: VerifyInputs, plan: _Plan, mode: int, tgt: torch.Tensor, drf: Optional[torch.Tensor],
           draft_kind: int, thr_t, thr_q, alpha: float, beta: float, method: str, exact: bool,
           outs: Optional[tuple] = None) -> VerifyResult:
    batch, k_max = tgt.shape[0], tgt.shape[1] - 1
    device = tgt.device
    outs = outs if outs is not None else _outputs(batch, k_max, device)
    sampling = inputs.sampling
    drf_t = drf if drf is not None else tgt
    tokens = inputs.draft_tokens if k_max > 0 else inputs.num_draft_tokens
    user = (tgt, drf_t, tokens, inputs.num_draft_tokens, inputs.seeds, inputs.offsets, sampling.temperature,
            sampling.lenience)
    strides = (tgt.stride(0), tgt.stride(1), drf_t.stride(0), drf_t.stride(1))
    dummy = sampling.temperature   # for buffers this variant never reads
    if plan.split:   # fused, per-request layout: row n and its log-sum-exps come from pass 1's tail
        key, const2 = _direct_key(plan, device, user, strides), plan.const2
        if _aligned(tgt, drf_t, strides, tgt.shape[2]):
            key, const2 = key and (*key, "aligned"), plan.const2a
        n_tiles = plan.tsum.shape[1]
        _launcher(sample_wide_kernel)(
            plan, plan.grid2, (*user, _or(thr_t, dummy), _or(thr_q, dummy), plan.nrow, plan.lse, plan.tsum,
                               plan.counters, *outs, k_max, tgt.shape[2], n_tiles, *strides), const2, key)
        return _result(outs, method, exact)
    sizes = (k_max, tgt.shape[2], plan.nc1, plan.nc2, plan.tiles, plan.n_tiles)
    key = _direct_key(plan, device, user, strides)
    kernel = accept_sample_rows_kernel if plan.rows2 else accept_sample_kernel
    _launcher(kernel)(
        plan, plan.grid2, (*user, *(_or(t, dummy) for t in (thr_t, thr_q, plan.m, plan.s, plan.a, plan.tau,
                                                              plan.bpart, plan.tsum, plan.counters)),
                           *outs, batch, *sizes, *strides, alpha, beta), plan.const2, key)
    return _result(outs, method, exact)


def _aligned(tgt: torch.Tensor, drf: torch.Tensor, strides: tuple, vocab: int) -> bool:
    """Whether every logits row starts 16-byte aligned and V and the strides are multiples of 8 elements (the
    kernels' ALIGNED constexpr: 16-byte vector loads; masks constant over 8-id groups). Host-side values only."""
    return (((tgt.data_ptr() | drf.data_ptr()) & 15) == 0 and vocab % 8 == 0
            and all(x % 8 == 0 for x in strides))


def _or(tensor, dummy):  # kernels take a (never read) dummy tensor for unused buffers
    return tensor if tensor is not None else dummy


def _draft(inputs: VerifyInputs) -> tuple[Optional[torch.Tensor], int]:
    if inputs.draft_logits is not None:
        return _rows(inputs.draft_logits), DRAFT_LOGITS
    if inputs.draft_probs is not None:
        return _rows(inputs.draft_probs), DRAFT_PROBS
    return None, DRAFT_NONE


def _thresholds(inputs: VerifyInputs, tgt: torch.Tensor, drf: Optional[torch.Tensor], kind: int):
    if not inputs.sampling.has_filters:
        return None, None
    return keep_thresholds_pair(tgt, drf if kind == DRAFT_LOGITS and tgt.shape[1] > 1 else None, inputs)


@per_slices
@_quiet
def fused_verify(inputs: VerifyInputs) -> VerifyResult:
    """Exact verification from logits: pass 1 (row statistics) + pass 2 (accept, lazy residual, sample). In the
    per-request layout pass 1's last program per request also runs the acceptance test (``stats._accept_tail``)
    and pass 2 is ``sample_wide_kernel``; in the batched layout pass 2 (``accept_sample_rows_kernel``) does both."""
    tgt = _rows(inputs.target_logits)
    batch, rows, vocab = tgt.shape
    drf, kind = _draft(inputs)
    thr_t, thr_q = _thresholds(inputs, tgt, drf, kind)
    plan = _plan(tgt.device, batch, rows - 1, vocab, MODE_LOGITS, kind, thr_t is not None, True)
    sampling = inputs.sampling
    temp = sampling.temperature
    drf_t = drf if drf is not None else tgt
    strides = (tgt.stride(0), tgt.stride(1), drf_t.stride(0), drf_t.stride(1))
    tokens = inputs.draft_tokens if rows > 1 else inputs.num_draft_tokens
    user = (tgt, drf_t, tokens, inputs.num_draft_tokens, inputs.seeds, inputs.offsets, temp, sampling.lenience)
    outs = _outputs(batch, rows - 1, tgt.device)
    key, const1 = _direct_key(plan, tgt.device, user, strides), plan.const1
    if plan.const1a is not None and _aligned(tgt, drf_t, strides, vocab):
        const1 = plan.const1a
        key = key and (*key, "aligned")
    kernel = {"rows": row_stats_rows_kernel, "stream": row_stats_stream_kernel}
    _launcher(kernel[plan.kernel1])(plan, plan.grid1, (tgt, drf_t, inputs.num_draft_tokens, temp, _or(thr_t, temp),
                                               _or(thr_q, temp), plan.m, plan.s, plan.a, batch, rows - 1, vocab,
                                               plan.nc1, *strides, tokens, inputs.seeds, inputs.offsets,
                                               sampling.lenience,
                                               *(_or(t, temp) for t in (plan.nrow, plan.lse, plan.cnt1)), *outs),
                            const1, key)
    return _pass2(inputs, plan, MODE_LOGITS, tgt, drf, kind, thr_t, thr_q, 0.0, 1.0, "fused", True, outs)


@per_slices
@_quiet
def sigmoid_verify(inputs: VerifyInputs, alpha: float, beta: float) -> VerifyResult:
    """The paper's NON-EXACT sigmoid approximation, one launch (plus the threshold pass if filters are set)."""
    if not alpha < 0 < beta:
        raise ValueError(f"sigmoid needs alpha < 0 < beta, got alpha={alpha}, beta={beta}")
    if inputs.sampling.any_greedy:
        raise NotImplementedError("method 'sigmoid' does not support greedy requests (temperature 0); greedy "
                                  "verification needs no approximation: use 'fused'")
    tgt = _rows(inputs.target_logits)
    batch, rows, vocab = tgt.shape
    drf, kind = _draft(inputs)
    thr_t, thr_q = _thresholds(inputs, tgt, drf, kind)
    plan = _plan(tgt.device, batch, rows - 1, vocab, MODE_SIGMOID, kind, thr_t is not None, False)
    return _pass2(inputs, plan, MODE_SIGMOID, tgt, drf, kind, thr_t, thr_q, float(alpha), float(beta), "sigmoid",
                  False)


@per_slices
@_quiet
def tiled_verify(inputs: VerifyInputs) -> VerifyResult:
    """The paper's exact tiled method on probabilities (softmaxes in PyTorch, then 2 launches)."""
    batch, k_max, vocab = inputs.batch_size, inputs.max_draft, inputs.vocab_size
    sampling = inputs.sampling
    p = log_probs(inputs.target_logits, sampling).exp_().contiguous()
    plan = _plan(p.device, batch, k_max, vocab, MODE_PROBS, DRAFT_PROBS, False, False)
    if k_max == 0:
        return _pass2(inputs, plan, MODE_PROBS, p, None, DRAFT_PROBS, None, None, 0.0, 1.0, "tiled", True)
    if inputs.draft_probs is not None:
        q = _rows(inputs.draft_probs.float())
    else:
        q = draft_log_probs(inputs.draft_tokens, vocab, sampling, inputs.draft_logits, None).exp_().contiguous()
    strides = (p.stride(0), p.stride(1), q.stride(0), q.stride(1))
    key = _direct_key(plan, p.device, (p, q, inputs.draft_tokens, inputs.num_draft_tokens, sampling.lenience),
                      strides)
    head = (p, q, inputs.draft_tokens, inputs.num_draft_tokens, sampling.lenience, plan.tau, plan.bpart)
    kernel = tiled_partials_rows_kernel if plan.rows_t else tiled_partials_kernel
    _launcher(kernel)(plan, plan.grid_t, (*head, batch, k_max, vocab, plan.n_tiles, *strides), plan.const_t, key)
    return _pass2(inputs, plan, MODE_PROBS, p, q, DRAFT_PROBS, None, None, 0.0, 1.0, "tiled", True)
