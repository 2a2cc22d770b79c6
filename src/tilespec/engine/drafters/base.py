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

from dataclasses import dataclass
from typing import Optional, Sequence

import torch


@dataclass
class Proposal:
    """What a step verifies: ``tokens`` [B, K] int64; ``logits`` [B, K, V] fp32, the draft distribution each token
    was sampled from (None: deterministic drafts, q one-hot); ``counts`` [B] int64, per-request draft lengths of a
    ragged proposal (None: K for every request; tokens past a request's count are padding, never accepted)."""

    tokens: torch.Tensor
    logits: Optional[torch.Tensor] = None
    counts: Optional[torch.Tensor] = None

    @property
    def k(self) -> int:
        return self.tokens.shape[1]


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
    row_buffers: tuple = ()   # attribute names of its own per-row buffers [B, ...] (narrowed likewise, slots.py)
    cache_version: int = 0
    compile_seconds: float = 0.0

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
        from .model import model_draft_runner
        return model_draft_runner(self.model, batch, capacity, target=target, compile=compile)

    def attach(self, target) -> None:
        """Called once by the decoder: check the draft model (if any) against ``target`` (same architecture kind,
        vocabulary and device)."""
        if self.model is not None:
            from .model import check_draft_model
            check_draft_model(target, self.model)


class ModelDrafter(Drafter):
    """Drafts with a model: γ autoregressive draft forwards per step (drafters/model.py)."""

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
