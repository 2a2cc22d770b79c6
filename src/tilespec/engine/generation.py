"""Per-generation state of :class:`~tilespec.engine.SpeculativeDecoder`: everything one ``stream``/``generate``
call owns, so two generations on one decoder never share results.

A :class:`Generation` holds the device-side :class:`~tilespec.engine.state.BatchState`, the runners, the γ
schedule, the context drafter's matching state, the timer and counters, and the host-side results
(``sequences[r]``, ``reasons[r]`` by original request index r). ``done`` lists requests that finished but stay in
the batch (the compiled path keeps static shapes); ``finished`` is True once every request is done.

:class:`PlannedStep` is what ``SpeculativeDecoder.step`` hands to ``commit``: the step's device outputs plus the
host facts decided before it (live rows, γ, per-row draft lengths, the timer's marks around the step).

Run-ahead (decoder ``_run_ahead``): on the whole-step graphs the next step may be launched before the host reads the
current one. Target-only steps move W by exactly one; speculative steps with a draft model only when
:meth:`Generation.may_run_ahead` proves the next step identical to the one the host would launch after the read.
"""
from __future__ import annotations

import time
import warnings
from dataclasses import dataclass, field, replace
from typing import Optional

import torch

from tilespec.verify.types import SamplingParams

from .metrics import PhaseTimer, RunStats
from .state import BatchState
from .drafters.base import Proposal
from .step import StepOutput


@dataclass
class StepEvent:
    """What one step produced: ``tokens[i]`` new tokens of request i (original index); ``finished`` requests."""

    step: int
    tokens: dict
    finished: list


@dataclass
class GenerationOutput:
    """``sequences[i]``: the new tokens of request i (prompt excluded); ``texts`` when a tokenizer is known."""

    sequences: list
    stats: RunStats
    texts: Optional[list] = None
    finish_reasons: list = field(default_factory=list)


def select_sampling(sampling: SamplingParams, rows: list) -> SamplingParams:
    """Restrict per-request sampling fields to the original request indices ``rows``."""
    changes = {}
    for name in ("temperature", "top_k", "top_p", "min_p", "lenience"):
        value = getattr(sampling, name)
        if isinstance(value, torch.Tensor) and value.ndim > 0:
            changes[name] = value[torch.as_tensor(rows, device=value.device)]
        elif isinstance(value, (list, tuple)):
            changes[name] = [value[r] for r in rows]
    return replace(sampling, **changes) if changes else sampling


def eos_ids(model, tokenizer, eos_token_id) -> set:
    if eos_token_id is None:
        eos_token_id = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
        if eos_token_id is None and tokenizer is not None:
            eos_token_id = tokenizer.eos_token_id
    if eos_token_id is None:
        return set()
    return {int(eos_token_id)} if isinstance(eos_token_id, int) else {int(e) for e in eos_token_id}


FALLBACK_DEVICES = ("cuda",)     # where a failing whole-step graph hands over to the host-commit step


