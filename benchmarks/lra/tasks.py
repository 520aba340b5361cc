"""The six LRA tasks as token sequences: where each comes from, its sizes, and its cache.

``load_task(name, data_dir=None, ...)`` returns a `TaskData`. With ``data_dir`` the task's official
file layout is read there and a missing file is an error naming the layout. Without it:

- ListOps is generated with LRA's algorithm ("generated": statistically LRA's task);
- Pathfinder and Path-X are regenerated with the ``snakes2`` algorithm ("pathfinder*", "pathx*":
  not yet validated against the original generator's statistics);
- Text, Retrieval and Image are stand-ins ("text*", "retrieval*", "image*"): the task's format and
  length, not LRA's data.

Token ids: 0 is padding, 1 the CLS token; bytes and pixels are ``value + 2``.
"""
from __future__ import annotations

import os
import sys
import time
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Dict, List, Optional

import numpy as np

from . import images, listops, pathfinder, text
from .cache import default_cache_dir, fingerprint, load_arrays, pack, save_arrays, unpack

TASKS = ("listops", "text", "retrieval", "image", "pathfinder", "pathx")
PAD, CLS = 0, 1

LAYOUTS = {
    "listops": "listops-1000/basic_{train,val,test}.tsv (LRA's release; 'Source\\tTarget' header)",
    "text": "aclImdb/{train,test}/{pos,neg}/*.txt (IMDb) or imdb/{train,dev,test}.tsv ('label\\ttext')",
    "retrieval": "tsv_data/new_aan_pairs.{train,eval,test}.tsv (LRA's release; label, id1, id2, text1, text2)",
    "image": "cifar-10-batches-py/{data_batch_1..5,test_batch} (CIFAR-10, python version), or Fashion-MNIST's "
             "{train,t10k}-{images-idx3,labels-idx1}-ubyte[.gz]",
    "pathfinder": "pathfinder32/curv_contour_length_14/metadata/*.npy and the imgs/ they name (LRA's release)",
    "pathx": "pathfinder128/curv_contour_length_14/metadata/*.npy and the imgs/ they name (LRA's release)",
}
#: sizes (train, dev, test) and lengths of generated sets: "full" is LRA's, "short" fits a CPU
PRESETS = {
    "listops": {"full": listops.FULL, "short": listops.SHORT},
    "pathfinder": {"full": dict(sizes=(160000, 20000, 20000)), "short": dict(sizes=(8000, 1000, 1000))},
    "pathx": {"full": dict(sizes=(160000, 20000, 20000), **pathfinder.PATHX),
              "short": dict(sizes=(2000, 250, 250), **pathfinder.PATHX)},
    "text": {"full": dict(sizes=(22500, 2500, 25000), min_bytes=1000, max_bytes=4000),
             "short": dict(sizes=(8000, 1000, 1000), min_bytes=200, max_bytes=512)},
    "retrieval": {"full": dict(sizes=(40000, 4000, 4000), min_bytes=1000, max_bytes=4000),
                  "short": dict(sizes=(8000, 1000, 1000), min_bytes=200, max_bytes=512)},
    "image": {"full": dict(sizes=(45000, 5000, 10000)), "short": dict(sizes=(9000, 1000, 2000))},
}
#: the generator parameters ``--set`` may change, per task
GENERATOR_PARAMS = {
    "listops": ("sizes", "min_length", "max_length", "max_depth", "max_args"),
    "pathfinder": ("sizes",) + tuple(f.name for f in fields(pathfinder.Params)),
    "pathx": ("sizes",) + tuple(f.name for f in fields(pathfinder.Params)),
    "text": ("sizes", "min_bytes", "max_bytes"),
    "retrieval": ("sizes", "min_bytes", "max_bytes"),
    "image": ("sizes",),
}
MAX_LENGTH = {"listops": 2000, "text": 4000, "retrieval": 4000, "image": 1024, "pathfinder": 1024, "pathx": 16384}
NUM_CLASSES = {"listops": 10, "text": 2, "retrieval": 2, "image": 10, "pathfinder": 2, "pathx": 2}
VOCAB = {"listops": len(listops.VOCAB), "text": 258, "retrieval": 258, "image": 258, "pathfinder": 258, "pathx": 258}
#: what the data is when no --data-dir is given
DEFAULT_KIND = {"listops": "generated", "text": "stand-in", "retrieval": "stand-in", "image": "stand-in",
                "pathfinder": "regenerated", "pathx": "regenerated"}
GENERATOR_VERSION = 3


