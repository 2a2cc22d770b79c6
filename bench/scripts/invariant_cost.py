"""GPU: what the deterministic mode's operators cost against the default ones, at Qwen2.5-1.5B's shapes, bf16.

For each step size T (tokens in one forward: 1, 16, 64 and 256 decode rows, 64 rows x 5 for a gamma-4 verify) the
GPU time of one layer's four projections (qkv, o, gate/up, down) with their two RMSNorms, and of the LM head over
the step's rows, with engine/paged/invariant.py's linear / rms_norm (one Triton launch configuration for every T)
and with F.linear / the native RMSNorm (cuBLAS picks per T). The paged attention at the same rows (one new token,
or five, over a 512-key context) with ``invariant=True`` (one KV split, the decode tile) and without. Each time: a CUDA
graph of 20 calls, median of 30 replays (bench/scripts/native_kernels.graph_us).

``forward_us`` adds 28 layers and the head: the matmul, norm and attention share of one forward step. It leaves out
RoPE, the K/V writes, the embedding and the engine's host loop, so it bounds the whole engine's slowdown from the
operators alone; the engine at 64 clients (bench/scripts/paged_engine.py --deterministic) is the measurement of it.
Every weight is random: time does not depend on the values. Also checked here: each invariant op's row is bitwise
the same inside a batch of T as alone, on this GPU.

Usage: python3 bench/scripts/invariant_cost.py [--json OUT.json]
"""
from __future__ import annotations

import argparse
import json
import os
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(__file__))
from native_kernels import graph_us  # noqa: E402
from paged_attention import paged_inputs  # noqa: E402

HIDDEN, INTER, HEADS, KV_HEADS, HEAD_DIM, LAYERS, VOCAB = 1536, 8960, 12, 2, 128, 28, 151936
STEPS = ((1, 1), (16, 1), (64, 1), (256, 1), (64, 5))      # (rows, tokens per row)


def layer_ops(x, w, linear, norm) -> torch.Tensor:
    """One layer's projections and norms over x [T, HIDDEN] (the attention stands apart)."""
    h = linear(norm(x, w["ln1"], 1e-6), w["qkv"], w["qkv_bias"])
    res = x + linear(h[:, :HIDDEN].contiguous(), w["o"])
    gu = linear(norm(res, w["ln2"], 1e-6), w["gate_up"])
    return linear(F.silu(gu[:, :INTER]) * gu[:, INTER:], w["down"])


def weights(device) -> dict:
    kw = dict(device=device, dtype=torch.bfloat16)
    nqkv = (HEADS + 2 * KV_HEADS) * HEAD_DIM
    return dict(ln1=1 + 0.1 * torch.randn(HIDDEN, **kw), ln2=1 + 0.1 * torch.randn(HIDDEN, **kw),
                qkv=0.02 * torch.randn(nqkv, HIDDEN, **kw), qkv_bias=0.02 * torch.randn(nqkv, **kw),
                o=0.02 * torch.randn(HIDDEN, HIDDEN, **kw), gate_up=0.02 * torch.randn(2 * INTER, HIDDEN, **kw),
                down=0.02 * torch.randn(HIDDEN, INTER, **kw), lm_head=0.02 * torch.randn(VOCAB, HIDDEN, **kw),
                norm=1 + 0.1 * torch.randn(HIDDEN, **kw))


def invariance_holds(inv, w, t: int) -> bool:
    """Row 0 of a T-row batch through the invariant layer ops and head equals the same row alone, bitwise."""
    x = torch.randn(t, HIDDEN, device="cuda", dtype=torch.bfloat16)
    batch = inv.linear(inv.rms_norm(layer_ops(x, w, inv.linear, inv.rms_norm), w["norm"], 1e-6), w["lm_head"])
    alone = inv.linear(inv.rms_norm(layer_ops(x[:1], w, inv.linear, inv.rms_norm), w["norm"], 1e-6), w["lm_head"])
    return bool(torch.equal(batch[:1], alone))


def benchmark(context: int = 512) -> list:
    from tilespec.engine.native.llama import rms_norm
    from tilespec.engine.paged import attention as pa
    from tilespec.engine.paged import invariant as inv
    torch.manual_seed(0)
    w = weights("cuda")
    rows = []
    for b, nq in STEPS:
        t = b * nq
        x = torch.randn(t, HIDDEN, device="cuda", dtype=torch.bfloat16)
        last = torch.randn(b, HIDDEN, device="cuda", dtype=torch.bfloat16)      # the head reads every row's tokens
        heads = x if nq > 1 else last
        args = paged_inputs(b, nq, context)
        row = dict(rows=b, tokens_per_row=nq, tokens=t, context=context)
        for name, linear, norm, invariant in (("default", F.linear, rms_norm, False),
                                              ("invariant", inv.linear, inv.rms_norm, True)):
            row[f"{name}_layer_us"] = graph_us(lambda: layer_ops(x, w, linear, norm))
            row[f"{name}_head_us"] = graph_us(lambda: linear(norm(heads, w["norm"], 1e-6), w["lm_head"]))
            row[f"{name}_attention_us"] = graph_us(lambda: pa.paged_attention(*args, max_q=nq, invariant=invariant))
            row[f"{name}_forward_us"] = round(LAYERS * (row[f"{name}_layer_us"] + row[f"{name}_attention_us"])
                                              + row[f"{name}_head_us"], 1)
        row["forward_slowdown"] = round(row["invariant_forward_us"] / row["default_forward_us"], 3)
        row["rows_bitwise_invariant"] = invariance_holds(inv, w, t)
        print(row, flush=True)
        rows.append(row)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--json", default=None)
    ap.add_argument("--context", type=int, default=512)
    args = ap.parse_args()
    from tilespec.env import run_record
    rows = benchmark(args.context)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(run_record("cuda"), model_shapes="Qwen2.5-1.5B (random bf16 weights)",
                           what="GPU time of the operators of one forward, deterministic mode vs default; not the "
                                "engine's step time (host loop, RoPE, K/V writes excluded)", rows=rows), f, indent=1)


if __name__ == "__main__":
    main()
