"""Text and Retrieval: LRA's byte-level files when present, else long-range stand-ins ("Text*",
"Retrieval*").

Real files (under ``--data-dir``):

- Text: ``aclImdb/{train,test}/{pos,neg}/*.txt`` (IMDb, Maas et al. 2011), or ``imdb/{train,dev,test}.tsv``
  with ``label\\ttext`` lines; bytes, truncated to ``max_length``.
- Retrieval: ``tsv_data/new_aan_pairs.{train,eval,test}.tsv``, LRA's ACL Anthology pairs, lines
  ``label\\tid1\\tid2\\ttext1\\ttext2``; each text truncated to ``max_length`` bytes.

Stand-ins, generated when the files are absent (no registry ships them):

- Text*: documents of common English words; ``2m+1`` *evidence* words are scattered at random
  positions over the whole document, each either a word (vote 1) or the same word spelt backwards
  (vote 0); the label is the majority vote. A word and its reversal have the same bytes, so the byte
  histogram, the length and any window of the document that misses most of the evidence say
  nothing about the label.
- Retrieval*: two documents of common words, each carrying the same ``keys`` = 8 distinct *key
  words* (upper-case words from `KEYS`) at random places spread over the whole document. In a
  matching pair (label 1) both documents name the keys in the same order; otherwise the second
  document has two of them swapped. Both documents always hold the same key words, so bags of words
  (and of bytes) and lengths say nothing about the label; only comparing the order of the keys over
  both whole documents does, and any prefix sees a key only where one happens to fall in it.
"""
from __future__ import annotations

import glob
import os
import random
from typing import Dict, List, Sequence, Tuple

import numpy as np

WORDS = tuple("""the of and to in is was for that with as on by he it at from his an were are which this be
or has had not first one their its new after but who they also two her have been other when there all
during time into school more may years over only year most would world city some where between later three
state such then national used made known under many university united while part season team these american
than film second born south well until war people north being high since both series name however about
called states music including four several house early world general government public water place small
life great area best century through group number around power history each year found family major night
local days light river market order point story young return field money report office sound garden paper
window letter animal summer winter spring autumn island forest mountain valley ocean station village bridge
engine doctor teacher student artist friend mother father sister brother child woman stone metal glass wood
cloud storm travel journey harbor castle temple palace theater museum library kitchen bottle basket candle
pencil blanket button camera ladder mirror pillow rocket saddle ticket tunnel wallet yellow orange purple
silver golden simple gentle honest modern ancient quiet rapid bright narrow hollow""".split())


# ----------------------------------------------------------------------------- real files

def read_imdb(root: str) -> Dict[str, List[Tuple[bytes, int]]]:
    """``aclImdb/`` (train/test with pos/neg folders) or ``imdb/*.tsv``; dev is the last 10% of
    train (by sorted file name, so it is the same on every machine)."""
    acl, tsv = os.path.join(root, "aclImdb"), os.path.join(root, "imdb")
    if os.path.isdir(acl):
        out = {}
        for split in ("train", "test"):
            rows = []
            for label, name in ((0, "neg"), (1, "pos")):
                for path in sorted(glob.glob(os.path.join(acl, split, name, "*.txt"))):
                    with open(path, "rb") as f:
                        rows.append((f.read(), label))
            out[split] = rows
        rng = random.Random(0)
        rng.shuffle(out["train"])
        cut = len(out["train"]) * 9 // 10
        out["train"], out["dev"] = out["train"][:cut], out["train"][cut:]
        return out
    out = {}
    for split in ("train", "dev", "test"):
        rows = []
        with open(os.path.join(tsv, f"{split}.tsv"), "rb") as f:
            for line in f:
                label, text = line.rstrip(b"\n").split(b"\t", 1)
                rows.append((text, int(label)))
        out[split] = rows
    return out


def read_aan(root: str) -> Dict[str, List[Tuple[bytes, bytes, int]]]:
    out = {}
    for split, name in (("train", "train"), ("dev", "eval"), ("test", "test")):
        rows = []
        with open(os.path.join(root, "tsv_data", f"new_aan_pairs.{name}.tsv"), "rb") as f:
            for line in f:
                parts = line.rstrip(b"\n").split(b"\t")
                if len(parts) < 5:
                    continue
                rows.append((parts[3], parts[4], int(float(parts[0]))))
        out[split] = rows
    return out


