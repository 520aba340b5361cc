"""Shortcut baselines of the generated sets, measured: what a stand-in must defeat to test long range.

    python -m benchmarks.lra baselines --out benchmarks/results/cpu/lra-baselines

- Retrieval*: a logistic regression on the words of each document's first 3 words ("prefix"), one
  on the whole documents' bags of words ``[b1, b2, b1 * b2, |b1 - b2|]`` ("bag of words"), and the
  ground truth read from the key order ("oracle": the label is the documents' content).
- Text*: the same prefix and bag-of-words regressions on the one document, and the byte histogram.
- Image*: a logistic regression on the raw pixels, the majority class, and the same small CNN as
  below (the classes are learnable from the pixels).
- Pathfinder*: a flood fill from one marker (at two thresholds), the count of lit pixels and the
  markers' distance (at contour length 14 at chance, at 6 not: `learnability` reports it), and a
  learnability check: does a small CNN trained a few epochs on the short set beat chance (not yet
  shown on a CPU: see the README; `learnability` reruns it alone with other generator settings).

Each regression is fitted on the train split and scored on the test split of the "short" sets.
"""
from __future__ import annotations

import json
import math
import os
import random
import time
from pathlib import Path
from typing import Dict, Optional, Sequence

import numpy as np
import torch
import torch.nn.functional as F

from . import pathfinder, text
from .tasks import load_task


def logistic_accuracy(xtr: np.ndarray, ytr: np.ndarray, xte: np.ndarray, yte: np.ndarray, l2: float = 1e-3,
                      iters: int = 200) -> float:
    """Multinomial logistic regression (standardized features, L2 ``l2``, L-BFGS) fitted on train,
    accuracy on test."""
    torch.manual_seed(0)
    xtr_t, xte_t = torch.as_tensor(xtr, dtype=torch.float64), torch.as_tensor(xte, dtype=torch.float64)
    mu, sd = xtr_t.mean(0), xtr_t.std(0).clamp(min=1e-6)
    xtr_t, xte_t = (xtr_t - mu) / sd, (xte_t - mu) / sd
    y = torch.as_tensor(ytr, dtype=torch.long)
    k = int(max(ytr.max(), yte.max())) + 1
    w = torch.zeros(xtr_t.shape[1], k, dtype=torch.float64, requires_grad=True)
    b = torch.zeros(k, dtype=torch.float64, requires_grad=True)
    opt = torch.optim.LBFGS([w, b], max_iter=iters, line_search_fn="strong_wolfe")

    def closure():
        opt.zero_grad()
        loss = F.cross_entropy(xtr_t @ w + b, y) + l2 * w.square().sum()
        loss.backward()
        return loss
    opt.step(closure)
    with torch.no_grad():
        return float(((xte_t @ w + b).argmax(1).numpy() == yte).mean())


def ridge_accuracy(xtr: np.ndarray, ytr: np.ndarray, xte: np.ndarray, yte: np.ndarray, l2: float = 1.0) -> float:
    """A linear least-squares classifier (one-hot targets, ridge ``l2``, standardized features): a
    fast linear baseline for the tests."""
    mu, sd = xtr.mean(0), np.maximum(xtr.std(0), 1e-6)
    a, b = (xtr - mu) / sd, (xte - mu) / sd
    a, b = np.hstack([a, np.ones((len(a), 1))]), np.hstack([b, np.ones((len(b), 1))])
    k = int(max(ytr.max(), yte.max())) + 1
    w = np.linalg.solve(a.T @ a + l2 * np.eye(a.shape[1]), a.T @ np.eye(k)[ytr])
    return float(((b @ w).argmax(1) == yte).mean())


class Vocabulary:
    def __init__(self, docs: Sequence[bytes]):
        self.index = {w: i for i, w in enumerate(sorted({w for d in docs for w in d.split()}))}

    def bags(self, docs: Sequence[bytes], first: Optional[int] = None) -> np.ndarray:
        out = np.zeros((len(docs), len(self.index)))
        for i, d in enumerate(docs):
            for w in d.split()[:first]:
                j = self.index.get(w)
                if j is not None:
                    out[i, j] += 1
        return out


