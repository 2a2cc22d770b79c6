"""The server's start-up timeline: when each process reached each phase, as wall-clock times, reported as one line
of seconds since the main process was launched, so a slow start says where its time went.

Every process keeps its own marks (:class:`Marks`: name -> ``time.time()``; wall clocks, because the processes
share no monotonic origin) starting from its own launch (:func:`process_start`: the kernel's record, so the
interpreter's start-up and the imports before any tilespec code ran count too). The engine process sends its marks
in Ready, the other API processes theirs when they listen; the main process prints :func:`startup_line` when it
serves. Spans that ran beside another phase (CUDA init beside the imports, the grammar probe beside the warm-up) are
marked as such: they are not on the critical path.
"""
from __future__ import annotations

import os
import time
from typing import Optional

_IMPORTED = time.time()     # the fallback launch time where /proc is missing


def process_start() -> float:
    """Wall-clock time this process was launched (Linux: /proc/self/stat's start time against /proc/uptime, 10 ms
    resolution); elsewhere the time this module was imported."""
    try:
        with open("/proc/self/stat") as f:
            started_ticks = int(f.read().rsplit(")", 1)[1].split()[19])     # field 22: starttime
        with open("/proc/uptime") as f:
            uptime = float(f.read().split()[0])
        return time.time() - (uptime - started_ticks / os.sysconf("SC_CLK_TCK"))
    except (OSError, ValueError, IndexError):
        return _IMPORTED


class Marks:
    """One process's phases in order: ``[(name, wall time), ...]`` from its launch; ``spans``: name -> seconds of
    work that ran beside the critical path (a thread)."""

    def __init__(self, launched: Optional[float] = None):
        self.marks: list = [("launched", process_start() if launched is None else launched)]
        self.spans: dict = {}

    def mark(self, name: str, at: Optional[float] = None) -> float:
        at = time.time() if at is None else at
        self.marks.append((name, at))
        return at

    def to_wire(self) -> dict:
        """A msgpack / pickle friendly copy (sent between processes)."""
        return {"marks": [[n, t] for n, t in self.marks], "spans": dict(self.spans)}


def _part(origin: float, wire: dict, skip_launch: bool = False) -> str:
    marks = wire.get("marks", [])
    items = [f"{name} {at - origin:.1f}" for i, (name, at) in enumerate(marks) if not (skip_launch and i == 0)]
    items += [f"{name} {s:.1f} s beside" for name, s in wire.get("spans", {}).items()]
    return ", ".join(items)


def startup_line(main: Marks, engine: Optional[dict] = None, api: Optional[list] = None) -> str:
    """``start-up (s since launch): main ... | engine ... | API 1 ... | main ...``: every mark as seconds since the
    main process's launch (``engine`` / ``api``: the other processes' :meth:`Marks.to_wire`)."""
    origin = main.marks[0][1]
    parts = [f"main {_part(origin, main.to_wire(), skip_launch=True)}"]
    if engine:
        parts.append(f"engine {_part(origin, engine)}")
    for i, wire in enumerate(api or [], start=1):
        parts.append(f"API {i} {_part(origin, wire)}")
    return "start-up (s since launch): " + " | ".join(parts)
