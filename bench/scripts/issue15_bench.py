#!/usr/bin/env python3
"""Issue 15: the ``fused`` verification's kernel variants side by side in one process, with ``sigmoid`` as the
yardstick (GPU; ``--device cpu`` with TRITON_INTERPRET=1 is a logic smoke test on a tiny vocabulary).

Variants are module globals of ``tilespec.verify.kernels.launch`` (the plan cache keys on them), set in turn:
  s12             session 12's defaults: lane-wise stream pass 1, one-tile pass 2 (sample_row_kernel), no ftz exp,
                  no programmatic dependent launch
  new             the defaults (session 13: grouped stream pass 1, wide pass 2, ex2.approx.ftz, PDL)
  new-group1 / new-tilepass2 / new-nopdl / new-pf1   new with one of the changes undone
  new-cap48 / new-cap0, new-cpp4, new-wide4w4 / new-wide8: launch-parameter ablations
  old             the code before issue 15 part 2 (classic pass 1, 2-byte loads)
For each batch size (default 1 and 64; K=5, V=151,936, bf16, T=1, "mid" inputs of ``ncu_fused.make_inputs``):
per variant, the fraction of rows identical to ``reference`` (tokens and acceptance count), graph replay == eager,
CUDA-graph replay time (CUDA events), eager time (median host wall time per call with a sync after it), and per-kernel
CUDA times (torch.profiler; pass 1 / pass 2 per call in ``split``); then ``sigmoid`` (graph / eager); with
--filters, top-k 50 and top-p 0.9 for old / new / sigmoid (graph). The JSON (rewritten after every row) holds the
device, versions, commit and every raw number; a summary table is printed last. Stops starting new rows after --time-budget seconds.

    python3 bench/scripts/issue15_bench.py --json issue15.json --filters
    TRITON_INTERPRET=1 python3 bench/scripts/issue15_bench.py --device cpu --vocab 4096 --batch 2 --iters 2
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from ncu_fused import git_commit, make_inputs, summarise, kernel_events  # noqa: E402

VARIANTS = {
    "s12": dict(GROUP1=1, PASS2="tile", FAST_EXP=False, PDL=False, PREFETCH1=1),   # session 12's defaults
    "new": dict(),
    "new-group1": dict(GROUP1=1),
    "new-tilepass2": dict(PASS2="tile"),
    "new-nopdl": dict(PDL=False),
    "new-pf1": dict(PREFETCH1=1),
    "new-cap48": dict(MAXNREG1=48),
    "new-cap0": dict(MAXNREG1=0),
    "new-cpp4": dict(CHUNKS_PER_PROGRAM=4),
    "new-wide4w4": dict(NUM_WARPS2_WIDE=4),
    "new-wide8": dict(WIDE_TILES=8),
    "old": dict(PASS1="classic", ALIGN_LOADS=False, SAMPLE_TILES=1, GROUP1=1, PASS2="tile", FAST_EXP=False,
                PDL=False, PREFETCH1=1),
}
FILTERS = {"top-k 50": dict(top_k=50), "top-p 0.9": dict(top_p=0.9)}


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 64])
    ap.add_argument("--k", type=int, default=5)
    ap.add_argument("--vocab", type=int, default=151936)
    ap.add_argument("--dtype", choices=("bf16", "fp16", "fp32"), default="bf16")
    ap.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS))
    ap.add_argument("--filters", action="store_true", help="also top-k 50 / top-p 0.9 (old, new, sigmoid)")
    ap.add_argument("--iters", type=int, default=200, help="graph replays timed (default 200)")
    ap.add_argument("--eager-iters", type=int, default=60, help="eager calls timed (default 60)")
    ap.add_argument("--profiler-iters", type=int, default=10)
    ap.add_argument("--time-budget", type=float, default=200.0)
    ap.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    ap.add_argument("--json", default=None)
    return ap.parse_args(argv)


class Bench:
    def __init__(self, args, torch, launch, verify, SamplingParams):
        self.args, self.torch, self.launch, self.verify, self.SP = args, torch, launch, verify, SamplingParams
        self.cuda = args.device == "cuda"
        self.defaults = {name: getattr(launch, name) for v in VARIANTS.values() for name in v}

    def set_variant(self, name: str) -> None:
        for key, value in self.defaults.items():
            setattr(self.launch, key, value)
        for key, value in VARIANTS[name].items():
            setattr(self.launch, key, value)

    def sync(self):
        if self.cuda:
            self.torch.cuda.synchronize()

    def caller(self, inputs, method: str, sampling):
        target, draft, tokens, seeds, offsets = inputs

        def call():
            return self.verify(target, tokens, draft_logits=draft, sampling=sampling, method=method, seed=seeds,
                               offsets=offsets, check_values=False)
        return call

    def eager_us(self, call) -> float:
        times = []
        for _ in range(max(1, self.args.eager_iters if self.cuda else 1)):
            start = time.perf_counter()
            call()
            self.sync()
            times.append((time.perf_counter() - start) * 1e6)
        return statistics.median(times)

    def graph_us(self, call):
        """(us per replay, replay == eager)."""
        torch = self.torch
        if not self.cuda:
            return None, None
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(3):
                call()
        torch.cuda.current_stream().wait_stream(side)
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            captured = call()
        graph.replay()
        torch.cuda.synchronize()
        eager = call()
        torch.cuda.synchronize()
        same = bool(torch.equal(captured.output_tokens, eager.output_tokens))
        for _ in range(10):
            graph.replay()
        begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        begin.record()
        for _ in range(self.args.iters):
            graph.replay()
        end.record()
        torch.cuda.synchronize()
        us = begin.elapsed_time(end) * 1e3 / self.args.iters
        del graph, captured
        return us, same

    def kernels(self, call) -> list:
        if not self.cuda or self.args.profiler_iters <= 0:
            return []
        from torch.profiler import ProfilerActivity, profile
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(self.args.profiler_iters):
                call()
            self.torch.cuda.synchronize()
        rows = summarise(kernel_events(prof), self.args.profiler_iters)
        for k in rows:   # (summarise gives totals over the profiled calls; run 1 crashed reading a missing key)
            k["us_per_call"] = round(k["total_us"] / self.args.profiler_iters, 3)
        return rows

    def row(self, batch, inputs, variant, method, filt, ref=None) -> dict:
        row = dict(batch=batch, variant=variant, method=method, filter=filt, graph_us=None, eager_us=None,
                   graph_matches_eager=None, same_rows_as_reference=None, kernels=[], error=None)
        try:
            self.set_variant(variant if method == "fused" else "new")
            sampling = self.SP(temperature=1.0, **FILTERS.get(filt, {}))
            call = self.caller(inputs, method, sampling)
            start = time.perf_counter()
            got = call()
            self.sync()
            row["first_call_s"] = round(time.perf_counter() - start, 3)
            if ref is not None:
                same = (got.output_tokens == ref.output_tokens).all(1) & (got.num_accepted == ref.num_accepted)
                row["same_rows_as_reference"] = float(same.float().mean())
            row["mean_accepted"] = float(got.num_accepted.float().mean())
            row["graph_us"], row["graph_matches_eager"] = self.graph_us(call)
            row["eager_us"] = self.eager_us(call)
            if filt == "none":
                row["kernels"] = self.kernels(call)
                row["split"] = split(row["kernels"])
        except Exception as err:  # noqa: BLE001 - one failing row must not end the run
            row["error"] = f"{type(err).__name__}: {err}"[:1500]
            try:
                self.sync()
            except Exception as err2:  # noqa: BLE001
                row["error"] += f" | sync: {err2}"[:300]
        finally:
            self.set_variant("new")
        return row


def main(argv=None) -> int:
    args = parse_args(argv)
    t0 = time.perf_counter()
    import torch
    if args.device == "cuda" and not torch.cuda.is_available():
        print("issue15_bench.py: CUDA is not available", file=sys.stderr)
        return 2
    import triton
    try:
        from tilespec import SamplingParams, verify
    except ImportError:
        sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "src"))
        from tilespec import SamplingParams, verify
    from tilespec.verify.kernels import launch
    bench = Bench(args, torch, launch, verify, SamplingParams)
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[args.dtype]
    report = dict(script="bench/scripts/issue15_bench.py", argv=sys.argv,
                  commit=os.environ.get("TILESPEC_COMMIT") or git_commit(),
                  device=torch.cuda.get_device_name() if bench.cuda else "cpu (TRITON_INTERPRET)",
                  torch=torch.__version__, triton=triton.__version__, python=platform.python_version(),
                  date=time.strftime("%Y-%m-%d %H:%M:%S"),
                  config=dict(batches=args.batch, k=args.k, vocab=args.vocab, dtype=args.dtype, temperature=1.0,
                              graph_iters=args.iters, eager_iters=args.eager_iters),
                  variants={v: VARIANTS[v] for v in args.variants}, defaults=bench.defaults, rows=[],
                  stopped_by_budget=False)

    def write():
        report["elapsed_s"] = round(time.perf_counter() - t0, 1)
        if args.json:
            Path(args.json + ".tmp").write_text(json.dumps(report, indent=1))
            os.replace(args.json + ".tmp", args.json)

    plan = []
    for batch in args.batch:
        plan += [(batch, v, "fused", "none") for v in args.variants] + [(batch, "new", "sigmoid", "none")]
    if args.filters:
        for batch in args.batch:
            for filt in FILTERS:
                plan += [(batch, v, "fused", filt) for v in ("s12", "new")] + [(batch, "new", "sigmoid", filt)]
    inputs, refs = {}, {}
    for batch, variant, method, filt in plan:
        if time.perf_counter() - t0 > args.time_budget:
            report["stopped_by_budget"] = True
            print(f"--time-budget reached: {len(report['rows'])}/{len(plan)} rows", flush=True)
            break
        if batch not in inputs:
            target, draft, tokens = make_inputs(torch, batch, args.k, args.vocab, dtype, "logits", 0, args.device)
            seeds = torch.arange(batch, device=args.device, dtype=torch.int64)
            offsets = torch.full((batch,), 1000, device=args.device, dtype=torch.int64)
            inputs[batch] = (target, draft, tokens, seeds, offsets)
        if method == "fused" and (batch, filt) not in refs:
            refs[(batch, filt)] = bench.caller(inputs[batch], "reference",
                                               SamplingParams(temperature=1.0, **FILTERS.get(filt, {})))()
        row = bench.row(batch, inputs[batch], variant, method, filt, refs.get((batch, filt)))
        report["rows"].append(row)
        fmt = lambda x: "-" if x is None else f"{x:9.1f}"  # noqa: E731
        print(f"[{time.perf_counter() - t0:6.1f}s] B={batch:<3d} {method:7s} {variant:14s} {filt:9s} graph "
              f"{fmt(row['graph_us'])} us eager {fmt(row['eager_us'])} us same-as-ref "
              f"{row['same_rows_as_reference']} graph==eager {row['graph_matches_eager']}"
              f"{' ERROR ' + row['error'] if row['error'] else ''}", flush=True)
        for k in row["kernels"]:
            print(f"           kernel {k['name'][:50]:50s} {k.get('us_per_call', 0.0):8.2f} us/call "
                  f"({k.get('launches_per_call', 0):.0f} launches/call)", flush=True)
        write()
    write()
    summary(report)
    return 0


def split(kernels: list) -> dict:
    """CUDA time per call of pass 1 (``row_stats*``), pass 2 (``*sample*``) and anything else (us; None if absent).
    Profiled eagerly, one kernel at a time: graph replay adds the gap between the two launches."""
    out = dict(pass1_us=None, pass2_us=None, other_us=None)
    for k in kernels:
        key = "pass1_us" if "row_stats" in k["name"] else "pass2_us" if "sample" in k["name"] else "other_us"
        out[key] = round((out[key] or 0.0) + k.get("us_per_call", 0.0), 3)
    return out


def summary(report: dict) -> None:
    rows = [r for r in report["rows"] if r["error"] is None]
    sig = {(r["batch"], r["filter"]): r for r in rows if r["method"] == "sigmoid"}
    print("\nsummary (us; graph replay / eager; ratio = fused graph / sigmoid graph)")
    print(f"{'B':>3} {'filter':9} {'variant':16} {'graph':>8} {'eager':>8} {'x sigmoid':>9} {'pass1':>7} {'pass2':>7} "
          f"{'same-as-ref':>11}")
    f = lambda x, w: f"{x:{w}.1f}" if isinstance(x, (int, float)) else f"{'-':>{w}}"  # noqa: E731
    for r in rows:
        s = sig.get((r["batch"], r["filter"]))
        ratio = (f"{r['graph_us'] / s['graph_us']:9.2f}" if s and r["graph_us"] and s["graph_us"] else f"{'-':>9}")
        name = r["variant"] if r["method"] == "fused" else "sigmoid"
        sp = r.get("split") or {}
        print(f"{r['batch']:>3} {r['filter']:9} {name:16} {f(r['graph_us'], 8)} {f(r['eager_us'], 8)} {ratio} "
              f"{f(sp.get('pass1_us'), 7)} {f(sp.get('pass2_us'), 7)} {str(r['same_rows_as_reference']):>11}")
    print("(pass1 / pass2: CUDA time per call of each launch, torch.profiler over eager calls; sigmoid's single "
          "launch is listed as pass2)")


if __name__ == "__main__":
    sys.exit(main())
