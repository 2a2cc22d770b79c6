"""K sampled chains from a draft MODEL (its own slot cache), for the multi-draft schemes (Khisti et al. 2024) on tree
steps.

The draft's cache keeps the committed tokens in the target's slot layout. Each step starts with one draft forward
over the previous step's committed chunk (:class:`Resync`): [old pending, accepted drafts, holes, new pending] at
slots [W_old, W_new] -- the chain engine's re-feed, generalised to a ragged accepted path (holes are masked) -- whose
last column gives the law of the first draft token. Then chain j's token t (t < L) is fed at draft slot
W + 1 + (t - 1) K + j, attending to the committed slots, the pending token's slot W and its own chain's earlier
slots; L - 1 forwards of K tokens. Those slots lie past the new W and are rewritten by the next resync, so only
committed tokens survive in the draft's cache.

Tokens are sampled from the processed draft law with Gumbel noise keyed by a per-chain seed (a stream no verify
scheme uses); the laws become the tree's ``draft_probs``.

:class:`ModelChainsDrafter` (the tree form of a ModelDrafter) hands out a :class:`ModelChainsRunner`: it ``observe``s
each step's accepted chunk and resyncs at the next ``propose``; a defrag or a dropped row (``select``) first writes
the pending chunk in the layout it was committed in, then the pending token is fed again at the new W.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from tilespec.multidraft.tree import TokenTree
from tilespec.verify.distributions import log_probs

from ..tree_step import sample_chains, window_gather
from .base import Drafter, ModelDrafter
from .contract import Proposal, StepView
from .head_tree import CHAIN_SEED_STRIDE, _own_slots, chains_tree
from .model import ModelDraftRunner
from .trees import capped, draft_resolved, tree_form


@dataclass
class Resync:
    """The chunk the draft must (re)write before drafting: tokens / positions / real [B, q] at slots [w0, w0 + q),
    over the committed context ``valid`` [B, C] (the mask's base); column q - 1 is every row's pending token."""

    tokens: torch.Tensor
    positions: torch.Tensor
    real: torch.Tensor
    valid: torch.Tensor
    w0: int

    @classmethod
    def first(cls, pending, seq_len, valid, write: int) -> "Resync":
        """After the prefill: the pending token alone at slot W."""
        return cls(pending[:, None], (seq_len - 1)[:, None], torch.ones_like(pending[:, None], dtype=torch.bool),
                   valid, write)

    @classmethod
    def after(cls, old_pending, old_seq_len, old_valid, old_write: int, path_tokens, num_emitted,
              new_pending) -> "Resync":
        """After a tree step: [old pending, accepted path (ragged), holes, new pending] at [W_old, W_new]."""
        b, d = path_tokens.shape
        n_acc = num_emitted - 1
        width = int(n_acc.max()) + 2
        cols = torch.arange(width, device=path_tokens.device)[None, :]
        tokens = torch.zeros(b, width, dtype=torch.int64, device=path_tokens.device)
        tokens[:, 0] = old_pending
        if width > 2:
            tokens[:, 1:width - 1] = path_tokens[:, :width - 2].clamp(min=0)
        tokens[:, -1] = new_pending
        real = (cols <= n_acc[:, None]) | (cols == width - 1)
        positions = (old_seq_len - 1)[:, None] + cols
        positions[:, -1] = old_seq_len - 1 + n_acc + 1
        return cls(tokens, positions, real, old_valid, old_write)

    def mask(self) -> torch.Tensor:
        """[B, 1, q, C]: the committed context plus the chunk's earlier real columns (holes never seen)."""
        q = self.tokens.shape[1]
        causal = torch.ones(q, q, dtype=torch.bool, device=self.tokens.device).tril()
        table = causal[None] & self.real[:, None, :]
        w0 = torch.tensor(self.w0, device=self.tokens.device)
        return (self.valid[:, None, :] | window_gather(table, w0, self.valid.shape[1])).unsqueeze(1)


_VOCABS: dict = {}


def _sample(law: torch.Tensor, seeds: torch.Tensor, position: torch.Tensor) -> torch.Tensor:
    """law [B, K, V] -> one token per (row, chain) [B, K], Gumbel noise keyed by (chain seed, position, token)."""
    key = (law.shape[-1], law.device)
    vocab = _VOCABS.get(key)
    if vocab is None:
        vocab = _VOCABS[key] = torch.arange(law.shape[-1], device=law.device)
    return sample_chains(torch.log(law), vocab, seeds, position)


def resync_law(draft, resync: Resync, resolved) -> Optional[torch.Tensor]:
    """Write the committed chunk into the draft's cache -> the processed law [B, V] of the first draft token (None
    when ``resolved`` is None). (Run before any defragmentation: the chunk's slots are those of the layout it was
    committed in.)"""
    logits = draft.forward(resync.tokens, resync.positions, resync.mask(), resync.w0, keep=1)[:, 0]
    if resolved is None:
        return None
    return torch.exp(log_probs(logits[:, None, :].float(), resolved)[:, 0])


def propose_model_chains(draft, law, pending, valid, seq_len, seeds, write: int, resolved, chains: int,
                         length: int) -> TokenTree:
    """K = ``chains`` chains of ``length`` tokens from the first token's law ``law`` [B, V] (:func:`resync_law`)
    -> an iid :class:`TokenTree` (nodes as :func:`~.head_tree.propose_chains`: node 1 + (t - 1) K + j = chain
    j's token t)."""
    b, dev, k = pending.shape[0], pending.device, chains
    probs = [law[:, None, :]]
    law = law[:, None, :].expand(b, k, law.shape[-1])
    chain_seeds = seeds[:, None] + CHAIN_SEED_STRIDE * torch.arange(1, k + 1, device=dev)[None, :]
    slots = max((length - 1) * k, 1)
    anc = torch.zeros(b, k, slots + 1, dtype=torch.bool, device=dev)
    anc[:, :, 0] = True                                                   # the pending token's slot W
    wpos = torch.tensor(write, device=dev)                                # one host-to-device copy per proposal
    toks = []
    for t in range(1, length + 1):
        tok = _sample(law, chain_seeds, seq_len - 1 + t)
        toks.append(tok)
        if t == length:
            probs.append(torch.full((b, k, law.shape[-1]), 1.0 / law.shape[-1], device=dev))   # leaves: unused
            break
        anc = anc | torch.nn.functional.pad(_own_slots(k, slots, t, dev), (1, 0))
        mask = (valid[:, None, :] | window_gather(anc, wpos, valid.shape[1])).unsqueeze(1)
        positions = (seq_len - 1 + t)[:, None].expand(b, k)
        logits = draft.forward(tok, positions, mask, write + 1 + (t - 1) * k)                 # [B, K, V]
        law = torch.exp(log_probs(logits.float(), resolved))
        probs.append(law)
    return chains_tree(pending, toks, probs)


class ModelChainsRunner(ModelDraftRunner):
    """The draft model's runner proposing ``shape.chains`` sampled chains (host-commit path: W as a host int)."""

    observes = True
    captures = False
    scores_context = False

    def __init__(self, model_runner, shape):
        super().__init__(model_runner)
        self.shape = shape
        self._last: Optional[tuple] = None    # the last step: (pending, seq_len, valid, W, out_tokens, num_emitted)

    def span(self, gamma: int) -> int:
        return self.shape.nodes

    def prefill(self, ids, positions, mask, features, short: bool):
        self._last = None
        return super().prefill(ids, positions, mask, features, short)

    def _resync(self, new_pending: Optional[torch.Tensor] = None) -> Optional[Resync]:
        if self._last is None:
            return None
        pending, seq_len, valid, write, out, num_emitted = self._last
        self._last = None
        if new_pending is None:
            new_pending = out.gather(1, (num_emitted - 1)[:, None])[:, 0]
        return Resync.after(pending, seq_len, valid, write, out[:, :-1], num_emitted, new_pending)

    def propose(self, view: StepView, gamma: int, resolved, greedy: bool, ex) -> Proposal:
        law_of = draft_resolved(self.shape, resolved, view.pending.shape[0], view.pending.device)
        resync = self._resync(view.pending) or Resync.first(view.pending, view.seq_len, view.valid, view.write)
        law = resync_law(self.model_runner, resync, law_of)
        k, length = self.shape.chains
        tree = propose_model_chains(self.model_runner, law, view.pending, view.valid, view.seq_len, view.seeds,
                                    view.write, law_of, k, length)
        tree.identical = self.shape.identical
        return capped(Proposal.of_tree(tree, scheme=self.shape.scheme, sampler=self.shape.sampler, depth=length,
                                       width=k), gamma, length)

    def observe(self, view: StepView, features, out_tokens, num_emitted, ex):
        self._last = (view.pending, view.seq_len, view.valid, int(view.write), out_tokens, num_emitted)
        return None

    def select(self, rows: torch.Tensor, slot_index: torch.Tensor) -> None:
        resync = self._resync()
        if resync is not None:     # the committed chunk, in the layout it was committed in (any law will do)
            resync_law(self.model_runner, resync, None)
        super().select(rows, slot_index)


class ModelChainsDrafter(Drafter):
    """A draft model (``base``, a ModelDrafter) proposing ``shape.chains`` sampled chains."""

    def __init__(self, base, shape):
        self.base, self.shape, self.model = base, shape, base.model
        self.name = "%s:chains-%d-%d-%s" % (base.name, *shape.chains, shape.scheme)

    def span(self, gamma: int) -> int:
        return self.shape.nodes

    def runner(self, batch: int, capacity: int, *, target, compile) -> ModelChainsRunner:
        from ..leases import shared_runner
        return ModelChainsRunner(shared_runner(self.model, "draft", capacity, batch, compile), self.shape)


@tree_form(ModelDrafter)
def model_chains(drafter: ModelDrafter, shape) -> ModelChainsDrafter:
    if shape.chains is None:
        raise ValueError("a draft model proposes K sampled chains: pass chains=(K, L)")
    return ModelChainsDrafter(drafter, shape)
