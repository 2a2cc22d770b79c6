"""REPORT.md's one-screen summary: what is faster than what, by how much, on which device, at which sample size.

Every number is read from the committed results (``load_results``' eval runs and ``(path, JSON)`` pairs) at
render time; each summary line names its source file and the section further down that holds the full table:

- (a) end-to-end tok/s per system at B = 1 from the newest real-weight ``e2e-*.json`` per target (both the old row
  layout, systems ``hf`` / ``hf-assisted`` / ``ar[@engine]`` / ``tilespec:<method>[@engine]``, and the new one with
  ``kind`` / ``task`` and ``hf-static`` / ``hf-prompt-lookup`` / ``ngram:…`` / ``suffix:…``), with speedups over the
  best target-only row and over ``hf-static`` of the same (task, T, B); plus a bar chart (``e2e_figure``);
- (b) native forward ms vs the HBM floor (``native-forward-*.json``, random-init timing files);
- (c) the verify-kernel headline at B = 1 and B = 64 (``verify-*.json``, experiments excluded);
- (d) the exactness suites (``exactness-*.json``); (e) eval sample sizes, with a warning below ``SMALL_N``.
A missing, unreadable or partial file is skipped with a note; nothing here raises on bad data.
"""
from __future__ import annotations

from pathlib import Path

from .report_tables import _batch, identical_count, is_partial, n_cell, tokens_per_s
from .report_summary_data import (CONTEXT_KINDS, HF_KINDS, SMALL_N, SPEC_KINDS, best_drafters, e2e_groups,
                                  e2e_models, exactness_files, file_date, file_time, is_gpu_device, native_files,
                                  newest, newest_e2e, verify_filter_rows, verify_headline)

TITLE = "## Summary"
SHORT = {"hf": "HF\ndynamic", "hf-static": "HF\nstatic", "hf-assisted": "HF\nassisted", "hf-prompt-lookup":
         "HF prompt\nlookup", "ar": "tilespec\ntarget-only", "tilespec": "tilespec\n+ draft", "ngram":
         "tilespec\nn-gram", "suffix": "tilespec\nsuffix", "tilespec+ngram": "tilespec\n+ draft + n-gram",
         "tilespec+suffix": "tilespec\n+ draft + suffix"}   # x tick labels of the bar chart


def _f(x, fmt="{:.1f}", none="–"):
    ok = isinstance(x, (int, float)) and not isinstance(x, bool) and x == x
    return fmt.format(x) if ok else none


def _x(x) -> str:
    return _f(x, "{:.2f}×")


def _dev(text) -> str:
    return str(text or "?").replace("NVIDIA ", "").replace(" 80GB HBM3", "")


# --------------------------------------------------------------------------------------------------- (a) e2e
def _batches(groups: list) -> str:
    return ", ".join(str(b) for b in sorted({key[2] for key, _ in groups}))


