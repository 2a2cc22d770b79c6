"""The paper's tables, ours followed by the paper's: Table 1 (accuracy, Δ% profiling) with its sampling-noise check
and the quality price of the methods that are not exact, Table 5 (wall clock), Table 6 (verify ms per step) and
Table 3 (realized bandwidth, plus the kernel-only ``verify-*`` benchmark table). Their method columns are the
registered methods (``tilespec.verify.registry``) the runs measured, beside the baseline ``BASELINE``; exactness
comes from the registry. The side studies' tables are in :mod:`.studies`.

Inputs: eval run records as loaded by :func:`bench.report.build.load_results` (and, for Table 3, its list of
other result files). The small formatting helpers at the top are shared with ``build.py``, which imports them from
here (this module never imports ``report``).
"""
from __future__ import annotations

import math
from pathlib import Path

from tilespec.bench.config import BASELINE
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
    return " (baseline)" if method == BASELINE else "" if _exact(method) else " (not exact)"


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
    """(examples whose output equals the baseline's, examples compared) for ``method`` vs the baseline: token sequences
    from ``raw`` chunks (matched by example index) where recorded, else the texts, else the stored fraction × n."""
    raw = r.get("raw") if isinstance(r.get("raw"), dict) else {}

    def seqs(m):
        out = {}
        for chunk in raw.get(m) or []:
            if isinstance(chunk, dict) and all(isinstance(chunk.get(k), list) for k in ("idx", "sequences")):
                out.update(zip(chunk["idx"], chunk["sequences"]))
        return out
    a, b = seqs(BASELINE), seqs(method)
    common = [i for i in a if i in b]
    if common:
        return sum(a[i] == b[i] for i in common), len(common)
    rows = r.get("methods") or {}
    ta, tb = (rows.get(BASELINE) or {}).get("texts"), (rows.get(method) or {}).get("texts")
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
def compared(runs: list) -> list[str]:
    """The methods the tables set beside the baseline: every method some run measured, in the registry's order
    (names a results file has but this version lacks last), the baseline left out."""
    seen = {m for r in runs for m in (r.get("methods") or {})}
    return [m for m in _methods({m: None for m in seen}) if m != BASELINE]


def _cols(methods: list, fmt) -> str:
    return " | ".join(fmt(m) for m in methods)


def _head(methods: list) -> str:
    return _cols(methods, lambda m: f"`{m}`{'' if _exact(m) else ' (NOT exact)'}")


def _sep(n: int) -> str:
    return "|" + "---|" * n


def table1(runs: list) -> list[str]:
    ms = compared(runs)
    exact = [m for m in ms if _exact(m)]
    out = ["## Table 1 — accuracy and Δ% profiling time (total time inside the verification step vs the baseline)",
           "", f"Ours: `{BASELINE}` is the baseline; the other columns are the registered methods the runs measured "
           "(the paper's *exact* kernel is our `tiled`). Paper rows below: A100, fp16, transformers 4.38.2 baseline.",
           "", "| dataset | target / draft | metric | n | baseline | " + _head(ms)
           + (" | outputs identical to baseline (" + " / ".join(exact) + ")" if exact else "") + " | "
           + _cols(ms, lambda m: f"Δ% {m}") + " |", _sep(5 + 2 * len(ms) + bool(exact))]
    for r in runs:
        rows = r.get("methods") or {}
        if not rows:
            continue
        metric = r.get("metric", "metric")
        g = lambda m, k: (rows.get(m) or {}).get(k)  # noqa: E731
        same = [" / ".join(_same_cell(r, m) for m in exact)] if exact else []
        out.append("| " + " | ".join([f"{_label(r)}{_ours_note(r)}", _pair(r), metric.upper(), n_cell(r),
                                       _f(g(BASELINE, metric))] + [_f(g(m, metric)) for m in ms] + same
                                      + [_pct(g(m, "delta_profiling_pct")) for m in ms]) + " |")
    out += ["", "Paper (Table 1):", "", "| dataset | target / draft | metric | n | baseline | exact | sigmoid | "
            "Δ% exact | Δ% sigmoid |", _sep(9)]
    for d, t, dr, m, b, e, s, de, ds in paper.TABLE1:
        out.append(f"| {d} | {t} / {dr} | {m} | 10% | {b} | {e} | {s} | {de:+.1f}% | {ds:+.1f}% |")
    return out + ["", "n: examples scored (\"of N\": the sampled set; **partial**: the run stopped before it, by its "
                  "time budget). Runs labelled \"B=16 (batched)\" generate 16 examples per call: their times are per "
                  "batched step, not the paper's batch-1 protocol, and Δ% compares methods at the same batch size. "
                  "Identical outputs: examples whose generated token sequence (else text) equals the baseline's. "
                  "‡: the run's record carries a `timing_note` (its times are not clean: see *Runs*); its outputs "
                  "and metrics are unaffected.", "",
                  "At temperature 0 the exact methods must give token-identical outputs (100 %); at temperature 1 "
                  f"`{BASELINE}` draws its random numbers differently (torch generator, transformers' semantics) from "
                  "our kernels (counter-based Philox, identical to each other), so their texts differ and their "
                  "metrics agree only within sampling noise.", ""]


