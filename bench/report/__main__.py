"""``python -m bench.report``: write REPORT.md (and PNG figures) from the results under bench/results/."""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

from .build import build_report


def main(argv: list | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.report", description=__doc__)
    p.add_argument("--results", type=Path, default=Path("bench/results"), help="results folder (bench/results)")
    p.add_argument("--out", type=Path, default=Path("REPORT.md"), help="markdown file to write (REPORT.md)")
    p.add_argument("--figures", type=Path, default=None,
                   help="folder for the PNG figures (default bench/results/eval-figures beside --out)")
    args = p.parse_args(argv)
    if not args.results.is_dir():
        p.error(f"no results folder {args.results}")
    build_report(args.results, args.out, args.figures)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
