"""What the paged engine serves: a Llama-family target with the native decoder path, and no drafter, a context
drafter (ngram, suffix), or a Llama-family draft model of the target's vocabulary (draft_model.py; also with a
context drafter, MODEL+ngram). Trained heads and token trees need a draft runner of their own: the server keeps
BatchEngine for them, ``tilespec.generate`` the decoder (:func:`choose_engine`: the one rule both pick by)."""
from __future__ import annotations

from typing import Optional, Sequence

from ..drafters import Drafter, resolve_drafter
from ..drafters.model import check_draft_model
from ..native.llama import unsupported_reason


def paged_reason(target, draft) -> Optional[str]:
    """None when :class:`PagedEngine` can serve ``target`` with ``draft``; otherwise why not (the caller then uses
    BatchEngine): a trained head or a tree drafter (no paged runner), a draft model without the native Llama-family
    path or of another vocabulary or device, or a target without the native Llama-family path."""
    reason = unsupported_reason(target)
    if reason is not None:
        return reason
    drafter = resolve_drafter(draft)
    if drafter is None:
        return None
    name = repr(getattr(drafter, "name", drafter))
    if _has_runner(drafter):
        return f"{name} drafts with a trained head or a token tree (the paged engine drafts chains only)"
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


def _has_runner(drafter) -> bool:
    """Whether the drafter has a device side of its own (a head, a tree drafter): the paged engine has none."""
    return type(drafter).runner is not Drafter.runner
