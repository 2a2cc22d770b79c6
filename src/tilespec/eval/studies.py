"""The paper's side studies, run on a fixed subset (the first ``cfg.sweep_limit`` examples of the main sample).

* acceptance (Table 8): heuristic schedule started at γ ∈ ``accept_gammas``; acceptance rate and verify ms/step.
* gamma (Fig. 3, Figs. 4-5): *constant* γ = 1..20 (the verify shape is then exactly γ); verify ms/step and peak
  memory (CUDA max allocated; on CPU the process' max RSS, which only grows and says little).
* alphabeta (Tables 2, 7): sigmoid with (α, β) = (-s, s) for s in ``scales``, accuracy and Δ% profiling vs the
  ``hf`` baseline on the same subset; beside each row the acceptance inflation measured in the run itself
  (α_sigmoid - α_baseline) and, when ``tilespec.exactness.distortion`` is available, its TV distance.
"""
from __future__ import annotations

from dataclasses import replace

from .harness import BASELINE, EvalConfig, decode_all, delta_pct, summarize


def _prepared(task, examples, target):
    device = next(target.parameters()).device
    dtype = next(target.parameters()).dtype
    return [task.prepare(e, device, dtype) for e in examples]


def _slim(row: dict, metric: str | None = None) -> dict:
    keys = ["verify_time_s", "verify_step_ms", "verify_step_ms_std", "wall_time_s", "alpha", "alpha_tested",
            "mean_gamma", "steps", "peak_memory_bytes", "bandwidth_gbps", "verify_bytes"]
    if metric and metric in row:
        keys.append(metric)
    return {k: row[k] for k in keys if k in row}


def acceptance_study(target, draft, task, examples, cfg: EvalConfig, log=print) -> dict:
    """{method: {γ0: {alpha, verify_step_ms, ...}}} for the heuristic schedule started at each γ0."""
    prepared = _prepared(task, examples, target)
    out = {}
    for method in cfg.methods:
        out[method] = {}
        for g in cfg.accept_gammas:
            run = decode_all(target, draft, task, prepared, method, cfg, gamma=g, schedule="heuristic",
                             max_new_tokens=cfg.sweep_max_new_tokens, warmup=cfg.warmup)
            out[method][str(g)] = _slim(summarize(run, target))
            log(f"  acceptance {method:8s} γ0={g:2d} alpha={out[method][str(g)]['alpha']:.3f} "
                f"{out[method][str(g)]['verify_step_ms']:.3f} ms/step")
    return out


def gamma_study(target, draft, task, examples, cfg: EvalConfig, log=print) -> dict:
    """{method: {γ: {verify_step_ms, peak_memory_bytes, ...}}} for constant γ."""
    prepared = _prepared(task, examples, target)
    out = {}
    for method in cfg.methods:
        out[method] = {}
        for g in cfg.sweep_gammas:
            run = decode_all(target, draft, task, prepared, method, cfg, gamma=g, schedule="constant",
                             max_new_tokens=cfg.sweep_max_new_tokens, warmup=cfg.warmup)
            out[method][str(g)] = _slim(summarize(run, target))
            log(f"  gamma {method:8s} γ={g:2d} {out[method][str(g)]['verify_step_ms']:.3f} ms/step "
                f"peak={out[method][str(g)]['peak_memory_bytes'] / 2**20:.0f} MiB")
    return out


def measure_distortion(alpha: float, beta: float) -> dict:
    """TV distance / acceptance inflation of sigmoid at (α, β) from ``tilespec.exactness.distortion`` if present."""
    try:
        from tilespec.exactness.distortion import run_distortion
    except ImportError as err:
        return {"available": False, "note": f"tilespec.exactness.distortion not available ({err.__class__.__name__})"}
    try:
        result = run_distortion(alpha=alpha, beta=beta)
    except TypeError:
        try:
            result = run_distortion(alphas=[alpha], betas=[beta])
        except Exception as err:  # noqa: BLE001 - the report records whatever went wrong
            return {"available": False, "note": f"run_distortion call failed: {err}"}
    except Exception as err:  # noqa: BLE001
        return {"available": False, "note": f"run_distortion failed: {err}"}
    if hasattr(result, "to_dict"):
        result = result.to_dict()
    elif hasattr(result, "__dict__") and not isinstance(result, dict):
        result = dict(vars(result))
    return {"available": True, "result": result}


def alphabeta_study(target, draft, task, examples, cfg: EvalConfig, log=print) -> dict:
    """Baseline row plus one sigmoid row per scale: metric, Δ% profiling vs hf, α inflation, distortion."""
    prepared = _prepared(task, examples, target)
    base_run = decode_all(target, draft, task, prepared, BASELINE, cfg, warmup=cfg.warmup)
    base = summarize(base_run, target, task=task, examples=examples)
    rows = [dict(scale=None, label="baseline", **_slim(base, task.metric))]
    for s in cfg.scales:
        run = decode_all(target, draft, task, prepared, "sigmoid", replace(cfg, sigmoid_scale=s), warmup=cfg.warmup)
        row = summarize(run, target, task=task, examples=examples)
        rows.append(dict(scale=s, label=f"-{s:g} {s:g}", alpha_scale=-s, beta_scale=s, **_slim(row, task.metric),
                         delta_profiling_pct=delta_pct(base["verify_time_s"], row["verify_time_s"]),
                         alpha_inflation=row["alpha"] - base["alpha"],
                         distortion=measure_distortion(-s, s)))
        log(f"  alphabeta ±{s:g}: {task.metric}={row[task.metric]:.4f} "
            f"Δprof={rows[-1]['delta_profiling_pct']:.1f}% α_infl={rows[-1]['alpha_inflation']:+.3f}")
    return {"rows": rows, "examples": len(examples)}
