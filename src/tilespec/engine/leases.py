"""Leases of shared compiled runners: one unfinished generation decodes with a shared runner at a time.

Compiled runners (CUDA graphs, native runners) are cached process-wide per shape and hold their KV caches, so two
open streams of one decoder (interleaved in one thread, or one abandoned midway and still referenced) must not
share one. A lease is a weak reference to the :class:`~tilespec.engine.generation.Generation` using the runner: it
ends when that generation finishes or is garbage-collected, with no cleanup call needed.
"""
from __future__ import annotations

import weakref

_LEASES: dict = {}   # id(shared runner) -> weakref to the Generation decoding with it


def in_use(runner) -> bool:
    """True while an unfinished, still-referenced generation holds ``runner``."""
    ref = _LEASES.get(id(runner))
    gen = ref() if ref is not None else None
    return gen is not None and not gen.finished


def lease(gen, runners, shared) -> None:
    """Lease to ``gen`` every runner of ``runners`` that is one of the ``shared`` (cached) runners."""
    for runner in runners:
        if runner is not None and any(runner is r for r in shared):
            _LEASES[id(runner)] = weakref.ref(gen)
