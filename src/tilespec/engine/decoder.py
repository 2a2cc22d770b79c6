"""``SpeculativeDecoder``: exact speculative decoding over Hugging Face models, batched and streaming.

Loop per step (B active requests, write pointer W; see state.py for the cache layout and invariants):
  1. drafts: the drafter's host-side context drafts (ragged, matched over the tokens read in the previous step's
     host sync) or γ tokens / a token tree from its device side (drafters/base.py: the one contract);
  2. the step body (step.py; captured whole on native runners, step_graph.py): one target forward over
     [pending, d_1..d_K] at slots [W, W+K], ``verify()`` keyed by per-request seeds and absolute positions, the
     drafter's ``observe``;
  3. one host read of the emitted counts and tokens; mark the accepted slots valid, advance W by max accepted + 1.
     Rejected slots become masked holes (rollback copies nothing); finished requests (EOS / length) leave the batch.
With no draft (``draft=None``) the same machinery decodes target-only, the baseline of the benchmarks.
The loop is split into ``prefill`` / ``step`` / ``commit`` / ``finish`` over a per-generation
:class:`~tilespec.engine.generation.Generation` (``stream`` drives them), so generations never share results.
A step with γ = 0 (nothing left to draft, or ``optimal`` fell back for good: speculation predicted or measured
slower) is a target-only step: no draft forward, verify() with K = 0; the schedule gets only its wall time. After the
fallback the draft runner is never touched again in that generation (its cache is left stale).
"""
from __future__ import annotations

import time
from typing import Iterator, Optional

import torch

from tilespec import settings
from tilespec.verify.registry import get_method, resolve_method
from tilespec.verify.types import SamplingParams
from tilespec.verify.validation import resolve_sampling

from .drafters import resolve_drafter
from .drafters.trees import tree_form_of
from .gamma import GammaSchedule
from .schedule import as_schedule
from .generation import (GenerationOutput, Generation, PlannedStep, StepEvent, eos_ids, select_sampling,
                         snapshot_outputs)
from .inputs import check_request
from .leases import lease, release_compiled, shared_runner  # noqa: F401  (release_compiled: public)
from .metrics import PhaseTimer, RunStats, peak_memory
from .prompts import prompt_lists, warmup_inputs
from .runner import is_encoder_decoder
from .state import BatchState, left_pad, prefill_mask
from .step import drafts_on_device, speculative_step
from .step_graph import step_graphs_for


