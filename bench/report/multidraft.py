"""REPORT.md's multi-draft section (Khisti et al. 2024 on the real Qwen pair) and the T=0 repeatability note, from
the committed ``multidraft-*.json`` (``python -m bench.multidraft``) and ``repeatability-*.json``
(``python -m bench.repeatability``) files. ``others``: [(path, parsed JSON or an error string)], as
:func:`bench.report.build.load_results` returns them. Every number printed comes from those files.
"""
from __future__ import annotations

from pathlib import Path

SCHEMES = ("sd", "specinfer", "spectr", "is")
ACCEPTANCE = ("optimal", "is", "spectr", "specinfer")     # the Table 3 columns
NAMES = {"sd": "SD (1 draft)", "specinfer": "SpecInfer", "spectr": "SpecTr", "is": "IS (trunc. LP s=5, m=40)",
         "optimal": "optimal (LP bound)"}


RUNTIME = "multidraft-schemes-runtime-"    # the multi-draft schemes on the engine (bench/scripts/trees.py --stage md)


def _newest(others: list, prefix: str) -> tuple[str, dict, Path] | None:
    """(file name, parsed JSON, path) of the newest ``prefix*`` file from a GPU run (no "cpu" in its name; the
    study's ``multidraft-`` prefix leaves out the runtime files)."""
    rows = [(Path(p).name, d, Path(p)) for p, d in others if Path(p).name.startswith(prefix) and isinstance(d, dict)
            and "cpu" not in Path(p).name and (prefix == RUNTIME or not Path(p).name.startswith(RUNTIME))]
    return sorted(rows, key=lambda r: (r[1].get("date") or "", r[0]))[-1] if rows else None


def _short(scheme: str) -> str:
    """A scheme's name without its parameters ("IS (trunc. ...)" -> "IS"); unknown keys as they are."""
    return NAMES.get(scheme, scheme).split(" (")[0]


def _cell(stats: dict | None) -> str:
    if not stats or stats.get("mean") is None:
        return "–"
    err = stats.get("stderr")
    return f"{stats['mean']:.2f} ± {err:.2f}" if err is not None else f"{stats['mean']:.2f}"


def multidraft_summary(others: list) -> list[str]:
    """One line for the opening summary: block efficiency at K = 2 and 4 and the best measured token rate gain."""
    found = _newest(others, "multidraft-")
    if found is None:
        return ["**Multi-draft (Khisti et al.) on the GPU**: no `multidraft-*.json` from a GPU committed.", ""]
    name, doc, _ = found
    be, sizes = doc["summary"]["block_efficiency"], doc["sample_sizes"]
    parts = []
    for ds, settings in be.items():
        sd = settings.get("fig3", {}).get("T=1.2", {}).get("sd", {}).get("mean")
        k2 = settings.get("table1", {}).get("K=2", {})
        k4 = settings.get("table1", {}).get("K=4", {})
        best2 = max(k2, key=lambda s: k2[s]["mean"]) if k2 else None
        best4 = max(k4, key=lambda s: k4[s]["mean"]) if k4 else None
        if sd and best2 and best4:
            parts.append(f"{ds}: SD {sd:.2f} tokens per target call, K=2 {_short(best2)} "
                         f"{k2[best2]['mean']:.2f}, K=4 {_short(best4)} {k4[best4]['mean']:.2f}")
    timing = (doc.get("timing") or {}).get("T=1.2") or {}
    gain = max(((r["gain_over_sd_pct"], k) for k, r in timing.items() if k != "sd"), default=None)
    speed = (f"; tokens/s of the multi-draft decoder (eager transformers forwards, not the fast runtime) best "
             f"{gain[1]} at {gain[0]:+.0f} % over its own SD" if gain else "")
    n = ", ".join(f"{k} {v}" for k, v in sizes["prompts_done"].items())
    return [f"**Multi-draft (Khisti et al.) on the GPU** (`{name}`; prompts per dataset {n}, draft temperature 1.2, "
            f"L = {doc['setting']['L']}): " + "; ".join(parts) + speed + ". " + _spread(be) + ".", ""]


