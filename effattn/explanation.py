"""What `effattn.explain` returns: one `Row` per registered path of an op with its reasons, and the
path ``backend="auto"`` takes. `explain_call` builds it for a call already checked; the entry points
(`effattn.explain`, `explain_lsh`, `explain_relative`) build the call."""
from __future__ import annotations

from typing import Dict, List, NamedTuple, Optional

from .backends import base


class Row(NamedTuple):
    """One registry row as `explain` found it for a call."""
    path: str                 # "triton/decode"
    backend: str
    rank: int                 # the row's priority for this call (lower is tried first)
    reasons: List[str]        # why it cannot serve the call; empty: it can
    notes: List[str]          # what serving involves besides the kernels; "only when named" remarks
    detail: Optional[str]     # detail inside the path (splits, which forward kernel), or None


def _undeclared(why: List[str]) -> bool:
    """Whether a row's reasons say it does not declare some feature of the call (so the call is not
    for that row; `base.Backend.take` prefers the reasons of a row that declares them all)."""
    return any(w.startswith("does not support ") for w in why)


class Explanation:
    """What `explain` found: one `Row` per registered path (in the order "auto" tries them) with
    its reasons, and the pick. Per backend (``reasons``, ``notes``, ``paths``, ``ranks``, keyed by
    backend name): what naming that backend would do, i.e. its first row that admits the call (or
    the reasons of its last, most general row when none does)."""

    def __init__(self, op: str, rows: List[Row], chosen_path: Optional[str], missing: Dict[str, List[str]],
                 groups: Dict[str, List[str]]):
        self.op, self.rows, self.chosen_path = op, rows, chosen_path
        self.missing, self.groups = missing, groups
        self.chosen = chosen_path.split("/")[0] if chosen_path else None
        self.reasons: Dict[str, List[str]] = {}
        self.notes: Dict[str, str] = {}
        self.paths: Dict[str, str] = {}
        self.ranks: Dict[str, int] = {}
        by_name = {r.path: r for r in rows}
        for r in (by_name[n] for names in groups.values() for n in names):   # each backend's own order
            if r.backend in self.ranks and not self.reasons[r.backend]:
                continue                                   # the backend already takes an earlier row
            if (r.backend in self.ranks and r.reasons and _undeclared(r.reasons)
                    and not _undeclared(self.reasons[r.backend])):
                continue                                   # keep the reasons of the row the call is for
            self.reasons[r.backend], self.ranks[r.backend] = r.reasons, r.rank
            self.notes.pop(r.backend, None)
            if r.notes:
                self.notes[r.backend] = "; ".join(r.notes)
            self.paths[r.backend] = r.path + (f": {r.detail}" if r.detail else "")
        self.reasons.update(missing)

    def row(self, path: str) -> Row:
        return next(r for r in self.rows if r.path == path)

    def can_serve(self, name: str) -> bool:
        """Whether backend (or path) `name` can serve the call."""
        if "/" in name:
            return not self.row(name).reasons
        return name in self.reasons and not self.reasons[name]

    def __str__(self):
        lines = [f"effattn.{self.op}: backend='auto' picks {self.chosen_path or 'nothing (no backend can serve)'}"]
        width = max([len(r.path) for r in self.rows] + [7])
        for r in self.rows:
            state = "can serve" if not r.reasons else "cannot serve: " + "; ".join(r.reasons)
            extra = [x for x in r.notes + [r.detail] if x]
            note = "".join(f" ({x})" for x in extra)
            lines.append(f"  [{r.rank:>3}] {r.path:{width}s} {state}{note}")
        for name, why in self.reasons.items():
            if not any(r.backend == name for r in self.rows):
                lines.append(f"  {'':5s} {name:{width}s} {'; '.join(why)}")
        return "\n".join(lines)

    __repr__ = __str__


def explain_call(op: str, call) -> Explanation:
    """The `Explanation` of a call already built: every row of ``op`` with its reasons."""
    found, chosen = [], None
    for p in base.rows(op, call):
        why = p.reasons(call)
        notes = list(p.notes(call)) if not why else []
        if not why and call.q.device.type in p.explicit_only_devices:
            notes.insert(0, f"on {call.q.device.type} only when asked for by name")
        elif not why and chosen is None:
            chosen = p.name
        found.append(Row(p.name, p.backend, p.rank(call), why, notes, p.describe(call) if not why else None))
    missing = {name: [base.missing_reason(op, name)] for name in base.BACKENDS if name not in base._REGISTRY[op]}
    groups = {b.name: [p.name for p in b.ordered(call)] for b in base.backends_for(op)}
    return Explanation(op, found, chosen, missing, groups)
