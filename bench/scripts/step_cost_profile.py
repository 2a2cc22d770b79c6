"""GPU: what one decoding step costs in the decoder, in continuous batching (the server's engine) and as a token tree.

Usage: python3 bench/scripts/step_cost_profile.py --json OUT.json [--tokens 128] [--runs a,b,...]

Random-initialised Qwen2.5-1.5B shapes and a random draft head of its shape (timing only: a step's cost does not
depend on the weights; acceptance does, so tokens per step are reported but not a speed-up). Each run decodes one
request of ``--tokens`` tokens after two warm-up requests (compiles and captures) and records wall ms per step, the
GPU's busy / idle time per step (union of kernel intervals in a torch.profiler trace), kernels per step grouped by
name, and the host functions with the most own time per step (cProfile). Runs:

* ``decoder-*``: SpeculativeDecoder (B = 1, compile=True), target-only / ngram γ 4 / head γ 4 / head tree (8, 6, 32);
* ``engine-*``: BatchEngine as ``tilespec serve`` builds it (max_batch 64, max_len 2048, compile=True, the load
  switch off and min_alpha 0 so every step drafts), one request alone; ``-len512`` variants use max_len 512 (a
  smaller slot capacity) to show what the capacity costs.
"""
from __future__ import annotations

import argparse
import cProfile
import json
import os
import pstats
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(__file__))
from engine_profile import busy_and_gaps, kernel_intervals, kernels_by_name  # noqa: E402
from native_forward import random_model  # noqa: E402


def random_head(model):
    from tilespec.heads.model import DraftHead, config_for
    torch.manual_seed(1)
    head = DraftHead(config_for(model, draft_vocab=32000), vocab_ids=torch.arange(32000))
    for p in head.parameters():
        p.data.normal_(0, 0.02)
    head = head.to("cuda", torch.bfloat16).bind(model)
    return head


def summarize(label: str, prof, steps: int, wall_s: float, tokens: int, host_rows: list) -> dict:
    iv = kernel_intervals(prof)
    span = (iv[-1][1] - iv[0][0]) if iv else 0.0
    busy, _ = busy_and_gaps(iv)
    top = kernels_by_name(iv, steps)[:25]
    res = dict(label=label, tokens=tokens, steps=steps, tokens_per_step=tokens / max(steps, 1), wall_s=wall_s,
               ms_per_step=1e3 * wall_s / max(steps, 1), kernels_per_step=len(iv) / max(steps, 1),
               busy_us_per_step=busy / max(steps, 1), idle_us_per_step=(span - busy) / max(steps, 1),
               top_kernels=top, host_top=host_rows)
    print(f"[{label}] {res['ms_per_step']:.3f} ms/step, {res['tokens_per_step']:.2f} tok/step, busy "
          f"{res['busy_us_per_step']:.0f} us, idle {res['idle_us_per_step']:.0f} us, {res['kernels_per_step']:.0f} "
          f"kernels/step", flush=True)
    for r in top[:12]:
        print(f"    {r['us_per_step']:8.1f} us  x{r['calls_per_step']:.1f}  {r['name'][:100]}", flush=True)
    for r in host_rows[:12]:
        print(f"    host {r['own_us']:8.1f} us own {r['cum_us']:8.1f} cum x{r['calls']:.1f} {r['func'][:90]}", flush=True)
    return res


def host_rows(prof: cProfile.Profile, steps: int, top: int = 25) -> list:
    st = pstats.Stats(prof)
    rows = [dict(func=f"{os.path.basename(f)}:{line}:{fn}", calls=nc / steps, own_us=1e6 * tt / steps,
                 cum_us=1e6 * ct / steps) for (f, line, fn), (cc, nc, tt, ct, _) in st.stats.items()]
    return sorted(rows, key=lambda r: -r["own_us"])[:top]


