"""GPU: the paged-KV attention kernel (engine/paged/attention.py) alone, µs per call (CUDA events around a CUDA
graph of 20 calls, median of 30 replays) at B in {1, 16, 64} sequences x q in {1, 5} new tokens over a 1k context,
Qwen2.5-1.5B heads (12 query, 2 KV, D 128), bf16, 16-slot blocks in a shuffled table. Per shape: the module's split
choice, forced splits (to tune ``splits_for``), the same attention over a contiguous cache with the slot cache's
split-KV kernel (engine/native/attention.py: what paging costs) and cuDNN/flash SDPA, and the kernel's max abs
difference from the PyTorch reference.

Usage: python3 bench/scripts/paged_attention.py [--json OUT.json] [--batches 1,16,64 --queries 1,5 --context 1024]
"""
from __future__ import annotations

import argparse
import itertools
import json
import os
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(__file__))
from native_kernels import graph_us  # noqa: E402

H, HKV, D, BLOCK = 12, 2, 128, 16


def paged_inputs(b: int, nq: int, context: int, seed: int = 0, device="cuda"):
    """(q, k_cache, v_cache, block_tables, cu_q, kv_lens): b sequences of nq new tokens, kv_len = context."""
    g = torch.Generator().manual_seed(seed)
    per = -(-context // BLOCK)
    tables = (torch.randperm(b * per, generator=g) + 1).int().view(b, per)
    cu_q = torch.arange(b + 1, dtype=torch.int32) * nq
    kw = dict(device=device, dtype=torch.bfloat16)
    q = torch.randn(b * nq, H, D, **kw)
    k = torch.randn(b * per + 1, BLOCK, HKV, D, **kw)
    v = torch.randn(b * per + 1, BLOCK, HKV, D, **kw)
    lens = torch.full((b,), context, dtype=torch.int32)
    return q, k, v, tables.to(device), cu_q.to(device), lens.to(device)


def contiguous_twin(q, k, v, tables, nq: int, context: int):
    """The same attention over contiguous [B, H_kv, C, D] caches: q [B, H, nq, D], K, V and the causal mask."""
    b = tables.shape[0]
    kc = k[tables.long()].flatten(1, 2)[:, :context].transpose(1, 2).contiguous()
    vc = v[tables.long()].flatten(1, 2)[:, :context].transpose(1, 2).contiguous()
    pos = torch.arange(context, device=q.device)
    keep = pos[None, :] <= (context - nq + torch.arange(nq, device=q.device))[:, None]
    mask = torch.zeros(b, 1, nq, context, device=q.device, dtype=q.dtype).masked_fill_(~keep, torch.finfo(q.dtype).min)
    return q.view(b, nq, H, D).transpose(1, 2), kc, vc, mask


def benchmark_paged_attention(batches=(1, 16, 64), queries=(1, 5), context: int = 1024,
                              forced_splits=(1, 2, 4, 8, 16)) -> list:
    """One row per (B, q): µs per call of the paged kernel (module's splits and each forced count), the native
    contiguous split-KV kernel, SDPA, and the paged kernel's max abs difference from the reference."""
    from tilespec.engine.native import attention as native
    from tilespec.engine.paged import attention as pa
    rows = []
    for b, nq in itertools.product(batches, queries):
        args = paged_inputs(b, nq, context)
        call = lambda: pa.paged_attention(*args, max_q=nq)   # noqa: E731
        out = call()
        diff = (out.float() - pa.paged_attention_reference(*args).float()).abs().max().item()
        row = dict(batch=b, q=nq, context=context, max_abs_diff=diff, paged_us=graph_us(call),
                   splits=pa.launch_plan(args[0], args[1], args[3], nq)[3])
        for ns in forced_splits:
            pa.SPLITS = ns
            try:
                row[f"paged_us_splits{ns}"] = graph_us(call)
            finally:
                pa.SPLITS = None
        qc, kc, vc, mask = contiguous_twin(*args[:4], nq, context)
        row["native_contiguous_us"] = graph_us(lambda: native.decode_attention(qc, kc, vc, mask))
        row["sdpa_us"] = graph_us(lambda: F.scaled_dot_product_attention(qc, kc, vc, attn_mask=mask, enable_gqa=True))
        print(row, flush=True)
        rows.append(row)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser()
    ints = lambda text: tuple(int(x) for x in text.split(","))    # noqa: E731
    ap.add_argument("--json", default=None)
    ap.add_argument("--batches", type=ints, default=(1, 16, 64))
    ap.add_argument("--queries", type=ints, default=(1, 5))
    ap.add_argument("--context", type=int, default=1024)
    args = ap.parse_args()
    from tilespec.env import run_record
    rows = benchmark_paged_attention(args.batches, args.queries, args.context)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(run_record("cuda"), heads=dict(q=H, kv=HKV, d=D), block_size=BLOCK, dtype="bfloat16",
                           rows=rows), f, indent=1)


if __name__ == "__main__":
    main()