def _spread(be: dict) -> str:
    """How far apart the multi-draft schemes' block efficiencies are, against their standard errors."""
    worst, worst_ratio = None, -1.0
    for ds, settings in be.items():
        for label, row in settings.get("table1", {}).items():
            means = {s: row[s]["mean"] for s in SCHEMES[1:] if s in row and row[s].get("mean") is not None}
            errs = [row[s]["stderr"] for s in means if row[s].get("stderr")]
            if len(means) < 2 or not errs:
                continue
            gap = max(means.values()) - min(means.values())
            if gap / max(errs) > worst_ratio:
                worst, worst_ratio = (ds, label, gap, max(errs)), gap / max(errs)
    if worst is None:
        return "no per-K spread to compare"
    ds, label, gap, err = worst
    return (f"The three multi-draft schemes differ by at most {gap:.2f} tokens per call ({ds}, {label}) against "
            f"standard errors of about {err:.2f}: at this sample size their order is not resolved")


def multidraft_section(others: list, rel=lambda p: p.as_posix()) -> list[str]:
    """The Fig. 3 / Table 1 / Table 2 / Table 3 numbers of the newest GPU run, its token rates and its figure
    (``rel``: a path as the report links it)."""
    found = _newest(others, "multidraft-")
    if found is None:
        return []
    name, doc, path = found
    be, ta, sizes = doc["summary"]["block_efficiency"], doc["summary"]["token_acceptance"], doc["sample_sizes"]
    out = ["## Multi-draft speculative sampling (Khisti et al. 2024), real Qwen2.5-Coder 1.5B / 0.5B", "",
           f"`{name}` ({doc.get('gpu') or doc.get('device')}, {doc['args']['dtype']} weights, fp32 softmax; target "
           f"{doc['setting']['target_sampling']}, drafts {doc['setting']['draft_sampling']}, L = "
           f"{doc['setting']['L']} tokens per draft, {sizes['reps_per_round']} selection repetitions per drafted "
           f"round; prompts {sizes['prompts_done']}, rounds {sizes['rounds']}, trajectory positions "
           f"{sizes['trajectory_positions']}). Block efficiency = tokens per target call, mean ± standard error over "
           "rounds.", "",
           "| dataset | K (T = 1.2) | " + " | ".join(NAMES[s] for s in SCHEMES) + " |",
           "|---|---|" + "---|" * len(SCHEMES)]
    for ds, settings in be.items():
        fig3 = settings.get("fig3", {}).get("T=1.2", {})
        out.append(f"| {ds} | 1 / 2 | " + " | ".join(_cell(fig3.get(s)) for s in SCHEMES) + " |")
        for label, row in settings.get("table1", {}).items():
            if label != "K=2":
                out.append(f"| {ds} | {label[2:]} | – | " + " | ".join(_cell(row.get(s)) for s in SCHEMES[1:]) + " |")
    out += ["", "(Row \"1 / 2\": SD with one draft, the others with two i.i.d. drafts.) Table 2 setting (second "
            "draft at T = 2.0; IS with LP truncation s and alphabet truncation m):", ""]
    t2 = {ds: settings.get("table2", {}) for ds, settings in be.items()}
    labels = sorted({k for rows in t2.values() for by in rows.values() for k in by})
    out += ["| dataset | " + " | ".join(labels) + " |", "|---|" + "---|" * len(labels)]
    for ds, rows in t2.items():
        merged = {k: v for by in rows.values() for k, v in by.items()}
        out.append(f"| {ds} | " + " | ".join(_cell(merged.get(k)) for k in labels) + " |")
    out += ["", "Table 3 setting: token-level acceptance probability along target-sampled trajectories, K i.i.d. "
            "drafts:", "", "| dataset | T_d | K | " + " | ".join(_short(s) for s in ACCEPTANCE) + " |",
            "|---|---|---|---|---|---|---|"]
    for ds, by_t in ta.items():
        for temp, by_k in by_t.items():
            for k, by_s in by_k.items():
                out.append(f"| {ds} | {temp} | {k} | " + " | ".join(
                    f"{by_s[s]['mean']:.3f}" if s in by_s else "–" for s in ACCEPTANCE)
                    + " |")
    timing = (doc.get("timing") or {}).get("T=1.2")
    if timing:
        sd = timing["sd"]
        out += ["", f"Token rate of `MultiDraftDecoder.generate` (T_d = 1.2; {sd['prompts']} prompts × "
                f"{doc['args']['timing_tokens']} new tokens per row; eager transformers forwards with a DynamicCache "
                "and host-side selection: a research path, ~2 orders of magnitude slower than the engine's runtime, "
                "so only the ratios to its own SD mean anything):", "",
                "| scheme | K | tokens/s | vs SD |", "|---|---|---|---|"]
        for key, r in timing.items():
            out.append(f"| {_short(key.split('/')[0])} | {r['K']} | {r['tokens_per_s']:.2f} | "
                       f"{r['gain_over_sd_pct']:+.0f} % |")
    out += _runtime_lines(others)
    png = path.with_suffix(".png")
    out += ["", f"![multi-draft]({rel(png)})" if png.is_file() else "", ""]
    return out


