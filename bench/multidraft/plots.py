"""Plot a ``python -m bench.multidraft`` result: Fig. 3 (BE vs draft temperature), Table 1 (BE vs K), Fig. 4
(non-identical drafts) and Table 3 (token-level acceptance vs K), one row of panels per dataset."""
from __future__ import annotations

from pathlib import Path

COLORS = {"sd": "tab:gray", "specinfer": "tab:blue", "spectr": "tab:green", "is": "tab:red", "optimal": "black",
          "is-s5": "tab:orange", "is-s15-m40": "tab:purple"}
STYLES = ["-", "--", ":", "-."]


def _series(block: dict, labels: list[str], scheme: str):
    ys, es = [], []
    for lab in labels:
        st = block.get(lab, {}).get(scheme, {})
        ys.append(st.get("mean"))
        es.append(st.get("stderr") or 0.0)
    return ys, es


def plot_results(result: dict, path: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    be, acc = result["summary"]["block_efficiency"], result["summary"]["token_acceptance"]
    datasets = list(be)
    fig, axes = plt.subplots(len(datasets), 4, figsize=(18, 4 * len(datasets)), squeeze=False)
    for row, ds in enumerate(datasets):
        panels = [("fig3", "draft temperature (K=2 i.i.d.)", ("sd", "specinfer", "spectr", "is")),
                  ("table1", "K (T=1.2)", ("specinfer", "spectr", "is")),
                  ("fig4", "2nd draft temperature (1st at 1.2)", ("specinfer", "is"))]
        for col, (setting, xlabel, schemes) in enumerate(panels):
            ax = axes[row][col]
            block = be[ds].get(setting, {})
            labels = list(block)
            xs = [float(lab.split("=")[1]) for lab in labels]
            for scheme in schemes:
                ys, es = _series(block, labels, scheme)
                ax.errorbar(xs, ys, yerr=es, marker="o", capsize=3, label=scheme, color=COLORS.get(scheme))
            ax.set_xlabel(xlabel)
            ax.set_ylabel("block efficiency (tokens / target call)")
            ax.set_title(f"{ds}: {setting}")
            ax.legend()
        ax = axes[row][3]
        for j, (temp, by_k) in enumerate(acc.get(ds, {}).items()):
            ks = sorted(by_k, key=int)
            for scheme in ("optimal", "is", "spectr", "specinfer"):
                ys = [by_k[k][scheme]["mean"] for k in ks]
                ax.plot([int(k) for k in ks], ys, marker="o", color=COLORS[scheme], linestyle=STYLES[j % 4],
                        label=f"{scheme} T_d={temp}")
        ax.set_xlabel("K")
        ax.set_ylabel("token-level acceptance")
        ax.set_title(f"{ds}: Table 3 setting")
        ax.legend(fontsize=7)
    fig.suptitle(f"multi-draft speculative sampling, {result['device']}, {result['date'][:10]}")
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return Path(path)
