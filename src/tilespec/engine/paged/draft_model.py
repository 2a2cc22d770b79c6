"""Draft models on the paged engine: a smaller Llama-family model (Qwen2.5-0.5B for 1.5B, ...) proposes each step's
drafts, verified exactly with the draft's own distribution q.

K/V: the draft runs as a second :class:`~.model.PagedModel` with as many blocks as the target's, of the same size,
addressed by the same block tables: a request's slot holds its target K/V in the target's cache and its draft K/V
in the draft's, so the one BlockManager (and its prefix cache) serves both. What the draft's cache holds of a
request is kept by its :class:`DraftState`: positions [0, base) for sure, then the drafts fed past them (``tail``),
valid while they equal the request's tokens there (rejected drafts' K/V are overwritten later, as the target's).
Blocks are sealed into the prefix cache only as far as both caches hold them (scheduler.Seq.sealable), so a request
that matches a cached prefix finds the draft's K/V there too and starts with base = the matched length.

One step (:meth:`PagedDrafts.run`, after scheduling and pricing, before the target's forward):
  * a decoding request offers ``cap`` placeholder drafts (:meth:`DraftState.propose`; MODEL+ngram: its context
    drafts where it has a match), which the scheduler and pricing (pricing.py) cut like context drafts;
  * one ragged draft forward feeds every prompt chunk of the step (the draft's prefill, in the target's step) and,
    per row that drafts, the tokens its draft cache lacks (the last step's accepted drafts and bonus token, or all
    it emitted while it did not draft) up to its pending token; then one forward of one token per row per further
    draft depth, over the rows that draft that deep (a decode graph per rows bucket where graphs are on);
  * draft token j (1-based) of a request is sampled at position len(tokens) - 1 + j from the draft's processed
    distribution q (the request's temperature, top-k, top-p, min-p) with Gumbel noise keyed by (seed, position),
    the decoder's draft stream (execution.sample_draft): it does not depend on the batch; greedy rows take the
    argmax. One host sync at the end brings the drafts to the host.
verify() gets q as draft_logits [rows, gamma, V] (one-hot rows for context drafts; none when every model-drafting
row is greedy: the drafts are then deterministic), so the accept / resample is exact; ``coupled`` with draft logits
is ``reference``, whose tokens at T > 0 depend on how many drafts a step verifies (pricing, the draft gate, token
budget and blocks decide that): seeded tokens are the same whatever the batch with ``pricing=False`` and room
enough, and follow the target's law always (tests/test_paged_draft_model.py).

Costs: the draft forwards run inside the step whose wall time pricing.StepCosts and the DraftGate measure, so a
shape is priced with its drafting (warm-up seeds cover the target's graphs only). Steps that draft are synchronous
(overlap.blocked: they propose); steps that do not leave the draft idle but for prompt chunks.
"""
from __future__ import annotations

from typing import Optional

import torch

from tilespec.verify import rng
from tilespec.verify.sampling import sample_keyed
from tilespec.verify.validation import resolve_sampling

from ..drafters import ContextState
from ..inputs import context_limit
from .layout import Fed, decode_inputs, mixed_inputs
from .model import PagedModel
from .overlap import resolve
from .piecewise import mixed_bucket, mixed_buckets
from .shapes import bucket
from .verify_rows import sampling_params

PLACEHOLDER = 0     # an offered model draft until the step's draft forwards replace it


def draft_law(seqs: list, sampling: list, gamma: int, vocab: int, pad: int, device) -> Optional[torch.Tensor]:
    """The drafts' law q [len(sampling), gamma, vocab] to fill depth by depth, when any drafting row samples (None at
    T = 0: verify needs no q); positions no row drafts at are one-hot at ``pad``, never read."""
    if not any(s.req.temperature > 0 for s in seqs):
        return None
    q = torch.full((len(sampling), gamma, vocab), float("-inf"), device=device)
    q[..., pad] = 0.0
    return q


def one_hot_context_drafts(q: Optional[torch.Tensor], sampling: list) -> Optional[torch.Tensor]:
    """q with the rows whose drafts came from the context drafter (MODEL+ngram, head+ngram) one-hot at them."""
    if q is not None:
        for r, it in enumerate(sampling):
            d = it.seq.drafts
            if d and not it.seq.context.model:
                q[r, :len(d)] = float("-inf")
                q[r, torch.arange(len(d)), torch.tensor(d)] = 0.0
    return q


