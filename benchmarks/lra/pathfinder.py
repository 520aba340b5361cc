"""Pathfinder (Linsley et al. 2018; LRA's 32x32 "curv_contour_length_14"), regenerated.

An image holds two *target* snakes of 14 paddles, a few short distractor snakes, and single paddles
filling the free space, all drawn alike. One circle marks an end of a target snake, a second circle
an end of the same snake (label 1) or of the other target (label 0). The task needs the path
between the circles to be followed paddle by paddle.

The original generator (drewlinsley/pathfinder ``snakes2.py``, Python 2) is not used; this one
follows its algorithm with LRA's 32x32 parameters:

- a paddle is a straight stroke ``paddle_length`` = 2 px long and about 1 px wide;
- a snake grows paddle by paddle: the next paddle starts ``gap`` = 2 px beyond the last one's end,
  turned by an angle drawn with weight ``cos(turn)^2`` within +-90 degrees (``continuity`` 1.0),
  among the turns whose paddle keeps ``margin`` = 1 px away from every other paddle;
- the two targets start ``seed_distance`` = 7 px apart, so where a circle sits says nothing of the
  label; a target that cannot reach 14 paddles is erased and drawn again (the image, after 16 tries);
- 20 // 4 = 5 distractor snakes of 4 paddles, then single paddles until no space is left.

The 2-pixel gap keeps a snake's paddles from touching: with 1-pixel gaps a flood fill from one
circle reaches the other whenever they share a snake, which solves most of a set without any
long-range reasoning; with 2 pixels it does no better than chance (tests check both baselines).

Images are drawn at 4x4 supersampling, so strokes are anti-aliased; coverage below
``1 / 4`` of a pixel is dropped so gaps stay empty. Values are ``uint8`` 0..255.

This is a regeneration, not the released set: the first target's placement, the stroke rendering
and the per-chunk label balancing are this module's, and its statistics have not been compared
with the original generator's, so tables mark it "pathfinder*" ("pathx*" at 128x128).

Path-X (``PATHX``) is the same algorithm at 128x128 with every length scaled by 4: paddles of 8 px,
8-px gaps, strokes 2 px wide, 4-px margins, targets starting 28 px apart, markers of radius 6.
"""
from __future__ import annotations

import functools
import math
import random
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Tuple

import numpy as np

SUPER = 4               # supersampling per pixel side
N_ANGLES = 64           # quantized paddle directions


@dataclass(frozen=True)
class Params:
    size: int = 32
    padding: int = 1
    paddle_length: float = 2.0
    gap: float = 2.0
    thickness: float = 1.0
    margin: int = 1
    contour_length: int = 14
    distractor_length: int = 4
    num_distractors: int = 5
    seed_distance: float = 7.0
    marker_radius: float = 1.5
    max_turn_tries: int = 24
    max_single_failures: int = 40

    @property
    def origin(self) -> int:
        """A stroke's stamp window is ``2 origin + 1`` pixels, the stroke starting in pixel ``origin``."""
        return max(3, math.ceil(self.paddle_length + self.thickness))

    @property
    def stamp(self) -> int:
        return 2 * self.origin + 1


#: Path-X (LRA's 128x128 Pathfinder): the 32x32 geometry scaled by 4 (see the module docstring)
PATHX = dict(size=128, padding=4, paddle_length=8.0, gap=8.0, thickness=2.0, margin=4, seed_distance=28.0,
             marker_radius=6.0)


@dataclass
class Sample:
    image: np.ndarray                     # (size, size) uint8
    label: int
    # the two targets' paddles, each (x0, y0, x1, y1)
    snakes: List[List[Tuple[float, float, float, float]]] = field(default_factory=list)
    ends: List[Tuple[float, float]] = field(default_factory=list)          # target (start tip, end tip)
    marker_snakes: Tuple[int, int] = (0, 0)


@functools.lru_cache(maxsize=None)
def _stamp(angle_index: int, fx: int, fy: int, length: float, thickness: float, margin: int, origin: int):
    """A stroke starting at pixel (origin + fx/4, origin + fy/4) of a (STAMP, STAMP) window (STAMP =
    2 origin + 1), pointing at ``angle_index`` (x is the column, y the row): its coverage, the
    (STAMP + 2 margin)^2 mask of pixels within ``margin`` of it, and the bounds (row min, row max, col
    min, col max) of its pixels."""
    STAMP = 2 * origin + 1
    a = 2 * math.pi * angle_index / N_ANGLES
    ux, uy = math.cos(a), math.sin(a)
    grid = (np.arange(STAMP * SUPER) + 0.5) / SUPER
    X, Y = np.meshgrid(grid, grid)
    dx, dy = X - (origin + fx / SUPER), Y - (origin + fy / SUPER)
    along, across = dx * ux + dy * uy, -dx * uy + dy * ux
    inside = (along >= 0) & (along <= length) & (np.abs(across) <= thickness / 2)
    cov = inside.reshape(STAMP, SUPER, STAMP, SUPER).mean(axis=(1, 3))
    cov = np.where(cov >= 0.25, cov, 0.0)
    on = cov > 0
    near = np.zeros((STAMP + 2 * margin, STAMP + 2 * margin), dtype=bool)
    for dr in range(2 * margin + 1):
        for dc in range(2 * margin + 1):
            near[dr:dr + STAMP, dc:dc + STAMP] |= on
    rows, cols = np.nonzero(on)
    return cov, on, near, (rows.min(), rows.max(), cols.min(), cols.max())


