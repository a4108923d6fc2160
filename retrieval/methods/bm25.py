"""BM25 candidates (`retrieval.method: bm25`, and half of `hybrid`), with the bm25s library.

**Terms.** A chunk is decoded to text as it is for embedding (`chunk_texts`: padding and
end-of-text dropped) and split by bm25s's own tokenizer: lowercased words of two or more word
characters, English stopwords removed, no stemmer (bm25s's PyStemmer, numba and jax extras are not
needed). GPT-2 token ids as terms were measured against it on the demo database: the same share of
validation chunks whose top neighbour lines up (data/reading.py; 78.6% either way, dense 72.9%),
but twice the postings (" the", "," in most chunks; "The" and " the" kept apart), so queries 4×
slower. **Scoring**: bm25s's defaults, written out in PARAMS (Lucene's BM25, k1 1.5, b 0.75).

**The index stage**, `<retrieval_dir>/bm25/`:

    index/          bm25s's `save`: the CSC score matrix as .npy (np.save, allow_pickle=False; loaded
                    memory-mapped), vocab.index.json, params.index.json; written as index.tmp/, renamed
    inputs.json     the database's parts (names, chunk-store fingerprints, offsets), TERMS, PARAMS
    manifest.json   + documents, vocabulary, postings, sha256 per file, seconds, fingerprint

The index covers every database chunk in database-id order (part 0, the training split, then the
corpora). It is one work unit, built in the driver: bm25s computes document frequencies over the
whole corpus in one object, so sharding it through the Executor would mean rewriting its index
build. It is linear in the chunks: under a second at the demo's 14k (decode 0.1 s, words 0.3 s,
index 0.4 s), so ~10 minutes and a few GB of driver memory at 10^7 (extrapolated, not measured).

**Queries** run through the build's Executor (Ray tasks from launch/build_index.py), one task per
query shard (`shard_candidates`; each worker loads the index once, memory-mapped). A query sums the
postings of its words over every database chunk and selects the top `fetch`: ~0.1 ms at 14k
chunks; linear in the database, ~70 ms at 10^7, so 10^7 queries want ~7·10^5 CPU-seconds (a cluster).
"""

from __future__ import annotations

import functools
import os
import shutil
import time
from pathlib import Path
from typing import Iterable, Iterator

import numpy as np

from retropipe.data.errors import BUILD_DATABASE
from retropipe.data.stage import Executor, fingerprint, open_stage, read_json, serial_executor, sha256_file, write_json
from retropipe.data.store import ChunkStore
from retropipe.data.tokenizer import get_tokenizer
from retropipe.retrieval import RetrievalError
from retropipe.retrieval.embed_job import chunk_texts

VERSION = 1
# What a term is (see the module docstring); a new rule must change this name.
TERMS = "bm25s.tokenize: lowercase, \\w\\w+, English stopwords, no stemmer"
PARAMS = {"method": "lucene", "k1": 1.5, "b": 0.75}
INDEX_DIR = "index"


def chunk_terms(texts: list[str]) -> list[list[str]]:
    """Each text's terms, in order, repeats kept (a query's repeated word counts each time, as in bm25s)."""
    import bm25s

    return bm25s.tokenize(texts, lower=True, stopwords="en", return_ids=False, show_progress=False)


def store_texts(store: ChunkStore, split: str, first: int, n: int) -> list[str]:
    """The texts of chunks [first, first + n) of a split, decoded as the embedder reads them."""
    chunks, ids = store.split(split), np.arange(first, first + n)
    return chunk_texts(chunks.tokens(ids), chunks.lengths[ids], get_tokenizer(store.manifest["tokenizer"]), store.eot_id)