@dataclass
class Generation:
    state: BatchState
    target: object                      # ModelRunner of the target
    draft: Optional[object]             # the drafter's DraftRunner (drafters/base.py; None: no device side)
    schedule: object                    # next() / update(...) (gamma.py's GammaSchedule or an injected one)
    timer: PhaseTimer
    stats: RunStats
    capacity: int
    max_new_tokens: int
    sampling: object                    # SamplingParams restricted to the active rows
    resolved: object                    # its ResolvedSampling
    context: Optional[object] = None    # the context drafter's ContextState
    t_start: float = 0.0
    step_no: int = 0
    produced: list = field(default_factory=list)
    sequences: list = field(default_factory=list)
    reasons: list = field(default_factory=list)
    done: set = field(default_factory=set)
    fast: Optional[object] = None       # step_graph.StepGraphs when the runners are native (whole-step graphs)
    compile_before: float = 0.0         # runners' compile seconds before this generation
    compiled_seen: float = 0.0         # compile / capture seconds of the runners when feed_rate last looked
    last_read: float = 0.0              # perf_counter() at the end of the last commit (a step's wall time starts
                                        # there when it was launched earlier, ahead of that read)

    def __post_init__(self):
        # what drafts: the schedule prices and resumes accordingly
        self.schedule.bind(model=self.draft is not None, context=self.context is not None)

    @property
    def finished(self) -> bool:
        return len(self.done) >= self.state.size

    def live(self) -> list:
        """Positions (in the active batch) of the rows still generating."""
        return [i for i, r in enumerate(self.state.rows) if r not in self.done]

    def take(self, host: torch.Tensor, emitted_all: list, live: list, eos: set) -> tuple[dict, list, list]:
        """Record a step's tokens: ``host`` [B, 1 + K + 1] = (num_emitted, output tokens) as read from the device.
        Each live row keeps its emitted tokens up to max_new_tokens and the first EOS. Returns (new tokens by
        request, requests that finished, batch positions that go on)."""
        new_tokens, finished, keep = {}, [], []
        for i in live:
            r = self.state.rows[i]
            toks = host[i, 1:1 + emitted_all[i]].tolist()[:self.max_new_tokens - self.produced[r]]
            for j, t in enumerate(toks):
                if t in eos:
                    toks = toks[:j + 1]
                    self.reasons[r] = "eos"
                    break
            self.sequences[r] += toks
            self.produced[r] += len(toks)
            new_tokens[r] = toks
            if self.context is not None:
                self.context.extend(r, toks)
            if self.reasons[r] == "eos" or self.produced[r] >= self.max_new_tokens:
                finished.append(r)
            else:
                keep.append(i)
        return new_tokens, finished, keep

    def draft_tensors(self, drafts: list, gamma: int, pad_id: int) -> Proposal:
        """Context drafts (per batch position, ragged) -> a device Proposal (tokens [B, γ] padded with ``pad_id``,
        counts [B]), timed as the draft phase; copied from pinned memory on CUDA, so asynchronously."""
        self.timer.start("draft")
        device = self.state.valid.device
        pin = device.type == "cuda"
        padded = torch.tensor([d + [pad_id] * (gamma - len(d)) for d in drafts], dtype=torch.int64, pin_memory=pin)
        counts = torch.tensor([len(d) for d in drafts], dtype=torch.int64, pin_memory=pin)
        out = Proposal(padded.to(device, non_blocking=True), counts=counts.to(device, non_blocking=True))
        self.timer.stop("draft")
        return out

    def graphed_step(self, lagged: bool, *args, **kwargs):
        """``fast.step`` (the whole step in captured graphs, step_graph.py), or None where it fails on CUDA (e.g. a
        new step shape that cannot be captured): the rest of the generation runs host-commit steps. Safe because the
        failed step changed no state and wrote only slots past W, which the host-commit step rewrites. A lagged step
        re-raises (the host's W is one step behind)."""
        try:
            return self.fast.step(*args, lagged=lagged, **kwargs)
        except Exception as err:    # noqa: BLE001 - stay correct where a capture fails
            if lagged or self.state.valid.device.type not in FALLBACK_DEVICES:
                raise
            warnings.warn(f"the whole-step graph failed ({type(err).__name__}: {err}); host-commit steps from now on")
            if self.state.valid.is_cuda:
                torch.cuda.synchronize(self.state.valid.device)
            self.fast = None
            return None

    def read_done(self, event: "StepEvent") -> "StepEvent":
        """End a commit (the bookkeeping phase) and note when, for the next step's wall time."""
        self.timer.stop("bookkeeping")
        self.last_read = time.perf_counter()
        return event

    def feed_schedule(self, planned: "PlannedStep", emitted: list, ks: list, requests: Optional[list] = None) -> None:
        """Tell the γ schedule how a speculative step went: accepted counts of the live rows that drafted (``emitted``
        / ``ks``: per live row, ``requests`` their request ids), the step's own draft and target time (on CUDA this
        waits for its events, not for a step launched after it), and its wall time from its launch or, if launched
        ahead, from the previous read. Schedules with ``wants_step_time`` get every live row with its request id
        and draft length (per-request α); others the accepted counts of the rows that drafted."""
        spent = self.timer.between(planned.before, planned.after)
        compiled = sum(getattr(r, "compile_seconds", 0.0) for r in (self.target, self.draft, self.fast) if r)
        if compiled != self.compiled_seen:   # the step captured or compiled a shape: its times say nothing of costs
            spent = {"draft": 0.0, "target": 0.0}   # (feed_rate, called next, notes the new total)
        if self.schedule.wants_step_time:   # injected schedules may not take these
            extra = {"step_time": time.perf_counter() - max(planned.started, self.last_read)}
            if requests is not None:
                extra.update(requests=list(requests), drafted=list(ks))
            accepted = [e - 1 if k > 0 else 0 for e, k in zip(emitted, ks)] if requests is not None else \
                [e - 1 for e, k in zip(emitted, ks) if k > 0]
        else:
            extra, accepted = {}, [e - 1 for e, k in zip(emitted, ks) if k > 0]
        self.schedule.update(planned.gamma, accepted, spent["draft"], spent["target"], **extra)

    def feed_rate(self, gamma: int, emitted: list, planned: Optional["PlannedStep"] = None) -> None:
        """Tell a schedule that measures rates (``optimal``) the wall time since the previous read and the mean
        tokens emitted per live request, for every step: target-only ones too (γ = 0), with their target time and
        whether the schedule itself chose not to draft (a fallback step) when ``planned`` is given."""
        if not emitted:
            return
        compiled = sum(getattr(r, "compile_seconds", 0.0) for r in (self.target, self.draft, self.fast) if r)
        if compiled != self.compiled_seen:   # the step captured or compiled a new shape: its wall time says nothing
            self.compiled_seen = compiled
            return
        wall, tokens = time.perf_counter() - self.last_read, sum(emitted) / len(emitted)
        if planned is None or not self.schedule.wants_step_time:
            self.schedule.observe_rate(gamma, wall, tokens)
            return
        target = self.timer.between(planned.before, planned.after)["target"] if gamma == 0 else None
        self.schedule.observe_rate(gamma, wall, tokens, target_time=target, fallback=planned.proposed == 0)

    def context_drafts(self, live: list, cap: int) -> Optional[list]:
        """The context drafter's host-side proposals per batch position (live rows only, at most ``cap`` tokens and
        never past max_new_tokens; [] = no match), or None if no row matched."""
        drafts = [[] for _ in range(self.state.size)]
        for i in live:
            limit = min(cap, self.remaining(i) - 1)
            if limit > 0:
                drafts[i] = self.context.propose(self.state.rows[i], limit)
        if any(drafts) and self.draft is None:     # the schedule cuts drafts that do not pay
            rows = [r if i in live else None for i, r in enumerate(self.state.rows)]
            drafts = self.schedule.select_drafts(drafts, rows)
        return drafts if drafts is not None and any(drafts) else None

    def remaining(self, i: int) -> int:
        """New tokens row i (position in the batch) may still emit."""
        return self.max_new_tokens - self.produced[self.state.rows[i]]

    def may_run_ahead(self, planned: "PlannedStep") -> bool:
        """Whether the next speculative step may be launched before ``planned`` (launched, not read) is read, being
        exactly the step the host would launch after the read (same γ, W and cache layout, hence the same tokens):

          * ``planned`` drafted with the draft model on the whole-step graphs (``committed``: the device advanced W
            and applied the end-of-request rule itself), and there is no context drafter (its drafts need the
            tokens on the host);
          * γ does not wait for the unread step: the schedule's ``fixed_gamma()`` gives it (the constant schedule;
            ``optimal`` while a draft model or head drafts, from statistics one step older: exact too, γ depends
            only on tokens already emitted, never on the random numbers it then consumes; the heuristic schedule
            waits for the read);
          * the budget cannot clip γ: every live row has at least γ_planned + 1 + γ + 1 tokens left, so whatever
            ``planned`` accepts, no row ends there by length and each survivor keeps >= γ + 1 (a row ending there
            by EOS is computed once more and ignored, as with target-only run-ahead);
          * no defrag is needed: ``planned`` moves W by at most γ_planned + 1, so W + (γ_planned + 1) + (span + 1)
            <= C (span: the slots past W the next step writes, γ for a chain)
            (``state.write`` is exact here: every earlier step has been read). Otherwise the next step waits for the
            read and defragments then, exactly as without run-ahead.
        """
        if not (planned.committed and planned.draft_forwards > 0 and planned.drafts is None
                and self.context is None and self.draft is not None):
            return False
        gamma = self.schedule.fixed_gamma()    # asked last: ``optimal`` pins what it returns
        if not gamma:
            return False
        need = planned.gamma + 1 + gamma + 1
        slots = planned.gamma + 1 + self.draft.span(gamma) + 1     # a tree step writes more slots than γ + 1
        live = self.live()
        return bool(live) and min(self.remaining(i) for i in live) >= need and self.state.write + slots <= self.capacity


