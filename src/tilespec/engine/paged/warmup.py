"""The paged engine's warm-up: every step shape compiled, captured or run once before serving, on the scratch block
only (no request's K/V is touched), so no request waits for a compile or a capture.

Shapes: mixed steps (one prompt chunk of every power of two up to the token budget beside 0..2^k - 1 single-token
rows: the attention kernel's compile variants), decode steps of every rows bucket x width (1, 1 + gamma) x table
width (powers of two up to the longest context: one CUDA graph each), and verify() at every (bucket, width) for
greedy and sampled requests.
"""
from __future__ import annotations

import time
from typing import Optional

import torch

from tilespec.verify.api import verify
from tilespec.verify.types import SamplingParams

from .model import StepInputs
from .shapes import BUCKETS, bucket, table_width


@torch.inference_mode()
def warm_up(engine, max_context: Optional[int] = None, log=None) -> int:
    """Compile the forward and capture every decode shape up to ``max_batch`` rows and ``max_context`` tokens
    (default max_len) before serving, on the scratch block only (no request's K/V is touched). Returns the
    number of shapes run (mixed steps: every power of two of rows and of prompt chunk, so the attention kernel
    compiles its variants here rather than inside a request). Without graphs (CPU) nothing to do."""
    if not engine.model.graphs:
        return 0
    start = time.perf_counter()
    bs, shapes = engine.blocks.block_size, 0
    s = 1
    while s <= bucket(engine.max_batch):       # mixed steps: the attention kernel's variants by rows and chunk
        q = 1
        while q <= min(engine.scheduler.token_budget, engine.max_len):
            engine.model.forward(scratch_inputs(engine, [q] + [1] * (s - 1)))
            shapes += 1
            q *= 2
        s *= 2
    widths = sorted({1, 1 + engine.gamma})
    top = table_width(-(-(max_context or engine.max_len) // bs))
    for rows in [b for b in BUCKETS if b <= bucket(engine.max_batch)]:
        for width in widths:
            m = 16
            while m <= top:
                engine.model.decode(StepInputs(
                    _t(engine, [engine.pad] * (rows * width)), _t(engine, list(range(width)) * rows),
                    _t(engine, list(range(width)) * rows),
                    torch.zeros((rows, m), dtype=torch.int32, device=engine.device),
                    _t(engine, range(0, (rows + 1) * width, width), torch.int32),
                    _t(engine, [width] * rows, torch.int32), _t(engine, range(rows * width)), width))
                shapes += 1
                m *= 2
            for temperature in (0.0, 1.0):       # verify's shapes compile on first use too
                zeros = torch.zeros(rows, dtype=torch.int64, device=engine.device)
                verify(torch.zeros((rows, width, engine.vocab_out), device=engine.device),
                       torch.full((rows, width - 1), engine.pad, dtype=torch.int64, device=engine.device),
                       num_draft_tokens=zeros, sampling=SamplingParams(temperature=temperature),
                       method=engine.method, seed=zeros, offsets=zeros, check_values=False)
    if log is not None:
        log(f"paged engine warm-up: {shapes} step shapes in {time.perf_counter() - start:.1f} s")
    return shapes


def _t(engine, values, dtype=torch.int64) -> torch.Tensor:
    return torch.tensor(values, dtype=dtype, device=engine.device)


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
