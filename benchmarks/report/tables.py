"""The paper's tables, ours beside the paper's: Table 1 (accuracy, Δ% profiling) with its sampling-noise check,
Table 5 (wall clock), Table 6 (verify ms per step), Table 8 (acceptance vs initial γ), Tables 2/7 (sigmoid scaling
sweep with its distortion) and Table 3 (realized bandwidth, plus the kernel-only ``verify-*`` benchmark table).

Inputs: eval run records as loaded by :func:`benchmarks.report.build.load_results` (and, for Table 3, its list of
other result files). The small formatting helpers at the top are shared with ``build.py``, which imports them from
here (this module never imports ``report``).
"""
from __future__ import annotations

import math
from pathlib import Path

from tilespec.verify.registry import all_methods, get_method

from . import paper

METHOD_ORDER = tuple(m.name for m in all_methods())   # the registry's display order
DATASET_NAMES = {"xsum": "XSum", "cnndm": "CNN/DM", "ljspeech": "LJSpeech (8 clips)",
                 "synthetic": "synthetic espeak-ng speech (NOT LibriSpeech)"}


def _f(x, fmt="{:.3f}", none="–"):
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return none
    try:
        return fmt.format(x)
    except (ValueError, TypeError):
        return str(x)


def _pct(x):
    return _f(x, "{:+.1f}%")


def _is_gpu(r: dict) -> bool:
    dev = str((r.get("environment") or {}).get("device"))
    return dev != "None" and "CPU" not in dev


def _methods(rows: dict) -> list:
    return [m for m in METHOD_ORDER if m in rows] + [m for m in rows if m not in METHOD_ORDER]


def _exact(method: str) -> bool:
    """The registry's word on ``method`` (a name a results file has but this version lacks counts as exact)."""
    try:
        return get_method(method).exact
    except ValueError:
        return True


def _suffix(method: str) -> str:
    return " (baseline)" if method == "hf" else "" if _exact(method) else " (not exact)"


def _dataset(r: dict) -> str:
    return DATASET_NAMES.get(r.get("dataset"), str(r.get("dataset")))


def _pair(r: dict) -> str:
    return f"{r.get('target')} / {r.get('draft') or '– (target-only)'}"


def drafter_note(r: dict) -> str:
    """", ngram drafter" / ", target-only" for the context-drafter and target-only runs of a stage, else ""."""
    d = r.get("draft")
    if d is None and r.get("target"):
        return ", target-only"
    return f", {d} drafter" if str(d) in ("ngram", "suffix") else ""


def _device(r: dict) -> str:
    dev = str((r.get("environment") or {}).get("device"))
    return dev.replace("NVIDIA ", "").replace(" 80GB HBM3", "")


def _temp(r: dict) -> str:
    return _f((r.get("config") or {}).get("temperature"), "{:g}")


def _batch(r: dict) -> int:
    """Examples per generation of a run's main comparison (1 = the paper's protocol)."""
    b = r.get("batch_size") or (r.get("config") or {}).get("batch_size") or 1
    return b if isinstance(b, int) and not isinstance(b, bool) else 1


def _label(r: dict) -> str:
    """Short run label used in every table: dataset, T, device (and the batch size of a batched run)."""
    b = _batch(r)
    return (f"{_dataset(r)}, T={_temp(r)}{drafter_note(r)}, {_device(r)}"
            + (f", B={b} (batched)" if b > 1 else ""))


def is_partial(r: dict) -> bool:
    """A run stopped before its sampled set: n below ``n_requested`` or a ``*-partial`` stage."""
    n, req = r.get("n"), r.get("n_requested")
    short = isinstance(n, int) and isinstance(req, int) and n < req
    return short or any(str(s).endswith("-partial") for s in r.get("stages_done") or [])


def n_cell(r: dict) -> str:
    """n, with the sampled target and a PARTIAL flag when the run stopped early."""
    n, req = r.get("n"), r.get("n_requested")
    return (f"{n}" + (f" of {req}" if req not in (None, n) else "")
            + (" (**partial**)" if is_partial(r) else ""))


def identical_count(r: dict, method: str) -> tuple | None:
    """(examples whose output equals the baseline's, examples compared) for ``method`` vs ``hf``: token sequences
    from ``raw`` chunks (matched by example index) where recorded, else the texts, else the stored fraction × n."""
    raw = r.get("raw") if isinstance(r.get("raw"), dict) else {}

    def seqs(m):
        out = {}
        for chunk in raw.get(m) or []:
            if isinstance(chunk, dict) and all(isinstance(chunk.get(k), list) for k in ("idx", "sequences")):
                out.update(zip(chunk["idx"], chunk["sequences"]))
        return out
    a, b = seqs("hf"), seqs(method)
    common = [i for i in a if i in b]
    if common:
        return sum(a[i] == b[i] for i in common), len(common)
    rows = r.get("methods") or {}
    ta, tb = (rows.get("hf") or {}).get("texts"), (rows.get(method) or {}).get("texts")
    if isinstance(ta, list) and isinstance(tb, list) and ta and len(ta) == len(tb):
        return sum(x == y for x, y in zip(ta, tb)), len(ta)
    frac, n = (rows.get(method) or {}).get("identical_to_baseline"), r.get("n")
    if isinstance(frac, (int, float)) and isinstance(n, int) and n > 0:
        return round(frac * n), n
    return None