def database_terms(database) -> tuple[list[list[int]], dict[str, int]]:
    """(term ids of every database chunk in database-id order, vocabulary {word: term id}). Decoded
    one chunk-store shard at a time (texts of one shard in memory); ids in order of first
    appearance, so the saved index is the same bytes on every build."""
    vocab: dict[str, int] = {}
    ids: list[list[int]] = []
    for part in database.parts:
        first = 0
        for n in part.store.manifest["shard_chunks"]["train"]:
            for words in chunk_terms(store_texts(part.store, "train", first, n)):
                ids.append([vocab.setdefault(w, len(vocab)) for w in words])
            first += n
    return ids, vocab


def bm25_inputs(database) -> dict:
    """What the index is built from: the chunks (parts, in id order) and the rules, not the database's
    method or embedder, so the bm25 and hybrid databases of one workdir share one index."""
    return {"version": VERSION, "parts": [[p["name"], p["fingerprint"], p["offset"]] for p in database.manifest["parts"]],
            "terms": TERMS, **PARAMS}


def build_bm25(database, out_dir: Path) -> dict:
    """The BM25 index over every chunk of the database (skipped when complete); its manifest."""
    import bm25s

    out_dir = Path(out_dir)
    inputs = bm25_inputs(database)
    manifest = open_stage(out_dir, inputs)
    if manifest is not None:
        return {**manifest, "skipped": True}
    begin = time.perf_counter()
    ids, vocab = database_terms(database)
    if not vocab:
        raise RetrievalError(f"the database at {database.root} holds no word BM25 can index "
                             f"({TERMS}); use retrieval.method: dense")
    model = bm25s.BM25(**PARAMS)
    model.index((ids, vocab), create_empty_token=False, show_progress=False)
    tmp, final = out_dir / (INDEX_DIR + ".tmp"), out_dir / INDEX_DIR
    for stale in (tmp, final):  # a crash before the manifest: rebuilt whole (the unit of work)
        shutil.rmtree(stale, ignore_errors=True)
    model.save(tmp, show_progress=False)
    os.replace(tmp, final)
    files = sorted(p.name for p in final.iterdir())
    manifest = {"version": VERSION, "inputs": inputs, "documents": len(ids), "vocabulary": len(vocab),
                "postings": int(len(model.scores["data"])), "bm25s": bm25s.__version__, "files": files,
                "sha256": {f: sha256_file(final / f) for f in files},
                "seconds": round(time.perf_counter() - begin, 2)}
    manifest["fingerprint"] = fingerprint({"inputs": inputs, "sha256": manifest["sha256"]})
    write_json(out_dir / "manifest.json", manifest)
    return manifest


@functools.lru_cache(maxsize=2)
def _load(index_dir: str, index_fingerprint: str, documents: int):
    """The saved index, arrays memory-mapped; once per process (a Ray worker runs many shards)."""
    import bm25s

    try:
        model = bm25s.BM25.load(index_dir, mmap=True, show_progress=False)
    except (OSError, ValueError, KeyError) as e:
        raise RetrievalError(f"{index_dir}: unreadable BM25 index ({e}); delete {Path(index_dir).parent} "
                             f"and run {BUILD_DATABASE}") from None
    if model.scores["num_docs"] != documents:
        raise RetrievalError(f"{index_dir}: holds {model.scores['num_docs']} chunks, its manifest says {documents}; "
                             f"delete {Path(index_dir).parent} and run {BUILD_DATABASE}")
    return model


def open_bm25(out_dir: Path) -> tuple[dict, object]:
    """(manifest, bm25s.BM25) of a built index directory (`<retrieval_dir>/bm25`)."""
    manifest = read_json(Path(out_dir) / "manifest.json", rerun=f"run {BUILD_DATABASE}")
    if manifest is None:
        raise RetrievalError(f"no BM25 index at {out_dir} (missing manifest.json); build it: {BUILD_DATABASE}")
    return manifest, _load(str((Path(out_dir) / INDEX_DIR).resolve()), manifest["fingerprint"], manifest["documents"])