class _Canvas:
    def __init__(self, p: Params):
        self.p, self.st, self.o = p, p.stamp, p.origin
        self.image = np.zeros((p.size + 2 * self.st, p.size + 2 * self.st))     # framed, so stamps never clip
        self.owner = np.zeros(self.image.shape, dtype=np.int32)               # paddle id per pixel, 0 = free
        self.n = 0
        self.lo, self.hi = p.padding + self.st, p.size - p.padding + self.st

    def footprint(self, x: float, y: float, k: int):
        """(row, col, stamp) of a paddle starting at (x, y) with direction k, or None when it leaves
        the drawable area (inside ``padding``)."""
        ix, iy = math.floor(x), math.floor(y)
        st = _stamp(k % N_ANGLES, int((x - ix) * SUPER), int((y - iy) * SUPER), self.p.paddle_length,
                    self.p.thickness, self.p.margin, self.o)
        r0, c0 = iy - self.o + self.st, ix - self.o + self.st
        rmin, rmax, cmin, cmax = st[3]
        if r0 + rmin < self.lo or r0 + rmax >= self.hi or c0 + cmin < self.lo or c0 + cmax >= self.hi:
            return None
        return r0, c0, st

    def fits(self, fp, allowed: int = 0) -> bool:
        """No pixel within ``margin`` of the paddle belongs to another paddle (``allowed``: the
        snake's previous paddle, which the gap keeps apart anyway)."""
        r0, c0, st = fp
        m = self.p.margin
        taken = self.owner[r0 - m:r0 + self.st + m, c0 - m:c0 + self.st + m][st[2]]
        return not np.any((taken != 0) & (taken != allowed))

    def put(self, fp) -> int:
        r0, c0, (cov, on, _, _) = fp
        self.n += 1
        win = (slice(r0, r0 + self.st), slice(c0, c0 + self.st))
        self.image[win] = np.maximum(self.image[win], cov)
        self.owner[win][on] = self.n
        return self.n


def _end(x, y, k, length):
    a = 2 * math.pi * k / N_ANGLES
    return x + length * math.cos(a), y + length * math.sin(a)


def _grow(canvas: _Canvas, rng: random.Random, x: float, y: float, k: int, n_paddles: int):
    """A snake of up to ``n_paddles`` from (x, y) heading k: its paddles ``(x0, y0, x1, y1)``, its tips,
    and how many paddles it got."""
    p = canvas.p
    fp = canvas.footprint(x, y, k)
    if fp is None or not canvas.fits(fp):
        return None
    last = canvas.put(fp)
    ex, ey = _end(x, y, k, p.paddle_length)
    paddles, tip0 = [(x, y, ex, ey)], (x, y)
    for _ in range(n_paddles - 1):
        for _ in range(p.max_turn_tries):
            # turn weighted by cos^2 within +-90 degrees (rejection sampling)
            turn = rng.uniform(-math.pi / 2, math.pi / 2)
            if rng.random() > math.cos(turn) ** 2:
                continue
            k2 = k + round(turn / (2 * math.pi) * N_ANGLES)
            nx, ny = _end(ex, ey, k2, p.gap)
            fp = canvas.footprint(nx, ny, k2)
            if fp is not None and canvas.fits(fp, allowed=last):
                break
        else:
            return paddles, (tip0, (ex, ey)), len(paddles)
        last, k, (x, y) = canvas.put(fp), k2, (nx, ny)
        ex, ey = _end(x, y, k, p.paddle_length)
        paddles.append((x, y, ex, ey))
    return paddles, (tip0, (ex, ey)), len(paddles)


def _disk(canvas: _Canvas, cx: float, cy: float, r: float) -> None:
    grid = (np.arange(canvas.image.shape[0] * SUPER) + 0.5) / SUPER - canvas.st
    sub = ((grid[None, :] - cx) ** 2 + (grid[:, None] - cy) ** 2) <= r * r
    n = canvas.image.shape[0]
    cov = sub.reshape(n, SUPER, n, SUPER).mean(axis=(1, 3))
    canvas.image = np.maximum(canvas.image, np.where(cov >= 0.25, np.minimum(cov * 1.5, 1.0), 0.0))


