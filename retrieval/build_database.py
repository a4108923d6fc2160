"""The retrieval database end to end: parts → embed → index → recall → neighbours of the training data
(`retrieval.method: dense`); bm25: parts → BM25 index → neighbours; hybrid: both indexes, then neighbours.

    result = build_retrieval(cfg.retrieval, store, cfg.retrieval_dir, chunks_per_seq=L, data_cfg=cfg.data)

Each stage is skipped when its manifest exists with the same inputs (the fingerprints of what
it reads), resumes from its finished shards after a crash, and is rebuilt when an input
changed. Engines come in as arguments (an embed runner, a task executor), so the whole build
runs in-process in tests and on Ray from launch/build_index.py.
"""

from __future__ import annotations

import re
from pathlib import Path

from retropipe.data.chunking import SPLITS
from retropipe.data.config import DataConfig
from retropipe.data.database_reader import Database
from retropipe.data.stage import Executor, serial_executor, write_json
from retropipe.data.store import ChunkStore
from retropipe.retrieval import RetrievalError
from retropipe.retrieval.config import RetrievalConfig
from retropipe.retrieval.database_parts import DatabaseVectors, prepare_corpora, write_database
from retropipe.retrieval.embed_job import (Embeddings, EmbedRunner, embed_stores, model_identity, resolve_model_path,
                                       runner_precision, serial_embed_runner)
from retropipe.retrieval.index import build_index, faiss_module, load_index, make_index, recall_check
from retropipe.retrieval.methods import embeds, lexical, method_of, method_search
from retropipe.retrieval.methods.bm25 import Bm25Search, build_bm25
from retropipe.retrieval.methods.dense import DenseSearch
from retropipe.retrieval.methods.hybrid import RRF_K
from retropipe.retrieval.neighbour_search import MANIFEST_VERSION, query_neighbours


def check_inputs(cfg: RetrievalConfig, store: ChunkStore, dim: int | None = None, database_chunks: int | None = None) -> None:
    """Fail before any work on settings that cannot succeed, naming the key."""
    chunks = database_chunks if database_chunks is not None else len(store.split("train"))
    if cfg.k > chunks:
        raise RetrievalError(f"config key 'retrieval.k': {cfg.k} neighbours per chunk, but the database (the "
                             f"training split of {store.root} and retrieval.corpora) holds only {chunks} chunks")
    if dim is not None:
        index = make_index(cfg.index, dim)
        # Training needs at least one vector per IVF list and per PQ centroid: say so now, not
        # after hours of embedding.
        sample = chunks if cfg.train_sample == 0 else min(cfg.train_sample, chunks)
        ivf = faiss_module().try_extract_index_ivf(index)
        pq = re.search(r"PQ(\d+)(?:x(\d+))?", cfg.index)
        needs = max(ivf.nlist if ivf is not None else 0, 2 ** int(pq.group(2) or 8) if pq else 0)
        if not index.is_trained and sample < needs:
            raise RetrievalError(f"config key 'retrieval.index': {cfg.index!r} needs at least {needs} training "
                                 f"vectors, but retrieval.train_sample and the database ({chunks} chunks) give "
                                 f"{sample}; use fewer lists, or 'Flat' for a small database")


def _expected_dim(cfg: RetrievalConfig, emb_dir: Path) -> int:
    """The embedding width, before embedding: so a bad retrieval.index fails in seconds, not hours.
    Read from the model's files where they say it (the driver then never loads the model: the
    embedding actors do); loaded and asked otherwise. The width the embeddings come out with is
    checked again before the index is built (`build_retrieval`)."""
    from retropipe.data.stage import read_json
    from retropipe.retrieval.embed_job import cached_embedder, embedding_dim
    from retropipe.retrieval.embedder import embedding_dim_from_files

    manifest = read_json(emb_dir / "manifest.json")
    if manifest is not None and manifest.get("dim"):
        return int(manifest["dim"])
    path = resolve_model_path(cfg.embedder)
    return embedding_dim_from_files(path) or embedding_dim(cached_embedder(str(path)))


def _bar(desc: str, total: int, enabled: bool):
    from tqdm import tqdm

    bar = tqdm(desc=desc, total=total, unit=" chunks", disable=not enabled, dynamic_ncols=True)
    return bar, bar.update


