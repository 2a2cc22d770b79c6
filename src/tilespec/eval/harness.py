"""The evaluation loop: decode the same examples with each verification method and aggregate what was measured.

Protocol (the seed paper's, §4.1): batch size 1, the transformers γ heuristic (start 5, +2 when a whole draft is
accepted, else -1), seeds ``seed + i`` for example i under every method, and an uncounted warm-up per method (see
:func:`warm_up`) that visits every draft length K the schedule can reach, so that no Triton compilation, CUDA-graph
capture or other first-call cost lands inside a timed region. Per method we keep the texts, the accuracy metric,
the time inside ``verify()`` (CUDA events on GPU, perf_counter on CPU; the engine's RunStats), the wall clock of
the whole decoding loop, acceptance, peak memory and the bytes the verification must read; Δ% columns compare each method with the ``hf`` baseline.
Settings live in :mod:`.config`, the aggregation of a run in :mod:`.aggregate`.
"""
from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass, field
from typing import Optional

import torch

from .aggregate import add_deltas, summarize
from .config import EvalConfig, engine_compile, method_options


def reachable_ks(gamma: int, schedule: str, max_gamma: int, temperature: float) -> list[int]:
    """Every draft length K that ``verify()`` can see in a generation: the engine drafts
    ``min(schedule γ, remaining - 1)``, so K runs over 0..γ_max (γ_max = γ for a constant schedule, else
    max(max_gamma, γ)). K = 0 (the last token of a generation, no draft) reaches ``verify()`` only when sampling."""
    top = gamma if schedule == "constant" else max(max_gamma, gamma)
    lo = 0 if temperature > 0 else 1
    return list(range(lo, top + 1))


def draft_kinds(k: int, temperature: float) -> tuple:
    """The draft kinds the engine passes to ``verify()`` at draft length ``k``: draft logits when sampling with a
    draft, none (one-hot drafts) when greedy or when nothing was drafted."""
    return ("logits",) if k > 0 and temperature > 0 else ("none",)


@dataclass
class VerifyCall:
    """What the engine passed to ``verify()`` in a real step: dtypes, vocabulary, device, graph replay or not."""

    logits_dtype: torch.dtype
    draft_dtype: Optional[torch.dtype]
    vocab: int
    device: torch.device
    graphs: bool
    seeds: torch.Tensor
    offsets: torch.Tensor
    options: tuple = ()


_RECORDERS: list = []   # lists collecting VerifyCall records while record_verify_calls is open


def harness_verify(target_logits, draft_tokens, draft_logits, sampling, method, seeds, offsets, graphs, **kwargs):
    """The ``verify_fn`` of the harness' decoders: ``engine.step.run_verify``, recorded while
    :func:`record_verify_calls` is open."""
    from tilespec.engine import step

    for calls in _RECORDERS:
        calls.append(VerifyCall(target_logits.dtype, draft_logits.dtype if draft_logits is not None else None,
                                int(target_logits.shape[-1]), target_logits.device, bool(graphs),
                                seeds.detach().clone(), offsets.detach().clone(), tuple(kwargs.get("options", ()))))
    return step.run_verify(target_logits, draft_tokens, draft_logits, sampling, method, seeds, offsets, graphs,
                           **kwargs)


@contextlib.contextmanager
def record_verify_calls(calls: list):
    """Record every verify call (as :class:`VerifyCall`) of decoders built by :func:`make_decoder` while open."""
    _RECORDERS.append(calls)
    try:
        yield calls
    finally:
        _RECORDERS.remove(calls)


