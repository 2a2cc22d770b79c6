"""What the paged engine serves: a Llama-family target with the native decoder path, and no drafter, a context
drafter (ngram, suffix), a Llama-family draft model of the target's vocabulary (draft_model.py; also with a
context drafter, MODEL+ngram), a trained head drafting chains (head.py; also head+ngram), or token trees: context
trees (the tree form of ngram / suffix: tree.py), a head's dynamic trees and sampled chains (head_tree.py). A draft
model's sampled chains (``chains=(K, L)``) have no paged runner yet: the server keeps BatchEngine for them,
``tilespec.generate`` the decoder (:func:`choose_engine`: the one rule both pick by)."""
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
