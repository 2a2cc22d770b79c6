#!/usr/bin/env python3
"""Tuning sweep of the launch parameters of tilespec's ``fused`` verification (pass 1 ``row_stats_kernel``,
pass 2 ``sample_row_kernel``). Needs a CUDA GPU (or ``--device cpu`` with TRITON_INTERPRET=1 for a logic smoke
test on a tiny vocabulary); no network access.

The parameters are module globals of ``tilespec.verify.kernels.launch`` (CHUNK1, SUB1, CHUNKS_PER_PROGRAM, BLOCK2,
NUM_WARPS1, NUM_WARPS2, SAMPLE_TILES; fused no longer reads PROGRAMS_PER_SM); the plan cache key includes them, so
setting them at runtime selects a new plan (and Triton compiles a new constexpr variant, ~1 s each). For every
config the script sets the globals, and for every batch size: warms up (eager), checks that (num_emitted,
output_tokens) equal the DEFAULT config's exactly, captures one call in a CUDA graph and times ``--graph-iters``
replays with CUDA events, then restores the defaults.

Sweeps (pass 1 at default while pass 2 is swept, and vice versa):
  pass 2: SAMPLE_TILES in {1, 2, 4, 8} x NUM_WARPS2 in {2, 4, 8} x BLOCK2 in {512, 1024, 2048}
  pass 1: NUM_WARPS1 in {4, 8, 16} x CHUNK1 in {8192, 16384} x SUB1 in {1024, 2048, 4096, 8192}
          x CHUNKS_PER_PROGRAM in {1, 2, 4, 8} (96 configs: raise --time-budget or pick --sweeps pass1)
  stream: the classic pass 1 (PASS1=classic, with / without ALIGN_LOADS) and the stream pass 1 over
          (SUB1_STREAM, NUM_WARPS1_STREAM) x MAXNREG1 {0, 40} (+ 32 once) x CHUNKS_PER_PROGRAM {0 (auto), 1, 2, 4}
          x PREFETCH1 (no prefetch: CHUNKS_PER_PROGRAM 0 / 1 only)
          (see stream_configs; SUB1 / NUM_WARPS1 of the pass-1 sweep apply to PASS1=classic only)
  combo : per batch, the best pass-2 config (same outputs) with the best pass-1 config, if time is left
(--quick: SAMPLE_TILES {1, 4, 8, 16} x NUM_WARPS2 {4, 8} x BLOCK2 {1024}; NUM_WARPS1 {4, 8} x CHUNK1 {8192, 16384}
x SUB1 {2048} x CHUNKS_PER_PROGRAM {1, 2, 4}.)
Pass-2 parameters and CHUNKS_PER_PROGRAM must not change results (sampling is Gumbel-max keyed by vocabulary id;
each pass-1 chunk's arithmetic does not depend on how many chunks a program handles); CHUNK1 / SUB1 / NUM_WARPS1 may
change float rounding, so a mismatch there is recorded, not fatal. Errors are recorded per config.

Usage:
    python3 bench/scripts/tune_fused.py --json tune_fused.json                 # B = 1, 8, 64 (default)
    python3 bench/scripts/tune_fused.py --json t.json --batch 1 64 --quick
    TRITON_INTERPRET=1 python3 bench/scripts/tune_fused.py --device cpu --vocab 2048 --batch 1 --k 2 --quick

The JSON (rewritten after every config, so an interrupted run leaves what it measured) holds the device, versions,
date, config, the default config's times (graph replay, per-kernel times from torch.profiler), every row
{batch, params, graph_us, same_outputs, error, ...} and, per batch, the best config. Stops starting new configs
after --time-budget seconds (default 220).

Exit status: 0 on success, 2 when CUDA (or Triton) is unavailable, with a message on stderr.
"""
from __future__ import annotations

import argparse
import itertools
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from ncu_fused import git_commit, make_inputs  # noqa: E402  (same inputs as the profiling script)