def e2e_lines(others: list, figure: str | None) -> tuple[list[str], list[str]]:
    """(summary lines, notes on skipped files) for the newest real-weight e2e file per target."""
    picked, notes = newest_e2e(others)
    out = []
    for path, doc in picked:
        env, st = doc.get("environment") or {}, doc.get("settings") or {}
        groups = e2e_groups(doc)
        if not groups:
            notes.append(f"`{path.name}`: no successful row, skipped")
            continue
        n = st.get("num_prompts")
        target, draft, corrected = e2e_models(st)
        spec = any(r["kind"] in SPEC_KINDS for _, rows in groups for r in rows)
        warn = f" ⚠ n = {n} prompts: timing only, too few for quality claims" if not n or n < SMALL_N else ""
        out += [f"**(a) End-to-end decoding, {target}"
                + (f" / draft {draft}" if draft and spec else "")
                + f"** — {_dev(env.get('gpu') or env.get('device'))}, {st.get('max_new_tokens', '?')} new tokens"
                + (" (EOS ignored: every request decodes the full budget)" if st.get("ignore_eos") else "")
                + f", n = {n if n is not None else '?'} prompts, B = {_batches(groups)}, `{path.name}` (commit "
                f"{str(env.get('commit') or '?').split(' ')[0]}, {str(env.get('date') or '?')[:10]}).{warn}"
                + (" (The file's settings name the text defaults; `--whisper` ran whisper-base, see bench_e2e.)"
                   if corrected else ""), ""]
        if doc.get("note"):
            out += [f"*Note in the file: {doc['note']}*", ""]
        out += ["| task | T | B | system | best configuration | tok/s | × best target-only | × hf-static |",
                "|---|---|---|---|---|---|---|---|"]
        for (task, temp, b), rows in groups:
            for r in rows:
                context = r["kind"] in CONTEXT_KINDS   # drafter / match share mean something for these only
                extra = [f"{k} {r[k]}" for k in ("runtime", "drafter") if r.get(k) and (context or k == "runtime")]
                if context and r.get("match_share") is not None:
                    extra.append(f"match {r['match_share'] * 100:.0f} %")
                cfg = f"`{r['system']}`" + (f" ({', '.join(extra)})" if extra else "")
                out.append(f"| {task} | {_f(temp, '{:g}')} | {b} | {r['label']} | {cfg} | {_f(r['tps'])} | "
                           f"{_x(r['vs_ar'])} | {_x(r['vs_static'])} |")
        out.append("")
        best = _headline(groups)
        if best:
            out += [best, ""]
    out += drafter_lines(picked)
    if figure and out:
        out += [f"![end-to-end tok/s by system]({figure})", "",
                "Bars: tok/s at B = 1, T = 0 per system (best configuration of each); whiskers: min–max of the "
                "per-batch rates where a system recorded them. Full tables: *End-to-end decoding (engine "
                "benchmark)* below.", ""]
    elif out:
        out += ["Full tables: *End-to-end decoding (engine benchmark)* below.", ""]
    return out, notes


def _headline(groups: list) -> str:
    """One sentence per (task, T, B): the fastest system and its margin over target-only and the fastest HF system;
    when the fastest is not speculative, the best speculative system's margin over target-only."""
    parts = []
    for (task, temp, b), rows in groups:
        top = max(rows, key=lambda r: r["tps"])
        hf = [r for r in rows if r["kind"] in HF_KINDS]
        best_hf = max(hf, key=lambda r: r["tps"]) if hf else None
        s = f"{task}, T={_f(temp, '{:g}')}, B={b}: fastest is {top['label']} at {_f(top['tps'])} tok/s"
        margins = []
        if top["vs_ar"] is not None and top["kind"] != "ar":
            margins.append(f"{_x(top['vs_ar'])} target-only")
        if best_hf is not None and top["kind"] not in HF_KINDS and best_hf["tps"]:
            margins.append(f"{_x(top['tps'] / best_hf['tps'])} the fastest transformers system, {best_hf['label']}")
        s += f" ({', '.join(margins)})" if margins else ""
        spec = [r for r in rows if r["kind"] in SPEC_KINDS]
        if spec and top["kind"] not in SPEC_KINDS:
            sp = max(spec, key=lambda r: r["tps"])
            s += (f"; best speculative: {sp['label']} `{sp['system']}` at {_f(sp['tps'])} tok/s = "
                  f"{_x(sp['vs_ar'])} target-only")
        parts.append(s)
    return "Headline — " + "; ".join(parts) + "." if parts else ""


