"""Trained draft heads (EAGLE-style, tilespec.heads) on the paged engine: chains of drafts from the head's one
layer over the target's own hidden states, verified exactly with the head's distribution q.

Entries (heads/model.py): the head's entry at position e reads the fused target feature of position e (``fc`` of
the hidden states at the head's ``feature_layers``) and the token at e + 1; its output h_e gives the head's law of
the token at e + 2. The target's forward writes every fed token's fused feature at the token's slot of a feature
cache (model.py, ``capture_features``), and the head keeps its own K/V [slots, H_kv, D]; both are addressed by the
target's block tables, so the one BlockManager (and its prefix cache) serves all three caches. What the head's
cache holds of a request (:class:`HeadState`): entries [0, base). A request starts (and restarts after preemption)
with base 0, whatever the prefix cache gave: the entries are recomputed from the stored features, which a prefix
hit does hold (written with the target's K/V). A shared block's head entries are written again by every request
that recomputes them, so an entry there may be another request's: its numerics, or at a block's last position
another next token (the next block differs). That changes the drafts' quality, never exactness: every draft is
sampled from the q computed in this step, and verify() gets that q.

One step (:meth:`PagedHead.run`, after scheduling and pricing, before the target's forward), per row that drafts
(its committed tokens t_0 .. t_{L-1}, t_{L-1} pending: fed this step, so its feature is not known yet):
  * one ragged head forward over the entries [base, L - 2] (features known, tokens t_{e+1}) at RoPE position e and
    slot e, attending through the paged attention (attention.py); h_{L-2} gives draft 1; base becomes L - 1;
  * then one forward of one entry per row per further depth: draft entry L - 2 + j reads h of the entry before it
    as its feature and draft j as its token (slots >= L - 1: overwritten by the real entries later) and gives draft
    j + 1, over the rows that draft that deep;
  * draft j of a request is sampled at position L - 1 + j from the head's processed law on its draft vocabulary
    (the request's temperature, top-k, top-p, min-p; Gumbel noise keyed by (seed, position) and the target id, as
    the decoder's head drafter does: drafters/head.py), greedy rows take the argmax; q over the full vocabulary
    (-inf outside a reduced draft vocabulary: q = 0 there) goes to verify().
Pricing and the draft gate see the head's forwards inside the step's measured wall time (as a draft model's,
draft_model.py); drafting steps are synchronous (overlap.blocked). The head's forwards run eagerly (no graphs yet).
A request drafts once its feature at L - 2 exists (L >= 2); ``head+ngram`` / ``head+suffix``: context drafts where
the context matches (one-hot q), the head elsewhere.
"""
from __future__ import annotations

from typing import Optional

import torch


from ..drafters import ContextState, HeadDrafter
from .attention import paged_attention
from .blocks import kv_zeros
from .draft_model import PLACEHOLDER, draft_law, one_hot_context_drafts, sample_drafts
from .layout import Fed, mixed_inputs
from .model import StepInputs
from .overlap import resolve


def is_head(drafter) -> bool:
    """Whether ``drafter`` drafts chains with a trained head (``head``, ``head+ngram``, a head folder)."""
    return isinstance(drafter, HeadDrafter)


def head_bytes_per_token(drafter) -> int:
    """Bytes per token slot of a head's caches (its K/V and the fused feature; a head's trees too: head_tree.py);
    0 for any other drafter."""
    from .head_tree import is_head_tree
    head = drafter.head if is_head(drafter) else drafter.base.head if is_head_tree(drafter) else None
    if head is None:
        return 0
    c, size = head.cfg, head.fc.weight.element_size()
    return (2 * c.kv_heads * c.head_dim + c.hidden) * size


class HeadState(ContextState):
    """A request's drafter state when a head drafts: its context drafter's (``context``, head+ngram), whether this
    step's drafts are the head's (``model``), its committed token count, and the head entries held (``base``)."""

    def __init__(self, length: int, context: Optional[ContextState] = None):
        self.context, self.model, self.length = context, False, length
        self.base, self.epoch = 0, -1

    def extend(self, row: int, tokens) -> None:
        self.length += len(tokens)
        if self.context is not None:
            self.context.extend(row, tokens)

    def propose(self, row: int, cap: int) -> list:
        drafts = self.context.propose(row, cap) if self.context is not None else []
        self.model = not drafts
        if self.model and self.length < 2:      # no target feature yet (a one-token prompt's first step)
            return []
        return drafts or [PLACEHOLDER] * cap

    def close(self) -> None:
        if self.context is not None:
            self.context.close()

    def admitted(self, epoch: int) -> None:
        """(Re)admitted (``epoch``: the request's preemptions): no head entry is trusted, they are recomputed."""
        if self.epoch != epoch:
            self.base, self.epoch = 0, epoch