PARAMS = ("CHUNK1", "SUB1", "CHUNKS_PER_PROGRAM", "BLOCK2", "NUM_WARPS1", "NUM_WARPS2", "SAMPLE_TILES", "PASS1",
          "SUB1_STREAM", "NUM_WARPS1_STREAM", "PREFETCH1", "MAXNREG1", "ALIGN_LOADS")
STREAM_PARAMS = ("PASS1", "SUB1_STREAM", "NUM_WARPS1_STREAM", "PREFETCH1", "MAXNREG1", "CHUNKS_PER_PROGRAM",
                 "ALIGN_LOADS")
PASS2_PARAMS = ("SAMPLE_TILES", "NUM_WARPS2", "BLOCK2")
PASS1_PARAMS = ("NUM_WARPS1", "CHUNK1", "SUB1", "CHUNKS_PER_PROGRAM")


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description="Launch-parameter tuning sweep for tilespec's fused verification",
                                 formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    ap.add_argument("--batch", type=int, nargs="+", default=None, metavar="B", help="batch sizes (default 1 8 64)")
    ap.add_argument("--k", type=int, default=5, help="draft tokens per request (default 5)")
    ap.add_argument("--vocab", type=int, default=151936, help="vocabulary size (default 151936)")
    ap.add_argument("--dtype", choices=("bf16", "fp16", "fp32"), default="bf16")
    ap.add_argument("--temperature", type=float, default=1.0)
    ap.add_argument("--quick", action="store_true", help="a smaller sweep")
    ap.add_argument("--sweeps", nargs="+", choices=("pass2", "pass1", "stream"), default=["pass2", "pass1"],
                    help="which sweeps to run, in this order (default: pass2 pass1; stream: the pass-1 "
                         "kernels, see stream_configs)")
    ap.add_argument("--json", default=None, metavar="PATH", help="write the results there")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--warmup", type=int, default=3, help="eager warm-up calls per config and batch (default 3)")
    ap.add_argument("--graph-iters", type=int, default=200, help="timed CUDA-graph replays (default 200)")
    ap.add_argument("--profiler-iters", type=int, default=20,
                    help="calls recorded by torch.profiler for the default / best configs (0 = skip; default 20)")
    ap.add_argument("--time-budget", type=float, default=220.0,
                    help="seconds after which no new config is started (default 220)")
    ap.add_argument("--device", choices=("cuda", "cpu"), default="cuda",
                    help="cpu: smoke test of the logic (TRITON_INTERPRET=1, tiny vocab; wall time, no graphs)")
    ap.add_argument("--cpu-iters", type=int, default=2, help="timed calls per config with --device cpu")
    args = ap.parse_args(argv)
    args.batches = args.batch or [1, 8, 64]
    if min(args.batches) < 1 or args.k < 0 or args.vocab < 1:
        ap.error("batch sizes and the vocabulary must be >= 1, K >= 0")
    return args


def fail(message: str) -> "NoReturn":  # noqa: F821
    print(f"tune_fused.py: {message}", file=sys.stderr)
    sys.exit(2)


def config_list(defaults: dict, quick: bool, sweeps=("pass2", "pass1")) -> list[tuple[str, dict]]:
    """[(sweep name, full params)]: pass-2 sweep with pass 1 at default, then pass-1 sweep with pass 2 at default."""
    if quick:
        p2 = dict(SAMPLE_TILES=[1, 4, 8, 16], NUM_WARPS2=[4, 8], BLOCK2=[1024])   # (BLOCK2 1024 = the law's tile)
        p1 = dict(NUM_WARPS1=[4, 8], CHUNK1=[8192, 16384], SUB1=[2048], CHUNKS_PER_PROGRAM=[1, 2, 4])
    else:
        p2 = dict(SAMPLE_TILES=[1, 2, 4, 8], NUM_WARPS2=[2, 4, 8], BLOCK2=[512, 1024, 2048])
        p1 = dict(NUM_WARPS1=[4, 8, 16], CHUNK1=[8192, 16384], SUB1=[1024, 2048, 4096, 8192],
                  CHUNKS_PER_PROGRAM=[1, 2, 4, 8])
    out = []
    for sweep in sweeps:
        if sweep == "stream":
            out += [("stream", dict(defaults, **params)) for params in stream_configs(quick)]
            continue
        grid = {"pass2": p2, "pass1": p1}[sweep]
        names = list(grid)
        for values in itertools.product(*(grid[n] for n in names)):
            params = dict(defaults)
            params.update(zip(names, values))
            out.append((sweep, params))
    return out