def sample_drafts(logits: torch.Tensor, seqs: list, seeds: torch.Tensor, positions: torch.Tensor, ids=None):
    """One draft token per row from the request's processed draft distribution (keyed: batch-independent); ``ids``
    maps the columns of a reduced draft vocabulary to target ids."""
    reqs = [s.req for s in seqs]
    if all(r.temperature == 0 for r in reqs):
        best = logits.argmax(dim=-1)
        return best if ids is None else ids[best]
    resolved = resolve_sampling(sampling_params(reqs), len(reqs), logits.device, check_values=False)
    return sample_keyed(logits, resolved, seeds, positions, rng.PURPOSE_EXTRA, ids=ids)


def kv_bytes_per_token(target, drafter=None) -> int:
    """K/V bytes per token of the target, plus the draft model's when ``drafter`` has one, or a trained head's
    caches (head.py; same blocks)."""
    from .head import head_bytes_per_token      # head.py builds on this module
    model = getattr(drafter, "model", None)
    extra = PagedModel.kv_bytes_per_token(model) if model is not None else head_bytes_per_token(drafter)
    return PagedModel.kv_bytes_per_token(target) + extra


def paged_drafts(engine, drafter, compile: bool):
    """The engine's draft runner (gamma > 0): a draft model's :class:`PagedDrafts`, a trained head's
    :class:`~.head.PagedHead`, a context tree's :class:`~.tree.PagedTrees`, a head's trees'
    :class:`~.head_tree.PagedHeadTrees`, else None."""
    from .head import PagedHead, is_head
    from .head_tree import PagedHeadTrees, is_head_tree
    from .tree import PagedTrees, is_context_tree
    if drafter is None or engine.gamma == 0:
        return None
    if is_context_tree(drafter):
        return PagedTrees(engine, drafter)
    if is_head_tree(drafter):
        return PagedHeadTrees(engine, drafter)
    if is_head(drafter):
        return PagedHead(engine, drafter)
    return PagedDrafts(engine, drafter, compile) if drafter.model is not None else None


class DraftState(ContextState):
    """A request's drafter state when a draft model drafts: its context drafter's (``context``, MODEL+ngram),
    whether this step's drafts are the model's (``model``), and what the draft's cache holds (module docstring)."""

    def __init__(self, context: Optional[ContextState] = None):
        self.context, self.model = context, False
        self.base, self.tail, self.epoch = 0, [], -1

    def extend(self, row: int, tokens) -> None:
        if self.context is not None:
            self.context.extend(row, tokens)

    def propose(self, row: int, cap: int) -> list:
        drafts = self.context.propose(row, cap) if self.context is not None else []
        self.model = not drafts
        return drafts or [PLACEHOLDER] * cap

    def close(self) -> None:
        if self.context is not None:
            self.context.close()

    def admitted(self, start: int, epoch: int) -> None:
        """(Re)admitted (``epoch``: the request's preemptions): the draft holds what the prefix cache gave."""
        if self.epoch != epoch:
            self.base, self.tail, self.epoch = start, [], epoch

    def draft_len(self, tokens: list) -> int:
        """How many leading positions of ``tokens`` the draft's cache holds (the tail resolved as far as known)."""
        n, tail = 0, self.tail
        while n < len(tail) and self.base + n < len(tokens) and tokens[self.base + n] == tail[n]:
            n += 1
        self.base, self.tail = self.base + n, tail[n:] if self.base + n >= len(tokens) else []
        return self.base


