"""GPU check of first-call costs in the eval harness's timed regions (no real weights needed).

Part A: ``verify()`` first-call vs steady-state time per (method, draft kind, K), with the number of compiled Triton
variants of each kernel after every call: shows which argument changes compile a new variant.
Part B: the harness's main comparison (hf, tiled, fused, sigmoid; T = 1; heuristic γ from 5) on random-weight
Qwen2-shaped models with the real vocabulary (151,936), with the legacy warm-up (one 8-token generation) and with
the exhaustive one (every reachable K and draft kind): per-example verify ms/step per method.

    PYTHONPATH=src python3 bench/gpu/warmup_check.py [--json OUT.json] [--compile eager|graphs]
"""
from __future__ import annotations

import argparse
import json
import time

import torch


def ncompiled(fn) -> int:
    total = 0
    for v in getattr(fn, "device_caches", {}).values():
        cache = v[0] if isinstance(v, tuple) else v
        try:
            total += len(cache)
        except TypeError:
            pass
    return total


def kernels():
    from tilespec.verify.kernels.sample import accept_sample_kernel, sample_row_kernel
    from tilespec.verify.kernels.stats import row_stats_kernel
    from tilespec.verify.kernels.tiled import tiled_partials_kernel
    return {"stats": row_stats_kernel, "sample": accept_sample_kernel, "sample_row": sample_row_kernel,
            "tiled": tiled_partials_kernel}


def part_a(vocab: int, dtype=torch.float32, k_values=(0, 1, 2, 3, 5, 8, 13, 16, 17, 20)) -> list:
    from tilespec.verify import verify
    from tilespec.verify.types import SamplingParams

    ks = kernels()
    rows = []
    seeds = torch.tensor([7], device="cuda")
    offsets = torch.tensor([100], device="cuda")
    for method in ("tiled", "fused", "sigmoid"):
        for kind in ("logits", "none"):
            for k in k_values:
                if kind == "logits" and k == 0:
                    continue
                times = []
                before = {n: ncompiled(f) for n, f in ks.items()}
                for rep in range(3):
                    tl = torch.randn(1, k + 1, vocab, device="cuda", dtype=dtype)
                    dt = torch.randint(0, vocab, (1, k), device="cuda")
                    dl = torch.randn(1, k, vocab, device="cuda", dtype=dtype) if kind == "logits" else None
                    torch.cuda.synchronize()
                    t0 = time.perf_counter()
                    verify(tl, dt, draft_logits=dl, sampling=SamplingParams(temperature=1.0), method=method,
                           seed=seeds, offsets=offsets, check_values=False)
                    torch.cuda.synchronize()
                    times.append(1e3 * (time.perf_counter() - t0))
                after = {n: ncompiled(f) for n, f in ks.items()}
                new = {n: after[n] - before[n] for n in ks if after[n] != before[n]}
                rows.append(dict(method=method, kind=kind, K=k, first_ms=round(times[0], 2),
                                 steady_ms=round(min(times[1:]), 3), new_variants=new))
                print(f"A {method:8s} {kind:6s} K={k:2d} first {times[0]:8.2f} ms steady {min(times[1:]):7.3f} ms "
                      f"new variants {new}", flush=True)
    # pointer alignment: a bf16 row slice of an odd vocabulary starts off a 16-byte boundary
    for method in ("fused", "sigmoid"):
        for off in (0, 1):
            v = 51865
            buf = torch.randn(1, 8, v, device="cuda", dtype=torch.bfloat16)
            tl = buf[:, off:off + 4]
            dl = torch.randn(1, 3, v, device="cuda", dtype=torch.bfloat16)
            dt = torch.randint(0, v, (1, 3), device="cuda")
            before = {n: ncompiled(f) for n, f in ks.items()}
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            verify(tl, dt, draft_logits=dl, sampling=SamplingParams(temperature=1.0), method=method, seed=seeds,
                   offsets=offsets, check_values=False)
            torch.cuda.synchronize()
            after = {n: ncompiled(f) for n, f in ks.items()}
            new = {n: after[n] - before[n] for n in ks if after[n] != before[n]}
            rows.append(dict(method=method, kind="bf16-slice", K=3, row_offset=off, V=v,
                             first_ms=round(1e3 * (time.perf_counter() - t0), 2), new_variants=new))
            print(f"A {method} bf16 V={v} row offset {off}: {1e3 * (time.perf_counter() - t0):.2f} ms new {new}",
                  flush=True)
    return rows