def warm_verify(method: str, sampling, ks, call: VerifyCall, temperature: float) -> list[tuple]:
    """Run ``verify()`` through the engine's own entry point (``engine.step.run_verify``, same graph/eager path,
    same dtypes) for every K in ``ks`` and every draft kind the engine uses there; returns the (K, kind) visited.

    Compiles every Triton variant and captures every CUDA graph the timed run can need (the verify kernels'
    variants differ by draft kind and by K = 0 vs K > 0, and each K is its own graph)."""
    from tilespec.engine.step import run_verify

    gen = torch.Generator(device="cpu").manual_seed(1234)
    visited = []
    batch = int(call.seeds.shape[0])
    with torch.inference_mode():   # as in the engine: graph input buffers captured there are inference tensors
        _warm_verify_loop(run_verify, method, sampling, ks, call, temperature, gen, batch, visited)
    if call.device.type == "cuda":
        torch.cuda.synchronize(call.device)
    return visited


def _warm_verify_loop(run_verify, method, sampling, ks, call, temperature, gen, batch, visited) -> None:
    for k in ks:
        for kind in draft_kinds(k, temperature):
            tl = torch.randn(batch, k + 1, call.vocab, generator=gen).to(call.device, call.logits_dtype)
            dt = torch.randint(0, call.vocab, (batch, k), generator=gen).to(call.device)
            dl = None
            if kind == "logits":
                dl = torch.randn(batch, k, call.vocab, generator=gen).to(call.device, call.draft_dtype or
                                                                       call.logits_dtype)
            run_verify(tl, dt, dl, sampling, method, call.seeds, call.offsets, graphs=call.graphs,
                       options=call.options)
            visited.append((k, kind))


class _ForcedSchedule:
    """A γ schedule that first returns the given values in order, then behaves like the wrapped one."""

    def __init__(self, inner, forced):
        self.inner, self.forced = inner, list(forced)

    def next(self) -> int:
        return self.forced.pop(0) if self.forced else self.inner.next()

    def update(self, *args, **kwargs) -> None:
        self.inner.update(*args, **kwargs)

    def __getattr__(self, name):
        return getattr(self.inner, name)


_FORCED: list = []   # the γ sequences forced_gammas is forcing (innermost last)


def harness_schedule(*args, **kwargs):
    """The ``schedule`` factory of the harness' decoders: :class:`GammaSchedule`, with the γ values of the
    innermost open :func:`forced_gammas` first."""
    from tilespec.engine import GammaSchedule

    inner = GammaSchedule(*args, **kwargs)
    return _ForcedSchedule(inner, _FORCED[-1]) if _FORCED else inner


@contextlib.contextmanager
def forced_gammas(values):
    """Make decoders built by :func:`make_decoder` draft ``values`` (in order) on the first steps of every
    generation started inside the context."""
    _FORCED.append(list(values))
    try:
        yield
    finally:
        _FORCED.pop()


_WARM_MODEL_KS: dict = {}   # (target, draft, capacity bucket, limit, compile) -> draft lengths already warmed