def _pair_features(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    return np.concatenate([a, b, a * b, np.abs(a - b)], axis=1)


def _rows(split, pair: bool):
    docs = [bytes((x - 2).astype(np.uint8)) for x in split.x]
    docs2 = [bytes((x - 2).astype(np.uint8)) for x in split.x2] if pair else None
    return docs, docs2, split.y


def text_baselines(task: str, cache_dir=None, workers: int = 1) -> Dict[str, float]:
    d = load_task(task, preset="short", cache_dir=cache_dir, workers=workers)
    pair = task == "retrieval"
    tr, tr2, ytr = _rows(d.train, pair)
    te, te2, yte = _rows(d.test, pair)
    vocab = Vocabulary(tr + (tr2 or []))
    out = {"majority class": float(np.mean(yte == np.bincount(ytr).argmax()))}
    for name, first in (("prefix (first 3 words), logistic", 3), ("bag of words, logistic", None)):
        ftr, fte = vocab.bags(tr, first), vocab.bags(te, first)
        if pair:
            ftr, fte = _pair_features(ftr, vocab.bags(tr2, first)), _pair_features(fte, vocab.bags(te2, first))
        out[name] = logistic_accuracy(ftr, ytr, fte, yte)
    htr, hte = text.unigram_baseline_inputs(tr), text.unigram_baseline_inputs(te)
    if pair:
        htr = _pair_features(htr, text.unigram_baseline_inputs(tr2))
        hte = _pair_features(hte, text.unigram_baseline_inputs(te2))
    out["byte histogram, logistic"] = logistic_accuracy(htr, ytr, hte, yte)
    if pair:
        out["oracle (key order compared)"] = float(np.mean(
            [int(text.key_order(a) == text.key_order(b)) == y for a, b, y in zip(te, te2, yte)]))
    return out


def image_baselines(cache_dir=None) -> Dict[str, float]:
    d = load_task("image", preset="short", cache_dir=cache_dir)
    xtr, xte = np.stack(d.train.x).astype(float), np.stack(d.test.x).astype(float)
    return {"majority class": float(np.mean(d.test.y == np.bincount(d.train.y).argmax())),
            "raw pixels, logistic": logistic_accuracy(xtr, d.train.y, xte, d.test.y, l2=1e-2)}


def pathfinder_shortcuts(n: int = 400, seed: int = 0, overrides: Optional[Dict] = None) -> Dict[str, float]:
    """Flood fill, pixel count and the markers' distance on ``n`` fresh Pathfinder* samples (they
    need the markers' positions, which only the generator knows), drawn with ``overrides`` of the
    generator's parameters (``sizes`` ignored). The distance regression (on d, d^2 and sqrt d) finds
    a set whose label shows in how far apart the markers are, which needs no path to be followed."""
    rng = random.Random(f"baselines:{seed}")
    params = pathfinder.Params(**{k: v for k, v in (overrides or {}).items() if k != "sizes"})
    ss = [pathfinder.draw_sample(rng, i % 2, params) for i in range(n)]
    labels = np.array([s.label for s in ss])
    out = {}
    for thr in (1, 128):
        pred = np.array([pathfinder.flood_fill_predicts(s.image, *pathfinder.marker_centres(s), thr) for s in ss])
        out[f"flood fill from a marker (pixels >= {thr})"] = float(np.mean(pred == labels))
    counts = np.array([(s.image > 0).sum() for s in ss], dtype=float)[:, None]
    half = n // 2
    out["lit-pixel count, logistic"] = logistic_accuracy(counts[:half], labels[:half], counts[half:], labels[half:])
    d = np.array([math.dist(*pathfinder.marker_centres(s)) for s in ss])
    d = np.stack([d, d * d, np.sqrt(d)], 1)
    out["marker distance, logistic"] = logistic_accuracy(d[:half], labels[:half], d[half:], labels[half:])
    return out


class SmallCNN(torch.nn.Module):
    """Five 3x3 convolutions (``width``, ``width``, pool, ``2 width`` x 2, pool, ``2 width``), a global
    max pool and a linear layer; ``batch_norm`` puts a BatchNorm after each convolution."""

    def __init__(self, width: int = 32, classes: int = 2, batch_norm: bool = False):
        super().__init__()
        c = width

        def conv(i, o):
            return [torch.nn.Conv2d(i, o, 3, padding=1)] + ([torch.nn.BatchNorm2d(o)] if batch_norm else []) + \
                [torch.nn.ReLU()]
        self.net = torch.nn.Sequential(
            *conv(1, c), *conv(c, c), torch.nn.MaxPool2d(2), *conv(c, 2 * c), *conv(2 * c, 2 * c), torch.nn.MaxPool2d(2),
            *conv(2 * c, 2 * c), torch.nn.AdaptiveMaxPool2d(1), torch.nn.Flatten(), torch.nn.Linear(2 * c, classes))

    def forward(self, x):
        return self.net(x)


P_CHANCE = "p(chance scores as much on test)"
#: float entries of a result that are not accuracies
NOT_ACCURACY = ("minutes", "lr", P_CHANCE)


def binomial_tail(hits: int, n: int, p: float) -> float:
    """P(X >= hits) for X ~ Binomial(n, p): how often guessing at chance ``p`` scores ``hits`` of ``n``."""
    if hits <= 0:
        return 1.0
    logs = [math.lgamma(n + 1) - math.lgamma(k + 1) - math.lgamma(n - k + 1) + k * math.log(p)
            + (n - k) * math.log1p(-p) for k in range(hits, n + 1)]
    top = max(logs)
    return min(1.0, math.exp(top) * sum(math.exp(v - top) for v in logs))


def cnn_learnability(task: str = "pathfinder", cache_dir=None, workers: int = 1, epochs: int = 12,
                     minutes: float = 15.0, seed: int = 0, overrides: Optional[Dict] = None, width: int = 32,
                     lr: float = 2e-3, batch_norm: bool = False, device: str = "cpu") -> Dict:
    """A small CNN (``width`` channels) on the task's short generated set (Pathfinder*: 8K train;
    Image*: 9K), ``overrides`` of the generator's parameters over it (``sizes`` for more images),
    trained on ``device``: the best dev epoch's test accuracy, and the chance of scoring as much by
    guessing (a one-sided binomial tail at chance)."""
    d = load_task(task, preset="short", cache_dir=cache_dir, workers=workers, progress=True, overrides=overrides)
    side = int(round(math.sqrt(len(d.train.x[0]))))
    dev_t = torch.device(device)

    def tensors(split):
        x = torch.as_tensor(np.stack(split.x) - 2, dtype=torch.float32).view(-1, 1, side, side) / 255
        return x.to(dev_t), torch.as_tensor(split.y).to(dev_t)
    (xtr, ytr), (xdv, ydv), (xte, yte) = map(tensors, (d.train, d.dev, d.test))
    torch.manual_seed(seed)
    model = SmallCNN(width, classes=d.num_classes, batch_norm=batch_norm).to(dev_t)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=1e-4)
    acc = lambda x, y: float((torch.cat([model(x[i:i + 500]) for i in range(0, len(x), 500)]).argmax(1)  # noqa: E731
                              == y).float().mean())
    best, curve, t0 = (-1.0, 0.0, 0), [], time.perf_counter()
    g = torch.Generator().manual_seed(seed)
    for epoch in range(1, epochs + 1):
        model.train()
        for idx in torch.randperm(len(xtr), generator=g).split(64):
            idx = idx.to(dev_t)
            loss = F.cross_entropy(model(xtr[idx]), ytr[idx])
            opt.zero_grad()
            loss.backward()
            opt.step()
        model.eval()
        with torch.no_grad():
            dev = acc(xdv, ydv)
            if dev > best[0]:
                best = (dev, acc(xte, yte), epoch)
        curve.append((epoch, dev))
        if time.perf_counter() - t0 > minutes * 60:
            break
    chance, minutes = 1.0 / d.num_classes, (time.perf_counter() - t0) / 60
    shortcuts = {} if task != "pathfinder" else pathfinder_shortcuts(min(400, len(xtr)), seed, overrides)
    return {"shortcuts on fresh samples of the same setting": shortcuts,
            "small CNN, dev accuracy of the best epoch": best[0], "small CNN, test accuracy (best dev epoch)": best[1],
            "epochs": len(curve), "best epoch": best[2], "dev curve": curve, "train examples": len(xtr),
            "test examples": len(xte), P_CHANCE: binomial_tail(round(best[1] * len(xte)), len(xte), chance),
            "chance": chance, "generator overrides": dict(overrides or {}), "width": width, "batch norm": batch_norm,
            "lr": lr, "seed": seed, "minutes": minutes}


