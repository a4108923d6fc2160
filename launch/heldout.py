"""Any held-out corpus as an evaluation split, with neighbours from the training database.

    store, neighbours = prepare_heldout(cfg, "other.jsonl", out_dir)
    # store.split("validation") holds every document of the corpus (same tokenizer, chunk_len);
    # neighbours.neighbour_tokens("validation", chunk_ids, k) -> (tokens, mask) (..., k, r)

The corpus is prepared like training data (data.prepare, every document held out), its chunks
embedded with the database's embedder and searched in the training index (retrieval.query),
so RETRO is evaluated on text it never saw while retrieving from what it trained with. Nothing
is excluded: if the corpus overlaps the training data, the leakage analysis (α) shows it.
Both steps are cached under out_dir: the neighbours are redone when the database or search
settings change; the prepared corpus is reused as it is (a corpus whose files changed under the
same path needs another --out).
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import numpy as np

from data.prepare import prepare
from data.readers import DataError
from data.store import ChunkStore

QUERY_BATCH = 256


class HeldoutNeighbours:
    """The `neighbour_tokens` contract of data.neighbours.NeighbourStore, for precomputed ids."""

    def __init__(self, ids: np.ndarray, database):
        self.ids, self.database, self.k = ids, database, ids.shape[1]

    def neighbour_tokens(self, split: str, chunk_ids: np.ndarray, k: int | None = None):
        k = k or self.k
        if k > self.k:
            raise DataError(f"{k} neighbours asked for, but the held-out neighbours hold {self.k} (retrieval.k)")
        chunk_ids = np.asarray(chunk_ids, dtype=np.int64)
        return self.database.tokens_of(self.ids[chunk_ids.reshape(-1), :k].reshape(*chunk_ids.shape, k))


def prepare_heldout(cfg, corpus: str, out_dir: Path, need_neighbours: bool = True, progress: bool = True):
    """(ChunkStore of the corpus, HeldoutNeighbours or None), prepared into out_dir."""
    from tqdm import tqdm

    train_store = ChunkStore(cfg.data_dir)
    data_cfg = dataclasses.replace(cfg.data, corpus=corpus, validation_fraction=1.0, max_documents=0)
    prepare(data_cfg, out_dir / "data", progress=progress)
    store = ChunkStore(out_dir / "data")
    if store.manifest["tokenizer"] != train_store.manifest["tokenizer"] or store.chunk_len != train_store.chunk_len:
        raise DataError(f"{corpus}: prepared with tokenizer {store.manifest['tokenizer']} / chunk_len "
                        f"{store.chunk_len}, but the models trained on {train_store.manifest['tokenizer']} / "
                        f"{train_store.chunk_len}")
    if not need_neighbours:
        return store, None

    from data.neighbours import NeighbourStore
    from data.tokenizer import get_tokenizer
    from retrieval.embed import chunk_texts
    from retrieval.files import read_json, save_npy, write_json
    from retrieval.query import Retriever

    database = NeighbourStore(cfg.retrieval_dir, train_store)  # neighbour + continuation tokens
    index_manifest = read_json(cfg.retrieval_dir / "index" / "manifest.json") or {}
    inputs = {"heldout_fingerprint": store.fingerprint, "database": index_manifest.get("fingerprint"),
              "k": database.k, "candidates": cfg.retrieval.candidates, "nprobe": cfg.retrieval.nprobe,
              "ef_search": cfg.retrieval.ef_search,
              "rerank": cfg.retrieval.rerank and index_manifest.get("factory") != "Flat"}
    path, manifest = out_dir / "neighbours.npy", out_dir / "neighbours.json"
    if path.exists() and read_json(manifest) == inputs:
        return store, HeldoutNeighbours(np.load(path, allow_pickle=False), database)
    # Only a cache miss loads the embedder and the index.
    retriever = Retriever(cfg.retrieval_dir, train_store, cfg.retrieval)
    chunks = store.split("validation")
    encoding = get_tokenizer(store.manifest["tokenizer"])
    parts = []
    for start in tqdm(range(0, len(chunks), QUERY_BATCH), desc="retrieve held-out", disable=not progress):
        ids = np.arange(start, min(start + QUERY_BATCH, len(chunks)))
        texts = chunk_texts(chunks.tokens(ids), chunks.lengths[ids], encoding, store.pad_id)
        parts.append(retriever.neighbour_ids(texts, retriever.k))             # (q, k)
    ids = np.concatenate(parts) if parts else np.zeros((0, retriever.k), dtype=np.int64)
    save_npy(path, ids.astype(np.int64))
    write_json(manifest, inputs)
    return store, HeldoutNeighbours(ids, database)


def describe(out_dir: Path) -> str:
    m = json.loads((out_dir / "data" / "manifest.json").read_text())["splits"]["validation"]
    return f"{m['documents']:,} documents, {m['chunks']:,} chunks, {m['tokens']:,} tokens"
