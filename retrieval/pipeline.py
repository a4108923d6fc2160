"""The retrieval database end to end: embed → train index → add/merge → recall → neighbours.

    result = build_retrieval(cfg.retrieval, store, cfg.retrieval_dir, chunks_per_seq=L)

Each stage is skipped when its manifest exists with the same inputs (the fingerprints of what
it reads), resumes from its finished shards after a crash, and is rebuilt when an input
changed. Engines come in as arguments (an embed runner, a task executor), so the whole
pipeline runs in-process in tests and on Ray from launch/build_index.py.
"""

from __future__ import annotations

import re
from pathlib import Path

from data.store import ChunkStore
from retrieval.config import RetrievalConfig
from retrieval.embed import EmbedRunner, Embeddings, embed_store, serial_embed_runner
from retrieval.files import MANIFEST_VERSION, RetrievalError, write_json
from retrieval.index import Executor, build_index, load_index, make_index, recall_check, serial_executor
from retrieval.neighbours import query_neighbours


def check_inputs(cfg: RetrievalConfig, store: ChunkStore, dim: int | None = None) -> None:
    """Fail before any work on settings that cannot succeed, naming the key."""
    train_chunks = len(store.split("train"))
    if cfg.k > train_chunks:
        raise RetrievalError(f"config key 'retrieval.k': {cfg.k} neighbours per chunk, but the database (the "
                             f"training split of {store.root}) holds only {train_chunks} chunks")
    if dim is not None:
        import faiss

        index = make_index(cfg.index, dim)
        # Training needs at least one vector per IVF list and per PQ centroid: say so now, not
        # after hours of embedding.
        sample = train_chunks if cfg.train_sample == 0 else min(cfg.train_sample, train_chunks)
        ivf = faiss.try_extract_index_ivf(index)
        pq = re.search(r"PQ(\d+)(?:x(\d+))?", cfg.index)
        needs = max(ivf.nlist if ivf is not None else 0, 2 ** int(pq.group(2) or 8) if pq else 0)
        if not index.is_trained and sample < needs:
            raise RetrievalError(f"config key 'retrieval.index': {cfg.index!r} needs at least {needs} training "
                                 f"vectors, but retrieval.train_sample and the database ({train_chunks} training "
                                 f"chunks) give {sample}; use fewer lists, or 'Flat' for a small database")


def _expected_dim(cfg: RetrievalConfig, emb_dir: Path) -> int:
    """The embedding width, before embedding: so a bad retrieval.index fails in seconds, not hours."""
    from retrieval.embed import cached_embedder, embedding_dim, resolve_model_path
    from retrieval.files import read_json

    manifest = read_json(emb_dir / "manifest.json")
    if manifest is not None and manifest.get("dim"):
        return int(manifest["dim"])
    return embedding_dim(cached_embedder(str(resolve_model_path(cfg.embedder))))


def _bar(desc: str, total: int, enabled: bool):
    from tqdm import tqdm

    bar = tqdm(desc=desc, total=total, unit=" chunks", disable=not enabled, dynamic_ncols=True)
    return bar, bar.update


def build_retrieval(cfg: RetrievalConfig, store: ChunkStore, out_dir: str | Path, chunks_per_seq: int,
                    embed_runner: EmbedRunner = serial_embed_runner, executor: Executor = serial_executor,
                    workers: int = 2, progress: bool = False) -> dict:
    """Build (or finish, or skip) every stage into out_dir; return {stage: manifest}."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    check_inputs(cfg, store, _expected_dim(cfg, out / "embeddings"))
    total = len(store.split("train")) + len(store.split("validation"))

    bar, update = _bar("embed", total, progress)
    with bar:
        emb_manifest = embed_store(store, out / "embeddings", cfg.embedder, cfg.embed_batch_size,
                                   embed_runner, progress=update)
    emb = Embeddings(out / "embeddings", emb_manifest)

    index_manifest = build_index(emb, out / "index", cfg.index, cfg.train_sample, cfg.seed, executor, workers)
    index = load_index(out / "index", index_manifest, emb.dim, cfg.nprobe, cfg.ef_search)
    rerank = cfg.rerank and cfg.index != "Flat"  # re-ranking exact results changes nothing
    search = {"nprobe": cfg.nprobe, "ef_search": cfg.ef_search, "k": cfg.k, "queries": cfg.recall_queries,
              "seed": cfg.seed, "candidates": cfg.candidates, "rerank": rerank}
    if index_manifest.get("recall", {}).get("search") != search:  # recall depends on search settings too
        index_manifest["recall"] = {**recall_check(index, emb, cfg.k, cfg.recall_queries, cfg.seed,
                                                   cfg.candidates, rerank), "search": search}
        write_json(out / "index" / "manifest.json", {k: v for k, v in index_manifest.items() if k != "skipped"})

    inputs = {"version": MANIFEST_VERSION, "chunk_store_fingerprint": store.fingerprint,
              "embeddings_fingerprint": emb.fingerprint, "index_fingerprint": index_manifest["fingerprint"],
              "k": cfg.k, "candidates": cfg.candidates, "chunks_per_seq": chunks_per_seq,
              "nprobe": cfg.nprobe, "ef_search": cfg.ef_search, "rerank": rerank}
    bar, update = _bar("neighbours", total, progress)
    with bar:
        nbr_manifest = query_neighbours(index, emb, store, out / "neighbours", inputs, cfg.k, cfg.candidates,
                                        chunks_per_seq, rerank, progress=update)
    return {"embeddings": emb_manifest, "index": index_manifest, "neighbours": nbr_manifest}


def summary(result: dict) -> str:
    """A one-screen summary: what ran, how fast, recall, missing neighbours."""
    emb, idx, nbr = result["embeddings"], result["index"], result["neighbours"]
    done = lambda m: "skipped (complete)" if m.get("skipped") else "built"  # noqa: E731
    lines = [f"embeddings  {done(emb)}: {emb['model']} dim {emb['dim']} "
             f"({sum(emb['shard_chunks']['train'])} train + {sum(emb['shard_chunks']['validation'])} validation chunks)"]
    if not emb.get("skipped") and emb.get("run"):
        lines[-1] += f"; {emb['run']['chunks_per_second']:.1f} chunks/s"
    lines.append(f"index       {done(idx)}: {idx['factory']!r} ({idx['merge']} merge), {idx['ntotal']} vectors")
    recall = idx.get("recall", {})
    if recall.get("recall") is not None:
        lines.append(f"recall@{recall['k']} vs exact search: {recall['recall']:.4f} "
                     f"on {recall['queries']} {recall['query_split']} queries "
                     f"(nprobe {recall['search']['nprobe']}, efSearch {recall['search']['ef_search']}, "
                     f"{'re-ranked ' if recall['search']['rerank'] else ''}{recall['search']['candidates']} candidates)")
    lines.append(f"neighbours  {done(nbr)}: k={nbr['k']} from {nbr['candidates']} candidates, "
                 f"sequence exclusion over {nbr['chunks_per_seq']} chunks")
    if not nbr.get("skipped"):
        lines[-1] += f"; {nbr['run']['chunks_per_second']:,.0f} chunks/s"
    for split, s in nbr["splits"].items():
        lines.append(f"  {split:<11} {s['num_chunks']:>9,} chunks, {s['missing']:,} missing neighbours "
                     f"({s['chunks_short_of_k']:,} chunks with fewer than k)")
    return "\n".join(lines)
