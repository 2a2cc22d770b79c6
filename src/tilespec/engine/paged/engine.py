"""The paged engine: continuous batching over paged K/V with prefix caching, chunked prefill in the decode batch,
and context speculation verified exactly per request.

One iteration (:meth:`PagedEngine.step`):
  1. the draft gate (pricing.py) says whether the drafter runs; decoding requests propose their drafts (ngram /
     suffix; a draft model's or a head's are placeholders, sampled after step 3 by draft_model.py / head.py), up
     to gamma;
  2. the scheduler (scheduler.py) picks the items: decode rows with their drafts first, then prompt chunks of waiting
     requests within a token budget when admission.py admits; it grows block tables, preempts when blocks run out;
  3. the drafts are priced (pricing.py): those that maximise expected tokens per measured second are kept;
  4. one ragged forward (model.py, layout.py); decode-only steps replay a CUDA graph per shape;
  5. ``verify()`` on the sampling rows (verify_rows.py): accepted drafts and one more token per request (a token
     tree's rows: select_tree and the accepted path's K/V compacted, tree.py; a head's trees: head_tree.py);
  6. commit: computed lengths advance (rejected drafts' K/V are overwritten later), full blocks are sealed into the
     prefix cache, finished requests release their blocks. A step without drafts (decode or mixed) is left in
     flight instead and committed by the next call, after it has launched the next step (overlap.py).

Exactness: a request's logits depend only on its own tokens, its random numbers on its seed and absolute positions,
its drafts on its own history; with ``coupled`` verification (the default) and context drafts its tokens are
target-only decoding's whatever the batch, drafts, pricing, preemption, prefix sharing or overlap
(tests/test_paged_engine.py, test_paged_overlap.py). Requests are engine/batch_request.BatchRequest records, events
BatchEvent, as for BatchEngine: the server (serve/core.py, in the engine process) drives either.
"""
from __future__ import annotations

import dataclasses
import itertools
import time
from typing import Optional

import torch

from tilespec.verify.registry import resolve_method
from tilespec.verify.types import SamplingParams

from ..batch_request import BatchEvent, BatchRequest, check_request, keep_plain, keep_tokens
from ..generation import eos_ids
from ..inputs import context_limit, vocab_limit
from .admission import Admission
from .blocks import (BlockManager, KVCacheTooLarge, default_blocks, free_memory, kv_too_large, out_of_memory,
                     warm_up_out_of_memory)
from .draft_model import kv_bytes_per_token, paged_drafts
from .grammar import advance, compiled, cut_drafts, mask_logits
from .layout import decode_inputs, fed_item, mixed_inputs
from .model import PagedModel
from .overlap import InFlight, Sample, blocked, placeholder, plain, resolve
from .piecewise import mixed_bucket, mixed_buckets
from .pricing import Acceptance, DraftGate, StepCosts, observe, price_drafts
from .scheduler import Item, Scheduler, Seq
from .support import paged_drafter
from .tree import TreeVerify, is_paged_tree, tree_gamma, tree_ok
from .shapes import bucket
from .verify_rows import emitted_logprobs, score_prompts, verify_rows

COUNTERS = ("steps", "decode_graph_steps", "prefill_tokens", "generated_tokens", "drafted", "accepted", "spec_steps",
            "requests_finished", "requests_cancelled", "preemptions", "admissions_deferred", "steps_drafter_off",
            "steps_overlapped", "host_plan_seconds", "host_launch_seconds", "host_wait_seconds", "host_commit_seconds")


