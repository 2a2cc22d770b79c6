"""The whole decoding step as two CUDA graphs, for native runners (engine/native): the host launches two replays
and reads the emitted tokens once per step.

Why: with the forwards at ~2 ms, the ~40 small eager launches around them per step (masks, positions, sampling
glue, the commit's bookkeeping) cost ~0.5 ms of host time during which the GPU idles, because each step ends in
the one host read. Here everything between two host reads is captured:
  * graph D: the step body's draft phase (step.draft_phase) -- the draft runner's γ tokens with their sampling ->
    draft tokens [B, γ] and, when sampling, the draft logits [B, γ, V]; or, when a context drafter proposed, the
    runner scoring those drafts (a draft model keeps its cache complete);
  * graph T: the step body's verify phase (step.verify_phase: the target forward over [pending, d_1..d_K],
    ``verify()`` or the greedy argmax of a target-only step, the runner's ``observe``) and the commit: the slots
    of accepted tokens become valid, and seq_len / pending / prev advance.
Two graphs rather than one so the draft and target phases keep their own CUDA-event times (the ``optimal`` γ
schedule estimates the cost ratio c from them). Drafts from elsewhere (context drafters) enter graph T as
``draft_tokens`` [B, K] with ``num_draft_tokens`` [B] (ragged). A token tree (``Proposal.tree``, a dynamic tree
from a head) rides the same way: graph D returns the proposal's tensors (``Proposal.flatten``; its layout -- the
tree's kind, depth, scheme -- is recorded at capture and is part of graph T's key) and graph T verifies it with the
step body's tree branch. Nothing here knows which drafter it runs: it asks the runner's contract
(drafters/contract.py: ``observes`` -- its per-row state rides through both graphs; ``scores_context``; runners
with ``captures = False`` never get here).

The write pointer W is a device scalar here: the draft writes at W-1 .. W+γ-1 and the target at W .. W+K inside one
capture. Keys: graph D (γ, the sampling flags, greedy) or ("score",); graph T (method, its options, sampling,
greedy, the proposal's layout -- draft logits, per-request counts, a tree's kind / depth / scheme -- and whether
the runner's state rides along). Shapes: B, C fixed per
generation. The device commit matches :meth:`BatchState.commit` for the live rows; graph T also applies the host's
end-of-request rule (``state.still_alive``) and advances W by the longest block among the rows live at the step
(0 when none is), the rule the host applies one read later (:meth:`StepGraphs.advance`). Rows that ended keep their
place (static shapes) but no context, and stop advancing (their positions stay bounded; their outputs are ignored).
So the next step may be launched before the host read (``lagged=True``): it reads W from the previous graph T, not
from the host, whose ``state.write`` then lags by one step (decoder.py decides when that is safe).
"""
from __future__ import annotations

import time
from typing import Optional

import torch

from tilespec.verify.registry import get_method
from tilespec.verify.types import ResolvedSampling, SamplingParams

from .drafters.base import Proposal, StepView
from .execution import SAMPLING_FLAGS, CapturedExecution, greedy_tokens  # noqa: F401  (greedy_tokens: public here)
from .graphs import GraphCache
from .metrics import PhaseTimer
from .state import BatchState, committed, still_alive
from .step import StepOutput, draft_phase, drafts_on_device, empty_proposal, verify_phase


class _Direct:
    """GraphCache's interface without capture: the same step functions run eagerly (CPU, the "native" mode).

    Like a replayed graph it returns the same output buffers on every call (rewritten in place), so the CPU tests
    see the aliasing a captured step has: an output read after the next call is that call's."""

    def __init__(self, fn):
        self.fn = fn
        self._out = {}

    def __call__(self, *args, key=None):
        out = self.fn(*args, key=key)
        flat, spec = torch.utils._pytree.tree_flatten(out)
        prev = self._out.get(key)
        if prev is None or len(prev) != len(flat) or any(
                not isinstance(a, torch.Tensor) or a.shape != b.shape or a.dtype != b.dtype
                for a, b in zip(prev, flat)):
            self._out[key] = flat
            return out
        for buf, new in zip(prev, flat):
            buf.copy_(new)
        return torch.utils._pytree.tree_unflatten(prev, spec)

    def __len__(self) -> int:
        return 0

    def clear(self) -> None:
        pass


