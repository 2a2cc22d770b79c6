"""``tilespec report``: build REPORT.md (and PNG figures) from the committed results under bench/results/."""
from __future__ import annotations

from pathlib import Path


def register(sub) -> None:
    p = sub.add_parser("report", help="write REPORT.md from bench/results/*.json (tables beside the paper's)")
    p.add_argument("--results", type=Path, default=Path("bench/results"), help="results folder (bench/results)")
    p.add_argument("--out", type=Path, default=Path("REPORT.md"), help="markdown file to write (REPORT.md)")
    p.add_argument("--figures", type=Path, default=None,
                   help="folder for the PNG figures (default bench/results/eval-figures beside --out)")
    p.add_argument("--debug", action="store_true", help="show tracebacks")
    p.set_defaults(func=run)


def run(args) -> int:
    from tilespec.eval.report import build_report

    if not args.results.is_dir():
        raise FileNotFoundError(f"no results folder {args.results}")
    build_report(args.results, args.out, args.figures)
    print(f"wrote {args.out}")
    return 0
