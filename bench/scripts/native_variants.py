"""GPU experiment: which SDPA backend the native decoder should use at decode shapes, and where the host time of a
target-only step goes. Random-init Qwen2.5-1.5B shapes (timing only).

Usage: python3 bench/scripts/native_variants.py --json OUT.json
"""
from __future__ import annotations

import argparse
import cProfile
import io
import json
import pstats
import time

import torch

from tilespec.env import git_commit
from native_forward import forward_times, random_model  # same directory


def forward_ms(model, q: int, capacity: int = 512) -> float:
    """Graph-replay ms of one q-token forward at B=1 (native_forward.forward_times builds and times it)."""
    return forward_times(model, batches=(1,), qs=(q,), capacity=capacity)[0]["graph_replay_ms"]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--json", required=True)
    args = ap.parse_args()
    from tilespec.engine import SpeculativeDecoder
    from tilespec.engine.native import runner as native_runner
    from tilespec.verify import SamplingParams
    res = dict(device=torch.cuda.get_device_name(), torch=torch.__version__, date=time.strftime("%Y-%m-%d"),
               commit=git_commit() or "unknown", weights="random-init (timing only)",
               variants={})
    model = random_model("qwen2.5-1.5b")
    backends = {"cudnn (default)": {}, "efficient": {"cudnn": False},
                "math": {"cudnn": False, "efficient": False, "flash": False}}
    for name, off in backends.items():
        torch.backends.cuda.enable_cudnn_sdp(not off.get("cudnn") is False)
        torch.backends.cuda.enable_mem_efficient_sdp(not off.get("efficient") is False)
        torch.backends.cuda.enable_flash_sdp(not off.get("flash") is False)
        native_runner.forget_compiled()
        row = {f"q{q}_ms": forward_ms(model, q) for q in (1, 4)}
        res["variants"][name] = row
        print(name, row, flush=True)
    torch.backends.cuda.enable_cudnn_sdp(True)
    torch.backends.cuda.enable_mem_efficient_sdp(True)
    torch.backends.cuda.enable_flash_sdp(True)
    native_runner.forget_compiled()
    dec = SpeculativeDecoder(model, None, compile=True, sampling=SamplingParams(temperature=0.0), eos_token_id=-1,
                             pad_token_id=0)
    prompts = torch.randint(0, 1000, (1, 64)).tolist()
    dec.generate(input_ids=prompts, max_new_tokens=128)
    prof = cProfile.Profile()
    prof.enable()
    out = dec.generate(input_ids=prompts, max_new_tokens=128)
    prof.disable()
    buf = io.StringIO()
    pstats.Stats(prof, stream=buf).sort_stats("tottime").print_stats(30)
    res["host_profile_tottime"] = buf.getvalue()
    res["engine"] = dict(tok_s=out.stats.tokens_per_second, times=out.stats.times, wall=out.stats.wall_time)
    print(buf.getvalue()[:6000], flush=True)
    with open(args.json, "w") as f:
        json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
