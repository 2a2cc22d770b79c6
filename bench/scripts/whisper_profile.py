"""GPU: where whisper-base target-only decoding spends a clip's time.

Usage: python3 bench/scripts/whisper_profile.py --json OUT.json [--clips 8]   (real whisper-base, LJSpeech clips)
Per clip (B=1, greedy, compile=True, end-of-text stops): wall ms, tokens, the engine's phase times, and under
torch.profiler the GPU's busy / idle time and the kernels grouped by name; also the transformers encoder alone
(eager) and one decode forward's graph replay, so "a clip costs X ms" splits into encoder, prefill, decode steps
and idle GPU.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(__file__))
from engine_profile import busy_and_gaps, kernel_intervals  # noqa: E402


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def timed(fn, reps: int = 10) -> float:
    fn()
    sync()
    t0 = time.perf_counter()
    for _ in range(reps):
        fn()
    sync()
    return (time.perf_counter() - t0) / reps * 1e3


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--json", required=True)
    ap.add_argument("--clips", type=int, default=8)
    args = ap.parse_args()
    from torch.profiler import ProfilerActivity, profile

    from tilespec.api import load_pair
    from tilespec.engine import SpeculativeDecoder
    from tilespec.env import data_root, run_record
    from tilespec.models.whisper import decoder_prompt, features, load_audio
    from tilespec.verify import SamplingParams

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")   # CPU: a dry run
    dtype = torch.float16 if device.type == "cuda" else torch.float32
    target, _, proc = load_pair("whisper-base", None, device, dtype)
    folder = data_root() / "ljspeech" / "wavs"
    clips = sorted(p for p in folder.iterdir() if p.suffix in (".flac", ".wav"))[:args.clips]
    feats = features(proc, [load_audio(c) for c in clips], device, dtype)
    prefix = list(decoder_prompt(target, proc))
    dec = SpeculativeDecoder(target, None, compile=True, sampling=SamplingParams.greedy())
    for i in range(2):                                   # compile / capture outside the measurement
        dec.generate([prefix], max_new_tokens=96, input_features=feats[i:i + 1])
    encoder_ms = timed(lambda: target.get_encoder()(feats[:1]).last_hidden_state)
    rows = []
    for i in range(len(clips)):
        f = feats[i:i + 1]
        sync()
        t0 = time.perf_counter()
        out = dec.generate([prefix], max_new_tokens=96, input_features=f)
        sync()
        wall = (time.perf_counter() - t0) * 1e3
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            dec.generate([prefix], max_new_tokens=96, input_features=f)
            sync()
        iv = kernel_intervals(prof)
        busy, gaps = busy_and_gaps(iv)
        span = (iv[-1][1] - iv[0][0]) if iv else 0.0
        by_name: dict = {}
        for s, e, n in iv:
            r = by_name.setdefault(n[:100], [0, 0.0])
            r[0] += 1
            r[1] += e - s
        top = sorted(({"name": n, "calls": c, "us": t} for n, (c, t) in by_name.items()), key=lambda r: -r["us"])[:15]
        rows.append(dict(clip=clips[i].name, tokens=out.stats.new_tokens, steps=out.stats.steps, wall_ms=wall,
                         tok_s=out.stats.new_tokens / wall * 1e3, phase_ms={k: v * 1e3 for k, v in out.stats.times.items()},
                         target_forward_ms=getattr(out.stats, "target_forward_ms", None), kernels=len(iv), gpu_busy_ms=busy / 1e3,
                         gpu_idle_ms=(span - busy) / 1e3, largest_gaps_us=sorted(gaps, reverse=True)[:8], top=top))
        r = rows[-1]
        print(f"[{r['clip']}] {r['tokens']} tokens {wall:.1f} ms ({r['tok_s']:.0f} tok/s): busy {r['gpu_busy_ms']:.2f} "
              f"idle {r['gpu_idle_ms']:.2f} ms, {len(iv)} kernels, phases {r['phase_ms']}", flush=True)
    toks, wall = sum(r["tokens"] for r in rows), sum(r["wall_ms"] for r in rows)
    res = dict(run_record(device.type), model="whisper-base", dtype="float16", clips=len(rows), encoder_eager_ms=encoder_ms,
               tokens=toks, wall_ms=wall, tok_s=toks / wall * 1e3, per_clip=rows)
    print(f"encoder (eager transformers) {encoder_ms:.2f} ms per clip; {toks} tokens in {wall:.0f} ms = "
          f"{res['tok_s']:.0f} tok/s; top kernels of the first clip:")
    for t in rows[0]["top"][:12]:
        print(f"   {t['us']:9.1f} us x{t['calls']:4d} {t['name'][:90]}")
    with open(args.json, "w") as f:
        json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
