"""REPORT.md's one-screen summary: what is faster than what, by how much, on which device, at which sample size.

Every number is read from the committed results (``load_results``' eval runs and ``(path, JSON)`` pairs) at
render time; each summary line names its source file and the section further down that holds the full table:

- (a) end-to-end tok/s per system at B = 1 from the newest real-weight ``e2e-*.json`` per target (both the old row
  layout, systems ``hf`` / ``hf-assisted`` / ``ar[@engine]`` / ``tilespec:<method>[@engine]``, and the new one with
  ``kind`` / ``task`` and ``hf-static`` / ``hf-prompt-lookup`` / ``ngram:…`` / ``suffix:…``), with speedups over the
  best target-only row and over ``hf-static`` of the same (task, T, B); plus a bar chart (``e2e_figure``);
- (b) native forward ms vs the HBM floor (``native-forward-*.json``, random-init timing files; (b)-(d) are built in
  :mod:`.summary_kernels`);
- (c) the verify-kernel headline at B = 1 and B = 64 (``verify-*.json``, experiments excluded);
- (d) the exactness suites (``exactness-*.json``); (e) eval sample sizes, with a warning below ``SMALL_N``.
A missing, unreadable or partial file is skipped with a note; nothing here raises on bad data.
"""
from __future__ import annotations

from pathlib import Path

from .glance import EXACT, glance_lines
from .tables import _batch, drafter_note, identical_count, is_partial, n_cell, tokens_per_s
from .summary_data import (is_context_kind, is_drafter_kind, is_hf_kind, spec_label, SMALL_N, _dev, _f, _x,
                           best_drafters, e2e_groups, e2e_models, exactness_files, file_date, file_time,
                           is_gpu_device, newest_e2e, verify_headline)
from .summary_kernels import (_exact_dev, _passed, _split, exactness_lines, exactness_table, filter_cells,
                              native_lines, native_table, verify_lines, verify_table)

TITLE = "## Summary"
SHORT = {"hf": "HF\ndynamic", "hf-static": "HF\nstatic", "hf-assisted": "HF\nassisted", "hf-prompt-lookup":
         "HF prompt\nlookup", "ar": "tilespec\ntarget-only", "tilespec": "tilespec\n+ draft", "ngram":
         "tilespec\nn-gram", "suffix": "tilespec\nsuffix", "tilespec+ngram": "tilespec\n+ draft + n-gram",
         "tilespec+suffix": "tilespec\n+ draft + suffix"}   # x tick labels of the bar chart


# --------------------------------------------------------------------------------------------------- (a) e2e
def _batches(groups: list) -> str:
    return ", ".join(str(b) for b in sorted({key[2] for key, _ in groups}))


def e2e_lines(others: list) -> tuple[list[str], list[str]]:
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
        spec = any(is_drafter_kind(r["kind"]) for _, rows in groups for r in rows)
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
                context = is_context_kind(r["kind"])   # drafter / match share mean something for these only
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
    if out:
        out += ["Full tables: *End-to-end decoding (engine benchmark)* below.", ""]
    return out, notes


def figure_lines(figure: str | None) -> list[str]:
    """The end-to-end bar chart, shown right under the 'At a glance' table."""
    if not figure:
        return []
    return [f"![end-to-end tok/s by system]({figure})", "",
            "Bars: tok/s at B = 1, T = 0 per system (best configuration of each); whiskers: min–max of the per-batch "
            "rates where a system recorded them. Full tables: *End-to-end decoding (engine benchmark)* below.", ""]


def _headline(groups: list) -> str:
    """One sentence per (task, T, B): the fastest system and its margin over target-only and the fastest HF system;
    when the fastest is not speculative, the best speculative system's margin over target-only."""
    parts = []
    for (task, temp, b), rows in groups:
        top = max(rows, key=lambda r: r["tps"])
        hf = [r for r in rows if is_hf_kind(r["kind"])]
        best_hf = max(hf, key=lambda r: r["tps"]) if hf else None
        s = f"{task}, T={_f(temp, '{:g}')}, B={b}: fastest is {top['label']} at {_f(top['tps'])} tok/s"
        margins = []
        if top["vs_ar"] is not None and top["kind"] != "ar":
            margins.append(f"{_x(top['vs_ar'])} target-only")
        if best_hf is not None and not is_hf_kind(top["kind"]) and best_hf["tps"]:
            margins.append(f"{_x(top['tps'] / best_hf['tps'])} the fastest transformers system, {best_hf['label']}")
        s += f" ({', '.join(margins)})" if margins else ""
        spec = [r for r in rows if is_drafter_kind(r["kind"])]
        if spec and not is_drafter_kind(top["kind"]):
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
        miss = f"; {', '.join(spec_label(k) for k in missing)}: not measured" if missing else ""
        if best is None:
            cells.append(f"{task}: not measured (no speculative row)")
            continue
        env = (doc or {}).get("environment") or {}
        cells.append(f"{task}: {spec_label(best['kind'])} (`{best['system']}`, {_f(best['tps'])} tok/s, "
                     f"{_x(best['vs_ar'])} target-only; `{path.name}`, commit "
                     f"{str(env.get('commit') or '?').split(' ')[0]}){miss}")
    def commit(doc):
        return str((doc.get("environment") or {}).get("commit") or "?").split(" ")[0]
    latest = max((doc for _, doc in picked), key=file_time, default=None)
    tail = ""
    if latest is not None and not any(is_context_kind(r["kind"]) for _, d in picked if commit(d) == commit(latest)
                                      for _, rs in e2e_groups(d) for r in rs):
        tail = (f" The newest e2e files (commit {commit(latest)}, {file_time(latest)[:10]}) hold no n-gram / suffix "
                "drafter rows: the drafter comparison was not measured with that code.")
    return ["**Best drafter per task** (B = 1, T = 0, fastest speculative configuration in the files above): "
            + "; ".join(cells) + "." + tail, ""]


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
    runs = [r for r in runs if r.get("methods")]   # side-study-only records (no main comparison) are not runs here
    return [r for r in runs if str(r.get("_source", "")).startswith("eval-scale-")] or \
        [r for r in runs if _batch(r) > 1]


