"""One decode step of continuous batching (engine/batching.py) over the first ``rows`` rows of the fixed batch.

This is the one place where continuous batching calls the engine's step functions: the whole-step graphs of
step_graph.py on native runners (scalar sampling), else the host-commit step of step.py; both run the same step
body with per-row draft lengths. The batch state and the runners' K/V
buffers are narrowed to their first ``rows`` rows (views, no copy; slots.first_rows), so a step costs what its
live rows need, rounded up to a power of two (each row count captures its own graphs); the state is written back
into the full-size tensors afterwards. Rows in range that are not live (free or prefilling) end the step with no
valid slot and a frozen length, as step_graph.py leaves ended rows.

Draft sources per request (:func:`choose_drafts`): a request's drafts come from its own history only, so its tokens
do not depend on the batch. With a context drafter and a draft runner (``head+ngram``, ``MODEL+ngram``) a request
with a context match verifies its context drafts and the others the runner's (:func:`mixed_proposal`): at T > 0
every context draft is verified with a one-hot draft distribution (q = 1 at the drafted token: exact, and the same
verification whatever the other rows draft).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn.functional as F

from tilespec.verify.logit_transforms import TransformBatch, transform_logits

from .drafters.contract import DraftRunner, Proposal
from .execution import HostExecution
from .metrics import PhaseTimer
from .slots import first_rows
from .state import BatchState
from .step import run_verify, speculative_step

_FIELDS = ("valid", "seq_len", "pending", "prev", "seeds", "alive", "limit")


def row_count(live: list, max_batch: int) -> int:
    """The step's row count: the smallest power of two (capped at ``max_batch``) above every live row index."""
    n = 1
    while n < max(live) + 1:
        n *= 2
    return min(n, max_batch)


@dataclass
class StepDrafts:
    """What one step drafts: ``gamma`` tokens from the draft runner (0: none), ``context`` [rows, Kc] context drafts
    (or None), ``counts`` per-row draft lengths (list), ``use_context`` [rows] bool: the rows verifying their context
    drafts while the others verify the runner's (None: one source for the whole step); ``vocab``: V of the target's
    logits (the one-hot draft logits of a mixed step)."""

    gamma: int = 0
    context: Optional[torch.Tensor] = None
    counts: Optional[list] = None
    use_context: Optional[torch.Tensor] = None
    vocab: int = 0

    @property
    def drafted(self) -> bool:
        return self.context is not None or self.gamma > 0


def choose_drafts(caps: list, contexts: Optional[list], runner: bool, pad: int, vocab: int, device,
                  width: int = 0) -> StepDrafts:
    """Per row b: ``caps[b]`` draft tokens at most; ``contexts[b]``: its context drafts ([] = no match; None: no
    context drafter); ``runner``: a draft runner proposes for rows without context drafts. ``width`` (the engine's
    γ) fixes the step's shape: context drafts are padded to at least ``width`` columns and a runner that drafts at
    all drafts ``width`` tokens, so a row count has one draft and one verify graph whatever the matches' lengths or
    the requests' remaining budgets (no step waits for a new capture); the counts keep each row's real length."""
    if contexts is None or not any(contexts):
        if not runner:
            return StepDrafts(counts=[0] * len(caps))
        return StepDrafts(gamma=max(max(caps), width) if max(caps) > 0 else 0, counts=list(caps))
    k = max(width, *map(len, contexts))
    context = torch.tensor([d + [pad] * (k - len(d)) for d in contexts], dtype=torch.int64, device=device)
    if not runner:
        return StepDrafts(context=context, counts=[len(d) for d in contexts])
    counts = [len(d) if d else c for d, c in zip(contexts, caps)]
    gamma = max((c for d, c in zip(contexts, caps) if not d), default=0)
    gamma = max(gamma, width) if gamma > 0 else 0
    use = torch.tensor([bool(d) for d in contexts], device=device)
    return StepDrafts(gamma=gamma, context=context, counts=counts, use_context=use, vocab=vocab)


def mixed_proposal(draft: DraftRunner, view: BatchState, drafts: StepDrafts, counts: torch.Tensor, resolved,
                   greedy: bool, pad: int) -> Proposal:
    """One proposal from two sources: ``drafts.context`` for the rows in ``drafts.use_context``, the runner's
    ``drafts.gamma`` tokens (proposed here, on the host path) for the others -> tokens [B, K], K = max(γ, Kc);
    logits [B, K, V] fp32 when sampling: the runner's for its tokens, one-hot (0 at the token, -inf elsewhere) for
    context drafts and padding; None when greedy. The step then treats it as drafts proposed elsewhere (the runner
    ``score``s them when it keeps a cache of its own)."""
    ctx, use, gamma = drafts.context, drafts.use_context, drafts.gamma
    k = max(gamma, ctx.shape[1])
    tokens = F.pad(ctx, (0, k - ctx.shape[1]), value=pad)
    own = None
    if gamma > 0:
        own = draft.propose(view, gamma, resolved, greedy, HostExecution(run_verify, False))
        tokens = torch.where(use[:, None], tokens, F.pad(own.tokens, (0, k - gamma), value=pad))
    logits = None
    if not greedy:
        logits = torch.full((*tokens.shape, drafts.vocab), float("-inf"), device=tokens.device)
        logits.scatter_(-1, tokens[..., None], 0.0)
        if own is not None and own.logits is not None:
            logits[:, :gamma] = torch.where(use[:, None, None], logits[:, :gamma], own.logits.float())
    return Proposal(tokens, logits, counts)


