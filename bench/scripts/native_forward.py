"""GPU: time the native runtime's forwards and target-only decoding against transformers on Qwen2.5-shaped models.

Usage: python3 bench/scripts/native_forward.py --json OUT.json [--real-dir DIR] [--tokens 128]
Without --real-dir the models are random-initialised Qwen2.5-1.5B/0.5B shapes (timing only: α is meaningless).
Records per-forward graph-replay ms per (model, B, q), engine target-only tok/s (B=1, 8), transformers
``generate`` with the static cache (compiled by transformers; warm-up excluded) and plain ``generate``,
compile seconds, the HBM floor, device and versions.
"""
from __future__ import annotations

import argparse
import json
import time

import torch

from tilespec.env import git_commit
SHAPES = {"qwen2.5-1.5b": dict(hidden_size=1536, intermediate_size=8960, num_hidden_layers=28,
                               num_attention_heads=12, num_key_value_heads=2),
          "qwen2.5-0.5b": dict(hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
                               num_attention_heads=14, num_key_value_heads=2)}


def random_model(name: str):
    from transformers import Qwen2Config, Qwen2ForCausalLM
    cfg = Qwen2Config(vocab_size=151936, max_position_embeddings=32768, tie_word_embeddings=False,
                      rope_theta=1e6, attn_implementation="sdpa", **SHAPES[name])
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = Qwen2ForCausalLM(cfg).to(torch.bfloat16).eval()
    for p in model.parameters():
        p.data.normal_(0, 0.02)
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    return model


