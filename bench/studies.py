"""The paper's side studies, run on a fixed subset (the first ``cfg.sweep_limit`` examples of the main sample).

* acceptance (Table 8): heuristic schedule started at γ ∈ ``accept_gammas``; acceptance rate and verify ms/step.
* gamma (Fig. 3, Figs. 4-5): *constant* γ = 1..20 by default (the verify shape is then exactly γ; the paper varies
  the initial γ of the heuristic instead: ``sweep_schedule="heuristic"``); verify ms/step and peak memory (CUDA max
  allocated; on CPU the process' max RSS, which only grows and says little).
* alphabeta (Tables 2, 7): sigmoid with (α, β) = (-s, s) for s in ``scales``, accuracy and Δ% profiling vs the
  ``hf`` baseline on the same subset; beside each row the acceptance inflation measured in the run itself
  (α_sigmoid - α_baseline) and, when ``tilespec.exactness.distortion`` is available, its TV distance.

``python -m bench.studies summarization|asr [tilespec eval options] --studies main,acceptance,gamma,alphabeta``
runs ``tilespec eval`` with these studies after its main comparison (same record, same resume and time budget).
"""
from __future__ import annotations

import argparse
import sys
import time
from dataclasses import replace

from tilespec.bench.aggregate import summarize
from tilespec.bench.config import BASELINE, EvalConfig
from tilespec.bench.harness import decode_all
from tilespec.bench.metrics import delta_pct


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


def coarse_to_fine(values) -> list:
    """``values`` reordered so that any prefix spans the range: ends first, then midpoints (1..20 -> 1, 20, 9, 17,
    5, 13, ...). A study cut by its time budget then still covers the whole γ range coarsely."""
    vals = list(dict.fromkeys(values))
    if len(vals) <= 2:
        return vals
    out = [vals[0], vals[-1]]
    step = 1
    while step * 2 < len(vals):
        step *= 2
    while step >= 1:
        for i in range(0, len(vals), step):
            if vals[i] not in out:
                out.append(vals[i])
        step //= 2
    return out


def _late(deadline, log, what: str) -> bool:
    if deadline is not None and time.time() > deadline:
        log(f"  time budget reached: {what}")
        return True
    return False


def acceptance_study(target, draft, task, examples, cfg: EvalConfig, log=print, deadline=None) -> dict:
    """{method: {γ0: {alpha, verify_step_ms, ...}}} for the heuristic schedule started at each γ0 (γ0-major, so a
    ``deadline`` leaves whole columns)."""
    prepared = _prepared(task, examples, target)
    out = {m: {} for m in cfg.methods}
    for g in cfg.accept_gammas:
        if _late(deadline, log, f"acceptance study stopped before γ0={g}"):
            break
        for method in cfg.methods:
            run = decode_all(target, draft, task, prepared, method, cfg, gamma=g, schedule="heuristic",
                             max_new_tokens=cfg.sweep_max_new_tokens, warmup=cfg.warmup)
            out[method][str(g)] = _slim(summarize(run, target))
            log(f"  [{time.strftime('%H:%M:%S')}] acceptance {method:8s} γ0={g:2d} "
                f"alpha={out[method][str(g)]['alpha']:.3f} {out[method][str(g)]['verify_step_ms']:.3f} ms/step")
    return out


def gamma_study(target, draft, task, examples, cfg: EvalConfig, log=print, deadline=None) -> dict:
    """{method: {γ: {verify_step_ms, peak_memory_bytes, ...}}} for constant γ, γ visited coarse to fine and
    γ-major (every method at a γ before the next γ), so a ``deadline`` leaves a coarse but complete curve."""
    prepared = _prepared(task, examples, target)
    out = {m: {} for m in cfg.methods}
    for g in coarse_to_fine(cfg.sweep_gammas):
        if _late(deadline, log, f"γ sweep stopped before γ={g} ({sum(map(len, out.values()))} points done)"):
            break
        for method in cfg.methods:
            run = decode_all(target, draft, task, prepared, method, cfg, gamma=g, schedule=cfg.sweep_schedule,
                             max_new_tokens=cfg.sweep_max_new_tokens, warmup=cfg.warmup)
            out[method][str(g)] = _slim(summarize(run, target))
            log(f"  [{time.strftime('%H:%M:%S')}] gamma {method:8s} γ={g:2d} "
                f"{out[method][str(g)]['verify_step_ms']:.3f} ms/step "
                f"peak={out[method][str(g)]['peak_memory_bytes'] / 2**20:.0f} MiB")
    return {m: dict(sorted(by.items(), key=lambda kv: int(kv[0]))) for m, by in out.items()}


def measure_distortion(alpha: float, beta: float, seed: int = 0) -> dict:
    """Distortion of sigmoid at (α, β) from ``tilespec.exactness.distortion``'s closed form (K = 1, float64), on
    its LM-like logit shapes: TV distance of the first emitted token's law from the target's, TV of the bonus row,
    and the acceptance inflation (acceptance under sigmoid / the exact acceptance). Never raises."""
    try:
        import torch

        from tilespec.exactness.distortion import logit_shapes, sigmoid_first_token_law, sigmoid_hat
    except ImportError as err:
        return {"available": False, "note": f"tilespec.exactness.distortion not available ({err.__class__.__name__})"}
    try:
        rows = []
        for shape, (t, d) in logit_shapes(seed).items():
            p = torch.softmax(t.double(), -1)
            exact_accept = float(torch.minimum(p, torch.softmax(d.double(), -1)).sum())
            law, acc = sigmoid_first_token_law(t, d, alpha, beta)
            bonus = sigmoid_hat(t, alpha, beta)
            rows.append(dict(shape=shape, tv_first_token=round(0.5 * float((law - p).abs().sum()), 4),
                             tv_bonus_token=round(0.5 * float((bonus / bonus.sum() - p).abs().sum()), 4),
                             accept_exact=round(exact_accept, 4), accept_sigmoid=round(acc, 4),
                             acceptance_inflation=round(acc / exact_accept, 3) if exact_accept > 0 else None))
    except Exception as err:  # noqa: BLE001 - the report records whatever went wrong
        return {"available": False, "note": f"distortion closed form failed: {err}"}
    tvs = [r["tv_first_token"] for r in rows]
    infl = [r["acceptance_inflation"] for r in rows if r["acceptance_inflation"] is not None]
    return {"available": True, "tv": max(tvs), "tv_mean": sum(tvs) / len(tvs),
            "acceptance_inflation": max(infl) if infl else None,
            "source": "tilespec.exactness.distortion closed form, K = 1, synthetic LM-like logit rows (V = 32000)",
            "result": rows}


