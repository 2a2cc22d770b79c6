"""GPU: time the sort-free top-k / top-p threshold kernels against the sort.

Usage: python3 bench/scripts/filter_thresholds.py --json OUT.json [--quick]
For B in (1, 64), R = K + 1 = 6 rows, V = 151,936, bf16 logits at T=1, filters top-k 50, top-p 0.9 and both:
* the chunked radix kernel (verify/kernels/radix.py) at BITS = 2, 4, 8 key bits per pass and chunks of 1024, 2048,
  4096 tokens per program, eager and replayed from a CUDA graph (the graph removes the ~17-34 launch overheads),
  with the (row, chunk) programs each pass reads; for top-p also the default without its single-value stop
  (``_nostop``, same run);
* the one-program-per-row kernel (verify/kernels/thresholds.py) at its default (2 bits, block 2048) and 4 bits;
* the sort-based evaluation (filters.py "sort") of the same thresholds.
CUDA-event medians of 50 calls (10 for the sort). Every kernel's thresholds are checked against the sort's.
``--quick``: only the radix defaults (4 bits, chunk 2048), the row kernel's default and the sort.
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


def graph_ms(fn, n: int = 50) -> float:
    """CUDA-event median of replaying ``fn`` captured in a CUDA graph (its launches cost one graph launch)."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return median_ms(graph.replay, n)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--json", required=True)
    ap.add_argument("--quick", action="store_true")
    args = ap.parse_args()
    from tilespec.env import run_record
    from tilespec.verify import SamplingParams
    from tilespec.verify.filters import keep_threshold
    from tilespec.verify.kernels.radix import radix_thresholds
    from tilespec.verify.kernels.thresholds import filter_thresholds
    from tilespec.verify.validation import resolve_sampling

    rows = []
    for batch in (1, 64):
        gen = torch.Generator(device="cuda").manual_seed(0)
        logits = (torch.randn(batch, 6, 151936, device="cuda", generator=gen) * 3).to(torch.bfloat16)
        for name, params in (("top_k=50", dict(top_k=50)), ("top_p=0.9", dict(top_p=0.9)),
                             ("top_k=50,top_p=0.9", dict(top_k=50, top_p=0.9))):
            s = resolve_sampling(SamplingParams(temperature=1.0, **params), batch, torch.device("cuda"))
            flags = (s.temperature, s.top_k, s.top_p, s.has_top_k, s.has_top_p)
            ref = keep_threshold(logits, s, method="sort")
            row = dict(B=batch, R=6, V=151936, filter=name,
                       sort_ms=median_ms(lambda: keep_threshold(logits, s, method="sort"), 10))
            radix = [(4, 2048)] if args.quick else [(b, c) for b in (2, 4, 8) for c in (1024, 2048, 4096)]
            variants = [(b, c, True) for b, c in radix] + ([(4, 2048, False)] if s.has_top_p else [])
            for bits, chunk, stop in variants:   # stop=False: top-p without its single-value stop (same run)
                def run():
                    return radix_thresholds(logits, *flags, bits=bits, chunk=chunk, stop=stop)
                tag = f"radix_bits{bits}_chunk{chunk}" + ("" if stop else "_nostop")
                row[f"{tag}_equal_sort"] = bool(torch.equal(run(), ref))
                row[f"{tag}_ms"] = median_ms(run)
                row[f"{tag}_graph_ms"] = graph_ms(run)
                counts = []
                radix_thresholds(logits, *flags, bits=bits, chunk=chunk, stop=stop, active_counts=counts)
                row[f"{tag}_chunks_read_per_pass"] = counts
            for bits in ((2,) if args.quick else (2, 4)):
                def run_row():
                    return filter_thresholds(logits, *flags, block=2048, bits=bits)
                row[f"row_bits{bits}_block2048_equal_sort"] = bool(torch.equal(run_row(), ref))
                row[f"row_bits{bits}_block2048_ms"] = median_ms(run_row, 10 if batch > 1 else 50)
            print(json.dumps(row), flush=True)
            rows.append(row)
    with open(args.json, "w") as f:
        json.dump(dict(run_record("cuda"), rows=rows), f, indent=1)


if __name__ == "__main__":
    main()