class PagedDrafts:
    """The draft model of a :class:`~.engine.PagedEngine` (see the module docstring)."""

    def __init__(self, engine, drafter, compile: bool):
        self.drafter, self.gamma, self.pad = drafter, engine.gamma, engine.pad
        self.block_size, self.device = engine.blocks.block_size, engine.device
        self.model = PagedModel(drafter.model, engine.blocks.num_blocks, self.block_size, compile=compile)
        self.vocab = self.model.native.lm_head.shape[0]
        self.sizes = mixed_buckets(engine.scheduler.token_budget)
        engine.max_len = min(engine.max_len, context_limit(drafter.model) or engine.max_len)

    def start(self, prompts) -> DraftState:
        return DraftState(self.drafter.start(prompts) if self.drafter.has_context else None)

    def memory_bytes(self) -> int:
        return self.model.memory_bytes()

    @torch.inference_mode()
    def run(self, items: list, sampling: list, prev=None) -> Optional[torch.Tensor]:
        """The step's draft work (module docstring) for its scheduled ``items`` (``sampling``: those verified, in
        verify's row order; ``prev``: the step in flight, whose placeholders the fed tokens may hold). Fills the
        drafting rows' ``seq.drafts``; returns q [len(sampling), gamma, V] for verify(), or None (no model drafts,
        or greedy ones only)."""
        feeds, rows, row = [], [], -1
        for it in items:
            seq, state = it.seq, it.seq.context
            row += it.samples
            state.admitted(it.start, seq.preemptions)
            drafts = bool(it.samples and seq.drafts and state.model)
            if not drafts and it.start >= len(seq.req.prompt):
                continue            # no prompt token and no draft: caught up when the request next drafts
            start, end = min(state.draft_len(seq.tokens), it.start), it.start + it.n
            if start < end:
                feeds.append(self._fed(seq, start, end, drafts))
                state.base, state.tail = end, []
            if drafts:
                rows.append((it.seq, row))
        if not feeds:
            return None
        size = mixed_bucket(sum(len(f.tokens) for f in feeds), self.sizes) if self.model.piecewise else None
        inputs = mixed_inputs(feeds, 1, device=self.device, pad_to=size or 0, pad_id=self.pad,
                              block_size=self.block_size)
        if prev is not None:
            resolve(inputs.tokens, prev)
        logits = self.model.mixed(inputs)       # a row per drafting request: its pending token's
        return self._draft(rows, logits, sampling) if rows else None

    def _fed(self, seq, start: int, end: int, samples: bool) -> Fed:
        bs = self.block_size
        return Fed(seq.tokens[start:end], start, [seq.table[p // bs] * bs + p % bs for p in range(start, end)],
                   seq.table, samples)

    def _draft(self, rows: list, logits: torch.Tensor, sampling: list) -> Optional[torch.Tensor]:
        """Sample every drafting row's drafts, depth by depth (``logits`` [>= n, V]: the first forward's)."""
        order = sorted(range(len(rows)), key=lambda i: -len(rows[i][0].drafts))    # the deepest first: a prefix
        seqs, vrows = [rows[i][0] for i in order], [rows[i][1] for i in order]     # drafts at every depth
        logits = logits[torch.tensor(order, device=self.device)]
        ks, dev = [len(s.drafts) for s in seqs], self.device
        seeds = torch.tensor([s.req.seed for s in seqs], device=dev)
        first = torch.tensor([len(s.tokens) for s in seqs], device=dev)      # draft 1's position: pending + 1
        tokens = torch.zeros((len(seqs), ks[0]), dtype=torch.int64, device=dev)
        q = draft_law(seqs, sampling, self.gamma, self.vocab, self.pad, dev)
        at = torch.tensor(vrows, device=dev)
        for j in range(ks[0]):
            m = sum(k > j for k in ks)      # rows drafting at depth j + 1
            tokens[:m, j] = self._sample(logits[:m], seqs[:m], seeds[:m], first[:m] + j)
            if q is not None:
                q[at[:m], j] = logits[:m]
            if j + 1 < ks[0]:
                logits = self._one_token(seqs[:sum(k > j + 1 for k in ks)], j, tokens[:, j])
        for s, k, drafted in zip(seqs, ks, tokens.tolist()):
            s.drafts[:] = drafted[:k]
            s.context.tail = drafted[:k - 1]     # fed at pending + 1 ..; the pending token is in base
        return one_hot_context_drafts(q, sampling)

    def _sample(self, logits: torch.Tensor, seqs: list, seeds: torch.Tensor, positions: torch.Tensor):
        return sample_drafts(logits, seqs, seeds, positions)

    def _one_token(self, seqs: list, j: int, ids: torch.Tensor) -> torch.Tensor:
        """The draft forward of depth j + 2: each row's draft j + 1 (``ids``, on the device) at position
        len(tokens) + j -> logits [len(seqs), V]."""
        bs, m = self.block_size, len(seqs)
        feeds = [Fed([self.pad], p, [s.table[p // bs] * bs + p % bs], s.table)
                 for s, p in ((s, len(s.tokens) + j) for s in seqs)]
        inputs = decode_inputs(feeds, (bucket(m), bucket(m), False), 1, pad_id=self.pad, block_size=bs,
                               device=self.device, fixed=self.model.graphs)
        inputs.tokens[:m] = ids[:m]
        return self.model.decode(inputs)[:m]
