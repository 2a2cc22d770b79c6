"""REPORT.md's quality table for the paper-scale runs: ROUGE-1 / ROUGE-2 / ROUGE-L (summarization) or WER (ASR) of
every method of every ``eval-scale-*`` run, each with a 95 % bootstrap interval over the examples, recomputed at
render time from the committed outputs (``methods[m].texts``) and references — no stored number is trusted here."""
from __future__ import annotations

from tilespec.bench.metrics import ROUGE_TYPES, _per_example, bootstrap_ci, rouge_per_example
from .tables import _label, _pair


def _cell(v: tuple) -> str:
    return f"{v[0]:.3f} [{v[1]:.3f}, {v[2]:.3f}]"


def method_quality(r: dict, method: str) -> dict:
    """{metric: (value, lo, hi)} of one method of a run, from its texts and the run's references; {} if missing."""
    row, refs = (r.get("methods") or {}).get(method) or {}, r.get("references")
    texts = row.get("texts")
    if not texts or not refs or len(refs) < len(texts):
        return {}
    refs = refs[:len(texts)]
    if r.get("metric") == "wer":
        pieces = _per_example("wer", texts, refs)
        return {"wer": bootstrap_ci("wer", pieces)} if pieces else {}
    per = rouge_per_example(texts, refs)   # scored once per report, shared with the paired bootstrap
    return {t: bootstrap_ci(t, per[t]) for t in ROUGE_TYPES}


def quality_table(runs: list) -> list[str]:
    sel = [r for r in runs if str(r.get("_source", "")).startswith("eval-scale-") and r.get("methods")]
    rows = []
    for r in sel:
        for m in r["methods"]:
            q = method_quality(r, m)
            if not q:
                continue
            cells = [(_cell(q[t]) if t in q else "–") for t in (*ROUGE_TYPES, "wer")]
            rows.append(f"| {_label(r)} | {_pair(r)} | {m}{' (NOT exact)' if m == 'sigmoid' else ''} | "
                        f"{len(r['methods'][m]['texts'])} | " + " | ".join(cells) + f" | `{r.get('_source')}` |")
    if not rows:
        return []
    return ["### Paper-scale runs: quality with 95 % bootstrap intervals", "",
            "Recomputed from the committed outputs and references: ROUGE F1 (stemmed, mean over examples) or corpus "
            "WER, each with the 2.5-97.5 % quantiles of 2,000 resamples of the examples. T = 0: the exact methods' "
            "outputs are (nearly all) the baseline's, so their values coincide; T = 1: each method draws its own "
            "samples, compare them with the paired intervals above.", "",
            "| run | target / draft | method | n | ROUGE-1 | ROUGE-2 | ROUGE-L | WER | file |",
            "|---|---|---|---|---|---|---|---|---|", *rows, ""]
