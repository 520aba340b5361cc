"""Image and Pathfinder files: CIFAR-10 (LRA's Image), Fashion-MNIST ("Image*"), Pathfinder's
released layout. Every reader returns ``{split: (images (N, 32, 32) uint8, labels (N,) int64)}``.

- CIFAR-10: ``cifar-10-batches-py/data_batch_{1..5}`` and ``test_batch`` (the Python pickles);
  gray as LRA makes it (``tf.image.rgb_to_grayscale``: 0.2989 R + 0.5870 G + 0.1140 B); dev is
  the last 10% of the training batches, as LRA's ``train[90%:]``.
- Fashion-MNIST: ``{train,t10k}-{images-idx3,labels-idx1}-ubyte[.gz]`` in ``--data-dir`` or
  where Debian's ``dataset-fashion-mnist`` installs them (``/usr/share/datasets/fashion-mnist``);
  28x28 padded with 2 black pixels a side to 32x32; dev is the last 10% of train.
- Pathfinder: ``pathfinder32/curv_contour_length_14/metadata/*.npy`` (text lines
  ``<folder> <file> <index> <label> ...``, despite the suffix) and the PNGs they name; the files are
  read in sorted order and split 80/10/10 as LRA's loader does.
"""
from __future__ import annotations

import glob
import gzip
import os
import pickle
from typing import Dict, Tuple

import numpy as np

GRAY = np.array([0.2989, 0.5870, 0.1140])
FASHION_SYSTEM_DIR = "/usr/share/datasets/fashion-mnist"
Arrays = Dict[str, Tuple[np.ndarray, np.ndarray]]


def _dev_cut(images, labels, frac=0.1):
    cut = len(labels) - int(len(labels) * frac)
    return (images[:cut], labels[:cut]), (images[cut:], labels[cut:])


def read_cifar10(root: str) -> Arrays:
    base = os.path.join(root, "cifar-10-batches-py")

    def batch(name):
        with open(os.path.join(base, name), "rb") as f:
            d = pickle.load(f, encoding="bytes")
        rgb = np.asarray(d[b"data"], dtype=np.float64).reshape(-1, 3, 32, 32).transpose(0, 2, 3, 1)
        gray = np.clip(np.round(rgb @ GRAY), 0, 255).astype(np.uint8)
        return gray, np.asarray(d[b"labels"], dtype=np.int64)

    parts = [batch(f"data_batch_{i}") for i in range(1, 6)]
    train = (np.concatenate([p[0] for p in parts]), np.concatenate([p[1] for p in parts]))
    tr, dev = _dev_cut(*train)
    return {"train": tr, "dev": dev, "test": batch("test_batch")}


def _idx(path_stem: str) -> np.ndarray:
    for path, opener in ((path_stem, open), (path_stem + ".gz", gzip.open)):
        if os.path.exists(path):
            with opener(path, "rb") as f:
                data = f.read()
            ndim = data[3]
            shape = tuple(int.from_bytes(data[4 + 4 * i:8 + 4 * i], "big") for i in range(ndim))
            return np.frombuffer(data, dtype=np.uint8, offset=4 + 4 * ndim).reshape(shape)
    raise FileNotFoundError(path_stem)


def fashion_dir(data_dir) -> str:
    """The folder holding Fashion-MNIST's idx files: ``data_dir`` (or its ``fashion-mnist/``) when it
    has them, else the Debian package's folder; raises FileNotFoundError naming both."""
    candidates = [d for d in (data_dir, data_dir and os.path.join(data_dir, "fashion-mnist")) if d]
    for d in candidates + [FASHION_SYSTEM_DIR]:
        if glob.glob(os.path.join(d, "train-images-idx3-ubyte*")):
            return d
    raise FileNotFoundError("Fashion-MNIST not found: expected train-images-idx3-ubyte[.gz], "
                            "train-labels-idx1-ubyte[.gz], t10k-images-idx3-ubyte[.gz], t10k-labels-idx1-ubyte[.gz] "
                            f"in {' or '.join(candidates + [FASHION_SYSTEM_DIR])} "
                            "(Debian/Ubuntu: apt-get install dataset-fashion-mnist)")


def read_fashion_mnist(folder: str) -> Arrays:
    def load(prefix):
        x = _idx(os.path.join(folder, f"{prefix}-images-idx3-ubyte"))
        y = _idx(os.path.join(folder, f"{prefix}-labels-idx1-ubyte")).astype(np.int64)
        return np.pad(x, ((0, 0), (2, 2), (2, 2))), y

    tr, dev = _dev_cut(*load("train"))
    return {"train": tr, "dev": dev, "test": load("t10k")}


def read_pathfinder(root: str, difficulty: str = "curv_contour_length_14") -> Arrays:
    from PIL import Image
    base = os.path.join(root, "pathfinder32", difficulty)
    files = sorted(glob.glob(os.path.join(base, "metadata", "*.npy")),
                   key=lambda p: (len(os.path.basename(p)), os.path.basename(p)))
    if not files:
        raise FileNotFoundError(os.path.join(base, "metadata", "*.npy"))
    rows = []
    for path in files:
        with open(path) as f:
            for line in f:
                parts = line.split()
                if len(parts) >= 4:
                    rows.append((os.path.join(base, parts[0], parts[1]), int(parts[3])))
    images = np.stack([np.asarray(Image.open(p).convert("L"), dtype=np.uint8) for p, _ in rows])
    labels = np.array([y for _, y in rows], dtype=np.int64)
    n = len(rows)
    a, b = n * 8 // 10, n * 9 // 10
    return {"train": (images[:a], labels[:a]), "dev": (images[a:b], labels[a:b]), "test": (images[b:], labels[b:])}
