"""How a step's tokens are laid out for the paged forward (:class:`~tilespec.engine.paged.model.StepInputs`).

Both kinds of step are ragged: request s feeds its n_s tokens at rows cu_q[s]:cu_q[s+1] of one flat batch.

* A **decode step** (every request decoding: its pending token + the k_s drafts the step verifies) has a fixed
  shape where it replays a CUDA graph: R rows (a rows bucket; absent rows feed no token), T tokens (a token bucket
  of R, pricing.py; the tokens after the last request's are padding, outside every sequence: they write their K/V
  to the scratch block and attend to nothing) and ``width`` logit rows per request (1, or 1 + gamma when any
  request drafts: its own rows, then its last one repeated), so verify() sees [R, width, V].
* A **mixed step** (prefill chunks beside decode rows) is ragged; where it replays piecewise graphs (piecewise.py)
  its tokens are padded to a mixed bucket as above; its logit rows are those of the sampling requests, padded to
  the widest and to the rows bucket as above, then those of the tokens whose prompt logprobs are wanted.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import numpy as np
import torch

from .blocks import SCRATCH
from .model import StepInputs
from .shapes import bucket, table_width


@dataclass(slots=True)     # one per request per step
class Fed:
    """One request's tokens in a step: ids, the position of the first, each one's cache slot, the request's block
    table, and whether the step samples it (its logits are verified: the last ``1 + drafts`` fed tokens)."""

    tokens: list
    start: int
    slots: list
    table: list
    samples: bool = True
    drafts: int = 0
    scored: int = 0          # ``scored`` of its tokens from ``score_from`` on want their logits too (prompt
    score_from: int = 0      # logprobs; mixed steps)
    positions: Optional[list] = None    # a draft tree's: each token's RoPE position (None: start, start + 1, ...)
    masks: Optional[list] = None        # and its ancestor bitmask over these tokens (engine/paged/tree.py)


def fed_item(it, bs: int) -> Fed:
    """A scheduled item's (scheduler.Item) tokens, positions and slots in blocks of ``bs``, with its drafts when it
    samples and, for a request that wants prompt logprobs, which of its positions are scored."""
    seq, start = it.seq, it.start
    if it.n == 1 and it.samples and not seq.drafts:        # a plain decode row: most rows of most steps
        return Fed([seq.tokens[start]], start, [seq.table[start // bs] * bs + start % bs], seq.table, True, 0)
    ids = seq.tokens[start:start + it.n] + (seq.drafts if it.samples else [])
    slots = [seq.table[p // bs] * bs + p % bs for p in range(start, start + len(ids))]
    fed = Fed(ids, start, slots, seq.table, it.samples, len(seq.drafts) if it.samples else 0)
    if seq.prompt_lps is not None:          # positions not yet scored whose next token is a prompt token
        lo, hi = max(start, len(seq.prompt_lps)), min(start + it.n, len(seq.req.prompt) - 1)
        fed.score_from, fed.scored = lo - start, max(0, hi - lo)
    return fed


class _Flat:
    """The requests' tokens back to back: ids, positions, slots, cu_q, lengths after the step, and block tables
    ``m`` wide for ``rows`` requests (rows past the fed ones: absent, no token, a table of scratch)."""

    def __init__(self, fed: list, m: int, rows: int = 0):
        rows = max(rows, len(fed))
        self.tables = np.full((rows, m), SCRATCH, dtype=np.int32)     # numpy rows: 4x cheaper than nested lists
        for i, f in enumerate(fed):
            self.tables[i, :len(f.table)] = f.table
        if all(len(f.tokens) == 1 and f.positions is None and f.masks is None for f in fed):   # plain decode rows
            self.tokens, self.slots = [f.tokens[0] for f in fed], [f.slots[0] for f in fed]
            self.positions, self.masks = [f.start for f in fed], None
            self.lens = [p + 1 for p in self.positions] + [0] * (rows - len(fed))
            self.cu = list(range(len(fed) + 1)) + [len(fed)] * (rows - len(fed))
            return
        self.tokens, self.positions, self.slots, self.cu, self.lens = [], [], [], [0], []
        trees = any(f.masks is not None for f in fed)
        self.masks = [] if trees else None          # chain tokens' mask in a tree step: -1, the causal rule
        for f in fed:
            self.tokens += f.tokens
            self.positions += range(f.start, f.start + len(f.tokens)) if f.positions is None else f.positions
            if trees:
                self.masks += [-1] * len(f.tokens) if f.masks is None else f.masks
            self.slots += f.slots
            self.cu.append(self.cu[-1] + len(f.tokens))
            self.lens.append(f.start + len(f.tokens))
        self.cu += [self.cu[-1]] * (rows - len(fed))
        self.lens += [0] * (rows - len(fed))

    def pad_to(self, total: int, pad_id: int, block_size: int) -> None:
        """Padding tokens up to ``total``: outside every sequence, position 0, K/V to the scratch block."""
        pad = max(0, total - len(self.tokens))
        self.tokens += [pad_id] * pad
        self.positions += [0] * pad
        self.slots += [SCRATCH * block_size + j % block_size for j in range(pad)]
        if self.masks is not None:
            self.masks += [-1] * pad

    def inputs(self, rows: list, max_q: int, device) -> StepInputs:
        """The step's tensors in two host-to-device copies (one int64, one int32 buffer), not seven: each copy is a
        launch and a wait on the step's critical path."""
        s, w = self.tables.shape
        longs = [self.tokens, self.positions, self.slots, rows] + ([self.masks] if self.masks is not None else [])
        tokens, positions, slots, rows, *masks = pack_aligned(longs, np.int64, device)
        tables, cu, lens = pack_aligned([self.tables.ravel(), self.cu, self.lens], np.int32, device)
        return StepInputs(tokens, positions, slots, tables.view(s, w), cu, lens, rows, max_q, *masks)


