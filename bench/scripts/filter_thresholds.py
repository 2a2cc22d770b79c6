"""GPU: time the sort-free top-k / top-p threshold kernel (verify/kernels/thresholds.py) against the sort.

Usage: python3 bench/scripts/filter_thresholds.py --json OUT.json
For B in (1, 64), R = K + 1 = 6 rows, V = 151,936, bf16 logits at T=1: the kernel at BITS = 1, 2, 4, 8 key bits per
pass (block 1024 and 2048), top-k 50 and top-p 0.9 separately, and the sort-based evaluation (filters.py "sort") of
the same thresholds; CUDA-event medians of 50 calls. The kernel's thresholds are checked against the sort's.
"""
from __future__ import annotations

import argparse
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(__file__))
from native_forward import time_replays  # noqa: E402


def median_ms(fn, n: int = 50) -> float:
    """CUDA-event median of ``fn`` after one warm call."""
    fn()
    torch.cuda.synchronize()
    return time_replays(fn, n)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--json", required=True)
    args = ap.parse_args()
    from tilespec.env import run_record
    from tilespec.verify import SamplingParams
    from tilespec.verify.filters import keep_threshold
    from tilespec.verify.kernels.thresholds import filter_thresholds
    from tilespec.verify.validation import resolve_sampling

    rows = []
    for batch in (1, 64):
        gen = torch.Generator(device="cuda").manual_seed(0)
        logits = (torch.randn(batch, 6, 151936, device="cuda", generator=gen) * 3).to(torch.bfloat16)
        for name, params in (("top_k=50", dict(top_k=50)), ("top_p=0.9", dict(top_p=0.9))):
            s = resolve_sampling(SamplingParams(temperature=1.0, **params), batch, torch.device("cuda"))
            ref = keep_threshold(logits, s, method="sort")
            row = dict(B=batch, R=6, V=151936, filter=name,
                       sort_ms=median_ms(lambda: keep_threshold(logits, s, method="sort"), 10))
            for bits in (1, 2, 4, 8):
                for block in (1024, 2048):
                    def run():
                        return filter_thresholds(logits, s.temperature, s.top_k, s.top_p, s.has_top_k, s.has_top_p,
                                                 block=block, bits=bits)
                    same = bool(torch.equal(run(), ref))
                    row[f"kernel_bits{bits}_block{block}_ms"] = median_ms(run)
                    row[f"kernel_bits{bits}_block{block}_equal_sort"] = same
            print(json.dumps(row), flush=True)
            rows.append(row)
    with open(args.json, "w") as f:
        json.dump(dict(run_record("cuda"), rows=rows), f, indent=1)


if __name__ == "__main__":
    main()
