"""The paged engine's host time per decode step: the model's forward replaced by a stub that returns logits at once,
so what is timed is the engine's own work (gate, scheduling, inputs, verify's packing and launches, commit) at each
rows count, target-only and with ngram drafts offered. On a GPU machine the stub's logits live on the device and
every step syncs as served; on CPU verify's torch ops run on the host over an 8-token vocabulary, so each costs
about its dispatch (a proxy for a launch): numbers for before / after comparisons on one machine.

    python bench/scripts/host_step.py --rows 1,16,64,256 --out bench/results/paged-host-step-cpu.json  # ~2 min
"""
from __future__ import annotations

import argparse
import gc
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


def stub_model(engine, vocab: int):
    """Replace the forward passes by logits read from one buffer (argmax: token 7 after token t is t + 1)."""
    def forward(inputs):
        rows = inputs.rows.shape[0]
        return torch.zeros((rows, vocab), device=inputs.tokens.device)
    engine.model.decode = forward
    engine.model.mixed = forward


def run(draft, rows: int, steps: int, vocab: int, overlap: bool, device: str = "cpu") -> dict:
    sys.path.insert(0, str(ROOT / "tests"))
    from engine_models import tiny_lm
    from tilespec.engine.batching import BatchRequest
    from tilespec.engine.paged import PagedEngine
    target = tiny_lm(0, vocab=vocab, layers=1).to(device)
    target.generation_config.eos_token_id = None
    engine = PagedEngine(target, draft, max_batch=rows, max_len=4096, overlap=overlap)
    stub_model(engine, vocab)
    prompt = [3, 4, 5, 6] * 50                          # repeats: ngram finds drafts
    for i in range(rows):
        engine.submit(BatchRequest(prompt=prompt, max_tokens=800, temperature=0.0, seed=i))
    while any(not seq.decoding for seq in engine.seqs.values()):
        engine.step()
    for _ in range(20):
        engine.step()
    gc.collect()
    gc.freeze()                          # as the server's engine process does after its warm-up
    times = []
    for _ in range(steps):
        t = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - t)
    return {"draft": draft or "none", "rows": rows, "overlap": overlap, "steps": steps,
            "host_us_p50": 1e6 * statistics.median(times), "host_us_mean": 1e6 * statistics.mean(times),
            "drafted": engine.counters["drafted"]}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rows", default="1,16,64,256")
    p.add_argument("--drafts", default="none,ngram")
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--vocab", type=int, default=8)
    p.add_argument("--device", default="cpu", help="cuda: the stub's logits and verify on the GPU, as served")
    p.add_argument("--out", type=Path)
    a = p.parse_args()
    torch.set_num_threads(1)
    name = torch.cuda.get_device_name() if a.device.startswith("cuda") else "cpu"
    out = {"device": f"{name} ({platform.processor()}, {os.cpu_count()} CPUs)", "torch": torch.__version__,
           "python": platform.python_version(), "date": time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime()),
           "commit": subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                                    cwd=ROOT).stdout.strip(), "vocab": a.vocab, "rows": []}
    for draft in a.drafts.split(","):
        for rows in [int(r) for r in a.rows.split(",")]:
            row = run(None if draft == "none" else draft, rows, a.steps, a.vocab, overlap=True, device=a.device)
            out["rows"].append(row)
            print(json.dumps(row), flush=True)
    if a.out:
        a.out.write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
