"""Results on disk and the LRA tables.

Every run writes ``results.json`` (a list of rows: at least ``task``, ``variant``,
``test_accuracy`` as a fraction, ``steps_per_s``, ``peak_mib``), ``results.csv`` and ``results.md``.
``python -m benchmarks.lra report --runs DIR`` gathers every ``results.json`` under ``DIR`` into

- Table 1 (LRA's Table 1): test accuracy per task x variant, mean +- std over the seeds run (and
  how many), with a majority-class row and a chance row per task; the average covers the tasks
  present for that variant only, and says how many (a missing task is never counted as 0);
- Table 2 (LRA's Table 2): training steps/s and peak memory per variant at each length, relative
  to softmax at that length (from ``speed`` runs),

as CSV, markdown and plots (accuracy bars, learning curves: dev accuracy against step per run,
speed and memory against length). A task that is a stand-in carries "*" in every table.
"""
from __future__ import annotations

import csv
import json
import statistics
from pathlib import Path
from typing import Dict, List, Tuple

from .tasks import TASKS

CSV_COLUMNS = ("task", "variant", "seed", "test_accuracy", "dev_accuracy", "majority_test_accuracy", "best_step",
               "steps", "finished", "steps_per_s", "peak_mib", "memory", "train_minutes", "batch_size", "recipe",
               "backend", "length", "device", "torch", "effattn", "date")


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
    write_rows(rows, out, seeds_markdown(rows))


def environment_line(rows: List[Dict]) -> str:
    r = rows[0] if rows else {}
    dates = sorted({x.get("date", "")[:10] for x in rows if x.get("date")})
    return (f"{r.get('device', '?')}; torch {r.get('torch', '?')}, effattn {r.get('effattn', '?')}, "
            f"python {r.get('python', '?')}; {', '.join(dates) or '?'}")


def pct(x) -> str:
    return "-" if x is None else f"{100 * x:.1f}"


def _task_order(label: str) -> int:
    name = label.split(" ")[0].rstrip("*")
    return TASKS.index(name) if name in TASKS else len(TASKS)


def by_seed(rows: List[Dict], key: str = "test_accuracy") -> Dict[Tuple[str, str], Dict]:
    """``{(task, variant): {seed: value}}``; of two rows of one seed the later wins (a re-run
    replaces an old one)."""
    out: Dict = {}
    for r in rows:
        if r.get(key) is not None:
            out.setdefault((r["task"], r["variant"]), {})[r.get("seed", 0)] = r[key]
    return out


def mean_std(values) -> str:
    """``"mean +- std (n)"`` in percent (sample std), or the single value."""
    values = list(values)
    if not values:
        return "-"
    if len(values) == 1:
        return pct(values[0])
    return f"{pct(statistics.mean(values))} ± {100 * statistics.stdev(values):.1f} ({len(values)})"


def reference_rows(rows: List[Dict], tasks: List[str]) -> List[str]:
    """The majority-class row (the train set's most frequent label, scored on test) and the chance row."""
    cells = {}
    for name, key in (("majority class", "majority_test_accuracy"), ("chance", "chance")):
        vals = [next((r[key] for r in rows if r["task"] == t and r.get(key) is not None), None) for t in tasks]
        cells[name] = vals
    return [f"| *{name}* | " + " | ".join(pct(v) for v in vals) + " | |" for name, vals in cells.items()]


def table1(rows: List[Dict]) -> str:
    acc_rows = [r for r in rows if r.get("test_accuracy") is not None]
    tasks = sorted({r["task"] for r in acc_rows}, key=_task_order)
    variants = list(dict.fromkeys(r["variant"] for r in acc_rows))
    seeds = by_seed(acc_rows)
    lines = ["| variant | " + " | ".join(tasks) + " | avg (tasks present) |", "|---" * (len(tasks) + 2) + "|"]
    for v in variants:
        runs = [seeds.get((t, v), {}) for t in tasks]
        means = [statistics.mean(x.values()) for x in runs if x]
        avg = f"{pct(sum(means) / len(means))} ({len(means)}/{len(tasks)})" if means else "-"
        lines.append(f"| {v} | " + " | ".join(mean_std(x.values()) for x in runs) + f" | {avg} |")
    lines += reference_rows(acc_rows, tasks)
    return "\n".join(lines) + "\n"


