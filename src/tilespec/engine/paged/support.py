"""What the paged engine serves: a Llama-family target with the native decoder path, and no drafter, a context
drafter (ngram, suffix), a Llama-family draft model of the target's vocabulary (draft_model.py; also with a
context drafter, MODEL+ngram), a trained head drafting chains (head.py; also head+ngram), or token trees: context
trees (the tree form of ngram / suffix: tree.py), a head's dynamic trees and sampled chains (head_tree.py). A draft
model's sampled chains (``chains=(K, L)``) have no paged runner yet, nor do trees over the limits of
:func:`tree_limit`: ``tilespec.generate`` runs them on the decoder, the server a head's trees on BatchEngine
(:func:`choose_engine`: the one rule both pick by; serve.check_batch_tree refuses the rest)."""
from __future__ import annotations

from typing import Optional, Sequence

from ..drafters import Drafter, resolve_drafter
from ..drafters.model import check_draft_model
from ..native.llama import unsupported_reason
from .head import is_head
from .head_tree import is_head_tree
from .tree import is_context_tree


def paged_reason(target, draft) -> Optional[str]:
    """None when :class:`PagedEngine` can serve ``target`` with ``draft``; otherwise why not (the caller then uses
    BatchEngine): a draft model's sampled chains (no paged runner), a head on another device than the target, a
    draft model without the native Llama-family path or of another vocabulary or device, or a target without the
    native Llama-family path. A head named but not loaded yet ("head", a folder) is taken: the engine loads it and checks it belongs to
    the target (HeadNotFound / HeadMismatch)."""
    reason = unsupported_reason(target)
    if reason is not None:
        return reason
    drafter = resolve_drafter(draft)
    if drafter is None:
        return None
    name = repr(getattr(drafter, "name", drafter))
    if is_head(drafter):
        return _head_reason(target, drafter, name)
    if is_context_tree(drafter):
        return None
    if is_head_tree(drafter):
        return _head_reason(target, drafter.base, name)
    if _has_runner(drafter):
        return (f"{name} drafts a token tree the paged engine has no runner for (it runs chains, context trees and "
                f"a head's trees and sampled chains)")
    if drafter.model is None:
        return None if drafter.has_context else f"{name} proposes no draft the paged engine can run"
    reason = unsupported_reason(drafter.model)
    if reason is not None:
        return f"the draft model {name}: {reason}"
    try:
        check_draft_model(target, drafter.model)
    except ValueError as err:
        return f"the draft model {name}: {err}"
    return None


def paged_drafter(target, draft):
    """The Drafter :class:`PagedEngine` runs for ``draft`` (None: target-only), attached to ``target`` (a head named
    "head" or by folder loads here); ValueError naming why not (:func:`paged_reason`)."""
    reason = paged_reason(target, draft)
    if reason is not None:
        raise ValueError(f"the paged engine drafts from the request's context (ngram, suffix, their token trees), "
                         f"with a Llama-family draft model or a trained head (chains or dynamic trees), over a "
                         f"Llama-family target; {reason}: serve it with BatchEngine")
    drafter = resolve_drafter(draft)
    if drafter is not None:
        drafter.attach(target)
    return drafter


