"""Results on disk (CSV, JSON, markdown) and the summary printed at the end of a run.

Summary: one table per (variant, mode), one row per length, one column per implementation (median
ms, or OOM / skip / n/s = unsupported / ERR), and ``eff/base`` = best effattn time / best baseline
time (below 1: effattn is faster), with the baseline named.
"""
from __future__ import annotations

import csv
import json
import math
from pathlib import Path
from typing import Dict, List, Optional

COLUMNS = ("variant", "op", "impl", "kind", "mode", "dtype", "B", "H", "L", "D", "status", "time_ms",
           "tflops", "peak_mem_mib", "flops", "visible_frac", "section", "max_diff")


def write_all(rows: List[dict], meta: dict, out: Path) -> List[Path]:
    out = Path(out)
    csv_path, json_path, md_path = out / "results.csv", out / "results.json", out / "results.md"
    with open(csv_path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=COLUMNS, extrasaction="ignore")
        w.writeheader()
        for r in rows:
            w.writerow({k: _csv_value(r.get(k)) for k in COLUMNS})
    with open(json_path, "w") as f:
        json.dump({"meta": meta, "rows": rows}, f, indent=1, default=str)
    md_path.write_text(summary_markdown(rows, meta))
    return [csv_path, json_path, md_path]


def _csv_value(x):
    if isinstance(x, float):
        return f"{x:.6g}"
    return "" if x is None else x


# ------------------------------------------------------------------------------------ tables

def short_status(status: str) -> str:
    if status == "ok":
        return "ok"
    if status == "oom":
        return "OOM"
    return {"skipped": "skip", "unsupported": "n/s", "error": "ERR"}.get(status.split(":", 1)[0], status[:5])


def fmt_ms(ms: float) -> str:
    if ms is None:                       # a check that passed: nothing timed
        return "ok"
    if ms >= 100:
        return f"{ms:.0f}"
    if ms >= 10:
        return f"{ms:.1f}"
    if ms >= 1:
        return f"{ms:.2f}"
    return f"{ms:.3f}"


def fmt_mib(mib: Optional[float]) -> str:
    if mib is None:
        return "n/a"
    if mib >= 1024:
        return f"{mib / 1024:.1f} GiB"
    return f"{mib:.0f} MiB" if mib >= 10 else f"{mib:.1f} MiB"


def _groups(rows: List[dict]):
    """{(variant, mode, section): {L: {impl: row}}} and the implementation order, both as first seen
    (section: a suite's section, or None)."""
    groups: Dict[tuple, Dict[int, Dict[str, dict]]] = {}
    order: Dict[tuple, List[str]] = {}
    for r in rows:
        key = (r["variant"], r["mode"], r.get("section"))
        groups.setdefault(key, {}).setdefault(r["L"], {})[r["impl"]] = r
        names = order.setdefault(key, [])
        if r["impl"] not in names:
            names.append(r["impl"])
    return groups, order


def best_ratio(by_impl: Dict[str, dict]):
    """(best effattn ms / best baseline ms, baseline name), or None when either side has no time."""
    eff = [r["time_ms"] for r in by_impl.values() if r["kind"] == "effattn" and r["status"] == "ok"]
    base = [(r["time_ms"], r["impl"]) for r in by_impl.values() if r["kind"] == "baseline" and r["status"] == "ok"]
    if not eff or not base:
        return None
    t, name = min(base)
    return min(eff) / t, name


def _table(key, by_L, names, cell, with_ratio=True):
    """Header + rows of one (variant, mode) table; columns that are unsupported everywhere are
    dropped and named in the returned footnote."""
    hidden = {n: next(r["status"] for r in (by_L[L].get(n) for L in by_L) if r is not None)
              for n in names
              if all(r is None or r["status"].startswith("unsupported") for r in (by_L[L].get(n) for L in by_L))}
    shown = [n for n in names if n not in hidden]
    header = ["L"] + shown + (["eff/base"] if with_ratio else [])
    body = []
    for L in sorted(by_L):
        line = [str(L)]
        for n in shown:
            r = by_L[L].get(n)
            line.append("" if r is None else (cell(r) if r["status"] == "ok" else short_status(r["status"])))
        if with_ratio:
            ratio = best_ratio(by_L[L])
            line.append("-" if ratio is None else f"{ratio[0]:.2f} ({ratio[1]})")
        body.append(line)
    # the footnote already says "unsupported": give the reason once
    foot = [f"{n}: {st.split(': ', 1)[-1] if st.startswith('unsupported: ') else st}" for n, st in hidden.items()]
    return header, body, foot


def _title(key, by_L) -> str:
    variant, mode, section = key
    any_row = next(iter(next(iter(by_L.values())).values()))
    Bs = sorted({r["B"] for rows in by_L.values() for r in rows.values()})
    B = f"B={Bs[0]}" if len(Bs) == 1 else f"B={Bs[-1]}..{Bs[0]} (B*L const)"
    return (f"{variant} | {'forward' if mode == 'fwd' else 'forward+backward'} | {any_row['dtype']} "
            f"{B} H={any_row['H']} D={any_row['D']}" + (f" | {section}" if section else ""))