def check_overrides(task: str, overrides: Optional[Dict]) -> None:
    """A ValueError naming a ``--set`` key the task's generator does not have."""
    for key in overrides or {}:
        if key not in GENERATOR_PARAMS[task]:
            raise ValueError(f"--set {key}: not a parameter of the {task} generator "
                             f"(one of {', '.join(GENERATOR_PARAMS[task])})")
    sizes = (overrides or {}).get("sizes")
    if sizes is not None and (not isinstance(sizes, (list, tuple)) or len(sizes) != 3
                              or not all(isinstance(n, int) and n >= 0 for n in sizes)):
        raise ValueError(f"--set sizes: expected [train, dev, test] counts, got {sizes!r}")


@dataclass
class Split:
    x: List[np.ndarray]                   # token ids per example (no CLS, no padding)
    y: np.ndarray                         # labels (N,)
    x2: Optional[List[np.ndarray]] = None  # the second document (Retrieval)

    def __len__(self):
        return len(self.y)


@dataclass
class TaskData:
    name: str
    train: Split
    dev: Split
    test: Split
    vocab_size: int
    num_classes: int
    kind: str               # "real", "generated", "regenerated" or "stand-in"
    source: str             # where the data came from, for reports
    note: str = ""          # how a generated set differs from the full-size one, e.g. "16-128 tokens"

    @property
    def standin(self) -> bool:
        """Marked "*" in tables: not LRA's data (a stand-in) or a regeneration not yet validated."""
        return self.kind in ("stand-in", "regenerated")

    @property
    def label(self) -> str:
        """The name in tables: ``*`` for a stand-in, the note in parentheses for a reduced set."""
        return self.name + ("*" if self.standin else "") + (f" ({self.note})" if self.note else "")

    @property
    def pair(self) -> bool:
        return self.train.x2 is not None


class MissingData(FileNotFoundError):
    pass


def _need(data_dir: str, task: str, exists: bool) -> None:
    if not exists:
        raise MissingData(f"{task}: no data found under --data-dir {data_dir}; expected {LAYOUTS[task]}")


def _pixels(arrays) -> Dict[str, Split]:
    return {s: Split([row for row in (img.reshape(len(img), -1).astype(np.int16) + 2)], lab.astype(np.int64))
            for s, (img, lab) in arrays.items()}


def cache_path(kind: str, params: Dict, cache_dir: Optional[Path]) -> Path:
    return Path(cache_dir or default_cache_dir()) / f"{kind}-{fingerprint(kind, GENERATOR_VERSION, params)}.npz"


def _cached(kind: str, params: Dict, cache_dir: Optional[Path], make, wait: bool = False,
            poll_s: float = 2.0) -> Dict[str, Split]:
    """Generated splits from the cache, or made by ``make()`` and stored under their fingerprint.
    ``wait``: another process is making them; wait for its file however long that takes (a
    note every 5 minutes), never make them here."""
    path = cache_path(kind, params, cache_dir)
    t0 = last = time.monotonic()
    while wait and not path.exists():
        time.sleep(poll_s)
        if time.monotonic() - last > 300:
            last = time.monotonic()
            print(f"waiting for {path} (being generated by rank 0, {(last - t0) / 60:.0f} min so far)",
                  file=sys.stderr, flush=True)
    if path.exists():
        z = load_arrays(path)
        return {s: Split(unpack(z[f"{s}_flat"], z[f"{s}_off"]), z[f"{s}_y"],
                         unpack(z[f"{s}_flat2"], z[f"{s}_off2"]) if f"{s}_flat2" in z else None)
                for s in ("train", "dev", "test")}
    splits = make()
    arrays = {}
    for s, sp in splits.items():
        p = pack(sp.x)
        arrays.update({f"{s}_flat": p["flat"], f"{s}_off": p["offsets"], f"{s}_y": sp.y})
        if sp.x2 is not None:
            p2 = pack(sp.x2)
            arrays.update({f"{s}_flat2": p2["flat"], f"{s}_off2": p2["offsets"]})
    save_arrays(path, arrays)
    return splits


def _token_splits(rows: Dict[str, list], encode) -> Dict[str, Split]:
    """``{split: [(input, [input2,] label)]}`` -> Splits, each input through ``encode``."""
    return {s: Split([encode(r[0]) for r in v], np.array([r[-1] for r in v], np.int64),
                     [encode(r[1]) for r in v] if v and len(v[0]) == 3 else None) for s, v in rows.items()}


