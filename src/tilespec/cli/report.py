"""``tilespec report``: REPORT.md is built by the repository's ``python -m benchmarks.report`` (a pointer here)."""
from __future__ import annotations

from ._moved import add_moved


def register(sub) -> None:
    add_moved(sub, "report", "report", "REPORT.md generation from bench/results")
