"""Neighbours of any chunk store's split in any database: a held-out corpus, another database, a subset.

    store = prepare_heldout(cfg.data, "other.jsonl", out_dir / "data", train_store)   # every document held out
    nbrs = split_neighbours(retriever, store, "validation", out_dir / "neighbours-full", cfg.retrieval)
    nbrs.neighbour_tokens("validation", chunk_ids, k)     # data.neighbour_store.NeighbourStore, as in training

The output is an ordinary neighbours directory (`<split>.npy` + manifest.json naming the query
chunk store and the database, see retrieval/neighbour_search.py), read by `NeighbourStore` like the
training data's. The database is searched by its own method (database.json, retrieval/methods/).
Where that embeds (dense, hybrid) the query chunks are embedded with the database's embedder into
`<out_dir>/embeddings` on `device` (skipped when `query_emb` already holds them, e.g. the training data's
validation split and a database embedded with the same model); bm25 embeds nothing. Exclusion: a chunk never
retrieves from a document with its own document's text (an exact copy of an evaluated document
in the database is kept out and counted in the manifest); nothing else is excluded, and the
leakage analysis (α) shows any near-copy.

A *subset* of the database (`allowed` ids, `database_subset`) is searched inside the same index,
exactly for a Flat index (and for BM25, which scores only those ids): the database-size curve
evaluates one model against growing databases without building an index for each.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np

from retropipe.data.config import DataConfig
from retropipe.data.database_reader import Database
from retropipe.data.errors import ConfigError, DataError
from retropipe.data.neighbour_store import NeighbourStore
from retropipe.data.prepare import prepare
from retropipe.data.reading import Reading
from retropipe.data.stage import fingerprint, path_tag, read_json
from retropipe.data.store import ChunkStore
from retropipe.retrieval.config import RetrievalConfig
from retropipe.retrieval.embed_job import (Embeddings, cached_embedder, embed_job, embed_store, resolve_embed_precision,
                                       serial_embed_runner)
from retropipe.retrieval.embedder import query_precision
from retropipe.retrieval.methods import embeds
from retropipe.retrieval.neighbour_search import query_neighbours
from retropipe.retrieval.query import Retriever


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
    """retrieval.embed_job's serial runner with the embedder on `device` (that one always uses the CPU)."""
    if device == "cpu":
        return serial_embed_runner

    def runner(spec, jobs):
        from retropipe.data.tokenizer import get_tokenizer

        if not jobs:
            return
        model = cached_embedder(spec.model_path, device, resolve_embed_precision(spec.precision, device))
        stores, encoding = [ChunkStore(d) for d in spec.data_dirs], get_tokenizer(spec.tokenizer)
        for job in jobs:
            yield job, embed_job(model, stores[job.part], encoding, job, spec.sub_batch)
    return runner


def query_embeddings(retriever: Retriever, store: ChunkStore, out_dir: Path, cfg: RetrievalConfig,
                     query_emb: Embeddings | None, device: str) -> Embeddings:
    """The store's embeddings as the retriever's database embeds (query_emb where it is that), else
    computed on `device` into <out_dir>/../embeddings."""
    # Embedded as the database was, or in fp32 where `device` would only emulate that (query_precision).
    precision = query_precision(retriever.database_precision, device)
    if (query_emb is None or query_emb.manifest.get("model_sha256") != retriever.embedder_identity["sha256"]
            or query_emb.manifest.get("precision", "fp32") not in (precision, retriever.database_precision)):
        emb_dir = out_dir.parent / "embeddings"
        emb_dir.mkdir(parents=True, exist_ok=True)
        manifest = embed_store(store, emb_dir, cfg.embedder, cfg.embed_batch_size, embed_runner_on(device),
                               precision=precision)
        query_emb = Embeddings(emb_dir, manifest)
    if query_emb.manifest.get("chunk_store_fingerprint") != store.fingerprint:
        raise DataError(f"{query_emb.dir}: embeddings of another chunk store than {store.root}")
    return query_emb


