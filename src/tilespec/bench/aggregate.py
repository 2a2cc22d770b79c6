"""Aggregates of one method's decoding run: the metric, verify / wall time, acceptance (pooled by
``RunStats.merge``), memory, bandwidth, and the Δ% columns against the baseline; plus a JSON-safe copy helper.
"""
from __future__ import annotations

import math
from typing import Optional

from .config import BASELINE
from .metrics import bandwidth_gbps, delta_pct, mean_std, verify_bytes


def _vocab_and_itemsize(model) -> tuple[int, int]:
    head = model.get_output_embeddings().weight
    return int(head.shape[0]), int(head.element_size())


def summarize(run, target, *, task=None, examples: Optional[list] = None) -> dict:
    """Aggregate a ``harness.MethodRun`` (method, texts, one RunStats per generation: per example at batch 1, per
    chunk in batched runs): metric, verify / wall time, per-step stats (the std is over generations), acceptance,
    memory, bandwidth, tokens/s (wall time without the engine's compile / capture seconds). Verify bytes count every row verify() saw: on the compiled paths finished rows stay
    in the batch (``requests`` rows per step), on the eager path they leave it (mean live rows per step)."""
    from tilespec.engine import RunStats

    stats = run.stats
    vocab, itemsize = _vocab_and_itemsize(target)
    tot = RunStats.merge(stats)
    verify_s = tot.times.get("verify", 0.0)
    per_example_ms = [1e3 * s.times.get("verify", 0.0) / s.steps for s in stats if s.steps]
    _, std_ms = mean_std(per_example_ms)
    nbytes = sum(verify_bytes(s.gammas, vocab, itemsize, _verify_rows(s)) for s in stats)
    # a compile / graph capture the warm-up missed lands in whichever method meets the shape first: keep it out of
    # the wall time the methods are compared on (recorded as compile_seconds and in wall_time_with_compile_s)
    wall = max(0.0, tot.wall_time - tot.compile_seconds)
    out = dict(
        method=run.method, examples=len(stats), steps=tot.steps, new_tokens=tot.new_tokens,
        verify_time_s=verify_s, verify_step_ms=1e3 * verify_s / tot.steps if tot.steps else float("nan"),
        verify_step_ms_std=std_ms, wall_time_s=wall, wall_time_with_compile_s=tot.wall_time,
        phase_times_s=dict(tot.times),
        alpha=tot.alpha, alpha_tested=tot.alpha_tested, mean_gamma=tot.mean_gamma,
        block_efficiency=tot.block_efficiency, drafter=tot.drafter, match_share=tot.match_share,
        tokens_per_s=tot.new_tokens / wall if wall > 0 else float("nan"),
        batch_size=max((s.requests for s in stats), default=0), compile_seconds=tot.compile_seconds,
        runtime=tot.runtime, peak_memory_bytes=tot.peak_memory_bytes, verify_bytes=nbytes, bandwidth_gbps=bandwidth_gbps(nbytes, verify_s),
        texts=list(run.texts),
    )
    if task is not None and examples is not None:
        out[task.metric] = task.score(run.texts, examples)
    return out


def _verify_rows(s) -> float:
    """Rows per verify() call of one generation: all requests on the compiled paths, mean live ones on eager."""
    if s.runtime not in ("eager", "native", "") or not s.steps:
        return s.requests or 1
    return s.request_steps / s.steps


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
