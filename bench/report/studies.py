"""REPORT.md's tables of the side studies (``python -m bench.studies``), ours beside the paper's: Table 8
(acceptance rate and verify ms per step vs the initial γ) and Tables 2/7 (the sigmoid scaling sweep with its measured
distortion)."""
from __future__ import annotations

from . import paper
from .tables import _f, _label, _methods, _ours_note, _pair, _pct


def table8(runs: list) -> list[str]:
    acc_runs = [r for r in runs if r.get("acceptance")]
    if not acc_runs:
        return []
    gammas = paper.TABLE8_GAMMAS
    head = " | ".join(f"α γ0={g}" for g in gammas) + " | " + " | ".join(f"ms γ0={g}" for g in gammas)
    out = ["## Table 8 — acceptance rate and verification ms per step for initial γ0 (heuristic schedule)", "",
           f"| source | dataset | target / draft | method | {head} |", "|---|---|---|---|" + "---|" * 2 * len(gammas)]
    for r in acc_runs:
        acc = r["acceptance"]
        for m in _methods(acc):
            by = acc[m]
            cells = [_f(by.get(str(g), {}).get("alpha"), "{:.1%}") for g in gammas]
            cells += [_f(by.get(str(g), {}).get("verify_step_ms")) for g in gammas]
            out.append(f"| ours{_ours_note(r)} | {_label(r)} (n={r.get('sweep_n')}) | {_pair(r)} | {m} | "
                       + " | ".join(cells) + " |")
    for m, (acc, ms) in paper.TABLE8_QWEN.items():
        out.append(f"| paper | XSum (10%) | Qwen 7B / Qwen 0.5B | {m} | " + " | ".join(f"{a}%" for a in acc) + " | "
                   + " | ".join(f"{t}" for t in ms) + " |")
    return out + ["", "α here = accepted / drafted tokens (a rejection ends a block, so later drafted tokens count "
                  "as not accepted).", ""]


def table7(runs: list) -> list[str]:
    ab_runs = [r for r in runs if r.get("alphabeta")]
    out = ["## Tables 2 / 7 — sigmoid (α, β) scaling sweep, with its measured distortion", ""]
    if ab_runs:
        out += ["| source | dataset | target / draft | scale (α, β) | metric | Δ% profiling | α (acceptance) | "
                "acceptance inflation vs hf | TV distance, first token (max over shapes) | acceptance inflation "
                "(closed form) |", "|---|---|---|---|---|---|---|---|---|---|"]
        for r in ab_runs:
            metric = r.get("metric", "metric")
            for row in r["alphabeta"].get("rows", []):
                dist = row.get("distortion") or {}
                tv = _f(dist.get("tv"), "{:.3f}") if dist.get("available") else ("n/a" if dist else "–")
                infl = _f(dist.get("acceptance_inflation"), "×{:.3f}") if dist.get("available") else "–"
                out.append(f"| ours{_ours_note(r)} | {_label(r)} (n={r['alphabeta'].get('examples')}) | "
                           f"{_pair(r)} | {row.get('label')} | {metric.upper()} {_f(row.get(metric), '{:.4f}')} | "
                           f"{_pct(row.get('delta_profiling_pct'))} | {_f(row.get('alpha'))} | "
                           f"{_f(row.get('alpha_inflation'), '{:+.3f}')} | {tv} | {infl} |")
    if not ab_runs:
        out += ["| source | dataset | target / draft | scale (α, β) | metric | Δ% profiling |", "|---|---|---|---|---|---|"]
    for name, d in paper.TABLE7.items():
        pair, _, data = name.partition(" (")
        for sc, (v, dp) in d.items():
            tail = " | – | – | – | – |" if ab_runs else " |"
            out.append(f"| paper | {data.rstrip(')')} | {pair} | −{sc:g} {sc:g} | {v} | {dp:+.1f}%{tail}")
    return out + ["", "Distortion: total-variation distance between the law of the first token sigmoid emits and "
                  "the target's, from `tilespec.exactness.distortion`'s closed form (K = 1, float64) on LM-like "
                  "logit rows; exact methods have TV 0 by construction (and pass the exactness suite). Sigmoid's "
                  "higher acceptance is part of its error, not a gain.", ""]
