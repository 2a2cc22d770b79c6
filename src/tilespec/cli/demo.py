"""``tilespec demo``: speculative decoding that pays, measured on this machine in one run.

Default: SmolLM2-135M-Instruct (CPU; fetched on first use) or Qwen2.5-Coder-1.5B-Instruct (GPU) with context
drafting (``ngram``: the draft tokens are copied from the prompt and the output so far, no draft model) on an
input-grounded prompt -- editing a given function, where the answer repeats much of the input. The same model
decodes the same prompt target-only and speculatively, alternating, ``--repeats`` times each; the last line
reports the measured speedup (total wall time of the target-only runs / of the speculative runs, prefill
included) and whether the greedy outputs are identical token for token.
"""
from __future__ import annotations

import json
import time
from pathlib import Path

from .generate import (encode_prompts, load_pair, pick_device, pick_dtype, print_stats, sampling_from_args,
                       stream_text)

DEFAULT_MODEL = "smollm2-135m-instruct"
DEFAULT_GPU_MODEL = "qwen2.5-coder-1.5b-instruct"
DEFAULT_DRAFT = "ngram"
FUNCTION = '''def moving_average(values, window):
    if window <= 0:
        raise ValueError("window must be positive")
    result = []
    total = 0.0
    for i, value in enumerate(values):
        total += value
        if i >= window:
            total -= values[i - window]
        if i >= window - 1:
            result.append(total / window)
    return result
'''
DEFAULT_PROMPT = ("In the following code, rename the variable `result` to `averages`. Output only the code.\n\n"
                  "```python\n" + FUNCTION + "```")


def _timed(dec, ids, args) -> tuple:
    t0 = time.perf_counter()
    out = dec.generate(ids, max_new_tokens=args.max_new_tokens, seed=args.seed)
    return out, time.perf_counter() - t0


def run(args) -> int:
    import torch
    from rich.console import Console
    from tilespec.engine import SpeculativeDecoder

    console = Console(stderr=True)
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.repeats < 1:
        raise ValueError(f"--repeats must be >= 1, got {args.repeats}")
    device = pick_device(args.device)
    dtype = pick_dtype(args.dtype, device)
    target_name = args.target or (DEFAULT_GPU_MODEL if device.type == "cuda" else DEFAULT_MODEL)
    draft_name = args.draft or (f"{target_name}:layers={args.layers}" if args.layers else DEFAULT_DRAFT)
    console.print(f"[bold]tilespec demo[/bold]: target [cyan]{target_name}[/cyan], draft [cyan]{draft_name}[/cyan], "
                  f"{device}, {str(dtype).replace('torch.', '')}, {torch.get_num_threads()} CPU threads, "
                  f"γ={args.gamma} ({args.gamma_schedule}), verify={args.method}")
    target, draft, tok = load_pair(target_name, draft_name, device, dtype, log=console.print)
    options = dict(gamma=args.gamma, gamma_schedule=args.gamma_schedule, method=args.method,
                   sampling=sampling_from_args(args), tokenizer=tok, compile=args.compile)
    spec = SpeculativeDecoder(target, draft, **options)
    base = SpeculativeDecoder(target, None, **options)
    ids = encode_prompts(tok, [args.prompt], True)
    for dec in (base, spec):   # uncounted: lazy initialisations (and graph captures with --compile)
        dec.warmup(prompt_len=min(len(ids[0]), 64), max_new_tokens=4)
    from rich.markup import escape
    console.print(f"[bold]prompt[/bold]: {escape(args.prompt)}\n[bold]speculative output[/bold]:")
    with torch.inference_mode():
        t0 = time.perf_counter()
        shown = stream_text(spec, tok, ids, args.max_new_tokens, args.seed)
        spec_times, spec_outs = [time.perf_counter() - t0], [[shown]]
        spec_stats = [spec.last_stats]
        base_times, base_outs = [], []
        for r in range(args.repeats):
            out, dt = _timed(base, ids, args)
            base_times.append(dt)
            base_outs.append(out.sequences)
            if r + 1 < args.repeats:
                out, dt = _timed(spec, ids, args)
                spec_times.append(dt)
                spec_outs.append(out.sequences)
                spec_stats.append(out.stats)
    stats = spec_stats[-1]
    print_stats(stats, title=f"speculative decoding ({stats.drafter})")
    tokens = sum(len(s[0]) for s in spec_outs)
    spec_rate, base_rate = tokens / sum(spec_times), sum(len(s[0]) for s in base_outs) / sum(base_times)
    speedup = sum(base_times) / sum(spec_times)
    greedy = args.temperature == 0
    same = all(o == base_outs[0] for o in spec_outs + base_outs)
    matched = f", {100 * stats.match_share:.0f} % of steps matched" if stats.context_steps else ""
    console.print(f"target-only: {base_rate:.1f} tokens/s; speculative ({stats.drafter}): {spec_rate:.1f} tokens/s "
                  f"(α = {stats.alpha:.2f}, τ = {stats.block_efficiency:.2f} tokens per target call{matched}); "
                  f"{args.repeats} run(s) each, alternating")
    if greedy and same:
        console.print(f"[bold green]✓ speculative output equals the target's greedy output ({len(shown)} tokens, "
                      f"token for token)[/bold green]")
    if args.json:
        from tilespec.env import run_record
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({
            "environment": run_record(device), "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "target": target_name,
            "draft": draft_name, "dtype": str(dtype), "threads": torch.get_num_threads(), "prompt": args.prompt,
            "settings": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items() if k != "func"},
            "target_only_seconds": base_times, "speculative_seconds": spec_times, "new_tokens": len(shown),
            "speedup": speedup, "outputs_identical": same, "output": tok.decode(shown, skip_special_tokens=True),
            "stats": [s.to_dict() for s in spec_stats]}, indent=2))
    verdict = ("yes" if same else "NO") if greedy else "n/a (sampling: same law, not the same tokens)"
    print(f"speedup {speedup:.2f}× over target-only decoding (same run, same model); outputs identical: {verdict}")
    if greedy and not same:
        console.print("[bold red]✗ outputs differ[/bold red] (with bf16/fp16 on GPU, batched and single-token "
                      "forwards may round differently; fp32 on CPU must match exactly)")
        return 1
    return 0


def register(sub) -> None:
    p = sub.add_parser("demo", help="measured speedup of speculative decoding on an embedded default model")
    p.add_argument("--target", default=None, help=f"target model (default {DEFAULT_MODEL} on CPU, "
                                                  f"{DEFAULT_GPU_MODEL} on GPU)")
    p.add_argument("--draft", default=None, help=f"draft (default {DEFAULT_DRAFT}): ngram, suffix, a draft model "
                                                 "such as NAME:layers=N, or MODEL+ngram")
    p.add_argument("--layers", type=int, default=0, help="draft with the target's first N layers instead of "
                                                         "ngram (a layer-skip draft; shows exactness, rarely speed)")
    p.add_argument("--prompt", default=DEFAULT_PROMPT)
    p.add_argument("--repeats", type=int, default=2, help="timed runs per mode, alternating (default 2)")
    p.add_argument("--threads", type=int, default=0, help="CPU threads for torch (default: torch's choice)")
    from .generate import add_decoding_arguments
    add_decoding_arguments(p)
    p.set_defaults(max_new_tokens=256, gamma=8, func=run)
