"""Token-tree drafting: the shape a drafter proposes trees of, and turning a drafter into a tree drafter.

``SpeculativeDecoder(target, draft, tree=... | chains=...)`` asks for the drafter's tree form (:func:`tree_drafter`); the
drafter's runner then proposes a tree :class:`~.contract.Proposal` (``tree`` set) and the one step body verifies it
(engine/step.py ``verify_phase``: tree mask and positions, ``select_tree``, compaction of the accepted path). Which
drafters propose trees:
  * a draft head (``draft="head"``, a head folder, a HeadDrafter; drafters/head_tree.py): ``tree=(branch, depth,
    nodes)`` an EAGLE-2-style dynamic tree (deterministic drafts, captured whole on native-graphs; ``tree="auto"``:
    the shape chosen from the head's per-depth acceptance at the sampling temperature, drafters/tree_choice.py), or
    ``chains=(K, L)`` K chains sampled from the head (the multi-draft schemes of Khisti et al. 2024, ``scheme``);
  * a context drafter without a model (``draft="ngram"``; drafters/context_tree.py): ``tree=(matches, length,
    nodes)``, several matches of the context merged into a trie;
  * a draft model (drafters/model_tree.py): ``chains=(K, L)`` K chains sampled from it.
The γ of a tree step is the trees' depth (a constant schedule); ``span`` (slots a step writes past W) is larger
than γ: the target writes every node, a head its frontier's draft entries.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

import torch

from tilespec.multidraft.token_tree import MAX_NODES
from tilespec.verify.types import SamplingParams


# drafter class -> factory(drafter, shape) -> its tree form; filled by the tree drafter modules (``tree_form``), which
# the package imports, so a drafter's own module never imports its tree form (the tree form builds on it)
_TREE_FORMS: dict = {}


def tree_form(cls):
    """Decorator: the decorated ``factory(drafter, shape)`` makes the tree form of ``cls`` drafters (subclasses
    included, unless they register their own)."""
    def register(factory):
        _TREE_FORMS[cls] = factory
        return factory
    return register


def no_trees(drafter):
    """The error of a drafter without a tree form."""
    return ValueError(f"tree decoding drafts with a head (draft='head', a head folder or a HeadDrafter), a draft "
                      f"model (chains=(K, L)) or from the context (draft='ngram': several n-gram matches as "
                      f"branches), not with {drafter.name!r}")


@dataclass(frozen=True)
class TreeShape:
    """``tree`` (branch or matches, depth, nodes) or ``chains`` (K, L); ``scheme``: the multi-draft scheme of sampled
    chains (specinfer, spectr, is, ...); ``draft_sampling``: the chains' draft law (None: the target's sampling);
    ``sampler``: the selection's categorical draw, 'cdf' or 'gumbel'; ``auto``: the tree's shape is chosen when its
    drafter is made (:func:`tree_drafter`, :meth:`resolve`), ``tree`` is None until then."""

    tree: Optional[tuple] = None
    chains: Optional[tuple] = None
    scheme: str = "specinfer"
    draft_sampling: Optional[SamplingParams] = None
    sampler: str = "cdf"
    auto: bool = False

    def resolve(self, tree: tuple) -> None:
        """Fix an ``auto`` shape's (branch, depth, nodes), once (the decoder reads the depth of this object)."""
        if not self.auto or self.tree is not None:
            raise ValueError("only an unresolved tree='auto' shape is resolved")
        object.__setattr__(self, "tree", tuple(int(x) for x in tree))

    @property
    def depth(self) -> int:
        return self.tree[1] if self.tree is not None else self.chains[1]

    @property
    def nodes(self) -> int:
        return self.tree[2] if self.tree is not None else 1 + self.chains[0] * self.chains[1]

    @property
    def identical(self) -> bool:
        """Sampled chains are judged under one law (SpecTr is defined for identical drafts; the other alive chains'
        laws equal the first's up to float rounding), else each under its own chain's law."""
        from tilespec.multidraft.schemes import parse_scheme
        return parse_scheme(self.scheme).kind == "spectr"

    def key(self) -> tuple:
        """Hashable identity (runner caches)."""
        return self.tree, self.chains, self.scheme, repr(self.draft_sampling), self.sampler