def time_replays(fn, n: int = 50) -> float:
    """Median ms of ``fn`` (already warm) by CUDA events."""
    times = []
    for _ in range(n):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b))
    times.sort()
    return times[len(times) // 2]


def forward_times(model, batches=(1, 8), qs=(1, 2, 3, 4, 6), capacity=512) -> list:
    from tilespec.engine.native import NativeRunner
    rows = []
    for b in batches:
        runner = NativeRunner(model, capacity, mode="native-graphs")
        for q in qs:
            tokens = torch.randint(0, 1000, (b, q), device="cuda")
            pos = torch.arange(100, 100 + q, device="cuda")[None].expand(b, q).contiguous()
            mask = torch.ones(b, 1, q, capacity, dtype=torch.bool, device="cuda")
            mask[..., 100 + q:] = False
            t0 = time.perf_counter()
            runner.forward(tokens, pos, mask, 100)
            torch.cuda.synchronize()
            first = time.perf_counter() - t0
            graph = list(runner._graphs._graphs.values())[-1].graph
            replay = time_replays(graph.replay)
            call = time_replays(lambda: runner.forward(tokens, pos, mask, 100))
            rows.append(dict(batch=b, q=q, graph_replay_ms=replay, forward_call_ms=call, first_call_s=first))
            print(f"  B={b} q={q}: replay {replay:.3f} ms, call {call:.3f} ms, first {first:.1f} s", flush=True)
    return rows


def profile_replay(model, q: int = 1, capacity: int = 512, top: int = 25) -> dict:
    """Per-kernel CUDA time of one q-token forward replay (torch.profiler over 20 replays)."""
    from torch.profiler import ProfilerActivity, profile
    from tilespec.engine.native import NativeRunner
    runner = NativeRunner(model, capacity, mode="native-graphs")
    tokens = torch.randint(0, 1000, (1, q), device="cuda")
    pos = torch.arange(100, 100 + q, device="cuda")[None]
    mask = torch.ones(1, 1, q, capacity, dtype=torch.bool, device="cuda")
    runner.forward(tokens, pos, mask, 100)
    graph = list(runner._graphs._graphs.values())[-1].graph
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(20):
            graph.replay()
        torch.cuda.synchronize()
    rows = []
    for ev in prof.key_averages():
        t = getattr(ev, "device_time_total", None) or getattr(ev, "cuda_time_total", 0)
        if t:
            rows.append(dict(name=ev.key[:120], calls_per_forward=ev.count / 20, us_per_forward=t / 20))
    rows.sort(key=lambda r: -r["us_per_forward"])
    total = sum(r["us_per_forward"] for r in rows)
    kernels = sum(r["calls_per_forward"] for r in rows)
    print(f"  profile q={q}: {total:.0f} us of kernels in {kernels:.0f} launches per forward", flush=True)
    for r in rows[:12]:
        print(f"    {r['us_per_forward']:8.1f} us  x{r['calls_per_forward']:.0f}  {r['name'][:90]}", flush=True)
    return dict(q=q, kernel_us_per_forward=total, kernels_per_forward=kernels, top=rows[:top])


def engine_tok_s(model, batch: int, tokens: int, prompt_len: int = 64, reps: int = 3) -> dict:
    from tilespec.engine import SpeculativeDecoder
    from tilespec.verify import SamplingParams
    dec = SpeculativeDecoder(model, None, compile=True, sampling=SamplingParams(temperature=0.0), eos_token_id=-1,
                             pad_token_id=0)
    prompts = torch.randint(0, 1000, (batch, prompt_len)).tolist()
    t0 = time.perf_counter()
    dec.generate(input_ids=prompts, max_new_tokens=tokens)
    warm = time.perf_counter() - t0
    rates, decode_rates = [], []
    for _ in range(reps):
        out = dec.generate(input_ids=prompts, max_new_tokens=tokens)
        rates.append(out.stats.tokens_per_second)
        decode = out.stats.wall_time - out.stats.times.get("prefill", 0.0)
        decode_rates.append(out.stats.new_tokens / decode)
    return dict(batch=batch, tokens=tokens, tok_s=max(rates), tok_s_all=rates, decode_tok_s=max(decode_rates),
                warmup_s=warm, runtime=out.stats.runtime)


def hf_tok_s(model, batch: int, tokens: int, static: bool, prompt_len: int = 64, reps: int = 3) -> dict:
    ids = torch.randint(0, 1000, (batch, prompt_len), device="cuda")
    kw = dict(max_new_tokens=tokens, min_new_tokens=tokens, do_sample=False, pad_token_id=0,
              attention_mask=torch.ones_like(ids))
    if static:
        kw["cache_implementation"] = "static"
    t0 = time.perf_counter()
    model.generate(ids, **kw)
    model.generate(ids, **kw)
    warm = time.perf_counter() - t0
    rates = []
    for _ in range(reps):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        out = model.generate(ids, **kw)
        torch.cuda.synchronize()
        rates.append(batch * (out.shape[1] - prompt_len) / (time.perf_counter() - t0))
    return dict(batch=batch, tokens=tokens, tok_s=max(rates), tok_s_all=rates, warmup_s=warm)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--json", required=True)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--skip-hf", action="store_true")
    args = ap.parse_args()
    import transformers
    import triton
    res = dict(device=torch.cuda.get_device_name(), torch=torch.__version__, transformers=transformers.__version__,
               triton=triton.__version__, date=time.strftime("%Y-%m-%d"),
               commit=git_commit() or "unknown", weights="random-init (timing only)",
               models={})
    for name in SHAPES:
        print(name, flush=True)
        model = random_model(name)
        nbytes = sum(p.numel() * p.element_size() for p in model.parameters())
        entry = dict(weight_bytes=nbytes, floor_ms_at_3TBps=nbytes / 3.0e9)
        t0 = time.perf_counter()
        entry["forwards"] = forward_times(model, qs=(1, 2, 3, 4, 6) if "1.5b" in name else (1, 2, 3, 4))
        entry["forwards_total_s"] = time.perf_counter() - t0
        entry["profile"] = profile_replay(model)
        if "1.5b" in name:
            entry["engine"] = [engine_tok_s(model, b, args.tokens) for b in (1, 8)]
            print("  engine", [(r["batch"], round(r["tok_s"], 1)) for r in entry["engine"]], flush=True)
            if not args.skip_hf:
                entry["hf_static"] = [hf_tok_s(model, b, args.tokens, True) for b in (1, 8)]
                entry["hf_dynamic"] = [hf_tok_s(model, 1, 32, False, reps=1)]
                print("  hf-static", [(r["batch"], round(r["tok_s"], 1)) for r in entry["hf_static"]], flush=True)
        res["models"][name] = entry
        with open(args.json, "w") as f:
            json.dump(res, f, indent=1)
        del model
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
