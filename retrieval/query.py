"""Retrieve for new text: search a database by its own method, return neighbour tokens.

    retriever = Retriever(cfg.retrieval_dir, cfg.retrieval)           # any built database directory
    ids, tokens = retriever.query(["text of one chunk"], k=2)
    # ids (q, k) int64 database ids; tokens (q, k, r) int64, -1 = missing

The database is one launch/build_index.py built, searched by the method its database.json records
(`retrieval.method`, retrieval/methods/; the config's key does not matter here): dense embeds the
query chunks with its own embedder (checked by content hash) and searches its FAISS index with the
search settings (candidates, re-ranking) the neighbour stage used; bm25 scores their words in its
BM25 index; hybrid fuses both. `search_for` builds the same search over a whole chunk store
(evaluation of a held-out corpus or another database, retrieval/heldout.py). Generation
excludes nothing (a new text has no document in the database; a prompt copied from a training
document will find it, as RETRO would); `exclude` takes document text hashes to keep out, as
evaluation of a held-out corpus needs. Plain numpy / FAISS / sentence-transformers: no Ray.

On `device="cuda"` the embedder runs on the GPU, and so do searches where the FAISS build has GPU
support (faiss-gpu, `faiss.StandardGpuResources`) and the index type has a GPU version (Flat,
IVF-Flat, IVF-PQ, IVF-SQ): `gpu_index` copies the index there. Everything else searches the CPU
index: HNSW, searches restricted to `allowed` ids (FAISS's GPU indexes ignore IDSelectors), and
fetches beyond the GPU's top-k limit.
"""

from __future__ import annotations

import warnings
from pathlib import Path

import numpy as np

from retropipe.data.database_reader import Database
from retropipe.data.errors import BUILD_DATABASE
from retropipe.data.neighbour_store import check_neighbour_count
from retropipe.data.reading import Reading
from retropipe.data.stage import read_json
from retropipe.data.store import ChunkStore
from retropipe.retrieval import RetrievalError
from retropipe.retrieval.config import RetrievalConfig
from retropipe.retrieval.database_parts import open_vectors
from retropipe.retrieval.embed_job import (cached_embedder, chunk_texts, embed, model_identity, resolve_embed_precision,
                                       resolve_model_path)
from retropipe.retrieval.embedder import query_precision
from retropipe.retrieval.index import load_index
from retropipe.retrieval.methods import embeds, lexical, method_of, method_search
from retropipe.retrieval.methods.bm25 import Bm25Search, open_bm25
from retropipe.retrieval.methods.dense import DenseSearch
from retropipe.retrieval.neighbour_search import find_neighbours, select_neighbours

# FAISS's GPU k-selection handles at most this many results per query (GPU_MAX_SELECTION_K).
GPU_MAX_K = 2048


def database_stages(root: Path) -> tuple[str, ...]:
    """The stage directories a built database of this method has (its database.json says which)."""
    manifest = read_json(root / "database.json", rerun=f"build it again: {BUILD_DATABASE}") or {}
    method = method_of(manifest)
    return ("index",) * embeds(method) + ("bm25",) * lexical(method) + ("neighbours",)


def check_database(retrieval_dir: str | Path) -> None:
    """Raise a RetrievalError naming the first missing piece of a database and how to build it."""
    root = Path(retrieval_dir)
    for path in [root / "database.json", *(root / stage / "manifest.json" for stage in database_stages(root))]:
        if not path.is_file():
            raise RetrievalError(f"no retrieval database at {root} (missing {path}); build it: {BUILD_DATABASE}")


def query_text(tokens: list[int], encoding, eot_id: int) -> str:
    """The text of one (possibly partial) chunk, decoded as the database's chunks were."""
    return chunk_texts(np.asarray([tokens]), np.asarray([len(tokens)]), encoding, eot_id)[0]


def gpu_index(index, device: str, nprobe: int, fetch: int):
    """(GPU copy of index, its GpuResources), or None where searches stay on the CPU: device not
    cuda, FAISS without GPU support, no GPU, a fetch over GPU_MAX_K, or an index type FAISS cannot
    copy (a warning then says so)."""
    if not str(device).startswith("cuda") or fetch > GPU_MAX_K:
        return None
    import faiss

    if not hasattr(faiss, "StandardGpuResources") or faiss.get_num_gpus() < 1:
        return None
    gpu = int(str(device).partition(":")[2] or 0)                        # "cuda:1" → GPU 1
    try:
        resources = faiss.StandardGpuResources()
        moved = faiss.index_cpu_to_gpu(resources, gpu, index)
        if faiss.try_extract_index_ivf(index) is not None:
            faiss.GpuParameterSpace().set_index_parameter(moved, "nprobe", nprobe)
    except RuntimeError as e:  # FAISS raises RuntimeError for an index type without a GPU version
        warnings.warn(f"FAISS index stays on the CPU: {str(e).splitlines()[0]}", stacklevel=2)
        return None
    return moved, resources


