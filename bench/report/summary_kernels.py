"""REPORT.md summary parts about the kernels and the runtime's forwards: (b) native forward ms vs the HBM floor,
(c) the verify-kernel headline and its filter rows, (d) the exactness suites; each as summary lines and a backing
table. Split from :mod:`.summary` (which assembles the summary); nothing here raises on bad data.
"""
from __future__ import annotations

from pathlib import Path

from tilespec.verify.registry import all_methods

from .summary_data import (_dev, _f, _x, exactness_files, native_files, newest, verify_filter_rows,
                                  verify_headline)


# --------------------------------------------------------------------------------------------------- (b) native
def native_lines(others: list) -> list[str]:
    files = native_files(others)
    if not files:
        return []
    path, doc = newest(files)
    cells = []
    for model, m in (doc.get("models") or {}).items():
        if not isinstance(m, dict):
            continue
        floor = m.get("floor_ms_at_3TBps")
        fw = next((x for x in m.get("forwards") or [] if isinstance(x, dict) and x.get("batch") == 1
                   and x.get("q") == 1), None)
        ms = (fw or {}).get("graph_replay_ms")
        if ms is None or not floor:
            continue
        cells.append(f"{model} {_f(ms, '{:.2f}')} ms vs floor {_f(floor, '{:.2f}')} ms ({ms / floor:.2f}× the floor)")
    if not cells:
        return [f"**(b) Native forward**: `{path.name}` has no B=1, q=1 forward with a floor, skipped.", ""]
    decode = [f"{model} B={b}: ours {_f(ours)} tok/s ({runtime}) vs transformers static cache {_f(static)} tok/s "
              f"({_x(ours / static if ours and static else None)})"
              for model, b, ours, runtime, static, _ in decode_rows(doc) if b == 1]
    return [f"**(b) Native compiled forward, B = 1, q = 1, CUDA-graph replay — random-init weights (timing only)**, "
            f"{_dev(doc.get('device'))}, `{path.name}`: " + "; ".join(cells) + ". Floor = weight bytes / 3 TB/s "
            "(HBM)." + (" Target-only decoding in the same file: " + "; ".join(decode) + "." if decode else "")
            + " Full tables: *Native forward vs the HBM floor* below.", ""]


def decode_rows(doc: dict) -> list:
    """[(model, batch, our tok/s, our runtime, HF static-cache tok/s, HF dynamic tok/s)] of a native file's
    target-only decoding runs (``models.<m>.engine`` / ``hf_static`` / ``hf_dynamic``, matched by batch)."""
    out = []
    for model, m in (doc.get("models") or {}).items():
        if not isinstance(m, dict) or not isinstance(m.get("engine"), list):
            continue

        def by_batch(key):
            return {x.get("batch"): x.get("tok_s") for x in m.get(key) or [] if isinstance(x, dict)}
        static, dynamic = by_batch("hf_static"), by_batch("hf_dynamic")
        for e in m["engine"]:
            if isinstance(e, dict) and isinstance(e.get("tok_s"), (int, float)):
                b = e.get("batch")
                out.append((model, b, e["tok_s"], e.get("runtime") or "?", static.get(b), dynamic.get(b)))
    return out


def native_table(others: list) -> list[str]:
    """Backing table of (b): every forward of every native-forward file."""
    files = native_files(others)
    if not files:
        return []
    out = ["## Native forward vs the HBM floor (random-init weights: timing only)", "",
           "Floor = weight bytes / 3 TB/s, the time to read the weights once; q = query tokens per request.", "",
           "| file | device | model | B | q | graph replay ms | forward call ms | floor ms | × floor |",
           "|---|---|---|---|---|---|---|---|---|"]
    for path, doc in files:
        for model, m in (doc.get("models") or {}).items():
            floor = (m or {}).get("floor_ms_at_3TBps") if isinstance(m, dict) else None
            for fw in (m.get("forwards") or []) if isinstance(m, dict) else []:
                if not isinstance(fw, dict):
                    continue
                ms = fw.get("graph_replay_ms")
                ratio = ms / floor if isinstance(ms, (int, float)) and floor else None
                out.append(f"| `{path.name}` | {_dev(doc.get('device'))} | {model} | {fw.get('batch')} | "
                           f"{fw.get('q')} | {_f(ms, '{:.2f}')} | {_f(fw.get('forward_call_ms'), '{:.2f}')} | "
                           f"{_f(floor, '{:.2f}')} | {_f(ratio, '{:.2f}')} |")
    decode = [(path, row) for path, doc in files for row in decode_rows(doc)]
    if decode:
        out += ["", "Target-only decoding, tokens per second (same random-init models; transformers' dynamic cache "
                "may have run fewer tokens, see each file):", "",
                "| file | model | B | ours tok/s | runtime | transformers static tok/s | transformers dynamic tok/s | "
                "ours / static |", "|---|---|---|---|---|---|---|---|"]
        for path, (model, b, ours, runtime, static, dynamic) in decode:
            out.append(f"| `{path.name}` | {model} | {b} | {_f(ours)} | {runtime} | {_f(static)} | {_f(dynamic)} | "
                       f"{_f(ours / static if static else None, '{:.2f}')} |")
    return out + [""]


