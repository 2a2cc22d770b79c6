"""GPU: where a decode step's time goes, kernel by kernel, and what the fused decode layer changes.

Usage: python3 bench/scripts/forward_profile.py --out OUT.json [--settings "attn,compact;layer,attn,compact"]
       [--real-dir DIR] [--sweep] [--tokens 128] [--context 500]

For each ``kernels`` setting (TILESPEC_NATIVE_KERNELS; ";" separates settings; the first is the baseline):
1. ``forwards``: graph-replay ms of the native forward at (B, q) in FORWARD_SHAPES, and the logits' max difference
   and argmax agreement against the baseline's on the same inputs;
2. ``profiles``: one q = 1 decode forward and one q = 5 verify forward (B = 1), kernel by kernel in launch order:
   duration, the gap before it, its role (qkv / o / gate_up / down / lm_head from the GEMM order, attention, other),
   the bytes its role must move (weights; K/V for attention) and the bandwidth that gives; plus totals per role;
3. ``decoder_step``: a target-only decoding step (B = 1): wall ms, GPU busy / idle, host functions; ``head_step``:
   a decoding step with a random draft head (γ 4; per-kernel totals by name, busy / idle time), the
   step cost profile of step_cost_profile.py;
4. ``engine``: target-only tok/s at B = 1 and 8 (``--tokens`` new tokens, EOS ignored).
``--sweep`` times each M = 1 projection kernel over its launch globals against cuBLAS (CUDA-graph replay).
Random-init Qwen2.5-1.5B shapes unless ``--real-dir`` (timing does not depend on the weights).
"""
from __future__ import annotations

import argparse
import itertools
import json
import os
import re
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(__file__))
from native_forward import random_model, time_replays  # noqa: E402

FORWARD_SHAPES = ((1, 1), (1, 2), (1, 5), (1, 8), (8, 1), (8, 5), (16, 1), (64, 1))
GEMM = re.compile(r"nvjet|gemm|gemv|cutlass|_fused_linear_kernel|_qkv_rope_kernel|sm90_xmma", re.I)
NOT_GEMM = re.compile(r"splitKreduce|reduce_kernel", re.I)
ATTENTION = re.compile(r"attention|sdpa|flash|fmha|_partial_kernel|_merge_kernel", re.I)


def build_model(real_dir):
    if not real_dir:
        return random_model("qwen2.5-1.5b")
    from transformers import AutoModelForCausalLM
    return AutoModelForCausalLM.from_pretrained(real_dir, dtype=torch.bfloat16).cuda().eval()


def _runner(model, kernels: str, capacity: int):
    from tilespec.engine.native import NativeRunner
    return NativeRunner(model, capacity, mode="native-graphs", kernels=kernels)


def _inputs(b: int, q: int, context: int, capacity: int):
    g = torch.Generator(device="cuda").manual_seed(b * 100 + q)
    tokens = torch.randint(0, 1000, (b, q), device="cuda", generator=g)
    pos = torch.arange(context, context + q, device="cuda")[None].expand(b, q).contiguous()
    mask = torch.zeros(b, 1, q, capacity, dtype=torch.bool, device="cuda")
    for t in range(q):
        mask[:, :, t, :context + t + 1] = True
    return tokens, pos, mask


def forwards(model, kernels: str, context: int, capacity: int, baseline: dict | None) -> tuple[list, dict]:
    runner = _runner(model, kernels, capacity)
    rows, logits = [], {}
    for b, q in FORWARD_SHAPES:
        tokens, pos, mask = _inputs(b, q, context, capacity)
        t0 = time.perf_counter()
        out = runner.forward(tokens, pos, mask, context)
        first = time.perf_counter() - t0
        graph = list(runner._graphs._graphs.values())[-1].graph
        ms = time_replays(graph.replay)
        logits[(b, q)] = out
        row = dict(batch=b, q=q, graph_replay_ms=ms, first_call_s=first)
        if baseline is not None:
            ref = baseline[(b, q)]
            row["max_abs_logit_diff"] = float((out - ref).abs().max())
            row["argmax_agreement"] = float((out.argmax(-1) == ref.argmax(-1)).float().mean())
        rows.append(row)
        print(f"  [{kernels or 'none'}] B={b} q={q}: {ms:.3f} ms" + (
            f"  (max |dlogit| {row['max_abs_logit_diff']:.3g}, argmax agree {row['argmax_agreement']:.3f})"
            if baseline is not None else ""), flush=True)
    return rows, logits


