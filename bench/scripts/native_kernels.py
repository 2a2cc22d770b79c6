"""GPU: tilespec's decode-shape Triton kernels (engine/native/linear.py, attention.py) against the PyTorch ops they
replace, per projection and in the whole native forward. Random-init Qwen2.5-1.5B / 0.5B shapes (timing only).

Usage: python3 bench/scripts/native_kernels.py --json OUT.json [--quick]

1. ``projections``: each layer projection of both models at M in {1, 8, 48} rows (48: default launch only), CUDA-graph replay of 20 calls
   (µs per call, GB/s of weight bytes): PyTorch (rms_norm + F.linear + epilogue, what inductor compiles them to is
   measured in step 2) vs ``fused_linear`` over a small sweep of its launch globals (outputs compared with the
   PyTorch ops: max abs difference recorded).
2. ``forwards``: the native forward (compiled layer, one CUDA graph) at (B, q) in {(1,1), (1,6), (8,1), (8,4)} for
   each ``kernels`` setting (TILESPEC_NATIVE_KERNELS), with a per-kernel profile of the B=1 q=1 replay.
0. ``attention``: decode attention alone, SDPA vs the split-KV kernels (graph replay).
3. ``engine``: target-only tok/s (B=1, 8; 128 new tokens) for "" and the fastest setting.
"""
from __future__ import annotations

import argparse
import itertools
import json
import os
import sys
import time
from pathlib import Path

import torch

from tilespec.env import git_commit
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
from native_forward import SHAPES, engine_tok_s, forward_times, profile_replay, random_model  # noqa: E402


