"""Which committed result files and rows the REPORT.md summary quotes (see ``summary.py``).

Inputs are ``(path, parsed JSON or error string)`` pairs from ``load_results``. Files are ranked by their date
(``environment.date`` / ``date`` / a ``YYYY-MM-DD`` in the name), then by how many systems they hold, then by name,
so the choice is deterministic. Rows that failed (``error``), lack a rate, or are not dicts are ignored.
"""
from __future__ import annotations

import re
from pathlib import Path

from tilespec.bench.e2e_systems import HF_KINDS, engine_draft_name

SMALL_N = 100  # sample sizes below this get a warning (quality claims need hundreds of examples per dataset)
# system kind -> summary label, in display order; a drafter kind not named here (any name the engine resolves, and
# tilespec+NAME) is labelled and ordered by :func:`label` / :func:`kind_rank`
E2E_ORDER = {"hf": "transformers (dynamic cache)", "hf-static": "transformers static cache",
             "hf-assisted": "transformers assisted (draft model)", "hf-prompt-lookup": "transformers prompt lookup",
             "ar": "tilespec target-only", "tilespec": "tilespec + draft model", "ngram": "tilespec n-gram",
             "suffix": "tilespec suffix", "tilespec+ngram": "tilespec draft model + n-gram",
             "tilespec+suffix": "tilespec draft model + suffix"}


def is_hf_kind(kind: str) -> bool:
    """Whether an e2e row's ``kind`` is one of transformers' systems (the baselines)."""
    return kind in HF_KINDS


def is_drafter_kind(kind: str) -> bool:
    """A speculative system of our engine: ``tilespec``, a drafter name, or ``tilespec+NAME``."""
    parsed = engine_draft_name(kind)
    return parsed is not None and kind != "ar"


def is_context_kind(kind: str) -> bool:
    """A system drafting with a named drafter (alone or backed by the draft model), not the --draft model alone."""
    parsed = engine_draft_name(kind)
    return parsed is not None and parsed[1] is not None


def label(kind: str) -> str:
    if kind in E2E_ORDER:
        return E2E_ORDER[kind]
    with_model, name = engine_draft_name(kind)
    return f"tilespec draft model + {name}" if with_model else f"tilespec {name}"


def kind_rank(kind: str) -> tuple:
    order = list(E2E_ORDER)
    return (order.index(kind), "") if kind in E2E_ORDER else (order.index("tilespec+suffix") + 1, kind)
VERIFY_BATCHES = (1, 64)
VERIFY_GAMMA = 5


def _num(x):
    return x if isinstance(x, (int, float)) and not isinstance(x, bool) and x == x else None


def _d(x) -> dict:
    return x if isinstance(x, dict) else {}


def file_date(path: Path, doc: dict) -> str:
    text = str(_d(doc.get("environment")).get("date") or doc.get("date") or "")
    m = re.search(r"\d{4}-\d{2}-\d{2}", text) or re.search(r"\d{4}-\d{2}-\d{2}", Path(path).name)
    return m.group(0) if m else ""


def file_time(doc: dict) -> str:
    """The recorded timestamp (``environment.date`` / ``date``) as written, '' without one: orders one day's files."""
    return str(_d(doc.get("environment")).get("date") or doc.get("date") or "")


def e2e_models(st: dict) -> tuple[str, str | None, bool]:
    """(target, draft, corrected) of an e2e file's settings. ``bench e2e --whisper`` replaces the text defaults
    (Qwen) by whisper-base after recording its settings, so a Whisper file may name the Qwen defaults: those are
    shown as what ran (``corrected`` = True)."""
    target, draft = st.get("target"), st.get("draft") or None
    if st.get("whisper") and "whisper" not in str(target or "").lower():
        return "whisper-base", None, True
    return str(target or "?"), draft, False


def newest(files: list):
    return max(files, key=lambda pd: (file_date(*pd[:2]), Path(pd[0]).name))


def kind(row: dict) -> str | None:
    """System kind of an e2e row: ``kind`` where recorded, else the system name before ``:`` / ``@``."""
    k = row.get("kind") or re.split(r"[:@]", str(row.get("system") or ""))[0]
    return k if k in E2E_ORDER or engine_draft_name(k) is not None else None


def _rows(doc: dict) -> list:
    res = doc.get("results")
    return [r for r in res if isinstance(r, dict) and "error" not in r] if isinstance(res, list) else []