def measure(label: str, run_once, steps_of) -> dict:
    """run_once() decodes one request and returns an opaque result; steps_of(result) -> (steps, tokens)."""
    from torch.profiler import ProfilerActivity, profile
    for _ in range(2):
        run_once()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    out = run_once()
    torch.cuda.synchronize()
    wall = time.perf_counter() - t0
    steps, tokens = steps_of(out)
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        out_p = run_once()
        torch.cuda.synchronize()
    cp = cProfile.Profile()
    cp.enable()
    run_once()
    torch.cuda.synchronize()
    cp.disable()
    return summarize(label, prof, steps_of(out_p)[0], wall, tokens, host_rows(cp, steps))


def decoder_run(model, draft, prompt, tokens, **kw):
    from tilespec.engine import SpeculativeDecoder
    from tilespec.verify import SamplingParams
    dec = SpeculativeDecoder(model, draft, compile=True, sampling=SamplingParams(temperature=0.0), eos_token_id=-1,
                             pad_token_id=0, **kw)
    ids = torch.tensor([prompt])
    return (lambda: dec.generate(input_ids=ids, max_new_tokens=tokens)), (lambda o: (o.stats.steps,
                                                                                      o.stats.new_tokens))


def engine_run(model, draft, prompt, tokens, max_len=2048):
    from tilespec.engine.batching import BatchEngine, BatchRequest
    eng = BatchEngine(model, draft, max_batch=64, gamma=4, max_len=max_len, compile=True, adaptive=False,
                      min_alpha=0.0, eos_token_id=-1)

    def once():
        s0 = eng.counters["steps"]
        req = BatchRequest(prompt=list(prompt), max_tokens=tokens, seed=0, temperature=0.0)
        eng.submit(req)
        while eng.has_work:
            eng.step()
        return eng.counters["steps"] - s0, len(req.tokens)
    return once, (lambda o: o)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--json", required=True)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--runs", default="")
    args = ap.parse_args()
    from tilespec.engine.drafters import HeadDrafter
    from tilespec.env import run_record
    model = random_model("qwen2.5-1.5b")
    head = random_head(model)
    prompt = ([11, 12, 13, 14, 15, 16, 17, 18] * 25)[:200]
    head_d = lambda: HeadDrafter(head)  # noqa: E731  (a fresh drafter per decoder)
    runs = {
        "decoder-none": lambda: decoder_run(model, None, prompt, args.tokens),
        "decoder-ngram": lambda: decoder_run(model, "ngram", prompt, args.tokens, gamma=4),
        "decoder-head": lambda: decoder_run(model, head_d(), prompt, args.tokens, gamma=4),
        "decoder-head-tree-8-6-32": lambda: decoder_run(model, head_d(), prompt, args.tokens, tree=(8, 6, 32)),
        "decoder-head-tree-4-4-16": lambda: decoder_run(model, head_d(), prompt, args.tokens, tree=(4, 4, 16)),
        "engine-none": lambda: engine_run(model, None, prompt, args.tokens),
        "engine-ngram": lambda: engine_run(model, "ngram", prompt, args.tokens),
        "engine-head": lambda: engine_run(model, head_d(), prompt, args.tokens),
        "engine-none-len512": lambda: engine_run(model, None, prompt, args.tokens, max_len=512),
        "engine-ngram-len512": lambda: engine_run(model, "ngram", prompt, args.tokens, max_len=512),
    }
    keep = [r for r in args.runs.split(",") if r] or list(runs)
    results = dict(run_record("cuda"), weights="random-init Qwen2.5-1.5B shapes and a random head (timing only)",
                   prompt_tokens=len(prompt), tokens=args.tokens, runs=[])
    for label in keep:
        try:
            once, steps_of = runs[label]()
            results["runs"].append(measure(label, once, steps_of))
        except Exception as err:      # keep the other runs
            print(f"[{label}] failed: {type(err).__name__}: {err}", flush=True)
            results["runs"].append(dict(label=label, error=f"{type(err).__name__}: {err}"))
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
