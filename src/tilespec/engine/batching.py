"""Continuous batching: requests join free rows of a fixed-size batch between steps and leave when done.

:class:`BatchEngine` keeps B = ``max_batch`` rows and caches of C slots for its whole life (so the step keeps one
shape and stays a captured CUDA graph on the native runtime). The step is the engine's own (step.py's blocks, or
step_graph.py's whole-step graphs for native runners); this module only decides, between steps, who is in it:

  * a row is *free*, *prefilling* or *live*. Free and prefilling rows are dead to the step (``state.alive`` false,
    no valid slot, frozen length): they ride along in the fixed shape and their outputs are ignored.
  * Admission (FIFO) gives a waiting request a free row b and reserves its prompt region: the P - 1 prompt tokens
    before the last go to slots [W0 - P, W0 - 1) of row b, W0 being the shared write pointer at admission (W is
    raised to P first when it is smaller; other rows only get holes). Every step writes at slots >= W - 1 >= W0 - 1,
    so the region is never touched by the steps that run while the prompt is prefilled.
  * Prefill runs through a view of row b of the caches (slots.row_forward: no copy, other rows untouched), at most
    ``prefill_chunk`` prompt tokens per engine iteration, interleaved with the decode steps of the live rows.
  * When its prefill is done the row goes live: valid = its region, length P, pending = the last prompt token,
    its seed, ``limit`` = P + max_tokens. When it ends (EOS, length, stop, cancel) the row is freed: no copy either.
  * When W would pass C the caches are defragmented as the decoder does (state.plan_defrag, one gather); prefills in
    progress are finished first so no half-written region moves.

Every drafter is served through its contract (drafters/base.py): the engine holds the drafter's ``DraftRunner``
(``drafter.runner``: a draft model's, a trained head's, or None for context drafts alone) for its whole life.
A prompt chunk runs through the target's row forward (returning the target's hidden states at the prompt positions
when the runner names ``features``) and then ``runner.prefill_row`` into the same row only, which returns the row's
state (a head's output at its last prompt entry: ``state.hidden`` of that row, written at go-live). Every decode step
passes the runner to the step body, which lets it ``observe`` the verify forward whether or not anything was drafted
(per-request γ = 0, the load switch, no context match), so a head stays current; ``select`` moves its K/V with the
target's at a defragmentation. Context drafters with a runner (``head+ngram``, ``MODEL+ngram``) choose per request
(batch_step.choose_drafts): its context drafts where it matches, the runner's up to its cap elsewhere, in one step.

Exactness under batching: a request's random numbers are keyed by its own seed and absolute positions (Philox, as in
the engine), its rows of every forward depend only on its own tokens, and its draft lengths are decided from its own
history only (:meth:`BatchEngine._gamma`), so its tokens do not depend on what else is in the batch. With the
default ``coupled`` verification (verify/methods/coupled.py) and a context drafter (or none), a request's tokens are
even those of target-only decoding, whatever is drafted: ``spec_max_batch`` (drafting off while more rows are live)
changes no token then. With sampled drafts (a draft model, a head; with a context drafter too, whose drafts are then
verified with a one-hot q: batch_step.mixed_proposal) ``coupled`` is ``reference``: a request's tokens still depend
only on its own history (no load switch by default), but turning drafting on or off by load keeps greedy tokens and
the target's exact law only, not a sampled request's tokens.
"""
from __future__ import annotations

import dataclasses
import itertools
import time
from collections import deque
from typing import Optional

import torch

from tilespec.verify.logit_transforms import TransformBatch
from tilespec.verify.registry import get_method, resolve_method
from tilespec.verify.types import SamplingParams
from tilespec.verify.validation import resolve_sampling

from .batch_request import SAMPLING_FIELDS, BatchEvent, BatchRequest, check_request, keep_tokens
from .batch_step import choose_drafts, row_count, step_rows
from .drafters import resolve_drafter
from .generation import eos_ids
from .inputs import context_limit, vocab_limit
from .leases import lease
from .runner import make_runner
from .slots import ensure_caches, region_mask, row_forward
from .spec_switch import SpecSwitch
from .state import BatchState
from .step_graph import step_graphs_for

__all__ = ["BatchEngine", "BatchEvent", "BatchRequest"]


