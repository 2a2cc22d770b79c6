"""Per-batch decoding state: slot validity, logical lengths, the pending token, and the masks built from them.

Invariants between steps (B = active requests, C = cache capacity, W = the shared write pointer, a host int):
  * ``valid`` [B, C] bool marks the slots holding request b's tokens at positions 0 .. seq_len[b] - 2 (in order);
    no slot >= W is valid, and the last valid slot of every request is W - 1 or earlier (holes are rejected drafts,
    left padding, or other requests' longer accepts).
  * ``pending`` [B] is the last token of each sequence (position seq_len - 1); it is in neither cache yet.
  * ``prev`` [B] is the token at position seq_len - 2. The draft re-feeds [prev, pending] at slots [W-1, W] on its
    first forward of a step, which (re)writes the last accepted draft token whenever the target accepted all of a
    block -- so the draft cache is complete without the extra forward gpt-fast needs, and shapes stay static.
Target and draft caches share this slot layout, so one ``valid`` mask serves both.
On the whole-step graph path (step_graph.py) the device also keeps ``alive`` [B] (rows still generating), ``limit``
[B] (the seq_len at which a row has max_new_tokens new tokens) and ``eos`` [E] (EOS ids), so that it applies the host's
end-of-request rule itself (:func:`still_alive`) one read before the host does.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

import torch


def chunk_mask(valid: torch.Tensor, write: int, start: int, q: int) -> torch.Tensor:
    """Bool mask [B, 1, q, C] (True = may attend) for q queries at slots [start, start + q) (start in {W-1, W}).

    Query i may see valid slots (any slot < W flagged in ``valid``) and the new slots W .. start + i.
    """
    cap = valid.shape[1]
    slots = torch.arange(cap, device=valid.device)
    ends = start + torch.arange(q, device=valid.device)
    fresh = (slots[None, :] >= write) & (slots[None, :] <= ends[:, None])            # [q, C]
    return (valid[:, None, :] | fresh[None]).unsqueeze(1)


def prefill_mask(pad_valid: torch.Tensor, capacity: int) -> torch.Tensor:
    """Bool causal + padding mask [B, 1, P, C] for a left-padded prefill at slots [0, P) of a C-slot cache."""
    p = pad_valid.shape[1]
    causal = torch.ones(p, capacity, dtype=torch.bool, device=pad_valid.device).tril()
    cols = torch.zeros(pad_valid.shape[0], capacity, dtype=torch.bool, device=pad_valid.device)
    cols[:, :p] = pad_valid
    return (causal[None] & cols[:, None, :]).unsqueeze(1)


def left_pad(prompts: Sequence[Sequence[int]], pad_id: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """Token lists -> (ids [B, P+1], is_token [B, P+1]) left-padded with at least one pad column.

    The extra column guarantees slot W - 1 >= 0 for the draft's re-feed even with one-token prompts.
    """
    if len(prompts) == 0:
        raise ValueError("no prompts given")
    for i, p in enumerate(prompts):
        if len(p) == 0:
            raise ValueError(f"prompt {i} is empty; every request needs at least one token")
    width = max(len(p) for p in prompts) + 1
    ids = torch.full((len(prompts), width), pad_id, dtype=torch.int64)
    is_tok = torch.zeros((len(prompts), width), dtype=torch.bool)
    for i, p in enumerate(prompts):
        ids[i, width - len(p):] = torch.as_tensor(list(p), dtype=torch.int64)
        is_tok[i, width - len(p):] = True
    return ids.to(device), is_tok.to(device)


def committed(valid: torch.Tensor, seq_len: torch.Tensor, pending: torch.Tensor, num_emitted: torch.Tensor,
              output_tokens: torch.Tensor, draft_tokens: torch.Tensor, write) -> tuple:
    """The device half of a commit -> (valid, seq_len, pending, prev) after one step that wrote slots [W, W+K].

    The slots of the pending token and the accepted drafts (W .. W + accepted) become valid; the last emitted token
    becomes pending and the one before it prev. ``write`` = W, a host int or a 0-d device tensor (inside a captured
    step). num_emitted [B], output_tokens [B, K+1] (-1 padded), draft_tokens [B, K]. With K = 0, prev *is* the old
    ``pending`` tensor (callers that need a distinct buffer clone it).
    """
    n_acc = num_emitted - 1
    slots = torch.arange(valid.shape[1], device=valid.device)[None, :]
    valid = valid | ((slots >= write) & (slots <= write + n_acc[:, None]))
    last = output_tokens.gather(1, n_acc[:, None]).squeeze(1)
    if draft_tokens.shape[1] > 0:
        prev_draft = draft_tokens.gather(1, (n_acc - 1).clamp(min=0)[:, None]).squeeze(1)
        prev = torch.where(n_acc > 0, prev_draft, pending)
    else:
        prev = pending
    return valid, seq_len + num_emitted, last, prev


def still_alive(alive: torch.Tensor, seq_len: torch.Tensor, limit: torch.Tensor, eos: torch.Tensor,
                num_emitted: torch.Tensor, output_tokens: torch.Tensor) -> torch.Tensor:
    """The host's end-of-request rule (``Generation.take``) on the device -> alive [B] bool after one step.

    alive, seq_len (before the step), limit [B]; eos [E] int64 (E may be 0); num_emitted [B]; output_tokens
    [B, K+1] (-1 padded: only the first num_emitted entries count). A row ends when it reaches max_new_tokens
    (seq_len + n >= limit) or emits an EOS id; an EOS past the length limit ends it by length, so ending is the same
    either way. Rows already ended stay ended.
    """
    emitted = torch.arange(output_tokens.shape[1], device=output_tokens.device)[None, :] < num_emitted[:, None]
    hit = ((output_tokens[:, :, None] == eos[None, None, :]).any(dim=-1) & emitted).any(dim=1)
    return alive & ~hit & (seq_len + num_emitted < limit)


@dataclass
class BatchState:
    """Device tensors of the active requests plus host bookkeeping; see the module docstring for invariants."""

    valid: torch.Tensor      # [B, C] bool
    seq_len: torch.Tensor    # [B] int64 logical length including the pending token
    pending: torch.Tensor    # [B] int64
    prev: torch.Tensor       # [B] int64
    seeds: torch.Tensor      # [B] int64 per-request seeds of the counter-based random streams
    write: int               # W
    rows: list               # original request index of each active row
    alive: Optional[torch.Tensor] = None   # [B] bool: rows still generating, as the device sees them (step_graph)
    limit: Optional[torch.Tensor] = None   # [B] int64: seq_len at which a row has produced max_new_tokens
    eos: Optional[torch.Tensor] = None     # [E] int64: the EOS ids (not per row)
    hidden: Optional[torch.Tensor] = None  # [B, d]: a draft head's output at the last committed entry (head.py)

    @classmethod
    def prefilled(cls, ids: torch.Tensor, is_tok: torch.Tensor, capacity: int, seeds: Sequence[int],
                  max_new_tokens: int, eos) -> "BatchState":
        """The state after a prefill of the left-padded prompts ``ids`` [B, P+1] (``is_tok``: real tokens) at
        slots [0, P): the last column is pending, W = P."""
        batch, p = ids.shape[0], ids.shape[1] - 1
        valid = torch.zeros((batch, capacity), dtype=torch.bool, device=ids.device)
        valid[:, :p] = is_tok[:, :p]
        seq_len = is_tok.sum(dim=1)
        return cls(valid=valid, seq_len=seq_len, pending=ids[:, p].clone(), prev=ids[:, p - 1].clone(), write=p,
                   rows=list(range(batch)), seeds=torch.as_tensor(seeds, dtype=torch.int64, device=ids.device),
                   alive=torch.ones(batch, dtype=torch.bool, device=ids.device), limit=seq_len + max_new_tokens,
                   eos=torch.tensor(sorted(eos), dtype=torch.int64, device=ids.device))

    @property
    def size(self) -> int:
        return len(self.rows)

    def commit(self, num_emitted: torch.Tensor, output_tokens: torch.Tensor, draft_tokens: torch.Tensor,
               max_accepted: int) -> None:
        """Apply one step's verify result: mark accepted slots valid, advance lengths, pending and prev.

        num_emitted [B], output_tokens [B, K+1] (-1 padded), draft_tokens [B, K]; the step wrote slots [W, W+K].
        ``max_accepted`` = max(num_emitted) - 1 (already on the host) advances W.
        """
        self.valid, self.seq_len, self.pending, self.prev = committed(
            self.valid, self.seq_len, self.pending, num_emitted, output_tokens, draft_tokens, self.write)
        self.write += max_accepted + 1

    def plan_defrag(self) -> tuple[torch.Tensor, int]:
        """Slot permutation [B, C] that packs each request's valid slots to end at slot M-1 (M = max count).

        Returns (slot_index, M); applying it and setting ``valid`` accordingly removes all holes and padding.
        """
        b, cap = self.valid.shape
        counts = self.valid.sum(dim=1)
        m = int(counts.max())
        key = self.valid.long() * cap + torch.arange(cap, device=self.valid.device)[None, :]
        order = torch.sort(key, dim=1, stable=True).indices            # invalid slots first, then valid in order
        slot_index = torch.cat([order[:, cap - m:], order[:, :cap - m]], dim=1)
        new_valid = torch.zeros_like(self.valid)
        new_valid[:, :m] = torch.arange(m, device=self.valid.device)[None, :] >= (m - counts)[:, None]
        self.valid = new_valid
        self.write = m
        return slot_index, m

    def keep_rows(self, keep: list) -> torch.Tensor:
        """Drop finished rows (``keep``: positions of the rows to keep) and return them as an index tensor."""
        idx = torch.as_tensor(keep, dtype=torch.int64, device=self.valid.device)
        self.valid = self.valid.index_select(0, idx)
        self.seq_len = self.seq_len.index_select(0, idx)
        self.pending = self.pending.index_select(0, idx)
        self.prev = self.prev.index_select(0, idx)
        self.seeds = self.seeds.index_select(0, idx)
        if self.alive is not None:
            self.alive = self.alive.index_select(0, idx)
            self.limit = self.limit.index_select(0, idx)
        if self.hidden is not None:
            self.hidden = self.hidden.index_select(0, idx)
        self.rows = [self.rows[i] for i in keep]
        return idx
