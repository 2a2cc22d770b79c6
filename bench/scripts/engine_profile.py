"""GPU: where a decoding step's time goes beyond the model forward (torch.profiler over whole engine generations).

Usage: python3 bench/scripts/engine_profile.py --json OUT.json [--tokens 128] [--batch 1]
Random-initialised Qwen2.5-1.5B / 0.5B shapes (timing only). For target-only decoding, n-gram drafting (γ=5, on a
repetitive prompt so the drafter proposes) and the 0.5B draft model at γ=2, 3 it records wall time per generated token, the GPU's busy time (union of
kernel intervals) and idle gaps per step, the kernels per step grouped by name, and the forward graph's own replay
time, so the difference between "one forward" and "one step" is attributed to kernels or to idle GPU.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(__file__))
from native_forward import random_model, time_replays  # noqa: E402


def kernel_intervals(prof) -> list:
    """(start_us, end_us, name) of every device kernel / memcpy / memset in the trace, sorted by start."""
    out = []
    for ev in prof.events():
        if getattr(ev, "device_type", None) is not None and str(ev.device_type).endswith("CUDA") and ev.time_range:
            out.append((ev.time_range.start, ev.time_range.end, ev.name))
    return sorted(out)


def busy_and_gaps(intervals: list) -> tuple:
    """Union length of the intervals and the idle gaps between them (µs)."""
    busy, gaps, end = 0.0, [], None
    for s, e, _ in intervals:
        if end is None:
            busy, end = e - s, e
            continue
        if s > end:
            gaps.append(s - end)
            busy += e - s
            end = e
        elif e > end:
            busy += e - end
            end = e
    return busy, gaps


def kernels_by_name(intervals: list, steps: int) -> list:
    """Kernels grouped by name (first 110 characters), costliest first: name, calls and µs per step."""
    by_name: dict = {}
    for s, e, n in intervals:
        row = by_name.setdefault(n[:110], [0, 0.0])
        row[0] += 1
        row[1] += e - s
    return sorted(({"name": n, "calls_per_step": c / steps, "us_per_step": t / steps} for n, (c, t) in by_name.items()),
                  key=lambda r: -r["us_per_step"])


HOST_PROFILE = False


def host_profile(dec, prompts, tokens: int, steps: int, top: int = 25) -> list:
    """cProfile of one generation: the host functions with the most own time (µs per step), to find what keeps
    the GPU idle between steps."""
    import cProfile
    import pstats
    prof = cProfile.Profile()
    torch.cuda.synchronize()
    prof.enable()
    dec.generate(input_ids=prompts, max_new_tokens=tokens)
    torch.cuda.synchronize()
    prof.disable()
    st = pstats.Stats(prof)
    rows = []
    for (fname, line, func), (cc, nc, tt, ct, _) in st.stats.items():
        rows.append(dict(func=f"{os.path.basename(fname)}:{line}:{func}", calls_per_step=nc / steps,
                         own_us_per_step=1e6 * tt / steps, cum_us_per_step=1e6 * ct / steps))
    rows.sort(key=lambda r: -r["own_us_per_step"])
    for r in rows[:12]:
        print(f"    host {r['own_us_per_step']:8.1f} us own, {r['cum_us_per_step']:8.1f} cum  x{r['calls_per_step']:.1f}"
              f"  {r['func'][:90]}", flush=True)
    by_cum = sorted(rows, key=lambda r: -r["cum_us_per_step"])[:top]
    return dict(by_own=rows[:top], by_cum=by_cum)


def profile_generation(dec, prompts, tokens: int, label: str, top: int = 20) -> dict:
    from torch.profiler import ProfilerActivity, profile
    dec.generate(input_ids=prompts, max_new_tokens=tokens)        # warm: compiles and captures
    dec.generate(input_ids=prompts, max_new_tokens=tokens)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    out = dec.generate(input_ids=prompts, max_new_tokens=tokens)
    torch.cuda.synchronize()
    wall_plain = time.perf_counter() - t0
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        out_p = dec.generate(input_ids=prompts, max_new_tokens=tokens)
        torch.cuda.synchronize()
    steps = max(1, out_p.stats.steps)
    host = host_profile(dec, prompts, tokens, steps) if HOST_PROFILE else None
    iv = kernel_intervals(prof)
    span = (iv[-1][1] - iv[0][0]) if iv else 0.0
    busy, gaps = busy_and_gaps(iv)
    rows = kernels_by_name(iv, steps)
    gaps.sort(reverse=True)
    res = dict(label=label, tokens=out.stats.new_tokens, steps=steps, wall_s=wall_plain,
               tok_s=out.stats.new_tokens / wall_plain, runtime=out.stats.runtime,
               profiled_tok_s=out_p.stats.new_tokens / max(out_p.stats.wall_time, 1e-9),
               kernel_span_us=span, gpu_busy_us=busy, gpu_idle_us=span - busy, busy_share=busy / span if span else None,
               kernels_per_step=len(iv) / steps, busy_us_per_step=busy / steps, idle_us_per_step=(span - busy) / steps,
               largest_gaps_us=gaps[:15], gaps_over_20us=sum(1 for g in gaps if g > 20), top=rows[:top],
               alpha=out.stats.alpha, fallback_at_step=out.stats.fallback_at_step, phase_s=dict(out.stats.times), phase_ms_per_step={k: 1e3 * v / steps for k, v in out_p.stats.times.items()},
               target_forward_ms=getattr(out.stats, "target_forward_ms", None),
               draft_forward_ms=getattr(out.stats, "draft_forward_ms", None), draft_calls=out.stats.draft_calls,
               host_profile=host)
    print(f"[{label}] phases ms/step {res['phase_ms_per_step']}", flush=True)
    print(f"[{label}] {res['tok_s']:.1f} tok/s; per step: busy {res['busy_us_per_step']:.0f} us, idle "
          f"{res['idle_us_per_step']:.0f} us, {res['kernels_per_step']:.0f} kernels", flush=True)
    for r in rows[:10]:
        print(f"    {r['us_per_step']:8.1f} us  x{r['calls_per_step']:.1f}  {r['name'][:90]}", flush=True)
    return res


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--json", required=True)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--runs", default="", help="comma list of run labels to keep (default: all)")
    ap.add_argument("--host-profile", action="store_true", help="also cProfile one generation per run (host time)")
    args = ap.parse_args()
    global HOST_PROFILE
    HOST_PROFILE = args.host_profile
    from tilespec.engine import SpeculativeDecoder
    from tilespec.engine.native import NativeRunner
    from tilespec.env import run_record
    from tilespec.verify import SamplingParams

    model = random_model("qwen2.5-1.5b")
    runner = NativeRunner(model, 512, mode="native-graphs")
    tok = torch.randint(0, 1000, (args.batch, 1), device="cuda")
    pos = torch.full((args.batch, 1), 100, device="cuda")
    mask = torch.ones(args.batch, 1, 1, 512, dtype=torch.bool, device="cuda")
    runner.forward(tok, pos, mask, 100)
    graph = list(runner._graphs._graphs.values())[-1].graph
    forward_ms = time_replays(graph.replay)
    del runner
    results = dict(run_record("cuda"), weights="random-init (timing only)", batch=args.batch,
                   forward_graph_ms_q1=forward_ms, runs=[])
    sampling = SamplingParams(temperature=0.0)
    plain = torch.randint(0, 1000, (args.batch, 64)).tolist()
    repetitive = [[11, 12, 13, 14, 15, 16, 17, 18] * 8 for _ in range(args.batch)]
    draft_model = random_model("qwen2.5-0.5b")
    long = torch.randint(0, 1000, (args.batch, 1000)).tolist()   # XSum-like prompt length: is prefill the cost?
    runs = (("target-only", None, plain, 0, args.tokens), ("ngram-gamma5", "ngram", repetitive, 5, args.tokens),
            ("draft0.5b-gamma2", draft_model, plain, 2, args.tokens),
            ("draft0.5b-gamma3", draft_model, plain, 3, args.tokens),
            ("target-only-prompt1000", None, long, 0, 32), ("draft0.5b-gamma2-prompt1000", draft_model, long, 2, 32),
            # random weights: the draft is never accepted, so "optimal" falls back to target-only steps after its
            # measured steps; those steps run ahead like target-only ones (tok/s should approach target-only's)
            ("draft0.5b-optimal-fallback", draft_model, plain, 2, args.tokens))
    keep = set(filter(None, args.runs.split(",")))
    for label, draft, prompts, gamma, tokens in runs:
        if keep and label not in keep:
            continue
        schedule = "optimal" if label.endswith("optimal-fallback") else "constant"
        kw = dict(gamma=gamma, gamma_schedule=schedule) if draft is not None else {}
        dec = SpeculativeDecoder(model, draft, compile=True, sampling=sampling, eos_token_id=-1, pad_token_id=0, **kw)
        results["runs"].append(profile_generation(dec, prompts, tokens, label))
    with open(args.json, "w") as f:
        json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
