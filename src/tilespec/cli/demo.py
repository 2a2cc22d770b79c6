"""``tilespec demo``: speculative decoding that pays, measured on this machine in one run.

Default: SmolLM2-135M-Instruct (CPU; fetched on first use) or Qwen2.5-Coder-1.5B-Instruct (GPU) with context
drafting (``ngram``: the draft tokens are copied from the prompt and the output so far, no draft model) on an
input-grounded task -- pretty-printing a one-line JSON document, where the answer repeats the input. The
speculative output is streamed once (untimed); then the same model decodes the same prompt target-only and
speculatively, alternating, ``--repeats`` times each. Each system gets ONE tokens/s figure: its new tokens over the
wall time of its timed runs, prefill included; the speedup is the ratio of the two, and the greedy outputs must be
identical token for token.
"""
from __future__ import annotations

import json
import time
from pathlib import Path

from .generate import (encode_prompts, load_pair, pick_device, pick_dtype, sampling_from_args, stats_rows,
                       stream_text)

DEFAULT_MODEL = "smollm2-135m-instruct"
DEFAULT_GPU_MODEL = "qwen2.5-coder-1.5b-instruct"
DEFAULT_DRAFT = "ngram"
DOCUMENT = {"name": "tilespec", "version": "0.3.0", "license": "Apache-2.0", "requires-python": ">=3.10",
            "dependencies": ["torch", "transformers", "triton", "rich"],
            "authors": [{"name": "Ada Lovelace", "email": "ada@example.com"}]}
DEFAULT_PROMPT = ("Format this JSON with one key per line and two-space indentation:\n\n" + json.dumps(DOCUMENT))
PER_RUN_ROWS = ("tokens/s", "wall time")   # one run's figures: the demo reports totals over the timed runs instead


def _timed(dec, ids, args) -> tuple:
    t0 = time.perf_counter()
    out = dec.generate(ids, max_new_tokens=args.max_new_tokens, seed=args.seed)
    return out, time.perf_counter() - t0


def answer_check(prompt: str, text: str) -> str | None:
    """For the default prompt: whether the answer is the input document (same JSON value), else None."""
    if prompt != DEFAULT_PROMPT:
        return None
    body = text.strip().removeprefix("```json").removeprefix("```").removesuffix("```")
    try:
        same = json.loads(body) == DOCUMENT
    except ValueError:
        same = False
    return "yes" if same else "no"


def _print_stats(console, stats) -> None:
    from rich.table import Table
    table = Table(title=f"speculative decoding ({stats.drafter}), last timed run", show_header=False)
    table.add_column("metric", style="bold")
    table.add_column("value", justify="right")
    for k, v in stats_rows(stats):
        if k not in PER_RUN_ROWS:
            table.add_row(k, v)
    console.print(table)


def run(args) -> int:
    import torch
    from rich.console import Console
    from rich.markup import escape
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
    console.print(f"[bold]prompt[/bold]: {escape(args.prompt)}\n[bold]speculative output[/bold]:")
    with torch.inference_mode():
        shown = stream_text(spec, tok, ids, args.max_new_tokens, args.seed)   # shown, not timed
        times, tokens = {"target-only": [], "speculative": []}, {"target-only": 0, "speculative": 0}
        outs, spec_stats = [[shown]], []
        for _ in range(args.repeats):
            for name, dec in (("target-only", base), ("speculative", spec)):
                out, dt = _timed(dec, ids, args)
                times[name].append(dt)
                tokens[name] += len(out.sequences[0])
                outs.append(out.sequences)
                if dec is spec:
                    spec_stats.append(out.stats)
    stats = spec_stats[-1]
    _print_stats(console, stats)
    rate = {name: tokens[name] / sum(t) for name, t in times.items()}
    speedup = sum(times["target-only"]) / sum(times["speculative"])
    greedy = args.temperature == 0
    same = all(o == outs[0] for o in outs)
    text = tok.decode(shown, skip_special_tokens=True)
    correct = answer_check(args.prompt, text)
    matched = f", {100 * stats.match_share:.0f} % of steps matched" if stats.context_steps else ""
    console.print(f"target-only: {rate['target-only']:.1f} tokens/s; speculative ({stats.drafter}): "
                  f"{rate['speculative']:.1f} tokens/s (α = {stats.alpha:.2f}, τ = {stats.block_efficiency:.2f} "
                  f"tokens per target call{matched}); {args.repeats} timed run(s) each, alternating, prefill included")
    if greedy and same:
        console.print(f"[bold green]✓ speculative output equals the target's greedy output ({len(shown)} tokens, "
                      f"token for token)[/bold green]")
    if correct is not None:
        style = "bold green" if correct == "yes" else "bold yellow"
        console.print(f"[{style}]{'✓' if correct == 'yes' else '✗'} the answer parses as the input JSON document: "
                      f"{correct}[/{style}]")
    if args.json:
        from tilespec.env import run_record
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({
            "environment": run_record(device), "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "target": target_name,
            "draft": draft_name, "dtype": str(dtype), "threads": torch.get_num_threads(), "prompt": args.prompt,
            "settings": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items() if k != "func"},
            "target_only_seconds": times["target-only"], "speculative_seconds": times["speculative"],
            "new_tokens": len(shown), "tokens_per_second": {"target_only": rate["target-only"],
                                                            "speculative": rate["speculative"]},
            "speedup": speedup, "outputs_identical": same, "output": text, "answer_is_input_document": correct,
            "stats": [s.to_dict() for s in spec_stats]}, indent=2))
    verdict = ("yes" if same else "NO") if greedy else "n/a (sampling: same law, not the same tokens)"
    print(f"speedup {speedup:.2f}× over target-only decoding (same run, same model); outputs identical: {verdict}")
    if speedup < 1 and device.type == "cpu" and torch.get_num_threads() > 1:
        console.print("[yellow]speculation lost here: on a CPU whose cores are busy with other work, threads wait for "
                      "each other in the wider verify forwards; compare with --threads 1[/yellow]")
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
    p.add_argument("--repeats", type=int, default=3, help="timed runs per system, alternating (default 3)")
    p.add_argument("--threads", type=int, default=0, help="CPU threads for torch (default: torch's choice)")
    from .generate import add_decoding_arguments
    add_decoding_arguments(p)
    p.set_defaults(max_new_tokens=256, gamma=8, func=run)
