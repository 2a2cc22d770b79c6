"""REPORT.md section "End-to-end decoding (engine benchmark)", rendered from ``bench/results/e2e-*.json``.

Inputs: the ``(path, parsed JSON)`` pairs of :func:`bench.report.build.load_results` (other files are ignored).
Each ``e2e-*`` document (written by ``tilespec bench e2e``) holds ``environment`` (gpu, torch, transformers,
commit, date), ``settings`` (target, draft, gamma, gamma_schedule, num_prompts, max_new_tokens, compile,
random_init, whisper), optional ``provenance``/``note`` and ``results``: rows with system (``hf``,
``hf-static``, ``hf-assisted``, ``hf-prompt-lookup``, ``ar[@engine]``, ``{tilespec,ngram,suffix}:<method>[/gN or
/schedule][@engine]``), temperature, batch_size, tokens_per_second,
tokens_per_second_per_request, peak_memory_bytes, verify_share and, for speculative systems, alpha, cost_ratio,
block_efficiency, mean_gamma, predicted_speedup(_gamma), speedup_vs_ar, greedy_match_ar; failed rows have only
``error``. Every key may be missing. One table per file, then a headline list over the real-weight files.
"""
from __future__ import annotations

from pathlib import Path

from .summary_data import e2e_models

TITLE = "## End-to-end decoding (engine benchmark)"
ERR_CHARS = 90


def _f(x, fmt="{:.2f}", none="–"):
    if x is None or isinstance(x, bool) or not isinstance(x, (int, float)) or x != x:
        return none
    return fmt.format(x)


def _d(x) -> dict:
    return x if isinstance(x, dict) else {}


def _rows(doc: dict) -> list:
    res = doc.get("results")
    return [r for r in res if isinstance(r, dict)] if isinstance(res, list) else []


def _num(x):
    return x if isinstance(x, (int, float)) and not isinstance(x, bool) and x == x else None


def _engine(row: dict) -> str | None:
    """Engine mode of a row: the ``@suffix`` of its system (``eager`` without one); None for the HF baselines."""
    system = str(row.get("system") or "")
    if system.startswith("hf"):
        return None
    return system.split("@", 1)[1] if "@" in system else (row.get("engine") or "eager")


def _is_spec(row: dict) -> bool:
    return str(row.get("system") or "").startswith(("tilespec", "ngram", "suffix"))


def _measured(row: dict, rows: list) -> float | None:
    """Speedup over ``ar`` of the same engine mode, temperature and batch size (recorded, else recomputed)."""
    if _num(row.get("speedup_vs_ar")) is not None:
        return row["speedup_vs_ar"]
    tps = _num(row.get("tokens_per_second"))
    for r in rows:
        if (str(r.get("system", "")).startswith("ar") and _engine(r) == _engine(row) and "error" not in r
                and r.get("temperature") == row.get("temperature") and r.get("batch_size") == row.get("batch_size")
                and _num(r.get("tokens_per_second")) and tps is not None):
            return tps / r["tokens_per_second"]
    return None


def _decode_only(row: dict, rows: list) -> float | None:
    """Speedup over ``ar`` (same engine mode, T, B) of decode time alone: wall time minus the eager prefill, which
    Theorem 3.8 does not model. None without per-phase times."""
    def rate(r):
        times = _d(r.get("times"))
        wall, pre, n = _num(r.get("wall_time")), _num(times.get("prefill")), _num(r.get("new_tokens"))
        return n / (wall - pre) if None not in (wall, pre, n) and wall > pre else None
    mine = rate(row)
    for r in rows:
        if (str(r.get("system", "")).startswith("ar") and _engine(r) == _engine(row) and "error" not in r
                and r.get("temperature") == row.get("temperature") and r.get("batch_size") == row.get("batch_size")):
            base = rate(r)
            return mine / base if mine and base else None
    return None


