#!/usr/bin/env python3
"""Profile tilespec's ``fused`` verification kernels (pass 1 ``row_stats_stream_kernel``, pass 2 ``sample_wide_kernel``)
with Nsight Compute and torch.profiler. Needs a CUDA GPU; no network access.

For every batch size B it builds bf16 (default) logits with V = 151,936 and K = 5 draft tokens at temperature 1
(draft logits close to the target's, drafted tokens sampled from the draft, so acceptances and rejections both
occur), warms up (Triton compilation, launch plans), then:

1. calls ``verify(..., method="fused", check_values=False)`` ``--profiled-calls`` times inside the NVTX push/pop
   range ``tilespec_fused_B{B}`` (after the warm-up such a call launches exactly the two kernels and no other CUDA
   work; the script checks this with torch.profiler and says so in the JSON). Profile exactly those kernels with

       ncu --nvtx --nvtx-include "tilespec_fused_B1/" --set full -o fused_B1 \\
           python3 bench/scripts/ncu_fused.py --batch 1
       ncu --nvtx --nvtx-include "tilespec_fused_B64/" --set full -o fused_B64 \\
           python3 bench/scripts/ncu_fused.py --batch 64

   or select by kernel name (the warm-up launches the same kernels, so skip them: 2 launches per warm-up call):

       ncu --kernel-name regex:"row_stats_stream_kernel|sample_wide_kernel" --launch-skip 20 --launch-count 2 \
           --set full -o fused_B1 python3 bench/scripts/ncu_fused.py --batch 1 --warmup 10 --no-timing

   (``--no-timing`` skips the torch.profiler / eager / graph measurements, which ncu would otherwise also replay.)
2. measures per-kernel CUDA time with torch.profiler over ``--profiler-iters`` calls (kernel names, calls, total and
   mean us), the eager host time per call (wall clock, synchronised after each call, median) and the CUDA-graph
   replay time per call (CUDA events over ``--graph-iters`` replays of one captured call), the eager time of the
   method alone on prepared inputs (what ``tilespec bench verify`` calls eager), and writes them as JSON
   to ``--json`` (also printed to stdout).

Arguments (all optional):
  --batch B            batch size; repeatable (default: 1 and 64)
  --k K                draft tokens per request (default 5)
  --vocab V            vocabulary size (default 151936)
  --dtype {bf16,fp16,fp32}   logits dtype (default bf16)
  --temperature T      sampling temperature (default 1.0; 0 = greedy)
  --draft {logits,none}      draft distribution given to verify (default logits)
  --method NAME        verify method to run (default fused; sigmoid / tiled work too, for comparison; the NVTX
                       range is then tilespec_{method}_B{B})
  --warmup N           warm-up calls per batch size before anything is profiled (default 10)
  --profiled-calls N   calls inside the NVTX range (default 1: ncu then sees exactly pass 1 + pass 2)
  --profiler-iters N   calls recorded by torch.profiler (default 20)
  --eager-iters N      calls timed eagerly (default 200)
  --graph-iters N      CUDA-graph replays timed (default 500; 0 skips the graph measurement)
  --no-timing          only the NVTX-ranged calls (fastest under ncu, which replays every kernel many times)
  --json PATH          write the results there (default: print only)
  --seed S             seed of the synthetic inputs and of verify (default 0)

Exit status: 0 on success, 2 when CUDA (or Triton) is unavailable, with a message on stderr.
"""
from __future__ import annotations

import argparse
import json
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description="Nsight Compute / torch.profiler harness for tilespec's fused kernels",
                                 formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    ap.add_argument("--batch", type=int, action="append", dest="batches", metavar="B")
    ap.add_argument("--k", type=int, default=5)
    ap.add_argument("--vocab", type=int, default=151936)
    ap.add_argument("--dtype", choices=("bf16", "fp16", "fp32"), default="bf16")
    ap.add_argument("--temperature", type=float, default=1.0)
    ap.add_argument("--top-k", type=int, default=0, help="top-k filter (default 0: none)")
    ap.add_argument("--top-p", type=float, default=1.0, help="top-p filter (default 1.0: none)")
    ap.add_argument("--draft", choices=("logits", "none"), default="logits")
    ap.add_argument("--method", default="fused")
    ap.add_argument("--warmup", type=int, default=10)
    ap.add_argument("--profiled-calls", type=int, default=1)
    ap.add_argument("--profiler-iters", type=int, default=20)
    ap.add_argument("--eager-iters", type=int, default=200)
    ap.add_argument("--graph-iters", type=int, default=500)
    ap.add_argument("--no-timing", action="store_true")
    ap.add_argument("--json", default=None, metavar="PATH")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    args.batches = args.batches or [1, 64]
    if min(args.batches) < 1 or args.k < 0 or args.vocab < 1:
        ap.error("batch sizes and the vocabulary must be >= 1, K >= 0")
    return args


