"""The paged engine's warm-up: every step shape compiled, captured or run once before serving, on the scratch block
only (no request's K/V is touched), so no request waits for a compile or a capture.

  * the attention kernel's compiled variants (attention.variants: tile rows x sequence lanes x split or not), each
    launched once;
  * every mixed bucket's piecewise graphs (piecewise.py): a served mixed step is padded to one of them;
  * unpadded mixed steps (torch.compile with dynamic sizes) -- a few row counts and prompt chunks, enough for the
    compiler's size specialisations (0 / 1 / many) and the largest step's memory -- only where a served step can
    run unpadded: without piecewise graphs (their capture failed) or with a token budget above every bucket. With
    them, every shape the compiled forward serves is a decode graph's, compiled below; the compiled code itself
    is in the persistent caches, but each process still traces and loads it, so a second start saves the whole
    phase, not just its compiles;
  * every decode step shape (rows bucket x token bucket x logit width, pricing.py) at every table width up to the
    longest context: one CUDA graph each, replayed and timed, which seeds the engine's step costs; and verify() at
    every (rows, width) for greedy and sampled requests.

The log line gives each phase's shapes, seconds and what torch.compile did in it (graphs traced, compiled code read
from the FX graph cache or compiled): on a second start every graph should come from the cache.
"""
from __future__ import annotations

import time
from typing import Optional

import torch

from tilespec.verify.api import verify
from tilespec.verify.types import SamplingParams

from .attention import warm_variants
from .blocks import SCRATCH
from .layout import Fed, decode_inputs, mixed_inputs
from .model import StepInputs
from .pricing import token_buckets
from .shapes import BUCKETS, bucket, table_width

TIMED_REPLAYS = 5


@torch.inference_mode()
def warm_up(engine, max_context: Optional[int] = None, log=None, eager: Optional[bool] = None) -> int:
    """Compile and capture every step shape up to ``max_batch`` rows and ``max_context`` tokens (default max_len)
    before serving (see the module docstring); ``eager``: run the unpadded mixed steps too (None: only where a
    served step can be unpadded). Returns the number of shapes run; without graphs (CPU) none."""
    if not engine.model.graphs:
        return 0
    start = time.perf_counter()
    rows_top = bucket(engine.max_batch)
    phases = Phases()
    phases.done("attention variants", warm_attention(engine, rows_top))
    phases.done("piecewise mixed", warm_piecewise(engine) if engine.model.piecewise else 0)
    if eager is None:       # piecewise is off when a bucket's capture failed just now: then steps run unpadded
        eager = not engine.model.piecewise or engine.scheduler.token_budget > engine.mixed_sizes[-1]
    phases.done("eager mixed", warm_eager(engine, rows_top) if eager else 0)
    phases.done("decode graphs", warm_decode(engine, rows_top, max_context))
    if log is not None:
        log(f"paged engine warm-up: {phases.shapes} step shapes in {time.perf_counter() - start:.1f} s "
            f"({phases.line()})")
    return phases.shapes


class Phases:
    """Each warm-up phase's shapes, seconds and torch.compile counters (what it traced, read or compiled)."""

    def __init__(self):
        self.shapes, self.parts, self.t, self.c = 0, [], time.perf_counter(), compile_counters()

    def done(self, name: str, shapes: int) -> None:
        t, c = time.perf_counter(), compile_counters()
        traced, aot, fx, misses = (b - a for a, b in zip(self.c, c))
        work = f"; {traced} traced, {aot} + {fx} cache hits, {misses} compiled" if traced or misses else ""
        self.parts.append(f"{name} {shapes} in {t - self.t:.1f} s{work}" if shapes else f"{name} skipped")
        self.shapes, self.t, self.c = self.shapes + shapes, t, c

    def line(self) -> str:
        return ", ".join(self.parts)


def compile_counters() -> tuple:
    """(graphs dynamo traced, AOTAutograd cache hits, FX graph cache hits, FX graph cache misses: graphs compiled)
    in this process so far (zeros where torch counts none of them)."""
    try:
        from torch._dynamo.utils import counters
    except ImportError:
        return 0, 0, 0, 0
    return (counters["stats"]["unique_graphs"], counters["aot_autograd"]["autograd_cache_hit"],
            counters["inductor"]["fxgraph_cache_hit"], counters["inductor"]["fxgraph_cache_miss"])


def warm_attention(engine, rows_top: int) -> int:
    """The attention kernel's variants (attention.warm_variants); returns how many ran."""
    k0, v0 = engine.model.caches[0]
    bs = engine.blocks.block_size
    budget = min(engine.scheduler.token_budget, engine.max_len)
    return warm_variants(engine.model.native.dtype, k0.unflatten(0, (-1, bs)), v0.unflatten(0, (-1, bs)),
                         engine.model.native.heads, max_seqs=max(rows_top, engine.scheduler.max_seqs), max_q=budget,
                         trees=engine.trees is not None)      # a tree engine's steps launch the masked variant too


