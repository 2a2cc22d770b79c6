"""GPU: which attention backend the native runtime's decode / verify forwards should use.

Usage: python3 bench/scripts/sdpa_backends.py --json OUT.json
1. SDPA alone at decode shapes (Qwen2.5-1.5B heads: 12 query / 2 KV heads, D = 128; B in {1, 8}, q in {1, 6},
   C in {512, 1024, 2048} with half the slots attended; additive bf16 mask as the engine builds it), per backend
   (PyTorch's default choice, cuDNN, memory-efficient, math), CUDA-graph replay µs.
2. The whole native 1.5B forward (random init) per TILESPEC_SDPA setting (graph replay ms, B 1/8, q 1/6), and the
   engine's target-only tok/s at B = 1 and 8 with each setting.
"""
from __future__ import annotations

import argparse
import itertools
import json
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(__file__))
from native_forward import engine_tok_s, forward_times, random_model  # noqa: E402
from native_kernels import graph_us  # noqa: E402

BACKENDS = ("default", "cudnn", "efficient", "math")


def alone() -> list:
    import torch.nn.functional as F
    from tilespec.engine.native.llama import sdpa_backends
    from torch.nn.attention import sdpa_kernel
    rows = []
    for b, nq, c in itertools.product((1, 8), (1, 6), (512, 1024, 2048)):
        torch.manual_seed(0)
        q = torch.randn(b, nq, 12, 128, device="cuda", dtype=torch.bfloat16).transpose(1, 2)
        k = torch.randn(b, 2, c, 128, device="cuda", dtype=torch.bfloat16)
        v = torch.randn_like(k)
        mask = torch.full((b, 1, nq, c), torch.finfo(torch.bfloat16).min, device="cuda", dtype=torch.bfloat16)
        mask[..., : c // 2] = 0
        ref = F.scaled_dot_product_attention(q.float(), k.float(), v.float(), attn_mask=mask.float(), enable_gqa=True)
        row = dict(batch=b, q=nq, capacity=c)
        for name in BACKENDS:
            def run(name=name):
                if name == "default":
                    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)
                with sdpa_kernel(list(sdpa_backends(name))):
                    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)
            try:
                err = (run().float() - ref).abs().max().item()
                row[name] = dict(us=graph_us(run), max_abs_err=err)
            except Exception as exc:   # a backend that refuses these inputs
                row[name] = dict(error=repr(exc)[:200])
        print("alone", json.dumps(row), flush=True)
        rows.append(row)
    return rows


def forwards(settings) -> dict:
    from tilespec.engine.native import runner as native_runner
    model = random_model("qwen2.5-1.5b")
    out = {}
    for setting in settings:
        os.environ["TILESPEC_SDPA"] = setting
        native_runner.forget_compiled()
        print(f"TILESPEC_SDPA={setting!r}", flush=True)
        try:
            entry = dict(rows=forward_times(model, batches=(1, 8), qs=(1, 6), capacity=1024))
            entry["engine"] = [engine_tok_s(model, b, 128) for b in (1, 8)]
            print("  engine", [(e["batch"], round(e["tok_s"], 1)) for e in entry["engine"]], flush=True)
        except Exception as exc:
            entry = dict(error=repr(exc)[:500])
            print("  error", entry["error"], flush=True)
        out[setting or "default"] = entry
    os.environ.pop("TILESPEC_SDPA", None)
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--json", required=True)
    ap.add_argument("--settings", nargs="*", default=["", "efficient"])
    args = ap.parse_args()
    from tilespec.env import run_record
    res = dict(run_record("cuda"), weights="random-init (timing only)", date_local=time.strftime("%Y-%m-%d %H:%M"))
    res["alone"] = alone()
    with open(args.json, "w") as fh:
        json.dump(res, fh, indent=1)
    res["forwards"] = forwards(args.settings)
    with open(args.json, "w") as fh:
        json.dump(res, fh, indent=1)


if __name__ == "__main__":
    main()
