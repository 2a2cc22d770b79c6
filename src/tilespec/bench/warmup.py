"""The harness' uncounted warm-up: everything the timed generations compile or capture is done before timing.

What the engine compiles or captures (engine/runner.py, engine/native/runner.py, engine/graphs.py):
  * verify(): one Triton variant per (method, draft kind, K = 0 vs K > 0) and, in eager verification, nothing else;
    :func:`warm_verify` calls ``engine.step.run_verify`` for every K and kind, at every batch size the run uses;
  * model forwards on the CUDA-graph paths (compile=True -> "native-graphs" for Qwen2/Llama and Whisper): one CUDA
    graph per (B, q, capacity) and runner; runners are shared process-wide per (model, role, capacity, B, mode).
    On the compiled paths finished requests stay in the batch (ignored), so B never shrinks inside a generation:
    the shapes are (chunk size, q, capacity bucket). :func:`warm_models` runs forced-γ generations on one chunk of
    every (B, capacity bucket) the run will see, so each (B, q = 1, 2, K + 1, capacity) graph exists before timing;
    context drafters (ngram / suffix, no draft model) cannot be forced to a draft length, so
    :func:`warm_target_shapes` feeds the shared target runner every q = 1..γ_max + 1 directly.
Capacity bucket (decoder.prefill): width + max_new_tokens + slack + γ_max + 2 (slack = max_new_tokens when B > 1),
rounded up to 256, width = the longest prompt of the chunk.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Optional

import torch

from .config import EvalConfig


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


def _rows(x: torch.Tensor, b: int) -> torch.Tensor:
    """``x`` [B0, ...] -> [b, ...] by repeating its first row (seeds / offsets of a recorded call at batch b)."""
    return x[:1].repeat(b, *([1] * (x.dim() - 1)))


def warm_verify(method: str, sampling, ks, call: VerifyCall, temperature: float,
                batches: Optional[list] = None) -> list[tuple]:
    """Run ``verify()`` through the engine's own entry point (``engine.step.run_verify``, same graph/eager path,
    same dtypes) for every K in ``ks``, every draft kind the engine uses there and every batch size in ``batches``
    (default: the recorded call's); returns the (K, kind) visited per batch size, concatenated.

    Compiles every Triton variant and captures every CUDA graph the timed run can need (the verify kernels'
    variants differ by draft kind and by K = 0 vs K > 0, and each (B, K) is its own graph)."""
    from tilespec.engine.step import run_verify

    gen = torch.Generator(device="cpu").manual_seed(1234)
    visited = []
    for batch in batches or [int(call.seeds.shape[0])]:
        with torch.inference_mode():   # as in the engine: graph input buffers captured there are inference tensors
            _warm_verify_loop(run_verify, method, sampling, ks, call, temperature, gen, int(batch), visited)
    if call.device.type == "cuda":
        torch.cuda.synchronize(call.device)
    return visited


def _warm_verify_loop(run_verify, method, sampling, ks, call, temperature, gen, batch, visited) -> None:
    seeds, offsets = _rows(call.seeds, batch), _rows(call.offsets, batch)
    for k in ks:
        for kind in draft_kinds(k, temperature):
            tl = torch.randn(batch, k + 1, call.vocab, generator=gen).to(call.device, call.logits_dtype)
            dt = torch.randint(0, call.vocab, (batch, k), generator=gen).to(call.device)
            dl = None
            if kind == "logits":
                dl = torch.randn(batch, k, call.vocab, generator=gen).to(call.device, call.draft_dtype or
                                                                       call.logits_dtype)
            run_verify(tl, dt, dl, sampling, method, seeds, offsets, graphs=call.graphs, options=call.options)
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


_WARM_MODEL_KS: dict = {}   # (target, draft, B, capacity bucket, limit, compile) -> draft lengths already warmed


def capacity_bucket(width: int, limit: int, gamma_max: int, batch: int = 1, spec: bool = True) -> int:
    """The engine's compiled KV capacity (decoder.prefill) for a batch of ``batch`` prompts whose longest has
    ``width`` tokens: width + limit + slack (0 at B = 1, else limit) + (γ_max + 2 with a drafter, else 2), rounded up
    to 256. Used to warm each (B, capacity) graph bucket once."""
    slack = 0 if batch == 1 else limit
    return -(-(width + limit + slack + (gamma_max + 2 if spec else 2)) // 256) * 256


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


def shape_groups(prepared: list, batch_size: int, limit: int, gamma_max: int, spec: bool = True) -> list[list]:
    """One representative chunk per distinct (B, capacity bucket) when ``prepared`` is decoded in consecutive
    chunks of ``batch_size`` (the last chunk may be smaller): the shapes the compiled paths capture."""
    seen, groups = set(), []
    for i in range(0, len(prepared), batch_size):
        chunk = prepared[i:i + batch_size]
        key = (len(chunk), capacity_bucket(max(len(p.ids) for p in chunk), limit, gamma_max, len(chunk), spec))
        if key not in seen:
            seen.add(key)
            groups.append(chunk)
    return groups


def batch_inputs(chunk: list) -> tuple[list, Optional[torch.Tensor]]:
    """(prompt token lists, encoder features [B, mels, frames] or None) of a chunk of Prepared inputs."""
    feats = [p.features for p in chunk]
    return [p.ids for p in chunk], (torch.cat(feats, dim=0) if feats[0] is not None else None)


def warm_models(dec, groups: list, ks, limit: int, gamma_max: int, seed: int) -> int:
    """CUDA-graph mode: for each chunk in ``groups`` (one per (B, capacity bucket), see :func:`shape_groups`; a
    plain list of Prepared is taken as batch-1 groups), generations with a forced γ sequence that drafts every K in
    ``ks`` once, so each (B, q, capacity) forward graph of target and draft is captured before timing. Runners (and
    their graphs) are shared process-wide, so each (B, bucket, K) is warmed once per process. Returns the number of
    warm-up generations run."""
    from tilespec.engine.runner import is_encoder_decoder

    from tilespec.engine.native.runner import native_reason

    if not dec.compile or (is_encoder_decoder(dec.target) and native_reason(dec.target) is not None):
        return 0   # eager forwards need no capture; transformers' encoder-decoder runners are rebuilt per generation
    groups = [g if isinstance(g, list) else [g] for g in groups]
    runs = 0
    for chunk in groups:
        ids, feats = batch_inputs(chunk)
        bucket = capacity_bucket(max(map(len, ids)), limit, gamma_max, len(ids))
        key = (id(dec.target), id(dec.draft), len(ids), bucket, limit, str(dec.compile))
        done = _WARM_MODEL_KS.setdefault(key, set())
        for plan in plan_forced([k for k in ks if k not in done], limit):
            with forced_gammas(plan):
                stream = dec.stream(input_ids=ids, max_new_tokens=limit, seed=seed, input_features=feats)
                for k in plan:
                    if next(stream, None) is None:
                        break
                    done.add(k)
                stream.close()
            runs += 1
    return runs


def warm_target_shapes(dec, groups: list, limit: int, gamma_max: int) -> int:
    """Context drafters on a compiled path: feed the shared target runner of every (B, capacity bucket) in
    ``groups`` one forward per q = 1..γ_max + 1 (a context step scores [pending, up to γ drafts]), so its graphs
    are captured before timing (target-only decoders: q = 1). Decoder-only models only (others: 0). The K/V written at slots [0, q) is finite
    (each query sees itself) and is overwritten or masked by the next prefill. Returns the forwards run."""
    from tilespec.engine.leases import shared_runner
    from tilespec.engine.runner import is_encoder_decoder

    if not dec.compile or is_encoder_decoder(dec.target):
        return 0
    device = next(dec.target.parameters()).device
    runs = 0
    with torch.inference_mode():
        for chunk in groups:
            b = len(chunk)
            cap = capacity_bucket(max(len(p.ids) for p in chunk), limit, gamma_max, b, dec.drafter is not None)
            runner = shared_runner(dec.target, "target", cap, b, dec.compile)
            for q in range(1, (gamma_max + 2) if dec.drafter is not None else 2):
                tokens = torch.zeros((b, q), dtype=torch.int64, device=device)
                positions = torch.arange(q, device=device)[None, :].expand(b, q).contiguous()
                mask = torch.zeros((b, 1, q, cap), dtype=torch.bool, device=device)
                mask[:, 0, torch.arange(q), torch.arange(q)] = True
                runner.forward(tokens, positions, mask, 0)
                runs += 1
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return runs


def warm_up(dec, prepared: list, method: str, cfg: EvalConfig, *, gamma: int, schedule: str, limit: int,
            exhaustive: Optional[bool] = None, batch_size: int = 1) -> dict:
    """The uncounted warm-up of one method before its timed generations (``prepared`` decoded in chunks of
    ``batch_size``):

    1. one short real generation (lazy initialisations, and it records how the engine calls ``verify()``);
    2. ``verify()`` for every K in :func:`reachable_ks`, every draft kind of :func:`draft_kinds` and every chunk
       size through the engine's own ``run_verify`` (Triton compilations, CUDA-graph captures);
    3. with CUDA-graph model forwards, every (B, q, capacity) forward graph (:func:`warm_models`, or
       :func:`warm_target_shapes` for context drafters).
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
    info = dict(ks=ks, verify_calls=0, model_generations=0, target_forwards=0, exhaustive=bool(exhaustive),
                batch_size=batch_size)
    if not exhaustive:
        return info
    gmax = gamma if schedule == "constant" else max(cfg.max_gamma, gamma)
    groups = shape_groups(prepared, batch_size, limit, gmax, spec=dec.drafter is not None)
    spec = dec.drafter is not None
    info["shapes"] = sorted({(len(g), capacity_bucket(max(len(p.ids) for p in g), limit, gmax, len(g), spec))
                             for g in groups})
    if calls and dec.drafter is not None:
        batches = sorted({len(g) for g in groups} | {1})
        info["verify_calls"] = len(warm_verify(method, dec.sampling, ks, calls[0], cfg.temperature, batches))
    if dec.draft is not None:
        info["model_generations"] = warm_models(dec, groups, ks, limit, gmax, cfg.seed)
    else:   # context drafter or target-only (q = 1)
        info["target_forwards"] = warm_target_shapes(dec, groups, limit, gmax)
    return info