def stream_configs(quick: bool) -> list[dict]:
    """The stream sweep: the previous pass 1 (classic, with and without 16-byte pass-2 loads) first,
    then the stream pass 1 over (slice width, warps) x register cap x CHUNKS_PER_PROGRAM (0 = auto) x prefetch.
    Slice width and warps change the fp32 order of the sums (so may change a token at a rounding boundary); the
    rest moves no bits."""
    out = [dict(PASS1="classic", ALIGN_LOADS=False), dict(PASS1="classic", ALIGN_LOADS=True)]
    shapes = [(2048, 8), (1024, 4), (4096, 16)] if not quick else [(2048, 8), (1024, 4)]
    for (sub, warps), maxnreg, cpp, prefetch in itertools.product(shapes, (0, 40), (0, 1, 2, 4), (True, False)):
        if not prefetch and cpp not in (0, 1):
            continue
        out.append(dict(PASS1="stream", SUB1_STREAM=sub, NUM_WARPS1_STREAM=warps, MAXNREG1=maxnreg,
                        CHUNKS_PER_PROGRAM=cpp, PREFETCH1=prefetch, ALIGN_LOADS=True))
    out.append(dict(PASS1="stream", SUB1_STREAM=2048, NUM_WARPS1_STREAM=8, MAXNREG1=32, CHUNKS_PER_PROGRAM=0,
                    PREFETCH1=True, ALIGN_LOADS=True))   # full occupancy, with spills (offline: 88 LDL/STL)
    return out


def short(params: dict) -> str:
    return " ".join(f"{k}={params[k]}" for k in PARAMS if k in params)


