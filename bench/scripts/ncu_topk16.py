"""One top-k 50 threshold call of kernels/topk16.py at B x 6 rows of V = 151,936 bf16 logits inside the NVTX range
``topk16`` (after a warm-up call), for ``ncu --nvtx --nvtx-include "topk16/"``.

Usage: python3 bench/scripts/ncu_topk16.py [--batch 64] [--digits 6,5,5]
"""
from __future__ import annotations

import argparse

import torch

from tilespec.verify.kernels.topk16 import top_k_thresholds16


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--digits", default="6,5,5")
    args = ap.parse_args()
    digits = tuple(int(d) for d in args.digits.split(","))
    gen = torch.Generator(device="cuda").manual_seed(0)
    logits = (torch.randn(args.batch, 6, 151936, device="cuda", generator=gen) * 3).to(torch.bfloat16)
    top_k = torch.full((args.batch,), 50, device="cuda")
    temperature = torch.ones(args.batch, device="cuda")
    top_k_thresholds16(logits, top_k, temperature, k_max=50, digits=digits)
    torch.cuda.synchronize()
    torch.cuda.nvtx.range_push("topk16")
    top_k_thresholds16(logits, top_k, temperature, k_max=50, digits=digits)
    torch.cuda.nvtx.range_pop()
    torch.cuda.synchronize()


if __name__ == "__main__":
    main()
