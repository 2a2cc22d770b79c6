"""One decoding step: the step body both paths share, and the host-commit step. No host syncs in here.

The body is two phases of device work over a :class:`~tilespec.engine.drafters.base.StepView` of the batch
(B active requests, write pointer W), with the drafter's device side (a ``DraftRunner`` or None) reached only
through its contract (drafters/base.py):
  * :func:`draft_phase` -- the step's :class:`Proposal`: drafts proposed elsewhere (a context drafter, ragged; the
    draft runner ``score``s them if it keeps a cache of its own), or γ tokens ``propose``d by the draft runner, or
    none (a target-only step);
  * :func:`verify_phase` -- one target forward over [pending, d_1 .. d_K] at slots [W, W + K] (a token tree: over
    its nodes, then its accepted path compacted into a chain step, tree_step.py; returning the hidden
    states the runner names in ``features``), ``verify()`` (or the greedy argmax of a target-only step), and the
    runner's ``observe`` -> its new per-row state.
:func:`speculative_step` runs them on the host-commit path (the caller commits after its one host read); the
whole-step graphs (step_graph.py) capture the same two phases, as graph D and graph T with the commit on device.
Forwards, samplers and verification go through the execution (engine/execution.py), which is all that differs.
Random streams: see execution.py.
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Optional

import torch

from tilespec.verify import verify
from tilespec.verify.registry import get_method
from tilespec.verify.types import ResolvedSampling, SamplingParams

from .drafters.base import DraftRunner, Proposal, StepView
from .execution import HostExecution, sample_draft  # noqa: F401  (sample_draft: public here too)
from .graphs import GraphCache
from .metrics import PhaseTimer
from .runner import CUDA_GRAPH_MODES, ModelRunner
from .state import BatchState, chunk_mask


@dataclass
class StepOutput:
    """draft_tokens [B, K]; num_emitted [B]; output_tokens [B, K+1] (-1 padded); hidden: the draft runner's new
    per-row state (``observe``), applied at the commit, or None."""

    draft_tokens: torch.Tensor
    num_emitted: torch.Tensor
    output_tokens: torch.Tensor
    hidden: Optional[torch.Tensor] = None


def _graph_verify(target_logits, draft_tokens, seeds, offsets, *extra, key):
    method, sampling, options, has_logits = key
    draft_logits = extra[0] if has_logits else None
    counts = extra[1 if has_logits else 0] if len(extra) > int(has_logits) else None
    res = verify(target_logits, draft_tokens, draft_logits=draft_logits, num_draft_tokens=counts,
                 sampling=sampling, method=method, options=dict(options), seed=seeds, offsets=offsets,
                 check_values=False)
    return res.num_emitted, res.output_tokens


_VERIFY_GRAPHS = GraphCache(_graph_verify)


def run_verify(target_logits, draft_tokens, draft_logits, sampling: SamplingParams, method: str, seeds, offsets,
               graphs: bool, num_draft_tokens: Optional[torch.Tensor] = None,
               options: tuple = ()) -> tuple[torch.Tensor, torch.Tensor]:
    """verify() -> (num_emitted [B], output_tokens [B, K+1]); replayed as a CUDA graph when ``graphs`` and the
    method (its registry record's ``graph_safe``) and sampling allow it (scalar sampling parameters: they are baked
    into the graph's key, and so are the method's resolved ``options``, ((name, value), ...)).
    num_draft_tokens [B]: per-request draft lengths of a ragged (context-drafted) step, None = K for all."""
    try:
        hash(sampling)
        hashable = True
    except TypeError:
        hashable = False
    if graphs and hashable and target_logits.is_cuda and get_method(method).graph_safe:
        extra = (draft_logits,) if draft_logits is not None else ()
        extra += (num_draft_tokens,) if num_draft_tokens is not None else ()
        num_emitted, out = _VERIFY_GRAPHS(target_logits, draft_tokens, seeds, offsets, *extra,
                                          key=(method, sampling, tuple(options), draft_logits is not None))
        return num_emitted.clone(), out.clone()
    res = verify(target_logits, draft_tokens, draft_logits=draft_logits, num_draft_tokens=num_draft_tokens,
                 sampling=sampling, method=method, options=dict(options), seed=seeds, offsets=offsets,
                 check_values=False)
    return res.num_emitted, res.output_tokens


class _Untimed:
    """PhaseTimer's interface for a captured body (the enclosing step times the graph)."""

    @staticmethod
    def start(name: str) -> None:
        pass

    stop = start


UNTIMED = _Untimed()


def empty_proposal(view: StepView, counts: Optional[torch.Tensor] = None) -> Proposal:
    """No drafts: tokens [B, 0]."""
    return Proposal(torch.zeros((view.pending.shape[0], 0), dtype=torch.int64, device=view.pending.device),
                    counts=counts)


def drafts_on_device(draft: Optional[DraftRunner], gamma: int, context: Optional[Proposal]) -> bool:
    """Whether :func:`draft_phase` runs device work: the runner proposes (γ > 0, no context drafts) or scores the
    context drafts (``scores_context``)."""
    if draft is None:
        return False
    return draft.scores_context if context is not None else gamma > 0


