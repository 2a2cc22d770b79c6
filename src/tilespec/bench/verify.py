"""``tilespec bench verify``: time every verification method against transformers and FlashInfer on one GPU.

For each grid point (B, K, V, logits dtype, sampling config, acceptance regime) the same inputs go to every
contender: our ``reference`` / ``tiled`` / ``sigmoid`` (NOT EXACT) / ``fused`` methods (called on prepared
inputs, i.e. what ``verify(..., check_values=False)`` runs after argument checks), transformers' own
``_speculative_sampling`` (installed package, B = 1, fp32 logits as HF produces them) and FlashInfer's
``chain_speculative_sampling`` plus the softmaxes (and top-k renormalisation) it needs. Reported per contender:
eager latency (host wall clock, synchronised after every call, median), CUDA-graph replay time (CUDA events,
mean over replays rotating between input copies so L2 does not hold the inputs), achieved GB/s against the bytes
that must be read (target + draft logits once), and peak extra device memory of one call. Heavy imports stay in
:func:`run`; results go to JSON (``--json``) and an optional plot of time per call vs K (``--plot``).
"""
from __future__ import annotations

import argparse
import datetime
import inspect
import json
import math
import os
import statistics
import time

# Outside contenders: transformers' own ``_speculative_sampling`` (B = 1) and FlashInfer's chain kernel.
EXTERNAL = ("hf", "flashinfer")
# Extra contenders of the --filters rows: ``filtered_logits`` alone on the target logits [B, K+1, V], by the
# sort-based evaluation and by the default sort-free path (Triton thresholds on CUDA). Their GB/s columns use the
# row's bytes_must_read (target + draft), so only their times are meaningful.
FILTER_ONLY = ("filtered_logits[sort]", "filtered_logits")
# (temperature, top_k, top_p, min_p) of the --filters rows: top-k 20 / 50, top-p 0.8 / 0.9 / 0.95, min-p 0.05 and
# Qwen's recommended setting (T 0.7, top-k 20, top-p 0.8)
FILTER_CONFIGS = ((1.0, 20, 1.0, 0.0), (1.0, 50, 1.0, 0.0), (1.0, 0, 0.8, 0.0), (1.0, 0, 0.9, 0.0),
                  (1.0, 0, 0.95, 0.0), (1.0, 0, 1.0, 0.05), (0.7, 20, 0.8, 0.0))
UNFILTERED = (1.0, 0, 1.0, 0.0)


def contenders() -> tuple:
    """Every registered method (the registry's ``hf`` is replaced by transformers' own function), then EXTERNAL."""
    from tilespec.verify.registry import all_methods
    return tuple(m.name for m in all_methods() if m.name not in EXTERNAL) + EXTERNAL


def _not_exact(name: str) -> bool:
    from tilespec.verify.registry import get_method
    return name not in EXTERNAL and not get_method(name).exact


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--json", default=None, help="write results here (default bench/results/verify-<device>"
                                                      ".json)")
    parser.add_argument("--plot", default=None, help="also write a PNG of time per call vs K")
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 8, 64])
    parser.add_argument("--draft", type=int, nargs="+", default=[1, 5, 10, 20], help="K values")
    parser.add_argument("--vocab", type=int, nargs="+", default=[32000, 51865, 151936, 256000])
    parser.add_argument("--dtype", nargs="+", default=["bf16", "fp32"])
    parser.add_argument("--contenders", nargs="+", default=list(contenders()))
    parser.add_argument("--sweep", action="store_true", help="add the sampling-config x regime sweep at K=5, "
                                                             "V=151936, bf16, B in {1, 64}")
    parser.add_argument("--reps", type=int, default=30, help="timed eager calls per contender")
    parser.add_argument("--graph-reps", type=int, default=200, help="timed CUDA-graph replays per contender")
    parser.add_argument("--check", action="store_true", help="first check on the GPU that fused / tiled emit the "
                                                             "same tokens as reference and that graph replay matches")
    parser.add_argument("--time-budget", type=float, default=1e9, help="stop adding grid points after this many "
                                                                        "seconds (results so far are kept)")
    parser.add_argument("--filters", action="store_true", help="add rows of every FILTER_CONFIGS setting (K=5, "
                                                               "V=151936, bf16, 'mid') for every --batch; rows "
                                                               "with filters also time filtered_logits alone "
                                                               "(sort-based vs default) unless --no-filter-only")
    parser.add_argument("--no-filter-only", action="store_true", help="filter rows without the filtered_logits "
                                                                      "contenders")