def _title(path: Path, doc: dict) -> list[str]:
    env, st = _d(doc.get("environment")), _d(doc.get("settings"))
    gpu = str(env.get("gpu") or env.get("device") or "?").replace("NVIDIA ", "")
    modes = ", ".join(str(st.get("compile") or "eager").split(","))
    commit = str(env.get("commit") or "?").split(" ")[0]
    dtype = str(doc.get("dtype") or st.get("dtype") or "?").replace("torch.", "")
    target, draft, corrected = e2e_models(st)
    head = (f"### {target} / {draft or '–'} — {gpu}, {dtype}, γ={st.get('gamma', '?')} "
            f"({st.get('gamma_schedule', '?')} schedule), {st.get('num_prompts', '?')} prompts × "
            f"{st.get('max_new_tokens', '?')} new tokens, engine modes: {modes}, commit {commit}")
    out = [head, "", f"`{path.name}`; {str(env.get('date') or '?')[:10]}; torch {env.get('torch', '?')}, "
           f"transformers {env.get('transformers', '?')}" + ("; Whisper (ASR)" if st.get("whisper") else "")
           + ("; the file's settings name the text defaults (recorded before `--whisper` replaced them)"
              if corrected else ""), ""]
    if st.get("random_init"):
        out += ["**Random weights: machinery timing only, α≈0** (α, τ, speedups and greedy match say nothing "
                "about the real pair).",
                ""]
    for key in ("provenance", "note"):
        if doc.get(key):
            out += [f"*{key.capitalize()}: {doc[key]}*", ""]
    return out


def file_table(path: Path, doc: dict) -> list[str]:
    rows = _rows(doc)
    per_req = any((_num(r.get("batch_size")) or 1) > 1 for r in rows)
    cols = ["T", "B", "system", "tok/s"] + (["tok/s/req"] if per_req else []) + [
        "α", "c", "τ", "mean γ", "pred. (Thm 3.8)", "meas. vs ar", "\\|pred−meas\\|/meas", "decode-only meas.",
        "\\|pred−dec\\|/dec", "verify %",
        "greedy = ar", "peak GiB"]
    out = _title(path, doc) + ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    for r in rows:
        cells = [_f(r.get("temperature"), "{:g}", "?"), _f(r.get("batch_size"), "{:d}", "?"),
                 f"`{r.get('system', '?')}`"]
        if "error" in r:
            err = " ".join(str(r["error"]).split()).replace("|", "\\|")
            err = err if len(err) <= ERR_CHARS else err[:ERR_CHARS] + "…"
            out.append("| " + " | ".join(cells + [f"error: {err}"] + ["–"] * (len(cols) - 4)) + " |")
            continue
        cells.append(_f(r.get("tokens_per_second"), "{:.1f}"))
        if per_req:
            b = _num(r.get("batch_size")) or 1
            cells.append(_f(r.get("tokens_per_second_per_request"), "{:.1f}") if b > 1 else "–")
        spec = _is_spec(r)
        pred = _num(r.get("predicted_speedup")) if spec else None
        meas = _measured(r, rows) if spec else None
        dec = _decode_only(r, rows) if spec else None
        pred_s = _f(pred)
        if pred is not None and _d(doc.get("settings")).get("gamma_schedule", "constant") != "constant":
            pred_s += f" (γ={r.get('predicted_speedup_gamma', '?')})"
        gm = r.get("greedy_match_ar") if spec and r.get("temperature") == 0 else None
        vs = _num(r.get("verify_share"))
        mem = _num(r.get("peak_memory_bytes"))
        cells += [_f(r.get("alpha"), "{:.3f}"), _f(r.get("cost_ratio")), _f(r.get("block_efficiency")),
                  _f(r.get("mean_gamma")), pred_s, _f(meas),
                  _f(abs(pred - meas) / meas * 100 if pred is not None and meas else None, "{:.0f}%"), _f(dec),
                  _f(abs(pred - dec) / dec * 100 if pred is not None and dec else None, "{:.0f}%"),
                  _f(vs * 100 if vs is not None else None, "{:.1f}"),
                  _f(gm * 100 if _num(gm) is not None else None, "{:.0f}%"),
                  _f(mem / 2**30 if mem is not None else None)]
        out.append("| " + " | ".join(cells) + " |")
    return out + [""]