class TransformedTarget:
    """The target runner of one host-commit step with its verify forward's logits transformed
    (verify/logit_transforms.py): the forward's tokens are [pending, d_1 .. d_K], so position i's penalties count
    the block's first i drafts. Everything else is the runner's."""

    def __init__(self, runner, transforms: TransformBatch):
        self.runner, self.transforms = runner, transforms

    def __getattr__(self, name):
        return getattr(self.runner, name)

    def forward(self, tokens, positions, mask, write, **kw):
        if kw.get("keep") is not None:
            raise ValueError("logit transforms need the logits of every verified position (keep=None)")
        out = self.runner.forward(tokens, positions, mask, write, **kw)
        logits, feats = out if kw.get("capture") else (out, None)
        logits = transform_logits(logits, tokens[:, 1:], self.transforms)
        return (logits, feats) if kw.get("capture") else logits


@torch.inference_mode()
def step_rows(target, draft, fast, state: BatchState, rows: int, drafts: StepDrafts, sampling, resolved, method: str,
              method_options: tuple, pad: int, graphs: bool, live: list,
              transforms: Optional[TransformBatch] = None) -> torch.Tensor:
    """Run one step over rows [0, rows) of ``state`` and return the host copy [rows, 1 + K + 1] of (num_emitted,
    output tokens); ``state`` is updated (write pointer included, and ``state.hidden``, the runner's per-row
    state). ``draft``: the drafter's DraftRunner (the model runners it owns and its own ``row_buffers`` are narrowed
    too; it observes every step that ``observes``, drafted or not) or None; ``drafts``: what the step verifies
    (:func:`choose_drafts`); ``graphs``: run on ``fast`` (StepGraphs); ``live``: the live row indices (they set how
    far W moves); ``transforms``: the rows' logit transforms, applied to the target's logits before verification
    (host-commit path only: ``graphs`` must be False)."""
    if transforms is not None and graphs:
        raise ValueError("logit transforms run on the host-commit step, not the whole-step graphs")
    sub = BatchState(write=state.write, rows=list(range(rows)), eos=state.eos,
                     **{f: getattr(state, f)[:rows] for f in _FIELDS})
    if state.hidden is not None:
        sub.hidden = state.hidden[:rows]
    timer = PhaseTimer(state.valid.device)
    counts = torch.tensor(drafts.counts, dtype=torch.int64, device=state.valid.device) if drafts.drafted else None
    own = (draft,) if draft is not None and draft.row_buffers else ()
    with first_rows((target, *(draft.runners if draft is not None else ()), *own), rows):
        gamma, proposal = drafts.gamma, None
        if drafts.use_context is not None:
            proposal = mixed_proposal(draft, sub, drafts, counts, resolved, resolved.all_greedy, pad)
            gamma = 0
        elif drafts.context is not None:
            proposal = Proposal(drafts.context, counts=counts)
        caps = counts if proposal is None else None
        if graphs:
            out = fast.step(sub, gamma, sampling, resolved, method, timer, context=proposal, counts=caps,
                            method_options=method_options)
        else:
            scorer = target if transforms is None else TransformedTarget(target, transforms)
            out = speculative_step(scorer, draft, sub, gamma, sampling, resolved, method, timer, graph_verify=False,
                                   context=proposal, counts=caps, method_options=method_options)
    host = torch.cat([out.num_emitted[:, None], out.output_tokens], dim=1).cpu()   # the step's one host read
    emitted = host[:, 0].tolist()
    if graphs:
        fast.advance(sub, max(emitted[b] for b in live))
    else:
        sub.commit(out.num_emitted, out.output_tokens, out.draft_tokens, max(emitted[b] for b in live) - 1)
        if out.hidden is not None:
            sub.hidden = out.hidden
        dead = ~sub.alive
        sub.valid = sub.valid & sub.alive[:, None]
        sub.seq_len = torch.where(dead, torch.ones_like(sub.seq_len), sub.seq_len)
        sub.pending = torch.where(dead, torch.full_like(sub.pending, pad), sub.pending)
        sub.prev = torch.where(dead, torch.full_like(sub.prev, pad), sub.prev)
    for f in ("valid", "seq_len", "pending", "prev", "alive"):
        getattr(state, f)[:rows].copy_(getattr(sub, f))
    if state.hidden is not None:       # the runner's new per-row state (rows not live: garbage, reset at go-live)
        state.hidden[:rows].copy_(sub.hidden)
    state.write = sub.write
    return host
