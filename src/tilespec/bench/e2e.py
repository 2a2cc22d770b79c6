"""``tilespec bench e2e``: end-to-end decoding speed of transformers and of our engine, same prompts, same device.

One run times, per (task, temperature, batch size), every system of ``--systems`` (see e2e_systems.py): HF
``generate`` (dynamic cache), ``hf-static`` (static cache; compile excluded and reported), HF assisted generation
and prompt lookup, our target-only (``ar``), our speculative decoding with ``--draft`` (``tilespec``; each verify
method × each γ / schedule), with any drafter the engine resolves by name (``ngram``, ``suffix``, ...), and with
such a drafter backed by the draft model (``tilespec+ngram``, ``tilespec+NAME``: not in the default list).

Row fields (missing when they do not apply): task, temperature, batch_size, system, kind, method, engine, gamma,
gamma_schedule, requests (sample size), new_tokens, wall_time, tokens_per_second(_per_request), warmup_seconds,
compile_seconds, peak_memory_bytes, output_hashes (per request); ours also times, steps, target_forward_ms (at
q = target_q: 1 target-only, γ+1 speculative), draft_forward_ms, verify_share, runs (the engine's stats per
batch), and runtime / draft_runtime / drafter / match_share where the engine reports them; speculative ones alpha,
alpha_tested, block_efficiency (τ), mean_gamma, cost_ratio c, predicted_speedup (Leviathan Thm 3.8 from
α_tested, c and γ = round(mean γ) for adaptive schedules, round(drafted per request-step) for context drafters).
Added over the whole file after each configuration: speedup_vs_ar and speedup_vs_hf_static (same task, T, B; this
run), and at T = 0 output_tokens, greedy_equal_ar (per request), greedy_match_ar (share) and greedy_prefix_ar /
greedy_prefix_share_ar (how many leading tokens agree with target-only: bf16 forwards of different shapes round
differently, so long greedy outputs can part after a near tie).

Resumable: the JSON (``--json``) is rewritten after every configuration, and a rerun with the same settings skips
the configurations it already holds (failed ones are retried). ``--budget-s`` stops starting new configurations
after that many seconds; ``--max-seconds`` cuts one system's timed pass after the batch that crosses it.

CPU smoke test: ``tilespec bench e2e --tiny --prompts 2 --max-new-tokens 8 --systems hf,ar,tilespec``.
"""
from __future__ import annotations

import json
import random
import sys
import time
from pathlib import Path

from .asr_inputs import asr_tasks, whisper_defaults, whisper_inputs
from .e2e_args import add_arguments, check_args  # noqa: F401  (add_arguments: public here)
from .e2e_systems import (BATCH1_ONLY, DRAFT_MODEL, HF_KINDS, Config, is_engine_kind, needs_draft_model, output_hash,
                          run_engine, run_hf, system_rank)

# Qwen2.5 1.5B / 0.5B shapes for --random-init (same configs, random weights); "tiny" for CPU smoke tests.
SHAPES = {
    "qwen-1.5b": dict(hidden_size=1536, intermediate_size=8960, num_hidden_layers=28, num_attention_heads=12,
                      num_key_value_heads=2, vocab_size=151936),
    "qwen-0.5b": dict(hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14,
                      num_key_value_heads=2, vocab_size=151936),
    "tiny-target": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                        num_key_value_heads=2, vocab_size=256),
    "tiny-draft": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=1, num_attention_heads=4,
                       num_key_value_heads=2, vocab_size=256),
}
# a resumed run must have been made with the same values of these settings
SAME_SETTINGS = ("target", "draft", "num_prompts", "max_new_tokens", "dtype", "tiny", "random_init", "whisper",
                 "document_chars", "lookup_tokens", "prompts_file", "warmup", "ignore_eos", "tree", "top_k", "top_p",
                 "min_p")
UNSET = {"top_k": 0, "top_p": 1.0, "min_p": 0.0}   # what a file written before a setting existed ran with