def graph_us(fn, calls: int = 20, reps: int = 30) -> float:
    """Median µs per call of ``fn`` captured ``calls`` times in one CUDA graph."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(calls):
            fn()
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        g.replay()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) * 1000 / calls)
    times.sort()
    return times[len(times) // 2]


def projections(quick: bool) -> list:
    from tilespec.engine.native import linear
    rows = []
    keys = ("BLOCK_N_SMALL", "BLOCK_N_LARGE", "BLOCK_K", "NUM_STAGES", "NUM_WARPS")
    sweep = [dict(zip(keys, v)) for v in [(16, 32, 256, 4, 4), (16, 32, 128, 4, 4), (16, 32, 256, 2, 4),
                                          (32, 64, 256, 4, 4), (16, 32, 512, 3, 4), (16, 32, 256, 4, 8)]]
    if quick:
        sweep = sweep[:3]
    defaults = {k: getattr(linear, k) for k in sweep[0]}
    dev, dt = "cuda", torch.bfloat16
    for name, shp in SHAPES.items():
        d, f = shp["hidden_size"], shp["intermediate_size"]
        hd = d // shp["num_attention_heads"]
        nqkv = d + 2 * shp["num_key_value_heads"] * hd
        projs = {"qkv": (d, nqkv, dict(norm=True, bias=True)), "o": (d, d, dict(residual=True)),
                 "gate_up": (d, 2 * f, dict(norm=True, silu_mul=True)), "down": (f, d, dict(residual=True))}
        for (pname, (k, n, opts)), m in itertools.product(projs.items(), (1, 8, 48)):
            configs = sweep if m < 48 else sweep[:1]
            torch.manual_seed(0)
            x = torch.randn(m, k, device=dev, dtype=dt)
            w = torch.randn(n, k, device=dev, dtype=dt) * 0.02
            kw = dict(silu_mul=opts.get("silu_mul", False), eps=1e-6)
            if opts.get("norm"):
                kw["norm"] = torch.rand(k, device=dev, dtype=dt) + 0.5
            if opts.get("bias"):
                kw["bias"] = torch.randn(n, device=dev, dtype=dt) * 0.02
            if opts.get("residual"):
                kw["residual"] = torch.randn(m, n, device=dev, dtype=dt)
            ref = linear.fused_linear_reference(x, w, **kw)
            row = dict(model=name, proj=pname, m=m, k=k, n=n, weight_mb=w.numel() * 2 / 1e6,
                       torch_us=graph_us(lambda: linear.fused_linear_reference(x, w, **kw)), configs=[])
            for cfg in configs:
                for key, val in cfg.items():
                    setattr(linear, key, val)
                try:
                    out = linear.fused_linear(x, w, **kw)
                    us = graph_us(lambda: linear.fused_linear(x, w, **kw))
                    row["configs"].append(dict(cfg, us=us, max_abs_diff=(out.float() - ref.float()).abs().max().item()))
                except Exception as err:   # a config Triton cannot compile (shared memory): record it
                    row["configs"].append(dict(cfg, error=repr(err)[:400]))
                    print(f"  {name} {pname} M={m} {cfg}: {err!r}"[:600], flush=True)
            for key, val in defaults.items():
                setattr(linear, key, val)
            ok = [c for c in row["configs"] if "us" in c]
            best = min(ok, key=lambda c: c["us"]) if ok else None
            default = next((c for c in ok if all(c[k2] == v for k2, v in defaults.items())), None)
            row["best"], row["default"] = best, default
            gbs = lambda us: w.numel() * 2 / (us * 1e-6) / 1e9  # noqa: E731
            best_txt = (f"best {best['us']:.1f} us ({gbs(best['us']):.0f} GB/s) {({k2: best[k2] for k2 in defaults})}"
                        if best else "every config failed")
            print(f"{name} {pname} M={m}: torch {row['torch_us']:.1f} us ({gbs(row['torch_us']):.0f} GB/s), "
                  f"kernel default {default and round(default['us'], 1)}, {best_txt}", flush=True)
            rows.append(row)
    return rows


def attention_inputs(b: int, nq: int, c: int, used: int) -> tuple:
    """Random bf16 decode-attention inputs with Qwen2.5-1.5B heads (12 query, 2 KV, D 128) on CUDA: q [B, H, Q, D]
    (a transposed view, as the layer passes it), K / V caches [B, H_kv, C, D], an additive mask [B, 1, Q, C] that
    shows the first ``used`` slots."""
    torch.manual_seed(0)
    h, hkv, d = 12, 2, 128
    q = torch.randn(b, nq, h, d, device="cuda", dtype=torch.bfloat16).transpose(1, 2)
    k = torch.randn(b, hkv, c, d, device="cuda", dtype=torch.bfloat16)
    v = torch.randn_like(k)
    mask = torch.full((b, 1, nq, c), torch.finfo(torch.bfloat16).min, device="cuda", dtype=torch.bfloat16)
    mask[..., :used] = 0
    return q, k, v, mask


def attention_rows(splits=(64, 128, 256)) -> list:
    """Decode attention (Qwen2.5-1.5B heads) at B in {1, 8}, Q in {1, 6}, C in {512, 2048} with a third of the
    capacity in use: SDPA (cuDNN, what the layer runs by default) vs the split-KV kernels at each SPLIT (cache
    slots per program); graph-replay µs."""
    from tilespec.engine.native import attention
    rows, default_split = [], attention.SPLIT
    for b, nq, c in itertools.product((1, 8), (1, 6), (512, 2048)):
        used = c // 3
        q, k, v, mask = attention_inputs(b, nq, c, used)
        ref = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)
        row = dict(batch=b, q=nq, capacity=c, used=used,
                   sdpa_us=graph_us(lambda: F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)))
        for split in splits:
            attention.SPLIT = split
            out = torch.ops.tilespec.decode_attention(q, k, v, mask).transpose(1, 2)
            row[f"kernel_us_split{split}"] = graph_us(lambda: torch.ops.tilespec.decode_attention(q, k, v, mask))
            row[f"max_abs_diff_split{split}"] = (out.float() - ref.float()).abs().max().item()
        attention.SPLIT = default_split
        print("attention", row, flush=True)
        rows.append(row)
    return rows


def forwards(settings: list, quick: bool) -> dict:
    from tilespec.engine.native import runner as native_runner
    out = {}
    for name in SHAPES:
        model = random_model(name)
        out[name] = {}
        for kernels in settings:
            os.environ["TILESPEC_NATIVE_KERNELS"] = kernels
            native_runner.forget_compiled()
            print(f"{name} kernels={kernels!r}", flush=True)
            try:
                t0 = time.perf_counter()
                rows = forward_times(model, batches=(1, 8), qs=(1, 6))
                entry = dict(rows=rows, seconds=time.perf_counter() - t0)
                if name == "qwen2.5-1.5b":
                    entry["profile_q1"] = profile_replay(model)
            except Exception as err:
                entry = dict(error=repr(err)[:500])
                print("  error", entry["error"], flush=True)
            out[name][kernels or "none"] = entry
        del model
        torch.cuda.empty_cache()
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--json", required=True)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--skip", nargs="*", default=[], choices=("attention", "projections", "forwards", "engine"))
    ap.add_argument("--settings", nargs="*", default=None, help="kernels settings to compare (default: a ladder)")
    args = ap.parse_args()
    import transformers
    import triton
    from tilespec.engine.native import runner as native_runner
    res = dict(device=torch.cuda.get_device_name(), torch=torch.__version__, transformers=transformers.__version__,
               triton=triton.__version__, date=time.strftime("%Y-%m-%d %H:%M"),
               commit=git_commit() or "unknown", weights="random-init (timing only)")

    def save():
        with open(args.json, "w") as fh:
            json.dump(res, fh, indent=1)

    if "attention" not in args.skip:
        res["attention"] = attention_rows()
        save()
    if "projections" not in args.skip:
        res["projections"] = projections(args.quick)
        save()
    settings = args.settings if args.settings is not None else ["", "attn", "qkv", "qkv,attn", "qkv,o,attn", "all"]
    if "forwards" not in args.skip:
        res["forwards"] = forwards(settings, args.quick)
        save()
    if "engine" not in args.skip:
        fw = res.get("forwards", {}).get("qwen2.5-1.5b", {})
        q1 = {k: next(r["graph_replay_ms"] for r in v["rows"] if r["batch"] == 1 and r["q"] == 1)
              for k, v in fw.items() if "rows" in v}
        best = min(q1, key=q1.get) if q1 else "all"
        res["engine"] = {}
        model = random_model("qwen2.5-1.5b")
        for kernels in dict.fromkeys(["none", best]):
            os.environ["TILESPEC_NATIVE_KERNELS"] = "" if kernels == "none" else kernels
            native_runner.forget_compiled()
            res["engine"][kernels] = [engine_tok_s(model, b, 128) for b in (1, 8)]
            print("engine", kernels, [(r["batch"], round(r["tok_s"], 1)) for r in res["engine"][kernels]], flush=True)
            save()
    save()


if __name__ == "__main__":
    main()
