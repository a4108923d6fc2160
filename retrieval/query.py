"""Retrieve for new text: embed query chunks, search a database's index, return neighbour tokens.

    retriever = Retriever(cfg.retrieval_dir, cfg.retrieval)           # any built database directory
    ids, tokens = retriever.query(["text of one chunk"], k=2)
    # ids (q, k) int64 database ids; tokens (q, k, r) int64, -1 = missing

The database is one launch/build_index.py built: its own embedder (checked by content hash),
index and search settings (candidates, re-ranking), as the neighbour stage used. Generation
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
from retropipe.retrieval import RetrievalError
from retropipe.retrieval.config import RetrievalConfig
from retropipe.retrieval.database_parts import open_vectors
from retropipe.retrieval.embed_job import (cached_embedder, chunk_texts, embed, model_identity, resolve_embed_precision,
                                       resolve_model_path)
from retropipe.retrieval.embedder import query_precision
from retropipe.retrieval.index import load_index
from retropipe.retrieval.neighbour_search import find_neighbours

STAGES = ("index", "neighbours")
# FAISS's GPU k-selection handles at most this many results per query (GPU_MAX_SELECTION_K).
GPU_MAX_K = 2048


def check_database(retrieval_dir: str | Path) -> None:
    """Raise a RetrievalError naming the first missing piece of a database and how to build it."""
    root = Path(retrieval_dir)
    for path in [root / "database.json", *(root / stage / "manifest.json" for stage in STAGES)]:
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
    """k nearest database chunks of new texts, and their tokens with continuations."""

    def __init__(self, retrieval_dir: str | Path, cfg: RetrievalConfig, device: str = "cpu"):
        root = Path(retrieval_dir)
        check_database(root)
        self.dir, self.cfg = root, cfg
        self.reading = Reading.for_evaluation(cfg)  # what a chunk of new text reads (data/reading.py)
        self.database = Database(root)
        self.vectors = open_vectors(self.database)
        index_manifest = read_json(root / "index" / "manifest.json", rerun=f"build it again: {BUILD_DATABASE}")
        if index_manifest["embeddings_fingerprint"] != self.vectors.fingerprint:
            raise RetrievalError(f"stale retrieval database at {root}: its index was built from other embeddings "
                                 f"than its parts now have; rebuild it: {BUILD_DATABASE}")
        self.index_manifest = index_manifest
        # Neighbours per chunk the database was built with: what the model trained and is evaluated with.
        self.k: int = int(read_json(root / "neighbours" / "manifest.json", rerun=f"build it again: {BUILD_DATABASE}")["k"])
        self.index = load_index(root / "index", index_manifest, self.vectors.dim, cfg.nprobe, cfg.ef_search)
        # Search as the neighbour stage did: `candidates` fetched, re-ranked unless the index is exact.
        self.fetch = min(max(cfg.candidates, self.k), self.index.ntotal)
        self.rerank = cfg.rerank and index_manifest["factory"] != "Flat"
        # On a GPU where FAISS can: (index, resources), the resources kept alive with the index.
        self.gpu = gpu_index(self.index, device, cfg.nprobe, self.fetch)
        # A query embedded by another model than the database's would land anywhere.
        model_path = resolve_model_path(cfg.embedder)
        self.embedder_identity = model_identity(model_path, cfg.embedder)
        if self.embedder_identity["sha256"] != self.database.manifest["embedder"]["sha256"]:
            raise RetrievalError(f"config key 'retrieval.embedder': {model_path} is not the model the database at "
                                 f"{root} was embedded with ({self.database.manifest['embedder']['name']})")
        self.model_path, self.device = model_path, device
        # Queries are embedded as the database was (its embeddings' manifest says how), where this
        # device computes that precision (query_precision).
        self.database_precision = self.vectors.parts[0][1].manifest.get("precision", "fp32")
        self.precision = query_precision(self.database_precision, device)
        self._model = None

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
        return self.search(embed(self.model, texts), k)

    def neighbour_tokens(self, ids: np.ndarray, query: np.ndarray | None = None) -> np.ndarray:
        """Tokens of neighbours ids (..., k) and their continuations: (..., k, r) int64, -1 = missing;
        aligned to query chunks (..., chunk_len) when given and retrieval.align_neighbours is on."""
        return self.reading.tokens(self.database, ids, query)

    def query(self, texts: list[str], k: int, query: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
        """(ids (q, k), tokens (q, k, r)) for each text; query (q, chunk_len): its tokens, for alignment."""
        ids = self.neighbour_ids(texts, k)
        return ids, self.neighbour_tokens(ids, query)
