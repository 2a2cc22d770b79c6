"""GPU: top-p keep thresholds of bf16 rows from the key-count window (verify/kernels/topp16.py), same process.

Usage: python3 bench/scripts/topp16_bench.py --json OUT.json [--profile]
For B in (1, 8, 64), K = 5, V = 151,936, bf16 target [B, 6, V] and draft [B, 5, V] logits (randn * 3, T = 1):
* thresholds alone, target and draft rows in one launch set, top-p 0.8 / 0.9 / 0.95: CUDA-graph and eager medians,
  rows the window did not decide (they take the gated fallback), kept sets equal to the sort's;
* the previous path (filters.keep_threshold: radix / row kernels) at top-p 0.9, graph;
* window sizes and chunk sizes side by side at top-p 0.9 (graph);
* --profile: cProfile of eager ``fused`` calls at B = 1 (no filter, top-p 0.9, top-k 50): where the host time goes.
"""
from __future__ import annotations

import argparse
import cProfile
import io
import json
import os
import pstats
import sys

import torch

sys.path.insert(0, os.path.dirname(__file__))
from filter_thresholds import graph_ms  # noqa: E402

from tilespec.bench.verify import time_eager  # noqa: E402

V, K = 151936, 5


def eager_us(fn, n: int = 50) -> float:
    fn()                                       # compile / warm up outside the timing
    return time_eager(fn, n)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--json", required=True)
    ap.add_argument("--profile", action="store_true")
    args = ap.parse_args()
    from tilespec.env import run_record
    from tilespec.verify import SamplingParams
    from tilespec.verify.filters import keep_threshold, scaled_logits, top_p_threshold_sorted
    from tilespec.verify.kernels import topp16
    from tilespec.verify.registry import get_method
    from tilespec.verify.validation import prepare_inputs, resolve_sampling
    doc = dict(run_record("cuda"), rows=[], variants=[], previous=[])
    gen = torch.Generator(device="cuda").manual_seed(0)
    for b in (1, 8, 64):
        tgt = (torch.randn(b, K + 1, V, device="cuda", generator=gen) * 3).bfloat16()
        drf = (torch.randn(b, K, V, device="cuda", generator=gen) * 3).bfloat16()
        temp = torch.ones(b, device="cuda")
        for p in (0.8, 0.9, 0.95):
            top_p = torch.full((b,), p, device="cuda")

            def pair(**kw):
                return topp16.top_p_thresholds16(tgt, top_p, temp, drf, **kw)
            thr_t, thr_d = pair(fallback=False)
            area = next(a for (dev, n, _, w), (a, _) in topp16._BUFFERS.items() if n == b * 11 and w == topp16.WINDOW)
            undecided = int(area[:, 1].sum())
            thr_t, thr_d = pair()
            same = True
            for x, thr in ((tgt, thr_t), (drf, thr_d)):
                z = scaled_logits(x, temp)
                want = top_p_threshold_sorted(z, top_p)
                same &= bool(torch.equal(z >= thr[..., None], z >= want[..., None]))
            kept = float((scaled_logits(tgt, temp) >= thr_t[..., None]).sum(-1).float().mean())
            row = dict(B=b, top_p=p, graph_us=graph_ms(pair, 100) * 1e3, eager_us=eager_us(pair),
                       undecided_rows=undecided, rows=b * 11, kept_ids_mean=kept, same_kept_as_sort=same)
            print(row, flush=True)
            doc["rows"].append(row)
        top_p = torch.full((b,), 0.9, device="cuda")
        s = resolve_sampling(SamplingParams(top_p=0.9), b, "cuda")
        prev = dict(B=b, top_p=0.9, graph_us=graph_ms(lambda: (keep_threshold(tgt, s), keep_threshold(drf, s)),
                                                       20) * 1e3)
        print("previous", prev, flush=True)
        doc["previous"].append(prev)
        if b in (1, 64):
            for window, chunk in ((256, 4096), (1024, 4096), (512, 2048), (512, 8192)):
                us = graph_ms(lambda: topp16.top_p_thresholds16(tgt, top_p, temp, drf, window=window, chunk=chunk),
                              100) * 1e3
                var = dict(B=b, top_p=0.9, window=window, chunk=chunk, graph_us=us)
                print(var, flush=True)
                doc["variants"].append(var)
        del tgt, drf
    if args.profile:
        fused = get_method("fused")
        tgt = (torch.randn(1, K + 1, V, device="cuda", generator=gen) * 3).bfloat16()
        drf = (torch.randn(1, K, V, device="cuda", generator=gen) * 3).bfloat16()
        tokens = torch.randint(0, V, (1, K), device="cuda", generator=gen)
        doc["profiles"] = {}
        for name, sp in (("none", SamplingParams()), ("top-p 0.9", SamplingParams(top_p=0.9)),
                         ("top-k 50", SamplingParams(top_k=50))):
            inputs = prepare_inputs(tgt, tokens, draft_logits=drf, sampling=sp, seed=1, check_values=False)
            options = dict(fused.resolve_options())
            us = eager_us(lambda: fused.fn(inputs, **options), 100)
            prof = cProfile.Profile()
            prof.enable()
            for _ in range(200):
                fused.fn(inputs, **options)
            torch.cuda.synchronize()
            prof.disable()
            out = io.StringIO()
            pstats.Stats(prof, stream=out).sort_stats("tottime").print_stats(25)
            doc["profiles"][name] = dict(eager_us=us, top_tottime=out.getvalue()[-6000:])
            print(name, us, flush=True)
            print(out.getvalue()[:3000], flush=True)
    with open(args.json, "w") as fh:
        json.dump(doc, fh, indent=1)


if __name__ == "__main__":
    main()