def newest_e2e(others: list) -> tuple[list, list]:
    """(newest real-weight e2e file per target/ASR setting and task list, notes on skipped e2e files). Newest =
    latest day; among one day's files those comparing our target-only with transformers' static-cache generate
    (the anchor users compare with) first, then the latest recorded time, then the most system kinds. A runtime
    comparison on one task and a drafter comparison on several tasks are both shown."""
    groups, notes = {}, []
    for path, doc in others:
        path = Path(path)
        if not path.name.startswith("e2e-") or isinstance(doc, str):
            continue
        if not isinstance(doc, dict) or not _rows(doc):
            notes.append(f"`{path.name}`: no result rows, skipped")
            continue
        st = _d(doc.get("settings"))
        if st.get("random_init") or st.get("tiny"):
            continue
        groups.setdefault((e2e_models(st)[0], bool(st.get("whisper")), str(st.get("task"))), []).append((path, doc))
    newest_day = {}
    for (target, whisper, _), docs in groups.items():
        day = max(file_date(*pd) for pd in docs)
        newest_day[(target, whisper)] = max(day, newest_day.get((target, whisper), day))
    picked = []
    for key in sorted(groups):
        docs = [pd for pd in groups[key] if file_date(*pd) == newest_day[key[:2]]]
        if docs:
            picked.append(max(docs, key=lambda pd: ({"ar", "hf-static"} <= {kind(r) for r in _rows(pd[1])},
                                                    file_time(pd[1]), len({kind(r) for r in _rows(pd[1])}),
                                                    pd[0].name)))
    return picked, notes


def _spread(row: dict) -> tuple | None:
    """(min, max) tok/s over the batches a row recorded (``runs``), when there are at least two."""
    rates = [_num(r.get("new_tokens")) / r["wall_time"] for r in row.get("runs") or []
             if isinstance(r, dict) and _num(r.get("new_tokens")) is not None and (_num(r.get("wall_time")) or 0) > 0]
    return (min(rates), max(rates)) if len(rates) >= 2 else None


def e2e_groups(doc: dict) -> list:
    """[((task, T, B), rows)], B = 1 first: the fastest row of each system kind, in ``E2E_ORDER``, each a dict with
    kind, label, system, tps, spread, vs_ar (over the fastest target-only row of the group), vs_static, runtime,
    drafter, match_share."""
    st = _d(doc.get("settings"))
    task0 = "ljspeech" if st.get("whisper") else st.get("task") or st.get("dataset") or "?"
    groups: dict = {}
    for r in _rows(doc):
        k, tps, b = kind(r), _num(r.get("tokens_per_second")), _num(r.get("batch_size", 1))
        if k is None or tps is None or b is None:
            continue
        g = groups.setdefault((str(r.get("task") or task0), _num(r.get("temperature")), int(b)), {})
        if k not in g or tps > g[k]["tps"]:
            g[k] = dict(kind=k, label=label(k), system=str(r.get("system")), tps=tps, spread=_spread(r),
                        runtime=r.get("runtime"), drafter=r.get("drafter"), match_share=_num(r.get("match_share")))
    out = []
    for (task, temp, b), g in sorted(groups.items(), key=lambda kv: (kv[0][2], kv[0][0], kv[0][1] or 0)):
        ar, static = g.get("ar"), g.get("hf-static")
        rows = [g[k] for k in sorted(g, key=kind_rank)]
        for r in rows:
            r["vs_ar"] = r["tps"] / ar["tps"] if ar and ar["tps"] else None
            r["vs_static"] = r["tps"] / static["tps"] if static and static["tps"] else None
        out.append(((task, temp, b), rows))
    return out


def spec_label(kind: str) -> str:
    """Short name of a speculative system kind: "draft model", "n-gram", "draft model + suffix", ..."""
    return label(kind).removeprefix("tilespec ").removeprefix("+ ")
DRAFTERS = ("tilespec", "ngram", "suffix")   # the drafters a per-task comparison should cover


