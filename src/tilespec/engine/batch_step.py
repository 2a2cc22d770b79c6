"""One decode step of continuous batching (engine/batching.py) over the first ``rows`` rows of the fixed batch.

This is the one place where continuous batching calls the engine's step functions: the whole-step graphs of
step_graph.py on native runners (scalar sampling), else the host-commit blocks of step.py (draft_block /
target_block / run_verify with per-row draft lengths, or speculative_step). The batch state and the runners' K/V
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
from .step import StepOutput, draft_block, run_verify, speculative_step, target_block

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
    output tokens); ``state`` is updated (write pointer included). ``gamma``: draft-model tokens (0: none);
    ``context``: [rows, K] drafts from a context drafter (or None); ``counts``: [rows] per-row draft lengths (None:
    no drafts); ``graphs``: run on ``fast`` (StepGraphs); ``live``: the live row indices (they set how far W moves)."""
    sub = BatchState(write=state.write, rows=list(range(rows)), eos=state.eos,
                     **{f: getattr(state, f)[:rows] for f in _FIELDS})
    timer = PhaseTimer(state.valid.device)
    with first_rows((target, draft), rows):
        if graphs:
            out = fast.step(sub, gamma, sampling, resolved, method, timer, draft_tokens=context,
                            num_draft_tokens=counts, method_options=method_options)
        elif context is not None:
            out = speculative_step(target, None, sub, context.shape[1], sampling, resolved, method, timer,
                                   graph_verify=False, context=(context, counts), method_options=method_options)
        elif gamma > 0:
            tokens, logits = draft_block(draft, sub, gamma, resolved, resolved.all_greedy)
            target_logits = target_block(target, sub, tokens)
            n, o = run_verify(target_logits, tokens, logits, sampling, method, sub.seeds, sub.seq_len, graphs=False,
                              num_draft_tokens=counts, options=method_options)
            out = StepOutput(draft_tokens=tokens, num_emitted=n, output_tokens=o)
        else:
            out = speculative_step(target, None, sub, 0, sampling, resolved, method, timer, graph_verify=False,
                                   method_options=method_options)
    host = torch.cat([out.num_emitted[:, None], out.output_tokens], dim=1).cpu()   # the step's one host read
    emitted = host[:, 0].tolist()
    if graphs:
        fast.advance(sub, max(emitted[b] for b in live))
    else:
        sub.commit(out.num_emitted, out.output_tokens, out.draft_tokens, max(emitted[b] for b in live) - 1)
        dead = ~sub.alive
        sub.valid = sub.valid & sub.alive[:, None]
        sub.seq_len = torch.where(dead, torch.ones_like(sub.seq_len), sub.seq_len)
        sub.pending = torch.where(dead, torch.full_like(sub.pending, pad), sub.pending)
        sub.prev = torch.where(dead, torch.full_like(sub.prev, pad), sub.prev)
    for f in ("valid", "seq_len", "pending", "prev", "alive"):
        getattr(state, f)[:rows].copy_(getattr(sub, f))
    state.write = sub.write
    return host
