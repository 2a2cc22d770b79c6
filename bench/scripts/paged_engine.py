"""The paged engine measured in-process on real weights: closed-loop load at several client counts (each client
submits its next request when the previous one ends), offline B=1 and B=8, a shared system prompt with and without
prefix caching, and the previous server engine (BatchEngine) at the same load, all in one process on one GPU.
Writes one JSON (device, versions, commit, raw per-request records summarised per level).

    python bench/scripts/paged_engine.py --out bench/results/paged-engine-qwen1.5b-h100.json
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT / "src"), str(Path(__file__).parent)]


def pct(values, q):
    s = sorted(values)
    return s[min(len(s) - 1, round(q / 100 * (len(s) - 1)))] if s else None


SLOW_MS = 50.0          # a step slower than this is recorded with what it held (stalls: compiles, captures, GC)
slow: list = []


def step_costs(eng) -> list:
    """The engine's priced step shapes: (rows, tokens, wide), the warm-up's seed and the served estimate (ms)."""
    out = []
    for shape in sorted(set(eng.costs.seeds) | set(eng.costs.excess)):
        seed, est = eng.costs.seeds.get(shape), eng.costs.estimate(shape)
        out.append({"rows": shape[0], "tokens": shape[1], "wide": shape[2], "samples": eng.costs.samples.get(shape, 0),
                    "seed_ms": None if seed is None else round(seed * 1e3, 3),
                    "estimate_ms": None if est is None else round(est * 1e3, 3)})
    return out


def triton_variants() -> int:
    """Compiled variants of the paged attention kernels (Triton specialises on constexprs and on int arguments)."""
    from tilespec.engine.paged import attention
    total = 0
    for fn in (getattr(attention, "_partial_kernel", None), getattr(attention, "_merge_kernel", None)):
        for cache in getattr(fn, "device_caches", {}).values():
            total += len(cache[0]) if isinstance(cache, tuple) else 0
    return total


LEVEL_COUNTERS = ("steps", "decode_graph_steps", "steps_overlapped", "steps_drafter_off", "spec_steps", "drafted",
                  "accepted", "admissions_deferred", "host_plan_seconds", "host_launch_seconds", "host_wait_seconds",
                  "host_commit_seconds")     # per level in the JSON: how its steps ran


def step_state(engine, before=None) -> dict:
    """What a step did, from counters: graph replays, captures (graphs cached), dynamo compiles, GC runs, rows."""
    import gc

    from torch._dynamo.utils import counters
    graphs = len(engine.model._decode) if getattr(engine.model, "_decode", None) is not None else 0
    now = {"graph_step": engine.counters.get("decode_graph_steps", 0), "graphs": graphs,
           "compiles": counters["stats"]["unique_graphs"], "gc": sum(g["collections"] for g in gc.get_stats()),
           "triton": triton_variants(), "running": engine.running, "waiting": len(engine.waiting)}
    if before is None:
        return now
    return {k: now[k] - before[k] if k in ("graph_step", "graphs", "compiles", "gc", "triton") else now[k] for k in now}


def closed_loop(engine, prompts: list, clients: int, requests: int, max_tokens: int, temperature: float,
                seed: int = 0, outputs: dict | None = None) -> dict:
    """``clients`` requests in flight until ``requests`` ended; tokens / wall time, TTFT and ITL per request.
    ``outputs``: filled with each prompt index's tokens (its first request's)."""
    from tilespec.engine.batching import BatchRequest
    made, done, live, peak_kv, index = 0, [], {}, 0, {}

    def submit():
        nonlocal made
        r = BatchRequest(prompt=prompts[made % len(prompts)], max_tokens=max_tokens, temperature=temperature,
                         seed=seed + made)
        engine.submit(r)
        live[r.rid] = r
        if outputs is not None:
            index[r.rid] = made % len(prompts)
        made += 1

    t0 = time.perf_counter()
    for _ in range(min(clients, requests)):
        submit()
    while live:
        before = step_state(engine)
        s0 = time.perf_counter()
        events = engine.step()
        ms = 1e3 * (time.perf_counter() - s0)
        if ms > SLOW_MS:
            slow.append(dict(ms=round(ms, 1), clients=clients, **step_state(engine, before)))
        for ev in events:
            if ev.finish_reason is not None:
                done.append(live.pop(ev.rid))
                if outputs is not None:
                    outputs.setdefault(index[ev.rid], list(done[-1].tokens))
                if made < requests:
                    submit()
        if hasattr(engine, "kv_bytes_in_use"):
            peak_kv = max(peak_kv, engine.kv_bytes_in_use())
    torch.cuda.synchronize()
    wall = time.perf_counter() - t0
    toks = sum(len(r.tokens) for r in done)
    ttft = [1e3 * (r.t_first - r.t_submit) for r in done]
    itl = [1e3 * (r.t_end - r.t_first) / (len(r.tokens) - 1) for r in done if len(r.tokens) > 1]
    from load_client import steady_tokens_per_s        # the HTTP load script's own definition, for one ratio
    steady = steady_tokens_per_s([{"ok": True, "sent": r.t_submit, "first": r.t_first, "end": r.t_end,
                                   "tokens": len(r.tokens)} for r in done], clients)
    return {"clients": clients, "requests": len(done), "tokens": toks, "wall_s": wall, "tok_s": toks / wall,
            "steady_tok_s": steady,
            "ttft_ms_p50": pct(ttft, 50), "ttft_ms_p99": pct(ttft, 99), "itl_ms_p50": pct(itl, 50),
            "kv_gib_peak": peak_kv / 2**30, "accepted": sum(r.accepted for r in done),
            "drafted": sum(r.drafted for r in done)}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--target", default="qwen2.5-coder-1.5b-instruct")
    p.add_argument("--task", default="code-edit")
    p.add_argument("--clients", default="1,16,64,128,256")
    p.add_argument("--requests-per-client", type=int, default=3)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--compare-alone", type=int, default=0,
                   help="per draft, this many prompts also served one at a time: how many of their texts the "
                        "loaded levels reproduce")
    p.add_argument("--drafts", default="none,ngram",
                   help="drafters, each run on its own engine; 'ngram:all' verifies every offered draft (pricing off), "
                        "'none:sync' runs every step synchronously (no overlap)")
    p.add_argument("--batch-engine-clients", default="64", help="BatchEngine levels ('' skips)")
    p.add_argument("--prefix-tokens", type=int, default=1000, help="shared system prompt length ('0' skips)")
    p.add_argument("--budget-s", type=float, default=480.0, help="stop starting new rows after this")
    p.add_argument("--out", type=Path, required=True)
    a = p.parse_args()
    from tilespec import models
    from tilespec.datasets import load_task
    from tilespec.engine.batching import BatchEngine
    from tilespec.engine.paged import PagedEngine
    from tilespec.engine.prompts import encode_prompts
    from tilespec.env import host_record
    from tilespec.serve.core import freeze_heap

    start = time.perf_counter()
    target, tok = models.load(a.target, dtype="bfloat16", device="cuda")
    texts = [r["prompt"] for r in load_task(a.task, limit=64, seed=0)]
    prompts = encode_prompts(tok, texts)
    pad = tok.pad_token_id or 0
    out = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "target": a.target,
           "task": a.task, "max_tokens": a.max_tokens, "temperature": 0.0, "eos": "ignored (EOS id None)",
           "commit": os.environ.get("TILESPEC_COMMIT") or subprocess.run(
               ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=ROOT).stdout.strip(),
           "date": time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime()), "python": platform.python_version(),
           "prompt_tokens_mean": statistics.mean(map(len, prompts)), **host_record(), "rows": []}
    import transformers
    import triton
    out["transformers"], out["triton"] = transformers.__version__, triton.__version__
    levels = [int(c) for c in a.clients.split(",") if c]

    def save():
        a.out.write_text(json.dumps(out, indent=1))

    for draft in a.drafts.split(","):
        t = time.perf_counter()
        name, _, mode = draft.partition(":")     # modes: all (no pricing), sync (no overlap), det (deterministic)
        eng = PagedEngine(target, None if name == "none" else name, max_batch=max(levels), gamma=4,
                          compile=True, max_len=4096, eos_token_id=[], pad_token_id=pad, pricing=mode != "all",
                          overlap=mode != "sync", deterministic=mode == "det")
        shapes = eng.warm_up(log=print)
        freeze_heap()                   # as the server's engine process does after its warm-up
        out["rows"].append({"system": f"paged:{draft}", "kind": "setup", "warmup_s": time.perf_counter() - t,
                            "shapes": shapes, "kv_blocks": eng.blocks.num_blocks})
        alone: dict = {}
        for i in range(min(a.compare_alone, len(prompts))):     # one request at a time: the reference texts
            one: dict = {}
            closed_loop(eng, prompts[i:i + 1], 1, 1, a.max_tokens, 0.0, outputs=one)
            alone[i] = one[0]
        for c in levels:
            if time.perf_counter() - start > a.budget_s:
                break
            closed_loop(eng, prompts, c, c, a.max_tokens, 0.0)           # a warm pass of the level
            before, loaded = dict(eng.counters), {}
            row = closed_loop(eng, prompts, c, a.requests_per_client * c, a.max_tokens, 0.0, outputs=loaded)
            if alone:
                same = [i for i in alone if i in loaded and loaded[i] == alone[i]]
                row.update(alone_compared=sum(i in loaded for i in alone), alone_identical=len(same))
            level = {k: eng.counters[k] - before[k] for k in LEVEL_COUNTERS}
            row.update(system=f"paged:{draft}", kind="load", graph_steps=eng.counters["decode_graph_steps"],
                       steps=eng.counters["steps"], preemptions=eng.counters["preemptions"],
                       captures=eng.model.captures, level_counters=level, step_costs=step_costs(eng))
            out["rows"].append(row)
            print(json.dumps(row))
            out["slow_steps"] = slow
            save()
        if draft == "none" and a.prefix_tokens > 0:
            system = prompts[0] * (a.prefix_tokens // len(prompts[0]) + 1)
            shared = [system[:a.prefix_tokens] + p for p in prompts]
            for caching in (True, False):
                e2 = PagedEngine(target, None, max_batch=64, compile=True, max_len=4096, eos_token_id=[],
                                 pad_token_id=pad, prefix_caching=caching)
                e2.warm_up(max_context=2048)
                closed_loop(e2, shared, 64, 64, a.max_tokens, 0.0)
                row = closed_loop(e2, shared, 64, 128, a.max_tokens, 0.0)
                row.update(system="paged:none", kind="shared-prefix", prefix_caching=caching,
                           prefix_tokens=a.prefix_tokens, block_hits=e2.blocks.hits, block_queries=e2.blocks.queries)
                out["rows"].append(row)
                print(json.dumps(row))
                del e2
                torch.cuda.empty_cache()
            save()
        del eng
        torch.cuda.empty_cache()
    for c in [int(x) for x in a.batch_engine_clients.split(",") if x]:
        for draft in a.drafts.split(","):
            if time.perf_counter() - start > a.budget_s:
                break
            eng = BatchEngine(target, None if draft == "none" else draft, max_batch=c, gamma=4, compile=True,
                              max_len=2048, eos_token_id=[], pad_token_id=pad)
            from tilespec.engine.batch_warmup import warm_up
            warm_up(eng)
            closed_loop(eng, prompts, c, c, a.max_tokens, 0.0)
            row = closed_loop(eng, prompts, c, a.requests_per_client * c, a.max_tokens, 0.0)
            row.update(system=f"batch:{draft}", kind="load")
            out["rows"].append(row)
            print(json.dumps(row))
            save()
            del eng
            torch.cuda.empty_cache()
    out["wall_s"] = time.perf_counter() - start
    out["slow_steps"] = slow
    save()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
