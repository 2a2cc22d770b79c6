"""The sums of tensor parallelism (two per layer): the process group's all-reduce, PyTorch's symmetric-memory one-shot
all-reduce, or the faster of the two measured per shape ("best").

* ``"nccl"``: ``funcol.all_reduce`` (the functional collective DTensor issues for ``Partial -> Replicate``; dynamo
  traces it into the compiled layer, a CUDA graph captures it). NCCL on GPUs, gloo on CPU.
* ``"symm"`` (CUDA): ``torch.ops.symm_mem.one_shot_all_reduce_copy`` (one kernel copies the partial sum into a
  symmetric buffer and reads the peers' buffers over NVLink; NVLink multicast never used); inputs over
  SYMM_MAX_ELEMENTS (prefill) take NCCL.
* ``"best"`` (CUDA): on the first, uncaptured call of each input shape every rank times both, each as BEST_CALLS
  calls captured in one CUDA graph (the fastest of BEST_REPLAYS replays), takes the slowest rank's time of each and
  keeps the faster for that shape: every rank picks the same. The measurements are kept in :data:`BEST`.
* ``"auto"``: ``"symm"`` on CUDA (faster than NCCL for decode-sized inputs:
  bench/results/tensor-parallel-h100x2.json), ``"nccl"`` elsewhere; env
  ``TILESPEC_TP_ALLREDUCE`` overrides it.
"""
from __future__ import annotations

import functools
import math
import os

import torch
import torch.distributed._functional_collectives as funcol

from tilespec import settings

ALLREDUCE = ("auto", "nccl", "symm", "best")
SYMM_MAX_ELEMENTS = 1 << 20   # larger sums (prefill) take NCCL: symmetric buffers are kept per shape, never freed
SYMM_VARIANT = ["copy"]   # "copy" (one_shot_all_reduce_copy) until it fails once, then "copy_then_reduce"
_SYMM: dict = {}   # (group name, numel, dtype, device) -> [two symmetric buffers, index of the next one]
BEST_CALLS, BEST_REPLAYS = 20, 3
BEST: dict = {}    # (group name, numel, dtype, device) -> {"elements", "dtype", "nccl_us", "symm_us", "pick"}


def nccl_all_reduce(x: torch.Tensor, group: str) -> torch.Tensor:
    """Sum over the group (functional collective: traced by dynamo, captured in CUDA graphs)."""
    return funcol.all_reduce(x, "sum", group)


def _eager(x: torch.Tensor, op: str, group: str) -> torch.Tensor:
    out = funcol.all_reduce(x.contiguous(), op, group)
    return out.wait() if isinstance(out, funcol.AsyncCollectiveTensor) else out


def _symm_buffers(group: str, x: torch.Tensor) -> list:
    """Two symmetric-memory buffers shaped like ``x`` for this group, made on first use (collective: every rank
    makes them at the same call, which the first, uncaptured run of each shape is: prefill or a graph's warm-up).
    Two, used in turn: a rank may fill the next buffer while a peer still reads the previous one; the one-shot
    kernel's entry barrier keeps the ranks within one sum of each other."""
    key = (group, x.numel(), x.dtype, x.device)
    entry = _SYMM.get(key)
    if entry is None:
        import torch.distributed._symmetric_memory as symm_mem
        if os.environ.get("TORCH_SYMM_MEM_DISABLE_MULTICAST") != "1":
            raise RuntimeError("set TORCH_SYMM_MEM_DISABLE_MULTICAST=1 (and NCCL_NVLS_ENABLE=0) before using the "
                               "symmetric-memory all-reduce: NVLink multicast must stay off")
        if torch.cuda.is_current_stream_capturing():
            raise RuntimeError("symmetric buffers must exist before a graph capture (run the shape once first)")
        bufs = []
        for _ in range(2):
            buf = symm_mem.empty(x.numel(), dtype=x.dtype, device=x.device)
            symm_mem.rendezvous(buf, group)
            bufs.append(buf)
        entry = _SYMM[key] = [bufs, 0]
    return entry


def _symm_sum(x: torch.Tensor, group: str) -> torch.Tensor:
    if x.numel() > SYMM_MAX_ELEMENTS:
        return _eager(x, "sum", group)
    entry = _symm_buffers(group, x)
    bufs, i = entry
    entry[1] = 1 - i
    flat = x.reshape(-1)
    if SYMM_VARIANT[0] == "copy":     # one kernel: the copy into the symmetric buffer happens inside the all-reduce
        try:
            return torch.ops.symm_mem.one_shot_all_reduce_copy(bufs[i], flat, "sum", group).view(x.shape)
        except (AttributeError, RuntimeError, TypeError):   # an older PyTorch: copy first (one more kernel)
            SYMM_VARIANT[0] = "copy_then_reduce"
    bufs[i].copy_(flat)
    return torch.ops.symm_mem.one_shot_all_reduce(bufs[i], "sum", group).view(x.shape)


