"""Top-k neighbours of every chunk from the training index, without leaks (RETRO §2.3, §2.6).

Each query fetches `retrieval.candidates` nearest chunks and keeps the first k that survive:
  - training split: no chunk of any document that appears in the query chunk's training
    sequence (chunks [s·L, (s+1)·L), L = seq_len / chunk_len), which includes its own document;
  - validation split: no chunk of its own document (the database holds only training documents,
    so this never fires; nothing else is excluded).
Fewer than k survivors are padded with -1 (never wrapped to some other chunk).

Layout of `<retrieval_dir>/neighbours/`:
    parts/<split>/shard-NNNNN.npy   per query shard (resume unit)
    <split>.npy                     (num_chunks, k) int64 training-split chunk ids, -1 = missing
    manifest.json                   fingerprints of chunk store, embeddings and index; k; L; counts
"""

from __future__ import annotations

import shutil
import time
from pathlib import Path

import numpy as np

from data.chunking import SPLITS
from data.store import ChunkStore
from retrieval.embed import Embeddings
from retrieval.index import search
from retrieval.files import MANIFEST_VERSION, fingerprint, load_npy, open_stage, save_npy, sha256_file, write_json


def excluded_documents(doc_index: np.ndarray, query_ids: np.ndarray, chunks_per_seq: int | None) -> np.ndarray:
    """Documents each query may not retrieve from: (n, g) int64, padded with -1.

    chunks_per_seq=None: the query's own document only (g = 1); else every document of the
    training sequence holding the query chunk (g = chunks_per_seq).
    """
    if chunks_per_seq is None:
        return doc_index[query_ids][:, None]
    seq_chunks = (query_ids // chunks_per_seq)[:, None] * chunks_per_seq + np.arange(chunks_per_seq)  # (n, L)
    inside = seq_chunks < len(doc_index)  # the last, partial sequence
    return np.where(inside, doc_index[np.minimum(seq_chunks, len(doc_index) - 1)], -1)


def select_neighbours(candidates: np.ndarray, db_doc_index: np.ndarray, excluded: np.ndarray, k: int) -> np.ndarray:
    """First k allowed candidates per row, in rank order: (n, k) int64, -1 where fewer survive.

    candidates (n, C) database ids from FAISS (-1 = none); db_doc_index (N,) document of each
    database chunk; excluded (n, g) forbidden documents per row (-1 = padding).
    """
    cand_doc = db_doc_index[np.maximum(candidates, 0)]                              # (n, C)
    forbidden = (cand_doc[:, :, None] == excluded[:, None, :]).any(-1)            # (n, C)
    allowed = (candidates >= 0) & ~forbidden
    # Stable sort puts allowed candidates first, keeping their rank order.
    order = np.argsort(~allowed, axis=1, kind="stable")[:, :k]
    picked = np.take_along_axis(candidates, order, 1)
    ok = np.take_along_axis(allowed, order, 1)
    out = np.where(ok, picked, -1).astype(np.int64)
    if out.shape[1] < k:  # fewer candidates than k at all (a tiny database)
        out = np.concatenate([out, np.full((len(out), k - out.shape[1]), -1, np.int64)], 1)
    return out


def query_neighbours(index, emb: Embeddings, store: ChunkStore, out_dir: Path, inputs: dict, k: int,
                     candidates: int, chunks_per_seq: int, rerank: bool = False, progress=None) -> dict:
    """Neighbours of every chunk of every split (resumable per query shard); return the manifest."""
    manifest = open_stage(out_dir, inputs)
    if manifest is not None:
        return {**manifest, "skipped": True}
    db_doc = store.split("train").doc_index
    fetch = min(candidates, index.ntotal)
    rows = (lambda ids: emb.rows("train", ids)) if rerank else None
    splits, begin, queried = {}, time.perf_counter(), 0
    for split in SPLITS:
        parts_dir = out_dir / "parts" / split
        parts_dir.mkdir(parents=True, exist_ok=True)
        doc_index = store.split(split).doc_index
        rule = chunks_per_seq if split == "train" else None
        parts = []
        for i, (first, x) in enumerate(emb.shards(split)):
            part = parts_dir / f"shard-{i:05d}.npy"
            parts.append(part)
            if part.exists():
                continue
            ids = np.arange(first, first + len(x))
            if len(x):
                cand = search(index, x, fetch, rows)                                # (n, C)
                nbrs = select_neighbours(cand, db_doc, excluded_documents(doc_index, ids, rule), k)
            else:
                nbrs = np.zeros((0, k), np.int64)
            save_npy(part, nbrs)
            queried += len(x)
            if progress:
                progress(len(x))
        final = out_dir / f"{split}.npy"
        whole = np.concatenate([load_npy(p, mmap=False) for p in parts]) if parts else np.zeros((0, k), np.int64)
        save_npy(final, whole)
        missing = whole < 0
        splits[split] = {"num_chunks": int(len(whole)), "missing": int(missing.sum()),
                         "chunks_short_of_k": int(missing.any(1).sum()), "sha256": sha256_file(final)}
    seconds = time.perf_counter() - begin
    manifest = {"version": MANIFEST_VERSION, "inputs": inputs, "k": k, "candidates": candidates,
                "chunks_per_seq": chunks_per_seq, "database_split": "train",
                "chunk_store_fingerprint": store.fingerprint,
                "embeddings_fingerprint": inputs["embeddings_fingerprint"],
                "index_fingerprint": inputs["index_fingerprint"], "splits": splits,
                "run": {"seconds": round(seconds, 2), "chunks_queried": queried,
                        "chunks_per_second": round(queried / max(seconds, 1e-9), 1)}}
    manifest["fingerprint"] = fingerprint({"inputs": inputs, "splits": splits})
    write_json(out_dir / "manifest.json", manifest)
    shutil.rmtree(out_dir / "parts", ignore_errors=True)
    return manifest