def encode(text: bytes, max_length: int) -> np.ndarray:
    """Bytes -> token ids ``byte + 2`` (0 is padding, 1 the CLS token), at most ``max_length``."""
    return np.frombuffer(text[:max_length], dtype=np.uint8).astype(np.int16) + 2


# ----------------------------------------------------------------------------- stand-ins

def _document(rng: random.Random, n_bytes: int, spell=lambda w: w) -> List[str]:
    words, size = [], 0
    while size < n_bytes:
        w = spell(rng.choice(WORDS))
        words.append(w)
        size += len(w) + 1
    return words


def text_standin(rng: random.Random, min_bytes: int, max_bytes: int, evidence: int = 9) -> Tuple[bytes, int]:
    """One Text* document and its label (see the module docstring)."""
    words = _document(rng, rng.randint(min_bytes, max_bytes))
    votes = [rng.randrange(2) for _ in range(evidence)]
    for vote, pos in zip(votes, rng.sample(range(len(words)), min(evidence, len(words)))):
        w = rng.choice([w for w in WORDS if w != w[::-1]])
        words[pos] = w if vote else w[::-1]
    label = int(sum(votes) * 2 > len(votes))
    return " ".join(words).encode()[:max_bytes], label


KEYS = tuple("AMBER BASALT CEDAR DELTA EMBER FJORD GRANITE HARBOR IVORY JASPER KELP LOTUS MAPLE NECTAR OPAL "
             "QUARTZ".split())


def _with_keys(rng: random.Random, n_bytes: int, keys: List[str]) -> bytes:
    """A document of about ``n_bytes`` (never more) with ``keys`` in this order at random word places."""
    longest = max(len(w) for w in WORDS) + 1          # _document overshoots by at most one word
    words = _document(rng, n_bytes - sum(len(k) + 1 for k in keys) - longest)
    for k, pos in zip(keys, sorted(rng.sample(range(len(words) + len(keys)), len(keys)))):
        words.insert(pos, k)
    return " ".join(words).encode()


def retrieval_standin(rng: random.Random, min_bytes: int, max_bytes: int, keys: int = 8) -> Tuple[bytes, bytes, int]:
    """One Retrieval* pair and its label (see the module docstring)."""
    label = rng.randrange(2)
    first = rng.sample(KEYS, keys)
    second = list(first)
    if not label:
        i, j = rng.sample(range(keys), 2)
        second[i], second[j] = second[j], second[i]
    return (_with_keys(rng, rng.randint(min_bytes, max_bytes), first),
            _with_keys(rng, rng.randint(min_bytes, max_bytes), second), label)


def key_order(doc: bytes) -> List[bytes]:
    """The key words of a Retrieval* document, in order (the label's ground truth)."""
    keys = {k.encode() for k in KEYS}
    return [w for w in doc.split() if w in keys]


CHUNK = 1000


def _standin_chunk(job) -> List[Tuple]:
    kind, seed, index, n, min_bytes, max_bytes = job
    rng = random.Random(f"{kind}:{seed}:{index}")
    make = text_standin if kind == "text" else retrieval_standin
    return [make(rng, min_bytes, max_bytes) for _ in range(n)]


def standin_split(kind: str, seed: int, n: int, min_bytes: int, max_bytes: int, workers: int = 1) -> List[Tuple]:
    """``n`` Text* documents ``(bytes, label)`` or Retrieval* pairs ``(bytes, bytes, label)``, drawn in
    seeded chunks so the result does not depend on ``workers``."""
    from .cache import parallel_map
    jobs = [(kind, seed, i, min(CHUNK, n - i * CHUNK), min_bytes, max_bytes) for i in range(-(-n // CHUNK))]
    return [row for chunk in parallel_map(_standin_chunk, jobs, workers) for row in chunk]


def unigram_baseline_inputs(docs: Sequence[bytes]) -> np.ndarray:
    """Byte histograms ``(N, 256)``, normalized (the "bag of bytes" baseline the stand-ins defeat)."""
    h = np.stack([np.bincount(np.frombuffer(d, dtype=np.uint8), minlength=256) for d in docs]).astype(float)
    return h / np.maximum(h.sum(1, keepdims=True), 1)
