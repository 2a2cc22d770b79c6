"""The device side of the drafter contract (drafters/base.py says who implements it): what a step verifies
(:class:`Proposal`), the batch tensors a step reads (:class:`StepView`) and a drafter's per-generation device state
(:class:`DraftRunner`), driven by the step body on the host-commit path and inside the captured whole step, and by
continuous batching (engine/batching.py: ``prefill_row`` / ``empty_state`` for rows that join mid-flight)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Optional

import torch

if TYPE_CHECKING:     # the tree sampler's package (and its scipy) loads only where trees are used
    from tilespec.multidraft.tree import TokenTree

_TREE_TENSORS = ("parents", "tokens", "sizes", "draft_probs")


@dataclass
class Proposal:
    """What a step verifies: ``tokens`` [B, K] int64; ``logits`` [B, K, V] fp32, the draft distribution each token
    was sampled from (None: deterministic drafts, q one-hot); ``counts`` [B] int64, per-request draft lengths of a
    ragged proposal (None: K for every request; tokens past a request's count are padding, never accepted).

    A token tree instead of a chain: ``tree`` (a :class:`~tilespec.multidraft.tree.TokenTree` [B, N], node 0 = the
    pending token; ``tokens`` is then tree.tokens[:, 1:]), selected exactly by ``select_tree`` with ``scheme`` (its
    i.i.d. kind) and ``sampler``; ``depth``: the trees' deepest level when static (selection without a host sync,
    so the step can be captured), else None; ``width``: an i.i.d. tree's widest level when static (K for K chains;
    with ``depth`` and a scheme of ``multidraft.schemes.STATIC_KINDS`` its selection needs no host sync either);
    ``counts`` [B] of a tree: per-request depth caps (deeper nodes count as padding), or None."""

    tokens: torch.Tensor
    logits: Optional[torch.Tensor] = None
    counts: Optional[torch.Tensor] = None
    tree: Optional["TokenTree"] = None
    scheme: str = "specinfer"
    sampler: str = "cdf"
    depth: Optional[int] = None
    width: Optional[int] = None

    @property
    def k(self) -> int:
        return self.tokens.shape[1]

    @classmethod
    def of_tree(cls, tree: "TokenTree", scheme: str = "specinfer", sampler: str = "cdf",
                depth: Optional[int] = None, width: Optional[int] = None) -> "Proposal":
        return cls(tree.tokens[:, 1:], tree=tree, scheme=scheme, sampler=sampler, depth=depth, width=width)

    def flatten(self) -> tuple:
        """(tensors, layout): the proposal's tensors (what a captured step takes or returns) and a hashable layout
        that :meth:`unflatten` rebuilds it from (part of the captured steps' keys: the tree's shape bucket)."""
        tensors = [self.tokens] + [t for t in (self.logits, self.counts) if t is not None]
        layout = (self.logits is not None, self.counts is not None)
        if self.tree is not None:
            tree = self.tree
            tensors += [getattr(tree, f) for f in _TREE_TENSORS if getattr(tree, f) is not None]
            layout += (tree.kind, tree.identical, tree.draft_probs is not None, self.scheme, self.sampler,
                       self.depth, self.width)
        return tuple(tensors), layout

    @classmethod
    def unflatten(cls, layout: tuple, tensors) -> "Proposal":
        tensors = list(tensors)
        tokens = tensors.pop(0)
        logits = tensors.pop(0) if layout[0] else None
        counts = tensors.pop(0) if layout[1] else None
        if len(layout) == 2:
            return cls(tokens, logits, counts)
        from tilespec.multidraft.tree import TokenTree
        kind, identical, has_probs, scheme, sampler, depth, width = layout[2:]
        parents, tree_tokens, sizes = tensors[:3]
        tree = TokenTree(parents, tree_tokens, sizes, kind, tensors[3] if has_probs else None, identical)
        return cls(tokens, logits, counts, tree, scheme, sampler, depth, width)


@dataclass
class StepView:
    """The device tensors of the batch a step reads (:class:`~tilespec.engine.state.BatchState` has the same
    fields and serves as one on the host path): valid [B, C] bool, seq_len / pending / prev / seeds [B] int64,
    write W (a host int, or a 0-d int64 tensor inside a captured step), hidden: the draft runner's per-row state
    (or None)."""

    valid: torch.Tensor
    seq_len: torch.Tensor
    pending: torch.Tensor
    prev: torch.Tensor
    seeds: torch.Tensor
    write: object
    hidden: Optional[torch.Tensor] = None


class DraftRunner:
    """The device side of a drafter for one generation, driven by the step body (engine/step.py) on both paths.

    Every call takes ``ex``, the execution (engine/execution.py): forwards, samplers and verify go through it, so the
    same code runs eagerly and inside a CUDA-graph capture. No host syncs, no data-dependent Python control flow.

    Declarations: ``features`` -- hidden-state indices the target's verify forward must hand to :meth:`observe`
    (and its prefill to :meth:`prefill`); ``observes`` -- :meth:`observe` must see every verify forward while the
    drafter is in use and returns the new per-row state; ``scores_context`` -- :meth:`score` runs forwards (its
    cache must see drafts it did not propose); ``mode``, ``cache_version``, ``compile_seconds``: as a model runner's.
    """

    mode: str = "eager"
    features: tuple = ()
    observes: bool = False
    scores_context: bool = False
    runners: tuple = ()       # model runners it owns (leased and narrowed with the target's runner)
    captures: bool = True     # propose / observe can run inside a captured whole step (no host syncs)
    row_buffers: tuple = ()   # attribute names of its own per-row buffers [B, ...] (narrowed likewise, slots.py)
    cache_version: int = 0
    compile_seconds: float = 0.0

    def span(self, gamma: int) -> int:
        """Slots past W that one step proposing with ``gamma`` writes in any cache (a chain: γ; a tree: more)."""
        return gamma

    def encode(self, input_features: torch.Tensor, target_encoded: torch.Tensor) -> None:
        """Encoder-decoder targets: run (or reuse: ``target_encoded``, the target's encoder output) an encoder."""

    def prefill(self, ids: torch.Tensor, positions: torch.Tensor, mask: torch.Tensor,
                features: Optional[torch.Tensor], short: bool) -> Optional[torch.Tensor]:
        """After the target's prefill of the left-padded prompts ids [B, P+1] at slots [0, P) (positions [B, P],
        mask [B, 1, P, C]; ``features`` [B, P, n d] when ``features`` were asked for; ``short``: a short forced
        prefix that may run as a captured graph): the initial per-row state, or None."""
        return None

    def prefill_row(self, row: int, ids: torch.Tensor, positions: torch.Tensor, mask: torch.Tensor, write: int,
                    features: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
        """Continuous batching (engine/batching.py): one chunk of one request's prompt into batch row ``row`` only
        (other rows untouched), after the target's forward of that chunk: ids [1, q+1] (the chunk's q tokens and the
        token after it), positions [1, q], mask [1, 1, q, C], ``write``: the chunk's first slot (host int),
        ``features`` [1, q, n d] of the target's forward when ``features`` were asked for -> the row's state after
        the chunk [1, ...] (the state of its last entry), or None."""
        return None

    def empty_state(self, batch: int) -> Optional[torch.Tensor]:
        """The per-row state of rows with no entry yet [batch, ...] (zeros; a one-token prompt has no prompt entry
        before its first step), or None for a runner without per-row state."""
        return None

    def propose(self, view: StepView, gamma: int, resolved, greedy: bool, ex) -> Proposal:
        """γ >= 1 tokens per request; token i (1-based) is sampled at position seq_len - 1 + i with the draft's
        Gumbel stream (execution.sample_draft), so verification stays exact."""
        raise NotImplementedError

    def score(self, view: StepView, proposal: Proposal, ex) -> None:
        """Drafts proposed elsewhere (a context drafter) are verified this step: see them at slots [W, W + K]."""

    def observe(self, view: StepView, features: Optional[torch.Tensor], out_tokens: torch.Tensor,
                num_emitted: torch.Tensor, ex) -> Optional[torch.Tensor]:
        """After verification (``view`` as before the commit): features [B, K+1, n d] of the verify forward (None
        without ``features``), out_tokens [B, K+1] (-1 padded), num_emitted [B] -> the new per-row state or None."""
        return None

    def select(self, rows: torch.Tensor, slot_index: torch.Tensor) -> None:
        """Keep batch rows ``rows`` and move slots by ``slot_index`` [B', C] (defrag, finished rows)."""

    def memory_bytes(self) -> int:
        return 0
