"""Pass 1 of ``tiled``: the seed paper's exact kernel (Wagner et al. 2024, Sec. 3.2.1, Fig. 1), for any batch size.

Inputs are probabilities: p [B, K+1, V] (target) and q [B, K, V] (draft), fp32. Grid (NT, K, B): program (k, i, b)
loads tile k (n = TILE vocabulary ids) of rows p_i and q_i of request b into registers ("SRAM") and computes
elementwise f = p - l q, a = max(0, f), the tile's partial residual mass b_k = sum a, and - in the one tile that
holds the drafted token x_i - tau = min(1, p(x_i) / (l q(x_i))) (tau = -1, i.e. reject, where q(x_i) = 0).
Only tau [B, K] and b_k [B, K, NT] are written; a is recomputed for the one row that is resampled (pass 2,
``sample.accept_sample_kernel`` in MODE_PROBS), which also aggregates b = sum_k b_k to detect a zero residual.
Rows i >= K_b are skipped. This kernel, like the paper's, does residual work for every draft row.
"""
from __future__ import annotations

from . import common  # noqa: F401  (interpreter setup)

import triton
import triton.language as tl


@triton.jit(do_not_specialize=["K", "V", "NT", "stride_pb", "stride_pr", "stride_qb", "stride_qr"])
def tiled_partials_kernel(p_ptr, q_ptr, tok_ptr, nd_ptr, len_ptr, tau_ptr, bpart_ptr,
                          K, V, NT, stride_pb, stride_pr, stride_qb, stride_qr, TILE: tl.constexpr):
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
        f = p - lenience * q
        a = tl.maximum(f, 0.0)
        tl.store(bpart_ptr + (b * K + i) * NT + k, tl.sum(a, axis=0))
        x = tl.load(tok_ptr + b * K + i).to(tl.int32)
        if (x >= k * TILE) & (x < (k + 1) * TILE):
            hit = offs == x
            p_x = tl.sum(tl.where(hit, p, 0.0), axis=0)
            q_x = tl.sum(tl.where(hit, q, 0.0), axis=0)
            tau = tl.where(q_x > 0.0, tl.minimum(1.0, p_x / (lenience * q_x)), -1.0)
            tl.store(tau_ptr + b * K + i, tau)