def neighbour_inputs(cfg: RetrievalConfig, database: Database, query_store: ChunkStore, index_manifest: dict | None,
                     chunks_per_seq: int | None, bm25_manifest: dict | None = None, **extra) -> dict:
    """What a neighbours directory is computed from: a change in any of it recomputes the neighbours.
    The method is the database's (database.json), whatever cfg.method says: evaluation searches
    another database its own way. A dense database's inputs are those it had before methods existed."""
    method = method_of(database.manifest)
    inputs = {"version": MANIFEST_VERSION, "chunk_store_fingerprint": query_store.fingerprint,
              "database_fingerprint": database.fingerprint, "chunks_per_seq": chunks_per_seq, "k": cfg.k,
              "candidates": cfg.candidates, **extra}
    if embeds(method):
        inputs.update(index_fingerprint=index_manifest["fingerprint"], rerank=reranks(cfg, index_manifest),
                      nprobe=cfg.nprobe, ef_search=cfg.ef_search)
    if lexical(method):
        inputs.update(method=method, bm25_fingerprint=bm25_manifest["fingerprint"])
    if method == "hybrid":
        inputs["fusion"] = f"rrf-{RRF_K}"
    return inputs


def reranks(cfg: RetrievalConfig, index_manifest: dict) -> bool:
    """Whether candidates are re-ranked by exact distance: asked for, and the index is not exact already."""
    return cfg.rerank and index_manifest["factory"] != "Flat"


def _embed_parts(cfg: RetrievalConfig, store: ChunkStore, parts: list, expected_dim: int, embed_runner: EmbedRunner,
                 progress: bool) -> tuple[list[dict], DatabaseVectors, Embeddings]:
    """Every part embedded in one pass of the runner (one pool of actors; a part already embedded
    counts as done): (their manifests, the database's vectors, the training data's embeddings)."""
    precision = runner_precision(embed_runner, cfg.embed_precision)  # once, for every part
    total = sum(len(p.store.split(s)) for p in parts for s in SPLITS)
    bar, update = _bar("embed " + ", ".join(p.name for p in parts), total, progress)
    with bar:
        embedded = embed_stores([(p.store, p.embeddings_dir) for p in parts], cfg.embedder, cfg.embed_batch_size,
                                embed_runner, progress=update, precision=precision)
    if embedded[0]["dim"] and embedded[0]["dim"] != expected_dim:  # the model's files said another width than it has
        check_inputs(cfg, store, embedded[0]["dim"])
    offsets, vectors_parts = 0, []
    for part, manifest in zip(parts, embedded):
        vectors_parts.append((offsets, Embeddings(part.embeddings_dir, manifest)))
        offsets += len(part.store.split("train"))
    return embedded, DatabaseVectors(vectors_parts), Embeddings(parts[0].embeddings_dir, embedded[0])


def _dense_stages(cfg: RetrievalConfig, store: ChunkStore, parts: list, out: Path, expected_dim: int,
                  embed_runner: EmbedRunner, executor: Executor, workers: int, progress: bool) -> tuple[dict, DenseSearch]:
    """Embeddings, database.json, FAISS index and its recall check: ({stage: manifest}, the training
    data's DenseSearch)."""
    embedded, vectors, query_emb = _embed_parts(cfg, store, parts, expected_dim, embed_runner, progress)
    write_database(out, parts, model_identity(resolve_model_path(cfg.embedder), cfg.embedder), cfg.method)
    index_manifest = build_index(vectors, out / "index", cfg.index, cfg.train_sample, cfg.seed, executor, workers)
    index = load_index(out / "index", index_manifest, vectors.dim, cfg.nprobe, cfg.ef_search)
    rerank = reranks(cfg, index_manifest)
    search = {"nprobe": cfg.nprobe, "ef_search": cfg.ef_search, "k": cfg.k, "queries": cfg.recall_queries,
              "seed": cfg.seed, "candidates": cfg.candidates, "rerank": rerank}
    if index_manifest.get("recall", {}).get("search") != search:  # recall depends on search settings too
        index_manifest["recall"] = {**recall_check(index, vectors, query_emb, cfg.k, cfg.recall_queries, cfg.seed,
                                                   cfg.candidates, rerank), "search": search}
        write_json(out / "index" / "manifest.json", {k: v for k, v in index_manifest.items() if k != "skipped"})
    result = {"embeddings": embedded[0], "parts": embedded, "index": index_manifest}
    return result, DenseSearch(index, query_emb, cfg.candidates, vectors.rows if rerank else None)