def _scale_cells(r: dict) -> dict:
    rows = r.get("methods") or {}
    metric = r.get("metric") or "metric"
    same = {m: identical_count(r, m) for m in EXACT if m in rows}
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
           f"| run | n (of target) | B | methods | outputs identical to hf ({' / '.join(EXACT)}) | "
           f"metric {' / '.join(('hf',) + EXACT)} | sigmoid (NOT exact): metric, tok/s vs hf | file |",
           "|---|---|---|---|---|---|---|---|"]
    for r in sel:
        c = _scale_cells(r)
        metric, rows, hf, sig = c["metric"], c["rows"], c["hf"], c["sig"]
        temp = (r.get("config") or {}).get("temperature")
        same = " / ".join(f"{x[0]}/{x[1]}" if x else "–" for x in c["same"].values()) if temp == 0 else \
            "– (T>0: hf draws other random numbers)"
        vals = " / ".join(_f((rows.get(m) or {}).get(metric), "{:.3f}") for m in ("hf",) + EXACT)
        sig_cell = "–"
        if isinstance(sig, dict):
            ms, mh = sig.get(metric), hf.get(metric)
            th, ts = tokens_per_s(hf), tokens_per_s(sig)
            if isinstance(ms, (int, float)) and isinstance(mh, (int, float)) and mh:
                sig_cell = (f"{metric.upper()} {ms:.3f} vs {mh:.3f} ({(ms - mh) / mh * 100:+.1f} %), "
                            + ("tok/s not clean ‡" if r.get("timing_note") else
                               f"{_x(ts / th if ts and th else None)} hf tok/s"))
        out.append(f"| {r.get('dataset')}{drafter_note(r)} T={_f(temp, '{:g}')}{' ‡' * bool(r.get('timing_note'))} | "
                   f"{n_cell(r)} | {_batch(r)} | {', '.join(rows)} | {same} | {metric.upper()} {vals} | {sig_cell} | "
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
            hf = max((r for r in rows if is_hf_kind(r["kind"]) and r["kind"] != "hf-prompt-lookup"),
                     key=lambda r: r["tps"], default=None)
            ar = by.get("ar")
            if ar and hf:
                cells.append(f"B={b}: {_f(ar['tps'])} vs {_f(hf['tps'])} tok/s ({hf['label']}), "
                             f"{ar['tps'] / hf['tps']:.2f}×")
            spec = [r for r in rows if is_drafter_kind(r["kind"])]
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
            cells.append(f"{r.get('dataset')}{drafter_note(r)} T={_f(temp, '{:g}')} "
                         f"n = {n_cell(r).replace(' (**partial**)', '')}")
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
                               f"({(ms - mh) / mh * 100:+.0f} %)"
                               + ("" if r.get("timing_note") else
                                  f" at {_x(ts / th if ts and th else None)} hf tok/s"))
        partial = any(is_partial(r) for r in sel)
        bs = sorted({_batch(r) for r in sel})
        out.append(f"- **Paper-scale evaluation** ({_dev((sel[0].get('environment') or {}).get('device'))}, "
                   f"B = {', '.join(map(str, bs))}"
                   + (" batched: per-batched-step timings, not the paper's batch-1 protocol" if max(bs) > 1 else "")
                   + (", **partial runs**" if partial else "") + "): " + "; ".join(cells) + "."
                   + (" T=0: tiled and fused outputs identical to hf for " + " and ".join(ident) + "." if ident else "")
                   + (" Sigmoid (NOT exact) at T=1: " + "; ".join(sig) + "." if sig else "")
                   + " Files: " + ", ".join(f"`{f}`" for f in sorted({r.get('_source') for r in sel})) + ".")
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
                cells.append(f"{task}: {spec_label(best['kind'])} {_x(best['vs_ar'])} target-only (`{path.name}`)"
                             + (f", {'/'.join(spec_label(k) for k in missing)} not measured" if missing else ""))
        out.append("- **Best drafter per task** (B = 1, T = 0): " + "; ".join(cells) + ".")
    if not out:
        return []
    return ["**Key numbers** (details and caveats in (a)-(f) below):", ""] + out + [""]


# --------------------------------------------------------------------------------------------------- assembly
def summary_section(runs: list, others: list, figure: str | None = None) -> list[str]:
    """The opening section: (a)-(e), then the skipped-file notes."""
    e2e, notes = e2e_lines(others)
    out = [TITLE, "", "Generated from the committed JSON files named on each line; the tables that back each claim "
           "follow further down.", ""]
    out += glance_lines(runs, others) + (figure_lines(figure) if e2e else []) + key_lines(runs, others)
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
        colors = ["#9e9e9e" if is_hf_kind(r["kind"]) else "#1f77b4" for r in rows]
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
