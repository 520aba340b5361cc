"""Image and Pathfinder files: CIFAR-10 (LRA's Image), Fashion-MNIST (an "Image*" read from
``--data-dir``), Pathfinder's and Path-X's released layouts, and the procedural Image* stand-in used
when no files are given. Every reader returns ``{split: (images (N, S, S) uint8, labels (N,) int64)}``.

- CIFAR-10: ``cifar-10-batches-py/data_batch_{1..5}`` and ``test_batch`` (the Python pickles);
  gray as LRA makes it (``tf.image.rgb_to_grayscale``: 0.2989 R + 0.5870 G + 0.1140 B); dev is
  the last 10% of the training batches, as LRA's ``train[90%:]``.
- Fashion-MNIST: ``{train,t10k}-{images-idx3,labels-idx1}-ubyte[.gz]`` in ``--data-dir`` (or its
  ``fashion-mnist/``); 28x28 padded with 2 black pixels a side to 32x32; dev is the last 10% of train.
- Pathfinder / Path-X: ``pathfinder32`` / ``pathfinder128/curv_contour_length_14/metadata/*.npy`` (text lines
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
    """The folder holding Fashion-MNIST's idx files: ``data_dir`` or its ``fashion-mnist/``; raises
    FileNotFoundError naming both."""
    candidates = [data_dir, os.path.join(data_dir, "fashion-mnist")]
    for d in candidates:
        if glob.glob(os.path.join(d, "train-images-idx3-ubyte*")):
            return d
    raise FileNotFoundError("Fashion-MNIST not found: expected train-images-idx3-ubyte[.gz], "
                            "train-labels-idx1-ubyte[.gz], t10k-images-idx3-ubyte[.gz], t10k-labels-idx1-ubyte[.gz] "
                            f"in {' or '.join(candidates)}")


def read_fashion_mnist(folder: str) -> Arrays:
    def load(prefix):
        x = _idx(os.path.join(folder, f"{prefix}-images-idx3-ubyte"))
        y = _idx(os.path.join(folder, f"{prefix}-labels-idx1-ubyte")).astype(np.int64)
        return np.pad(x, ((0, 0), (2, 2), (2, 2))), y

    tr, dev = _dev_cut(*load("train"))
    return {"train": tr, "dev": dev, "test": load("t10k")}


def read_pathfinder(root: str, difficulty: str = "curv_contour_length_14", folder: str = "pathfinder32") -> Arrays:
    from PIL import Image
    base = os.path.join(root, folder, difficulty)
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


# ----------------------------------------------------------------------------- Image* stand-in

#: the ten shape classes of Image*, each a region of the shape's own frame (u, v in [-1, 1])
SHAPES = ("disc", "ring", "square", "square outline", "triangle", "plus", "cross", "two bars", "diamond", "arc")


def _shape_mask(cls: int, u: np.ndarray, v: np.ndarray) -> np.ndarray:
    r, m = np.hypot(u, v), np.maximum(np.abs(u), np.abs(v))
    if cls == 0:
        return r < 1
    if cls == 1:
        return (r < 1) & (r > 0.55)
    if cls == 2:
        return m < 0.85
    if cls == 3:
        return (m < 0.9) & (m > 0.55)
    if cls == 4:
        return (v < 0.7) & (v > 1.7 * np.abs(u) - 1.0)
    if cls == 5:
        return ((np.abs(u) < 0.3) | (np.abs(v) < 0.3)) & (m < 1)
    if cls == 6:
        return ((np.abs(u - v) < 0.42) | (np.abs(u + v) < 0.42)) & (r < 1.1)
    if cls == 7:
        return (np.abs(u) < 0.9) & (np.abs(np.abs(v) - 0.55) < 0.22)
    if cls == 8:
        return np.abs(u) + np.abs(v) < 1
    return (r < 1) & (r > 0.55) & (v < 0.1)


def _smooth_noise(rng: np.random.Generator, size: int, cells: int) -> np.ndarray:
    """Low-frequency noise: a random ``cells x cells`` grid, bilinearly upsampled to ``size``."""
    g = rng.normal(size=(cells + 1, cells + 1))
    t = np.linspace(0, cells, size)
    i = np.minimum(t.astype(int), cells - 1)
    f = t - i
    rows = g[i] * (1 - f)[:, None] + g[i + 1] * f[:, None]
    return rows[:, i] * (1 - f)[None, :] + rows[:, i + 1] * f[None, :]


def shape_image(rng: np.random.Generator, cls: int, size: int = 32) -> np.ndarray:
    """One Image* picture of class ``cls``: the class's shape at a random place, scale (radius 5-12
    px), rotation (+-25 degrees) and aspect, of a random grey on a random textured background
    (either one brighter), partly crossed by two random strokes, with pixel noise."""
    s = rng.uniform(5, 12)
    cx, cy = rng.uniform(s, size - s, 2)
    a = rng.uniform(-25, 25) * np.pi / 180
    aspect = rng.uniform(0.75, 1.33)
    y, x = np.mgrid[0:size, 0:size] + 0.5
    dx, dy = (x - cx) / s, (y - cy) / s
    u = (np.cos(a) * dx + np.sin(a) * dy) * aspect
    v = (-np.sin(a) * dx + np.cos(a) * dy) / aspect
    fg, bg = rng.uniform(0, 255, 2)
    while abs(fg - bg) < 50:
        fg, bg = rng.uniform(0, 255, 2)
    img = bg + 25 * _smooth_noise(rng, size, 4) + np.where(_shape_mask(cls, u, v), fg - bg, 0.0)
    for _ in range(2):      # distractor strokes: lines of random grey
        p0, p1 = rng.uniform(0, size, 2), rng.uniform(0, size, 2)
        d = p1 - p0
        t = np.clip(((x - p0[0]) * d[0] + (y - p0[1]) * d[1]) / max(d @ d, 1e-9), 0, 1)
        near = np.hypot(x - p0[0] - t * d[0], y - p0[1] - t * d[1]) < rng.uniform(0.5, 1.5)
        img = np.where(near, rng.uniform(0, 255), img)
    img += rng.normal(0, 18, img.shape)
    return np.clip(np.round(img), 0, 255).astype(np.uint8)


def shapes_split(seed: int, n: int, size: int = 32) -> Tuple[np.ndarray, np.ndarray]:
    """``n`` Image* pictures ``(n, size, size)`` uint8 and balanced labels, from ``seed`` alone."""
    rng = np.random.default_rng([seed, 7])
    labels = rng.permutation(np.arange(n) % 10)
    imgs = np.stack([shape_image(rng, int(c), size) for c in labels]) if n else np.zeros((0, size, size), np.uint8)
    return imgs, labels.astype(np.int64)
