"""PNG plots: one figure per (variant, mode), time vs L and memory vs L, one line per implementation
(effattn solid and drawn on top, baselines dashed, each with its own marker so that lines lying on
each other stay visible). Nothing is dropped silently: a configuration without a result (out of
memory, unsupported, skipped) is an "x" on the bottom edge of the panel, and a memory of 0 MiB (below
the measurement's resolution) is drawn on the linear part of the memory axis at 0.

    python -m benchmarks.plots benchmarks/results/cpu/results.json     # re-plot saved results
"""
from __future__ import annotations

from pathlib import Path
from typing import List

from .report import _groups, _title

MARKERS = "osD^v<>ph*"


def label(name: str, op: str) -> str:
    """Legend text: the implementation, and what "naive" computes for linear attention."""
    if name == "naive" and op == "linear_attention":
        return "naive (quadratic form: L x L matrix)"
    return name


def make_plots(rows: List[dict], meta: dict, out: Path, dpi: int = 80) -> List[Path]:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.lines import Line2D
    from matplotlib.ticker import NullLocator

    groups, order = _groups(rows)
    paths = []
    for key, by_L in groups.items():
        variant, mode, section = key
        lengths = sorted(by_L)
        if not lengths or lengths[-1] <= 0:                  # a bookkeeping row (the GPU suite's precompile)
            continue
        fig, (ax_t, ax_m) = plt.subplots(1, 2, figsize=(11, 4.6))
        missing_any, plotted = False, 0
        for i, name in enumerate(order[key]):
            mine = [by_L[L][name] for L in lengths if name in by_L[L]]
            ok = [r for r in mine if r["status"] == "ok"]
            if not ok and all(r["status"].startswith("unsupported") for r in mine):
                continue                                     # never runs here: named under the table
            effattn = mine[0]["kind"] == "effattn"
            style = dict(label=label(name, mine[0]["op"]), marker=MARKERS[i % len(MARKERS)], markersize=5,
                         color=f"C{i % 10}", linestyle="-" if effattn else "--", linewidth=2.2 if effattn else 1.4,
                         zorder=3 if effattn else 2, alpha=1.0 if effattn else 0.85)
            ax_t.plot([r["L"] for r in ok], [r["time_ms"] for r in ok], **style)
            plotted += len(ok)
            mem = [r for r in ok if r["peak_mem_mib"] is not None]
            ax_m.plot([r["L"] for r in mem], [max(r["peak_mem_mib"], 0.0) for r in mem], **style)
            # no result: an x on the bottom edge (x in data coordinates, y in axes coordinates)
            gone = [r["L"] for r in mine if r["status"] != "ok"]
            for ax in (ax_t, ax_m):
                if gone:
                    ax.plot(gone, [0.02] * len(gone), "x", color=style["color"], markersize=8, clip_on=False,
                            transform=ax.get_xaxis_transform(), zorder=4)
            missing_any = missing_any or bool(gone)
        if not plotted:                                      # nothing measured (a section cut by its budget)
            plt.close(fig)
            continue
        for ax, ylabel in ((ax_t, "time per call (ms, median)"), (ax_m, "memory added by one call (MiB)")):
            ax.set_xscale("log", base=2)
            ax.set_xticks(lengths, [f"{L // 1024}k" if L >= 1024 and L % 1024 == 0 else str(L) for L in lengths])
            ax.xaxis.set_minor_locator(NullLocator())
            ax.set_xlabel("sequence length L")
            ax.set_ylabel(ylabel)
            ax.grid(True, which="both", alpha=0.3)
        ax_t.set_yscale("log")
        ax_m.set_yscale("symlog", linthresh=1.0)             # 0 MiB stays on the plot
        ax_m.set_ylim(bottom=0)
        ax_t.set_title("time (lower is better)", fontsize=9)
        ax_m.set_title("extra memory beyond the inputs (lower is better)", fontsize=9)
        handles, labels = ax_t.get_legend_handles_labels()
        if missing_any:
            handles.append(Line2D([], [], marker="x", linestyle="none", color="gray"))
            labels.append("x on the bottom edge: no result (out of memory, unsupported or skipped)")
        if handles:
            ax_t.legend(handles, labels, fontsize=7)
        about = meta.get("variants", {}).get(variant, "")
        fig.suptitle(f"{_title(key, by_L)} on {meta['device']}" + (f"\n{about}" if about else ""), fontsize=9)
        fig.tight_layout()
        path = Path(out) / f"{section + '-' if section else ''}{variant}-{mode}.png"
        fig.savefig(path, dpi=dpi)
        plt.close(fig)
        paths.append(path)
    return paths


if __name__ == "__main__":
    import json
    import sys

    src = Path(sys.argv[1] if len(sys.argv) > 1 else "results.json")
    data = json.loads(src.read_text())
    for p in make_plots(data["rows"], data["meta"], src.parent):
        print(p)
