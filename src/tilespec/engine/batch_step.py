"""One decode step of continuous batching (engine/batching.py) over the first ``rows`` rows of the fixed batch.

This is the one place where continuous batching calls the engine's step functions: the whole-step graphs of
step_graph.py on native runners (scalar sampling), else the host-commit step of step.py; both run the same step
body with per-row draft lengths. The batch state and the runners' K/V
buffers are narrowed to their first ``rows`` rows (views, no copy; slots.first_rows), so a step costs what its
live rows need, rounded up to a power of two (each row count captures its own graphs); the state is written back
into the full-size tensors afterwards. Rows in range that are not live (free or prefilling) end the step with no
valid slot and a frozen length, as step_graph.py leaves ended rows.
"""
from __future__ import annotations

from typing import Optional

import torch

from .metrics import PhaseTimer
from .slots import first_rows
from .state import BatchState
from .drafters.base import Proposal
from .step import speculative_step

_FIELDS = ("valid", "seq_len", "pending", "prev", "seeds", "alive", "limit")


def row_count(live: list, max_batch: int) -> int:
    """The step's row count: the smallest power of two (capped at ``max_batch``) above every live row index."""
    n = 1
    while n < max(live) + 1:
        n *= 2
    return min(n, max_batch)


@torch.inference_mode()
def step_rows(target, draft, fast, state: BatchState, rows: int, gamma: int, context: Optional[torch.Tensor],
              counts: Optional[torch.Tensor], sampling, resolved, method: str, method_options: tuple, pad: int,
              graphs: bool, live: list) -> torch.Tensor:
    """Run one step over rows [0, rows) of ``state`` and return the host copy [rows, 1 + K + 1] of (num_emitted,
    output tokens); ``state`` is updated (write pointer included, and ``state.hidden``, the runner's per-row
    state). ``draft``: the drafter's DraftRunner (the model runners it owns and its own ``row_buffers`` are narrowed
    too; it observes every step that ``observes``, drafted or not) or None; ``gamma``: tokens it proposes (0: none);
    ``context``: [rows, K] drafts from a context drafter (or None); ``counts``: [rows] per-row draft lengths (None:
    no drafts); ``graphs``: run on ``fast`` (StepGraphs); ``live``: the live row indices (they set how far W moves)."""
    sub = BatchState(write=state.write, rows=list(range(rows)), eos=state.eos,
                     **{f: getattr(state, f)[:rows] for f in _FIELDS})
    if state.hidden is not None:
        sub.hidden = state.hidden[:rows]
    timer = PhaseTimer(state.valid.device)
    proposal = Proposal(context, counts=counts) if context is not None else None
    caps = counts if context is None else None
    own = (draft,) if draft is not None and draft.row_buffers else ()
    with first_rows((target, *(draft.runners if draft is not None else ()), *own), rows):
        if graphs:
            out = fast.step(sub, gamma, sampling, resolved, method, timer, context=proposal, counts=caps,
                            method_options=method_options)
        else:
            out = speculative_step(target, draft, sub, gamma, sampling, resolved, method, timer, graph_verify=False,
                                   context=proposal, counts=caps, method_options=method_options)
    host = torch.cat([out.num_emitted[:, None], out.output_tokens], dim=1).cpu()   # the step's one host read
    emitted = host[:, 0].tolist()
    if graphs:
        fast.advance(sub, max(emitted[b] for b in live))
    else:
        sub.commit(out.num_emitted, out.output_tokens, out.draft_tokens, max(emitted[b] for b in live) - 1)
        if out.hidden is not None:
            sub.hidden = out.hidden
        dead = ~sub.alive
        sub.valid = sub.valid & sub.alive[:, None]
        sub.seq_len = torch.where(dead, torch.ones_like(sub.seq_len), sub.seq_len)
        sub.pending = torch.where(dead, torch.full_like(sub.pending, pad), sub.pending)
        sub.prev = torch.where(dead, torch.full_like(sub.prev, pad), sub.prev)
    for f in ("valid", "seq_len", "pending", "prev", "alive"):
        getattr(state, f)[:rows].copy_(getattr(sub, f))
    if state.hidden is not None:       # the runner's new per-row state (rows not live: garbage, reset at go-live)
        state.hidden[:rows].copy_(sub.hidden)
    state.write = sub.write
    return host
