"""Attention of a step's new tokens over a paged K/V cache: a split-KV Triton kernel (CUDA, or Triton's interpreter)
and its PyTorch reference.

Layout: ``q`` [T, H, D] holds the new tokens of S sequences back to back, sequence s owning rows
cu_q[s]:cu_q[s+1] (n_s >= 0 of them; 0 for a padding sequence). ``k_cache`` / ``v_cache`` [num_blocks, block_size,
H_kv, D] already hold the step's new K/V; ``block_tables`` [S, max_blocks] int32 maps a sequence's i-th block of
positions [i*bs, (i+1)*bs) to a physical block (entries past kv_lens are never read). ``kv_lens`` [S] int32 is a
sequence's length after the step: its query j sits at position kv_lens[s] - n_s + j and attends causally to keys
[0, that position]. H = G * H_kv (GQA). Output [T, H, D] in q's dtype: softmax(q k^T * scale) v with fp32 math;
rows outside cu_q[0]:cu_q[S] are zeros from the reference and left unwritten by the kernel.

Token trees (``tree_mask`` [T] int64, optional): a sequence's new tokens may be a draft tree's nodes (node m at key
kv_lens[s] - n_s + m, parents first); a row's bit m set = it sees new token m (its ancestors, itself), on top of the
causal rule, so a chain row's mask is -1 and new tokens past the 64th (a prefill chunk) are causal only: trees have
at most 64 nodes. RoPE positions (depths) are the caller's. No mask: the kernel compiles without the test.

Kernel: a tile is up to BLOCK_M consecutive tokens of one sequence x the G heads of one KV head (BLOCK_M * G_pow2
rows against BLOCK_N keys per ``tl.dot``, K/V read once per group); tiles are packed over sequences (a program maps
its tile id to (sequence, tile) from cu_q on the device), so the grid (tiles, H_kv, splits) depends on host ints
only: no host sync, CUDA-graph safe. Each tile's keys [0, last position] are cut into ``splits`` even pieces
(flash decoding, so B = 1 decode over 2k keys still fills the GPU) whose online-softmax partials a second kernel
merges; one split writes the output directly. Requirements of the kernel: block_size a power of two, D <= 256.

Compiled variants: Triton compiles a kernel once per distinct set of constexprs and of specialised arguments (an int
equal to 1 or divisible by 16 is one). The sequence count, split count and block-table stride vary every step, so
they are not specialised; the sequence loop's width SP and the merge's split width take a few fixed values; what is
left, :func:`launch_key` (tile rows, SP, one split or more), is a small set that :func:`variants` lists and the
engine's warm-up compiles (:func:`warm_variants`), so no served step waits for a compile.
"""
from __future__ import annotations

import math
import warnings
from typing import Optional

import torch

from tilespec.env import triton_available, triton_interpreted, use_triton_interpreter_without_cuda

from .attention_reference import attention_rows, paged_attention_reference  # noqa: F401 - attention's API
from .attention_reference import check_inputs as _check, check_tree_mask

BLOCK_N = 64        # keys per inner step
MAX_ROWS = 128      # rows (tokens x padded group heads) per tile
MERGE_ROWS = 32     # rows per program of the merge
MIN_SPLIT_KEYS = 128  # a split covers at least this many keys of the cache's capacity
MAX_SPLITS = 64
SPLIT_WIDTH = 64    # the merge's split lanes (a power of two >= MAX_SPLITS: one compiled merge for every split count)
SPLITS = None       # force the number of KV splits (tests, benchmarks); None: splits_for(...)
_KERNEL_FAILED: list = []   # the first failure of the kernels, if any (they are not tried again)