def fail(message: str) -> "NoReturn":  # noqa: F821
    print(f"ncu_fused.py: {message}", file=sys.stderr)
    sys.exit(2)


def git_commit() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, timeout=10,
                              cwd=Path(__file__).resolve().parent).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def make_inputs(torch, batch: int, k: int, vocab: int, dtype, draft_kind: str, seed: int, device: str = "cuda"):
    """target ~ 3 N(0,1), draft = target + N(0,1) ("mid" acceptance), drafted tokens sampled from the draft."""
    gen = torch.Generator(device=device).manual_seed(seed)
    target = torch.randn(batch, k + 1, vocab, device=device, generator=gen) * 3.0
    draft = target[:, :k] + torch.randn(batch, k, vocab, device=device, generator=gen)
    if k > 0:
        tokens = torch.multinomial(torch.softmax(draft.reshape(-1, vocab), -1), 1, generator=gen).view(batch, k)
    else:
        tokens = torch.zeros(batch, 0, dtype=torch.int64, device=device)
    return (target.to(dtype).contiguous(), draft.to(dtype).contiguous() if draft_kind == "logits" else None,
            tokens.contiguous())


def kernel_events(prof) -> list:
    """(name, duration us) of every GPU kernel the profiler recorded."""
    from torch.autograd import DeviceType
    out = []
    for evt in prof.events():
        if getattr(evt, "device_type", None) == DeviceType.CUDA:
            out.append((evt.name, evt.time_range.elapsed_us()))
    return out


def summarise(events: list, calls: int) -> list[dict]:
    by_name: dict[str, list[float]] = {}
    for name, us in events:
        by_name.setdefault(name, []).append(us)
    rows = []
    for name, times in sorted(by_name.items(), key=lambda kv: -sum(kv[1])):
        rows.append({"name": name, "launches": len(times), "launches_per_call": len(times) / calls,
                     "total_us": round(sum(times), 3), "mean_us": round(sum(times) / len(times), 3),
                     "median_us": round(statistics.median(times), 3), "min_us": round(min(times), 3)})
    return rows


