"""How a step's tokens are laid out for the paged forward (:class:`~tilespec.engine.paged.model.StepInputs`).

Both kinds of step are ragged: request s feeds its n_s tokens at rows cu_q[s]:cu_q[s+1] of one flat batch.

* A **decode step** (every request decoding: its pending token + the k_s drafts the step verifies) has a fixed
  shape where it replays a CUDA graph: R rows (a rows bucket; absent rows feed no token), T tokens (a token bucket
  of R, pricing.py; the tokens after the last request's are padding, outside every sequence: they write their K/V
  to the scratch block and attend to nothing) and ``width`` logit rows per request (1, or 1 + gamma when any
  request drafts: its own rows, then its last one repeated), so verify() sees [R, width, V].
* A **mixed step** (prefill chunks beside decode rows) is ragged; where it replays piecewise graphs (piecewise.py)
  its tokens are padded to a mixed bucket as above; its logit rows are those of the sampling requests, padded to
  the widest and to the rows bucket as above.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from .blocks import SCRATCH
from .model import StepInputs
from .shapes import bucket, table_width


@dataclass
class Fed:
    """One request's tokens in a step: ids, the position of the first, each one's cache slot, the request's block
    table, and whether the step samples it (its logits are verified: the last ``1 + drafts`` fed tokens)."""

    tokens: list
    start: int
    slots: list
    table: list
    samples: bool = True
    drafts: int = 0


def _tensor(values, device, dtype=torch.int64) -> torch.Tensor:
    return torch.tensor(values, dtype=dtype).to(device, non_blocking=True)


def decode_inputs(fed: list, shape: tuple, width: int, *, pad_id: int, block_size: int, device,
                  fixed: bool) -> StepInputs:
    """A decode step (see the module docstring). ``shape`` = (R, T, wide) from the planner; ``fixed``: pad to it and
    to a power-of-two table width (a graph replays it); otherwise R = len(fed), T = the tokens fed."""
    rows, total = (shape[0], shape[1]) if fixed else (len(fed), 0)
    m = max(len(f.table) for f in fed)
    m = table_width(m) if fixed else m
    tables = [f.table + [SCRATCH] * (m - len(f.table)) for f in fed] + [[SCRATCH] * m] * (rows - len(fed))
    tokens, positions, slots, cu, lens, logit_rows = [], [], [], [0], [], []
    for f in fed:
        base = cu[-1]
        tokens += f.tokens
        positions += range(f.start, f.start + len(f.tokens))
        slots += f.slots
        cu.append(base + len(f.tokens))
        lens.append(f.start + len(f.tokens))
        logit_rows += [base + j for j in range(len(f.tokens))] + [cu[-1] - 1] * (width - len(f.tokens))
    absent = rows - len(fed)
    cu += [cu[-1]] * absent
    lens += [0] * absent
    logit_rows += [0] * (absent * width)
    pad = max(0, total - len(tokens))
    tokens += [pad_id] * pad
    positions += [0] * pad
    slots += [SCRATCH * block_size + j % block_size for j in range(pad)]
    return StepInputs(_tensor(tokens, device), _tensor(positions, device), _tensor(slots, device),
                      _tensor(tables, device, torch.int32), _tensor(cu, device, torch.int32),
                      _tensor(lens, device, torch.int32), _tensor(logit_rows, device), width)


def mixed_inputs(fed: list, width: int, *, device, pad_to: int = 0, pad_id: int = 0, block_size: int = 16
                 ) -> StepInputs:
    """A mixed step (see the module docstring): ``width`` logit rows per sampling request; ``pad_to``: padding
    tokens up to that many (a piecewise bucket: outside every sequence, K/V to the scratch block)."""
    tokens, positions, slots, cu, lens, rows = [], [], [], [0], [], []
    m = max(len(f.table) for f in fed)
    tables = [f.table + [SCRATCH] * (m - len(f.table)) for f in fed]
    sampling = 0
    for f in fed:
        base = cu[-1]
        tokens += f.tokens
        positions += range(f.start, f.start + len(f.tokens))
        slots += f.slots
        cu.append(base + len(f.tokens))
        lens.append(f.start + len(f.tokens))
        if f.samples:
            own = [cu[-1] - 1 - f.drafts + j for j in range(1 + f.drafts)]
            rows += own + [own[-1]] * (width - len(own))
            sampling += 1
    if sampling:      # verify takes the rows bucket: the head computes the padding rows, no logits copy later
        rows += rows[:width] * (bucket(sampling) - sampling)
    pad = max(0, pad_to - len(tokens))
    tokens += [pad_id] * pad
    positions += [0] * pad
    slots += [SCRATCH * block_size + j % block_size for j in range(pad)]
    return StepInputs(_tensor(tokens, device), _tensor(positions, device), _tensor(slots, device),
                      _tensor(tables, device, torch.int32), _tensor(cu, device, torch.int32),
                      _tensor(lens, device, torch.int32), _tensor(rows, device), max(len(f.tokens) for f in fed))
