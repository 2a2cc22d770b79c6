"""``tilespec eval summarization|asr``: measured quality (ROUGE / WER) beside speed, per verification method, on the
same examples and seeds (the seed paper's accuracy / profiling comparison; docs/eval.md).

``add_eval_arguments`` and ``run`` are shared with the repository's ``python -m bench.studies``, which adds the
side studies (γ sweeps, acceptance vs initial γ, sigmoid scales); the paper-scale runs and the synthetic ASR set
are ``python -m bench.scale`` and ``python -m bench.synth``.
"""
from __future__ import annotations

from pathlib import Path

from tilespec.bench.config import default_methods

DEFAULTS = {
    "summarization": dict(dataset="xsum", target="qwen2.5-coder-1.5b-instruct", draft="qwen2.5-coder-0.5b-instruct"),
    "asr": dict(dataset="ljspeech", target="whisper-base", draft="whisper-base:layers=4"),
}


def add_eval_arguments(p, task: str) -> None:
    """The options of ``tilespec eval TASK`` on the parser ``p``."""
    d = DEFAULTS[task]
    p.add_argument("--dataset", default=d["dataset"], help=f"dataset (default {d['dataset']})")
    p.add_argument("--data", type=Path, default=None, help="dataset file/folder (default: the shared data folder)")
    if task == "asr":
        p.add_argument("--synthetic-dir", type=Path, default=None,
                       help="folder made by `python -m bench.synth` for --dataset synthetic (default "
                            "$TILESPEC_SYNTH_DIR; synthetic speech (espeak-ng), NOT LibriSpeech)")
    p.add_argument("--limit", type=int, default=None, help="examples, subsampled with --seed (default: all)")
    p.add_argument("--seed", type=int, default=0, help="subsampling and decoding seed (default 0)")
    p.add_argument("--methods", default=None, help="comma-separated (hf = the paper's baseline; default: every "
                                                   "registered method marked evaluate: " + ", ".join(default_methods())
                                                   + ")")
    p.add_argument("--target", default=d["target"])
    p.add_argument("--draft", default=d["draft"], help="registry name, NAME:layers=N, distilled (ASR: the "
                                                          "target's trained draft), ngram, suffix or MODEL+ngram; "
                                                          "'none' for target-only")
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default=None, help="float32 (CPU default) / bfloat16 (CUDA default) / float16")
    p.add_argument("--max-new-tokens", type=int, default=100 if task == "summarization" else 128)
    p.add_argument("--temperature", type=float, default=1.0, help="0 = greedy (default 1: speculative sampling)")
    p.add_argument("--gamma", type=int, default=5, help="initial γ of the heuristic (default 5)")
    p.add_argument("--schedule", default="heuristic", choices=("heuristic", "constant", "optimal"))
    p.add_argument("--sigmoid-scale", type=float, default=None,
                   help="sigmoid α=-s, β=s in the main table (default 1e4 summarization, 1e3 ASR)")
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
                   help="seconds for this invocation (model loading included): no new chunk of examples starts after "
                        "it; results are written after each chunk, and the same command again resumes (see --fresh)")
    p.add_argument("--json", type=Path, default=None, help="add the record to this results file")
    p.add_argument("--debug", action="store_true", help="show tracebacks")
    p.set_defaults(func=run, task=task)


def register(sub) -> None:
    ev = sub.add_parser("eval", help="quality (ROUGE / WER) beside speed per verification method, summarization / ASR")
    ev_sub = ev.add_subparsers(dest="eval_task", metavar="TASK")
    add_eval_arguments(ev_sub.add_parser("summarization", help="XSum / CNN-DM, ROUGE-1"), "summarization")
    add_eval_arguments(ev_sub.add_parser("asr", help="LJSpeech / a synthetic espeak-ng set, WER"), "asr")


def build_config(args, **study_settings):
    """EvalConfig from parsed arguments (ValueError for bad values); ``study_settings``: the side-study fields
    (``studies``, ``sweep_limit``, ...) a caller that runs side studies adds."""
    from tilespec.bench.config import EvalConfig
    from tilespec.env import pick_dtype

    dtype = args.dtype or str(pick_dtype("auto", args.device)).removeprefix("torch.")
    draft = None if str(args.draft).lower() in ("none", "") else args.draft
    return EvalConfig(task=args.task, dataset=args.dataset, limit=args.limit, seed=args.seed,
                      **({"methods": tuple(m.strip() for m in args.methods.split(",") if m.strip())}
                         if args.methods else {}),
                      target=args.target, draft=draft, device=args.device, dtype=dtype,
                      max_new_tokens=args.max_new_tokens, temperature=args.temperature, gamma=args.gamma,
                      schedule=args.schedule, sigmoid_scale=args.sigmoid_scale,
                      max_article_chars=args.max_article_chars, compile=args.compile, warmup=not args.no_warmup,
                      time_budget=args.time_budget, batch_size=args.batch_size, **study_settings)


def run(args, studies: dict | None = None, **study_settings) -> int:
    """Run ``tilespec eval`` for parsed ``args``; ``studies`` / ``study_settings``: see :func:`build_config` and
    :func:`tilespec.bench.quality.evaluate`."""
    import json
    import time

    from tilespec.bench.quality import evaluate, find_run, write_results

    cfg = build_config(args, **study_settings)
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
    record = evaluate(cfg, data_path=data, on_update=on_update, previous=previous, studies=studies)
    if args.json:
        write_results(args.json, record)
        print(f"wrote {args.json}")
    else:
        slim = {k: v for k, v in record.items() if k not in ("references", "ids")}
        print(json.dumps(slim, indent=1)[:4000])
    return 0