def main(argv=None) -> int:
    args = parse_args(argv)
    try:
        import torch
    except ImportError:
        fail("PyTorch is not installed")
    if not torch.cuda.is_available():
        fail("CUDA is not available (torch.cuda.is_available() is False); this script profiles GPU kernels and "
             "must run on a machine with an NVIDIA GPU and a CUDA build of PyTorch")
    try:
        import triton
    except ImportError:
        fail("Triton is not installed (pip install -e '.[gpu]')")
    from torch.profiler import ProfilerActivity, profile

    try:
        from tilespec import SamplingParams, verify
    except ImportError:  # not installed: use the checkout this script lives in
        sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "src"))
        from tilespec import SamplingParams, verify

    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[args.dtype]
    sampling = SamplingParams(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p)
    report = {"script": "bench/scripts/ncu_fused.py", "argv": sys.argv, "commit": git_commit(),
              "device": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
              "python": platform.python_version(), "date": time.strftime("%Y-%m-%d %H:%M:%S"),
              "config": {"k": args.k, "vocab": args.vocab, "dtype": args.dtype, "temperature": args.temperature,
                         "top_k": args.top_k, "top_p": args.top_p, "draft": args.draft, "method": args.method}, "runs": []}

    for batch in args.batches:
        target, draft, tokens = make_inputs(torch, batch, args.k, args.vocab, dtype, args.draft, args.seed)
        seeds = torch.arange(batch, device="cuda", dtype=torch.int64) + args.seed
        offsets = torch.full((batch,), 1000, device="cuda", dtype=torch.int64)

        def call():
            return verify(target, tokens, draft_logits=draft, sampling=sampling, method=args.method, seed=seeds,
                          offsets=offsets, check_values=False)

        for _ in range(max(1, args.warmup)):
            result = call()
        torch.cuda.synchronize()
        run = {"method": args.method, "batch": batch, "nvtx_range": f"tilespec_{args.method}_B{batch}", "profiled_calls": args.profiled_calls,
               "mean_accepted": float(result.num_accepted.float().mean())}

        # ---- the calls Nsight Compute should profile (filter: --nvtx --nvtx-include "tilespec_fused_B{B}/") ----
        torch.cuda.nvtx.range_push(run["nvtx_range"])
        for _ in range(args.profiled_calls):
            call()
        torch.cuda.nvtx.range_pop()
        torch.cuda.synchronize()

        if not args.no_timing:
            # ---- per-kernel CUDA time (torch.profiler / CUPTI) ----
            iters = max(1, args.profiler_iters)
            with profile(activities=[ProfilerActivity.CUDA]) as prof:
                for _ in range(iters):
                    call()
                torch.cuda.synchronize()
            events = kernel_events(prof)
            run["kernels"] = summarise(events, iters)
            run["kernel_launches_per_call"] = len(events) / iters
            names = [r["name"] for r in run["kernels"]]
            run["only_pass1_and_pass2"] = (len(events) == 2 * iters and len(names) == 2 and
                                           any("row_stats_stream_kernel" in n for n in names) and
                                           any("sample_wide_kernel" in n for n in names))
            run["kernel_us_per_call"] = round(sum(us for _, us in events) / iters, 3)

            # ---- eager host time per call (as tilespec bench verify: sync after each call) ----
            times = []
            for _ in range(max(1, args.eager_iters)):
                start = time.perf_counter()
                call()
                torch.cuda.synchronize()
                times.append((time.perf_counter() - start) * 1e6)
            run["eager_us_median"] = round(statistics.median(times), 2)
            run["eager_us_min"] = round(min(times), 2)
            # the method alone on prepared inputs (what `tilespec bench verify` reports as eager)
            from tilespec.verify.registry import get_method
            from tilespec.verify.validation import prepare_inputs
            inputs = prepare_inputs(target, tokens, draft_logits=draft, sampling=sampling, seed=seeds,
                                    offsets=offsets, check_values=False)
            method_fn = get_method(args.method).fn
            times = []
            for _ in range(max(1, args.eager_iters)):
                start = time.perf_counter()
                method_fn(inputs)
                torch.cuda.synchronize()
                times.append((time.perf_counter() - start) * 1e6)
            run["eager_method_only_us_median"] = round(statistics.median(times), 2)

            # ---- CUDA-graph replay time per call ----
            if args.graph_iters > 0:
                try:
                    graph = torch.cuda.CUDAGraph()
                    stream = torch.cuda.Stream()
                    stream.wait_stream(torch.cuda.current_stream())
                    with torch.cuda.stream(stream):
                        call()   # warm-up on the capture stream
                    torch.cuda.current_stream().wait_stream(stream)
                    torch.cuda.synchronize()
                    with torch.cuda.graph(graph):
                        captured = call()
                    graph.replay()
                    torch.cuda.synchronize()
                    eager = call()
                    run["graph_matches_eager"] = bool(torch.equal(captured.output_tokens, eager.output_tokens))
                    begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                    for _ in range(20):
                        graph.replay()
                    begin.record()
                    for _ in range(args.graph_iters):
                        graph.replay()
                    end.record()
                    torch.cuda.synchronize()
                    run["graph_us_per_call"] = round(begin.elapsed_time(end) * 1e3 / args.graph_iters, 3)
                except Exception as err:  # capture problems are reported, not fatal
                    run["graph_error"] = f"{type(err).__name__}: {err}"
        report["runs"].append(run)
        print(json.dumps(run), flush=True)

    if args.json:
        with open(args.json, "w") as fh:
            json.dump(report, fh, indent=1)
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
