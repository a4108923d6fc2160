"""Hybrid candidates: the dense and the BM25 lists fused by reciprocal rank (`retrieval.method: hybrid`).

Reciprocal rank fusion (Cormack, Clarke & Büttcher, SIGIR 2009): an id's fused score is the sum of
1 / (RRF_K + rank) over the lists that hold it (rank 1 = best). It needs no calibration between a
cosine distance and a BM25 score, which live on unrelated scales, and an id high in both lists
beats one at the top of only one. Each list is `retrieval.candidates` long; the fused list keeps
every id of either (up to twice that), so the exclusions that follow lose no survivor to the cut.
"""

from __future__ import annotations

from typing import Iterable, Iterator

import numpy as np

RRF_K = 60  # the paper's constant: damps the weight of the very first ranks; unchanged since


def rrf(dense: np.ndarray, lexical: np.ndarray, k: int = RRF_K) -> np.ndarray:
    """(n, a) and (n, b) ranked database ids (-1 = none) → (n, max(a, b) · 2) ids by fused score,
    best first, -1 pads. Ties go to the id met first when the lists are read rank by rank, the dense
    list first at each rank."""
    n, width = len(dense), max(dense.shape[1], lexical.shape[1])
    pad = lambda a: np.pad(a, ((0, 0), (0, width - a.shape[1])), constant_values=-1)  # noqa: E731
    ids = np.stack([pad(dense), pad(lexical)], axis=2).reshape(n, 2 * width)          # (n, 2W): d1 l1 d2 l2 ...
    rank = np.repeat(np.arange(1, width + 1), 2)                                       # (2W,)
    share = np.where(ids >= 0, 1.0 / (k + rank), 0.0)                                 # (n, 2W)
    same = ids[:, :, None] == ids[:, None, :]                                         # (n, 2W, 2W)
    score = (same * share[:, None, :]).sum(-1)                                        # (n, 2W): each entry's id's sum
    earlier = np.tril(np.ones((2 * width, 2 * width), dtype=bool), -1)                # [j, i]: i before j
    listed_before = (same & earlier).any(-1)                                          # (n, 2W): a second mention
    score = np.where((ids >= 0) & ~listed_before, score, -np.inf)
    order = np.argsort(-score, axis=1, kind="stable")                                 # stable: reading order breaks ties
    return np.where(np.take_along_axis(score, order, 1) > -np.inf, np.take_along_axis(ids, order, 1), -1)


class HybridSearch:
    """A DenseSearch and a Bm25Search of the same query store, fused by `rrf`."""

    def __init__(self, dense, bm25):
        self.dense, self.bm25 = dense, bm25

    def of(self, vectors: np.ndarray, texts: list[str]) -> np.ndarray:
        """(q, C) fused candidates of new texts and their embeddings (q, d)."""
        return rrf(self.dense.of(vectors), self.bm25.of_texts(texts))

    def candidates(self, split: str, shards: Iterable[tuple[int, int, int]]) -> Iterator[tuple]:
        """(i, first, n, (n, C) fused ids) per query shard, as the BM25 tasks finish."""
        for i, first, n, lexical in self.bm25.candidates(split, shards):
            yield i, first, n, rrf(self.dense.of(self.dense.shard(split, i, n)), lexical)
