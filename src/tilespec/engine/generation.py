"""Per-generation state of :class:`~tilespec.engine.SpeculativeDecoder`: everything one ``stream``/``generate``
call owns, so two generations on one decoder never share results.

A :class:`Generation` holds the device-side :class:`~tilespec.engine.state.BatchState`, the runners, the γ
schedule, the context drafter's matching state, the timer and counters, and the host-side results
(``sequences[r]``, ``reasons[r]`` by original request index r). ``done`` lists requests that finished but stay in
the batch (the compiled path keeps static shapes); ``finished`` is True once every request is done.

:class:`PlannedStep` is what ``SpeculativeDecoder.step`` hands to ``commit``: the step's device outputs plus the
host facts decided before it (live rows, γ, per-row draft lengths, phase totals before the step).
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Optional

import torch

from tilespec.verify.types import SamplingParams

from .metrics import PhaseTimer, RunStats
from .state import BatchState
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


@dataclass
class Generation:
    state: BatchState
    target: object                      # ModelRunner of the target
    draft: Optional[object]             # ModelRunner of the draft model (None: no model, or never used)
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

    def context_drafts(self, live: list, cap: int) -> Optional[list]:
        """The context drafter's host-side proposals per batch position (live rows only, at most ``cap`` tokens and
        never past max_new_tokens; [] = no match), or None if no row matched."""
        drafts = [[] for _ in range(self.state.size)]
        for i in live:
            limit = min(cap, self.remaining(i) - 1)
            if limit > 0:
                drafts[i] = self.context.propose(self.state.rows[i], limit)
        return drafts if any(drafts) else None

    def remaining(self, i: int) -> int:
        """New tokens row i (position in the batch) may still emit."""
        return self.max_new_tokens - self.produced[self.state.rows[i]]


@dataclass
class PlannedStep:
    out: StepOutput
    live: list                          # batch positions of the live rows
    gamma: int                          # the step's draft length: max over rows (0: target-only)
    drafts: Optional[list] = None       # per batch position: tokens drafted (context steps), else None
    before: dict = field(default_factory=dict)
    runners: tuple = ()
    draft_forwards: int = 0             # forwards of the draft model in this step
    committed: bool = False             # the step committed on the device (StepGraphs); the host advances W only
    advanced: bool = False              # ... and W was advanced when the step was launched (target-only steps)
    started: float = 0.0                # perf_counter() when the step was planned (its wall time feeds the schedule)
    host: Optional[object] = None       # advanced steps: [B, 1 + q] copy of (num_emitted, output_tokens) taken at
                                        # launch, before a run-ahead replay overwrites the graph's outputs; on CUDA
                                        # a pinned host tensor filled asynchronously, ready once host_ready fires
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
