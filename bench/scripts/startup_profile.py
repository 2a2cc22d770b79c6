"""Where the engine process's model load spends its seconds before the weights: the imports, transformers' config and
tokenizer, each under cProfile, with CUDA's context created on a thread beside them as `tilespec serve`'s engine
process does (serve/startup.cuda_init), and once without that thread (a fresh process each). Only the model folder's
small files are needed (config.json, the tokenizer's), so it runs on a GPU machine without the weights.

    python bench/scripts/startup_profile.py --model-dir DIR --out bench/results/engine-load-profile-<card>.json
"""
from __future__ import annotations

import argparse
import cProfile
import io
import json
import os
import platform
import pstats
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def top(profile: cProfile.Profile, n: int = 25) -> list:
    """The ``n`` functions with the most cumulative time, as text lines."""
    out = io.StringIO()
    pstats.Stats(profile, stream=out).sort_stats("cumulative").print_stats(n)
    return [line.rstrip() for line in out.getvalue().splitlines() if line.strip()][-n:]


def phases(model_dir: str, beside: bool) -> dict:
    """One process's phases (seconds) and the profiles of the config and the tokenizer."""
    t0 = time.perf_counter()
    marks, profiles = {}, {}
    import torch    # noqa: F401 - timed: the engine process imports it first
    marks["import torch"] = time.perf_counter() - t0
    cuda = None
    if beside:
        from tilespec.serve.startup import cuda_init
        cuda = cuda_init("cuda")
    t = time.perf_counter()
    import transformers as tf
    from transformers import AutoConfig
    marks["import transformers"] = time.perf_counter() - t
    for name, fn in (("config", lambda: AutoConfig.from_pretrained(model_dir)),
                     ("tokenizer", lambda: tf.AutoTokenizer.from_pretrained(model_dir))):
        profile, t = cProfile.Profile(), time.perf_counter()
        profile.enable()
        fn()
        profile.disable()
        marks[name] = time.perf_counter() - t
        profiles[name] = top(profile)
    if cuda is not None:
        t = time.perf_counter()
        cuda.result()
        marks["cuda joined"], marks["cuda thread"] = time.perf_counter() - t, cuda.seconds
    return {"cuda_beside": beside, "seconds": {k: round(v, 3) for k, v in marks.items()}, "profiles": profiles}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model-dir", required=True, help="a model folder (config.json and the tokenizer's files)")
    p.add_argument("--one", choices=["beside", "alone"], help=argparse.SUPPRESS)    # a child's run
    p.add_argument("--out", type=Path)
    a = p.parse_args()
    if a.one:
        print(json.dumps(phases(a.model_dir, a.one == "beside")))
        return 0
    runs = []
    for mode in ("beside", "alone", "beside"):      # fresh processes: no module imported twice
        env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT / "src"), os.environ.get("PYTHONPATH", "")]))
        done = subprocess.run([sys.executable, __file__, "--model-dir", a.model_dir, "--one", mode], env=env,
                              capture_output=True, text=True)
        if done.returncode != 0:
            print(done.stderr[-2000:], file=sys.stderr)
            return done.returncode
        runs.append(json.loads(done.stdout.strip().splitlines()[-1]))
        print(mode, runs[-1]["seconds"], flush=True)
    try:
        gpu = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"], capture_output=True,
                             text=True).stdout.strip()
    except FileNotFoundError:
        gpu = ""
    out = {"what": "the engine process's load before the weights: imports, config, tokenizer (cProfile), with and "
                   "without CUDA's context created beside", "device": gpu or "cpu",
           "cpu": platform.processor(), "cpu_count": os.cpu_count(), "python": platform.python_version(),
           "commit": os.environ.get("TILESPEC_COMMIT") or subprocess.run(
               ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=ROOT).stdout.strip(),
           "date": time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime()), "model_dir": a.model_dir, "runs": runs}
    if a.out:
        a.out.write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