def top_ids(scores: np.ndarray, fetch: int) -> np.ndarray:
    """(fetch,) int64: the ids of the `fetch` highest positive scores (N,), best first, ties to the
    lower id; -1 pads (a chunk sharing no word with the query is no candidate). Exact in O(N)."""
    take = min(fetch, len(scores))
    kth = np.partition(scores, len(scores) - take)[len(scores) - take]   # the take-th highest score
    above = np.flatnonzero(scores > kth)
    top = np.concatenate([above, np.flatnonzero(scores == kth)[:take - len(above)]])
    top = top[np.lexsort((top, -scores[top]))]
    top = top[scores[top] > 0]
    return np.concatenate([top, np.full(fetch - len(top), -1)]).astype(np.int64)


def bm25_candidates(model, terms: list[list[str]], fetch: int, mask: np.ndarray | None = None) -> np.ndarray:
    """(len(terms), fetch) int64 database ids by BM25 score, best first, -1 = none. mask (N,) float32:
    1 for the ids that may be returned (a database subset), None for all."""
    out = np.full((len(terms), fetch), -1, dtype=np.int64)
    for row, words in enumerate(terms):
        term_ids = model.get_tokens_ids(words)                 # words the database never holds drop out
        if term_ids:
            out[row] = top_ids(model.get_scores_from_ids(term_ids, weight_mask=mask), fetch)
    return out


@functools.lru_cache(maxsize=4)
def _store(root: str, store_fingerprint: str) -> ChunkStore:
    store = ChunkStore(root)
    if store.fingerprint != store_fingerprint:
        raise RetrievalError(f"chunk store {root} changed while its neighbours were computed; run {BUILD_DATABASE}")
    return store


def shard_candidates(index_dir: str, index_fingerprint: str, documents: int, store_root: str, store_fingerprint: str,
                     split: str, first: int, n: int, fetch: int, mask: np.ndarray | None) -> tuple[int, np.ndarray]:
    """One query shard's candidates: (first, (n, fetch) ids). The Executor's unit (a Ray task, or in-process)."""
    texts = store_texts(_store(store_root, store_fingerprint), split, first, n)
    return first, bm25_candidates(_load(index_dir, index_fingerprint, documents), chunk_terms(texts), fetch, mask)


class Bm25Search:
    """BM25 candidates of new texts (`of_texts`) or of a query store's shards (`candidates`)."""

    def __init__(self, index_dir: Path, store: ChunkStore | None, fetch: int, allowed: np.ndarray | None = None,
                 executor: Executor = serial_executor, workers: int = 2):
        self.manifest, self.model = open_bm25(index_dir)
        self.index_dir = str((Path(index_dir) / INDEX_DIR).resolve())  # absolute: a task may run on another node
        self.store, self.executor, self.workers = store, executor, workers
        self.fetch = min(fetch, self.manifest["documents"])
        self.mask = None
        if allowed is not None:  # the ids of a smaller database inside this one (database_subset)
            self.mask = np.zeros(self.manifest["documents"], dtype=np.float32)
            self.mask[allowed] = 1.0

    def of_texts(self, texts: list[str]) -> np.ndarray:
        """(len(texts), fetch) database ids, best first, -1 = none."""
        return bm25_candidates(self.model, chunk_terms(texts), self.fetch, self.mask)

    def candidates(self, split: str, shards: Iterable[tuple[int, int, int]]) -> Iterator[tuple]:
        """(i, first, n, (n, fetch) ids) per query shard (i, first, n) of the store, as the tasks finish."""
        where = {first: (i, n) for i, first, n in shards}
        jobs = [(self.index_dir, self.manifest["fingerprint"], self.manifest["documents"], str(self.store.root.resolve()),
                 self.store.fingerprint, split, first, n, self.fetch, self.mask) for first, (i, n) in where.items()]
        for first, found in self.executor(shard_candidates, jobs, self.workers):
            i, n = where[first]
            yield i, first, n, found