def _official(name: str, data_dir: str, max_length: int):
    """(splits, source) read from the official files under ``data_dir``."""
    if name == "listops":
        paths = [os.path.join(data_dir, "listops-1000", f"basic_{s}.tsv") for s in ("train", "val", "test")]
        _need(data_dir, name, all(map(os.path.exists, paths)))
        rows = dict(zip(("train", "dev", "test"), map(listops.read_tsv, paths)))
        return _token_splits(rows, listops.tokenize), os.path.join(data_dir, "listops-1000")
    if name in ("pathfinder", "pathx"):
        folder = "pathfinder32" if name == "pathfinder" else "pathfinder128"
        _need(data_dir, name, os.path.isdir(os.path.join(data_dir, folder, "curv_contour_length_14", "metadata")))
        return _pixels(images.read_pathfinder(data_dir, folder=folder)), os.path.join(data_dir, folder)
    if name == "image":
        if os.path.isdir(os.path.join(data_dir, "cifar-10-batches-py")):
            return _pixels(images.read_cifar10(data_dir)), os.path.join(data_dir, "cifar-10-batches-py")
        try:
            folder = images.fashion_dir(data_dir)
        except FileNotFoundError:
            _need(data_dir, name, False)
        return _pixels(images.read_fashion_mnist(folder)), f"Fashion-MNIST ({folder})"
    encode = lambda t: text.encode(t, max_length)    # noqa: E731
    if name == "text":
        _need(data_dir, name, os.path.isdir(os.path.join(data_dir, "aclImdb"))
              or os.path.exists(os.path.join(data_dir, "imdb", "train.tsv")))
        return _token_splits(text.read_imdb(data_dir), encode), data_dir
    _need(data_dir, name, os.path.exists(os.path.join(data_dir, "tsv_data", "new_aan_pairs.train.tsv")))
    return _token_splits(text.read_aan(data_dir), encode), data_dir


def _generated(name: str, params: Dict, seed: int, workers: int, max_length: int, progress: bool):
    """(make, fingerprint params, source) of a generated set."""
    params = dict(params)
    sizes = params.pop("sizes")
    gen = dict(params, seed=seed, sizes=list(sizes))
    desc = f"{name} ({sum(sizes)} examples)" if progress else None
    if name == "listops":
        def make():
            return _token_splits(listops.generate(workers=workers, progress=desc, **gen), listops.tokenize)
        return make, gen, f"generated (LRA's algorithm), {gen}"
    if name in ("pathfinder", "pathx"):
        def make():
            return {s: _pixels({s: pathfinder.generate(seed=seed * 3 + i, n=n, workers=workers, progress=desc and
                                                       f"{desc}, {s}", **params)})[s]
                    for i, (s, n) in enumerate(zip(("train", "dev", "test"), sizes))}
        return make, gen, f"regenerated (snakes2 algorithm, not validated against the original), {gen}"
    if name == "image":
        def make():
            return _pixels({s: images.shapes_split(seed * 3 + i, n) for i, (s, n) in
                            enumerate(zip(("train", "dev", "test"), sizes))})
        return make, gen, f"stand-in (procedural grey shapes, 10 classes), {gen}"
    gen["max_length"] = max_length
    encode = lambda t: text.encode(t, max_length)    # noqa: E731

    def make():
        return _token_splits({s: text.standin_split(name, seed * 3 + i, n, params["min_bytes"],
                                                    min(params["max_bytes"], max_length), workers)
                              for i, (s, n) in enumerate(zip(("train", "dev", "test"), sizes))}, encode)
    return make, gen, f"stand-in, {gen}"


def load_task(name: str, data_dir: Optional[str] = None, *, preset: str = "full", seed: int = 0,
              cache_dir: Optional[Path] = None, workers: int = 1, max_length: Optional[int] = None,
              overrides: Optional[Dict] = None, wait: bool = False, progress: bool = False) -> TaskData:
    """The task's train / dev / test splits (see the module docstring). ``preset`` ("full" or
    "short") and ``overrides`` size the generated sets; ``max_length`` truncates byte documents.
    ``wait``: another process generates a missing set; wait for its cache file. ``progress``: report
    a long generation's progress on stderr."""
    if name not in TASKS:
        raise ValueError(f"load_task: task must be one of {', '.join(TASKS)}, got {name!r}")
    max_length = max_length or MAX_LENGTH[name]
    if data_dir is not None:
        if not os.path.isdir(data_dir):
            raise MissingData(f"--data-dir {data_dir} is not a directory")
        splits, source = _official(name, data_dir, max_length)
        kind = "stand-in" if name == "image" and source.startswith("Fashion") else "real"
        return TaskData(name, splits["train"], splits["dev"], splits["test"], VOCAB[name], NUM_CLASSES[name], kind,
                        source)
    check_overrides(name, overrides)
    params = dict(PRESETS[name][preset], **(overrides or {}))
    make, gen, source = _generated(name, params, seed, workers, max_length, progress)
    splits = _cached(name, gen, cache_dir, make, wait=wait)
    note = ""
    if preset != "full" or overrides:
        full = PRESETS[name]["full"]
        if name == "listops" and (params["min_length"], params["max_length"]) != (full["min_length"],
                                                                                 full["max_length"]):
            note = f"{params['min_length']}-{params['max_length']} tokens"
        else:
            note = "small set"
    return TaskData(name, splits["train"], splits["dev"], splits["test"], VOCAB[name], NUM_CLASSES[name],
                    DEFAULT_KIND[name], source, note)