class Tuner:
    def __init__(self, args, torch, launch, verify, SamplingParams):
        self.args, self.torch, self.launch, self.verify = args, torch, launch, verify
        self.sampling = SamplingParams(temperature=args.temperature)
        self.cuda = args.device == "cuda"
        self.defaults = {p: getattr(launch, p) for p in PARAMS}
        self.inputs = {}
        self.reference = {}

    # ---- globals ----
    def set_params(self, params: dict) -> None:
        for name, value in params.items():
            setattr(self.launch, name, value)

    def restore(self) -> None:
        self.set_params(self.defaults)

    # ---- one call ----
    def caller(self, batch: int):
        target, draft, tokens, seeds, offsets = self.inputs[batch]

        def call():
            return self.verify(target, tokens, draft_logits=draft, sampling=self.sampling, method="fused",
                               seed=seeds, offsets=offsets, check_values=False)
        return call

    def sync(self) -> None:
        if self.cuda:
            self.torch.cuda.synchronize()

    def time_graph(self, call) -> tuple[float, bool]:
        """(us per call over graph replays, whether the graph's outputs equal an eager call's)."""
        torch = self.torch
        if not self.cuda:
            times = []
            for _ in range(max(1, self.args.cpu_iters)):
                start = time.perf_counter()
                call()
                times.append((time.perf_counter() - start) * 1e6)
            return statistics.median(times), True
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(max(1, self.args.warmup)):
                call()
        torch.cuda.current_stream().wait_stream(stream)
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            captured = call()
        graph.replay()
        torch.cuda.synchronize()
        eager = call()
        torch.cuda.synchronize()
        matches = bool(torch.equal(captured.output_tokens, eager.output_tokens)
                       and torch.equal(captured.num_emitted, eager.num_emitted))
        for _ in range(10):
            graph.replay()
        begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        iters = max(1, self.args.graph_iters)
        begin.record()
        for _ in range(iters):
            graph.replay()
        end.record()
        torch.cuda.synchronize()
        us = begin.elapsed_time(end) * 1e3 / iters
        del graph, captured
        return us, matches

    def kernel_times(self, call) -> list[dict]:
        """Per-kernel mean CUDA time (torch.profiler) over --profiler-iters eager calls."""
        if not self.cuda or self.args.profiler_iters <= 0:
            return []
        torch = self.torch
        from torch.autograd import DeviceType
        from torch.profiler import ProfilerActivity, profile
        iters = self.args.profiler_iters
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(iters):
                call()
            torch.cuda.synchronize()
        by_name: dict[str, list[float]] = {}
        for evt in prof.events():
            if getattr(evt, "device_type", None) == DeviceType.CUDA:
                by_name.setdefault(evt.name, []).append(evt.time_range.elapsed_us())
        return [{"name": name, "launches_per_call": len(t) / iters, "mean_us": round(sum(t) / len(t), 3),
                 "median_us": round(statistics.median(t), 3), "us_per_call": round(sum(t) / iters, 3)}
                for name, t in sorted(by_name.items(), key=lambda kv: -sum(kv[1]))]

    # ---- one config at one batch ----
    def measure(self, batch: int, params: dict, sweep: str, profile_kernels: bool = False) -> dict:
        torch = self.torch
        row = {"batch": batch, "sweep": sweep, "params": dict(params),
               "is_default": params == self.defaults, "graph_us": None, "same_outputs": None,
               "graph_matches_eager": None, "first_call_s": None, "error": None}
        try:
            self.set_params(params)
            call = self.caller(batch)
            start = time.perf_counter()
            result = call()
            self.sync()
            row["first_call_s"] = round(time.perf_counter() - start, 3)
            for _ in range(max(0, self.args.warmup - 1)):
                result = call()
            self.sync()
            ref = self.reference.get(batch)
            if ref is None:
                self.reference[batch] = (result.num_emitted.clone(), result.output_tokens.clone())
                row["same_outputs"] = True
                row["mean_accepted"] = round(float(result.num_accepted.float().mean()), 4)
            else:
                row["same_outputs"] = bool(torch.equal(result.num_emitted, ref[0])
                                           and torch.equal(result.output_tokens, ref[1]))
                if not row["same_outputs"]:
                    row["mismatched_requests"] = int(((result.output_tokens != ref[1]).any(-1)
                                                      | (result.num_emitted != ref[0])).sum())
            us, matches = self.time_graph(call)
            row["graph_us"] = round(us, 3)
            row["graph_matches_eager"] = matches
            if profile_kernels:
                row["kernels"] = self.kernel_times(call)
        except Exception as err:  # noqa: BLE001 - one bad config must not end the sweep
            row["error"] = f"{type(err).__name__}: {err}"[:2000]
            try:
                self.sync()
            except Exception as err2:  # noqa: BLE001 - e.g. a sticky CUDA error: later configs will fail too
                row["error"] += f" | sync after error: {type(err2).__name__}: {err2}"[:500]
        finally:
            self.restore()
        return row


def best_rows(rows: list[dict], batch: int) -> dict:
    ok = [r for r in rows if r["batch"] == batch and r["error"] is None and r["graph_us"] is not None]
    same = [r for r in ok if r["same_outputs"]]
    pick = lambda rs, sweep=None: min((r for r in rs if sweep is None or r["sweep"] == sweep),  # noqa: E731
                                      key=lambda r: r["graph_us"], default=None)
    brief = lambda r: None if r is None else {"params": r["params"], "graph_us": r["graph_us"],  # noqa: E731
                                                 "sweep": r["sweep"], "same_outputs": r["same_outputs"]}
    return {"best_same_outputs": brief(pick(same)), "best_any": brief(pick(ok)),
            "best_pass2": brief(pick(same, "pass2")), "best_pass1": brief(pick(ok, "pass1")),
            "best_pass1_same_outputs": brief(pick(same, "pass1")), "best_stream": brief(pick(ok, "stream"))}