def split_neighbours(retriever: Retriever, store: ChunkStore, split: str, out_dir: Path, cfg: RetrievalConfig,
                     query_emb: Embeddings | None = None, allowed: np.ndarray | None = None,
                     progress=None, device: str = "cpu") -> NeighbourStore:
    """Neighbours of every chunk of store's split in the retriever's database (cached in out_dir), by
    that database's method (`retriever.method`); new query embeddings (a method that embeds) are
    computed on `device`."""
    from retropipe.retrieval.build_database import neighbour_inputs

    out_dir = Path(out_dir)
    extra = {}
    if embeds(retriever.method):
        query_emb = query_embeddings(retriever, store, out_dir, cfg, query_emb, device)
        extra["query_embeddings"] = query_emb.fingerprint
    inputs = neighbour_inputs(cfg, retriever.database, store, retriever.index_manifest, None, retriever.bm25_manifest,
                              **extra, split=split, allowed=None if allowed is None else fingerprint(allowed.tolist()))
    search = retriever.search_for(store, query_emb, allowed, fetch=cfg.candidates)
    query_neighbours(search, store, retriever.database, out_dir, inputs, retriever.k, cfg.candidates, None,
                     splits=(split,), progress=progress, method=retriever.method)
    return NeighbourStore(out_dir, store, reading=Reading.for_evaluation(cfg))


def stored_embeddings(cfg, store):
    """The build's embeddings of `store` (the training data), or None: a held-out corpus is embedded anew."""
    manifest = read_json(cfg.retrieval_dir / "embeddings" / "manifest.json")
    if manifest and manifest.get("chunk_store_fingerprint") == store.fingerprint:
        return Embeddings(cfg.retrieval_dir / "embeddings", manifest)
    return None


def evaluation_neighbours(cfg, store: ChunkStore, split: str, out: Path, database_dir: Path, device: str = "cpu"):
    """What an evaluation of `store`'s split reads: (its neighbours, the database-size curve
    [(label, tokens, neighbours)]). cfg: the composed config (its retrieval, eval and workdir).

    The training data against its own database reads the neighbours the build computed; any other
    chunk store (a held-out corpus) or database is searched anew, its neighbours cached under
    out/neighbours/. Every source reads by `Reading.for_evaluation` (data/reading.py). Queries not
    embedded by the build are embedded (and searched, where FAISS can) on `device`."""
    own = store.root.resolve() == cfg.data_dir.resolve() and database_dir.resolve() == cfg.retrieval_dir.resolve()
    retriever = None
    if own:  # the training data against its own database: the neighbours the build computed
        neighbours = NeighbourStore.of(cfg.retrieval_dir, store, reading=Reading.for_evaluation(cfg.retrieval))
    else:
        retriever = Retriever(database_dir, cfg.retrieval, device=device)
        neighbours = split_neighbours(retriever, store, split, out / "neighbours" / path_tag(str(database_dir)),
                                      cfg.retrieval, stored_embeddings(cfg, store), device=device)
    curve = []
    if cfg.eval.database_curve:
        retriever = retriever or Retriever(database_dir, cfg.retrieval, device=device)
        if len(retriever.database.parts) < 2:
            raise ConfigError("eval.database_curve", f"the database at {database_dir} holds the training split only; "
                              f"add corpora with retrieval.corpora (and run launch/build_index.py) to grow it")
        query_emb = stored_embeddings(cfg, store)
        for fraction in sorted(set(cfg.eval.database_curve)):
            allowed, tokens = database_subset(retriever.database, fraction, cfg.retrieval.seed)
            label = "training split" if fraction == 0 else f"+{fraction:.1%} of the further corpora"
            nbrs = split_neighbours(retriever, store, split, out / "neighbours" / f"{path_tag(str(database_dir))}-{fraction:g}",
                                    cfg.retrieval, query_emb, allowed, device=device)
            curve.append((label, tokens, nbrs))
    return neighbours, curve
