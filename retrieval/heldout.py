"""Neighbours of any chunk store's split in any database: a held-out corpus, another database, a subset.

    store = prepare_heldout(cfg.data, "other.jsonl", out_dir / "data", train_store)   # every document held out
    nbrs = split_neighbours(retriever, store, "validation", out_dir / "neighbours-full", cfg.retrieval)
    nbrs.neighbour_tokens("validation", chunk_ids, k)     # data.neighbours.NeighbourStore, as in training

The output is an ordinary neighbours directory (`<split>.npy` + manifest.json naming the query
chunk store and the database, see retrieval/neighbours.py), read by `NeighbourStore` like the
training data's. The query chunks are embedded with the database's embedder into
`<out_dir>/embeddings` on `device` (skipped when `query_emb` already holds them, e.g. the training data's
validation split and a database embedded with the same model). Exclusion: a chunk never
retrieves from a document with its own document's text (an exact copy of an evaluated document
in the database is kept out and counted in the manifest); nothing else is excluded, and the
leakage analysis (α) shows any near-copy.

A *subset* of the database (`allowed` ids, `database_subset`) is searched inside the same index,
exactly for a Flat index: the database-size curve evaluates one model against growing databases
without building an index for each.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np

from data.config import DataConfig
from data.database import Database
from data.neighbours import NeighbourStore
from data.prepare import prepare
from data.readers import DataError
from data.stage import fingerprint
from data.store import ChunkStore
from retrieval.config import RetrievalConfig
from retrieval.embed import Embeddings, cached_embedder, embed_job, embed_store, serial_embed_runner
from retrieval.neighbours import query_neighbours
from retrieval.query import Retriever


def prepare_heldout(data_cfg: DataConfig, corpus: str, out_dir: Path, like: ChunkStore, progress: bool = True) -> ChunkStore:
    """The corpus prepared as the training data was (tokenizer, chunk_len), every document in validation."""
    cfg = dataclasses.replace(data_cfg, corpus=corpus, tokenizer=like.manifest["tokenizer"], chunk_len=like.chunk_len,
                              validation_fraction=1.0, max_documents=0)
    prepare(cfg, out_dir, progress=progress)
    return ChunkStore(out_dir)


def database_subset(database: Database, fraction: float, seed: int) -> tuple[np.ndarray | None, int]:
    """(allowed database ids or None for all, tokens in the subset): part 0 whole, plus `fraction` of the
    documents of the further parts (a seeded random choice of documents; 0 = the training split only)."""
    if fraction >= 1.0:
        return None, int(database.manifest["tokens"])
    allowed, tokens = [np.arange(database.parts[0].chunks, dtype=np.int64)], database.manifest["parts"][0]["tokens"]
    for i, part in enumerate(database.parts[1:], start=1):
        docs = part.store.documents
        in_db = np.asarray(docs.column("split").to_pylist()) == "train"
        doc_rows = np.flatnonzero(in_db)
        chosen = np.random.default_rng([seed, i]).permutation(len(doc_rows))[:int(round(fraction * len(doc_rows)))]
        keep = np.zeros(len(docs), dtype=bool)
        keep[doc_rows[chosen]] = True
        chunk_docs = part.split.doc_index
        allowed.append(part.offset + np.flatnonzero(keep[chunk_docs]))
        tokens += int(docs.column("num_tokens").to_numpy()[keep].sum())
    return np.sort(np.concatenate(allowed)), int(tokens)


def embed_runner_on(device: str):
    """retrieval.embed's serial runner with the embedder on `device` (that one always uses the CPU)."""
    if device == "cpu":
        return serial_embed_runner

    def runner(spec, jobs):
        from data.tokenizer import get_tokenizer

        if not jobs:
            return
        model = cached_embedder(spec.model_path, device)
        store, encoding = ChunkStore(spec.data_dir), get_tokenizer(spec.tokenizer)
        for job in jobs:
            yield job, embed_job(model, store, encoding, job, spec.sub_batch)
    return runner


def split_neighbours(retriever: Retriever, store: ChunkStore, split: str, out_dir: Path, cfg: RetrievalConfig,
                     query_emb: Embeddings | None = None, allowed: np.ndarray | None = None,
                     progress=None, device: str = "cpu") -> NeighbourStore:
    """Neighbours of every chunk of store's split in the retriever's database (cached in out_dir);
    new query embeddings are computed on `device`."""
    out_dir = Path(out_dir)
    if query_emb is None or query_emb.manifest.get("model_sha256") != retriever.embedder_identity["sha256"]:
        emb_dir = out_dir.parent / "embeddings"
        emb_dir.mkdir(parents=True, exist_ok=True)
        manifest = embed_store(store, emb_dir, cfg.embedder, cfg.embed_batch_size, embed_runner_on(device))
        query_emb = Embeddings(emb_dir, manifest)
    if query_emb.manifest.get("chunk_store_fingerprint") != store.fingerprint:
        raise DataError(f"{query_emb.dir}: embeddings of another chunk store than {store.root}")
    from retrieval.build import neighbour_inputs

    inputs = neighbour_inputs(cfg, retriever.database, store, retriever.index_manifest, None,
                              query_embeddings=query_emb.fingerprint, split=split,
                              allowed=None if allowed is None else fingerprint(allowed.tolist()))
    query_neighbours(retriever.index_for(allowed), query_emb, store, retriever.database, out_dir, inputs, retriever.k,
                     cfg.candidates, None, retriever.vectors.rows if retriever.rerank else None, splits=(split,),
                     progress=progress, allowed=allowed)
    return NeighbourStore(out_dir, store, align=cfg.align_neighbours, aligned_only=cfg.aligned_only)