def main(argv=None) -> int:
    args = parse_args(argv)
    t0 = time.perf_counter()
    try:
        import torch
    except ImportError:
        fail("PyTorch is not installed")
    if args.device == "cuda" and not torch.cuda.is_available():
        fail("CUDA is not available (torch.cuda.is_available() is False); this script times GPU kernels and must "
             "run on a machine with an NVIDIA GPU and a CUDA build of PyTorch (for a CPU logic smoke test use "
             "TRITON_INTERPRET=1 ... --device cpu --vocab 2048 --batch 1 --k 2 --quick)")
    if args.device == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
        fail("--device cpu needs TRITON_INTERPRET=1 in the environment")
    try:
        import triton
    except ImportError:
        fail("Triton is not installed (pip install -e '.[gpu]')")
    try:
        from tilespec import SamplingParams, verify
    except ImportError:  # not installed: use the checkout this script lives in
        sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "src"))
        from tilespec import SamplingParams, verify
    from tilespec.verify.kernels import launch

    tuner = Tuner(args, torch, launch, verify, SamplingParams)
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[args.dtype]
    device_name = torch.cuda.get_device_name() if args.device == "cuda" else f"cpu (TRITON_INTERPRET) {platform.processor()}"
    report = {"script": "bench/scripts/tune_fused.py", "argv": sys.argv, "commit": git_commit(), "device": device_name,
              "torch": torch.__version__, "triton": triton.__version__, "python": platform.python_version(),
              "date": time.strftime("%Y-%m-%d %H:%M:%S"),
              "sm_count": launch._sm_count(torch.device(args.device)),
              "config": {"batches": args.batches, "k": args.k, "vocab": args.vocab, "dtype": args.dtype,
                         "temperature": args.temperature, "quick": args.quick, "graph_iters": args.graph_iters,
                         "warmup": args.warmup, "time_budget_s": args.time_budget, "timing": "cuda-graph replay"
                         if args.device == "cuda" else "cpu wall time (interpreter; meaningless as a speed)"},
              "defaults": dict(tuner.defaults), "default_runs": {}, "rows": [], "best": {}, "combo": [],
              "complete": False, "stopped_by_budget": False, "elapsed_s": None}

    def elapsed() -> float:
        return time.perf_counter() - t0

    def write() -> None:
        report["elapsed_s"] = round(elapsed(), 1)
        report["best"] = {str(b): best_rows(report["rows"] + report["combo"], b) for b in args.batches}
        if args.json:
            tmp = args.json + ".tmp"
            with open(tmp, "w") as fh:
                json.dump(report, fh, indent=1)
            os.replace(tmp, args.json)

    def show(row: dict) -> None:
        status = (f"graph_us={row['graph_us']:9.3f}" if row["graph_us"] is not None else "graph_us=     n/a")
        extra = f" ERROR {row['error']}" if row["error"] else ""
        print(f"[{elapsed():6.1f}s] {row['sweep']:7s} B={row['batch']:<4d} {short(row['params'])}  {status} "
              f"same={row['same_outputs']} graph_ok={row['graph_matches_eager']} "
              f"first={row['first_call_s']}s{extra}", flush=True)

    print(f"device {device_name}, torch {torch.__version__}, triton {triton.__version__}, "
          f"SMs {report['sm_count']}, defaults {short(tuner.defaults)}", flush=True)
    for batch in args.batches:
        target, draft, tokens = make_inputs(torch, batch, args.k, args.vocab, dtype, "logits", args.seed, args.device)
        seeds = torch.arange(batch, device=args.device, dtype=torch.int64) + args.seed
        offsets = torch.full((batch,), 1000, device=args.device, dtype=torch.int64)
        tuner.inputs[batch] = (target, draft, tokens, seeds, offsets)
    tuner.sync()
    print(f"[{elapsed():6.1f}s] inputs built", flush=True)

    # ---- 1. the default config: reference outputs and times ----
    for batch in args.batches:
        row = tuner.measure(batch, tuner.defaults, "default", profile_kernels=True)
        report["default_runs"][str(batch)] = row
        show(row)
        for k in row.get("kernels", []):
            print(f"         kernel {k['name'][:60]:60s} {k['us_per_call']:9.3f} us/call "
                  f"({k['launches_per_call']:.1f} launches/call)", flush=True)
        if row["error"]:
            print(f"default config failed at B={batch}; later configs at this batch are compared to nothing",
                  flush=True)
    write()

    # ---- 2. the sweeps (config outer, batch inner: each constexpr variant compiles once) ----
    stopped = False
    configs = config_list(tuner.defaults, args.quick, args.sweeps)
    report["n_configs"] = len(configs)
    sweep_start = elapsed()
    print(f"[{elapsed():6.1f}s] sweeping {len(configs)} configs x {len(args.batches)} batch sizes", flush=True)
    for i, (sweep, params) in enumerate(configs):
        if elapsed() > args.time_budget:
            stopped = True
            print(f"[{elapsed():6.1f}s] --time-budget {args.time_budget} s reached after {i}/{len(configs)} "
                  f"configs; stopping", flush=True)
            break
        if i in (2, 10):
            per = (elapsed() - sweep_start) / i
            print(f"[{elapsed():6.1f}s] ~{per:.1f} s/config: projected sweep end at "
                  f"{sweep_start + per * len(configs):.0f} s (budget {args.time_budget:.0f} s)", flush=True)
        for batch in args.batches:
            row = tuner.measure(batch, params, sweep)
            report["rows"].append(row)
            show(row)
        write()

    # ---- 3. combo: best pass-2 (same outputs) + best pass-1, per batch, then kernel times of the best ----
    if not stopped:
        for batch in args.batches:
            if elapsed() > args.time_budget:
                stopped = True
                break
            best = best_rows(report["rows"], batch)
            b2, b1 = best["best_pass2"], best["best_pass1"]
            if b2 is None or b1 is None:
                continue
            params = dict(tuner.defaults)
            params.update({p: b2["params"][p] for p in PASS2_PARAMS})
            params.update({p: b1["params"][p] for p in PASS1_PARAMS})
            if params in (b2["params"], b1["params"]):
                continue
            row = tuner.measure(batch, params, "combo")
            report["combo"].append(row)
            show(row)
            write()
    if not stopped:
        for batch in args.batches:
            if elapsed() > args.time_budget:
                stopped = True
                break
            best = best_rows(report["rows"] + report["combo"], batch)["best_same_outputs"]
            if best is None or best["params"] == tuner.defaults:
                continue
            row = tuner.measure(batch, best["params"], "best", profile_kernels=True)   # re-measured + kernels
            report.setdefault("best_runs", {})[str(batch)] = row
            show(row)
            for k in row.get("kernels", []):
                print(f"         kernel {k['name'][:60]:60s} {k['us_per_call']:9.3f} us/call", flush=True)
            write()

    report["stopped_by_budget"] = stopped
    report["complete"] = not stopped
    write()
    print(f"\n[{elapsed():6.1f}s] done{' (stopped by --time-budget)' if stopped else ''}", flush=True)
    for batch in args.batches:
        d = report["default_runs"].get(str(batch), {})
        best = report["best"][str(batch)]
        print(f"B={batch}: default {d.get('graph_us')} us", flush=True)
        for label in ("best_same_outputs", "best_any", "best_pass2", "best_pass1", "best_stream"):
            b = best[label]
            if b is not None:
                print(f"    {label:18s} {b['graph_us']:9.3f} us  {short(b['params'])}  same={b['same_outputs']}",
                      flush=True)
    if args.json:
        print(f"wrote {args.json}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
