"""NearDuplicates: MinHash with LSH banding, to find rows whose text nearly repeats an earlier
row's, in one pass and in input order (so a rerun finds exactly the same ones).

    dedup = NearDuplicates(threshold=0.8)
    dedup.first_seen("the cat sat on the mat", row=0)    # None: new
    dedup.first_seen("The cat sat on the mat!", row=1)   # 0: a near-duplicate of row 0

A text is the set of its word 3-grams (lower-cased, punctuation dropped); two texts match when
the estimated Jaccard similarity of those sets is at least `threshold`. Each text gets a MinHash
signature of `num_perm` values (one universal hash per permutation over a 64-bit blake2b of each
shingle, as datasketch's MinHash); the signature is cut into bands whose width puts the LSH
curve's midpoint at the threshold, rows sharing a band are candidates, and a candidate counts
only when its signatures agree on at least `threshold` of their values.

NOTE: why MinHash and not semhash: semhash embeds with a model from the Hugging Face hub, which a
pool's CLI host may not reach; MinHash needs nothing and is exact enough for the near-verbatim
repeats (boilerplate, scraped copies) that waste a batch job's tokens. Memory: one signature of
`num_perm` uint32 per row kept (512 B at 128), plus the band tables.
"""

from __future__ import annotations

import hashlib
import re

import numpy as np

__all__ = ["NearDuplicates"]

_MERSENNE = np.uint64((1 << 61) - 1)
_MAX_HASH = np.uint64((1 << 32) - 1)
_WORD = re.compile(r"\w+")
SHINGLE_WORDS = 3


def _bands(threshold: float, num_perm: int) -> tuple[int, int]:
    """(bands, rows per band) with the LSH curve's midpoint (1/b)^(1/r) nearest the threshold."""
    best = (1, num_perm)
    best_gap = float("inf")
    for rows in range(1, num_perm + 1):
        bands = num_perm // rows
        gap = abs((1 / bands) ** (1 / rows) - threshold)
        if gap < best_gap:
            best, best_gap = (bands, rows), gap
    return best


class NearDuplicates:
    def __init__(self, threshold: float = 0.8, num_perm: int = 128, seed: int = 1) -> None:
        if not 0 < threshold <= 1:
            raise ValueError(f"threshold must be in (0, 1], got {threshold}")
        self.threshold = threshold
        self.num_perm = num_perm
        generator = np.random.default_rng(seed)
        self._a = generator.integers(1, int(_MERSENNE), num_perm, dtype=np.uint64)
        self._b = generator.integers(0, int(_MERSENNE), num_perm, dtype=np.uint64)
        self.num_bands, self.band_rows = _bands(threshold, num_perm)
        self._tables: list[dict[bytes, list[int]]] = [{} for _ in range(self.num_bands)]
        self._signatures: dict[int, np.ndarray] = {}  # row -> signature of a row kept
        self.num_duplicates = 0

    def signature(self, text: str) -> np.ndarray:
        words = _WORD.findall(text.lower())
        shingles = {" ".join(words[i:i + SHINGLE_WORDS])
                    for i in range(max(1, len(words) - SHINGLE_WORDS + 1))}
        hashes = np.array([int.from_bytes(hashlib.blake2b(s.encode(), digest_size=8).digest(),
                                          "little") & 0xFFFFFFFF for s in shingles],
                          dtype=np.uint64)  # [num_shingles]
        # NOTE: uint64 products wrap, as in datasketch: the permutations stay deterministic.
        with np.errstate(over="ignore"):
            permuted = (np.outer(hashes, self._a) + self._b) % _MERSENNE & _MAX_HASH
        return permuted.min(axis=0).astype(np.uint32)  # [num_perm]

    def first_seen(self, text: str, row: int) -> int | None:
        """The earlier row `text` nearly repeats, or None (and the row is remembered)."""
        signature = self.signature(text)
        keys = [signature[i * self.band_rows:(i + 1) * self.band_rows].tobytes()
                for i in range(self.num_bands)]
        candidates: set[int] = set()
        for table, key in zip(self._tables, keys, strict=True):
            candidates.update(table.get(key, ()))
        for earlier in sorted(candidates):
            if float(np.mean(self._signatures[earlier] == signature)) >= self.threshold:
                self.num_duplicates += 1
                return earlier
        self._signatures[row] = signature
        for table, key in zip(self._tables, keys, strict=True):
            table.setdefault(key, []).append(row)
        return None
