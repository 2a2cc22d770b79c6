"""``tilespec demo``: speculative decoding that pays, measured on this machine in one run (under a minute on an idle
2-core CPU).

Default: SmolLM2-135M-Instruct (CPU; fetched on first use) or Qwen2.5-Coder-1.5B-Instruct (GPU) with context
drafting (``ngram``: the draft tokens are copied from the prompt and the output so far, no draft model) on an
input-grounded task -- pretty-printing a one-line JSON document, where the answer repeats the input. On a CPU the
thread count is chosen from the CPUs free right now (:func:`._paired.free_cpus`). The speculative output is streamed
once (untimed); then the same model decodes the same prompt target-only and speculatively in back-to-back pairs
until the 95 % interval of the paired speedup is within ``--precision`` (or ``--repeats`` pairs / ``--budget``
seconds run out: then the demo says the machine is too busy to measure and prints the noise it measured instead of a
ratio). Each system gets ONE tokens/s figure: its new tokens over the wall time of its counted runs, prefill
included; the greedy outputs must be identical token for token. Both systems run on the engine ``--engine`` picks
(auto: the paged engine where it runs the pair, as ``tilespec.generate`` does; else the decoder).
"""
from __future__ import annotations

import json
import time
from pathlib import Path

from ._paired import Measurement, Watchdog, free_cpus, measure
from .generate import (add_engine_argument, build_engine, check_decoding_args, encode_prompts, load_pair,
                       pick_cli_engine, pick_device, pick_dtype, stats_rows, stream_text)

DEFAULT_MODEL = "smollm2-135m-instruct"
DEFAULT_GPU_MODEL = "qwen2.5-coder-1.5b-instruct"
DEFAULT_DRAFT = "ngram"
DOCUMENT = {"name": "tilespec", "version": "0.3.0", "license": "Apache-2.0", "requires-python": ">=3.10",
            "dependencies": ["torch", "transformers", "triton", "rich"],
            "authors": [{"name": "Ada Lovelace", "email": "ada@example.com"}]}
DEFAULT_PROMPT = ("Format this JSON with one key per line and two-space indentation:\n\n" + json.dumps(DOCUMENT))
PER_RUN_ROWS = ("tokens/s", "wall time")   # one run's figures: the demo reports totals over the timed runs instead
MIN_PAIRS = 2       # the fewest pairs a speedup is claimed from: ±15 % takes 2 ratios within 2.2 % of each other
PRECISION = 0.15    # (t = 12.7), or a spread (sd) of at most 5.6 % over 3 pairs, 8.8 % over 4 (0.43-1.51x: never)
BUDGET_S = 45.0     # timed pairs: 3 single-thread pairs fit (11-15 s each); idle 2 cores: ~11 s + 2-4 pairs of ~6-9 s


def _timed(name: str, dec, ids, args, watch: Watchdog | None = None) -> tuple:
    """One timed run of system ``name``: (output, wall seconds, CPU seconds of this process). Decodes through
    ``stream`` (what ``generate`` runs, one event per step) so that ``watch`` can look at the CPU between steps."""
    done = []
    if watch is not None:
        watch.start()
    w0, c0 = time.perf_counter(), time.process_time()
    for _ in dec.stream(ids, max_new_tokens=args.max_new_tokens, seed=args.seed, on_finish=done.append):
        if watch is not None:
            watch.check()
    return done[0], time.perf_counter() - w0, time.process_time() - c0


class _Watched:
    """A decoder whose ``stream`` lets a :class:`Watchdog` look between steps (for the streamed, untimed run)."""

    def __init__(self, dec, watch: Watchdog):
        self.dec, self.watch = dec, watch

    def stream(self, *args, **kw):
        self.watch.start()
        for event in self.dec.stream(*args, **kw):
            self.watch.check()
            yield event


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


def _choose_threads(args, device):
    """--threads N, else (CPU) the CPUs free now; returns (threads, CpuReport or None)."""
    import torch
    if args.threads:
        torch.set_num_threads(args.threads)
        return args.threads, None
    if device.type != "cpu":
        return torch.get_num_threads(), None
    report = free_cpus(limit=torch.get_num_threads())
    torch.set_num_threads(report.threads)
    return report.threads, report


def _noise(m: Measurement) -> str:
    """The noise measured, in words: spread of the paired ratios, range of the run times, CPU the runs got."""
    pairs = m.counted or m.pairs
    base = [p.target_only_s for p in pairs]
    spec = [p.speculative_s for p in pairs]
    share = min(min(p.cpu_share) for p in pairs)
    words = [f"{len(pairs)} pair{'s' if len(pairs) != 1 else ''}"]
    if m.summary and m.summary.pairs > 1:
        words.append(f"95 % interval {m.summary.low:.2f}-{m.summary.high:.2f}×, paired ratios "
                     f"{min(p.ratio for p in pairs):.2f}-{max(p.ratio for p in pairs):.2f}× "
                     f"(±{100 * m.summary.spread:.0f} % pair to pair)")
    span = (lambda t: f"{t[0]:.3g} s" if len(t) == 1 else f"{min(t):.3g}-{max(t):.3g} s")
    words.append(f"target-only {span(base)}, speculative {span(spec)} a run")
    n = pairs[-1].threads
    words.append(f"the least CPU a run got: {100 * share:.0f} % of "
                 + ("one thread's time" if n == 1 else f"{n} threads' time"))
    return "; ".join(words)