def part_b(compile_mode: str, n: int, tokens: int) -> dict:
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from tilespec.eval import harness
    from tilespec.eval.harness import EvalConfig, run_main
    from tilespec.eval.tasks import TextTask

    torch.manual_seed(0)
    cfg_t = Qwen2Config(vocab_size=151936, hidden_size=512, intermediate_size=1024, num_hidden_layers=4,
                        num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=4096,
                        tie_word_embeddings=False)
    target = Qwen2ForCausalLM(cfg_t).to("cuda", torch.bfloat16).eval()
    d = cfg_t.to_dict()
    d["num_hidden_layers"] = 1
    if d.get("layer_types"):
        d["layer_types"] = d["layer_types"][:1]
    cfg_d = Qwen2Config(**d)
    draft = Qwen2ForCausalLM(cfg_d).to("cuda", torch.bfloat16).eval()
    draft.load_state_dict(target.state_dict(), strict=False)
    with torch.no_grad():
        for m in (target, draft):
            m.lm_head.weight.mul_(40.0)     # peaked next-token laws: acceptance varies, γ moves

    class Tok:
        def __call__(self, text):
            return {"input_ids": [int(w) % 151000 if w.isdigit() else 5 for w in text.split()]}

        def decode(self, ids, skip_special_tokens=True):
            return " ".join(map(str, ids))

    gen = torch.Generator().manual_seed(1)
    docs = [dict(id=str(i), document=" ".join(str(int(x)) for x in torch.randint(0, 151000, (300 + 40 * i,),
                                                                                  generator=gen)),
                 reference="1 2 3") for i in range(n)]
    out = {}
    legacy_warm = harness.warm_up

    def legacy(dec, prepared, method, cfg, *, gamma, schedule, limit, exhaustive=None):
        p = prepared[0]
        dec.generate(input_ids=[p.ids], max_new_tokens=min(8, limit), seed=cfg.seed, input_features=p.features)
        return {"legacy": True}

    for label, fn in (("legacy-warmup", legacy), ("exhaustive-warmup", legacy_warm)):
        harness.warm_up = fn
        try:
            cfg = EvalConfig(task="summarization", dataset="xsum", methods=("hf", "tiled", "fused", "sigmoid"),
                             target="random-qwen2", draft="random-qwen2:layers=1", device="cuda", dtype="bfloat16",
                             max_new_tokens=tokens, temperature=1.0, compile=compile_mode)
            t0 = time.time()
            rows = run_main(target, draft, TextTask(Tok(), None), docs, cfg, log=print)
            out[label] = {m: dict(verify_step_ms=r["verify_step_ms"], verify_step_ms_std=r["verify_step_ms_std"],
                                  verify_time_s=r["verify_time_s"], delta_profiling_pct=r.get("delta_profiling_pct"),
                                  wall_time_s=r["wall_time_s"], mean_gamma=r["mean_gamma"], steps=r["steps"],
                                  warmup=r.get("warmup"))
                          for m, r in rows.items()}
            out[label]["seconds"] = time.time() - t0
            print(label, json.dumps(out[label], default=str)[:1500], flush=True)
        finally:
            harness.warm_up = legacy_warm
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--json", default=None)
    ap.add_argument("--compile", default="eager")
    ap.add_argument("--n", type=int, default=4)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--skip-a", action="store_true")
    ap.add_argument("--ks", default="0,1,2,3,5,8,13,16,17,20", help="draft lengths of part A")
    args = ap.parse_args()
    import triton
    res = dict(device=torch.cuda.get_device_name(0), torch=torch.__version__, triton=triton.__version__)
    if not args.skip_a:
        res["part_a"] = part_a(151936, k_values=tuple(int(k) for k in args.ks.split(",")))
    res["part_b_" + args.compile] = part_b(args.compile, args.n, args.tokens)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=1, default=str)


if __name__ == "__main__":
    main()