def drafter_lines(picked: list) -> list[str]:
    """'Best drafter per task' at B = 1, T = 0 over the summarized e2e files; drafters a task lacks are named as not
    measured, and the newest commit's files are said to hold none when they do not."""
    rows = best_drafters(picked)
    if not rows:
        return []
    cells = []
    for task, best, path, doc, seen, missing in rows:
        miss = f"; {', '.join(SPEC_KINDS[k] for k in missing)}: not measured" if missing else ""
        if best is None:
            cells.append(f"{task}: not measured (no speculative row)")
            continue
        env = (doc or {}).get("environment") or {}
        cells.append(f"{task}: {SPEC_KINDS[best['kind']]} (`{best['system']}`, {_f(best['tps'])} tok/s, "
                     f"{_x(best['vs_ar'])} target-only; `{path.name}`, commit "
                     f"{str(env.get('commit') or '?').split(' ')[0]}){miss}")
    def commit(doc):
        return str((doc.get("environment") or {}).get("commit") or "?").split(" ")[0]
    latest = max((doc for _, doc in picked), key=file_time, default=None)
    tail = ""
    if latest is not None and not any(r["kind"] in CONTEXT_KINDS for _, d in picked if commit(d) == commit(latest)
                                      for _, rs in e2e_groups(d) for r in rs):
        tail = (f" The newest e2e files (commit {commit(latest)}, {file_time(latest)[:10]}) hold no n-gram / suffix "
                "drafter rows: the drafter comparison was not measured with that code.")
    return ["**Best drafter per task** (B = 1, T = 0, fastest speculative configuration in the files above): "
            + "; ".join(cells) + "." + tail, ""]


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
    return f"top-k {r['top_k']}" if r.get("top_k") else f"top-p {r.get('top_p')}"


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
    methods = ["fused", "tiled", "sigmoid", "reference", "hf", "flashinfer"]
    out = ["## Verification kernel at B = 1 and B = 64", "",
           f"`{path.name}`, {_dev(doc.get('device'))}, V={rows[0]['V']}, bf16, T=1, mid regime; µs per call, graph "
           "(CUDA events over replays) / eager (host wall time per synchronised call); – = not capturable or not "
           "run. `sigmoid` is NOT exact. Filter rows: each timed call includes the top-k / top-p filtering of the "
           "target and draft logits (ours: the default sort-free path).", "",
           "| B | γ | filter | " + " | ".join(methods) + " |", "|---|---|---|" + "---|" * len(methods)]
    for r in rows + verify_filter_rows(doc):
        res = r["results"]
        filt = _filter_name(r) if r.get("top_k") or (r.get("top_p") or 1.0) < 1.0 else "none"
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
    gpu = next((g for g in ("H100", "H200", "A100") if g in path.name), None)
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


def sample_lines(runs: list) -> list[str]:
    """(e): n per eval run, flagged below SMALL_N."""
    if not runs:
        return ["**(f) Evaluation sample sizes**: no eval runs committed.", ""]
    cells, small = [], 0
    for r in runs:
        n, env = r.get("n"), r.get("environment") or {}
        temp = (r.get("config") or {}).get("temperature")
        flag = isinstance(n, int) and n < SMALL_N
        small += flag
        of = f" of {r['n_requested']}" if r.get("n_requested") not in (None, n) else ""
        b = _batch(r)
        cells.append(f"{r.get('dataset')} T={_f(temp, '{:g}')} {_dev(env.get('device'))}"
                     + (f" B={b}" if b > 1 else "") + f": n = {_f(n, '{}', '?')}{of}"
                     + (" (partial)" if is_partial(r) and of else "") + (" ⚠" if flag else ""))
    out = ["**(f) Evaluation sample sizes, all runs** (Tables 1-8; per-run setup under *Runs* below): "
            + "; ".join(cells) + "."]
    if small:
        out.append(f"⚠ **{small} of {len(runs)} run(s) have n < {SMALL_N}**: their T=1 quality differences are "
                   f"within noise and prove little; the paper used ~10 % of each test set (~1,100 for XSum/CNN-DM).")
    return out + [""]


def scale_runs(runs: list) -> list:
    """The newest eval-scale runs: runs from ``eval-scale-*`` files, else batched runs (``batch_size`` > 1)."""
    return [r for r in runs if str(r.get("_source", "")).startswith("eval-scale-")] or \
        [r for r in runs if _batch(r) > 1]


def _scale_cells(r: dict) -> dict:
    rows = r.get("methods") or {}
    metric = r.get("metric") or "metric"
    same = {m: identical_count(r, m) for m in ("tiled", "fused") if m in rows}
    sig, hf = rows.get("sigmoid"), rows.get("hf") or {}
    return dict(rows=rows, metric=metric, same=same, sig=sig, hf=hf)