def tree_shape(tree: Optional[Sequence[int]], chains: Optional[Sequence[int]], scheme: str = "specinfer",
               draft_sampling: Optional[SamplingParams] = None, sampler: str = "cdf") -> TreeShape:
    """Validate and build a :class:`TreeShape` (ValueError on bad settings)."""
    from tilespec.multidraft.schemes import parse_scheme
    if (tree is None) == (chains is None):
        raise ValueError("give one of tree=(branch, depth, nodes) / tree='auto' and chains=(K, L)")
    if sampler not in ("cdf", "gumbel"):
        raise ValueError(f"sampler must be 'cdf' or 'gumbel', got {sampler!r}")
    if draft_sampling is not None and not isinstance(draft_sampling, SamplingParams):
        raise TypeError(f"draft_sampling must be a SamplingParams, got {type(draft_sampling).__name__}")
    if chains is not None:
        k, length = (int(x) for x in chains)
        if k < 1 or length < 1 or 1 + k * length > MAX_NODES:
            raise ValueError(f"chains=(K, L) needs K, L >= 1 and 1 + K L <= {MAX_NODES} nodes, got {tuple(chains)}")
        parse_scheme(scheme)                     # an unknown scheme fails here
        return TreeShape(chains=(k, length), scheme=scheme, draft_sampling=draft_sampling, sampler=sampler)
    if isinstance(tree, str):
        if tree != "auto":
            raise ValueError(f"tree must be (branch, depth, nodes) or 'auto', got {tree!r}")
        return TreeShape(scheme=scheme, draft_sampling=draft_sampling, sampler=sampler, auto=True)
    branch, depth, nodes = (int(x) for x in tree)
    if branch < 1 or depth < 1 or not 2 <= nodes <= MAX_NODES:
        raise ValueError(f"tree=(branch, depth, nodes) needs branch, depth >= 1 and 2 <= nodes <= {MAX_NODES}, "
                         f"got {tuple(tree)}")
    return TreeShape(tree=(branch, depth, nodes), scheme=scheme, draft_sampling=draft_sampling, sampler=sampler)


def tree_drafter(drafter, shape: TreeShape, sampling: SamplingParams, gamma_schedule: str):
    """The drafter proposing trees of ``shape`` (the factory its class registered with :func:`tree_form`); trees are exact only and use a constant γ
    (the depth)."""
    if drafter is None:
        raise ValueError("tree decoding needs a drafter: draft='head', a draft model (chains) or 'ngram'")
    if any(float(x) != 1.0 for x in torch.as_tensor(sampling.lenience).reshape(-1).tolist()):
        raise ValueError("tree decoding is exact only: lenience < 1 is not supported")
    if gamma_schedule != "constant":
        raise ValueError(f"tree decoding drafts trees of a fixed depth: gamma_schedule must be 'constant', got "
                         f"{gamma_schedule!r}")
    factory = next((_TREE_FORMS[c] for c in type(drafter).__mro__ if c in _TREE_FORMS), None)
    if factory is None:
        raise no_trees(drafter)
    if shape.auto and shape.tree is None:
        from .tree_choice import DEFAULT_TREE, head_tree_shape
        manifest = getattr(getattr(drafter, "head", None), "manifest", None)
        temperature = float(torch.as_tensor(sampling.temperature, dtype=torch.float64).mean())
        shape.resolve(head_tree_shape(manifest, temperature) if manifest is not None else DEFAULT_TREE)
    return factory(drafter, shape)


def tree_form_of(drafter, tree, chains, scheme: str, draft_sampling: Optional[SamplingParams],
                 sampling: SamplingParams, gamma_schedule: str = "constant"):
    """The drafter the keywords ``tree`` / ``chains`` / ``scheme`` / ``draft_sampling`` ask for (SpeculativeDecoder's,
    tilespec.generate's on either engine, ``tilespec serve``'s): the tree form of ``drafter`` (attach it to the target
    first: an ``auto`` shape reads a loaded head's manifest), or ``drafter`` itself when neither ``tree`` nor
    ``chains`` is given -> (that drafter, its TreeShape or None). One function, so every entry point turns the
    keywords into the same tree drafter."""
    if tree is None and chains is None:
        return drafter, None
    shape = tree_shape(tree, chains, scheme, draft_sampling)
    return tree_drafter(drafter, shape, sampling, gamma_schedule), shape


def draft_resolved(shape: TreeShape, resolved, batch: int, device):
    """The sampled chains' draft law for ``batch`` rows: ``shape.draft_sampling`` resolved, else the target's."""
    if shape.draft_sampling is None:
        return resolved
    from tilespec.verify.validation import resolve_sampling
    return resolve_sampling(shape.draft_sampling, batch, device)


def capped(proposal, gamma: int, depth: int):
    """``proposal`` (a tree of ``depth`` levels) capped at γ < depth levels (near a request's token limit the step
    may accept at most γ drafts): ``counts`` [B] = γ, the selection's depth cap; unchanged when γ >= depth."""
    if gamma >= depth:
        return proposal
    rows = proposal.tokens.shape[0]
    proposal.counts = torch.full((rows,), gamma, dtype=torch.int64, device=proposal.tokens.device)
    return proposal