# --------------------------------------------------------------------------------------------------- (c) verify
def verify_lines(others: list) -> list[str]:
    head = verify_headline(others)
    if head is None:
        return []
    path, doc, rows = head
    if not rows:
        return [f"**(c) Verify kernel**: `{path.name}` has no B=1/B=64 bf16 row at T=1, skipped.", ""]
    parts = []
    for r in rows:
        res = r["results"]
        fused_g, fused_e = (res.get("fused") or {}).get("graph_us"), (res.get("fused") or {}).get("eager_us")
        s = (f"B={r['B']}, γ={r['K']}: fused {_f(fused_g)} µs (graph) / {_f(fused_e, '{:.0f}')} µs (eager), sigmoid "
             f"{_f((res.get('sigmoid') or {}).get('graph_us'))} µs (graph, NOT exact)")
        for name, label in (("hf", "transformers"), ("flashinfer", "FlashInfer")):
            e = (res.get(name) or {}).get("eager_us")
            if e is not None:
                s += f", {label} {_f(e, '{:.0f}')} µs (eager; fused {e / fused_e:.1f}× faster eager-vs-eager)" \
                    if fused_e else f", {label} {_f(e, '{:.0f}')} µs (eager)"
            else:
                s += f", {label} not measured"
        parts.append(s)
    filt = filter_cells(doc)
    return [f"**(c) Verification step alone**, V={rows[0]['V']}, bf16, T=1, {_dev(doc.get('device'))}, "
            f"`{path.name}`: " + "; ".join(parts) + ". Transformers and FlashInfer cannot be captured in a CUDA "
            "graph, so only eager times compare all four."
            + (" With a filter (eager, fused vs FlashInfer): " + "; ".join(filt) + "." if filt else "")
            + " Full table: *Verification kernel at B = 1 and B = 64* below; B=1 sweep: *Table 3*.", ""]


def _filter_name(r: dict) -> str:
    parts = [f"T {r['temperature']}"] if r.get("temperature") not in (None, 1.0) else []
    parts += [f"top-k {r['top_k']}"] if r.get("top_k") else []
    parts += [f"top-p {r['top_p']}"] if (r.get("top_p") or 1.0) < 1.0 else []
    parts += [f"min-p {r['min_p']}"] if (r.get("min_p") or 0.0) > 0.0 else []
    return " / ".join(parts) or "none"


def filter_cells(doc: dict) -> list[str]:
    """'top-k 50, B=1: fused 810 µs vs FlashInfer 557 µs (fused 0.69× as fast)' per filtered row of a verify file."""
    cells = []
    for r in verify_filter_rows(doc):
        res = r["results"]
        fe, fi = (res.get("fused") or {}).get("eager_us"), (res.get("flashinfer") or {}).get("eager_us")
        if fe is None:
            continue
        c = f"{_filter_name(r)}, B={r['B']}: fused {_f(fe, '{:.0f}')} µs"
        if fi:
            c += (f" vs FlashInfer {_f(fi, '{:.0f}')} µs (fused {fi / fe:.1f}× faster)" if fi >= fe else
                  f" vs FlashInfer {_f(fi, '{:.0f}')} µs (fused {fe / fi:.1f}× slower)")
        cells.append(c)
    return cells