def scale_lines(runs: list) -> list[str]:
    """(e): the paper-scale evaluation: n of its target per run, batch size and protocol, partial runs flagged, T=0
    identity counts, sigmoid's quality change beside its speed; backed by Table 1 and the sigmoid table."""
    sel = scale_runs(runs)
    if not sel:
        return []
    env = sel[0].get("environment") or {}
    batches = sorted({_batch(r) for r in sel})
    out = [f"**(e) Paper-scale evaluation** ({sel[0].get('target')} / {sel[0].get('draft')}, "
           f"{_dev(env.get('device'))}, commit {env.get('commit')}; B = {', '.join(map(str, batches))}"
           + (" — **batched mode**: timings are per batched step, not the paper's batch-1 protocol; Δ% compares "
              "methods at the same batch size" if max(batches) > 1 else "") + "). "
           + ("**Partial**: " if any(is_partial(r) for r in sel) else "") + "n per run below; target = the sampled "
           "set (`n_requested`). Backing tables: *Table 1*, *Table 5*, *Sigmoid (NOT exact)*.", "",
           "| run | n (of target) | B | methods | outputs identical to hf (tiled / fused) | "
           f"metric hf / tiled / fused | sigmoid (NOT exact): metric, tok/s vs hf | file |",
           "|---|---|---|---|---|---|---|---|"]
    for r in sel:
        c = _scale_cells(r)
        metric, rows, hf, sig = c["metric"], c["rows"], c["hf"], c["sig"]
        temp = (r.get("config") or {}).get("temperature")
        same = " / ".join(f"{x[0]}/{x[1]}" if x else "–" for x in c["same"].values()) if temp == 0 else \
            "– (T>0: hf draws other random numbers)"
        vals = " / ".join(_f((rows.get(m) or {}).get(metric), "{:.3f}") for m in ("hf", "tiled", "fused"))
        sig_cell = "–"
        if isinstance(sig, dict):
            ms, mh = sig.get(metric), hf.get(metric)
            th, ts = tokens_per_s(hf), tokens_per_s(sig)
            if isinstance(ms, (int, float)) and isinstance(mh, (int, float)) and mh:
                sig_cell = (f"{metric.upper()} {ms:.3f} vs {mh:.3f} ({(ms - mh) / mh * 100:+.1f} %), "
                            f"{_x(ts / th if ts and th else None)} hf tok/s")
        out.append(f"| {r.get('dataset')} T={_f(temp, '{:g}')} | {n_cell(r)} | {_batch(r)} | "
                   f"{', '.join(rows)} | {same} | {metric.upper()} {vals} | {sig_cell} | "
                   f"`{r.get('_source')}` |")
    return out + [""]


