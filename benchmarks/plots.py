"""PNG plots: one figure per (variant, mode), time vs L and peak memory vs L (both log-log), one
line per implementation (effattn solid, baselines dashed). Configurations without a time (OOM,
unsupported, skipped) leave gaps.

    python -m benchmarks.plots benchmarks/results/cpu/results.json     # re-plot saved results
"""
from __future__ import annotations

from pathlib import Path
from typing import List

from .report import _groups, _title, ok_rows


def make_plots(rows: List[dict], meta: dict, out: Path, dpi: int = 80) -> List[Path]:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import NullLocator

    groups, order = _groups(rows)
    good = ok_rows(rows)
    paths = []
    for key, by_L in groups.items():
        variant, mode, section = key
        fig, (ax_t, ax_m) = plt.subplots(1, 2, figsize=(11, 4.2))
        for i, name in enumerate(order[key]):
            pts = sorted((r["L"], r["time_ms"], r["peak_mem_mib"], r["kind"]) for r in good
                         if r["variant"] == variant and r["mode"] == mode and r["impl"] == name
                         and r.get("section") == section)
            if not pts:
                continue
            style = dict(label=name, marker="o", markersize=4, color=f"C{i % 10}",
                         linestyle="-" if pts[0][3] == "effattn" else "--",
                         linewidth=2.2 if pts[0][3] == "effattn" else 1.4)
            ax_t.plot([p[0] for p in pts], [p[1] for p in pts], **style)
            mem = [(p[0], p[2]) for p in pts if p[2] is not None and p[2] > 0]
            if mem:
                ax_m.plot([m[0] for m in mem], [m[1] for m in mem], **style)
        lengths = sorted(by_L)
        for ax, ylabel in ((ax_t, "median time (ms)"), (ax_m, "peak memory (MiB)")):
            ax.set_xscale("log", base=2)
            ax.set_xticks(lengths, [f"{L // 1024}k" if L >= 1024 and L % 1024 == 0 else str(L) for L in lengths])
            ax.xaxis.set_minor_locator(NullLocator())
            ax.set_yscale("log")
            ax.set_xlabel("sequence length L")
            ax.set_ylabel(ylabel)
            ax.grid(True, which="both", alpha=0.3)
        ax_m.set_title(meta["memory_method"] + ", beyond the inputs", fontsize=8)
        handles, labels = ax_t.get_legend_handles_labels()
        if handles:
            ax_t.legend(fontsize=8)
        about = meta.get("variants", {}).get(variant, "")
        fig.suptitle(f"{meta['device']}\n{_title(key, by_L)}" + (f"\n{about}" if about else ""), fontsize=9)
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