def best_drafters(picked: list) -> list:
    """Per task at B = 1, T = 0 over the summarized e2e files: [(task, best speculative row or None, its file,
    measured drafter kinds, drafter kinds not measured)]; a task a file asked for (``settings.task``, comma list)
    without any row counts as not measured."""
    tasks: dict = {}
    for path, doc in picked:
        st = _d(doc.get("settings"))
        for t in str(st.get("task") or "").split(","):
            if t.strip() and not st.get("whisper"):
                tasks.setdefault(t.strip(), [])
        for (task, temp, b), rows in e2e_groups(doc):
            if b == 1 and temp == 0:
                tasks.setdefault(task, []).extend((r, path, doc) for r in rows if is_drafter_kind(r["kind"]))
    out = []
    for task in sorted(tasks):
        cands = tasks[task]
        best = max(cands, key=lambda c: c[0]["tps"]) if cands else None
        seen = {c[0]["kind"] for c in cands}
        out.append((task, best[0] if best else None, best[1] if best else None, best[2] if best else None,
                    sorted(seen, key=kind_rank), [k for k in DRAFTERS if k not in seen]))
    return out


def native_files(others: list) -> list:
    return [(Path(p), d) for p, d in others
            if Path(p).name.startswith("native-forward-") and isinstance(d, dict) and isinstance(d.get("models"), dict)]


def verify_headline(others: list):
    """(path, doc, rows) of the newest non-experiment verify file: its V=151936 (else largest V) bf16, T=1,
    mid-regime, no top-k rows at γ = VERIFY_GAMMA (else the smallest γ) for each of VERIFY_BATCHES; None if none."""
    files = [(Path(p), d) for p, d in others if Path(p).name.startswith("verify-") and isinstance(d, dict)
             and isinstance(d.get("rows"), list) and "EXPERIMENT" not in str(d.get("note") or "").upper()]
    if not files:
        return None
    path, doc = newest(files)
    ok = [r for r in doc["rows"] if isinstance(r, dict) and isinstance(r.get("results"), dict)
          and r.get("dtype") == "bf16" and r.get("temperature") == 1.0 and r.get("regime", "mid") == "mid"
          and not _filtered(r) and _num(r.get("V")) and _num(r.get("K"))]
    vs = {r["V"] for r in ok}
    v = 151936 if 151936 in vs else max(vs, default=None)
    rows = []
    for b in VERIFY_BATCHES:
        cand = [r for r in ok if r["V"] == v and r.get("B") == b]
        pick = next((r for r in cand if r["K"] == VERIFY_GAMMA), min(cand, key=lambda r: r["K"], default=None))
        if pick is not None:
            rows.append(pick)
    return path, doc, rows


def verify_filter_rows(doc: dict) -> list:
    """Rows of a verify file with a top-k, top-p or min-p filter (bf16, mid regime, γ = VERIFY_GAMMA, V as the headline),
    B in VERIFY_BATCHES, ordered by filter then B."""
    ok = [r for r in doc.get("rows") or [] if isinstance(r, dict) and isinstance(r.get("results"), dict)
          and r.get("dtype") == "bf16" and r.get("regime", "mid") == "mid" and r.get("K") == VERIFY_GAMMA
          and r.get("B") in VERIFY_BATCHES and _filtered(r)]
    return sorted(ok, key=lambda r: (r.get("top_k") or 0, _num(r.get("top_p")) or 1.0, _num(r.get("min_p")) or 0.0,
                                     _num(r.get("temperature")) or 1.0, r["B"]))


def _filtered(r: dict) -> bool:
    """Whether a verify row has a top-k, top-p or min-p filter."""
    return bool(r.get("top_k") or (_num(r.get("top_p")) or 1.0) < 1.0 or (_num(r.get("min_p")) or 0.0) > 0.0)


def is_gpu_device(text) -> bool:
    t = str(text or "").lower()
    return any(w in t for w in ("cuda", "nvidia", "h100", "h200", "a100", "gpu"))


def exactness_files(others: list) -> list:
    """[(path, doc, result dicts)] of every exactness file with at least one result: GPU files first, then newest
    first, then by name."""
    out = []
    for p, d in others:
        if Path(p).name.startswith("exactness-") and isinstance(d, dict):
            res = [x for x in d.get("results") or [] if isinstance(x, dict)]
            if res:
                out.append((Path(p), d, res))
    out.sort(key=lambda x: x[0].name)
    out.sort(key=lambda x: file_date(x[0], x[1]), reverse=True)
    out.sort(key=lambda x: not is_gpu_device(x[1].get("device")))
    return out


# ------------------------------------------------------------------------------------------ formatting
def _f(x, fmt="{:.1f}", none="–"):
    ok = isinstance(x, (int, float)) and not isinstance(x, bool) and x == x
    return fmt.format(x) if ok else none


def _x(x) -> str:
    return _f(x, "{:.2f}×")


def _dev(text) -> str:
    return str(text or "?").replace("NVIDIA ", "").replace(" 80GB HBM3", "")
