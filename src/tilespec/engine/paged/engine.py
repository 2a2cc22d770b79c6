"""The paged engine: continuous batching over paged K/V with prefix caching, chunked prefill in the decode batch,
and context speculation verified exactly per request.

One iteration (:meth:`PagedEngine.step`):
  1. every decoding request proposes its context drafts (ngram / suffix; none where the load switch says drafting
     does not pay at this batch size, engine/spec_switch.py);
  2. the scheduler (scheduler.py) picks the items: decode rows with their drafts first, then prompt chunks of
     waiting requests, within a token budget; it grows block tables, preempts when blocks run out;
  3. one forward (model.py) over every item's tokens; a step of decode rows alone replays a CUDA graph per
     (rows bucket, width);
  4. ``verify()`` on the rows that sample ([N, K + 1, V] logits, ragged draft counts, per-request seeds keyed by
     absolute position): accepted drafts and one more token per request;
  5. bookkeeping: computed lengths advance past the fed tokens and accepted drafts (rejected drafts' K/V are simply
     overwritten later: rollback copies nothing), full blocks are sealed into the prefix cache, finished requests
     release their blocks.

Exactness: a request's logits depend only on its own tokens; its random numbers are keyed by its seed and absolute
positions; its drafts come from its own history. With ``coupled`` verification (the default) and context drafts its
tokens are those of target-only decoding, whatever was drafted, so the load switch, preemption, prefix sharing and
the rest of the batch change none of its tokens (tests/test_paged_engine.py).
The requests are engine/batch_request.BatchRequest records and the events BatchEvent, as for BatchEngine: the server
(serve/core.py, in the engine process) drives either.
"""
from __future__ import annotations

import dataclasses
import itertools
import time
from typing import Optional

import torch

from tilespec.verify.api import verify
from tilespec.verify.logit_transforms import TransformBatch, transform_logits
from tilespec.verify.registry import resolve_method
from tilespec.verify.types import SamplingParams

from ..batch_request import BatchEvent, BatchRequest, check_request, keep_tokens
from ..drafters import Drafter, resolve_drafter
from ..generation import eos_ids
from ..inputs import context_limit, vocab_limit
from ..native.llama import unsupported_reason
from ..spec_switch import SpecSwitch
from .blocks import SCRATCH, BlockManager
from .model import PagedModel, StepInputs
from .scheduler import Item, Scheduler, Seq
from .shapes import bucket, table_width

CPU_KV_BYTES = 2 << 30


def paged_reason(target, draft) -> Optional[str]:
    """None when :class:`PagedEngine` can serve ``target`` with ``draft``; otherwise why not (the caller then uses
    BatchEngine): a draft model or trained head (they need a draft runner), or a target without the native
    Llama-family path."""
    reason = unsupported_reason(target)
    if reason is not None:
        return reason
    drafter = resolve_drafter(draft)
    if drafter is not None and (not drafter.has_context or drafter.model is not None or _has_runner(drafter)):
        return f"{getattr(drafter, 'name', drafter)!r} drafts with a model or a trained head"
    return None


def _has_runner(drafter) -> bool:
    """Whether the drafter has a device side of its own (a head, a tree drafter): the paged engine has none."""
    return type(drafter).runner is not Drafter.runner


