"""The five LRA tasks as token sequences: where each comes from, its sizes, and its cache.

``load_task(name, data_dir=None, ...)`` returns a `TaskData`. With ``data_dir`` the task's official
file layout is read there and a missing file is an error naming the layout; without it ListOps and
Pathfinder are generated (LRA's algorithms, so they are the real task, not a stand-in), Text and
Retrieval are the stand-ins "Text*" / "Retrieval*", and Image is Fashion-MNIST ("Image*").
Token ids: 0 is padding, 1 the CLS token; bytes and pixels are ``value + 2``.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, List, Optional

import numpy as np

from . import images, listops, pathfinder, text
from .cache import default_cache_dir, fingerprint, load_arrays, pack, save_arrays, unpack

TASKS = ("listops", "text", "retrieval", "image", "pathfinder")
PAD, CLS = 0, 1

LAYOUTS = {
    "listops": "listops-1000/basic_{train,val,test}.tsv (LRA's release; 'Source\\tTarget' header)",
    "text": "aclImdb/{train,test}/{pos,neg}/*.txt (IMDb) or imdb/{train,dev,test}.tsv ('label\\ttext')",
    "retrieval": "tsv_data/new_aan_pairs.{train,eval,test}.tsv (LRA's release; label, id1, id2, text1, text2)",
    "image": "cifar-10-batches-py/{data_batch_1..5,test_batch} (CIFAR-10, python version)",
    "pathfinder": "pathfinder32/curv_contour_length_14/metadata/*.npy and the imgs/ they name (LRA's release)",
}
#: sizes (train, dev, test) and lengths of generated sets: "full" is LRA's, "short" fits a CPU
PRESETS = {
    "listops": {"full": listops.FULL, "short": listops.SHORT},
    "pathfinder": {"full": dict(sizes=(160000, 20000, 20000)), "short": dict(sizes=(8000, 1000, 1000))},
    "text": {"full": dict(sizes=(22500, 2500, 25000), min_bytes=1000, max_bytes=4000),
             "short": dict(sizes=(8000, 1000, 1000), min_bytes=200, max_bytes=512)},
    "retrieval": {"full": dict(sizes=(40000, 4000, 4000), min_bytes=1000, max_bytes=4000),
                  "short": dict(sizes=(8000, 1000, 1000), min_bytes=200, max_bytes=512)},
}
MAX_LENGTH = {"listops": 2000, "text": 4000, "retrieval": 4000, "image": 1024, "pathfinder": 1024}
NUM_CLASSES = {"listops": 10, "text": 2, "retrieval": 2, "image": 10, "pathfinder": 2}
VOCAB = {"listops": len(listops.VOCAB), "text": 258, "retrieval": 258, "image": 258, "pathfinder": 258}
GENERATOR_VERSION = 2


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
    standin: bool           # True: "Text*", "Retrieval*", "Image*" (not LRA's data)
    source: str             # where the data came from, for reports
    note: str = ""          # how a generated set differs from the full-size one, e.g. "16-128 tokens"

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


def _cached(kind: str, params: Dict, cache_dir: Optional[Path], make) -> Dict[str, Split]:
    """Generated splits from the cache, or made by ``make()`` and stored under their fingerprint."""
    path = Path(cache_dir or default_cache_dir()) / f"{kind}-{fingerprint(kind, GENERATOR_VERSION, params)}.npz"
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


def load_task(name: str, data_dir: Optional[str] = None, *, preset: str = "full", seed: int = 0,
              cache_dir: Optional[Path] = None, workers: int = 1, max_length: Optional[int] = None,
              overrides: Optional[Dict] = None) -> TaskData:
    """The task's train / dev / test splits (see the module docstring). ``preset`` ("full" or
    "short") and ``overrides`` size the generated sets; ``max_length`` truncates byte documents."""
    if name not in TASKS:
        raise ValueError(f"load_task: task must be one of {', '.join(TASKS)}, got {name!r}")
    max_length = max_length or MAX_LENGTH[name]
    params = dict(PRESETS.get(name, {}).get(preset, {}), **(overrides or {}))
    if data_dir is not None and not os.path.isdir(data_dir):
        raise MissingData(f"--data-dir {data_dir} is not a directory")
    standin, source = False, ""
    if name == "listops":
        if data_dir is not None:
            paths = [os.path.join(data_dir, "listops-1000", f"basic_{s}.tsv") for s in ("train", "val", "test")]
            _need(data_dir, name, all(map(os.path.exists, paths)))
            rows = dict(zip(("train", "dev", "test"), map(listops.read_tsv, paths)))
            source = os.path.join(data_dir, "listops-1000")
        else:
            gen = dict(params, seed=seed)
            rows = None
            source = f"generated (LRA algorithm), {gen}"
        if rows is None:
            def make():
                r = listops.generate(workers=workers, **gen)
                return {s: Split([listops.tokenize(src) for src, _ in v], np.array([y for _, y in v], np.int64))
                        for s, v in r.items()}
            splits = _cached("listops", gen, cache_dir, make)
        else:
            splits = {s: Split([listops.tokenize(src) for src, _ in v], np.array([y for _, y in v], np.int64))
                      for s, v in rows.items()}
    elif name == "pathfinder":
        if data_dir is not None:
            _need(data_dir, name, bool(os.path.isdir(os.path.join(data_dir, "pathfinder32", "curv_contour_length_14",
                                                                  "metadata"))))
            splits = _pixels(images.read_pathfinder(data_dir))
            source = os.path.join(data_dir, "pathfinder32")
        else:
            sizes = params.pop("sizes")
            gen = dict(params, seed=seed, sizes=sizes)

            def make():
                out = {}
                for i, (s, n) in enumerate(zip(("train", "dev", "test"), sizes)):
                    imgs, labs = pathfinder.generate(seed=seed * 3 + i, n=n, workers=workers, **params)
                    out.update(_pixels({s: (imgs, labs)}))
                return out
            splits = _cached("pathfinder", gen, cache_dir, make)
            source = f"generated (snakes2 algorithm, 2-px gaps), {gen}"
    elif name == "image":
        if data_dir is not None and os.path.isdir(os.path.join(data_dir, "cifar-10-batches-py")):
            splits, source = _pixels(images.read_cifar10(data_dir)), os.path.join(data_dir, "cifar-10-batches-py")
        else:
            try:
                folder = images.fashion_dir(data_dir)
            except FileNotFoundError as e:
                raise MissingData(f"image: expected {LAYOUTS['image']} under --data-dir, or Fashion-MNIST for "
                                  f"Image*: {e}") from None
            splits, standin, source = _pixels(images.read_fashion_mnist(folder)), True, f"Fashion-MNIST ({folder})"
    else:   # text, retrieval
        if data_dir is not None:
            if name == "text":
                _need(data_dir, name, os.path.isdir(os.path.join(data_dir, "aclImdb"))
                      or os.path.exists(os.path.join(data_dir, "imdb", "train.tsv")))
                rows = text.read_imdb(data_dir)
                splits = {s: Split([text.encode(t, max_length) for t, _ in v], np.array([y for _, y in v], np.int64))
                          for s, v in rows.items()}
            else:
                _need(data_dir, name, os.path.exists(os.path.join(data_dir, "tsv_data", "new_aan_pairs.train.tsv")))
                rows = text.read_aan(data_dir)
                splits = {s: Split([text.encode(a, max_length) for a, _, _ in v],
                                   np.array([y for _, _, y in v], np.int64),
                                   [text.encode(b, max_length) for _, b, _ in v]) for s, v in rows.items()}
            source = data_dir
        else:
            sizes = params.pop("sizes")
            gen = dict(params, seed=seed, sizes=sizes, max_length=max_length)

            def make():
                out = {}
                for i, (s, n) in enumerate(zip(("train", "dev", "test"), sizes)):
                    rows = text.standin_split(name, seed * 3 + i, n, params["min_bytes"],
                                              min(params["max_bytes"], max_length), workers)
                    out[s] = Split([text.encode(r[0], max_length) for r in rows], np.array([r[-1] for r in rows]),
                                   [text.encode(r[1], max_length) for r in rows] if name == "retrieval" else None)
                return out
            splits, standin = _cached(name, gen, cache_dir, make), True
            source = f"stand-in, {gen}"
    note = ""
    if data_dir is None and name != "image" and (preset != "full" or overrides):
        full = PRESETS[name]["full"]
        lengths = (params.get("min_length"), params.get("max_length"))
        if name == "listops" and lengths != (full["min_length"], full["max_length"]):
            note = f"{params['min_length']}-{params['max_length']} tokens"
        else:
            note = "small set"
    return TaskData(name, splits["train"], splits["dev"], splits["test"], VOCAB[name], NUM_CLASSES[name],
                    standin, source, note)