@torch.library.custom_op("tilespec::symm_all_reduce", mutates_args=())
def symm_all_reduce(x: torch.Tensor, group: str) -> torch.Tensor:
    """Sum over the group by PyTorch's one-shot symmetric-memory all-reduce (every rank loads every peer's buffer
    over NVLink; no multicast); inputs over SYMM_MAX_ELEMENTS by NCCL. CUDA only. Opaque to inductor."""
    return _symm_sum(x, group)


@symm_all_reduce.register_fake
def _(x, group):
    return torch.empty_like(x)


def _graph_us(fn, x: torch.Tensor, group: str) -> float:
    """Microseconds per call of ``fn(x, group)``: BEST_CALLS calls captured in one CUDA graph, the fastest of
    BEST_REPLAYS replays; inf when the capture failed on any rank (the ranks agree before any replay)."""
    y = x.detach().clone()
    graph = torch.cuda.CUDAGraph()
    try:
        fn(y, group)                     # uncaptured first: symmetric buffers, the communicator
        torch.cuda.synchronize()
        with torch.cuda.graph(graph, capture_error_mode="thread_local"):
            for _ in range(BEST_CALLS):
                fn(y, group)
        ok = 1.0
    except RuntimeError:
        ok = 0.0
    if _eager(torch.tensor([ok], device=x.device), "min", group).item() < 1:
        return math.inf
    best = math.inf
    for _ in range(BEST_REPLAYS):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        best = min(best, start.elapsed_time(end) * 1e3 / BEST_CALLS)
    return best


def pick_faster(nccl_us: float, symm_us: float) -> str:
    """"symm" when it measured strictly faster, else "nccl" (the times are the slowest rank's: equal everywhere)."""
    return "symm" if symm_us < nccl_us else "nccl"


def _best_choice(x: torch.Tensor, group: str) -> str:
    key = (group, x.numel(), x.dtype, x.device)
    found = BEST.get(key)
    if found is None:
        if torch.cuda.is_current_stream_capturing():
            raise RuntimeError("allreduce='best' measures each shape on its first, uncaptured call: run the shape "
                               "once before capturing a graph")
        times = torch.tensor([_graph_us(_eager_sum, x, group), _graph_us(_symm_sum, x, group)],
                             dtype=torch.float64, device=x.device)
        nccl_us, symm_us = _eager(times, "max", group).tolist()
        found = BEST[key] = {"elements": x.numel(), "dtype": str(x.dtype).replace("torch.", ""),
                             "nccl_us": nccl_us, "symm_us": symm_us, "pick": pick_faster(nccl_us, symm_us)}
    return found["pick"]


def _eager_sum(x: torch.Tensor, group: str) -> torch.Tensor:
    return _eager(x, "sum", group)


@torch.library.custom_op("tilespec::best_all_reduce", mutates_args=())
def best_all_reduce(x: torch.Tensor, group: str) -> torch.Tensor:
    """Sum over the group by the all-reduce measured faster for this shape (see the module docstring); inputs over
    SYMM_MAX_ELEMENTS by NCCL. CUDA only. Opaque to inductor."""
    if x.numel() > SYMM_MAX_ELEMENTS or _best_choice(x, group) == "nccl":
        return _eager(x, "sum", group)
    return _symm_sum(x, group)


@best_all_reduce.register_fake
def _(x, group):
    return torch.empty_like(x)


def resolve_allreduce(allreduce: str, device: torch.device) -> str:
    """"auto" -> "symm" on CUDA, else "nccl"; env TILESPEC_TP_ALLREDUCE overrides "auto"; "best" -> "nccl" off CUDA
    (there is nothing to choose from). TORCH_SYMM_MEM_DISABLE_MULTICAST is set to 1 when unset for "symm"/"best"."""
    if allreduce not in ALLREDUCE:
        raise ValueError(f"allreduce must be one of {ALLREDUCE}, got {allreduce!r}")
    if allreduce == "auto":
        allreduce = settings.get().tp_allreduce or ("symm" if device.type == "cuda" else "nccl")
    if allreduce == "best" and device.type != "cuda":
        return "nccl"
    if allreduce == "symm" and device.type != "cuda":
        raise ValueError("the symmetric-memory all-reduce needs CUDA devices; use allreduce='nccl'")
    if allreduce in ("symm", "best"):
        os.environ.setdefault("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")
    return allreduce


def reducer(allreduce: str, group: str):
    """The sum function for a resolved ``allreduce`` ("nccl", "symm" or "best") over the named group."""
    fn = {"nccl": nccl_all_reduce, "symm": symm_all_reduce, "best": best_all_reduce}[allreduce]
    return functools.partial(fn, group=group)


__all__ = ["ALLREDUCE", "BEST", "SYMM_MAX_ELEMENTS", "best_all_reduce", "nccl_all_reduce", "pick_faster",
           "reducer", "resolve_allreduce", "symm_all_reduce"]
