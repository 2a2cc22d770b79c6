"""The evaluation loop: decode the same examples with each verification method and aggregate what was measured.

Protocol (the seed paper's, §4.1): batch size 1, the transformers γ heuristic (start 5, +2 when a whole draft is
accepted, else -1), seeds ``seed + i`` for example i under every method, a warm-up generation per method that is not
counted. Per method we keep the texts, the accuracy metric, the time inside ``verify()`` (CUDA events on GPU,
perf_counter on CPU; the engine's RunStats), the wall clock of the whole decoding loop, acceptance, peak memory and
the bytes the verification must read; Δ% columns compare each method with the ``hf`` baseline.
"""
from __future__ import annotations

import contextlib
import math
from dataclasses import asdict, dataclass, field
from typing import Optional

import torch

from .metrics import bandwidth_gbps, delta_pct, mean_std, verify_bytes

METHODS = ("hf", "tiled", "fused", "sigmoid")
BASELINE = "hf"
SIGMOID_SCALE = {"summarization": 1e4, "asr": 1e3}   # the paper's α = -s, β = s per task


@dataclass
class EvalConfig:
    """Settings of one evaluation run (recorded verbatim in the results JSON)."""

    task: str = "summarization"
    dataset: str = "xsum"
    limit: Optional[int] = None
    seed: int = 0
    methods: tuple = METHODS
    target: str = "qwen2.5-coder-1.5b-instruct"
    draft: Optional[str] = "qwen2.5-coder-0.5b-instruct"
    device: str = "cpu"
    dtype: str = "float32"
    max_new_tokens: int = 100
    temperature: float = 1.0
    gamma: int = 5
    schedule: str = "heuristic"
    max_gamma: int = 20
    sigmoid_scale: Optional[float] = None
    max_article_chars: Optional[int] = 4000
    studies: tuple = ("main",)
    sweep_limit: int = 4
    sweep_gammas: tuple = tuple(range(1, 21))
    accept_gammas: tuple = (3, 5, 10, 15)
    scales: tuple = (10.0, 1e3, 1e4, 1e5)
    sweep_max_new_tokens: int = 40
    warmup: bool = True

    def __post_init__(self):
        self.methods = tuple(self.methods)
        unknown = [m for m in self.methods if m not in METHODS + ("reference",)]
        if unknown:
            raise ValueError(f"unknown method(s) {unknown}; choose from {', '.join(METHODS + ('reference',))}")
        if not self.methods:
            raise ValueError("at least one method is needed")
        if self.task not in SIGMOID_SCALE:
            raise ValueError(f"unknown task {self.task!r}; choose summarization or asr")
        for name in ("max_new_tokens", "gamma", "max_gamma", "sweep_limit", "sweep_max_new_tokens"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
        if self.limit is not None and (not isinstance(self.limit, int) or self.limit < 1):
            raise ValueError(f"limit must be a positive integer, got {self.limit!r}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if self.temperature == 0 and ("sigmoid" in self.methods or "alphabeta" in self.studies):
            raise ValueError("sigmoid has no greedy mode (temperature 0): drop it from --methods / --studies or "
                             "sample (temperature > 0)")
        bad = [s for s in self.studies if s not in ("main", "acceptance", "gamma", "alphabeta")]
        if bad:
            raise ValueError(f"unknown studies {bad}; choose from main, acceptance, gamma, alphabeta")
        if any(g < 1 for g in tuple(self.sweep_gammas) + tuple(self.accept_gammas)):
            raise ValueError("gamma values must be >= 1")
        if any(s <= 0 for s in self.scales):
            raise ValueError("sigmoid scales must be > 0 (alpha = -s, beta = s)")
        if self.sigmoid_scale is None:
            self.sigmoid_scale = SIGMOID_SCALE[self.task]

    def to_dict(self) -> dict:
        return {k: (list(v) if isinstance(v, tuple) else v) for k, v in asdict(self).items()}


@contextlib.contextmanager
def sigmoid_constants(scale: float):
    """Temporarily set the sigmoid method's (α, β) = (-scale, scale) through its public setter."""
    from tilespec.verify.methods import sigmoid as sig

    old = sig.get_constants()
    sig.set_constants(-float(scale), float(scale))
    try:
        yield
    finally:
        sig.set_constants(*old)


def _vocab_and_itemsize(model) -> tuple[int, int]:
    head = model.get_output_embeddings().weight
    return int(head.shape[0]), int(head.element_size())


@dataclass
class MethodRun:
    """Raw per-example results of decoding a list of inputs with one method and one γ setting."""

    method: str
    sequences: list = field(default_factory=list)
    texts: list = field(default_factory=list)
    stats: list = field(default_factory=list)


def decode_all(target, draft, task, prepared: list, method: str, cfg: EvalConfig, *, gamma: Optional[int] = None,
               schedule: Optional[str] = None, max_new_tokens: Optional[int] = None, warmup: bool = True) -> MethodRun:
    """Decode every prepared input (batch 1, seed ``cfg.seed + i``) with ``method``; one uncounted warm-up first."""
    from tilespec.engine import SpeculativeDecoder
    from tilespec.verify.types import SamplingParams

    gamma = gamma or cfg.gamma
    dec = SpeculativeDecoder(target, draft, gamma=gamma, gamma_schedule=schedule or cfg.schedule,
                             max_gamma=max(cfg.max_gamma, gamma), method=method,
                             sampling=SamplingParams(temperature=cfg.temperature))
    limit = max_new_tokens or cfg.max_new_tokens
    run = MethodRun(method=method)
    scale = cfg.sigmoid_scale if method == "sigmoid" else None
    ctx = sigmoid_constants(scale) if scale is not None else contextlib.nullcontext()
    with ctx:
        if warmup and prepared:
            p = prepared[0]
            dec.generate(input_ids=[p.ids], max_new_tokens=min(8, limit), seed=cfg.seed, input_features=p.features)
        for i, p in enumerate(prepared):
            out = dec.generate(input_ids=[p.ids], max_new_tokens=limit, seed=cfg.seed + i, input_features=p.features)
            run.sequences.append(list(out.sequences[0]))
            run.texts.append(task.decode(out.sequences[0]))
            run.stats.append(out.stats)
    return run


def summarize(run: MethodRun, target, *, task=None, examples: Optional[list] = None) -> dict:
    """Aggregate a :class:`MethodRun`: metric, verify/wall time, per-step stats, acceptance, memory, bandwidth."""
    stats = run.stats
    vocab, itemsize = _vocab_and_itemsize(target)
    verify_s = sum(s.times.get("verify", 0.0) for s in stats)
    steps = sum(s.steps for s in stats)
    per_example_ms = [1e3 * s.times.get("verify", 0.0) / s.steps for s in stats if s.steps]
    _, std_ms = mean_std(per_example_ms)
    drafted = sum(s.drafted for s in stats)
    tested = sum(s.tested for s in stats)
    accepted = sum(s.accepted for s in stats)
    nbytes = sum(verify_bytes(s.gammas, vocab, itemsize, 1) for s in stats)
    gammas = [g for s in stats for g in s.gammas]
    phases = {}
    for s in stats:
        for k, v in s.times.items():
            phases[k] = phases.get(k, 0.0) + v
    out = dict(
        method=run.method, examples=len(stats), steps=steps, new_tokens=sum(s.new_tokens for s in stats),
        verify_time_s=verify_s, verify_step_ms=1e3 * verify_s / steps if steps else float("nan"),
        verify_step_ms_std=std_ms, wall_time_s=sum(s.wall_time for s in stats), phase_times_s=phases,
        alpha=accepted / drafted if drafted else float("nan"), alpha_tested=accepted / tested if tested else float("nan"),
        mean_gamma=sum(gammas) / len(gammas) if gammas else 0.0,
        peak_memory_bytes=max((s.peak_memory_bytes for s in stats), default=0),
        verify_bytes=nbytes, bandwidth_gbps=bandwidth_gbps(nbytes, verify_s),
        texts=list(run.texts),
    )
    if task is not None and examples is not None:
        out[task.metric] = task.score(run.texts, examples)
    return out


def add_deltas(methods: dict, baseline: str = BASELINE, sequences: Optional[dict] = None) -> None:
    """Add Δ% (profiling = total verify time, per-step, wall clock) vs ``baseline`` and output agreement in place."""
    base = methods.get(baseline)
    if base is None:
        return
    for name, row in methods.items():
        row["delta_profiling_pct"] = delta_pct(base["verify_time_s"], row["verify_time_s"])
        row["delta_step_pct"] = delta_pct(base["verify_step_ms"], row["verify_step_ms"])
        row["delta_wall_pct"] = delta_pct(base["wall_time_s"], row["wall_time_s"])
        if sequences and name in sequences and baseline in sequences:
            same = [a == b for a, b in zip(sequences[name], sequences[baseline])]
            row["identical_to_baseline"] = sum(same) / len(same) if same else float("nan")


def clean(obj):
    """JSON-safe copy: NaN/inf -> None, tuples -> lists."""
    if isinstance(obj, float):
        return None if math.isnan(obj) or math.isinf(obj) else obj
    if isinstance(obj, dict):
        return {str(k): clean(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [clean(v) for v in obj]
    return obj


def run_main(target, draft, task, examples: list, cfg: EvalConfig, log=print) -> dict:
    """The main comparison (paper Tables 1, 5, 6): every method on every example with the heuristic γ."""
    device = next(target.parameters()).device
    dtype = next(target.parameters()).dtype
    prepared = [task.prepare(e, device, dtype) for e in examples]
    rows, seqs = {}, {}
    for method in cfg.methods:
        run = decode_all(target, draft, task, prepared, method, cfg, warmup=cfg.warmup)
        rows[method] = summarize(run, target, task=task, examples=examples)
        seqs[method] = run.sequences
        r = rows[method]
        log(f"  {method:8s} {task.metric}={r[task.metric]:.4f} verify={r['verify_time_s']:.3f}s "
            f"({r['verify_step_ms']:.3f} ms/step) wall={r['wall_time_s']:.2f}s alpha={r['alpha']:.3f}")
    add_deltas(rows, sequences=seqs)
    return rows