def noise_table(runs: list) -> list[str]:
    """Sampled runs (T > 0): is each exact method's metric within sampling noise of the baseline's?"""
    from tilespec.bench.metrics import paired_bootstrap
    lines = []
    exact = [m for m in compared(runs) if _exact(m)]
    for r in runs:
        rows, refs, metric = r.get("methods") or {}, r.get("references"), r.get("metric")
        base = (rows.get(BASELINE) or {}).get("texts")
        if not (r.get("config") or {}).get("temperature") or not base or not refs or metric not in ("rouge1", "wer"):
            continue
        for m in exact:
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
            "Paired bootstrap over the examples (2,000 resamples): metric(method) − metric(`" + BASELINE + "`) and its "
            "95 % interval; \"yes\" = the interval contains 0.", "",
            "| dataset | metric | method | n | difference | 95 % interval | within noise |", _sep(7), *lines, ""]


def approximate_table(runs: list) -> list[str]:
    """Sampled runs with a NOT exact method: its quality change beside its speed, against the baseline and the
    fastest exact method of the same run. Its speed comes partly from accepting drafts it should reject."""
    lines = []
    approx = [m for m in compared(runs) if not _exact(m)]
    for r in runs:
        rows, metric = r.get("methods") or {}, r.get("metric")
        base = rows.get(BASELINE)
        if not (r.get("config") or {}).get("temperature") or not isinstance(base, dict):
            continue
        exact = [(tokens_per_s(rows[m]), m) for m in rows if m != BASELINE and _exact(m) and isinstance(rows[m], dict)
                 and tokens_per_s(rows[m])]
        best = max(exact) if exact else None
        for m in approx:
            row = rows.get(m)
            if not isinstance(row, dict):
                continue
            ma, mb = row.get(metric), base.get(metric)
            diff = ma - mb if isinstance(ma, (int, float)) and isinstance(mb, (int, float)) else None
            rel = diff / mb * 100 if diff is not None and mb else None
            tb, ta = tokens_per_s(base), tokens_per_s(row)
            lines.append(f"| {_label(r)}{_ours_note(r)} | {n_cell(r)} | {m} | {str(metric).upper()} | {_f(mb)} | "
                         f"{_f(ma)} | {_f(diff, '{:+.3f}')} ({_f(rel, '{:+.1f}%')}) | {_f(tb, '{:.0f}')} | "
                         + (f"{best[1]} {best[0]:.0f}" if best else "–") + f" | {_f(ta, '{:.0f}')} | "
                         f"{_f(ta / tb if ta and tb else None, '{:.2f}×')} | {_f(base.get('alpha'), '{:.2f}')} / "
                         f"{_f(row.get('alpha'), '{:.2f}')} | {base.get('new_tokens', '–')} / "
                         f"{row.get('new_tokens', '–')} | `{r.get('_source')}` |")
    if not lines:
        return []
    return ["### Methods that are NOT exact: their quality change beside their speed", "",
            "Same run, same examples and seeds. tok/s = new tokens / wall time of the whole decoding loop (batched "
            "runs: all requests of a batch). A higher acceptance α and the speed it buys are part of the error: such a "
            "method accepts drafts the exact rule would reject (and may emit fewer tokens), so its metric change is the "
            "price of its speed, not noise. ROUGE: higher is better; WER: lower is better.", "",
            f"| run | n | method | metric | {BASELINE} | method | method − {BASELINE} | {BASELINE} tok/s | fastest exact "
            f"tok/s | method tok/s | method / {BASELINE} tok/s | α {BASELINE} / method | new tokens {BASELINE} / method "
            "| file |", _sep(14), *lines, ""]


def table5(runs: list) -> list[str]:
    ms = compared(runs)
    out = ["## Table 5 — wall clock of the whole decoding loop, Δ% vs baseline", "",
           "| dataset | target / draft | n | engine | baseline wall (s) | " + _cols(ms, lambda m: f"Δ% {m}") + " |",
           _sep(5 + len(ms))]
    for r in runs:
        rows = r.get("methods") or {}
        if not rows:
            continue
        g = lambda m, k: (rows.get(m) or {}).get(k)  # noqa: E731
        out.append(f"| {_label(r)}{_ours_note(r)} | {_pair(r)} | {n_cell(r)} | "
                   f"{(r.get('config') or {}).get('compile', 'eager')} | {_f(g(BASELINE, 'wall_time_s'), '{:.2f}')} | "
                   + " | ".join(_pct(g(m, "delta_wall_pct")) for m in ms) + " |")
    out += ["", "Paper (Table 5, HF generate):", "", "| dataset | target / draft | Δ% exact | Δ% sigmoid |", _sep(4)]
    out += [f"| {d} | {t} / {dr} | {e:+.1f}% | {s:+.1f}% |" for d, t, dr, e, s in paper.TABLE5]
    return out + ["", "Wall clock includes the draft and target forwards (and, with a non-exact method, its different "
                  "acceptance, hence a different number of steps): it mixes verification speed with how many "
                  "tokens each method accepts.", ""]