def configs(args, tasks: list) -> list:
    """Every configuration of the run, in the order they are timed (``ar`` first: the others compare to it)."""
    from tilespec.engine.drafters import split_draft_name
    model = split_draft_name(args.draft)[0]
    engines = [e for e in str(args.compile).split(",") if e]
    spec = [("constant", g) for g in args.gamma] if "constant" in args.gamma_schedule else []
    spec += [(s, args.gamma[0]) for s in args.gamma_schedule if s != "constant"]
    if getattr(args, "tree", None):     # a tree's γ is its depth, drafted every step (a constant schedule)
        from tilespec.bench.tree_args import tree_option      # an auto tree's depth is chosen per temperature
        spec = [("constant", None if args.tree == "auto" else tree_option(args)[1])]
    out = []
    for task in tasks:
        for t in args.temperatures:
            for b in args.batch_sizes:
                for kind in sorted(dict.fromkeys(args.systems), key=system_rank):
                    if (kind in BATCH1_ONLY and b > 1) or (needs_draft_model(kind) and not model) \
                            or (kind == DRAFT_MODEL and not args.draft):
                        continue
                    if kind in HF_KINDS:
                        out.append(Config(task, t, b, kind, gamma=args.gamma[0], schedule=args.gamma_schedule[0]))
                    elif kind == "ar":
                        out += [Config(task, t, b, kind, engine=e) for e in engines]
                    else:
                        out += [Config(task, t, b, kind, m, e, g, s) for e in engines for m in args.methods
                                for s, g in spec]
    return out


# ------------------------------------------------------------------------------------------------- inputs
def prompt_ids(args, task: str, tok, vocab: int) -> list:
    """Token id lists of the task's first ``num_prompts`` prompts (chat-wrapped); random ids without a tokenizer."""
    if tok is None:
        rng = random.Random(0)
        return [[rng.randrange(3, vocab) for _ in range(rng.randint(16, 48))] for _ in range(args.num_prompts)]
    if args.prompts_file is not None:
        rows = [json.loads(x) for x in args.prompts_file.read_text().splitlines() if x.strip()]
        texts = [next(str(r[k]) for k in ("prompt", "document", "text") if k in r) for r in rows]
    else:
        from tilespec.datasets import load_task
        path = args.xsum_wheel if task == "xsum" else None
        texts = [r["prompt"] for r in load_task(task, None, path=path, max_document_chars=args.document_chars)]
    if len(texts) < args.num_prompts:
        raise ValueError(f"{task} has {len(texts)} prompts, fewer than --prompts {args.num_prompts}")
    from tilespec.engine.prompts import encode_prompts
    return encode_prompts(tok, texts[:args.num_prompts], True)


def load_models(args, device, dtype, tp=None):
    """(target, draft or None, tokenizer or None); ``tp``: a named target is loaded sharded (draft replicated)."""
    import torch
    if args.tiny or args.random_init:
        from transformers import Qwen2Config, Qwen2ForCausalLM
        from tilespec.engine.drafters import draft_spec, split_draft_name
        names = ("tiny-target", "tiny-draft") if args.tiny else ("qwen-1.5b", "qwen-0.5b")
        out = []
        for i, name in enumerate(names):
            torch.manual_seed(i)
            cfg = Qwen2Config(**SHAPES[name], max_position_embeddings=4096, tie_word_embeddings=True,
                              attn_implementation="sdpa")
            out.append(Qwen2ForCausalLM(cfg).to(device=device, dtype=dtype).eval())
        model, context = split_draft_name(args.draft)
        return out[0], draft_spec(out[1] if model else None, context), None
    from tilespec.api import load_pair
    return load_pair(args.target, args.draft or None, device, dtype, log=lambda m: print(m, file=sys.stderr), tp=tp)


# ------------------------------------------------------------------------------------------------- results
def environment(device) -> dict:
    """The run record (``tilespec.env.run_record``) with ``device`` as given and the GPU's name as ``gpu``."""
    from tilespec.env import run_record
    env = run_record(device)
    if device.type == "cuda":
        env["gpu"] = env["device"]
    env["device"] = str(device)
    return env


def load_previous(path: Path, settings: dict) -> list:
    """Measured rows of an earlier run of the same settings at ``path`` ([] when there is none)."""
    if not path.is_file():
        return []
    try:
        doc = json.loads(path.read_text())
    except json.JSONDecodeError as err:
        raise ValueError(f"{path} is not valid JSON ({err}); delete it or pass another --json path") from None
    old = doc.get("settings", {})
    diff = [k for k in SAME_SETTINGS if old.get(k, UNSET.get(k)) != settings.get(k)]
    if diff:
        k = diff[0]
        raise ValueError(f"{path} holds a run with other settings ({k}: {old.get(k)!r} there, {settings.get(k)!r} "
                         f"now); pass another --json path or the same settings to resume")
    return [r for r in doc.get("results", []) if "error" not in r and "key" in r]