def draw_sample(rng: random.Random, label: int, p: Params = Params()) -> Sample:
    """One image with the given label (0 or 1)."""
    lo, hi = p.padding + 2.0, p.size - p.padding - 2.0
    while True:
        canvas = _Canvas(p)
        x0, y0 = rng.uniform(lo, hi), rng.uniform(lo, hi)
        targets = []
        for attempt in range(16):
            if targets:     # the second target starts seed_distance from the first one's start
                a = rng.uniform(0, 2 * math.pi)
                sx, sy = x0 + p.seed_distance * math.cos(a), y0 + p.seed_distance * math.sin(a)
            else:
                sx, sy = x0, y0
            saved = canvas.image.copy(), canvas.owner.copy(), canvas.n
            grown = _grow(canvas, rng, sx, sy, rng.randrange(N_ANGLES), p.contour_length)
            if grown is not None and grown[2] == p.contour_length:
                targets.append(grown)
                if len(targets) == 2:
                    break
            else:           # undo the partial snake and try again
                canvas.image, canvas.owner, canvas.n = saved
                if not targets and attempt >= 3:
                    break
        if len(targets) == 2:
            break
    for _ in range(p.num_distractors):
        for _ in range(10):
            if _grow(canvas, rng, rng.uniform(lo, hi), rng.uniform(lo, hi), rng.randrange(N_ANGLES),
                     p.distractor_length) is not None:
                break
    failures = 0
    while failures < p.max_single_failures:
        fp = canvas.footprint(rng.uniform(lo, hi), rng.uniform(lo, hi), rng.randrange(N_ANGLES))
        if fp is not None and canvas.fits(fp):
            canvas.put(fp)
        else:
            failures += 1
    first = rng.randrange(2)
    second = first if label == 1 else 1 - first
    m0, m1 = targets[first][1][0], targets[second][1][1]
    for (cx, cy) in (m0, m1):
        _disk(canvas, cx, cy, p.marker_radius)
    image = canvas.image[canvas.st:canvas.st + p.size, canvas.st:canvas.st + p.size]
    return Sample(image=np.round(np.clip(image, 0, 1) * 255).astype(np.uint8), label=label,
                  snakes=[t[0] for t in targets], ends=[t[1] for t in targets], marker_snakes=(first, second))


CHUNK = 500


def draw_chunk(job: Tuple[int, int, int, Dict]) -> Tuple[np.ndarray, np.ndarray]:
    """Images and labels ``[index * CHUNK, index * CHUNK + n)`` of a set; labels alternate 0/1 within
    a chunk before a seeded shuffle, so every chunk is balanced."""
    seed, index, n, params = job
    rng = random.Random(f"pathfinder:{seed}:{index}")
    p = Params(**params)
    labels = [i % 2 for i in range(n)]
    rng.shuffle(labels)
    images = np.stack([draw_sample(rng, y, p).image for y in labels]) if n else np.zeros((0, p.size, p.size), np.uint8)
    return images, np.array(labels, dtype=np.int64)


def generate(seed: int = 0, n: int = 1000, workers: int = 1, progress: Optional[str] = None,
             **params) -> Tuple[np.ndarray, np.ndarray]:
    """``n`` images ``(n, size, size)`` uint8 and labels ``(n,)``, the same for any ``workers``."""
    from .cache import parallel_map
    jobs = [(seed, i, min(CHUNK, n - i * CHUNK), params) for i in range(math.ceil(n / CHUNK))]
    parts = parallel_map(draw_chunk, jobs, workers, progress)
    size = Params(**params).size
    if not parts:
        return np.zeros((0, size, size), np.uint8), np.zeros(0, np.int64)
    return np.concatenate([a for a, _ in parts]), np.concatenate([b for _, b in parts])


# ----------------------------------------------------------------------------- baselines (tests)

def marker_centres(sample: Sample) -> Tuple[Tuple[float, float], Tuple[float, float]]:
    a, b = sample.marker_snakes
    return sample.ends[a][0], sample.ends[b][1]


def flood_fill_predicts(image: np.ndarray, start: Tuple[float, float], goal: Tuple[float, float],
                        threshold: int = 1, diagonal: bool = True) -> int:
    """1 when the pixels >= ``threshold`` connect the pixel at ``start`` to the one at ``goal``."""
    on = image >= threshold
    n = image.shape[0]
    sr, sc = min(int(start[1]), n - 1), min(int(start[0]), n - 1)
    gr, gc = min(int(goal[1]), n - 1), min(int(goal[0]), n - 1)
    seen = np.zeros_like(on)
    stack = [(sr, sc)]
    steps = [(-1, 0), (1, 0), (0, -1), (0, 1)] + ([(-1, -1), (-1, 1), (1, -1), (1, 1)] if diagonal else [])
    while stack:
        r, c = stack.pop()
        if not (0 <= r < n and 0 <= c < n) or seen[r, c] or not on[r, c]:
            continue
        seen[r, c] = True
        stack.extend((r + dr, c + dc) for dr, dc in steps)
    return int(seen[gr, gc])