def _role_bytes(native, context: int, b: int) -> dict:
    el = native.embed.element_size()
    w = native.layers[0]
    kv = 2 * b * native.kv_heads * (context + 1) * native.head_dim * el
    return {"qkv": w.qkv.numel() * el, "o": w.o.numel() * el, "gate_up": w.gate_up.numel() * el,
            "down": w.down.numel() * el, "lm_head": native.lm_head.numel() * el, "attention": kv}


def profile_forward(model, kernels: str, q: int, context: int, capacity: int) -> dict:
    """One B = 1 forward replay, kernel by kernel (the median of 10 replays per kernel position)."""
    from torch.profiler import ProfilerActivity, profile
    from engine_profile import kernel_intervals
    from tilespec.engine.native.runner import native_model
    runner = _runner(model, kernels, capacity)
    tokens, pos, mask = _inputs(1, q, context, capacity)
    runner.forward(tokens, pos, mask, context)
    graph = list(runner._graphs._graphs.values())[-1].graph
    reps = 10
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            graph.replay()
            torch.cuda.synchronize()
    iv = kernel_intervals(prof)
    n = len(iv) // reps
    per = [iv[i * n:(i + 1) * n] for i in range(reps)]
    native = native_model(model)
    layers = native.num_layers
    sizes = _role_bytes(native, context, 1)
    names = [x[2] for x in per[0]]
    gemm_idx = [i for i, nm in enumerate(names) if GEMM.search(nm) and not NOT_GEMM.search(nm)]
    roles = {}
    if len(gemm_idx) == 4 * layers + 1:
        for j, i in enumerate(gemm_idx):
            roles[i] = "lm_head" if j == len(gemm_idx) - 1 else ("qkv", "o", "gate_up", "down")[j % 4]
    rows = []
    for i, nm in enumerate(names):
        durs = sorted(p[i][1] - p[i][0] for p in per)
        gaps = sorted(p[i][0] - p[i - 1][1] for p in per) if i else [0.0]
        role = roles.get(i) or ("attention" if ATTENTION.search(nm) else ("gemm?" if i in gemm_idx else "other"))
        us = durs[len(durs) // 2]
        nbytes = sizes.get(role) if not (role == "attention" and "merge" in nm) else None
        rows.append(dict(i=i, name=nm[:110], role=role, us=us, gap_before_us=gaps[len(gaps) // 2],
                         bytes=nbytes, gb_s=(nbytes / us / 1e3) if nbytes else None))
    by_role: dict = {}
    for r in rows:
        e = by_role.setdefault(r["role"], {"kernels": 0, "us": 0.0, "bytes": 0})
        e["kernels"] += 1
        e["us"] += r["us"]
        e["bytes"] += r["bytes"] or 0
    for e in by_role.values():
        e["gb_s"] = e["bytes"] / e["us"] / 1e3 if e["bytes"] else None
    total_us, gap_us = sum(r["us"] for r in rows), sum(r["gap_before_us"] for r in rows)
    span_ms = time_replays(graph.replay)
    weight_bytes = sum(v for k, v in sizes.items() if k != "lm_head" and k != "attention") * layers + sizes["lm_head"]
    print(f"  profile [{kernels or 'none'}] q={q}: {len(rows)} kernels, {total_us:.0f} us busy, {gap_us:.0f} us gaps,"
          f" replay {span_ms * 1e3:.0f} us; " + ", ".join(f"{k} {v['us']:.0f} us" for k, v in by_role.items()),
          flush=True)
    return dict(kernels=kernels, q=q, context=context, n_kernels=len(rows), busy_us=total_us, gaps_us=gap_us,
                replay_us=span_ms * 1e3, weight_bytes=weight_bytes, by_role=by_role, rows=rows)


def decoder_step(model, kernels: str, tokens: int) -> dict:
    """Target-only decoding (B = 1, SpeculativeDecoder): wall ms per step and the GPU's busy / idle time per step."""
    from tilespec import settings
    from step_cost_profile import decoder_run, measure
    settings.configure(native_kernels=kernels)
    once, steps_of = decoder_run(model, None, list(range(100, 164)), tokens)
    res = measure(f"target-only[{kernels or 'none'}]", once, steps_of)
    res["host_top"] = res.get("host_top", [])[:15]
    return res


def head_step(model, kernels: str, tokens: int) -> dict:
    from tilespec import settings
    from step_cost_profile import decoder_run, measure, random_head
    from tilespec.engine.drafters.head import HeadDrafter
    settings.configure(native_kernels=kernels)
    head = random_head(model)
    once, steps_of = decoder_run(model, HeadDrafter(head), list(range(100, 164)), tokens, gamma=4)
    res = measure(f"head-gamma4[{kernels or 'none'}]", once, steps_of)
    res.pop("host_top", None)
    return res


def engine(model, kernels: str, tokens: int) -> list:
    from tilespec import settings
    from native_forward import engine_tok_s
    settings.configure(native_kernels=kernels)
    return [engine_tok_s(model, b, tokens) for b in (1, 8)]


class _Globals:
    """Set a module's launch globals inside a ``with`` block and restore them after."""

    def __init__(self, module, **values):
        self.module, self.values = module, values

    def __enter__(self):
        self.saved = {k: getattr(self.module, k) for k in self.values}
        for k, v in self.values.items():
            setattr(self.module, k, v)

    def __exit__(self, *exc):
        for k, v in self.saved.items():
            setattr(self.module, k, v)


def _grid(m: int):
    warps = (4, 8) if m == 1 else (4,)
    return itertools.product((4, 8, 16), (512, 1024), warps)


def sweep(model, rows=(1, 5, 8)) -> list:
    """Few-row projection kernels over their launch globals vs cuBLAS (F.linear, no norm or epilogue), µs per call
    in a CUDA graph of 20 calls, at M rows."""
    import torch.nn.functional as F
    from native_kernels import graph_us
    from tilespec.engine.native import linear, qkv_rope
    from tilespec.engine.native.runner import native_model
    nat = native_model(model)
    w = nat.layers[0]
    out = []

    def timed(fn):
        try:
            return graph_us(fn)
        except Exception as err:   # e.g. out of shared memory / registers
            print(f"    {type(err).__name__}: {str(err)[:80]}", flush=True)
            return None

    for m in rows:
        rnd = lambda k: torch.randn(m, k, device="cuda", dtype=nat.dtype)  # noqa: E731
        x = rnd(w.qkv.shape[1])
        cases = {"o": (rnd(w.o.shape[1]), w.o, {}), "gate_up": (x, w.gate_up, dict(norm=w.ln2, silu_mul=True)),
                 "down": (rnd(w.down.shape[1]), w.down, {})}
        for name, (xx, ww, kw) in cases.items():
            base = timed(lambda: F.linear(xx, ww))
            for bn, bk, warps in _grid(m):
                with _Globals(linear, FEW_BLOCK_N=bn, FEW_BLOCK_N_LARGE=bn, FEW_BLOCK_K=bk, FEW_BLOCK_K_LONG=bk,
                              NUM_WARPS=warps):
                    us = timed(lambda: linear.fused_linear(xx, ww, **kw))
                out.append(dict(proj=name, m=m, block_n=bn, block_k=bk, warps=warps, us=us, cublas_us=base,
                                weight_bytes=ww.numel() * ww.element_size()))
        caches = nat.new_caches(1, 1024)[0]
        h = torch.randn(1, m, x.shape[1], device="cuda", dtype=nat.dtype)
        cos = torch.randn(1, m, nat.head_dim, device="cuda")
        wp = torch.tensor(500, device="cuda")
        base = timed(lambda: F.linear(x, w.qkv, w.qkv_bias))
        for hb, bk, warps in _grid(m):
            with _Globals(qkv_rope, HALF_BLOCK=max(hb, 4), BLOCK_K=bk, NUM_WARPS=warps):
                us = timed(lambda: qkv_rope.qkv_rope(h, h, w.ln1, w.qkv, w.qkv_bias, cos, cos, *caches, wp,
                                                     heads=nat.heads, kv_heads=nat.kv_heads, head_dim=nat.head_dim,
                                                     eps=nat.eps))
            out.append(dict(proj="qkv_rope", m=m, block_n=2 * hb, block_k=bk, warps=warps, us=us, cublas_us=base,
                            weight_bytes=w.qkv.numel() * w.qkv.element_size()))
        for name in ("o", "gate_up", "down", "qkv_rope"):
            best = min((r for r in out if r["proj"] == name and r["m"] == m and r["us"]), key=lambda r: r["us"],
                       default=None)
            if best:
                print(f"  sweep M={m} {name}: best {best['us']:.2f} us ({best['weight_bytes'] / best['us'] / 1e3:.0f}"
                      f" GB/s) at block_n {best['block_n']} block_k {best['block_k']} warps {best['warps']}; cuBLAS "
                      f"{best['cublas_us'] or float('nan'):.2f} us", flush=True)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--settings", default="attn,compact;layer,attn,compact")
    ap.add_argument("--real-dir", default="")
    ap.add_argument("--sweep", action="store_true")
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--context", type=int, default=500)
    ap.add_argument("--capacity", type=int, default=1024)
    ap.add_argument("--parts", default="forwards,profiles,head,engine")
    args = ap.parse_args()
    from tilespec.engine.native.runner import forget_compiled
    from tilespec.env import git_commit
    import transformers
    import triton
    model = build_model(args.real_dir)
    parts = set(args.parts.split(","))
    res = dict(device=torch.cuda.get_device_name(), torch=torch.__version__, triton=triton.__version__,
               transformers=transformers.__version__, commit=os.environ.get("TILESPEC_COMMIT") or git_commit(),
               date=time.strftime("%Y-%m-%d"), weights=args.real_dir or "random-init Qwen2.5-1.5B shape (timing only)",
               context=args.context, capacity=args.capacity, settings={})

    def save():
        with open(args.out, "w") as f:
            json.dump(res, f, indent=1)

    if args.sweep:
        res["sweep"] = sweep(model)
        save()
    baseline = None
    for kernels in args.settings.split(";"):
        forget_compiled()
        entry = res["settings"].setdefault(kernels or "none", {})
        if "forwards" in parts:
            entry["forwards"], logits = forwards(model, kernels, args.context, args.capacity, baseline)
            baseline = baseline or logits
            save()
        if "profiles" in parts:
            entry["profiles"] = [profile_forward(model, kernels, q, args.context, args.capacity) for q in (1, 5)]
            save()
        if "decoder" in parts:
            entry["decoder_step"] = decoder_step(model, kernels, args.tokens)
            save()
        if "head" in parts:
            entry["head_step"] = head_step(model, kernels, args.tokens)
            save()
        if "engine" in parts:
            entry["engine"] = engine(model, kernels, args.tokens)
            print(f"  engine [{kernels or 'none'}]: " + ", ".join(f"B={r['batch']} {r['tok_s']:.0f} tok/s"
                                                                  for r in entry["engine"]), flush=True)
            save()
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