def run_baselines(out: Path, cache_dir=None, workers: int = 2, learnability: bool = True) -> Dict:
    torch.set_num_threads(max(1, workers))
    res = {"retrieval*": text_baselines("retrieval", cache_dir, workers),
           "text*": text_baselines("text", cache_dir, workers),
           "image*": image_baselines(cache_dir), "pathfinder*": pathfinder_shortcuts()}
    if learnability:
        res["pathfinder* learnability"] = cnn_learnability("pathfinder", cache_dir, workers)
        res["image* learnability"] = cnn_learnability("image", cache_dir, workers)
    res["chance"] = {"retrieval*": 0.5, "text*": 0.5, "image*": 0.1, "pathfinder*": 0.5}
    from .train import environment
    res["environment"] = dict(environment(torch.device("cpu")), command="python -m benchmarks.lra baselines"
                              + ("" if learnability else " --skip-learnability"))
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps(res, indent=1) + "\n")
    md = baselines_markdown(res)
    (out / "results.md").write_text(md)
    print(md)
    return res


def run_learnability(out: Path, task: str = "pathfinder", overrides: Optional[Dict] = None, cache_dir=None,
                     workers: int = 2, threads: int = 2, epochs: int = 12, minutes: float = 15.0, width: int = 32,
                     lr: float = 2e-3, seed: int = 0, batch_norm: bool = False, device: str = "cpu") -> Dict:
    """`cnn_learnability` as a command: ``results.json`` and ``results.md`` in ``out``, with the
    command line that reproduces them."""
    torch.set_num_threads(threads)
    load0 = os.getloadavg()[0]
    res = cnn_learnability(task, cache_dir, workers, epochs, minutes, seed, overrides, width, lr, batch_norm, device)
    sets = "".join(f" --set '{k}={json.dumps(v, separators=(',', ':'))}'" for k, v in (overrides or {}).items())
    res["command"] = (f"python -m benchmarks.lra learnability --task {task}{sets} --epochs {epochs} --minutes {minutes:g} "
                      f"--width {width}{' --batch-norm' if batch_norm else ''} --lr {lr:g} --seed {seed} --threads {threads}"
                      f"{'' if device == 'cpu' else f' --device {device}'}")
    res["task"], res["threads"], res["load average (1 min) at start, end"] = task, threads, [load0, os.getloadavg()[0]]
    from .train import environment
    res.update(environment(torch.device(device)))
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps(res, indent=1) + "\n")
    md = learnability_markdown(res)
    (out / "results.md").write_text(md)
    print(md)
    return res