def _same_cell(r: dict, method: str) -> str:
    c = identical_count(r, method) if method in (r.get("methods") or {}) else None
    return f"{c[0]}/{c[1]}" if c else "–"


def tokens_per_s(row: dict):
    """Decoding rate of an eval method row: recorded ``tokens_per_s``, else new tokens / wall time."""
    tps = row.get("tokens_per_s")
    if isinstance(tps, (int, float)) and not isinstance(tps, bool):
        return tps
    n, w = row.get("new_tokens"), row.get("wall_time_s")
    return n / w if isinstance(n, (int, float)) and isinstance(w, (int, float)) and w > 0 else None


def _ours_note(r: dict) -> str:
    return ("" if _is_gpu(r) else " (CPU: Triton interpreter)") + (" ‡" if r.get("timing_note") else "")


# --------------------------------------------------------------------------------------------------- tables
def table1(runs: list) -> list[str]:
    out = ["## Table 1 — accuracy and Δ% profiling time (total time inside the verification step vs the baseline)",
           "", "Ours: `hf` is the baseline; the paper's *exact* kernel is our `tiled`; `fused` is ours. "
           "Paper rows: A100, fp16, transformers 4.38.2 baseline.", "",
           "| source | dataset | target / draft | metric | n | baseline | exact (tiled) | fused | sigmoid | "
           "outputs identical to baseline (tiled / fused) | Δ% exact (tiled) | Δ% fused | Δ% sigmoid |",
           "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in runs:
        rows = r.get("methods") or {}
        if not rows:
            continue
        metric = r.get("metric", "metric")
        g = lambda m, k: (rows.get(m) or {}).get(k)  # noqa: E731
        same = " / ".join(_same_cell(r, m) for m in ("tiled", "fused"))
        out.append(f"| ours{_ours_note(r)} | {_label(r)} | {_pair(r)} | {metric.upper()} | {n_cell(r)} | "
                   f"{_f(g('hf', metric))} | {_f(g('tiled', metric))} | {_f(g('fused', metric))} | "
                   f"{_f(g('sigmoid', metric))} | {same} | {_pct(g('tiled', 'delta_profiling_pct'))} | "
                   f"{_pct(g('fused', 'delta_profiling_pct'))} | {_pct(g('sigmoid', 'delta_profiling_pct'))} |")
    for d, t, dr, m, b, e, s, de, ds in paper.TABLE1:
        out.append(f"| paper | {d} | {t} / {dr} | {m} | 10% | {b} | {e} | – | {s} | – | {de:+.1f}% | – | "
                   f"{ds:+.1f}% |")
    return out + ["", "n: examples scored (\"of N\": the sampled set; **partial**: the run stopped before it, by its "
                  "time budget). Runs labelled \"B=16 (batched)\" generate 16 examples per call: their times are per "
                  "batched step, not the paper's batch-1 protocol, and Δ% compares methods at the same batch size. "
                  "Identical outputs: examples whose generated token sequence (else text) equals the baseline's. "
                  "‡: the run's record carries a `timing_note` (its times are not clean: see *Runs*); its outputs "
                  "and metrics are unaffected.", "",
                  "At temperature 0 the exact methods must give token-identical outputs (100 %); at temperature 1 "
                  "`hf` draws its random numbers differently (torch generator, transformers' semantics) from "
                  "`tiled`/`fused` (counter-based Philox, identical to each other), so their texts differ and their "
                  "metrics agree only within sampling noise.", ""]


def noise_table(runs: list) -> list[str]:
    """Sampled runs (T > 0): is each exact method's metric within sampling noise of the baseline's?"""
    from tilespec.bench.metrics import paired_bootstrap
    lines = []
    for r in runs:
        rows, refs, metric = r.get("methods") or {}, r.get("references"), r.get("metric")
        base = (rows.get("hf") or {}).get("texts")
        if not (r.get("config") or {}).get("temperature") or not base or not refs or metric not in ("rouge1", "wer"):
            continue
        for m in ("tiled", "fused"):
            texts = (rows.get(m) or {}).get("texts")
            if not texts or len(texts) != len(base) or len(refs) < len(base):
                continue
            d, lo, hi = paired_bootstrap(metric, base, texts, refs[:len(base)])
            verdict = "yes" if lo <= 0 <= hi else "**no**"
            lines.append(f"| {_label(r)} | {metric.upper()} | {m} | {len(base)} | {d:+.3f} | [{lo:+.3f}, {hi:+.3f}] | "
                         f"{verdict} |")
    if not lines:
        return []
    return ["### Sampled runs: exact methods vs the baseline within sampling noise?", "",
            "Paired bootstrap over the examples (2,000 resamples): metric(method) − metric(`hf`) and its 95 % "
            "interval; \"yes\" = the interval contains 0.", "",
            "| dataset | metric | method | n | difference | 95 % interval | within noise |", "|---|---|---|---|---|---|---|",
            *lines, ""]


def sigmoid_table(runs: list) -> list[str]:
    """Sampled runs with sigmoid: its quality change beside its speed, against ``hf`` and ``fused`` of the same run.
    Sigmoid is NOT exact: its speed comes partly from accepting drafts it should reject."""
    lines = []
    for r in runs:
        rows, metric = r.get("methods") or {}, r.get("metric")
        sig, hf, fused = rows.get("sigmoid"), rows.get("hf"), rows.get("fused")
        if not (r.get("config") or {}).get("temperature") or not isinstance(sig, dict) or not isinstance(hf, dict):
            continue
        ms, mh = sig.get(metric), hf.get(metric)
        diff = ms - mh if isinstance(ms, (int, float)) and isinstance(mh, (int, float)) else None
        rel = diff / mh * 100 if diff is not None and mh else None
        th, tf, ts = tokens_per_s(hf), tokens_per_s(fused or {}), tokens_per_s(sig)
        lines.append(f"| {_label(r)}{_ours_note(r)} | {n_cell(r)} | {str(metric).upper()} | {_f(mh)} | "
                     f"{_f((fused or {}).get(metric))} | {_f(ms)} | {_f(diff, '{:+.3f}')} ({_f(rel, '{:+.1f}%')}) | "
                     f"{_f(th, '{:.0f}')} | {_f(tf, '{:.0f}')} | {_f(ts, '{:.0f}')} | "
                     f"{_f(ts / th if ts and th else None, '{:.2f}×')} | {_f(hf.get('alpha'), '{:.2f}')} / "
                     f"{_f(sig.get('alpha'), '{:.2f}')} | {hf.get('new_tokens', '–')} / "
                     f"{sig.get('new_tokens', '–')} | `{r.get('_source')}` |")
    if not lines:
        return []
    return ["### Sigmoid (NOT exact): its quality change beside its speed", "",
            "Same run, same examples and seeds. tok/s = new tokens / wall time of the whole decoding loop (batched "
            "runs: all requests of a batch). Sigmoid's higher acceptance α and its speed are part of its error: it "
            "accepts drafts the exact rule would reject (and may emit fewer tokens), so its metric change is the price "
            "of its speed, not noise. ROUGE: higher is better; WER: lower is better.", "",
            "| run | n | metric | hf | fused | sigmoid | sigmoid − hf | hf tok/s | fused tok/s | sigmoid tok/s | "
            "sigmoid / hf tok/s | α hf / sigmoid | new tokens hf / sigmoid | file |",
            "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|", *lines, ""]


def table5(runs: list) -> list[str]:
    out = ["## Table 5 — wall clock of the whole decoding loop, Δ% vs baseline", "",
           "| source | dataset | target / draft | n | engine | baseline wall (s) | Δ% tiled | Δ% fused | Δ% sigmoid |",
           "|---|---|---|---|---|---|---|---|---|"]
    for r in runs:
        rows = r.get("methods") or {}
        if not rows:
            continue
        g = lambda m, k: (rows.get(m) or {}).get(k)  # noqa: E731
        out.append(f"| ours{_ours_note(r)} | {_label(r)} | {_pair(r)} | {n_cell(r)} | "
                   f"{(r.get('config') or {}).get('compile', 'eager')} | {_f(g('hf', 'wall_time_s'), '{:.2f}')} | "
                   f"{_pct(g('tiled', 'delta_wall_pct'))} | {_pct(g('fused', 'delta_wall_pct'))} | "
                   f"{_pct(g('sigmoid', 'delta_wall_pct'))} |")
    for d, t, dr, e, s in paper.TABLE5:
        out.append(f"| paper | {d} | {t} / {dr} | 10% | HF generate | – | {e:+.1f}% (exact) | – | {s:+.1f}% |")
    return out + ["", "Wall clock includes the draft and target forwards (and, with sigmoid, its different "
                  "acceptance, hence a different number of steps): it mixes verification speed with how many "
                  "tokens each method accepts.", ""]


def table6(runs: list) -> list[str]:
    out = ["## Table 6 — time inside the verification step per decoding step (ms, mean ± std over examples)", "",
           "| source | dataset | target / draft | baseline | exact (tiled) | fused | sigmoid | Δ% tiled | Δ% fused | "
           "Δ% sigmoid |", "|---|---|---|---|---|---|---|---|---|---|"]
    for r in runs:
        rows = r.get("methods") or {}
        if not rows:
            continue
        cell = lambda m: (f"{_f((rows.get(m) or {}).get('verify_step_ms'))} ± "  # noqa: E731
                          f"{_f((rows.get(m) or {}).get('verify_step_ms_std'))}" if m in rows else "–")
        g = lambda m: (rows.get(m) or {}).get("delta_step_pct")  # noqa: E731
        out.append(f"| ours{_ours_note(r)} | {_label(r)} | {_pair(r)} | {cell('hf')} | {cell('tiled')} | "
                   f"{cell('fused')} | {cell('sigmoid')} | {_pct(g('tiled'))} | {_pct(g('fused'))} | "
                   f"{_pct(g('sigmoid'))} |")
    for d, t, dr, b, e, s, de, ds in paper.TABLE6:
        out.append(f"| paper | {d} | {t} / {dr} | {b[0]} ± {b[1]} | {e[0]} ± {e[1]} | – | {s[0]} ± {s[1]} | "
                   f"{de:+.1f}% | – | {ds:+.1f}% |")
    return out + [""]


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


def table3(runs: list, others: list) -> list[str]:
    out = ["## Table 3 — realized bandwidth of the verification step", "",
           "Ours (eval runs): bytes the verification must read (target γ+1 and draft γ logit rows per step, in the "
           "logits' dtype) / time inside `verify()` — a lower bound of the DRAM traffic the paper counts with "
           "Nsight Compute sectors. Kernel-only numbers from the `verify-*` benchmark follow below.", "",
           "| source | dataset | target / draft | baseline GB/s | exact (tiled) GB/s | fused GB/s | sigmoid GB/s |",
           "|---|---|---|---|---|---|---|"]
    for r in runs:
        rows = r.get("methods") or {}
        if not rows:
            continue
        g = lambda m: _f((rows.get(m) or {}).get("bandwidth_gbps"), "{:.2f}")  # noqa: E731
        out.append(f"| ours{_ours_note(r)} | {_label(r)} | {_pair(r)} | {g('hf')} | {g('tiled')} | {g('fused')} | "
                   f"{g('sigmoid')} |")
    for name, b, e, s in paper.TABLE3:
        out.append(f"| paper | XSum / CV16 (100 ex.) | {name} | {b} | {e} | – | {s} |")
    out.append("")
    for path, doc in others:
        if path.name.startswith("verify-") and isinstance(doc, dict) and "EXPERIMENT" not in str(doc.get("note")):
            out += verify_kernel_table(path, doc)
    return out


def verify_kernel_table(path: Path, doc: dict) -> list[str]:
    """GPU kernel-level view of Tables 3/6 from a ``verify-*`` benchmark file (B = 1, temperature 1, eager)."""
    from tilespec.bench.metrics import delta_pct

    rows = [r for r in doc.get("rows", []) if isinstance(r, dict) and r.get("B") == 1
            and r.get("temperature") == 1.0 and r.get("regime") == "mid" and not r.get("top_k")
            and r.get("dtype") == "bf16" and r.get("V") in (51865, 151936)]
    if not rows:
        return []
    evaluated = [m.name for m in all_methods() if m.evaluate]
    methods = [m for m in evaluated if any(m in r.get("results", {}) for r in rows)]
    out = [f"Verification step alone on {doc.get('device')} (`{path.name}`, batch 1, bf16 logits, temperature 1, "
           "eager launches; µs per call, Δ% vs `hf`, realized GB/s = bytes that must be read / time):", "",
           "| V | γ | " + " | ".join(f"{m} µs" for m in methods) + " | " +
           " | ".join(f"Δ% {m}" for m in methods if m != "hf") + " | " + " | ".join(f"{m} GB/s" for m in methods)
           + " |", "|---|---|" + "---|" * (3 * len(methods) - 1)]
    for r in sorted(rows, key=lambda r: (r["V"], r["K"])):
        res = r["results"]
        us = [(res.get(m) or {}).get("eager_us") for m in methods]
        base = (res.get("hf") or {}).get("eager_us")
        out.append(f"| {r['V']} | {r['K']} | " + " | ".join(_f(u, "{:.0f}") for u in us) + " | " +
                   " | ".join(_pct(delta_pct(base, (res.get(m) or {}).get("eager_us"))) for m in methods if m != "hf")
                   + " | " + " | ".join(_f((res.get(m) or {}).get("eager_GBps"), "{:.1f}") for m in methods) + " |")
    return out + [""]
