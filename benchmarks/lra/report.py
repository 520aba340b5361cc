"""Results on disk and the LRA tables.

Every run writes ``results.json`` (a list of rows: at least ``task``, ``variant``,
``test_accuracy`` as a fraction, ``steps_per_s``, ``peak_mib``), ``results.csv`` and ``results.md``.
``python -m benchmarks.lra report --runs DIR`` gathers every ``results.json`` under ``DIR`` into

- Table 1 (LRA's Table 1): test accuracy per task x variant; the average covers the tasks present
  for that variant only, and says how many (a missing task is never counted as 0);
- Table 2 (LRA's Table 2): training steps/s and peak memory per variant at each length, relative
  to softmax at that length (from ``speed`` runs),

as CSV, markdown and plots. A task that is a stand-in carries "*" in every table.
"""
from __future__ import annotations

import csv
import json
from pathlib import Path
from typing import Dict, List

from .tasks import TASKS

CSV_COLUMNS = ("task", "variant", "test_accuracy", "dev_accuracy", "best_step", "steps", "finished", "steps_per_s",
               "peak_mib", "memory", "train_minutes", "batch_size", "config", "backend", "length", "device", "torch",
               "effattn", "date")


def write_rows(rows: List[Dict], out: Path, markdown: str) -> None:
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps(rows, indent=1, default=str) + "\n")
    with open(out / "results.csv", "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=CSV_COLUMNS, extrasaction="ignore")
        w.writeheader()
        for r in rows:
            w.writerow({k: (f"{r[k]:.6g}" if isinstance(r.get(k), float) else r.get(k, "")) for k in CSV_COLUMNS})
    (out / "results.md").write_text(markdown)


def write_run(rows: List[Dict], out: Path) -> None:
    write_rows(rows, out, runs_markdown(rows))


def environment_line(rows: List[Dict]) -> str:
    r = rows[0] if rows else {}
    dates = sorted({x.get("date", "")[:10] for x in rows if x.get("date")})
    return (f"{r.get('device', '?')}; torch {r.get('torch', '?')}, effattn {r.get('effattn', '?')}, "
            f"python {r.get('python', '?')}; {', '.join(dates) or '?'}")


def pct(x) -> str:
    return "-" if x is None else f"{100 * x:.1f}"


def runs_markdown(rows: List[Dict]) -> str:
    """One line per run: accuracy, speed, memory, how far it trained."""
    lines = ["| task | variant | test acc. (%) | best dev (%) | steps | steps/s | peak memory (MiB) | train min |",
             "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        steps = f"{r['steps']}" + ("" if r.get("finished", True) else f" of {r.get('target_steps')}")
        lines.append(f"| {r['task']} | {r['variant']} | {pct(r['test_accuracy'])} | {pct(r.get('dev_accuracy'))} | "
                     f"{steps} | {r['steps_per_s']:.2f} | {r['peak_mib']:.0f} | {r.get('train_minutes', 0):.1f} |")
    lines += ["", environment_line(rows) + ". Memory: " + (rows[0].get("memory", "") if rows else "") + ".",
              "A task marked * is a stand-in, not LRA's data (see benchmarks/lra/README.md)."]
    return "\n".join(lines) + "\n"


def _task_order(label: str) -> int:
    name = label.split(" ")[0].rstrip("*")
    return TASKS.index(name) if name in TASKS else len(TASKS)


def table1(rows: List[Dict]) -> str:
    acc_rows = [r for r in rows if r.get("test_accuracy") is not None]
    tasks = sorted({r["task"] for r in acc_rows}, key=_task_order)
    variants = list(dict.fromkeys(r["variant"] for r in acc_rows))
    best: Dict = {}
    for r in acc_rows:       # the last row of a (task, variant) wins: a re-run replaces an old one
        best[(r["task"], r["variant"])] = r["test_accuracy"]
    lines = ["| variant | " + " | ".join(tasks) + " | avg (tasks present) |", "|---" * (len(tasks) + 2) + "|"]
    for v in variants:
        vals = [best.get((t, v)) for t in tasks]
        present = [x for x in vals if x is not None]
        avg = f"{pct(sum(present) / len(present))} ({len(present)}/{len(tasks)})" if present else "-"
        lines.append(f"| {v} | " + " | ".join(pct(x) for x in vals) + f" | {avg} |")
    return "\n".join(lines) + "\n"


def table2(rows: List[Dict]) -> str:
    speed = [r for r in rows if r.get("length")]
    if not speed:
        return ""
    lengths = sorted({r["length"] for r in speed})
    variants = list(dict.fromkeys(r["variant"] for r in speed))
    by = {(r["variant"], r["length"]): r for r in speed}
    head = " | ".join(f"{L // 1024}K" if L % 1024 == 0 else str(L) for L in lengths)
    out = []
    for key, title in (("steps_per_s", "training steps/s, relative to softmax (softmax: absolute)"),
                       ("peak_mib", "peak memory, relative to softmax (softmax: MiB)")):
        out += [f"{title}:", "", f"| variant | {head} |", "|---" * (len(lengths) + 1) + "|"]
        for v in variants:
            cells = []
            for L in lengths:
                r, base = by.get((v, L)), by.get(("softmax", L))
                if r is None or r.get(key) is None:
                    cells.append(r.get("status", "-") if r else "-")
                elif v == "softmax" or base is None or not base.get(key):
                    cells.append(f"{r[key]:.2f}" if key == "steps_per_s" else f"{r[key]:.0f}")
                else:
                    cells.append(f"{r[key] / base[key]:.2f}x")
            out.append(f"| {v} | " + " | ".join(cells) + " |")
        out.append("")
    return "\n".join(out)


def speed_markdown(rows: List[Dict], note: str = "") -> str:
    r = rows[0] if rows else {}
    about = (f"{environment_line(rows)}. Byte-level text classifier, config `{r.get('config')}`, batch "
             f"{r.get('batch_size')}, backend `{r.get('backend')}`; memory: {r.get('memory', '?')}.")
    title = "# Training speed and memory by sequence length (LRA Table 2 style)"
    return f"{title}\n\n{about}{' ' + note if note else ''}\n\n{table2(rows)}"


#: what makes two rows the same run (a demo's summary adds fields to its variants' rows)
IDENTITY = ("task", "variant", "date", "config", "length", "seed", "steps", "batch_size", "test_accuracy", "data")


def gather(runs: Path) -> List[Dict]:
    """Every row of every ``results.json`` under ``runs``, once (a demo folder repeats its variants'
    rows at the top)."""
    rows, seen = [], set()
    for path in sorted(Path(runs).rglob("results.json")):
        data = json.loads(path.read_text())
        for r in data if isinstance(data, list) else []:
            key = json.dumps([r.get(k) for k in IDENTITY], default=str) if isinstance(r, dict) else None
            if isinstance(r, dict) and "task" in r and "variant" in r and key not in seen:
                seen.add(key)
                rows.append(r)
    return rows


def full_report(rows: List[Dict], out: Path) -> List[Path]:
    acc = [r for r in rows if not r.get("length")]
    md = ["# Long Range Arena", "", environment_line(rows) + ".", ""]
    if acc:
        md += ["## Test accuracy (%), best dev checkpoint (Table 1 style)", "", table1(acc),
               "A task marked * is a stand-in, not LRA's data. The average covers the tasks present.", ""]
    t2 = table2(rows)
    if t2:
        md += ["## Training speed and memory (Table 2 style)", "", t2]
    write_rows(rows, out, "\n".join(md) + "\n")
    paths = [Path(out) / n for n in ("results.json", "results.csv", "results.md")]
    paths += plots(rows, Path(out))
    return paths


def plots(rows: List[Dict], out: Path) -> List[Path]:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return []
    made = []
    acc = [r for r in rows if not r.get("length") and r.get("test_accuracy") is not None]
    if acc:
        fig, ax = plt.subplots(figsize=(7, 3.5))
        labels = [f"{r['task']}\n{r['variant']}" for r in acc]
        ax.bar(range(len(acc)), [100 * r["test_accuracy"] for r in acc], color="C0")
        ax.set_xticks(range(len(acc)), labels, fontsize=7)
        ax.set_ylabel("test accuracy (%)")
        ax.set_title(environment_line(acc), fontsize=7)
        fig.tight_layout()
        fig.savefig(out / "accuracy.png", dpi=80)
        plt.close(fig)
        made.append(out / "accuracy.png")
    speed = [r for r in rows if r.get("length") and r.get("steps_per_s")]
    if speed:
        fig, (a1, a2) = plt.subplots(1, 2, figsize=(10, 3.8))
        for v in dict.fromkeys(r["variant"] for r in speed):
            pts = sorted((r["length"], r["steps_per_s"], r["peak_mib"]) for r in speed if r["variant"] == v)
            a1.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=v)
            a2.plot([p[0] for p in pts], [p[2] for p in pts], marker="o", label=v)
        for ax, yl in ((a1, "training steps/s"), (a2, "peak memory (MiB)")):
            ax.set_xlabel("sequence length")
            ax.set_ylabel(yl)
            ax.set_yscale("log")
            ax.grid(alpha=0.3)
        a1.legend(fontsize=7)
        fig.suptitle(environment_line(speed), fontsize=7)
        fig.tight_layout()
        fig.savefig(out / "speed.png", dpi=80)
        plt.close(fig)
        made.append(out / "speed.png")
    return made
