"""Pass 1 of ``tiled``: the seed paper's exact kernel (Wagner et al. 2024, Sec. 3.2.1, Fig. 1), for any batch size.

Inputs are probabilities: p [B, K+1, V] (target) and q [B, K, V] (draft), fp32. For draft row i of request b and
tile k (n = TILE vocabulary ids), held in registers ("SRAM"), it computes elementwise f = p - l q, a = max(0, f),
the tile's partial residual mass b_k = sum a, and - in the one tile that holds the drafted token x_i -
tau = min(1, p(x_i) / (l q(x_i))) (tau = -1, i.e. reject, where q(x_i) = 0). Only tau [B, K] and b_k [B, K, NT]
are written; a is recomputed for the one row that is resampled (pass 2, ``sample`` in MODE_PROBS), which also
aggregates b = sum_k b_k to detect a zero residual. Rows i >= K_b are skipped. This kernel, like the paper's,
does residual work for every draft row.

Two layouts with the same arithmetic (``common``): ``tiled_partials_kernel``, grid (NT, K, B), one request per
program; ``tiled_partials_rows_kernel``, grid (NT, K, ceil(B / BLOCK_B)), a [BLOCK_B, TILE] block of BLOCK_B
requests per program (small vocabularies: NT = 1). Both take the same arguments (B, the batch size, bounds the
batched layout's request blocks).
"""
from __future__ import annotations

import triton
import triton.language as tl

from .common import tau_at


@triton.jit(do_not_specialize=["B", "K", "V", "NT", "stride_pb", "stride_pr", "stride_qb", "stride_qr"])
def tiled_partials_kernel(p_ptr, q_ptr, tok_ptr, nd_ptr, len_ptr, tau_ptr, bpart_ptr,
                          B, K, V, NT, stride_pb, stride_pr, stride_qb, stride_qr, TILE: tl.constexpr):
    k = tl.program_id(0)
    i = tl.program_id(1)
    b = tl.program_id(2)
    if i < tl.load(nd_ptr + b):
        lenience = tl.load(len_ptr + b)
        offs = k * TILE + tl.arange(0, TILE)
        mask = offs < V
        b64 = b.to(tl.int64)
        p = tl.load(p_ptr + b64 * stride_pb + i * stride_pr + offs, mask=mask, other=0.0).to(tl.float32)
        q = tl.load(q_ptr + b64 * stride_qb + i * stride_qr + offs, mask=mask, other=0.0).to(tl.float32)
        a = tl.maximum(p - lenience * q, 0.0)
        tl.store(bpart_ptr + (b * K + i) * NT + k, tl.sum(a, axis=0))
        x = tl.load(tok_ptr + b * K + i).to(tl.int32)
        if (x >= k * TILE) & (x < (k + 1) * TILE):
            tau = tau_at(p, q, x, offs, lenience)
            tl.store(tau_ptr + b * K + i, tau)


@triton.jit(do_not_specialize=["B", "K", "V", "NT", "stride_pb", "stride_pr", "stride_qb", "stride_qr"])
def tiled_partials_rows_kernel(p_ptr, q_ptr, tok_ptr, nd_ptr, len_ptr, tau_ptr, bpart_ptr,
                               B, K, V, NT, stride_pb, stride_pr, stride_qb, stride_qr, TILE: tl.constexpr,
                               BLOCK_B: tl.constexpr):
    k = tl.program_id(0)
    i = tl.program_id(1)
    req = tl.program_id(2) * BLOCK_B + tl.arange(0, BLOCK_B)
    live = req < B
    active = live & (i < tl.load(nd_ptr + req, mask=live, other=0))
    if tl.max(active.to(tl.int32), axis=0) > 0:
        lenience = tl.load(len_ptr + req, mask=active, other=1.0)
        offs = k * TILE + tl.arange(0, TILE)
        mask = active[:, None] & (offs < V)[None, :]
        req64 = req.to(tl.int64)
        p = tl.load(p_ptr + (req64 * stride_pb + i * stride_pr)[:, None] + offs[None, :], mask=mask,
                    other=0.0).to(tl.float32)
        q = tl.load(q_ptr + (req64 * stride_qb + i * stride_qr)[:, None] + offs[None, :], mask=mask,
                    other=0.0).to(tl.float32)
        a = tl.maximum(p - lenience[:, None] * q, 0.0)
        tl.store(bpart_ptr + (req * K + i) * NT + k, tl.sum(a, axis=1), mask=active)
        x = tl.load(tok_ptr + req * K + i, mask=active, other=-1).to(tl.int32)
        inside = active & (x >= k * TILE) & (x < (k + 1) * TILE)
        if tl.max(inside.to(tl.int32), axis=0) > 0:
            tl.store(tau_ptr + req * K + i, tau_at(p, q, x, offs[None, :], lenience), mask=inside)