class SpeculativeDecoder:
    """Speculative decoding of ``target`` with ``draft`` (or target-only decoding when ``draft`` is None).

    Args:
        target: a transformers model (decoder-only causal LM, or Whisper-style encoder-decoder).
        draft: None (target-only), a draft model (same device and vocabulary; a draft sharing the target's encoder
            weights reuses its encoder output), "ngram" / "suffix" (context drafting, no model), a
            :class:`~tilespec.engine.drafters.Drafter`, or [model, "ngram"] (context drafts where a request has a
            match, the model otherwise). ``self.draft`` is the draft model (or None), ``self.drafter`` the Drafter.
        gamma: draft length (initial value for adaptive schedules; the per-request cap of context drafts);
            gamma_schedule: "constant" | "heuristic" | "optimal" (see gamma.py); max_gamma caps adaptive schedules.
        fallback_below: "optimal" only: once the estimates are measured, fall back to target-only decoding for the
            rest of a generation when the best predicted speedup (Leviathan Thm 3.8) is below this (0 disables).
        schedule: the γ schedule factory, called once per generation as ``schedule(gamma_schedule, gamma,
            max_gamma, fallback_below=...)`` and returning an object with ``next()`` and ``update(gamma,
            num_accepted, draft_time, target_time)``; default :class:`GammaSchedule`.
        verify_fn: replaces ``engine.step.run_verify`` (same signature) for every step, e.g. to record calls.
        method: verification method name ("auto": fused on a GPU, else reference; "reference", "hf", "fused",
            ...); method_options: its options (e.g.
            sigmoid's {"alpha": -1e3, "beta": 1e3}), validated here and part of the verify graph's key. Every method
            but "hf" keeps a request's tokens independent of the rest of the batch; "hf" (transformers' semantics)
            draws the batch from one generator, so its tokens depend on the batch (per-request seeds not honoured).
        sampling: SamplingParams (scalars, or per-request sequences matching the batch).
        tokenizer: optional; needed for string prompts and decoded texts. String prompts are encoded by
            :func:`tilespec.engine.prompts.encode_prompts`: wrapped in the tokenizer's chat template when it has one
            (as the CLI and ``tilespec.generate`` do); ``chat=False`` tokenizes the raw text.
        compile: the execution path (``engine.runner.step_mode``, docs/engine.md): True = on CUDA the native
            compiled runtime with whole-step CUDA graphs for supported models, else graphs of the transformers
            modules (eager on CPU); "native", "native-graphs", "graphs", "compiled-graphs", a torch.compile mode,
            or "debug". Compiled shapes are static: finished requests stay in the batch, ignored.
        eos_token_id: int or list; defaults to the target's generation config / the tokenizer.
        graph_verify: on the CUDA-graph paths, also replay ``verify()`` as a graph (methods that never sync with the
            host, scalar sampling parameters). False keeps verification eager, e.g. to time every method the same
            way as a baseline that cannot be captured.
        cache_slack: extra KV slots per request for the holes ragged acceptance leaves (default: max_new_tokens
            when B > 1); when the write pointer reaches the capacity the caches are defragmented (one copy).
        run_ahead: on the whole-step graph path, launch the next step before reading the current one where that
            step is certain (target-only steps; draft-model steps with the constant schedule, see
            ``Generation.may_run_ahead``); same tokens either way. Default: env ``TILESPEC_RUN_AHEAD`` (on unless
            "0"); ``dec.run_ahead`` may be changed between generations.
        tree / chains: verify a token tree per step instead of a chain (docs/trees.md): tree=(branch, depth, nodes)
            (a head's dynamic tree; "ngram": (matches, length, nodes)) or chains=(K, L) sampled chains (a head or a
            draft model) selected with ``scheme`` under ``draft_sampling``; γ = the depth, exact only.
    """

    def __init__(self, target, draft=None, *, gamma: int = 5, gamma_schedule: str = "constant", max_gamma: int = 16,
                 method: str = "auto", sampling: SamplingParams = SamplingParams(), tokenizer=None,
                 compile: bool | str = False, eos_token_id=None, pad_token_id: Optional[int] = None,
                 cache_slack: Optional[int] = None, graph_verify: bool = True, fallback_below: float = 1.0,
                 schedule=None, verify_fn=None, method_options: Optional[dict] = None,
                 chat: bool = True, run_ahead: Optional[bool] = None, tree=None, chains=None,
                 scheme: str = "specinfer", draft_sampling: Optional[SamplingParams] = None):
        if not hasattr(target, "config"):
            raise TypeError(f"target must be a Hugging Face model, got {type(target).__name__}")
        drafter = resolve_drafter(draft)
        if drafter is not None:     # a draft model must match the target; a trained head loads / checks here
            drafter.attach(target)
        if not isinstance(sampling, SamplingParams):
            raise TypeError(f"sampling must be a SamplingParams, got {type(sampling).__name__}")
        if tree is not None or chains is not None:   # token trees: the drafter proposes them (drafters/trees.py)
            drafter, shape = tree_form_of(drafter, tree, chains, scheme, draft_sampling, sampling, gamma_schedule)
            gamma = shape.depth
        if schedule is not None and not callable(schedule):
            raise TypeError(f"schedule must be a factory like GammaSchedule, got {type(schedule).__name__}")
        if verify_fn is not None and not callable(verify_fn):
            raise TypeError(f"verify_fn must be callable like engine.step.run_verify, got {type(verify_fn).__name__}")
        GammaSchedule(gamma_schedule, gamma, max_gamma, fallback_below=fallback_below)  # validates them early
        method = resolve_method(method, next(target.parameters()).device)
        self.method_options = get_method(method).resolve_options(method_options)  # bad ones fail here, not mid-run
        draft = drafter.model if drafter is not None else None
        self.target, self.draft, self.drafter = target, draft, drafter
        self.gamma, self.gamma_schedule, self.max_gamma = gamma, gamma_schedule, max_gamma
        self.fallback_below = fallback_below
        self.schedule_factory = schedule or GammaSchedule
        self._costs: dict = {}   # batch size -> measured c / overhead timings of the last generation (GammaSchedule)
        self.verify_fn = verify_fn
        self.method, self.sampling, self.tokenizer, self.compile = method, sampling, tokenizer, compile
        self.eos = eos_ids(target, tokenizer, eos_token_id)
        if pad_token_id is None and tokenizer is not None:
            pad_token_id = tokenizer.pad_token_id
        self.pad_id = int(pad_token_id) if pad_token_id is not None else (min(self.eos) if self.eos else 0)
        self.device = next(target.parameters()).device
        self.cache_slack = cache_slack
        self.graph_verify = graph_verify
        self.chat = chat
        self.run_ahead = settings.get().run_ahead if run_ahead is None else bool(run_ahead)
        self.last_stats: Optional[RunStats] = None   # convenience: the stats of the last generation that finished

    def _prompt_lists(self, input_ids, prompts) -> list:
        return prompt_lists(self.tokenizer, input_ids, prompts, self.chat)

    def _runner(self, name: str, model, capacity: int, batch: int):
        return shared_runner(model, name, capacity, batch, self.compile)

    def cache_capacity(self, width: int, batch: int, max_new_tokens: int) -> int:
        """Cache slots for ``batch`` prompts padded to ``width``; compiled: rounded up to 256 (shared graphs)."""
        g_max = self.max_gamma if self.gamma_schedule != "constant" else self.gamma
        slack = self.cache_slack if self.cache_slack is not None else (0 if batch == 1 else max_new_tokens)
        need = width + max_new_tokens + slack + (self.drafter.span(g_max) + 2 if self.drafter is not None else 2)
        return -(-need // 256) * 256 if self.compile else need

    @torch.inference_mode()
    def prefill(self, input_ids=None, *, prompts=None, max_new_tokens: int = 64, seed=0,
                input_features: Optional[torch.Tensor] = None) -> Generation:
        """Validate the inputs, build the caches and run the prompt through target (and draft model): a new
        :class:`Generation`. Arguments as for :meth:`stream`."""
        if not isinstance(max_new_tokens, int) or max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be an integer >= 1, got {max_new_tokens!r}")
        prompt_lists = self._prompt_lists(input_ids, prompts)
        seeds = check_request(self.target, self.draft, prompt_lists, max_new_tokens, seed, self.sampling)
        batch = len(prompt_lists)
        encdec = is_encoder_decoder(self.target)
        if encdec and input_features is None:
            raise ValueError("an encoder-decoder target needs input_features")
        if encdec and input_features.shape[0] != batch:
            raise ValueError(f"input_features has {input_features.shape[0]} rows for {batch} decoder prompts")
        ids, is_tok = left_pad(prompt_lists, self.pad_id, self.device)
        width, spec = ids.shape[1], self.drafter is not None
        capacity = self.cache_capacity(width, batch, max_new_tokens)
        if encdec:
            limit = getattr(self.target.config, "max_target_positions", None)
            if limit is not None and max(map(len, prompt_lists)) + max_new_tokens > limit:
                raise ValueError(f"prompt + max_new_tokens exceeds the decoder's {limit} positions")
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
        schedule = as_schedule(self.schedule_factory(self.gamma_schedule, self.gamma, max(self.max_gamma, self.gamma),
                                                     fallback_below=self.fallback_below))
        schedule.inherit_cost(self._costs.get(batch))   # costs belong to the models and the machine, not the prompt
        timer = PhaseTimer(self.device)
        stats = RunStats(requests=batch, method=self.method if spec else "target-only",
                         drafter=self.drafter.name if spec else "")
        t_start = time.perf_counter()

        timer.start("prefill")
        target = self._runner("target", self.target, capacity, batch)
        draft = self.drafter.runner(batch, capacity, target=target, compile=self.compile) if spec else None
        if encdec:
            enc = target.encode(input_features)
            if draft is not None:
                draft.encode(input_features, enc)
        p = width - 1
        pad_valid = is_tok[:, :p]
        positions = (pad_valid.long().cumsum(dim=1) - 1).clamp(min=0)
        pmask = prefill_mask(pad_valid, capacity)
        short = encdec and p <= 8    # encoder-decoder prompts: a short forced prefix (Whisper: 3-4 tokens), a graph
        skip = draft is None or schedule.falls_back_at_start   # measured: the draft loses here
        state = BatchState.prefilled(ids, is_tok, capacity, seeds, max_new_tokens, self.eos)
        features = () if skip else draft.features     # hidden states the drafter reads, if any
        out = target.forward(ids[:, :p], positions, pmask, 0, keep=1, compiled=short and target.mode == "native-graphs",
                             **({"capture": features} if features else {}))
        if not skip:
            state.hidden = draft.prefill(ids, positions, pmask, out[1] if features else None, short)
        context = self.drafter.start(prompt_lists) if spec else None
        stats.runtime = target.mode
        stats.draft_runtime = draft.mode if draft is not None else ""
        captures = draft is None or draft.captures       # a runner whose steps need the host: host-commit path
        fast = step_graphs_for(target, draft) if self.graph_verify and self.verify_fn is None and captures else None
        compile_before = sum(getattr(r, "compile_seconds", 0.0) for r in (target, draft, fast) if r is not None)
        timer.stop("prefill")
        sampling = select_sampling(self.sampling, state.rows)
        gen = Generation(state=state, target=target, draft=draft, schedule=schedule, timer=timer, stats=stats,
                         capacity=capacity, max_new_tokens=max_new_tokens, sampling=sampling,
                         resolved=resolve_sampling(sampling, state.size, self.device), context=context,
                         t_start=t_start, produced=[0] * batch, sequences=[[] for _ in range(batch)],
                         reasons=["length"] * batch, fast=fast, compile_before=compile_before)
        lease(gen, (target, draft))
        return gen

    @torch.inference_mode()
    def step(self, gen: Generation, lagged: bool = False) -> PlannedStep:
        """Choose γ (and context drafts), defragment if needed, run draft/target/verify: no host sync. ``lagged``:
        launched before the previous step was read (its W comes from the device, see :meth:`_run_ahead`)."""
        state, stats, timer = gen.state, gen.stats, gen.timer
        started = time.perf_counter()
        before = timer.mark()
        live = gen.live()
        remaining = max(gen.remaining(i) for i in live)
        spec = self.drafter is not None
        proposed = gen.schedule.next() if spec else 0    # one next() per step (wrappers may count calls)
        fallback = spec and proposed == 0                # the schedule gave up on speculation for good
        gamma = min(proposed, remaining - 1)
        drafts = None
        if gamma > 0 and gen.context is not None:
            timer.start("draft")
            drafts = gen.context_drafts(live, gamma)
            timer.stop("draft")
            if drafts is not None:
                gamma = max(len(d) for d in drafts)
            elif gen.draft is None:
                gamma = 0                                # no match and no model: a target-only step
        use_draft = gen.draft is not None and not fallback
        runners = (gen.target, gen.draft) if use_draft else (gen.target,)  # a fallen-back draft is never used
        if fallback:
            stats.fallback_steps += 1
            if stats.fallback_at_step is None:
                stats.fallback_at_step = gen.step_no
        span = gen.draft.span(gamma) if use_draft and gamma > 0 and drafts is None else gamma
        if state.write + span + 1 > gen.capacity:
            assert not lagged, "Generation.may_run_ahead let a step run ahead into a defrag"
            slot_index, _ = state.plan_defrag()
            rows = torch.arange(state.size, device=self.device)
            for runner in runners:
                runner.select(rows, slot_index)
            stats.defrags += 1
        context = gen.draft_tensors(drafts, gamma, self.pad_id) if drafts is not None else None
        draft = gen.draft if use_draft else None
        committed = gen.fast is not None and gen.fast.usable(self.method, gen.sampling)
        if committed:   # the whole step in captured graphs, commit included (step_graph.py); None: it failed
            out = gen.graphed_step(lagged, state, gamma, gen.sampling, gen.resolved, self.method, timer,
                                   context=context, method_options=self.method_options, use_draft=use_draft)
            committed = out is not None
        if not committed:
            out = speculative_step(gen.target, draft, state, gamma, gen.sampling, gen.resolved, self.method,
                                   timer, graph_verify=self.graph_verify, verify_fn=self.verify_fn, context=context,
                                   method_options=self.method_options)
        forwards = 0 if not drafts_on_device(draft, gamma, context) else 1 if context is not None else gamma
        # target-only (no drafter, or the optimal schedule's fallback, for good): W moves by one slot, known now
        advanced = committed and (not spec or fallback) and gamma == 0 and drafts is None
        if advanced:
            state.write += 1
        return PlannedStep(out=out, live=live, gamma=gamma, drafts=drafts, before=before, after=timer.mark(),
                           runners=runners, draft_forwards=forwards, committed=committed, advanced=advanced,
                           started=started, proposed=proposed if spec else None)

    def _run_ahead(self, gen: Generation, planned: PlannedStep) -> Optional[PlannedStep]:
        """Launch the next step before reading ``planned`` when its inputs do not depend on that read, so the GPU
        never waits for the host's bookkeeping and launches: target-only steps on the whole-step graphs (W moves by
        one, known), and draft-model steps that ``Generation.may_run_ahead`` proves identical to the step launched
        after the read (their W comes from the device: ``lagged``). A request that ends at ``planned`` by EOS is
        computed once more and ignored; None when the next step is not certain to be needed (every live request
        ends at ``planned`` by length), cannot run ahead, or ``self.run_ahead`` is off."""
        if not self.run_ahead or gen.finished:
            return None
        if planned.advanced:
            if all(gen.remaining(i) <= 1 for i in gen.live()) or gen.schedule.resumes_next:
                return None
            lagged = False
        elif gen.may_run_ahead(planned):
            lagged = True
        else:
            return None
        planned.host, planned.host_ready = snapshot_outputs(planned.out)   # the next replay rewrites the outputs
        gen.stats.ahead_steps += 1
        return self.step(gen, lagged=lagged)

    @torch.inference_mode()
    def commit(self, gen: Generation, planned: PlannedStep) -> StepEvent:
        """The step's one host read: apply the verify result, record tokens / EOS / counters, drop finished rows."""
        state, stats, timer, out = gen.state, gen.stats, gen.timer, planned.out
        live = [i for i in planned.live if state.rows[i] not in gen.done]   # run-ahead: some may have ended since
        gamma = planned.gamma
        timer.start("bookkeeping")
        if planned.host_ready is not None:
            planned.host_ready.synchronize()      # waits for this step only, not for the run-ahead one
        host = (planned.host if planned.host is not None else
                torch.cat([out.num_emitted[:, None], out.output_tokens], dim=1)).cpu()   # the one sync per step
        emitted_all = host[:, 0].tolist()
        if planned.advanced:
            pass                                  # the step moved W when it was launched
        elif planned.committed:                   # as graph T did: ended rows do not count
            gen.fast.advance(state, max((emitted_all[i] for i in live), default=0))
        else:
            state.commit(out.num_emitted, out.output_tokens, out.draft_tokens, max(emitted_all) - 1)
            state.hidden = out.hidden if out.hidden is not None else state.hidden
        if gen.done and not planned.committed:    # zombie rows keep no context (graph T clears them itself)
            state.valid[[i for i, r in enumerate(state.rows) if r in gen.done]] = False
        if not live:  # a run-ahead step after every request ended: nothing to record but its forwards
            stats.target_calls += 1
            stats.draft_calls += planned.draft_forwards
            return gen.read_done(StepEvent(step=gen.step_no, tokens={}, finished=[]))
        emitted = [emitted_all[i] for i in live]
        ks = [len(planned.drafts[i]) if planned.drafts is not None else gamma for i in live]
        new_tokens, finished, keep = gen.take(host, emitted_all, live, self.eos)
        stats.count_step(gamma, planned.draft_forwards, ks, emitted, context=planned.drafts is not None)
        stats.graphed_steps += planned.committed
        if gamma > 0:
            gen.feed_schedule(planned, emitted, ks, [state.rows[i] for i in live])
        gen.feed_rate(gamma, emitted, planned)
        if finished and keep and not self.compile:
            rows = state.keep_rows(keep)
            ident = torch.arange(gen.capacity, device=self.device)[None, :].expand(len(keep), gen.capacity)
            for runner in planned.runners:
                runner.select(rows, ident)
            gen.sampling = select_sampling(self.sampling, state.rows)
            gen.resolved = resolve_sampling(gen.sampling, state.size, self.device)
        elif finished:
            gen.done.update(finished)
            if not planned.committed:             # graph T keeps state.alive itself; here the host tells it
                state.alive[[i for i in live if state.rows[i] in gen.done]] = False
        gen.step_no += 1
        return gen.read_done(StepEvent(step=gen.step_no - 1, tokens=new_tokens, finished=finished))

    @torch.inference_mode()
    def finish(self, gen: Generation) -> GenerationOutput:
        """Close the generation's counters and return its output (also kept in ``self.last_stats``)."""
        stats = gen.stats
        stats.wall_time = time.perf_counter() - gen.t_start
        stats.times = gen.timer.resolve()
        stats.compile_seconds = sum(getattr(r, "compile_seconds", 0.0) for r in (gen.target, gen.draft, gen.fast)
                                    if r is not None) - gen.compile_before
        stats.new_tokens = sum(gen.produced)
        stats.kv_cache_bytes = gen.target.memory_bytes() + (gen.draft.memory_bytes() if gen.draft is not None else 0)
        stats.peak_memory_bytes = peak_memory(self.device)
        if gen.context is not None:
            gen.context.close()
        cost = gen.schedule.cost_state()
        self._costs[stats.requests] = cost or self._costs.get(stats.requests)
        self.last_stats = stats
        texts = None
        if self.tokenizer is not None:
            texts = [self.tokenizer.decode(s, skip_special_tokens=True) for s in gen.sequences]
        return GenerationOutput(sequences=gen.sequences, stats=stats, texts=texts, finish_reasons=gen.reasons)

    @torch.inference_mode()
    def stream(self, input_ids=None, *, prompts=None, max_new_tokens: int = 64, seed=0,
               input_features: Optional[torch.Tensor] = None, on_finish=None) -> Iterator[StepEvent]:
        """Decode and yield a :class:`StepEvent` per step; stats land in ``self.last_stats`` at the end.

        input_ids: token lists / [B, L] tensor (no padding), or prompts: str / list of str (needs a tokenizer).
        For encoder-decoder models input_ids are the decoder prompts (e.g. Whisper's forced prefix) and
        input_features [B, mels, frames] feed the encoder.
        seed: int (request i uses seed + i) or per-request list; drives the counter-based random streams.
        on_finish: optional callable receiving the :class:`GenerationOutput` when the generation ends.
        """
        gen = self.prefill(input_ids, prompts=prompts, max_new_tokens=max_new_tokens, seed=seed,
                           input_features=input_features)
        yield from self._events(gen)
        output = self.finish(gen)
        if on_finish is not None:
            on_finish(output)

    @torch.inference_mode()
    def generate(self, input_ids=None, *, prompts=None, max_new_tokens: int = 64, seed=0,
                 input_features: Optional[torch.Tensor] = None) -> GenerationOutput:
        """Decode to completion; returns the new tokens per request, decoded texts (with a tokenizer) and stats."""
        gen = self.prefill(input_ids, prompts=prompts, max_new_tokens=max_new_tokens, seed=seed,
                           input_features=input_features)
        for _ in self._events(gen):
            pass
        return self.finish(gen)

    def _events(self, gen: Generation) -> Iterator[StepEvent]:
        """step / commit until every request ends; certain steps are launched one ahead (:meth:`_run_ahead`)."""
        planned = None
        while planned is not None or not gen.finished:
            planned = planned or self.step(gen)
            ahead = self._run_ahead(gen, planned)
            yield self.commit(gen, planned)
            planned = ahead

    def warmup(self, prompt_len: int = 16, max_new_tokens: int = 8, batch: int = 1) -> RunStats:
        """One uncounted generation on a synthetic prompt (token ids 1..prompt_len, repeated so context drafters
        match): lazy initialisations, and on the compiled paths the graphs of those shapes. Returns its stats."""
        ids, features = warmup_inputs(self.target, prompt_len, batch, self.device)
        return self.generate(ids, max_new_tokens=max_new_tokens, input_features=features).stats