# --------------------------------------------------------------------------------------------------- key numbers
def key_lines(runs: list, others: list) -> list[str]:
    """The opening bullets: the headline number of each summary part, each with device, n and its file."""
    out = []
    picked, _ = newest_e2e(others)
    for path, doc in sorted(picked, key=lambda pd: file_time(pd[1]), reverse=True):
        env, st = doc.get("environment") or {}, doc.get("settings") or {}
        target = e2e_models(st)[0]
        cells, spec_cells = [], []
        for (task, temp, b), rows in e2e_groups(doc):
            by = {r["kind"]: r for r in rows}
            hf = max((r for r in rows if r["kind"] in HF_KINDS and r["kind"] != "hf-prompt-lookup"),
                     key=lambda r: r["tps"], default=None)
            ar = by.get("ar")
            if ar and hf:
                cells.append(f"B={b}: {_f(ar['tps'])} vs {_f(hf['tps'])} tok/s ({hf['label']}), "
                             f"{ar['tps'] / hf['tps']:.2f}×")
            spec = [r for r in rows if r["kind"] in SPEC_KINDS]
            if ar and spec:
                sp = max(spec, key=lambda r: r["tps"])
                spec_cells.append(f"{task} B={b}: {sp['label']} `{sp['system']}` {_f(sp['tps'])} tok/s = "
                                  f"{_x(sp['vs_ar'])} our target-only")
        if not cells and not spec_cells:
            continue
        task = ", ".join(sorted({k[0] for k, _ in e2e_groups(doc)}))
        line = (f"- **{target} end-to-end** ({task}, T=0, {_dev(env.get('gpu') or env.get('device'))}, "
                f"n = {st.get('num_prompts', '?')} prompts × {st.get('max_new_tokens', '?')} tokens"
                + (", EOS ignored" if st.get("ignore_eos") else "") + f", `{path.name}`, commit "
                f"{str(env.get('commit') or '?').split(' ')[0]}" + ("; ⚠ the file's note is quoted in (a)"
                                                                    if doc.get("note") else "") + "): ")
        parts = []
        if cells:
            parts.append("ours target-only vs transformers " + "; ".join(cells))
        if spec_cells:
            parts.append("speculative: " + "; ".join(spec_cells))
        out.append(line + "; ".join(parts) + ".")
    head = verify_headline(others)
    if head and head[2]:
        path, doc, rows = head
        cells = []
        for r in rows:
            res = r["results"]
            g = lambda m, k: (res.get(m) or {}).get(k)  # noqa: E731
            c = (f"B={r['B']}: fused {_f(g('fused', 'graph_us'))} µs graph / {_f(g('fused', 'eager_us'), '{:.0f}')} "
                 f"eager, sigmoid (NOT exact) {_f(g('sigmoid', 'graph_us'))} / "
                 f"{_f(g('sigmoid', 'eager_us'), '{:.0f}')}")
            if g("flashinfer", "eager_us") and g("fused", "eager_us"):
                c += (f", FlashInfer {_f(g('flashinfer', 'eager_us'), '{:.0f}')} eager "
                      f"({g('flashinfer', 'eager_us') / g('fused', 'eager_us'):.1f}× fused's eager time)")
            cells.append(c)
        out.append(f"- **Verification step alone** (V={rows[0]['V']}, γ={rows[0]['K']}, bf16, T=1, "
                   f"{_dev(doc.get('device'))}, `{path.name}`): " + "; ".join(cells)
                   + ("; with a filter, fused's eager time exceeds FlashInfer's at " + ", ".join(slower) + " (see (c))"
                      if (slower := [c.split(":")[0].replace(", B=", " B=") for c in filter_cells(doc)
                                     if "slower" in c]) else "") + ".")
    sel = scale_runs(runs)
    if sel:
        cells, ident, sig = [], [], []
        for r in sel:
            temp = (r.get("config") or {}).get("temperature")
            cells.append(f"{r.get('dataset')} T={_f(temp, '{:g}')} n = {n_cell(r).replace(' (**partial**)', '')}")
            c = _scale_cells(r)
            if temp == 0 and c["same"]:
                vals = list(c["same"].values())
                if all(vals) and len({v for v in vals}) == 1:
                    ident.append(f"{vals[0][0]}/{vals[0][1]} {r.get('dataset')}")
                else:
                    ident.append(" / ".join(f"{m} {v[0]}/{v[1]}" for m, v in c["same"].items() if v)
                                 + f" {r.get('dataset')}")
            if isinstance(c["sig"], dict) and c["hf"].get(c["metric"]):
                ms, mh = c["sig"].get(c["metric"]), c["hf"][c["metric"]]
                th, ts = tokens_per_s(c["hf"]), tokens_per_s(c["sig"])
                if isinstance(ms, (int, float)):
                    sig.append(f"{r.get('dataset')} (n = {r.get('n')}) {c['metric'].upper()} {ms:.3f} vs {mh:.3f} "
                               f"({(ms - mh) / mh * 100:+.0f} %) at {_x(ts / th if ts and th else None)} hf tok/s")
        partial = any(is_partial(r) for r in sel)
        bs = sorted({_batch(r) for r in sel})
        out.append(f"- **Paper-scale evaluation** ({_dev((sel[0].get('environment') or {}).get('device'))}, "
                   f"B = {', '.join(map(str, bs))}"
                   + (" batched: per-batched-step timings, not the paper's batch-1 protocol" if max(bs) > 1 else "")
                   + (", **partial runs**" if partial else "") + "): " + "; ".join(cells) + "."
                   + (" T=0: tiled and fused outputs identical to hf for " + " and ".join(ident) + "." if ident else "")
                   + (" Sigmoid (NOT exact) at T=1: " + "; ".join(sig) + "." if sig else "")
                   + " Files: " + ", ".join(f"`{r.get('_source')}`" for r in sel) + ".")
    gpu = [x for x in exactness_files(others) if is_gpu_device(x[1].get("device"))]
    if gpu:
        path, doc, res = max(gpu, key=lambda x: (file_date(x[0], x[1]), x[0].name))
        exact, power = _split(res)
        failed = sum(1 for x in res if not x.get("passed"))
        out.append(f"- **Exactness on the GPU** ({', '.join(sorted({str(x.get('method')) for x in exact}))}, "
                   f"{_exact_dev(path, doc)}, {_f(doc.get('samples'), '{:,.0f}')} samples per check, "
                   f"`{path.name}`): {_passed(res)} checks passed ({_passed(exact)} exact-method, "
                   f"{_passed(power)} planted-bias detected)" + (f" — **{failed} FAILED**" if failed else "") + ".")
    drafters = best_drafters(picked)
    if drafters:
        cells = []
        for task, best, path, _doc, _seen, missing in drafters:
            if best is None:
                cells.append(f"{task}: not measured")
            else:
                cells.append(f"{task}: {SPEC_KINDS[best['kind']]} {_x(best['vs_ar'])} target-only (`{path.name}`)"
                             + (f", {'/'.join(SPEC_KINDS[k] for k in missing)} not measured" if missing else ""))
        out.append("- **Best drafter per task** (B = 1, T = 0): " + "; ".join(cells) + ".")
    if not out:
        return []
    return ["**Key numbers** (details and caveats in (a)-(f) below):", ""] + out + [""]