def draft_phase(draft: Optional[DraftRunner], view: StepView, gamma: int, resolved: Optional[ResolvedSampling],
                greedy: bool, ex, context: Optional[Proposal] = None,
                counts: Optional[torch.Tensor] = None) -> Proposal:
    """The step's proposal: ``context`` (drafts proposed elsewhere; the runner scores them when it
    ``scores_context``), else γ tokens from ``draft`` capped per request by ``counts`` [B] (None: γ each), else
    none."""
    if context is not None:
        if draft is not None and draft.scores_context:
            draft.score(view, context, ex)
        return context
    if draft is None or gamma == 0:
        return empty_proposal(view, counts)
    proposal = draft.propose(view, gamma, resolved, greedy, ex)
    return proposal if counts is None else replace(proposal, counts=counts)


def target_block(target: ModelRunner, view: StepView, draft_tokens: torch.Tensor, ex, capture: tuple = ()):
    """Score [pending, d_1 .. d_K] at slots [W, W+K] in one target forward -> logits [B, K+1, V] (with ``capture``:
    (logits, features [B, K+1, n d]))."""
    k = draft_tokens.shape[1]
    tokens_in = torch.cat([view.pending[:, None], draft_tokens], dim=1)
    positions = (view.seq_len - 1)[:, None] + torch.arange(k + 1, device=tokens_in.device)[None, :]
    mask = chunk_mask(view.valid, view.write, view.write, k + 1)
    return ex.forward(target, tokens_in, positions, mask, view.write, capture=capture)


def verify_phase(target, draft: Optional[DraftRunner], view: StepView, proposal: Proposal,
                 sampling: SamplingParams, method: str, greedy: bool, ex, timer=UNTIMED) -> tuple:
    """Target forward -> verify -> the runner's ``observe`` (when it ``observes``): (num_emitted [B],
    output_tokens [B, K+1], the runner's new per-row state or None, the accepted drafts' tokens [B, K] the commit
    reads). A tree proposal (``proposal.tree``) is scored with the tree mask and positions, selected by
    ``select_tree`` and its accepted path's K/V compacted to slots W .. W + accepted (engine/tree_step.py): from
    there on it is a chain step over the path (the observer sees the path's features and tokens)."""
    observer = draft if draft is not None and draft.observes else None
    capture = observer.features if observer is not None else ()
    timer.start("target")
    feats = None
    if proposal.tree is not None:
        from .tree_step import tree_forward, tree_select     # the tree sampler loads only where trees are used
        scored = tree_forward(target, view, proposal.tree, ex, capture=capture)
    else:
        scored = target_block(target, view, proposal.tokens, ex, capture=capture)
    logits, feats = scored if capture else (scored, None)
    timer.stop("target")
    timer.start("verify")
    drafts = proposal.tokens
    if proposal.tree is not None:
        num_emitted, out, drafts, feats = tree_select(target, view, proposal, logits, feats, sampling, ex)
    elif greedy and proposal.k == 0:
        out = ex.argmax(logits[:, 0])[:, None]
        num_emitted = torch.ones_like(view.seq_len)
    else:
        num_emitted, out = ex.verify(logits, proposal.tokens, proposal.logits, proposal.counts, sampling, method,
                                     view.seeds, view.seq_len)
    timer.stop("verify")
    state = None
    if observer is not None:
        timer.start("draft")
        state = observer.observe(view, feats, out, num_emitted, ex)
        timer.stop("draft")
    return num_emitted, out, state, drafts


def speculative_step(target: ModelRunner, draft: Optional[DraftRunner], state: BatchState, gamma: int,
                     sampling: SamplingParams, resolved: ResolvedSampling, method: str,
                     timer: PhaseTimer, graph_verify: bool = True, verify_fn=None,
                     context: Optional[Proposal] = None, counts: Optional[torch.Tensor] = None,
                     method_options: tuple = ()) -> StepOutput:
    """One step on the host-commit path: :func:`draft_phase` then :func:`verify_phase`; the caller commits.

    draft: the drafter's runner in use this step, or None; gamma: tokens it proposes (0: none); context: drafts
    proposed on the host (ragged by ``context.counts``); counts: per-request caps of the runner's proposal.
    verify_fn: replaces :func:`run_verify` (same signature); verify() is replayed as a graph when ``graph_verify``
    and the target runs CUDA graphs. method_options: the method's resolved options, ((name, value), ...).
    """
    ex = HostExecution(verify_fn or run_verify, graph_verify and target.mode in CUDA_GRAPH_MODES, method_options,
                       own_sampler=verify_fn is None)
    greedy = resolved.all_greedy
    timed = drafts_on_device(draft, gamma, context)
    if timed:
        timer.start("draft")
    proposal = draft_phase(draft, state, gamma, resolved, greedy, ex, context, counts)
    if timed:
        timer.stop("draft")
    num_emitted, out, hidden, drafts = verify_phase(target, draft, state, proposal, sampling, method, greedy, ex,
                                                    timer)
    return StepOutput(draft_tokens=drafts, num_emitted=num_emitted, output_tokens=out, hidden=hidden)