class PagedEngine:
    """Serve ``target`` (a Llama-family transformers model) with continuous batching over paged K/V.

    draft: None, "ngram", "suffix", a context Drafter, a Llama-family draft model (draft_model.py) or a trained head
    ("head", "head+ngram", a head folder, a HeadDrafter: head.py); gamma: cap per request and step; max_batch: running
    requests at most; token_budget: tokens per forward (decode rows with their drafts + prefill chunks); block_size:
    slots per block (a power of two > gamma); num_blocks: K/V blocks (default: ``kv_fraction`` of the free GPU memory,
    at most max_batch full-length requests; on CPU at most 2 GiB; blocks the device cannot hold raise
    blocks.KVCacheTooLarge, an OutOfMemoryError saying what was asked, what is free and what to lower); max_len:
    longest prompt + max_tokens (default the model's context); prefix_caching: share full prompt blocks between
    requests; pricing: each step verifies the drafts that pay by the measured cost model (pricing.py; False: every
    offered draft, for comparisons); max_admission_wait: seconds a waiting request may be held so that prefills
    coalesce (admission.py; 0: admit at once); overlap: plan and launch the next decode step before the last one's
    tokens reach the host (overlap.py; False: every step synchronous). compile: CUDA graphs + torch.compile on CUDA.
    deterministic: batch-invariant operators (model.py): a request's logits bitwise the same whatever the batch, load,
    prefix cache or drafts. Not thread-safe: one thread calls submit, cancel and step.
    """

    finished = False

    def __init__(self, target, draft=None, *, max_batch: int = 64, gamma: int = 4, token_budget: int = 2048,
                 block_size: int = 16, num_blocks: Optional[int] = None, kv_fraction: float = 0.5,
                 max_len: Optional[int] = None, prefix_caching: bool = True, method: str = "coupled",
                 compile: bool = False, pricing: bool = True, max_admission_wait: float = 0.1,
                 overlap: bool = True, eos_token_id=None, pad_token_id: int = 0, tokenizer=None, deterministic=False):
        drafter = paged_drafter(target, draft)
        if not (isinstance(max_batch, int) and max_batch >= 1):
            raise ValueError(f"max_batch must be an integer >= 1, got {max_batch!r}")
        if not 0.0 < kv_fraction <= 1.0:
            raise ValueError(f"kv_fraction must be in (0, 1], got {kv_fraction!r}")
        if not (isinstance(gamma, int) and 0 <= gamma < 32):
            raise ValueError(f"gamma must be an integer in [0, 32), got {gamma!r}")
        gamma = gamma if drafter is not None else 0
        gamma, self.depth = tree_gamma(drafter, gamma) if is_paged_tree(drafter) else (gamma, gamma)   # tree.py
        if gamma >= block_size:
            raise ValueError(f"gamma {gamma} must be below block_size {block_size} (padding rows share one block)")
        if token_budget < max_batch * (1 + gamma):
            token_budget = max_batch * (1 + gamma)        # a full decode batch always fits one step
        self.drafter, self.gamma, self.device = drafter, gamma, next(target.parameters()).device
        self.method = resolve_method(method, self.device)
        self.max_batch, self.pricing, self.overlap = max_batch, bool(pricing), bool(overlap)
        self._inflight: Optional[InFlight] = None      # a decode step launched, its tokens not yet committed
        self.max_len = min(max_len or context_limit(target) or 4096, context_limit(target) or 1 << 30)
        self.vocab = vocab_limit(target)
        self.eos, self.pad = eos_ids(target, tokenizer, eos_token_id), int(pad_token_id)
        block_bytes = kv_bytes_per_token(target, drafter if gamma else None) * block_size
        chosen = num_blocks is not None         # by the caller, else sized here from the free memory
        self._block_bytes, self._kv_fraction, self._blocks_chosen = block_bytes, kv_fraction, chosen
        if not chosen:
            num_blocks = default_blocks(block_bytes, max_batch * (-(-self.max_len // block_size)) + 1, kv_fraction,
                                        self.device)
        try:        # the K/V caches: the target's here, a draft model's or a head's in paged_drafts
            self._build(target, drafter, num_blocks, block_size, prefix_caching, token_budget, max_batch, gamma,
                        max_admission_wait, compile, deterministic)
        except KVCacheTooLarge:
            failed = True
        else:
            failed = False
        if failed:      # out of the except: the failed allocation's frames, and any caches made, are gone now
            self.model = self.drafts = None
            raise kv_too_large(num_blocks, block_size, block_bytes, self.device, free_memory(self.device),
                               kv_fraction, chosen)
        self.tokenizer, self.grammars = tokenizer, None          # grammars: compiled on the first request with one
        self.seqs: dict = {}                  # rid -> Seq
        self._ids, self._order = itertools.count(), itertools.count()
        self.counters = dict.fromkeys(COUNTERS, 0)

    def _build(self, target, drafter, num_blocks: int, block_size: int, prefix_caching: bool, token_budget: int,
               max_batch: int, gamma: int, max_admission_wait: float, compile: bool,
               deterministic: bool) -> None:
        """The model runners over ``num_blocks`` K/V blocks, the block manager and the scheduler."""
        self.model = PagedModel(target, num_blocks, block_size, compile=compile, deterministic=deterministic)
        self.vocab_out = self.model.native.lm_head.shape[0]
        self.blocks = BlockManager(num_blocks, block_size, prefix_caching)
        self.scheduler = Scheduler(self.blocks, token_budget=token_budget, max_seqs=max_batch)
        self.costs = StepCosts()              # seconds per decode step shape (warm-up seeds, then served steps)
        self.admission = Admission(max_admission_wait)
        self.fixed_shapes = self.model.graphs  # steps padded to their shape (graphs replay them)
        self.mixed_sizes = mixed_buckets(self.scheduler.token_budget)
        self.acceptance = Acceptance(gamma) if drafter is not None and gamma > 0 else None
        self.gate = DraftGate() if self.acceptance is not None and self.pricing else None
        self.drafts = paged_drafts(self, drafter, compile)      # a draft model's or a head's runner, trees, or None
        self.trees = self.drafts if isinstance(self.drafts, TreeVerify) else None

    # ------------------------------------------------------------------------------------------------ requests
    @property
    def capacity_tokens(self) -> int:
        return (self.blocks.num_blocks - 1) * self.blocks.block_size

    waiting = property(lambda self: self.scheduler.waiting)
    running = property(lambda self: len(self.scheduler.running))

    @property
    def has_work(self) -> bool:
        return bool(self.scheduler.waiting or self.scheduler.running or self._inflight is not None)

    def kv_bytes_in_use(self) -> int:
        used = self.blocks.num_blocks - 1 - self.blocks.num_free
        return used * self.blocks.block_size * kv_bytes_per_token(self.model.native.model, self.drafts and self.drafter)

    @property
    def max_request_len(self) -> int:
        """The most positions (prompt + max_tokens) one request may take: the context, within the K/V blocks."""
        return min(self.max_len, self.capacity_tokens - self.gamma)

    def check(self, req: BatchRequest) -> None:
        """Raise ValueError with the reason when ``req`` cannot be served (before admission)."""
        check_request(req, self.max_request_len, self.vocab)
        if req.grammar is not None:
            compiled(self, req)

    def submit(self, req: BatchRequest) -> int:
        self.check(req)
        req.rid, req.t_submit = next(self._ids), time.perf_counter()
        req.cap = self.depth if req.gamma is None else min(req.gamma, self.depth)
        req.cap = req.cap if self.trees is None or tree_ok(req) else 0
        stops = frozenset(req.stop_token_ids) | (frozenset() if req.ignore_eos else frozenset(self.eos))
        if req.logits is not None and req.logits.min_tokens > 0:       # min_tokens bans the request's stop ids
            req.logits = dataclasses.replace(req.logits, banned=tuple(sorted(stops)))
        seq = Seq(req=req, tokens=list(req.prompt), order=next(self._order), stops=stops,
                  prompt_key=hash(tuple(req.prompt)), plain=plain(req))
        if req.grammar is not None:
            seq.matcher = self.grammars.matcher(compiled(self, req))
        if req.prompt_logprobs is not None:     # every prompt position computed, none taken from the cache
            seq.cacheable, seq.prompt_lps = False, []
        if self.acceptance is not None:
            seq.context, seq.told = (self.drafts or self.drafter).start([req.prompt]), len(req.prompt)
            seq.acceptance = self.acceptance.new_request()
        self.seqs[req.rid] = seq
        self.scheduler.add(seq)
        return req.rid

    def cancel(self, rid: int) -> Optional[BatchRequest]:
        """Drop request ``rid`` (waiting or running): its blocks are released at once."""
        seq = self.seqs.get(rid)
        if seq is None:
            return None
        self._retire(seq, "cancelled")
        return seq.req

    def _retire(self, seq: Seq, reason: str) -> None:
        self.scheduler.remove(seq)
        self.seqs.pop(seq.req.rid, None)
        seq.req.finish_reason, seq.req.t_end = reason, time.perf_counter()
        self.counters["requests_cancelled" if reason == "cancelled" else "requests_finished"] += 1

    def generate(self, prompts, max_new_tokens: int = 128, sampling: Optional[SamplingParams] = None, seed=0,
                 tokenizer=None):
        """Offline generation on this engine (engine/paged/offline.py) -> GenerationOutput."""
        from .offline import generate
        return generate(self, prompts, max_new_tokens, sampling, seed, tokenizer)

    def warm_up(self, max_context: Optional[int] = None, log=None) -> int:
        """Compile and capture every step shape before serving (engine/paged/warmup.py); returns how many ran. Out of
        device memory there: KVCacheTooLarge naming the cache's share and what to lower."""
        from .warmup import warm_up
        try:
            return warm_up(self, max_context, log)
        except RuntimeError as err:
            if not out_of_memory(err) or isinstance(err, KVCacheTooLarge):
                raise
        # out of the except: the failed capture's frames and tensors are released before the error travels
        raise warm_up_out_of_memory(self.blocks.num_blocks, self._block_bytes, self._kv_fraction, self._blocks_chosen,
                                    self.max_batch)

    # ------------------------------------------------------------------------------------------------ the loop
    def _gate(self, admit: bool) -> Optional[tuple]:
        """(rows bucket, whether the drafter runs) for this step's decode rows, when the draft gate decides (priced,
        with a drafter); None otherwise. A step that will prefill (``admit``: waiting requests may join) takes the
        gate's measured winner without exploring (pricing.DraftGate)."""
        running = self.scheduler.running
        # Seq.decoding inlined: its two properties cost 44 us a step at 256 rows, this 16
        decoding = sum([len(seq.tokens) - seq.computed == 1 for seq in running]) if self.gate is not None else 0
        if not decoding:
            return None
        mixed = decoding < len(running) or (admit and bool(self.scheduler.waiting))
        gated = (bucket(decoding), self.gate.drafting(bucket(decoding), explore=not mixed))
        self.counters["steps_drafter_off"] += not gated[1]
        return gated

    def _propose(self, drafting: bool) -> None:
        """Every decoding request's context drafts (none when the drafter is off this step: then the loop only
        clears, since at 256 rows computing each request's cap cost 0.4 ms a step of host time; Seq.propose)."""
        if not drafting:
            for seq in self.scheduler.running:
                if seq.drafts:
                    seq.drafts = []
            return
        for seq in self.scheduler.running:
            req = seq.req
            cap = min(req.cap, req.max_tokens - len(req.tokens) - 1) if seq.decoding and seq.context else 0
            seq.drafts = seq.propose(cap) if cap > 0 else []

    @torch.inference_mode()
    def step(self) -> list:
        """One iteration (see the module docstring). Returns the BatchEvent of every request that got tokens or
        ended. A decode step without drafts is left in flight (overlap.py): its events come with the next call."""
        started = time.perf_counter()
        admit = self._admits(started)
        gated = self._gate(admit)
        drafting = self.acceptance is not None and (gated is None or gated[1])
        prev, events = self._inflight, []
        if prev is not None and blocked(self, drafting, admit and bool(self.scheduler.waiting)):
            events, started = self._land(prev), time.perf_counter()   # the wait is that step's cost, not this one's
            self._observe(prev.sample, started - prev.sample.started if prev.sample else 0.0)
            prev = None
            admit = self._admits(started)      # the requests that just ended may have emptied the batch
        self._inflight = None
        self.counters["admissions_deferred"] += not admit and bool(self.scheduler.waiting)
        self._propose(drafting)
        items = self.scheduler.schedule(admit)
        self.counters["preemptions"] = self.scheduler.preemptions
        if not items:
            if prev is not None:
                return events + self._land(prev)
            if self.scheduler.waiting and not self.scheduler.running:
                raise RuntimeError("the paged engine could not admit a checked request into an empty cache")
            return events
        sampling, decoding, prefill = [], [], 0      # one pass: at 256 rows each pass over the items costs
        for it in items:                            # tens of microseconds of the host's step
            if it.samples:
                sampling.append(it)
            if len(it.seq.tokens) - it.seq.computed == 1:     # decoding (it samples: its one token is its last)
                decoding.append(it)
            else:
                prefill += it.n
        decode_only = len(decoding) == len(items)
        if self.grammars is not None:
            cut_drafts(sampling)                # drafts the grammar refuses are cut before pricing
        priced = self.acceptance if self.pricing and self.trees is None else None     # trees: verified uncut
        shape = price_drafts(decoding, priced, self.costs, self.gamma, self.counters["steps"])
        q = self.drafts.run(items, sampling, prev) if self.drafts is not None else None     # the draft model's law
        fed = [fed_item(it, self.blocks.block_size) for it in items]
        if self.trees is not None:
            self.trees.lay_out(items, fed)
        self.counters["prefill_tokens"] += prefill
        captures, planned, scored = self.model.captures, time.perf_counter(), 0     # host seconds by phase: counters
        self.counters["host_plan_seconds"] += planned - started
        if decode_only:
            width = 1 + self.gamma if shape[2] else 1
            inputs = decode_inputs(fed, shape, width, pad_id=self.pad, block_size=self.blocks.block_size,
                                   device=self.device, fixed=self.fixed_shapes)
            if prev is not None:
                resolve(inputs.tokens, prev)
            logits = self.model.decode(inputs).view(-1, width, self.vocab_out)     # bucket rows: absent ones too
            self.counters["decode_graph_steps"] += int(self.model.graphs)
        else:
            width = 1 + (self.gamma if any(it.seq.drafts for it in sampling) else 0)
            size = mixed_bucket(sum(len(f.tokens) for f in fed), self.mixed_sizes) if self.fixed_shapes else 0
            inputs = mixed_inputs(fed, width, device=self.device, pad_to=size or 0, pad_id=self.pad,
                                  block_size=self.blocks.block_size)
            if prev is not None:
                resolve(inputs.tokens, prev)
            logits, scored = self.model.mixed(inputs), sum(f.scored for f in fed)
            if scored:                          # the prompt tokens' rows come last
                score_prompts(items, fed, logits[logits.shape[0] - scored:])
                logits = logits[:logits.shape[0] - scored]
            logits = logits.view(-1, width, self.vocab_out)
        flight = None
        if self.overlap and width == 1 and sampling and not scored and all(it.seq.plain for it in sampling):
            flight = self._launch(items, sampling, logits, Sample(not decode_only, shape, gated, started=started))
        self.counters["host_launch_seconds"] += time.perf_counter() - planned
        if prev is not None:            # the previous step's tokens, while the device runs this one
            events += self._land(prev)
            self.counters["steps_overlapped"] += 1
            if flight is not None:      # the device starts this step about now: a drain measures from here
                flight.sample.started = time.perf_counter()
        if flight is None:
            own = self._verify_and_commit(items, sampling, logits, q)
            made = sum(len(e.tokens) for e in own)
        else:
            self._inflight, own, made = flight, [], len(sampling)
        self.counters["steps"] += 1
        if self.model.captures != captures:     # a step that captured a graph is no sample
            if flight is not None:
                flight.sample = None
        elif prev is not None or flight is None:    # the call waited for the step it landed, or ran its own
            wall = time.perf_counter() - started
            self._observe(prev.sample if prev is not None else Sample(not decode_only, shape, gated, made), wall)
        return events + own

    def _observe(self, sample: Optional[Sample], wall: float) -> None:
        observe(sample, wall, self.admission, self.costs, self.gate)

    def _admits(self, now: float) -> bool:
        waiting = (seq.req.t_submit for seq in self.scheduler.waiting)
        return self.admission.admit(now, waiting, len(self.scheduler.running))

    def _launch(self, items: list, sampling: list, logits: torch.Tensor, sample: Sample) -> InFlight:
        """Verify a step without drafts and leave it in flight: each sampling request's token is a placeholder until
        :meth:`_land` (overlap.py); its position, slot and length budget are known now. Fed tokens that are no
        placeholder (prompt chunks) are in the cache once the step runs: their blocks are sealed now."""
        result, _ = verify_rows(sampling, logits, pad=self.pad, method=self.method)
        flight = InFlight.launch(sampling, result.output_tokens)
        flight.sample = dataclasses.replace(sample, made=len(sampling))
        for it in items:
            if not it.samples:
                it.seq.computed = it.start + it.n
                self.blocks.seal(it.seq.tokens, it.seq.table, it.seq.keys, it.seq.sealable(it.seq.computed))
        bs = self.blocks.block_size
        for row, it in enumerate(sampling):
            seq = it.seq
            seq.computed = it.start + it.n                  # the fed tokens are in the cache
            # none of the fed tokens a placeholder (a prompt's end): sealed now, so twins find it
            if not seq.pending and seq.computed // bs > len(seq.keys):
                self.blocks.seal(seq.tokens, seq.table, seq.keys, seq.sealable(seq.computed))
            seq.tokens.append(placeholder(row))
            seq.pending += 1
            seq.held = len(seq.req.tokens) + seq.pending >= seq.req.max_tokens     # its last token is in flight
        return flight

    def _land(self, flight: InFlight) -> list:
        """Wait for a step in flight and commit its tokens (requests that ended or were cancelled meanwhile are
        skipped: their extra row is dropped)."""
        events, t0 = [], time.perf_counter()
        tokens = flight.wait()
        t1 = time.perf_counter()
        self.counters["host_wait_seconds"] += t1 - t0
        bs, kept = self.blocks.block_size, 0
        for it, token in zip(flight.items, tokens):
            seq = it.seq
            req = seq.req
            seq.pending -= 1
            if req.finish_reason is not None:
                continue
            seq.tokens[it.start + it.n] = token
            if seq.matcher is None and keep_plain(req, token, seq.stops):     # most rows: no event fields to fill
                events.append(BatchEvent(req.rid, [token]))
                kept += 1
            else:
                events.append(self._commit(it, 0, [token], placed=True))
                if req.finish_reason is not None:
                    continue
            seq.held = len(req.tokens) + seq.pending >= req.max_tokens
            upto = min(seq.computed, len(seq.tokens) - seq.pending)     # sealed up to the first token in flight
            if upto // bs > len(seq.keys):
                self.blocks.seal(seq.tokens, seq.table, seq.keys, seq.sealable(upto))
        self.counters["generated_tokens"] += kept
        self.counters["host_commit_seconds"] += time.perf_counter() - t1
        return events

    def _verify_and_commit(self, items: list, sampling: list, logits: torch.Tensor, q=None) -> list:
        for it in items:                    # every fed token up to the sampling point is now in the cache
            if not it.samples:
                it.seq.computed = it.start + it.n
        events = []
        if sampling:
            if self.grammars is not None:
                mask_logits(sampling, logits)
            host, logprobs = self._verify(sampling, logits, q)
            for it, row, lp in zip(sampling, host, logprobs):
                if it.seq.req.finish_reason is not None:     # ended by the step landed before this one's verify
                    continue
                events.append(self._commit(it, len(it.seq.drafts), row[1:1 + row[0]], lp))
        for it in items:
            seq = it.seq
            if seq.req.finish_reason is None:
                self.blocks.seal(seq.tokens, seq.table, seq.keys, seq.sealable(seq.computed))
        return events

    def _verify(self, sampling: list, logits: torch.Tensor, q=None) -> tuple:
        """verify_rows.py's verify (``q``: the draft model's draft logits), then its tokens on the host -> per
        request [num_emitted, tokens...], and per request its tokens' logprobs (None unless it asked)."""
        if self.trees is not None:
            return self.trees.verify(sampling, logits)
        result, logits = verify_rows(sampling, logits, pad=self.pad, method=self.method, draft_logits=q)
        n, reqs = len(sampling), [it.seq.req for it in sampling]
        host = torch.cat([result.num_emitted[:n, None], result.output_tokens[:n]], dim=1).cpu().tolist()
        return host, emitted_logprobs(logits, reqs, result, [row[0] for row in host])

    def _commit(self, it: Item, drafted: int, new: list, logprobs: Optional[list] = None,
                placed: bool = False) -> BatchEvent:
        """Record a request's verified tokens ``new``; ``placed``: a landed step's one token, already in its
        placeholder's place (computed advanced at launch)."""
        seq, req = it.seq, it.seq.req
        first = not req.tokens
        if not placed:
            seq.computed = it.start + it.n + len(new) - 1       # fed tokens + accepted drafts
        if seq.context is not None and drafted:
            self.acceptance.observe(seq.acceptance, drafted, len(new) - 1, self.counters["steps"])
            req.drafted += drafted
            req.accepted += len(new) - 1
            self.counters["drafted"] += drafted
            self.counters["accepted"] += len(new) - 1
            self.counters["spec_steps"] += 1
        new, ended = advance(seq.matcher, new) if seq.matcher is not None else (new, False)
        toks, reason = keep_tokens(req, new, seq.stops, time.perf_counter())
        reason = "stop" if ended else reason        # its grammar terminated (also when EOS is ignored)
        if not placed:
            seq.tokens += toks
        self.counters["generated_tokens"] += len(toks)
        if reason is not None:
            self._retire(seq, reason)
        return BatchEvent(rid=req.rid, tokens=toks, finish_reason=reason,
                          logprobs=None if logprobs is None else logprobs[:len(toks)],
                          prompt_logprobs=seq.prompt_lps if first else None)