# --------------------------------------------------------------------------------------------------- assembly
def summary_section(runs: list, others: list, figure: str | None = None) -> list[str]:
    """The opening section: (a)-(e), then the skipped-file notes."""
    e2e, notes = e2e_lines(others, figure)
    out = [TITLE, "", "Generated from the committed JSON files named on each line; the tables that back each claim "
           "follow further down.", ""]
    out += key_lines(runs, others)
    out += e2e or ["**(a) End-to-end decoding**: no real-weight `e2e-*.json` with result rows committed.", ""]
    out += native_lines(others) + verify_lines(others) + exactness_lines(others) + scale_lines(runs)
    out += sample_lines(runs)
    skipped = notes + [f"`{Path(p).name}`: {d}" for p, d in others if isinstance(d, str)]
    if skipped:
        out += ["Skipped: " + "; ".join(skipped) + ".", ""]
    return out


def backing_sections(others: list) -> list[str]:
    return native_table(others) + verify_table(others) + exactness_table(others)


# --------------------------------------------------------------------------------------------------- figure
def e2e_figure(others: list, out_dir: Path) -> Path | None:
    """Bar chart of tok/s by system at B = 1, T = 0, one panel per (target, task) of the newest real-weight e2e
    files, whiskers = per-batch min–max where recorded; None without data or matplotlib."""
    panels = []
    for path, doc in newest_e2e(others)[0]:
        for (task, temp, b), rows in e2e_groups(doc):
            if temp == 0 and b == 1:
                panels.append((path, doc, task, rows))
    if not panels:
        return None
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        from matplotlib.patches import Patch
    except ImportError:
        return None
    width = max(6.5, 1.1 * max(len(p[3]) for p in panels))
    fig, axes = plt.subplots(1, len(panels), figsize=(width * len(panels), 4.2), squeeze=False)
    for ax, (path, doc, task, rows) in zip(axes[0], panels):
        tps = [r["tps"] for r in rows]
        colors = ["#9e9e9e" if r["kind"] in HF_KINDS else "#1f77b4" for r in rows]
        ax.bar(range(len(rows)), tps, color=colors)
        for i, r in enumerate(rows):   # value above the bar or its whisker
            ax.annotate(f"{r['tps']:.3g}", (i, r["spread"][1] if r["spread"] else r["tps"]), xytext=(0, 3),
                        textcoords="offset points", ha="center", fontsize=7)
        spread = [(i, r) for i, r in enumerate(rows) if r["spread"]]
        if spread:
            lo = [r["tps"] - r["spread"][0] for _, r in spread]
            hi = [r["spread"][1] - r["tps"] for _, r in spread]
            ax.errorbar([i for i, _ in spread], [r["tps"] for _, r in spread], yerr=[lo, hi], fmt="none",
                        ecolor="black", capsize=3)
        ax.set_xticks(range(len(rows)))
        ax.set_xticklabels([SHORT.get(r["kind"], r["kind"]) for r in rows], fontsize=7)
        ax.set_ylabel("decoding throughput (tokens / s)")
        st, env = doc.get("settings") or {}, doc.get("environment") or {}
        ax.set_title(f"{e2e_models(st)[0]}, {task}, B=1, T=0\n{_dev(env.get('gpu') or env.get('device'))}, "
                     f"n={st.get('num_prompts', '?')} prompts, {path.name}", fontsize=8)
        ax.grid(axis="y", alpha=0.3)
        ax.legend(handles=[Patch(color="#9e9e9e", label="transformers"),
                           Patch(color="#1f77b4", label="tilespec")], fontsize=7)
    fig.tight_layout()
    out_dir.mkdir(parents=True, exist_ok=True)
    out = out_dir / "summary-e2e-tokps.png"
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out
