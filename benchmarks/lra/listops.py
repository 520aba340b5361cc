"""ListOps (Nangia & Bowman 2018, as generated for the Long Range Arena): random operator trees.

The algorithm follows LRA's published generator: a node below ``max_depth`` becomes an operator
with probability 0.25 (else a leaf digit 0-9); an operator, one of MIN, MAX, MED (the integer part
of the median) and SM (sum mod 10), takes 2..``max_args`` arguments, each a fresh node one level
deeper. The root is drawn at depth 1. A tree is kept when ``min_length < tokens < max_length``
(LRA: 500 < n < 2000, about 8% of the trees drawn) and its string was not seen before; the kept
trees are then cut into train / dev / test in order, so no string appears in two splits.

Token strings are LRA's without parentheses: ``[MAX 2 9 [MIN 4 7 ] 0 ]`` (the closing ``]`` is a
token: dropping it makes nested expressions ambiguous).

The work is split into fixed chunks, each drawn from its own seeded ``random.Random`` and joined in
chunk order, so a set depends on the seed and parameters only, never on the number of processes.
"""
from __future__ import annotations

import random
import statistics
from typing import Dict, List, Optional, Sequence, Tuple

import numpy as np

OPERATORS = ("[MIN", "[MAX", "[MED", "[SM")
CLOSE = "]"
VOCAB = ("<pad>", "<cls>", *OPERATORS, CLOSE, *(str(d) for d in range(10)))
TOKEN_ID = {t: i for i, t in enumerate(VOCAB)}
OPERATOR_P = 0.25
CHUNK = 2000            # trees drawn per chunk (the unit of parallel work and of determinism)

#: LRA's full-size set, and the short one the CPU demo trains on
FULL = dict(min_length=500, max_length=2000, max_depth=10, max_args=10, sizes=(96000, 2000, 2000))
SHORT = dict(min_length=16, max_length=128, max_depth=10, max_args=10, sizes=(20000, 2000, 2000))


def apply(op: str, args: Sequence[int]) -> int:
    if op == "[MIN":
        return min(args)
    if op == "[MAX":
        return max(args)
    if op == "[MED":
        return int(statistics.median(args))
    if op == "[SM":
        return sum(args) % 10
    raise ValueError(f"listops: unknown operator {op!r}")


def draw_tree(rng: random.Random, max_length: int, max_depth: int = 10,
              max_args: int = 10) -> Optional[Tuple[List[str], int]]:
    """One tree as (tokens, value), or None once it grows to ``max_length`` tokens (drawing stops
    there: such a tree would be rejected anyway, and the deep ones are the expensive ones)."""
    tokens: List[str] = []

    def node(depth: int) -> int:
        if len(tokens) >= max_length:
            raise _TooLong
        if depth >= max_depth or rng.random() > OPERATOR_P:
            d = rng.randrange(10)
            tokens.append(str(d))
            return d
        n_args = rng.randint(2, max_args)
        op = rng.choice(OPERATORS)
        tokens.append(op)
        values = [node(depth + 1) for _ in range(n_args)]
        tokens.append(CLOSE)
        return apply(op, values)

    try:
        value = node(1)
    except _TooLong:
        return None
    return tokens, value


class _TooLong(Exception):
    pass


def draw_chunk(job: Tuple[int, int, Dict]) -> List[Tuple[str, int]]:
    """Chunk ``index`` of a set: the kept ``(source, label)`` pairs of ``CHUNK`` draws."""
    seed, index, p = job
    rng = random.Random(f"listops:{seed}:{index}")
    kept = []
    for _ in range(CHUNK):
        tree = draw_tree(rng, p["max_length"], p["max_depth"], p["max_args"])
        if tree is not None and p["min_length"] < len(tree[0]) < p["max_length"]:
            kept.append((" ".join(tree[0]), tree[1]))
    return kept


def generate(seed: int = 0, sizes=(96000, 2000, 2000), min_length: int = 500, max_length: int = 2000,
             max_depth: int = 10, max_args: int = 10, workers: int = 1,
             progress: Optional[str] = None) -> Dict[str, List[Tuple[str, int]]]:
    """Train / dev / test lists of ``(source, label)``; see the module docstring."""
    from .cache import parallel_map
    p = dict(min_length=min_length, max_length=max_length, max_depth=max_depth, max_args=max_args)
    need = sum(sizes)
    seen, rows, index = set(), [], 0
    while len(rows) < need:
        # a batch of chunks at a time; more than needed on average, the surplus is dropped
        jobs = [(seed, index + i, p) for i in range(max(workers, 1) * 4)]
        index += len(jobs)
        for chunk in parallel_map(draw_chunk, jobs, workers, progress):
            for src, label in chunk:
                if src not in seen and len(rows) < need:
                    seen.add(src)
                    rows.append((src, label))
    a, b = sizes[0], sizes[0] + sizes[1]
    return {"train": rows[:a], "dev": rows[a:b], "test": rows[b:need]}


def tokenize(source: str) -> np.ndarray:
    """LRA's source string (with or without parentheses) -> token ids (no CLS, no padding)."""
    parts = source.replace("(", " ").replace(")", " ").split()
    try:
        return np.array([TOKEN_ID[t] for t in parts], dtype=np.int16)
    except KeyError as e:
        raise ValueError(f"listops: unknown token {e.args[0]!r} in {source[:80]!r}") from None


def read_tsv(path) -> List[Tuple[str, int]]:
    """LRA's ``basic_{train,val,test}.tsv``: a ``Source\\tTarget`` header, then one tree per line."""
    rows = []
    with open(path) as f:
        header = f.readline().rstrip("\n").split("\t")
        if header[:2] != ["Source", "Target"]:
            raise ValueError(f"listops: {path} does not start with the header 'Source\\tTarget'")
        for line in f:
            if line.strip():
                src, target = line.rstrip("\n").split("\t")[:2]
                rows.append((src, int(target)))
    return rows


def write_tsv(path, rows: Sequence[Tuple[str, int]]) -> None:
    with open(path, "w") as f:
        f.write("Source\tTarget\n")
        for src, label in rows:
            f.write(f"{src}\t{label}\n")
