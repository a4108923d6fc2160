"""Retrieve for new text (generation): embed a query chunk, search the index, return neighbour tokens.

    retriever = Retriever(cfg.retrieval_dir, ChunkStore(cfg.data_dir), cfg.retrieval)
    ids, tokens = retriever.query(["text of one chunk"], k=2)
    # ids (q, k) int64 training-split chunk ids; tokens (q, k, r) int64, -1 = missing

The database is the one launch/build_index.py built: the same embedder (checked by content
hash), the same index and search settings (candidates, re-ranking) as the neighbour stage.
Unlike that stage no document is excluded: a new text has no document in the database (a prompt
copied from a training document will find it, as RETRO would). Neighbour and continuation tokens
are assembled by data.neighbours.NeighbourStore, exactly as for training and evaluation.
Plain numpy / FAISS / sentence-transformers: no Ray, no DeepSpeed.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from data.neighbours import NeighbourStore
from data.store import ChunkStore
from retrieval.config import RetrievalConfig
from retrieval.embed import Embeddings, cached_embedder, chunk_texts, embed, model_identity, resolve_model_path
from retrieval.files import RetrievalError, read_json
from retrieval.index import load_index, search
from retrieval.neighbours import select_neighbours

BUILD = "python launch/build_index.py --config <your config>"


STAGES = ("embeddings", "index", "neighbours")


def check_database(retrieval_dir: str | Path) -> None:
    """Raise a RetrievalError naming the first missing stage manifest and how to build it."""
    root = Path(retrieval_dir)
    for stage in STAGES:
        if not (root / stage / "manifest.json").is_file():
            raise RetrievalError(f"no retrieval database at {root} (missing {root / stage / 'manifest.json'}); "
                                 f"build it: {BUILD}")


def query_text(tokens: list[int], encoding, eot_id: int) -> str:
    """The text of one (possibly partial) chunk, decoded as the database's chunks were."""
    return chunk_texts(np.asarray([tokens]), np.asarray([len(tokens)]), encoding, eot_id)[0]


class Retriever:
    """k nearest training chunks of new texts, and their tokens with continuations."""

    def __init__(self, retrieval_dir: str | Path, store: ChunkStore, cfg: RetrievalConfig, device: str = "cpu"):
        root = Path(retrieval_dir)
        self.dir = root
        check_database(root)
        manifests = {stage: read_json(root / stage / "manifest.json") for stage in STAGES}
        emb_manifest, index_manifest = manifests["embeddings"], manifests["index"]
        if emb_manifest["chunk_store_fingerprint"] != store.fingerprint or \
                index_manifest["embeddings_fingerprint"] != emb_manifest["fingerprint"]:
            raise RetrievalError(f"stale retrieval database at {root}: it was built from other data than "
                                 f"{store.root} (fingerprints differ); rebuild it: {BUILD}")
        self.embeddings = Embeddings(root / "embeddings", emb_manifest)
        # Chunk ids and tokens: NeighbourStore checks the chunk store fingerprint and reads the stored k.
        self.store = NeighbourStore(root, store)
        self.k: int = self.store.k
        self.index = load_index(root / "index", index_manifest, self.embeddings.dim, cfg.nprobe, cfg.ef_search)
        # Search as the neighbour stage did: `candidates` fetched, re-ranked unless the index is exact.
        self.fetch = min(max(cfg.candidates, self.k), self.index.ntotal)
        self.rerank = cfg.rerank and index_manifest["factory"] != "Flat"
        # A query embedded by another model than the database's would land anywhere.
        model_path = resolve_model_path(cfg.embedder)
        if model_identity(model_path, cfg.embedder)["sha256"] != emb_manifest["model_sha256"]:
            raise RetrievalError(f"config key 'retrieval.embedder': {model_path} is not the model the database at "
                                 f"{root} was embedded with ({emb_manifest['model']}, {emb_manifest['model_path']})")
        self.model = cached_embedder(str(model_path), device)
        self._db_doc = store.split("train").doc_index

    def neighbour_ids(self, texts: list[str], k: int) -> np.ndarray:
        """(len(texts), k) int64 training chunk ids, nearest first, -1 where the database has fewer."""
        if not 1 <= k <= self.k:
            raise RetrievalError(f"{k} neighbours asked for, but the database at {self.dir} holds {self.k} per "
                                 f"chunk (retrieval.k); rebuild it with a larger retrieval.k for more")
        vectors = embed(self.model, texts)                                          # (q, d)
        rows = (lambda ids: self.embeddings.rows("train", ids)) if self.rerank else None
        candidates = search(self.index, vectors, self.fetch, rows)                  # (q, C)
        nothing_excluded = np.full((len(texts), 1), -1, dtype=np.int64)
        return select_neighbours(candidates, self._db_doc, nothing_excluded, k)    # (q, k)

    def neighbour_tokens(self, ids: np.ndarray) -> np.ndarray:
        """Tokens of neighbours ids (..., k) and their continuations: (..., k, r) int64, -1 = missing."""
        tokens, mask = self.store.tokens_of(ids)                                     # each (..., k, r)
        return np.where(mask, tokens, -1).astype(np.int64)

    def query(self, texts: list[str], k: int) -> tuple[np.ndarray, np.ndarray]:
        """(ids (q, k), tokens (q, k, r)) for each text."""
        ids = self.neighbour_ids(texts, k)
        return ids, self.neighbour_tokens(ids)
