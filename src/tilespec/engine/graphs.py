"""CUDA-graph capture of the engine's fixed-shape device work (model forwards, draft sampling, verification).

:class:`GraphCache` wraps a function of tensors. The first call with a new input signature (shapes, dtypes and the
hashable ``key`` the caller adds) copies the inputs into static buffers, runs the function once on a side stream
(warm-up: lazy initialisations, cuBLAS workspaces, Triton compilation) and captures one more run on that same
stream into a ``torch.cuda.CUDAGraph``; every later call copies the inputs into those buffers and replays. Capture takes a few
milliseconds per shape, against minutes for ``torch.compile(mode="reduce-overhead")`` on a 1.5B model.

Invariants the wrapped functions must keep (the engine's forwards do):
  * no host synchronisation and no data-dependent Python control flow (a capture would fail or bake one branch);
  * every tensor they read besides the inputs lives at a fixed address for the cache's lifetime (model weights,
    the slot KV buffers, the write pointer ``SlotCache.write_pos``);
  * the warm-up run must be harmless to repeat: a model forward rewrites the same K/V slots with the same values.
Outputs are the graph's own buffers, overwritten by the next replay of the same graph: callers copy what they keep.
All graphs of one cache share a memory pool; that is safe because they are replayed one at a time on one stream.

Captured GEMMs use the cuBLAS workspace that torch keeps per (handle, stream): the graph bakes in its address, and
the workspace is allocated by the warm-up outside any pool. ``torch._C._cuda_clearCublasWorkspaces()`` frees every
such workspace; torch.compile's CUDA-graph trees (``mode="reduce-overhead"``, which transformers' static-cache
``generate`` uses on CUDA) call it around each warm-up and recording. A graph captured before such a call and
replayed after it writes into freed memory: silent corruption, or ``an illegal memory access`` once the memory was
returned to the driver. So every clear bumps :func:`workspace_epoch`, and a cache whose graphs are older than the
current epoch drops them and captures again (a few ms per shape; the compiled code is kept).

A cache holds at most ``max_graphs`` graphs and evicts the least recently replayed one to capture a new shape: a
long-lived server meets many (row count, draft length, sampling) keys over a day, and a bound that raised instead
would take its engine down; ``evictions`` counts how often that happened (a steadily rising count means shapes are
not bounded and every step captures).
"""
from __future__ import annotations

import gc
from collections import OrderedDict
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Callable, Hashable

import torch


@dataclass
class _Captured:
    graph: torch.cuda.CUDAGraph
    inputs: tuple
    output: object


_CAPTURE_STREAMS: dict = {}
_EPOCH = [0]          # bumped by every cuBLAS workspace clear, see workspace_epoch()


def workspace_epoch() -> int:
    """How many times torch's cuBLAS workspaces were freed in this process (since tilespec watched for it): graphs
    captured at an older epoch may point at a freed workspace."""
    _watch_workspace_clears()
    return _EPOCH[0]


def _watch_workspace_clears() -> None:
    """Wrap ``torch._C._cuda_clearCublasWorkspaces`` (once) so every caller, CUDA-graph trees included, bumps the
    epoch. Absent on CPU-only builds: nothing to watch there (no graphs either)."""
    clear = getattr(torch._C, "_cuda_clearCublasWorkspaces", None)
    if clear is None or getattr(clear, "_tilespec_watched", False):
        return

    def clear_and_count(*args, **kwargs):
        _EPOCH[0] += 1
        return clear(*args, **kwargs)

    clear_and_count._tilespec_watched = True
    clear_and_count.__wrapped__ = clear
    torch._C._cuda_clearCublasWorkspaces = clear_and_count