def verify_table(others: list) -> list[str]:
    head = verify_headline(others)
    if head is None or not head[2]:
        return []
    path, doc, rows = head
    names = {m for r in rows for m in r["results"]}
    registered = [m.name for m in all_methods()]
    methods = [m for m in registered if m in names] + sorted(names - set(registered))   # then outside contenders
    approx = ", ".join(f"`{m.name}`" for m in all_methods() if not m.exact and m.name in names)
    out = ["## Verification kernel at B = 1 and B = 64", "",
           f"`{path.name}`, {_dev(doc.get('device'))}, V={rows[0]['V']}, bf16, T=1, mid regime; µs per call, graph "
           "(CUDA events over replays) / eager (host wall time per synchronised call); – = not capturable or not "
           f"run.{f' {approx} NOT exact.' if approx else ''} Filter rows: each timed call includes the top-k / top-p "
           "filtering of the "
           "target and draft logits (ours: the default sort-free path).", "",
           "| B | γ | filter | " + " | ".join(methods) + " |", "|---|---|---|" + "---|" * len(methods)]
    for r in rows + verify_filter_rows(doc):
        res = r["results"]
        filt = _filter_name(r)
        out.append(f"| {r['B']} | {r['K']} | {filt} | " + " | ".join(
            f"{_f((res.get(m) or {}).get('graph_us'))} / {_f((res.get(m) or {}).get('eager_us'))}"
            for m in methods) + " |")
    return out + [""]


# --------------------------------------------------------------------------------------------------- (d), (e)
def _split(res: list) -> tuple[list, list]:
    """(checks of exact methods: the output law must match, power checks: a planted bias must be detected)."""
    return [x for x in res if x.get("exact_method", True)], [x for x in res if not x.get("exact_method", True)]


def _passed(xs: list) -> str:
    return f"{sum(1 for x in xs if x.get('passed'))}/{len(xs)}"


def _exact_dev(path: Path, doc: dict) -> str:
    """The device of an exactness file; a bare 'cuda' gets the GPU named in the file name (H100, H200, A100)."""
    dev = _dev(doc.get("device"))
    gpu = next((g for g in ("H100", "H200", "A100") if g.lower() in path.name.lower()), None)
    return f"{dev} ({gpu}, per the file name)" if dev == "cuda" and gpu else dev


def exactness_lines(others: list) -> list[str]:
    files = exactness_files(others)
    if not files:
        return []
    out = ["**(d) Exactness** (statistical suite, `tilespec check exactness`; table: *Exactness suites* below):"]
    for path, doc, res in files:
        exact, power = _split(res)
        failed = sum(1 for x in res if not x.get("passed"))
        methods = sorted({str(x.get("method")) for x in exact})
        line = (f"- {', '.join(methods)} on {_exact_dev(path, doc)}: {_passed(res)} checks passed ({_passed(exact)} "
                "exact-method checks" + (f", {_passed(power)} planted-bias checks detected" if power else "") + ")"
                + (f" — **{failed} FAILED**" if failed else "")
                + f" ({_f(doc.get('samples'), '{:,.0f}')} samples per check, `{path.name}`)")
        out.append(line)
    return out + [""]


def exactness_table(others: list) -> list[str]:
    files = exactness_files(others)
    if not files:
        return []
    out = ["## Exactness suites", "",
           "Exact-method checks pass when the sampled output law is indistinguishable from the target's (p-values "
           "and total-variation distance over those checks); planted-bias checks pass when a deliberately biased "
           "sampler is detected (power).", "",
           "| file | device | exact methods | samples | exact-method checks passed | min p-value | max TV | "
           "planted-bias checks detected |", "|---|---|---|---|---|---|---|---|"]
    for path, doc, res in files:
        exact, power = _split(res)
        ps = [x["min_p_value"] for x in exact if isinstance(x.get("min_p_value"), (int, float))]
        tvs = [x["max_tv"] for x in exact if isinstance(x.get("max_tv"), (int, float))]
        methods = ", ".join(sorted({str(x.get("method")) for x in exact}))
        out.append(f"| `{path.name}` | {_exact_dev(path, doc)} | {methods} | {_f(doc.get('samples'), '{:,.0f}')} | "
                   f"{_passed(exact)} | {_f(min(ps) if ps else None, '{:.3g}')} | "
                   f"{_f(max(tvs) if tvs else None, '{:.3g}')} | {_passed(power) if power else '–'} |")
    return out + [""]