def _make_inputs(torch, b, k, v, dtype, regime, seed):
    """Target [B, K+1, V] and draft [B, K, V] logits (scale 3) and tokens drawn from the draft law."""
    gen = torch.Generator(device="cuda").manual_seed(seed)
    target = torch.randn(b, k + 1, v, device="cuda", generator=gen) * 3.0
    noise = torch.randn(b, k, v, device="cuda", generator=gen) * 3.0
    mix = {"p~q": 0.98, "mid": 0.7, "disjoint": 0.0}[regime]
    draft = mix * target[:, :k] + math.sqrt(1 - mix * mix) * noise
    if regime == "disjoint":
        target[..., v // 2:] = float("-inf")
        draft[..., : v // 2] = float("-inf")
    probs = torch.softmax(draft.reshape(-1, v), -1)
    tokens = torch.multinomial(probs, 1, generator=gen).view(b, k)
    return target.to(dtype), draft.to(dtype), tokens


def _contender_fns(torch, name, target, draft, tokens, cfg, seed):
    """Return (fn, graphable) for one contender on one input set, or raise RuntimeError(why it cannot run)."""
    from tilespec.verify.registry import get_method
    from tilespec.verify.types import SamplingParams
    from tilespec.verify.validation import prepare_inputs
    temp, top_k, top_p, min_p = cfg
    b, k = tokens.shape
    if name in FILTER_ONLY:
        from tilespec.verify.distributions import filtered_logits
        from tilespec.verify.validation import resolve_sampling
        resolved = resolve_sampling(SamplingParams(temperature=temp, top_k=top_k, top_p=top_p, min_p=min_p), b,
                                    target.device)
        how = "sort" if name.endswith("[sort]") else "auto"
        return (lambda: filtered_logits(target, resolved, method=how)), True
    if name not in EXTERNAL:
        sampling = SamplingParams(temperature=temp, top_k=top_k, top_p=top_p, min_p=min_p)
        inputs = prepare_inputs(target, tokens, draft_logits=draft, sampling=sampling, seed=seed,
                                check_values=False)
        method = get_method(name)
        options = dict(method.resolve_options())
        return (lambda: method.fn(inputs, **options)), method.graph_safe
    if name == "hf":
        if b != 1:
            raise RuntimeError("transformers' _speculative_sampling is B = 1 only")
        from transformers.generation.utils import _speculative_sampling as hf_fn
        from transformers.generation.logits_process import MinPLogitsWarper, TopKLogitsWarper, TopPLogitsWarper
        new = target.float() / temp
        cand = draft.float() / temp
        for on, warp in ((top_k, lambda: TopKLogitsWarper(top_k)), (top_p < 1.0, lambda: TopPLogitsWarper(top_p)),
                         (min_p > 0, lambda: MinPLogitsWarper(min_p))):
            if on:
                new = warp()(None, new.view(-1, new.shape[-1])).view(new.shape)
                cand = warp()(None, cand.view(-1, cand.shape[-1])).view(cand.shape)
        ids = torch.cat([torch.zeros(1, 3, dtype=torch.long, device="cuda"), tokens], dim=1)
        extra = {"is_done_candidate": False} if "is_done_candidate" in inspect.signature(hf_fn).parameters else {}
        return (lambda: hf_fn(ids, cand, k, new, **extra)), False
    if name == "flashinfer":
        import flashinfer.sampling as fs
        params = inspect.signature(fs.chain_speculative_sampling).parameters
        seed_t = torch.tensor([seed], dtype=torch.int64, device="cuda")
        off_t = torch.zeros(1, dtype=torch.int64, device="cuda")
        kw = {"seed": seed_t, "offset": off_t} if "seed" in params and "offset" in params else {}
        ids32 = tokens.int()

        def fi():
            p = torch.softmax(target.float() / temp, dim=-1)
            q = torch.softmax(draft.float() / temp, dim=-1)
            if top_k:
                p = fs.top_k_renorm_probs(p.view(-1, p.shape[-1]), top_k).view(p.shape)
                q = fs.top_k_renorm_probs(q.view(-1, q.shape[-1]), top_k).view(q.shape)
            if top_p < 1.0:
                p = fs.top_p_renorm_probs(p.view(-1, p.shape[-1]), top_p).view(p.shape)
                q = fs.top_p_renorm_probs(q.view(-1, q.shape[-1]), top_p).view(q.shape)
            if min_p > 0:   # FlashInfer has no min-p renorm: the mask and renormalisation in PyTorch
                p = torch.where(p >= min_p * p.amax(-1, keepdim=True), p, 0.0)
                q = torch.where(q >= min_p * q.amax(-1, keepdim=True), q, 0.0)
                p, q = p / p.sum(-1, keepdim=True), q / q.sum(-1, keepdim=True)
            return fs.chain_speculative_sampling(q, ids32, p, **kw)
        return fi, bool(kw)
    raise RuntimeError(f"unknown contender {name}")


def time_eager(fn, reps: int) -> float:
    """Median host wall time of ``fn()`` in us, the GPU synchronised before and after every call."""
    import torch
    times = []
    for _ in range(reps):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e6


def _time_graph(torch, fns, reps):
    graphs = []
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for fn in fns:
            fn()
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    for fn in fns:
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            fn()
        graphs.append(g)
    for g in graphs:
        g.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for i in range(reps):
        graphs[i % len(graphs)].replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1e3 / reps


def _peak_extra(torch, fn):
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    fn()
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated() - base


def _point(torch, args, b, k, v, dtype_name, cfg, regime, log):
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[dtype_name]
    elt = torch.finfo(dtype).bits // 8
    must_read = b * (2 * k + 1) * v * elt
    n_sets = max(1, min(4, math.ceil(200e6 / must_read)))
    sets = [_make_inputs(torch, b, k, v, dtype, regime, seed=17 + i) for i in range(n_sets)]
    row = {"B": b, "K": k, "V": v, "dtype": dtype_name, "temperature": cfg[0], "top_k": cfg[1], "top_p": cfg[2],
           "min_p": cfg[3], "regime": regime,
           "bytes_must_read": must_read, "input_sets": n_sets, "results": {}}
    filter_row = (getattr(args, "filters", False) and not getattr(args, "no_filter_only", False)
                  and (cfg[1] or cfg[2] < 1.0 or cfg[3] > 0))
    for name in list(args.contenders) + (list(FILTER_ONLY) if filter_row else []):
        res = {}
        try:
            fns = [_contender_fns(torch, name, *s, cfg, seed=1234) for s in sets]
            fn, graphable = fns[0]
            fn()
            first = time_eager(fn, 1)
            res["eager_us"] = time_eager(fn, max(3, min(args.reps, int(0.3e6 / first))))
            res["peak_extra_bytes"] = _peak_extra(torch, fn)
            if graphable:
                try:
                    reps = max(10, min(args.graph_reps, int(0.2e6 / res["eager_us"]) * 4))
                    res["graph_us"] = _time_graph(torch, [f for f, _ in fns], reps)
                    res["graph_GBps"] = must_read / res["graph_us"] / 1e3
                except Exception as err:  # noqa: BLE001 - record why capture failed and go on
                    res["graph_error"] = f"{type(err).__name__}: {str(err)[:200]}"
            else:
                res["graph_error"] = "not capturable (host syncs or host-side RNG state)"
            res["eager_GBps"] = must_read / res["eager_us"] / 1e3
        except Exception as err:  # noqa: BLE001
            res["error"] = f"{type(err).__name__}: {str(err)[:300]}"
        row["results"][name] = res
    del sets
    torch.cuda.empty_cache()
    log(row)
    return row


def _gpu_checks(torch) -> dict:
    """Token agreement of fused / tiled with reference on the GPU, and graph replay == eager for fused."""
    from tilespec.verify.registry import get_method
    from tilespec.verify.types import SamplingParams
    from tilespec.verify.validation import prepare_inputs
    out = {}
    for dtype_name, dtype in (("bf16", torch.bfloat16), ("fp32", torch.float32)):
        for temp, top_k, top_p in ((1.0, 0, 1.0), (0.6, 50, 1.0), (1.0, 0, 0.9), (0.7, 20, 0.8), (0.0, 0, 1.0)):
            target, draft, tokens = _make_inputs(torch, 64, 5, 151936, dtype, "mid", seed=3)
            nd = torch.randint(0, 6, (64,), device="cuda")
            inputs = prepare_inputs(target, tokens, draft_logits=draft, num_draft_tokens=nd,
                                    sampling=SamplingParams(temperature=temp, top_k=top_k, top_p=top_p), seed=99,
                                    offsets=5)
            ref = get_method("reference")(inputs)
            for name in ("fused", "tiled"):
                got = get_method(name)(inputs)
                same = ((got.output_tokens == ref.output_tokens).all(1) & (got.num_accepted == ref.num_accepted))
                out[f"{name}/{dtype_name}/T{temp}/k{top_k}/p{top_p}"] = round(same.float().mean().item(), 4)
    target, draft, tokens = _make_inputs(torch, 8, 5, 151936, torch.bfloat16, "mid", seed=4)
    inputs = prepare_inputs(target, tokens, draft_logits=draft, seed=5)
    fused = get_method("fused")
    eager = fused(inputs).output_tokens.clone()
    fused(inputs)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = fused(inputs)
    graph.replay()
    graph.replay()
    out["fused/graph_replay_equals_eager"] = bool(torch.equal(captured.output_tokens, eager))
    return out


def _versions(torch):
    from tilespec.env import git_commit, versions
    return {**versions("flashinfer"), "commit": git_commit() or ""}


def _fmt(res, key):
    return f"{res[key]:9.1f}" if key in res else "        -"


def run(args) -> int:
    import torch
    if not torch.cuda.is_available():
        print("tilespec bench verify needs a CUDA GPU (none found); nothing measured")
        return 2
    t_start = time.time()
    device = torch.cuda.get_device_name()
    date = datetime.date.today().isoformat()
    path = args.json or f"bench/results/verify-{device.replace(' ', '_')}.json"
    doc = {"device": device, "date": date, "versions": _versions(torch), "note": "; ".join(f"{n} is NOT EXACT" for n in contenders() if _not_exact(n)),
           "timing": {"eager": "median host wall time per call, synchronised after each call",
                      "graph": "CUDA events over replays of captured single calls, rotating input copies"},
           "rows": []}

    def log(row):
        parts = [f"B={row['B']:<3} K={row['K']:<2} V={row['V']:<6} {row['dtype']:<4} T={row['temperature']} "
                 f"k={row['top_k']} p={row.get('top_p', 1.0)} {row['regime']:<8}"]
        for name, res in row["results"].items():
            parts.append(f"{name}: {_fmt(res, 'eager_us')}/{_fmt(res, 'graph_us')}" if "error" not in res
                         else f"{name}: ERR")
        print(" | ".join(parts), flush=True)
        doc["rows"].append(row)
        os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
        with open(path, "w") as fh:
            json.dump(doc, fh, indent=1)

    if args.check:
        doc["checks"] = _gpu_checks(torch)
        print("checks:", json.dumps(doc["checks"]), flush=True)
    # the headline points first (bf16, V=151936), then the sampling sweep, then the rest of the grid
    grid = [(b, k, v, dt, UNFILTERED, "mid") for dt in args.dtype for v in args.vocab for b in args.batch
            for k in args.draft]
    key = [p for p in grid if p[2] == 151936 and p[3] == "bf16"]
    sweep = [(b, 5, 151936, "bf16", cfg, regime) for b in (1, 64)
             for cfg in (UNFILTERED, (0.6, 0, 1.0, 0.0), (0.6, 50, 1.0, 0.0), (1.0, 0, 0.9, 0.0))
             for regime in ("p~q", "mid", "disjoint") if (cfg, regime) != (UNFILTERED, "mid")] if args.sweep else []
    filters = [(b, 5, 151936, "bf16", cfg, "mid") for b in args.batch
               for cfg in FILTER_CONFIGS] if getattr(args, "filters", False) else []
    points = key + filters + sweep + [p for p in grid if p not in key]
    print(f"{device}: {len(points)} grid points; columns are eager/graph microseconds per call", flush=True)
    for b, k, v, dt, cfg, regime in points:
        if time.time() - t_start > args.time_budget:
            doc["truncated"] = f"time budget {args.time_budget}s reached after {len(doc['rows'])} points"
            print(doc["truncated"])
            break
        _point(torch, args, b, k, v, dt, cfg, regime, log)
    with open(path, "w") as fh:
        json.dump(doc, fh, indent=1)
    print(f"wrote {path}")
    if args.plot:
        plot_verify(doc, args.plot)
    return 0


def plot_verify(doc: dict, out_path: str, batches=(1, 64), vocab=151936, dtype="bf16") -> None:
    """Paper Fig. 3 style: time per call vs K (log scale), one panel per batch size, eager dashed, graph solid."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, axes = plt.subplots(1, len(batches), figsize=(6 * len(batches), 4.5), squeeze=False)
    for ax, b in zip(axes[0], batches):
        rows = sorted((r for r in doc["rows"] if r["B"] == b and r["V"] == vocab and r["dtype"] == dtype
                       and r["temperature"] == 1.0 and r["top_k"] == 0 and r.get("top_p", 1.0) == 1.0
                       and r["regime"] == "mid"),
                      key=lambda r: r["K"])
        for i, name in enumerate(contenders()):
            color = f"C{i}"
            for key, style in (("graph_us", "-"), ("eager_us", "--")):
                pts = [(r["K"], r["results"].get(name, {}).get(key)) for r in rows]
                pts = [(k, t) for k, t in pts if t]
                if pts:
                    label = f"{name}{' (NOT exact)' if _not_exact(name) else ''} {key.split('_')[0]}"
                    ax.plot(*zip(*pts), style, marker="o", color=color, label=label)
        ax.set(xlabel="draft tokens per call (gamma = K)", ylabel="time per call (us)", yscale="log",
               title=f"B={b}, V={vocab}, {dtype} logits, T=1 - {doc.get('device', '')}")
        ax.grid(True, which="both", alpha=0.3)
    axes[0][-1].legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    fig.tight_layout()
    fig.savefig(out_path, dpi=120)
    print(f"wrote {out_path}")
