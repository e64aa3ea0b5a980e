"""Text filters for prompts a model wrote itself: normalization, exact and near duplicates (MinHash over word
shingles, confirmed by their exact Jaccard similarity), degenerate text, and overlap with evaluation prompts.

    keep = NearDuplicates(threshold=0.7)
    keep.add("Write a poem about the sea.")           # True: new
    keep.add("write a poem about the sea!")           # False: the same words
    looping("the cat the cat the cat the cat")        # True
    Contamination(["How do I sort a list?"]).hits("how do I sort a list in Python?")  # True: 5 shared words in order
"""

from __future__ import annotations

import hashlib
import re
from collections import defaultdict
from collections.abc import Iterable

import numpy as np

__all__ = ["Contamination", "NearDuplicates", "jaccard", "looping", "normalize", "shingles", "words"]

_WORD = re.compile(r"\w+", re.UNICODE)
_PRIME = (1 << 31) - 1  # a Mersenne prime: MinHash's modulus


def normalize(text: str) -> str:
    """Lower case, words only, single spaces: what makes two prompts "the same"."""
    return " ".join(words(text))


def words(text: str) -> list[str]:
    return _WORD.findall(text.lower())


def shingles(text: str, n: int = 3) -> set[str]:
    """The word n-grams of ``text`` (the whole text as one when it has fewer than n words)."""
    w = words(text)
    if len(w) < n:
        return {" ".join(w)} if w else set()
    return {" ".join(w[i:i + n]) for i in range(len(w) - n + 1)}


def jaccard(a: set[str], b: set[str]) -> float:
    return len(a & b) / len(a | b) if a or b else 1.0


def looping(text: str, n: int = 3, min_distinct: float = 0.5) -> bool:
    """Whether ``text`` repeats itself: fewer than ``min_distinct`` of its word n-grams are distinct (a model stuck in
    a loop), or one word makes up more than half of a text of ten words or more."""
    w = words(text)
    grams = [tuple(w[i:i + n]) for i in range(len(w) - n + 1)]
    if len(grams) >= 4 and len(set(grams)) < min_distinct * len(grams):
        return True
    if len(w) >= 10:
        counts: dict[str, int] = defaultdict(int)
        for x in w:
            counts[x] += 1
        return max(counts.values()) > len(w) / 2
    return False


def _hash64(item: str) -> int:
    return int.from_bytes(hashlib.blake2b(item.encode(), digest_size=8).digest(), "little")


class NearDuplicates:
    """Texts seen so far; :meth:`add` says whether a text is new: not the same words as one seen, and not a near
    duplicate (Jaccard similarity of word 3-gram sets at or above ``threshold``). MinHash signatures (``bands`` x
    ``rows`` values) banded into buckets find the candidates; each candidate is confirmed by its exact Jaccard
    similarity, so a kept text is never a near duplicate that the buckets happened to catch (it may, rarely, be one
    they missed: a pair at the threshold shares a bucket with probability 1 - (1 - t^rows)^bands, 0.99 at 0.7)."""

    def __init__(self, threshold: float = 0.7, bands: int = 16, rows: int = 4, seed: int = 0):
        if not 0 < threshold <= 1:
            raise ValueError(f"near-duplicate threshold must be in (0, 1], not {threshold}")
        self.threshold, self.bands, self.rows = threshold, bands, rows
        rng = np.random.default_rng(seed)
        self._a = rng.integers(1, _PRIME, size=bands * rows, dtype=np.uint64)
        self._b = rng.integers(0, _PRIME, size=bands * rows, dtype=np.uint64)
        self._exact: set[str] = set()
        self._sets: list[set[str]] = []
        self._buckets: dict[tuple[int, bytes], list[int]] = defaultdict(list)

    def _signature(self, grams: set[str]) -> np.ndarray:
        """The MinHash signature: per hash function (a*x + b) mod p, x a shingle's hash, minimized over shingles;
        a, b, x < p = 2^31 - 1, so a*x + b stays within 64 bits."""
        x = np.array([_hash64(g) % _PRIME for g in grams], dtype=np.uint64)[:, None]
        return ((self._a[None, :] * x + self._b[None, :]) % np.uint64(_PRIME)).min(axis=0)

    def add(self, text: str) -> bool:
        key = normalize(text)
        if key in self._exact:
            return False
        grams = shingles(text)
        if not grams:
            return False
        signature = self._signature(grams)
        keys = [(band, signature[band * self.rows:(band + 1) * self.rows].tobytes()) for band in range(self.bands)]
        candidates = {i for k in keys for i in self._buckets.get(k, ())}
        if any(jaccard(grams, self._sets[i]) >= self.threshold for i in candidates):
            return False
        index = len(self._sets)
        self._exact.add(key)
        self._sets.append(grams)
        for k in keys:
            self._buckets[k].append(index)
        return True


class Contamination:
    """Evaluation prompts a training prompt must not overlap: it shares a word ``n``-gram with one (``n`` = 8, or
    the evaluation prompt's whole text when shorter), or has the same words."""

    def __init__(self, texts: Iterable[str], n: int = 8):
        self.n = n
        self._grams: set[str] = set()
        self._short: set[str] = set()
        for text in texts:
            w = words(text)
            if len(w) < n:
                self._short.add(" ".join(w))
            else:
                self._grams.update(" ".join(w[i:i + n]) for i in range(len(w) - n + 1))

    def hits(self, text: str) -> bool:
        w = words(text)
        joined = " ".join(w)
        if joined in self._short or any(s and f" {s} " in f" {joined} " for s in self._short if len(s.split()) >= 4):
            return True
        return any(" ".join(w[i:i + self.n]) in self._grams for i in range(len(w) - self.n + 1))
