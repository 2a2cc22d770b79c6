"""A physical core of its own for the engine process's step loop.

On a GPU host the engine's step is host-bound at many rows: planning, launching and committing a step at 256 rows is
a few milliseconds of one Python thread, about the device's own time for it. Over HTTP the API processes (and, in a
benchmark, the load generator) keep other cores busy; when one of them runs on the hyperthread sibling of the core
the step loop is on, every host phase of the step gets slower alike (seen on an H200 host: 1.5-1.7x at 256 rows
over HTTP against the same engine in-process). So once warmed up, a CUDA engine keeps one physical core (all its
hyperthreads) for its step loop, and every other thread of the server (the engine's own I/O threads, the API
processes) moves off it. vLLM and SGLang leave placement to the OS; ``--engine-cpus none`` does too.

Linux only (``os.sched_setaffinity``); elsewhere, with fewer than 4 usable CPUs, or for an engine on the CPU (its
forward needs every core) nothing is reserved.
"""
from __future__ import annotations

import os
from typing import Iterable, Optional

MIN_CPUS = 4        # below this, a reserved core would starve the API processes


def parse_cpus(text: str) -> frozenset:
    """``"0-3,8"`` -> {0, 1, 2, 3, 8} (the kernel's cpu-list format); ValueError naming the format otherwise."""
    cpus = set()
    try:
        for part in text.strip().split(","):
            if not part.strip():
                continue
            lo, _, hi = part.partition("-")
            first, last = int(lo), int(hi or lo)
            if first < 0 or last < first:
                raise ValueError
            cpus.update(range(first, last + 1))
    except ValueError:
        raise ValueError(f"a CPU list looks like 7 or 6-7 or 3,11, got {text!r}") from None
    return frozenset(cpus)


def allowed() -> frozenset:
    """The CPUs this process may run on (empty where the OS gives no affinity API)."""
    getter = getattr(os, "sched_getaffinity", None)
    return frozenset(getter(0)) if getter is not None else frozenset()


def siblings(cpu: int) -> frozenset:
    """``cpu`` and its hyperthread siblings (sysfs topology; just ``cpu`` where that is not readable)."""
    try:
        with open(f"/sys/devices/system/cpu/cpu{cpu}/topology/thread_siblings_list") as f:
            return parse_cpus(f.read()) | {cpu}
    except (OSError, ValueError):
        return frozenset({cpu})


def engine_cpus(choice: str = "auto", usable: Optional[Iterable[int]] = None) -> frozenset:
    """The CPUs the step loop keeps to itself. ``choice``: "auto" (the physical core of the highest-numbered usable
    CPU, its siblings among the usable ones; nothing with fewer than :data:`MIN_CPUS`), "none", or a CPU list;
    ``usable``: default :func:`allowed`. A list outside the usable CPUs is a ValueError naming them."""
    usable = allowed() if usable is None else frozenset(usable)
    if choice == "none" or not usable:
        return frozenset()
    if choice == "auto":
        if len(usable) < MIN_CPUS:
            return frozenset()
        return siblings(max(usable)) & usable
    cpus = parse_cpus(choice)
    if not cpus or not cpus < usable:
        raise ValueError(f"--engine-cpus {choice!r} must name some, not all, of this process's CPUs "
                         f"({_spell(usable)}), or be auto / none")
    return cpus


def _spell(cpus: Iterable[int]) -> str:
    return ",".join(str(c) for c in sorted(cpus))


def threads() -> list:
    """This process's thread ids (Linux /proc; [0], the calling thread, elsewhere)."""
    try:
        return [int(t) for t in os.listdir("/proc/self/task")]
    except OSError:
        return [0]


def keep_off(cpus: frozenset, skip: Iterable[int] = ()) -> None:
    """Every thread of this process (but ``skip``'s thread ids), and every thread or process it starts later, runs
    off ``cpus``. A thread that ended meanwhile is skipped."""
    if not cpus or not hasattr(os, "sched_setaffinity"):
        return
    rest = allowed() - cpus
    if not rest:
        return
    skip = set(skip)
    for tid in threads():
        if tid in skip:
            continue
        try:
            os.sched_setaffinity(tid, rest)
        except OSError:         # the thread ended (or is not ours to move): nothing to do
            pass


def reserve(cpus: frozenset) -> frozenset:
    """The calling thread (the step loop) runs on ``cpus`` only and every other thread of this process off them;
    the reserved set (empty when nothing was reserved)."""
    if not cpus or not hasattr(os, "sched_setaffinity"):
        return frozenset()
    me = os.gettid() if hasattr(os, "gettid") else 0
    keep_off(cpus, skip=[me])
    os.sched_setaffinity(0, cpus)
    return cpus