def add_comparisons(rows: list) -> None:
    """Speedups vs ``ar`` and ``hf-static`` and greedy equality with ``ar``, each within (task, T, B)."""
    ok = [r for r in rows if "error" not in r]
    for r in ok:
        group = [x for x in ok if (x["task"], x["temperature"], x["batch_size"])
                 == (r["task"], r["temperature"], r["batch_size"])]
        ars = [x for x in group if x["kind"] == "ar"]
        ar = next((x for x in ars if x.get("engine") == r.get("engine")), ars[0] if ars else None)
        static = next((x for x in group if x["kind"] == "hf-static"), None)
        for name, base in (("speedup_vs_ar", ar), ("speedup_vs_hf_static", static)):
            if base is not None and base is not r and base["tokens_per_second"] > 0:
                r[name] = r["tokens_per_second"] / base["tokens_per_second"]
        if ar is not None and ar is not r and r["temperature"] == 0:
            eq = [a == b for a, b in zip(r["output_hashes"], ar["output_hashes"])]
            r.update(greedy_equal_ar=eq, greedy_match_ar=sum(eq) / len(eq) if eq else None)
            if r.get("output_tokens") and ar.get("output_tokens"):   # how far outputs agree before they diverge
                prefix = [_common_prefix(a, b) for a, b in zip(r["output_tokens"], ar["output_tokens"])]
                total = sum(max(len(a), 1) for a in ar["output_tokens"])
                r.update(greedy_prefix_ar=prefix, greedy_prefix_share_ar=sum(prefix) / total)


def _common_prefix(a: list, b: list) -> int:
    """Length of the common prefix of two token lists."""
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def plot(results: list, path: Path) -> bool:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    groups = sorted({(r["task"], r["temperature"], r["batch_size"]) for r in results})
    systems = sorted({r["system"] for r in results})
    fig, ax = plt.subplots(figsize=(2.5 + 1.8 * len(groups), 4.5))
    width = 0.8 / max(len(systems), 1)
    for j, system in enumerate(systems):
        vals = [next((r["tokens_per_second"] for r in results if r["system"] == system
                      and (r["task"], r["temperature"], r["batch_size"]) == g), 0.0) for g in groups]
        ax.bar([i + j * width for i in range(len(groups))], vals, width, label=system)
    ax.set_xticks([i + 0.4 - width / 2 for i in range(len(groups))])
    ax.set_xticklabels([f"{task}\nT={t:g}, B={b}" for task, t, b in groups], fontsize=8)
    ax.set_ylabel("tokens/s (all requests)")
    ax.legend(fontsize=7, ncol=2, loc="upper left")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    return True


def _measure(cfg: Config, target, draft, batches, args, device, tok, feats) -> dict:
    import torch
    with torch.inference_mode():
        if cfg.kind in HF_KINDS:
            r = run_hf(cfg, target, draft, batches, args, device, tok, feats)
        else:
            r = run_engine(cfg, target, draft, batches, args, device, feats)
    seqs = r.pop("sequences")
    r.update(key=cfg.key, task=cfg.task, temperature=cfg.temperature, batch_size=cfg.batch_size, system=cfg.system,
             kind=cfg.kind, requests=len(seqs), output_hashes=[output_hash(s) for s in seqs],
             output_tokens=[list(map(int, s)) for s in seqs] if cfg.temperature == 0 else None,
             tokens_per_second=r["new_tokens"] / r["wall_time"] if r["wall_time"] > 0 else 0.0)
    r["tokens_per_second_per_request"] = r["tokens_per_second"] / cfg.batch_size
    if is_engine_kind(cfg.kind):
        r.update(engine=cfg.engine, method=cfg.method, gamma_schedule=cfg.schedule,
                 gamma=cfg.gamma if cfg.gamma is not None else r.get("tree", {}).get("depth"))
    elif cfg.kind == "hf-assisted":
        r.update(gamma=cfg.gamma, gamma_schedule=cfg.schedule)
    elif cfg.kind == "hf-prompt-lookup":
        r["gamma"] = args.lookup_tokens
    return r