class BatchEngine:
    """Continuous batching over ``max_batch`` rows of ``capacity`` slots (see the module docstring).

    target: a decoder-only transformers model; draft: anything ``SpeculativeDecoder`` takes (None, a draft model,
    "ngram" / "suffix", "head" / "head+ngram" / a head folder, [model, "ngram"], a Drafter). gamma: default draft cap
    per request and step;
    max_len: the longest prompt + max_tokens accepted (default: the model's context, at most 2048); capacity: slots
    per row (default 2 max_len + gamma + 2, so defragmentation is rare). adaptive: drafting on / off per step row
    count as measured (:class:`~tilespec.engine.spec_switch.SpecSwitch`; default on for context drafters alone
    verified with ``coupled``, where it changes no token). compile: as SpeculativeDecoder's
    (True on CUDA: native runners with whole-step CUDA graphs). Not thread-safe: one thread calls :meth:`submit`,
    :meth:`cancel` and :meth:`step` (the server's engine thread).
    """

    finished = False     # a long-lived lease holder (engine/leases.py): its runners are never handed to others

    def __init__(self, target, draft=None, *, max_batch: int = 8, gamma: int = 4, max_len: Optional[int] = None,
                 capacity: Optional[int] = None, method: str = "coupled", compile: bool | str = False,
                 prefill_chunk: int = 512, spec_max_batch: Optional[int] = None, min_alpha: float = 0.1,
                 adaptive: Optional[bool] = None,
                 eos_token_id=None, pad_token_id: int = 0, tokenizer=None):
        if not (isinstance(max_batch, int) and max_batch >= 1):
            raise ValueError(f"max_batch must be an integer >= 1, got {max_batch!r}")
        if not (isinstance(gamma, int) and 0 <= gamma <= 32):
            raise ValueError(f"gamma must be an integer in [0, 32], got {gamma!r}")
        if not (isinstance(prefill_chunk, int) and prefill_chunk >= 1):
            raise ValueError(f"prefill_chunk must be an integer >= 1, got {prefill_chunk!r}")
        drafter = resolve_drafter(draft)
        if drafter is not None:     # a draft model must match the target; a trained head loads / checks here
            drafter.attach(target)
        self.drafter = drafter
        method = resolve_method(method, next(target.parameters()).device)
        self.method_options = tuple(get_method(method).resolve_options(None))
        self.method, self.gamma, self.max_batch = method, gamma if drafter is not None else 0, max_batch
        self.prefill_chunk, self.spec_max_batch, self.min_alpha = prefill_chunk, spec_max_batch, min_alpha
        model = drafter.model if drafter is not None else None
        limit = min(context_limit(m) or 4096 for m in (target, model) if m is not None)   # the draft sees them too
        self.max_len = min(max_len or min(limit, 2048), limit)
        cap = capacity or 2 * self.max_len + self.gamma + 2
        if compile:
            cap = -(-cap // 256) * 256
        if cap < self.max_len + self.gamma + 2:
            raise ValueError(f"capacity {cap} is below max_len + gamma + 2 = {self.max_len + self.gamma + 2}")
        self.capacity, self.vocab = cap, vocab_limit(target)
        self.out_vocab = target.get_output_embeddings().weight.shape[0]
        self.device = next(target.parameters()).device
        self.eos = eos_ids(target, tokenizer, eos_token_id)
        self.pad = int(pad_token_id)
        self.target = make_runner(target, cap, compile=compile)
        # the drafter's device side through its contract (drafters/base.py), or None (context drafts only)
        self.drafting = drafter.runner(max_batch, cap, target=self.target, compile=compile) \
            if drafter is not None else None
        self.features = tuple(self.drafting.features) if self.drafting is not None else ()
        if self.features and self.target.mode not in ("eager", "native", "native-graphs"):
            raise ValueError(f"{drafter.name} reads the target's hidden states: serve it with compile off, 'native' "
                             f"or 'native-graphs' (compile=True on CUDA), not {self.target.mode!r}")
        for runner in (self.target, *(self.drafting.runners if self.drafting is not None else ())):
            ensure_caches(runner, max_batch)
        lease(self, (self.drafting,))      # shared compiled draft runners stay this engine's for its whole life
        if adaptive is None:        # on where switching changes no token: coupled verification of context drafts
            adaptive = drafter is not None and drafter.has_context and self.drafting is None and method == "coupled"
        self.switch = SpecSwitch() if adaptive and drafter is not None else None
        self.fast = step_graphs_for(self.target, self.drafting)
        b, dev = max_batch, self.device
        self.state = BatchState(valid=torch.zeros((b, cap), dtype=torch.bool, device=dev),
                                seq_len=torch.ones(b, dtype=torch.int64, device=dev),
                                pending=torch.full((b,), self.pad, dtype=torch.int64, device=dev),
                                prev=torch.full((b,), self.pad, dtype=torch.int64, device=dev),
                                seeds=torch.zeros(b, dtype=torch.int64, device=dev), write=0, rows=list(range(b)),
                                alive=torch.zeros(b, dtype=torch.bool, device=dev),
                                limit=torch.ones(b, dtype=torch.int64, device=dev),
                                eos=torch.tensor(sorted(self.eos), dtype=torch.int64, device=dev))
        if self.drafting is not None:     # the runner's per-row state (a head's last output), per row at go-live
            self.state.hidden = self.drafting.empty_state(b)
            if self.drafting.observes and self.state.hidden is None:
                raise TypeError(f"{type(self.drafting).__name__} observes the verify forwards but gives no "
                                f"empty_state(batch): continuous batching needs each row's state before its prompt")
        self.rows: list = [None] * b          # row -> BatchRequest (prefilling or live) or None (free)
        self.waiting: deque = deque()
        self._ids = itertools.count()
        self._graph_sampling: set = set()      # scalar sampling tuples the whole-step graphs were captured for
        self.counters = {"steps": 0, "defrags": 0, "prefill_tokens": 0, "generated_tokens": 0, "drafted": 0,
                         "accepted": 0, "spec_steps": 0, "requests_finished": 0, "requests_cancelled": 0}

    # ------------------------------------------------------------------------------------------------ requests
    @property
    def max_request_len(self) -> int:
        """The most positions (prompt + max_tokens) one request may take."""
        return self.max_len

    def check(self, req: BatchRequest) -> None:
        """Raise ValueError with the reason when ``req`` cannot be served (empty / too long / bad ids or values)."""
        check_request(req, self.max_request_len, self.vocab)
        if req.logprobs is not None or req.prompt_logprobs is not None:
            raise ValueError("logprobs are reported by the paged engine (Llama-family targets with ngram, suffix or "
                             "no draft); this engine serves draft models and heads: drop logprobs")
        if req.grammar is not None:
            raise ValueError("structured outputs are served by the paged engine (Llama-family targets with ngram, "
                             "suffix or no draft); this engine serves draft models and heads: drop the grammar")

    def submit(self, req: BatchRequest) -> int:
        """Queue a request (checked first); returns its id."""
        self.check(req)
        req.rid, req.t_submit = next(self._ids), time.perf_counter()
        req.cap = self.gamma if req.gamma is None else min(req.gamma, self.gamma)   # the caches hold gamma
        if req.logits is not None and req.logits.min_tokens > 0:       # min_tokens bans the request's stop ids
            req.logits = dataclasses.replace(req.logits, banned=tuple(sorted(self._stops(req))))
        self.waiting.append(req)
        return req.rid

    @torch.inference_mode()
    def cancel(self, rid: int) -> Optional[BatchRequest]:
        """Drop request ``rid`` (waiting or running): its row is free for the next admission."""
        for req in self.waiting:
            if req.rid == rid:
                self.waiting.remove(req)
                req.finish_reason, req.t_end = "cancelled", time.perf_counter()
                self.counters["requests_cancelled"] += 1
                return req
        for req in self.rows:
            if req is not None and req.rid == rid:
                self._retire(req, "cancelled")
                return req
        return None

    def _stops(self, req: BatchRequest) -> set:
        """The ids that end ``req``: EOS (unless it ignores EOS) and its stop_token_ids."""
        return (set() if req.ignore_eos else set(self.eos)) | set(req.stop_token_ids)

    def _transforms(self, rows: int) -> Optional[TransformBatch]:
        """The step's logit transforms over rows [0, rows) (None when no live request has one)."""
        reqs = [self.rows[b] if self.rows[b] is not None and self.rows[b].live else None for b in range(rows)]
        settings = [r.logits if r is not None and r.logits is not None and r.logits.active else None for r in reqs]
        if not any(settings):
            return None
        return TransformBatch.from_settings(settings, [r.tokens if r is not None else [] for r in reqs],
                                            self.out_vocab, self.device)

    @property
    def running(self) -> int:
        return sum(r is not None for r in self.rows)

    @property
    def has_work(self) -> bool:
        return bool(self.waiting) or self.running > 0

    # ------------------------------------------------------------------------------------------------ the loop
    @torch.inference_mode()
    def step(self) -> list:
        """One iteration: admit waiting requests into free rows, prefill up to ``prefill_chunk`` prompt tokens, then
        one decode step of the live rows. Returns the :class:`BatchEvent` of every request that got tokens or ended."""
        self._admit()
        self._prefill(self.prefill_chunk)
        if self.state.write + self.gamma + 1 > self.capacity:   # before choosing the live rows: it may finish prefills
            self._defrag()
        live = [b for b, r in enumerate(self.rows) if r is not None and r.live]
        return self._decode(live) if live else []

    def _admit(self) -> None:
        while self.waiting and None in self.rows:
            req = self.waiting.popleft()
            b = self.rows.index(None)
            p = len(req.prompt)
            if self.state.write < p:               # the region must end before W - 1 (see the module docstring)
                self.state.write = p
            req.row, req.start, req.done = b, self.state.write - p, 0
            self.rows[b] = req
            if self.drafter is not None and self.drafter.has_context:
                req.context = self.drafter.start([req.prompt])

    def _prefill(self, budget: int) -> None:
        for req in [r for r in self.rows if r is not None and not r.live]:
            need = len(req.prompt) - 1 - req.done
            n = need if budget is None else min(need, budget)
            if n > 0:
                self._prefill_chunk(req, n)
                req.done += n
                self.counters["prefill_tokens"] += n
                if budget is not None:
                    budget -= n
            if req.done >= len(req.prompt) - 1:
                self._go_live(req)
            if budget is not None and budget <= 0:
                break

    def _prefill_chunk(self, req: BatchRequest, n: int) -> None:
        """Prompt tokens [done, done + n) of ``req`` into its row's region of the target's caches and then the draft
        runner's (with the target's features of the chunk when the runner reads them); the runner's state after
        the chunk goes to the row's ``state.hidden`` (the last chunk's is the row's state at go-live)."""
        ids = torch.tensor([req.prompt[req.done:req.done + n + 1]], dtype=torch.int64, device=self.device)
        pos = torch.arange(req.done, req.done + n, device=self.device)[None]
        mask = region_mask(self.capacity, req.start, req.done, n, self.device)
        write = req.start + req.done
        out = row_forward(self.target, req.row, ids[:, :n], pos, mask, write, capture=self.features)
        if self.drafting is not None:
            h = self.drafting.prefill_row(req.row, ids, pos, mask, write, out[1] if self.features else None)
            if h is not None:
                self.state.hidden[req.row] = h[0].to(self.state.hidden.dtype)

    def _go_live(self, req: BatchRequest) -> None:
        s, b, p = self.state, req.row, len(req.prompt)
        s.valid[b] = False
        s.valid[b, req.start:req.start + p - 1] = True
        s.seq_len[b] = p
        s.pending[b] = req.prompt[-1]
        s.prev[b] = req.prompt[-2] if p >= 2 else self.pad
        s.seeds[b] = req.seed
        s.alive[b] = True
        s.limit[b] = p + req.max_tokens
        if p == 1 and s.hidden is not None:      # no prompt entry: the runner starts from its empty state
            s.hidden[b] = self.drafting.empty_state(1)[0]
        req.live = True

    def _retire(self, req: BatchRequest, reason: str) -> None:
        b = req.row
        self.rows[b] = None
        self.state.alive[b] = False
        self.state.valid[b] = False
        req.finish_reason, req.t_end, req.row = reason, time.perf_counter(), None
        req.live = False
        key = "requests_cancelled" if reason == "cancelled" else "requests_finished"
        self.counters[key] += 1

    # ------------------------------------------------------------------------------------------------ decoding
    def _gamma(self, req: BatchRequest, n_live: int) -> int:
        """The request's draft cap this step: its own cap, never past its budget, 0 once its own acceptance rate is
        measured below ``min_alpha`` (after 32 drafted tokens); 0 for everyone while more than ``spec_max_batch``
        rows are live (opt-in, see the module docstring)."""
        if req.cap <= 0 or (self.spec_max_batch is not None and n_live > self.spec_max_batch):
            return 0
        if req.drafted >= 32 and req.accepted < self.min_alpha * req.drafted:
            return 0
        return max(0, min(req.cap, req.max_tokens - len(req.tokens) - 1))

    def _sampling(self, live: list, rows: int) -> SamplingParams:
        """Scalars when every live request samples alike (so the whole-step graphs apply), else per-row lists over
        the step's ``rows`` rows (rows not live take the first live request's values)."""
        values = [self.rows[b].sampling for b in live]
        if all(v == values[0] for v in values):
            return SamplingParams(*values[0])
        per_row = [self.rows[b].sampling if self.rows[b] is not None else values[0] for b in range(rows)]
        return SamplingParams(*[list(col) for col in zip(*per_row)])

    def _decode(self, live: list) -> list:
        started = time.perf_counter()
        rows = row_count(live, self.max_batch)
        allow = self.switch is None or self.switch.draft(rows)
        caps = {b: self._gamma(self.rows[b], len(live)) if allow else 0 for b in live}
        compiled = self._compile_seconds()
        caps_rows = [caps.get(b, 0) for b in range(rows)]
        contexts = None
        if self.drafter is not None and self.drafter.has_context and max(caps_rows) > 0:
            contexts = [self.rows[b].context.propose(0, c) if c > 0 else [] for b, c in enumerate(caps_rows)]
        drafts = choose_drafts(caps_rows, contexts, self.drafting is not None, self.pad, self.out_vocab, self.device,
                               width=self.gamma)
        sampling = self._sampling(live, rows)
        resolved = resolve_sampling(sampling, rows, self.device)
        transforms = self._transforms(rows)
        # the whole-step graphs know neither transforms nor per-request stop rules (their device commit ends a row
        # at EOS): such steps take the host-commit path
        plain = transforms is None and not any(self.rows[b].ignore_eos for b in live)
        host = step_rows(self.target, self.drafting, self.fast, self.state, rows, drafts, sampling, resolved,
                         self.method, self.method_options, self.pad, plain and self._graph_ok(sampling), live,
                         transforms=transforms)
        drafted, counts = drafts.drafted, drafts.counts
        if self.switch is not None:
            emitted = host[:, 0].tolist()
            self.switch.observe(rows, drafted, time.perf_counter() - started, sum(emitted[b] for b in live) / len(live),
                                valid=self._compile_seconds() == compiled)
        self.counters["steps"] += 1
        self.counters["spec_steps"] += int(drafted)
        return self._take(live, host, host[:, 0].tolist(), counts)

    def _compile_seconds(self) -> float:
        return sum(getattr(r, "compile_seconds", 0.0) for r in (self.target, self.drafting, self.fast)
                   if r is not None)

    def _graph_ok(self, sampling: SamplingParams) -> bool:
        """The whole-step graphs take scalar sampling baked into their key: allow a handful of distinct settings
        (each captures its own graphs), then run other settings on the host-commit path."""
        if self.fast is None or not self.fast.usable(self.method, sampling):
            return False
        key = tuple(getattr(sampling, f) for f in SAMPLING_FIELDS)
        if key not in self._graph_sampling and len(self._graph_sampling) >= 8:
            return False
        self._graph_sampling.add(key)
        return True

    def _defrag(self) -> None:
        self._prefill(None)                       # a region half written must not move
        slot_index, _ = self.state.plan_defrag()
        rows = torch.arange(self.max_batch, device=self.device)
        for runner in (self.target, self.drafting):    # the runner's own K/V (a head's) move with the target's
            if runner is not None:
                runner.select(rows, slot_index)
        self.counters["defrags"] += 1

    def _take(self, live: list, host: torch.Tensor, emitted: list, counts: list) -> list:
        events, now = [], time.perf_counter()
        for b in live:
            req = self.rows[b]
            n = emitted[b]
            toks, reason = keep_tokens(req, host[b, 1:1 + n].tolist(), self._stops(req), now)
            req.drafted += counts[b]
            req.accepted += n - 1
            self.counters["drafted"] += counts[b]
            self.counters["accepted"] += n - 1
            self.counters["generated_tokens"] += len(toks)
            if req.context is not None:
                req.context.extend(0, toks)
            if reason is not None:
                self._retire(req, reason)
            events.append(BatchEvent(rid=req.rid, tokens=toks, finish_reason=reason))
        return events
