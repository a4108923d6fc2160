"""Dense candidates: the query chunks' stored embeddings searched in the FAISS index (RETRO §2.3).

The embeddings, the index and its search (`retrieval/index.py` `search`: `fetch` nearest ids,
optionally re-ranked by exact distance, optionally only among `allowed` ids) are the dense build's
own; this adapter only walks them shard by shard for `query_neighbours`.
"""

from __future__ import annotations

from typing import Callable, Iterable, Iterator

import numpy as np

from retropipe.retrieval import RetrievalError
from retropipe.retrieval.index import search


class DenseSearch:
    """Candidates of a query store's chunks from their embeddings (a retrieval.embed_job.Embeddings)."""

    def __init__(self, index, query_emb, fetch: int, rows: Callable[[np.ndarray], np.ndarray] | None = None,
                 allowed: np.ndarray | None = None):
        self.index, self.query_emb, self.rows, self.allowed = index, query_emb, rows, allowed
        self.fetch = min(fetch, index.ntotal)

    def of(self, vectors: np.ndarray) -> np.ndarray:
        """(q, fetch) database ids of query vectors (q, d), nearest first, -1 = none."""
        return search(self.index, vectors, self.fetch, self.rows, self.allowed)

    def shard(self, split: str, i: int, n: int) -> np.ndarray:
        """(n, d) float32: the embeddings of query shard i, checked against the store's shard size."""
        x = self.query_emb.shard(split, i)
        if len(x) != n:
            raise RetrievalError(f"{self.query_emb.shard_path(split, i)}: {len(x)} embeddings for a shard of {n} "
                                 f"chunks; the embeddings are of another chunk store: run launch/build_index.py again")
        return x

    def candidates(self, split: str, shards: Iterable[tuple[int, int, int]]) -> Iterator[tuple]:
        """(i, first, n, (n, fetch) ids) per query shard (i, first, n), in order."""
        for i, first, n in shards:
            yield i, first, n, self.of(self.shard(split, i, n))