def headlines(docs: list) -> list[str]:
    """Per (target, T, B=1) over real-weight files: best tilespec tok/s vs the best HF-assisted and ``ar@graphs``."""
    groups: dict = {}
    for path, doc in docs:
        if _d(doc.get("settings")).get("random_init"):
            continue
        target = e2e_models(_d(doc.get("settings")))[0]
        for r in _rows(doc):
            if "error" in r or r.get("batch_size") != 1:
                continue
            tps, system = _num(r.get("tokens_per_second")), str(r.get("system") or "")
            kind = ("spec" if _is_spec(r) else "hfa" if system == "hf-assisted" else
                    "arg" if system == "ar@graphs" else None)
            if kind is None or tps is None:
                continue
            g = groups.setdefault((target, r.get("temperature")), {})
            if kind not in g or tps > g[kind][0]:
                meas = _measured(r, _rows(doc)) if kind == "spec" else None
                g[kind] = (tps, system, path.name, _d(doc.get("settings")), meas)
    out = []
    for (target, temp), g in sorted(groups.items(), key=lambda kv: (str(kv[0][0]), _num(kv[0][1]) or 0)):
        if "spec" not in g:
            continue
        tps, system, name, st, meas = g["spec"]
        line = (f"- **{target}, T={_f(temp, '{:g}', '?')}, B=1**: best tilespec {tps:.1f} tok/s (`{system}`, "
                f"γ={st.get('gamma', '?')} {st.get('gamma_schedule', '?')}, `{name}`; {_f(meas)}× `ar` of the "
                "same file and engine mode)")
        for key, label in (("hfa", "HF assisted"), ("arg", "our `ar@graphs`")):
            if key in g:
                line += f"; {tps / g[key][0]:.2f}× {label} (best {g[key][0]:.1f} tok/s, `{g[key][2]}`)"
            else:
                line += f"; no {label} run"
        out.append(line)
    return out


def e2e_section(others: list) -> list[str]:
    docs = [(Path(p), d) for p, d in others if isinstance(d, dict) and (Path(p).name.startswith("e2e-") or
                                                                     _d(d.get("settings")).get("benchmark") == "e2e")]
    if not docs:
        return []
    docs.sort(key=lambda pd: (bool(_d(pd[1].get("settings")).get("random_init")), pd[0].name))
    out = [TITLE, "",
           "Whole decoding loop (`tilespec bench e2e`), tokens per second over all requests. α = accepted / drafted; "
           "c = draft / target forward cost; τ = tokens emitted per target forward (block efficiency); predicted "
           "speedup = Leviathan et al. Thm 3.8 from α over tested positions, c and γ; measured = tok/s over `ar` "
           "(target-only decoding) in the same engine mode, T and B, from whole wall times; decode-only = the same "
           "without the eager prefill (Thm 3.8 models decoding steps only); verify % = share of draft + target + verify "
           "time spent in verification.",
           "",
           "Greedy match < 100 % in bf16 comes from bf16 logits of a (γ+1)-token target forward differing from "
           "single-token forwards (ties and near-ties flip the argmax), not from the verification, which is exact "
           "in fp32 (see the CPU tests).", ""]
    for path, doc in docs:
        out += file_table(path, doc)
    heads = headlines(docs)
    if heads:
        out += ["### Headlines", "", "Real weights only; best B=1 run per target and T across the files above (files "
                "differ in commit, prompts and token budget; same-file speedups are in the tables).", ""] + heads + [""]
    return out