class PagedEngine:
    """Serve ``target`` (a Llama-family transformers model) with continuous batching over paged K/V.

    draft: None, "ngram", "suffix" or a context Drafter (drafts from the request's own tokens); gamma: draft cap per
    request and step; max_batch: running requests at most; token_budget: tokens per forward (decode rows with their
    drafts + prefill chunks); block_size: slots per block (a power of two > gamma); num_blocks: K/V blocks (default:
    ``kv_fraction`` of the free GPU memory, at most max_batch full-length requests; on CPU at most 2 GiB); max_len: longest
    prompt + max_tokens (default the model's context); prefix_caching: share full prompt blocks between requests;
    adaptive: drafting on / off per batch size as measured (default on with a drafter: with coupled verification it
    changes no token); spec_max_batch: no drafting while more requests decode. compile: CUDA graphs + torch.compile on CUDA. Not thread-safe: one thread calls submit,
    cancel and step.
    """

    finished = False

    def __init__(self, target, draft=None, *, max_batch: int = 64, gamma: int = 4, token_budget: int = 2048,
                 block_size: int = 16, num_blocks: Optional[int] = None, kv_fraction: float = 0.5,
                 max_len: Optional[int] = None, prefix_caching: bool = True, method: str = "coupled",
                 compile: bool = False, adaptive: Optional[bool] = None, min_alpha: float = 0.1,
                 spec_max_batch: Optional[int] = None, eos_token_id=None, pad_token_id: int = 0, tokenizer=None):
        reason = paged_reason(target, draft)
        if reason is not None:
            raise ValueError(f"the paged engine drafts from the request's context (ngram, suffix) over a "
                             f"Llama-family target; {reason}: serve it with BatchEngine")
        drafter = resolve_drafter(draft)
        if not (isinstance(max_batch, int) and max_batch >= 1):
            raise ValueError(f"max_batch must be an integer >= 1, got {max_batch!r}")
        if not 0.0 < kv_fraction <= 1.0:
            raise ValueError(f"kv_fraction must be in (0, 1], got {kv_fraction!r}")
        if not (isinstance(gamma, int) and 0 <= gamma < 32):
            raise ValueError(f"gamma must be an integer in [0, 32), got {gamma!r}")
        gamma = gamma if drafter is not None else 0
        if gamma >= block_size:
            raise ValueError(f"gamma {gamma} must be below block_size {block_size} (padding rows share one block)")
        if token_budget < max_batch * (1 + gamma):
            token_budget = max_batch * (1 + gamma)        # a full decode batch always fits one step
        self.drafter, self.gamma = drafter, gamma
        self.device = next(target.parameters()).device
        self.method = resolve_method(method, self.device)
        self.max_batch, self.min_alpha, self.spec_max_batch = max_batch, min_alpha, spec_max_batch
        self.max_len = min(max_len or context_limit(target) or 4096, context_limit(target) or 1 << 30)
        self.vocab = vocab_limit(target)
        self.eos, self.pad = eos_ids(target, tokenizer, eos_token_id), int(pad_token_id)
        if num_blocks is None:
            num_blocks = self._default_blocks(target, block_size, kv_fraction)
        self.model = PagedModel(target, num_blocks, block_size, compile=compile)
        self.vocab_out = self.model.native.lm_head.shape[0]
        self.blocks = BlockManager(num_blocks, block_size, prefix_caching)
        self.scheduler = Scheduler(self.blocks, token_budget=token_budget, max_seqs=max_batch)
        if adaptive is None:
            adaptive = drafter is not None and self.method == "coupled"
        self.switch = SpecSwitch() if adaptive and drafter is not None else None
        self.seqs: dict = {}                  # rid -> Seq
        self._ids, self._order = itertools.count(), itertools.count()
        self.counters = {"steps": 0, "decode_graph_steps": 0, "prefill_tokens": 0,
                         "generated_tokens": 0, "drafted": 0, "accepted": 0, "spec_steps": 0,
                         "requests_finished": 0, "requests_cancelled": 0, "preemptions": 0}

    def _default_blocks(self, target, block_size: int, fraction: float) -> int:
        per_block = PagedModel.kv_bytes_per_token(target) * block_size
        full = self.max_batch * (-(-self.max_len // block_size)) + 1
        if self.device.type != "cuda":          # host memory: at most CPU_KV_BYTES of K/V
            return max(2, min(full, CPU_KV_BYTES // per_block))
        free, _ = torch.cuda.mem_get_info(self.device)
        return max(2, min(full, int(free * fraction) // per_block))

    # ------------------------------------------------------------------------------------------------ requests
    @property
    def capacity_tokens(self) -> int:
        return (self.blocks.num_blocks - 1) * self.blocks.block_size

    @property
    def waiting(self):
        return self.scheduler.waiting

    @property
    def running(self) -> int:
        return len(self.scheduler.running)

    @property
    def has_work(self) -> bool:
        return bool(self.scheduler.waiting or self.scheduler.running)

    def kv_bytes_in_use(self) -> int:
        used = self.blocks.num_blocks - 1 - self.blocks.num_free
        return used * self.blocks.block_size * PagedModel.kv_bytes_per_token(self.model.native.model)

    @property
    def max_request_len(self) -> int:
        """The most positions (prompt + max_tokens) one request may take: the context, within the K/V blocks."""
        return min(self.max_len, self.capacity_tokens - self.gamma)

    def check(self, req: BatchRequest) -> None:
        """Raise ValueError with the reason when ``req`` cannot be served (before admission)."""
        check_request(req, self.max_request_len, self.vocab)

    def submit(self, req: BatchRequest) -> int:
        self.check(req)
        req.rid, req.t_submit = next(self._ids), time.perf_counter()
        req.cap = self.gamma if req.gamma is None else min(req.gamma, self.gamma)
        if req.logits is not None and req.logits.min_tokens > 0:       # min_tokens bans the request's stop ids
            req.logits = dataclasses.replace(req.logits, banned=tuple(sorted(self._stops(req))))
        seq = Seq(req=req, tokens=list(req.prompt), order=next(self._order))
        if self.drafter is not None:
            seq.context = self.drafter.start([req.prompt])
        self.seqs[req.rid] = seq
        self.scheduler.add(seq)
        return req.rid

    def _stops(self, req: BatchRequest) -> set:
        """The ids that end ``req``: EOS (unless it ignores EOS) and its stop_token_ids."""
        return (set() if req.ignore_eos else set(self.eos)) | set(req.stop_token_ids)

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
        """Compile and capture every step shape before serving (engine/paged/warmup.py); returns how many ran."""
        from .warmup import warm_up
        return warm_up(self, max_context, log)

    # ------------------------------------------------------------------------------------------------ the loop
    def _draft_cap(self, seq: Seq) -> int:
        req = seq.req
        if req.cap <= 0 or (req.drafted >= 32 and req.accepted < self.min_alpha * req.drafted):
            return 0
        return max(0, min(req.cap, req.max_tokens - len(req.tokens) - 1))

    def _propose(self) -> bool:
        decoding = [s for s in self.scheduler.running if s.decoding]
        allow = self.spec_max_batch is None or len(decoding) <= self.spec_max_batch
        allow = allow and (self.switch is None or self.switch.draft(bucket(len(decoding))))
        for seq in self.scheduler.running:
            cap = self._draft_cap(seq) if allow and seq.decoding and seq.context is not None else 0
            seq.drafts = seq.context.propose(0, cap) if cap > 0 else []
        return allow and self.drafter is not None

    @torch.inference_mode()
    def step(self) -> list:
        """One iteration (see the module docstring). Returns the BatchEvent of every request that got tokens or
        ended."""
        started = time.perf_counter()
        drafting = self._propose()
        items = self.scheduler.schedule()
        self.counters["preemptions"] = self.scheduler.preemptions
        if not items:
            if self.scheduler.waiting and not self.scheduler.running:
                raise RuntimeError("the paged engine could not admit a checked request into an empty cache")
            return []
        sampling = [it for it in items if it.samples]
        decode_only = all(it.seq.decoding and it.samples for it in items)
        width = self._width(items) if decode_only else 0
        if decode_only and self.model.graphs:
            inputs = self._decode_inputs(items, width)
            logits = self.model.decode(inputs).view(-1, width, self.vocab_out)     # bucket rows: absent ones too
            self.counters["decode_graph_steps"] += 1
        else:
            inputs, width = self._mixed_inputs(items, sampling)
            logits = self.model.forward(inputs).view(-1, width, self.vocab_out)
        events = self._verify_and_commit(items, sampling, logits)
        self.counters["steps"] += 1
        if self.switch is not None and decode_only:
            emitted = sum(len(e.tokens) for e in events)
            self.switch.observe(bucket(len(items)), drafting and width > 1, time.perf_counter() - started,
                                emitted / len(items))
        return events

    def _width(self, items: list) -> int:
        """Tokens verified per sampling request this step: 1 + gamma when any request drafts (shorter drafts are
        padded), else 1 -- so the forward and verify() see few shapes (each new shape may compile or capture)."""
        return 1 + (self.gamma if any(it.seq.drafts for it in items) else 0)

    def _tensor(self, values, dtype=torch.int64) -> torch.Tensor:
        return torch.tensor(values, dtype=dtype).to(self.device, non_blocking=True)

    def _slot(self, seq: Seq, pos: int) -> int:
        bs = self.blocks.block_size
        return seq.table[pos // bs] * bs + pos % bs

    def _decode_inputs(self, items: list, width: int) -> StepInputs:
        """Every request fed ``width`` tokens (pending + drafts, padded; padding writes to the scratch block), the
        row count rounded up to a bucket with absent rows on the scratch block: a fixed shape per (bucket, width)."""
        rows = bucket(len(items))
        m = table_width(max(len(it.seq.table) for it in items))
        tokens, positions, slots, lens = [], [], [], []
        tables = [it.seq.table + [SCRATCH] * (m - len(it.seq.table)) for it in items]
        tables += [[SCRATCH] * m] * (rows - len(items))
        for it in items:
            seq = it.seq
            fed = [seq.tokens[-1]] + seq.drafts
            tokens += fed + [self.pad] * (width - len(fed))
            positions += [it.start + j for j in range(width)]
            slots += [self._slot(seq, it.start + j) for j in range(len(fed))]
            slots += [SCRATCH * self.blocks.block_size + j for j in range(len(fed), width)]
            lens.append(it.start + width)
        absent = rows - len(items)
        tokens += [self.pad] * (absent * width)
        positions += list(range(width)) * absent
        slots += list(range(width)) * absent
        lens += [width] * absent
        return StepInputs(self._tensor(tokens), self._tensor(positions), self._tensor(slots),
                          self._tensor(tables, torch.int32),
                          self._tensor(range(0, (rows + 1) * width, width), torch.int32),
                          self._tensor(lens, torch.int32), self._tensor(range(rows * width)), width)

    def _mixed_inputs(self, items: list, sampling: list) -> tuple:
        """Ragged items (prefill chunks and decode rows); logits rows: for each sampling item its last fed token
        and its drafts, padded to the widest (repeating the last row) -> (inputs, width)."""
        width = self._width(sampling)
        tokens, positions, slots, cu, lens, rows = [], [], [], [0], [], []
        m = max(len(it.seq.table) for it in items)
        tables = [it.seq.table + [SCRATCH] * (m - len(it.seq.table)) for it in items]
        for it in items:
            seq = it.seq
            fed = seq.tokens[it.start:it.start + it.n] + (seq.drafts if it.samples else [])
            base = cu[-1]
            tokens += fed
            positions += range(it.start, it.start + len(fed))
            slots += [self._slot(seq, it.start + j) for j in range(len(fed))]
            cu.append(base + len(fed))
            lens.append(it.start + len(fed))
            if it.samples:
                last = base + it.n - 1
                own = [last + j for j in range(1 + len(seq.drafts))]
                rows += own + [own[-1]] * (width - len(own))
            self.counters["prefill_tokens"] += 0 if seq.decoding else it.n
        if sampling:      # verify takes the rows bucket: the head computes the padding rows, no logits copy later
            rows += rows[:width] * ((bucket(len(sampling)) - len(sampling)))
        inputs = StepInputs(self._tensor(tokens), self._tensor(positions), self._tensor(slots),
                            self._tensor(tables, torch.int32), self._tensor(cu, torch.int32),
                            self._tensor(lens, torch.int32), self._tensor(rows),
                            max(it.width for it in items))
        return inputs, width

    def _sampling_params(self, reqs: list) -> SamplingParams:
        values = [(r.temperature, r.top_k, r.top_p, r.min_p) for r in reqs]
        if all(v == values[0] for v in values):
            return SamplingParams(*values[0])
        return SamplingParams(*[list(col) for col in zip(*values)])

    def _verify_and_commit(self, items: list, sampling: list, logits: torch.Tensor) -> list:
        for it in items:                    # every fed token up to the sampling point is now in the cache
            if not it.samples:
                it.seq.computed = it.start + it.n
        events = []
        if sampling:
            host = self._verify(sampling, logits)
            for it, row in zip(sampling, host):
                events.append(self._commit(it, len(it.seq.drafts), row[1:1 + row[0]]))
        for it in items:
            seq = it.seq
            if seq.req.finish_reason is None:
                self.blocks.seal(seq.tokens, seq.table, seq.keys, seq.computed)
        return events

    def _verify(self, sampling: list, logits: torch.Tensor) -> list:
        """verify() over the sampling requests and ``logits`` [bucket rows, 1 + K, V] (both step paths give the rows
        bucket; absent rows: no drafts, seed 0, whatever logits the padding holds), so its shapes are few -> per
        request [num_emitted, tokens...] (host)."""
        n, rows, k = len(sampling), logits.shape[0], logits.shape[1] - 1
        reqs = [it.seq.req for it in sampling]
        counts = [len(it.seq.drafts) for it in sampling] + [0] * (rows - n)
        drafts = [it.seq.drafts + [self.pad] * (k - len(it.seq.drafts)) for it in sampling]
        drafts = self._tensor(drafts + [[self.pad] * k] * (rows - n)).view(rows, k)
        settings = [r.logits if r.logits is not None and r.logits.active else None for r in reqs]
        if any(settings):        # penalties etc. on the target's law; position i counts the block's drafts < i
            logits = transform_logits(logits, drafts, TransformBatch.from_settings(
                settings + [None] * (rows - n), [r.tokens for r in reqs] + [[]] * (rows - n), self.vocab_out,
                self.device))
        result = verify(logits, drafts, num_draft_tokens=self._tensor(counts),
                        sampling=self._sampling_params(reqs + reqs[:1] * (rows - n)), method=self.method,
                        seed=self._tensor([r.seed for r in reqs] + [0] * (rows - n)),
                        offsets=self._tensor([len(it.seq.tokens) for it in sampling] + [0] * (rows - n)),
                        check_values=False)
        return torch.cat([result.num_emitted[:n, None], result.output_tokens[:n]], dim=1).cpu().tolist()

    def _commit(self, it: Item, drafted: int, new: list) -> BatchEvent:
        seq, req = it.seq, it.seq.req
        seq.computed = it.start + it.n + len(new) - 1       # fed tokens + accepted drafts
        if seq.context is not None and drafted:
            req.drafted += drafted
            req.accepted += len(new) - 1
            self.counters["drafted"] += drafted
            self.counters["accepted"] += len(new) - 1
            self.counters["spec_steps"] += 1
        toks, reason = keep_tokens(req, new, self._stops(req), time.perf_counter())
        seq.tokens += toks
        self.counters["generated_tokens"] += len(toks)
        if seq.context is not None:
            seq.context.extend(0, toks)
        if reason is not None:
            self._retire(seq, reason)
        return BatchEvent(rid=req.rid, tokens=toks, finish_reason=reason)
