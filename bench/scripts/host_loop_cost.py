"""The paged engine's host time per step under closed-loop load (requests end and are replaced, so prefills, mixed
steps and the drafter's per-request start are in it), target-only vs a context drafter, on CPU with the forward
stubbed (logits at once: token ``table[t]`` follows token t), so what is timed is the engine's own work. ``gate``:
``real`` (DraftGate decides), ``off`` (the drafter never runs: the pure cost of having one), ``on`` (always).
Complements host_step.py (steady decode rows, no turnover).

    PYTHONPATH=src python bench/scripts/host_loop_cost.py --rows 64,256 --drafts none,ngram:off,ngram:real
"""
from __future__ import annotations

import argparse
import cProfile
import gc
import json
import pstats
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
PHASES = ("host_plan_seconds", "host_launch_seconds", "host_wait_seconds", "host_commit_seconds")


def stub_model(engine, vocab: int, seed: int = 0, forward_s: float = 0.0):
    """Forwards replaced by one-hot logits of ``table[token]`` at each logit row (a deterministic random walk);
    ``forward_s``: each forward also sleeps that long (a device's step time, off the CPU: the draft gate then weighs
    drafting against a forward that costs what a GPU's does at low load, whatever its token count)."""
    table = torch.randint(1, vocab, (vocab,), generator=torch.Generator().manual_seed(seed))

    def forward(inputs):
        if forward_s:
            time.sleep(forward_s)
        nxt = table[inputs.tokens.index_select(0, inputs.rows).clamp(0, vocab - 1)]
        return torch.nn.functional.one_hot(nxt, vocab).float() * 10.0
    engine.model.decode = forward
    engine.model.mixed = forward


def run(draft: str, gate: str, rows: int, requests: int, max_tokens: int, prompt_len: int, vocab: int,
        profile: Path = None, forward_s: float = 0.0) -> dict:
    sys.path.insert(0, str(ROOT / "tests"))
    from engine_models import random_prompts, tiny_lm
    from tilespec.engine.batching import BatchRequest
    from tilespec.engine.paged import PagedEngine
    target = tiny_lm(0, vocab=vocab, layers=1)
    engine = PagedEngine(target, None if draft == "none" else draft, max_batch=rows, max_len=2048, eos_token_id=[])
    stub_model(engine, vocab, forward_s=forward_s)
    if engine.gate is not None and gate != "real":
        engine.gate.drafting = lambda rows, explore=True: gate == "on"
    prompts = random_prompts(64, 0, prompt_len, vocab)
    made, live = 0, 0

    def submit():
        nonlocal made, live
        engine.submit(BatchRequest(prompt=prompts[made % len(prompts)], max_tokens=max_tokens, temperature=0.0,
                                   seed=made))
        made, live = made + 1, live + 1

    def loop(total: int, times=None):
        nonlocal live
        for _ in range(min(rows, total - made)):
            submit()
        while live:
            t = time.process_time()
            events = engine.step()
            if times is not None:
                times.append(time.process_time() - t)
            for ev in events:
                if ev.finish_reason is not None:
                    live -= 1
                    if made < total:
                        submit()
    loop(rows)                            # a warm pass (the gate's and costs' first samples)
    gc.collect()
    gc.freeze()                           # as the server's engine process does after its warm-up
    before, t0, cpu = dict(engine.counters), time.perf_counter(), time.process_time()
    prof = cProfile.Profile() if profile else None
    if prof:
        prof.enable()
    times: list = []
    loop(made + requests, times)
    if prof:
        prof.disable()
        prof.dump_stats(profile / f"{draft}-{gate}-{rows}.prof")
        pstats.Stats(prof).sort_stats("tottime").print_stats(25)
    wall, cpu = time.perf_counter() - t0, time.process_time() - cpu
    c = {k: engine.counters[k] - before[k] for k in engine.counters}
    steps = max(1, c["steps"])
    out = {"draft": draft, "gate": gate, "rows": rows, "steps": c["steps"], "drafter_off": c["steps_drafter_off"],
           "spec_steps": c["spec_steps"], "drafted": c["drafted"], "accepted": c["accepted"],
           "tokens": c["generated_tokens"], "step_us": round(1e6 * wall / steps),
           "cpu_us": round(1e6 * cpu / steps), "tok_s": round(c["generated_tokens"] / wall), "times": times}
    out.update({k.split("_")[1] + "_us": round(1e6 * c[k] / steps) for k in PHASES})
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rows", default="64,256")
    p.add_argument("--drafts", default="none,ngram:off,ngram:real", help="DRAFT[:GATE], GATE real|off|on")
    p.add_argument("--requests-per-row", type=int, default=2)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--prompt-len", type=int, default=250)
    p.add_argument("--vocab", type=int, default=256)
    p.add_argument("--repeat", type=int, default=3, help="runs of each: the one of least CPU time is reported, and "
                   "floor_us (the mean over steps of each step's least CPU time) where they ran the same steps")
    p.add_argument("--profile", type=Path, help="cProfile the timed pass into this folder (and print the top 25)")
    p.add_argument("--forward-ms", type=float, default=0.0,
                   help="each stubbed forward sleeps this long (a GPU step's time at low load; 0: none)")
    p.add_argument("--out", type=Path)
    a = p.parse_args()
    torch.set_num_threads(1)
    results = []
    for rows in [int(r) for r in a.rows.split(",")]:
        runs: dict = {}
        for _ in range(a.repeat):          # interleaved: other load on the machine only ever adds time
            for spec in a.drafts.split(","):
                draft, _, gate = spec.partition(":")
                runs.setdefault(spec, []).append(run(draft, gate or "real", rows, a.requests_per_row * rows,
                                                     a.max_tokens, a.prompt_len, a.vocab, a.profile,
                                                     a.forward_ms / 1e3))
        for spec, rs in runs.items():
            row = min(rs, key=lambda r: r["cpu_us"])
            if len({len(r["times"]) for r in rs}) == 1:     # the same steps each time: each step's least CPU time
                row["floor_us"] = round(1e6 * statistics.mean(map(min, zip(*(r["times"] for r in rs)))))
            row.pop("times")
            results.append(row)
            print(json.dumps(row), flush=True)
    if a.out:
        a.out.write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
