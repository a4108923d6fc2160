"""Top-k neighbours of chunks from the database index, without leaks (RETRO §2.3, §2.6).

Each query fetches `retrieval.candidates` nearest chunks and keeps the first k that survive:
  - no chunk of a document whose text equals that of a document the query must not see: for a
    training chunk, any document of its training sequence (chunks [s·L, (s+1)·L), L = seq_len /
    chunk_len), its own included; for any other chunk, its own document. Documents are compared
    by their normalised text's hash (data.chunking.text_hash), so an exact copy of a document,
    in the training split or in a further corpus, is excluded like the document itself;
  - no second copy of a neighbour already kept (the same chunk of two identical documents);
Fewer than k survivors are padded with -1 (never wrapped to some other chunk).

Layout of `<retrieval_dir>/neighbours/` (and of any other neighbours directory):
    parts/<split>/shard-NNNNN.npy   per query shard (resume unit)
    <split>.npy                     (num_chunks, k) int64 database ids, -1 = missing
    manifest.json                   method; chunk store, database, embeddings and index fingerprints; k; L; counts
Which candidates a query fetches is the method's (retrieval/methods/); the rules here are every method's.
"""

from __future__ import annotations

import shutil
import time
from pathlib import Path

import numpy as np

from retropipe.data.chunking import SPLITS
from retropipe.data.database_reader import Database
from retropipe.data.stage import fingerprint, load_npy, open_stage, save_npy, sha256_file, write_json
from retropipe.data.store import ChunkStore
from retropipe.retrieval.index import search

MANIFEST_VERSION = 2  # 2: database ids, exclusion by document text hash
_MIX = np.uint64(0x9E3779B97F4A7C15)  # spreads chunk positions over 64 bits before the xor


