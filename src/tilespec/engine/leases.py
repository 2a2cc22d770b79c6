"""Leases of shared compiled runners: one unfinished generation decodes with a shared runner at a time.

Compiled runners (CUDA graphs, native runners) are cached process-wide per shape and hold their KV caches, so two
open streams of one decoder (interleaved in one thread, or one abandoned midway and still referenced) must not
share one. A lease is a weak reference to the :class:`~tilespec.engine.generation.Generation` using the runner: it
ends when that generation finishes or is garbage-collected, with no cleanup call needed.
"""
from __future__ import annotations

import weakref

from tilespec import settings

from .native import NativeRunner
from .runner import is_encoder_decoder, make_runner

_LEASES: dict = {}   # id(shared runner) -> weakref to the Generation decoding with it
_COMPILED_RUNNERS: dict = {}   # (id(model), role, capacity, batch, compile, kernels) -> shared runner


def release_compiled() -> None:
    """Drop every cached compiled runner (their graphs and KV buffers)."""
    _COMPILED_RUNNERS.clear()


def shared_runner(model, name: str, capacity: int, batch: int, compile):
    """The runner of ``model`` in role ``name``: compiled runners are shared process-wide per (model, role,
    capacity, batch, compile mode, native kernel setting), so decoders that differ only in sampling or verify method
    reuse the same graphs (a changed TILESPEC_NATIVE_KERNELS gets runners of its own); eager runners are built per
    generation. A shared runner busy with another open generation is not handed out: the caller gets a runner of
    its own."""
    key = (id(model), name, capacity, batch, str(compile), settings.get().native_kernels)
    cached = _COMPILED_RUNNERS.get(key)
    busy = cached is not None and in_use(cached)
    if compile and cached is not None and cached.model is model and not busy:
        return cached
    runner = make_runner(model, capacity, compile=compile)
    # transformers' cross-attention cache cannot be reset in place; native runners re-fill theirs on encode()
    reuse = compile and (not is_encoder_decoder(model) or isinstance(runner, NativeRunner))
    if reuse and not busy:
        _COMPILED_RUNNERS[key] = runner
    return runner


def in_use(runner) -> bool:
    """True while an unfinished, still-referenced generation holds ``runner``."""
    ref = _LEASES.get(id(runner))
    gen = ref() if ref is not None else None
    return gen is not None and not gen.finished


def lease(gen, runners) -> None:
    """Lease to ``gen`` every runner of ``runners`` that is a shared (cached) runner, and the model runners a
    drafter's DraftRunner owns (its ``runners``)."""
    for runner in [r for o in runners if o is not None for r in (o, *getattr(o, "runners", ()))]:
        if any(runner is r for r in _COMPILED_RUNNERS.values()):
            _LEASES[id(runner)] = weakref.ref(gen)
