"""What one paged decode step costs on the GPU, by rows and fed tokens: the data a per-step draft chooser prices
with. For every rows count S and token total T = S + drafts (drafts spread over the rows, at most gamma each:
ragged, not S x (1 + gamma)), the captured decode forward is replayed and timed with CUDA events, then verify() on
its logits; block tables are either sized to the context (the engine's table-width buckets) or to the longest
context (one width for every context). Also the capture time of each graph. Writes one JSON.

    python bench/scripts/step_cost.py --out bench/results/paged-step-cost-qwen1.5b-h200.json
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "src"))


def ragged_inputs(engine, rows: int, extra: int, gamma: int, ctx: int, m: int):
    """S = rows requests at context ``ctx``; ``extra`` draft tokens given to the first rows, gamma each at most."""
    from tilespec.engine.paged.model import StepInputs
    bs = engine.blocks.block_size
    counts = [min(gamma, max(0, extra - gamma * s)) for s in range(rows)]
    fed = [1 + k for k in counts]
    tokens = sum(fed)
    cu, lens, logit_rows = [0], [], []
    for n in fed:
        base = cu[-1]
        own = [base + j for j in range(n)]
        logit_rows += own + [own[-1]] * (1 + gamma - n)
        cu.append(base + n)
        lens.append(ctx + n)
    per = -(-(ctx + gamma + 1) // bs)
    tables = [[1 + (s * per + j) % (engine.blocks.num_blocks - 1) for j in range(per)] + [0] * (m - per)
              for s in range(rows)]
    dev = engine.device

    def t(v, dt=torch.int64):
        return torch.tensor(v, dtype=dt, device=dev)
    return StepInputs(t([engine.pad] * tokens), t([ctx + j % (gamma + 1) for j in range(tokens)]),
                      t([j % bs for j in range(tokens)]), t(tables, torch.int32), t(cu, torch.int32),
                      t(lens, torch.int32), t(logit_rows), 1 + gamma), counts


def timed(fn, reps: int) -> float:
    """Median milliseconds of ``fn`` over ``reps`` runs (CUDA events, after two untimed runs)."""
    for _ in range(2):
        fn()
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b))
    return statistics.median(times)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--target", default="qwen2.5-coder-1.5b-instruct")
    p.add_argument("--rows", default="1,4,16,32,64,128,256")
    p.add_argument("--extra", default="0,0.25,0.5,1,2,4", help="draft tokens per row, on average")
    p.add_argument("--contexts", default="512,2048")
    p.add_argument("--gamma", type=int, default=4)
    p.add_argument("--reps", type=int, default=30)
    p.add_argument("--out", type=Path, required=True)
    a = p.parse_args()
    from tilespec import models
    from tilespec.engine.paged import PagedEngine
    from tilespec.engine.paged.shapes import table_width
    from tilespec.verify.api import verify
    from tilespec.verify.types import SamplingParams

    target, tok = models.load(a.target, dtype="bfloat16", device="cuda")
    rows_list = [int(r) for r in a.rows.split(",")]
    contexts = [int(c) for c in a.contexts.split(",")]
    eng = PagedEngine(target, "ngram", max_batch=max(rows_list), gamma=a.gamma, compile=True, max_len=4096,
                      eos_token_id=[], pad_token_id=tok.pad_token_id or 0,
                      num_blocks=max(rows_list) * (-(-max(contexts) // 16) + 1) + 1)
    top = table_width(-(-eng.max_len // eng.blocks.block_size))
    import transformers
    import triton
    out = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
           "transformers": transformers.__version__, "target": a.target, "gamma": a.gamma,
           "commit": os.environ.get("TILESPEC_COMMIT") or subprocess.run(
               ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=ROOT).stdout.strip(),
           "date": time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime()), "reps": a.reps, "rows": []}
    t0 = time.perf_counter()
    eng.model.forward(ragged_inputs(eng, 4, 4, a.gamma, 64, 16)[0])       # the compile, once
    out["compile_s"] = time.perf_counter() - t0
    zeros = {}
    for ctx in contexts:
        for s in rows_list:
            for e in [float(x) for x in a.extra.split(",")]:
                extra = round(e * s)
                if extra > a.gamma * s:
                    continue
                for m in sorted({table_width(-(-(ctx + a.gamma + 1) // eng.blocks.block_size)), top}):
                    inputs, counts = ragged_inputs(eng, s, extra, a.gamma, ctx, m)
                    c0 = time.perf_counter()
                    eng.model.decode(inputs)
                    torch.cuda.synchronize()
                    capture = time.perf_counter() - c0
                    fwd = timed(lambda: eng.model.decode(inputs), a.reps)
                    logits = eng.model.decode(inputs).view(s, 1 + a.gamma, -1)
                    drafts = torch.zeros((s, a.gamma), dtype=torch.int64, device=eng.device)
                    num = torch.tensor(counts, device=eng.device)
                    z = zeros.setdefault(s, torch.zeros(s, dtype=torch.int64, device=eng.device))
                    ver = timed(lambda: verify(logits, drafts, num_draft_tokens=num, sampling=SamplingParams(0.0),
                                               method=eng.method, seed=z, offsets=z, check_values=False), a.reps)
                    row = {"rows": s, "tokens": s + extra, "context": ctx, "table_width": m,
                           "forward_ms": fwd, "verify_ms": ver, "first_call_s": capture}
                    out["rows"].append(row)
                    print(json.dumps(row), flush=True)
        a.out.write_text(json.dumps(out, indent=1))
    out["wall_s"] = time.perf_counter() - t0
    a.out.write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
