"""Drafters: a draft model, context drafting (``ngram``, ``suffix``), or context drafting with a model fallback.

``resolve_drafter(draft)`` turns the ``draft=`` argument of :class:`~tilespec.engine.SpeculativeDecoder` into a
:class:`Drafter` (or None for target-only decoding):
  None -> None;  a Hugging Face model -> ModelDrafter;  "ngram" / "suffix" -> that context drafter;
  a Drafter instance -> itself;  [model, "ngram"] (either order; also a ContextDrafter instance) -> the context
  drafter with the model as its fallback for requests without a match.
"""
from __future__ import annotations

from .base import ContextDrafter, ContextState, Drafter, ModelDrafter
from .ngram import NgramDrafter
from .suffix import SuffixDrafter

CONTEXT_DRAFTERS = {"ngram": NgramDrafter, "suffix": SuffixDrafter}

__all__ = ["Drafter", "ModelDrafter", "ContextDrafter", "ContextState", "NgramDrafter", "SuffixDrafter",
           "CONTEXT_DRAFTERS", "resolve_drafter"]


def _context(spec) -> ContextDrafter:
    if isinstance(spec, ContextDrafter):
        return spec
    if isinstance(spec, str) and spec in CONTEXT_DRAFTERS:
        return CONTEXT_DRAFTERS[spec]()
    raise ValueError(f"unknown drafter {spec!r}; use a draft model, None, {', '.join(map(repr, CONTEXT_DRAFTERS))}, "
                     f"a Drafter instance, or [model, 'ngram'] to combine")


def resolve_drafter(draft):
    """The :class:`Drafter` for a ``draft=`` argument (see the module docstring); None for target-only."""
    if draft is None or isinstance(draft, Drafter):
        return draft
    if hasattr(draft, "config"):
        return ModelDrafter(draft)
    if isinstance(draft, (list, tuple)):
        models = [d for d in draft if hasattr(d, "config")]
        others = [d for d in draft if not hasattr(d, "config")]
        if len(draft) != 2 or len(models) != 1 or len(others) != 1:
            raise ValueError("a combined draft is [model, 'ngram' | 'suffix' | ContextDrafter]: one model and one "
                             f"context drafter, got {draft!r}")
        context = _context(others[0])
        if context.model is not None and context.model is not models[0]:
            raise ValueError("this ContextDrafter already has a fallback model; pass it alone")
        context.model = models[0]
        return context
    if isinstance(draft, str):
        return _context(draft)
    raise TypeError(f"draft must be a Hugging Face model, None, 'ngram', 'suffix', a Drafter or [model, 'ngram'], "
                    f"got {type(draft).__name__}")