class StepGraphs:
    """Captured draft and target+verify+commit blocks of one (target, draft) pair of native-graphs runners.

    ``usable(method, sampling)`` says whether a step can run here (a method whose registry record is graph-safe,
    hashable sampling);
    :meth:`step` runs one step and updates ``state`` (all but the host-side write pointer, see :meth:`advance`).
    ``write_dev`` is the W the host sets before a step that is not lagged; ``_w`` is the device W after the last
    step (graph T's output), which a lagged step starts from.
    """

    def __init__(self, target, draft=None, *, capture: bool = True):
        self.target, self.draft = target, draft     # the target's runner; the drafter's DraftRunner or None
        self.write_dev = torch.zeros((), dtype=torch.int64, device=target.device)
        wrap = GraphCache if capture else _Direct
        self._compiled = capture            # captured bodies run the tree bookkeeping compiled (engine/fused.py)
        self._draft_graphs = wrap(self._draft_block)
        self._target_graphs = wrap(self._target_block)
        self.compile_seconds = 0.0      # first-use compile + capture time of new step shapes
        self._versions: tuple = ()
        self._no_draft: dict = {}       # batch size -> an empty [B, 0] draft, made once
        self._layouts: dict = {}        # graph D key -> the layout of the proposal it returns (Proposal.flatten)
        self._w: Optional[torch.Tensor] = None

    def usable(self, method: str, sampling: SamplingParams) -> bool:
        try:
            hash(sampling)
        except TypeError:
            return False
        return get_method(method).graph_safe

    # ---------------------------------------------------------------------------------------- captured bodies
    def _draft_block(self, valid, seq_len, pending, prev, seeds, w, *rest, key):
        """Graph D: draft_phase -- the runner proposes (key (γ, sampling flags, greedy); its per-row state rides
        first in ``rest`` when it ``observes``, then the sampling tensors) or scores context drafts (key
        ("score",), ``rest`` = (tokens [B, K],))."""
        if key[0] == "score":
            view = StepView(valid, seq_len, pending, prev, seeds, w)
            draft_phase(self.draft, view, 0, None, True, CapturedExecution(compiled=self._compiled),
                        context=Proposal(rest[0]))
            return ()
        gamma, flags, greedy = key
        hidden = None
        if self.draft.observes:
            hidden, *rest = rest
        view = StepView(valid, seq_len, pending, prev, seeds, w, hidden)
        proposal = draft_phase(self.draft, view, gamma, ResolvedSampling(*rest, *flags), greedy,
                               CapturedExecution(compiled=self._compiled))
        tensors, self._layouts[key] = proposal.flatten()    # recorded while capturing: what the replays return
        return tensors

    def _target_block(self, valid, seq_len, pending, prev, seeds, w, alive, limit, eos, *extra, key):
        """Graph T: verify_phase and the commit (``extra``: the proposal's tensors, then the runner's state)."""
        method, options, sampling, greedy, layout, observe = key
        hidden = None
        if observe:                      # the runner's per-row state rides last
            hidden, extra = extra[-1], extra[:-1]
        proposal = Proposal.unflatten(layout, extra)
        view = StepView(valid, seq_len, pending, prev, seeds, w, hidden)
        # logits stay in the model dtype: verify() reads bf16 / fp16 and computes in fp32 (an fp32 copy of
        # [B, K+1, V] would cost a write and a read of twice the bytes)
        num_emitted, out, new_hidden, drafts = verify_phase(self.target, self.draft if observe else None, view,
                                                            proposal, sampling, method, greedy,
                                                            CapturedExecution(options, self._compiled))
        new_valid, new_len, nxt, prv = committed(valid, seq_len, pending, num_emitted, out, drafts, w)
        now_alive = still_alive(alive, seq_len, limit, eos, num_emitted, out)
        new_w = w + (num_emitted * alive).amax()     # rows that had ended do not move W (0 when none is live)
        # ended rows: no context, frozen state. torch.where also keeps the outputs from aliasing the graph's inputs
        # (the next replay copies the state into them first)
        new_valid = new_valid & now_alive[:, None]
        new_len, nxt, prv = (torch.where(alive, a, b) for a, b in ((new_len, seq_len), (nxt, pending), (prv, prev)))
        if not observe:
            return num_emitted, out, new_valid, new_len, nxt, prv, now_alive, new_w
        new_hidden = torch.where(alive[:, None], new_hidden.to(hidden.dtype), hidden)
        return num_emitted, out, new_valid, new_len, nxt, prv, now_alive, new_w, new_hidden

    # ---------------------------------------------------------------------------------------- host side
    def step(self, state: BatchState, gamma: int, sampling: SamplingParams, resolved: ResolvedSampling,
             method: str, timer: PhaseTimer, context: Optional[Proposal] = None,
             counts: Optional[torch.Tensor] = None, method_options: tuple = (), lagged: bool = False,
             use_draft: bool = True) -> StepOutput:
        """One step: the draft runner's γ tokens (capped per request by ``counts`` [B]), or the ``context``
        drafts (ragged by their counts; the runner scores them when it ``scores_context``), or none; then target +
        verify (with the method's resolved options, ((name, value), ...), part of the graph key) + commit. Updates
        ``state``'s device tensors; the caller reads the output once and calls :meth:`advance`.

        lagged: the previous step has not been read yet, so ``state.write`` is one step behind: W is taken from the
        previous step's graph T instead (the host must not overwrite it with its stale value).
        use_draft: False once the draft runner is no longer used (the schedule fell back): no draft work at all."""
        greedy = resolved.all_greedy
        draft = self.draft if use_draft else None
        observe = draft is not None and draft.observes
        versions = tuple(r.cache_version for r in (self.target, self.draft) if r is not None)
        if versions != self._versions:          # new K/V buffers: the captured steps point at the old ones
            if lagged:
                raise RuntimeError("a lagged step cannot follow a change of the K/V buffers (defrag, new runners)")
            self._draft_graphs.clear()
            self._target_graphs.clear()
            self._versions = versions
        if lagged:
            if self._w is None:
                raise RuntimeError("a lagged step needs a previous step on these graphs")
            w = self._w
        else:
            w = self.write_dev
            w.fill_(state.write)
        base = (state.valid, state.seq_len, state.pending, state.prev, state.seeds, w)
        proposal = context
        if drafts_on_device(draft, gamma, context):
            timer.start("draft")
            n, t0 = len(self._draft_graphs), time.perf_counter()
            if context is not None:
                self._draft_graphs(*base, context.tokens, key=("score",))
            else:
                flags = tuple(getattr(resolved, f) for f in SAMPLING_FLAGS)
                tensors = (resolved.temperature, resolved.top_k, resolved.top_p, resolved.min_p, resolved.lenience)
                hid = (state.hidden,) if observe else ()
                key = (gamma, flags, greedy)
                outs = self._draft_graphs(*base, *hid, *tensors, key=key)
                proposal = Proposal.unflatten(self._layouts[key], outs)
                proposal.counts = counts if counts is not None else proposal.counts
            if len(self._draft_graphs) != n:
                self.compile_seconds += time.perf_counter() - t0
            timer.stop("draft")
        elif proposal is None:
            tokens = self._no_draft.get(state.size)
            if tokens is None:
                tokens = self._no_draft[state.size] = empty_proposal(state).tokens
            proposal = Proposal(tokens, counts=counts)
        timer.start("target")
        tensors, layout = proposal.flatten()
        key = (method, tuple(method_options), sampling, greedy, layout, observe)
        n, t0 = len(self._target_graphs), time.perf_counter()
        num_emitted, out, valid, seq_len, pending, prev, alive, self._w, *hidden = self._target_graphs(
            *base, state.alive, state.limit, state.eos, *tensors, *((state.hidden,) if observe else ()), key=key)
        if hidden:
            state.hidden = hidden[0]
        if len(self._target_graphs) != n:
            self.compile_seconds += time.perf_counter() - t0
        timer.stop("target")
        state.valid, state.seq_len, state.pending, state.prev, state.alive = valid, seq_len, pending, prev, alive
        # graph buffers, valid until the next replay: the caller reads them once (the commit already happened)
        return StepOutput(draft_tokens=proposal.tokens, num_emitted=num_emitted, output_tokens=out)

    @staticmethod
    def advance(state: BatchState, longest: int) -> None:
        """The host half of the commit: move the write pointer past the longest block emitted by a row that was live
        at the step (``longest`` = max num_emitted over those rows, 0 if none), as graph T did on the device."""
        state.write += longest


def step_graphs_for(target, draft=None) -> Optional[StepGraphs]:
    """The :class:`StepGraphs` of a (target, draft) pair of runners, kept on the target runner (so compiled runners
    shared across generations share their captured steps); None unless every runner is native. In the "native"
    mode (eager, any device) the same step functions run without capture, so CPU tests cover them."""
    runners = (target,) if draft is None else (target, draft)
    modes = {getattr(r, "mode", None) for r in runners}
    if not modes <= {"native", "native-graphs"} or len(modes) != 1:
        return None
    table = target.__dict__.setdefault("_step_graphs", {})
    key = id(draft)
    entry = table.get(key)
    if entry is None or entry.draft is not draft:
        entry = table[key] = StepGraphs(target, draft, capture=modes == {"native-graphs"})
    return entry