def alphabeta_study(target, draft, task, examples, cfg: EvalConfig, log=print, deadline=None) -> dict:
    """Baseline row plus one sigmoid row per scale: metric, Δ% profiling vs hf, α inflation, distortion."""
    prepared = _prepared(task, examples, target)
    base_run = decode_all(target, draft, task, prepared, BASELINE, cfg, warmup=cfg.warmup)
    base = summarize(base_run, target, task=task, examples=examples)
    rows = [dict(scale=None, label="baseline", **_slim(base, task.metric))]
    for s in cfg.scales:
        if _late(deadline, log, f"α/β sweep stopped before ±{s:g}"):
            break
        run = decode_all(target, draft, task, prepared, "sigmoid", replace(cfg, sigmoid_scale=s), warmup=cfg.warmup)
        row = summarize(run, target, task=task, examples=examples)
        rows.append(dict(scale=s, label=f"-{s:g} {s:g}", alpha_scale=-s, beta_scale=s, **_slim(row, task.metric),
                         delta_profiling_pct=delta_pct(base["verify_time_s"], row["verify_time_s"]),
                         alpha_inflation=row["alpha"] - base["alpha"],
                         distortion=measure_distortion(-s, s)))
        log(f"  [{time.strftime('%H:%M:%S')}] alphabeta ±{s:g}: {task.metric}={row[task.metric]:.4f} "
            f"Δprof={rows[-1]['delta_profiling_pct']:.1f}% α_infl={rows[-1]['alpha_inflation']:+.3f}")
    return {"rows": rows, "examples": len(examples)}


# study name -> (key of its result in the eval record, function)
STUDIES = {"acceptance": ("acceptance", acceptance_study), "gamma": ("gamma_sweep", gamma_study),
           "alphabeta": ("alphabeta", alphabeta_study)}


def _int_list(text: str) -> list[int]:
    """"1-20" or "3,5,10" -> list of ints."""
    out = []
    for part in text.split(","):
        part = part.strip()
        if "-" in part:
            lo, hi = part.split("-", 1)
            out.extend(range(int(lo), int(hi) + 1))
        elif part:
            out.append(int(part))
    if not out:
        raise argparse.ArgumentTypeError(f"empty integer list {text!r}")
    return out


def _float_list(text: str) -> list[float]:
    try:
        return [float(p) for p in text.split(",") if p.strip()]
    except ValueError as err:
        raise argparse.ArgumentTypeError(f"bad number list {text!r}") from err


def add_study_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--studies", default="main,acceptance,gamma,alphabeta",
                   help="comma-separated of main, " + ", ".join(STUDIES) + " or 'all' (default all)")
    p.add_argument("--sweep-limit", type=int, default=4, help="examples used by the side studies (default 4)")
    p.add_argument("--sweep-gammas", type=_int_list, default=list(range(1, 21)), help="constant γ values (1-20)")
    p.add_argument("--accept-gammas", type=_int_list, default=[3, 5, 10, 15], help="initial γ values (3,5,10,15)")
    p.add_argument("--scales", type=_float_list, default=[10.0, 1e3, 1e4, 1e5], help="sigmoid scales s")
    p.add_argument("--sweep-max-new-tokens", type=int, default=40)
    p.add_argument("--sweep-schedule", default="constant", choices=("constant", "heuristic"),
                   help="γ sweep (Fig. 3-5): constant γ (default) or the heuristic started at γ (the paper's)")
    p.add_argument("--main-share", type=float, default=0.6, help="share of --time-budget for the main comparison")


def study_settings(args) -> dict:
    """The EvalConfig side-study fields from parsed arguments."""
    names = ("main", *STUDIES) if args.studies == "all" else \
        tuple(s.strip() for s in args.studies.split(",") if s.strip())
    return dict(studies=names, sweep_limit=args.sweep_limit, sweep_gammas=tuple(args.sweep_gammas),
                accept_gammas=tuple(args.accept_gammas), scales=tuple(args.scales),
                sweep_max_new_tokens=args.sweep_max_new_tokens, sweep_schedule=args.sweep_schedule,
                main_share=args.main_share)


def main(argv: list | None = None) -> int:
    from tilespec.cli.eval import add_eval_arguments, run

    p = argparse.ArgumentParser(prog="python -m bench.studies",
                                description="tilespec eval plus the seed paper's side studies")
    sub = p.add_subparsers(dest="eval_task", metavar="TASK", required=True)
    for task in ("summarization", "asr"):
        t = sub.add_parser(task)
        add_eval_arguments(t, task)
        add_study_arguments(t)
    args = p.parse_args(argv)
    return run(args, studies=STUDIES, **study_settings(args))


if __name__ == "__main__":
    sys.exit(main())
