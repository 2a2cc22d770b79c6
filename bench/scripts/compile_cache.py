"""GPU: the user-visible compile cost of the native runtime, cold vs warm (inductor's on-disk caches).

Run it twice in separate processes: the first compiles (cold unless the cache folder already holds the kernels),
the second finds inductor's FX-graph and Triton caches on disk. Appends one row per run to --json.
Usage: python3 bench/scripts/compile_cache.py --model qwen2.5-coder-0.5b-instruct --json OUT.json
"""
from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

import torch

from tilespec.env import git_commit
def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="qwen2.5-coder-0.5b-instruct")
    ap.add_argument("--json", required=True)
    args = ap.parse_args()
    import tilespec
    from tilespec.engine import SpeculativeDecoder
    from tilespec.verify import SamplingParams
    t0 = time.perf_counter()
    model, tok = tilespec.load(args.model, dtype="bfloat16", device="cuda")
    load_s = time.perf_counter() - t0
    dec = SpeculativeDecoder(model, None, compile=True, sampling=SamplingParams(temperature=0.0), tokenizer=tok)
    t0 = time.perf_counter()
    out = dec.generate(input_ids=[[1, 2, 3, 4, 5, 6, 7, 8]], max_new_tokens=8)
    first = time.perf_counter() - t0
    t0 = time.perf_counter()
    dec.generate(input_ids=[[1, 2, 3, 4, 5, 6, 7, 8]], max_new_tokens=8)
    second = time.perf_counter() - t0
    path = Path(args.json)
    rows = json.loads(path.read_text()) if path.exists() else []
    rows.append(dict(model=args.model, device=torch.cuda.get_device_name(), torch=torch.__version__,
                     commit=git_commit() or "unknown", date=time.strftime("%Y-%m-%d"),
                     run=len(rows) + 1, load_s=load_s, first_generate_s=first, compile_seconds=out.stats.compile_seconds,
                     second_generate_s=second, runtime=out.stats.runtime,
                     inductor_cache=os.environ.get("TORCHINDUCTOR_CACHE_DIR", "default (/tmp/torchinductor_$USER)")))
    path.write_text(json.dumps(rows, indent=1))
    print(rows[-1], flush=True)


if __name__ == "__main__":
    main()