def build_retrieval(cfg: RetrievalConfig, store: ChunkStore, out_dir: str | Path, chunks_per_seq: int,
                    data_cfg: DataConfig | None = None, embed_runner: EmbedRunner = serial_embed_runner,
                    executor: Executor = serial_executor, workers: int = 2, progress: bool = False) -> dict:
    """Build (or finish, or skip) every stage of `retrieval.method` into out_dir; return {stage: manifest}.
    bm25 embeds nothing (no embedder is loaded); hybrid builds both the dense stages and the BM25 index."""
    out = Path(out_dir)
    expected_dim = _expected_dim(cfg, out / "embeddings") if embeds(cfg.method) else None
    check_inputs(cfg, store, expected_dim)  # before anything is written
    out.mkdir(parents=True, exist_ok=True)
    parts = prepare_corpora(cfg.corpora, data_cfg or DataConfig(), store, out, executor, progress)
    check_inputs(cfg, store, database_chunks=sum(len(p.store.split("train")) for p in parts))
    result, dense = {}, None
    if embeds(cfg.method):
        result, dense = _dense_stages(cfg, store, parts, out, expected_dim, embed_runner, executor, workers, progress)
    else:
        write_database(out, parts, None, cfg.method)
    database = Database(out)
    bm25 = None
    if lexical(cfg.method):
        result["bm25"] = build_bm25(database, out / "bm25")
        bm25 = Bm25Search(out / "bm25", store, cfg.candidates, executor=executor, workers=workers)

    extra = {"query_embeddings": dense.query_emb.fingerprint} if dense is not None else {}
    inputs = neighbour_inputs(cfg, database, store, result.get("index"), chunks_per_seq, result.get("bm25"), **extra)
    bar, update = _bar("neighbours", len(store.split("train")) + len(store.split("validation")), progress)
    with bar:
        result["neighbours"] = query_neighbours(method_search(cfg.method, dense, bm25), store, database,
                                                out / "neighbours", inputs, cfg.k, cfg.candidates, chunks_per_seq,
                                                progress=update, method=cfg.method)
    return {**result, "database": database.manifest}


def _done(manifest: dict) -> str:
    return "skipped (complete)" if manifest.get("skipped") else "built"


def _dense_summary(result: dict) -> list[str]:
    """The embeddings, index and recall lines of a method that embeds."""
    emb, idx = result["embeddings"], result["index"]
    lines = [f"embeddings  {_done(emb)}: {emb['model']} dim {emb['dim']} {emb.get('precision', 'fp32')} "
             f"({sum(emb['shard_chunks']['train'])} train + {sum(emb['shard_chunks']['validation'])} validation chunks)"]
    embedded = [p for p in result.get("parts", [emb]) if not p.get("skipped") and p.get("run")]
    if embedded:  # one pass over every part not yet embedded: its rate, whichever parts it took
        copied = sum(p["run"].get("chunks_copied", 0) for p in embedded)
        lines[-1] += (f"; this build embedded {sum(p['run']['chunks_embedded'] for p in embedded):,} chunks "
                      f"and copied {copied:,} exact copies' vectors, {embedded[0]['run']['chunks_per_second']:.1f} "
                      f"chunks/s")
    lines.append(f"index       {_done(idx)}: {idx['factory']!r} ({idx['merge']} merge), {idx['ntotal']} vectors")
    recall = idx.get("recall", {})
    if recall.get("recall") is not None:
        lines.append(f"recall@{recall['k']} vs exact search: {recall['recall']:.4f} "
                     f"on {recall['queries']} {recall['query_split']} queries "
                     f"(nprobe {recall['search']['nprobe']}, efSearch {recall['search']['ef_search']}, "
                     f"{'re-ranked ' if recall['search']['rerank'] else ''}{recall['search']['candidates']} candidates)")
    return lines


def summary(result: dict) -> str:
    """A one-screen summary: what ran, how fast, the database's parts, recall, neighbour quality."""
    nbr, db = result["neighbours"], result["database"]
    dense = _dense_summary(result) if "embeddings" in result else []
    lines = dense[:1] + [f"database    {len(db['parts'])} part(s), {db['chunks']:,} chunks, {db['tokens']:,} tokens: "
                         + ", ".join(f"{p['name']} ({p['chunks']:,} chunks)" for p in db["parts"])] + dense[1:]
    if "bm25" in result:
        bm25 = result["bm25"]
        lines.append(f"bm25        {_done(bm25)}: {bm25['documents']:,} chunks, {bm25['vocabulary']:,} words, "
                     f"{bm25['postings']:,} postings" + ("" if bm25.get("skipped") else f", {bm25['seconds']} s"))
    lines.append(f"neighbours  {_done(nbr)}: {nbr.get('method', 'dense')}, k={nbr['k']} from {nbr['candidates']} "
                 f"candidates, sequence exclusion over {nbr['chunks_per_seq']} chunks")
    if not nbr.get("skipped"):
        lines[-1] += f"; {nbr['run']['chunks_per_second']:,.0f} chunks/s"
    for split, s in nbr["splits"].items():
        lines.append(f"  {split:<11} {s['num_chunks']:>9,} chunks, {s['missing']:,} missing neighbours "
                     f"({s['chunks_short_of_k']:,} chunks with fewer than k), {s['without_continuation']:,} "
                     f"without a continuation (document end); {s['documents_with_copies_in_database']:,} "
                     f"documents have an exact copy in the database (never retrieved)")
    return "\n".join(lines)
