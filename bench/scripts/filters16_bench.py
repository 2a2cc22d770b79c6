"""GPU: the 16-bit top-k kernel (verify/kernels/topk16.py) and the filtered ``fused`` step, same process.

Usage: python3 bench/scripts/filters16_bench.py --json OUT.json
For B in (1, 64), K = 5, V = 151,936, bf16 target and draft logits (randn * 3, T = 1 unless said):
* keep thresholds alone for top-k 50 on the B x 6 target rows: ``topk16`` against ``torch.topk``
  (``keep._top_k_thresholds``, the previous path) and the radix kernel; eager and CUDA-graph medians, equality;
  topk16's pivot path at several chunk sizes and warps, and its digit-counting fallback forced for every row at
  several digit splits, side by side (graph);
* ``verify(method="fused")`` end to end (graph replay): no filter, top-k 50, top-p 0.9, top-k 50 + top-p 0.9, and T 0.7 / top-k 20 / top-p 0.8
  (Qwen2.5's generation config);
* Triton's fp32 ``/`` (div.full) against torch's division over every finite bf16 value for a few T: how many
  quotients differ (why the kernels divide with div.rn where a keep threshold is compared).
"""
from __future__ import annotations

import argparse
import json
import os
import sys

import torch
import triton
import triton.language as tl

sys.path.insert(0, os.path.dirname(__file__))
from filter_thresholds import graph_ms, median_ms  # noqa: E402

V, K = 151936, 5


@triton.jit
def _div_kernel(x_ptr, full_ptr, rn_ptr, t, n, BLOCK: tl.constexpr):
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    x = tl.load(x_ptr + i, mask=i < n)
    tl.store(full_ptr + i, x / t, mask=i < n)
    tl.store(rn_ptr + i, tl.div_rn(x, t), mask=i < n)


def division_mismatches(temps=(0.3, 0.6, 0.7, 0.8, 0.9, 1.3, 1.7)) -> list:
    bits = torch.arange(-32768, 32768, dtype=torch.int32, device="cuda").to(torch.int16)
    x = bits.view(torch.bfloat16).float()
    x = x[torch.isfinite(x)].contiguous()
    rows = []
    for t in temps:
        full, rn = torch.empty_like(x), torch.empty_like(x)
        _div_kernel[(triton.cdiv(x.numel(), 1024),)](x, full, rn, t, x.numel(), BLOCK=1024)
        want = x / torch.tensor(t, device="cuda")
        rows.append(dict(T=t, values=x.numel(), div_full_differs=int((full != want).sum()),
                         div_full_below=int((full < want).sum()), div_rn_differs=int((rn != want).sum())))
    return rows


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--json", required=True)
    args = ap.parse_args()
    from tilespec.env import run_record
    from tilespec.verify import SamplingParams, verify
    from tilespec.verify.filters import keep_threshold
    from tilespec.verify.kernels import keep
    from tilespec.verify.kernels.topk16 import top_k_thresholds16
    from tilespec.verify.validation import resolve_sampling

    record = dict(run_record("cuda"), thresholds=[], fused=[], division=division_mismatches())
    print(json.dumps(record["division"]), flush=True)
    for batch in (1, 64):
        gen = torch.Generator(device="cuda").manual_seed(0)
        target = (torch.randn(batch, K + 1, V, device="cuda", generator=gen) * 3).to(torch.bfloat16)
        draft = (0.8 * target[:, :K].float() + 0.6 * torch.randn(batch, K, V, device="cuda", generator=gen)
                 ).to(torch.bfloat16)
        tokens = torch.multinomial(torch.softmax(draft.float().view(-1, V), -1), 1, generator=gen).view(batch, K)
        s = resolve_sampling(SamplingParams(top_k=50), batch, torch.device("cuda"))
        runs = {"topk16": lambda: top_k_thresholds16(target, s.top_k, s.temperature, k_max=50),
                "torch_topk": lambda: keep._top_k_thresholds(target, s.top_k, s.temperature, 50),
                "radix": lambda: keep_threshold(target, s, method="triton")}
        ref = runs["torch_topk"]()
        row = dict(B=batch, rows=batch * (K + 1), filter="top_k=50")
        for name, fn in runs.items():
            row[f"{name}_equal_torch_topk"] = bool(torch.equal(fn(), ref))
            row[f"{name}_eager_ms"] = median_ms(fn)
            row[f"{name}_graph_ms"] = graph_ms(fn)
        variants = [dict(pivot=True, chunk=c, num_warps=w) for c in (1024, 2048, 4096) for w in (4, 8)]
        variants += [dict(pivot=False, digits=d) for d in ((8, 8), (6, 5, 5), (4, 4, 4, 4))]
        for v in variants:
            def variant():
                return top_k_thresholds16(target, s.top_k, s.temperature, k_max=50, **v)
            tag = "topk16_" + "_".join(f"{key}{'-'.join(map(str, val)) if isinstance(val, tuple) else val}"
                                       for key, val in v.items())
            row[f"{tag}_equal"] = bool(torch.equal(variant(), ref))
            row[f"{tag}_graph_ms"] = graph_ms(variant)
        print(json.dumps(row), flush=True)
        record["thresholds"].append(row)

        cases = {"none": SamplingParams(), "top_k=50": SamplingParams(top_k=50),
                 "top_p=0.9": SamplingParams(top_p=0.9),
                 "top_k=50,top_p=0.9": SamplingParams(top_k=50, top_p=0.9),
                 "T=0.7,top_k=20,top_p=0.8": SamplingParams(temperature=0.7, top_k=20, top_p=0.8)}
        for name, sampling in cases.items():

            def step():
                return verify(target, tokens, draft_logits=draft, method="fused", sampling=sampling, seed=1,
                              offsets=0, check_values=False)
            ref_out = verify(target, tokens, draft_logits=draft, method="reference", sampling=sampling, seed=1,
                             offsets=0).output_tokens
            got = step().output_tokens
            row = dict(B=batch, filter=name, graph_ms=graph_ms(step), eager_ms=median_ms(step),
                       rows_equal_reference=float((got == ref_out).all(1).float().mean()))
            print(json.dumps(row), flush=True)
            record["fused"].append(row)
    with open(args.json, "w") as f:
        json.dump(record, f, indent=1)


if __name__ == "__main__":
    main()
