"""The paged engine's warm-up: every step shape compiled, captured or run once before serving, on the scratch block
only (no request's K/V is touched), so no request waits for a compile or a capture.

  * the attention kernel's compiled variants (attention.variants: tile rows x sequence lanes x split or not), each
    launched once;
  * mixed steps (eager, torch.compile with dynamic sizes): a few row counts and prompt chunks, enough for the
    compiler's size specialisations (0 / 1 / many) and the largest step's memory; then every mixed bucket's
    piecewise graphs (piecewise.py);
  * every decode step shape (rows bucket x token bucket x logit width, pricing.py) at every table width up to the
    longest context: one CUDA graph each, replayed and timed, which seeds the engine's step costs; and verify() at
    every (rows, width) for greedy and sampled requests.
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
def warm_up(engine, max_context: Optional[int] = None, log=None) -> int:
    """Compile and capture every step shape up to ``max_batch`` rows and ``max_context`` tokens (default max_len)
    before serving (see the module docstring). Returns the number of shapes run; without graphs (CPU) none."""
    if not engine.model.graphs:
        return 0
    start = time.perf_counter()
    native, rows_top = engine.model.native, bucket(engine.max_batch)
    k0, v0 = engine.model.caches[0]
    bs = engine.blocks.block_size
    budget = min(engine.scheduler.token_budget, engine.max_len)
    marks = [time.perf_counter()]          # phase ends: attention variants, eager mixed, piecewise, decode
    shapes = warm_variants(native.dtype, k0.unflatten(0, (-1, bs)), v0.unflatten(0, (-1, bs)), native.heads,
                           max_seqs=max(rows_top, engine.scheduler.max_seqs), max_q=budget)
    for s in sorted({1, 2, 4, rows_top}):
        for q in sorted({1, 2, 17, 64, budget}):
            engine.model.forward(scratch_inputs(engine, [q] + [1] * (s - 1)))
            shapes += 1
    marks.append(time.perf_counter())
    if engine.model.piecewise:
        for size in engine.mixed_sizes:         # one sampling token on the scratch block, the rest padding
            engine.model.mixed(mixed_inputs([Fed([engine.pad], 0, [SCRATCH * bs], [SCRATCH])], 1,
                                            device=engine.device, pad_to=size, pad_id=engine.pad, block_size=bs))
            shapes += 1
    marks.append(time.perf_counter())
    top = table_width(-(-(max_context or engine.max_len) // bs))
    for rows in [b for b in BUCKETS if b <= rows_top]:
        for total, wide in decode_shapes(rows, engine.gamma):
            width = 1 + engine.gamma if wide else 1
            m = 16
            while m <= top:
                inputs = scratch_decode(engine, rows, total, width, m)
                engine.model.decode(inputs)
                if m == 16:                    # the step costs' seed: the shortest table (device time)
                    engine.costs.seed((rows, total, wide), _timed(lambda: engine.model.decode(inputs)))
                shapes += 1
                m *= 2
        for width in sorted({1, 1 + engine.gamma}):
            for temperature in (0.0, 1.0):       # verify's shapes compile on first use too
                zeros = torch.zeros(rows, dtype=torch.int64, device=engine.device)
                verify(torch.zeros((rows, width, engine.vocab_out), device=engine.device),
                       torch.full((rows, width - 1), engine.pad, dtype=torch.int64, device=engine.device),
                       num_draft_tokens=zeros, sampling=SamplingParams(temperature=temperature),
                       method=engine.method, seed=zeros, offsets=zeros, check_values=False)
    marks.append(time.perf_counter())
    if log is not None:
        phases = ", ".join(f"{name} {b - a:.1f} s" for name, a, b in
                           zip(("attention + eager mixed", "piecewise mixed", "decode graphs"), marks, marks[1:]))
        log(f"paged engine warm-up: {shapes} step shapes in {time.perf_counter() - start:.1f} s ({phases})")
    return shapes


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
