"""What the paged engine serves: a Llama-family target with the native decoder path, and no drafter or a context
drafter (ngram, suffix). Draft models and trained heads need a draft runner per row: the server keeps BatchEngine
for them."""
from __future__ import annotations

from typing import Optional

from ..drafters import Drafter, resolve_drafter
from ..native.llama import unsupported_reason


def paged_reason(target, draft) -> Optional[str]:
    """None when :class:`PagedEngine` can serve ``target`` with ``draft``; otherwise why not (the caller then uses
    BatchEngine): a draft model or trained head (they need a draft runner), or a target without the native
    Llama-family path."""
    reason = unsupported_reason(target)
    if reason is not None:
        return reason
    drafter = resolve_drafter(draft)
    if drafter is not None and (not drafter.has_context or drafter.model is not None or _has_runner(drafter)):
        return f"{getattr(drafter, 'name', drafter)!r} drafts with a model or a trained head"
    return None


def _has_runner(drafter) -> bool:
    """Whether the drafter has a device side of its own (a head, a tree drafter): the paged engine has none."""
    return type(drafter).runner is not Drafter.runner