_TRITON = triton_available()
if _TRITON:
    use_triton_interpreter_without_cuda()   # before triton is imported (CPU runs use the interpreter)
    import triton
    import triton.language as tl

    @triton.jit
    def _tile_of(pid, cu_ptr, S, BLOCK_M: tl.constexpr, SP: tl.constexpr):
        """Packed tile ``pid`` -> (sequence s, its tile t, live): sequence s has ceil(n_s / BLOCK_M) tiles."""
        rs = tl.arange(0, SP)
        lo = tl.load(cu_ptr + rs, mask=rs < S, other=0)
        hi = tl.load(cu_ptr + rs + 1, mask=rs < S, other=0)
        cnt = (hi - lo + BLOCK_M - 1) // BLOCK_M
        s = tl.sum((tl.cumsum(cnt, axis=0) <= pid).to(tl.int32), axis=0)
        t = pid - tl.sum(tl.where(rs < s, cnt, 0), axis=0)
        return tl.minimum(s, S - 1), t, s < S

    @triton.jit(do_not_specialize=["S", "NS", "sbt"])
    def _partial_kernel(q_ptr, k_ptr, v_ptr, bt_ptr, cu_ptr, len_ptr, tm_ptr, o_ptr, pm_ptr, pl_ptr, pacc_ptr,
                        S, H, NS, qk_scale, sqt, sqh, skb, sks, skh, svb, svs, svh, sbt,
                        G: tl.constexpr, GP: tl.constexpr, D: tl.constexpr, DP: tl.constexpr, BS: tl.constexpr,
                        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, SP: tl.constexpr, SINGLE: tl.constexpr,
                        F32DOT: tl.constexpr, TREE: tl.constexpr = False):
        """Program (tile, j, split): rows r = m * GP + g (token t * BLOCK_M + m of the sequence, head j * G + g)
        over the split's keys. SINGLE: writes the normalised output; else the row max pm (log2 units), sum pl and
        unnormalised P @ V pacc (fp32) at slot (tile * H_kv + j) * NS + split. F32DOT: 0 the inputs' dot, 1 an
        fp32 one, 2 fp32 sums of products (batch-invariant runs in the interpreter). TREE: tm_ptr's masks too."""
        pid = tl.program_id(0)
        j = tl.program_id(1)
        sp = tl.program_id(2)
        s, t, live = _tile_of(pid, cu_ptr, S, BLOCK_M, SP)
        q0 = tl.load(cu_ptr + s)
        n = tl.load(cu_ptr + s + 1) - q0
        kv_len = tl.load(len_ptr + s)
        r = tl.arange(0, BLOCK_M * GP)
        i = t * BLOCK_M + r // GP
        g = r % GP
        row_ok = (i < tl.where(live, n, 0)) & (g < G)
        pos = kv_len - n + i                                    # each row attends to keys [0, pos]
        rd = tl.arange(0, DP)
        d_ok = rd < D
        kv_end = kv_len - n + tl.minimum(n, (t + 1) * BLOCK_M)  # keys the tile needs
        per = ((kv_end + BLOCK_N - 1) // BLOCK_N + NS - 1) // NS * BLOCK_N   # keys per split, whole steps
        lo = sp * per
        hi = tl.where(live, tl.minimum(lo + per, kv_end), lo)
        qv = tl.load(q_ptr + (q0 + i)[:, None].to(tl.int64) * sqt + (j * G + g)[:, None] * sqh + rd[None, :],
                     mask=row_ok[:, None] & d_ok[None, :], other=0.0)
        if F32DOT:
            qv = qv.to(tl.float32)
        if TREE:
            tm = tl.load(tm_ptr + (q0 + i).to(tl.int64), mask=row_ok, other=-1)
        m_i = tl.full([BLOCK_M * GP], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_M * GP], tl.float32)
        acc = tl.zeros([BLOCK_M * GP, DP], tl.float32)
        for n0 in range(lo, hi, BLOCK_N):
            kp = n0 + tl.arange(0, BLOCK_N)
            k_ok = kp < hi
            blk = tl.load(bt_ptr + s.to(tl.int64) * sbt + kp // BS, mask=k_ok, other=0).to(tl.int64)
            kmask = k_ok[:, None] & d_ok[None, :]
            kt = tl.load(k_ptr + (blk * skb + (kp % BS) * sks + j * skh)[:, None] + rd[None, :], mask=kmask,
                         other=0.0)
            vt = tl.load(v_ptr + (blk * svb + (kp % BS) * svs + j * svh)[:, None] + rd[None, :], mask=kmask,
                         other=0.0)
            if F32DOT == 2:     # the interpreter's dot (numpy's BLAS) varies with a row's place in the tile
                sc = tl.sum(qv[:, None, :] * kt.to(tl.float32)[None, :, :], axis=2)
            elif F32DOT:
                sc = tl.dot(qv, tl.trans(kt.to(tl.float32)), input_precision="ieee")
            else:
                sc = tl.dot(qv, tl.trans(kt))
            seen = k_ok[None, :] & (kp[None, :] <= pos[:, None])
            if TREE:        # new token rel of the sequence: seen when bit rel of the row's mask is set
                rel = kp - (kv_len - n)
                bit = (tm[:, None] >> tl.minimum(tl.maximum(rel, 0), 63).to(tl.int64)[None, :]) & 1
                seen = seen & (((rel < 0) | (rel > 63))[None, :] | (bit != 0))
            sc = tl.where(seen, sc * qk_scale, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(sc, axis=1))
            m_use = tl.where(m_new == float("-inf"), 0.0, m_new)   # a row with no key yet in this split
            alpha = tl.exp2(m_i - m_use)
            p = tl.exp2(sc - m_use[:, None])
            l_i = l_i * alpha + tl.sum(p, axis=1)
            if F32DOT == 2:
                acc = acc * alpha[:, None] + tl.sum(p[:, :, None] * vt.to(tl.float32)[None, :, :], axis=1)
            elif F32DOT:
                acc = acc * alpha[:, None] + tl.dot(p, vt.to(tl.float32), input_precision="ieee")
            else:
                acc = acc * alpha[:, None] + tl.dot(p.to(vt.dtype), vt)
            m_i = m_new
        if SINGLE:
            out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
            o_off = (q0 + i)[:, None].to(tl.int64) * (H * D) + (j * G + g)[:, None] * D + rd[None, :]
            tl.store(o_ptr + o_off, out.to(o_ptr.dtype.element_ty), mask=row_ok[:, None] & d_ok[None, :])
        else:
            slot = ((pid * tl.num_programs(1) + j) * NS + sp).to(tl.int64) * (BLOCK_M * GP)
            tl.store(pm_ptr + slot + r, m_i)
            tl.store(pl_ptr + slot + r, l_i)
            tl.store(pacc_ptr + (slot + r[:, None]) * DP + rd[None, :], acc)

    @triton.jit(do_not_specialize=["S", "NS"])
    def _merge_kernel(cu_ptr, o_ptr, pm_ptr, pl_ptr, pacc_ptr, S, H, NS,
                      G: tl.constexpr, GP: tl.constexpr, D: tl.constexpr, DP: tl.constexpr, BLOCK_M: tl.constexpr,
                      SP: tl.constexpr, BLOCK_S: tl.constexpr, ROWS: tl.constexpr):
        """Program (tile, j, row block): merges the NS splits' partials of ROWS rows (log-sum-exp weights) into o."""
        pid = tl.program_id(0)
        j = tl.program_id(1)
        s, t, live = _tile_of(pid, cu_ptr, S, BLOCK_M, SP)
        q0 = tl.load(cu_ptr + s)
        n = tl.where(live, tl.load(cu_ptr + s + 1) - q0, 0)
        r = tl.program_id(2) * ROWS + tl.arange(0, ROWS)
        i = t * BLOCK_M + r // GP
        g = r % GP
        row_ok = (i < n) & (g < G)
        rs, rd = tl.arange(0, BLOCK_S), tl.arange(0, DP)
        base = ((pid * tl.num_programs(1) + j) * NS).to(tl.int64)
        pmask = (rs < tl.where(live, NS, 0))[:, None]
        pm = tl.load(pm_ptr + (base + rs[:, None]) * (BLOCK_M * GP) + r[None, :], mask=pmask, other=float("-inf"))
        pl = tl.load(pl_ptr + (base + rs[:, None]) * (BLOCK_M * GP) + r[None, :], mask=pmask, other=0.0)
        m = tl.max(pm, axis=0)
        seen = m > float("-inf")
        w = tl.where(seen[None, :], tl.exp2(pm - tl.where(seen, m, 0.0)[None, :]), 0.0)   # [BLOCK_S, ROWS]
        denom = tl.sum(w * pl, axis=0)
        out = tl.zeros([ROWS, DP], tl.float32)
        for si in range(NS):
            ws = tl.sum(tl.where(rs[:, None] == si, w, 0.0), axis=0)
            part = tl.load(pacc_ptr + ((base + si) * (BLOCK_M * GP) + r[:, None]) * DP + rd[None, :],
                           mask=(ws > 0)[:, None], other=0.0)
            out += part * ws[:, None]
        out = out / tl.where(denom > 0, denom, 1.0)[:, None]
        o_off = (q0 + i)[:, None].to(tl.int64) * (H * D) + (j * G + g)[:, None] * D + rd[None, :]
        tl.store(o_ptr + o_off, out.to(o_ptr.dtype.element_ty), mask=row_ok[:, None] & (rd < D)[None, :])


def _pow2(n: int, low: int = 1) -> int:
    p = low
    while p < n:
        p *= 2
    return p


def sequence_lanes(s: int) -> int:
    """SP, the lanes a program scans to find its sequence: 16, 64, 256, ... (few compiled variants) >= s."""
    p = 16
    while p < s:
        p *= 4
    return p


def splits_for(programs: int, capacity: int, sms: int) -> int:
    """KV splits per tile: about two waves of ``sms`` programs over ``programs`` (tiles x H_kv) when they are
    fewer, at most ``capacity`` / MIN_SPLIT_KEYS and MAX_SPLITS; 1 once the tiles fill the GPU."""
    if SPLITS:
        return SPLITS
    if programs >= sms:
        return 1
    return max(1, min(-(-2 * sms // programs), capacity // MIN_SPLIT_KEYS, MAX_SPLITS))


def _sm_count(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 4


def kernel_takes(q, k_cache, v_cache) -> bool:
    """Whether the Triton kernel can run these inputs: Triton installed, CUDA or the interpreter, block_size a
    power of two, D <= 256, caches with unit stride along D, and the kernel never failed to build."""
    bs, d = k_cache.shape[1], q.shape[-1]
    return (_TRITON and not _KERNEL_FAILED and (q.is_cuda or triton_interpreted()) and bs & (bs - 1) == 0
            and d <= 256 and k_cache.stride(-1) == 1 and v_cache.stride(-1) == 1)


def paged_attention(q, k_cache, v_cache, block_tables, cu_q, kv_lens, *, scale=None, max_q=None, kernel="auto",
                    out=None, invariant: bool = False, tree_mask=None) -> torch.Tensor:
    """Attention of the step's tokens over the paged cache (module docstring: shapes and semantics).

    ``scale``: default 1/sqrt(D). ``max_q``: a host upper bound on n_s (default T); it sizes the kernel's tiles and
    must hold. ``kernel``: "auto" (Triton on CUDA where it is installed, else the reference), "triton" (also in Triton's interpreter
    on CPU) or "torch" (:func:`paged_attention_reference`). The Triton path reads no tensor value on the host and is
    opaque to ``torch.compile`` (``torch.ops.tilespec.paged_attention``). A kernel that fails to build warns once and
    the reference runs from then on. ``out``: a [T, H, D] tensor of q's dtype to write into (eager callers: a
    piecewise graph's static buffer; its rows outside every sequence are left as they were). ``invariant``: a row's
    output is bitwise independent of the batch, its sequence's other rows and max_q (the engine's deterministic
    mode): one KV split and the tile of max_q = 1 whatever the step; the kernel also in the interpreter, else
    invariant.attention_rows (the reference's per-sequence SDPA follows the chunk length). ``tree_mask``: None
    (chains), or [T] int64 ancestor bitmasks (module docstring: token trees)."""
    if kernel not in ("auto", "torch", "triton"):
        raise ValueError(f"kernel must be 'auto', 'torch' or 'triton', got {kernel!r}")
    _check(q, k_cache, v_cache, block_tables, cu_q, kv_lens, max_q)
    check_tree_mask(q, tree_mask)
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else float(scale)
    if out is not None and (out.shape != q.shape or out.dtype != q.dtype or out.device != q.device):
        raise ValueError(f"out must be {tuple(q.shape)} {q.dtype} on {q.device}, got {tuple(out.shape)} {out.dtype}")
    if invariant and (kernel == "torch" or not kernel_takes(q, k_cache, v_cache)):
        ref = attention_rows(q, k_cache, v_cache, block_tables, cu_q, kv_lens, scale, tree_mask)
        return ref if out is None else _into(out, ref, cu_q)
    if kernel == "torch" or (kernel == "auto" and not (q.is_cuda and _TRITON) and not invariant):
        ref = paged_attention_reference(q, k_cache, v_cache, block_tables, cu_q, kv_lens, scale=scale, max_q=max_q,
                                        tree_mask=tree_mask)
        return ref if out is None else _into(out, ref, cu_q)
    if not kernel_takes(q, k_cache, v_cache) and not _KERNEL_FAILED:
        raise ValueError(f"the paged attention kernel needs Triton on CUDA (or TRITON_INTERPRET=1), block_size a "
                         f"power of two (got {k_cache.shape[1]}), D <= 256 (got {q.shape[-1]}) and caches with unit "
                         f"stride along D; use kernel='torch' otherwise")
    mq = q.shape[0] if max_q is None else max_q
    if torch.compiler.is_compiling():
        return torch.ops.tilespec.paged_attention(q, k_cache, v_cache, block_tables, cu_q, kv_lens, scale, mq,
                                                  invariant, tree_mask)
    return _run(q, k_cache, v_cache, block_tables, cu_q, kv_lens, scale, mq, out, invariant, tree_mask)


def _into(out, ref, cu_q):
    """The reference's rows of the sequences copied into ``out`` (the rows after them left as they were)."""
    out[:int(cu_q[-1])].copy_(ref[:int(cu_q[-1])])
    return out


def _run(q, k_cache, v_cache, block_tables, cu_q, kv_lens, scale: float, max_q: int, out=None,
         invariant: bool = False, tree_mask=None) -> torch.Tensor:
    """The kernels; the reference from the first time they fail to build (warned once)."""
    if not _KERNEL_FAILED:
        try:
            return _launch(q, k_cache, v_cache, block_tables, cu_q, kv_lens, scale, max_q, out=out,
                           invariant=invariant, tree_mask=tree_mask)
        except Exception as err:   # noqa: BLE001 - a kernel that fails to build must not end decoding
            _KERNEL_FAILED.append(f"{type(err).__name__}: {err}")
            warnings.warn(f"the paged attention kernel failed ({_KERNEL_FAILED[0]}); using the PyTorch reference")
    ref = (attention_rows(q, k_cache, v_cache, block_tables, cu_q, kv_lens, scale, tree_mask) if invariant else
           paged_attention_reference(q, k_cache, v_cache, block_tables, cu_q, kv_lens, scale=scale,
                                     tree_mask=tree_mask))
    return ref if out is None else _into(out, ref, cu_q)


@torch.library.custom_op("tilespec::paged_attention", mutates_args=())
def _paged_op(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
              cu_q: torch.Tensor, kv_lens: torch.Tensor, scale: float, max_q: int, invariant: bool = False,
              tree_mask: Optional[torch.Tensor] = None) -> torch.Tensor:
    """:func:`_run` as an operator opaque to compiled callers (inductor neither traces nor re-specialises it)."""
    return _run(q, k_cache, v_cache, block_tables, cu_q, kv_lens, scale, max_q, invariant=invariant,
                tree_mask=tree_mask)


@_paged_op.register_fake
def _(q, k_cache, v_cache, block_tables, cu_q, kv_lens, scale, max_q, invariant=False, tree_mask=None):
    return torch.empty_like(q, memory_format=torch.contiguous_format)


def tile_shape(g: int, max_q: int) -> tuple:
    """(BLOCK_M tokens per tile, padded group GP): BLOCK_M * GP rows, at least 16 (tl.dot), at most MAX_ROWS
    unless one token's group needs more."""
    gp = _pow2(g)
    block_m = min(_pow2(max_q), max(1, MAX_ROWS // gp))
    return max(block_m, -(-16 // gp)), gp


def launch_plan(q, k_cache, block_tables, max_q: int, invariant: bool = False) -> tuple:
    """(BLOCK_M, GP, tiles, splits) of a launch, from host ints only: tiles bounds the packed tiles
    sum_s ceil(n_s / BLOCK_M) by both S * ceil(max_q / BLOCK_M) and (T + S * (BLOCK_M - 1)) // BLOCK_M.
    ``invariant``: the decode tile (max_q = 1) and one split, whatever the step. With one split a row's keys are
    read in steps of BLOCK_N from key 0 up to its own position, whatever the tile's extent (the steps past it are
    all masked and add exact zeros); a fixed tile keeps the dot's shape, so its instruction, fixed too."""
    t, h, _ = q.shape
    s, hkv = block_tables.shape[0], k_cache.shape[2]
    block_m, gp = tile_shape(h // hkv, 1 if invariant else max_q)
    tiles = min(s * -(-max_q // block_m), (t + s * (block_m - 1)) // block_m)
    if invariant:
        return block_m, gp, tiles, 1
    return block_m, gp, tiles, splits_for(tiles * hkv, block_tables.shape[1] * k_cache.shape[1], _sm_count(q.device))


def _warps(rows: int, dp: int) -> int:
    return 8 if rows * dp >= 128 * 128 else 4


def launch_key(q, k_cache, block_tables, max_q: int, splits: int | None = None) -> tuple:
    """What a launch compiles by (beyond the model's fixed sizes and dtype): (BLOCK_M, SP, one split, warps)."""
    block_m, gp, _, ns = launch_plan(q, k_cache, block_tables, max_q)
    ns = splits or ns
    return block_m, sequence_lanes(block_tables.shape[0]), ns == 1, _warps(block_m * gp, _pow2(q.shape[-1], 16))


def variants(heads: int, kv_heads: int, head_dim: int, max_seqs: int, max_q: int) -> set:
    """Every :func:`launch_key` of a model (``heads`` / ``kv_heads`` / ``head_dim``) whose steps hold at most
    ``max_seqs`` sequences of at most ``max_q`` tokens each."""
    g, dp = heads // kv_heads, _pow2(head_dim, 16)
    tiles = {tile_shape(g, q) for q in [2 ** i for i in range(max(1, max_q).bit_length() + 1)]}
    lanes, p = [], 16
    while True:
        lanes.append(p)
        if p >= max_seqs:
            break
        p *= 4
    return {(bm, sp, single, _warps(bm * gp, dp)) for bm, gp in tiles for sp in lanes for single in (True, False)}


def warm_variants(q_dtype, k_cache, v_cache, heads: int, max_seqs: int, max_q: int, trees: bool = False) -> int:
    """Compile every launch variant (:func:`variants`) once, on block 0 of the given caches (their scratch block:
    it is overwritten by nothing the kernel writes), ``trees``: also with a tree mask; returns how many ran. A no-op
    without the kernel."""
    kv_heads, d, dev = k_cache.shape[2], k_cache.shape[3], k_cache.device
    q0 = torch.zeros((1, heads, d), dtype=q_dtype, device=dev)
    if not kernel_takes(q0, k_cache, v_cache):
        return 0
    done = 0
    for block_m, sp, single, _ in sorted(variants(heads, kv_heads, d, max_seqs, max_q)):
        s = sp // 4 + 1 if sp > 16 else 1              # a sequence count with these lanes
        q = torch.zeros((s * block_m, heads, d), dtype=q_dtype, device=dev)
        cu = torch.arange(0, (s + 1) * block_m, block_m, dtype=torch.int32, device=dev)
        lens = torch.full((s,), block_m, dtype=torch.int32, device=dev)
        tables = torch.zeros((s, 1), dtype=torch.int32, device=dev)
        if block_m > k_cache.shape[1]:                 # keys of the sequence's tokens: one block may not hold them
            tables = torch.zeros((s, -(-block_m // k_cache.shape[1])), dtype=torch.int32, device=dev)
        for tree in (None, torch.full((s * block_m,), -1, device=dev)) if trees else (None,):    # chains, trees
            _launch(q, k_cache, v_cache, tables, cu, lens, 1.0, block_m, splits=1 if single else 2, tree_mask=tree)
            done += 1
    return done


def _launch(q, k_cache, v_cache, block_tables, cu_q, kv_lens, scale, max_q, splits=None, out=None,
            invariant: bool = False, tree_mask=None) -> torch.Tensor:
    t, h, d = q.shape
    out = torch.empty((t, h, d), dtype=q.dtype, device=q.device) if out is None else out
    s = block_tables.shape[0]
    if t == 0 or s == 0:
        return out
    hkv, bs = k_cache.shape[2], k_cache.shape[1]
    block_tables, cu_q, kv_lens = block_tables.contiguous(), cu_q.contiguous(), kv_lens.contiguous()
    q = q if q.stride(-1) == 1 else q.contiguous()
    g = h // hkv
    block_m, gp, tiles, ns = launch_plan(q, k_cache, block_tables, max_q, invariant)
    ns = 1 if invariant else splits or ns
    rows, dp = block_m * gp, _pow2(d, 16)
    f32dot = q.dtype == torch.float32 or triton_interpreted()   # the interpreter's bf16 / fp16 dot is unreliable
    f32dot = 2 if invariant and triton_interpreted() else f32dot
    common = dict(G=g, GP=gp, D=d, DP=dp, BLOCK_M=block_m, SP=sequence_lanes(s))
    if ns == 1:
        pm = pl = pacc = out     # unused
    else:
        pm = torch.empty((tiles * hkv * ns, rows), dtype=torch.float32, device=q.device)
        pl = torch.empty_like(pm)
        pacc = torch.empty((tiles * hkv * ns, rows, dp), dtype=torch.float32, device=q.device)
    tree = {} if tree_mask is None else {"TREE": True}     # chains: the variant compiled without the test
    _partial_kernel[(tiles, hkv, ns)](
        q, k_cache, v_cache, block_tables, cu_q, kv_lens, tree_mask.contiguous() if tree else cu_q, out, pm, pl,
        pacc, s, h, ns, scale * math.log2(math.e), q.stride(0), q.stride(1), *k_cache.stride()[:3],
        *v_cache.stride()[:3], block_tables.stride(0), BS=bs, BLOCK_N=BLOCK_N, SINGLE=ns == 1, F32DOT=f32dot,
        num_warps=_warps(rows, dp), **common, **tree)
    if ns > 1:
        mr = min(rows, MERGE_ROWS)
        _merge_kernel[(tiles, hkv, rows // mr)](cu_q, out, pm, pl, pacc, s, h, ns, BLOCK_S=max(SPLIT_WIDTH, _pow2(ns, 2)), ROWS=mr,
                                                num_warps=4, **common)
    return out