class Retriever:
    """k nearest database chunks of new texts, and their tokens with continuations, found by the
    database's own method (`method`, from its database.json; retrieval/methods/)."""

    def __init__(self, retrieval_dir: str | Path, cfg: RetrievalConfig, device: str = "cpu"):
        root = Path(retrieval_dir)
        check_database(root)
        self.dir, self.cfg, self.device = root, cfg, device
        self.reading = Reading.for_evaluation(cfg)  # what a chunk of new text reads (data/reading.py)
        self.database = Database(root)
        self.method = method_of(self.database.manifest)
        # Neighbours per chunk the database was built with: what the model trained and is evaluated with.
        self.k: int = int(read_json(root / "neighbours" / "manifest.json", rerun=f"build it again: {BUILD_DATABASE}")["k"])
        # Search as the neighbour stage did: `candidates` fetched (dense: re-ranked unless the index is exact).
        self.fetch = min(max(cfg.candidates, self.k), len(self.database))
        self.index_manifest = self.bm25_manifest = self.gpu = None
        if embeds(self.method):
            self._open_dense(root, cfg, device)
        if lexical(self.method):
            self.bm25_manifest = open_bm25(root / "bm25")[0]
        self._model = self._live = None

    def _open_dense(self, root: Path, cfg: RetrievalConfig, device: str) -> None:
        """The embeddings, FAISS index (on the GPU where it can) and embedder check of a dense or hybrid database."""
        self.vectors = open_vectors(self.database)
        index_manifest = read_json(root / "index" / "manifest.json", rerun=f"build it again: {BUILD_DATABASE}")
        if index_manifest["embeddings_fingerprint"] != self.vectors.fingerprint:
            raise RetrievalError(f"stale retrieval database at {root}: its index was built from other embeddings "
                                 f"than its parts now have; rebuild it: {BUILD_DATABASE}")
        self.index_manifest = index_manifest
        self.index = load_index(root / "index", index_manifest, self.vectors.dim, cfg.nprobe, cfg.ef_search)
        self.rerank = cfg.rerank and index_manifest["factory"] != "Flat"
        # On a GPU where FAISS can: (index, resources), the resources kept alive with the index.
        self.gpu = gpu_index(self.index, device, cfg.nprobe, self.fetch)
        # A query embedded by another model than the database's would land anywhere.
        model_path = resolve_model_path(cfg.embedder)
        self.embedder_identity = model_identity(model_path, cfg.embedder)
        if self.embedder_identity["sha256"] != self.database.manifest["embedder"]["sha256"]:
            raise RetrievalError(f"config key 'retrieval.embedder': {model_path} is not the model the database at "
                                 f"{root} was embedded with ({self.database.manifest['embedder']['name']})")
        self.model_path = model_path
        # Queries are embedded as the database was (its embeddings' manifest says how), where this
        # device computes that precision (query_precision).
        self.database_precision = self.vectors.parts[0][1].manifest.get("precision", "fp32")
        self.precision = query_precision(self.database_precision, device)

    def search_for(self, store: ChunkStore, query_emb=None, allowed: np.ndarray | None = None,
                   fetch: int | None = None):
        """The method's search over a query chunk store (retrieval/methods/) for `query_neighbours`:
        query_emb its embeddings (a method that embeds); allowed: only these database ids."""
        fetch = fetch or self.fetch
        dense = bm25 = None
        if embeds(self.method):
            dense = DenseSearch(self.index_for(allowed), query_emb, fetch, self.vectors.rows if self.rerank else None,
                                allowed)
        if lexical(self.method):
            bm25 = Bm25Search(self.dir / "bm25", store, fetch, allowed)
        return method_search(self.method, dense, bm25)

    @property
    def model(self):
        """The embedder, loaded on first use (a query whose vectors are known needs none)."""
        if self._model is None:
            self._model = cached_embedder(str(self.model_path), self.device,
                                          resolve_embed_precision(self.precision, self.device))
        return self._model

    def index_for(self, allowed: np.ndarray | None = None):
        """The index to search: the GPU copy where there is one, unless the search is restricted
        to `allowed` ids (GPU indexes would ignore that), else the CPU index."""
        return self.gpu[0] if self.gpu is not None and allowed is None else self.index

    def search(self, vectors: np.ndarray, k: int, exclude: np.ndarray | None = None,
               allowed: np.ndarray | None = None) -> np.ndarray:
        """(q, k) int64 database ids of query vectors (q, d), nearest first, -1 where fewer survive.

        exclude (q, g) uint64: document text hashes each query must not retrieve (0 = none);
        allowed: only these database ids (a smaller database inside this one).
        """
        k = check_neighbour_count(k, self.k, f"the database at {self.dir}")
        exclude = exclude if exclude is not None else np.zeros((len(vectors), 1), dtype=np.uint64)
        return find_neighbours(self.index_for(allowed), self.database, vectors, exclude, k, self.fetch,
                               self.vectors.rows if self.rerank else None, allowed)

    def neighbour_ids(self, texts: list[str], k: int) -> np.ndarray:
        """(len(texts), k) int64 database ids, nearest first, -1 where the database has fewer."""
        if self.method == "dense":
            return self.search(embed(self.model, texts), k)
        k = check_neighbour_count(k, self.k, f"the database at {self.dir}")
        if self._live is None:  # once: generation asks chunk by chunk
            self._live = self.search_for(None)
        found = self._live.of_texts(texts) if self.method == "bm25" else self._live.of(embed(self.model, texts), texts)
        return select_neighbours(found, self.database.text_hashes, self.database.positions,
                                 np.zeros((len(texts), 1), dtype=np.uint64), k)

    def neighbour_tokens(self, ids: np.ndarray, query: np.ndarray | None = None) -> np.ndarray:
        """Tokens of neighbours ids (..., k) and their continuations: (..., k, r) int64, -1 = missing;
        aligned to query chunks (..., chunk_len) when given and retrieval.align_neighbours is on."""
        return self.reading.tokens(self.database, ids, query)

    def query(self, texts: list[str], k: int, query: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
        """(ids (q, k), tokens (q, k, r)) for each text; query (q, chunk_len): its tokens, for alignment."""
        ids = self.neighbour_ids(texts, k)
        return ids, self.neighbour_tokens(ids, query)
