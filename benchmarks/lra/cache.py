"""Generated data on disk: fingerprinted cache files, atomic writes, and a process pool.

A generated set is stored as ``<cache>/<name>-<fingerprint>.npz``; the fingerprint hashes the
generator's name, its version and every parameter, so changing any of them makes a new file and a
stale file is never read. Files are written to a temporary name and renamed into place, so an
interrupted run leaves no half-written set (and two processes racing write the same bytes).
"""
from __future__ import annotations

import hashlib
import json
import multiprocessing
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Callable, Dict, List, Optional

import numpy as np


def default_cache_dir() -> Path:
    return Path(os.environ.get("EFFATTN_LRA_CACHE", Path.home() / ".cache" / "effattn-lra"))


def fingerprint(name: str, version: int, params: Dict) -> str:
    blob = json.dumps({"name": name, "version": version, "params": params}, sort_keys=True, default=str)
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


def atomic_write(path: Path, write: Callable[[str], None]) -> None:
    """``write(tmp_path)`` then rename onto ``path`` (same directory, so the rename is atomic)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    os.close(fd)
    try:
        write(tmp)
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def save_arrays(path: Path, arrays: Dict[str, np.ndarray]) -> None:
    def write(tmp):
        with open(tmp, "wb") as f:
            np.savez(f, **arrays)
    atomic_write(path, write)


def load_arrays(path: Path) -> Dict[str, np.ndarray]:
    with np.load(path, allow_pickle=False) as z:
        return {k: z[k] for k in z.files}


def parallel_map(fn: Callable, jobs: List, workers: int, progress: Optional[str] = None) -> List:
    """``[fn(j) for j in jobs]`` in order, on ``workers`` processes when more than one is asked for.
    ``progress``: a name; a line on stderr every 30 s says how many jobs are done."""
    t0 = last = time.monotonic()
    out = []

    def done(result):
        nonlocal last
        out.append(result)
        if progress and time.monotonic() - last > 30:
            last = time.monotonic()
            rate = len(out) / (last - t0)
            print(f"generating {progress}: {len(out)}/{len(jobs)} chunks, about "
                  f"{(len(jobs) - len(out)) / rate / 60:.1f} min left", file=sys.stderr, flush=True)

    if workers <= 1 or len(jobs) <= 1:
        for j in jobs:
            done(fn(j))
        return out
    ctx = multiprocessing.get_context("fork" if os.name == "posix" else "spawn")
    with ctx.Pool(min(workers, len(jobs))) as pool:
        for r in pool.imap(fn, jobs, chunksize=1):
            done(r)
    return out


def pack(seqs: List[np.ndarray]) -> Dict[str, np.ndarray]:
    """Ragged sequences as one flat array and offsets (npz holds no ragged arrays)."""
    lengths = np.array([len(s) for s in seqs], dtype=np.int64)
    flat = np.concatenate(seqs) if seqs else np.zeros(0, dtype=np.int16)
    return {"flat": flat, "offsets": np.concatenate([[0], np.cumsum(lengths)])}


def unpack(flat: np.ndarray, offsets: np.ndarray) -> List[np.ndarray]:
    return [flat[offsets[i]:offsets[i + 1]] for i in range(len(offsets) - 1)]
