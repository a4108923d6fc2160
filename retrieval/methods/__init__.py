"""Retrieval methods (`retrieval.method`): how a query chunk's candidate database ids are ranked.

    METHODS                          # ("dense", "bm25", "hybrid"), checked by RetrievalConfig
    method_of(database.manifest)     # the method a built database was built with (its database.json)
    embeds(method), lexical(method)  # the stages it needs: embeddings + FAISS index; a BM25 index
    method_search(method, dense, bm25)

A method ends in a *search* for one query chunk store: `search.candidates(split, shards)` yields,
for each query shard (i, first chunk id, n) asked for, in any order, `(i, first, n, candidates)`
with candidates (n, C) database ids ranked best first, -1 = none. `query_neighbours`
(retrieval/neighbour_search.py) passes them through `select_neighbours`, so the no-leak rules are
the same for every method. The modules:

    dense.py   DenseSearch: FAISS over the chunk embeddings, as RETRO retrieves
    bm25.py    the BM25 index stage (`build_bm25`, `open_bm25`), `bm25_candidates`, Bm25Search
    hybrid.py  `rrf`: reciprocal rank fusion of the dense and BM25 lists; HybridSearch

A database records its method in database.json (a database of an older RetroPipe has none: dense).
Evaluation and generation read it there, not from the config, so `--database OTHER` searches OTHER
the way it was built.
"""

from __future__ import annotations

METHODS = ("dense", "bm25", "hybrid")


def method_of(database_manifest: dict) -> str:
    """The method recorded in a database.json (as a dict); dense where none is (built before the key)."""
    return database_manifest.get("method", "dense")


def embeds(method: str) -> bool:
    """Whether the method needs chunk embeddings and the FAISS index."""
    return method in ("dense", "hybrid")


def lexical(method: str) -> bool:
    """Whether the method needs the BM25 index."""
    return method in ("bm25", "hybrid")


def method_search(method: str, dense=None, bm25=None):
    """The search of `method` from its parts: a DenseSearch, a Bm25Search, or both fused."""
    if method == "dense":
        return dense
    if method == "bm25":
        return bm25
    from retropipe.retrieval.methods.hybrid import HybridSearch

    return HybridSearch(dense, bm25)