def learnability_markdown(res: Dict) -> str:
    """The ``results.md`` of a `run_learnability` result."""
    shortcuts = res.get("shortcuts on fresh samples of the same setting", {})
    task, overrides, (load0, load1) = res["task"], res["generator overrides"], res["load average (1 min) at start, end"]
    acc, dev = res["small CNN, test accuracy (best dev epoch)"], res["small CNN, dev accuracy of the best epoch"]
    curve = ", ".join(f"{100 * a:.1f}" for _, a in res["dev curve"])
    md = (f"# Learnability of {task}*: a small CNN\n\n`{res['command']}`\n\n"
          f"| task | generator overrides | train examples | epochs | minutes | best dev (%) | test (%) | "
          f"chance (%) | p of chance |\n|---|---|---|---|---|---|---|---|---|\n"
          f"| {task}* | {json.dumps(res['generator overrides']) if overrides else 'none (short preset)'} | "
          f"{res['train examples']} | {res['epochs']} | {res['minutes']:.1f} | {100 * dev:.1f} | {100 * acc:.1f} | "
          f"{100 * res['chance']:.1f} | {res[P_CHANCE]:.2g} |\n\n"
          + (f"Shortcuts on {min(400, res['train examples'])} fresh samples of the same setting (half fitted, half "
             "scored): " + "; ".join(f"{name} {100 * v:.1f}%" for name, v in shortcuts.items()) + ". "
             if shortcuts else "") +
          f"Dev accuracy by epoch (%): {curve}. Test: {res['test examples']} examples, scored with the best dev "
          f"epoch; p of chance: the probability that guessing scores as much (one-sided binomial). "
          f"{res['device']}, torch {res['torch']}, {res['date']}; load average {load0:.1f} at the start, "
          f"{load1:.1f} at the end (other jobs share the machine).\n")
    return md


def baselines_markdown(res: Dict) -> str:
    md = ["# Shortcut baselines of the generated sets", "",
          "`python -m benchmarks.lra baselines`: fitted on the train split, accuracy (%) on the test split of the "
          "`short` sets (Retrieval*, Text*: 8K / 1K / 1K, 200-512 bytes; Image*: 9K / 1K / 2K; Pathfinder*: 400 "
          "fresh samples for the shortcuts, the 8K / 1K / 1K set for the CNN, at most 12 epochs or 15 minutes).", "",
          "| task | baseline | accuracy (%) |", "|---|---|---|"]
    for task, vals in res.items():
        if task in ("chance", "environment"):
            continue
        for name, v in vals.items():
            if isinstance(v, float) and name not in NOT_ACCURACY:
                md.append(f"| {task} | {name} | {100 * v:.1f} |")
        if "epochs" in vals:
            md.append(f"| {task} | (epochs trained, minutes{', p of chance' if P_CHANCE in vals else ''}) | "
                      f"{vals['epochs']}, {vals['minutes']:.1f}"
                      f"{f', {vals[P_CHANCE]:.1g}' if P_CHANCE in vals else ''} |")
        md.append(f"| {task.split(' ')[0]} | *chance* | {100 * res['chance'][task.split(' ')[0]]:.1f} |")
    env = res.get("environment")
    if env:
        md += ["", f"`{env['command']}` on {env['device']}, torch {env['torch']}, {env['date']}."]
    return "\n".join(md) + "\n"