@contextmanager
def quiet_capture():
    """``torch.cuda.graph`` without its housekeeping: on entry it empties the CUDA and pinned-host caching allocators
    (and, in some torch versions, runs a full garbage collection), which is right for one capture but costs tens of
    milliseconds each in a warm-up of a hundred (the caches fill up again from the driver after each; a collection
    walks every object of the loaded models). vLLM's capture wrapper skips the same calls. The graph's own memory
    comes from its pool either way."""
    host = hasattr(torch._C, "_host_emptyCache")       # not in every torch
    saved = gc.collect, torch.cuda.empty_cache, getattr(torch._C, "_host_emptyCache", None)
    gc.collect = torch.cuda.empty_cache = _nothing
    if host:
        torch._C._host_emptyCache = _nothing
    try:
        yield
    finally:
        gc.collect, torch.cuda.empty_cache = saved[:2]
        if host:
            torch._C._host_emptyCache = saved[2]


def _nothing(*args, **kwargs) -> int:
    return 0


def _capture_stream(device: torch.device) -> torch.cuda.Stream:
    """One warm-up-and-capture stream per device, for every cache. Why: cuBLAS keeps a workspace per stream; the
    warm-up on this stream allocates it outside any capture, so a capture never allocates it inside a graph's pool.
    (Capturing on torch's default capture stream after warming up elsewhere put that workspace in the first graph's
    pool; once a cache was dropped - Whisper runners are rebuilt per generation - later captures used freed memory
    and failed with CUBLAS_STATUS_EXECUTION_FAILED / cudaErrorStreamCaptureInvalidated.)"""
    key = torch.device(device).index if torch.device(device).index is not None else torch.cuda.current_device()
    stream = _CAPTURE_STREAMS.get(key)
    if stream is None:
        stream = _CAPTURE_STREAMS[key] = torch.cuda.Stream(device)
    return stream


class GraphCache:
    """Capture-once, replay-many wrapper: ``cache(*tensors, key=...)`` -> the function's output (graph buffers)."""

    def __init__(self, fn: Callable, max_graphs: int = 256):
        self.fn = fn
        self.max_graphs = max_graphs
        self.evictions = 0
        self.captures = 0           # graphs captured so far (a call that captured is no timing sample)
        self._graphs: OrderedDict = OrderedDict()      # least recently replayed first
        self._pool = None
        self._epoch = workspace_epoch()

    def __len__(self) -> int:
        return len(self._graphs)

    def __call__(self, *args: torch.Tensor, key: Hashable = None):
        sig = (key,) + tuple((tuple(a.shape), a.dtype, a.device) for a in args)
        if self._epoch != _EPOCH[0]:         # a cuBLAS workspace the graphs use was freed: capture again
            self.clear()
        entry = self._graphs.get(sig)
        if entry is None:
            entry = self._capture(sig, args, key)
        else:
            self._graphs.move_to_end(sig)
            for dst, src in zip(entry.inputs, args):
                if dst.data_ptr() != src.data_ptr():
                    dst.copy_(src)
        entry.graph.replay()
        return entry.output

    def _capture(self, sig, args, key) -> _Captured:
        static = tuple(a.clone() for a in args)
        self.captures += 1
        graph, output = self._record(static, key)
        entry = self._graphs[sig] = _Captured(graph=graph, inputs=static, output=output)
        while len(self._graphs) > self.max_graphs:
            self._graphs.popitem(last=False)
            self.evictions += 1
        return entry

    def _record(self, static: tuple, key):
        """Warm up on a side stream, then capture one run of ``fn`` on ``static`` -> (graph, its output buffers)."""
        device = static[0].device
        if device.type != "cuda":
            raise RuntimeError("CUDA graphs need CUDA tensors")
        side = _capture_stream(device)
        side.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(side):
            self.fn(*static, key=key)
        torch.cuda.current_stream(device).wait_stream(side)
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
        graph = torch.cuda.CUDAGraph()
        with quiet_capture(), torch.cuda.graph(graph, pool=self._pool, stream=side):
            output = self.fn(*static, key=key)
        return graph, output

    def clear(self) -> None:
        self._graphs.clear()
        self._pool = None
        self._epoch = workspace_epoch()
