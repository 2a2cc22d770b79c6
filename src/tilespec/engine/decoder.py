"""``SpeculativeDecoder``: exact speculative decoding over Hugging Face models, batched and streaming.

Loop per step (B active requests, write pointer W; see state.py for the cache layout and invariants):
  1. draft γ tokens autoregressively with the draft's slot cache (first forward re-feeds [prev, pending]);
  2. one target forward over [pending, d_1..d_γ] at slots [W, W+γ];
  3. ``verify()`` (any registered method), keyed by per-request seeds and absolute positions;
  4. one host read of the emitted counts and tokens; mark the accepted slots valid, advance W by max accepted + 1.
     Rejected slots become masked holes (rollback copies nothing); finished requests (EOS / length) leave the batch.
With no draft (``draft=None``) the same machinery decodes target-only, the baseline of the benchmarks. A step with
γ = 0 (the budget leaves nothing to draft, or the ``optimal`` schedule fell back for good because speculation is
predicted to be slower) is a target-only step: no draft forward, verify() with K = 0, not fed to the schedule. After
the fallback the draft runner is never touched again in that generation (its cache is left stale).
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field, replace
from typing import Iterator, Optional

import torch

from tilespec.verify.registry import get_method
from tilespec.verify.types import SamplingParams
from tilespec.verify.validation import resolve_sampling

from .gamma import GammaSchedule
from .metrics import PhaseTimer, RunStats, peak_memory
from .prompts import encode_prompts
from .runner import ModelRunner, is_encoder_decoder, make_runner, shares_encoder
from .state import BatchState, left_pad, prefill_mask
from .step import speculative_step
from .step_graph import step_graphs_for


_COMPILED_RUNNERS: dict = {}


def release_compiled() -> None:
    """Drop every cached compiled runner (their graphs and KV buffers)."""
    _COMPILED_RUNNERS.clear()


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


def _select_sampling(sampling: SamplingParams, rows: list) -> SamplingParams:
    """Restrict per-request sampling fields to the original request indices ``rows``."""
    changes = {}
    for name in ("temperature", "top_k", "top_p", "min_p", "lenience"):
        value = getattr(sampling, name)
        if isinstance(value, torch.Tensor) and value.ndim > 0:
            changes[name] = value[torch.as_tensor(rows, device=value.device)]
        elif isinstance(value, (list, tuple)):
            changes[name] = [value[r] for r in rows]
    return replace(sampling, **changes) if changes else sampling


def _eos_ids(model, tokenizer, eos_token_id) -> set:
    if eos_token_id is None:
        eos_token_id = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
        if eos_token_id is None and tokenizer is not None:
            eos_token_id = tokenizer.eos_token_id
    if eos_token_id is None:
        return set()
    return {int(eos_token_id)} if isinstance(eos_token_id, int) else {int(e) for e in eos_token_id}


class SpeculativeDecoder:
    """Speculative decoding of ``target`` with ``draft`` (or target-only decoding when ``draft`` is None).

    Args:
        target, draft: transformers models (decoder-only causal LMs, or Whisper-style encoder-decoders) on the same
            device with the same vocabulary. A draft sharing the target's encoder weights reuses its encoder output.
        gamma: draft length (initial value for adaptive schedules); gamma_schedule: "constant" | "heuristic" |
            "optimal" (see gamma.py); max_gamma caps adaptive schedules.
        fallback_below: "optimal" only: once the estimates are measured, fall back to target-only decoding for the
            rest of a generation when the best predicted speedup (Leviathan Thm 3.8) is below this (0 disables).
        method: verification method name ("reference", "hf", "fused", ...); method_options: its options (e.g.
            sigmoid's {"alpha": -1e3, "beta": 1e3}), validated here and part of the verify graph's key.
        sampling: SamplingParams (scalars, or per-request sequences matching the batch).
        tokenizer: optional; needed for string prompts and decoded texts. String prompts are encoded by
            :func:`tilespec.engine.prompts.encode_prompts`: wrapped in the tokenizer's chat template when it has one
            (as the CLI and ``tilespec.generate`` do); ``chat=False`` tokenizes the raw text.
        compile: the fast path for the decode/verify steps (see ``engine.runner.step_mode``): True or "graphs" =
            CUDA-graph replay of every forward, the draft sampler and verify (CUDA; True means eager on CPU);
            "compiled-graphs" = also torch.compile the norms/MLPs (experimental); another string = that
            torch.compile mode; "debug" = dynamo with the eager backend, for CPU tests. Shapes stay
            static (fixed B, slot capacity, q in {1, 2, γ+1}): finished requests stay in the batch, ignored.
        eos_token_id: int or list; defaults to the target's generation config / the tokenizer.
        graph_verify: on the CUDA-graph paths, also replay ``verify()`` as a graph (methods that never sync with the
            host, scalar sampling parameters). False keeps verification eager, e.g. to time every method the same
            way as a baseline that cannot be captured.
        cache_slack: extra KV slots per request for the holes ragged acceptance leaves (default: max_new_tokens
            when B > 1); when the write pointer reaches the capacity the caches are defragmented (one copy).
    """

    def __init__(self, target, draft=None, *, gamma: int = 5, gamma_schedule: str = "constant", max_gamma: int = 16,
                 method: str = "reference", sampling: SamplingParams = SamplingParams(), tokenizer=None,
                 compile: bool | str = False, eos_token_id=None, pad_token_id: Optional[int] = None,
                 cache_slack: Optional[int] = None, graph_verify: bool = True, fallback_below: float = 1.0,
                 method_options: Optional[dict] = None, chat: bool = True):
        if not hasattr(target, "config"):
            raise TypeError(f"target must be a Hugging Face model, got {type(target).__name__}")
        if draft is not None and not hasattr(draft, "config"):
            raise TypeError(f"draft must be a Hugging Face model or None, got {type(draft).__name__}")
        if not isinstance(sampling, SamplingParams):
            raise TypeError(f"sampling must be a SamplingParams, got {type(sampling).__name__}")
        GammaSchedule(gamma_schedule, gamma, max_gamma, fallback_below=fallback_below)  # validates them early
        self.method_options = get_method(method).resolve_options(method_options)  # bad ones fail here, not mid-run
        if draft is not None:
            if is_encoder_decoder(target) != is_encoder_decoder(draft):
                raise ValueError("target and draft must both be decoder-only or both encoder-decoder")
            tv = target.get_output_embeddings().weight.shape[0]
            dv = draft.get_output_embeddings().weight.shape[0]
            if tv != dv:
                raise ValueError(f"vocabulary mismatch: target has {tv} output tokens, draft has {dv}")
            if next(target.parameters()).device != next(draft.parameters()).device:
                raise ValueError("target and draft must be on the same device")
        self.target, self.draft = target, draft
        self.gamma, self.gamma_schedule, self.max_gamma = gamma, gamma_schedule, max_gamma
        self.fallback_below = fallback_below
        self.method, self.sampling, self.tokenizer, self.compile = method, sampling, tokenizer, compile
        self.eos = _eos_ids(target, tokenizer, eos_token_id)
        if pad_token_id is None and tokenizer is not None:
            pad_token_id = tokenizer.pad_token_id
        self.pad_id = int(pad_token_id) if pad_token_id is not None else (min(self.eos) if self.eos else 0)
        self.device = next(target.parameters()).device
        self.cache_slack = cache_slack
        self.graph_verify = graph_verify
        self.chat = chat
        self.last_stats: Optional[RunStats] = None

    # ----------------------------------------------------------------------------------------------- inputs
    def _prompt_lists(self, input_ids, prompts) -> list:
        if (input_ids is None) == (prompts is None):
            raise ValueError("pass exactly one of input_ids and prompts")
        if prompts is not None:
            if self.tokenizer is None:
                raise ValueError("string prompts need a tokenizer (SpeculativeDecoder(..., tokenizer=...))")
            prompts = [prompts] if isinstance(prompts, str) else list(prompts)
            return encode_prompts(self.tokenizer, prompts, self.chat)
        if isinstance(input_ids, torch.Tensor):
            if input_ids.ndim == 1:
                input_ids = input_ids[None]
            if input_ids.ndim != 2 or input_ids.dtype.is_floating_point:
                raise ValueError(f"input_ids must be an integer tensor [B, L], got {tuple(input_ids.shape)}")
            return input_ids.tolist()
        lists = list(input_ids)
        if lists and isinstance(lists[0], int):
            lists = [lists]
        return [list(map(int, p)) for p in lists]

    def _runner(self, name: str, model, capacity: int, batch: int) -> ModelRunner:
        """Compiled runners are shared process-wide per (model, role, capacity, batch, compile mode), so decoders
        that differ only in sampling or verify method reuse the same graphs; eager runners are rebuilt."""
        key = (id(model), name, capacity, batch, str(self.compile))
        reuse = self.compile and not is_encoder_decoder(model)  # a cross-attention cache cannot be reset in place
        if reuse and key in _COMPILED_RUNNERS and _COMPILED_RUNNERS[key].model is model:
            return _COMPILED_RUNNERS[key]
        runner = make_runner(model, capacity, compile=self.compile)
        if reuse:
            _COMPILED_RUNNERS[key] = runner
        return runner

    # ----------------------------------------------------------------------------------------------- decoding
    @torch.inference_mode()
    def stream(self, input_ids=None, *, prompts=None, max_new_tokens: int = 64, seed=0,
               input_features: Optional[torch.Tensor] = None) -> Iterator[StepEvent]:
        """Decode and yield a :class:`StepEvent` per step; stats land in ``self.last_stats`` at the end.

        input_ids: token lists / [B, L] tensor (no padding), or prompts: str / list of str (needs a tokenizer).
        For encoder-decoder models input_ids are the decoder prompts (e.g. Whisper's forced prefix) and
        input_features [B, mels, frames] feed the encoder.
        seed: int (request i uses seed + i) or per-request list; drives the counter-based random streams.
        """
        if not isinstance(max_new_tokens, int) or max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be an integer >= 1, got {max_new_tokens!r}")
        prompt_lists = self._prompt_lists(input_ids, prompts)
        batch = len(prompt_lists)
        encdec = is_encoder_decoder(self.target)
        if encdec and input_features is None:
            raise ValueError("an encoder-decoder target needs input_features")
        if encdec and input_features.shape[0] != batch:
            raise ValueError(f"input_features has {input_features.shape[0]} rows for {batch} decoder prompts")
        ids, is_tok = left_pad(prompt_lists, self.pad_id, self.device)
        width = ids.shape[1]
        spec = self.draft is not None
        g_max = self.max_gamma if self.gamma_schedule != "constant" else self.gamma
        slack = self.cache_slack if self.cache_slack is not None else (0 if batch == 1 else max_new_tokens)
        capacity = width + max_new_tokens + slack + (g_max + 2 if spec else 2)
        if self.compile:  # round up so prompts of similar length reuse the same compiled graphs
            capacity = -(-capacity // 256) * 256
        if encdec:
            limit = getattr(self.target.config, "max_target_positions", None)
            if limit is not None and max(map(len, prompt_lists)) + max_new_tokens > limit:
                raise ValueError(f"prompt + max_new_tokens exceeds the decoder's {limit} positions")
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
        schedule = GammaSchedule(self.gamma_schedule, self.gamma, max(self.max_gamma, self.gamma),
                                 fallback_below=self.fallback_below)
        timer = PhaseTimer(self.device)
        stats = RunStats(requests=batch, method=self.method if spec else "target-only")
        t_start = time.perf_counter()

        timer.start("prefill")
        target = self._runner("target", self.target, capacity, batch)
        draft = self._runner("draft", self.draft, capacity, batch) if spec else None
        stats.runtime = target.mode
        stats.draft_runtime = draft.mode if spec else ""
        fast = step_graphs_for(target, draft) if self.graph_verify else None   # whole steps as CUDA graphs
        compile_before = sum(getattr(r, "compile_seconds", 0.0) for r in (target, draft, fast) if r is not None)
        if encdec:
            enc = target.encode(input_features)
            if spec:
                draft.encode(input_features, shared=enc if shares_encoder(self.target, self.draft) else None)
        p = width - 1
        pad_valid = is_tok[:, :p]
        positions = (pad_valid.long().cumsum(dim=1) - 1).clamp(min=0)
        pmask = prefill_mask(pad_valid, capacity)
        for runner in (target, draft) if spec else (target,):
            runner.forward(ids[:, :p], positions, pmask, 0, keep=1, compiled=False)
        valid = torch.zeros((batch, capacity), dtype=torch.bool, device=self.device)
        valid[:, :p] = pad_valid
        seeds = seed if not isinstance(seed, int) else [seed + i for i in range(batch)]
        if len(seeds) != batch:
            raise ValueError(f"got {len(seeds)} seeds for {batch} requests")
        state = BatchState(valid=valid, seq_len=is_tok.sum(dim=1), pending=ids[:, p].clone(),
                           prev=ids[:, p - 1].clone(), write=p, rows=list(range(batch)),
                           seeds=torch.as_tensor(list(seeds), dtype=torch.int64, device=self.device))
        timer.stop("prefill")

        produced = [0] * batch
        self._sequences = [[] for _ in range(batch)]
        self._reasons = ["length"] * batch
        sampling = _select_sampling(self.sampling, state.rows)
        resolved = resolve_sampling(sampling, state.size, self.device)
        step_no = 0
        done: set = set()   # compiled path: finished rows stay in the batch (static shapes) and are ignored
        while len(done) < state.size:
            live = [i for i, r in enumerate(state.rows) if r not in done]
            remaining = max(max_new_tokens - produced[state.rows[i]] for i in live)
            proposed = schedule.next() if spec else 0       # one next() per step (wrappers may count calls)
            fallback = spec and proposed == 0                # the schedule gave up on speculation for good
            gamma = min(proposed, remaining - 1)
            runners = (target, draft) if spec and not fallback else (target,)  # a fallen-back draft is never used
            if fallback:
                stats.fallback_steps += 1
                if stats.fallback_at_step is None:
                    stats.fallback_at_step = step_no
            if state.write + gamma + 1 > capacity:
                slot_index, _ = state.plan_defrag()
                rows = torch.arange(state.size, device=self.device)
                for runner in runners:
                    runner.select(rows, slot_index)
                stats.defrags += 1
            before = dict(timer.totals)
            if fast is not None and fast.usable(self.method, sampling):
                out = fast.step(state, gamma, sampling, resolved, self.method, timer,   # commits on the device
                                method_options=self.method_options)
            else:
                out = speculative_step(target, draft if gamma > 0 else None, state, gamma, sampling, resolved,
                                       self.method, timer, graph_verify=self.graph_verify,
                                       method_options=self.method_options)
            timer.start("bookkeeping")
            host = torch.cat([out.num_emitted[:, None], out.output_tokens], dim=1).cpu()   # the one sync per step
            emitted_all = host[:, 0].tolist()
            if fast is not None and fast.usable(self.method, sampling):
                fast.advance(state, max(emitted_all) - 1)
            else:
                state.commit(out.num_emitted, out.output_tokens, out.draft_tokens, max(emitted_all) - 1)
            if done:  # zombie rows (compiled path) keep no context, so they never fill the cache
                state.valid[[i for i, r in enumerate(state.rows) if r in done]] = False
            emitted = [emitted_all[i] for i in live]
            new_tokens, finished, keep = {}, [], []
            for i in live:
                r = state.rows[i]
                toks = host[i, 1:1 + emitted_all[i]].tolist()[:max_new_tokens - produced[r]]
                for j, t in enumerate(toks):
                    if t in self.eos:
                        toks = toks[:j + 1]
                        self._reasons[r] = "eos"
                        break
                self._sequences[r] += toks
                produced[r] += len(toks)
                new_tokens[r] = toks
                if self._reasons[r] == "eos" or produced[r] >= max_new_tokens:
                    finished.append(r)
                else:
                    keep.append(i)
            stats.steps += 1
            stats.target_calls += 1
            stats.draft_calls += gamma if gamma > 0 else 0
            stats.request_steps += len(live)
            stats.drafted += gamma * len(live)
            stats.accepted += sum(e - 1 for e in emitted)
            stats.tested += sum(min(e, gamma) for e in emitted) if gamma > 0 else 0
            stats.emitted += sum(emitted)
            stats.gammas.append(gamma)
            totals = timer.resolve() if timer.cuda else timer.totals
            if gamma > 0:
                schedule.update(gamma, [e - 1 for e in emitted], totals["draft"] - before["draft"],
                                totals["target"] - before["target"])
            if finished and keep and not self.compile:
                rows = state.keep_rows(keep)
                ident = torch.arange(capacity, device=self.device)[None, :].expand(len(keep), capacity)
                for runner in runners:
                    runner.select(rows, ident)
                sampling = _select_sampling(self.sampling, state.rows)
                resolved = resolve_sampling(sampling, state.size, self.device)
            elif finished:
                done.update(finished)
            timer.stop("bookkeeping")
            yield StepEvent(step=step_no, tokens=new_tokens, finished=finished)
            step_no += 1

        stats.wall_time = time.perf_counter() - t_start
        stats.compile_seconds = sum(getattr(r, "compile_seconds", 0.0) for r in (target, draft, fast)
                                    if r is not None) - compile_before
        stats.times = timer.resolve()
        stats.new_tokens = sum(produced)
        stats.kv_cache_bytes = target.memory_bytes() + (draft.memory_bytes() if spec else 0)
        stats.peak_memory_bytes = peak_memory(self.device)
        self.last_stats = stats

    def generate(self, input_ids=None, *, prompts=None, max_new_tokens: int = 64, seed=0,
                 input_features: Optional[torch.Tensor] = None) -> GenerationOutput:
        """Decode to completion; returns the new tokens per request, decoded texts (with a tokenizer) and stats."""
        for _ in self.stream(input_ids, prompts=prompts, max_new_tokens=max_new_tokens, seed=seed,
                             input_features=input_features):
            pass
        texts = None
        if self.tokenizer is not None:
            texts = [self.tokenizer.decode(s, skip_special_tokens=True) for s in self._sequences]
        return GenerationOutput(sequences=self._sequences, stats=self.last_stats, texts=texts,
                                finish_reasons=self._reasons)
