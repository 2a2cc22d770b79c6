"""Drafters: a draft model, context drafting (``ngram``, ``suffix``), context drafting with a model fallback, or a
trained draft head (``head``, ``head+ngram``; drafters/head.py).

Every drafter implements one contract (base.py: a host side proposing context drafts, a device side -- a
:class:`DraftRunner` -- proposing / scoring / observing inside the engine's one step body).
``resolve_drafter(draft)`` turns the ``draft=`` argument of :class:`~tilespec.engine.SpeculativeDecoder` into a
:class:`Drafter` (or None for target-only decoding):
  None -> None;  a Hugging Face model -> ModelDrafter;  "ngram" / "suffix" -> that context drafter;
  a Drafter instance -> itself;  [model, "ngram"] (either order; also a ContextDrafter instance) -> the context
  drafter with the model as its fallback for requests without a match;  "head" / "head+ngram" -> the target's
  trained head (found in ``$TILESPEC_HOME/heads/<target>/`` when the decoder attaches it), a head folder (one with
  a manifest.json, optionally "+ngram") -> that head.
Draft *names* (the CLI's ``--draft``): "ngram", "suffix", "MODEL+ngram", "MODEL+suffix", "head", "head+ngram",
a head folder, or a model name;
:func:`split_draft_name` parses them, :func:`draft_spec` builds the ``draft=`` argument once the model is loaded.
"""
from __future__ import annotations

from pathlib import Path

from .base import ContextDrafter, ContextState, Drafter, DraftRunner, ModelDrafter, Proposal, StepView
from .head import HeadDrafter
from .model import ModelDraftRunner
from .ngram import NgramDrafter
from .suffix import SuffixDrafter
from . import context_tree, head_tree, model_tree  # noqa: F401,E402  (register the tree forms)

CONTEXT_DRAFTERS = {"ngram": NgramDrafter, "suffix": SuffixDrafter}
HEAD_NAME = "head"
HEAD_DRAFTERS = {HEAD_NAME: HeadDrafter}    # "head" / "head+ngram": the target's trained head (drafters/head.py)


def head_spec(name) -> "HeadDrafter | None":
    """The HeadDrafter for a draft name "head", "head+ngram", "PATH" or "PATH+ngram" (PATH: a folder holding a
    head's manifest.json); None for any other name."""
    if not isinstance(name, (str, Path)):
        return None
    text = str(name).strip()
    base, plus, context = text.rpartition("+")
    if not (plus and context in CONTEXT_DRAFTERS):
        base, context = text, None
    if base == HEAD_NAME:
        return HeadDrafter(context=context)
    if base and (Path(base) / "manifest.json").is_file():
        from tilespec.heads.distilled import is_distilled_folder
        if not is_distilled_folder(base):      # a distilled Whisper draft is a model (heads/distilled.py)
            return HeadDrafter(base, context=context)
    return None

__all__ = ["Drafter", "DraftRunner", "Proposal", "StepView", "ModelDrafter", "ModelDraftRunner", "ContextDrafter",
           "ContextState", "NgramDrafter", "SuffixDrafter",
           "HeadDrafter", "CONTEXT_DRAFTERS", "HEAD_DRAFTERS", "head_spec", "drafter_names", "resolve_drafter",
           "split_draft_name", "draft_spec", "draft_model"]


def drafter_names() -> list:
    """Every drafter name ``draft=`` takes as a string: the keys of this package's ``*_DRAFTERS`` registries
    (for "did you mean" suggestions; a registry added here is picked up without touching its callers)."""
    return sorted({n for k, v in globals().items() if k.endswith("_DRAFTERS") and isinstance(v, dict) for n in v})


def split_draft_name(name: str | None) -> tuple:
    """``--draft`` value -> (model name or None, context drafter name or None): "ngram" -> (None, "ngram"),
    "qwen+suffix" -> ("qwen", "suffix"), "qwen" -> ("qwen", None), None / "" / "none" -> (None, None)."""
    if name is None or str(name).strip().lower() in ("", "none"):
        return None, None
    name = str(name).strip()
    if head_spec(name) is not None:     # a head: no model to load (the decoder finds the head for its target)
        return None, name
    if name in CONTEXT_DRAFTERS:
        return None, name
    model, plus, context = name.rpartition("+")
    if plus and context in CONTEXT_DRAFTERS:
        if not model:
            raise ValueError(f"draft {name!r} names no model before '+'; use {context!r} alone or MODEL+{context}")
        return model, context
    if plus and context and not model.endswith(":") and "/" not in context and ":" not in context:
        raise ValueError(f"unknown context drafter {context!r} in draft {name!r}; use MODEL+"
                         f"{' or MODEL+'.join(CONTEXT_DRAFTERS)}")
    return name, None


def draft_spec(model, context: str | None):
    """The ``draft=`` argument for a loaded draft model (or None) and a context drafter name (or None)."""
    if context is None:
        return model
    return context if model is None else [model, context]


def draft_model(draft):
    """The Hugging Face draft model inside a ``draft=`` argument (model, list or Drafter), or None."""
    if hasattr(draft, "config"):
        return draft
    if isinstance(draft, (list, tuple)):
        return next((d for d in draft if hasattr(d, "config")), None)
    return getattr(draft, "model", None)


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
    if isinstance(draft, (str, Path)):
        head = head_spec(draft)
        return head if head is not None else _context(draft)
    raise TypeError(f"draft must be a Hugging Face model, None, 'ngram', 'suffix', a Drafter or [model, 'ngram'], "
                    f"got {type(draft).__name__}")