def _runtime_lines(others: list) -> list[str]:
    """The schemes on the engine's runtime (``SpeculativeDecoder(chains=(K, L), scheme=...)``): tok/s and τ per row
    of the newest ``multidraft-schemes-runtime-*.json``, against its target-only row."""
    found = _newest(others, RUNTIME)
    if found is None:
        return []
    name, doc, _ = found
    rows = [r for r in doc.get("rows", []) if "tokens_per_second" in r]
    base = next((r["tokens_per_second"] for r in rows if r["system"] == "ar"), None)
    st = doc.get("settings", {})
    out = ["", f"The same schemes on the engine's runtime (`{name}`: `SpeculativeDecoder(chains=(K, L), scheme=...)`, "
           f"{st.get('task')}, {st.get('num_prompts')} prompts × {st.get('max_new_tokens')} tokens, B = 1, T = 1, "
           f"T_d = {st.get('draft_temperature')}; `mdm-*` draft with {st.get('md_draft')}, `md-*` with the head; "
           "`graphed`: whole-step graphs, else the host-commit path):", "",
           "| system | tok/s | τ | vs target-only | graphed |", "|---|---|---|---|---|"]
    for r in rows:
        ratio = f"{r['tokens_per_second'] / base:.2f}×" if base else "–"
        out.append(f"| {r['system']} | {r['tokens_per_second']:.1f} | {r.get('tau', 0):.2f} | {ratio} | "
                   f"{'yes' if r.get('graphed') else 'no'} |")
    return out


def repeatability_lines(others: list) -> list[str]:
    """What the newest repeatability run with probes says about greedy divergences on the GPU."""
    probed = [(p, d) for p, d in others if isinstance(d, dict) and (d.get("probes") or {}).get("torch.bfloat16")]
    found = _newest(probed, "repeatability-")
    if found is None:
        return []
    name, doc, _ = found
    probes = doc["probes"]["torch.bfloat16"]
    gaps = sorted({(p["example"], p["token"], p["gap_ulps"]) for p in probes})
    pairs = {(tuple(r["a"]), tuple(r["b"])): r["differing"] for r in doc["pairs"]}
    own = [v for (a, b), v in pairs.items() if a[0] == b[0] == "target"]
    worst = max(g for *_, g in gaps)
    return [f"**Greedy (T=0) divergences on the GPU are bf16 ties** (`{name}`, {doc['dataset']} examples "
            f"{doc['offset']}-{doc['offset'] + doc['batch'] - 1}, batch {doc['batch']}): at every one of the "
            f"{len(gaps)} splits the target's top two bf16 logits are equal or one bf16 step apart (largest gap "
            f"{worst:.0f} ulp); our own target-only decoding differs from itself between two runs on "
            f"{own[0] if own else '?'} of {doc['batch']} examples, so such splits are rounding (different forward "
            "shapes and kernels), not verification. Exactness is established in fp32 (token for token on CPU) and "
            "statistically.", ""]