def summary_text(rows: List[dict], meta: dict) -> str:
    """The terminal summary: median ms per implementation and the effattn / best-baseline ratio."""
    groups, order = _groups(rows)
    out = [f"\n{meta['device']} | torch {meta['torch']} | triton {meta['triton']} | median ms "
           "(OOM, skip = over the memory budget, n/s = unsupported, ERR = error; see results.csv)",
           "eff/base = best effattn time / best baseline time (< 1: effattn faster)"]
    for key, by_L in groups.items():
        header, body, foot = _table(key, by_L, order[key], lambda r: fmt_ms(r["time_ms"]))
        widths = [max(len(row[i]) for row in [header] + body) for i in range(len(header))]
        out.append("\n" + _title(key, by_L))
        out.append("  ".join(h.rjust(w) for h, w in zip(header, widths)))
        out.extend("  ".join(c.rjust(w) for c, w in zip(row, widths)) for row in body)
        out.extend(f"  (not shown, unsupported: {f})" for f in foot)
    return "\n".join(out)


def _md_table(header, body) -> List[str]:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(c or " " for c in row) + " |" for row in body]
    return lines


def summary_markdown(rows: List[dict], meta: dict) -> str:
    groups, order = _groups(rows)
    args = meta.get("args", {})
    unit, scale = ("TFLOP/s", 1) if meta.get("device_type") == "cuda" else ("GFLOP/s", 1000)
    cmd = "python -m benchmarks.run" + "".join(
        f" --{k.replace('_', '-')}" + ("" if v is True else f" {v}")
        for k, v in args.items() if v not in (None, False, "")
        and not (k == "backends" and v == "torch,triton,cuda") and not (k == "modes" and v == "fwd,fwdbwd"))
    out = [f"# effattn benchmarks: {meta['device']}", "",
           f"`{cmd}` on {meta['date']}: torch {meta['torch']}, triton {meta['triton']}, "
           f"CUDA {meta['cuda']}{', driver ' + meta['driver'] if meta.get('driver') else ''}, CPU threads: {meta['cpu_threads']}, dtype {meta['dtype']}, "
           f"D={meta['head_dim']}, B={meta['batch']}, H={meta['heads']}, window={meta['window']}.", "",
           f"- time: {meta['timing']}", f"- FLOPs: {meta['flops']}",
           f"- memory: {meta['memory_method']}, beyond the inputs",
           f"- cells: median ms ({unit}); OOM, skip (over the memory budget), n/s (unsupported), "
           "ERR (error): the reasons are listed at the end and in results.csv",
           "- eff/base: best effattn time / best baseline time (< 1: effattn is faster)"]
    if meta.get("not_installed"):
        out.append("- not installed, not swept: " + "; ".join(f"{k} ({v})" for k, v in meta["not_installed"].items()))
    for key, by_L in groups.items():
        out += ["", f"## {_title(key, by_L)}", "", meta.get("variants", {}).get(key[0], ""), ""]
        header, body, foot = _table(key, by_L, order[key],
                                    lambda r: fmt_ms(r["time_ms"]) + (
                                        "" if r["tflops"] is None else f" ({r['tflops'] * scale:.3g})"))
        out += _md_table(header, body)
        header, body, _ = _table(key, by_L, order[key], lambda r: fmt_mib(r["peak_mem_mib"]), with_ratio=False)
        header[0] = "L (peak memory)"
        out += [""] + _md_table(header, body)
        if foot:
            out += [""] + [f"Not shown, unsupported everywhere: {f}" for f in foot]
    problems: Dict[tuple, List[str]] = {}
    for r in rows:
        if r["status"] != "ok":
            problems.setdefault((r["impl"], r["status"]), [])
            tag = f"{r['variant']}/{r['mode']}/L={r['L']}"
            problems[(r["impl"], r["status"])].append(tag)
    if problems:
        out += ["", "## Configurations without a time", ""]
        for (impl, status), where in sorted(problems.items()):
            shown = ", ".join(where[:6]) + (f", ... ({len(where)} in all)" if len(where) > 6 else "")
            out.append(f"- **{impl}** {status}: {shown}")
    return "\n".join(out) + "\n"


def ok_rows(rows: List[dict]) -> List[dict]:
    return [r for r in rows if r["status"] == "ok" and r["time_ms"] is not None and not math.isnan(r["time_ms"])]


def headline_markdown(rows: List[dict], meta: dict, mode: str = "fwdbwd") -> str:
    """The table the README quotes: at the longest L of each variant, every implementation's time and
    memory side by side (baselines that beat effattn included), and how each was measured."""
    groups, order = _groups(rows)
    names = [n for n in dict.fromkeys(n for key in order for n in order[key])
             if any(r["impl"] == n and r["status"] == "ok" for r in rows)]
    header = ["variant", "L"] + [f"{n} ms" for n in names] + [f"{n} MiB" for n in names]
    body = []
    for (variant, m), by_L in groups.items():
        if m != mode:
            continue
        L = max(L for L in by_L if any(r["status"] == "ok" for r in by_L[L].values()))
        cells = [by_L[L].get(n) for n in names]
        def cell(r, what):
            if r is None:
                return "-"
            if r["status"] != "ok":
                return short_status(r["status"])
            return fmt_ms(r["time_ms"]) if what == "ms" else fmt_mib(r["peak_mem_mib"])
        body.append([variant, str(L)] + [cell(r, "ms") for r in cells] + [cell(r, "mib") for r in cells])
    intro = (f"{meta['device']}, torch {meta['torch']}, {meta['cpu_threads']} thread(s), {meta['dtype']}, "
             f"B={meta['batch']}, H={meta['heads']}, D={meta['head_dim']}, {meta['date'][:10]}; "
             f"{'forward+backward' if mode == 'fwdbwd' else 'forward'} ms (median) and MiB added by one call "
             f"({meta['memory_method']}); '-' = not applicable (no such baseline for the op), "
             "n/s = unsupported, skip = over the memory budget.")
    return "\n".join([intro, ""] + _md_table(header, body)) + "\n"