def tree_limit(draft, block_size: int = 16) -> Optional[str]:
    """Why the paged engine cannot run the token trees ``draft`` proposes with blocks of ``block_size`` slots, in
    words with the fix (None: it can, or ``draft`` proposes no tree it runs). A tree's N - 1 draft nodes are a
    step's new tokens after the root, fewer than block_size (padding rows share one block, as for chains) and
    within the 64 ancestor bits of the tree mask; a head's tree also feeds its (depth - 1) frontiers of ``branch``
    (chains: K) entries in one forward, within those bits (head_tree.py); the depth a step may accept is the
    engine's gamma, below 32."""
    from .tree import is_paged_tree
    drafter = resolve_drafter(draft)
    if drafter is None or not is_paged_tree(drafter):
        return None
    shape = drafter.shape
    what = f"tree={shape.tree}" if shape.tree is not None else f"chains={shape.chains}"
    if shape.depth >= 32:
        return f"{what} (depth {shape.depth}: the paged engine accepts fewer than 32 tokens a step; lower the depth)"
    if is_head_tree(drafter):
        width = shape.tree[0] if shape.tree is not None else shape.chains[0]
        if (shape.depth - 1) * width > 64:
            return (f"{what} (a head's (depth - 1) x {'branch' if shape.tree is not None else 'K'} = "
                    f"{(shape.depth - 1) * width} frontier entries exceed the 64 ancestor bits of the paged "
                    f"attention; lower the depth or the width)")
    if shape.nodes - 1 >= block_size:
        need = 1 << (shape.nodes - 1).bit_length()        # block sizes are powers of two
        return (f"{what} ({shape.nodes - 1} draft nodes: the paged engine verifies fewer than block_size="
                f"{block_size}; pass block_size={need} or a tree of at most {block_size} nodes)")
    return None


def choose_engine(target, draft, engine: str, fallback: str, fallback_only: Sequence[str] = (),
                  fix: str = "") -> str:
    """"paged" or ``fallback`` for ``engine`` = "auto" | "paged" | ``fallback`` (the server's "batch",
    ``tilespec.generate``'s "decoder"): auto takes the paged engine wherever it can serve ``target`` with ``draft``
    (:func:`paged_reason`) and none of ``fallback_only`` is given (the options, in words, that only the fallback
    honours); "paged" refuses with a ValueError naming why, then ``fix``. Where ``engine`` and ``fallback_only``
    decide alone (``engine`` is the fallback, or options are given) the models are not looked at: a caller may decide
    before they load (target / draft None)."""
    if engine not in ("auto", "paged", fallback):
        raise ValueError(f"engine must be 'auto', 'paged' or {fallback!r}, got {engine!r}")
    if engine == fallback:
        return fallback
    if fallback_only:
        if engine == "paged":
            raise ValueError(f"the paged engine cannot honour {', '.join(fallback_only)}; {fix}")
        return fallback
    reason = paged_reason(target, draft)
    if reason is None:
        return "paged"
    if engine == "paged":
        raise ValueError(f"the paged engine cannot serve this: {reason}; {fix}")
    return fallback


def _head_reason(target, drafter, name: str) -> Optional[str]:
    head = drafter.head
    if head is None:
        return None
    device, p = head.fc.weight.device, next(target.parameters())
    return None if device == p.device else f"the head {name} is on {device}, the target on {p.device}"


def _has_runner(drafter) -> bool:
    """Whether the drafter has a device side of its own (a tree drafter; a head's is head.py): the paged engine
    has none for it."""
    return type(drafter).runner is not Drafter.runner


def tree_drafter(target, draft, tree=None, chains=None, scheme: Optional[str] = None, draft_sampling=None,
                 sampling=None) -> tuple:
    """(the tree drafter, its depth) the paged engine runs for ``tree=(branch, depth, nodes)`` / ``chains=(K, L)``
    over ``draft``: the tree form the decoder builds for those keywords (drafters/trees.tree_form_of, on ``draft``
    attached to ``target``; ``sampling``: the target's, SamplingParams() by default); its depth is the gamma the
    engine caps a step's accepted tokens by. (``draft``, None) without tree keywords."""
    if tree is None and chains is None:
        return draft, None
    from tilespec.verify.types import SamplingParams
    from ..drafters.trees import tree_form_of
    drafter = resolve_drafter(draft)
    if drafter is not None:     # as the decoder does: a head loads here, so an auto shape reads its manifest
        drafter.attach(target)
    drafter, shape = tree_form_of(drafter, tree, chains, scheme or "specinfer", draft_sampling,
                                  sampling if sampling is not None else SamplingParams())
    return drafter, shape.depth
