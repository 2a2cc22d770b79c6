"""The drafter contract: who proposes the tokens a step verifies.

A :class:`Drafter` (what ``draft=`` resolves to) may have two sides, both optional:
  * host side, ``has_context`` / ``start(prompts)``: a per-generation :class:`ContextState` proposing drafts copied
    from the request's own context (prompt + output so far), found on the host by matching; no forward pass, so
    the cost ratio c is ~0. Proposals are deterministic: ``verify()`` gets no draft logits (q is one-hot at the
    drafted token), which is exact at every temperature. Ragged: an empty proposal drafts 0 tokens for a request;
  * device side, ``runner(batch, capacity, target=..., compile=...)``: a per-generation :class:`DraftRunner` (or
    None) that the step body drives with the same four calls on the host-commit path (step.py) and inside the
    captured whole step (step_graph.py): ``propose`` -> a :class:`Proposal`; ``score`` (context drafts were
    verified instead: keep its cache complete); the target's verify forward returns the hidden states the runner
    names in ``features``; ``observe`` after verification -> its new per-row state (``BatchState.hidden``).
Drafters: :class:`ModelDrafter` (a draft model, drafters/model.py), :class:`ContextDrafter` (``ngram``,
``suffix``; with a ``fallback`` model: context drafts where a request has a match, the model otherwise),
:class:`~tilespec.engine.drafters.head.HeadDrafter` (a trained head fed by the target's own hidden states,
optionally with a context drafter: ``head+ngram``). ``attach(target)`` is called once by the decoder (a head checks
it belongs to this target). The decoder and both steps ask only through this contract, never by type.

Per generation a context drafter hands out a :class:`ContextState` (``start(prompts)``): the engine appends the
tokens each request emits (``extend``, host lists it already read in the step's one host sync) and asks for up to
``cap`` tokens per request (``propose``); an empty proposal drafts 0 tokens for that request (ragged batch).
"""
from __future__ import annotations

from typing import Optional, Sequence

from .contract import DraftRunner, Proposal, StepView  # noqa: F401  (the contract's names, public here too)
from .model import check_draft_model, model_draft_runner


class ContextState:
    """Per-generation matching state of a context drafter: one token history per request (original index)."""

    def extend(self, row: int, tokens: Sequence[int]) -> None:
        """Append ``tokens`` (emitted by request ``row``) to its history."""
        raise NotImplementedError

    def propose(self, row: int, cap: int) -> list:
        """Up to ``cap`` (>= 1) tokens to draft after request ``row``'s history; [] when nothing matches."""
        raise NotImplementedError

    def close(self) -> None:
        """The generation ended (a drafter that learns from earlier requests records their outputs here)."""


class Drafter:
    """Base of every drafter; ``name`` is what RunStats and the CLI report."""

    name: str = "drafter"
    model = None              # a Hugging Face draft model, or None

    @property
    def has_context(self) -> bool:
        return False

    def start(self, prompts: Sequence[Sequence[int]]) -> Optional[ContextState]:
        """The per-generation host-side matching state (``has_context``), else None."""
        return None

    def runner(self, batch: int, capacity: int, *, target, compile) -> Optional[DraftRunner]:
        """The per-generation :class:`DraftRunner` (``target``: the target's runner; ``compile``: the decoder's
        execution path), or None for a drafter without a device side. Default: the draft model's runner."""
        if self.model is None:
            return None
        return model_draft_runner(self.model, batch, capacity, target=target, compile=compile)

    def span(self, gamma: int) -> int:
        """Slots past W that one step drafting ``gamma`` tokens writes (a chain: γ; a tree drafter: more)."""
        return gamma


    def attach(self, target) -> None:
        """Called once by the decoder: check the draft model (if any) against ``target`` (same architecture kind,
        vocabulary and device)."""
        if self.model is not None:
            check_draft_model(target, self.model)


class ModelDrafter(Drafter):
    """Drafts with a model: γ autoregressive draft forwards per step (drafters/model.py); K sampled chains per step
    as its tree form (drafters/model_tree.py)."""

    def __init__(self, model, name: Optional[str] = None):
        if not hasattr(model, "config"):
            raise TypeError(f"a draft model must be a Hugging Face model, got {type(model).__name__}")
        self.model = model
        self.name = name or getattr(model.config, "_name_or_path", "") or type(model).__name__


class ContextDrafter(Drafter):
    """Base of the drafters that copy from the context; ``fallback``: a draft model for steps without a match.

    tokens_per_match: the per-request draft length grows with the length n of the matched suffix (``n *
    tokens_per_match`` at most, before the schedule's cap): a one-token match is weak evidence, a long one strong.
    """

    kind = "context"

    def __init__(self, *, fallback=None, tokens_per_match: int = 4):
        if not isinstance(tokens_per_match, int) or tokens_per_match < 1:
            raise ValueError(f"tokens_per_match must be an integer >= 1, got {tokens_per_match!r}")
        if fallback is not None and not hasattr(fallback, "config"):
            raise TypeError(f"fallback must be a Hugging Face draft model or None, got {type(fallback).__name__}")
        self.model = fallback
        self.tokens_per_match = tokens_per_match

    @property
    def has_context(self) -> bool:
        return True

    @property
    def name(self) -> str:
        if self.model is None:
            return self.kind
        model_name = getattr(self.model.config, "_name_or_path", "") or type(self.model).__name__
        return f"{model_name}+{self.kind}"

    def start(self, prompts: Sequence[Sequence[int]]) -> ContextState:
        raise NotImplementedError
