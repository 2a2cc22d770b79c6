"""GPU experiment: SDPA (cuDNN) vs FlexAttention's decoding kernel inside the compiled native layer.
Random-init Qwen2.5 shapes; forward graph-replay ms per (model, B, q). Usage: native_flex.py --json OUT"""
from __future__ import annotations

import argparse
import json
import time

import torch

from tilespec import settings
from tilespec.env import git_commit
from native_forward import SHAPES, forward_times, random_model


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--json", required=True)
    args = ap.parse_args()
    from tilespec.engine.native import runner as native_runner
    res = dict(device=torch.cuda.get_device_name(), torch=torch.__version__, date=time.strftime("%Y-%m-%d"),
               commit=git_commit() or "unknown", weights="random-init (timing only)", rows=[])
    for name in SHAPES:
        model = random_model(name)
        for flex in ("0", "1"):
            settings.configure(native_flex=flex == "1")
            native_runner.forget_compiled()
            t0 = time.perf_counter()
            rows = forward_times(model, batches=(1, 8), qs=(1, 4))
            for r in rows:
                r.update(model=name, attention="flex" if flex == "1" else "sdpa")
            res["rows"] += rows
            res.setdefault("compile_s", {})[f"{name}/{flex}"] = time.perf_counter() - t0
            with open(args.json, "w") as f:
                json.dump(res, f, indent=1)
        del model


if __name__ == "__main__":
    main()
