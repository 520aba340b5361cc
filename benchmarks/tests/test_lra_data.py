"""Long Range Arena data: the ListOps, Pathfinder and Path-X generators, the stand-ins and their
shortcut baselines, the cache and the loaders of the official file layouts (on tiny fixtures written
in those formats)."""
import gzip
import pickle
import random
from collections import Counter

import numpy as np
import pytest

from benchmarks.lra import images, listops, pathfinder, tasks, text
from benchmarks.lra.cache import fingerprint

# ----------------------------------------------------------------------------------- ListOps

def evaluate_tokens(tokens):
    """An evaluator independent of the generator: a stack machine over the token string."""
    stack = []
    for t in tokens:
        if t.startswith("["):
            stack.append([t])
        elif t == "]":
            op, *args = stack.pop()
            args = sorted(args)
            value = {"[MIN": args[0], "[MAX": args[-1], "[SM": sum(args) % 10,
                     "[MED": (args[(len(args) - 1) // 2] + args[len(args) // 2]) // 2}[op]
            if not stack:
                return value
            stack[-1].append(value)
        else:
            if not stack:
                return int(t)
            stack[-1].append(int(t))
    raise AssertionError("unbalanced expression")


@pytest.fixture(scope="module")
def short_listops():
    return listops.generate(seed=3, sizes=(600, 100, 100), min_length=16, max_length=128)


def test_listops_labels_match_an_independent_evaluator(short_listops):
    for split in short_listops.values():
        for src, label in split:
            assert evaluate_tokens(src.split()) == label, src


def test_listops_lengths_in_range_and_no_duplicates_across_splits(short_listops):
    seen = set()
    for split in short_listops.values():
        for src, _ in split:
            assert 16 < len(src.split()) < 128
            assert src not in seen
            seen.add(src)
    assert [len(v) for v in short_listops.values()] == [600, 100, 100]


def test_listops_full_size_lengths_and_label_bands():
    # LRA's parameters (500 < n < 2000): the extreme labels 0 and 9 are about 17% each
    rows = listops.generate(seed=1, sizes=(300, 0, 0), workers=1)["train"]
    lengths = [len(s.split()) for s, _ in rows]
    assert min(lengths) > 500 and max(lengths) < 2000
    share = Counter(y for _, y in rows)
    assert 0.08 <= share[0] / 300 <= 0.28 and 0.08 <= share[9] / 300 <= 0.28, share
    assert max(share.values()) / 300 < 0.3 and len(share) >= 9, share
    for src, y in rows[:20]:
        assert evaluate_tokens(src.split()) == y


def test_listops_is_deterministic_and_independent_of_workers():
    a = listops.generate(seed=5, sizes=(50, 10, 10), min_length=10, max_length=60, workers=1)
    b = listops.generate(seed=5, sizes=(50, 10, 10), min_length=10, max_length=60, workers=2)
    c = listops.generate(seed=6, sizes=(50, 10, 10), min_length=10, max_length=60, workers=1)
    assert a == b and a != c


def test_listops_tokenizer_keeps_closing_brackets_and_drops_parentheses():
    ids = listops.tokenize("( ( ( [MAX 2 ) 9 ) [MIN 4 7 ] ) ]")
    assert [listops.VOCAB[i] for i in ids] == ["[MAX", "2", "9", "[MIN", "4", "7", "]", "]"]
    with pytest.raises(ValueError, match="unknown token"):
        listops.tokenize("[MAX 2 X ]")


# ----------------------------------------------------------------------------------- Pathfinder

@pytest.fixture(scope="module")
def pf_samples():
    rng = random.Random(11)
    return [pathfinder.draw_sample(rng, i % 2) for i in range(100)]


def test_pathfinder_deterministic_balanced_and_independent_of_workers():
    a_img, a_lab = pathfinder.generate(seed=2, n=12)
    b_img, b_lab = pathfinder.generate(seed=2, n=12, workers=2)
    c_img, _ = pathfinder.generate(seed=3, n=12)
    assert np.array_equal(a_img, b_img) and np.array_equal(a_lab, b_lab)
    assert not np.array_equal(a_img, c_img)
    assert a_img.shape == (12, 32, 32) and a_img.dtype == np.uint8
    assert a_lab.sum() == 6


def test_pathfinder_markers_share_a_snake_iff_label_1(pf_samples):
    for s in pf_samples:
        assert len(s.snakes) == 2 and all(len(snake) == 14 for snake in s.snakes)
        first, second = s.marker_snakes
        assert (first == second) == (s.label == 1)
        m0, m1 = pathfinder.marker_centres(s)
        assert m0 == s.ends[first][0] and m1 == s.ends[second][1]
        for (cx, cy) in (m0, m1):                     # a bright circle sits on each marker
            assert s.image[int(cy), int(cx)] > 128
        # 2-pixel paddles with 2-pixel gaps: each paddle starts 2 px beyond the previous one's end
        for snake in s.snakes:
            seg = np.array(snake)
            assert np.allclose(np.hypot(seg[:, 2] - seg[:, 0], seg[:, 3] - seg[:, 1]), 2.0)
            assert np.allclose(np.hypot(seg[1:, 0] - seg[:-1, 2], seg[1:, 1] - seg[:-1, 3]), 2.0)


def test_pathfinder_flood_fill_and_pixel_count_baselines_at_chance(pf_samples):
    labels = np.array([s.label for s in pf_samples])
    for threshold in (1, 128):
        pred = np.array([pathfinder.flood_fill_predicts(s.image, *pathfinder.marker_centres(s), threshold)
                         for s in pf_samples])
        assert 0.35 <= (pred == labels).mean() <= 0.65
    counts = np.array([(s.image > 0).sum() for s in pf_samples])
    cut = np.median(counts[:50])                    # threshold fitted on one half, scored on the other
    acc = max(((counts[50:] > cut) == labels[50:]).mean(), ((counts[50:] <= cut) == labels[50:]).mean())
    assert acc <= 0.68


def test_binomial_tail_against_exact_sums():
    from math import comb

    from benchmarks.lra.baselines import binomial_tail
    assert binomial_tail(0, 10, 0.5) == 1.0
    assert binomial_tail(10, 10, 0.5) == pytest.approx(2.0 ** -10)
    assert binomial_tail(60, 100, 0.5) == pytest.approx(sum(comb(100, k) for k in range(60, 101)) / 2 ** 100)
    assert binomial_tail(3, 20, 0.1) == pytest.approx(
        1 - sum(comb(20, k) * 0.1 ** k * 0.9 ** (20 - k) for k in range(3)))
    assert binomial_tail(560, 1000, 0.5) < 1e-4 < binomial_tail(520, 1000, 0.5)


def test_learnability_command_writes_its_result_and_command(tmp_path, capsys):
    """`learnability` (a small CNN vs chance) on a tiny set at Pathfinder's easiest length: the files,
    the reproducing command and the generator parameters it ran with."""
    import json

    from benchmarks.lra.__main__ import main
    out = tmp_path / "learn"
    assert main(["learnability", "--task", "pathfinder", "--set", "sizes=[24,8,8]", "--set", "contour_length=6",
                 "--epochs", "1", "--width", "4", "--batch-norm", "--threads", "1", "--workers", "1", "--cache-dir",
                 str(tmp_path / "cache"), "--out", str(out)]) == 0
    res = json.loads((out / "results.json").read_text())
    assert res["generator overrides"] == {"sizes": [24, 8, 8], "contour_length": 6}
    assert res["train examples"] == 24 and res["test examples"] == 8 and res["epochs"] == 1 and res["chance"] == 0.5
    assert "--set 'contour_length=6'" in res["command"] and "--width 4 --batch-norm" in res["command"]
    assert res["batch norm"] is True
    assert 0.0 < res["p(chance scores as much on test)"] <= 1.0
    assert "| pathfinder* |" in (out / "results.md").read_text()
    shortcuts = res["shortcuts on fresh samples of the same setting"]      # 24 fresh samples: 12 fitted, 12 scored
    assert set(shortcuts) >= {"marker distance, logistic", "lit-pixel count, logistic"}
    assert all(v in {k / 12 for k in range(13)} for v in shortcuts.values())
    assert "marker distance, logistic" in (out / "results.md").read_text()
    assert main(["learnability", "--epochs", "0"]) == 2                 # a one-line error, not a traceback
    capsys.readouterr()
    import torch
    bad = [(["--set", "no_such=1"], "--set no_such: not a parameter of the pathfinder generator")]
    if not torch.cuda.is_available():
        bad.append((["--device", "cuda"], "--device cuda: no CUDA GPU"))
    for argv, needle in bad:
        assert main(["learnability", *argv]) == 2
        err = capsys.readouterr().err.strip()
        assert needle in err and "\n" not in err, err


def test_pathfinder_flood_fill_solves_touching_paddles():
    # the baseline itself works: without gaps a flood fill finds the connection
    rng = random.Random(4)
    ss = [pathfinder.draw_sample(rng, i % 2, pathfinder.Params(gap=0.0)) for i in range(40)]
    pred = [pathfinder.flood_fill_predicts(s.image, *pathfinder.marker_centres(s)) for s in ss]
    assert np.mean([p == s.label for p, s in zip(pred, ss)]) >= 0.8


# ----------------------------------------------------------------------------------- stand-ins

def _nearest_centroid_accuracy(features, labels):
    n = len(labels) // 2
    c0, c1 = features[:n][labels[:n] == 0].mean(0), features[:n][labels[:n] == 1].mean(0)
    pred = np.linalg.norm(features[n:] - c1, axis=1) < np.linalg.norm(features[n:] - c0, axis=1)
    return (pred == labels[n:]).mean()


def test_text_standin_byte_histogram_and_length_at_chance():
    rows = text.standin_split("text", seed=0, n=600, min_bytes=200, max_bytes=400)
    assert rows == text.standin_split("text", seed=0, n=600, min_bytes=200, max_bytes=400, workers=2)
    labels = np.array([y for _, y in rows])
    assert 0.4 <= labels.mean() <= 0.6
    hist = text.unigram_baseline_inputs([d for d, _ in rows])
    assert 0.4 <= _nearest_centroid_accuracy(hist, labels) <= 0.6
    lengths = np.array([[len(d)] for d, _ in rows], dtype=float)
    assert 0.4 <= _nearest_centroid_accuracy(lengths, labels) <= 0.6


def test_retrieval_standin_needs_the_whole_documents():
    """Both documents always hold the same key words; only their order over the whole documents
    tells the label: prefix and bag-of-words regressions score at chance, comparing key orders 100%."""
    from benchmarks.lra.baselines import Vocabulary, _pair_features, ridge_accuracy
    rows = text.standin_split("retrieval", seed=0, n=600, min_bytes=200, max_bytes=400)
    labels = np.array([y for _, _, y in rows])
    assert 0.4 <= labels.mean() <= 0.6
    for a, b, y in rows:
        ka, kb = text.key_order(a), text.key_order(b)
        assert sorted(ka) == sorted(kb) and len(ka) == 8 and (ka == kb) == bool(y)
        assert len(a) <= 400 and len(b) <= 400
    A, B = [r[0] for r in rows], [r[1] for r in rows]
    vocab = Vocabulary(A + B)
    for first in (3, None):
        f = _pair_features(vocab.bags(A, first), vocab.bags(B, first))
        assert 0.38 <= ridge_accuracy(f[:400], labels[:400], f[400:], labels[400:], l2=10.0) <= 0.62, first
    # the same regression is no dummy: it reads Text*'s votes off its bag of words
    docs, ys = zip(*text.standin_split("text", seed=0, n=600, min_bytes=200, max_bytes=400))
    bags, ys = Vocabulary(docs).bags(docs), np.array(ys)
    assert ridge_accuracy(bags[:400], ys[:400], bags[400:], ys[400:], l2=10.0) > 0.65
    # the key words are spread: on average the first key sits well into the document
    first_key = [a.split().index(text.key_order(a)[0]) / len(a.split()) for a in A]
    assert 0.05 < np.mean(first_key) < 0.2 and np.mean([text.key_order(a)[-1] in a.split()[-3:] for a in A]) < 0.5


def test_image_standin_deterministic_balanced_and_not_linearly_easy():
    x, y = images.shapes_split(0, 600)
    x2, y2 = images.shapes_split(0, 600)
    assert np.array_equal(x, x2) and np.array_equal(y, y2) and x.shape == (600, 32, 32) and x.dtype == np.uint8
    assert np.bincount(y).tolist() == [60] * 10
    assert not np.array_equal(images.shapes_split(1, 10)[0], x[:10])
    # raw pixels do not give the class away (Fashion-MNIST gives a linear model 84%)
    flat = x.reshape(600, -1).astype(float)
    centroids = np.stack([flat[:400][y[:400] == c].mean(0) for c in range(10)])
    nearest = np.linalg.norm(flat[400:, None] - centroids[None], axis=2).argmin(1)
    assert (nearest == y[400:]).mean() < 0.3
    # ... while the ten classes are ten distinct shapes
    yy, xx = np.mgrid[0:32, 0:32] + 0.5
    u, v = (xx - 16) / 9, (yy - 16) / 9
    masks = np.stack([images._shape_mask(c, u, v) for c in range(10)]).astype(float)
    assert len({m.tobytes() for m in masks}) == 10 and all(m.sum() > 20 for m in masks)


# ----------------------------------------------------------------------------------- cache, tasks

def test_generated_sets_are_cached_under_their_fingerprint(tmp_path):
    over = {"sizes": [40, 8, 8], "min_length": 10, "max_length": 40}
    a = tasks.load_task("listops", cache_dir=tmp_path, overrides=over)
    files = list(tmp_path.glob("listops-*.npz"))
    assert len(files) == 1
    b = tasks.load_task("listops", cache_dir=tmp_path, overrides=over)
    assert all(np.array_equal(x, y) for x, y in zip(a.train.x, b.train.x)) and np.array_equal(a.test.y, b.test.y)
    tasks.load_task("listops", cache_dir=tmp_path, overrides=dict(over, max_length=41))
    assert len(list(tmp_path.glob("listops-*.npz"))) == 2
    assert fingerprint("x", 1, {"a": 1}) != fingerprint("x", 2, {"a": 1})
    assert not a.standin and a.kind == "generated" and a.label == "listops (10-40 tokens)"
    t = tasks.load_task("retrieval", cache_dir=tmp_path, overrides={"sizes": [6, 2, 2], "min_bytes": 50,
                                                                     "max_bytes": 80})
    assert t.standin and t.label == "retrieval* (small set)" and t.pair and len(t.train.x2) == 6


# ----------------------------------------------------------------------------------- official layouts

def test_missing_layout_error_names_the_expected_files(tmp_path):
    for task, needle in (("listops", "listops-1000/basic_"), ("retrieval", "new_aan_pairs"),
                         ("text", "aclImdb"), ("pathfinder", "pathfinder32/curv_contour_length_14"),
                         ("pathx", "pathfinder128/curv_contour_length_14")):
        with pytest.raises(tasks.MissingData, match=needle):
            tasks.load_task(task, str(tmp_path))


def test_listops_tsv_loader(tmp_path):
    d = tmp_path / "listops-1000"
    d.mkdir()
    rows = [("( ( [MAX 2 ) 9 ) ]", 9), ("( ( ( [SM 3 ) 4 ) 5 ) ]", 2)]
    for name in ("train", "val", "test"):
        listops.write_tsv(d / f"basic_{name}.tsv", rows)
    t = tasks.load_task("listops", str(tmp_path))
    assert [listops.VOCAB[i] for i in t.dev.x[1]] == ["[SM", "3", "4", "5", "]"]
    assert list(t.test.y) == [9, 2]


def test_imdb_and_aan_loaders(tmp_path):
    for split in ("train", "test"):
        for lab in ("pos", "neg"):
            folder = tmp_path / "aclImdb" / split / lab
            folder.mkdir(parents=True)
            for i in range(5):
                (folder / f"{i}_7.txt").write_bytes(f"{lab} review {i}".encode())
    t = tasks.load_task("text", str(tmp_path), max_length=6)
    assert len(t.train) + len(t.dev) == 10 and len(t.test) == 10
    assert all(len(x) <= 6 for x in t.train.x) and not t.standin
    assert bytes((t.test.x[0] - 2).astype(np.uint8)) in (b"neg re", b"pos re")
    tsv = tmp_path / "tsv_data"
    tsv.mkdir()
    for name in ("train", "eval", "test"):
        (tsv / f"new_aan_pairs.{name}.tsv").write_text("1\tid1\tid2\tabc\tabd\n0.0\tid3\tid4\txyz\tq\n")
    r = tasks.load_task("retrieval", str(tmp_path))
    assert r.pair and list(r.dev.y) == [1, 0]
    assert bytes((r.train.x2[1] - 2).astype(np.uint8)) == b"q"


def test_cifar_fashion_and_pathfinder_loaders(tmp_path):
    rng = np.random.default_rng(0)
    base = tmp_path / "cifar-10-batches-py"
    base.mkdir()
    for name in [f"data_batch_{i}" for i in range(1, 6)] + ["test_batch"]:
        with open(base / name, "wb") as f:
            pickle.dump({b"data": rng.integers(0, 256, (10, 3072), dtype=np.uint8), b"labels": list(range(10))}, f)
    t = tasks.load_task("image", str(tmp_path))
    assert not t.standin and len(t.train) == 45 and len(t.dev) == 5 and len(t.test) == 10
    with open(base / "test_batch", "rb") as f:
        d = pickle.load(f)
    rgb = d[b"data"][0].reshape(3, 32, 32).astype(float)
    gray = np.round(0.2989 * rgb[0] + 0.5870 * rgb[1] + 0.1140 * rgb[2])
    assert np.array_equal(t.test.x[0] - 2, gray.reshape(-1))

    fm = tmp_path / "fm"
    fm.mkdir()
    for prefix, n in (("train", 20), ("t10k", 4)):
        imgs = rng.integers(0, 256, (n, 28, 28), dtype=np.uint8)
        with gzip.open(fm / f"{prefix}-images-idx3-ubyte.gz", "wb") as f:
            f.write(bytes([0, 0, 8, 3]) + b"".join(v.to_bytes(4, "big") for v in (n, 28, 28)) + imgs.tobytes())
        with gzip.open(fm / f"{prefix}-labels-idx1-ubyte.gz", "wb") as f:
            f.write(bytes([0, 0, 8, 1]) + n.to_bytes(4, "big") + bytes(range(n % 10)) + bytes(n - n % 10))
    f = tasks.load_task("image", str(fm))
    assert f.standin and f.label == "image*" and len(f.train) == 18 and len(f.test) == 4
    assert len(f.test.x[0]) == 1024
    first = f.test.x[0].reshape(32, 32) - 2
    assert first[:2].sum() == 0 and first[:, :2].sum() == 0     # 2-pixel black frame

    from PIL import Image
    root = tmp_path / "pathfinder32" / "curv_contour_length_14"
    (root / "imgs" / "0").mkdir(parents=True)
    (root / "metadata").mkdir()
    lines = []
    imgs, labs = pathfinder.generate(seed=0, n=10)
    for i in range(10):
        Image.fromarray(imgs[i]).save(root / "imgs" / "0" / f"sample_{i}.png")
        lines.append(f"imgs/0 sample_{i}.png {i} {labs[i]} 1.0 14 4 5 2 0.5 1 1")
    (root / "metadata" / "0.npy").write_text("\n".join(lines) + "\n")
    p = tasks.load_task("pathfinder", str(tmp_path))
    assert len(p.train) == 8 and len(p.dev) == 1 and len(p.test) == 1
    assert np.array_equal(p.train.x[3] - 2, imgs[3].reshape(-1)) and p.test.y[0] == labs[9]


def test_image_without_files_is_the_marked_standin_and_a_bad_dir_names_the_layout(tmp_path):
    with pytest.raises(tasks.MissingData, match="cifar-10-batches-py"):
        tasks.load_task("image", str(tmp_path))
    t = tasks.load_task("image", cache_dir=tmp_path, overrides={"sizes": [20, 10, 10]})
    assert t.kind == "stand-in" and t.label == "image* (small set)" and len(t.train.x[0]) == 1024
    assert "procedural" in t.source


def test_pathx_generator_and_loader(tmp_path):
    p = pathfinder.Params(**pathfinder.PATHX)
    rng = random.Random(1)
    for label in (0, 1):
        s = pathfinder.draw_sample(rng, label, p)
        assert s.image.shape == (128, 128) and (s.marker_snakes[0] == s.marker_snakes[1]) == bool(label)
        for snake in s.snakes:          # 8-px paddles, 8-px gaps: the 32x32 geometry scaled by 4
            seg = np.array(snake)
            assert len(seg) == 14 and np.allclose(np.hypot(seg[:, 2] - seg[:, 0], seg[:, 3] - seg[:, 1]), 8.0)
            assert np.allclose(np.hypot(seg[1:, 0] - seg[:-1, 2], seg[1:, 1] - seg[:-1, 3]), 8.0)
        for (cx, cy) in pathfinder.marker_centres(s):
            assert s.image[int(cy), int(cx)] > 128
    t = tasks.load_task("pathx", cache_dir=tmp_path, overrides={"sizes": [2, 1, 1]})
    assert t.label == "pathx* (small set)" and t.kind == "regenerated" and len(t.train.x[0]) == 128 * 128
    from PIL import Image
    root = tmp_path / "data" / "pathfinder128" / "curv_contour_length_14"
    (root / "imgs" / "0").mkdir(parents=True)
    (root / "metadata").mkdir()
    imgs = np.random.default_rng(0).integers(0, 256, (10, 128, 128), dtype=np.uint8)
    for i in range(10):
        Image.fromarray(imgs[i]).save(root / "imgs" / "0" / f"sample_{i}.png")
    (root / "metadata" / "0.npy").write_text("".join(f"imgs/0 sample_{i}.png {i} {i % 2}\n" for i in range(10)))
    r = tasks.load_task("pathx", str(tmp_path / "data"))
    assert r.kind == "real" and r.label == "pathx" and len(r.train) == 8
    assert np.array_equal(r.test.x[0] - 2, imgs[9].reshape(-1)) and r.test.y[0] == 1


def test_baselines_markdown_rows_chance_and_environment():
    from benchmarks.lra.baselines import baselines_markdown
    res = {"retrieval*": {"prefix (first 3 words), logistic": 0.52, "majority class": 0.469},
           "pathfinder* learnability": {"small CNN, test accuracy (best dev epoch)": 0.5, "epochs": 2, "minutes": 15.9,
                                        "p(chance scores as much on test)": 0.51},
           "chance": {"retrieval*": 0.5, "pathfinder*": 0.5},
           "environment": {"command": "python -m benchmarks.lra baselines", "device": "CPU X, 2 cores", "torch": "2.13",
                           "date": "2026-11-27 21:00 UTC"}}
    md = baselines_markdown(res)
    assert "| retrieval* | prefix (first 3 words), logistic | 52.0 |" in md and "| retrieval* | *chance* | 50.0 |" in md
    assert "| pathfinder* learnability | (epochs trained, minutes, p of chance) | 2, 15.9, 0.5 |" in md
    assert "| pathfinder* | *chance* | 50.0 |" in md and "minutes | 15" not in md
    assert md.rstrip().endswith("`python -m benchmarks.lra baselines` on CPU X, 2 cores, torch 2.13, 2026-11-27 21:00 UTC.")