def _capacity_bucket(width: int, limit: int, gamma_max: int) -> int:
    """The engine's compiled KV capacity for a batch-1 prompt of ``width`` tokens (decoder.stream: width +
    max_new_tokens + gamma_max + 2, rounded up to 256); only used to warm each graph bucket once."""
    return -(-(width + limit + gamma_max + 2) // 256) * 256


def plan_forced(ks, limit: int) -> list[list[int]]:
    """Split the draft lengths ``ks`` (> 0) into forced-γ sequences that each fit one generation of ``limit`` new
    tokens: a step drafting k consumes at most k + 1 tokens and the engine drafts min(γ, remaining - 1)."""
    todo = sorted((k for k in set(ks) if 0 < k <= limit - 1), reverse=True)
    plans = []
    while todo:
        chunk, budget = [], limit
        for k in list(todo):
            if k + 1 <= budget:
                chunk.append(k)
                budget -= k + 1
                todo.remove(k)
        plans.append(chunk)
    return plans


def warm_models(dec, prepared: list, ks, limit: int, gamma_max: int, seed: int) -> int:
    """CUDA-graph mode, decoder-only models: for each KV-capacity bucket of the inputs, generations with a forced γ
    sequence that drafts every K in ``ks`` once, so each (q, capacity) model-forward graph is captured before
    timing. Runners (and their graphs) are shared process-wide, so each (bucket, K) is warmed once per process.
    Returns the number of warm-up generations run."""
    from tilespec.engine.runner import is_encoder_decoder

    from tilespec.engine.native.runner import native_reason

    if not dec.compile or (is_encoder_decoder(dec.target) and native_reason(dec.target) is not None):
        return 0   # eager forwards need no capture; transformers' encoder-decoder runners are rebuilt per generation
    runs = 0
    for p in prepared:
        bucket = _capacity_bucket(len(p.ids), limit, gamma_max)
        key = (id(dec.target), id(dec.draft), bucket, limit, str(dec.compile))
        done = _WARM_MODEL_KS.setdefault(key, set())
        for chunk in plan_forced([k for k in ks if k not in done], limit):
            with forced_gammas(chunk):
                stream = dec.stream(input_ids=[p.ids], max_new_tokens=limit, seed=seed, input_features=p.features)
                for k in chunk:
                    if next(stream, None) is None:
                        break
                    done.add(k)
                stream.close()
            runs += 1
    return runs


def warm_up(dec, prepared: list, method: str, cfg: EvalConfig, *, gamma: int, schedule: str, limit: int,
            exhaustive: Optional[bool] = None) -> dict:
    """The uncounted warm-up of one method before its timed generations:

    1. one short real generation (lazy initialisations, and it records how the engine calls ``verify()``);
    2. ``verify()`` for every K in :func:`reachable_ks` and every draft kind of :func:`draft_kinds` through the
       engine's own ``run_verify`` (Triton compilations, CUDA-graph captures);
    3. with CUDA-graph model forwards, every (q, capacity) forward graph (:func:`warm_models`).
    Steps 2-3 run on CUDA only by default (``exhaustive=None``): on CPU nothing is compiled or captured, and
    Triton's interpreter would spend minutes on them. Returns what was warmed (recorded in the results)."""
    if not prepared:
        return {}
    if exhaustive is None:
        exhaustive = next(dec.target.parameters()).device.type == "cuda"
    p = prepared[0]
    calls: list = []
    with record_verify_calls(calls):
        dec.generate(input_ids=[p.ids], max_new_tokens=min(8, limit), seed=cfg.seed, input_features=p.features)
    ks = reachable_ks(gamma, schedule, max(cfg.max_gamma, gamma), cfg.temperature)
    info = dict(ks=ks, verify_calls=0, model_generations=0, exhaustive=bool(exhaustive))
    if not exhaustive:
        return info
    if calls and dec.draft is not None:
        info["verify_calls"] = len(warm_verify(method, dec.sampling, ks, calls[0], cfg.temperature))
    if dec.draft is not None:
        gmax = gamma if schedule == "constant" else max(cfg.max_gamma, gamma)
        info["model_generations"] = warm_models(dec, prepared, ks, limit, gmax, cfg.seed)
    return info


@dataclass
class MethodRun:
    """Raw per-example results of decoding a list of inputs with one method and one γ setting."""

    method: str
    sequences: list = field(default_factory=list)
    texts: list = field(default_factory=list)
    stats: list = field(default_factory=list)
    warmup: dict = field(default_factory=dict)


def make_decoder(target, draft, method: str, cfg: EvalConfig, *, gamma: Optional[int] = None,
                 schedule: Optional[str] = None):
    """The :class:`SpeculativeDecoder` of one (method, γ, schedule) setting of ``cfg``."""
    from tilespec.engine import SpeculativeDecoder
    from tilespec.verify.types import SamplingParams

    gamma = gamma or cfg.gamma
    device = next(target.parameters()).device
    return SpeculativeDecoder(target, draft, gamma=gamma, gamma_schedule=schedule or cfg.schedule,
                              max_gamma=max(cfg.max_gamma, gamma), method=method,
                              sampling=SamplingParams(temperature=cfg.temperature),
                              compile=engine_compile(cfg, device), schedule=harness_schedule,
                              verify_fn=harness_verify, method_options=method_options(method, cfg),
                              graph_verify=False)  # every method's verify timed eagerly, like the hf baseline


def decode_all(target, draft, task, prepared: list, method: str, cfg: EvalConfig, *, gamma: Optional[int] = None,
               schedule: Optional[str] = None, max_new_tokens: Optional[int] = None, warmup: bool = True) -> MethodRun:
    """Decode every prepared input (batch 1, seed ``cfg.seed + i``) with ``method``; uncounted warm-up first."""
    gamma = gamma or cfg.gamma
    schedule = schedule or cfg.schedule
    dec = make_decoder(target, draft, method, cfg, gamma=gamma, schedule=schedule)
    limit = max_new_tokens or cfg.max_new_tokens
    run = MethodRun(method=method)
    if warmup and prepared:
        run.warmup = warm_up(dec, prepared, method, cfg, gamma=gamma, schedule=schedule, limit=limit)
    for i, p in enumerate(prepared):
        _generate_into(run, dec, task, p, cfg.seed + i, limit)
    return run


def _generate_into(run: MethodRun, dec, task, p, seed: int, limit: int) -> None:
    out = dec.generate(input_ids=[p.ids], max_new_tokens=limit, seed=seed, input_features=p.features)
    run.sequences.append(list(out.sequences[0]))
    run.texts.append(task.decode(out.sequences[0]))
    run.stats.append(out.stats)


def run_main(target, draft, task, examples: list, cfg: EvalConfig, log=print,
             deadline: Optional[float] = None) -> dict:
    """The main comparison (paper Tables 1, 5, 6): every method on every example with the heuristic γ.

    Every method is warmed up first; then the examples are decoded example-major (example i with every method,
    then example i + 1), so that a ``deadline`` (time.time() value) cuts all methods at the same example count:
    after the deadline no new example is started (at least one is always done). Each row's ``examples`` says how
    many were decoded."""
    device = next(target.parameters()).device
    dtype = next(target.parameters()).dtype
    prepared = [task.prepare(e, device, dtype) for e in examples]
    decs = {m: make_decoder(target, draft, m, cfg) for m in cfg.methods}
    runs = {m: MethodRun(method=m) for m in cfg.methods}
    for m in cfg.methods:
        if cfg.warmup and prepared:
            runs[m].warmup = warm_up(decs[m], prepared, m, cfg, gamma=cfg.gamma, schedule=cfg.schedule,
                                     limit=cfg.max_new_tokens)
    log(f"  [{time.strftime('%H:%M:%S')}] warm-up done ({', '.join(cfg.methods)})")
    for i, p in enumerate(prepared):
        if i > 0 and deadline is not None and time.time() > deadline:
            log(f"  time budget reached: main comparison on {i} of {len(prepared)} examples")
            break
        for m in cfg.methods:
            _generate_into(runs[m], decs[m], task, p, cfg.seed + i, cfg.max_new_tokens)
        if (i + 1) % 5 == 0 or i + 1 == len(prepared):
            log(f"  [{time.strftime('%H:%M:%S')}] {i + 1}/{len(prepared)} examples")
    n = len(runs[cfg.methods[0]].stats)
    rows, seqs = {}, {}
    for m in cfg.methods:
        rows[m] = summarize(runs[m], target, task=task, examples=examples[:n])
        rows[m]["warmup"] = runs[m].warmup
        seqs[m] = runs[m].sequences
        r = rows[m]
        log(f"  {m:8s} {task.metric}={r[task.metric]:.4f} verify={r['verify_time_s']:.3f}s "
            f"({r['verify_step_ms']:.3f} ms/step) wall={r['wall_time_s']:.2f}s alpha={r['alpha']:.3f}")
    add_deltas(rows, sequences=seqs)
    return rows