class PagedHead:
    """The trained head of a :class:`~.engine.PagedEngine` (see the module docstring)."""

    def __init__(self, engine, drafter: HeadDrafter):
        head = self.head = drafter.head
        self.drafter, self.gamma, self.pad = drafter, engine.gamma, engine.pad
        self.block_size, self.device = engine.blocks.block_size, engine.device
        c, dtype = head.cfg, head.fc.weight.dtype
        slots = engine.blocks.num_blocks * self.block_size
        self.k, self.v = kv_zeros((slots, c.kv_heads, c.head_dim), dtype, self.device, 2)
        self.features, = kv_zeros((slots, c.hidden), dtype, self.device, 1)
        self.vocab = c.vocab_size
        engine.model.capture_features(c.feature_layers, head.fuse, self.features)

    def start(self, prompts) -> HeadState:
        return HeadState(len(prompts[0]), self.drafter.start(prompts) if self.drafter.has_context else None)

    def memory_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.k, self.v, self.features))

    @torch.inference_mode()
    def run(self, items: list, sampling: list, prev=None) -> Optional[torch.Tensor]:
        """The step's head drafting (module docstring) for its scheduled ``items`` (``sampling``: those verified, in
        verify's row order; ``prev``: the step in flight, whose placeholders the fed tokens may hold). Fills the
        drafting rows' ``seq.drafts``; returns q [len(sampling), gamma, V] for verify(), or None (no head drafts, or
        greedy ones only)."""
        rows, row = [], -1
        for it in items:
            seq, state = it.seq, it.seq.context
            row += it.samples
            state.admitted(seq.preemptions)
            if it.samples and seq.drafts and state.model:
                rows.append((seq, row))
        if not rows:
            return None
        order = sorted(range(len(rows)), key=lambda i: -len(rows[i][0].drafts))    # the deepest first: a prefix
        seqs, vrows = [rows[i][0] for i in order], [rows[i][1] for i in order]     # drafts at every depth
        return self._draft(seqs, vrows, self._catch_up(seqs, prev), sampling)

    def _slot(self, seq, position: int) -> int:
        return seq.table[position // self.block_size] * self.block_size + position % self.block_size

    def _catch_up(self, seqs: list, prev) -> torch.Tensor:
        """The head's entries [base, L - 2] of every drafting request in one ragged forward -> the output of each
        one's last entry [len(seqs), d] (draft 1's law)."""
        feeds = []
        for seq in seqs:
            state, last = seq.context, len(seq.tokens) - 2
            base = min(state.base, last)        # one entry at least: the last one's output is draft 1's law
            feeds.append(Fed(seq.tokens[base + 1:last + 2], base, [self._slot(seq, e) for e in range(base, last + 1)],
                             seq.table))
            state.base = last + 1
        inputs = mixed_inputs(feeds, 1, device=self.device, pad_id=self.pad, block_size=self.block_size)
        if prev is not None:
            resolve(inputs.tokens, prev)
        h = self.entries(self.features.index_select(0, inputs.slots), inputs)
        return h.index_select(0, inputs.rows[:len(seqs)])

    def entries(self, feat: torch.Tensor, inputs: StepInputs) -> torch.Tensor:
        """Head entries of ragged rows (``inputs``: tokens are each entry's next token, positions / slots its own):
        feat [T, d] -> h [T, d]; their K/V written at ``inputs.slots`` first (heads/model.py's maths, attention
        through the block tables)."""
        head, bs = self.head, self.block_size
        cos, sin = head.rope(inputs.positions[None])
        xq, xk, xv = head.qkv_of(feat[None], inputs.tokens[None], cos, sin)     # [1, H(_kv), T, D]
        self.k.index_copy_(0, inputs.slots, xk[0].transpose(0, 1))
        self.v.index_copy_(0, inputs.slots, xv[0].transpose(0, 1))
        attn = paged_attention(xq[0].transpose(0, 1).contiguous(), self.k.unflatten(0, (-1, bs)),
                               self.v.unflatten(0, (-1, bs)), inputs.tables, inputs.cu_q, inputs.kv_lens,
                               max_q=inputs.max_q, tree_mask=inputs.tree_mask)     # a head's tree: head_tree.py
        return head.finish(feat[None], attn.transpose(0, 1)[None])[0]

    def _draft(self, seqs: list, vrows: list, h: torch.Tensor, sampling: list) -> Optional[torch.Tensor]:
        """Sample every drafting row's drafts, depth by depth, from ``h`` [len(seqs), d] (the catch-up's outputs)."""
        head, dev = self.head, self.device
        ks = [len(s.drafts) for s in seqs]
        seeds = torch.tensor([s.req.seed for s in seqs], device=dev)
        first = torch.tensor([len(s.tokens) for s in seqs], device=dev)      # draft 1's position: pending + 1
        tokens = torch.zeros((len(seqs), ks[0]), dtype=torch.int64, device=dev)
        q = draft_law(seqs, sampling, self.gamma, self.vocab, self.pad, dev)
        at = torch.tensor(vrows, device=dev)
        for j in range(ks[0]):
            m = sum(k > j for k in ks)      # rows drafting at depth j + 1
            small = head.logits(h[:m]).float()
            tokens[:m, j] = self._sample(small, seqs[:m], seeds[:m], first[:m] + j)
            if q is not None:
                q[at[:m], j] = head.full_logits(small)
            if j + 1 < ks[0]:
                h = self._one_entry(seqs[:sum(k > j + 1 for k in ks)], j, h, tokens[:, j])
        for s, k, drafted in zip(seqs, ks, tokens.tolist()):
            s.drafts[:] = drafted[:k]
        return one_hot_context_drafts(q, sampling)

    def _sample(self, small: torch.Tensor, seqs: list, seeds: torch.Tensor, positions: torch.Tensor):
        """One draft token per row (target ids) from the request's processed head law on the draft vocabulary."""
        return sample_drafts(small, seqs, seeds, positions, ids=self.head.vocab_ids)

    def _one_entry(self, seqs: list, j: int, h: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """The draft entries of depth j + 2: each row's entry at position L - 1 + j, its feature the head's output
        before it (``h``), its token draft j + 1 (``ids``, on the device) -> outputs [len(seqs), d]."""
        m = len(seqs)
        feeds = [Fed([self.pad], p, [self._slot(s, p)], s.table) for s, p in ((s, len(s.tokens) - 1 + j) for s in seqs)]
        inputs = mixed_inputs(feeds, 1, device=self.device, pad_id=self.pad, block_size=self.block_size)
        inputs.tokens[:m] = ids[:m]
        return self.entries(h[:m], inputs)