def run(args) -> int:
    check_args(args)
    whisper_defaults(args)           # before the settings are recorded
    t_start = time.perf_counter()
    from tilespec.env import pick_device, pick_dtype
    from tilespec.engine.native.tensor_parallel import init_tensor_parallel, shard
    tp = init_tensor_parallel(args.tp) if args.tp > 1 else None
    args.systems = [k for k in args.systems if tp is None or k not in HF_KINDS]   # sharded: no transformers path
    device = tp.device if tp is not None else pick_device(args.device)
    dtype = pick_dtype(args.dtype, device)
    out = args.out or Path("bench/results") / f"e2e-{Path(str(args.target)).name.replace(':', '-')}-{device.type}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    settings = {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items() if k != "func"}
    settings["dtype"] = str(dtype)
    results = load_previous(out, settings)
    tasks = asr_tasks(args) if args.whisper else [t for t in args.task.split(",") if t]
    todo = [c for c in configs(args, tasks) if c.key not in {r["key"] for r in results}]
    if results:
        print(f"[e2e] resuming {out}: {len(results)} configurations done, {len(todo)} to run", file=sys.stderr)
    if not todo:
        print(f"nothing to run: {out} holds every configuration")
        return 0
    target, draft, tok = load_models(args, device, dtype, tp)
    from tilespec.engine.drafters import draft_model
    trained = getattr(draft_model(draft), "tilespec_manifest", None)   # a trained (distilled) draft: how it was made
    if trained is not None:
        settings["draft_manifest"] = trained
    if tp is not None and getattr(target, "_tilespec_tp", None) is None:   # --tiny / --random-init: built here
        shard(target, tp)
    vocab = target.get_output_embeddings().weight.shape[0]
    feats, prompts = {}, {}
    if args.whisper:
        for task in tasks:
            prompts[task], feats[task] = whisper_inputs(args, target, tok, device, dtype, task)
        tok = getattr(tok, "tokenizer", tok)
    skipped = sorted({k for k in args.systems if k in BATCH1_ONLY} if max(args.batch_sizes) > 1 else set())
    if skipped:
        print(f"[e2e] {', '.join(skipped)}: batch 1 only in transformers, not run at B > 1", file=sys.stderr)
    from tilespec.engine.drafters import split_draft_name
    no_model = not split_draft_name(args.draft)[0]
    skipped = sorted({k for k in args.systems if needs_draft_model(k)} if no_model else set())
    if skipped:
        print(f"[e2e] {', '.join(skipped)}: not run without a draft model (--draft {args.draft!r})", file=sys.stderr)

    def write():
        if tp is not None and not tp.main:
            return
        add_comparisons(results)
        out.write_text(json.dumps({"environment": environment(device), "settings": settings, "results": results},
                                  indent=1))
    missing = {}  # drafters this engine lacks: said once, recorded per configuration (retried on resume)
    for n, cfg in enumerate(todo):
        if args.budget_s and time.perf_counter() - t_start > args.budget_s:
            print(f"[e2e] budget of {args.budget_s:g} s reached with {len(todo) - n} configurations left; run the "
                  f"same command again to continue", file=sys.stderr)
            break
        if cfg.kind in missing:
            err = missing[cfg.kind]
        else:
            print(f"[e2e] {cfg.key} ...", file=sys.stderr, flush=True)
            try:
                if cfg.task not in prompts:
                    prompts[cfg.task] = prompt_ids(args, cfg.task, tok, vocab)
                p = prompts[cfg.task]
                batches = [p[i:i + cfg.batch_size] for i in range(0, len(p), cfg.batch_size)]
                err, r = None, _measure(cfg, target, draft, batches, args, device, tok, feats.get(cfg.task))
            except Exception as e:  # noqa: BLE001 - record the failure, keep benchmarking the rest
                err = e
                print(f"[e2e]   failed: {err}", file=sys.stderr)
                if "this engine has no drafter" in str(err):
                    missing[cfg.kind] = err
        if err is not None:
            results.append({"key": cfg.key, "task": cfg.task, "system": cfg.system, "kind": cfg.kind,
                            "temperature": cfg.temperature, "batch_size": cfg.batch_size, "error": str(err)})
            write()
            continue
        results.append(r)
        write()
        extra = f", α={r['alpha']:.3f}, τ={r['block_efficiency']:.2f}" if r.get("alpha") is not None else ""
        print(f"[e2e]   {r['tokens_per_second']:.1f} tok/s over {r['requests']} requests{extra}"
              + (f", {r['speedup_vs_ar']:.2f}x ar" if r.get("speedup_vs_ar") else ""), file=sys.stderr, flush=True)
    write()
    if tp is not None and not tp.main:
        return 0
    plotted = plot([r for r in results if "error" not in r], out.with_suffix(".png"))
    print(f"wrote {out}" + (f" and {out.with_suffix('.png')}" if plotted else " (no matplotlib: no plot)"))
    return 0