def seeds_markdown(rows: List[Dict]) -> str:
    """One line per task x variant: test and best dev accuracy as mean +- std over the seeds, speed,
    memory; then the majority-class and chance rows."""
    acc = [r for r in rows if r.get("test_accuracy") is not None]
    test, dev = by_seed(acc), by_seed(acc, "dev_accuracy")
    lines = ["| task | variant | recipe | seeds | test acc. (%) | best dev (%) | steps | steps/s | peak memory (MiB) | "
             "train min |", "|---" * 10 + "|"]
    for key, runs in test.items():
        group = [r for r in acc if (r["task"], r["variant"]) == key]
        steps = sorted({r["steps"] for r in group})
        unfinished = sum(1 for r in group if not r.get("finished", True))
        lines.append(f"| {key[0]} | {key[1]} | {group[0].get('recipe', '?')} | {len(runs)} | "
                     f"{mean_std(runs.values())} | {mean_std(dev[key].values())} | "
                     f"{'-'.join(map(str, (steps[0], steps[-1]) if len(steps) > 1 else steps))}"
                     f"{f' ({unfinished} stopped early)' if unfinished else ''} | "
                     f"{statistics.mean(r['steps_per_s'] for r in group):.2f} | "
                     f"{max(r['peak_mib'] for r in group):.0f} | "
                     f"{statistics.mean(r.get('train_minutes', 0) for r in group):.1f} |")
    for task in dict.fromkeys(k[0] for k in test):
        for name, key in (("majority class", "majority_test_accuracy"), ("chance", "chance")):
            v = next((r[key] for r in acc if r["task"] == task and r.get(key) is not None), None)
            lines.append(f"| {task} | *{name}* | | | {pct(v)} | | | | | |")
    lines += ["", "Mean ± sample std over the seeds (n). " + environment_line(acc) + ". Memory: "
              + (acc[0].get("memory", "") if acc else "") + ".",
              "A task marked * is a stand-in or an unvalidated regeneration, not LRA's data "
              "(see benchmarks/lra/README.md)."]
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
    about = (f"{environment_line(rows)}. Byte-level classifier, recipe `{r.get('recipe')}` "
             f"({r.get('model_about')}), batch "
             f"{r.get('batch_size')}, backend `{r.get('backend')}`; memory: {r.get('memory', '?')}.")
    title = "# Training speed and memory by sequence length (LRA Table 2 style)"
    return f"{title}\n\n{about}{' ' + note if note else ''}\n\n{table2(rows)}"


#: what makes two rows the same run (a demo's summary adds fields to its variants' rows)
IDENTITY = ("task", "variant", "date", "recipe", "length", "seed", "steps", "batch_size", "test_accuracy", "data")


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
        recipes = ", ".join(sorted({f"`{r.get('recipe', '?')}`" for r in acc}))
        md += ["## Test accuracy (%), best dev checkpoint (Table 1 style)", "", table1(acc),
               f"Mean ± sample std over the seeds (n); recipe(s) {recipes}. A task marked * is a stand-in or an "
               "unvalidated regeneration, not LRA's data. The average covers the tasks present.", ""]
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
        groups = by_seed(acc)
        labels = [f"{t}\n{v}" for t, v in groups]
        vals = [list(x.values()) for x in groups.values()]
        ax.bar(range(len(vals)), [100 * statistics.mean(x) for x in vals], color="C0",
               yerr=[100 * statistics.stdev(x) if len(x) > 1 else 0 for x in vals], capsize=3)
        ax.set_xticks(range(len(vals)), labels, fontsize=6)
        ax.set_ylabel("test accuracy (%)")
        ax.set_title(environment_line(acc), fontsize=7)
        fig.tight_layout()
        fig.savefig(out / "accuracy.png", dpi=80)
        plt.close(fig)
        made.append(out / "accuracy.png")
    curves = [r for r in acc if r.get("evals")]
    if curves:
        fig, ax = plt.subplots(figsize=(7, 4))
        colors = {v: f"C{i % 10}" for i, v in enumerate(dict.fromkeys(r["variant"] for r in curves))}
        labelled = set()
        for r in curves:
            name = f"{r['task']} {r['variant']}"
            ax.plot([e[0] for e in r["evals"]], [100 * e[1] for e in r["evals"]], color=colors[r["variant"]],
                    alpha=0.7, lw=1, marker=".", label=None if name in labelled else name)
            labelled.add(name)
        ax.set_xlabel("training step")
        ax.set_ylabel("dev accuracy (%)")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=6, ncol=2)
        ax.set_title("learning curves (one line per run); " + environment_line(curves), fontsize=7)
        fig.tight_layout()
        fig.savefig(out / "curves.png", dpi=80)
        plt.close(fig)
        made.append(out / "curves.png")
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