def warm_piecewise(engine) -> int:
    """Every mixed bucket's pieces captured (piecewise.py): one sampling token on the scratch block, the rest
    padding."""
    bs = engine.blocks.block_size
    for size in engine.mixed_sizes:
        engine.model.mixed(mixed_inputs([Fed([engine.pad], 0, [SCRATCH * bs], [SCRATCH])], 1, device=engine.device,
                                        pad_to=size, pad_id=engine.pad, block_size=bs))
    return len(engine.mixed_sizes)


def warm_eager(engine, rows_top: int) -> int:
    """Unpadded mixed steps through the compiled forward: its size specialisations and the largest step."""
    budget, n = min(engine.scheduler.token_budget, engine.max_len), 0
    for s in sorted({1, 2, 4, rows_top}):
        for q in sorted({1, 2, 17, 64, budget}):
            engine.model.forward(scratch_inputs(engine, [q] + [1] * (s - 1)))
            n += 1
    return n


def warm_decode(engine, rows_top: int, max_context: Optional[int]) -> int:
    """Every decode step shape's graph at every table width, the shortest timed (the step costs' seeds), and
    verify() at every (rows, width) for greedy and sampled requests."""
    top = table_width(-(-(max_context or engine.max_len) // engine.blocks.block_size))
    n = 0
    for rows in [b for b in BUCKETS if b <= rows_top]:
        for total, wide in decode_shapes(rows, engine.gamma):
            width = 1 + engine.gamma if wide else 1
            m = 16
            while m <= top:
                inputs = scratch_decode(engine, rows, total, width, m)
                engine.model.decode(inputs)
                if m == 16:                    # the step costs' seed: the shortest table (device time)
                    engine.costs.seed((rows, total, wide), _timed(lambda: engine.model.decode(inputs)))
                n += 1
                m *= 2
        for width in sorted({1, 1 + engine.gamma}):
            for temperature in (0.0, 1.0):       # verify's shapes compile on first use too
                zeros = torch.zeros(rows, dtype=torch.int64, device=engine.device)
                verify(torch.zeros((rows, width, engine.vocab_out), device=engine.device),
                       torch.full((rows, width - 1), engine.pad, dtype=torch.int64, device=engine.device),
                       num_draft_tokens=zeros, sampling=SamplingParams(temperature=temperature),
                       method=engine.method, seed=zeros, offsets=zeros, check_values=False)
    return n


def decode_shapes(rows: int, gamma: int) -> list:
    """(token total, wide) of every decode step of ``rows`` rows: no drafts, then each token bucket with drafts."""
    return [(rows, False)] + ([(t, True) for t in token_buckets(rows, gamma)] if gamma > 0 else [])


def _timed(fn) -> float:
    """Median seconds of ``fn`` over TIMED_REPLAYS runs (CUDA events)."""
    times = []
    for _ in range(TIMED_REPLAYS):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) / 1e3)
    return sorted(times)[len(times) // 2]


def _t(engine, values, dtype=torch.int64) -> torch.Tensor:
    return torch.tensor(values, dtype=dtype, device=engine.device)


def scratch_decode(engine, rows: int, total: int, width: int, m: int) -> StepInputs:
    """A decode step of ``rows`` requests on the scratch block: ``total`` tokens spread over them, at most
    ``width`` each (the rest padding), block tables ``m`` wide."""
    bs, fed, left = engine.blocks.block_size, [], total
    for r in range(rows):
        n = min(width, max(1, left - (rows - 1 - r)))
        left -= n
        fed.append(Fed([engine.pad] * n, 0, [SCRATCH * bs + j for j in range(n)], [SCRATCH]))
    inputs = decode_inputs(fed, (rows, total, width > 1), width, pad_id=engine.pad, block_size=bs,
                           device=engine.device, fixed=True)
    if inputs.tables.shape[1] != m:
        inputs.tables = torch.zeros((rows, m), dtype=torch.int32, device=engine.device)
    return inputs


def scratch_inputs(engine, counts: list) -> StepInputs:
    """A mixed step of len(counts) requests feeding counts[s] tokens each, all on the scratch block."""
    t, bs = sum(counts), engine.blocks.block_size
    cu = [0]
    for c in counts:
        cu.append(cu[-1] + c)
    width = table_width(-(-max(counts) // bs))
    return StepInputs(_t(engine, [engine.pad] * t), _t(engine, [j % bs for j in range(t)]),
                      _t(engine, [j % bs for j in range(t)]),
                      torch.zeros((len(counts), width), dtype=torch.int32, device=engine.device),
                      _t(engine, cu, torch.int32), _t(engine, counts, torch.int32),
                      _t(engine, [t - 1]), max(counts))
