"""Commands that moved out of the installed package: each still parses (any arguments) and says where it went.

Report generators, studies, paper-scale runs and data makers are the repository's own tools: they live in its
top-level ``benchmarks`` package and run from a checkout as ``python -m benchmarks.<name>``.
"""
from __future__ import annotations

import argparse
import sys


def add_moved(sub, name: str, module: str, what: str) -> None:
    """Register ``name`` under the subparsers ``sub`` as a pointer to ``python -m benchmarks.<module>``."""
    p = sub.add_parser(name, help=f"moved: {what} is `python -m benchmarks.{module}` in a tilespec checkout",
                       add_help=False, prefix_chars="\0")
    p.add_argument("rest", nargs=argparse.REMAINDER, help=argparse.SUPPRESS)
    p.set_defaults(func=lambda args: _point(name, module, what))


def _point(name: str, module: str, what: str) -> int:
    print(f"tilespec: `{name}` moved out of the installed package: {what} is the repository's "
          f"`python -m benchmarks.{module}` (run it from the root of a tilespec checkout, e.g. "
          f"`python -m benchmarks.{module} --help`)", file=sys.stderr)
    return 2