def run(args) -> int:
    import torch
    saved = torch.get_num_threads()
    try:
        return _demo(args)
    finally:   # the thread count is this process's: leave it as the caller had it
        torch.set_num_threads(saved)


def _demo(args) -> int:
    import torch
    from rich.console import Console
    from rich.markup import escape

    began = time.monotonic()
    console = Console(stderr=True)
    if args.repeats < 2:
        raise ValueError(f"--repeats must be >= 2 (pairs: one pair measures no noise), got {args.repeats}")
    if args.budget <= 0 or not 0 < args.precision < 1:
        raise ValueError(f"--budget must be > 0 and --precision in (0, 1), got {args.budget} and {args.precision}")
    check_decoding_args(args)
    choice = pick_cli_engine(args)          # what the options decide fails before a model loads
    device = pick_device(args.device)
    dtype = pick_dtype(args.dtype, device)
    threads, cpu = _choose_threads(args, device)
    target_name = args.target or (DEFAULT_GPU_MODEL if device.type == "cuda" else DEFAULT_MODEL)
    draft_name = args.draft or (f"{target_name}:layers={args.layers}" if args.layers else DEFAULT_DRAFT)
    why = f" ({cpu.describe()})" if cpu else " (--threads)" if args.threads else ""
    console.print(f"[bold]tilespec demo[/bold]: target [cyan]{target_name}[/cyan], draft [cyan]{draft_name}[/cyan], "
                  f"{device}, {str(dtype).replace('torch.', '')}, {threads} CPU thread{'s' if threads != 1 else ''}"
                  f"{why}, γ={args.gamma} ({args.gamma_schedule}), verify={args.method}")
    target, draft, tok = load_pair(target_name, draft_name, device, dtype, log=console.print)
    ids = encode_prompts(tok, [args.prompt], True)
    choice = choice or pick_cli_engine(args, target, draft)
    console.print(f"[dim]engine: {'paged (the one tilespec serve runs on)' if choice == 'paged' else 'decoder'}, "
                  f"both systems[/dim]")
    spec = build_engine(choice, args, target, draft, tok, ids)       # the same engine decodes target-only
    base = build_engine(choice, args, target, None, tok, ids)
    for dec in (base, spec):   # uncounted: lazy initialisations (and graph captures with --compile)
        dec.warmup(prompt_len=min(len(ids[0]), 64), max_new_tokens=4)
    console.print(f"[bold]prompt[/bold]: {escape(args.prompt)}\n[bold]speculative output[/bold]:")
    outs, spec_stats, tokens = [], [], {"target-only": [], "speculative": []}

    def dropped(old: int, new: int, share: float) -> None:
        console.print(f"[yellow]other processes took CPUs (this process got {100 * share:.0f} % of {old} threads' "
                      f"time): {old} → {new} thread{'s' if new != 1 else ''}[/yellow]")

    watch = Watchdog(threads, torch.set_num_threads, enabled=cpu is not None, on_drop=dropped)

    def run_one(name: str) -> tuple:
        out, wall, cpu_s = _timed(name, base if name == "target-only" else spec, ids, args, watch)
        outs.append(out.sequences)
        tokens[name].append(len(out.sequences[0]))
        if name == "speculative":
            spec_stats.append(out.stats)
        return wall, cpu_s

    def on_pair(pair, counted: int) -> None:
        label = f"pair {counted}" if pair.counted else f"a pair begun at {pair.threads} threads, not counted"
        console.print(f"[dim]{label}: target-only {pair.target_only_s:.2f} s, speculative "
                      f"{pair.speculative_s:.2f} s: {pair.ratio:.2f}×[/dim]")

    with torch.inference_mode():
        shown = stream_text(_Watched(spec, watch), tok, ids, args.max_new_tokens, args.seed)   # shown, not timed
        outs.append([shown])
        console.print(f"[dim]timing target-only and speculative decoding in pairs until the speedup's 95 % interval "
                      f"is within ±{100 * args.precision:.0f} % (at most {args.repeats} pairs, "
                      f"{args.budget:.0f} s)[/dim]")
        m = measure(run_one, lambda: watch.threads, max_pairs=args.repeats, min_pairs=min(MIN_PAIRS, args.repeats),
                    budget_s=args.budget, precision=args.precision, on_pair=on_pair)
    threads = watch.threads
    stats = spec_stats[-1]
    _print_stats(console, stats)
    counted = m.counted
    first = len(m.pairs) - len(counted)
    seconds = {"target-only": [p.target_only_s for p in counted], "speculative": [p.speculative_s for p in counted]}
    rate = {name: (sum(tokens[name][first:]) / sum(t) if t else None) for name, t in seconds.items()}
    greedy = args.temperature == 0
    same = all(o == outs[0] for o in outs)
    text = tok.decode(shown, skip_special_tokens=True)
    correct = answer_check(args.prompt, text)
    matched = f", {100 * stats.match_share:.0f} % of steps matched" if stats.context_steps else ""
    if m.stable:
        console.print(f"target-only: {rate['target-only']:.1f} tokens/s; speculative ({stats.drafter}): "
                      f"{rate['speculative']:.1f} tokens/s (α = {stats.alpha:.2f}, τ = {stats.block_efficiency:.2f} "
                      f"tokens per target call{matched}); {len(counted)} pairs, alternating, prefill included, "
                      f"{threads} thread{'s' if threads != 1 else ''}")
    else:
        console.print(f"speculative ({stats.drafter}): α = {stats.alpha:.2f}, τ = {stats.block_efficiency:.2f} "
                      f"tokens per target call{matched}")
    if greedy and same:
        console.print(f"[bold green]✓ speculative output equals the target's greedy output ({len(shown)} tokens, "
                      f"token for token)[/bold green]")
    if correct is not None:
        style = "bold green" if correct == "yes" else "bold yellow"
        console.print(f"[{style}]{'✓' if correct == 'yes' else '✗'} the answer parses as the input JSON document: "
                      f"{correct}[/{style}]")
    s = m.summary
    if args.json:
        from tilespec.env import run_record
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({
            "environment": run_record(device), "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "target": target_name,
            "draft": draft_name, "engine": choice, "dtype": str(dtype), "threads": threads, "prompt": args.prompt,
            "settings": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items() if k != "func"},
            "cpu": ({"usable": cpu.cpus, "probe_got": cpu.got, "load_average": cpu.load_average,
                     "torch_default_threads": cpu.limit, "threads_chosen": cpu.threads} if cpu else None),
            "thread_drops": watch.drops, "pairs": [p.to_dict() for p in m.pairs],
            "target_only_seconds": seconds["target-only"], "speculative_seconds": seconds["speculative"],
            "new_tokens": len(shown),
            "tokens_per_second": {"target_only": rate["target-only"], "speculative": rate["speculative"]},
            "verdict": "measured" if m.stable else "too busy to measure", "stopped": m.stopped,
            "precision": args.precision, "speedup": s.speedup if m.stable else None,
            "speedup_interval_95": [s.low, s.high] if s and s.pairs > 1 else None,
            "pair_spread": s.spread if s and s.pairs > 1 else None, "noise": _noise(m),
            "measure_seconds": m.seconds, "wall_seconds": time.monotonic() - began,
            "outputs_identical": same, "output": text, "answer_is_input_document": correct,
            "stats": [st.to_dict() for st in spec_stats]}, indent=2))
    verdict = ("yes" if same else "NO") if greedy else "n/a (sampling: same law, not the same tokens)"
    if m.stable:
        print(f"speedup {s.speedup:.2f}× over target-only decoding (95 % interval {s.low:.2f}-{s.high:.2f}× from "
              f"{s.pairs} alternating pairs; same run, same model); outputs identical: {verdict}")
        if s.speedup < 1 and device.type == "cpu" and threads > 1:
            console.print("[yellow]speculation lost here: on a CPU whose cores are busy with other work, threads wait "
                          "for each other in the wider verify forwards; compare with --threads 1[/yellow]")
    else:
        few = s is not None and s.pairs > 1 and s.spread <= args.precision and m.stopped == "budget"
        why = f"only {s.pairs} pairs fit in --budget {args.budget:.0f} s" if few else "this machine is too busy"
        print(f"speedup not measured within ±{100 * args.precision:.0f} %: {why} ({_noise(m)}); "
              f"outputs identical: {verdict}")
        console.print("[yellow]" + ("this CPU is slow (or shared): allow more time with --budget SECONDS" if few else
                                    "other processes share these CPUs: run again when the machine is quieter, or "
                                    "allow more time with --budget SECONDS --repeats N") + "[/yellow]")
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
    p.add_argument("--repeats", type=int, default=10,
                   help="at most this many timed pairs (target-only, then speculative; default 10)")
    p.add_argument("--budget", type=float, default=BUDGET_S,
                   help=f"seconds of timed pairs at most (default {BUDGET_S:.0f}; no pair starts that would end "
                        "past it)")
    p.add_argument("--precision", type=float, default=PRECISION,
                   help=f"stop once the speedup's 95 %% interval is within ± this fraction (default {PRECISION}), "
                        f"after {MIN_PAIRS} pairs at least")
    p.add_argument("--threads", type=int, default=0,
                   help="CPU threads for torch (default: the CPUs free now, probed; fewer if they get busy)")
    from .generate import add_decoding_arguments
    add_engine_argument(p)
    add_decoding_arguments(p)
    p.set_defaults(max_new_tokens=256, gamma=8, func=run)