def table6(runs: list) -> list[str]:
    ms = compared(runs)
    out = ["## Table 6 — time inside the verification step per decoding step (ms, mean ± std over examples)", "",
           "| dataset | target / draft | baseline | " + _head(ms) + " | " + _cols(ms, lambda m: f"Δ% {m}") + " |",
           _sep(3 + 2 * len(ms))]
    for r in runs:
        rows = r.get("methods") or {}
        if not rows:
            continue
        cell = lambda m: (f"{_f((rows.get(m) or {}).get('verify_step_ms'))} ± "  # noqa: E731
                          f"{_f((rows.get(m) or {}).get('verify_step_ms_std'))}" if m in rows else "–")
        g = lambda m: (rows.get(m) or {}).get("delta_step_pct")  # noqa: E731
        out.append(f"| {_label(r)}{_ours_note(r)} | {_pair(r)} | {cell(BASELINE)} | " + " | ".join(map(cell, ms))
                   + " | " + " | ".join(_pct(g(m)) for m in ms) + " |")
    out += ["", "Paper (Table 6):", "", "| dataset | target / draft | baseline | exact | sigmoid | Δ% exact | "
            "Δ% sigmoid |", _sep(7)]
    out += [f"| {d} | {t} / {dr} | {b[0]} ± {b[1]} | {e[0]} ± {e[1]} | {s[0]} ± {s[1]} | {de:+.1f}% | {ds:+.1f}% |"
            for d, t, dr, b, e, s, de, ds in paper.TABLE6]
    return out + [""]


def table3(runs: list, others: list) -> list[str]:
    ms = compared(runs)
    out = ["## Table 3 — realized bandwidth of the verification step", "",
           "Ours (eval runs): bytes the verification must read (target γ+1 and draft γ logit rows per step, in the "
           "logits' dtype) / time inside `verify()` — a lower bound of the DRAM traffic the paper counts with "
           "Nsight Compute sectors. Kernel-only numbers from the `verify-*` benchmark follow below.", "",
           "| dataset | target / draft | baseline GB/s | " + _cols(ms, lambda m: f"{m} GB/s") + " |", _sep(3 + len(ms))]
    for r in runs:
        rows = r.get("methods") or {}
        if not rows:
            continue
        g = lambda m: _f((rows.get(m) or {}).get("bandwidth_gbps"), "{:.2f}")  # noqa: E731
        out.append(f"| {_label(r)}{_ours_note(r)} | {_pair(r)} | {g(BASELINE)} | " + " | ".join(map(g, ms)) + " |")
    out += ["", "Paper (Table 3, XSum / CV16, 100 examples):", "", "| target / draft | baseline GB/s | exact GB/s | "
            "sigmoid GB/s |", _sep(4)]
    out += [f"| {name} | {b} | {e} | {s} |" for name, b, e, s in paper.TABLE3]
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
            and (r.get("top_p") or 1.0) >= 1.0 and not (r.get("min_p") or 0.0)
            and r.get("dtype") == "bf16" and r.get("V") in (51865, 151936)]
    if not rows:
        return []
    evaluated = [m.name for m in all_methods() if m.evaluate]
    methods = [m for m in evaluated if any(m in r.get("results", {}) for r in rows)]
    out = [f"Verification step alone on {doc.get('device')} (`{path.name}`, batch 1, bf16 logits, temperature 1, "
           f"eager launches; µs per call, Δ% vs `{BASELINE}`, realized GB/s = bytes that must be read / time):", "",
           "| V | γ | " + " | ".join(f"{m} µs" for m in methods) + " | " +
           " | ".join(f"Δ% {m}" for m in methods if m != BASELINE) + " | " + " | ".join(f"{m} GB/s" for m in methods)
           + " |", "|---|---|" + "---|" * (3 * len(methods) - 1)]
    for r in sorted(rows, key=lambda r: (r["V"], r["K"])):
        res = r["results"]
        us = [(res.get(m) or {}).get("eager_us") for m in methods]
        base = (res.get(BASELINE) or {}).get("eager_us")
        out.append(f"| {r['V']} | {r['K']} | " + " | ".join(_f(u, "{:.0f}") for u in us) + " | " +
                   " | ".join(_pct(delta_pct(base, (res.get(m) or {}).get("eager_us"))) for m in methods if m != BASELINE)
                   + " | " + " | ".join(_f((res.get(m) or {}).get("eager_GBps"), "{:.1f}") for m in methods) + " |")
    return out + [""]