def excluded_hashes(text_hashes: np.ndarray, query_ids: np.ndarray, chunks_per_seq: int | None) -> np.ndarray:
    """Document text hashes each query may not retrieve from: (n, g) uint64, padded with 0.

    text_hashes: (c,) the query split's per-chunk document hashes. chunks_per_seq=None: the
    query's own document only (g = 1); else every document of its training sequence (g = L).
    """
    if chunks_per_seq is None:
        return text_hashes[query_ids][:, None]
    seq_chunks = (query_ids // chunks_per_seq)[:, None] * chunks_per_seq + np.arange(chunks_per_seq)  # (n, L)
    inside = seq_chunks < len(text_hashes)  # the last, partial sequence
    return np.where(inside, text_hashes[np.minimum(seq_chunks, len(text_hashes) - 1)], np.uint64(0))


def select_neighbours(candidates: np.ndarray, db_hashes: np.ndarray, db_positions: np.ndarray,
                      excluded: np.ndarray, k: int) -> np.ndarray:
    """First k allowed candidates per row, in rank order: (n, k) int64, -1 where fewer survive.

    candidates (n, C) database ids from FAISS (-1 = none); db_hashes / db_positions (N,) each
    database chunk's document text hash and index within its document; excluded (n, g) forbidden
    document hashes per row (0 = padding).
    """
    safe = np.maximum(candidates, 0)
    cand_hash = db_hashes[safe]                                                    # (n, C)
    present = candidates >= 0
    forbidden = (cand_hash[:, :, None] == excluded[:, None, :]).any(-1) & present  # (n, C)
    allowed = present & ~forbidden
    # The same chunk of two identical documents: keep the better-ranked copy only.
    key = cand_hash ^ (db_positions[safe].astype(np.uint64) * _MIX)
    C = candidates.shape[1]
    earlier = np.tril(np.ones((C, C), dtype=bool), -1)                             # [j, i]: i < j
    repeated = ((key[:, :, None] == key[:, None, :]) & earlier & allowed[:, None, :]).any(-1)
    allowed &= ~repeated
    # Stable sort puts allowed candidates first, keeping their rank order.
    order = np.argsort(~allowed, axis=1, kind="stable")[:, :k]
    picked = np.take_along_axis(candidates, order, 1)
    ok = np.take_along_axis(allowed, order, 1)
    out = np.where(ok, picked, -1).astype(np.int64)
    if out.shape[1] < k:  # fewer candidates than k at all (a tiny database)
        out = np.concatenate([out, np.full((len(out), k - out.shape[1]), -1, np.int64)], 1)
    return out


def find_neighbours(index, database: Database, queries: np.ndarray, excluded: np.ndarray, k: int, fetch: int,
                    rows=None, allowed: np.ndarray | None = None) -> np.ndarray:
    """Search then select: (n, k) database ids, -1 = missing (see select_neighbours)."""
    candidates = search(index, queries, min(fetch, index.ntotal), rows, allowed)      # (n, C)
    return select_neighbours(candidates, database.text_hashes, database.positions, excluded, k)


def documents_with_copies(store: ChunkStore, split: str, database: Database) -> int:
    """Documents of the split whose exact text (another document than themselves) is in the database:
    their chunks never retrieve it, and the count is reported rather than hidden."""
    docs = store.documents
    mine = docs.column("text_hash").to_numpy()[np.asarray(docs.column("split").to_pylist()) == split]
    db_docs, counts = np.unique(database.document_hashes, return_counts=True)
    if not len(db_docs):
        return 0
    pos = np.minimum(np.searchsorted(db_docs, mine), len(db_docs) - 1)
    occurrences = np.where(db_docs[pos] == mine, counts[pos], 0)
    own = 1 if split == "train" and store.fingerprint == database.parts[0].store.fingerprint else 0
    return int((occurrences - own > 0).sum())


def neighbour_quality(ids: np.ndarray, database: Database) -> dict:
    """Counts for a manifest: missing ids, chunks short of k, kept neighbours without a continuation."""
    missing = ids < 0
    present = ~missing
    no_continuation = present & (database.continuation[np.maximum(ids, 0)] < 0)
    return {"num_chunks": int(len(ids)), "missing": int(missing.sum()),
            "chunks_short_of_k": int(missing.any(1).sum()) if ids.size else 0,
            "without_continuation": int(no_continuation.sum())}


def query_neighbours(search, store: ChunkStore, database: Database, out_dir: Path, inputs: dict, k: int,
                     candidates: int, chunks_per_seq: int | None, splits=SPLITS, progress=None,
                     method: str = "dense") -> dict:
    """Neighbours of every chunk of the splits of `store` (resumable per query shard); return the manifest.

    search: the method's search of this store (retrieval/methods/: `candidates(split, shards)`).
    chunks_per_seq applies the training-sequence rule to the "train" split (None: own document only,
    e.g. a held-out corpus). `candidates` and `method` are recorded in the manifest.
    """
    manifest = open_stage(out_dir, inputs)
    if manifest is not None:
        return {**manifest, "skipped": True}
    counts, begin, queried = {}, time.perf_counter(), 0
    for split in splits:
        parts_dir = out_dir / "parts" / split
        parts_dir.mkdir(parents=True, exist_ok=True)
        hashes = store.text_hashes(split)
        rule = chunks_per_seq if split == "train" else None
        sizes = store.manifest["shard_chunks"][split]                 # query shards = the store's shards
        starts = np.cumsum([0] + sizes)
        parts = [parts_dir / f"shard-{i:05d}.npy" for i in range(len(sizes))]
        todo = [(i, int(starts[i]), n) for i, n in enumerate(sizes) if not parts[i].exists()]
        for i, _, _ in (t for t in todo if t[2] == 0):
            save_npy(parts[i], np.zeros((0, k), np.int64))
        for i, first, n, found in search.candidates(split, [t for t in todo if t[2]]):
            excluded = excluded_hashes(hashes, np.arange(first, first + n), rule)
            save_npy(parts[i], select_neighbours(found, database.text_hashes, database.positions, excluded, k))
            queried += n
            if progress:
                progress(n)
        final = out_dir / f"{split}.npy"
        whole = np.concatenate([load_npy(p, mmap=False) for p in parts]) if parts else np.zeros((0, k), np.int64)
        save_npy(final, whole)
        counts[split] = {**neighbour_quality(whole, database), "sha256": sha256_file(final),
                         "documents_with_copies_in_database": documents_with_copies(store, split, database)}
    seconds = time.perf_counter() - begin
    manifest = {"version": MANIFEST_VERSION, "inputs": inputs, "method": method, "k": k, "candidates": candidates,
                "chunks_per_seq": chunks_per_seq, "chunk_store_fingerprint": store.fingerprint,
                "database": _relative(database.root, out_dir), "database_absolute": str(database.root.resolve()),
                "database_fingerprint": database.fingerprint, "splits": counts,
                "run": {"seconds": round(seconds, 2), "chunks_queried": queried,
                        "chunks_per_second": round(queried / max(seconds, 1e-9), 1)}}
    manifest["fingerprint"] = fingerprint({"inputs": inputs, "splits": {s: c["sha256"] for s, c in counts.items()}})
    write_json(out_dir / "manifest.json", manifest)
    shutil.rmtree(out_dir / "parts", ignore_errors=True)
    return manifest


def _relative(path: Path, start: Path) -> str:
    import os

    return os.path.relpath(Path(path).resolve(), Path(start).resolve())
