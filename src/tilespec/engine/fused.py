"""Inductor-compiled regions of a captured step's tensor bookkeeping (token trees: frontier, mask, selection).

Why: inside a whole-step CUDA graph (step_graph.py) every small eager op is still one kernel of ~2 µs of GPU time,
and a token-tree step's bookkeeping (Philox draws, masks, gathers, top-k frontiers, the path walk) is ~1,000 of
them. Compiled with inductor, each group of elementwise / gather ops becomes a few fused Triton kernels.

What: plain functions of tensors with static shapes for a given (B, C, tree shape) and no host sync (they already
run inside CUDA-graph capture). The maths lives once, in the plain function; :func:`fused` hands out either it or
its compiled copy, ``torch.compile(fn, dynamic=False, fullgraph=True)``, made once per function (one compiled
variant per input signature: batch size, capacity, tree shape, sampling flags).

Where: only when the execution says so (:func:`wanted`: ``ex.compiled``, set by the captured whole-step graphs of
the "native-graphs" mode, and CUDA tensors). The host-commit path, the "native" mode's eager twin of the whole step
and every CPU run call the plain function, so CPU tests cover the same maths.

First call: GraphCache runs each step body once outside capture before recording it (graphs.py ``_record``), so
inductor traces, compiles and autotunes there and the capture records the compiled kernels. A region whose compile
fails warns and runs the plain function from then on, for every input signature (the failure surfaces in that
warm-up run, outside capture; a failure inside a capture propagates like any failing capture, and the step falls back
to the host-commit path). Callers keep inputs a region cannot trace away from it rather than rely on that.

Random draws are Philox integer ops (verify/rng.py): the same numbers compiled (Triton, where int64 products wrap)
and eager. Not so with inductor's C++ backend at -O3, where the wrapping products are undefined behaviour and come
out wrong: one more reason CPU runs stay plain. Float maths (softmax, Gumbel logs, the head's logits) may differ in
the last bit between inductor's kernels and the eager ones, which can reorder near-tied draft candidates.
"""
from __future__ import annotations

import warnings
from typing import Callable

import torch

RECOMPILE_LIMIT = 64      # compiled variants kept per function: (B, C, tree shape, sampling flags) combinations
_REGIONS: dict = {}       # plain function -> its _Region


def wanted(ex, like: torch.Tensor) -> bool:
    """Whether the execution ``ex`` runs compiled regions for tensors like ``like``: a captured step, on CUDA."""
    return bool(getattr(ex, "compiled", False)) and like.is_cuda


def fused(fn: Callable, on: bool) -> Callable:
    """``fn`` itself, or (``on``) its compiled copy."""
    return compiled(fn) if on else fn


def compiled(fn: Callable) -> Callable:
    """The one compiled copy of ``fn`` (made at the first call for it)."""
    region = _REGIONS.get(fn)
    if region is None:
        from .native.runner import raise_recompile_limits
        raise_recompile_limits(RECOMPILE_LIMIT)
        region = _REGIONS[fn] = _Region(fn)
    return region


def _capturing() -> bool:
    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()


class _Region:
    """``fn`` compiled, or ``fn`` itself once its compile failed outside a capture."""

    def __init__(self, fn: Callable):
        self.fn = fn
        self.__name__ = fn.__name__
        self._compiled = torch.compile(fn, dynamic=False, fullgraph=True)
        self.failed = False

    def __call__(self, *args, **kwargs):
        if not self.failed:
            try:
                return self._compiled(*args, **kwargs)
            except Exception as err:     # noqa: BLE001 - inductor failing on a region: the same maths eagerly
                if _capturing():
                    raise
                warnings.warn(f"compiling {self.__name__} failed ({type(err).__name__}: {err}); running it eagerly")
                self.failed = True
        return self.fn(*args, **kwargs)