@dataclass
class PlannedStep:
    out: StepOutput
    live: list                          # batch positions of the live rows
    gamma: int                          # the step's draft length: max over rows (0: target-only)
    drafts: Optional[list] = None       # per batch position: tokens drafted (context steps), else None
    before: int = 0                     # PhaseTimer.mark() before and after the step's phases
    after: int = 0
    runners: tuple = ()
    draft_forwards: int = 0             # forwards of the draft model in this step
    committed: bool = False             # the step committed on the device (StepGraphs); the host advances W only
    advanced: bool = False              # ... and W was advanced when the step was launched (target-only steps)
    started: float = 0.0                # perf_counter() when the step was planned (its wall time feeds the schedule)
    proposed: Optional[int] = None      # the schedule's γ for the step (0: it chose not to draft, a fallback step)
    host: Optional[object] = None       # steps run ahead of: [B, 1 + q] copy of (num_emitted, output_tokens) taken
                                        # before the next replay overwrites the graph's outputs; on CUDA a pinned
                                        # host tensor filled asynchronously, ready once host_ready fires
    host_ready: Optional[object] = None # torch.cuda.Event recorded after that copy (None: host is usable now)


def snapshot_outputs(out) -> tuple:
    """(host, ready) for a step launched ahead of its read: [B, 1 + q] (num_emitted, output_tokens) taken now, since
    the next replay rewrites the graph's output buffers. On CUDA a pinned host tensor filled asynchronously and the
    event after the copy: a plain ``.cpu()`` at commit time would queue behind the run-ahead step and make the GPU
    wait for the host's bookkeeping every step. On CPU a copy and None."""
    host = torch.cat([out.num_emitted[:, None], out.output_tokens], dim=1)
    if not host.is_cuda:
        return host, None
    pinned = torch.empty(host.shape, dtype=host.dtype, pin_memory=True)
    pinned.copy_(host, non_blocking=True)
    ready = torch.cuda.Event()
    ready.record()
    return pinned, ready