def pack_aligned(parts: list, dtype, device) -> list:
    """1-d integer sequences -> views of one device buffer (one copy), each starting on a 16-byte boundary: Triton
    specialises a kernel on its pointers' alignment, so an unaligned view would compile a new variant mid-serving."""
    step, offsets, total = 16 // np.dtype(dtype).itemsize, [], 0
    for part in parts:
        offsets.append(total)
        total += -(-len(part) // step) * step
    host = np.zeros(total, dtype)
    for offset, part in zip(offsets, parts):
        host[offset:offset + len(part)] = part
    buffer = torch.from_numpy(host).to(device, non_blocking=True)
    return [buffer[offset:offset + len(part)] for offset, part in zip(offsets, parts)]


def _own_rows(end: int, n: int, width: int) -> list:
    """The logit rows of a request whose last ``n`` fed tokens (ending at row ``end``) are verified, padded to
    ``width`` by repeating the last."""
    own = [end - n + j for j in range(n)]
    return own + [own[-1]] * (width - n)


def decode_inputs(fed: list, shape: tuple, width: int, *, pad_id: int, block_size: int, device,
                  fixed: bool) -> StepInputs:
    """A decode step (see the module docstring). ``shape`` = (R, T, wide) from the planner; ``fixed``: pad to it and
    to a power-of-two table width (a graph replays it); otherwise R = len(fed), T = the tokens fed."""
    rows, total = (shape[0], shape[1]) if fixed else (len(fed), 0)
    m = max(len(f.table) for f in fed)
    flat = _Flat(fed, table_width(m) if fixed else m, rows)
    if width == 1 and len(flat.tokens) == len(fed):     # one token a request: its own row
        logit_rows = list(range(len(fed)))
    else:
        logit_rows = []
        for f, end in zip(fed, flat.cu[1:]):
            logit_rows += _own_rows(end, len(f.tokens), width)
    logit_rows += [0] * ((rows - len(fed)) * width)      # absent rows: logits of row 0
    flat.pad_to(total, pad_id, block_size)
    return flat.inputs(logit_rows, width, device)


def mixed_inputs(fed: list, width: int, *, device, pad_to: int = 0, pad_id: int = 0, block_size: int = 16
                 ) -> StepInputs:
    """A mixed step (see the module docstring): ``width`` logit rows per sampling request; ``pad_to``: padding
    tokens up to that many (a piecewise bucket: outside every sequence, K/V to the scratch block)."""
    flat = _Flat(fed, max(len(f.table) for f in fed))
    rows, sampling = [], 0
    for f, end in zip(fed, flat.cu[1:]):
        if f.samples:
            rows += _own_rows(end, 1 + f.drafts, width)
            sampling += 1
    if sampling:      # verify takes the rows bucket: the head computes the padding rows, no logits copy later
        rows += rows[:width] * (bucket(sampling) - sampling)
    for f, end in zip(fed, flat.cu[1:]):   # then the scored tokens' rows (prompt logprobs), after verify's
        rows += range(end - len(f.tokens) + f.score_from, end - len(f.tokens) + f.score_from + f.scored)
    flat.pad_to(pad_to, pad_id, block_size)
    return flat.inputs(rows, max(len(f.tokens) for f in fed), device)
